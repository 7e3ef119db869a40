"""End-to-end: `ucpfs inspect --json` on torch.save files that ucpfs did not write.

The running torch (1.13 or 2.x; CTest runs both) writes random objects (every dtype it has:
2.x adds float8_*, uint16/32/64 and complex32, saved through _rebuild_tensor_v3; views into
shared storages with offsets and strides, transposes, expanded stride-0 views, 0-d and empty
tensors, Parameters, nested dicts/OrderedDicts/lists/tuples, argparse.Namespace, pickle protocols
2 and 4; 2.x also writes its extra records .format_version, .storage_alignment, byteorder,
.data/serialization_id). For every
tensor ucpfs reports, the raw file bytes at `data_offset`, read with the reported
dtype/shape/stride, must equal the tensor torch wrote; the reported storage record must be the
one Python's zipfile finds; and every tensor of the object must be reported exactly once per path.
The random objects and the every-dtype file are also saved in torch's legacy format
(_use_new_zipfile_serialization=False, no zip), checked alike.
"""
import argparse
import collections
import json
import os
import struct
import zipfile

import torch

from e2e_common import ALL_DTYPES, Results, bits_equal, random_tensor, run, seeded_rng, tmpdir, ucpfs_bin


def flatten(obj, path, out):
    """Tensors by dot-joined path, in the order ucpfs walks the pickle graph."""
    join = (lambda k: f"{path}.{k}" if path else str(k))
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            flatten(v, join(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            flatten(v, join(i), out)
    elif isinstance(obj, argparse.Namespace):
        for k, v in vars(obj).items():
            flatten(v, join(k), out)
    return out


def random_leaf(rng):
    dtype = rng.choice(ALL_DTYPES)
    kind = rng.choice(["plain", "plain", "zero_d", "empty", "view", "transpose", "expand", "param"])
    if kind == "zero_d":
        return random_tensor(rng, dtype, ())
    if kind == "empty":
        return random_tensor(rng, dtype, rng.choice([(0,), (3, 0), (0, 2, 5)]))
    shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 4)))
    t = random_tensor(rng, dtype, shape)
    if kind == "view" and t.dim() >= 1 and t.shape[0] > 1:
        return t[1:].narrow(-1, 0, max(1, t.shape[-1] // 2))
    if kind == "transpose" and t.dim() >= 2:
        return t.transpose(0, 1)
    if kind == "expand":
        return random_tensor(rng, dtype, (1, 3)).expand(4, 3)
    if kind == "param" and dtype.is_floating_point:
        return torch.nn.Parameter(t, requires_grad=False)
    return t


def random_tree(rng, depth=0):
    if depth > 3 or rng.random() < 0.35:
        r = rng.random()
        if r < 0.8:
            return random_leaf(rng)
        return rng.choice([None, True, 7, -3, 2 ** 40, "text", 1.5])
    kind = rng.choice(["dict", "odict", "list", "tuple", "shared"])
    n = rng.randint(0, 5)
    if kind == "dict":
        return {f"k{i}": random_tree(rng, depth + 1) for i in range(n)}
    if kind == "odict":
        return collections.OrderedDict((f"layer{i}", random_tree(rng, depth + 1)) for i in range(n))
    if kind == "list":
        return [random_tree(rng, depth + 1) for _ in range(n)]
    if kind == "tuple":
        return tuple(random_tree(rng, depth + 1) for _ in range(n))
    # Several views of one storage, at different offsets and strides.
    dtype = rng.choice(ALL_DTYPES)
    base = random_tensor(rng, dtype, (6, 8))
    return {"whole": base, "row": base[2], "col": base[:, 3], "block": base[1:4, 2:7],
            "strided": base[::2, ::3], "flat_tail": base.view(-1)[5:]}


def local_data_offset(zf_path, info):
    with open(zf_path, "rb") as f:
        f.seek(info.header_offset)
        hdr = f.read(30)
        name_len, extra_len = struct.unpack("<HH", hdr[26:30])
        return info.header_offset + 30 + name_len + extra_len


def check_file(path, obj, legacy=False):
    """Every tensor's bytes at its reported offset are the tensor's; in a zip, its storage record
    is the one zipfile finds; in torch's legacy format, the 8 bytes before its storage are the
    storage's count (of elements, or of bytes when torch saved it untyped)."""
    out = run([ucpfs_bin(), "inspect", "--json", path]).stdout
    report = json.loads(out)
    assert report["format"] == ("torch.save (legacy)" if legacy else "torch.save"), report["format"]
    assert zipfile.is_zipfile(path) != legacy, path
    assert report["size"] == os.path.getsize(path), (report["size"], os.path.getsize(path))
    expected = flatten(obj, "", [])
    got = report["tensors"]
    assert [k for k, _ in expected] == [t["key"] for t in got], \
        f"keys differ:\n{[k for k, _ in expected]}\n{[t['key'] for t in got]}"
    data = open(path, "rb").read()
    zf = None if legacy else zipfile.ZipFile(path)
    prefix = None if legacy else zf.namelist()[0].split("/")[0]
    for (key, want), t in zip(expected, got):
        dtype = getattr(torch, t["dtype"])
        assert dtype == want.dtype, (key, t["dtype"], want.dtype)
        assert t["shape"] == list(want.shape), (key, t["shape"], list(want.shape))
        assert t["stride"] == list(want.stride()), (key, t["stride"], list(want.stride()))
        assert t["storage_offset"] == want.storage_offset(), key
        item = want.element_size()
        assert t["nbytes"] == want.numel() * item, key
        if legacy:
            start = t["data_offset"] - t["storage_offset"] * item
            count = struct.unpack("<q", data[start - 8:start])[0]
            storage = want.untyped_storage() if hasattr(want, "untyped_storage") else want.storage()  # torch 1.13
            # Elements of the storage's type; bytes where torch 2.x saved it untyped (a dtype with
            # no legacy storage class, or a storage viewed as two dtypes).
            assert count in (storage.nbytes() // item, storage.nbytes()), (key, count, storage.nbytes())
        else:
            info = zf.getinfo(f"{prefix}/data/{t['storage_key']}")
            start = local_data_offset(path, info)
            assert t["data_offset"] == start + t["storage_offset"] * item, (key, t["data_offset"], start)
        if want.numel() == 0:
            continue
        extent = 1 + sum((s - 1) * st for s, st in zip(t["shape"], t["stride"]))
        raw = bytearray(data[t["data_offset"]:t["data_offset"] + extent * item])
        assert len(raw) == extent * item, key
        flat = torch.frombuffer(raw, dtype=dtype)
        got_t = torch.as_strided(flat, t["shape"], t["stride"], 0)
        assert bits_equal(got_t, want.detach()), f"{key}: bytes at data_offset differ"


def main():
    res = Results("e2e_inspect_torch_files")
    rng = seeded_rng("e2e_inspect_torch_files")
    with tmpdir("ucpfs-inspect-") as d:
        # Random objects, both pickle protocols torch.save users pick.
        for i in range(40):
            obj = {"root": random_tree(rng)} if i % 3 else random_tree(rng)
            proto = 2 if i % 2 == 0 else 4
            path = os.path.join(d, f"rand{i}.pt")
            torch.save(obj, path, pickle_protocol=proto)
            res.check(f"random file {i} (protocol {proto})", lambda p=path, o=obj: check_file(p, o))
            # The same object in torch's legacy format (no zip): the same tensors, the same bytes.
            legacy_path = os.path.join(d, f"rand{i}.legacy.pt")
            torch.save(obj, legacy_path, pickle_protocol=proto, _use_new_zipfile_serialization=False)
            res.check(f"random file {i} (protocol {proto}, legacy format)",
                      lambda p=legacy_path, o=obj: check_file(p, o, legacy=True))

        # Every dtype, 0-d and empty, in one file.
        every = collections.OrderedDict()
        for dt in ALL_DTYPES:
            name = str(dt).split(".")[1]
            every[name] = random_tensor(rng, dt, (3, 5))
            every[name + "_0d"] = random_tensor(rng, dt, ())
            every[name + "_empty"] = random_tensor(rng, dt, (0, 4))
        p = os.path.join(d, "every_dtype.pt")
        torch.save(every, p)
        res.check("every dtype", lambda: check_file(p, every))

        # A real module state dict (OrderedDict with _metadata, Parameters) and a Namespace.
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7),
                                    torch.nn.Embedding(11, 3)).to(torch.bfloat16)
        sd = model.state_dict()
        p2 = os.path.join(d, "state_dict.pt")
        torch.save(sd, p2)
        res.check("module state_dict", lambda: check_file(p2, sd))
        ns = {"args": argparse.Namespace(lr=0.1, name="x", w=torch.arange(6.0).view(2, 3)),
              "model": sd}
        p3 = os.path.join(d, "namespace.pt")
        torch.save(ns, p3)
        res.check("argparse.Namespace with a tensor", lambda: check_file(p3, ns))

        # torch's legacy format: every dtype; a file cut short is refused with a clear error.
        p4 = os.path.join(d, "every_dtype.legacy.pt")
        torch.save(every, p4, _use_new_zipfile_serialization=False)
        res.check("every dtype, legacy format", lambda: check_file(p4, every, legacy=True))

        def legacy_cut():
            cut = os.path.join(d, "cut.legacy.pt")
            with open(p4, "rb") as f:
                data = f.read()
            with open(cut, "wb") as f:
                f.write(data[:len(data) - 3])
            r = run([ucpfs_bin(), "inspect", "--json", cut], check=False)
            assert r.returncode == 1, r.returncode
            assert cut in r.stderr and "corrupt" in r.stderr and "past the end" in r.stderr, r.stderr
        res.check("legacy format cut short: refused, saying where", legacy_cut)
    res.finish()


if __name__ == "__main__":
    main()
