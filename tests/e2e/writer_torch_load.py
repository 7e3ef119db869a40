"""End-to-end: files from ucpfs's lazy torch.save writer load with unmodified torch.load.

Run by CTest with Debian's /usr/bin/python3 (torch 1.13) and with torch 2.13 (.venv), and
UCPFS_TOOLS_DIR = build/tests (holding write_torch); by hand:
/usr/bin/python3 writer_torch_load.py --tools-dir build/tests.

For each case: tensors made with torch have their raw bytes written to a temporary file, a JSON
spec describes the object, `write_torch` renders the lazy file (with several --chunk sizes,
which must all give the same bytes), and then
  - the file size equals the size write_torch reports (LazyTorchFile::Size()),
  - zipfile lists the records in the writer's order, data offsets are aligned and match the
    report, and each data/<k> record holds exactly the k-th tensor's bytes (first-use order),
  - torch.load(weights_only=False) and, for float-free specs written with --no-floats,
    torch.load(weights_only=True) give back the same structure (OrderedDict vs dict, list vs
    tuple) with every tensor equal bit for bit (dtype, shape, bytes);
  - on torch >= 2.6, every file (floats included) also loads with torch.load's default
    (weights_only=True), mmap=True, and mmap=True with weights_only=True, and
    get_unsafe_globals_in_checkpoint finds nothing. The dtypes case then also holds the dtypes
    only torch 2.x has (float8_*, uint16/32/64, complex32: the _rebuild_tensor_v3 path).
Documented caveats are asserted too: a spec with floats loads with weights_only=False but
fails with weights_only=True on torch 1.13 (and loads on >= 2.6); --no-floats refuses it;
zipfile.testzip() reports the tensor records' CRC 0 as bad; float8 tensors (the
_rebuild_tensor_v3 path) do not load in torch 1.13 (and load bit for bit on >= 2.6).
"""
import argparse
import collections
import json
import os
import struct
import sys
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from e2e_common import (ALL_DTYPES, TORCH_2_6, Results, bits_equal, random_tensor, run,  # noqa: E402
                        seeded_rng, served_loads, tmpdir, tool)

CHUNKS = (1, 4093, 1 << 20)


def raw_bytes(t):
    t = t.detach().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    if t.numel() == 0:
        return b""
    return bytes(t.reshape(-1).view(torch.uint8).numpy())


class Case:
    """One object to write: builds the JSON spec and the raw tensor file as it walks `obj`."""

    def __init__(self, name, obj, d, floats=False, prefix="archive", alignment=64):
        self.name, self.obj, self.floats = name, obj, floats
        self.prefix, self.alignment = prefix, alignment
        self.raw_path = os.path.join(d, f"{name}.raw")
        self.spec_path = os.path.join(d, f"{name}.json")
        self.tensors = []  # in first-use (pickle) order = storage key order
        self._raw = bytearray()
        spec = self.spec_of(obj)
        with open(self.raw_path, "wb") as f:
            f.write(self._raw)
        with open(self.spec_path, "w") as f:
            json.dump(spec, f)

    def spec_of(self, o):
        if o is None:
            return {"type": "none"}
        if isinstance(o, bool):
            return {"type": "bool", "value": o}
        if isinstance(o, int):
            return {"type": "int", "value": o}
        if isinstance(o, float):
            return {"type": "float", "value": o}
        if isinstance(o, str):
            return {"type": "str", "value": o}
        if isinstance(o, (list, tuple)):
            return {"type": "list" if isinstance(o, list) else "tuple",
                    "items": [self.spec_of(x) for x in o]}
        if isinstance(o, dict):
            return {"type": "dict", "ordered": isinstance(o, collections.OrderedDict),
                    "items": [[k, self.spec_of(v)] for k, v in o.items()]}
        if isinstance(o, torch.Tensor):
            data = raw_bytes(o)
            self.tensors.append(o)
            spec = {"type": "tensor", "dtype": str(o.dtype).replace("torch.", ""),
                    "shape": list(o.shape), "file": self.raw_path, "offset": len(self._raw)}
            self._raw += data
            return spec
        raise TypeError(type(o))

    def expected_names(self):
        names = ["data.pkl", ".format_version", ".storage_alignment", "byteorder"]
        names += [f"data/{k}" for k in range(len(self.tensors))]
        names += ["version", ".data/serialization_id"]
        return [f"{self.prefix}/{n}" for n in names]

    def write(self, out, chunk, no_floats):
        cmd = [tool("write_torch"), "--chunk", str(chunk)]
        if no_floats:
            cmd.append("--no-floats")
        if self.prefix != "archive":
            cmd += ["--prefix", self.prefix]
        if self.alignment != 64:
            cmd += ["--alignment", str(self.alignment)]
        return json.loads(run(cmd + [self.spec_path, out]).stdout)


