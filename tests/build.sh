#!/usr/bin/env bash
# Configures and builds ucpfs into DIR (default build/) with warnings as errors.
# Extra arguments go to cmake's configure step, e.g. -DUCPFS_SANITIZE=address,undefined.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}
shift || true
cmake -S . -B "$dir" -G Ninja -DUCPFS_WERROR=ON "$@" >/dev/null
cmake --build "$dir" -j"$(nproc)"
