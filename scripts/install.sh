#!/usr/bin/env bash
# Install what the project needs on a fresh Debian/Ubuntu machine (CPU): system audio tools,
# the CPU PyTorch wheel, the Python requirements and the test tools.
# On GPU machines install the CUDA PyTorch build first (or use the Docker image); this script
# keeps an already installed torch.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for tool in espeak-ng sox flac; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=""; [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq espeak-ng sox flac libsndfile1 >/dev/null
fi

PIP="python3 -m pip install -q --disable-pip-version-check"
python3 -c "import torch" 2>/dev/null || $PIP torch==2.13.0
$PIP -r requirements-dev.txt
