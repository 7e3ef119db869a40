#!/usr/bin/env bash
# Saving into the mount: mount an empty directory, save a sharded DCP checkpoint into it with
# real torch (2 processes, gloo), and watch it become views without a remount; then torch.save
# a file, see `ucpfs status` count it, and `ucpfs sync` make it durable. Checks each step and
# exits non-zero if one does not hold.
set -euo pipefail
cd "$(dirname "$0")/.."
tests/install-deps.sh
tests/build.sh build
UCPFS=$PWD/build/cli/ucpfs
work=$(mktemp -d /tmp/ucpfs-save.XXXXXX)
mnt=$work/mnt
cleanup() {
  if mountpoint -q "$mnt" 2>/dev/null; then "$UCPFS" umount "$mnt" || umount -l "$mnt"; fi
  rm -rf "$work"
}
trap cleanup EXIT

mkdir -p "$work/run" "$mnt"
echo "== ucpfs mount $work/run $mnt   (an empty directory)"
"$UCPFS" mount "$work/run" "$mnt" --cache-size 512M
ls -A "$mnt"

echo
echo "== saving a DCP checkpoint into $mnt/step-1 with torch $(/usr/bin/python3 -c 'import torch; print(torch.__version__)') (2 ranks)"
/usr/bin/python3 tests/e2e/fixtures/gen_dcp113_llama.py "$mnt/step-1" --ranks 2 --seed 0 \
  --expected "$work/expected.pt" >/dev/null
for _ in $(seq 100); do [ -d "$mnt/atomic" ] && break; sleep 0.1; done
echo "views appeared without a remount:"
ls "$mnt"
ls "$mnt/atomic" | head -3

echo
echo "== torch.save into the mount, then ucpfs status and ucpfs sync"
/usr/bin/python3 - "$mnt" "$work/expected.pt" <<'PY'
import sys, torch
mnt, expected = sys.argv[1], torch.load(sys.argv[2])
torch.save({"note": torch.arange(10)}, f"{mnt}/extra.pt")
got = torch.load(f"{mnt}/atomic/layers.0.attention.wq.weight/fp32.pt")["param"]
# fp32.pt is the fp32 master the trainer saved beside the bf16 weight.
want = expected["optimizer.state.layers.0.attention.wq.weight.fp32_param"]
assert torch.equal(got, want), "the view differs from what was saved"
print("atomic/layers.0.attention.wq.weight/fp32.pt:", tuple(got.shape), "equals the fp32 master the ranks saved")
PY
"$UCPFS" status "$mnt"
"$UCPFS" sync "$mnt"
cmp "$mnt/extra.pt" "$work/run/extra.pt"
echo "extra.pt is durable in the source, byte for byte"
echo
echo "== ucpfs umount $mnt"
"$UCPFS" umount "$mnt"
