"""What the IQK families (IQ2_K..IQ6_K in iqk.py, IQ2_KS..IQ5_KS in iqk_ks.py) share: the non-linear value grids,
ik's nearest-entry lookups into them, the sub-block scale search over both halves of a grid, and the block
statistics both families compute the same way.

Each grid (ggml-common.h) holds the plain grid followed by a slightly shifted copy; a per-sub-block bit picks the
copy. The per-value helpers read the tables as module globals and take a grid number (`kind` 3, 4, 5 or 6 for IQ3NL,
IQ4K, IQ5NL, IQ6NL) rather than a table, because LLVM inlines a jitted helper only when it takes no arrays. Callers
pass `kind` as a literal constant, so that Numba compiles one copy per grid with the other grids' branches removed.
The scale search's trials run in grid_sums' vector IR over each grid's slot tables (slot_values): written as plain
loops, LLVM vectorised them in some compiles and not in others (IQ4_KS at 7.9 or 1.7 M weights/s, IQ5_KS at 0.7,
depending on the process that compiled it; ik: 5.4 and 4.9). Every multiply-add is fused exactly where ik's GCC
build fuses it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ikquant.formats.grid_sums import slot_lane_sums
from ikquant.formats.numeric import abs_max, fmaf, nearest_int_fma, trunc_i32
from ikquant.formats.vector_ir import whole_vectors

NJIT = dict(cache=True, nogil=True, error_model="numpy")
F = np.float32


def _runs(*pairs: int) -> np.ndarray:
    """Expand (value, count) pairs: ik's nearest-entry index tables are long runs of one entry."""
    out: list[int] = []
    for value, count in zip(pairs[::2], pairs[1::2]):
        out += [value] * count
    return np.array(out, dtype=np.int8)


# The grids as ik stores them (int8), plain half first.
IQ2NL_VALUES = np.array([-31, -13, 1, 17, -26, -8, 6, 22], dtype=np.int8)
IQ3NL_VALUES = np.array([-63, -40, -23, -10, 1, 13, 28, 47, -59, -36, -19, -6, 5, 17, 32, 51], dtype=np.int8)
IQ4K_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
     -123, -100, -79, -61, -45, -31, -18, -6, 5, 17, 29, 42, 57, 73, 93, 117], dtype=np.int8)  # fmt: skip
IQ5NL_VALUES = np.array(
    [-126, -114, -103, -92, -83, -74, -65, -57, -50, -43, -36, -30, -24, -18, -12, -6,
     -1, 5, 11, 17, 23, 29, 36, 43, 51, 59, 68, 77, 87, 97, 109, 121,
     -124, -112, -101, -90, -81, -72, -63, -55, -48, -41, -34, -28, -22, -16, -10, -4,
     1, 7, 13, 19, 25, 31, 38, 45, 53, 61, 70, 79, 89, 99, 111, 123], dtype=np.int8)  # fmt: skip
# iq6nl_values: ik's IQ6_K quantizer takes its first 64 entries and builds the shifted half as entry + 1.
_IQ6NL_PLAIN = np.array(
    [-127, -121, -115, -109, -104, -98, -93, -88, -84, -79, -74, -70, -66, -62, -58, -54,
     -51, -47, -44, -40, -37, -34, -31, -28, -25, -22, -19, -16, -13, -11, -8, -5,
     -2, 0, 3, 6, 9, 12, 14, 17, 20, 23, 27, 30, 33, 36, 40, 44,
     47, 51, 55, 59, 63, 68, 72, 77, 82, 87, 92, 98, 103, 109, 115, 121], dtype=np.int8)  # fmt: skip
IQ6NL_VALUES = np.concatenate([_IQ6NL_PLAIN, _IQ6NL_PLAIN + np.int8(1)])

# The same grids as float32 (exact), for the arithmetic.
IQ2NL = IQ2NL_VALUES.astype(np.float32)
IQ3NL = IQ3NL_VALUES.astype(np.float32)
IQ4K = IQ4K_VALUES.astype(np.float32)
IQ5NL = IQ5NL_VALUES.astype(np.float32)
IQ6NL = IQ6NL_VALUES.astype(np.float32)

