"""ucpfs.torch.StorageReader: torch.distributed.checkpoint.load of a DeepSpeed, a Megatron, a
Hugging Face Trainer and a torchtitan save.

The shared fixtures ds_zero2 (DeepSpeed ZeRO-2, 2 ranks, 3 steps of AdamW in two groups, with the
engine's truth and the losses of 3 more uninterrupted steps) and mcore_tp2_dp2 (Megatron-Core tp 2
dp 2, DistributedOptimizer fully_reshardable, with what megatron-core's own loader reads back and
the live optimizer) are each loaded, on 2 gloo ranks, with

    dcp.load({"model": msd, "optim": osd}, storage_reader=ucpfs.torch.StorageReader(SRC))
    set_state_dict(model, optim, model_state_dict=..., optim_state_dict=...)

into (a) a torch 2.13 FSDP2 job (fully_shard per layer and the root) and (b) a DTensor
tensor-parallel job (parallelize_module with ColwiseParallel / RowwiseParallel). Checked, per
parameter, gathered with full_tensor(): the weight (fp32 master), exp_avg and exp_avg_sq equal
bit for bit to ucpfs's own atomic/ files (ucpfs.open) and to the framework's truth (DeepSpeed's
safe_get_full_* of the live engine; megatron-core's load_plain_tensors), the step and the param
groups to the live optimizer's; each rank read from the source about half of what the whole
states hold (never whole tensors). Each FSDP2 job then trains 2 more steps with the fixture's
batches: the losses equal the uninterrupted job's bit for bit (DeepSpeed's continue_losses;
megatron-core's live "resume" losses, from a tp 2 dp 2 job, reproduced at tp 1 under FSDP2).
The shared fixture hf_trainer (the Trainer's checkpoint-3/: model.safetensors and optimizer.pt,
its parameters by position, decay and no-decay groups) is loaded the same way into the FSDP2 job
only: weights and moments equal atomic/ and the live job's, and its next 2 losses (the same
batch on each rank) the live job's. The shared fixture torchtitan (torchtitan 0.3.0's DCP save of
its llama3 debug model under FSDP2: weights as wq/wk/wv, optimizer state under the fused wqkv)
is loaded into torchtitan's own model and optimizer under FSDP2, the state as its
CheckpointManager passes it to dcp.load: weights, moments, steps and the group equal atomic/ and
the live job's bit for bit.

The models: DeepSpeed's, the fixture's own TinyGPT (gen_deepspeed.py); Hugging Face's, the
fixture's LlamaForCausalLM (gen_hf_trainer.make_model). Megatron's, under FSDP2 the
fixture's GPTModel at tp 1 (gen_megatron_core.build_model; its `_extra_state` Nones dropped from
the state), under TP a plain torch module with GPTModel's parameter names and shapes (no forward).
Megatron's names come through `StorageReader(rename=...)`: the checkpoint's
`self_attention.linear_qkv.layer_norm_weight` is the model's `input_layernorm.weight`.

Usage: .venv/bin/python torch_storage_reader_test.py [SOURCE...] (deepspeed megatron hf
torchtitan: the jobs of those sources, by default all; ctest runs the first two as
e2e_torch_storage_reader, the others as e2e_torch_storage_reader_hf_dcp). The package: the wheel
test's --target install, or UCPFS_PYTHON_PACKAGE (a directory holding an importable `ucpfs`).
"""
import json
import os
import re
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "fixtures"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD = 2


# ---- the models ----

def deepspeed_model():
    import gen_deepspeed as g  # noqa: PLC0415
    torch.manual_seed(1234)  # not the fixture's seed: every value must come from the checkpoint
    model = g.TinyGPT()
    trained = [(n, p) for n, p in model.named_parameters()]
    decay = [n for n, _ in trained if n.endswith(".weight") and "layernorm" not in n]
    return model, [decay, [n for n, _ in trained if n not in decay]], \
        dict(lr=1e-2, betas=(0.9, 0.95)), [0.1, 0.0]


def hf_model(groups):
    """The fixture's LlamaForCausalLM (gen_hf_trainer.make_model), its Trainer's two groups."""
    import gen_hf_trainer as g  # noqa: PLC0415
    model = g.make_model(seed=1234)  # not the fixture's seed: every value must come from the checkpoint
    return model, groups, dict(lr=1e-2), [0.01, 0.0]


