"""End-to-end: the `hf/` view loads in Hugging Face transformers and gives the training job's own
logits (issue 24, items 1 and 3).

fixtures/gen_megatron_llama.py trains a Llama-style GPTModel (GQA, SwiGLU, RMSNorm, rotary, padded
vocabulary) with megatron-core 0.16.1 at tp 2 over gloo and saves it with dist_checkpointing.save
as Megatron-LM does, untied and tied; the live model's logits on a batch and its greedy tokens
are the truth. For each checkpoint, mounted (real FUSE):
 1. transformers.AutoModelForCausalLM.from_pretrained(MNT/hf, torch_dtype=float32) loads (no
    missing or unexpected key) and its logits on the batch equal the live Megatron model's (max
    abs difference <= 1e-4), and greedy generation of the same prompt gives the live tokens;
 2. config.json: the real vocabulary (129, not the 256 padded rows), tie_word_embeddings as
    trained, GQA heads; the tied model has no lm_head.weight in its shards;
 3. safetensors.safe_open reads every shard the index names, and the index names each tensor once;
 4. `--hf-dtype bf16` (and `-o hf_dtype=fp16`): every tensor in that dtype, equal to the fp32 view's
    tensor rounded (config.json says the dtype), and the bf16 model's logits stay close (<= 0.05);
 5. a copy whose args lack norm_epsilon (re-saved common.pt): no hf/, `hf.error` and
    status.json's hf.error name args.norm_epsilon; the other views are still served.
A Hugging Face source (a tied LlamaForCausalLM and a WordLevel tokenizer, saved here by
save_pretrained in 3 shards) is served as itself: the same tensors, config.json and tokenizer files
passed through (AutoTokenizer encodes as the original), the live model's logits (exact) and greedy
tokens; `--hf-dtype bf16` rewrites config.json's dtype and narrows every tensor. The same folder
with its weights as one pytorch_model.bin in torch's legacy format (as older Hub models hold
them): hf/ holds the same tensors and gives the live logits.
A torchtitan 0.3.0 save (fixtures/gen_torchtitan.py: its llama3 debug model under FSDP2, Meta's
rotary layout, llama3 rope scaling) mounted without --hf-config names the missing facts in
hf.error; with the base model's config.json (written here from torchtitan's model config) hf/
holds exactly what torchtitan's own Llama3StateDictAdapter.to_hf makes of the live weights, and
from_pretrained gives torchtitan's own model's logits (<= 1e-4) and greedy tokens; `ucpfs convert
--view hf` writes the same bytes (without --hf-config it fails naming the option) and `ucpfs verify
--view hf` reads them.
The Hugging Face Trainer's DeepSpeed ZeRO-2 checkpoint-3/ (fixture hf_trainer_zero2): hf/ is the
engine's module under its own names with the Trainer's config.json; from_pretrained gives the
logits of the framework's model holding the live job's weights (exact) and its greedy tokens.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/hf_view_test.py [DIR]
(DIR: reuse what `gen_megatron_llama.py DIR` wrote).
"""
import json
import os
import shutil
import sys

import torch

from e2e_common import Results, run, tmpdir, ucpfs_bin
from mount_common import mounted, status
from shared_fixtures import fixture


def hf_model(path):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    model, info = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def check_logits(model, truth, tol):
    with torch.no_grad():
        got = model(truth["tokens"]).logits.float()
    want = truth["logits"]
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = (got - want).abs().max().item()
    assert diff <= tol, f"max abs logit difference {diff} > {tol}"
    return diff


def check_greedy(model, truth):
    want = truth["greedy"][0].tolist()
    with torch.no_grad():
        out = model.generate(truth["prompt"], max_new_tokens=len(want), do_sample=False)
    got = out[0, truth["prompt"].shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    if eos is not None and eos in want:  # generation stops at the EOS the live job also produced
        want = want[:want.index(eos) + 1]
    assert got == want, f"greedy tokens {got} != live {want}"


def shards(hf):
    from safetensors import safe_open  # noqa: PLC0415
    index = json.load(open(os.path.join(hf, "model.safetensors.index.json")))
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(hf, f), "pt") as s:
            for k in s.keys():
                assert k not in out, f"{k} in two shards"
                assert index["weight_map"][k] == f, k
                out[k] = s.get_tensor(k)
    assert set(out) == set(index["weight_map"]), "the index and the shards name different tensors"
    return out


