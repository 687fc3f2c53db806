#!/usr/bin/env bash
# One MLPerf timing run: train.py with its arguments, between a start and an end line.
#
#   scripts/run_and_time.sh CONFIG [train.py arguments...]
#
# Under srun (scripts/slurm/run.sub) every task runs it: each task starts its own train.py and
# rank 0 alone prints the timing lines. The seed is $SEED when set, else train.py draws one from
# os.urandom (and logs it). CACHES_CLEARED=1 says the launcher dropped the page cache first
# (logged as cache_clear); without it the MLPerf log says they were not.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: scripts/run_and_time.sh CONFIG [train.py arguments...]" >&2
  exit 2
fi

args=("$@")
if [ -n "${SEED:-}" ]; then
  case "$SEED" in
    *[!0-9]* | '') echo "SEED must be a non-negative integer, got '$SEED'" >&2; exit 2 ;;
  esac
  args+=(--set "training.seed=$SEED")
fi
if [ "${CACHES_CLEARED:-0}" = 1 ]; then
  args+=(--cache-cleared)
fi

rank=${RANK:-${SLURM_PROCID:-0}}
start=$(date +%s)
if [ "$rank" = 0 ]; then
  echo "STARTING TIMING RUN AT $(date -d "@$start" '+%Y-%m-%d %r')"
fi
# A preemption signal (SIGUSR1, SIGTERM) must reach train.py, which saves and exits with 75,
# and this shell must live on to report that status rather than die of the signal: torchrun
# signals only this shell, Slurm every process of the step (train.py then hears it twice).
python3 train.py "${args[@]}" &
child=$!
trap 'kill -USR1 "$child" 2>/dev/null || true' USR1
trap 'kill -TERM "$child" 2>/dev/null || true' TERM
while true; do
  status=0
  wait "$child" || status=$?
  kill -0 "$child" 2>/dev/null || break  # a signal interrupted the wait: wait again
done
end=$(date +%s)
if [ "$rank" = 0 ]; then
  echo "ENDING TIMING RUN AT $(date -d "@$end" '+%Y-%m-%d %r')"
  echo "RESULT,RNN_SPEECH_RECOGNITION,,$((end - start)),${ORG:-rnnt-open},$(date -d "@$start" '+%Y-%m-%d %r')"
fi
exit "$status"
