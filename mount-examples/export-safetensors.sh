#!/usr/bin/env bash
# Export a sharded training checkpoint as consolidated Hugging Face safetensors:
#   1. 2 processes save a sharded DCP checkpoint with torch 1.13 (a small Llama: bf16 and fp32
#      weights, fp32 masters and Adam moments);
#   2. mount it: safetensors/ holds the weights consolidated, split as Hugging Face splits them
#      (--safetensors-shard-size, here 8K to get several files; the default is 5GB), with
#      model.safetensors.index.json; copy the folder out with cp and unmount;
#   3. `ucpfs convert --safetensors` writes the same folder without FUSE: the two are compared
#      byte for byte;
#   4. safetensors.torch.load_file (torch 2.13) loads every shard, and every weight is checked
#      against the full tensor the ranks saved: same names, dtype, shape and bytes.
# Exits non-zero if a check fails.
. "$(dirname "$0")/common.sh" safetensors
need_torch2

echo "== 1. save a sharded DCP checkpoint with torch 1.13 (2 ranks)"
sample_dcp113 "$work/ckpt" "$work/expected.pt"  # gen_dcp113_llama.py --ranks 2 --seed 0, shared
ls "$work/ckpt"

echo
echo "== 2. mount, copy safetensors/ out, unmount"
mkdir "$work/mnt"
"$UCPFS" mount "$work/ckpt" "$work/mnt" --safetensors-shard-size 8K
ls -l "$work/mnt/safetensors"
cp -r "$work/mnt/safetensors" "$work/export"
"$UCPFS" umount "$work/mnt"

echo
echo "== 3. ucpfs convert --safetensors writes the same files"
"$UCPFS" convert "$work/ckpt" "$work/converted" --safetensors --safetensors-shard-size 8K >/dev/null
diff -r "$work/export" "$work/converted/safetensors"
echo "identical, byte for byte: $(ls "$work/export" | tr '\n' ' ')"

echo
echo "== 4. load with safetensors.torch.load_file and compare with the saved weights"
"$PY2" - "$work/export" "$work/expected.pt" <<'PY'
import json, os, sys
import torch
from safetensors.torch import load_file

export, expected = sys.argv[1], torch.load(sys.argv[2])
index = json.load(open(os.path.join(export, "model.safetensors.index.json")))
weights = {}
for shard in sorted(set(index["weight_map"].values())):
    tensors = load_file(os.path.join(export, shard))
    assert all(index["weight_map"][k] == shard for k in tensors), f"{shard}: index disagrees"
    weights.update(tensors)
# The weights the 2 ranks saved, whole (the optimizer's masters and moments are not weights).
want = {k: v for k, v in expected.items() if not k.startswith("optimizer.")}
assert sorted(weights) == sorted(want), f"names {sorted(weights)} != {sorted(want)}"
for k, w in want.items():
    got = weights[k]
    assert got.dtype == w.dtype and got.shape == w.shape, (k, got.dtype, w.dtype, got.shape, w.shape)
    assert torch.equal(got.view(-1).view(torch.uint8), w.contiguous().view(-1).view(torch.uint8)), f"{k} differs"
print(f"{len(weights)} weights in {len(set(index['weight_map'].values()))} files equal the saved ones "
      f"(dtypes {sorted({str(t.dtype) for t in weights.values()})})")
PY
echo "export-safetensors: done in ${SECONDS} s"
