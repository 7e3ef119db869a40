"""End-to-end: a Hugging Face Llama served as Megatron-Core ranks (`--preset megatron-core`, issue 24 item 2).

Two tiny LlamaForCausalLMs (transformers, built from a LlamaConfig in code: GQA with 4 heads in 2
key-value groups, SwiGLU, RMSNorm, vocabulary 250), one untied and one with tied embeddings, are
saved with save_pretrained and each mounted with `--preset megatron-core --layout tp2_pp1_dp1
--layout tp1_pp2_dp1`. Then, in one
world of 2 gloo ranks on CPU, for each layout, Megatron-Core 0.16.1 builds its GPTModel of that
layout (local spec, RMSNorm, rope, vocabulary padded as Megatron-LM pads it: 256 at tp2, 128 at
tp1; share_embeddings_and_output_weights for the tied one), and each rank:
 1. loads MNT/target/<layout>/rank_<r>/model.pt with load_state_dict(strict=True): every name,
    `_extra_state` included, is Megatron-Core's;
 2. runs the same tokens: at tp2 both ranks give the whole (gathered) logits; at pp2 stage 0 sends
    its hidden states to stage 1 (set_input_tensor), which gives the logits;
 3. the logits of the real 250 tokens match the Hugging Face model's on those tokens (fp32, max
    abs difference <= 1e-4).
Also: the padded vocabulary rows repeat the last real row (what Megatron-LM's converters write), in
the embedding and the output layer (the tied model's last stage holds the embedding as
output_layer.weight); `ucpfs mount --preset megatron-core` of a model whose
config.json is not a Llama-family one is refused with the reason.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/hf_megatron_core_test.py
"""
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from e2e_common import Results, run, tmpdir, ucpfs_bin
from mount_common import mounted

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))

VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 250, 32, 48, 2, 4, 2
LAYOUTS = [(2, 1), (1, 2)]  # (tp, pp), dp 1
TOL = 1e-4


def padded_vocab(tp):
    """Megatron-LM's _vocab_size_with_padding with make_vocab_size_divisible_by 128."""
    multiple = 128 * tp
    return (VOCAB + multiple - 1) // multiple * multiple


def make_hf(outdir, tied):
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                      rms_norm_eps=1e-6, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(outdir)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    tokens[0, :4] = torch.tensor([VOCAB - 1, 0, VOCAB - 2, 1])  # the last real rows too
    with torch.no_grad():
        logits = model(tokens).logits
    return model.state_dict(), tokens, logits


