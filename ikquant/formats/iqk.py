"""IQK types with one f16 scale per 256-value block: IQ2_K, IQ3_K, IQ4_K, IQ5_K, IQ6_K.

A block holds d (f16), an `extra` bitmask and sixteen 16-value sub-blocks, each with a small integer scale. Values
are codes into a non-linear grid; bit t of `extra` moves sub-block t onto a second, slightly shifted copy of the
grid. ik picks each sub-block's scale (and grid) with an importance-weighted search, quantizes the sixteen scales
against d, then refits d by least squares over the whole block.

ik's bytes hinge on float rounding, so every multiply-add below is fused exactly where ik's GCC 12 -O3 build fuses
it (read off its assembly): products feeding a running sum are fused (`fmaf(w*q, x, s)`), while the 256-value sum
of squares is vectorised in order without fusing. Where GCC proves a loop dead (IQ3_K's gradient refinement only
updates a value that is never read), it is left out here too.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.base import Codec
from ikquant.formats.numeric import (
    f16_bits_to_f32,
    f32_to_f16_bits,
    fmaf,
    nearest_int_fma,
    trunc_i32,
)
from ikquant.types import register_codec

QK_K = 256
NJIT = dict(cache=True, nogil=True, error_model="numpy")
KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")
F = np.float32

# Value grids (ggml-common.h). Each holds the plain grid followed by its shifted copy.
IQ2NL = np.array([-31, -13, 1, 17, -26, -8, 6, 22], dtype=np.float32)
IQ3NL = np.array([-63, -40, -23, -10, 1, 13, 28, 47, -59, -36, -19, -6, 5, 17, 32, 51], dtype=np.float32)
IQ4K = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
    + [-123, -100, -79, -61, -45, -31, -18, -6, 5, 17, 29, 42, 57, 73, 93, 117],
    dtype=np.float32,
)
IQ5NL = np.array(
    [-126, -114, -103, -92, -83, -74, -65, -57, -50, -43, -36, -30, -24, -18, -12, -6]
    + [-1, 5, 11, 17, 23, 29, 36, 43, 51, 59, 68, 77, 87, 97, 109, 121]
    + [-124, -112, -101, -90, -81, -72, -63, -55, -48, -41, -34, -28, -22, -16, -10, -4]
    + [1, 7, 13, 19, 25, 31, 38, 45, 53, 61, 70, 79, 89, 99, 111, 123],
    dtype=np.float32,
)
# iq6nl_values: ik's IQ6_K quantizer takes the first 64 entries and builds the shifted half as entry + 1.
_IQ6NL_FIRST = np.array(
    [-127, -121, -115, -109, -104, -98, -93, -88, -84, -79, -74, -70, -66, -62, -58, -54]
    + [-51, -47, -44, -40, -37, -34, -31, -28, -25, -22, -19, -16, -13, -11, -8, -5]
    + [-2, 0, 3, 6, 9, 12, 14, 17, 20, 23, 27, 30, 33, 36, 40, 44]
    + [47, 51, 55, 59, 63, 68, 72, 77, 82, 87, 92, 98, 103, 109, 115, 121],
    dtype=np.float32,
)
IQ6NL = np.concatenate([_IQ6NL_FIRST, _IQ6NL_FIRST + np.float32(1.0)])

# ik's nearest-value lookups (iqk_quantize.cpp), indexed by the integer part of x minus the grid's first entry: an
# entry below the grid size is the answer, an entry n + i means "compare grid[i] and grid[i + 1]". They serve both
# the plain and the shifted grid, and C's truncation toward zero makes them slightly imperfect, so they are kept
# as data rather than replaced by an exact nearest search.
IQ3NL_INDEX = np.array(
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 9, 9, 2, 2, 2,
        2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 10, 10, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 11, 11, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
        12, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 13, 13, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 14, 14, 7, 7,
        7, 7, 7, 7, 7, 7, 7,
    ],
    dtype=np.int8,
)  # fmt: skip
IQ4NL_INDEX = np.array(
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 17, 17,
        2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 18, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3,
        19, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 20, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 21, 21, 6, 6, 6, 6, 6,
        6, 6, 6, 6, 6, 6, 22, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 23, 23, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 24, 9, 9, 9, 9, 9,
        9, 9, 9, 9, 9, 9, 25, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 26, 26, 11, 11, 11, 11, 11, 11, 11, 11,
        11, 11, 11, 11, 27, 27, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 12, 28, 13, 13, 13, 13, 13, 13,
        13, 13, 13, 13, 13, 13, 13, 13, 13, 13, 13, 29, 14, 14, 14, 14, 14, 14, 14, 14, 14, 14, 14, 14, 14, 14, 14,
        14, 14, 14, 14, 14, 14, 30, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15,
    ],
    dtype=np.int8,
)  # fmt: skip
IQ5NL_INDEX = np.array(
    [
        0, 0, 0, 0, 0, 0, 32, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 33, 33, 2, 2, 2, 2, 2, 2, 2, 2, 2, 34, 34, 3, 3, 3, 3,
        3, 3, 3, 3, 35, 35, 4, 4, 4, 4, 4, 4, 4, 36, 36, 5, 5, 5, 5, 5, 5, 5, 37, 37, 6, 6, 6, 6, 6, 6, 6, 38, 7, 7,
        7, 7, 7, 7, 39, 39, 8, 8, 8, 8, 8, 40, 40, 9, 9, 9, 9, 9, 41, 41, 10, 10, 10, 10, 10, 42, 11, 11, 11, 11,
        11, 43, 12, 12, 12, 12, 12, 44, 13, 13, 13, 13, 13, 45, 14, 14, 14, 14, 14, 46, 15, 15, 15, 15, 47, 47, 16,
        16, 16, 16, 48, 17, 17, 17, 17, 17, 49, 18, 18, 18, 18, 18, 50, 19, 19, 19, 19, 19, 51, 20, 20, 20, 20, 20,
        52, 21, 21, 21, 21, 21, 53, 53, 22, 22, 22, 22, 22, 54, 54, 23, 23, 23, 23, 23, 23, 55, 24, 24, 24, 24, 24,
        24, 24, 56, 25, 25, 25, 25, 25, 25, 25, 57, 57, 26, 26, 26, 26, 26, 26, 26, 58, 58, 27, 27, 27, 27, 27, 27,
        27, 27, 59, 28, 28, 28, 28, 28, 28, 28, 28, 28, 60, 29, 29, 29, 29, 29, 29, 29, 29, 29, 29, 61, 30, 30, 30,
        30, 30, 30, 30, 30, 30, 30, 30, 62, 31, 31, 31, 31, 31, 31,
    ],
    dtype=np.int8,
)  # fmt: skip
IQ6NL_INDEX = np.array(
    [
        0, 0, 0, 64, 1, 1, 1, 1, 1, 65, 2, 2, 2, 2, 2, 66, 3, 3, 3, 3, 67, 67, 4, 4, 4, 4, 68, 5, 5, 5, 5, 69, 69,
        6, 6, 6, 70, 70, 7, 7, 7, 71, 8, 8, 8, 72, 72, 9, 9, 9, 73, 73, 10, 10, 10, 74, 11, 11, 11, 75, 12, 12, 12,
        76, 13, 13, 13, 77, 14, 14, 14, 78, 15, 15, 79, 79, 16, 16, 80, 17, 17, 81, 81, 18, 18, 82, 19, 19, 83, 83,
        20, 84, 84, 21, 85, 85, 22, 86, 86, 23, 87, 87, 24, 88, 88, 25, 89, 89, 26, 90, 90, 27, 91, 91, 28, 92, 29,
        93, 93, 30, 94, 94, 31, 95, 95, 32, 96, 33, 97, 97, 34, 98, 98, 35, 99, 99, 36, 100, 100, 37, 101, 38, 102,
        102, 39, 103, 103, 40, 104, 104, 41, 41, 105, 42, 42, 106, 106, 43, 107, 107, 44, 108, 108, 45, 45, 109, 46,
        46, 46, 110, 47, 47, 111, 111, 48, 48, 112, 49, 49, 49, 113, 50, 50, 50, 114, 51, 51, 51, 115, 52, 52, 52,
        116, 116, 53, 53, 53, 117, 54, 54, 54, 118, 118, 55, 55, 55, 119, 119, 56, 56, 56, 120, 120, 57, 57, 57,
        121, 121, 58, 58, 58, 58, 122, 59, 59, 59, 59, 123, 123, 60, 60, 60, 60, 124, 61, 61, 61, 61, 61, 125, 62,
        62, 62, 62, 62, 126, 63, 63, 63,
    ],
    dtype=np.int8,
)  # fmt: skip

# IQ6_K's to_float evaluates a cubic in the 6-bit code instead of reading iq6nl_values.
A_IQ6K = F(-127.0)
B_IQ6K = F(6.2568)
C_IQ6K = F(0.11218)
D_IQ6K = F(0.0011972)


@njit(**NJIT)
def _iq6k_levels() -> np.ndarray:
    """The 128 floats IQ6_K decodes to before scaling (code + 64 for the shifted grid).

    ik's build evaluates A + q*(B + q*(-C + q*D)) + m as three fused multiply-adds, then adds m; without the fusing
    about half the values move by an ulp. Every value of a code is the same float, so a table replaces the cubic.
    """
    levels = np.empty(128, dtype=np.float32)
    for code in range(64):
        q = F(code)
        p = fmaf(q, fmaf(q, fmaf(q, D_IQ6K, -C_IQ6K), B_IQ6K), A_IQ6K)
        levels[code] = p
        levels[code + 64] = p + F(1.0)
    return levels


IQ6K_LEVELS = _iq6k_levels()


# ---------------------------------------------------------------------------------------------------------- helpers


@njit(**NJIT)
def _store_f16(out: np.ndarray, pos: int, v: np.float32) -> None:
    h = f32_to_f16_bits(v)
    out[pos] = np.uint8(h & np.uint16(0xFF))
    out[pos + 1] = np.uint8(h >> np.uint16(8))


@njit(**NJIT)
def _load_f16(q: np.ndarray, pos: int) -> np.float32:
    return f16_bits_to_f32(np.uint16(q[pos]) | (np.uint16(q[pos + 1]) << np.uint16(8)))


@njit(**NJIT)
def _row_weights(xr: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """ik's QHelper: a 16-value block whose importances (or values) are all ~0 gets uniform tiny weights instead.

    The three sums are vectorised in ik's build: products rounded, then added in order.
    """
    eps = F(1e-9)
    threshold = F(16.0) * (eps * eps)
    for base in range(0, xr.size, 16):
        sw2 = F(0.0)
        sx2 = F(0.0)
        swx = F(0.0)
        for j in range(base, base + 16):
            w = qw[j]
            x = xr[j]
            sw2 += w * w
            sx2 += x * x
            swx += w * abs(x)
            out[j] = w
        if not (sw2 > threshold and sx2 > threshold and swx > threshold):
            for j in range(base, base + 16):
                out[j] = eps


@njit(**NJIT)
def _sum_squares(xb: np.ndarray) -> np.float32:
    """Sum of x*x over a block, as ik's build vectorises it: each square rounded, then added in order."""
    s = F(0.0)
    for j in range(xb.size):
        s += xb[j] * xb[j]
    return s


