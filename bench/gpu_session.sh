#!/usr/bin/env bash
# Everything this project checks and times on a GPU machine, in phases that each fit one
# device call (the PyTorch + CUDA image has no DALI, librosa or mlperf-logging: wheels for the
# missing packages are carried in $WHEELS, made by bench/gpu_wheels.sh). Results go to $OUT
# (default results/gpu).
#
#   bash bench/gpu_session.sh setup       # the carried wheels, DALI and espeak-ng only
#   bash bench/gpu_session.sh tests       # every @pytest.mark.gpu test
#   bash bench/gpu_session.sh loss        # bench/joint_loss.py (issue: fused joint + loss)
#   bash bench/gpu_session.sh step        # bench/train_step.py eager vs graphs, wave vs cuDNN LSTM
#   bash bench/gpu_session.sh lstm        # bench/encoder_lstm.py: cuDNN vs the wave kernels per stack;
#                                         # bench/wave_tile_skip.py: what per-tile skipping saves;
#                                         # bench/wave_anatomy.py: where a wave step's time goes
#   bash bench/gpu_session.sh features    # bench/feature_stage.py: the feature stage and its kernels
#   bash bench/gpu_session.sh decode      # bench/decode.py, all decoder modes
#   bash bench/gpu_session.sh train       # train.py on synthetic batches: fp16, graphs, cg eval
#   bash bench/gpu_session.sh truth       # train.py's logged utt/s against its own timestamps at
#                                         # log frequencies 1 and 10, bench/train_step.py beside it
#   bash bench/gpu_session.sh multi       # the NCCL tests (-m multi_gpu) on this machine's GPUs
#   bash bench/gpu_session.sh scaling     # weak scaling of the Trainer's step on 1, 2, 4, ... GPUs
#                                         # at 192 and 24 per GPU, exposed communication; strong
#                                         # scaling: half the GPUs, two micro-batches each
#   bash bench/gpu_session.sh fullrun     # train.py under torchrun on 2 and 4 GPUs, with eval
#   bash bench/gpu_session.sh dgx         # the MLPerf configuration on every GPU here, 3 epochs:
#                                         # its projected time to train and compliance verdict
#
# Real audio (the convergence check of docs/CONVERGENCE.md), on one warm machine, in order:
#   bash bench/gpu_session.sh corpus      # espeak-ng from .carry/debs; the sentences corpus
#   bash bench/gpu_session.sh pipeline    # bench/data_pipeline.py on it, every backend here;
#                                         # bench/worker_handoff.py beside it
#   bash bench/gpu_session.sh multireal   # train.py on its audio on every GPU here (NCCL);
#                                         # PER_GPU=48 EPOCHS=30 TARGET=0.058 on 4 GPUs: the
#                                         # convergence run's schedule, to the target
#   bash bench/gpu_session.sh realstep    # the trainer's step on its audio vs synthetic batches
#                                         # (EPOCHS=2, BACKEND=torch|dali, RESAMPLING=gpu|cpu,
#                                         # WORKERS=8, SETS="key=value ..."; PROFILE_FROM=30:
#                                         # torch.profiler over 5 steps of each, the GPU's
#                                         # work only unless PROFILE_HOST=true, and
#                                         # bench/trace_streams.py on it)
#   bash bench/gpu_session.sh realstep_ab # realstep for this checkout and the tree SRC_B in
#                                         # turn, ROUNDS (2) times each: a change's effect
#   bash bench/gpu_session.sh converge    # the runs of configs/convergence/, in the background
#   bash bench/gpu_session.sh fork        # more runs, from the fast run's first checkpoint past
#                                         # the loss plateau
#   bash bench/gpu_session.sh wait        # until they end (or this call's time); their logs
#                                         # and metrics in $OUT/runs.tar.gz
#   bash bench/gpu_session.sh evalparity  # eval.py in every decoder mode; compliance checker
#   bash bench/gpu_session.sh rescore     # each run's checkpoint scored with nn.LSTM and the wave
#                                         # kernels' forward (eval.encoder_lstm)
#   bash bench/gpu_session.sh lossreading # bench/loss_reading.py: the reference and the fused
#                                         # loss on the same batches and weights (START, default:
#                                         # the checkpoint `fork` copied; BATCHES, default 20)
#   bash bench/gpu_session.sh stress      # several short runs on every GPU at once: races
#   bash bench/gpu_session.sh bundle      # $OUT's files in one $OUT/results.tar.gz (the device
#                                         # tool brings back at most 8 files a call)
#
# The machine goes back after 30 s without a call, with everything on it (the corpus, the
# runs in the background): keep the calls coming back to back until the last one.
# DALI travels in parts, one per call (.carry/dali, made by bench/dali_parts.sh); each call
# keeps its part in /tmp/dali_parts, and the call that has them all unpacks DALI.
#
# ON_GPU=i runs a phase on GPU i alone with its share of the cores (GPU i of n gets the i-th
# n-th of them), so that benchmarks beside `converge`'s runs neither take nor lose cores.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
if [ -n "${ON_GPU:-}" ]; then
  share=$(( $(nproc) / $(nvidia-smi --list-gpus | wc -l) ))
  first=$(( ON_GPU * share ))
  exec env ON_GPU= CUDA_VISIBLE_DEVICES="$ON_GPU" taskset -c "$first-$(( first + share - 1 ))" \
    bash "$0" "$@"
