#!/usr/bin/env bash
# Resume a torch 2.x FSDP2 job on another world size, with no conversion step:
#   1. a job of 2 processes trains a tiny Llama with Adam, sharded with FSDP2 (fully_shard), and
#      saves it with torch.distributed.checkpoint (DCP), each rank its own shards;
#   2. ucpfs mounts the checkpoint with --layout=tp1_pp1_dp1: target/tp1_pp1_dp1/rank_0/ holds the
#      whole model (model.pt) and optimizer (optim.pt) as ordinary torch.save files;
#   3. a new job of 4 processes loads them with torch's set_state_dict(full_state_dict=True),
#      each rank keeping its own FSDP2 shard, checks its state equals what was saved bit for bit,
#      trains 3 more steps, and checks the losses equal those of the job that never stopped.
# The Python of both jobs is mount-examples/fsdp2_job.py. Exits non-zero if a check fails.
. "$(dirname "$0")/common.sh" resume
need_torch2

echo "== 1. train 3 steps on 2 ranks with FSDP2 and save with DCP (torch 2.13)"
"$PY2" mount-examples/fsdp2_job.py save "$work/ckpt" "$work" --ranks 2
ls "$work/ckpt"

echo
echo "== 2. ucpfs mount $work/ckpt $work/mnt --layout=tp1_pp1_dp1"
mkdir "$work/mnt"
"$UCPFS" mount "$work/ckpt" "$work/mnt" --layout=tp1_pp1_dp1
ls -l "$work/mnt/target/tp1_pp1_dp1/rank_0"

echo
echo "== 3. resume on 4 ranks from $work/mnt/target/tp1_pp1_dp1/rank_0"
"$PY2" mount-examples/fsdp2_job.py resume "$work/mnt/target/tp1_pp1_dp1/rank_0" "$work" --ranks 4

"$UCPFS" umount "$work/mnt"
echo "resume-new-layout: done in ${SECONDS} s"
