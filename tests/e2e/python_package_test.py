"""The Python package (pyproject.toml, python/): built as a wheel and used as a new user would.

  wheel  Builds the wheel (`pip wheel .`, scikit-build-core and nanobind from PyPI in pip's
         isolated build environment; its CMake build directory .build-python/ is kept, so a
         rebuild compiles only what changed, and it compiles through ccache when installed, so
         a fresh clone's build reuses the last one's objects) and installs it into a fresh venv
         with no torch:
         the `ucpfs` command runs, `import ucpfs` works, torch is not there, the extension
         needs no libfuse3 and every library it needs resolves. The wheel is also installed
         with `pip install --target` for the `views` test (the shared venv's torch 2.13 then
         imports it; nothing is installed into the shared venv).
  views  As the unprivileged user nobody, in a mount namespace where /dev/fuse is /dev/null,
         `ucpfs.open(SRC)` of a DeepSpeed ZeRO-2 save and a Megatron-Core tp 2 save serves every
         file of two target layouts; then, as root, `ucpfs.mount(SRC, MNT)` of the same SRC:
         every file is equal byte for byte to the mount's, torch.load of the file object
         (safetensors.torch.load of its bytes) equals torch.load (safetensors' load_file) of the
         mount's file, and the listings are the mount's. A mount that
         fails raises MountError with the daemon's text. Materialised as nobody too: a
         Megatron-Core Llama save's (fixture megatron_llama) `.hf.materialize(DIR)`, which
         AutoModelForCausalLM.from_pretrained(DIR) loads with logits equal bit for bit to
         from_pretrained(MNT/hf) of the mount (and to the live job's), and a target model.pt's
         `.materialize(PATH)`, which torch.load(PATH, mmap=True) loads equal to the mount's; a
         second materialize reuses the files, and one after the source changed writes them anew.

Usage (ctest runs both, `views` after `wheel`):
  python3 python_package_test.py wheel
  .venv/bin/python python_package_test.py views
"""
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)


def package_site():
    """The directory the `ucpfs` package is imported from: UCPFS_PYTHON_PACKAGE (an in-tree
    build's <build>/python/pkg), else the wheel test's --target install."""
    site = os.environ.get("UCPFS_PYTHON_PACKAGE")
    if site:
        return site
    site = os.path.join(package_dir(), "site")
    assert os.path.isdir(site), f"{site}: run the wheel test first (ctest -R e2e_python_wheel)"
    return site


def package_dir():
    """Where the wheel test leaves the wheel, the fresh venv and the --target install."""
    tools = os.environ.get("UCPFS_TOOLS_DIR")
    if not tools:
        sys.exit("UCPFS_TOOLS_DIR is not set (run through ctest, or export it)")
    return os.path.join(os.path.dirname(tools), "python-package")


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", **kw)
    if p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}")
    return p


def wheel_build_env():
    """pip's environment for the wheel build. With ccache installed (tests/install-deps.sh installs
    it), CMake compiles through it as tests/build.sh does (CMake takes the launcher from these
    variables at the build directory's first configure), paths hashed relative to the clone: a
    fresh clone's first wheel build, as in CI, reuses the objects of the last one instead of
    compiling the whole Release build again."""
    env = dict(os.environ)
    if shutil.which("ccache"):
        env.update(CMAKE_C_COMPILER_LAUNCHER="ccache", CMAKE_CXX_COMPILER_LAUNCHER="ccache",
                   CCACHE_BASEDIR=ROOT, CCACHE_NOHASHDIR="1")
    return env


