#!/usr/bin/env bash
# ThreadSanitizer run, outside CI: builds ucpfs with -fsanitize=thread into build-tsan/ and runs
# the end-to-end tests with concurrent readers against it (8 readers of every atomic file twice,
# concurrent first lookups of target layouts, the FUSE tree's parallel readers) under torch 1.13,
# the Filesystem unit test (concurrent lookups and forgets evicting subtrees), the pinned cache's
# (threads blocked in Acquire, a seeded multi-thread acquire/release stress test) and the write
# capture's (writers, flusher threads and the committer at once).
# The daemons' reports go to build-tsan/tsan-reports/; any report fails the run.
# Usage: tests/tsan.sh   (after tests/install-deps.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
tests/build.sh build-tsan -DUCPFS_SANITIZE=thread -DCMAKE_BUILD_TYPE=RelWithDebInfo
reports=$PWD/build-tsan/tsan-reports
rm -rf "$reports"
mkdir -p "$reports"
export TSAN_OPTIONS="log_path=$reports/tsan second_deadlock_stack=1"
# A report makes the test exit non-zero too; the reports are printed either way, so a failure
# in CI always shows the race, not only the test's own output.
rc=0
ctest --test-dir build-tsan --output-on-failure -R "e2e_mount_dcp_torch113|e2e_target_views_torch113|e2e_fuse_tree|filesystem_test|pinned_cache_test|write_capture_test" || rc=$?
if compgen -G "$reports/tsan*" >/dev/null; then
  echo "tsan: reports in $reports:"
  head -120 "$reports"/tsan*
  exit 1
fi
if [ "$rc" -ne 0 ]; then
  echo "tsan: ctest failed (exit $rc) with no report written"
  exit "$rc"
fi
echo "tsan: no data race reported"