@njit(**NJIT)
def _block_weights(xb: np.ndarray, qw: np.ndarray, weighted: bool, sigma2: np.float32, plain: np.float32,
                   out: np.ndarray) -> None:
    """Per-value search weights: qw*sqrt(sigma2 + x^2) with importances, else plain + x^2 (plain is 0 or sigma2/4).

    ik's build fuses x*x into the add under the square root. plain + x*x is added unfused where ik searches, and
    where it fuses 0.25*sigma2 instead, that product is exact, so one form serves both.
    """
    for j in range(xb.size):
        x = xb[j]
        if weighted:
            out[j] = qw[j] * np.sqrt(fmaf(x, x, sigma2))
        else:
            out[j] = plain + x * x


@njit(**NJIT)
def _abs_max(xb: np.ndarray) -> tuple[np.float32, np.float32]:
    """(max |x|, the x that attains it first)."""
    amax = F(0.0)
    vmax = F(0.0)
    for j in range(xb.size):
        ax = abs(xb[j])
        if ax > amax:
            amax = ax
            vmax = xb[j]
    return amax, vmax


@njit(**NJIT)
def _grid(kind: int) -> tuple[np.ndarray, np.ndarray, int, int, bool]:
    """(grid, lookup table, grid size, table limit, whether the offset is taken in float) of IQ`kind`_K.

    IQ3/4/5_K index their table by (int)x - grid[0], IQ6_K by (int)(x - grid[0]); past `limit` ik clamps. The
    tables are module globals, so the hot loops below touch no reference counts.
    """
    if kind == 3:
        return IQ3NL, IQ3NL_INDEX, 8, 111, False
    if kind == 4:
        return IQ4K, IQ4NL_INDEX, 16, 241, False
    if kind == 5:
        return IQ5NL, IQ5NL_INDEX, 32, 247, False
    return IQ6NL, IQ6NL_INDEX, 64, 249, True


