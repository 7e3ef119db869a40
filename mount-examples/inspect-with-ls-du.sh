#!/usr/bin/env bash
# Inspect a checkpoint through the mount with ls, du and stat: every size is exact before any
# tensor byte is read (.ucpfs/stats.json shows the source bytes read: none).
. "$(dirname "$0")/common.sh" lsdu
mnt=$work/mnt

/usr/bin/python3 tests/e2e/fixtures/gen_dcp113_llama.py "$work/ckpt" --ranks 4 --seed 1 \
  --expected "$work/expected.pt" >/dev/null
mkdir -p "$mnt"
"$UCPFS" mount "$work/ckpt" "$mnt" --layout=tp2_pp2_dp1
read_bytes() {
  /usr/bin/python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['source_bytes_read'])" "$mnt/.ucpfs/stats.json"
}
# The mount itself decodes the small non-tensor items (train state, scheduler, ...) for
# extra_state.pt and status.json; what follows must read nothing more.
at_mount=$(read_bytes)
echo "== du -sh of each view"
du -sh "$mnt/atomic" "$mnt/target/tp2_pp2_dp1"
echo
echo "== du -s --apparent-size --block-size=1 per rank"
du -s --apparent-size --block-size=1 "$mnt"/target/tp2_pp2_dp1/rank_*
echo
echo "== stat of one rank file"
stat -c '%n: %s bytes, inode %i, %h link(s)' "$mnt"/target/tp2_pp2_dp1/rank_0/*
echo
echo "== find the exp_avg views"
find "$mnt/atomic" -name exp_avg.pt | sed -n 1,5p   # sed reads all input: no SIGPIPE under pipefail
echo
echo "== .ucpfs/stats.json (nothing above read tensor data)"
cat "$mnt/.ucpfs/stats.json" | tr -s ' \n' ' '; echo
bytes=$(( $(read_bytes) - at_mount ))
echo "ls/du/stat/find read $bytes source bytes (the mount read $at_mount bytes of non-tensor items)"
[ "$bytes" = 0 ] || exit 1
"$UCPFS" umount "$mnt"
