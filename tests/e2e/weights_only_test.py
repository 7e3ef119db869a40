"""End-to-end: weights-only sources and the safetensors views (issue 11).

A small Hugging Face Llama-style state dict (GQA attention, SwiGLU MLP, untied head) is saved by
the real producers:
  - safetensors/bf16: sharded `model-0000K-of-0000N.safetensors` + `model.safetensors.index.json`
    written with safetensors.torch.save_file (the library, shards as huggingface_hub splits them);
  - safetensors/fp32: one `model.safetensors`;
  - torch/bin: one `pytorch_model.bin` (torch.save of the state dict, tied head: the embedding's
    storage saved once under both names);
  - torch/pth: `consolidated.00.pth`, a bf16 state dict;
  - torch/wrapped: `model.pt` = {"model": fp16 state dict, "step": 7, "optimizer": {...}}, as
    training scripts save (the state dict under "model" is served, the rest is not);
  - torch/odd: a `pytorch_model.bin` whose vocabulary has 97 rows (odd, as GPT-2's 50257).
Each is mounted at its directory and checked:
 1. atomic/<name>/fp32.pt holds the tensor upcast to fp32, bit for bit;
 2. target/tp1_pp1_dp1/rank_0/model.pt equals the state dict (names, order-free, dtypes, bits);
 3. target/tp2_pp1_dp1/rank_r/model.pt splits column parameters (q/k/v/gate/up) along dim 0, row
    parameters (o/down) along dim 1, embeddings and head by vocabulary rows, and replicates norms;
    an odd vocabulary is padded the way Megatron pads (to a multiple of 128 * tp): each rank holds
    its slice of the padded table, zeros only past row 97;
 4. (safetensors library present) each rank's model.safetensors is byte-identical to
    safetensors.torch.save_file(model.pt's tensors, metadata={"format": "pt"});
 5. (library present) safetensors/ holds the weights consolidated: every shard byte-identical to
    save_file of the tensors its index assigns it, shards split as huggingface_hub splits them
    (a small --safetensors-shard-size forces several), loadable by safetensors.torch.load_file;
    `ucpfs convert --safetensors` writes the same bytes.
 6. bad input: a safetensors file with a corrupt header, an index naming a missing shard, a shard
    reached through a symlink, and two torch files without an index are refused with an error
    naming the file.
Under torch 1.13 (no safetensors library in Debian) the safetensors fixtures are written by the
torch 2.13 environment's python (UCPFS_TORCH2_PYTHON) when it is there, and checks 1-3 and 6 run.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/weights_only_test.py
"""
import json
import os
import shutil
import subprocess
import sys

import torch

from e2e_common import Results, bits_equal, run, served_loads, tmpdir, ucpfs_bin
from mount_common import mounted

try:
    import safetensors.torch as st