def worker(rank, world, port, mnts, outdir, tokens):
    from rendezvous import rank_env  # noqa: PLC0415
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from gen_megatron_core import install_cpu_shims  # noqa: PLC0415
    install_cpu_shims()
    from megatron.core import parallel_state as ps  # noqa: PLC0415
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: PLC0415
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415
    out = {}
    for (tied, mnt), (tp, pp) in [(m, lay) for m in mnts.items() for lay in LAYOUTS]:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp)
        model_parallel_cuda_manual_seed(123, force_reset_rng=True)
        cfg = TransformerConfig(
            num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
            ffn_hidden_size=FFN, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            add_bias_linear=False, normalization="RMSNorm", layernorm_epsilon=1e-6, hidden_dropout=0.0,
            attention_dropout=0.0, bias_activation_fusion=False, apply_rope_fusion=False,
            use_cpu_initialization=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            pipeline_dtype=torch.float32)
        model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=padded_vocab(tp),
                         max_sequence_length=64, pre_process=ps.is_pipeline_first_stage(),
                         post_process=ps.is_pipeline_last_stage(), parallel_output=False,
                         share_embeddings_and_output_weights=tied, position_embedding_type="rope",
                         rotary_base=10000).eval()
        layout = f"tp{tp}_pp{pp}_dp1"
        sd = torch.load(os.path.join(mnt, "target", layout, f"rank_{rank}", "model.pt"), weights_only=True)
        model.load_state_dict(sd, strict=True)
        b, s = tokens.shape
        pos = torch.arange(s).unsqueeze(0).expand(b, s)
        mask = torch.ones(b, 1, s, s, dtype=torch.bool).triu(1)
        with torch.no_grad():
            if pp == 1:
                logits = model(tokens, pos, mask)
            elif ps.is_pipeline_first_stage():
                hidden = model(tokens, pos, mask)  # [s, b, h]
                dist.send(hidden.contiguous(), dst=1)
                logits = None
            else:
                hidden = torch.empty(s, b, HIDDEN)
                dist.recv(hidden, src=0)
                model.set_input_tensor(hidden)
                logits = model(tokens, pos, mask)
        out[(tied, layout)] = {"keys": list(sd.keys()), "logits": logits,
                       "vocab": {k: v for k, v in sd.items() if k.endswith(("word_embeddings.weight",
                                                                           "output_layer.weight"))}}
    torch.save(out, os.path.join(outdir, f"rank_{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def expect(res, label, cond):
    def check():
        assert cond, "not so"
    res.check(label, check)


def main():
    from rendezvous import TcpRendezvous  # noqa: PLC0415
    res = Results("hf_megatron_core")
    with tmpdir("hf-mcore-") as d, contextlib.ExitStack() as mounts:
        hf, mnts = {}, {}
        for tied in (False, True):
            src = os.path.join(d, f"hf_tied{int(tied)}")
            hf[tied] = make_hf(src, tied)
            mnt, _ = mounts.enter_context(mounted(src, os.path.join(d, f"mnt_tied{int(tied)}"), "--preset",
                                                  "megatron-core", "--layout", "tp2_pp1_dp1", "--layout", "tp1_pp2_dp1"))
            mnts[tied] = mnt
        tokens = hf[False][1]
        with TcpRendezvous() as rdzv:
            mp.spawn(worker, args=(2, rdzv.port, mnts, d, tokens), nprocs=2, join=True)
        mounts.close()
        got = [torch.load(os.path.join(d, f"rank_{r}.pt"), weights_only=False) for r in range(2)]
        for tied, (tp, pp) in [(t, lay) for t in (False, True) for lay in LAYOUTS]:
            hf_sd, _, hf_logits = hf[tied]
            layout = f"tp{tp}_pp{pp}_dp1"
            what = f"{'tied' if tied else 'untied'} {layout}"
            ranks = [r for r in range(2) if got[r][(tied, layout)]["logits"] is not None]
            expect(res, f"{what}: load_state_dict(strict=True) of every rank, logits from ranks {ranks}",
                   ranks == ([0, 1] if pp == 1 else [1]))
            for r in ranks:
                logits = got[r][(tied, layout)]["logits"]
                ok_shape = tuple(logits.shape) == (*tokens.shape, padded_vocab(tp))
                diff = (logits[..., :VOCAB] - hf_logits).abs().max().item() if ok_shape else float("inf")
                print(f"{what} rank {r}: max abs logit diff {diff:.2e}", flush=True)
                expect(res, f"{what} rank {r}: logits {tuple(logits.shape)} match the Hugging Face model's "
                            f"(max abs diff {diff:.2e} <= {TOL})", ok_shape and diff <= TOL)
            # The vocabulary: rows past the real ones repeat the last real row.
            for hf_name, name in (("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
                                  ("model.embed_tokens.weight" if tied else "lm_head.weight", "output_layer.weight")):
                parts = [got[r][(tied, layout)]["vocab"][name] for r in range(2)
                         if name in got[r][(tied, layout)]["vocab"]]
                if tied and pp == 1 and name == "output_layer.weight":
                    expect(res, f"{what}: no output_layer.weight (GPTModel shares the embedding)", not parts)
                    continue
                whole = torch.cat(parts) if parts else torch.empty(0)
                want = torch.cat([hf_sd[hf_name], hf_sd[hf_name][-1:].expand(padded_vocab(tp) - VOCAB, -1)])
                expect(res, f"{what}: {name} is {hf_name} padded to {padded_vocab(tp)} rows with its last row",
                       whole.shape == want.shape and torch.equal(whole, want))
        src = os.path.join(d, "hf_tied0")
        # A family whose weights Megatron-Core's GPTModel does not compute alike is refused.
        cfg_path = os.path.join(src, "config.json")
        cfg = json.load(open(cfg_path))
        cfg["model_type"] = "gemma"
        json.dump(cfg, open(cfg_path, "w"))
        os.makedirs(os.path.join(d, "mnt2"))
        p = run([ucpfs_bin(), "mount", src, os.path.join(d, "mnt2"), "--preset", "megatron-core",
                 "--layout", "tp2_pp1_dp1"], check=False)
        if p.returncode == 0:
            run([ucpfs_bin(), "umount", os.path.join(d, "mnt2")], check=False)
        expect(res, f"model_type gemma refused: {p.stderr.strip()[-160:]}",
                  p.returncode != 0 and "model_type 'gemma'" in p.stderr)
    res.finish()


if __name__ == "__main__":
    main()
