#!/usr/bin/env bash
# Serve a Megatron-Core training checkpoint to Hugging Face transformers with no conversion step:
#   1. a real Megatron-Core GPTModel (Llama-style: GQA, SwiGLU, RMSNorm, rotary, padded vocabulary)
#      trained 3 optimizer steps at tp 2 (2 processes) is saved as Megatron-LM saves it
#      (dist_checkpointing torch_dist + its args), by tests/e2e/fixtures/gen_megatron_llama.py,
#      which also keeps the live model's logits and greedy tokens;
#   2. ucpfs mounts it: MNT/hf/ is a Hugging Face model folder (config.json made from the saved
#      args, Llama's names, the fused QKV and gate/up split, the padding rows stripped), computed
#      on read;
#   3. transformers' AutoModelForCausalLM.from_pretrained(MNT/hf) loads it and generates; its
#      logits and greedy tokens are checked against the live Megatron model's (hf_job.py).
# Exits non-zero if a check fails.
. "$(dirname "$0")/common.sh" hf-from-megatron
need_torch2
export PYTHONWARNINGS=ignore   # megatron-core's warnings about missing Apex / Transformer Engine

echo "== 1. save a Llama-style Megatron-Core GPTModel trained at tp 2 (2 processes)"
"$PY2" tests/e2e/fixtures/gen_megatron_llama.py "$work/out" --cases untied >/dev/null
find "$work/out/untied" -type f | sort

echo
echo "== 2. ucpfs mount $work/out/untied $work/mnt"
mkdir "$work/mnt"
"$UCPFS" mount "$work/out/untied" "$work/mnt"
ls -l "$work/mnt/hf"

echo
echo "== 3. from_pretrained($work/mnt/hf) generates"
"$PY2" mount-examples/hf_job.py "$work/mnt/hf" "$work/out/untied_truth.pt"

"$UCPFS" umount "$work/mnt"
echo "hf-from-megatron: done in ${SECONDS} s"
