"""End-to-end: Megatron-Core `torch_dist` checkpoints from the real producer (issue 11, item 2).

fixtures/gen_megatron_core.py trains a small GPT (GQA, SwiGLU, padded vocabulary) with the
installed megatron-core 0.16.1 on CPU over gloo and saves it with dist_checkpointing.save, as
Megatron-LM does: tp2 pp2 (non-distributed Adam), tp2 dp2 with the DistributedOptimizer saved
'fully_reshardable' and 'dp_reshardable', tp1 pp2 dp2 with tied embeddings, and an MoE model with
expert parallelism 2 (SequentialMLP experts). The oracle is megatron-core's own reader, run by the
generator: dist_checkpointing.load_plain_tensors (consolidated tensors) and
dist_checkpointing.load into GPTModels of other layouts (each rank's model.state_dict()).
For each checkpoint, mounted (real FUSE):
 1. the parameters are Megatron's state_dict names: one per layer (`decoder.layers.<i>.…`) and
    expert (`…local_experts.<j>.…`), without DDP's `module.` prefix;
 2. every atomic/<param>/{fp32,exp_avg,exp_avg_sq}.pt equals the consolidated tensor of that
    layer (and expert) bit for bit; dp_reshardable's opaque optimizer buckets are not mapped to
    parameters (no exp_avg.pt) and are listed as not served in status.json and ucp_info.json;
 3. target/tp<T>_pp<P>_dp1/rank_<r>/model.pt, for every (T, P) in {1,2}x{1,2} other than the
    saved one, holds exactly the tensors Megatron's loader gives rank (tp, pp) = (r % T, r // T)
    of a GPTModel of that layout: the same names (the local spec's input_layernorm /
    pre_mlp_layernorm written as the checkpoint names them, `linear_qkv.layer_norm_*` and
    `linear_fc1.layer_norm_*`, through the spec's own sharded_state_dict_keys_map), shapes and
    bytes; vocabulary tensors: the tokenizer's 129 rows equal (args.vocab_size 128 and
    NullTokenizer's EOD row, so the tp1 table has 256 rows), and every row the source stores (its
    padding included) is served as stored (checked against the consolidated tensor); only rows
    past the source's stored ones are zeros.
 4. 'fully_reshardable' with one stage: target/tp1_pp1_dp1/rank_0/optim.pt loads into a
    torch.optim.AdamW over a tp1 GPTModel (which, loaded with the view's model.pt, gives the logits
    of megatron's loader's tp1 model) grouped by megatron-core's own _get_param_groups
    (load_state_dict): its groups hold the parameters the live job's groups held, each group's
    fields (lr, betas, eps, weight_decay, wd_mult, ...) equal the live optimizer's, every
    parameter's step is the live step (common.pt's param groups), its moments are the
    consolidated ones, and resuming trains the uninterrupted job's next 3 losses (within 1e-6
    relative: the job ran at tp2 dp2, the resumed one at tp1 in one process).
 5. tp2_dp2_fr mounted with `-o make_vocab_size_divisible_by=48`: the vocabulary tensors of tp1 and
    tp2 targets are padded to a multiple of 48*T (144 and 2 x 96 rows), each row the stored one.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/megatron_core_test.py [DIR]
(DIR: reuse what `gen_megatron_core.py DIR` wrote instead of generating).
"""
import json
import os
import re
import sys

import torch

from e2e_common import Results, bits_equal, run, tmpdir
from mount_common import mounted, status

HERE = os.path.dirname(os.path.abspath(__file__))
GEN = os.path.join(HERE, "fixtures", "gen_megatron_core.py")
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def unstack(key, t):
    """Megatron's stacked key + tensor -> {per-layer (and per-expert) state_dict name: tensor}."""
    parts = key.split(".")
    marks = [i for i, p in enumerate(parts) if i + 1 < len(parts) and not parts[i + 1].isdigit() and
             (p in ("layers", "local_experts") or (p == "experts" and i > 0 and parts[i - 1] == "experts"))]
    if not marks:
        return {key: t}
    out = {}
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in t.shape[:len(marks)]]).reshape(-1, len(marks)).tolist():
        named = list(parts)
        for m, i in zip(reversed(marks), reversed(idx)):
            if named[m] == "experts":
                named[m] = "local_experts"
            named.insert(m + 1, str(i))
        out[".".join(named)] = t[tuple(idx)]
    return out


def expected_atomic(plain):
    """param -> {file: tensor} from load_plain_tensors' output (optimizer keys by Megatron's naming)."""
    out = {}
    for key, t in plain.items():
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or ".distributed." in key:
            continue  # dp_reshardable's per-bucket buffers belong to no one parameter
        m = re.fullmatch(r"(?:chained_\d+\.)?optimizer\.state\.(param|fp32_param|exp_avg|exp_avg_sq)\.module\.(.+)", key)
        if m:
            state, name = ("fp32" if m[1] in ("param", "fp32_param") else m[1]), m[2]
        elif key.startswith("module."):
            state, name = "weight", key[len("module."):]
        else:
            raise AssertionError(f"unexpected key {key}")
        for param, v in unstack(name, t).items():
            out.setdefault(param, {})[state] = v
    files = {}
    for param, states in out.items():
        f = {"fp32.pt": states.get("fp32", states.get("weight"))}
        f.update({s + ".pt": states[s] for s in ("exp_avg", "exp_avg_sq") if s in states})
        files[param] = f
    return files


