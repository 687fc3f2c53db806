#!/usr/bin/env bash
# The spoken-digits quickstart: synthesize a corpus with espeak-ng in the LibriSpeech layout,
# build manifests and a tokenizer, train configs/tiny.yaml on CPU until the dev WER reaches
# 5.8%, re-score the checkpoint with eval.py and check the MLPerf log.
#
#   bash scripts/quickstart.sh                      # everything under datasets/ and results/
#   DATA=/tmp/digits OUT=/tmp/run TRAIN_UTTS=3000 bash scripts/quickstart.sh --set training.epochs=8
# Extra arguments go to train.py (e.g. --set overrides). Reruns reuse the finished corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
# the environment scripts/install.sh made, unless another one is active
if [ -z "${VIRTUAL_ENV:-}" ] && [ -z "${CONDA_PREFIX:-}" ] && [ -f .venv/bin/activate ]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi

DATA=${DATA:-datasets/digits}
OUT=${OUT:-results/tiny}
TRAIN_UTTS=${TRAIN_UTTS:-3000}
DEV_UTTS=${DEV_UTTS:-2703}   # dev-clean's size: an MLPerf log evaluated on fewer is not compliant
VOCAB=24                     # digits text supports 18..27 pieces; configs/tiny.yaml has 24 + blank
SEED=${SEED:-1}

step() { printf '\n== %s\n' "$*"; }

step "1-3/6 synthesize the digits corpus ($TRAIN_UTTS train, $DEV_UTTS dev) in $DATA, \
validated manifests, a $VOCAB-piece tokenizer and token ids"
bash scripts/prepare_synthetic_corpus.sh digits "$DATA" "$VOCAB" --train "$TRAIN_UTTS" \
  --dev "$DEV_UTTS" --seed "$SEED"

step "4/6 train configs/tiny.yaml to the 5.8% WER target"
# a rerun trains afresh: --overwrite deletes the previous run's checkpoints in $OUT
python3 train.py configs/tiny.yaml --device cpu --overwrite \
  --set data.dataset_dir="$DATA" \
  --set "data.train_manifests=[$DATA/digits-train.jsonl]" \
  --set "data.val_manifests=[$DATA/digits-dev.jsonl]" \
  --set data.tokenizer="$DATA/tokenizer$VOCAB.model" \
  --set training.output_dir="$OUT" "$@"

step "5/6 re-score the newest checkpoint with eval.py"
# the newest checkpoint directory: the final state the run saved last
ckpt=$(find "$OUT/checkpoints" -mindepth 1 -maxdepth 1 -name 'ckpt_*' -printf '%T@ %p\n' \
  | sort -n | tail -n 1 | cut -d' ' -f2-)
python3 eval.py configs/tiny.yaml "$ckpt" --device cpu \
  --set data.dataset_dir="$DATA" \
  --set "data.val_manifests=[$DATA/digits-dev.jsonl]" \
  --set data.tokenizer="$DATA/tokenizer$VOCAB.model"

step "6/6 MLPerf compliance check and curves"
python3 -m mlperf_logging.compliance_checker --usage training --ruleset 3.1.0 \
  --log_output "$OUT/compliance_checker.log" "$OUT/mlperf.log" | tail -n 3
python3 scripts/plot_metrics.py "$OUT/metrics.jsonl" --out "$OUT/curves.png"

printf '\nMLPerf log:   %s\nmetrics:      %s\ncurves:       %s\ncheckpoint:   %s\n' \
  "$OUT/mlperf.log" "$OUT/metrics.jsonl" "$OUT/curves.png" "$ckpt"