def megatron_model(shapes, groups):
    """A plain module with the parameter names and global shapes of GPTModel's local spec (the
    live job's names: `input_layernorm`, which the checkpoint calls
    `self_attention.linear_qkv.layer_norm_`)."""
    root = torch.nn.Module()
    for name, shape in shapes.items():
        mod = root
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            if not hasattr(mod, part):
                here = ".".join(parts[:i + 1])
                if part.endswith("embeddings") and i == len(parts) - 2:
                    sub = torch.nn.Embedding(*shapes[here + ".weight"])
                elif part.startswith("linear_"):
                    w = shapes[here + ".weight"]
                    sub = torch.nn.Linear(w[1], w[0], bias=False)
                else:
                    sub = torch.nn.Module()
                mod.add_module(part, sub)
            mod = getattr(mod, part)
        if not isinstance(getattr(mod, parts[-1], None), torch.nn.Parameter):
            mod.register_parameter(parts[-1], torch.nn.Parameter(torch.randn(shape)))
    names = [n for n, _ in root.named_parameters()]
    assert sorted(names) == sorted(shapes), (names, list(shapes))
    return root, groups, {}, None


def megatron_gpt(groups):
    """The fixture's Megatron-Core GPTModel (local spec, tied embeddings) at tp 1, on the CPU."""
    import gen_megatron_core as g  # noqa: PLC0415
    g.install_cpu_shims()
    g.set_layout(1, 1, 1234)  # not the fixture's seed: every value must come from the checkpoint
    model, _, _ = g.build_model(1, 1, True, wrap=False)
    return model, groups, {}, None


def megatron_steps(model, optim, resume, rank):
    """The fixture job's next 2 steps (gen_megatron_core.train_steps) in plain torch: its batches
    on this dp rank, the mean loss of its micro-batches, megatron's default clip_grad 1.0."""
    import gen_megatron_core as g  # noqa: PLC0415
    losses = []
    for step in range(resume["first_step"], resume["first_step"] + 2):
        total = 0
        for tokens in g.batches(resume["seed"], step, rank):
            pos = torch.arange(g.SEQ).unsqueeze(0).expand(g.MICRO_BATCH, g.SEQ)
            mask = torch.ones(g.MICRO_BATCH, 1, g.SEQ, g.SEQ, dtype=torch.bool).triu(1)
            loss = model(tokens, pos, mask, labels=torch.roll(tokens, -1, 1)).float().mean()
            (loss / g.N_MICRO).backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        mean = total / g.N_MICRO
        dist.all_reduce(mean)
        losses.append(float(mean) / WORLD)
    return losses


class KeysMap:
    """Megatron-Core's sharded_state_dict_keys_map (state_dict name part -> checkpoint name part)
    both ways: `StorageReader(rename=...)` gives the model's names."""

    def __init__(self, keys_map):
        self.keys_map = keys_map

    def __call__(self, ckpt_name):  # checkpoint -> model
        for state_part, ckpt_part in self.keys_map.items():
            ckpt_name = ckpt_name.replace("." + ckpt_part, "." + state_part)
        return ckpt_name

    def to_ckpt(self, name):
        for state_part, ckpt_part in self.keys_map.items():
            name = name.replace("." + state_part, "." + ckpt_part)
        return name


def shard(model, kind, mesh):
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
        for m in list(model.modules()):
            if getattr(m, "_is_layer", False):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: PLC0415
    plan = {}
    for name, m in model.named_modules():
        if not isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, torch.nn.Embedding) or leaf in ("dense", "dense_4h_to_h", "linear_proj", "linear_fc2"):
            plan[name] = RowwiseParallel()
        else:
            plan[name] = ColwiseParallel()
    assert plan, "no linear layer to parallelize"
    return parallelize_module(model, mesh, plan)


def mark_layers(model):
    """FSDP2 units: each transformer layer (a child of a ModuleList or a `layers` container)."""
    for name, m in model.named_modules():
        if re.search(r"layers\.\d+$", name):
            m._is_layer = True


# ---- one rank ----

