#!/usr/bin/env bash
# The whole test suite, from a fresh Debian 12 machine (root): installs what is missing
# (Debian packages, then the pinned torch 2.13 virtual environment .venv/), builds, runs every
# CTest test (unit, property, e2e under torch 1.13 and 2.13, slow), then builds the libFuzzer
# targets with clang and runs each for a bounded time.
set -euo pipefail
cd "$(dirname "$0")/.."
tests/install-deps.sh
tests/install-python.sh >/dev/null
tests/build.sh build
ctest --test-dir build --output-on-failure -j2 -LE fuzz
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DUCPFS_FUZZ=ON -DUCPFS_WERROR=ON >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target fuzz_zip_reader fuzz_pickle fuzz_torch_file fuzz_dcp_metadata \
  fuzz_index_record fuzz_plain_value fuzz_deepspeed_scan fuzz_capture_journal fuzz_safetensors
ctest --test-dir build-fuzz --output-on-failure -j"$(nproc)" -L fuzz   # each target is one process: run them side by side
