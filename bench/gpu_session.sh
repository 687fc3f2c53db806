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
#   bash bench/gpu_session.sh multi       # the NCCL tests (-m multi_gpu) on this machine's GPUs
#   bash bench/gpu_session.sh scaling     # weak scaling of the Trainer's step on 1, 2, 4, ... GPUs
#                                         # at 192 and 24 per GPU, exposed communication
#   bash bench/gpu_session.sh fullrun     # train.py under torchrun on 2 and 4 GPUs, with eval
set -uo pipefail
cd "$(dirname "$0")/.." || exit
phase=${1:?phase: tests | loss | step | lstm | decode | train | truth | multi | scaling | fullrun}
OUT=${OUT:-results/gpu}
WHEELS=${WHEELS:-.carry/wheels}
# the spoken-digits corpus the distributed tests train on (this machine has no espeak-ng):
# python3 -c 'from pathlib import Path; from tests.conftest import build_digits_corpus as b;
# b(Path(".carry/digits"))' on a machine that has it
if [ -d .carry/digits ]; then export RNNT_TEST_CORPUS=$PWD/.carry/digits; fi
gpus=$(nvidia-smi --list-gpus | wc -l)
mkdir -p "$OUT"
# the GPU machine runs this checkout uninstalled: the benchmarks and scripts import rnnt from it
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
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
    python3 train.py configs/systems/h200_1x1x192.yaml --num_cg 4 \
      --set data.backend=synthetic --set data.tokenizer= --set loss.backend=fused \
      --set eval.mode=cg_unroll_pipeline \
      --set training.epochs=2 --set training.log_frequency=1 --set training.output_dir=/tmp/rnnt_train \
      2>&1 | tee "$OUT/train.log"
    cp /tmp/rnnt_train/mlperf.log /tmp/rnnt_train/metrics.jsonl "$OUT/" ;;  # checkpoints stay there
  truth)
    steps=${STEPS:-100}
    for freq in 1 10; do
      python3 train.py configs/systems/h200_1x1x192.yaml --num_cg 4 \
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
  multi)
    timeout 560 python3 -m pytest -q -m multi_gpu -p no:cacheprovider --durations=12 tests \
      2>&1 | tee "$OUT/multi_gpu_tests.log" ;;
  scaling)
    for n in 1 2 4 8; do
      [ "$n" -le "$gpus" ] || break
      torchrun --standalone --nproc_per_node "$n" bench/train_step.py --batch-sizes 192 24 \
        --num-cg 4 --steps 30 ${AVG:+--average-lengths} --json "$OUT/scaling_$n${AVG:+_avg}.json" 2>&1 \
        | tee "$OUT/scaling_$n.log" | grep -v Warning
    done
    torchrun --standalone --nproc_per_node "$gpus" bench/train_step.py --batch-sizes 192 24 \
      --num-cg 4 --steps 30 ${AVG:+--average-lengths} --set training.overlap_grad_reduce=false \
      --json "$OUT/scaling_${gpus}_no_overlap${AVG:+_avg}.json" 2>&1 | tee "$OUT/scaling_no_overlap.log" ;;
  fullrun)
    for n in 2 4; do
      [ "$n" -le "$gpus" ] || break
      torchrun --standalone --nproc_per_node "$n" train.py configs/baseline_v3-1023sp.yaml \
        --num_cg 4 --set data.backend=synthetic --set data.tokenizer= \
        --set optimizer.allow_gbs_mismatch=true \
        --set data.synthetic_steps_per_epoch="${STEPS:-40}" \
        --set training.epochs=2 --set training.save_every_epochs=1 \
        --set eval.mode=cg_unroll_pipeline --set training.output_dir="/tmp/rnnt_full$n" \
        2>&1 | tee "$OUT/fullrun_$n.log" | grep -Ev "Warning|warn"
      cp "/tmp/rnnt_full$n/metrics.jsonl" "$OUT/fullrun_metrics_$n.jsonl"
      ls -R "/tmp/rnnt_full$n/checkpoints" > "$OUT/fullrun_checkpoints_$n.txt"
    done ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