def rank_main(rank, port, cfg):
    from rendezvous import rank_env  # noqa: PLC0415
    rank_env(rank, WORLD, port)
    torch.set_num_threads(1)
    sys.path.insert(0, cfg["site"])
    dist.init_process_group("gloo")
    try:
        (run_titan_rank if cfg["source"] == "torchtitan" else run_rank)(rank, cfg)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_titan_rank(rank, cfg):
    """torchtitan's own model and optimizer under FSDP2 as its trainer builds them; the state as its
    CheckpointManager passes it to dcp.load: the model's state_dict() (its hook splits the fused
    wqkv into wq/wk/wv), the optimizer's by parameter (wqkv); loaded back through the model's own
    load_state_dict (its hook fuses them again)."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,  # noqa: PLC0415
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
    from e2e_common import bits_equal  # noqa: PLC0415
    import gen_torchtitan as g  # noqa: PLC0415
    import ucpfs  # noqa: PLC0415
    import ucpfs.torch  # noqa: PLC0415
    torch.manual_seed(1234)  # not the fixture's seed: every value must come from the checkpoint
    model = g.build_model()
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = g.torch_optimizer(g.make_optimizer(model))
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)}
    reader = ucpfs.torch.StorageReader(cfg["src"], index_dir=cfg["index_dir"])
    dcp.load(state, storage_reader=reader)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])

    truth = torch.load(cfg["truth"], weights_only=False)
    views = ucpfs.open(cfg["src"], index_dir=cfg["index_dir"])
    n_checked = 0

    def atomic(name, s):
        with views.atomic.open(f"{name}/{s}.pt") as f:
            return torch.load(f, weights_only=True)["param"]
    for name, t in model.state_dict().items():
        t = full(t)
        assert bits_equal(t, atomic(name, "fp32")), f"torchtitan: {name} differs from atomic/{name}/fp32.pt"
        assert bits_equal(t, truth["model"][name]), f"torchtitan: {name} differs from the live job's"
        n_checked += 1
    osd = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    assert sorted(osd["state"]) == sorted(truth["optim"]["state"]), "torchtitan: optimizer state names differ"
    for fqn, st in osd["state"].items():
        want = truth["optim"]["state"][fqn]
        for s in ("exp_avg", "exp_avg_sq"):
            assert bits_equal(st[s], atomic(fqn, s)), f"torchtitan: {fqn} {s} differs from atomic/"
            assert bits_equal(st[s], want[s]), f"torchtitan: {fqn} {s} differs from the live job's"
            n_checked += 1
        assert bits_equal(st["step"], want["step"]), f"torchtitan: {fqn} step {st['step']} != {want['step']}"
    for got, want in zip(osd["param_groups"], truth["optim"]["param_groups"]):
        for k, v in want.items():
            assert got[k] == v, f"torchtitan: group {k}: {got[k]} != {v}"
    whole = sum(full(p).numel() * 4 * 3 for p in model.parameters())
    share = reader.bytes_read / whole
    # wq/wk/wv are whole on each rank (torchtitan's hook gathers wqkv to split it): more than half.
    assert share < 0.8, f"torchtitan: rank {rank} read {reader.bytes_read} bytes of {whole} ({share:.2f})"
    if rank == 0:
        with open(cfg["report"], "w") as f:
            json.dump({"checked": n_checked, "bytes_read": reader.bytes_read, "whole": whole, "losses": [],
                       "warnings": reader.warnings}, f)


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_rank(rank, cfg):
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from e2e_common import bits_equal  # noqa: PLC0415
    import ucpfs  # noqa: PLC0415
    import ucpfs.torch  # noqa: PLC0415
    assert ucpfs.__file__.startswith(cfg["site"]), ucpfs.__file__
    src, kind = cfg["src"], cfg["kind"]
    if cfg["source"] == "deepspeed":
        model, group_names, opt_kw, decays = deepspeed_model()
    elif cfg["source"] == "hf":
        model, group_names, opt_kw, decays = hf_model(cfg["groups"])
    elif kind == "fsdp2":
        model, group_names, opt_kw, decays = megatron_gpt(cfg["groups"])
    else:
        model, group_names, opt_kw, decays = megatron_model({k: tuple(v) for k, v in cfg["shapes"].items()},
                                                            cfg["groups"])
    mark_layers(model)
    mesh = init_device_mesh("cpu", (WORLD,))
    model = shard(model, kind, mesh)
    params = dict(model.named_parameters())
    pgroups = [{"params": [params[n] for n in names]} for names in group_names]
    if decays:
        for g, wd in zip(pgroups, decays):
            g["weight_decay"] = wd
    optim = torch.optim.AdamW(pgroups, **opt_kw)
    msd, osd = get_state_dict(model, optim)
    # GPTModel's local modules hold None as `_extra_state`, which the checkpoint does not name.
    msd = {k: v for k, v in msd.items() if not (k.endswith("._extra_state") and v is None)}
    state = {"model": msd, "optim": osd}
    names = KeysMap(cfg.get("keys_map", {}))
    reader = ucpfs.torch.StorageReader(src, index_dir=cfg["index_dir"], rename=names if names.keys_map else None)
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    # The state, gathered, against ucpfs's atomic/ files and the framework's truth.
    views = ucpfs.open(src, index_dir=cfg["index_dir"])
    truth = torch.load(cfg["truth"], weights_only=False)
    n_checked = 0
    osd_now = optim.state_dict()
    by_id = {id(p): n for n, p in model.named_parameters()}
    pid_of = {}
    for gi, g in enumerate(optim.param_groups):
        for p, pid in zip(g["params"], osd_now["param_groups"][gi]["params"]):
            pid_of[by_id[id(p)]] = pid
    for name, p in model.named_parameters():
        st = osd_now["state"][pid_of[name]]
        got = {"fp32": full(p.detach()), "exp_avg": full(st["exp_avg"]), "exp_avg_sq": full(st["exp_avg_sq"])}
        for s, t in got.items():
            ckpt_name = names.to_ckpt(name)
            with views.atomic.open(f"{ckpt_name}/{s}.pt") as f:
                atomic = torch.load(f, weights_only=True)["param"]
            assert bits_equal(t, atomic), f"{cfg['name']}: {name} {s} differs from atomic/{ckpt_name}/{s}.pt"
            want = truth_of(cfg["source"], truth, ckpt_name, s)
            assert bits_equal(t, want), f"{cfg['name']}: {name} {s} differs from the framework's truth"
            n_checked += 1
        step = float(st["step"])
        assert step == cfg["step"], f"{cfg['name']}: {name} step {step}, want {cfg['step']}"
    for g, want in zip(optim.param_groups, cfg["param_groups"]):
        for k, v in want.items():
            assert g[k] == (tuple(v) if isinstance(v, list) else v), f"{cfg['name']}: group {k}: {g[k]} != {v}"

    # Each rank read about its half of the states, not whole tensors.
    whole = sum(full(p).numel() * 4 * 3 for p in model.parameters())
    share = reader.bytes_read / whole
    assert 0.3 < share < 0.75, f"{cfg['name']}: rank {rank} read {reader.bytes_read} bytes of {whole} ({share:.2f})"

    losses = []
    if cfg.get("resume") and cfg["source"] == "megatron":
        losses = megatron_steps(model, optim, cfg["resume"], rank)
    elif cfg.get("resume") and cfg["source"] == "hf":
        # The live job's next 2 steps (gen_hf_trainer.save_truth): the same batch on each rank.
        for b in truth["batches"][:2]:
            loss = model(**b).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append((mean / WORLD).item())
    elif cfg.get("resume"):
        import gen_deepspeed as g  # noqa: PLC0415
        for s in range(int(cfg["step"]), int(cfg["step"]) + 2):
            tokens = g.batch(cfg["seed"], s, rank)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, g.VOCAB), tokens[:, 1:].reshape(-1))
            loss.backward()
            # The DeepSpeed job's config leaves gradient_clipping at DeepSpeed's default, 1.0.
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad()
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            losses.append((mean / WORLD).item().hex())
    if rank == 0:
        with open(cfg["report"], "w") as f:
            json.dump({"checked": n_checked, "bytes_read": reader.bytes_read, "whole": whole, "losses": losses,
                       "warnings": reader.warnings}, f)


def truth_of(source, truth, name, state):
    if source == "deepspeed":
        return truth[name][state]
    if source == "hf":
        return truth["weights" if state == "fp32" else state][name]
    plain = truth["plain"]
    prefix = {"fp32": "optimizer.state.param.", "exp_avg": "optimizer.state.exp_avg.",
              "exp_avg_sq": "optimizer.state.exp_avg_sq."}[state]
    m = re.match(r"(decoder\.layers)\.(\d+)\.(.*)", name)
    if m:
        return plain[f"{prefix}module.{m.group(1)}.{m.group(3)}"][int(m.group(2))]
    return plain[f"{prefix}module.{name}"]


def run_job(cfg):
    from rendezvous import TcpRendezvous  # noqa: PLC0415
    with TcpRendezvous() as rdzv:
        mp.spawn(rank_main, args=(rdzv.port, cfg), nprocs=WORLD, join=True)
    with open(cfg["report"]) as f:
        return json.load(f)


FIELDS = ("lr", "betas", "eps", "weight_decay")


def deepspeed_jobs(out, work):
    ds_resume = json.load(open(out + "_resume.json"))
    return [dict(name=f"deepspeed->{kind}", source="deepspeed", kind=kind, src=out, truth=out + "_truth.pt",
                 index_dir=os.path.join(work, "index-ds"), step=3.0, seed=ds_resume["seed"], resume=kind == "fsdp2",
                 resume_losses=ds_resume["continue_losses"][:2],
                 param_groups=[{"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1},
                               {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.0}])
            for kind in ("fsdp2", "tp")]


def megatron_jobs(out, work):
    import ucpfs  # noqa: PLC0415
    mc = os.path.join(out, "tp2_dp2_fr")
    mc_truth = torch.load(mc + "_truth.pt", weights_only=False)
    # The Megatron model's names and shapes: what ucpfs lists (the same names the truth's
    # stacked keys unstack to), and its groups from the live optimizer.
    v = ucpfs.open(mc, index_dir=os.path.join(work, "index-mc"))
    names = KeysMap(mc_truth["keys_map"])
    shapes = {}
    for name in v.atomic.listdir():
        with v.atomic.open(f"{name}/fp32.pt") as f:
            shapes[names(name)] = list(torch.load(f, weights_only=True)["param"].shape)
    live = mc_truth["optimizer"]
    mc_groups = [[n[len("module."):] if n.startswith("module.") else n for n in names] for names in live["names"]]
    return [dict(name=f"megatron->{kind}", source="megatron", kind=kind, src=mc, truth=mc + "_truth.pt",
                 index_dir=os.path.join(work, "index-mc"), step=live["step"], shapes=shapes,
                 groups=mc_groups, keys_map=mc_truth["keys_map"], resume=live["resume"] if kind == "fsdp2" else None,
                 resume_losses=live["resume"]["losses"][:2],
                 param_groups=[{k: g[k] for k in FIELDS} for g in live["param_groups"]])
            for kind in ("fsdp2", "tp")]


def hf_jobs(out, work):
    """The Hugging Face Trainer's checkpoint-3/ (model.safetensors, optimizer.pt by position)."""
    truth = torch.load(os.path.join(out, "truth.pt"), weights_only=False)
    return [dict(name="hf->fsdp2", source="hf", kind="fsdp2", src=os.path.join(out, "checkpoint-3"),
                 truth=os.path.join(out, "truth.pt"), index_dir=os.path.join(work, "index-hf"), step=3.0,
                 groups=[g["names"] for g in truth["groups"]], resume=True, resume_losses=truth["losses"][:2],
                 param_groups=[{k: g[k] for k in FIELDS} for g in truth["groups"]])]