# ik's nearest-entry lookups (iqk_quantize.cpp), indexed by the integer part of x minus the grid's first entry: an
# entry below the half's size n is the answer, an entry n + i means "compare grid[i] and grid[i + 1]". They serve
# both halves, and C's truncation toward zero makes them slightly imperfect, so they are kept as data rather than
# replaced by an exact nearest search.
IQ3NL_INDEX = _runs(0, 11, 8, 2, 1, 18, 9, 2, 2, 13, 10, 2, 3, 10, 11, 2, 4, 10, 12, 1, 5, 12, 13, 2, 6, 15, 14, 2,
                    7, 9)  # fmt: skip
IQ4NL_INDEX = _runs(0, 11, 16, 2, 1, 20, 17, 2, 2, 18, 18, 1, 3, 16, 19, 1, 4, 14, 20, 1, 5, 12, 21, 2, 6, 11, 22, 1,
                    7, 10, 23, 2, 8, 10, 24, 1, 9, 11, 25, 1, 10, 11, 26, 2, 11, 12, 27, 2, 12, 14, 28, 1, 13, 17,
                    29, 1, 14, 21, 30, 1, 15, 12)  # fmt: skip
IQ5NL_INDEX = _runs(0, 6, 32, 1, 1, 10, 33, 2, 2, 9, 34, 2, 3, 8, 35, 2, 4, 7, 36, 2, 5, 7, 37, 2, 6, 7, 38, 1,
                    7, 6, 39, 2, 8, 5, 40, 2, 9, 5, 41, 2, 10, 5, 42, 1, 11, 5, 43, 1, 12, 5, 44, 1, 13, 5, 45, 1,
                    14, 5, 46, 1, 15, 4, 47, 2, 16, 4, 48, 1, 17, 5, 49, 1, 18, 5, 50, 1, 19, 5, 51, 1, 20, 5, 52, 1,
                    21, 5, 53, 2, 22, 5, 54, 2, 23, 6, 55, 1, 24, 7, 56, 1, 25, 7, 57, 2, 26, 7, 58, 2, 27, 8, 59, 1,
                    28, 9, 60, 1, 29, 10, 61, 1, 30, 11, 62, 1, 31, 6)  # fmt: skip
IQ6NL_INDEX = _runs(0, 3, 64, 1, 1, 5, 65, 1, 2, 5, 66, 1, 3, 4, 67, 2, 4, 4, 68, 1, 5, 4, 69, 2, 6, 3, 70, 2, 7, 3,
                    71, 1, 8, 3, 72, 2, 9, 3, 73, 2, 10, 3, 74, 1, 11, 3, 75, 1, 12, 3, 76, 1, 13, 3, 77, 1, 14, 3,
                    78, 1, 15, 2, 79, 2, 16, 2, 80, 1, 17, 2, 81, 2, 18, 2, 82, 1, 19, 2, 83, 2, 20, 1, 84, 2, 21, 1,
                    85, 2, 22, 1, 86, 2, 23, 1, 87, 2, 24, 1, 88, 2, 25, 1, 89, 2, 26, 1, 90, 2, 27, 1, 91, 2, 28, 1,
                    92, 1, 29, 1, 93, 2, 30, 1, 94, 2, 31, 1, 95, 2, 32, 1, 96, 1, 33, 1, 97, 2, 34, 1, 98, 2, 35, 1,
                    99, 2, 36, 1, 100, 2, 37, 1, 101, 1, 38, 1, 102, 2, 39, 1, 103, 2, 40, 1, 104, 2, 41, 2, 105, 1,
                    42, 2, 106, 2, 43, 1, 107, 2, 44, 1, 108, 2, 45, 2, 109, 1, 46, 3, 110, 1, 47, 2, 111, 2, 48, 2,
                    112, 1, 49, 3, 113, 1, 50, 3, 114, 1, 51, 3, 115, 1, 52, 3, 116, 2, 53, 3, 117, 1, 54, 3, 118, 2,
                    55, 3, 119, 2, 56, 3, 120, 2, 57, 3, 121, 2, 58, 4, 122, 1, 59, 4, 123, 2, 60, 4, 124, 1, 61, 5,
                    125, 1, 62, 5, 126, 1, 63, 3)  # fmt: skip


