#!/usr/bin/env bash
# Resume on a different parallelism without converting anything:
#   1. train a small Llama-style model with Adam and save it sharded over 2 ranks (real torch DCP);
#   2. mount it with --layout=tp1_pp1_dp1 (one rank) and --layout=tp2_pp2_dp2 (eight ranks);
#   3. load target/tp1_pp1_dp1/rank_0/{model,optim}.pt into a fresh model and Adam, train 3 more
#      steps, and check the losses equal those of the uninterrupted run, bit for bit.
set -euo pipefail
cd "$(dirname "$0")/.."
tests/install-deps.sh
tests/build.sh build
UCPFS=$PWD/build/cli/ucpfs
work=$(mktemp -d /tmp/ucpfs-resume.XXXXXX)
mnt=$work/mnt
cleanup() {
  if mountpoint -q "$mnt" 2>/dev/null; then "$UCPFS" umount "$mnt" || umount -l "$mnt"; fi
  rm -rf "$work"
}
trap cleanup EXIT

echo "== train 3 Adam steps and save the model sharded by columns over 2 ranks"
/usr/bin/python3 tests/e2e/fixtures/gen_llama_train.py "$work/ckpt" --ranks 2 --sharding cols \
  --steps 3 --seed 7 --expected "$work/expected.pt" >/dev/null

mkdir -p "$mnt"
"$UCPFS" mount "$work/ckpt" "$mnt" --layout=tp1_pp1_dp1 --layout=tp2_pp2_dp2
echo "== ls $mnt/target/tp2_pp2_dp2/rank_5"
ls -l "$mnt/target/tp2_pp2_dp2/rank_5"

echo
echo "== resume from $mnt/target/tp1_pp1_dp1/rank_0"
/usr/bin/python3 - "$mnt" "$work/expected_resume.json" <<'PY'
import json, sys
import torch
sys.path.insert(0, "tests/e2e/fixtures")
import gen_llama_train as gen

mnt, info = sys.argv[1], json.load(open(sys.argv[2]))
torch.set_num_threads(1)
rank0 = f"{mnt}/target/tp1_pp1_dp1/rank_0"
model = gen.Llama()
model.load_state_dict(torch.load(f"{rank0}/model.pt"))
opt = gen.make_optimizer(model)
opt.load_state_dict(torch.load(f"{rank0}/optim.pt"))
k = info["steps"]
losses = [float(gen.train_step(model, opt, gen.batch(info["seed"], k + j))) for j in range(3)]
want = [float.fromhex(h) for h in info["continue_losses"]]
for got, ref in zip(losses, want):
    print(f"  loss {got:.10f}   uninterrupted {ref:.10f}")
assert [x.hex() for x in losses] == info["continue_losses"], "resumed losses differ"
print("resumed bit for bit")
PY
"$UCPFS" umount "$mnt"
