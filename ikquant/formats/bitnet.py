"""ik's BitNet types IQ1_BN, IQ2_BN and IQ2_BN_R4: ternary values {-1, 0, +1} times one scale per row.

Both quantizers take the row's largest magnitude M as the scale and code each value as a trit t: 0 (x <= -M/2),
1 (|x| < M/2), 2 (x >= M/2); a value decodes as scale * (t - 1). ik ignores importance weights for all three types.
Rows are a header followed by 64-value blocks:

- IQ1_BN (2-byte header, 13-byte blocks, 1.625 bits per value): the header is M as f16. A block is four groups of
  16 values; a group's first 15 values fill three bytes of 5 trits each, the 16th values of the four groups share
  the 13th byte. A byte holds its trits as a base-3 number n (first trit least significant) scaled to a byte,
  ceil(256 n / 243); trit j of byte b is the top trit of (b * 3^(4-j)) mod 256, i.e. (v + (v >> 1)) >> 7 of it.
- IQ2_BN (4-byte header, 16-byte blocks): the header is M as f32; byte j of a block holds the 2-bit trits of values
  j, j + 16, j + 32 and j + 48 (from the low bits up).
- IQ2_BN_R4: IQ2_BN's bits regrouped 4 rows at a time (ik's repack_iq2_bn). A group starts with the 4 rows' f32
  scales; then per block column 64 bytes: byte 16 l + 4 k + i holds, for row k, the trit pairs (bits 2l, 2l + 1) of
  IQ2_BN bytes i, i + 4, i + 8 and i + 12 of that row's block, from the low bits up.

The value of a code is what ik's matrix kernels (and its CUDA dequantizer) compute: the header's scale times t - 1.
ik's CPU to_float for IQ1_BN and IQ2_BN differs: it decodes the row from its first byte, reading the header as codes
and dropping the tail of the last block, and never applies the scale (tests/test_quant_golden.py checks the golden floats
against that). IQ2_BN_R4's to_float reads its header and matches the values given here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from ikquant.formats.base import Codec
from ikquant.formats.interleaved import InterleavedCodec, row_scales_r4
from ikquant.formats.numeric import finite_abs_max, load_f16, load_f32, store_f16, store_f32
from ikquant.types import register_codec

KERNEL: dict[str, Any] = dict(cache=True, nogil=True, parallel=True, error_model="numpy")
QK_BN = 64
IQ1_BN_BLOCK = 13
IQ2_BN_BLOCK = 16
#: 3^5, the number of values the 5 trits of an IQ1_BN code byte can take
FIVE_TRIT_VALUES = 243


def _trit_table() -> np.ndarray:
    """[256, 5] int8: trit j (0, 1, 2) of an IQ1_BN code byte, by ik's (v + (v >> 1)) >> 7 of v = b * 3^(4-j) mod 256."""
    b = np.arange(256, dtype=np.int64)[:, None]
    v = (b * (3 ** (4 - np.arange(5)))[None, :]) & 0xFF
    return ((v + (v >> 1)) >> 7).astype(np.int8)


TRITS = _trit_table()


@njit(cache=True, nogil=True, inline="always")
def _trit(v: np.float32, thresh: np.float32) -> np.int32:
    """0 for a value at or below -thresh, 1 for |v| < thresh, 2 at or above +thresh; one expression of selects, so
    that a loop over values vectorises (_row_trits)."""
    return np.int32(1) if abs(v) < thresh else (np.int32(0) if v < 0 else np.int32(2))


@njit(cache=True, nogil=True, inline="always")
def _row_trits(x: np.ndarray, thresh: np.float32, trits: np.ndarray) -> None:
    """_trit of every value of a row, as selects, into a buffer the codes are then summed from (a loop LLVM
    vectorises: IQ1_BN quantized 781 M weights/s a thread with a _trit per value as it packed, 1405 this way)."""
    for j in range(x.shape[0]):
        trits[j] = _trit(x[j], thresh)