fi
phase=${1:?phase: setup | tests | loss | step | lstm | features | decode | train | truth | multi | scaling | fullrun | dgx | corpus | pipeline | multireal | realstep | realstep_ab | converge | fork | wait | evalparity | rescore | lossreading | stress | bundle}
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
# PYTHONPATH for a trainer from the source tree $1: that tree first. A trainer imports its own
# tree's rnnt (its script's folder leads sys.path), but the loader's forkserver does not get
# that sys.path, and puts its working directory (here, this checkout) first on its own: trees
# whose `worker_processes` does not set PYTHONSAFEPATH run this checkout's loader in their
# workers beside their own trainer, so time their loader from their own directory.
tree_path() { echo "$(cd "$1" && pwd):$PYTHONPATH"; }
# Phases started side by side (ON_GPU) set the machine up one at a time: two unpacking DALI
# or installing wheels into the same folder at once left broken or half-written files.
exec 9>/tmp/gpu_session_setup.lock
flock 9
# an earlier phase on this machine (maybe still running) installed them already
if [ -d /tmp/site ]; then export PYTHONPATH=/tmp/site:$PYTHONPATH; fi
if [ -d "$WHEELS" ] && ! python3 -c "import librosa, mlperf_logging" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
if [ -d .carry/dali ]; then
  mkdir -p /tmp/dali_parts && cp -n .carry/dali/* /tmp/dali_parts/ 2>/dev/null
fi
if [ -f /tmp/dali_parts/SHA256SUMS ] && [ ! -d /tmp/dali_site ]; then
  archive=$(awk '{print $2}' /tmp/dali_parts/SHA256SUMS)
  if cat /tmp/dali_parts/"$archive".part* > "/tmp/$archive" 2>/dev/null \
      && (cd /tmp && sha256sum --quiet -c /tmp/dali_parts/SHA256SUMS); then
    # unpacked beside, then renamed: an interrupted unpack must not pass for a finished one
    rm -rf /tmp/dali_site.partial && mkdir -p /tmp/dali_site.partial \
      && tar -xJf "/tmp/$archive" -C /tmp/dali_site.partial && mv /tmp/dali_site.partial /tmp/dali_site
  else
    echo "DALI: $(find /tmp/dali_parts -name '*.part*' | wc -l) parts here, not all yet"
  fi
fi
if [ -d /tmp/dali_site ]; then export PYTHONPATH=/tmp/dali_site:$PYTHONPATH; fi
# espeak-ng from Debian packages (bench/espeak_debs.sh made .carry/debs)
# (unpacked once: later calls, which need not carry them, find them in /tmp/esp)
if [ -d .carry/debs ] && [ ! -d /tmp/esp ] && ! command -v espeak-ng >/dev/null; then
  for f in .carry/debs/*.deb; do dpkg -x "$f" /tmp/esp.partial; done && mv /tmp/esp.partial /tmp/esp
fi
if [ -d /tmp/esp ]; then
  lib=/tmp/esp/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH=$lib:$lib/pulseaudio:/tmp/esp/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export ESPEAK_DATA_PATH=$lib/espeak-ng-data PATH=/tmp/esp/usr/bin:$PATH
fi
flock -u 9
exec 9>&-
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
corpus=datasets/sentences
runs=results/convergence

# Detached training runs of configs/convergence/ for `converge` and `fork`, so that later calls
# can wait for them: start_runs CHECKPOINT PREFIX NAME... where NAME is fast_sN or plain_sN and
# CHECKPOINT ("" for none) is where they start (train.py --init-from). Run i gets GPU
# (FIRST_GPU + i) mod (GPUs here) and that GPU's share of the cores (pinned, so that other
# phases can time on the remaining GPUs), and runs from a copy of this checkout that later
# calls' copies cannot change under it. The plain path takes micro-batches of 96 with two
# accumulated (the same global batch) where a GPU has under 100 GiB: its lattice
# log-probabilities and their gradient needed about 75 GB at 192. FAST_GPUS=n trains each fast
# run under torchrun on n GPUs from its own, with 192 / n per GPU: the sampler deals the same
# global batches to any number of ranks, so the run sees the plain runs' data, and its log is
# a multi-GPU run to the target. WORKERS: loader processes per run (default: the share of
# cores less two, at most 14). SETS: more `key=value` overrides for every run. SRC: another
# source tree to run (as for `stress`): a run that must repeat an earlier one bit for bit.
# Runs given the same GPU run one after another, in the order named, and after the runs of
# earlier calls on it (a lock per GPU): two plain runs at batch 192 need more than an H200's
# memory, and processes sharing a GPU have died of an illegal memory access
# (docs/CONVERGENCE.md). SHARE_GPUS=1 starts them all at once instead.
start_runs() {
  local from=$1 prefix=$2  # with a checkpoint: $fork_to, the epoch to train to
  shift 2
  mkdir -p "$runs"
  local src mem_gib share workers fast_gpus
  src=$(mktemp -d /tmp/rnnt_converge_src.XXXX)
  (cd "${SRC:-.}" && cp -a rnnt train.py eval.py configs "$src"/)
  ln -s "$PWD/datasets" "$src/datasets" && ln -s "$PWD/results" "$src/results"
  mem_gib=$(( $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1) / 1024 ))
  share=$(( $(nproc) / gpus ))
  workers=$(( share - 2 ))
  [ "$workers" -gt 14 ] && workers=14
  workers=${WORKERS:-$workers} fast_gpus=${FAST_GPUS:-1}
  local i=0 name path seed config extra gpu n launch visible cores log lane locks g
  for name in "$@"; do
    path=${name%_s*} seed=${name##*_s}
    config=configs/convergence/sentences.yaml extra=()
    for kv in ${SETS:-}; do extra+=(--set "$kv"); done
    if [ "$path" = plain ]; then
      config=configs/convergence/sentences_plain.yaml
      [ "$mem_gib" -lt 100 ] && extra=(--set training.batch_size=96 --set training.grad_accumulation=2)
    fi
    if [ -n "$from" ]; then
      extra+=(--init-from "$from" --set training.epochs="$fork_to" --set training.target_wer=0)
    fi
    gpu=$(( (${FIRST_GPU:-0} + i) % gpus )) n=1 launch=(python3)
    i=$(( i + 1 ))
    if [ "$path" = fast ] && [ "$fast_gpus" -gt 1 ]; then
      n=$fast_gpus name=${name}_${n}gpu
      [ $(( gpu + n )) -gt "$gpus" ] && gpu=0
      launch=(torchrun --standalone --nproc_per_node "$n")
      extra+=(--set system.gpus_per_node="$n" --set training.batch_size=$(( 192 / n )))
    fi
    name=$prefix$name
    visible=$(seq -s, "$gpu" $(( gpu + n - 1 ))) cores="$(( gpu * share ))-$(( (gpu + n) * share - 1 ))"
    log=$PWD/$runs/$name.log
    lane=$src/lane_$gpu.sh
    [ -n "${SHARE_GPUS:-}" ] && lane=$src/lane_run$i.sh
    [ -f "$lane" ] && echo "$name: GPUs $visible, after the runs before it on them"
    [ -f "$lane" ] || echo "$name: GPUs $visible, cores $cores, $workers workers ${extra[*]}"
    # each of its GPUs' locks, in ascending order so that no two runs wait on each other, held
    # by flock itself (-o): a worker process left behind by a crash must not keep the GPU
    locks=()
    if [ -z "${SHARE_GPUS:-}" ]; then
      for g in $(seq "$gpu" $(( gpu + n - 1 ))); do locks+=(flock -o "/tmp/rnnt_gpu$g.lock"); done
    fi
    [ -f "$lane" ] || printf 'cd %q || exit\n' "$src" > "$lane"
    {
      printf '%q ' "${locks[@]}" env PYTHONPATH="$(tree_path "$src")" CUDA_VISIBLE_DEVICES="$visible" \
        taskset -c "$cores" "${launch[@]}" train.py "$config" \
        --set training.seed="$seed" --set data.num_threads="$workers" "${extra[@]}" \
        --set training.output_dir="results/convergence/$name"
      printf '> %q 2>&1 < /dev/null\n' "$log"
    } >> "$lane"
  done
  # each lane detached, by its full path (`wait` looks for it), with nothing of this script's
  # stdout held open: a caller's pipe must not wait for the runs
  for lane in "$src"/lane_*.sh; do
    setsid nohup bash "$lane" > /dev/null 2>&1 < /dev/null &
  done
}
# whether a run of `converge` or `fork` is training, or is queued behind one that is
runs_alive() {
  pgrep -f "train.py configs/convergence" >/dev/null || pgrep -f "rnnt_converge_src.*/lane_" >/dev/null
}

