"""The absorbed-MLA weights ik derives at load from a file that carries attn_kv_b alone, as its kernels see them.

ik's llm_prepare_mla makes attn_k_b (each head's nope rows of attn_kv_b, transposed) with ggml_cast: Q8_0 written by
the cache writer's row quantizer when attn_kv_b is quantized, else attn_kv_b's own float type; attn_v_b is a copy of
each head's value rows, in attn_kv_b's type and bytes. A `HeadSource` says which stored tensor such a weight comes
from, the type ik multiplies it as, and how its rows (raw bytes and their decoding) are taken from the stored ones,
so the ik arithmetic multiplies it with the kernels of that type, as it multiplies a file's own attn_k_b / attn_v_b.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ikquant.formats.cache_rows import cache_row_bytes
from ikquant.types import type_by_name

#: raw rows and their float32 decoding -> the same of the derived weight
TakeRows = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
#: the float types ik keeps when it transposes attn_kv_b's nope rows (any other, quantized, becomes Q8_0)
KEPT_TYPES = ("F32", "F16", "BF16")
#: offsets of the derived weights' cache kinds (ikrun/weights.py keys what is made from a tensor by kind)
K_B_KIND, V_B_KIND = -1000, -2000


@dataclass(frozen=True)
class HeadSource:
    """A per-head weight's rows: stored tensor `name` as it is (`take` None), or rows ik derives from it."""

    name: str
    type_name: str
    take: TakeRows | None = None
    #: added to the weight cache's kind of anything made from the derived rows
    kind: int = 0
    #: each head's rows (0: the stored tensor's rows over the heads)
    head_rows: int = 0

    def rows(self, raw: np.ndarray, decoded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The weight's raw rows and their decoding, from the stored tensor's."""
        return (raw, decoded) if self.take is None else self.take(raw, decoded)


def derived_k_b_type(kv_b_type: str) -> str:
    """The type of the attn_k_b ik derives from an attn_kv_b of `kv_b_type`."""
    return kv_b_type if kv_b_type in KEPT_TYPES else "Q8_0"


def derived_k_b_source(kv_b: str, kv_b_type: str, n_head: int, n_nope: int, n_lat: int) -> HeadSource:
    """attn_k_b [H * C, D] as ik derives it from attn_kv_b [H * (D + V), C] of type `kv_b_type`."""
    kept = derived_k_b_type(kv_b_type)

    def take(raw: np.ndarray, decoded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = np.ascontiguousarray(decoded.reshape(n_head, -1, decoded.shape[1])[:, :n_nope].transpose(0, 2, 1))
        rows = w.reshape(-1, n_nope)
        if kept != "Q8_0":
            return rows, rows
        q = cache_row_bytes("Q8_0", rows)
        return q, type_by_name("Q8_0").require_codec().dequantize(q, n_nope)

    return HeadSource(kv_b, kept, take, K_B_KIND, n_lat)


def derived_v_b_source(kv_b: str, kv_b_type: str, n_head: int, n_nope: int, head_v: int) -> HeadSource:
    """attn_v_b [H * V, C] as ik derives it from attn_kv_b: each head's value rows, bytes as stored."""

    def take(raw: np.ndarray, decoded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raw_v = raw.reshape(n_head, -1, raw.shape[1])[:, n_nope:].reshape(-1, raw.shape[1])
        dec_v = decoded.reshape(n_head, -1, decoded.shape[1])[:, n_nope:].reshape(-1, decoded.shape[1])
        return np.ascontiguousarray(raw_v), np.ascontiguousarray(dec_v)

    return HeadSource(kv_b, kv_b_type, take, V_B_KIND, head_v)
