#!/usr/bin/env bash
# A spoken corpus made with espeak-ng, prepared the way scripts/preprocess_librispeech.sh
# prepares LibriSpeech: validated manifests, a SentencePiece tokenizer on the train
# transcripts, and manifests with token ids.
#
#   bash scripts/prepare_synthetic_corpus.sh KIND DATA VOCAB [--wav] [corpus options...]
#
#   KIND    digits | sentences (see scripts/make_synthetic_corpus.py --help)
#   DATA    corpus root; gets DATA/KIND-train.jsonl, DATA/KIND-dev.jsonl and
#           DATA/tokenizerVOCAB.model
#   --wav   decode the FLAC files into WAV (<split>-wav/), as the LibriSpeech chain does
# The other options go to make_synthetic_corpus.py (--train N, --dev N, --seed S,
# --durations librispeech, --held-out-speakers N, --workers N). Reruns reuse a finished corpus.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# the environment scripts/install.sh made, unless another one is active
if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ] && [ -f "$repo/.venv/bin/activate" ]; then
  # shellcheck disable=SC1091
  . "$repo/.venv/bin/activate"
fi
kind=${1:?usage: prepare_synthetic_corpus.sh KIND DATA VOCAB [--wav] [corpus options]}
data=${2:?DATA folder}
vocab=${3:?VOCAB size}
shift 3
wav=()
if [[ "${1:-}" == --wav ]]; then wav=(--convert-to-wav); shift; fi
py() { python3 "$repo/scripts/$1" "${@:2}"; }

py make_synthetic_corpus.py "$kind" "$data" --no-progress "$@"
py build_manifest.py --dataset-dir "$data" --splits train --max-duration 16.7 "${wav[@]}" \
  --output "$data/$kind-train-raw.jsonl" --no-progress
py build_manifest.py --dataset-dir "$data" --splits dev "${wav[@]}" \
  --output "$data/$kind-dev-raw.jsonl" --no-progress
py train_tokenizer.py --manifests "$data/$kind-train-raw.jsonl" --vocab-size "$vocab" \
  --output-prefix "$data/tokenizer$vocab"
for split in train dev; do
  py build_manifest.py --dataset-dir "$data" --from-manifest "$data/$kind-$split-raw.jsonl" \
    --tokenizer "$data/tokenizer$vocab.model" --output "$data/$kind-$split.jsonl" --no-progress
done
