"""Large synthetic DCP checkpoints for tests/bench/scale_bench.py, written without torch.

Usage: python3 gen_scale_dcp.py OUTDIR [--layers L] [--dim D] [--kv-dim K] [--ffn F]
                                [--vocab V] [--ranks R] [--files-per-rank N] [--shards S]
                                [--dtype float32|bfloat16] [--sparse]

A torchtitan-style llama (tok_embeddings, layers.<i>.attention.{wq,wk,wv,wo},
feed_forward.{w1,w2,w3}, attention_norm, ffn_norm, norm, output; all weights of shape
[out, in]) with Adam state: for every parameter `P`, the tensors P, optimizer.state.P.exp_avg,
optimizer.state.P.exp_avg_sq (all --dtype) and optimizer.state.P.step (0-d float32), so 4 tensors
per parameter; plus BYTE_IO items train_state.step and lr_scheduler. It is a torch >= 2.5 DCP
directory as gen_dcp2x.py writes one (its stand-in classes, pickler and torch.save zip layout):
`__<r>_<i>.distcp` for R ranks x N files, and one `.metadata` (protocol 4, version "1.0.0").

Every tensor but the 0-d steps is split by rows into S chunks (torch.chunk sizes); tensor j's
chunk k is saved by rank (j * S + k) % R, so with S == R every rank holds a piece of everything
(FSDP) and with S < R the tensors are spread over the ranks. Each rank's items go to its N files
as torch's _split_by_size_and_type does (BYTE_IO round robin, tensors largest first into the
emptiest file). Each chunk is its own torch.save zip inside the .distcp file.

--sparse leaves every tensor's data unwritten (a hole of the right length: the files are sparse
and read as zeros), so a 100 GB-class checkpoint takes a few MB of disk and seconds to write.
Without it, tensor bytes are a cheap deterministic pattern (no randomness: the scale benchmark
measures the index and the views, not the values).

Examples (scale_bench.py runs these):
  1,000 files, 20,028 tensors (556 layers), small tensors:
    python3 gen_scale_dcp.py OUT --layers 556 --dim 16 --kv-dim 8 --ffn 32 --vocab 64 \
        --ranks 1000 --files-per-rank 1 --shards 2
  107 GB (8.95 G parameters, fp32 weights + 2 Adam moments; llama-70B widths, 8 layers), sparse:
    python3 gen_scale_dcp.py OUT --layers 8 --dim 8192 --kv-dim 1024 --ffn 28672 \
        --vocab 128256 --ranks 8 --files-per-rank 2 --shards 8 --sparse
Prints one JSON line: {"files", "tensors", "chunks", "params", "n_bytes", "disk_bytes"}.
"""
import argparse
import json
import os
import pickle
import shutil
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e", "fixtures"))
import gen_dcp2x as g  # noqa: E402  (torch-free stand-ins; must not import torch)


def model_params(layers, dim, kv_dim, ffn, vocab):
    """[(fqn, shape)] in torchtitan's state-dict order."""
    out = [("tok_embeddings.weight", (vocab, dim))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + "attention.wq.weight", (dim, dim)), (p + "attention.wk.weight", (kv_dim, dim)),
                (p + "attention.wv.weight", (kv_dim, dim)), (p + "attention.wo.weight", (dim, dim)),
                (p + "feed_forward.w1.weight", (ffn, dim)), (p + "feed_forward.w2.weight", (dim, ffn)),
                (p + "feed_forward.w3.weight", (ffn, dim)),
                (p + "attention_norm.weight", (dim,)), (p + "ffn_norm.weight", (dim,))]
    out += [("norm.weight", (dim,)), ("output.weight", (vocab, dim))]
    return out


def state_tensors(params, dtype):
    """[(fqn, dtype, shape)]: the weights, then the optimizer state per parameter."""
    out = [(fqn, dtype, shape) for fqn, shape in params]
    for fqn, shape in params:
        st = "optimizer.state." + fqn
        out += [(st + ".exp_avg", dtype, shape), (st + ".exp_avg_sq", dtype, shape),
                (st + ".step", "float32", ())]
    return out