@njit(**KERNEL)
def _quantize_iq1_bn(x: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    for r in prange(n_rows):
        m = finite_abs_max(x[r])
        store_f16(out[r], 0, m)
        t = np.empty(n, np.int32)
        _row_trits(x[r], np.float32(0.5) * m, t)
        for ib in range(n // QK_BN):
            o, base = 2 + IQ1_BN_BLOCK * ib, ib * QK_BN
            for g in range(4):
                for k in range(3):
                    at = base + 16 * g + 5 * k
                    code = t[at] + 3 * t[at + 1] + 9 * t[at + 2] + 27 * t[at + 3] + 81 * t[at + 4]
                    out[r, o + 3 * g + k] = (256 * code + FIVE_TRIT_VALUES - 1) // FIVE_TRIT_VALUES
            last = t[base + 15] + 3 * t[base + 31] + 9 * t[base + 47] + 27 * t[base + 63]
            out[r, o + 12] = (256 * last + FIVE_TRIT_VALUES - 1) // FIVE_TRIT_VALUES


@njit(**KERNEL)
def _dequantize_iq1_bn(q: np.ndarray, trits: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        d = load_f16(q[r], 0)
        for ib in range(n // QK_BN):
            o, base = 2 + IQ1_BN_BLOCK * ib, ib * QK_BN
            for g in range(4):
                for k in range(3):
                    b = q[r, o + 3 * g + k]
                    for j in range(5):
                        out[r, base + 16 * g + 5 * k + j] = d * np.float32(trits[b, j] - 1)
                out[r, base + 16 * g + 15] = d * np.float32(trits[q[r, o + 12], g] - 1)


@njit(**KERNEL)
def _quantize_iq2_bn(x: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    for r in prange(n_rows):
        m = finite_abs_max(x[r])
        store_f32(out[r], 0, m)
        thresh = np.float32(0.5) * m
        for ib in range(n // QK_BN):
            o, base = 4 + IQ2_BN_BLOCK * ib, ib * QK_BN
            for j in range(16):
                b = 0
                for s in range(4):
                    b |= _trit(x[r, base + j + 16 * s], thresh) << (2 * s)
                out[r, o + j] = b


@njit(**KERNEL)
def _dequantize_iq2_bn(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        d = load_f32(q[r], 0)
        for ib in range(n // QK_BN):
            o, base = 4 + IQ2_BN_BLOCK * ib, ib * QK_BN
            for j in range(16):
                b = q[r, o + j]
                for s in range(4):
                    out[r, base + j + 16 * s] = d * np.float32(((b >> (2 * s)) & 3) - 1)


class IQ1BNCodec(Codec, type_name="IQ1_BN"):
    uses_imatrix = False
    max_abs_input = 65504.0
    # a value below M/2 becomes 0, one at or above it +-d: the error is at most M/2 plus the f16 rounding of d = M
    # (2^-11 M, or 2^-25 where d is an f16 subnormal)
    rel_error_bound = 0.5 + 2.0**-11
    abs_error_floor = 2.0**-24

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq1_bn(x, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq1_bn(q, TRITS, out)


class IQ2BNCodec(Codec, type_name="IQ2_BN"):
    uses_imatrix = False
    # as IQ1_BN with an exact f32 scale: the error is at most M/2
    rel_error_bound = 0.5

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq2_bn(x, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq2_bn(q, out)


def iq2_bn_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """Block column `ib` of an IQ2_BN_R4 group: the IQ2_BN source bit of every bit of its 64 bytes."""
    bits = []
    for o in range(64):
        pair, row, i = o // 16, (o % 16) // 4, o % 4
        for j in range(8):
            src_byte = row * row_bytes + 4 + IQ2_BN_BLOCK * ib + i + 4 * (j // 2)
            bits.append(8 * src_byte + 2 * pair + j % 2)
    return np.array(bits, dtype=np.int64)



register_codec(InterleavedCodec("IQ2_BN_R4", iq2_bn_r4_block, row_scales_r4))
