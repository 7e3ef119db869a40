#!/usr/bin/env bash
# Share one prebuilt index between many mounts (the multi-node recipe):
#   1. 2 processes save a sharded DCP checkpoint (torch 1.13);
#   2. one job builds its index once into a shared directory: ucpfs index SRC --index-dir SHARED
#      (on a cluster: a parallel filesystem every node sees);
#   3. two mounts of the same SRC, as two nodes would mount it, with --index-dir SHARED
#      --read-only-index: they only read the index, never write it, and serve identical bytes;
#   4. a missing index and a stale one (the source changed after indexing) are refused, not
#      rebuilt: each node fails with the reason, and the shared index is left as it was;
#   5. re-running `ucpfs index` (the one writer) brings the index up to date, and the nodes mount.
# Exits non-zero if a check fails.
. "$(dirname "$0")/common.sh" shared-index
src=$work/ckpt shared=$work/shared-index

echo "== 1. save a sharded DCP checkpoint with torch 1.13 (2 ranks)"
sample_dcp113 "$src" "$work/expected.pt"  # gen_dcp113_llama.py --ranks 2 --seed 0, shared

echo
echo "== 2. ucpfs index $src --index-dir $shared   (once, by one job)"
"$UCPFS" index "$src" --index-dir "$shared" 2>&1 | tr '\r' '\n' | sed '/^$/d'
ls -l "$shared"
index_sum() { sha256sum "$shared/data.mdb" | cut -d' ' -f1; }
built=$(index_sum)

echo
echo "== 3. two read-only-index mounts of $src, as node A and node B"
for node in a b; do
  mkdir "$work/node-$node"
  "$UCPFS" mount "$src" "$work/node-$node" --index-dir "$shared" --read-only-index --read-only \
    --layout=tp2_pp1_dp1
done
diff -r "$work/node-a/atomic" "$work/node-b/atomic"
diff -r "$work/node-a/target" "$work/node-b/target"
n_files=$(find "$work/node-a/atomic" "$work/node-a/target" -type f | wc -l)
echo "node A and node B serve identical bytes: $n_files files compared"
/usr/bin/python3 - "$work/node-b" "$work/expected.pt" <<'PY'
import sys, torch
mnt, expected = sys.argv[1], torch.load(sys.argv[2])
got = torch.load(f"{mnt}/atomic/layers.0.attention.wq.weight/fp32.pt")["param"]
assert torch.equal(got, expected["optimizer.state.layers.0.attention.wq.weight.fp32_param"])
print("and what they serve is what was saved (atomic/layers.0.attention.wq.weight/fp32.pt)")
PY
for node in a b; do "$UCPFS" umount "$work/node-$node"; done
[ "$(index_sum)" = "$built" ] || { echo "the shared index was written" >&2; exit 1; }
echo "the shared index was not written"

# A mount that must fail: prints ucpfs's error; exits non-zero if it mounted.
refused() {
  if "$UCPFS" mount "$@" 2>"$work/err"; then
    echo "mounted, but should have been refused" >&2
    return 1
  fi
  echo "refused: $(cat "$work/err")"
}

echo
echo "== 4a. a node whose --index-dir holds no index"
mkdir "$work/node-c" "$work/empty-index"
refused "$src" "$work/node-c" --index-dir "$work/empty-index" --read-only-index
[ -z "$(ls -A "$work/empty-index")" ] || { echo "an index was built there" >&2; exit 1; }
echo "nothing was built there"

echo
echo "== 4b. the source changes after indexing (a file rewritten in place): the index is stale"
/usr/bin/python3 - "$src/__0_0.distcp" <<'PY'
import os, sys
with open(sys.argv[1], "r+b") as f:   # same size, new content and mtime
    f.write(f.read(1))
PY
refused "$src" "$work/node-c" --index-dir "$shared" --read-only-index
[ "$(index_sum)" = "$built" ] || { echo "the shared index was written" >&2; exit 1; }
echo "the shared index was left as it was"

echo
echo "== 5. ucpfs index again (the one writer), then a node mounts"
"$UCPFS" index "$src" --index-dir "$shared" 2>&1 | tr '\r' '\n' | sed '/^$/d'
"$UCPFS" mount "$src" "$work/node-c" --index-dir "$shared" --read-only-index --read-only
ls "$work/node-c/atomic" | sed -n 1,3p   # (sed reads all: no SIGPIPE)
"$UCPFS" umount "$work/node-c"
echo "shared-index: done in ${SECONDS} s"
