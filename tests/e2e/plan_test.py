"""End-to-end: `ucpfs plan` on a real torch DCP save (gen_llama_train.py, 2 gloo ranks, every
tensor split by rows) for tp2: the JSON matrix (bytes each target rank reads from each .distcp
file) equals what this test computes itself from torch's own DCP metadata (each chunk's box and
file) and the pieces each rank holds (ucp_info.json of `ucpfs convert`); the text table has the
same totals; the SVG parses as XML and names every rank and source file read. With 40 source
files (a synthetic save), the table groups them into 8 columns and the picture keeps 29 + "other"."""
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
import torch113_compat  # noqa: E402,F401  (torch 1.13's DCP on Python 3.11)
import torch  # noqa: E402

from e2e_common import Results, run, tmpdir, ucpfs_bin  # noqa: E402

LAYOUT = "tp2_pp1_dp1"


def dcp_chunks(src):
    """fqn -> (itemsize, [(offsets, sizes, relative_path)]) from torch's reader."""
    try:
        from torch.distributed.checkpoint import FileSystemReader
    except ImportError:
        from torch.distributed._shard.checkpoint import FileSystemReader
    md = FileSystemReader(src).read_metadata()
    out = {}
    for idx, info in md.storage_data.items():
        tmd = md.state_dict_metadata[idx.fqn]
        if not hasattr(tmd, "chunks"):
            continue  # BYTE_IO
        itemsize = torch.empty((), dtype=tmd.properties.dtype).element_size()
        chunk = next(c for c in tmd.chunks if list(c.offsets) == list(idx.offset))
        out.setdefault(idx.fqn, (itemsize, []))[1].append((list(chunk.offsets), list(chunk.sizes), info.relative_path))
    return out


def overlap(a_off, a_size, b_off, b_size):
    n = 1
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return 0
        n *= hi - lo
    return n


def expected_matrix(src, converted):
    """rank -> file -> {relative_path: bytes}, from the chunks and each rank's pieces."""
    chunks = dcp_chunks(src)
    out = {}
    rank_dirs = sorted(os.listdir(os.path.join(converted, "target", LAYOUT)))
    for rd in rank_dirs:
        rank = int(rd.split("_")[1])
        with open(os.path.join(converted, "target", LAYOUT, rd, "ucp_info.json")) as f:
            info = json.load(f)
        files = {}
        for t in info["tensors"]:
            itemsize, cs = chunks[t["source_key"]]
            pieces = t["pieces"] or [{"offsets": [], "sizes": []}]  # a 0-d step: the whole tensor
            seen = set()
            for off, size, path in cs:
                if (tuple(off), tuple(size)) in seen:
                    continue  # a replica: read once
                seen.add((tuple(off), tuple(size)))
                n = sum(overlap(p["offsets"], p["sizes"], off, size) for p in pieces)
                if n:
                    d = files.setdefault(t["file"], {})
                    d[path] = d.get(path, 0) + n * itemsize
        for key in info["extra_state"]:  # whole tensors among the extra items
            if key in chunks:
                itemsize, cs = chunks[key]
                for off, size, path in cs:
                    d = files.setdefault("extra_state.pt", {})
                    d[path] = d.get(path, 0) + overlap(off, size, off, size) * itemsize
        out[rank] = files
    return out


def human(n):
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    v, u = float(n), 0
    while v >= 1024 and u < 4:
        v /= 1024
        u += 1
    return f"{n} B" if u == 0 else f"{v:.1f} {units[u]}"


