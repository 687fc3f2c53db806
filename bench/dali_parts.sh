#!/usr/bin/env bash
# DALI for the GPU machine (Python 3.12, CUDA 13, no network), in parts small enough to travel
# one per device call beside the other carried files (64 MiB a call in all). Run from the
# repository root on a machine with internet access; writes .carry/dali.
#
#   bash bench/dali_parts.sh [VERSION]
#
# The wheel (about 200 MB) holds the extension modules of nine Python builds; the GPU machine
# needs the cp312 ones. The rest is unpacked, repacked with xz (about 133 MB for 2.4.0) and
# split into 44 MiB parts: three calls instead of five for the wheel itself. bench/gpu_session.sh
# collects the parts across calls on a warm machine and unpacks them once all are there.
set -euo pipefail
version=${1:-2.4.0}
dest=.carry/dali
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 -d "$work" \
  "nvidia-dali-cuda130==$version"
mkdir "$work/tree"
(cd "$work/tree" && python3 -m zipfile -e "$work"/nvidia_dali_cuda130-*.whl .)
find "$work/tree" -name '*.cpython-3*-x86_64-linux-gnu.so' ! -name '*.cpython-312-*' -delete
rm -rf "$dest"
mkdir -p "$dest"
archive=dali-$version-cp312.tar.xz
tar -C "$work/tree" -cf - . | xz -9 -T0 > "$work/$archive"
(cd "$work" && sha256sum "$archive") > "$dest/SHA256SUMS"
split -b 44M -d "$work/$archive" "$dest/$archive.part"
ls -l "$dest"
