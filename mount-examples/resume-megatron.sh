#!/usr/bin/env bash
# Resume Megatron on another tensor- and pipeline-parallel layout from the mount:
#   1. a real Megatron-Core GPTModel trained 2 optimizer steps at tp 2, pp 1 (2 processes) is saved
#      as Megatron-LM saves it (--ckpt-format torch: latest_checkpointed_iteration.txt,
#      iter_0000002/mp_rank_0{0,1}/model_optim_rng.pt), by tests/e2e/fixtures/gen_megatron_legacy.py;
#   2. ucpfs mounts it with --layout=tp1_pp2_dp1: target/tp1_pp2_dp1/rank_{0,1}/ hold the two
#      pipeline stages of the unsplit model;
#   3. 2 processes build the Megatron-Core models of tp 1, pp 2 (megatron-core itself), load
#      rank_N/model.pt with load_state_dict, and check every weight and fp32 master equals the
#      saved model, bit for bit (mount-examples/megatron_job.py).
# Exits non-zero if a check fails.
. "$(dirname "$0")/common.sh" megatron
need_torch2
export PYTHONWARNINGS=ignore   # megatron-core's warnings about missing Apex / Transformer Engine

echo "== 1. save a Megatron-Core GPTModel trained at tp 2, pp 1 (2 processes)"
"$PY2" tests/e2e/fixtures/gen_megatron_legacy.py save "$work/ckpt" --tp 2 --pp 1 >/dev/null
find "$work/ckpt" -type f | sort

echo
echo "== 2. ucpfs mount $work/ckpt $work/mnt --layout=tp1_pp2_dp1"
mkdir "$work/mnt"
"$UCPFS" mount "$work/ckpt" "$work/mnt" --layout=tp1_pp2_dp1
ls -l "$work/mnt/target/tp1_pp2_dp1/rank_1"

echo
echo "== 3. load target/tp1_pp2_dp1/rank_{0,1}/model.pt into Megatron-Core models of tp 1, pp 2"
"$PY2" mount-examples/megatron_job.py "$work/mnt/target/tp1_pp2_dp1" "$work/ckpt_truth.pt" --tp 1 --pp 2

"$UCPFS" umount "$work/mnt"
echo "resume-megatron: done in ${SECONDS} s"
