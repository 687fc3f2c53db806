#!/usr/bin/env bash
# LibriSpeech preprocessing chain; each stage is skipped when its outputs exist (they are
# written atomically), so an interrupted run is simply started again.
#
#   bash scripts/preprocess_librispeech.sh [DATASET_DIR] [--workers N] [--vocab-size V]
#        [--tokenizer-prefix P] [--stages "manifests tokenizer tokens"] [--force]
#
#   manifests  validate every split present and convert FLAC to WAV (<split>-wav/):
#              DATASET_DIR/librispeech-<split>-wav-untokenized.jsonl (+ .report.txt listing
#              every excluded utterance)
#   tokenizer  SentencePiece unigram on the train transcripts: P.model (default
#              DATASET_DIR/../sentencepieces/librispeech1023)
#   tokens     DATASET_DIR/librispeech-<split>-wav.jsonl with token ids (the config's manifests)
#
# Train manifests keep every utterance: training drops those longer than data.max_duration
# (16.7 s) itself and logs the count, so the manifests serve any max_duration.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# the environment scripts/install.sh made, unless another one is active
if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ] && [ -f .venv/bin/activate ]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi

root="datasets/LibriSpeech"
if [[ $# -gt 0 && "$1" != --* ]]; then root="$1"; shift; fi
workers="$(nproc)"
vocab=1023
prefix=""
stages="manifests tokenizer tokens"
force=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --workers) workers="$2"; shift 2 ;;
    --vocab-size) vocab="$2"; shift 2 ;;
    --tokenizer-prefix) prefix="$2"; shift 2 ;;
    --stages) stages="$2"; shift 2 ;;
    --force) force=1; shift ;;
    *) echo "unknown argument: $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
[[ -d "$root" ]] || { echo "error: dataset directory $root not found" >&2; exit 1; }
[[ -n "$prefix" ]] || prefix="$(dirname "$root")/sentencepieces/librispeech${vocab}"

train=(); eval_splits=()
for s in train-clean-100 train-clean-360 train-other-500; do [[ -d "$root/$s" ]] && train+=("$s"); done
for s in dev-clean dev-other test-clean test-other; do [[ -d "$root/$s" ]] && eval_splits+=("$s"); done
[[ ${#train[@]} -gt 0 ]] || { echo "error: no train-* split in $root" >&2; exit 1; }
[[ -d "$root/dev-clean" ]] || { echo "error: $root/dev-clean (the eval set) not found" >&2; exit 1; }
[[ ${#train[@]} -eq 3 ]] || echo "note: only ${train[*]} present; MLPerf trains on all 960 h" >&2
all=("${train[@]}" "${eval_splits[@]}")

untokenized() { echo "$root/librispeech-$1-wav-untokenized.jsonl"; }
tokenized() { echo "$root/librispeech-$1-wav.jsonl"; }
wanted() { [[ " $stages " == *" $1 "* ]]; }
fresh() { [[ $force -eq 1 || ! -e "$1" ]]; }  # true when $1 must be (re)built
py() { python3 "$repo/scripts/$1" "${@:2}"; }

if wanted manifests; then
  for s in "${all[@]}"; do
    out="$(untokenized "$s")"
    if fresh "$out"; then
      echo "== manifest $s"
      py build_manifest.py --dataset-dir "$root" --splits "$s" --output "$out" \
        --convert-to-wav --workers "$workers"
    else
      echo "== manifest $s: $out exists, skipped"
    fi
  done
fi

if wanted tokenizer; then
  if fresh "$prefix.model"; then
    echo "== tokenizer ($vocab pieces) on ${train[*]}"
    manifests=(); for s in "${train[@]}"; do manifests+=("$(untokenized "$s")"); done
    py train_tokenizer.py --manifests "${manifests[@]}" --vocab-size "$vocab" --output-prefix "$prefix"
  else
    echo "== tokenizer: $prefix.model exists, skipped"
  fi
fi

if wanted tokens; then
  for s in "${all[@]}"; do
    out="$(tokenized "$s")"
    # a retrained tokenizer makes every tokenized manifest stale
    if fresh "$out" || [[ "$prefix.model" -nt "$out" ]]; then
      echo "== token ids $s"
      py build_manifest.py --dataset-dir "$root" --from-manifest "$(untokenized "$s")" \
        --tokenizer "$prefix.model" --output "$out"
    else
      echo "== token ids $s: $out exists, skipped"
    fi
  done
fi
echo "done: manifests $root/librispeech-<split>-wav.jsonl, tokenizer $prefix.model"
