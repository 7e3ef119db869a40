"""End-to-end: torch.distributed.checkpoint saves into a real FUSE mount (issue 10), torch >= 2.6.

Gloo ranks on CPU (spawned processes, driven step by step from this process through queues)
hold a small model sharded with FSDP2 (fully_shard; an uneven 509-row embedding, two 512x2048
linears: about 15 MiB per rank file at 2 ranks, so files span several 8 MiB capture chunks) and
its Adam state, and save {"model": get_model_state_dict, "optimizer": get_optimizer_state_dict,
"train_state": {"step"}} with DCP at the root of a mount (the mount indexes SRC's root), and the
same state into a plain directory:
 1. dcp.save from 2 and from 4 ranks into a mount of an empty directory: as soon as dcp.save
    returns (no sync: DCP fsyncs every file and renames .metadata.tmp, which makes everything
    closed before durable), SRC holds the files of the plain save, every .distcp byte-identical;
    .metadata differs only in storage_meta (checkpoint_id is the path saved to, save_id a fresh
    uuid4 per save), so it is compared unpickled (equal but for storage_meta, and byte-identical
    once pickled with the plain save's storage_meta); the views appear without a remount (every
    atomic/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt equals the gathered full tensors, bit for
    bit); dcp.load from the mount path gives every rank its live shards.
 2. dcp.async_save(...).result() the same way (2 ranks), then one more training step and a
    second async_save over the first, into the same mount and into a mount of a run directory
    (a copy of the first save): SRC equals the plain directory saved over the same way, the
    views switch to the new values without a remount, and dcp.load from the mount gives the new
    state. Readers that opened a view file of the first generation before the second save (one
    having read a little, one not at all; the kernel's cached pages dropped with fadvise) still
    read the first save's values; so does a reader in the run directory's mount, where no view
    had been read before (its own check). Then a dcp.save over a served checkpoint whose rank 1
    writes STRAGGLER_S after rank 0: a reader polling every atomic file meanwhile sees each hold
    the old values or the new ones, never a mix of the two saves.
 3. kill -9 of the daemon at many points of a multi-file save: each iteration (seeded; the seed
    is printed, UCPFS_TEST_SEED reproduces the choices, not the timing) writes 8 shards with
    torch.save through the mount, fsyncs some of them (some held open a while after their
    fsync), then writes the pointer file `latest` last, while the daemon is killed as the writer
    starts, while a fsynced shard is still open, once everything is closed, or after a random
    delay. The next mount recovers; then no shard or `latest` is torn (absent or byte-exact),
    `latest` is present only with all 8 shards, every file whose fsync returned success before
    the kill is present and exact, and no .part is left.

Run by hand: UCPFS_BIN=build/cli/ucpfs .venv/bin/python tests/e2e/dcp_save_into_mount_test.py
"""
import collections
import dataclasses
import io
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings

import torch

from e2e_common import Results, TORCH_VERSION, seeded_rng, tmpdir
from mount_common import FIXTURES, capture_parts, expected_atomic, is_mounted, mounted, status, step_equal

sys.path.insert(0, FIXTURES)
from rendezvous import TcpRendezvous, rank_env  # noqa: E402

NAME = "dcp_save_into_mount"
VOCAB, DIM, HIDDEN = 509, 512, 2048  # 509 rows: uneven FSDP2 shards at 4 ranks
MODEL_SEED = 5
CACHE = ("--cache-size", "256M")
VIEW_TIMEOUT_S = 30
RANK_TIMEOUT_S = 120
# Longer than the reindexer's quiet spell (200 ms) plus the 1 s the mount's root names are cached.
STRAGGLER_S = 2.5


# ---------------------------------------------------------------------------------------------
# The ranks (run in spawned processes)

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.up = torch.nn.Linear(DIM, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, DIM)
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(self.norm(h))


def train_step(model, opt, step):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=g)
    opt.zero_grad()
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()


