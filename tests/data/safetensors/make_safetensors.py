#!/usr/bin/env python3
"""Writes the safetensors fixtures that tests/unit/safetensors_test.cc reproduces byte for byte.

Usage: .venv/bin/python make_safetensors.py [OUTDIR]   (default: the folder this script lives in)

Needs torch >= 2.7 (float8_e8m0fnu) and safetensors 0.8.0 (tests/requirements.txt); the
committed files were made with torch 2.13.0+cpu and safetensors 0.8.0.

Every tensor's bytes are PatternByte(seed, k) for k = 0 .. n_bytes-1 (the C++ test computes the
same bytes), so the files are deterministic and the test needs no torch. Metadata has at most
one key: the library writes metadata from a Rust HashMap, in an order that changes per run.

Outputs:
  mixed.safetensors       F32/BF16/I64/BOOL/U8/F8_E4M3/F16/I32 tensors, names out of order,
                          metadata {"format": "pt"}
  zero_empty.safetensors  a 0-d tensor, empty tensors ([0], [2, 0], [0, 3] of two dtypes), no metadata
  all_dtypes.safetensors  one tensor of every dtype ucpfs maps (F4/F6 excepted), no metadata
  names.safetensors       names and a metadata value that need JSON escaping or are not ASCII
  no_tensors.safetensors  no tensors, metadata {"format": "pt"}
  empty.safetensors       no tensors, no metadata
  index.json              json.dumps(index, indent=2, sort_keys=True) + "\\n", as transformers'
                          save_pretrained writes model.safetensors.index.json
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file


def pattern_byte(seed, k):
    return (k * 31 + seed * 7 + (k >> 8)) % 251


def tensor(dtype, shape, seed):
    n_elems = 1
    for d in shape:
        n_elems *= d
    n_bytes = n_elems * torch.empty((), dtype=dtype).element_size()
    data = bytearray(pattern_byte(seed, k) for k in range(n_bytes))
    if dtype == torch.bool:  # torch refuses nothing here, but keep bools 0/1 so they load as bools
        data = bytearray(b & 1 for b in data)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape).clone() if n_bytes else \
        torch.empty(shape, dtype=dtype)


# (name, dtype, shape, seed): the C++ test holds the same tables.
MIXED = [
    ("layers.1.w", torch.float32, [3, 2], 1),
    ("layers.0.w", torch.bfloat16, [2, 3], 2),
    ("step", torch.int64, [], 3),
    ("mask", torch.bool, [5], 4),
    ("tokens", torch.uint8, [7], 5),
    ("scale_fp8", torch.float8_e4m3fn, [3], 6),
    ("a_half", torch.float16, [1, 1, 3], 7),
    ("ids", torch.int32, [4], 8),
    ("bias", torch.float32, [3], 9),
    ("Z_upper", torch.bfloat16, [1], 10),
]
ZERO_EMPTY = [
    ("scalar", torch.float32, [], 1),
    ("empty", torch.float32, [0], 2),
    ("empty_2x0", torch.int64, [2, 0], 3),
    ("empty_0x3", torch.float32, [0, 3], 4),
    ("after", torch.float16, [2], 5),
]
ALL_DTYPES = [
    ("f64", torch.float64, [2], 1), ("f32", torch.float32, [2], 2), ("f16", torch.float16, [2], 3),
    ("bf16", torch.bfloat16, [2], 4), ("i64", torch.int64, [2], 5), ("i32", torch.int32, [2], 6),
    ("i16", torch.int16, [2], 7), ("i8", torch.int8, [2], 8), ("u8", torch.uint8, [2], 9),
    ("bool", torch.bool, [2], 10), ("u16", torch.uint16, [2], 11), ("u32", torch.uint32, [2], 12),
    ("u64", torch.uint64, [2], 13), ("c64", torch.complex64, [2], 14),
    ("f8_e4m3", torch.float8_e4m3fn, [3], 15), ("f8_e5m2", torch.float8_e5m2, [3], 16),
    ("f8_e4m3fnuz", torch.float8_e4m3fnuz, [3], 17), ("f8_e5m2fnuz", torch.float8_e5m2fnuz, [3], 18),
    ("f8_e8m0", torch.float8_e8m0fnu, [3], 19),
]
NAMES = [
    ("caf\u00e9", torch.float32, [1], 1),
    ("quote\"back\\slash/", torch.float32, [1], 2),
    ("ctl\x01\x1f\x7f\t\n\r\b\f", torch.float32, [1], 3),
    ("\u4e2d\u6587.\U0001f600", torch.float32, [1], 4),
    ("z", torch.float32, [1], 5),
    ("Z", torch.float32, [1], 6),
]
INDEX_WEIGHT_MAP = {
    "model.layers.10.w": "model-00002-of-00002.safetensors",
    "model.layers.9.w": "model-00001-of-00002.safetensors",
    "lm_head.weight": "model-00002-of-00002.safetensors",
    "caf\u00e9\x7f\x01\"\\/": "model-00001-of-00002.safetensors",
    "\U0001f600": "model-00001-of-00002.safetensors",
    "\uffff": "model-00001-of-00002.safetensors",
    "Z": "model-00001-of-00002.safetensors",
}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))

    def save(fname, table, metadata):
        save_file({n: tensor(d, s, seed) for n, d, s, seed in table}, os.path.join(out, fname),
                  metadata=metadata)

    save("mixed.safetensors", MIXED, {"format": "pt"})
    save("zero_empty.safetensors", ZERO_EMPTY, None)
    save("all_dtypes.safetensors", ALL_DTYPES, None)
    save("names.safetensors", NAMES, {"note": "\u00e9\"\\\n\x00"})
    save("no_tensors.safetensors", [], {"format": "pt"})
    save("empty.safetensors", [], None)
    index = {"metadata": {"total_size": 123456789}, "weight_map": INDEX_WEIGHT_MAP}
    with open(os.path.join(out, "index.json"), "w") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