case "$phase" in
  setup)
    # only the set-up above (wheels into /tmp/site, DALI, espeak-ng), for a call that runs
    # scripts of its own after it with PYTHONPATH=$PWD:/tmp/site
    if [ -d /tmp/site ]; then echo "wheels in /tmp/site"; fi ;;
  tests)
    # TESTS: other pytest arguments (files, -k) than the whole suite
    # shellcheck disable=SC2086
    python3 -m pytest -q -m gpu -p no:cacheprovider --durations=10 ${TESTS:-tests} 2>&1 \
      | tee "$OUT/gpu_tests.log" ;;
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
    python3 bench/encoder_lstm.py --json "$OUT/encoder_lstm.json" 2>&1 | tee "$OUT/encoder_lstm.log"
    python3 bench/wave_tile_skip.py --json "$OUT/wave_tile_skip.json" 2>&1 | tee "$OUT/wave_tile_skip.log"
    python3 bench/wave_anatomy.py --json "$OUT/wave_anatomy.json" 2>&1 | tee "$OUT/wave_anatomy.log" ;;
  features)
    python3 bench/feature_stage.py 2>&1 | tee "$OUT/feature_stage.log" ;;
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
      --json "$OUT/scaling_${gpus}_no_overlap${AVG:+_avg}.json" 2>&1 | tee "$OUT/scaling_no_overlap.log"
    # strong scaling: the global batch of all GPUs at 192 each, on half the GPUs with two
    # micro-batches of 192 accumulated per step
    if [ "$gpus" -ge 2 ]; then
      torchrun --standalone --nproc_per_node $(( gpus / 2 )) bench/train_step.py --batch-sizes 192 \
        --num-cg 4 --steps 30 --set training.grad_accumulation=2 \
        --json "$OUT/scaling_$(( gpus / 2 ))x2.json" 2>&1 | tee "$OUT/scaling_strong.log" | grep -v Warning
    fi ;;
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
  dgx)
    # the MLPerf configuration at 192 per GPU on this machine's GPUs: STEPS synthetic steps per
    # epoch at real lengths, the dev-clean shapes evaluated after each of 3 epochs; then the
    # projected time to train (bench/project_ttt.py) and the compliance checker on its log
    run=/tmp/rnnt_dgx$gpus
    torchrun --standalone --nproc_per_node "$gpus" train.py configs/baseline_v3-1023sp.yaml \
      --num_cg 4 --overwrite --set data.backend=synthetic --set data.tokenizer= \
      --set optimizer.allow_gbs_mismatch=true --set data.synthetic_steps_per_epoch="${STEPS:-200}" \
      --set training.epochs=3 --set training.target_wer=0 --set training.save_every_epochs=0 \
      --set training.output_dir="$run" 2>&1 | tee "$OUT/dgx_$gpus.log" | grep -Ev "Warning|warn"
    python3 bench/project_ttt.py "$run" --json "$OUT/dgx_projection_$gpus.json" \
      | tee "$OUT/dgx_projection_$gpus.txt"
    python3 -m mlperf_logging.compliance_checker --usage training --ruleset 3.1.0 \
      "$run/mlperf.log" 2>&1 | tail -5 | tee "$OUT/dgx_compliance_$gpus.txt" ;;
  corpus)
    ldd "$(command -v espeak-ng)" | grep -i "not found"
    start=$(date +%s)
    bash scripts/prepare_synthetic_corpus.sh sentences "$corpus" 1023 --wav --train "${TRAIN:-30000}" \
      --durations librispeech --held-out-speakers 12 --seed 1 2>&1 | tee "$OUT/corpus.log"
    { echo "built in $(( $(date +%s) - start )) s on $(nproc) cores"
      du -sh "$corpus" "$corpus"/train "$corpus"/train-wav "$corpus"/dev-wav
      cat "$corpus/synthetic_corpus.json"; } | tee "$OUT/corpus.txt" ;;
  pipeline)
    # BACKENDS, RESAMPLING, THREADS narrow it; PROFILE=1 prints the GPU stage's kernels
    tag=${BACKENDS:-all}; tag=${tag// /_}
    # shellcheck disable=SC2086
    python3 bench/data_pipeline.py --manifest "$corpus/sentences-train.jsonl" --dataset-dir "$corpus" \
      --backends ${BACKENDS:-torch dali} --resampling ${RESAMPLING:-gpu cpu} --threads ${THREADS:-4 8} \
      ${PROFILE:+--profile} --json "$OUT/data_pipeline_$tag.json" 2>&1 | tee "$OUT/data_pipeline_$tag.log"
    # what each torch-loader batch costs the training process on this host's cores
    python3 bench/worker_handoff.py --workers 4 2>&1 | grep -E "^(new|reused)" \
      | tee "$OUT/worker_handoff.log" ;;
  realstep)
    # the fast path's trainer for EPOCHS (2) epochs on the corpus's audio, then on synthetic
    # batches of the same utterances' lengths and transcripts (a lengths table written from the
    # manifest); the summary's last epoch is the steady state (the first also holds the dev
    # set's workers' start halfway through it, a one-off cost of 1-2 s);
    # in a folder of its own, so that several can run side by side (ON_GPU); SRC: another
    # source tree's trainer (as for `stress`), to time two versions side by side
    work=$(mktemp -d /tmp/realstep.XXXX)
    for split in train dev; do
      python3 -c 'import json, sys
