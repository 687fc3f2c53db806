#!/usr/bin/env bash
# Build the reproduction image. BASE_IMAGE picks another NGC PyTorch release.
set -euo pipefail
cd "$(dirname "$0")/.."
docker build ${BASE_IMAGE:+--build-arg BASE_IMAGE="$BASE_IMAGE"} -t "${IMAGE:-rnnt-mlperf}" .
