#!/usr/bin/env bash
# The test suite, from a fresh Debian 12 machine (root): installs what is missing (Debian
# packages, then the pinned torch 2.13 virtual environment), builds, and runs a tier of CTest:
#
#   tests/run.sh           the quick tier (the README's test command, meant to take at most 10
#                          minutes on 2 cores; docs/testing.md has the measured times): every
#                          unit, property and index test, and the end-to-end tests labelled
#                          `quick` (a representative set: real mounts of DCP, DeepSpeed,
#                          Megatron and weights-only sources, write capture, the CLI, under
#                          torch 1.13 and 2.13);
#   tests/run.sh --rest    every other CTest test (the rest of the end-to-end tests, slow), then
#                          the libFuzzer targets built with clang, each for a bounded time;
#   tests/run.sh --full    both: the whole suite, as CI runs it (CI then adds the sanitizers,
#                          long fuzzing and the examples).
#   --no-fuzz (after --rest or --full) leaves out the bounded-time fuzz runs: for CI, whose
#                          next step (tests/long-fuzz.sh) runs every target on the same build.
#
# CI (.ci/run) runs the quick tier, then --rest --no-fuzz, then the sanitizers, long fuzzing and
# the examples.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=${1:---quick}
fuzz=yes
case "$tier" in
  --quick|--rest|--full) ;;
  *) echo "usage: tests/run.sh [--quick|--rest [--no-fuzz]|--full [--no-fuzz]]" >&2; exit 2 ;;
esac
case "${2:-}" in
  "") ;;
  --no-fuzz) [ "$tier" != --quick ] || { echo "tests/run.sh: --no-fuzz goes with --rest or --full" >&2; exit 2; }
             fuzz=no ;;
  *) echo "usage: tests/run.sh [--quick|--rest [--no-fuzz]|--full [--no-fuzz]]" >&2; exit 2 ;;
esac
# Runs a step and then says how long it took and how busy the machine was, so a time reported
# from this script can be compared with docs/testing.md's (a shared machine stretches it).
timed() {
  local start=$SECONDS rc=0
  "$@" || rc=$?
  echo "tests/run.sh: $1 ${*: -1} took $((SECONDS - start)) s ($(nproc) cores, load average" \
    "$(cut -d' ' -f1-3 /proc/loadavg) at the end)"
  return $rc
}
tests/install-deps.sh
tests/install-python.sh >/dev/null
timed tests/build.sh build
if [ "$tier" != --rest ]; then
  timed ctest --test-dir build --output-on-failure -j2 -L 'unit|property|index|quick'
fi
if [ "$tier" != --quick ]; then
  # Everything the quick tier did not run (one regex: CTest takes a single -LE).
  timed ctest --test-dir build --output-on-failure -j2 -LE 'fuzz|unit|property|index|quick'
  if [ "$fuzz" = yes ]; then
    CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DUCPFS_FUZZ=ON -DUCPFS_WERROR=ON >/dev/null
    cmake --build build-fuzz -j"$(nproc)" --target fuzz_targets   # every ucpfs_fuzz target
    ctest --test-dir build-fuzz --output-on-failure -j"$(nproc)" -L fuzz   # each target is one process: run them side by side
  fi
fi
