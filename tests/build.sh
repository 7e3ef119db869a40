#!/usr/bin/env bash
# Configures and builds ucpfs into DIR (default build/) with warnings as errors.
#   tests/build.sh [DIR] [--target T]... [cmake configure arguments]
# Each `--target T` builds only T (and what it needs): `tests/build.sh build --target ucpfs` is
# the command alone, what the examples and a first mount need; without one every target is built
# (the test binaries too, as tests/run.sh needs). The other arguments go to cmake's configure
# step, e.g. -DUCPFS_SANITIZE=address,undefined.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}
shift || true
targets=()
configure=()
while [ $# -gt 0 ]; do
  case "$1" in
    --target) [ $# -ge 2 ] || { echo "tests/build.sh: --target needs a target name" >&2; exit 2; }
              targets+=("$2"); shift 2 ;;
    --target=*) targets+=("${1#--target=}"); shift ;;
    *) configure+=("$1"); shift ;;
  esac
done
# ccache, when installed (tests/install-deps.sh installs it), keeps compiled objects across
# clones: CI's fresh clone and the sanitizer builds recompile only what changed. Paths are
# hashed relative to the clone, so clones at different places share the cache.
launcher=()
if command -v ccache >/dev/null 2>&1; then
  export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
  launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B "$dir" -G Ninja -DUCPFS_WERROR=ON "${launcher[@]}" "${configure[@]}" >/dev/null
if [ ${#targets[@]} -gt 0 ]; then
  cmake --build "$dir" -j"$(nproc)" --target "${targets[@]}"
else
  cmake --build "$dir" -j"$(nproc)"
fi
