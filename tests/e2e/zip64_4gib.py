"""Slow end-to-end: files over 4 GiB (ZIP64).

Runs under torch 1.13 and torch 2.x (CTest registers both).
1. torch writes a file whose first storage is 4 GiB + 64 bytes (ZIP64 size and offset
   extras) followed by small tensors whose local headers start past 4 GiB; `ucpfs inspect`
   must report offsets at which the small tensors' bytes equal what torch wrote, and the big
   tensor's offset must match the zip directory. The big tensor is zeros (calloc'd, so cheap).
2. ucpfs's lazy writer produces a > 4 GiB file from a sparse source (written sparse by the
   write_torch tool), and torch loads it with every tensor equal: torch.load's default, and on
   torch >= 2.6 also mmap=True (with and without an explicit weights_only=True), with no unsafe
   globals.
"""
import json
import os
import struct
import subprocess
import zipfile

import torch

from e2e_common import TORCH_2_6, TORCH_VERSION, Results, run, tmpdir, tool, ucpfs_bin

BIG_ELEMS = (1 << 30) + 16  # float32: 4 GiB + 64 bytes


def local_data_offset(path, info):
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
    return info.header_offset + 30 + name_len + extra_len


def main():
    res = Results("slow_zip64_4gib")
    with tmpdir("ucpfs-zip64-") as d:
        path = os.path.join(d, "big.pt")
        small = {"after_a": torch.arange(10, dtype=torch.int64),
                 "after_b": torch.randn(3, 4, dtype=torch.float64).t()}
        obj = {"big": torch.zeros(BIG_ELEMS, dtype=torch.float32), **small}
        torch.save(obj, path)
        del obj

        def reader():
            report = json.loads(run([ucpfs_bin(), "inspect", "--json", path]).stdout)
            assert report["size"] == os.path.getsize(path) > (1 << 32)
            zf = zipfile.ZipFile(path)
            prefix = zf.namelist()[0].split("/")[0]
            by_key = {t["key"]: t for t in report["tensors"]}
            big = by_key["big"]
            assert big["nbytes"] == BIG_ELEMS * 4
            assert big["data_offset"] == local_data_offset(path, zf.getinfo(f"{prefix}/data/{big['storage_key']}"))
            with open(path, "rb") as f:
                for key, want in small.items():
                    t = by_key[key]
                    assert t["data_offset"] > (1 << 32), (key, t["data_offset"])
                    info = zf.getinfo(f"{prefix}/data/{t['storage_key']}")
                    assert t["data_offset"] == local_data_offset(path, info) + t["storage_offset"] * want.element_size()
                    extent = 1 + sum((s - 1) * st for s, st in zip(t["shape"], t["stride"]))
                    f.seek(t["data_offset"])
                    raw = bytearray(f.read(extent * want.element_size()))
                    got = torch.as_strided(torch.frombuffer(raw, dtype=want.dtype), t["shape"], t["stride"])
                    assert torch.equal(got, want), key
        res.check("reader: torch-written ZIP64 file", reader)
        os.unlink(path)

        def writer():
            raw = os.path.join(d, "raw.bin")
            tail = torch.arange(1000, dtype=torch.int32)
            with open(raw, "wb") as f:
                f.truncate(BIG_ELEMS * 4)  # sparse zeros
                f.seek(BIG_ELEMS * 4)
                f.write(tail.numpy().tobytes())
            spec = {"type": "dict", "ordered": False, "items": [
                ["big", {"type": "tensor", "dtype": "float32", "shape": [BIG_ELEMS], "file": raw, "offset": 0}],
                ["tail", {"type": "tensor", "dtype": "int32", "shape": [1000], "file": raw, "offset": BIG_ELEMS * 4}],
                ["step", {"type": "int", "value": 7}]]}
            spec_path = os.path.join(d, "spec.json")
            json.dump(spec, open(spec_path, "w"))
            out = os.path.join(d, "written.pt")
            run([tool("write_torch"), "--sparse", spec_path, out])
            os.unlink(raw)
            assert os.path.getsize(out) > (1 << 32)

            def same(loaded, how):
                assert loaded["step"] == 7, how
                assert torch.equal(loaded["tail"], tail), how
                assert loaded["big"].shape == (BIG_ELEMS,) and not loaded["big"].any(), how
            same(torch.load(out), "default")
            if TORCH_2_6:
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(out)
                assert unsafe == [], unsafe
                same(torch.load(out, mmap=True), "mmap=True")
                same(torch.load(out, mmap=True, weights_only=True), "mmap=True, weights_only=True")
        res.check(f"writer: > 4 GiB file loads in torch {TORCH_VERSION[0]}.{TORCH_VERSION[1]}", writer)
    res.finish()


if __name__ == "__main__":
    main()
