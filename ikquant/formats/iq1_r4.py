"""IQ1_S_R4 and IQ1_M_R4: ik's 4-row IQ1 types (ik's quantize_iq1_s_r4 / quantize_iq1_m_r4). Unlike the other
interleaved types they are not a regrouping of IQ1_S / IQ1_M bytes: they have 32-value blocks and one f16 scale per
row, and their own quantizer (the IQ1 block searches of iq1_search, on other importances and scale codes).

A group of 4 rows of n values is 4 f16 row scales d_k, then n / 32 blocks holding the 4 rows' blocks side by side;
iktools' per-row view gives each row 2 + (6 or 7) n / 32 bytes of that group, as GGMLType.row_bytes counts them.

- IQ1_S_R4 block (24 bytes): 16 low index bytes (byte 4 i + k: group i of row k), 4 u16 (row k): the 4 indices'
  top 3 bits, a 3-bit scale s (bits 12-14) and the shift sign (bit 15); value = d_k (2 s + 1) (level + shift).
- IQ1_M_R4 block (28 bytes): 16 low index bytes as above, 8 qh bytes (byte 4 h + k: row k's half h, top bits of
  its two groups in the nibbles and their shift signs in bits 3 and 7), 4 scale bytes (row k: one 4-bit scale s
  per 16 values); value = d_k s (level + shift).

The importance of a value is qw sqrt(sigma2 + x^2) (sigma2 = 1.5 times the block's mean square) or, without an
importance vector or where qw |x| vanishes over the block (IQ1_M_R4: over a half), sqrt(sigma2 + x^2). A block
whose sum of squares is below 1e-14 (IQ1_M_R4: a half) is stored as the all-zero grid point with scale 0. d_k is
1.0625 times the row's largest block scale / 15; IQ1_S_R4 codes a scale as nearest((scale / d - 1) / 2) in
0..7, IQ1_M_R4 as nearest(scale / d) in 0..15. The float arithmetic is ik's GCC build (its sums of squares round
each square; the importances fall back to sqrt(sigma2 + x^2) with x^2 rounded in IQ1_M_R4, fused elsewhere).

ik's IQ1_M_R4 keeps its two shift variables from block to block: a half below the threshold in a block that is not
all zero stores the shift bits of the last half (first or second, as its own) that had some, in the call's order
(groups, blocks, rows; before any, ik reads uninitialized memory, here 0), and `iq1_search.carry_shifts`
reproduces that. A call must hold whole groups of 4 rows.
"""

from __future__ import annotations

import warnings

import numpy as np
from numba import njit, prange

from ikquant.errors import QuantInputError
from ikquant.formats.base import Codec
from ikquant.formats.iq1_search import (
    IQ1M_SHIFT_MASKS,
    NO_SHIFT,
    carry_shifts,
    iq1_grid,
    iq1m_block,
    iq1s_block,
    scale_code,
    scratch,
    sum_squares,
)
from ikquant.formats.iq12 import GRID_IQ1S, IQ1S_DELTA
from ikquant.formats.numeric import fmaf, load_f16, nearest_int_fma, store_f16

GROUP = 4
BLOCK = 32
HEADER = 2 * GROUP  # the group's 4 f16 row scales
IQ1_S_R4_BLOCK = 24
IQ1_M_R4_BLOCK = 28
ZERO_POINT = 1029  # the grid point of 8 levels 0 (ik stores it for blocks of zeros)
EPS = np.float32(1e-14)
#: an IQ1_M_R4 half that neither stores nor sets a shift (its whole block is zeros)
UNUSED = -2
KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")
NJIT = dict(cache=True, nogil=True, error_model="numpy")


@njit(**NJIT)
def _roots(xg: np.ndarray, o: int, sigma2: np.float32, fused: bool, weight: np.ndarray, wo: int, n: int) -> None:
    """weight[wo:wo+n] = sqrt(sigma2 + x^2) of xg[o + wo:...], the square fused into the sum or rounded first."""
    for j in range(wo, wo + n):
        v = xg[o + j]
        weight[j] = np.sqrt(fmaf(v, v, sigma2) if fused else sigma2 + v * v)


