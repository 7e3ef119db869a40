"""Seeds of fuzz_deepspeed_scan: real DeepSpeed saves of a tiny model, packed as the fuzz input.

Usage: .venv/bin/python tests/fuzz/deepspeed_seeds.py [OUTDIR]   (default: tests/fuzz/seeds)

Saves a tiny model (hidden 2, 1 layer, ffn 2, vocabulary 3 padded to 8: 16 parameters in two
param groups) for one training step with the engine itself (tests/e2e/fixtures/gen_deepspeed.py,
about 20 s a case) and writes, per case, OUTDIR/deepspeed_<case>.bin: every file of the save as a
section (MARKER, a role byte, the file's bytes), the format tests/fuzz/deepspeed_scan_fuzz.cc
reads. Also variants of zero1: _notag (no `latest`, the files in the directory itself),
_truncated (every tensor storage record cut to half its bytes, the zip otherwise intact) and
deepspeed_regress_no_model.bin (no model-states file: once read an empty map's first entry).
Each seed stays below the fuzz runs' -max_len=65536.
"""
import io
import os
import re
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))


def fuzz_constants():
    """kMarker, kTag and kNames (role = index, | 0x80: no tag) of the fuzz target, read from its
    source so the two never disagree."""
    with open(os.path.join(HERE, "deepspeed_scan_fuzz.cc")) as f:
        text = f.read()
    marker = re.search(r'kMarker = "([^"]+)";', text).group(1).encode()
    tag = re.search(r'kTag = "([^"]+)";', text).group(1)
    names = re.findall(r'"([^"]+)"', re.search(r"kNames = \{(.*?)\};", text, re.S).group(1))
    return marker, tag, names


MARKER, TAG, NAMES = fuzz_constants()
CASES = [("zero1", 2), ("zero3", 3), ("bf16_optimizer", 2)]
MODEL = ["--steps", "1", "--hidden", "2", "--layers", "1", "--ffn", "2", "--vocab", "3", "--no-truth"]


def save(case, ranks, outdir):
    gen = os.path.join(HERE, "..", "e2e", "fixtures", "gen_deepspeed.py")
    run = subprocess.run([sys.executable, gen, "save", outdir, "--case", case, "--ranks", str(ranks)] + MODEL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if run.returncode != 0:
        sys.exit(f"gen_deepspeed.py save --case {case} failed:\n{run.stdout[-4000:]}")


def files_of(ckpt):
    """(role, bytes) of every file the scanner reads, `latest` first."""
    out = []
    with open(os.path.join(ckpt, "latest"), "rb") as f:
        out.append((0, f.read()))
    for name in sorted(os.listdir(os.path.join(ckpt, TAG))):
        with open(os.path.join(ckpt, TAG, name), "rb") as f:
            out.append((NAMES.index(name), f.read()))
    return out


def pack(files):
    return b"".join(MARKER + bytes([role]) + data for role, data in files)


def truncate_storages(data):
    """The same torch.save zip with every archive/data/N record cut to half its bytes."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            body = src.read(info)
            if "/data/" in info.filename:  # not .data/serialization_id
                body = body[:len(body) // 2]
            dst.writestr(info, body)
    return out.getvalue()


def write(outdir, name, blob):
    assert len(blob) < 65536, (name, len(blob))
    with open(os.path.join(outdir, name), "wb") as f:
        f.write(blob)
    print(f"{name}: {len(blob)} bytes")


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "seeds")
    with tempfile.TemporaryDirectory() as tmp:
        for case, ranks in CASES:
            ckpt = os.path.join(tmp, case)
            save(case, ranks, ckpt)
            files = files_of(ckpt)
            write(outdir, f"deepspeed_{case}.bin", pack(files))
            if case == "zero1":
                write(outdir, "deepspeed_zero1_notag.bin", pack([(r | 0x80, d) for r, d in files if r != 0]))
                write(outdir, "deepspeed_zero1_truncated.bin",
                      pack([(r, truncate_storages(d) if r else d) for r, d in files]))
                # Regression: optimizer partitions without a model-states file.
                write(outdir, "deepspeed_regress_no_model.bin", pack([(r, d) for r, d in files if r != 1]))


if __name__ == "__main__":
    main()
