"""End-to-end: several nodes, simulated, each reading only its own bytes of one checkpoint in
object storage (issue 27), against a real Ceph RGW (tests/s3/rgw.sh; run under `rgw.sh exec DIR`).

A DCP checkpoint (a tiny MLP after one AdamW step: weights and Adam moments, keyed by parameter
name as get_state_dict gives them) is saved into the bucket by torch's own S3 path
(FsspecWriter over s3fs), and indexed once by `ucpfs index s3://...`, which keeps the index in
the bucket under PREFIX/.ucpfs/ (`--index-dir` keeps one local and writes nothing there; a second
machine reads the bucket's). Then, for N = 2, 4 and 8, N separate `ucpfs mount` processes (one
per simulated node, each with its own mount point and local cache, `--read-only-index`: the
bucket's index, nothing written) each torch.load only
rank N_i's files of the layout tp1_pp1_dpN_zero1 (the weights whole, 1/N of the optimizer state),
all nodes at once:
 - what each node's S3 client GETs (stats.json s3.bytes_get, from before its loads to after) is
   within 10 % of what `ucpfs plan` says its rank reads, and so is the sum over the nodes; the
   node's whole GET count, mount start included, is too;
 - per object (stats.json s3.object_bytes_get): no node GETs more of an object than its rank
   needs of it (10 % slack), so none downloads the whole shard of which it needs only part;
 - the loaded views are the live job's state: every rank's model.pt equals the model, and the
   ranks' optimizer partitions, concatenated, are the model's parameters and Adam moments
   flattened in parameter order;
 - the nodes wrote nothing to the bucket and built no index of their own.
`ucpfs verify s3://...` checks the bucket's index (current). Last, the catalog in the bucket is
tampered with: a read-only user and `verify` refuse it (naming it and the hash), a writable
`ucpfs index` rebuilds it and writes it back.

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


@contextlib.contextmanager
def node_cache(work, name):
    """A node's own local cache (XDG_CACHE_HOME: where ucpfs keeps its copy of the bucket's
    index), as on a machine of its own."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = os.path.join(work, "cache", name)
    try:
        yield os.environ["XDG_CACHE_HOME"]
    finally:
        if old is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = old


def bucket_index_objects(fs, url):
    """The objects under PREFIX/.ucpfs/ with their ETags."""
    d = url.removeprefix("s3://") + "/.ucpfs"
    fs.invalidate_cache()
    return {o["name"].rsplit("/", 1)[1]: o["ETag"] for o in fs.ls(d, detail=True)} if fs.exists(d) else {}


def local_builds(cache):
    """Catalogs ucpfs built locally in a node's cache (not the copies of the bucket's)."""
    return [r for r, _, fs in os.walk(cache) if "data.mdb" in fs and "from-bucket" not in r]


def check_nodes(n, url, work, model, opt, fs):
    layout = f"tp1_pp1_dp{n}_zero1"
    with node_cache(work, f"n{n}-planner"):
        plan = json.loads(run([ucpfs_bin(), "plan", url, f"--layout={layout}", "--json", "--read-only-index"]).stdout)
    sizes = {f["path"]: f["size"] for f in plan["source_files"]}
    prefix = url + "/"
    in_bucket = bucket_index_objects(fs, url)
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        mounts = []
        for i in range(n):  # each node its own cache, the bucket's index read-only
            with node_cache(work, f"n{n}-node{i}"):
                mounts.append(stack.enter_context(mounted(url, os.path.join(work, f"n{n}-node{i}"),
                                                          f"--layout={layout}", "--read-only-index"))[0])
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
    assert bucket_index_objects(fs, url) == in_bucket, "a node with --read-only-index wrote to the bucket's .ucpfs/"
    for i in range(n):
        cache = os.path.join(work, "cache", f"n{n}-node{i}")
        assert not local_builds(cache), f"node {i} built an index of its own: {local_builds(cache)}"
        assert any("from-bucket" in r for r, _, _ in os.walk(cache)), f"node {i} has no copy of the bucket's index"
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