@njit(**NJIT)
def _weighted(xg: np.ndarray, o: int, qw: np.ndarray, qo: int, sigma2: np.float32, weight: np.ndarray) -> None:
    """weight[:32] = qw sqrt(sigma2 + x^2) of the block at xg[o], its importances qw[qo:qo+32]."""
    for j in range(BLOCK):
        v = xg[o + j]
        weight[j] = qw[qo + j] * np.sqrt(fmaf(v, v, sigma2))


@njit(**NJIT)
def _importance(weight: np.ndarray, xg: np.ndarray, o: int, lo: int, n: int) -> np.float32:
    """sum of weight |x| over weight[lo:lo+n]."""
    s = np.float32(0.0)
    for j in range(lo, lo + n):
        s = fmaf(weight[j], abs(xg[o + j]), s)
    return s


@njit(**NJIT)
def _store_zero_s(blob: np.ndarray, bo: int, k: int) -> None:
    """Row k's part of the IQ1_S_R4 block at bo as ik stores a block of zeros: 4 x the zero point, scale code 0."""
    h = 0
    for i in range(4):
        blob[bo + 4 * i + k] = ZERO_POINT & 255
        h |= (ZERO_POINT >> 8) << (3 * i)
    blob[bo + 16 + 2 * k] = h & 255
    blob[bo + 17 + 2 * k] = h >> 8


@njit(**KERNEL)
def _quantize_iq1_s_r4(x: np.ndarray, qw: np.ndarray, out: np.ndarray, grid: tuple) -> None:  # type: ignore[type-arg]
    """x [groups, 4 n] (a group's rows back to back), out [groups, group bytes]."""
    groups = x.shape[0]
    n = x.shape[1] // GROUP
    nblock = n // BLOCK
    for g in prange(groups):
        weight, L, order, sums, index, marks = scratch()
        scales = np.zeros((nblock, GROUP), np.float32)
        mx = np.zeros(GROUP, np.float32)
        xg = x[g]
        blob = out[g]
        for ib in range(nblock):
            bo = HEADER + IQ1_S_R4_BLOCK * ib
            for k in range(GROUP):
                o = k * n + BLOCK * ib
                sumx2 = sum_squares(xg, o, BLOCK, False)
                if sumx2 < EPS:
                    _store_zero_s(blob, bo, k)
                    continue
                sigma2 = np.float32(1.5) * sumx2 / np.float32(BLOCK)
                weighted = qw.size > 0
                if weighted:
                    _weighted(xg, o, qw, BLOCK * ib, sigma2, weight)
                    weighted = not _importance(weight, xg, o, 0, BLOCK) < EPS
                if not weighted:
                    _roots(xg, o, sigma2, True, weight, 0, BLOCK)
                scale, shift, found = iq1s_block(xg, o, weight, grid, L, order, sums, index, marks)
                if not found:  # where ik aborts; the importances above never bring it about
                    _store_zero_s(blob, bo, k)
                    continue
                scales[ib, k] = scale
                mx[k] = max(mx[k], scale)
                h = 0x8000 if shift < 0 else 0
                for i in range(4):
                    blob[bo + 4 * i + k] = index[i] & 255
                    h |= (index[i] >> 8) << (3 * i)
                blob[bo + 16 + 2 * k] = h & 255
                blob[bo + 17 + 2 * k] = h >> 8
        for k in range(GROUP):
            store_f16(blob, 2 * k, np.float32(1.0625) * mx[k] / np.float32(15.0))
            inv = np.float32(15.0) / mx[k] if mx[k] else np.float32(0.0)
            for ib in range(nblock):
                blob[HEADER + IQ1_S_R4_BLOCK * ib + 17 + 2 * k] |= scale_code(inv, scales[ib, k]) << 4