def tensor_data(dtype, shape, j, sparse):
    n_bytes = g.numel(shape) * g.DTYPES[dtype][0]
    if sparse:
        return g.Hole(n_bytes)
    word = struct.pack("<I", (j * 2654435761) & 0x3F7FFFFF)  # a finite float32 / bf16 pair
    return (word * (n_bytes // 4 + 1))[:n_bytes]


def write(out, a):
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    params = model_params(a.layers, a.dim, a.kv_dim, a.ffn, a.vocab)
    tensors = state_tensors(params, a.dtype)
    cls = g.DCP
    per_rank = {r: [] for r in range(a.ranks)}  # rank -> [(kind, fqn, payload)]
    sdm, planner = {}, {}
    n_chunks = 0
    n_bytes_total = 0
    for j, (fqn, dtype, shape) in enumerate(tensors):
        if shape:
            pieces = g.chunk_ranges(shape[0], a.shards)
        else:
            pieces = [(0, 0)]
        chunks_md = []
        for k, (row, rows) in enumerate(pieces):
            offsets = (row,) + (0,) * (len(shape) - 1) if shape else ()
            sizes = (rows,) + tuple(shape[1:]) if shape else ()
            rank = (j * a.shards + k) % a.ranks
            t = g.T(dtype, sizes, tensor_data(dtype, sizes, j, a.sparse))
            per_rank[rank].append(("tensor", cls.MetadataIndex(fqn, g.Size(offsets), k), t))
            chunks_md.append(cls.ChunkStorageMetadata(g.Size(offsets), g.Size(sizes)))
            n_chunks += 1
            n_bytes_total += len(t.data)
        sdm[fqn] = cls.TensorStorageMetadata(cls.TensorProperties(getattr(sys.modules["torch"], dtype)),
                                             g.Size(shape), chunks_md)
        planner[fqn] = tuple(fqn.split(".", 1)) if fqn.startswith("optimizer.") else (fqn,)
    for fqn, value in (("train_state.step", 1000),
                       ("lr_scheduler", {"last_epoch": 1000, "_step_count": 1001, "base_lrs": [3e-4]})):
        per_rank[0].append(("bytes", cls.MetadataIndex(fqn), value))
        sdm[fqn] = cls.BytesStorageMetadata()
        planner[fqn] = (fqn,)

    storage_data = {}
    n_files = 0
    for r, items in per_rank.items():
        bins = g.split_by_size_and_type(items, a.files_per_rank, lambda it: len(it[2].data))
        for i, b in enumerate(bins):
            name = f"__{r}_{i}.distcp"
            with open(os.path.join(out, name), "wb") as f:
                for kind, key, payload in b:
                    start = f.tell()
                    for piece in g.torch_save_pieces(payload):
                        if isinstance(piece, g.Hole):
                            f.seek(len(piece), os.SEEK_CUR)
                        else:
                            f.write(piece)
                    storage_data[key] = cls._StorageInfo(name, start, f.tell() - start)
                f.truncate(f.tell())
            n_files += 1
    md = cls.Metadata(sdm, planner, storage_data, None, "1.0.0")
    with open(os.path.join(out, ".metadata"), "wb") as f:
        pickle.dump(md, f, protocol=4)
    disk = 0
    for name in os.listdir(out):
        disk += os.stat(os.path.join(out, name)).st_blocks * 512
    return {"files": n_files, "tensors": len(tensors), "chunks": n_chunks, "params": len(params),
            "n_bytes": n_bytes_total, "disk_bytes": disk}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--kv-dim", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--files-per-rank", type=int, default=1)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--sparse", action="store_true")
    a = ap.parse_args()
    print(json.dumps(write(os.path.abspath(a.outdir), a)))


if __name__ == "__main__":
    sys.exit(main())