def wheel_test():
    d = package_dir()
    for sub in ("wheel", "venv", "site"):
        shutil.rmtree(os.path.join(d, sub), ignore_errors=True)
    py = "/usr/bin/python3"  # Debian 12's, as a new user's
    run([py, "-m", "pip", "wheel", "--no-deps", "-w", os.path.join(d, "wheel"), ROOT], timeout=1700,
        env=wheel_build_env())
    wheels = [w for w in os.listdir(os.path.join(d, "wheel")) if w.endswith(".whl")]
    assert len(wheels) == 1, wheels
    wheel = os.path.join(d, "wheel", wheels[0])
    print(f"built {wheels[0]} ({os.path.getsize(wheel) >> 10} KiB)", flush=True)
    venv = os.path.join(d, "venv")
    run([py, "-m", "venv", venv])
    vpy = os.path.join(venv, "bin", "python")
    run([vpy, "-m", "pip", "install", "--no-deps", wheel], timeout=120)
    # The command, the module, and no torch anywhere in the venv.
    out = run([os.path.join(venv, "bin", "ucpfs"), "--version"]).stdout
    assert "ucpfs" in out, out
    # The wheel carries the HTTP(S)-only libcurl the build chose (tests/build-curl.sh), and its
    # binary loads that copy, not the build machine's cache; else the system's.
    curl = [line for line in out.splitlines() if line.startswith("libcurl for s3://: ")]
    assert len(curl) == 1, out
    if curl[0].endswith("(HTTP and HTTPS only)"):
        path = curl[0].split(": ", 1)[1].rsplit(" (", 1)[0]
        assert path.startswith(venv) and path.endswith("/ucpfs/bin/../lib/ucpfs/libcurl.so.4"), out
        assert os.path.isfile(path), path
    else:
        assert curl[0].endswith("the system's libcurl.so.4"), out
    out = run([vpy, "-c", "import importlib.util, ucpfs; print(ucpfs.__file__); "
                          "print(importlib.util.find_spec('torch')); print(ucpfs.binary())"]).stdout.split()
    assert out[0].startswith(venv) and out[1] == "None" and out[2].startswith(venv), out
    # The extension's libraries: no libfuse3 (it never mounts), every one found.
    core = [os.path.join(dp, f) for dp, _, fs in os.walk(venv) for f in fs if f.startswith("_core.")]
    assert len(core) == 1, core
    ldd = run(["ldd", core[0]]).stdout
    assert "not found" not in ldd and "libfuse3" not in ldd, ldd
    print("extension needs:", " ".join(sorted(line.split()[0] for line in ldd.splitlines() if "=>" in line)))
    ldd = run(["ldd", out[2]]).stdout
    assert "not found" not in ldd, ldd
    # A missing system library is named, with the package that has it.
    lmdb = [line.split()[2] for line in run(["ldd", core[0]]).stdout.splitlines() if "liblmdb" in line][0]
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                        f'mount --bind /dev/null "{lmdb}" && exec "{vpy}" -c "import ucpfs"'],
                       capture_output=True, text=True)
    assert p.returncode != 0 and "apt-get install liblmdb0" in p.stderr, p.stderr
    # For the views test under the shared venv's torch.
    run([vpy, "-m", "pip", "install", "--no-deps", "--target", os.path.join(d, "site"), wheel], timeout=120)
    print("python_package wheel: ok", flush=True)


# ---- views: the child, run as nobody with no /dev/fuse ----

def child(out_dir, cases_json):
    os.environ.update(HF_HUB_OFFLINE="1", HF_HOME=os.path.join(out_dir, "hf-home"))
    import safetensors.torch  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import ucpfs  # noqa: PLC0415
    assert os.getuid() != 0 and os.geteuid() != 0, "the child must not run as root"
    assert not os.path.exists("/dev/fuse") or \
        os.stat("/dev/fuse").st_rdev == os.stat("/dev/null").st_rdev, "/dev/fuse is there"
    with open("/proc/self/mounts") as f:
        mounts_before = f.read()
    report = {}
    cases = json.loads(cases_json)
    for name, src, layouts in cases["targets"]:
        v = ucpfs.open(src)
        r = report[name] = {"index_dir": v.index_dir, "root": sorted(v.listdir()),
                            "atomic": sorted(v.atomic.listdir()), "files": {}}
        for layout in layouts:
            t = v.target(layout)
            for rank in sorted(t.listdir()):
                rdir = t.dir(rank)
                for fname in sorted(rdir.listdir()):
                    rel = f"target/{layout}/{rank}/{fname}"
                    with rdir.open(fname) as f:
                        data = f.read()
                        assert f.tell() == len(data) == rdir.stat(fname).st_size, rel
                        # Random seeks and short reads give the same bytes.
                        rng = random.Random(rel)
                        for _ in range(20):
                            at = rng.randrange(len(data) + 1)
                            n = rng.randrange(1, 1 << 16)
                            f.seek(at)
                            assert f.read(n) == data[at:at + n], f"{rel}: bytes at {at}"
                        entry = {"sha256": hashlib.sha256(data).hexdigest(), "n_bytes": len(data)}
                        obj = None
                        if fname.endswith(".pt"):
                            f.seek(0)
                            obj = torch.load(f, weights_only=False)
                        elif fname.endswith(".safetensors"):
                            obj = dict(sorted(safetensors.torch.load(data).items()))  # its order means nothing
                        if obj is not None:
                            dump = os.path.join(out_dir, hashlib.sha256(f"{name}/{rel}".encode()).hexdigest() + ".pt")
                            torch.save(obj, dump)
                            entry["loaded"] = dump
                    r["files"][rel] = entry
        # A source file is a real file: mmap=True through its path.
        sources = [p for p in ("mp_rank_00_model_states.pt", "common.pt") if p in v.listdir()]
        for p in sources:
            e = v / p
            assert e.real_path == os.path.join(v.source_dir, p), e.real_path
            torch.load(e.real_path, mmap=True, weights_only=False)
    report["materialized"] = materialize_child(out_dir, *cases["hf"])
    # Nothing was mounted (other mounts on the machine may come and go: only ours would name SRC).
    with open("/proc/self/mounts") as f:
        mounts = f.read()
    sources = [src for _, src, _ in cases["targets"]] + [cases["hf"][1]]
    assert not any(src in mounts and src not in mounts_before for src in sources), \
        "a mount of SRC was made"
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f)