@njit(**NJIT)
def _best_index(kind: int, base: int, x: np.float32) -> int:
    """ik's nearest entry to x in grid[base : base + n] of IQ`kind`_K, through its lookup table."""
    grid, table, n, limit, float_offset = _grid(kind)
    v0 = grid[base]
    if float_offset:
        ix = np.int64(trunc_i32(x - v0))
    else:
        ix = np.int64(trunc_i32(x)) - np.int64(v0)
    if ix < 0:
        return 0
    if ix >= limit:
        return n - 1
    code = np.int64(table[ix])
    if code < n:
        return code
    i = code - n
    if x - grid[base + i] < grid[base + i + 1] - x:
        return i
    return i + 1


@njit(**NJIT)
def _trial(kind: int, base: int, xb: np.ndarray, wb: np.ndarray, inv: np.float32
           ) -> tuple[np.float32, np.float32, np.float32, np.float32]:
    """Weighted sums for one candidate inverse scale: (sum w q x, sum w q^2) rounding x*inv, then -x*inv."""
    grid = _grid(kind)[0]
    sqx_p = F(0.0)
    sq2_p = F(0.0)
    sqx_m = F(0.0)
    sq2_m = F(0.0)
    for j in range(16):
        x = xb[j]
        w = wb[j]
        al = inv * x
        q = grid[base + _best_index(kind, base, al)]
        wq = w * q
        sqx_p = fmaf(wq, x, sqx_p)
        sq2_p = fmaf(wq, q, sq2_p)
        q = grid[base + _best_index(kind, base, -al)]
        wq = w * q
        sqx_m = fmaf(wq, x, sqx_m)
        sq2_m = fmaf(wq, q, sq2_m)
    return sqx_p, sq2_p, sqx_m, sq2_m


@njit(**NJIT)
def _refit(kind: int, base: int, xb: np.ndarray, wb: np.ndarray, d: np.float32) -> np.float32:
    """Least-squares scale for the codes that rounding x/d gives (ik refines each sub-block scale once)."""
    grid = _grid(kind)[0]
    inv = F(1.0) / d
    sqx = F(0.0)
    sq2 = F(0.0)
    for j in range(16):
        x = xb[j]
        q = grid[base + _best_index(kind, base, inv * x)]
        wq = wb[j] * q
        sqx = fmaf(wq, x, sqx)
        sq2 = fmaf(wq, q, sq2)
    if sq2 > 0:
        return sqx / sq2
    return d


@njit(**NJIT)
def _search_scale(kind: int, xb: np.ndarray, wb: np.ndarray, vmax: np.float32, ntry: int, step: int,
                  guard_first: bool) -> tuple[np.float32, bool]:
    """ik's sub-block scale search for IQ3/4/5/6_K: (scale, whether the shifted grid won).

    Starts from max/grid[0] (both signs), then tries inverse scales (step*itry + grid[0])/max on the plain and on
    the shifted grid, keeping the best weighted least-squares fit. `guard_first` is IQ3_K's check that the first
    fit has a positive denominator (the others divide unconditionally).
    """
    grid, _, n, _, _ = _grid(kind)
    d = -vmax / grid[0]
    sqx_p, sq2_p, sqx_m, sq2_m = _trial(kind, 0, xb, wb, F(1.0) / d)
    best = F(0.0)
    if not guard_first or sq2_p > 0:
        d = sqx_p / sq2_p
        best = d * sqx_p
    if sq2_m > 0 and sqx_m * sqx_m > best * sq2_m:
        d = sqx_m / sq2_m
        best = d * sqx_m
    shifted = False
    for itry in range(-ntry, ntry + 1):
        for base in (0, n):
            inv = F(step * itry + np.int64(grid[base])) / vmax
            sqx_p, sq2_p, sqx_m, sq2_m = _trial(kind, base, xb, wb, inv)
            if sq2_p > 0 and sqx_p * sqx_p > best * sq2_p:
                d = sqx_p / sq2_p
                best = d * sqx_p
                shifted = base != 0
            if sq2_m > 0 and sqx_m * sqx_m > best * sq2_m:
                d = sqx_m / sq2_m
                best = d * sqx_m
                shifted = base != 0
    return d, shifted


# ------------------------------------------------------------------------------------------------------------ IQ2_K


