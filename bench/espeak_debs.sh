#!/usr/bin/env bash
# Fetch Debian 12's espeak-ng and sox and the shared libraries they need that a bare CUDA
# image lacks, for a GPU machine without them or network (bench/gpu_session.sh unpacks them
# there with dpkg -x and points PATH, LD_LIBRARY_PATH and ESPEAK_DATA_PATH at them). espeak-ng
# speaks the corpora; sox makes the "recorded-like" audio of tests/unit/test_dali.py. About
# 12 MB.
#
#   bash bench/espeak_debs.sh [DEST]        # default .carry/debs; run on a Debian 12 machine
set -euo pipefail
dest=${1:-.carry/debs}
mkdir -p "$dest"
cd "$dest"
# espeak-ng itself, its data, then what `ldd espeak-ng` reported missing on the GPU image
apt-get download espeak-ng espeak-ng-data libespeak-ng1 libpcaudio0 libsonic0 \
  libasound2 libasound2-data libpulse0 libasyncns0 libdbus-1-3 libsndfile1 libsystemd0 \
  libx11-6 libx11-xcb1 libxcb1 libxau6 libxdmcp6 libflac12 libogg0 libvorbis0a \
  libvorbisenc2 libopus0 libmpg123-0 libmp3lame0 libbsd0 libmd0 libcap2 libgcrypt20 \
  libgpg-error0 liblz4-1 liblzma5 libzstd1 \
  sox libsox3 libsox-fmt-base libgsm1 libltdl7 libmagic1 libmagic-mgc libpng16-16 libgomp1 \
  libopencore-amrnb0 libopencore-amrwb0 libvorbisfile3 libwavpack1
find . -maxdepth 1 -name "*.deb" | wc -l
