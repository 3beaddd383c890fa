"""MXFP4: 32 FP4 (E2M1) codes sharing one E8M0 power-of-two scale.

ik's quantizer (iqk_quantize.cpp) ignores importance weights: the exponent comes from the block's max |x| and each
value takes the grid point nearest to it. Every step is exact or a correctly rounded single operation except
log2f, which numba takes from the same C library as ik, so the bytes match ik's exactly.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ikquant.formats.base import Codec
from ikquant.formats.numeric import e8m0_half_to_f32, finite_abs_max, trunc_i32

QK = 32
BLOCK_BYTES = 17
KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")

# ggml-common.h kvalues_mxfp4: the E2M1 values doubled (hence the half-valued scale); codes 8-15 negate 0-7
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
_FVALUES = KVALUES_MXFP4.astype(np.float32)


@njit(cache=True, nogil=True, error_model="numpy")
def _block_exponent(amax: np.float32) -> np.uint8:
    """ik's e = (uint8_t)(floor(log2f(amax)) - 2 + 127): x86 converts through int32, so tiny blocks wrap around."""
    e = (np.float32(math.floor(math.log2(amax))) - np.float32(2.0)) + np.float32(127.0)
    return np.uint8(trunc_i32(e) & np.int32(0xFF))


@njit(cache=True, nogil=True, error_model="numpy")
def _nearest_code(v: np.float32, grid: np.ndarray) -> np.int32:
    """ik takes the first code with the smallest float32 |x - d*v| over all 16. Rounding is symmetric, so
    |x + d*v| = ||x| - d*v|, and a grid point of the other sign never beats code 0; hence: search |x| over codes
    0-7 in order, then move a nonzero code of a negative x to its negated twin (8 + k). Written with selects only
    (and a 32-bit code, the floats' width), so that a loop over values vectorises."""
    a = abs(v)
    best = a
    code = np.int32(0)
    for k in range(1, 8):
        diff = abs(a - grid[k])
        better = diff < best
        best = diff if better else best
        code = np.int32(k) if better else code
    return code + np.int32(8) if v < 0 and code != 0 else code


@njit(**KERNEL)
def _quantize_mxfp4(x: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    for r in prange(n_rows):
        grid = np.empty(8, dtype=np.float32)
        code = np.empty(QK, dtype=np.int32)
        for ib in range(n // QK):
            xb = x[r, ib * QK : (ib + 1) * QK]
            o = ib * BLOCK_BYTES
            amax = finite_abs_max(xb)
            if amax == 0:
                for k in range(BLOCK_BYTES):
                    out[r, o + k] = 0
                continue
            e = _block_exponent(amax)
            out[r, o] = e
            d = e8m0_half_to_f32(e)
            for k in range(8):
                grid[k] = d * _FVALUES[k]
            for j in range(QK):
                code[j] = _nearest_code(xb[j], grid)
            for j in range(QK // 2):
                out[r, o + 1 + j] = np.uint8(code[j] | (code[j + QK // 2] << 4))


@njit(cache=True, nogil=True, inline="always")
def mxfp4_values(row: np.ndarray, k0: int, k1: int, y: np.ndarray, at: int) -> None:
    """Values k0 .. k1 - 1 (multiples of QK) of an MXFP4 row (its bytes) into y[at : at + k1 - k0]: the decoding,
    of whole rows here and of a block of rows at a time in the runtime's expert kernel, which decodes into its
    first-level cache (a row's length need not be a multiple of the kernel's step, so the span is explicit)."""
    half = QK // 2
    for ib in range(k0 // QK, k1 // QK):
        o = ib * BLOCK_BYTES
        d = e8m0_half_to_f32(row[o])
        src = row[o + 1 : o + 1 + half]
        lo = y[at + ib * QK - k0 : at + ib * QK - k0 + half]
        hi = y[at + ib * QK - k0 + half : at + (ib + 1) * QK - k0]
        for j in range(half):
            lo[j] = d * _FVALUES[src[j] & np.uint8(15)]
        for j in range(half):
            hi[j] = d * _FVALUES[src[j] >> np.uint8(4)]


@njit(**KERNEL)
def _dequantize_mxfp4(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        mxfp4_values(q[r], 0, n, out[r], 0)


class MXFP4Codec(Codec, type_name="MXFP4"):
    uses_imatrix = False
    # The scale puts amax/(2d) in [4, 8) (or just below 4 when log2f rounds up to the next power of two), where
    # the E2M1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6 is at most 2 apart, and clips at 6: the error stays below amax/4.
    # Blocks with amax < 2^-125 get a wrapped-around exponent and all-zero codes: an error below 2^-125. Every
    # finite float32 is representable (the largest exponent used is 253).
    rel_error_bound = 0.25 + 2.0**-20
    abs_error_floor = 2.0**-125

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_mxfp4(x, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_mxfp4(q, out)

