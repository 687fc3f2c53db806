#!/usr/bin/env bash
# Download, on a machine with internet access, the wheels that bench/gpu_session.sh installs on
# the GPU machine (Python 3.12, x86-64, no network there): the packages the tests and benchmarks
# import that its PyTorch image lacks. Run from the repository root; writes .carry/wheels.
#
#   bash bench/gpu_wheels.sh [DEST]
set -euo pipefail
dest=${1:-.carry/wheels}
mkdir -p "$dest"
# the last line: what DALI (carried apart, bench/dali_parts.sh) imports beyond numpy and
# packaging, which the image has; its image and compression codecs are never imported here
packages=(soundfile cffi pycparser soxr librosa audioread pooch platformdirs decorator
          mlperf-logging jiwer rapidfuzz
          optree gast astunparse six nvtx makefun "libcst~=1.8")
# at the versions CI tested (constraints.txt), so that the GPU machine runs what CI ran
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -c constraints.txt \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$dest" "${packages[@]}"
ls "$dest"