def torchtitan_jobs(out, work):
    """torchtitan's DCP save (checkpoint/step-3/: FSDP2, fused wqkv)."""
    truth = torch.load(os.path.join(out, "truth.pt"), weights_only=False)
    return [dict(name="torchtitan->fsdp2", source="torchtitan", kind="fsdp2",
                 src=os.path.join(out, truth["checkpoint"]), truth=os.path.join(out, "truth.pt"),
                 index_dir=os.path.join(work, "index-titan"))]


# source -> (its shared fixture, its jobs)
SOURCES = {"deepspeed": ("ds_zero2", deepspeed_jobs), "megatron": ("mcore_tp2_dp2", megatron_jobs),
           "hf": ("hf_trainer", hf_jobs), "torchtitan": ("torchtitan", torchtitan_jobs)}


def main():
    from shared_fixtures import fixtures  # noqa: PLC0415
    from python_package_test import package_site  # noqa: PLC0415
    site = package_site()
    sys.path.insert(0, site)
    sources = sys.argv[1:] or list(SOURCES)
    assert all(s in SOURCES for s in sources), f"sources: {', '.join(SOURCES)}"
    work = tempfile.mkdtemp(prefix="torch-storage-reader-", dir="/tmp")
    try:
        paths = fixtures([SOURCES[s][0] for s in sources], work)
        jobs = [cfg for s in sources for cfg in SOURCES[s][1](paths[SOURCES[s][0]], work)]
        for cfg in jobs:
            cfg["site"] = site
            cfg["report"] = os.path.join(work, cfg["name"].replace(">", "") + ".json")
            r = run_job(cfg)
            line = (f"{cfg['name']}: {r['checked']} tensors equal to atomic/ and the truth; rank 0 read "
                    f"{r['bytes_read']} of {r['whole']} bytes")
            if cfg.get("resume"):
                want = cfg["resume_losses"]
                assert r["losses"] == want, \
                    f"{cfg['name']}: losses after the load {r['losses']} != the uninterrupted job's {want}"
                line += f"; 2 steps after the load equal the uninterrupted job's losses {want}"
            print(line, flush=True)
        print(f"torch_storage_reader ({' '.join(sources)}): ok", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
