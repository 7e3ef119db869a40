"""End-to-end: the `hf/` view of Megatron-LM legacy saves, Megatron-DeepSpeed pipeline saves and
Megatron-Core Qwen2-style and MoE saves loads in Hugging Face transformers and gives the framework's own
logits (issue 24).

1. Megatron-LM legacy (`--ckpt-format torch`, fixture megatron_legacy_tp2_pp2: fixtures/
   gen_megatron_legacy.py, a real Megatron-Core GPTModel and optimizer step at tp 2 x pp 2, saved
   as `iter_0000002/mp_rank_TT_PPP/model_optim_rng.pt` with Megatron-LM's args: GQA 4 heads in 2
   groups, SwiGLU, RMSNorm, rotary, add_bias_linear, tied embeddings, vocabulary 37 + EOD padded
   to 48, bf16 weights with fp32 norms):
   - mounted as it is: no hf/, hf.error says the weights are in two dtypes and names --hf-dtype;
   - with --hf-dtype fp32: config.json (llama, attention_bias and mlp_bias, the 38 real tokens,
     tied), from_pretrained strict (no missing or unexpected key), and its logits equal those of
     a Megatron-Core GPTModel (tp 1, fp32) holding the live job's weights (load_state_dict
     strict), max abs difference <= 1e-4, and the same greedy tokens.
2. Megatron-DeepSpeed (fixture mds_llama_pp2_tp2: fixtures/gen_megatron_deepspeed.py --llama,
   DeepSpeed 0.19.8's PipelineEngine at pp 2 x tp 2 over gloo, its `layer_NN-model_TT-model_states.pt`
   files and Megatron-DeepSpeed's args in the client state: RMSNorm, rotary, no biases, tied
   embedding through TiedLayerSpec): from_pretrained strict, its logits equal the job's own
   model (the generator's GPTModel, tp 1) holding the live engine's fp32 weights (<= 1e-4), and
   the same greedy tokens.

3. Qwen2 (fixture megatron_llama's qwen2 case: Megatron-Core with add_qkv_bias, tp 2): hf/ is a
   Qwen2ForCausalLM (q/k/v biases, none on o_proj or the MLP) giving the live logits (<= 1e-4) and
   greedy tokens; save_pretrained Qwen2 and Mistral folders are served as themselves.
4. Mixtral (fixture megatron_llama's mixtral case: Megatron-Core GPTModel with 4 SequentialMLP
   experts, top-2 softmax routing, expert parallelism 2): hf/ is a MixtralForCausalLM
   (block_sparse_moe.gate, experts.N.w1/w2/w3) giving the live logits and greedy tokens; with
   shared experts recorded in its args, hf.error names them.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/hf_megatron_test.py [legacy|deepspeed|families]...
(CTest runs each part as its own test: e2e_hf_megatron_legacy (1), _deepspeed (2), _families (3, 4).)
"""
import json
import os
import shutil
import sys

import torch
import torch.multiprocessing as mp

from e2e_common import Results, tmpdir
from hf_view_test import hf_model, shards
from mount_common import mounted
from shared_fixtures import fixture

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
TOL = 1e-4
GREEDY = 4


def shared_fixture(name, work):
    """fixture(), copied into work once however many checks read it."""
    out = os.path.join(work, name, "out")
    return out if os.path.isdir(out) else fixture(name, work)


