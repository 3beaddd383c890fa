"""The 1- and 2-bit i-quants IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M: their decoding, and codecs over ik's searches.

Each codes groups of 8 values as one point of a grid whose points hold 8 two-bit levels (iq12_grids.py). An IQ2
level l decodes as the magnitude 8, 25 or 43 (ik's iq2xxs/iq2xs/iq2s_grid bytes), signed by a 7-bit sign group
whose parity gives the 8th sign (IQ2_XXS, IQ2_XS) or by a byte of explicit signs (IQ2_S); an IQ1 level decodes as
-1, 0 or 1 plus a shift of +-1/8. Per 256-value super-block (little-endian fields):

- IQ2_XXS (66 bytes): f16 d, then per 32 values two u32: four 8-bit grid indices; four 7-bit sign groups and a
  4-bit scale s in the top bits. value = (d (0.5 + s) / 4) * level * sign.
- IQ2_XS (74): f16 d, 32 u16 (9-bit grid index, 7-bit sign group), 8 bytes of two 4-bit scales (one per 16
  values).
- IQ2_S (82): f16 d, 32 grid index bytes, 32 sign bytes, 8 bytes of the indices' top 2 bits (per 32 values, 2 bits
  per group of 8), 8 scale bytes as IQ2_XS.
- IQ1_S (50): f16 d, 32 index bytes, per 32 values a u16: the indices' top 3 bits (3 x 4 groups), a 3-bit scale s
  (bits 12-14) and the shift's sign (bit 15). value = (d (2 s + 1)) * (level + shift).
- IQ1_M (56): 32 index bytes, 16 bytes of the indices' top 3 bits and the shifts' signs (per group of 8), 8 bytes
  of 3-bit scales (two per 32 values: one per 16) whose top nibbles together are the f16 d.

The arithmetic is ik's dequantize_row_* order (float32, products left to right). Quantizing: IQ2_XXS, IQ2_XS and
IQ2_S in iq2_search.py, IQ1_S and IQ1_M in iq1_search.py, ports of ik's searches. IQ2_XXS, IQ2_XS and IQ1_S need an
importance matrix, as ik's ggml_quantize_chunk does; IQ2_S weights each value by sigma2 / 4 + x^2 without one, IQ1_M
by x^2. The interleaved IQ1_S_R4 / IQ1_M_R4 are types of their own (iq1_r4.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.base import Codec
from ikquant.formats.iq1_search import iq1_grid, quantize_iq1_m, quantize_iq1_s
from ikquant.formats.iq2_search import (
    grid_tables,
    quantize_iq2_s,
    quantize_iq2_xs,
    quantize_iq2_xxs,
)
from ikquant.formats.iq12_grids import KGRID_IQ1S, KGRID_IQ2S, KGRID_IQ2XS, KGRID_IQ2XXS
from ikquant.formats.iquants import KSIGNS
from ikquant.formats.numeric import f16_bits_to_f32, load_f16

QK_K = 256
KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")
IQ1S_DELTA = np.float32(0.125)


def _grid(kgrid: np.ndarray, values: tuple[float, float, float]) -> np.ndarray:
    """[points, 8] float32 decoded levels of a kgrid (level 3 does not occur in these grids)."""
    levels = (kgrid[:, None].astype(np.int64) >> (2 * np.arange(8))[None, :]) & 3
    if (levels == 3).any():
        raise AssertionError("a 2-bit grid point with level 3")
    return np.array(values, dtype=np.float32)[levels]


IQ2_LEVELS = (8.0, 25.0, 43.0)
GRID_IQ2XXS = _grid(KGRID_IQ2XXS, IQ2_LEVELS)
GRID_IQ2XS = _grid(KGRID_IQ2XS, IQ2_LEVELS)
GRID_IQ2S = _grid(KGRID_IQ2S, IQ2_LEVELS)
GRID_IQ1S = _grid(KGRID_IQ1S, (-1.0, 0.0, 1.0))


@njit(cache=True, nogil=True, inline="always")
def _signed(dl: np.float32, grid: np.ndarray, g: int, signs: int, out: np.ndarray, r: int, y: int) -> None:
    for j in range(8):
        v = dl * grid[g, j]
        out[r, y + j] = -v if (signs >> j) & 1 else v


@njit(cache=True, nogil=True, inline="always")
def _half_scales(d: np.float32, sc: np.uint8) -> tuple[np.float32, np.float32]:
    """The two 16-value scales of a scale byte (IQ2_XS, IQ2_S): d (0.5 + nibble) / 4."""
    return (d * (np.float32(0.5) + np.float32(sc & 15)) * np.float32(0.25),
            d * (np.float32(0.5) + np.float32(sc >> 4)) * np.float32(0.25))


@njit(cache=True, nogil=True, inline="always")
def _shifted(dl: np.float32, grid: np.ndarray, g: int, delta: np.float32, out: np.ndarray, r: int, y: int) -> None:
    for j in range(8):
        out[r, y + j] = dl * (grid[g, j] + delta)


@njit(**KERNEL)
def _dequantize_iq2_xxs(q: np.ndarray, out: np.ndarray, grid: np.ndarray, ksigns: np.ndarray) -> None:
    for r in prange(out.shape[0]):
        for ibl in range(out.shape[1] // QK_K):
            b = 66 * ibl
            d = load_f16(q[r], b)
            for ib in range(8):
                o = b + 2 + 8 * ib
                aux = np.uint32(q[r, o + 4]) | (np.uint32(q[r, o + 5]) << 8) | (np.uint32(q[r, o + 6]) << 16) | (
                    np.uint32(q[r, o + 7]) << 24)
                db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.25)
                for g in range(4):
                    _signed(db, grid, q[r, o + g], ksigns[(aux >> (7 * g)) & 127], out, r, QK_K * ibl + 32 * ib + 8 * g)


@njit(**KERNEL)
def _dequantize_iq2_xs(q: np.ndarray, out: np.ndarray, grid: np.ndarray, ksigns: np.ndarray) -> None:
    for r in prange(out.shape[0]):
        for ibl in range(out.shape[1] // QK_K):
            b = 74 * ibl
            d = load_f16(q[r], b)
            for ib in range(8):
                db0, db1 = _half_scales(d, q[r, b + 66 + ib])
                for g in range(4):
                    o = b + 2 + 8 * ib + 2 * g
                    v = np.int64(q[r, o]) | (np.int64(q[r, o + 1]) << 8)
                    _signed(db0 if g < 2 else db1, grid, v & 511, ksigns[v >> 9], out, r,
                            QK_K * ibl + 32 * ib + 8 * g)


@njit(**KERNEL)
def _dequantize_iq2_s(q: np.ndarray, out: np.ndarray, grid: np.ndarray) -> None:
    for r in prange(out.shape[0]):
        for ibl in range(out.shape[1] // QK_K):
            b = 82 * ibl
            d = load_f16(q[r], b)
            for ib in range(8):
                db0, db1 = _half_scales(d, q[r, b + 74 + ib])
                qh = np.int64(q[r, b + 66 + ib])
                for g in range(4):
                    idx = np.int64(q[r, b + 2 + 4 * ib + g]) | ((qh << (8 - 2 * g)) & 0x300)
                    _signed(db0 if g < 2 else db1, grid, idx, q[r, b + 34 + 4 * ib + g], out, r,
                            QK_K * ibl + 32 * ib + 8 * g)


@njit(**KERNEL)
def _dequantize_iq1_s(q: np.ndarray, out: np.ndarray, grid: np.ndarray) -> None:
    for r in prange(out.shape[0]):
        for ibl in range(out.shape[1] // QK_K):
            b = 50 * ibl
            d = load_f16(q[r], b)
            for ib in range(8):
                qh = np.int64(q[r, b + 34 + 2 * ib]) | (np.int64(q[r, b + 35 + 2 * ib]) << 8)
                dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
                delta = -IQ1S_DELTA if qh & 0x8000 else IQ1S_DELTA
                for g in range(4):
                    idx = np.int64(q[r, b + 2 + 4 * ib + g]) | (((qh >> (3 * g)) & 7) << 8)
                    _shifted(dl, grid, idx, delta, out, r, QK_K * ibl + 32 * ib + 8 * g)


@njit(**KERNEL)
def _dequantize_iq1_m(q: np.ndarray, out: np.ndarray, grid: np.ndarray) -> None:
    for r in prange(out.shape[0]):
        for ibl in range(out.shape[1] // QK_K):
            b = 56 * ibl
            sc = np.empty(4, np.int64)
            for t in range(4):
                sc[t] = np.int64(q[r, b + 48 + 2 * t]) | (np.int64(q[r, b + 49 + 2 * t]) << 8)
            bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000)
            d = f16_bits_to_f32(np.uint16(bits))
            for ib in range(8):
                s = sc[ib // 2] >> (6 * (ib % 2))
                dl1 = d * np.float32(2 * (s & 7) + 1)
                dl2 = d * np.float32(2 * ((s >> 3) & 7) + 1)
                for g in range(4):
                    qh = np.int64(q[r, b + 32 + 2 * ib + g // 2])
                    idx = np.int64(q[r, b + 4 * ib + g]) | ((qh << (8 if g % 2 == 0 else 4)) & 0x700)
                    delta = -IQ1S_DELTA if qh & (0x08 if g % 2 == 0 else 0x80) else IQ1S_DELTA
                    _shifted(dl1 if g < 2 else dl2, grid, idx, delta, out, r, QK_K * ibl + 32 * ib + 8 * g)


class _IQ2Codec(Codec):
    """The IQ2 types' limits: a sub-block's fitted scale is at most its max|x| (every magnitude is >= 1) and d is
    an f16 of max scale / 31 (IQ2_XS refits d: up to 1.05 max|x|); a d step of 2^-24 moves a value by at most
    (15.5 / 4) 43 steps."""

    max_abs_input = 65504.0 * 31
    rel_error_bound = 2.0
    block_scale_f16 = 0
    abs_error_floor = 2 * 15.5 / 4 * 43 * 2.0**-24


class _NeedsImatrix(_IQ2Codec):
    """IQ2_XXS and IQ2_XS: ik's ggml_quantize_chunk asserts an importance vector (ggml_quantize_requires_imatrix).
    Its row quantizer's unweighted branch still serves Codec.quantize's redo of rows whose weights vanish (and the
    _R4 forms, which ik quantizes without one)."""

    requires_imatrix = True


class IQ2_XXSCodec(_NeedsImatrix, type_name="IQ2_XXS"):
    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        t = grid_tables("IQ2_XXS")
        quantize_iq2_xxs(x, w, out, t.levels, t.dense, t.dense_at, t.kmap, t.neighbours)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq2_xxs(q, out, GRID_IQ2XXS, KSIGNS)


class IQ2_XSCodec(_NeedsImatrix, type_name="IQ2_XS"):
    max_abs_input = 65504.0 / 1.05

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        t = grid_tables("IQ2_XS")
        quantize_iq2_xs(x, w, out, t.levels, t.dense, t.dense_at, t.kmap, t.neighbours, GRID_IQ2XS)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq2_xs(q, out, GRID_IQ2XS, KSIGNS)


class IQ2_SCodec(_IQ2Codec, type_name="IQ2_S"):
    """Without an importance vector ik weights each value by sigma2 / 4 + x^2 (it does not require one)."""

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        t = grid_tables("IQ2_S")
        quantize_iq2_s(x, w, out, t.levels, t.dense, t.dense_at, t.kmap, t.neighbours)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq2_s(q, out, GRID_IQ2S)


class IQ1_SCodec(Codec, type_name="IQ1_S"):
    """ik's ggml_quantize_chunk asserts an importance vector for IQ1_S. Codec.quantize's redo of rows whose weights
    vanish quantizes them with unit importance, as ik's reference quantizer does."""

    requires_imatrix = True
    block_scale_f16 = 0
    # d = 1.125 max scale / 15 in f16; a block's scale is at most 8 max|x| (a fit may put every value on +-1/8)
    max_abs_input = 65504.0 * 15 / (8 * 1.125)
    rel_error_bound = 2.0
    # blocks below 1e-12 are stored as zeros; d rounded to f16 near its subnormal step, times (2 s + 1)(1 + 1/8)
    abs_error_floor = 1e-12 + 15 * 1.125 * 2.0**-24

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        quantize_iq1_s(x, w, out, iq1_grid())

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq1_s(q, out, GRID_IQ1S)


class IQ1_MCodec(Codec, type_name="IQ1_M"):
    """Without an importance vector ik weights each value by x^2. A block of 16 values below 1e-7 takes the shift
    bits its position held in the call's previous super-block (ik's quirk), so rows interact."""

    # d is refitted: at most 8 max|x| (every level +-1/8), stored 8.5% larger in f16
    max_abs_input = 65504.0 / (8 * 1.085)
    rel_error_bound = 2.0
    # blocks below 1e-7 are stored as zeros; d rounded to f16 near its subnormal step, times (2 s + 1)(1 + 1/8)
    abs_error_floor = 1e-7 + 15 * 1.125 * 2.0**-24
    rows_interact = True

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        quantize_iq1_m(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq1_m(q, out, GRID_IQ1S)

