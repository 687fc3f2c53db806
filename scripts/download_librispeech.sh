#!/usr/bin/env bash
# Download and extract LibriSpeech from OpenSLR: MD5-checked, resumable, idempotent.
#   bash scripts/download_librispeech.sh --dest datasets [--parts dev-clean ...] [--base-url URL]
#     [--md5-file md5sum.txt] [--retries N] [--keep-archives]
# See rnnt/prep/download.py for the files it leaves and how reruns behave.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m rnnt.prep.download "$@"