def greedy(logits_of, prompt, n):
    seq = prompt
    for _ in range(n):
        seq = torch.cat([seq, logits_of(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    return seq


def compare(model, want_logits, tokens, want_seq, eos=None):
    """The Hugging Face model's logits on tokens vs want_logits; its greedy continuation of
    want_seq's prompt (all but its last GREEDY tokens) vs want_seq."""
    n_prompt = want_seq.shape[1] - GREEDY
    with torch.no_grad():
        got = model(tokens).logits.float()
        seq = model.generate(want_seq[:, :n_prompt], max_new_tokens=GREEDY, do_sample=False)
    assert got.shape == want_logits.shape, (got.shape, want_logits.shape)
    diff = (got - want_logits).abs().max().item()
    assert diff <= TOL, f"max abs logit difference {diff} > {TOL}"
    want = want_seq[0].tolist()
    got_seq = seq[0].tolist()
    if eos is not None and eos in want[n_prompt:]:  # generation stops at EOS, as the job's would
        want = want[:want.index(eos, n_prompt) + 1]
    assert got_seq == want, f"greedy {got_seq} != the framework's {want}"
    return diff


# ---- Megatron-LM legacy -------------------------------------------------------------------

def megatron_oracle(rank, port, truth_path, tokens, prompt, out):
    """Megatron-Core's own GPTModel (tp 1, fp32) with the live job's weights: logits and greedy."""
    import torch.distributed as dist  # noqa: PLC0415
    from rendezvous import rank_env  # noqa: PLC0415
    import gen_megatron_legacy as gml  # noqa: PLC0415
    rank_env(rank, 1, port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from gen_megatron_core import install_cpu_shims  # noqa: PLC0415
    install_cpu_shims()
    from megatron.core import parallel_state as ps  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: PLC0415
    from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: PLC0415
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: PLC0415
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(123, force_reset_rng=True)
    c = gml.CONFIG
    cfg = TransformerConfig(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        num_query_groups=c["num_query_groups"], ffn_hidden_size=c["ffn_hidden_size"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, apply_rope_fusion=False,
        use_cpu_initialization=True, params_dtype=torch.float32)
    padded = gml.padded_vocab(1)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=padded,
                     max_sequence_length=c["seq_length"], parallel_output=False,
                     share_embeddings_and_output_weights=True, position_embedding_type="rope").eval()
    truth = torch.load(truth_path, weights_only=False)["params"]
    sd = model.state_dict()
    for name, states in truth.items():
        w = states["weight"]
        sd[name] = w[:padded] if name == "embedding.word_embeddings.weight" else w
    extra = {k for k in sd if k not in truth and not k.endswith("_extra_state")}
    assert extra == {"output_layer.weight"} or not extra, extra  # the tied head is the embedding
    model.load_state_dict(sd, strict=True)

    def logits_of(t):
        b, s = t.shape
        pos = torch.arange(s).unsqueeze(0).expand(b, s)
        mask = torch.ones(b, 1, s, s, dtype=torch.bool).triu(1)
        with torch.no_grad():
            return model(t, pos, mask)[..., :gml.VOCAB + 1].float()
    torch.save({"logits": logits_of(tokens), "greedy": greedy(logits_of, prompt, GREEDY)}, out)
    dist.destroy_process_group()


def legacy(r, work):
    from rendezvous import TcpRendezvous  # noqa: PLC0415
    gen = fixture("megatron_legacy_tp2_pp2", work)
    tokens = torch.randint(0, 38, (2, 8), generator=torch.Generator().manual_seed(4))
    tokens[1, -1] = 37  # the EOD row, the last real one
    out = os.path.join(work, "legacy_oracle.pt")
    with TcpRendezvous() as rdzv:
        mp.spawn(megatron_oracle, args=(rdzv.port, gen + "_truth.pt", tokens, tokens[:1, :4], out), nprocs=1, join=True)
    want = torch.load(out)
    with mounted(gen, os.path.join(work, "mnt-legacy")) as (mnt, _):
        def two_dtypes():
            assert not os.path.exists(os.path.join(mnt, "hf"))
            text = open(os.path.join(mnt, "hf.error")).read()
            assert "more than one dtype" in text and "--hf-dtype" in text, text
        r.check("legacy bf16 + fp32 norms: hf.error asks for --hf-dtype", two_dtypes)
    with mounted(gen, os.path.join(work, "mnt-legacy32"), "--hf-dtype", "fp32") as (mnt, _):
        hf = os.path.join(mnt, "hf")

        def config():
            c = json.load(open(os.path.join(hf, "config.json")))
            assert (c["model_type"], c["vocab_size"], c["tie_word_embeddings"]) == ("llama", 38, True), c
            assert (c["attention_bias"], c["mlp_bias"], c["num_key_value_heads"]) == (True, True, 2), c
            got = shards(hf)
            assert "lm_head.weight" not in got and got["model.embed_tokens.weight"].shape == (38, 16)
            assert "model.layers.3.self_attn.k_proj.bias" in got and "model.layers.3.mlp.up_proj.bias" in got
        r.check("legacy: config.json (biases, 38 real tokens, tied) and the shards", config)

        def logits():
            diff = compare(hf_model(hf), want["logits"], tokens, want["greedy"], eos=37)
            print(f"legacy: max abs logit difference {diff:.2e}", flush=True)
        r.check("legacy tp2 pp2: from_pretrained(MNT/hf) gives Megatron-Core's logits and greedy tokens", logits)


# ---- Megatron-DeepSpeed -------------------------------------------------------------------

def mds_model(truth):
    """The job's own model class (the generator's GPTModel at tp 1, --llama) with the live engine's
    fp32 weights, renamed from the pipeline's numbered layers."""
    import gen_megatron_deepspeed as gmd  # noqa: PLC0415
    gmd.LLAMA, gmd.TP.rank, gmd.TP.size = True, 0, 1
    model = gmd.GPTModel(1).eval()
    names = [k for k in truth if k != "__step__"]
    layers = sorted({int(k.split(".")[0]) for k in names if k.endswith("query_key_value.weight")})
    final = min(int(k.split(".")[0]) for k in names if k.split(".")[0].isdigit() and int(k.split(".")[0]) > layers[-1])
    padded = gmd.padded_vocab(1)
    sd = {}
    for k in names:
        w = truth[k]["fp32"]
        head, _, rest = k.partition(".")
        if k == "tied_modules.embed.word_embeddings.weight":
            sd["language_model.embedding.word_embeddings.weight"] = w[:padded]
            sd["language_model.output_layer.weight"] = w[:padded]
        elif head.isdigit() and int(head) in layers:
            sd[f"language_model.encoder.layers.{layers.index(int(head))}.{rest}"] = w
        elif head.isdigit() and int(head) == final:
            sd[f"language_model.encoder.final_layernorm.{rest}"] = w
        else:
            raise AssertionError(f"unexpected pipeline parameter {k}")
    model.load_state_dict(sd, strict=True)
    return model, gmd.VOCAB


def deepspeed(r, work):
    gen = fixture("mds_llama_pp2_tp2", work)
    truth = torch.load(gen + "_truth.pt", weights_only=False)
    model, vocab = mds_model(truth)

    def logits_of(t):
        with torch.no_grad():
            return model(t)[..., :vocab]
    tokens = torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(5))
    want, seq = logits_of(tokens), greedy(logits_of, tokens[:1, :3], GREEDY)
    with mounted(gen, os.path.join(work, "mnt-mds")) as (mnt, _):
        hf = os.path.join(mnt, "hf")

        def config():
            assert os.path.isdir(hf), open(os.path.join(mnt, "hf.error")).read()
            c = json.load(open(os.path.join(hf, "config.json")))
            assert (c["model_type"], c["vocab_size"], c["tie_word_embeddings"]) == ("llama", 37, True), c
            assert (c["attention_bias"], c["mlp_bias"], c["rms_norm_eps"]) == (False, False, 1e-5), c
            layer_files = [f for _, _, fs in os.walk(gen) for f in fs if f.startswith("layer_")]
            assert len(layer_files) >= 4, layer_files  # the pipeline's layer files are the source
        r.check("Megatron-DeepSpeed pipeline: config.json from the client state's args", config)

        def logits():
            diff = compare(hf_model(hf), want, tokens, seq)
            print(f"Megatron-DeepSpeed: max abs logit difference {diff:.2e}", flush=True)
        r.check("Megatron-DeepSpeed pp2 tp2: from_pretrained(MNT/hf) gives the job's logits and greedy tokens", logits)


def live_logits_and_tokens(hf, truth, class_name, what):
    """from_pretrained(hf) is a class_name whose logits and greedy tokens are the live job's."""
    from hf_view_test import check_greedy, check_logits  # noqa: PLC0415
    model = hf_model(hf)
    assert type(model).__name__ == class_name, type(model)
    diff = check_logits(model, truth, TOL)
    check_greedy(model, truth)
    print(f"{what}: max abs logit difference {diff:.2e}", flush=True)


# ---- Qwen2 and Mistral ---------------------------------------------------------------------

def qwen2(r, work):
    """Megatron-Core with add_qkv_bias (fixture megatron_llama's qwen2 case) is a Qwen2; Hugging Face
    Qwen2 and Mistral folders are served as themselves."""
    gen = shared_fixture("megatron_llama", work)
    truth = torch.load(os.path.join(gen, "qwen2_truth.pt"), weights_only=False)
    with mounted(os.path.join(gen, "qwen2"), os.path.join(work, "mnt-qwen2")) as (mnt, _):
        hf = os.path.join(mnt, "hf")

        def megatron_qwen2():
            assert os.path.isdir(hf), open(os.path.join(mnt, "hf.error")).read()
            c = json.load(open(os.path.join(hf, "config.json")))
            assert (c["model_type"], c["architectures"], c["vocab_size"]) == ("qwen2", ["Qwen2ForCausalLM"], 129), c
            got = shards(hf)
            assert {"model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.bias",
                    "model.layers.1.self_attn.v_proj.bias"} <= set(got), sorted(got)
            assert not [k for k in got if k.endswith(("o_proj.bias", "mlp.up_proj.bias"))], sorted(got)
            live_logits_and_tokens(hf, truth, "Qwen2ForCausalLM", "Megatron-Core add_qkv_bias as Qwen2")
        r.check("Megatron-Core add_qkv_bias: hf/ is a Qwen2 with the live logits and greedy tokens", megatron_qwen2)
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    tokens = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(6))
    for name, cls, cfg in (("qwen2", Qwen2ForCausalLM, Qwen2Config(**sizes, tie_word_embeddings=True)),
                           ("mistral", MistralForCausalLM, MistralConfig(**sizes, sliding_window=4))):
        torch.manual_seed(7)
        live = cls(cfg).eval()
        src = os.path.join(work, f"hf-{name}")
        live.save_pretrained(src)
        with torch.no_grad():
            want = live(tokens).logits
        with mounted(src, os.path.join(work, f"mnt-hf-{name}")) as (mnt, _):
            def identity():
                hf = os.path.join(mnt, "hf")
                assert open(os.path.join(hf, "config.json"), "rb").read() == open(os.path.join(src, "config.json"), "rb").read()
                model = hf_model(hf)
                assert type(model) is cls, type(model)
                with torch.no_grad():
                    assert torch.equal(model(tokens).logits, want), "logits differ"
            r.check(f"a Hugging Face {name} folder: hf/ is itself (config, logits)", identity)


# ---- Mixtral -------------------------------------------------------------------------------

def mixtral(r, work):
    """Megatron-Core MoE (fixture megatron_llama's mixtral case: 4 SequentialMLP experts, top 2, at
    expert parallelism 2) is a Mixtral; a mixture Mixtral does not compute is refused by name."""
    gen = shared_fixture("megatron_llama", work)
    truth = torch.load(os.path.join(gen, "mixtral_truth.pt"), weights_only=False)
    src = os.path.join(gen, "mixtral")
    with mounted(src, os.path.join(work, "mnt-mixtral")) as (mnt, _):
        hf = os.path.join(mnt, "hf")

        def experts():
            assert os.path.isdir(hf), open(os.path.join(mnt, "hf.error")).read()
            c = json.load(open(os.path.join(hf, "config.json")))
            assert (c["model_type"], c["num_local_experts"], c["num_experts_per_tok"]) == ("mixtral", 4, 2), c
            assert (c["intermediate_size"], c["vocab_size"], c["tie_word_embeddings"]) == (48, 129, False), c
            got = shards(hf)
            for e in range(4):
                assert got[f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"].shape == (48, 32)
                assert got[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"].shape == (32, 48)
            assert got["model.layers.0.block_sparse_moe.gate.weight"].shape == (4, 32)
            live_logits_and_tokens(hf, truth, "MixtralForCausalLM", "Megatron-Core MoE as Mixtral")
        r.check("Megatron-Core MoE (ep 2): hf/ is a Mixtral with the live logits and greedy tokens", experts)
    shared = os.path.join(work, "mixtral-shared")
    shutil.copytree(src, shared)
    common = torch.load(os.path.join(shared, "common.pt"), weights_only=False)
    common["args"].moe_shared_expert_intermediate_size = 16
    torch.save(common, os.path.join(shared, "common.pt"))
    with mounted(shared, os.path.join(work, "mnt-mixtral-shared")) as (mnt, _):
        def refused():
            assert not os.path.exists(os.path.join(mnt, "hf"))
            text = open(os.path.join(mnt, "hf.error")).read()
            assert "shared experts" in text, text
        r.check("a mixture with shared experts: hf.error says so", refused)


PARTS = {"legacy": [legacy], "deepspeed": [deepspeed], "families": [qwen2, mixtral]}


def main():
    parts = sys.argv[1:] or list(PARTS)  # one CTest test per part, each with its one fixture
    r = Results("e2e_hf_megatron_" + "_".join(parts))
    with tmpdir("hf-megatron-") as work:
        for part in parts:
            for check in PARTS[part]:
                check(r, work)
    r.finish()


if __name__ == "__main__":
    main()