except ImportError:  # torch 1.13's python has no safetensors
    st = None

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 64, 4, 2, 96, 128, 2
HEAD_DIM = HIDDEN // HEADS
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def llama_state_dict(dtype, seed, tied=False, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    sd = {}

    def t(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    sd["model.embed_tokens.weight"] = t(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = t(HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.k_proj.weight"] = t(KV_HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.v_proj.weight"] = t(KV_HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.o_proj.weight"] = t(HIDDEN, HEADS * HEAD_DIM)
        sd[p + "mlp.gate_proj.weight"] = t(FFN, HIDDEN)
        sd[p + "mlp.up_proj.weight"] = t(FFN, HIDDEN)
        sd[p + "mlp.down_proj.weight"] = t(HIDDEN, FFN)
        sd[p + "input_layernorm.weight"] = t(HIDDEN)
        sd[p + "post_attention_layernorm.weight"] = t(HIDDEN)
    sd["model.norm.weight"] = t(HIDDEN)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] if tied else t(vocab, HIDDEN)
    return sd


def hf_shards(sd, max_bytes):
    """huggingface_hub's split_torch_state_dict_into_shards: [[names]] in file order."""
    shards, current, size = [], [], 0
    for name, t in sd.items():
        n = t.numel() * t.element_size()
        if n > max_bytes:
            shards.append([name])
            continue
        if size + n > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        shards.append(current)
    return shards


def save_sharded_safetensors(sd, out, max_bytes):
    """What transformers' save_pretrained writes with safetensors: shards + index."""
    os.makedirs(out, exist_ok=True)
    shards = hf_shards(sd, max_bytes)
    weight_map = {}
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        st.save_file({n: sd[n].contiguous() for n in names}, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        f.write(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")


def gen_safetensors(root):
    """Writes the safetensors sources under root (run with a python that has the library)."""
    save_sharded_safetensors(llama_state_dict(torch.bfloat16, 1), os.path.join(root, "st_bf16"), max_bytes=40000)
    os.makedirs(os.path.join(root, "st_fp32"))
    st.save_file(llama_state_dict(torch.float32, 2), os.path.join(root, "st_fp32", "model.safetensors"),
                 metadata={"format": "pt"})


def load_source(src):
    """The state dict a source directory holds, read with the producers' own loaders."""
    names = sorted(os.listdir(src))
    if "model.safetensors.index.json" in names or any(n.endswith(".safetensors") for n in names):
        if st is None:
            return None
        sd = {}
        for n in names:
            if n.endswith(".safetensors"):
                sd.update(st.load_file(os.path.join(src, n)))
        return sd
    (pt,) = [n for n in names if n.endswith((".bin", ".pt", ".pth"))]
    sd = torch.load(os.path.join(src, pt))
    return sd["model"] if "model" in sd and isinstance(sd["model"], dict) else sd


def tp_piece(name, t, tp, r):
    """What rank r of tp ranks holds of parameter `name` under the Hugging Face preset."""
    if tp == 1:
        return t
    kind = name.split(".")[-2]
    if name in ("model.embed_tokens.weight", "lm_head.weight") and t.shape[0] % tp:
        # Megatron's _vocab_size_with_padding: a multiple of make_vocab_size_divisible_by (128) * tp.
        padded = -(-t.shape[0] // (128 * tp)) * 128 * tp
        t = torch.cat([t, torch.zeros((padded - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype)])
    if kind in COLUMN or name in ("model.embed_tokens.weight", "lm_head.weight"):
        return t.chunk(tp, 0)[r]
    if kind in ROW:
        return t.chunk(tp, 1)[r]
    return t  # norms: replicated


def check_atomic(m, sd):
    for name, t in sd.items():
        for how, got in served_loads(os.path.join(m, "atomic", name, "fp32.pt")):
            assert bits_equal(got["param"], t.float()), f"atomic {name} ({how})"
    assert sorted(os.listdir(os.path.join(m, "atomic"))) == sorted(sd), "atomic/ lists exactly the tensors"


def check_target(m, sd, tp):
    for r in range(tp):
        path = os.path.join(m, "target", f"tp{tp}_pp1_dp1", f"rank_{r}", "model.pt")
        for how, got in served_loads(path):
            assert set(got) == set(sd), f"{path}: names {sorted(set(got) ^ set(sd))} differ"
            for name, t in sd.items():
                want = tp_piece(name, t, tp, r)
                assert bits_equal(got[name], want.contiguous()), f"{path} {name} ({how})"
        if st is not None:
            model = torch.load(path)
            st_path = os.path.join(os.path.dirname(path), "model.safetensors")
            with tmpdir("ucpfs-st-") as d:
                st.save_file(model, os.path.join(d, "x.safetensors"), metadata={"format": "pt"})
                want_bytes = open(os.path.join(d, "x.safetensors"), "rb").read()
            assert open(st_path, "rb").read() == want_bytes, f"{st_path} differs from save_file's bytes"


def check_safetensors_view(m, sd, max_bytes, src):
    view = os.path.join(m, "safetensors")
    names = sorted(os.listdir(view))
    index = json.load(open(os.path.join(view, "model.safetensors.index.json")))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    order = list(load_order(m, sd))
    want_shards = hf_shards({n: sd[n] for n in order}, max_bytes)
    files = [f"model-{k + 1:05d}-of-{len(want_shards):05d}.safetensors" for k in range(len(want_shards))]
    assert names == sorted(files + ["model.safetensors.index.json"]), names
    assert index["weight_map"] == {n: files[k] for k, s in enumerate(want_shards) for n in s}
    got = {}
    with tmpdir("ucpfs-st-") as d:
        for k, shard in enumerate(want_shards):
            st.save_file({n: sd[n].clone() for n in shard}, os.path.join(d, files[k]), metadata={"format": "pt"})
            served = open(os.path.join(view, files[k]), "rb").read()
            assert served == open(os.path.join(d, files[k]), "rb").read(), f"{files[k]} differs from save_file's"
            got.update(st.load_file(os.path.join(view, files[k])))
    assert set(got) == set(sd) and all(bits_equal(got[n], sd[n]) for n in sd)
    # The offline export writes the same bytes.
    with tmpdir("ucpfs-convert-") as out:
        run([ucpfs_bin(), "convert", src, out, "--safetensors", "--safetensors-shard-size", str(max_bytes),
             "--index-dir", os.path.join(out, "idx")], timeout=120)
        for n in names:
            assert open(os.path.join(out, "safetensors", n), "rb").read() == open(os.path.join(view, n), "rb").read(), n


def load_order(m, sd):
    """The parameter order the mount serves (model.pt of tp1 keeps the source's order)."""
    return torch.load(os.path.join(m, "target", "tp1_pp1_dp1", "rank_0", "model.pt")).keys()


def mount_fails(src, mnt, needle):
    os.makedirs(mnt, exist_ok=True)
    p = run([ucpfs_bin(), "mount", src, mnt, "--read-only", "--index-dir", mnt + ".idx"], check=False, timeout=120)
    if p.returncode == 0:
        run([ucpfs_bin(), "umount", mnt], check=False)
        raise AssertionError(f"mount of {src} succeeded")
    assert needle in p.stderr, f"error does not name {needle!r}: {p.stderr}"


def bad_inputs(work, sources):
    bad = os.path.join(work, "bad")
    # A corrupt header: the length field points past the end of the file.
    d = os.path.join(bad, "header")
    os.makedirs(d)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write((1 << 40).to_bytes(8, "little") + b'{"a": {}}')
    mount_fails(d, os.path.join(bad, "m1"), "model.safetensors")
    # Two torch files and no index.
    d = os.path.join(bad, "two")
    os.makedirs(d)
    torch.save({"a": torch.zeros(2)}, os.path.join(d, "a.pt"))
    torch.save({"b": torch.zeros(2)}, os.path.join(d, "b.pt"))
    mount_fails(d, os.path.join(bad, "m2"), "a.pt")
    if "st_bf16" in sources:
        # An index naming a shard that is missing, then one reached through a symlink.
        d = os.path.join(bad, "missing")
        shutil.copytree(sources["st_bf16"], d)
        victim = sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))[-1]
        os.unlink(os.path.join(d, victim))
        mount_fails(d, os.path.join(bad, "m3"), victim)
        os.symlink(os.path.join(sources["st_bf16"], victim), os.path.join(d, victim))
        mount_fails(d, os.path.join(bad, "m4"), victim)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--gen-safetensors":
        gen_safetensors(sys.argv[2])
        return
    res = Results("weights_only")
    with tmpdir("ucpfs-weights-") as work:
        sources = {}
        producer = sys.executable if st is not None else os.environ.get("UCPFS_TORCH2_PYTHON")
        if producer and os.path.exists(producer):
            run([producer, os.path.abspath(__file__), "--gen-safetensors", work], timeout=300)
            sources["st_bf16"] = os.path.join(work, "st_bf16")
            sources["st_fp32"] = os.path.join(work, "st_fp32")
        else:
            print("weights_only: no python with safetensors: the safetensors sources are skipped", flush=True)
        for name, fname, dtype, tied, vocab in (("pt_bin", "pytorch_model.bin", torch.float32, True, VOCAB),
                                                ("pt_pth", "consolidated.00.pth", torch.bfloat16, False, VOCAB),
                                                ("pt_wrapped", "model.pt", torch.float16, False, VOCAB),
                                                ("pt_odd", "pytorch_model.bin", torch.float32, False, 97)):
            d = os.path.join(work, name)
            os.makedirs(d)
            sd = llama_state_dict(dtype, 3, tied=tied, vocab=vocab)
            if name == "pt_wrapped":  # a training script's file: the state dict under "model"
                sd = {"model": sd, "step": 7, "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}}}
            torch.save(sd, os.path.join(d, fname))
            sources[name] = d
        for name, src in sources.items():
            sd = load_source(src)
            shard_bytes = 30000
            mnt = os.path.join(work, "mnt-" + name)
            with mounted(src, mnt, "--read-only", "--layout", "tp1_pp1_dp1", "--layout", "tp2_pp1_dp1",
                         "--safetensors-shard-size", str(shard_bytes), "--index-dir", mnt + ".idx") as (m, _):
                if sd is None:
                    sd = torch.load(os.path.join(m, "target", "tp1_pp1_dp1", "rank_0", "model.pt"))
                    res.check(f"{name}: served tensors are the saved ones (read by torch 2.13)",
                              lambda: check_with_producer(m, src))
                res.check(f"{name}: atomic fp32 = upcast tensors", lambda: check_atomic(m, sd))
                res.check(f"{name}: tp1_pp1_dp1 = the state dict", lambda: check_target(m, sd, 1))
                res.check(f"{name}: tp2_pp1_dp1 splits column/row/vocab", lambda: check_target(m, sd, 2))
                if st is not None:
                    res.check(f"{name}: safetensors/ = save_file's bytes, HF shards",
                              lambda: check_safetensors_view(m, sd, shard_bytes, src))
        res.check("bad inputs are refused naming the file", lambda: bad_inputs(work, sources))
    res.finish()


def check_with_producer(m, src):
    """Under torch 1.13: the 2.13 python (with the library) compares the served model.pt with the
    source files."""
    code = ("import sys, torch, safetensors.torch as st, os\n"
            "src, pt = sys.argv[1], sys.argv[2]\n"
            "sd = {}\n"
            "[sd.update(st.load_file(os.path.join(src, n))) for n in os.listdir(src) if n.endswith('.safetensors')]\n"
            "got = torch.load(pt)\n"
            "assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)\n")
    run([os.environ["UCPFS_TORCH2_PYTHON"], "-c", code, src,
         os.path.join(m, "target", "tp1_pp1_dp1", "rank_0", "model.pt")], timeout=120)


if __name__ == "__main__":
    main()
