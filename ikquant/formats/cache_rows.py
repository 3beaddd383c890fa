"""The row quantizers ik's `ggml_cpy` runs when it writes float32 keys and values into a quantized KV cache.

A cache write goes through the destination type's `from_float`, which is not always the quantizer llama-quantize
uses for a weight of that type (the codecs in this package):
- Q8_0: the AVX2 row quantizer, id = 127/amax and round half to even (the reference divides 1 by amax/127 and
  rounds halves away from zero);
- Q4_0: ik's "low-PPL" cache quantizer: codes round(x/d) half to even with d = (the signed extreme)/-8, then the
  scale refitted by least squares weighted by x^2;
- Q6_0: the reference rounding (d = max/-32, codes truncated from x/d + 32.5) with the same x^2-weighted refit of
  the scale (llama-quantize always runs the weighted search);
- Q4_1, Q5_0, Q5_1: the reference rounding, the codecs' path without importance weights;
- Q8_KV: the codec's (ik's quantize_row_q8_KV; one f32 scale per cache row, a head's keys);
- IQ4_NL: the block search without its trial scales (ntry -1: the extreme at the grid's low end, then the greedy
  code moves), weights x^2, the codes of the search kept (llama-quantize tries 15 scales and recomputes the codes);
- F16, BF16: the round-to-nearest-even conversions.
The bytes decode with the type's codec.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.errors import QuantInputError
from ikquant.formats.iq4 import block_scale_iq4nl
from ikquant.formats.numeric import fmaf, hsum_float_8, store_f16
from ikquant.types import type_by_name

QK = 32
KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")
SCALAR = dict(cache=True, nogil=True, error_model="numpy")


@njit(**KERNEL)
def _cache_q8_0(x: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    qs = out.view(np.int8)
    for r in prange(n_rows):
        for ib in range(n // QK):
            base, o = ib * QK, ib * 34
            amax = np.float32(0.0)
            for j in range(QK):
                amax = max(amax, abs(x[r, base + j]))
            store_f16(out[r], o, amax / np.float32(127.0))
            idv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            for j in range(QK):
                qs[r, o + 2 + j] = np.int8(np.rint(x[r, base + j] * idv))


@njit(**KERNEL)
def _cache_q4_0(x: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    for r in prange(n_rows):
        codes = np.empty(QK, dtype=np.uint8)
        sqx = np.zeros(8, dtype=np.float32)
        sq2 = np.zeros(8, dtype=np.float32)
        for ib in range(n // QK):
            xb = x[r, ib * QK : (ib + 1) * QK]
            vmax, vmin = xb.max(), xb.min()
            amax, amin = abs(vmax), abs(vmin)
            if amax > amin:
                d = vmax / np.float32(-8.0)
                idv = np.float32(1.0) / d if amax > np.float32(1e-13) else np.float32(0.0)
            else:
                d = vmin / np.float32(-8.0)
                idv = np.float32(1.0) / d if amin > np.float32(1e-13) else np.float32(0.0)
            sqx[:] = 0
            sq2[:] = 0
            for j in range(QK):  # lane j % 8 of the j // 8-th vector accumulates value j
                q = min(np.float32(np.rint(idv * xb[j])), np.float32(7.0))
                codes[j] = np.uint8(np.int32(q) + 8)
                wr = (xb[j] * xb[j]) * q
                sqx[j % 8] = fmaf(wr, xb[j], sqx[j % 8])
                sq2[j % 8] = fmaf(wr, q, sq2[j % 8])
            sumq2 = hsum_float_8(sq2)
            if sumq2 > 0:
                d = hsum_float_8(sqx) / sumq2
            o = ib * 18
            store_f16(out[r], o, d)
            for j in range(16):
                out[r, o + 2 + j] = codes[j] | (codes[j + 16] << np.uint8(4))


@njit(**SCALAR)
def _code6(v: np.float32) -> np.uint8:
    """The reference's 6-bit code of v = x/d: v + 32.5 truncated to int8, capped at 63."""
    c = np.int32(np.int8(np.int32(v + np.float32(32.5))))
    return np.uint8(c if c < 63 else 63)


