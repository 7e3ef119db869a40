# Sourced by every example (`. "$(dirname "$0")/common.sh" NAME`): the set-up they all share.
#   - stops at the first failing command (set -euo pipefail), so a failed check fails the example;
#   - goes to the repository root, installs the missing Debian packages and builds the ucpfs
#     command only, not the tests (tests/build.sh --target ucpfs: nothing is rebuilt when it
#     is current);
#   - UCPFS: the ucpfs binary; need_torch2 sets PY2, the python of .venv/ (torch 2.13,
#     DeepSpeed, megatron-core, safetensors; tests/install-python.sh creates it once, then only
#     checks it);
#   - work: a fresh directory /tmp/ucpfs-NAME.XXXXXX for checkpoints, mounts and logs; TMPDIR
#     points inside it, so what the producers put in temporary files goes with it;
#   - on every exit (success, a failed check, Ctrl-C, kill): unmounts every mount under $work,
#     then removes $work. Nothing stays mounted and nothing stays in /tmp.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tests/install-deps.sh
tests/build.sh build --target ucpfs
UCPFS=$PWD/build/cli/ucpfs
work=$(mktemp -d "/tmp/ucpfs-${1:-example}.XXXXXX")
mkdir -p "$work/tmp"
export TMPDIR=$work/tmp

mounts_under_work() {
  # Innermost first, so nested mounts come off before the ones that hold them.
  awk -v w="$work/" 'index($2, w) == 1 { print $2 }' /proc/self/mounts | sort -r
}
cleanup() {
  local m
  for m in $(mounts_under_work); do
    "$UCPFS" umount "$m" 2>/dev/null || umount -l "$m" || true
  done
  if [ -n "$(mounts_under_work)" ]; then   # never rm -rf through a mount
    echo "left mounted under $work: $(mounts_under_work)" >&2
    return
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP   # a signal exits through the EXIT trap too

# sample_dcp113 DIR EXPECTED: the examples' sample checkpoint (2 ranks of a small Llama saved by
# torch 1.13's DCP, tests/e2e/fixtures/gen_dcp113_llama.py --ranks 2 --seed 0) copied to DIR, its
# expected tensors to EXPECTED. Generated once into build/fixtures/dcp113_llama (CI's test run
# makes it there first; tests/e2e/shared_fixtures.py reuses a complete copy) and shared.
sample_dcp113() {
  local out
  out=$(/usr/bin/python3 tests/e2e/shared_fixtures.py ensure dcp113_llama build/fixtures/dcp113_llama)
  cp -r "$out" "$1"
  cp "${out}_expected.pt" "$2"
}

# Examples that run torch 2.13 producers call this first; it sets PY2 to .venv's python.
need_torch2() { PY2=$(tests/install-python.sh | tail -n 1); }

SECONDS=0   # the examples end with "done in ${SECONDS} s"
