#!/usr/bin/env bash
# Installs the Debian 12 packages ucpfs needs to build and test (as root), only those missing.
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config git ccache
      libfuse3-dev fuse3 liburing-dev liblmdb-dev libxxhash-dev zlib1g-dev
      nlohmann-json3-dev libcli11-dev libtomlplusplus-dev libre2-dev libgtest-dev googletest
      python3-torch python3-numpy python3-venv clang libclang-rt-14-dev rsync
      meson libnuma-dev dpkg-dev
      # the S3 client (core/io/s3_client.h) and the tests' S3 store (tests/s3/rgw.sh)
      libcurl4-openssl-dev libexpat1-dev
      ceph-mon ceph-osd radosgw ceph-common)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}" >&2
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# libfuse >= 3.17 from Debian's source package, for the kernel's fast paths (passthrough,
# io_uring); the build falls back to libfuse3-dev (3.14) when it cannot be had.
bash "$(dirname "$0")/build-libfuse.sh" >/dev/null
# An HTTP(S)-only libcurl from Debian's source package of the machine's curl, for the S3 client
# (3 libraries loaded instead of ~30); ucpfs loads the system's libcurl when it cannot be had.
bash "$(dirname "$0")/build-curl.sh" >/dev/null
