#!/usr/bin/env bash
# Unit tests in a second build with AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
tests/install-deps.sh
tests/build.sh build-asan -DUCPFS_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=Debug
ctest --test-dir build-asan --output-on-failure -j2 -L unit