def check_atomic(mnt, plain, sharding):
    want = expected_atomic(plain)
    got = sorted(os.listdir(os.path.join(mnt, "atomic")))
    assert got == sorted(want), f"atomic params {got} != {sorted(want)}"
    moments = 0
    for param, files in want.items():
        d = os.path.join(mnt, "atomic", param)
        names = sorted(n for n in os.listdir(d) if n != "step.pt")
        assert names == sorted(files), (param, names, sorted(files))
        for name, t in files.items():
            obj = torch.load(os.path.join(d, name))
            p = obj["param"]
            assert bits_equal(p, t.float()), f"{param}/{name}: values differ"
            moments += name == "exp_avg.pt" and bool(t.abs().sum() > 0)
    if sharding == "dp_reshardable":
        assert moments == 0
        buckets = [k for k in plain if ".gbuf_idx_" in k]
        assert buckets, "no dp_reshardable bucket in the checkpoint"
        reported = json.dumps(status(mnt))
        info = open(os.path.join(mnt, "target", "tp1_pp1_dp1", "rank_0", "ucp_info.json")).read()
        for k in buckets:
            assert json.dumps(k)[1:-1] in reported and json.dumps(k)[1:-1] in info, f"{k} is not reported as not served"
    else:
        assert moments > 0, "no non-zero Adam moment: the optimizer did not step"


def megatron_name(key, keys_map):
    """A local-spec state_dict name as the checkpoint (and so the view) names it."""
    for local, ckpt in keys_map.items():
        key = re.sub(r"(\.layers\.\d+\.)" + re.escape(local), lambda m: m[1] + ckpt, key)
    return key


def check_target(mnt, truth, layout, ranks):
    t, p = (int(x) for x in re.fullmatch(r"tp(\d+)_pp(\d+)", layout).groups())
    vocab = truth["case"]["vocab"]
    plain = truth["plain"]
    for r, sd in sorted(ranks.items()):
        path = os.path.join(mnt, "target", f"{layout}_dp1", f"rank_{r}", "model.pt")
        got = torch.load(path)
        want = {megatron_name(k, truth["keys_map"]): v for k, v in sd.items()}
        assert list(got) == list(want), f"{layout} rank {r}: names\n view {list(got)}\n megatron {list(want)}"
        for name, w in want.items():
            g = got[name]
            what = f"{layout} rank {r} {name}"
            assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, w.shape, g.dtype, w.dtype)
            if name in VOCAB_PARAMS:
                first = (r % t) * w.shape[0]
                rows = max(0, min(w.shape[0], vocab - first))
                assert bits_equal(g[:rows], w[:rows]), f"{what}: vocabulary rows differ"
                # The source's global rows, padding included (a tied last stage's output_layer is
                # the word embeddings).
                src = plain.get("module." + name, plain.get("module.embedding.word_embeddings.weight"))
                stored = src[first:first + w.shape[0]]
                assert bits_equal(g[:stored.shape[0]], stored.to(g.dtype)), f"{what}: stored rows are not served as stored"
                assert not g[stored.shape[0]:].any(), f"{what}: rows past the source's are not zero"
            else:
                assert bits_equal(g, w), f"{what}: values differ"