for line in open(sys.argv[1]):
    u = json.loads(line)
    print(u["utt_id"], u["duration"], u["transcript"], sep="\t")' \
        "$corpus/sentences-$split.jsonl" > "$work/sentences_${split}_lengths.tsv"
    done
    for data in real synthetic; do
      extra=()
      for kv in ${SETS:-}; do extra+=(--set "$kv"); done
      # PROFILE_FROM=step: torch.profiler over PROFILE_STEPS (5) steps from there, both runs
      [ -n "${PROFILE_FROM:-}" ] && extra+=(--set training.profile_from_step="$PROFILE_FROM"
        --set training.profile_steps="${PROFILE_STEPS:-5}"
        --set training.profile_host="${PROFILE_HOST:-false}")
      [ "$data" = synthetic ] && extra+=(--set data.backend=synthetic
        --set data.synthetic_train_lengths="$work/sentences_train_lengths.tsv"
        --set data.synthetic_val_lengths="$work/sentences_dev_lengths.tsv")
      PYTHONPATH=$(tree_path "${SRC:-.}") \
        python3 "${SRC:-.}/train.py" "${SRC:-.}/configs/convergence/sentences.yaml" --overwrite \
        --set training.epochs="${EPOCHS:-2}" \
        --set data.backend="${BACKEND:-torch}" --set data.resampling_device="${RESAMPLING:-gpu}" \
        --set data.num_threads="${WORKERS:-8}" \
        --set training.output_dir="$work/step_$data" "${extra[@]}" 2>&1 | tee "$OUT/realstep_$data.log" \
        | grep -v Warning
      cp "$work/step_$data/metrics.jsonl" "$OUT/realstep_${data}_metrics.jsonl"
      for f in "$work/step_$data"/profile/*; do
        [ -f "$f" ] && gzip -c "$f" > "$OUT/realstep_${data}_$(basename "$f").gz"
      done
      # the feature stage's bursts on its own stream: span against busy time (a long wait
      # behind the step's kernels shows as a span far beyond the busy time), and the time it
      # ran alone (the step's stream waiting for it)
      for f in "$work/step_$data"/profile/*.json; do
        [ -f "$f" ] && python3 bench/trace_streams.py "$f" > "$OUT/realstep_${data}_streams.txt"
      done
    done
    python3 scripts/plot_metrics.py "$OUT/realstep_real_metrics.jsonl" \
      "$OUT/realstep_synthetic_metrics.jsonl" --labels real synthetic --summary-only ;;
  realstep_ab)
    # this checkout against SRC_B (another commit's tree, from `git archive`), alternating on
    # the same GPU and cores so that both see the same machine: each run's real and synthetic
    # medians, in $OUT/realstep_ab.txt
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for arm in this other; do
        src=.
        [ "$arm" = other ] && src=${SRC_B:?"SRC_B: the tree to compare with"}
        OUT=$OUT/ab_${arm}_$round SRC=$src bash "$0" realstep 2>&1 \
          | grep -E "^(real|synthetic):" | sed "s/^/$arm, round $round, /"
      done
    done | tee "$OUT/realstep_ab.txt" ;;
  multireal)
    # real audio on every GPU here under NCCL: the corpus's fast-path config for EPOCHS epochs,
    # evaluated after each, with BACKEND's loader. PER_GPU utterances per GPU (192: the global
    # batch grows with the GPUs; 192 / GPUs: the convergence run's global batch and schedule,
    # which with TARGET=0.058 trains to the MLPerf target); then the compliance checker.
    torchrun --standalone --nproc_per_node "$gpus" train.py configs/convergence/sentences.yaml \
      --overwrite --set system.gpus_per_node="$gpus" --set data.backend="${BACKEND:-torch}" \
      --set training.batch_size="${PER_GPU:-192}" --set training.epochs="${EPOCHS:-2}" \
      --set training.target_wer="${TARGET:-0}" --set training.output_dir=/tmp/rnnt_multireal 2>&1 \
      | tee "$OUT/multireal_$gpus.log" | grep -Ev "Warning|warn"
    cp /tmp/rnnt_multireal/metrics.jsonl "$OUT/multireal_metrics_$gpus.jsonl"
    cp /tmp/rnnt_multireal/mlperf.log "$OUT/multireal_mlperf_$gpus.log"
    python3 -m mlperf_logging.compliance_checker --usage training --ruleset 3.1.0 \
      /tmp/rnnt_multireal/mlperf.log 2>&1 | tail -3 | tee "$OUT/multireal_compliance_$gpus.txt" ;;
  converge)
    # the runs named in RUNS (fast, plain) for each seed in SEEDS, detached (start_runs)
    names=()
    for seed in ${SEEDS:-1}; do for path in ${RUNS:-fast plain}; do names+=("${path}_s$seed"); done; done
    start_runs "" "" "${names[@]}" ;;
  fork)
    # Runs that start from a checkpoint of the fast run FAST_RUN (default fast_s1) instead of
    # from scratch: the first one whose dev WER is below FORK_WER (default 0.95), so after the
    # run has left the loss plateau whose end varies by 1,000 steps between runs
    # (docs/CONVERGENCE.md); FORK_EPOCH=n takes that epoch's checkpoint instead, for when a
    # change to the evaluation moves the WERs that pick it. FORKS names them (default
    # "plain_s1 plain_s2 fast_s2"); they train FORK_EPOCHS (default 6) epochs past it, target
    # off; FORK_TAG (with SETS, say) goes into their names. Waits up to WAIT_S for that
    # checkpoint, and copies it beside the runs, out of reach of the fast run's retention.
    deadline=$(( $(date +%s) + ${WAIT_S:-540} )) ckpt=""
    while [ -z "$ckpt" ] && [ "$(date +%s)" -lt "$deadline" ]; do
      ckpt=$(python3 - "$runs/${FAST_RUN:-fast_s1}/checkpoints" "${FORK_WER:-0.95}" "${FORK_EPOCH:-}" <<'PY'
import json, sys
from pathlib import Path
found = []
for done in Path(sys.argv[1]).glob("ckpt_e*/complete.json"):
    wer = json.loads(done.read_text()).get("meta", {}).get("wer")
    epoch = int(done.parent.name.split("_")[1][1:])
    if (str(epoch) == sys.argv[3]) if sys.argv[3] else (wer is not None and wer < float(sys.argv[2])):
        found.append((epoch, str(done.parent)))
