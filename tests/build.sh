#!/usr/bin/env bash
# Configures and builds ucpfs into DIR (default build/) with warnings as errors.
# Extra arguments go to cmake's configure step, e.g. -DUCPFS_SANITIZE=address,undefined.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}
shift || true
# ccache, when installed (tests/install-deps.sh installs it), keeps compiled objects across
# clones: CI's fresh clone and the sanitizer builds recompile only what changed. Paths are
# hashed relative to the clone, so clones at different places share the cache.
launcher=()
if command -v ccache >/dev/null 2>&1; then
  export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B "$dir" -G Ninja -DUCPFS_WERROR=ON "${launcher[@]}" "$@" >/dev/null
cmake --build "$dir" -j"$(nproc)"
