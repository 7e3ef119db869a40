"""End-to-end: several nodes, simulated, each reading only its own bytes of one checkpoint in
object storage (issue 27), against a real Ceph RGW (tests/s3/rgw.sh; run under `rgw.sh exec DIR`).

A DCP checkpoint (a tiny MLP after one AdamW step: weights and Adam moments, keyed by parameter
name as get_state_dict gives them) is saved into the bucket by torch's own S3 path
(FsspecWriter over s3fs), and indexed once into a local index directory the nodes share
read-only. Then, for N = 2, 4 and 8, N separate `ucpfs mount` processes (one per simulated node,
each with its own mount point, `--read-only-index` on the shared index) each torch.load only
rank N_i's files of the layout tp1_pp1_dpN_zero1 (the weights whole, 1/N of the optimizer state),
all nodes at once:
 - what each node's S3 client GETs (stats.json s3.bytes_get, from before its loads to after) is
   within 10 % of what `ucpfs plan` says its rank reads, and so is the sum over the nodes; the
   node's whole GET count, mount start included, is too;
 - per object (stats.json s3.object_bytes_get): no node GETs more of an object than its rank
   needs of it (10 % slack), so none downloads the whole shard of which it needs only part;
 - the loaded views are the live job's state: every rank's model.pt equals the model, and the
   ranks' optimizer partitions, concatenated, are the model's parameters and Adam moments
   flattened in parameter order.

Run by hand: tests/s3/rgw.sh exec DIR env UCPFS_BIN=build/cli/ucpfs \
    .venv/bin/python tests/e2e/s3_nodes_test.py
"""
import concurrent.futures
import contextlib
import json
import os
import sys
import time

import torch

from e2e_common import Results, run, tmpdir, ucpfs_bin
from mount_common import mounted
import s3_common

NODE_COUNTS = (2, 4, 8)
SLACK = 0.10


def stats(m):
    return json.load(open(os.path.join(m, ".ucpfs", "stats.json")))["s3"]


def node_load(m, layout, rank, files):
    """One node: its rank's files read with torch.load; its client's counters around the loads."""
    start = stats(m)
    loaded = {f: torch.load(os.path.join(m, "target", layout, f"rank_{rank}", f)) for f in files}
    return start, stats(m), loaded


def check_nodes(n, url, index_dir, work, model, opt):
    layout = f"tp1_pp1_dp{n}_zero1"
    plan = json.loads(run([ucpfs_bin(), "plan", url, f"--layout={layout}", "--json", "--index-dir", index_dir,
                           "--read-only-index"]).stdout)
    sizes = {f["path"]: f["size"] for f in plan["source_files"]}
    prefix = url + "/"
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        mounts = [stack.enter_context(mounted(url, os.path.join(work, f"n{n}-node{i}"), f"--layout={layout}",
                                              "--index-dir", index_dir, "--read-only-index"))[0]
                  for i in range(n)]
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            jobs = [pool.submit(node_load, mounts[i], layout, i, [f["name"] for f in plan["ranks"][i]["files"]])
                    for i in range(n)]
            results = [j.result() for j in jobs]
    elapsed = time.monotonic() - t0
    total_got = total_want = 0
    for i, (start, end, _) in enumerate(results):
        rank = plan["ranks"][i]
        assert rank["rank"] == i, rank["rank"]
        want = rank["read_bytes"]
        got = end["bytes_get"] - start["bytes_get"]
        total_got, total_want = total_got + got, total_want + want
        assert want > 0 and abs(got - want) <= SLACK * want, f"{layout} node {i}: GET {got} bytes, its rank's plan {want}"
        whole = end["bytes_get"]  # mount start (listing, .metadata, small records) included
        assert whole <= (1 + SLACK) * want, f"{layout} node {i}: GET {whole} bytes in all, its rank's plan {want}"
        for name, n_bytes in end["object_bytes_get"].items():
            assert name.startswith(prefix), name
            rel = name[len(prefix):]
            need = rank["reads"].get(rel, 0)
            loads = n_bytes - start["object_bytes_get"].get(name, 0)
            assert loads <= (1 + SLACK) * need, f"{layout} node {i}: GET {loads} bytes of {rel} while loading, needs {need}"
            if 0 < need < sizes[rel]:  # a shard it needs part of (.metadata is read whole at mount start)
                assert n_bytes < sizes[rel], \
                    f"{layout} node {i}: GET all {sizes[rel]} bytes of {rel} (in {n_bytes}), needs only {need}"
    assert abs(total_got - total_want) <= SLACK * total_want, f"{layout}: nodes GET {total_got} bytes, plans {total_want}"
    partial = [p for p, s in sizes.items() if 0 < plan["ranks"][0]["reads"].get(p, 0) < s]
    assert partial, f"{layout}: no rank needs only part of a shard (the test would prove nothing): {plan['ranks'][0]}"
    check_values(results, model, opt)
    print(f"{layout}: {n} nodes GET {total_got} bytes for their loads, their plans {total_want} "
          f"(checkpoint {sum(sizes.values())} bytes; each node GETs part of {', '.join(partial)}); "
          f"mount + load + umount {elapsed:.1f} s", flush=True)


def check_values(results, model, opt):
    """model.pt is the live model on every rank; the optimizer partitions tile the flat state."""
    live = model.state_dict()
    names = list(live)
    for _, _, loaded in results:
        got = loaded["model.pt"]
        assert list(got) == names, (list(got), names)
        for k in names:
            assert torch.equal(got[k], live[k]), f"model.pt {k} differs from the live model"
    state = [opt.state[p] for p in model.parameters()]
    want = {"fp32": torch.cat([p.detach().flatten() for p in model.parameters()]),
            "exp_avg": torch.cat([s["exp_avg"].flatten() for s in state]),
            "exp_avg_sq": torch.cat([s["exp_avg_sq"].flatten() for s in state])}
    for field, flat in want.items():
        parts = torch.cat([loaded["optim.pt"][field].flatten() for _, _, loaded in results])
        assert parts.numel() >= flat.numel(), (field, parts.numel(), flat.numel())
        assert torch.equal(parts[:flat.numel()], flat), f"optim.pt {field}: the ranks' partitions differ from the live state"
        assert not parts[flat.numel():].any(), f"optim.pt {field}: padding is not zero"


def main():
    res = Results("s3_nodes")
    fs = s3_common.filesystem()
    bucket = f"ucpfs-nodes-{os.getpid()}-{int(time.time()) % 100000}"
    url = f"s3://{bucket}/runs/step1"
    s3_common.make_bucket(fs, bucket)
    try:
        with tmpdir("ucpfs_s3_nodes_") as work:
            model, opt = s3_common.train_tiny()
            t0 = time.monotonic()
            s3_common.dcp_save_s3(s3_common.training_state(model, opt), url)
            print(f"dcp.save through FsspecWriter (s3fs) into {url}: {time.monotonic() - t0:.1f} s, "
                  f"{sorted(fs.ls(url.removeprefix('s3://'), detail=False))}", flush=True)
            index_dir = os.path.join(work, "index")  # built once; every node reads it, none writes it
            t0 = time.monotonic()
            run([ucpfs_bin(), "index", url, "--index-dir", index_dir, "-q"])
            print(f"index built once: {time.monotonic() - t0:.2f} s", flush=True)
            for n in NODE_COUNTS:
                res.check(f"{n} nodes read only their bytes",
                          lambda n=n: check_nodes(n, url, index_dir, work, model, opt))
    finally:
        s3_common.remove_bucket(fs, bucket)
    res.finish()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
