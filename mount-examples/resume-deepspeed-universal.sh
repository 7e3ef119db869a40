#!/usr/bin/env bash
# Resume a DeepSpeed job on another data-parallel size from the mount, with no ds_to_universal step:
#   1. a DeepSpeed engine on 2 processes (ZeRO-2, bf16 with fp32 master weights) trains a tiny GPT
#      3 steps and saves with engine.save_checkpoint: `latest` -> global_step3/, each rank's
#      optimizer partition in its own file;
#   2. ucpfs mounts the save directory: global_step3_universal/ is the universal checkpoint
#      ds_to_universal would write, and latest_universal names it;
#   3. a new engine on 3 processes with "checkpoint": {"load_universal": true} loads from the mount
#      and checks that every fp32 master and Adam moment equals the saved one, bit for bit; then it
#      trains 3 more steps.
# The Python of both jobs is mount-examples/deepspeed_job.py. Exits non-zero if a check fails.
. "$(dirname "$0")/common.sh" deepspeed
need_torch2
# DeepSpeed's log lines and torch's deprecation warnings, left out (a failure still fails: pipefail).
quiet() { sed -e '/^\[[0-9-]* [0-9:,]*\]/d' -e '/FutureWarning/,+1d' -e '/shm_comm_op built/d'; }

echo "== 1. train 3 steps with DeepSpeed ZeRO-2 on 2 ranks and save"
"$PY2" mount-examples/deepspeed_job.py save "$work/ckpt" "$work" --ranks 2 2>&1 | quiet
ls "$work/ckpt" "$work/ckpt/global_step3"

echo
echo "== 2. ucpfs mount $work/ckpt $work/mnt"
mkdir "$work/mnt"
"$UCPFS" mount "$work/ckpt" "$work/mnt"
echo "latest_universal: $(cat "$work/mnt/latest_universal")"
ls "$work/mnt/global_step3_universal/zero" | sed -n 1,4p   # (sed reads all: no SIGPIPE)
echo "  ... ($(ls "$work/mnt/global_step3_universal/zero" | wc -l) entries)"

echo
echo "== 3. resume on 3 ranks with checkpoint.load_universal from $work/mnt"
"$PY2" mount-examples/deepspeed_job.py resume "$work/mnt" "$work" --ranks 3 2>&1 | quiet

"$UCPFS" umount "$work/mnt"
echo "resume-deepspeed-universal: done in ${SECONDS} s"
