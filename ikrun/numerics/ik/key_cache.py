"""ik's K x Q product over a quantized K cache without flash attention (-ctk q8_0 / q4_0, -fa off).

ik's graph multiplies the cache's view of a layer's keys (one matrix of its cells per KV head) with the queries in
its ordinary matmul: the K cache is the "weight". The queries are rounded to the K type's vec_dot_type (Q8_2_X4 on
AVX2 for Q8_0 and Q4_0, the activations of a Q8_0 or Q4_0 weight), and each query head is one matmul of its own
against its group's keys (iqk_mul_mat_4d: the heads split over ik's threads, each head's keys over the threads left),
which takes the weights' kernel choice: with 32 query rows and more ik converts the cache rows to Q8_0_R8 and
multiplies integers (formats.py, qgemm.py). The cache holds what ik's ggml_cpy wrote (ikquant/formats/cache_rows.py),
so the keys are written here as they are read: the same rows, the same bytes. With -khad ik rotates both the keys
(before the write) and the queries by its Hadamard transform; the rotated queries are what is rounded.
"""

from __future__ import annotations

import numpy as np

from ikquant.formats.cache_rows import cache_row_bytes
from ikquant.types import type_by_name
from ikrun.numerics.ik.attention import KV_CELL_PAD
from ikrun.numerics.ik.formats import ToInts, integer_rows
from ikrun.numerics.ik.qgemm import pack, qmatmul


def key_cells(n_keys: int) -> int:
    """The rows of the K view ik multiplies for `n_keys` keys (its cache cells, padded: what its kernel choice
    sees)."""
    return n_keys + (-n_keys % KV_CELL_PAD)


def key_products(q: np.ndarray, k: np.ndarray, type_name: str, ints: ToInts, fmt: str) -> np.ndarray:
    """The scores q . k [H, n, keys] of queries q [n, H, d] against keys k [keys, H_kv, d] written into a K cache of
    GGML type `type_name`, multiplied as ik's kernel holds the cache rows (`ints`) against the queries rounded to
    activation format `fmt`."""
    n, n_head, d = q.shape
    n_keys, n_kv = k.shape[0], k.shape[1]
    codec = type_by_name(type_name).require_codec()
    packed = []
    for g in range(n_kv):
        raw = cache_row_bytes(type_name, np.ascontiguousarray(k[:, g], dtype=np.float32))
        packed.append(pack(ints(raw, codec.dequantize(raw, d).reshape(n_keys, d))))
    group = n_head // n_kv
    scores = np.empty((n_head, n, n_keys), np.float32)
    for h in range(n_head):
        scores[h] = qmatmul(integer_rows(q[:, h], fmt), packed[h // group])
    return scores
