# Reproduction image for GPU nodes: NGC PyTorch (CUDA, cuDNN, NCCL, apex) + DALI + this code.
#   docker build -t rnnt-mlperf .
#   docker run --gpus all --ipc=host -v /data:/datasets -v $PWD/results:/workspace/rnnt/results \
#       rnnt-mlperf torchrun --nproc_per_node 8 train.py configs/baseline_v3-1023sp.yaml --num_cg 4
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends espeak-ng sox flac libsndfile1 \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/rnnt
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt nvidia-dali-cuda130
COPY . .
# The CUDA C++ kernels (rnnt/kernels/csrc: the fused loss's Hopper logits GEMM and its lattice
# walk for A100 and H100 / H200, the encoder's Hopper wave LSTM), built now with the image's
# nvcc so no rank compiles them at start-up (building needs no GPU).
ENV RNNT_KERNEL_CACHE=/opt/rnnt-kernels
RUN python3 -c "from rnnt.kernels import lattice_walk, logits_gemm, lstm_wave; \
    print(logits_gemm.library(), lstm_wave.library()); \
    print([lattice_walk.library(cc) for cc in ((8, 0), (9, 0))])"