@njit(**NJIT)
def _iq2k_search(xb: np.ndarray, wb: np.ndarray, order: np.ndarray, sumx: np.ndarray, sumw: np.ndarray
                 ) -> tuple[np.float32, bool]:
    """IQ2_K's exhaustive sub-block fit: every split of the sorted values into four runs, on each grid, both ways up.

    Prefix sums over the values sorted by (x, index) make each split O(1). The four-term sums are written in the
    order and with the fusing of ik's build: the first product is fused into the second, then each further
    product is fused into the running sum (a grid entry of 1 makes its term a plain add).
    """
    for j in range(16):  # stable insertion sort: the order std::sort gives the (x, index) pairs
        k = j
        while k > 0 and xb[order[k - 1]] > xb[j]:
            order[k] = order[k - 1]
            k -= 1
        order[k] = j
    sumw[0] = F(0.0)
    sumx[0] = F(0.0)
    for j in range(16):
        jj = order[j]
        sumw[j + 1] = sumw[j] + wb[jj]
        sumx[j + 1] = fmaf(wb[jj], xb[jj], sumx[j])
    v0, v1, v3 = F(-31.0), F(-13.0), F(17.0)  # plain grid -31, -13, 1, 17
    s0, s1, s2, s3 = F(-26.0), F(-8.0), F(6.0), F(22.0)  # shifted grid
    tw = sumw[16]
    tx = sumx[16]
    best = F(0.0)
    d = F(0.0)
    shifted = False
    for i1 in range(16):
        aw = sumw[i1]
        ax = sumx[i1]
        for i2 in range(i1, 16):
            bw = sumw[i2] - aw
            bx = sumx[i2] - ax
            # first two runs of: plain, shifted, plain reversed, shifted reversed
            w1 = fmaf(aw * v0, v0, (bw * v1) * v1)
            x1 = fmaf(ax, v0, bx * v1)
            w2 = fmaf(aw * s0, s0, (bw * s1) * s1)
            x2 = fmaf(ax, s0, bx * s1)
            w3 = fmaf(aw * v3, v3, bw)
            x3 = fmaf(ax, v3, bx)
            w4 = fmaf(aw * s3, s3, (bw * s2) * s2)
            x4 = fmaf(ax, s3, bx * s2)
            swi2 = sumw[i2]
            sxi2 = sumx[i2]
            for i3 in range(i2, 16):
                cw = sumw[i3] - swi2
                ew = tw - sumw[i3]
                cx = sumx[i3] - sxi2
                ex = tx - sumx[i3]
                sq2 = fmaf(ew * v3, v3, w1 + cw)
                if sq2 > 0:
                    sqx = fmaf(ex, v3, x1 + cx)
                    if sqx * sqx > best * sq2:
                        d = sqx / sq2
                        best = d * sqx
                        shifted = False
                sq2 = fmaf(ew * s3, s3, fmaf(cw * s2, s2, w2))
                if sq2 > 0:
                    sqx = fmaf(ex, s3, fmaf(cx, s2, x2))
                    if sqx * sqx > best * sq2:
                        d = sqx / sq2
                        best = d * sqx
                        shifted = True
                sq2 = fmaf(ew * v0, v0, fmaf(cw * v1, v1, w3))
                if sq2 > 0:
                    sqx = fmaf(ex, v0, fmaf(cx, v1, x3))
                    if sqx * sqx > best * sq2:
                        d = sqx / sq2
                        best = d * sqx
                        shifted = False
                sq2 = fmaf(ew * s0, s0, fmaf(cw * s1, s1, w4))
                if sq2 > 0:
                    sqx = fmaf(ex, s0, fmaf(cx, s1, x4))
                    if sqx * sqx > best * sq2:
                        d = sqx / sq2
                        best = d * sqx
                        shifted = True
    return d, shifted


