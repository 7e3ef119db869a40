#!/usr/bin/env bash
# Main job: build ucpfs, save a sample sharded checkpoint with real torch (2 processes, gloo,
# PyTorch DCP), mount it, look at atomic/ with ls and du (no tensor data is read), torch.load
# one consolidated atomic file, and unmount.
. "$(dirname "$0")/common.sh" sample
mnt=$work/mnt

echo "== saving a sharded DCP checkpoint with torch $(/usr/bin/python3 -c 'import torch; print(torch.__version__)') (2 ranks)"
sample_dcp113 "$work/ckpt" "$work/expected.pt"  # gen_dcp113_llama.py --ranks 2 --seed 0, shared
ls -l "$work/ckpt"

mkdir -p "$mnt"
echo
echo "== ucpfs mount $work/ckpt $mnt"
time "$UCPFS" mount "$work/ckpt" "$mnt"

echo
echo "== ls $mnt/atomic"
ls "$mnt/atomic"
echo
echo "== ls -l $mnt/atomic/layers.0.attention.wq.weight"
ls -l "$mnt/atomic/layers.0.attention.wq.weight"
echo
echo "== du -sh $mnt/atomic   (virtual sizes; no tensor data is read)"
du -sh "$mnt/atomic"

echo
echo "== torch.load of one atomic file"
/usr/bin/python3 - "$mnt" "$work/expected.pt" <<'PY'
import sys, torch
mnt, expected = sys.argv[1], torch.load(sys.argv[2])
sd = torch.load(f"{mnt}/atomic/layers.0.attention.wq.weight/fp32.pt", weights_only=True)
print({k: (v if k != "param" else f"tensor{tuple(v.shape)} {v.dtype}") for k, v in sd.items()})
# fp32.pt is the fp32 master the trainer saved beside the bf16 weight.
full = expected["optimizer.state.layers.0.attention.wq.weight.fp32_param"]
print("equal to the fp32 master torch saved (sharded over 2 ranks):", torch.equal(sd["param"], full))
assert torch.equal(sd["param"], full)
PY

echo
echo "== ucpfs umount $mnt"
"$UCPFS" umount "$mnt"
