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
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?phase: tests | loss | step | lstm | decode | train}
OUT=${OUT:-results/gpu}
WHEELS=${WHEELS:-.carry/wheels}
DATA=${DATA:-.carry/data}     # copies of ../shared/data (LibriSpeech utterance lengths)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RNNT_SHARED_DATA="$DATA"
if [ -d "$WHEELS" ] && ! python3 -c "import librosa, mlperf_logging" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

case "$phase" in
  tests)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" ;;
  loss)
    python3 bench/joint_loss.py --lengths "$DATA/librispeech_train-clean-5_lengths.tsv" \
      --json "$OUT/joint_loss.json" 2>&1 | tee "$OUT/joint_loss.log" ;;
  step)
    for backend in ${LOSS_BACKENDS:-fused}; do  # torchaudio faults on long ragged batches
      python3 bench/train_step.py --batch-sizes 16 64 192 --num-cg 0 4 --steps 20 \
        --loss-backend "$backend" --lengths-tsv "$DATA/librispeech_train-clean-5_lengths.tsv" \
        --json "$OUT/train_step_$backend.json" 2>&1 | tee "$OUT/train_step_$backend.log"
    done
    # the config's encoder_lstm is auto (the wave kernels at batch 192 on Hopper): cuDNN beside it
    if [ -n "${CUDNN:-1}" ]; then
      python3 bench/train_step.py --batch-sizes 192 --num-cg 4 --steps 20 --loss-backend fused \
        --set model.encoder_lstm=cudnn --lengths-tsv "$DATA/librispeech_train-clean-5_lengths.tsv" \
        --json "$OUT/train_step_cudnn.json" 2>&1 | tee "$OUT/train_step_cudnn.log"
    fi ;;
  lstm)
    python3 bench/encoder_lstm.py --json "$OUT/encoder_lstm.json" 2>&1 | tee "$OUT/encoder_lstm.log" ;;
  decode)
    python3 bench/decode.py configs/baseline_v3-1023sp.yaml \
      --lengths "$DATA/librispeech_dev-clean_lengths.tsv" --batch-sizes 32 338 \
      --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" ;;
  train)
    python3 train.py configs/baseline_v3-1023sp.yaml --num_cg 4 \
      --set data.backend=synthetic --set data.tokenizer= --set loss.backend=fused \
      --set eval.mode=cg_unroll_pipeline \
      --set data.synthetic_train_lengths="$DATA/librispeech_train-clean-5_lengths.tsv" \
      --set data.synthetic_val_lengths="$DATA/librispeech_dev-clean_lengths.tsv" \
      --set training.epochs=2 --set training.log_frequency=1 --set training.output_dir=/tmp/rnnt_train \
      2>&1 | tee "$OUT/train.log"
    cp /tmp/rnnt_train/mlperf.log /tmp/rnnt_train/metrics.jsonl "$OUT/" ;;  # checkpoints stay there
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