@njit(**KERNEL)
def _quantize_iq1_m_r4(x: np.ndarray, qw: np.ndarray, out: np.ndarray, grid: tuple, shifts: np.ndarray) -> None:  # type: ignore[type-arg]
    """x [groups, 4 n], out [groups, group bytes] without the shift bits; shifts [groups, blocks, 4, 2]: each half's
    shift combination, NO_SHIFT (below the threshold: takes the last one stored) or UNUSED."""
    groups = x.shape[0]
    n = x.shape[1] // GROUP
    nblock = n // BLOCK
    for g in prange(groups):
        weight, L, order, sums, index, marks = scratch()
        scales = np.zeros((nblock, GROUP, 2), np.float32)
        mx = np.zeros(GROUP, np.float32)
        xg = x[g]
        blob = out[g]
        for ib in range(nblock):
            bo = HEADER + IQ1_M_R4_BLOCK * ib
            for k in range(GROUP):
                o = k * n + BLOCK * ib
                low = sum_squares(xg, o, BLOCK // 2, False)
                high = sum_squares(xg, o + BLOCK // 2, BLOCK // 2, False)
                sumx2 = low + high
                if sumx2 < EPS:
                    for i in range(4):
                        blob[bo + 4 * i + k] = ZERO_POINT & 255
                    for h in range(2):
                        blob[bo + 16 + 4 * h + k] = (ZERO_POINT >> 8) * 0x11
                        shifts[g, ib, k, h] = UNUSED
                    continue
                sigma2 = np.float32(1.5) * sumx2 / np.float32(BLOCK)
                if qw.size:
                    _weighted(xg, o, qw, BLOCK * ib, sigma2, weight)
                    if _importance(weight, xg, o, 0, BLOCK // 2) < EPS:
                        _roots(xg, o, sigma2, False, weight, 0, BLOCK // 2)
                    if np.float64(_importance(weight, xg, o, BLOCK // 2, BLOCK // 2)) < 1e-14:
                        _roots(xg, o, sigma2, False, weight, BLOCK // 2, BLOCK // 2)
                else:
                    _roots(xg, o, sigma2, True, weight, 0, BLOCK)
                for h in range(2):
                    scale, combo, found = np.float32(0.0), 0, False
                    if (low if h == 0 else high) > EPS:
                        scale, combo, found = iq1m_block(xg, o + 16 * h, weight, 16 * h, grid, L, order, sums,
                                                         index, 2 * h, marks)
                    if found:
                        scales[ib, k, h] = scale
                        shifts[g, ib, k, h] = combo
                    else:  # below the threshold (or, where ik aborts, no split fits)
                        index[2 * h] = index[2 * h + 1] = ZERO_POINT
                        shifts[g, ib, k, h] = NO_SHIFT
                mx[k] = max(mx[k], max(scales[ib, k, 0], scales[ib, k, 1]))
                for i in range(4):
                    blob[bo + 4 * i + k] = index[i] & 255
                for h in range(2):
                    blob[bo + 16 + 4 * h + k] = (index[2 * h] >> 8) | ((index[2 * h + 1] >> 8) << 4)
        for k in range(GROUP):
            store_f16(blob, 2 * k, np.float32(1.0625) * mx[k] / np.float32(15.0))
            inv = np.float32(15.0) / mx[k] if mx[k] else np.float32(0.0)
            for ib in range(nblock):
                lo = max(0, min(15, nearest_int_fma(scales[ib, k, 0], inv)))
                hi = max(0, min(15, nearest_int_fma(scales[ib, k, 1], inv)))
                blob[HEADER + IQ1_M_R4_BLOCK * ib + 24 + k] = lo | (hi << 4)


@njit(**KERNEL)
def _store_iq1_m_r4_shifts(out: np.ndarray, shifts: np.ndarray) -> None:
    for g in prange(out.shape[0]):
        for ib in range(shifts.shape[1]):
            for k in range(GROUP):
                for h in range(2):
                    combo = shifts[g, ib, k, h]
                    if combo >= 0:
                        out[g, HEADER + IQ1_M_R4_BLOCK * ib + 16 + 4 * h + k] |= IQ1M_SHIFT_MASKS[combo]


@njit(**KERNEL)
def _dequantize_iq1_s_r4(q: np.ndarray, out: np.ndarray, grid: np.ndarray) -> None:
    """q [groups, group bytes], out [groups, 4 n]."""
    n = out.shape[1] // GROUP
    for g in prange(q.shape[0]):
        for k in range(GROUP):
            d = load_f16(q[g], 2 * k)
            for ib in range(n // BLOCK):
                bo = HEADER + IQ1_S_R4_BLOCK * ib
                qh = np.int64(q[g, bo + 16 + 2 * k]) | (np.int64(q[g, bo + 17 + 2 * k]) << 8)
                delta = -IQ1S_DELTA if qh & 0x8000 else IQ1S_DELTA
                dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
                for i in range(4):
                    idx = np.int64(q[g, bo + 4 * i + k]) | (((qh >> (3 * i)) & 7) << 8)
                    for j in range(8):
                        out[g, k * n + BLOCK * ib + 8 * i + j] = dl * (grid[idx, j] + delta)


@njit(**KERNEL)
def _dequantize_iq1_m_r4(q: np.ndarray, out: np.ndarray, grid: np.ndarray) -> None:
    n = out.shape[1] // GROUP
    for g in prange(q.shape[0]):
        for k in range(GROUP):
            d = load_f16(q[g], 2 * k)
            for ib in range(n // BLOCK):
                bo = HEADER + IQ1_M_R4_BLOCK * ib
                sc = q[g, bo + 24 + k]
                for h in range(2):
                    dl = d * np.float32((sc >> (4 * h)) & 15)
                    qh = np.int64(q[g, bo + 16 + 4 * h + k])
                    for t in range(2):
                        idx = np.int64(q[g, bo + 8 * h + 4 * t + k]) | (((qh >> (4 * t)) & 7) << 8)
                        delta = -IQ1S_DELTA if qh & (0x08 << (4 * t)) else IQ1S_DELTA
                        for j in range(8):
                            out[g, k * n + BLOCK * ib + 16 * h + 8 * t + j] = dl * (grid[idx, j] + delta)


class _IQ1R4Codec(Codec):
    """Rows come and go in whole groups of 4: a group's bytes are its rows' per-row views back to back."""

    # d = 1.0625 max scale / 15 in f16; a block's scale is at most 8 max|x| (a fit may put every value on +-1/8)
    max_abs_input = 65504.0 * 15 / (8 * 1.0625)
    rel_error_bound = 2.0
    # blocks whose squares sum below 1e-14 (|x| < 1e-7) are stored as zeros; d rounded to f16 near its subnormal
    # step, times the largest scale code and level (15 (1 + 1/8))
    abs_error_floor = 1e-7 + 15 * 1.125 * 2.0**-24

    def _groups(self, n_rows: int) -> int:
        if n_rows % GROUP:
            raise QuantInputError(f"{self.type_name}: {n_rows} rows are not a whole number of {GROUP}-row groups "
                                  f"(the type stores rows in groups of {GROUP}; use {self.ggml_type.base} instead)")
        return n_rows // GROUP

    def _grouped(self, a: np.ndarray) -> np.ndarray:
        """A view of rows [n_rows, m] as groups [n_rows / 4, 4 m]."""
        return a.reshape(self._groups(a.shape[0]), -1)

    def _repair_degenerate_rows(self, x: np.ndarray, out: np.ndarray) -> None:
        """Codec's repair a group at a time. ik's quantizer itself drops importances that vanish over a block;
        only absurd ones (whose products overflow) can give NaN here."""
        n = x.shape[1]
        finite = np.isfinite(self.dequantize(out, n)).reshape(-1, GROUP * n).all(axis=1)
        bad = np.flatnonzero(~finite)
        if bad.size:
            warnings.warn(f"{self.type_name}: the importance weights gave NaN scales in {bad.size} group(s) of "
                          f"{GROUP} rows (first: rows from {GROUP * bad[0]}); those rows were quantized without "
                          "importance weights", stacklevel=3)
            rows = (GROUP * bad[:, None] + np.arange(GROUP)).reshape(-1)
            fixed = np.empty((rows.size, out.shape[1]), dtype=np.uint8)
            self._quantize(np.ascontiguousarray(x[rows]), np.empty(0, dtype=np.float32), fixed)
            out[rows] = fixed


class IQ1_S_R4Codec(_IQ1R4Codec, type_name="IQ1_S_R4"):
    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq1_s_r4(self._grouped(x), w, self._grouped(out), iq1_grid())

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq1_s_r4(self._grouped(q), self._grouped(out), GRID_IQ1S)


class IQ1_M_R4Codec(_IQ1R4Codec, type_name="IQ1_M_R4"):
    # a half below the threshold takes the shift bits of the call's previous blocks (ik's quirk)
    rows_interact = True

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        xg, og = self._grouped(x), self._grouped(out)
        shifts = np.empty((xg.shape[0], x.shape[1] // BLOCK, GROUP, 2), dtype=np.int64)
        _quantize_iq1_m_r4(xg, w, og, iq1_grid(), shifts)
        carry_shifts(shifts)
        _store_iq1_m_r4_shifts(og, shifts)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq1_m_r4(self._grouped(q), self._grouped(out), GRID_IQ1S)

