#!/usr/bin/env bash
# Install what the project needs on a Debian/Ubuntu machine (CPU): the audio tools, the CPU
# PyTorch wheel (kept if a PyTorch is already there, as in the NGC image) and this package with
# its test tools, at the versions CI tested (constraints.txt).
#
# It installs into the active virtual environment (venv or conda); with none active, into .venv,
# made here with access to the system's packages (so an image's PyTorch is reused): a
# distribution's own Python refuses pip installs (PEP 668). Then run `. .venv/bin/activate`
# once per shell before the other commands.
set -euo pipefail
cd "$(dirname "$0")/.."

sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
apt_install() {
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "$@" >/dev/null
}

missing=()
for tool in espeak-ng sox flac; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt_install espeak-ng sox flac libsndfile1
fi

if [ -n "${VIRTUAL_ENV:-}" ] || [ -n "${CONDA_PREFIX:-}" ]; then
  python=python3
else
  if [ ! -x .venv/bin/python ]; then
    python3 -c "import ensurepip" 2>/dev/null || apt_install python3-venv
    python3 -m venv --system-site-packages .venv
  fi
  python=.venv/bin/python
fi

pip_install() {
  "$python" -m pip install -q --disable-pip-version-check "$@"
}
"$python" -c "import torch" 2>/dev/null || pip_install torch==2.13.0
pip_install -c constraints.txt -e ".[dev]"

if [ "$python" != python3 ]; then
  echo "installed into .venv: run '. .venv/bin/activate' before the other commands"
fi
