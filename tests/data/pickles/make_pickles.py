#!/usr/bin/env python3
"""Writes the torch-free pickle fixtures that tests/unit/pickle_test.cc checks.

Usage: python3 make_pickles.py [OUTDIR]   (default: the folder this script lives in)

Outputs (deterministic: no sets of strings, no hash-ordered containers, fixed values):
  plain_p{0,1,2,3,4,5}.pkl   pickle.dumps(sample(), protocol=N) of one object tree covering
                             scalars, big ints, floats, bytes, bytearray, unicode str, nested
                             dict/list/tuple/set/frozenset, argparse.Namespace, an Enum, a
                             dataclass, pathlib.PurePosixPath, OrderedDict, a self-referencing
                             list, a recursive tuple and a shared sub-object referenced twice.
The C++ test asserts the exact parsed structure, so changing sample() means changing the test.
Python: any python3 >= 3.8 (no torch). The committed files were made with CPython 3.11.
"""
import argparse
import collections
import dataclasses
import enum
import os
import pathlib
import pickle
import sys


class Color(enum.Enum):
    RED = 1
    GREEN = 2


@dataclasses.dataclass
class Point:
    x: int
    y: float
    tag: str


def sample():
    shared = [10, 20]
    selfref = [1]
    selfref.append(selfref)
    inner = []
    rec_tuple = (inner, 'rec')
    inner.append(rec_tuple)          # tuple -> list -> the same tuple (POP/POP_MARK paths)
    od = collections.OrderedDict()
    od['b'] = 1
    od['a'] = [2, 3]
    return {
        'none': None,
        'true': True,
        'false': False,
        'int_small': 7,
        'int_neg': -300,
        'int_65535': 65535,
        'int32_min': -2**31,
        'int_2_40': 2**40,
        'int64_min': -2**63,
        'big': 2**70,
        'bigneg': -2**65,
        'float': 1.5,
        'float_neg': -0.25,
        'float_big': 1e300,
        'bytes': b'\x00\x01\xffabc',
        'empty_bytes': b'',
        'bytearray': bytearray(b'xy\x80'),
        'str': 'h\u00e9llo w\u00f6rld \u2713 \U0001F600',
        'str_esc': 'back\\slash\nnew\rline\x00nul',
        'empty_str': '',
        'nested': {
            'list': [1, [2, 3], (4, 5)],
            'tuple': (1, 'a', (None,)),
            'empty_tuple': (),
            'set': {1, 2, 3},
            'frozenset': frozenset({4, 5}),
            'int_key': {1: 'one', 2: 'two'},
        },
        'ns': argparse.Namespace(lr=0.1, name='run'),
        'color': Color.GREEN,
        'point': Point(3, 2.5, 'p'),
        'path': pathlib.PurePosixPath('/tmp/ckpt/step-100'),
        'od': od,
        'selfref': selfref,
        'rec_tuple': rec_tuple,
        'shared_a': shared,
        'shared_b': shared,
    }


def main():
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    os.makedirs(outdir, exist_ok=True)
    for proto in (0, 1, 2, 3, 4, 5):
        data = pickle.dumps(sample(), protocol=proto)
        # Round-trip check: Python itself reads back what we commit.
        back = pickle.loads(data)
        assert back['shared_a'] is back['shared_b']
        assert back['selfref'][1] is back['selfref']
        path = os.path.join(outdir, f'plain_p{proto}.pkl')
        with open(path, 'wb') as f:
            f.write(data)
        print(f'wrote {path} ({len(data)} bytes)')


if __name__ == '__main__':
    main()