@njit(**KERNEL)
def _cache_q6_0(x: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    for r in prange(n_rows):
        for ib in range(n // QK):
            xb = x[r, ib * QK : (ib + 1) * QK]
            amax, vmax = np.float32(0.0), np.float32(0.0)
            for j in range(QK):
                if amax < abs(xb[j]):
                    amax, vmax = abs(xb[j]), xb[j]
            d = vmax / np.float32(-32.0)
            idv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            o = ib * 26
            for k in range(8):
                out[r, o + 2 + k] = 0
            sumqx, sumq2 = np.float32(0.0), np.float32(0.0)
            for j in range(16):
                x0, x1 = xb[j] * idv, xb[j + 16] * idv
                w0, w1 = x0 * x0, x1 * x1
                l0, l1 = _code6(x0), _code6(x1)
                out[r, o + 10 + j] = (l0 & np.uint8(15)) | ((l1 & np.uint8(15)) << np.uint8(4))
                h = (l0 >> np.uint8(4)) | ((l1 >> np.uint8(4)) << np.uint8(2))
                out[r, o + 2 + j % 8] |= h << np.uint8(4 * (j // 8))
                q0, q1 = np.float32(l0) - np.float32(32.0), np.float32(l1) - np.float32(32.0)
                sumqx += fmaf(w0 * xb[j], q0, w1 * xb[j + 16] * q1)
                sumq2 += fmaf(w0 * q0, q0, w1 * q1 * q1)
            store_f16(out[r], o, sumqx / sumq2 if sumq2 > 0 else d)


@njit(**KERNEL)
def _cache_iq4_nl(x: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    for r in prange(n_rows):
        codes = np.zeros(QK, dtype=np.uint8)  # a zero block keeps the codes before it, as ik's do (its scale is 0)
        for ib in range(n // QK):
            xb = x[r, ib * QK : (ib + 1) * QK]
            d = block_scale_iq4nl(xb, xb * xb, codes, False)
            o = ib * 18
            store_f16(out[r], o, d)
            for j in range(16):
                out[r, o + 2 + j] = codes[j] | (codes[j + 16] << np.uint8(4))


_CACHE_KERNELS = {"Q8_0": _cache_q8_0, "Q4_0": _cache_q4_0, "Q6_0": _cache_q6_0, "IQ4_NL": _cache_iq4_nl}
#: types whose cache write is the codec's own quantizer without importance weights
_CODEC_WRITES = ("F32", "F16", "BF16", "Q4_1", "Q5_0", "Q5_1", "Q8_KV")
#: the cache types whose writes this module reproduces
CACHE_WRITE_TYPES = (*_CODEC_WRITES, *_CACHE_KERNELS)


def cache_row_bytes(type_name: str, rows: np.ndarray) -> np.ndarray:
    """Rows [n_rows, n] of float32 as ik's ggml_cpy writes them into a cache of `type_name` ([n_rows, row bytes])."""
    codec = type_by_name(type_name).require_codec()
    kernel = _CACHE_KERNELS.get(type_name)
    if kernel is None:
        if type_name not in _CODEC_WRITES:
            raise QuantInputError(f"writes into a {type_name} KV cache are not reproduced; reproduced: "
                                  + ", ".join(CACHE_WRITE_TYPES))
        return codec.quantize(rows)
    x = codec._check_rows(rows)
    out = np.empty((x.shape[0], codec.ggml_type.row_bytes(x.shape[1])), dtype=np.uint8)
    if x.shape[0]:
        kernel(x, out)
    return out


def cache_round_trip(type_name: str, rows: np.ndarray) -> np.ndarray:
    """What a cache of `type_name` holds of float32 rows [n_rows, n]: its bytes decoded back to float32."""
    if type_name == "F32":
        return np.ascontiguousarray(rows, dtype=np.float32)
    return type_by_name(type_name).require_codec().dequantize(cache_row_bytes(type_name, rows), rows.shape[1])
