#!/usr/bin/env bash
# Start the image on this node with the datasets and results mounted, as the calling user (so
# the files it writes under results/ are theirs):
#   DATASETS=/raid/datasets docker/run.sh torchrun --nproc_per_node 8 train.py CONFIG --num_cg 4
set -euo pipefail
cd "$(dirname "$0")/.."
: "${DATASETS:?set DATASETS to the folder holding LibriSpeech/ and sentencepieces/}"
mkdir -p results
exec docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
  --user "$(id -u):$(id -g)" --env HOME=/tmp \
  -v "$DATASETS":/workspace/rnnt/datasets -v "$PWD/results":/workspace/rnnt/results \
  "${IMAGE:-rnnt-mlperf}" "$@"
