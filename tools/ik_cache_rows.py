#!/usr/bin/env python3
"""The bytes ik writes into a KV cache of each type, from its own library: calls `from_float` of the type's traits
in a native ik build's libggml.so (what its ggml_cpy runs for a cache write) on rows of keys, and saves the rows and
each type's bytes for tests/test_kv_cache.py.

The rows: 64 rows of 128 values, normal with a few outliers per row (as roped keys have), seeded.

Example: python tools/ik_cache_rows.py --lib ~/ik/build/ggml/src/libggml.so --out tests/data/kv-cache
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np

#: ik's cache types (ggml type ids) whose writes are saved
TYPES = {"q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q6_0": 133, "iq4_nl": 20, "f16": 1,
         "bf16": 30}


class TypeTraits(ctypes.Structure):
    """The head of ggml_type_traits_t up to from_float (ggml.h)."""

    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p),
                ("from_float_to_mat", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64), ("ncols", ctypes.c_int64), ("gemv", ctypes.c_void_p),
                ("gemm", ctypes.c_void_p), ("row_meta_size", ctypes.c_int64)]


def key_rows(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    x[np.arange(64), rng.integers(0, 128, 64)] *= 8  # an outlier per row
    x[0, :32] = 0  # an all-zero block
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", type=Path, required=True, help="libggml.so of a native ik build")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    lib = ctypes.CDLL(str(args.lib))
    lib.ggml_internal_get_type_traits.restype = TypeTraits
    lib.ggml_internal_get_type_traits.argtypes = [ctypes.c_int]
    args.out.mkdir(parents=True, exist_ok=True)
    x = key_rows()
    np.save(args.out / "rows.npy", x)
    quantize = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    for name, type_id in TYPES.items():
        traits = lib.ggml_internal_get_type_traits(type_id)
        assert traits.type_name.decode() == name, (traits.type_name, name)
        row_bytes = traits.type_size * x.shape[1] // traits.blck_size
        out = np.zeros((x.shape[0], row_bytes), dtype=np.uint8)
        for r in range(x.shape[0]):  # one call per row, as ggml_cpy quantizes a head's row at a time
            quantize(traits.from_float)(x[r].ctypes.data, out[r].ctypes.data, x.shape[1])
        out.tofile(args.out / f"ik-{name}.bin")
        print(name, out.nbytes, "bytes")


if __name__ == "__main__":
    main()
