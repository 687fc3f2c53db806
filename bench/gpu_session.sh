#!/usr/bin/env bash
# Everything this project checks and times on a GPU machine, in phases that each fit one
# device call (the PyTorch + CUDA image has no DALI, librosa or mlperf-logging: wheels for the
# missing packages are carried in $WHEELS, made by bench/gpu_wheels.sh). Results go to $OUT
# (default results/gpu).
#
#   bash bench/gpu_session.sh tests       # every @pytest.mark.gpu test
#   bash bench/gpu_session.sh loss        # bench/joint_loss.py (issue: fused joint + loss)
#   bash bench/gpu_session.sh step        # bench/train_step.py eager vs graphs, wave vs cuDNN LSTM
#   bash bench/gpu_session.sh lstm        # bench/encoder_lstm.py: cuDNN vs the wave kernels per stack
#   bash bench/gpu_session.sh decode      # bench/decode.py, all decoder modes
#   bash bench/gpu_session.sh train       # train.py on synthetic batches: fp16, graphs, cg eval
#   bash bench/gpu_session.sh truth       # train.py's logged utt/s against its own timestamps at
#                                         # log frequencies 1 and 10, bench/train_step.py beside it
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?phase: tests | loss | step | lstm | decode | train | truth}
OUT=${OUT:-results/gpu}
WHEELS=${WHEELS:-.carry/wheels}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d "$WHEELS" ] && ! python3 -c "import librosa, mlperf_logging" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

case "$phase" in
  tests)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" ;;
  loss)
    python3 bench/joint_loss.py --json "$OUT/joint_loss.json" 2>&1 | tee "$OUT/joint_loss.log" ;;
  step)
    # the config's encoder_lstm is auto (the wave kernels at batch 192 on Hopper): cuDNN beside it
    python3 bench/train_step.py --batch-sizes 16 64 192 --num-cg 0 4 --steps 20 \
      --json "$OUT/train_step.json" 2>&1 | tee "$OUT/train_step.log"
    if [ -n "${CUDNN:-1}" ]; then
      python3 bench/train_step.py --batch-sizes 192 --num-cg 4 --steps 20 \
        --set model.encoder_lstm=cudnn --json "$OUT/train_step_cudnn.json" 2>&1 \
        | tee "$OUT/train_step_cudnn.log"
    fi ;;
  lstm)
    python3 bench/encoder_lstm.py --json "$OUT/encoder_lstm.json" 2>&1 | tee "$OUT/encoder_lstm.log" ;;
  decode)
    python3 bench/decode.py configs/baseline_v3-1023sp.yaml --batch-sizes 32 338 \
      --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" ;;
  train)
    python3 train.py configs/baseline_v3-1023sp.yaml --num_cg 4 \
      --set data.backend=synthetic --set data.tokenizer= --set loss.backend=fused \
      --set eval.mode=cg_unroll_pipeline \
      --set training.epochs=2 --set training.log_frequency=1 --set training.output_dir=/tmp/rnnt_train \
      2>&1 | tee "$OUT/train.log"
    cp /tmp/rnnt_train/mlperf.log /tmp/rnnt_train/metrics.jsonl "$OUT/" ;;  # checkpoints stay there
  truth)
    steps=${STEPS:-100}
    for freq in 1 10; do
      python3 train.py configs/baseline_v3-1023sp.yaml --num_cg 4 \
        --set data.backend=synthetic --set data.tokenizer= --set eval.mode=cg_unroll_pipeline \
        --set data.synthetic_steps_per_epoch="$steps" --set training.epochs=2 \
        --set training.log_frequency="$freq" --set training.output_dir="/tmp/rnnt_log$freq" \
        2>&1 | tee "$OUT/train_log$freq.log"
      cp "/tmp/rnnt_log$freq/metrics.jsonl" "$OUT/metrics_log$freq.jsonl"
      python3 bench/log_truth.py "/tmp/rnnt_log$freq/metrics.jsonl" --batch 192 \
        2>&1 | tee "$OUT/log_truth$freq.txt"
    done
    python3 bench/train_step.py --batch-sizes 192 --num-cg 4 --steps 50 --checkpoint-cost \
      --json "$OUT/train_step_truth.json" 2>&1 | tee "$OUT/train_step_truth.log" ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