def same(got, want, path="root"):
    if type(got) is not type(want):
        raise AssertionError(f"{path}: type {type(got).__name__} != {type(want).__name__}")
    if isinstance(want, torch.Tensor):
        if got.dtype != want.dtype or got.shape != want.shape:
            raise AssertionError(f"{path}: {got.dtype}{tuple(got.shape)} != "
                                 f"{want.dtype}{tuple(want.shape)}")
        if got.requires_grad or not bits_equal(got, want):
            raise AssertionError(f"{path}: tensor values differ")
    elif isinstance(want, dict):
        if list(got.keys()) != list(want.keys()):
            raise AssertionError(f"{path}: keys {list(got.keys())[:5]}... != "
                                 f"{list(want.keys())[:5]}...")
        for k in want:
            same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        if len(got) != len(want):
            raise AssertionError(f"{path}: length {len(got)} != {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            same(g, w, f"{path}[{i}]")
    elif got != want:
        raise AssertionError(f"{path}: {got!r} != {want!r}")


def local_data_offset(path, info):
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
    return info.header_offset + 30 + name_len + extra_len


def check_file(case, out, report):
    assert os.path.getsize(out) == report["size"], (os.path.getsize(out), report["size"])
    zf = zipfile.ZipFile(out)
    names = zf.namelist()
    assert names == case.expected_names(), names
    assert [f"{case.prefix}/{r['name']}" for r in report["records"]] == names
    with open(out, "rb") as f:
        blob = f.read()
    for rec, info in zip(report["records"], zf.infolist()):
        off = local_data_offset(out, info)
        assert off == rec["data_offset"] and off % case.alignment == 0, (rec, off)
        assert info.file_size == rec["n_bytes"] and info.compress_type == zipfile.ZIP_STORED
    for k, t in enumerate(case.tensors):
        rec = report["records"][4 + k]
        data = blob[rec["data_offset"]:rec["data_offset"] + rec["n_bytes"]]
        assert data == raw_bytes(t), f"data/{k} bytes differ"
    # The in-memory records carry real CRCs: zipfile reads them with its CRC check.
    assert zf.read(f"{case.prefix}/version") == b"3\n"
    assert zf.read(f"{case.prefix}/byteorder") == b"little"
    assert zf.read(f"{case.prefix}/.storage_alignment") == str(case.alignment).encode()
    assert zf.read(f"{case.prefix}/.format_version") == b"1"
    sid = zf.read(f"{case.prefix}/.data/serialization_id")
    assert len(sid) == 40 and sid.isdigit(), sid
    zf.read(f"{case.prefix}/data.pkl")
    # Tensor records carry CRC 0 (documented): testzip flags the first non-empty one whose
    # real CRC is not 0.
    bad = zf.testzip()
    nonzero = [f"{case.prefix}/data/{k}" for k, t in enumerate(case.tensors)
               if len(raw_bytes(t)) and zipfile.crc32(raw_bytes(t)) != 0]
    assert bad == (nonzero[0] if nonzero else None), (bad, nonzero[:1])
    return blob


def load(path, weights_only):
    return torch.load(path, weights_only=weights_only)


def run_case(res, case, d, chunks=CHUNKS):
    """Writes the case with each chunk size and checks layout, bytes and torch.load."""
    no_floats = not case.floats
    blobs = []
    for chunk in chunks:
        out = os.path.join(d, f"{case.name}.{chunk}.pt")

        def write_and_check(out=out, chunk=chunk):
            report = case.write(out, chunk, no_floats)
            blobs.append(check_file(case, out, report))
        res.check(f"{case.name}: write --chunk {chunk}, layout and bytes", write_and_check)
    def identical():
        assert len(blobs) == len(chunks), "some writes failed"
        assert all(b == blobs[0] for b in blobs), "outputs differ between chunk sizes"
    res.check(f"{case.name}: identical bytes for chunk sizes {chunks}", identical)
    out = os.path.join(d, f"{case.name}.{chunks[-1]}.pt")
    res.check(f"{case.name}: torch.load weights_only=False",
              lambda: same(load(out, False), case.obj))
    if no_floats:
        res.check(f"{case.name}: torch.load weights_only=True",
                  lambda: same(load(out, True), case.obj))
    if TORCH_2_6:
        def loads_2x():
            for how, obj in served_loads(out, has_floats=case.floats):
                same(obj, case.obj, f"root ({how})")
        res.check(f"{case.name}: torch.load default, mmap=True, mmap+weights_only; no unsafe globals",
                  loads_2x)


def expect_raise(fn, what):
    try:
        fn()
    except Exception:  # noqa: BLE001 - any failure is the expected outcome
        return
    raise AssertionError(f"expected failure: {what}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tools-dir", help="directory holding write_torch (default: $UCPFS_TOOLS_DIR)")
    args = ap.parse_args()
    if args.tools_dir:
        os.environ["UCPFS_TOOLS_DIR"] = os.path.abspath(args.tools_dir)

    res = Results("writer_torch_load")
    rng = seeded_rng("writer_torch_load")
    with tmpdir("ucpfs-writer-") as d:
        # Every dtype the running torch supports, in several shapes, plus a large-ish tensor.
        dtypes = collections.OrderedDict()
        for dt in ALL_DTYPES:
            n = str(dt).replace("torch.", "")
            dtypes[f"{n}.2x3"] = random_tensor(rng, dt, (2, 3))
            dtypes[f"{n}.0d"] = random_tensor(rng, dt, ())
            dtypes[f"{n}.empty"] = random_tensor(rng, dt, (0,))
            dtypes[f"{n}.3x0"] = random_tensor(rng, dt, (3, 0))
            dtypes[f"{n}.5x1x7"] = random_tensor(rng, dt, (5, 1, 7))
        small = Case("dtypes_small", dtypes, d)
        run_case(res, small, d)

        big = collections.OrderedDict()
        big["large_f32"] = random_tensor(rng, torch.float32, (300_000,))
        big["large_bf16"] = random_tensor(rng, torch.bfloat16, (700, 129))
        big["dtypes"] = dtypes
        run_case(res, Case("dtypes_large", big, d), d, chunks=(4093, 1 << 20))

        # Nested containers, big and negative ints, unicode, None, bools, batching (> 1000).
        inner = collections.OrderedDict()
        inner["layers"] = [(i, f"layer.{i}", random_tensor(rng, torch.float16, (i + 1, 2)),
                            i % 2 == 0) for i in range(4)]
        inner["none"] = None
        inner["t"] = (True, False, None, (), (1,), (1, 2), (1, 2, 3), [])
        nested = {
            "model": inner,
            "ints": [0, 1, 255, 256, 65535, 65536, -1, -5, 2**31 - 1, -2**31, 2**31, -2**31 - 1,
                     2**40, -2**40, 2**63 - 1, -2**63],
            "unicode": "héllo wörld ✓ 日本語 😀",
            "empty": {"d": {}, "od": collections.OrderedDict(), "l": [], "t": ()},
            "many_dict": {f"k{i}": i for i in range(1500)},
            "many_list": list(range(2500)),
            "many_tensors": [random_tensor(rng, torch.int32, (i % 3,)) for i in range(1100)],
            7: "int key",
            -3: {"x": random_tensor(rng, torch.bool, (4, 4))},
        }
        run_case(res, Case("nested", nested, d), d, chunks=(4093, 1 << 20))

        # Floats: load with weights_only=False; torch 1.13 weights_only=True rejects BINFLOAT.
        floats = {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8,
                                    "weight_decay": 0.0, "neg": -2.5, "big": 1e300}],
                  "w": random_tensor(rng, torch.float32, (3,))}
        fcase = Case("floats", floats, d, floats=True)
        run_case(res, fcase, d, chunks=(1 << 20,))
        fout = os.path.join(d, f"floats.{1 << 20}.pt")
        if TORCH_2_6:  # weights_only=True (the default) accepts BINFLOAT
            res.check("floats: weights_only=True loads on torch >= 2.6",
                      lambda: same(load(fout, True), floats))
        else:
            res.check("floats: weights_only=True fails on torch 1.13 (documented caveat)",
                      lambda: expect_raise(lambda: load(fout, True), "BINFLOAT with weights_only=True"))

        def no_floats_refused():
            p = run([tool("write_torch"), "--no-floats", fcase.spec_path, os.path.join(d, "nf.pt")],
                    check=False)
            assert p.returncode != 0 and "float" in p.stderr, (p.returncode, p.stderr)
        res.check("floats: write_torch --no-floats refuses the spec", no_floats_refused)

        # Another prefix and a 4096-byte alignment.
        other = collections.OrderedDict(a=random_tensor(rng, torch.int64, (33,)),
                                        b=random_tensor(rng, torch.complex64, (2, 2)))
        run_case(res, Case("prefix_align", other, d, prefix="other", alignment=4096), d,
                 chunks=(4093,))

        # dtypes without a legacy storage class use _rebuild_tensor_v3: torch 1.13 cannot load,
        # torch 2.x loads them.
        f8 = {"type": "tensor", "dtype": "float8_e4m3fn", "shape": [2], "file": small.raw_path,
              "offset": 0}
        v3spec = {"type": "dict", "items": [["f8", f8]]}
        v3path = os.path.join(d, "v3.json")
        with open(v3path, "w") as f:
            json.dump(v3spec, f)

        def v3_written():
            out = os.path.join(d, "v3.pt")
            run([tool("write_torch"), v3path, out])
            pk = zipfile.ZipFile(out).read("archive/data.pkl")
            assert b"_rebuild_tensor_v3" in pk and b"UntypedStorage" in pk
            if not TORCH_2_6:
                expect_raise(lambda: load(out, False), "_rebuild_tensor_v3 in torch 1.13")
                return
            with open(small.raw_path, "rb") as f:
                want = {"f8": torch.frombuffer(bytearray(f.read(2)), dtype=torch.float8_e4m3fn)}
            same(load(out, False), want)
            for how, obj in served_loads(out):
                same(obj, want, f"root ({how})")
        res.check("v3 dtypes: written; not loadable by torch 1.13 (documented caveat), "
                  "bit for bit on torch >= 2.6", v3_written)

        def bad_spec():
            bad = os.path.join(d, "bad.json")
            with open(bad, "w") as f:
                json.dump({"type": "tensor", "dtype": "float32", "shape": [10**6],
                           "file": small.raw_path, "offset": 0}, f)
            p = run([tool("write_torch"), bad, os.path.join(d, "bad.pt")], check=False)
            assert p.returncode != 0 and p.stderr, (p.returncode, p.stderr)
        res.check("write_torch: tensor range outside its file is an error", bad_spec)
    res.finish()


if __name__ == "__main__":
    main()