def main():
    res = Results("e2e_plan")
    exe = ucpfs_bin()
    with tmpdir("ucpfs-plan-") as d:
        src = os.path.join(d, "ckpt")
        subprocess.run([sys.executable, os.path.join(HERE, "fixtures", "gen_llama_train.py"), src, "--ranks", "2",
                        "--sharding", "rows", "--steps", "1"], check=True, capture_output=True)
        converted = os.path.join(d, "out")
        run([exe, "convert", src, converted, "--layout", LAYOUT, "--threads", "2"])
        svg = os.path.join(d, "plan.svg")
        j = json.loads(run([exe, "plan", src, "--layout", LAYOUT, "--json"]).stdout)
        text = run([exe, "plan", src, "--layout", LAYOUT, "--svg", svg]).stdout
        want = expected_matrix(src, converted)

        def matrix():
            assert j["layout"] == LAYOUT and len(j["ranks"]) == 2, j["layout"]
            for r in j["ranks"]:
                got = {f["name"]: f["reads"] for f in r["files"]}
                assert got == want[r["rank"]], (r["rank"], got, want[r["rank"]])
                # Every .distcp file feeds every rank (rows split at the source, tp2 splits some
                # parameters by columns).
                assert set(r["reads"]) == {"__0_0.distcp", "__1_0.distcp"}, r["reads"]
                for f in r["files"]:
                    assert f["read_bytes"] == sum(f["reads"].values())
                    assert f["read_bytes"] + f["zero_bytes"] == f["payload_bytes"], f
                    # The rank file on disk holds exactly that much tensor data and more bytes.
                    on_disk = os.path.getsize(os.path.join(converted, "target", LAYOUT, f"rank_{r['rank']}", f["name"]))
                    assert on_disk == f["size"] > f["payload_bytes"], (on_disk, f)
        res.check("JSON matrix equals chunks x pieces from torch's metadata", matrix)

        def sources():
            by_path = {s["path"]: s for s in j["source_files"]}
            for p in ("__0_0.distcp", "__1_0.distcp"):
                s = by_path[p]
                total = sum(r["reads"].get(p, 0) for r in j["ranks"])
                assert s["read_bytes"] == total and s["fan_out"] == 2, s
                assert 0 < s["distinct_bytes"] <= s["read_bytes"] and s["distinct_bytes"] <= s["size"], s
            assert by_path[".metadata"]["read_bytes"] == 0
            t = j["totals"]
            assert t["read_bytes"] == sum(r["read_bytes"] for r in j["ranks"]) == t["payload_bytes"], t
        res.check("per-source totals, distinct bytes and fan-out", sources)

        def table():
            lines = text.splitlines()
            total = next(l for l in lines if l.startswith("total")).split("  ")
            cells = [c.strip() for c in total if c.strip()]
            by_path = {s["path"]: s for s in j["source_files"]}
            want_cells = ["total", human(by_path["__0_0.distcp"]["read_bytes"]), human(by_path["__1_0.distcp"]["read_bytes"]),
                          human(j["totals"]["read_bytes"]), human(j["totals"]["file_bytes"])]
            assert cells == want_cells, (cells, want_cells)
            for r in j["ranks"]:
                row = next(l for l in lines if re.match(rf"^{r['rank']}\s", l))
                assert human(r["read_bytes"]) in row, (row, r["read_bytes"])
            summary = lines[-2]
            assert summary.startswith("2 ranks read 2 of 3 source files: " + human(j["totals"]["read_bytes"]) + " read"), summary
            assert "read amplification 1.00x" in summary, summary
        res.check("text table has the same totals", table)

        def picture():
            root = ET.parse(svg).getroot()
            assert root.tag == "{http://www.w3.org/2000/svg}svg", root.tag
            words = " ".join("".join(e.itertext()) for e in root.iter() if e.tag.endswith("text"))
            for name in ("rank 0", "rank 1", "__0_0.distcp", "__1_0.distcp", LAYOUT):
                assert name in words, (name, words[:400])
            bands = [e for e in root.iter() if e.tag.endswith("path")]
            assert len(bands) == 4, len(bands)  # 2 files x 2 ranks
        res.check("SVG parses and names every rank and source file", picture)

        # Many source files: 8 ranks x 5 files of a synthetic torchtitan DCP save (torch-free
        # writer of the scale benchmark). The table groups them into 8 columns in the ranks'
        # order, the picture keeps the 29 most read and puts the rest in "other".
        many = os.path.join(d, "many")
        subprocess.run([sys.executable, os.path.join(HERE, "..", "bench", "gen_scale_dcp.py"), many, "--ranks", "8",
                        "--files-per-rank", "5", "--layers", "2"], check=True, capture_output=True)
        many_svg = os.path.join(d, "many.svg")
        mj = json.loads(run([exe, "plan", many, "--layout", "tp2_pp1_dp2", "--json", "--quiet"]).stdout)
        mtext = run([exe, "plan", many, "--layout", "tp2_pp1_dp2", "--svg", many_svg, "--quiet"]).stdout

        def many_files():
            distcp = sorted(f for f in os.listdir(many) if f.endswith(".distcp"))
            assert len(distcp) == 40, distcp
            assert mj["totals"]["source_files_read"] == 40, mj["totals"]
            for r in mj["ranks"]:
                assert r["read_bytes"] == sum(sum(f["reads"].values()) for f in r["files"]), r["rank"]
            by_path = {s["path"]: s for s in mj["source_files"]}
            assert sum(by_path[p]["read_bytes"] for p in distcp) == mj["totals"]["read_bytes"]
            assert "40 source files grouped into 8 columns of up to 5:" in mtext, mtext
            for g in range(8):
                assert f"  g{g + 1}: __{g}_0.distcp .. __{g}_4.distcp (5 files)" in mtext, mtext
            root = ET.parse(many_svg).getroot()
            # A source's label: its name, then its size in a <tspan>.
            words = [(e.text or "").strip() for e in root.iter() if e.tag.endswith("}text")]
            sources = [w for w in words if w.startswith("__") and w.endswith(".distcp")]
            assert len(sources) == 29 and sources == sorted(sources, key=lambda n: [int(x) for x in re.findall(r"\d+", n)]), sources
            assert "other (11 files)" in words, words
        res.check("40 source files: grouped table columns, the picture's 29 + other", many_files)
    res.finish()


if __name__ == "__main__":
    main()