def rank_main(rank, world, port, cmds, replies):
    """One gloo rank: builds and trains the FSDP2 model, then runs commands until "quit"."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # DCP warns when it overwrites a checkpoint (part 2 does)
    rank_env(rank, world, port)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(MODEL_SEED)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for m in (model.up, model.down):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = 0
    for _ in range(2):
        train_step(model, opt, step)
        step += 1

    def state():
        return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt),
                "train_state": {"step": step}}

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().contiguous()

    while True:
        cmd = cmds.get()
        if cmd[0] == "quit":
            break
        try:
            t0 = time.monotonic()
            info = None
            if cmd[0] == "save":  # ("save", path, "sync" | "async" | "straggler")
                if cmd[2] == "straggler":  # rank 1 starts writing its files STRAGGLER_S late
                    class Straggler(dcp.FileSystemWriter):
                        def write_data(self, plan, planner):
                            if rank == 1:
                                time.sleep(STRAGGLER_S)
                            return super().write_data(plan, planner)
                    dcp.save(state(), storage_writer=Straggler(cmd[1]))
                elif cmd[2] == "async":
                    dcp.async_save(state(), checkpoint_id=cmd[1]).result()
                else:
                    dcp.save(state(), checkpoint_id=cmd[1])
            elif cmd[0] == "train":
                train_step(model, opt, step)
                step += 1
            elif cmd[0] == "truth":  # ("truth", path): rank 0 writes {flat key: full tensor}
                flat, _ = flatten_state_dict(state())
                full = collections.OrderedDict(
                    (k, v.full_tensor().detach().clone() if isinstance(v, DTensor) else v.detach().clone())
                    for k, v in flat.items() if isinstance(v, torch.Tensor))
                if rank == 0:
                    torch.save(full, cmd[1])
            elif cmd[0] == "load":  # ("load", path): dcp.load into zeroed copies, compare with live
                live = state()
                into = tree_map(lambda v: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v, live)
                into["train_state"]["step"] = -1
                dcp.load(into, checkpoint_id=cmd[1])
                a, _ = flatten_state_dict(into)
                b, _ = flatten_state_dict(live)
                assert list(a) == list(b)
                n = 0
                for k in b:
                    if isinstance(b[k], torch.Tensor):
                        x, y = local(a[k]), local(b[k])
                        assert x.dtype == y.dtype and x.shape == y.shape, k
                        assert torch.equal(x.view(torch.int32) if x.dtype == torch.float32 else x,
                                           y.view(torch.int32) if y.dtype == torch.float32 else y), \
                            f"rank {rank}: {k} loaded from {cmd[1]} differs"
                        n += 1
                    else:
                        assert a[k] == b[k], (k, a[k], b[k])
                info = n
            else:
                raise ValueError(f"unknown command {cmd}")
            replies.put((rank, True, (time.monotonic() - t0, info)))
        except BaseException:  # noqa: BLE001 - reported to the driver, which stops every rank
            replies.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads may abort the interpreter's teardown (gen_llama_train.leave_rank)


class Ranks:
    """`world` spawned gloo ranks; do(cmd) runs a command on all of them and waits (bounded)."""

    def __init__(self, world):
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.world = world
        self.broken = False
        self.cmds = [ctx.Queue() for _ in range(world)]
        self.replies = ctx.Queue()
        self.rdzv = TcpRendezvous()  # kept until the ranks exit: new process groups meet at its store
        self.procs = [ctx.Process(target=rank_main, args=(r, world, self.rdzv.port, self.cmds[r], self.replies),
                                  daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def do(self, *cmd, timeout_s=RANK_TIMEOUT_S):
        """Every rank's answer {rank: (seconds, info)}. A failure is raised once every rank has
        answered (10 s more at most); ranks that do not answer (stuck in a collective) make
        later commands fail at once instead of each waiting out its timeout."""
        if self.broken:
            raise AssertionError(f"{cmd}: not run, the ranks are stuck since an earlier failure")
        for q in self.cmds:
            q.put(cmd)
        deadline = time.monotonic() + timeout_s
        got, failed = {}, None
        while len(got) < self.world:
            try:
                rank, ok, info = self.replies.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.broken = True
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                raise AssertionError(f"{cmd}: no answer from ranks {sorted(set(range(self.world)) - set(got))} "
                                     f"within {timeout_s} s (exited: {dead}){failed or ''}") from None
            got[rank] = info
            if not ok and failed is None:
                failed = f"\n{cmd} failed on rank {rank}:\n{info}"
                deadline = min(deadline, time.monotonic() + 10)
        if failed:
            raise AssertionError(failed.strip())
        return got

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for q in self.cmds:
            q.put(("quit",))
        deadline = time.monotonic() + 20
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        self.rdzv.close()


# ---------------------------------------------------------------------------------------------
# Checks on the driver's side

def files_under(d):
    """Relative paths of the files beneath d, .ucpfs/ (the capture's own directory) left out."""
    out = []
    for r, dirs, fs in os.walk(d):
        if r == d and ".ucpfs" in dirs:
            dirs.remove(".ucpfs")
        out += [os.path.relpath(os.path.join(r, f), d) for f in fs]
    return sorted(out)


def metadata_equal(got_path, want_path, got_id, want_id):
    """DCP's .metadata of two saves of the same state: byte-different only through
    storage_meta (checkpoint_id = the path saved to, save_id = a uuid4 per save); everything
    else equal after unpickling."""
    got = pickle.load(open(got_path, "rb"))
    want = pickle.load(open(want_path, "rb"))
    assert str(got.storage_meta.checkpoint_id) == got_id, (got.storage_meta, got_id)
    assert str(want.storage_meta.checkpoint_id) == want_id, (want.storage_meta, want_id)
    assert got.storage_meta.save_id != want.storage_meta.save_id  # fresh per save
    assert dataclasses.replace(got, storage_meta=None) == dataclasses.replace(want, storage_meta=None), \
        f"{got_path}: metadata differs from {want_path} beyond storage_meta"
    # And byte for byte once storage_meta is the same object: nothing else differs.
    same = dataclasses.replace(got, storage_meta=want.storage_meta)
    return pickle.dumps(same) == open(want_path, "rb").read()


def src_equals_plain(src, plain, mnt):
    """SRC (saved through the mount at mnt) against the plain save; returns a short summary."""
    got, want = files_under(src), files_under(plain)
    assert got == want, f"SRC {got} != plain {want}"
    n_distcp, md_bytes = 0, None
    for f in want:
        a, b = os.path.join(src, f), os.path.join(plain, f)
        if f.endswith(".metadata"):
            md_bytes = metadata_equal(a, b, mnt, plain)
        else:
            assert open(a, "rb").read() == open(b, "rb").read(), f"{f}: SRC differs from the plain save"
            n_distcp += f.endswith(".distcp")
    assert n_distcp and md_bytes is not None, want
    return n_distcp, md_bytes


def atomic_equal(mnt, truth):
    """Every atomic file of the mount equals the truth; returns how many were compared."""
    want = expected_atomic(truth)
    got = sorted(os.listdir(os.path.join(mnt, "atomic")))
    assert got == sorted(want), f"atomic/: {got} != {sorted(want)}"
    n = 0
    for param, files in want.items():
        d = os.path.join(mnt, "atomic", param)
        assert sorted(os.listdir(d)) == sorted(files), f"{param}: {os.listdir(d)}"
        for name, t in files.items():
            obj = torch.load(os.path.join(d, name))
            if name == "step.pt":
                step_equal(obj, t, f"atomic/{param}/{name}")
            else:
                assert list(obj)[-1] == "param", f"{param}/{name}: {list(obj)}"
                same_bits(obj["param"], t, f"atomic/{param}/{name}")
            n += 1
    return n


def same_bits(a, b, what):
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape, \
        f"{what}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)), f"{what}: values differ"


def wait_views(mnt, truth, timeout_s=VIEW_TIMEOUT_S):
    """Polls until the mount's atomic views equal the truth (no remount); returns (n, seconds)."""
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout_s:
        try:
            return atomic_equal(mnt, truth), time.monotonic() - t0
        except (AssertionError, OSError, RuntimeError, KeyError, pickle.UnpicklingError) as e:
            last = e
        time.sleep(0.1)
    raise AssertionError(f"{mnt}: views not equal to the saved state after {timeout_s} s: {last}")


def wait_generation(mnt, after, timeout_s=10):
    """The generation status.json reports once it is past `after` (the mount's root names are
    cached for 1 s, so .ucpfs/ may show the previous generation that long)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = status(mnt)
        if st["generation"] > after or time.monotonic() > deadline:
            assert st["generation"] > after, f"{mnt}: still generation {st['generation']} after {timeout_s} s"
            return st


def sync(mnt):
    with open(os.path.join(mnt, ".ucpfs", "sync"), "rb") as f:
        f.read()


def save_into_mount(work, ranks, label, mode="sync"):
    """One save of the ranks' state into a plain directory and at the root of a mount of an
    empty directory; the checks of part 1. Returns a summary."""
    src, plain, mnt = (os.path.join(work, f"{label}-{x}") for x in ("src", "plain", "mnt"))
    os.makedirs(src)
    truth_path = os.path.join(work, f"{label}-truth.pt")
    ranks.do("truth", truth_path)
    truth = torch.load(truth_path)
    ranks.do("save", plain, mode)
    with mounted(src, mnt, *CACHE) as (m, _):
        assert status(m)["format"] == "none", status(m)
        took = max(t for t, _ in ranks.do("save", m, mode).values())
        # No sync: DCP fsynced every file and renamed .metadata.tmp (durable first).
        n_distcp, md_bytes = src_equals_plain(src, plain, m)
        n_atomic, view_s = wait_views(m, truth)
        n_loaded = sum(n for _, n in ranks.do("load", m).values())
        st = wait_generation(m, 1)
        assert st["format"] != "none", st
        gen = st["generation"]
    return (f"{label}: {n_distcp} .distcp byte-identical, .metadata equal but for storage_meta "
            f"({'then byte-identical' if md_bytes else 'pickled differently'}); {n_atomic} atomic files "
            f"{view_s:.2f} s after the save (generation {gen}); dcp.load from the mount: {n_loaded} "
            f"shards; save {took:.2f} s")


def read_all(fd):
    chunks, off = [], 0
    while True:
        b = os.pread(fd, 1 << 20, off)
        if not b:
            return b"".join(chunks)
        chunks.append(b)
        off += len(b)


def old_reader_reads(fd, want, what):
    """A reader of a replaced generation's view file: the kernel's cached pages are dropped
    first (fadvise), so the daemon answers the reads."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        data = read_all(fd)
    except OSError as e:
        raise AssertionError(f"old reader of {what} after the swap: {e}") from None
    same_bits(torch.load(io.BytesIO(data))["param"], want, f"old reader of {what}")


def async_then_save_over(work, ranks, run_dir_reader):
    """Part 2: async_save into an empty mount, then a second async_save over it (and over a
    mounted run directory): views switch, old readers keep theirs. The outcome of the run
    directory's reader, whose generation had never been read, goes into run_dir_reader."""
    src, plain, mnt = (os.path.join(work, f"async-{x}") for x in ("src", "plain", "mnt"))
    run_src, run_mnt = os.path.join(work, "async-rundir"), os.path.join(work, "async-rundir-mnt")
    os.makedirs(src)
    ranks.do("truth", os.path.join(work, "async-truth1.pt"))
    truth1 = torch.load(os.path.join(work, "async-truth1.pt"))
    want1 = expected_atomic(truth1)
    ranks.do("save", plain, "async")
    notes = []
    with mounted(src, mnt, *CACHE) as (m, _):
        ranks.do("save", m, "async")
        n_distcp, _ = src_equals_plain(src, plain, m)
        n_atomic, view_s = wait_views(m, truth1)
        ranks.do("load", m)
        notes.append(f"async_save: {n_distcp} .distcp identical, {n_atomic} atomic files after {view_s:.2f} s")
        gen1 = wait_generation(m, 1)["generation"]
        shutil.copytree(plain, run_src)
        with mounted(run_src, run_mnt, *CACHE) as (rm, _):
            # Readers of the first generation, opened before the second save: one has read the
            # start of its file, one has not (the mount's own reads above opened the sources);
            # in the run directory's mount nothing was ever read.
            p, q = sorted(want1)[0], sorted(want1)[-1]
            readers = [(os.open(os.path.join(m, "atomic", p, "fp32.pt"), os.O_RDONLY), want1[p]["fp32.pt"],
                        f"atomic/{p}/fp32.pt (read a little before)"),
                       (os.open(os.path.join(m, "atomic", q, "exp_avg.pt"), os.O_RDONLY), want1[q]["exp_avg.pt"],
                        f"atomic/{q}/exp_avg.pt (opened before)")]
            fresh = os.open(os.path.join(rm, "atomic", p, "exp_avg_sq.pt"), os.O_RDONLY)
            try:
                assert len(os.pread(readers[0][0], 100, 0)) == 100
                ranks.do("train")
                ranks.do("truth", os.path.join(work, "async-truth2.pt"))
                truth2 = torch.load(os.path.join(work, "async-truth2.pt"))
                ranks.do("save", plain, "async")  # over the first, as into the mounts
                ranks.do("save", m, "async")
                ranks.do("save", rm, "async")
                src_equals_plain(src, plain, m)
                src_equals_plain(run_src, plain, rm)
                n2, view2_s = wait_views(m, truth2)
                wait_views(rm, truth2)
                gen2 = wait_generation(m, gen1)["generation"]
                for fd, want, what in readers:
                    old_reader_reads(fd, want, what)
                try:
                    old_reader_reads(fresh, want1[p]["exp_avg_sq.pt"], f"atomic/{p}/exp_avg_sq.pt (run dir)")
                    run_dir_reader["error"] = None
                except AssertionError as e:
                    run_dir_reader["error"] = str(e)
                ranks.do("load", m)
                ranks.do("load", rm)
            finally:
                for fd, _, _ in readers:
                    os.close(fd)
                os.close(fresh)
    notes.append(f"second async_save over the first: SRC identical to the plain save over, {n2} atomic "
                 f"files switched in {view2_s:.2f} s (generation {gen1} -> {gen2}); {len(readers)} old readers "
                 f"read the first save's values")
    return "; ".join(notes)


def straggler_save_over(work, ranks):
    """A dcp.save over a served checkpoint (a mount of the run directory part 2 saved into)
    whose rank 1 writes its file STRAGGLER_S after rank 0: a reader polling the views meanwhile
    sees each atomic file hold the old values or the new ones, never a mix of the two saves."""
    src, mnt = os.path.join(work, "async-src"), os.path.join(work, "straggler-mnt")
    ranks.do("truth", os.path.join(work, "straggler-old.pt"))
    old = expected_atomic(torch.load(os.path.join(work, "straggler-old.pt")))
    with mounted(src, mnt, *CACHE) as (m, _):
        wait_views(m, torch.load(os.path.join(work, "straggler-old.pt")))
        ranks.do("train")
        ranks.do("truth", os.path.join(work, "straggler-new.pt"))
        new = expected_atomic(torch.load(os.path.join(work, "straggler-new.pt")))
        seen, stop = collections.Counter(), threading.Event()
        bad = []

        def poll():
            while not stop.is_set():
                for param in sorted(old):
                    what = f"atomic/{param}/fp32.pt"
                    try:
                        got = torch.load(os.path.join(m, "atomic", param, "fp32.pt"))["param"]
                    except Exception as e:  # noqa: BLE001 - every failure is a finding
                        bad.append(f"{what}: {type(e).__name__}: {e}")
                        continue
                    if torch.equal(got, old[param]["fp32.pt"]):
                        seen["old"] += 1
                    elif torch.equal(got, new[param]["fp32.pt"]):
                        seen["new"] += 1
                    else:
                        seen["mixed"] += 1
                        bad.append(f"{what}: neither the old nor the new save's values")

        reader = threading.Thread(target=poll, daemon=True)
        reader.start()
        try:
            ranks.do("save", m, "straggler")
            n, view_s = wait_views(m, torch.load(os.path.join(work, "straggler-new.pt")))
        finally:
            stop.set()
            reader.join(30)
        assert seen["old"] and seen["new"], seen
        assert not bad, f"{len(bad)} bad reads ({dict(seen)}), first: {bad[:3]}"
    return f"straggler save: {dict(seen)} reads of the views during the save, all old or new"


# ---------------------------------------------------------------------------------------------
# Part 3: kill -9 during a multi-file save

N_SHARDS = 8
KILL_MODES = ("start", "held", "after", "random")


def shard_state(seed, i):
    g = torch.Generator().manual_seed(seed * 100 + i)
    rows = 256 + 64 * (i % 4)
    return {f"block{i}.{j}.weight": torch.randn(rows, 1024, generator=g) for j in range(3)}


def torch_save_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def daemon_pid(src, mnt):
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 3 and argv[1] == b"mount" and argv[2:4] == [src.encode(), mnt.encode()]:
            return int(pid)
    raise AssertionError(f"no daemon serving {mnt}")


class Writer(threading.Thread):
    """Saves the shards (torch.save into open files), fsyncing those in `fsync`, then `latest`."""

    def __init__(self, d, objs, fsync, hold_open_s, latest):
        super().__init__(daemon=True)
        self.d, self.objs, self.fsync, self.hold, self.latest = d, objs, fsync, hold_open_s, latest
        self.synced, self.closed, self.error = [], [], None
        self.holding = threading.Event()  # set while a file is held open after its fsync

    def run(self):
        try:
            for name, obj in self.objs.items():
                with open(os.path.join(self.d, name), "wb") as f:
                    torch.save(obj, f)
                    f.flush()
                    if name in self.fsync:
                        os.fsync(f.fileno())
                        self.synced.append(name)  # success, before the kill (if any)
                        if name in self.hold:
                            self.holding.set()
                            time.sleep(self.hold[name])
                            self.holding.clear()
                self.closed.append(name)
            with open(os.path.join(self.d, "latest"), "w") as f:
                f.write(self.latest)
                f.flush()
                if "latest" in self.fsync:
                    os.fsync(f.fileno())
                    self.synced.append("latest")
            self.closed.append("latest")
        except Exception as e:  # noqa: BLE001 - OSError, or torch.save's RuntimeError once the daemon is gone
            self.error = e


def check_recovered(src, d, wants, synced):
    """After recovery: nothing torn, latest never ahead of its shards, fsynced files present."""
    present = {}
    for name, data in wants.items():
        p = os.path.join(src, d, name)
        if os.path.exists(p):
            got = open(p, "rb").read()
            assert got == data, f"{d}/{name} is torn: {len(got)} bytes, want {len(data)}"
            present[name] = True
    shards = [n for n in wants if n != "latest" and n in present]
    if "latest" in present:
        assert len(shards) == N_SHARDS, f"{d}/latest is there with only {shards}"
    lost = [n for n in synced if n not in present]
    assert not lost, f"{d}: fsync returned success for {lost}, absent after recovery"
    parts = capture_parts(src)
    assert not parts, f"left over: {parts}"
    return len(shards), "latest" in present


def kill_during_saves(work, rng, iterations=16, budget_s=75):
    src, mnt = os.path.join(work, "kill-src"), os.path.join(work, "kill-mnt")
    os.makedirs(src)
    seed = rng.randrange(1 << 30)
    objs = collections.OrderedDict((f"shard_{i}.pt", shard_state(seed, i)) for i in range(N_SHARDS))
    wants = collections.OrderedDict((n, torch_save_bytes(o)) for n, o in objs.items())
    t_start = time.monotonic()
    pending = None  # (dir, wants, synced) of the iteration whose daemon was killed
    outcomes, duration = [], None
    it = -1
    while True:
        it += 1
        with mounted(src, mnt, "--cache-size", "64M") as (m, _):
            if pending is not None:  # this mount recovered what the killed daemon left
                outcomes[-1]["result"] = check_recovered(src, *pending)
            if it > iterations or time.monotonic() - t_start > budget_s:
                break
            d = f"it{it:02d}"
            os.mkdir(os.path.join(m, d))
            w_wants = dict(wants, latest=d.encode())
            if it == 0:  # calibration: no kill; every file durable after sync
                w = Writer(os.path.join(m, d), objs, {"shard_3.pt"}, {}, d)
                t0 = time.monotonic()
                w.start()
                w.join(60)
                duration = time.monotonic() - t0
                assert not w.is_alive() and w.error is None, w.error
                sync(m)
                outcomes.append({"it": it, "kill_after_s": None, "synced": w.synced, "closed": len(w.closed)})
                pending = (d, w_wants, list(wants) + ["latest"])
                continue
            # When the daemon dies: as the writer starts, while a shard it fsynced is still open,
            # once everything is closed, or after a random delay (each of the first three once).
            mode = KILL_MODES[it - 1] if it <= len(KILL_MODES) else rng.choices(KILL_MODES, (1, 2, 2, 5))[0]
            fsync = {n for n in list(wants) + ["latest"] if rng.random() < 0.35}
            hold = {}
            if mode == "held" or (fsync and rng.random() < 0.3):  # a shard held open after its fsync
                held = rng.choice(sorted(set(fsync) - {"latest"}) or list(wants))
                fsync.add(held)
                hold[held] = 0.5 if mode == "held" else 0.2
            pid = daemon_pid(src, mnt)
            w = Writer(os.path.join(m, d), objs, fsync, hold, d)
            t0 = time.monotonic()
            w.start()
            if mode == "held":
                assert w.holding.wait(30), "the writer never held its fsynced shard"
                time.sleep(0.05)
            elif mode == "after":
                w.join(60)
            elif mode == "random":
                time.sleep(rng.uniform(0, duration * 1.2 + sum(hold.values())))
            delay = time.monotonic() - t0
            os.kill(pid, signal.SIGKILL)
            w.join(30)
            alive = w.is_alive()
            subprocess.run(["umount", "-l", mnt], capture_output=True)
            assert not alive, "the writer hangs after the daemon was killed"
            outcomes.append({"it": it, "mode": mode, "kill_after_s": round(delay, 3), "fsync": sorted(fsync),
                             "hold": hold,
                             "synced": list(w.synced), "closed": len(w.closed),
                             "error": type(w.error).__name__ if w.error else None})
            pending = (d, w_wants, list(w.synced))
    for o in outcomes:
        print(f"{NAME}: kill iteration {o}", flush=True)
    killed = [o for o in outcomes if o["kill_after_s"] is not None]
    assert len(killed) >= 8, f"only {len(killed)} kill iterations in {budget_s} s"
    during = sum(1 for o in killed if 0 < o["closed"] < N_SHARDS + 1)
    modes = collections.Counter(o["mode"] for o in killed)
    return (f"seed {seed}: {len(killed)} kills {dict(modes)} (files closed before each kill: "
            f"{sorted(o['closed'] for o in killed)}; {during} mid-save), every recovery whole")


def main():
    if TORCH_VERSION < (2, 6):
        sys.exit(f"{NAME}: needs torch >= 2.6 (dcp.async_save, FSDP2), this is {torch.__version__}")
    rng = seeded_rng(NAME)
    res = Results(NAME)
    t0 = time.monotonic()
    with tmpdir("ucpfs-dcp-into-mount-") as work:
        def report(label, fn):
            def run_it():
                out = fn()
                print(f"{NAME}: {out}", flush=True)
            res.check(label, run_it)

        with Ranks(2) as ranks:
            report("dcp.save from 2 ranks into an empty mount: SRC identical, views without remount, dcp.load",
                   lambda: save_into_mount(work, ranks, "save2"))
            run_dir_reader = {"error": "not run"}
            report("dcp.async_save, then a second save over it: views switch, old readers keep old bytes",
                   lambda: async_then_save_over(work, ranks, run_dir_reader))

            def never_read():
                assert run_dir_reader["error"] is None, run_dir_reader["error"]
                return "the run directory's reader read the first save's values"
            report("a reader of a generation none of whose sources had been read keeps old bytes after a save over it",
                   never_read)
            report("a save over a served checkpoint with a straggling rank: views never mix the two saves",
                   lambda: straggler_save_over(work, ranks))
        with Ranks(4) as ranks:
            report("dcp.save from 4 ranks into an empty mount: SRC identical, views without remount, dcp.load",
                   lambda: save_into_mount(work, ranks, "save4"))
        report("kill -9 during torch.save of 8 shards + latest: nothing torn, latest last, fsynced kept",
               lambda: kill_during_saves(work, rng))
        leftover = [p for p in os.listdir(work) if p.endswith("mnt") and is_mounted(os.path.join(work, p))]
        assert not leftover, leftover
    print(f"{NAME}: {time.monotonic() - t0:.1f} s", flush=True)
    res.finish()


if __name__ == "__main__":
    main()