# int64 copies of the grids' integers and of the lookup tables: the per-value lookups run faster on them than on int8
_I3, _X3 = IQ3NL_VALUES.astype(np.int64), IQ3NL_INDEX.astype(np.int64)
_I4, _X4 = IQ4K_VALUES.astype(np.int64), IQ4NL_INDEX.astype(np.int64)
_I5, _X5 = IQ5NL_VALUES.astype(np.int64), IQ5NL_INDEX.astype(np.int64)
_I6, _X6 = IQ6NL_VALUES.astype(np.int64), IQ6NL_INDEX.astype(np.int64)


@njit(**NJIT)
def grid(kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """(float32 grid, int64 grid, lookup table, entries per half, table limit) of grid `kind`; past the limit ik
    clamps."""
    if kind == 3:
        return IQ3NL, _I3, _X3, 8, 111
    if kind == 4:
        return IQ4K, _I4, _X4, 16, 241
    if kind == 5:
        return IQ5NL, _I5, _X5, 32, 247
    return IQ6NL, _I6, _X6, 64, 249


@njit(**NJIT)
def nearest(kind: int, base: int, x: np.float32) -> int:
    """ik's nearest entry to x (best_index_iq{3,4,5,6}nl) in the half of grid `kind` that starts at `base`.

    IQ3/4/5 index their table by (int)x - grid[0], IQ6 by (int)(x - grid[0]).
    """
    values, ivalues, table, n, limit = grid(kind)
    if kind == 6:
        ix = np.int64(trunc_i32(x - values[base]))
    else:
        ix = np.int64(trunc_i32(x)) - ivalues[base]
    if ix < 0:
        return 0
    if ix >= limit:
        return n - 1
    k = table[ix]
    if k < n:
        return k
    k -= n
    if x - values[base + k] < values[base + k + 1] - x:
        return k
    return k + 1


#: the midpoints between the plain IQ3 grid's neighbouring entries (exact in float32)
_IQ3_MIDPOINTS = (IQ3NL[:7] + IQ3NL[1:8]) / np.float32(2.0)


@njit(**NJIT)
def nearest_plain_iq3(x: np.float32) -> int:
    """nearest(3, 0, x) without a table or branches, so that it runs in vector lanes: the count of the plain IQ3
    grid's midpoints at or below x (ik's table holds the nearest entry, a tie going to the upper one), and 0 where
    ik's truncation to int overflows (x >= 2^31; NaN and x <= -2^31 count 0 anyway). Checked equal to nearest once
    on every float32 of |x| < 512 (the plain half has no midpoint where ik's rounded comparison decides)."""
    n = 0
    for j in range(7):
        n += x >= _IQ3_MIDPOINTS[j]
    return n if x < np.float32(2147483648.0) else 0


@njit(**NJIT)
def nearest_iq2(base: int, x: np.float32) -> int:
    """ik's best_index_iq2nl: nearest of the four IQ2NL entries from `base`, by its two comparisons."""
    idx = 0 if x < IQ2NL[base + 1] else (2 if x > IQ2NL[base + 2] else 1)
    if x - IQ2NL[base + idx] < IQ2NL[base + idx + 1] - x:
        return idx
    return idx + 1


@njit(**NJIT)
def keep_better(sumqx: np.float32, sumq2: np.float32, d: np.float32, best: np.float32
                ) -> tuple[np.float32, np.float32, bool]:
    """ik's acceptance test of a trial fit: scale sumqx/sumq2 replaces d when its gain sumqx^2/sumq2 beats best."""
    if sumq2 > 0 and sumqx * sumqx > best * sumq2:
        d = sumqx / sumq2
        return d, d * sumqx, True
    return d, best, False


def _slot_codes(index: np.ndarray, n: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """ik's lookup table up to its limit as the two candidate codes (entries of a half) per slot, equal where the
    slot answers alone, with one slot more at each end for ik's clamps below the table and from its limit on."""
    index = index[:limit].astype(np.int32)
    lo = np.concatenate([[0], np.where(index < n, index, index - n), [n - 1]]).astype(np.int32)
    hi = np.concatenate([[0], np.where(index < n, index, index - n + 1), [n - 1]]).astype(np.int32)
    return lo, hi


def _slot_values(values: np.ndarray, index: np.ndarray, n: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """The candidate codes' values per slot, [half, slot]: what grid_sums.slot_lane_sums reads."""
    lo, hi = _slot_codes(index, n, limit)
    halves = values.reshape(2, n)
    return np.ascontiguousarray(halves[:, lo]), np.ascontiguousarray(halves[:, hi])


_LO3, _HI3 = _slot_values(IQ3NL, IQ3NL_INDEX, 8, 111)
_LO4, _HI4 = _slot_values(IQ4K, IQ4NL_INDEX, 16, 241)
_LO5, _HI5 = _slot_values(IQ5NL, IQ5NL_INDEX, 32, 247)
_LO6, _HI6 = _slot_values(IQ6NL, IQ6NL_INDEX, 64, 249)
#: grid 4's candidate codes per slot (IQ4_KSS's search needs the codes, not only their values)
IQ4_SLOT_LOW, IQ4_SLOT_HIGH = _slot_codes(IQ4NL_INDEX, 16, 241)


@njit(**NJIT)
def slot_values(kind: int) -> tuple[np.ndarray, np.ndarray]:
    """The two candidate values per lookup slot of grid `kind`, [half, slot] (see _slot_values)."""
    if kind == 3:
        return _LO3, _HI3
    if kind == 4:
        return _LO4, _HI4
    if kind == 5:
        return _LO5, _HI5
    return _LO6, _HI6


@njit(**NJIT)
def lane_sums(kind: int, base: int, xb: np.ndarray, wb: np.ndarray, inv: np.ndarray, sumqx: np.ndarray,
              sumq2: np.ndarray) -> None:
    """Weighted sums (sum w q x, sum w q^2) of every trial inverse scale inv[l] at once (inv.size a multiple of
    LANES), rounding x*inv[l] onto the grid half at `base` as ik's lookup does: the trials in vector lanes, each
    lane's sums one chain over the sub-block in ik's order (ik forms them one trial at a time)."""
    values, ivalues, _, _, limit = grid(kind)
    low, high = slot_values(kind)
    half = 0 if base == 0 else 1
    if kind == 6:
        slot_lane_sums(xb, wb, inv, low[half], high[half], values[base], 0, limit, sumqx, sumq2)
    else:
        slot_lane_sums(xb, wb, inv, low[half], high[half], F(0.0), ivalues[base], limit, sumqx, sumq2)


@njit(**NJIT)
def grid_search(kind: int, xb: np.ndarray, wb: np.ndarray, vmax: np.float32, ntry: int, step: int,
                guard_first: bool) -> tuple[np.float32, bool]:
    """ik's sub-block scale search on grid `kind`: (best weighted least-squares scale, whether the shifted half won).

    Starts from max/grid[0] (both signs), then tries the inverse scales (step*itry + grid[base])/max for itry in
    [-ntry, ntry] on the plain and on the shifted half, each both signs (-x*inv as x*(-inv): the same product).
    `guard_first` is IQ3_K's and IQ3_KS's check that the first fit has a positive denominator (the other types
    divide unconditionally). Every trial's sums are formed side by side (lane_sums: lanes 0, 1 the start, then
    2 + 2 i + sign on the plain half, P + 2 i + sign on the shifted one, P the plain lanes padded to whole
    vectors), then compared in ik's order.
    """
    values, ivalues, _, n, _ = grid(kind)
    n_inv = 2 * ntry + 1
    plain = whole_vectors(2 + 2 * n_inv)
    inv = np.zeros(plain + whole_vectors(2 * n_inv), dtype=np.float32)
    sumqx = np.empty(inv.size, dtype=np.float32)
    sumq2 = np.empty(inv.size, dtype=np.float32)
    d = -vmax / values[0]
    inv[0] = F(1.0) / d
    for i in range(n_inv):
        inv[2 + 2 * i] = F(step * (i - ntry) + ivalues[0]) / vmax
        inv[plain + 2 * i] = F(step * (i - ntry) + ivalues[n]) / vmax
    for lane in range(0, inv.size, 2):
        inv[lane + 1] = -inv[lane]
    lane_sums(kind, 0, xb, wb, inv[:plain], sumqx[:plain], sumq2[:plain])
    lane_sums(kind, n, xb, wb, inv[plain:], sumqx[plain:], sumq2[plain:])
    best = F(0.0)
    if not guard_first or sumq2[0] > 0:
        d = sumqx[0] / sumq2[0]
        best = d * sumqx[0]
    d, best, _ = keep_better(sumqx[1], sumq2[1], d, best)
    shifted = False
    for i in range(n_inv):
        for lane, on_shifted in ((2 + 2 * i, False), (plain + 2 * i, True)):
            d, best, better_p = keep_better(sumqx[lane], sumq2[lane], d, best)
            d, best, better_m = keep_better(sumqx[lane + 1], sumq2[lane + 1], d, best)
            if better_p or better_m:
                shifted = on_shifted
    return d, shifted


@njit(**NJIT)
def iqk_qx_quants(x: np.ndarray, w: np.ndarray, nmax: int, L: np.ndarray) -> np.float32:
    """iqk_quantize.cpp's own make_qx_quants: weighted symmetric scale for the codes round(x/scale) in [-nmax, nmax).

    Tries 19 inverse scales around nmax/max and keeps the best weighted least-squares fit; L receives the codes
    plus nmax. Unlike ggml-quants.c's namesake it has no refinement pass, and its trial loop is scalar and fused.
    """
    amax, vmax = abs_max(x)
    if amax == 0:
        L[:] = 0
        return F(0.0)
    fn = F(nmax)
    iscale = -fn / vmax
    sumlx = F(0.0)
    suml2 = F(0.0)
    for i in range(x.size):
        l = min(nmax - 1, max(-nmax, nearest_int_fma(iscale, x[i])))
        L[i] = l + nmax
        fl = F(l)
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
        scale, best, better = keep_better(sumlx, suml2, scale, best)
        if better:
            for i in range(x.size):
                L[i] = nmax + min(nmax - 1, max(-nmax, nearest_int_fma(iscale, x[i])))
    return scale


@njit(**NJIT)
def importance(qw: np.ndarray, x: np.ndarray, block: int, out: np.ndarray) -> None:
    """ik's QHelper: a block of `block` values whose importances (or values) are all ~0 gets the tiny weight 1e-9
    instead, so that no scale search divides by zero. The three sums are vectorised in ik's build: products
    rounded, then added in order."""
    eps = F(1e-9)
    floor = F(block) * (eps * eps)
    for b in range(0, x.size, block):
        sumw2 = F(0.0)
        sumx2 = F(0.0)
        sumwx = F(0.0)
        for j in range(b, b + block):
            w = qw[j]
            out[j] = w
            sumw2 += w * w
            sumx2 += x[j] * x[j]
            sumwx += w * abs(x[j])
        if not (sumw2 > floor and sumx2 > floor and sumwx > floor):
            out[b : b + block] = eps


@njit(**NJIT)
def sum_squares(x: np.ndarray) -> np.float32:
    """Sum of x*x over a block, as ik's build vectorises it: each square rounded, then added in order."""
    s = F(0.0)
    for j in range(x.size):
        s += x[j] * x[j]
    return s
