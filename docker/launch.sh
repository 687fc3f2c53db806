#!/usr/bin/env bash
# One MLPerf timing run on this node in the image: the page cache dropped first (when this user
# may), then torchrun with one process per GPU running scripts/run_and_time.sh.
#   DATASETS=/raid/datasets docker/launch.sh [SYSTEM_CONFIG] [train.py arguments...]
# SYSTEM_CONFIG defaults to configs/systems/dgxh100_1x8x192.yaml (8 GPUs); SEED, ORG pass on.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/systems/dgxh100_1x8x192.yaml}
[ $# -eq 0 ] || shift
gpus=$(nvidia-smi --list-gpus | wc -l)
cleared=0
if sync && { echo 3 > /proc/sys/vm/drop_caches; } 2>/dev/null; then
  cleared=1
elif sudo -n true 2>/dev/null && sudo sh -c 'sync && echo 3 > /proc/sys/vm/drop_caches'; then
  cleared=1
else
  echo "launch.sh: could not drop the page cache (needs root); the MLPerf log will say so" >&2
fi
output="results/run-$(date +%Y%m%d-%H%M%S)"
exec env CACHES_CLEARED="$cleared" docker/run.sh \
  env CACHES_CLEARED="$cleared" SEED="${SEED:-}" ORG="${ORG:-rnnt-open}" \
  torchrun --standalone --nproc_per_node "$gpus" --no-python \
  bash scripts/run_and_time.sh "$config" --set "training.output_dir=$output" "$@"