def hf_source(r, work):
    """A Hugging Face model folder saved by save_pretrained, mounted: hf/ is the source itself."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: PLC0415
    src = os.path.join(work, "hf-src")
    torch.manual_seed(5)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=0, eos_token_id=1)
    live = LlamaForCausalLM(cfg).eval()
    live.save_pretrained(src, max_shard_size="20KB")
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 96)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(src)
    want_sd = live.state_dict()
    text = "w5 w17 w33 w90 w4 w61"
    tokens = torch.tensor([[5, 17, 33, 90, 4, 61], [7, 7, 8, 9, 95, 3]])
    with torch.no_grad():
        want = live(tokens).logits
        greedy = live.generate(tokens[:1], max_new_tokens=4, do_sample=False)
    with mounted(src, os.path.join(work, "mnt-hf")) as (mnt, _):
        hf = os.path.join(mnt, "hf")

        def identity():
            names = sorted(os.listdir(hf))
            for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
                assert f in names, names
                assert open(os.path.join(hf, f), "rb").read() == open(os.path.join(src, f), "rb").read(), f
            got = shards(hf)
            assert set(got) == {k for k in want_sd if k != "lm_head.weight"}, sorted(got)
            for k, t in got.items():
                assert torch.equal(t, want_sd[k]), k
            ids = AutoTokenizer.from_pretrained(hf)(text).input_ids
            assert ids == tokens[0].tolist(), ids
            model = hf_model(hf)
            with torch.no_grad():
                assert torch.equal(model(tokens).logits, want), "logits differ"
                gen = model.generate(tokens[:1], max_new_tokens=4, do_sample=False)
                assert torch.equal(gen, greedy), (gen, greedy)
        r.check("a Hugging Face source: hf/ is itself (tensors, config, tokenizer, logits)", identity)
    # The same folder as older Hub models hold it: one pytorch_model.bin in torch's legacy format
    # (no zip; what torch.save wrote before 1.6), without the tied lm_head.weight as
    # save_pretrained leaves it out.
    legacy = os.path.join(work, "hf-src-legacy")
    os.makedirs(legacy)
    for f in os.listdir(src):
        if f.endswith(".json") and "safetensors" not in f:
            shutil.copy(os.path.join(src, f), legacy)
    torch.save({k: v for k, v in want_sd.items() if k != "lm_head.weight"}, os.path.join(legacy, "pytorch_model.bin"),
               _use_new_zipfile_serialization=False)
    with mounted(legacy, os.path.join(work, "mnt-hf-legacy")) as (mnt, _):
        hf = os.path.join(mnt, "hf")

        def from_legacy():
            got = shards(hf)
            assert set(got) == {k for k in want_sd if k != "lm_head.weight"}, sorted(got)
            for k, t in got.items():
                assert torch.equal(t, want_sd[k]), k
            model = hf_model(hf)
            with torch.no_grad():
                assert torch.equal(model(tokens).logits, want), "logits differ"
        r.check("a Hugging Face folder with a legacy-format pytorch_model.bin: hf/ gives the live logits",
                from_legacy)

    def verify_legacy():
        v = json.loads(run([ucpfs_bin(), "verify", legacy, "--view", "hf", "--json", "-q", "--index-dir",
                            os.path.join(work, "hf-legacy-verify")], timeout=300).stdout)
        assert v["ok"], v
        assert [u["why"] for u in v["unchecked"]] == ["torch's legacy format carries no checksums"], v["unchecked"]
    r.check("`ucpfs verify` of the legacy folder: its views read, the file named as carrying no checksums",
            verify_legacy)
    with mounted(src, os.path.join(work, "mnt-hf-bf16"), "--hf-dtype", "bf16") as (mnt, _):
        hf = os.path.join(mnt, "hf")

        def narrowed():
            c = json.load(open(os.path.join(hf, "config.json")))
            assert c["dtype"] == "bfloat16" and c["vocab_size"] == 96, c
            for k, t in shards(hf).items():
                assert t.dtype == torch.bfloat16 and torch.equal(t, want_sd[k].to(torch.bfloat16)), k
        r.check("a Hugging Face source with --hf-dtype bf16", narrowed)


def titan_config(cfg):
    """The Hugging Face config.json of torchtitan's Llama3Model.Config (what a user has beside the
    base model they trained from)."""
    attn = cfg.layers[0].attention
    rope = attn.rope
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "num_attention_heads": attn.n_heads, "num_key_value_heads": attn.n_kv_heads or attn.n_heads,
            "rms_norm_eps": cfg.norm.eps, "max_position_embeddings": rope.max_seq_len,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": float(rope.theta), "factor": rope.scaling_factor,
                                "low_freq_factor": rope.low_freq_factor, "high_freq_factor": rope.high_freq_factor,
                                "original_max_position_embeddings": rope.original_max_position_embeddings},
            "attention_bias": False, "mlp_bias": False, "bos_token_id": None, "eos_token_id": None}


def titan_source(r, work):
    """torchtitan's own save, its own model as the oracle."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures"))
    import gen_torchtitan as gt  # noqa: PLC0415
    gt.install_device_stub()  # torchtitan imports Triton kernels at import time; none run on a CPU
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter  # noqa: PLC0415
    gen = fixture("torchtitan", work)
    src = os.path.join(gen, gt.CHECKPOINT, "step-3")
    weights = torch.load(os.path.join(gen, "truth.pt"), weights_only=False)["model"]
    cfg = gt.trainer_config().model_spec.model
    model = gt.build_model()
    model.load_state_dict(weights)
    model.eval()

    def titan_logits(tokens):
        positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
        with torch.no_grad():
            return model(tokens, attention_masks=model.get_attention_masks(positions=positions), positions=positions)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    want = titan_logits(tokens)
    seq = tokens[:1, :6]
    for _ in range(4):
        seq = torch.cat([seq, titan_logits(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    base = os.path.join(work, "titan-base")
    os.makedirs(base)
    with open(os.path.join(base, "config.json"), "w") as f:
        json.dump(titan_config(cfg), f)
    with mounted(src, os.path.join(work, "mnt-titan-bare")) as (mnt, _):
        def missing():
            assert not os.path.exists(os.path.join(mnt, "hf"))
            text = open(os.path.join(mnt, "hf.error")).read()
            assert "--hf-config" in text and "heads" in text, text
        r.check("torchtitan without --hf-config: hf.error names the missing facts", missing)
    with mounted(src, os.path.join(work, "mnt-titan"), "--hf-config", os.path.join(base, "config.json")) as (mnt, _):
        hf = os.path.join(mnt, "hf")

        def adapter():
            theirs = Llama3StateDictAdapter(cfg, None).to_hf(weights)
            got = shards(hf)
            assert set(got) == set(theirs), sorted(set(got) ^ set(theirs))
            for k, t in got.items():
                assert torch.equal(t, theirs[k]), k
        r.check("torchtitan: hf/ is what torchtitan's own to_hf makes (q/k rotary permutation)", adapter)

        def converted():
            # convert and verify list hf/ through the same view kind as the mount (views/view_files.h).
            out = os.path.join(work, "titan-converted")
            cfg_args = ["--hf-config", os.path.join(base, "config.json")]
            run([ucpfs_bin(), "convert", src, out, "--view", "hf", "-q"] + cfg_args, timeout=300)
            assert sorted(os.listdir(os.path.join(out))) == ["hf"], os.listdir(out)
            assert sorted(os.listdir(os.path.join(out, "hf"))) == sorted(os.listdir(hf))
            for f in os.listdir(hf):
                assert open(os.path.join(out, "hf", f), "rb").read() == open(os.path.join(hf, f), "rb").read(), f
            v = json.loads(run([ucpfs_bin(), "verify", src, "--no-atomic", "--view", "hf", "--json", "-q"] + cfg_args,
                               timeout=300).stdout)
            assert v["ok"] and v["checked"]["views"] == len(os.listdir(hf)), v
            bare = run([ucpfs_bin(), "convert", src, os.path.join(work, "titan-bare"), "--view", "hf", "-q"],
                       check=False, timeout=300)
            assert bare.returncode == 1 and "no hf view" in bare.stderr and "--hf-config" in bare.stderr, bare.stderr
        r.check("torchtitan: `ucpfs convert --view hf` writes the mount's hf/ bytes; verify reads them", converted)

        def logits():
            hf_m = hf_model(hf)
            with torch.no_grad():
                diff = (hf_m(tokens).logits - want).abs().max().item()
                gen_ids = hf_m.generate(seq[:, :6], max_new_tokens=4, do_sample=False)
            assert diff <= 1e-4, f"max abs logit difference {diff}"
            assert torch.equal(gen_ids, seq), (gen_ids, seq)
            print(f"torchtitan: max abs logit difference {diff:.2e}", flush=True)
        r.check("torchtitan: from_pretrained(MNT/hf) gives torchtitan's logits and greedy tokens", logits)


def deepspeed_source(r, work):
    """The Trainer's DeepSpeed save: the live weights (the engine's safe_get_full_fp32_param) in
    the framework's own model are the oracle."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures"))
    import gen_hf_trainer  # noqa: PLC0415
    gen = fixture("hf_trainer_zero2", work)
    truth = torch.load(os.path.join(gen, "truth.pt"), weights_only=False)
    live = gen_hf_trainer.make_model().eval()
    live.load_state_dict(truth["weights"], strict=True)
    tokens = torch.tensor([[3, 9, 27, 81, 50, 11, 2, 7]])
    with torch.no_grad():
        want = live(tokens).logits
        greedy = live.generate(tokens, max_new_tokens=4, do_sample=False)
    with mounted(os.path.join(gen, "checkpoint-3"), os.path.join(work, "mnt-ds")) as (mnt, _):
        def same():
            hf = os.path.join(mnt, "hf")
            assert set(shards(hf)) == set(truth["weights"]), "not the model's names"
            model = hf_model(hf)
            with torch.no_grad():
                assert torch.equal(model(tokens).logits, want), "logits differ"
                assert torch.equal(model.generate(tokens, max_new_tokens=4, do_sample=False), greedy)
        r.check("the Trainer's DeepSpeed ZeRO-2 save: from_pretrained gives the live model's logits", same)


def main():
    r = Results("e2e_hf_view")
    with tmpdir("hf-view-") as work:
        hf_source(r, work)
        titan_source(r, work)
        deepspeed_source(r, work)
        gen = sys.argv[1] if len(sys.argv) > 1 else fixture("megatron_llama", work)
        for case in ("untied", "tied"):
            truth = torch.load(os.path.join(gen, f"{case}_truth.pt"), weights_only=False)
            src = os.path.join(gen, case)
            fp32 = {}
            with mounted(src, os.path.join(work, f"mnt-{case}")) as (mnt, _):
                hf = os.path.join(mnt, "hf")

                def config():
                    st = status(mnt)
                    assert "hf" not in st and st["counts"]["hf_files"] >= 3, st.get("hf")
                    c = json.load(open(os.path.join(hf, "config.json")))
                    assert c["model_type"] == "llama" and c["vocab_size"] == truth["case"]["vocab"], c
                    assert c["tie_word_embeddings"] == truth["case"]["tied"], c
                    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 2, 8), c
                    assert (c["rms_norm_eps"], c["rope_theta"]) == (1e-5, 500000), c
                r.check(f"{case}: config.json", config)

                def read_shards():
                    fp32.update(shards(hf))
                    assert ("lm_head.weight" in fp32) == (not truth["case"]["tied"]), sorted(fp32)
                    assert fp32["model.embed_tokens.weight"].shape == (truth["case"]["vocab"], 32)
                    assert all(t.dtype == torch.float32 for t in fp32.values())
                r.check(f"{case}: safe_open reads every shard", read_shards)

                def logits():
                    model = hf_model(hf)
                    diff = check_logits(model, truth, 1e-4)
                    check_greedy(model, truth)
                    print(f"{case}: max abs logit difference {diff:.2e}", flush=True)
                r.check(f"{case}: from_pretrained(MNT/hf) gives the live logits and greedy tokens", logits)

            if case != "untied":
                continue
            for opt, dtype in ((["--hf-dtype", "bf16"], torch.bfloat16), (["-o", "hf_dtype=fp16"], torch.float16)):
                with mounted(src, os.path.join(work, f"mnt-{dtype}"), *opt) as (mnt, _):
                    hf = os.path.join(mnt, "hf")

                    def narrowed():
                        c = json.load(open(os.path.join(hf, "config.json")))
                        assert c["dtype"] == str(dtype).removeprefix("torch."), c
                        got = shards(hf)
                        assert set(got) == set(fp32)
                        for k, t in got.items():
                            assert t.dtype == dtype, (k, t.dtype)
                            assert torch.equal(t, fp32[k].to(dtype)), k
                        if dtype == torch.bfloat16:
                            check_logits(hf_model(hf), truth, 0.05)
                    r.check(f"{opt}: every tensor in {dtype}", narrowed)

            bad = os.path.join(work, "no_eps")
            shutil.copytree(src, bad)
            common = torch.load(os.path.join(bad, "common.pt"), weights_only=False)
            del common["args"].norm_epsilon
            torch.save(common, os.path.join(bad, "common.pt"))
            with mounted(bad, os.path.join(work, "mnt-bad")) as (mnt, _):
                def missing_fact():
                    assert not os.path.exists(os.path.join(mnt, "hf"))
                    text = open(os.path.join(mnt, "hf.error")).read()
                    assert "args.norm_epsilon" in text, text
                    assert "args.norm_epsilon" in status(mnt)["hf"]["error"], status(mnt).get("hf")
                    assert os.listdir(os.path.join(mnt, "safetensors")), "the other views are gone"
                r.check("a missing fact is named in hf.error and status.json", missing_fact)
    r.finish()


if __name__ == "__main__":
    main()