def optim_worker(_, optim_path, truth_path, store):
    """In a process of its own (megatron's CPU shims patch torch): a tp1 GPTModel loads the view's
    model.pt (strict) and gives the logits megatron's loader's tp1 model gave (NullTokenizer's EOD
    row included); an AdamW over it grouped by megatron-core's own _get_param_groups,
    load_state_dict(optim.pt); the groups' members, fields, every parameter's step and Adam moments
    are checked against the live job."""
    import torch.distributed as dist  # noqa: PLC0415
    sys.path.insert(0, os.path.dirname(GEN))
    import gen_megatron_core as gen  # noqa: PLC0415
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    gen.install_cpu_shims()
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups  # noqa: PLC0415
    truth = torch.load(truth_path, weights_only=False)
    live, keys_map, vocab = truth["optimizer"], truth["keys_map"], truth["case"]["vocab"]
    gen.set_layout(1, 1, 1)
    model, _, _ = gen.build_model(1, 1, truth["case"]["tied"], distributed_optimizer=False, wrap=False)
    name_of = {p: megatron_name(n, keys_map) for n, p in model.named_parameters()}
    view = torch.load(os.path.join(os.path.dirname(optim_path), "model.pt"))
    model.load_state_dict({k: view[megatron_name(k, keys_map)] if isinstance(v, torch.Tensor) else v
                           for k, v in model.state_dict().items()}, strict=True)
    _, logits = gen.logits_of(model)
    assert torch.equal(truth["tokens"], _) and bits_equal(logits, truth["logits"]), \
        f"logits of the view's tp1 model differ from megatron's loader's by {(logits - truth['logits']).abs().max()}"
    groups = _get_param_groups([model], OptimizerConfig(optimizer="adam", lr=1.0), None)
    opt = torch.optim.AdamW([{"params": g["params"]} for g in groups])
    optim = torch.load(optim_path)
    opt.load_state_dict(optim)
    members = [[name_of[p] for p in g["params"]] for g in groups]
    assert [g["param_names"] for g in optim["param_groups"]] == members, "optim.pt's groups are not megatron's"
    assert [[megatron_name(n, keys_map) for n in names] for names in live["names"]] == members, \
        "the live job grouped its parameters otherwise"
    assert len(opt.param_groups) == len(live["param_groups"])
    for got, want in zip(opt.param_groups, live["param_groups"]):
        for k, v in want.items():
            assert got.get(k) == v, f"param group field {k}: {got.get(k)!r}, the live job's {v!r}"
    moments = expected_atomic(truth["plain"])
    for p, name in name_of.items():
        st = opt.state[p]
        assert float(st["step"]) == live["step"], (name, st["step"], live["step"])
        for m in ("exp_avg", "exp_avg_sq"):
            want = moments[name][m + ".pt"]
            rows = min(vocab, p.shape[0]) if name in VOCAB_PARAMS else p.shape[0]
            assert st[m].shape == p.shape and bits_equal(st[m][:rows], want[:rows].float()), f"{name} {m}"
    # Resume: the uninterrupted job's next steps (the same batches, every data-parallel rank's
    # micro-batches averaged, megatron's default clip_grad 1.0) give its losses.
    res = live["resume"]
    losses = []
    for step in range(res["first_step"], res["first_step"] + len(res["losses"])):
        opt.zero_grad()
        micro = [t for d in range(res["dp"]) for t in gen.batches(res["seed"], step, d)]
        total = 0.0
        for tokens in micro:
            out, loss_of = gen.forward_step(iter([tokens]), model)
            loss, _ = loss_of(out)
            (loss / len(micro)).backward()
            total += float(loss) / len(micro)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(total)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, res["losses"]))
    print(f"resumed losses {losses}, the uninterrupted job's {res['losses']} (largest relative difference {worst:.2e})")
    assert worst < 1e-6, f"resumed losses {losses} differ from the uninterrupted job's {res['losses']}"
    dist.destroy_process_group()


def check_optim(mnt, work, name, truth_path):
    optim_path = os.path.join(mnt, "target", "tp1_pp1_dp1", "rank_0", "optim.pt")
    store = os.path.join(work, f"optim-store-{name}")
    torch.multiprocessing.spawn(optim_worker, (optim_path, truth_path, store), nprocs=1, join=True)


def check_pad_option(work, name, plain):
    """`-o make_vocab_size_divisible_by=48` over the saved args' 128: the vocabulary of 129 tokens
    is padded to a multiple of 48*T (144 rows at tp1, 2 x 96 at tp2), its rows the stored ones."""
    src = os.path.join(work, name)
    stored = plain["module.embedding.word_embeddings.weight"]
    with mounted(src, os.path.join(work, "mnt-pad-" + name), "-o", "make_vocab_size_divisible_by=48") as (mnt, _):
        for layout, rank, rows in (("tp1_pp1_dp1", 0, 144), ("tp2_pp1_dp1", 1, 96)):
            sd = torch.load(os.path.join(mnt, "target", layout, f"rank_{rank}", "model.pt"))
            for vocab_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                if vocab_name not in sd:
                    continue
                w = sd[vocab_name]
                first = rank * rows
                assert w.shape == (rows, stored.shape[1]), (layout, vocab_name, w.shape)
                assert bits_equal(w, stored[first:first + rows].to(w.dtype)), (layout, vocab_name, "rows differ")


def check_checkpoint(work, name):
    src = os.path.join(work, name)
    truth = torch.load(src + "_truth.pt", weights_only=False)
    saved = f"tp{truth['case']['tp']}_pp{truth['case']['pp']}"
    with mounted(src, os.path.join(work, "mnt-" + name)) as (mnt, _):
        check_atomic(mnt, truth["plain"], truth["case"]["sharding"])
        for layout, ranks in truth["targets"].items():
            if layout != saved:
                check_target(mnt, truth, layout, ranks)
        if "optimizer" in truth:
            check_optim(mnt, work, name, src + "_truth.pt")
    if name == "tp2_dp2_fr":
        check_pad_option(work, name, truth["plain"])


def main():
    res = Results("megatron_core")
    with tmpdir("ucpfs-megatron-core-") as work:
        if len(sys.argv) > 1:  # a directory the generator filled before (debugging)
            work = sys.argv[1]
        else:
            run([sys.executable, GEN, work], timeout=900)
        names = sorted(n[:-len("_truth.pt")] for n in os.listdir(work) if n.endswith("_truth.pt"))
        assert names, "the generator wrote no checkpoint"
        for name in names:
            res.check(f"{name}: atomic views equal megatron's consolidated tensors; target views equal "
                      "what dist_checkpointing.load gives each rank of the other layouts",
                      lambda name=name: check_checkpoint(work, name))
    res.finish()


if __name__ == "__main__":
    main()
