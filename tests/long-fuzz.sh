#!/usr/bin/env bash
# Long fuzzing, outside CI: every parser's libFuzzer target (zip, pickle, torch file, DCP
# metadata, index record decoder, plain values, DeepSpeed scanner, write-capture journal, safetensors, S3 XML answers) built with ASan + UBSan, run
# for RUNS executions each (default 1,000,000), one after another. Prints each target's
# executions, time and coverage, and exits non-zero on the first crash (the crashing input is
# left in build-fuzz/).
# Usage: tests/long-fuzz.sh [RUNS]   (after tests/install-deps.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-1000000}
# Through tests/build.sh, so the build compiles through ccache like the others (a fresh clone's
# build-fuzz, as in CI, reuses the last one's objects).
CC=clang CXX=clang++ bash tests/build.sh build-fuzz --target fuzz_targets -DUCPFS_FUZZ=ON   # every ucpfs_fuzz target
# The targets' names: the fuzz-labelled tests (one per target, named as it).
mapfile -t targets < <(ctest --test-dir build-fuzz -N -L fuzz | sed -n 's/^ *Test *#[0-9]*: \(fuzz_[a-z0-9_]*\)$/\1/p')
(( ${#targets[@]} > 0 )) || { echo "long-fuzz: no fuzz targets found"; exit 1; }
for t in "${targets[@]}"; do
  corpus=build-fuzz/fuzz-corpus/$t
  mkdir -p "$corpus"
  start=$(date +%s)
  log=build-fuzz/long-fuzz-$t.log
  (cd build-fuzz && "./tests/$t" -runs="$runs" -rss_limit_mb=1024 -max_len=65536 -timeout=20 \
      "fuzz-corpus/$t" ../tests/fuzz/seeds) >"$log" 2>&1 || { tail -40 "$log"; echo "long-fuzz: $t FAILED"; exit 1; }
  done_line=$(grep -E "^#[0-9]+\s+DONE" "$log" | tail -1)
  echo "long-fuzz: $t: $done_line ($(( $(date +%s) - start )) s)"
done
echo "long-fuzz: ${#targets[@]} targets, $runs runs each, no crash"