@njit(**NJIT)
def _iqk_qx_scale(x: np.ndarray, w: np.ndarray, nmax: int) -> np.float32:
    """iqk_quantize.cpp's make_qx_quants: weighted symmetric scale for the codes round(x/scale) in [-nmax, nmax).

    Unlike ggml-quants.c's namesake it has no final gradient pass, and its candidate loop is scalar and fused.
    """
    amax, vmax = _abs_max(x)
    if amax == 0:
        return F(0.0)
    fn = F(nmax)
    iscale = -fn / vmax
    sumlx = F(0.0)
    suml2 = F(0.0)
    for i in range(x.size):
        fl = F(min(nmax - 1, max(-nmax, nearest_int_fma(iscale, x[i]))))
        sumlx = fmaf(w[i] * x[i], fl, sumlx)
        suml2 = fmaf(w[i] * fl, fl, suml2)
    scale = sumlx / suml2 if suml2 != 0 else F(0.0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -fmaf(F(0.1), F(step), fn) / vmax
        sumlx = F(0.0)
        suml2 = F(0.0)
        for i in range(x.size):
            fl = F(min(nmax - 1, max(-nmax, nearest_int_fma(iscale, x[i]))))
            sumlx = fmaf(w[i] * x[i], fl, sumlx)
            suml2 = fmaf(w[i] * fl, fl, suml2)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(**NJIT)
def _iq2k_index(grid: np.ndarray, base: int, x: np.float32) -> int:
    """ik's best_index_iq2nl: nearest of the four entries grid[base : base + 4], ties to the upper one."""
    idx = 0 if x < grid[base + 1] else (2 if x > grid[base + 2] else 1)
    if x - grid[base + idx] < grid[base + idx + 1] - x:
        return idx
    return idx + 1


@njit(**KERNEL)
def _quantize_iq2_k(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    weighted = qw.size > 0
    for r in prange(n_rows):
        xr = x[r]
        o = out[r]
        rw = np.empty(n if weighted else 0, dtype=np.float32)
        if weighted:
            _row_weights(xr, qw, rw)
        weight = np.empty(QK_K, dtype=np.float32)
        scales = np.empty(16, dtype=np.float32)
        sw = np.empty(16, dtype=np.float32)
        order = np.empty(16, dtype=np.int64)
        sumx = np.empty(17, dtype=np.float32)
        sumw = np.empty(17, dtype=np.float32)
        for ibl in range(n // QK_K):
            xbl = xr[ibl * QK_K : (ibl + 1) * QK_K]
            ob = o[ibl * 76 : (ibl + 1) * 76]
            ob[:] = 0
            sigma2 = F(1.5) * _sum_squares(xbl) / F(QK_K)
            _block_weights(xbl, rw[ibl * QK_K : (ibl + 1) * QK_K], weighted, sigma2, F(0.25) * sigma2, weight)
            extra = 0
            max_abs_scale = F(0.0)
            for ib in range(16):
                xb = xbl[16 * ib : 16 * ib + 16]
                wb = weight[16 * ib : 16 * ib + 16]
                s = F(0.0)
                for j in range(16):
                    s += wb[j]
                sw[ib] = s
                if _abs_max(xb)[0] < F(1e-16):
                    scales[ib] = F(0.0)
                    continue
                d, shifted = _iq2k_search(xb, wb, order, sumx, sumw)
                scales[ib] = d
                if shifted:
                    extra |= 1 << ib
                max_abs_scale = max(max_abs_scale, abs(d))
            if max_abs_scale == 0:
                continue
            d = _iqk_qx_scale(scales, sw, 8)
            if d == 0:
                continue
            ob[2] = extra & 0xFF
            ob[3] = extra >> 8
            inv = F(1.0) / d
            sumqx = F(0.0)
            sumq2 = F(0.0)
            for ib in range(16):
                ls = min(7, max(-8, nearest_int_fma(inv, scales[ib])))
                ob[4 + ib // 2] |= np.uint8((ls + 8) << (4 * (ib % 2)))
                dl = d * F(ls)
                if dl == 0:
                    continue
                base = 4 if (extra >> ib) & 1 else 0
                idl = F(1.0) / dl
                ib32 = ib // 2
                qpos = 12 + 32 * (ib32 // 4) + 16 * (ib % 2)
                shift = 2 * (ib32 % 4)
                for j in range(16):
                    xv = xbl[16 * ib + j]
                    k = _iq2k_index(IQ2NL, base, idl * xv)
                    ob[qpos + j] |= np.uint8(k << shift)
                    q = F(np.int64(IQ2NL[base + k]) * ls)
                    wq = weight[16 * ib + j] * q
                    sumqx = fmaf(wq, xv, sumqx)
                    sumq2 = fmaf(wq, q, sumq2)
            _store_f16(ob, 0, F(1.03) * (sumqx / sumq2 if sumq2 > 0 else d))


@njit(**KERNEL)
def _dequantize_iq2_k(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        qr = q[r]
        y = out[r]
        lut = np.empty(4, dtype=np.float32)
        for ibl in range(n // QK_K):
            o = 76 * ibl
            d = _load_f16(qr, o)
            extra = np.int64(qr[o + 2]) | (np.int64(qr[o + 3]) << 8)
            for ib in range(16):
                ib32 = ib // 2
                dl = d * F(np.int64((qr[o + 4 + ib32] >> (4 * (ib % 2))) & 15) - 8)
                base = 4 * ((extra >> ib) & 1)
                for k in range(4):
                    lut[k] = dl * IQ2NL[base + k]
                qpos = o + 12 + 32 * (ib32 // 4) + 16 * (ib % 2)
                shift = 2 * (ib32 % 4)
                yb = y[QK_K * ibl + 16 * ib : QK_K * ibl + 16 * ib + 16]
                for j in range(16):
                    yb[j] = lut[(qr[qpos + j] >> shift) & 3]


# ------------------------------------------------------------------------------------------------------------ IQ3_K


@njit(**KERNEL)
def _quantize_iq3_k(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    weighted = qw.size > 0
    for r in prange(n_rows):
        xr = x[r]
        o = out[r]
        rw = np.empty(n if weighted else 0, dtype=np.float32)
        if weighted:
            _row_weights(xr, qw, rw)
        weight = np.empty(QK_K, dtype=np.float32)
        scales = np.empty(16, dtype=np.float32)
        for ibl in range(n // QK_K):
            xbl = xr[ibl * QK_K : (ibl + 1) * QK_K]
            ob = o[ibl * 110 : (ibl + 1) * 110]
            ob[:] = 0
            sigma2 = F(1.5) * _sum_squares(xbl) / F(QK_K)
            _block_weights(xbl, rw[ibl * QK_K : (ibl + 1) * QK_K], weighted, sigma2, F(0.25) * sigma2, weight)
            extra = 0
            max_abs_scale = F(0.0)
            for ib in range(16):
                xb = xbl[16 * ib : 16 * ib + 16]
                wb = weight[16 * ib : 16 * ib + 16]
                amax, vmax = _abs_max(xb)
                if amax < F(1e-16):
                    scales[ib] = F(0.0)
                    continue
                d, shifted = _search_scale(3, xb, wb, vmax, 3, 2, True)
                if d == 0:
                    scales[ib] = F(0.0)
                    continue
                d = _refit(3, 8 if shifted else 0, xb, wb, d)
                scales[ib] = d
                if shifted:
                    extra |= 1 << ib
                max_abs_scale = max(max_abs_scale, abs(d))
            if max_abs_scale == 0:
                continue
            d = max_abs_scale / F(31.0)
            ob[2] = extra & 0xFF
            ob[3] = extra >> 8
            inv = F(1.0) / d
            sumqx = F(0.0)
            sumq2 = F(0.0)
            for ib in range(16):
                s = scales[ib]
                ls = min(15, max(0, nearest_int_fma(F(0.5), fmaf(abs(s), inv, F(-1.0)))))
                ob[6 + ib // 2] |= np.uint8(ls << (4 * (ib % 2)))
                if s < 0:
                    ob[4 + ib // 8] |= np.uint8(1 << (ib % 8))
                ls = (2 * ls + 1) * (-1 if s < 0 else 1)
                dl = d * F(ls)
                if dl == 0:
                    continue
                base = 8 if (extra >> ib) & 1 else 0
                idl = F(1.0) / dl
                ib32 = ib // 2
                qpos = 14 + 32 * (ib32 // 4) + 16 * (ib % 2)
                hpos = 78 + 16 * (ib % 2)
                for j in range(16):
                    xv = xbl[16 * ib + j]
                    k = _best_index(3, base, idl * xv)
                    ob[qpos + j] |= np.uint8((k & 3) << (2 * (ib32 % 4)))
                    ob[hpos + j] |= np.uint8((k >> 2) << ib32)
                    q = F(np.int64(IQ3NL[base + k]) * ls)
                    wq = weight[16 * ib + j] * q
                    sumqx = fmaf(wq, xv, sumqx)
                    sumq2 = fmaf(wq, q, sumq2)
            _store_f16(ob, 0, F(1.01) * (sumqx / sumq2 if sumq2 > 0 else d))


@njit(**KERNEL)
def _dequantize_iq3_k(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        qr = q[r]
        y = out[r]
        lut = np.empty(8, dtype=np.float32)
        for ibl in range(n // QK_K):
            o = 110 * ibl
            d = _load_f16(qr, o)
            extra = np.int64(qr[o + 2]) | (np.int64(qr[o + 3]) << 8)
            signs = np.int64(qr[o + 4]) | (np.int64(qr[o + 5]) << 8)
            for ib in range(16):
                ib32 = ib // 2
                ls = 2 * np.int64((qr[o + 6 + ib32] >> (4 * (ib % 2))) & 15) + 1
                dl = d * F(-ls if (signs >> ib) & 1 else ls)
                base = 8 * ((extra >> ib) & 1)
                for k in range(8):
                    lut[k] = dl * IQ3NL[base + k]
                qpos = o + 14 + 32 * (ib32 // 4) + 16 * (ib % 2)
                hpos = o + 78 + 16 * (ib % 2)
                shift = 2 * (ib32 % 4)
                yb = y[QK_K * ibl + 16 * ib : QK_K * ibl + 16 * ib + 16]
                for j in range(16):
                    yb[j] = lut[((qr[qpos + j] >> shift) & 3) | (((qr[hpos + j] >> ib32) & 1) << 2)]


# ------------------------------------------------------------------------------------------------------------ IQ4_K


@njit(**KERNEL)
def _quantize_iq4_k(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    weighted = qw.size > 0
    for r in prange(n_rows):
        xr = x[r]
        o = out[r]
        rw = np.empty(n if weighted else 0, dtype=np.float32)
        if weighted:
            _row_weights(xr, qw, rw)
        weight = np.empty(QK_K, dtype=np.float32)
        scales = np.empty(16, dtype=np.float32)
        codes = np.empty(QK_K, dtype=np.uint8)
        for ibl in range(n // QK_K):
            xbl = xr[ibl * QK_K : (ibl + 1) * QK_K]
            ob = o[ibl * 144 : (ibl + 1) * 144]
            ob[:] = 0
            sigma2 = _sum_squares(xbl) * F(2.0 / QK_K)
            # without importances IQ4_K weighs by x^2 alone
            _block_weights(xbl, rw[ibl * QK_K : (ibl + 1) * QK_K], weighted, sigma2, F(0.0), weight)
            extra = 0
            max_scale = F(0.0)
            amax_scale = F(0.0)
            for ib in range(16):
                xb = xbl[16 * ib : 16 * ib + 16]
                amax, vmax = _abs_max(xb)
                if amax < F(1e-16):
                    scales[ib] = F(0.0)
                    continue
                d, shifted = _search_scale(4, xb, weight[16 * ib : 16 * ib + 16], vmax, 7, 1, False)
                if shifted:
                    extra |= 1 << ib
                scales[ib] = d
                if abs(d) > amax_scale:
                    amax_scale = abs(d)
                    max_scale = d
            d = -max_scale / F(32.0)
            ob[2] = extra & 0xFF
            ob[3] = extra >> 8
            inv = F(1.0) / d if d != 0 else F(0.0)
            sumqx = F(0.0)
            sumq2 = F(0.0)
            for ib in range(16):
                base = 16 if (extra >> ib) & 1 else 0
                ls = min(31, max(-32, nearest_int_fma(inv, scales[ib])))
                dl = d * F(ls)
                idl = F(1.0) / dl if dl != 0 else F(0.0)
                for j in range(16):
                    xv = xbl[16 * ib + j]
                    k = _best_index(4, base, idl * xv)
                    codes[16 * ib + j] = k
                    q = F(np.int64(IQ4K[base + k]) * ls)
                    wq = weight[16 * ib + j] * q
                    sumqx = fmaf(wq, xv, sumqx)
                    sumq2 = fmaf(wq, q, sumq2)
                ls += 32
                ob[8 + ib // 2] |= np.uint8((ls & 15) << (4 * (ib % 2)))
                ob[4 + ib // 4] |= np.uint8((ls >> 4) << (2 * (ib % 4)))
            _store_f16(ob, 0, sumqx / sumq2 if sumq2 > 0 else d)
            for i in range(8):
                for j in range(16):
                    ob[16 + 16 * i + j] = codes[32 * i + j] | (codes[32 * i + 16 + j] << 4)


@njit(**KERNEL)
def _dequantize_iq4_k(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        qr = q[r]
        y = out[r]
        lut = np.empty(16, dtype=np.float32)
        for ibl in range(n // QK_K):
            o = 144 * ibl
            d = _load_f16(qr, o)
            extra = np.int64(qr[o + 2]) | (np.int64(qr[o + 3]) << 8)
            for ib in range(16):
                ib32 = ib // 2
                ls = np.int64((qr[o + 8 + ib32] >> (4 * (ib % 2))) & 15)
                ls |= np.int64((qr[o + 4 + ib // 4] >> (2 * (ib % 4))) & 3) << 4
                dl = d * F(ls - 32)
                base = 16 * ((extra >> ib) & 1)
                for k in range(16):
                    lut[k] = dl * IQ4K[base + k]
                qpos = o + 16 + 16 * ib32
                shift = 4 * (ib % 2)
                yb = y[QK_K * ibl + 16 * ib : QK_K * ibl + 16 * ib + 16]
                for j in range(16):
                    yb[j] = lut[(qr[qpos + j] >> shift) & 15]


# ----------------------------------------------------------------------------------------------------- IQ5_K, IQ6_K


@njit(**NJIT)
def _search_iq56(kind: int, xbl: np.ndarray, weight: np.ndarray, scales: np.ndarray) -> tuple[int, np.float32]:
    """Sub-block scales of an IQ5_K/IQ6_K block (searched, then refit once): (extra bits, the scale of largest |.|)."""
    extra = 0
    max_scale = F(0.0)
    max_abs_scale = F(0.0)
    for ib in range(16):
        xb = xbl[16 * ib : 16 * ib + 16]
        wb = weight[16 * ib : 16 * ib + 16]
        amax, vmax = _abs_max(xb)
        if amax < F(1e-16):
            scales[ib] = F(0.0)
            continue
        d, shifted = _search_scale(kind, xb, wb, vmax, 5, 1, False)
        if d != 0:
            d = _refit(kind, _grid(kind)[2] if shifted else 0, xb, wb, d)
        scales[ib] = d
        if shifted:
            extra |= 1 << ib
        if abs(d) > max_abs_scale:
            max_abs_scale = abs(d)
            max_scale = d
    return extra, max_scale


@njit(**KERNEL)
def _quantize_iq5_k(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    weighted = qw.size > 0
    for r in prange(n_rows):
        xr = x[r]
        o = out[r]
        rw = np.empty(n if weighted else 0, dtype=np.float32)
        if weighted:
            _row_weights(xr, qw, rw)
        weight = np.empty(QK_K, dtype=np.float32)
        scales = np.empty(16, dtype=np.float32)
        for ibl in range(n // QK_K):
            xbl = xr[ibl * QK_K : (ibl + 1) * QK_K]
            ob = o[ibl * 176 : (ibl + 1) * 176]
            ob[:] = 0
            sigma2 = F(2.0) * _sum_squares(xbl) / F(QK_K)
            _block_weights(xbl, rw[ibl * QK_K : (ibl + 1) * QK_K], weighted, sigma2, F(0.25) * sigma2, weight)
            extra, max_scale = _search_iq56(5, xbl, weight, scales)
            if max_scale == 0:
                continue
            d = -max_scale / F(32.0)
            _store_f16(ob, 0, d)
            ob[2] = extra & 0xFF
            ob[3] = extra >> 8
            inv = F(1.0) / d
            sumqx = F(0.0)
            sumq2 = F(0.0)
            for ib in range(16):
                ls = min(31, max(-32, nearest_int_fma(inv, scales[ib])))
                uls = ls + 32
                ob[8 + ib // 2] |= np.uint8((uls & 15) << (4 * (ib % 2)))
                ob[4 + ib // 4] |= np.uint8((uls >> 4) << (2 * (ib % 4)))
                dl = d * F(ls)
                if dl == 0:
                    continue
                base = 32 if (extra >> ib) & 1 else 0
                idl = F(1.0) / dl
                ib32 = ib // 2
                qpos = 16 + 32 * (ib32 // 2) + 16 * (ib % 2)
                hpos = 144 + 16 * (ib % 2)
                for j in range(16):
                    xv = xbl[16 * ib + j]
                    k = _best_index(5, base, idl * xv)
                    ob[qpos + j] |= np.uint8((k & 15) << (4 * (ib32 % 2)))
                    ob[hpos + j] |= np.uint8((k >> 4) << ib32)
                    q = F(np.int64(IQ5NL[base + k]) * ls)
                    wq = weight[16 * ib + j] * q
                    sumqx = fmaf(wq, xv, sumqx)
                    sumq2 = fmaf(wq, q, sumq2)
            if sumq2 > 0:
                _store_f16(ob, 0, sumqx / sumq2)


@njit(**KERNEL)
def _dequantize_iq5_k(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        qr = q[r]
        y = out[r]
        lut = np.empty(32, dtype=np.float32)
        for ibl in range(n // QK_K):
            o = 176 * ibl
            d = _load_f16(qr, o)
            extra = np.int64(qr[o + 2]) | (np.int64(qr[o + 3]) << 8)
            for ib in range(16):
                ib32 = ib // 2
                ls = np.int64((qr[o + 8 + ib32] >> (4 * (ib % 2))) & 15)
                ls |= np.int64((qr[o + 4 + ib // 4] >> (2 * (ib % 4))) & 3) << 4
                dl = d * F(ls - 32)
                base = 32 * ((extra >> ib) & 1)
                for k in range(32):
                    lut[k] = dl * IQ5NL[base + k]
                qpos = o + 16 + 32 * (ib32 // 2) + 16 * (ib % 2)
                hpos = o + 144 + 16 * (ib % 2)
                shift = 4 * (ib32 % 2)
                yb = y[QK_K * ibl + 16 * ib : QK_K * ibl + 16 * ib + 16]
                for j in range(16):
                    yb[j] = lut[((qr[qpos + j] >> shift) & 15) | (((qr[hpos + j] >> ib32) & 1) << 4)]


@njit(**KERNEL)
def _quantize_iq6_k(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    weighted = qw.size > 0
    for r in prange(n_rows):
        xr = x[r]
        o = out[r]
        rw = np.empty(n if weighted else 0, dtype=np.float32)
        if weighted:
            _row_weights(xr, qw, rw)
        weight = np.empty(QK_K, dtype=np.float32)
        scales = np.empty(16, dtype=np.float32)
        for ibl in range(n // QK_K):
            xbl = xr[ibl * QK_K : (ibl + 1) * QK_K]
            ob = o[ibl * 212 : (ibl + 1) * 212]
            ob[:] = 0
            sigma2 = F(2.0) * _sum_squares(xbl) / F(QK_K)
            _block_weights(xbl, rw[ibl * QK_K : (ibl + 1) * QK_K], weighted, sigma2, F(0.25) * sigma2, weight)
            extra, max_scale = _search_iq56(6, xbl, weight, scales)
            if max_scale == 0:
                continue
            d = -max_scale / F(127.0)
            _store_f16(ob, 0, d)
            ob[2] = extra & 0xFF
            ob[3] = extra >> 8
            inv = F(1.0) / d
            sumqx = F(0.0)
            sumq2 = F(0.0)
            for ib in range(16):
                ls = min(127, max(-127, nearest_int_fma(inv, scales[ib])))
                ob[4 + ib] = np.uint8(ls & 0xFF)
                dl = d * F(ls)
                if dl == 0:
                    continue
                base = 64 if (extra >> ib) & 1 else 0
                idl = F(1.0) / dl
                ib32 = ib // 2
                qpos = 20 + 32 * (ib32 // 2) + 16 * (ib % 2)
                hpos = 148 + 32 * (ib32 // 4) + 16 * (ib % 2)
                for j in range(16):
                    xv = xbl[16 * ib + j]
                    k = _best_index(6, base, idl * xv)
                    ob[qpos + j] |= np.uint8((k & 15) << (4 * (ib32 % 2)))
                    ob[hpos + j] |= np.uint8((k >> 4) << (2 * (ib32 % 4)))
                    q = IQ6NL[base + k] * F(ls)
                    wq = weight[16 * ib + j] * q
                    sumqx = fmaf(wq, xv, sumqx)
                    sumq2 = fmaf(wq, q, sumq2)
            if sumq2 > 0:
                _store_f16(ob, 0, sumqx / sumq2)


@njit(**KERNEL)
def _dequantize_iq6_k(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        qr = q[r]
        y = out[r]
        for ibl in range(n // QK_K):
            o = 212 * ibl
            d = _load_f16(qr, o)
            extra = np.int64(qr[o + 2]) | (np.int64(qr[o + 3]) << 8)
            for ib in range(16):
                ib32 = ib // 2
                dl = d * F(np.int8(qr[o + 4 + ib]))
                base = 64 * ((extra >> ib) & 1)
                qpos = o + 20 + 32 * (ib32 // 2) + 16 * (ib % 2)
                hpos = o + 148 + 32 * (ib32 // 4) + 16 * (ib % 2)
                shift = 4 * (ib32 % 2)
                hshift = 2 * (ib32 % 4)
                yb = y[QK_K * ibl + 16 * ib : QK_K * ibl + 16 * ib + 16]
                for j in range(16):
                    k = ((qr[qpos + j] >> shift) & 15) | (((qr[hpos + j] >> hshift) & 3) << 4)
                    yb[j] = dl * IQ6K_LEVELS[base + k]


# ----------------------------------------------------------------------------------------------------------- codecs


def _search_limit(grid_max: float, weight_factor: float) -> float:
    """Largest max|x| a block may hold before ik's own scale search overflows float32 (20 % margin, rounded down to
    a whole thousand so that it is an exact float32).

    The search compares (sum of w*q*x)^2 over 16 values, with weights w <= weight_factor * max|x|^2 (no importances)
    and codes |q| <= grid_max. Once that square passes FLT_MAX every comparison fails and ik's output degrades badly
    (errors above 2 * max|x| for IQ2_K at 2e6), so larger inputs are refused. It is far below where d would overflow
    fp16 (about 65504 * 64 or more).
    """
    limit = 0.8 * (float(np.sqrt(np.finfo(np.float32).max)) / (16 * weight_factor * grid_max)) ** (1.0 / 3.0)
    return float(int(limit) // 1000 * 1000)


def _error_bound(grid: np.ndarray, deviation: float = 0.0) -> float:
    """Documented relative error: 3 * (half the grid's widest gap + the decoder's deviation) / the grid's largest entry.

    Rounding onto the grid costs at most half its widest gap times the sub-block scale, and the largest sub-block
    scale maps the block maximum to about the grid's largest entry. The factor 3 covers the coarse integer
    sub-block scales and the least-squares fits clipping extremes: an adversarial search over blocks reached 0.55
    (IQ2_K), 0.25 (IQ3_K), 0.13 (IQ4_K), 0.088 (IQ5_K) and 0.029 (IQ6_K) against bounds of 0.87, 0.55, 0.28, 0.14
    and 0.082.
    """
    half = np.reshape(grid, (2, -1))
    widest = float(np.diff(half, axis=1).max()) / 2
    return 3 * (widest + deviation) / float(np.abs(grid).max())


def _error_floor(largest_code: int) -> float:
    """Absolute error allowance for tiny blocks: fp16 d below 2^-14 is subnormal with step 2^-24 (it can round to
    0), so a value coded as q moves by up to half that step times |q|; twice that for the largest |q|."""
    return largest_code * 2.0**-24


class IQ2_KCodec(Codec):
    type_name = "IQ2_K"
    max_abs_input = _search_limit(31, 1.5)
    rel_error_bound = _error_bound(IQ2NL)
    # codes are grid (|v| <= 31) times a sub-block scale in [-8, 7], and d is stored 3 % larger
    abs_error_floor = _error_floor(256)

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq2_k(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq2_k(q, out)


class IQ3_KCodec(Codec):
    type_name = "IQ3_K"
    max_abs_input = _search_limit(63, 1.5)
    rel_error_bound = _error_bound(IQ3NL)
    # grid |v| <= 63 times an odd sub-block scale |2n + 1| <= 31
    abs_error_floor = _error_floor(63 * 31)

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq3_k(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq3_k(q, out)


class IQ4_KCodec(Codec):
    type_name = "IQ4_K"
    # without importances IQ4_K weighs by x^2 alone
    max_abs_input = _search_limit(127, 1.0)
    rel_error_bound = _error_bound(IQ4K)
    abs_error_floor = _error_floor(127 * 32)

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq4_k(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq4_k(q, out)


class IQ5_KCodec(Codec):
    type_name = "IQ5_K"
    max_abs_input = _search_limit(126, 1.5)
    rel_error_bound = _error_bound(IQ5NL)
    abs_error_floor = _error_floor(126 * 32)

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq5_k(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq5_k(q, out)


class IQ6_KCodec(Codec):
    type_name = "IQ6_K"
    max_abs_input = _search_limit(127, 1.5)
    # the decoder's cubic strays from the quantizer's integer grid by up to 0.49
    rel_error_bound = _error_bound(IQ6NL, 0.49)
    abs_error_floor = _error_floor(127 * 127)

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq6_k(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq6_k(q, out)


for _codec in (IQ2_KCodec(), IQ3_KCodec(), IQ4_KCodec(), IQ5_KCodec(), IQ6_KCodec()):
    register_codec(_codec.type_name, _codec)