print(min(found)[1] if found else "")
PY
)
      [ -z "$ckpt" ] && { echo "$(date +%T) $(find "$runs/${FAST_RUN:-fast_s1}/checkpoints" -mindepth 1 -maxdepth 1 -printf '%f ' 2>/dev/null)"; sleep 5; }
    done
    if [ -z "$ckpt" ]; then
      wanted="below dev WER ${FORK_WER:-0.95}"
      [ -n "${FORK_EPOCH:-}" ] && wanted="of epoch $FORK_EPOCH"
      echo "fork: no checkpoint $wanted in $runs/${FAST_RUN:-fast_s1}/checkpoints yet"
      exit 1
    fi
    copy=$runs/start_$(basename "$ckpt")
    rm -rf "$copy" && cp -a "$ckpt" "$copy"
    echo "fork: from $ckpt ($(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["meta"])' "$copy/complete.json"))"
    done_epochs=$(basename "$ckpt" | cut -d_ -f2 | tr -d e)
    fork_to=$(( done_epochs + ${FORK_EPOCHS:-6} ))
    # shellcheck disable=SC2086
    start_runs "$PWD/$copy" "from_e${done_epochs}_${FORK_TAG:+${FORK_TAG}_}" ${FORKS:-plain_s1 plain_s2 fast_s2} ;;
  wait)
    # until every run of `converge` has ended, or this call's time is nearly up
    deadline=$(( $(date +%s) + ${WAIT_S:-540} ))
    while runs_alive && [ "$(date +%s)" -lt "$deadline" ]; do
      sleep 10
    done
    # every run's log and metrics in one file, $OUT/runs.tar.gz: the device tool brings back
    # at most 8 files a call, and a session's forks make more than that
    rm -rf /tmp/gpu_session_runs && mkdir -p /tmp/gpu_session_runs
    for log in "$runs"/*.log; do
      name=$(basename "$log" .log)
      cp "$log" "/tmp/gpu_session_runs/$name.log"
      cp "$runs/$name/metrics.jsonl" "/tmp/gpu_session_runs/${name}_metrics.jsonl" 2>/dev/null
      echo "== $name"; grep -v Warning "$log" | tail -n 4
    done
    tar -czf "$OUT/runs.tar.gz" -C /tmp/gpu_session_runs .
    pgrep -fa "train.py configs/convergence|rnnt_converge_src.*/lane_" || echo "all runs ended" ;;
  stress)
    # RUNS_PER_GPU (default 3) short fast-path runs on every GPU at once, for STRESS_S seconds
    # (default 170) each, from the checkpoint START (default: the one `fork` copied, else from
    # scratch), run k of each GPU with seed SEED0 + k (default 10 + k), with SETS and the
    # source tree SRC (default this checkout; another commit's, unpacked from `git archive`,
    # compares). EPOCHS_EACH=n: each run stops after epoch n (from an epoch-8 START, 9 is one
    # epoch and its evaluation) and, if it ended cleanly, its slot starts the next seed
    # (+ RUNS_PER_GPU) until the STRESS_S are up: more starts and first evaluations per call. Sharing a GPU stretches
    # each kernel and lets the host run further ahead of it, which is what exposed an illegal
    # memory access that one run per GPU had not shown (docs/CONVERGENCE.md). MEMCHECK=1 runs
    # the last run of GPU 0 under compute-sanitizer's memcheck with the caching allocator on,
    # so that it reports what faults: an access outside every allocation. COREDUMP=1: every
    # run writes a lightweight CUDA core dump when a kernel faults, and cuda-gdb (where
    # installed) names the kernel; at full speed, unlike memcheck. Arms per GPU g: ENV_GPU<g>
    # (say ENV_GPU1="CUDA_MODULE_LOADING=EAGER") and SETS_GPU<g> (say
    # SETS_GPU2="data.device=cpu"). Prints each run's exit status, last step, lines with
    # allocator retries and first CUDA error.
    src=${SRC:-.} per_gpu=${RUNS_PER_GPU:-3} stress_s=${STRESS_S:-170}
    start=${START:-$(find "$runs" -maxdepth 1 -name 'start_ckpt_*' 2>/dev/null | sort | head -n 1)}
    share=$(( $(nproc) / gpus / per_gpu ))
    mkdir -p "$OUT/stress"
    for g in $(seq 0 $(( gpus - 1 ))); do
      for k in $(seq 1 "$per_gpu"); do
        first=$(( (g * per_gpu + k - 1) * share ))
        extra=() wrap=() arm_env=ENV_GPU$g arm_sets=SETS_GPU$g
        for kv in ${SETS:-} ${!arm_sets:-}; do extra+=(--set "$kv"); done
        [ -n "$start" ] && extra+=(--init-from "$start")
        [ -n "${EPOCHS_EACH:-}" ] && extra+=(--set training.epochs="$EPOCHS_EACH")
        memcheck=""
        if [ -n "${MEMCHECK:-}" ] && [ "$g" = 0 ] && [ "$k" = "$per_gpu" ]; then
          memcheck=1 stress_s=$(( stress_s + 60 ))
          wrap=(compute-sanitizer --tool memcheck --print-limit 10
            --log-file "$OUT/stress/memcheck.txt")
          extra+=(--set training.log_frequency=1)
        fi
        ( deadline=$(( $(date +%s) + stress_s )) i=0
          while :; do
            name=gpu${g}_run${k}_$i left=$(( deadline - $(date +%s) ))
            # shellcheck disable=SC2206
            envs=(${!arm_env:-})
            [ -n "${COREDUMP:-}" ] && envs+=(CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1
              CUDA_ENABLE_LIGHTWEIGHT_COREDUMP=1 CUDA_COREDUMP_FILE="$OUT/stress/core_$name")
            env "${envs[@]}" PYTHONPATH="$(tree_path "$src")" CUDA_VISIBLE_DEVICES="$g" \
              taskset -c "$first-$(( first + share - 1 ))" timeout "$left" "${wrap[@]}" \
              python3 "$src/train.py" "$src/configs/convergence/sentences.yaml" --overwrite \
              --set training.seed=$(( ${SEED0:-10} + k + i * per_gpu )) \
              --set data.num_threads=$(( share > 1 ? share - 1 : 1 )) --set training.target_wer=0 \
              --set training.output_dir="/tmp/stress_${g}_$k" "${extra[@]}" \
              > "$OUT/stress/$name.log" 2>&1
            rc=$?
            echo "$rc" > "$OUT/stress/$name.rc"
            i=$(( i + 1 ))
            # another start after a clean end, when one can reach its first steps
            if [ -z "${EPOCHS_EACH:-}" ] || [ -n "$memcheck" ] || [ "$rc" != 0 ] \
                || [ $(( deadline - $(date +%s) )) -lt 30 ]; then
              break
            fi
          done ) &
      done
    done
    wait
    for log in "$OUT"/stress/gpu*.log; do
      echo "$(basename "$log" .log): exit $(cat "${log%.log}.rc"), last $(grep -oE 'step [0-9]+' "$log" \
        | tail -n 1), $(grep -c 'allocator retries' "$log") lines with allocator retries;" \
        "$(grep -m 1 -oE 'illegal memory access|CUDA error: [a-z ]+' "$log")"
    done | tee "$OUT/stress/summary.txt"
    # per GPU (an arm each where ENV_GPU<g> / SETS_GPU<g> differ): runs, and how they ended
    for g in $(seq 0 $(( gpus - 1 ))); do
      runs_g=$(grep -c "^gpu${g}_" "$OUT/stress/summary.txt")
      clean=$(grep "^gpu${g}_" "$OUT/stress/summary.txt" | grep -c "exit 0,")
      died=$(grep "^gpu${g}_" "$OUT/stress/summary.txt" | grep -cE "illegal memory access|CUDA error")
      cut=$(grep "^gpu${g}_" "$OUT/stress/summary.txt" | grep "exit 124," | grep -cvE "illegal|CUDA error")
      arm_sets=SETS_GPU$g arm_env=ENV_GPU$g
      echo "GPU $g (arm: ${!arm_sets:-} ${!arm_env:-}): $runs_g runs, $clean to their end," \
        "$died with a CUDA error, $cut cut by STRESS_S, $(( runs_g - clean - died - cut )) otherwise"
    done | tee -a "$OUT/stress/summary.txt"
    [ -f "$OUT/stress/memcheck.txt" ] && grep -m 20 -A 8 "Invalid" "$OUT/stress/memcheck.txt"
    for core in "$OUT"/stress/core_*; do
      [ -f "$core" ] || continue
      echo "== $core"
      if command -v cuda-gdb >/dev/null; then
        cuda-gdb -batch -ex "target cudacore $core" -ex "info cuda kernels" 2>&1 | tail -n 20
      fi
      rm -f "$core"  # too large to come back, and `bundle` would pack it
    done ;;
  rescore)
    # every run's final checkpoint under results/convergence whose name matches RUNS_GLOB
    # (default *fast*) scored by eval.py with the encoder's stacks on nn.LSTM and on the wave
    # kernels' forward (eval.encoder_lstm): does scoring with the recurrence a run trained
    # with change its WER? CKPTS=n scores the last n checkpoints kept, oldest first: a curve.
    for dir in "$runs"/${RUNS_GLOB:-*fast*}/checkpoints; do
      for ckpt in $(find "$dir" -mindepth 1 -maxdepth 1 -name 'ckpt_*' -printf '%T@ %p\n' \
          | sort -n | tail -n "${CKPTS:-1}" | cut -d' ' -f2-); do
        for lstm in cudnn wave; do
          echo "== $ckpt eval.encoder_lstm=$lstm"
          python3 eval.py configs/convergence/sentences.yaml "$ckpt" --mode cg_unroll_pipeline \
            --set eval.encoder_lstm="$lstm" --output "/tmp/hyp_rescore.jsonl" 2>&1 \
            | grep -E "^WER|throughput"
        done
      done
    done | tee "$OUT/rescore.log" ;;
  lossreading)
    start=${START:-$(find "$runs" -maxdepth 1 -name 'start_ckpt_*' 2>/dev/null | sort | head -n 1)}
    from=()
    [ -n "$start" ] && from=(--init-from "$start")
    python3 bench/loss_reading.py configs/convergence/sentences.yaml "${from[@]}" \
      --batches "${BATCHES:-20}" --json "$OUT/loss_reading.json" 2>&1 | grep -v Warning \
      | tee "$OUT/loss_reading.log" ;;
  evalparity)
    # the fast run's final checkpoint scored by eval.py in every decoder mode, then with the
    # wave encoder
    ckpt=$(find "$runs/${FAST_RUN:-fast_s1}/checkpoints" -mindepth 1 -maxdepth 1 -name 'ckpt_*' -printf '%T@ %p\n' \
      | sort -n | tail -n 1 | cut -d' ' -f2-)
    for mode in no_cg cg cg_unroll_pipeline; do
      python3 eval.py configs/convergence/sentences.yaml "$ckpt" --mode "$mode" \
        --output "/tmp/hyp_$mode.jsonl" 2>&1 | grep -v Warning | tee "$OUT/eval_$mode.log"
    done
    # the same checkpoint scored with the recurrence it trained with (the wave kernels'
    # forward): its WER against nn.LSTM's, and the dev set's time
    python3 eval.py configs/convergence/sentences.yaml "$ckpt" --mode cg_unroll_pipeline \
      --set eval.encoder_lstm=wave --output /tmp/hyp_wave.jsonl 2>&1 | grep -v Warning \
      | tee "$OUT/eval_wave.log"
    log="$runs/${FAST_RUN:-fast_s1}/mlperf.log"
    grep -h '"eval_accuracy"' "$log" | tail -n 1 | tee "$OUT/last_eval.txt"
    python3 -m mlperf_logging.compliance_checker --usage training --ruleset 3.1.0 \
      --log_output "$OUT/compliance_checker.log" "$log" 2>&1 | tail -n 3
    cp "$log" "$OUT/fast_mlperf.log" ;;
  bundle)
    tar -czf /tmp/results.tar.gz -C "$OUT" --exclude results.tar.gz . \
      && find "$OUT" -mindepth 1 -delete && mv /tmp/results.tar.gz "$OUT/" \
      && echo "$OUT/results.tar.gz: $(du -h "$OUT/results.tar.gz" | cut -f1)" ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
