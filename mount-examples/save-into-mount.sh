#!/usr/bin/env bash
# Save into the mount and resume from its views, without a remount:
#   1. mount an empty run directory with --layout=tp1_pp1_dp1;
#   2. a job of 2 processes (torch 1.13, gloo) trains a small Llama with Adam 3 steps and saves a
#      sharded DCP checkpoint into MNT/step-3; once it is durable, the mount serves it as views
#      (atomic/, target/tp1_pp1_dp1/) without a remount;
#   3. resume from MNT/target/tp1_pp1_dp1/rank_0/{model,optim}.pt in one process: 3 more steps,
#      losses equal to the uninterrupted run's, bit for bit; atomic/ is checked too;
#   4. torch.save a file into the mount, see `ucpfs status` count it, `ucpfs sync` make it durable,
#      and find it in the source byte for byte.
# Exits non-zero if a check fails.
. "$(dirname "$0")/common.sh" save
mnt=$work/mnt

mkdir -p "$work/run" "$mnt"
echo "== 1. ucpfs mount $work/run $mnt --layout=tp1_pp1_dp1   (an empty directory)"
"$UCPFS" mount "$work/run" "$mnt" --layout=tp1_pp1_dp1 --cache-size 512M
ls -A "$mnt"

echo
echo "== 2. train 3 steps and save a DCP checkpoint into $mnt/step-3 with torch 1.13 (2 ranks)"
/usr/bin/python3 tests/e2e/fixtures/gen_llama_train.py "$mnt/step-3" --ranks 2 --sharding cols \
  --steps 3 --seed 7 --expected "$work/expected.pt" >/dev/null
# The views follow within a second or so of the save (re-indexed in the background).
for _ in $(seq 100); do [ -e "$mnt/target/tp1_pp1_dp1/rank_0/optim.pt" ] && break; sleep 0.1; done
echo "views appeared without a remount:"
ls "$mnt" "$mnt/target/tp1_pp1_dp1/rank_0"

echo
echo "== 3. resume from $mnt/target/tp1_pp1_dp1/rank_0"
/usr/bin/python3 - "$mnt" "$work/expected.pt" "$work/expected_resume.json" <<'PY'
import json, sys
import torch
sys.path.insert(0, "tests/e2e/fixtures")
import gen_llama_train as gen

mnt, expected, info = sys.argv[1], torch.load(sys.argv[2]), json.load(open(sys.argv[3]))
torch.set_num_threads(1)
# atomic/: one parameter's Adam moment, consolidated from the 2 ranks' column shards.
got = torch.load(f"{mnt}/atomic/layers.0.attention.wq.weight/exp_avg.pt")["param"]
assert torch.equal(got, expected["optimizer.state.layers.0.attention.wq.weight.exp_avg"]), "atomic view differs"
print("atomic/layers.0.attention.wq.weight/exp_avg.pt equals the moment the ranks saved")
# target/: the whole model and optimizer, as one rank of layout tp1_pp1_dp1.
rank0 = f"{mnt}/target/tp1_pp1_dp1/rank_0"
model = gen.Llama()
model.load_state_dict(torch.load(f"{rank0}/model.pt"))
opt = gen.make_optimizer(model)
opt.load_state_dict(torch.load(f"{rank0}/optim.pt"))
k = info["steps"]
losses = [float(gen.train_step(model, opt, gen.batch(info["seed"], k + j))) for j in range(3)]
for got, ref in zip(losses, (float.fromhex(h) for h in info["continue_losses"])):
    print(f"  loss {got:.10f}   uninterrupted {ref:.10f}")
assert [x.hex() for x in losses] == info["continue_losses"], "resumed losses differ"
print("resumed from the view bit for bit")
PY

echo
echo "== 4. torch.save into the mount, then ucpfs status and ucpfs sync"
/usr/bin/python3 -c 'import sys, torch; torch.save({"note": torch.arange(10)}, sys.argv[1])' "$mnt/extra.pt"
"$UCPFS" status "$mnt"
"$UCPFS" sync "$mnt"
cmp "$mnt/extra.pt" "$work/run/extra.pt"
echo "extra.pt is durable in the source, byte for byte"

echo
echo "== ucpfs umount $mnt"
"$UCPFS" umount "$mnt"
echo "save-into-mount: done in ${SECONDS} s"
