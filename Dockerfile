# Reproduction image for GPU nodes: NGC PyTorch (CUDA, cuDNN, NCCL, Triton, apex) + DALI + this
# code, run as an unprivileged user.
#   docker/build.sh                       # or: docker build -t rnnt-mlperf .
#   DATASETS=/raid/datasets docker/launch.sh   # one node, one MLPerf timing run
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
# the audio tools of the synthetic corpora and the quickstart, at the base image's Ubuntu 24.04
# release series
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      espeak-ng=1.51* sox=14.4.2* flac=1.4.3* libsndfile1=1.2.2* \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/rnnt
# The image's own packages (PyTorch, Triton, apex) stay as they are: NGC sets PIP_CONSTRAINT,
# which every pip install here honours. DALI at the version CI tested.
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt nvidia-dali-cuda130==2.4.0
COPY . .
RUN pip install --no-cache-dir --no-deps --no-build-isolation -e . \
 && python3 docker/check_image.py

# The CUDA C++ kernels (rnnt/kernels/csrc: the fused loss's Hopper logits GEMM and its lattice
# walk for A100 and H100 / H200, the encoder's Hopper wave LSTM), built now with the image's
# nvcc so no rank compiles them at start-up (building needs no GPU).
ENV RNNT_KERNEL_CACHE=/opt/rnnt-kernels
RUN python3 -c "from rnnt.kernels import lattice_walk, logits_gemm, lstm_wave; \
    print(logits_gemm.library(), lstm_wave.library()); \
    print([lattice_walk.library(cc) for cc in ((8, 0), (9, 0))])" \
 && chmod -R a+rX /opt/rnnt-kernels /workspace/rnnt

# docker/run.sh runs the container as the calling user (--user), so files written to mounted
# folders belong to them; this user is the default otherwise
RUN useradd --create-home --uid 1000 rnnt
USER 1000
