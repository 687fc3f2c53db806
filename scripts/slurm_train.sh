#!/usr/bin/env bash
# Multi-node training under SLURM, one task per node, torchrun spawning one process per GPU.
#   sbatch --nodes 8 scripts/slurm_train.sh configs/baseline_v3-1023sp.yaml --num_cg 4 \
#          --set optimizer.preset=gbs6144 --set training.batch_size=96
#SBATCH --job-name=rnnt
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
: "${1:?usage: sbatch [--nodes N] scripts/slurm_train.sh CONFIG [train.py options]}"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=${MASTER_PORT:-29500}
srun --kill-on-bad-exit=1 torchrun \
  --nnodes "$SLURM_JOB_NUM_NODES" --nproc_per_node "$GPUS_PER_NODE" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$SLURM_JOB_ID" \
  train.py "$@"