def materialize_child(out_dir, name, src, layout):
    """As nobody: hf/ materialised, loaded by from_pretrained (its logits on the live job's tokens
    saved); a target model.pt materialised, loaded with mmap=True (saved); then materialised again,
    which must reuse every file."""
    import torch  # noqa: PLC0415
    import ucpfs  # noqa: PLC0415
    v = ucpfs.open(src)
    hf = v.hf.materialize(os.path.join(out_dir, "hf"))
    torch.save(hf_logits(hf, src), os.path.join(out_dir, "hf-logits.pt"))
    torch.save(hf_logits(None, src, v.hf), os.path.join(out_dir, "hf-lazy-logits.pt"))
    rel = f"target/{layout}/rank_0/model.pt"
    pt = v.dir(os.path.dirname(rel))["model.pt"].materialize(os.path.join(out_dir, "model.pt"))
    torch.save(torch.load(pt, mmap=True, weights_only=True), os.path.join(out_dir, "model-mmap.pt"))
    files = {f: file_id(os.path.join(hf, f)) for f in os.listdir(hf) if not f.startswith(".")}
    files["model.pt"] = file_id(pt)
    assert files["model.pt"][2] == hashlib.sha256(v.open(rel).read()).hexdigest(), "model.pt: bytes differ"
    # Again, from a new open of the unchanged source: nothing is written.
    v = ucpfs.open(src)
    v.hf.materialize(hf)
    v.dir(os.path.dirname(rel))["model.pt"].materialize(pt)
    again = {f: file_id(os.path.join(hf, f)) for f in os.listdir(hf) if not f.startswith(".")}
    again["model.pt"] = file_id(pt)
    assert again == files, f"{name}: a second materialize of an unchanged source wrote again: {files} {again}"
    return {"name": name, "hf": hf, "rel": rel, "files": files, "index_dir": v.index_dir}


def hf_logits(hf, src, view=None):
    """The logits of from_pretrained(hf) on the live job's tokens (hf None: of from_pretrained(None,
    config=, state_dict=) with the config and a ucpfs.torch.LazyStateDict of the views' folder
    `view`); the model (which maps hf's safetensors files: a mount stays busy while it lives) is
    gone on return."""
    import gc  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    if hf is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    else:
        import ucpfs.torch  # noqa: PLC0415
        with view.open("config.json") as f:
            config = json.load(f)
        config = transformers.AutoConfig.for_model(**config)
        model_class = getattr(transformers, config.architectures[0])
        model, info = model_class.from_pretrained(None, config=config, state_dict=ucpfs.torch.LazyStateDict(view),
                                                  dtype=torch.float32, output_loading_info=True)
        assert not any(info.values()), f"from_pretrained(state_dict=LazyStateDict): {info}"
        model.eval()
    truth = torch.load(src + "_truth.pt", weights_only=False)
    with torch.no_grad():
        logits = model(truth["tokens"]).logits.clone()
    del model
    gc.collect()
    return logits