def index_json(url, *extra):
    return json.loads(run([ucpfs_bin(), "index", url, "--json", "-q", *extra]).stdout)


def check_index_in_bucket(fs, url, work):
    """`ucpfs index s3://...` builds once and writes the index next to the data; --index-dir keeps
    one local and writes nothing to the bucket."""
    with node_cache(work, "local-only"):
        local = index_json(url, "--index-dir", os.path.join(work, "index-local"))
    assert "bucket_index" not in local and bucket_index_objects(fs, url) == {}, "--index-dir wrote to the bucket"
    t0 = time.monotonic()
    with node_cache(work, "builder"):
        built = index_json(url)
    objects = bucket_index_objects(fs, url)
    assert built["bucket_index"]["uploaded"] and not built["bucket_index"]["from_bucket"], built
    assert "index.json" in objects and len(objects) == 2, objects
    with node_cache(work, "second"):  # another machine: the bucket's index, nothing written
        again = index_json(url, "--read-only-index")
    assert again["bucket_index"]["from_bucket"] and again["index_state"] == "reused", again
    assert bucket_index_objects(fs, url) == objects
    with node_cache(work, "verifier"):  # verify checks the index a mount would use: the bucket's
        v = run([ucpfs_bin(), "verify", url, "--json", "-q"], check=False)
    assert v.returncode == 0 and json.loads(v.stdout)["index"] == "current", v.stdout + v.stderr
    assert bucket_index_objects(fs, url) == objects, "verify wrote to the bucket"
    print(f"index built once and kept in the bucket ({sorted(objects)}): {time.monotonic() - t0:.2f} s", flush=True)


def check_bad_bucket_index(fs, url, work):
    """A catalog in the bucket whose bytes are not its manifest's is refused read-only (naming
    it), and a writable `ucpfs index` rebuilds and replaces it."""
    objects = bucket_index_objects(fs, url)
    data = next(k for k in objects if k.endswith(".mdb"))
    key = url.removeprefix("s3://") + "/.ucpfs/" + data
    raw = bytearray(fs.cat(key))
    raw[len(raw) // 2] ^= 0xFF
    fs.pipe(key, bytes(raw))
    tampered = bucket_index_objects(fs, url)[data]
    with node_cache(work, "tampered"):
        p = run([ucpfs_bin(), "plan", url, "--layout=tp1_pp1_dp2_zero1", "--read-only-index"], check=False)
    assert p.returncode != 0 and data in p.stderr and "hash" in p.stderr, p.stderr
    with node_cache(work, "tampered-verify"):
        v = run([ucpfs_bin(), "verify", url, "--json", "-q"], check=False)
    assert v.returncode != 0 and "bucket" in json.loads(v.stdout)["index"] and data in v.stdout, v.stdout + v.stderr
    with node_cache(work, "repair"):
        fixed = index_json(url)
    assert fixed["bucket_index"]["uploaded"] and "hash" in fixed["bucket_index"]["warning"], fixed
    after = bucket_index_objects(fs, url)
    assert after.get(data) != tampered, after  # the same name (same source, same catalog), good bytes again
    with node_cache(work, "after-repair"):
        assert index_json(url, "--read-only-index")["bucket_index"]["from_bucket"]
    print(f"tampered {data}: refused read-only ({p.stderr.strip().splitlines()[-1][:160]}...), rebuilt", flush=True)


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
            res.check("the index is built once and kept in the bucket", lambda: check_index_in_bucket(fs, url, work))
            for n in NODE_COUNTS:
                res.check(f"{n} nodes read only their bytes",
                          lambda n=n: check_nodes(n, url, work, model, opt, fs))
            res.check("a bucket index that does not check out is refused, then rebuilt",
                      lambda: check_bad_bucket_index(fs, url, work))
    finally:
        s3_common.remove_bucket(fs, bucket)
    res.finish()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
