"""`ucpfs verify`: a good checkpoint verifies (exit 0, JSON counts equal the views `ucpfs convert`
writes, the tensors torch.load finds in them and the checkpoint's tensors); damaged copies each
fail non-zero naming the damaged file: a flipped byte inside a torch.save record (CRC-32), a
replicated shard made different, a truncated data file, a file changed after indexing (stale).

Sources: a real torch 1.13/2.x DCP save (gen_dcp113_llama.py), a torch.save state dict written
here by torch, and gen_dcp2x.py's rank-local DCP (replicas on every rank; written in torch's
exact layout without torch) and its corrupt/replica copy. About 6 s.
"""
import json
import os
import shutil
import subprocess
import sys
import zipfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_common import Results, run, tmpdir, ucpfs_bin  # noqa: E402
from shared_fixtures import fixture  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
LAYOUT = "tp2_pp1_dp1"


def verify(src, *extra):
    p = run([ucpfs_bin(), "verify", src, "--json", "--quiet", *extra], check=False)
    assert p.returncode in (0, 1), f"verify exited {p.returncode}: {p.stderr}"
    return p.returncode, json.loads(p.stdout)


def count_tensors(obj):
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(count_tensors(v) for v in obj)
    return 0


def fails_naming(src, name, words, *extra):
    rc, out = verify(src, *extra)
    assert rc == 1 and not out["ok"], f"{src}: exit {rc}, {out}"
    hits = [p for p in out["problems"] if name in p["file"] and all(w in p["what"] for w in words)]
    assert hits, f"no problem names {name} with {words}: {out['problems']}"


def main():
    res = Results("verify_test")
    with tmpdir("ucpfs-verify-") as tmp:
        dcp = os.path.join(tmp, "dcp")
        run([sys.executable, os.path.join(FIXTURES, "gen_dcp113_llama.py"), dcp, "--ranks", "2"])
        pristine = os.path.join(tmp, "dcp_pristine")
        shutil.copytree(dcp, pristine)
        expected = json.load(open(os.path.join(tmp, "dcp_expected.json")))

        def good_dcp():
            rc, out = verify(dcp, "--layout", LAYOUT)
            assert rc == 0 and out["ok"] and out["problems"] == [], out
            assert out["index"] == "none (built on the first mount or `ucpfs index`)", out["index"]
            assert not os.path.exists(os.path.join(dcp, ".ucpfs")), "verify wrote an index"
            conv = json.loads(run([ucpfs_bin(), "convert", dcp, os.path.join(tmp, "conv"), "--layout", LAYOUT,
                                   "--atomic", "--json", "--quiet"]).stdout)
            c = out["checked"]
            assert c["views"] == conv["files"] and c["view_bytes"] == conv["bytes"], (c, conv)
            n = 0
            for root, _, files in os.walk(os.path.join(tmp, "conv")):
                n += sum(count_tensors(torch.load(os.path.join(root, f))) for f in files if f.endswith(".pt"))
            assert c["view_tensors"] == n, (c, n)
            assert c["source_tensors"] == sum(1 for v in expected.values() if v["kind"] == "tensor"), c
            assert [u["file"] for u in out["unchecked"]] == ["__0_0.distcp", "__1_0.distcp"], out["unchecked"]
        res.check("a real DCP save verifies, counts equal convert's views and torch.load's tensors", good_dcp)

        def truncated():
            bad = os.path.join(tmp, "truncated")
            shutil.copytree(pristine, bad)
            path = os.path.join(bad, "__1_0.distcp")
            os.truncate(path, os.path.getsize(path) - 100)
            fails_naming(bad, "__1_0.distcp", [])
        res.check("a truncated .distcp fails naming it", truncated)

        def stale():
            bad = os.path.join(tmp, "stale")
            shutil.copytree(pristine, bad)
            run([ucpfs_bin(), "index", bad, "--quiet"])
            assert verify(bad)[0] == 0
            path = os.path.join(bad, "__0_0.distcp")
            with open(path, "r+b") as f:  # same size, new bytes, a later mtime
                f.seek(10)
                b = f.read(1)
                f.seek(10)
                f.write(bytes([b[0] ^ 0xFF]))
            st = os.stat(path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
            fails_naming(bad, "__0_0.distcp", ["changed since it was indexed"])
        res.check("a file changed after indexing fails naming it (stale index)", stale)

        # A torch.save state dict (real torch, real CRC-32 per record).
        weights = os.path.join(tmp, "weights")
        os.makedirs(weights)
        g = torch.Generator().manual_seed(0)
        torch.save({"a.weight": torch.randn(64, 32, generator=g), "b.bias": torch.randn(32, generator=g)},
                   os.path.join(weights, "pytorch_model.bin"))

        def good_weights():
            rc, out = verify(weights, "--safetensors")
            assert rc == 0, out
            assert out["checked"]["crc_records"] >= 2 and out["checked"]["crc_bytes"] >= (64 * 32 + 32) * 4, out
        res.check("a torch.save state dict verifies with its records CRC-checked", good_weights)

        def flipped():
            bad = os.path.join(tmp, "flipped")
            shutil.copytree(weights, bad)
            path = os.path.join(bad, "pytorch_model.bin")
            with zipfile.ZipFile(path) as z:
                info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
            with open(path, "r+b") as f:
                f.seek(info.header_offset + 26)
                n_name, n_extra = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
                at = info.header_offset + 30 + n_name + n_extra + 7
                f.seek(at)
                b = f.read(1)
                f.seek(at)
                f.write(bytes([b[0] ^ 0x01]))
            fails_naming(bad, "pytorch_model.bin", ["CRC-32", "data/0"])
        res.check("a flipped byte in a torch.save record fails its CRC-32, naming the file", flipped)

        # Rank-local DCP: every rank stores its replica of the replicated tensors.
        local = os.path.join(tmp, "ranklocal")
        run([sys.executable, os.path.join(FIXTURES, "gen_dcp2x.py"), local, "--variant", "ranklocal"])
        corrupt = fixture("dcp2x_corrupt_torch113", tmp)

        def replicas():
            rc, out = verify(local)
            assert rc == 0, out
            fails_naming(os.path.join(corrupt, "replica"), ".distcp", ["replicas with different data"])
        res.check("replicas verify when equal and fail naming the file when one differs", replicas)
    res.finish()


if __name__ == "__main__":
    main()
