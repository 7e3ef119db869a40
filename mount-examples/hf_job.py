"""The serving side of hf-from-megatron.sh: Hugging Face transformers loads the mount's hf/ folder
as it is and generates.

Usage (the python of .venv/: torch 2.13, transformers 5.24 on CPU):
  hf_job.py HF_DIR TRUTH
HF_DIR is the mount's hf/; TRUTH what the Megatron job kept (tests/e2e/fixtures/gen_megatron_llama.py:
its live model's logits on a batch, a prompt and its greedy tokens). Checks the logits within 1e-4
and the generated tokens equal.
"""
import sys

import torch
from transformers import AutoModelForCausalLM

hf, truth = sys.argv[1], torch.load(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
with torch.no_grad():
    diff = (model(truth["tokens"]).logits - truth["logits"]).abs().max().item()
    out = model.generate(truth["prompt"], max_new_tokens=truth["greedy"].shape[1], do_sample=False)
new = out[0, truth["prompt"].shape[1]:].tolist()
print(f"prompt {truth['prompt'][0].tolist()} -> generated {new}")
print(f"the Megatron job generated {truth['greedy'][0].tolist()}; max abs logit difference {diff:.1e}")
assert diff <= 1e-4 and new == truth["greedy"][0].tolist(), "not the Megatron model's output"