def file_id(path):
    st = os.stat(path)
    with open(path, "rb") as f:
        return [st.st_ino, st.st_mtime_ns, hashlib.sha256(f.read()).hexdigest()]


def materialize_check(r, src, work, out_dir):
    """As root: the materialised files against a real mount's, and written anew once SRC changed."""
    import torch  # noqa: PLC0415
    from e2e_common import bits_equal  # noqa: PLC0415
    import ucpfs  # noqa: PLC0415
    m = r["materialized"]
    mnt = os.path.join(work, "mnt-" + m["name"])
    os.makedirs(mnt)
    with ucpfs.mount(src, mnt, read_only=True) as mo:
        names = sorted(f for f in os.listdir(mo.path / "hf"))
        assert names == sorted(f for f in m["files"] if f != "model.pt"), f"hf/ lists {names}: {sorted(m['files'])}"
        for f in names:
            digest = hashlib.sha256((mo.path / "hf" / f).read_bytes()).hexdigest()
            assert digest == m["files"][f][2], f"hf/{f}: the materialised file differs from the mount's"
        want = hf_logits(mo.path / "hf", src)
        got = torch.load(os.path.join(out_dir, "hf-logits.pt"), weights_only=True)
        assert bits_equal(got, want), "from_pretrained of the materialised hf/ differs from the mount's hf/"
        lazy = torch.load(os.path.join(out_dir, "hf-lazy-logits.pt"), weights_only=True)
        assert bits_equal(lazy, want), "from_pretrained(state_dict=LazyStateDict(hf)) differs from the mount's hf/"
        diff = (got - torch.load(src + "_truth.pt", weights_only=False)["logits"]).abs().max().item()
        assert diff <= 1e-4, f"materialised hf/: logits differ from the live job's by {diff}"
        mounted_pt = torch.load(mo.path / m["rel"], weights_only=True)
        assert hashlib.sha256((mo.path / m["rel"]).read_bytes()).hexdigest() == m["files"]["model.pt"][2], m["rel"]
        deep_equal(mounted_pt, torch.load(os.path.join(out_dir, "model-mmap.pt"), weights_only=True), m["rel"])
    # The source changes (a file's mtime): a new open materialises every file anew.
    common = os.path.join(src, "common.pt")
    st = os.stat(common)
    os.utime(common, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    ucpfs.open(src, index_dir=os.path.join(work, "index-" + m["name"])).hf.materialize(m["hf"])
    for f in os.listdir(m["hf"]):
        if not f.startswith("."):
            assert file_id(os.path.join(m["hf"], f))[0] != m["files"][f][0], f"hf/{f}: not written anew"
    print(f"{m['name']}: hf/ materialised as nobody, and as a LazyStateDict: from_pretrained equals the mount's hf/ "
          f"(logits bit for bit, "
          f"within {diff:.1e} of the live job's); {m['rel']} with mmap=True equals the mount's; reused while "
          f"unchanged, written anew after", flush=True)


def deep_equal(a, b, what):
    import torch  # noqa: PLC0415
    from e2e_common import bits_equal  # noqa: PLC0415
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bits_equal(a, b), what
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{what}: keys {list(a)[:5]} vs {list(b)[:5]}"
        for k in a:
            deep_equal(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            deep_equal(x, y, f"{what}[{i}]")
    else:
        assert pickle.dumps(a) == pickle.dumps(b), f"{what}: {a!r} != {b!r}"


def views_test():
    import safetensors.torch  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from shared_fixtures import fixtures  # noqa: PLC0415
    site = package_site()
    sys.path.insert(0, site)
    import ucpfs  # noqa: PLC0415
    assert ucpfs.__file__.startswith(site), ucpfs.__file__
    work = tempfile.mkdtemp(prefix="pypkg-views-", dir="/tmp")
    index_dirs = []  # nobody's indexes, outside `work`
    try:
        paths = fixtures(["ds_zero2", "mcore_tp2_dp2", "megatron_llama"], work)
        cases = [("deepspeed", paths["ds_zero2"], ["tp1_pp1_dp2", "tp1_pp2_dp1"]),
                 ("megatron", os.path.join(paths["mcore_tp2_dp2"], "tp2_dp2_fr"), ["tp1_pp1_dp2", "tp2_pp1_dp1"])]
        llama = os.path.join(paths["megatron_llama"], "untied")
        # nobody may read the sources (not write them: the index goes elsewhere).
        run(["chmod", "-R", "go+rX,go-w", work])
        out_dir = os.path.join(work, "child")
        os.makedirs(out_dir)
        os.chmod(out_dir, 0o777)
        env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONPATH": f"{site}:{HERE}"}
        inner = [sys.executable, os.path.abspath(__file__), "child", out_dir,
                 json.dumps({"targets": cases, "hf": ["megatron_llama", llama, "tp1_pp1_dp1"]})]
        script = ('[ -e /dev/fuse ] && mount --bind /dev/null /dev/fuse; '
                  'exec setpriv --reuid=nobody --regid=nogroup --clear-groups -- "$@"')
        p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *inner],
                           capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, f"the unprivileged child failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
        report = json.load(open(os.path.join(out_dir, "report.json")))
        index_dirs = [r["index_dir"] for r in report.values()]
        n_files = n_loaded = 0
        for name, src, layouts in cases:
            r = report[name]
            assert not r["index_dir"].startswith(src), f"{name}: nobody's index went into SRC: {r['index_dir']}"
            assert len(r["files"]) >= 2 * len(layouts), f"{name}: too few target files served: {list(r['files'])}"
            mnt = os.path.join(work, "mnt-" + name)
            os.makedirs(mnt)
            with ucpfs.mount(src, mnt, read_only=True) as m:
                assert sorted(os.listdir(m.path)) == r["root"], f"{name}: root {sorted(os.listdir(m.path))} vs {r['root']}"
                assert sorted(os.listdir(m.path / "atomic")) == r["atomic"], f"{name}: atomic/ differs"
                for layout in layouts:
                    mounted_files = sorted(f"target/{layout}/{rank}/{f}" for rank in os.listdir(m.path / "target" / layout)
                                           for f in os.listdir(m.path / "target" / layout / rank))
                    assert mounted_files == sorted(k for k in r["files"] if k.startswith(f"target/{layout}/")), \
                        f"{name} {layout}: files differ"
                for rel, e in r["files"].items():
                    data = (m.path / rel).read_bytes()
                    assert hashlib.sha256(data).hexdigest() == e["sha256"] and len(data) == e["n_bytes"], \
                        f"{name} {rel}: bytes differ from the mount's"
                    if "loaded" in e:
                        want = dict(sorted(safetensors.torch.load_file(m.path / rel).items())) \
                            if rel.endswith(".safetensors") else torch.load(m.path / rel, weights_only=False)
                        deep_equal(want, torch.load(e["loaded"], weights_only=False), f"{name} {rel}")
                        n_loaded += 1
                    n_files += 1
            print(f"{name}: {len(r['files'])} target files equal to the mount's (index of nobody at {r['index_dir']})",
                  flush=True)
        materialize_check(report, llama, work, out_dir)
        # A mount that fails says why, in the daemon's words.
        try:
            with ucpfs.mount(os.path.join(work, "no-such-source"), os.path.join(work, "mnt-deepspeed")):
                raise AssertionError("a mount of a missing source succeeded")
        except ucpfs.MountError as e:
            assert "no-such-source" in str(e), str(e)
        assert n_loaded >= n_files // 2, (n_loaded, n_files)
        print(f"python_package views: ok ({n_files} files, {n_loaded} loaded by torch.load or safetensors)", flush=True)
    finally:
        # Every mount above is gone (the context managers unmount); never rm through a live one.
        with open("/proc/self/mounts") as f:
            live = [line.split()[1] for line in f if line.split()[1].startswith(work)]
        for mnt in live:  # a failed check may still hold a file of it open: detach it lazily
            subprocess.run(["fusermount3", "-u", "-z", mnt])
        with open("/proc/self/mounts") as f:
            live = [line.split()[1] for line in f if line.split()[1].startswith(work)]
        if live:
            print(f"left {work} in place: still mounted: {live}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
        for d in index_dirs:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "wheel":
        wheel_test()
    elif len(sys.argv) >= 2 and sys.argv[1] == "views":
        views_test()
    elif len(sys.argv) == 4 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
