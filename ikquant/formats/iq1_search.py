"""The searches that write IQ1_S and IQ1_M (ik's quantize_row_iq1_s_impl and quantize_row_iq1_m_impl), and the
block searches the interleaved IQ1_S_R4 / IQ1_M_R4 share with them.

An IQ1 value is -1, 0 or +1 plus a shift of +delta or -delta (delta = 1/8) common to a group of 8, times a block
scale; each group's 8 levels must be one of the 2048 points of the IQ1 grid (iq12_grids.KGRID_IQ1S, 2 bits a level).
With three levels the best weighted least-squares fit of a block can be found exactly: sort the block's values, and
every pair of cut points (i1 <= i2) splits them into the levels -1 / 0 / +1. Prefix sums of w x and w over the
sorted values give each split's fit sum(w x q)^2 / sum(w q^2) in a few operations, for each choice of shift (IQ1_S:
one shift per 32 values; IQ1_M: one per group of 8, four combinations per 16 values). The scan in ik's order visits
only the splits that can be the one it takes last (iq1_lanes: the same split, a few percent of the work). The best
split's groups are then checked against the grid: a group that is no grid point takes the nearest of that key's
precomputed neighbours (all grid points within its 3 smallest distances, compared by importance-weighted squared
error at the chosen scale), and when one did, the scale is refitted to the points taken.

- IQ1_S (50 bytes per 256 values): f16 d, 32 low index bytes, per 32 values a u16 of the indices' top 3 bits x 4,
  a 3-bit scale s (bits 12-14) and the shift's sign (bit 15). d is stored 12.5% larger than max scale / 15, and
  s = nearest((scale / d - 1) / 2) clamped to 0..7, so a block's scale is d (2 s + 1).
- IQ1_M (56 bytes per 256 values): 32 low index bytes, 16 bytes of top bits and shift signs (two groups each),
  4 u16 of 3-bit scales (one per 16 values) whose top nibbles together are the f16 d: d is refitted over the whole
  super-block's decoded levels and stored 8.5% larger.

The importance of a value is qw sqrt(sigma2 + x^2), sigma2 the super-block's mean square times 2 (IQ1_S) or its 32
values' times 1.5 (IQ1_M); without an importance vector IQ1_M uses x^2 and IQ1_S unit qw (ik's reference quantizer:
ggml_quantize_chunk itself refuses IQ1_S without one). Sorting keeps equal values in their order (glibc's qsort is a
stable merge sort). The float arithmetic is ik's GCC build, as its machine code does it (and checked against that
build on random rows, ties and zeros included): GCC fuses a multiply-add (`fmaf`) only where the product has no
other use, so IQ1_S's prefix sums of w x are fused and IQ1_M's are not, IQ1_S's norm of a +delta split is summed
unfused and that of a -delta split fused, and IQ1_M's refit rounds every product; split terms that do not change
with the second cut point are computed once per first cut point (rounded on their own); sums of squares round each
square (GCC vectorizes the squares and adds them in order).

Two of ik's quirks are kept. IQ1_M skips the first value's importance when it checks whether a block's weights
vanish. And an IQ1_M block of 16 values below 1e-7 stores no shift of its own: ik's shift array keeps what that
block position held in the previous super-block of the call (rows, then super-blocks, in order; before any, ik
reads uninitialized memory, here 0), and that shift lands in the bits and in the refit of d. `carry_shifts`
reproduces it after the rows were searched in parallel. Where ik aborts (no split fits, which only importance
weights that vanish over a block bring about), d is written as NaN so that Codec.quantize quantizes the row again
without the weights.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.iq1_lanes import (
    MINUS,
    PLUS,
    SUM_W_MAX,
    SUM_WX_MAX,
    iq1m_contenders,
    iq1s_contenders,
    lowest_bit,
)
from ikquant.formats.iq2_search import grid_tables
from ikquant.formats.listed_search import nearest_listed
from ikquant.formats.numeric import f32_to_f16_bits, fmaf, nearest_int, store_f16
from ikquant.formats.ordering import stable_order
from ikquant.formats.vector_ir import LANES

QK_K = 256
IQ1_S_BYTES = 50  # d (2), qs (32), qh (16)
IQ1_M_BYTES = 56  # qs (32), qh (16), scales and d (8)
IQ1S_BLOCK = 32
IQ1M_BLOCK = 16
GROUP_MAX_EPS_IQ1_S = np.float32(1e-12)  # ik: a block below this maximum is stored as zeros
GROUP_MAX_EPS_IQ1_M = np.float32(1e-7)
FLT_MIN = np.float32(1.1754944e-38)
FLT_MAX = np.float32(3.4028235e38)
NAN_F16 = 0x7E00
#: a level (-1, 0, +1) plus the group's shift, for shift +delta and -delta
SHIFT_PLUS = np.array(PLUS, dtype=np.float32)
SHIFT_MINUS = np.array(MINUS, dtype=np.float32)
#: IQ1_M's shift-sign bits in a qh byte per shift combination (0: +/+, 1: +/-, 2: -/+, 3: -/-; first/second 8)
IQ1M_SHIFT_MASKS = np.array([0x00, 0x80, 0x08, 0x88], dtype=np.int64)
#: IQ1_M's stored shift of a block that has none of its own (below the threshold): filled by carry_shifts
NO_SHIFT = -1
NJIT = dict(cache=True, nogil=True, error_model="numpy")
KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")

def iq1_grid() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What the kernels take of ik's iq2xs_init_impl tables for the IQ1 grid (every grid point within the 3 smallest
    distances of an off-grid key): (key map, neighbour lists, levels [2048, 8], the lists' dense magnitudes and
    where each begins), built on first use."""
    t = grid_tables("IQ1_S")
    return t.kmap, t.neighbours, t.levels, t.dense, t.dense_at


@njit(**NJIT)
def scratch() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One thread's work arrays: importances (32), levels (32), sort order (32), prefix sums (4 x 33, and a vector
    of padding: w x and w, or for IQ1_M those of its first and second group), grid indices (4) and the marked
    splits (33, iq1_lanes)."""
    return (np.empty(IQ1S_BLOCK, np.float32), np.zeros(IQ1S_BLOCK, np.int64), np.empty(IQ1S_BLOCK, np.int64),
            np.zeros((4, IQ1S_BLOCK + 1 + LANES), np.float32), np.zeros(4, np.int64),
            np.zeros(IQ1S_BLOCK + 1, np.int64))


@njit(inline="always", **NJIT)
def _grid_point(grid: tuple, x: np.ndarray, o: int, weight: np.ndarray, wo: int, scale: np.float32,  # type: ignore[type-arg]
                shifted: np.ndarray, L: np.ndarray, lo: int) -> tuple[int, bool]:
    """The grid point of the group of levels L[lo:lo+8] for the values x[o:o+8], and whether the levels were one.
    Off the grid it is ik's iq1_find_best_neighbour2: the listed neighbour whose shifted levels, times scale, have
    the least weighted squared error (the first on ties; none finite: the list's first), its levels written into L.
    As IQ2's search (listed_search) over the dense magnitudes v = 2 l + 1: shifted[l] = shifted[0] + l, so
    v / 2 + (shifted[0] - 1 / 2) is it exactly (multiples of 1/8)."""
    kmap, neighbours, levels, dense, dense_at = grid
    u = 0
    for j in range(8):
        u |= L[lo + j] << (2 * j)
    g = kmap[u]
    if g >= 0:
        return g, True
    start = -g - 1
    count = neighbours[start]
    j = nearest_listed(dense, dense_at[start], count,
                       (-x[o], -x[o + 1], -x[o + 2], -x[o + 3], -x[o + 4], -x[o + 5], -x[o + 6], -x[o + 7]),
                       (weight[wo], weight[wo + 1], weight[wo + 2], weight[wo + 3], weight[wo + 4], weight[wo + 5],
                        weight[wo + 6], weight[wo + 7]), scale, np.float32(0.5), shifted[0] - np.float32(0.5))
    best = neighbours[start + 1 + max(j, 0)]  # no finite sum: ik keeps the list's first
    for i in range(8):
        L[lo + i] = levels[best, i]
    return best, False


@njit(**NJIT)
def _fit3(a: np.float32, b: np.float32, c: np.float32, q: np.ndarray) -> np.float32:
    """a q0 + b q1 + c q2 as ik's build sums it: (a q0 + b q1) + c q2, the last product fused (a q0 is computed
    once per first cut point; b q1 is exact)."""
    return fmaf(c, q[2], a * q[0] + b * q[1])


@njit(**NJIT)
def _norm3(a: np.float32, b: np.float32, c: np.float32, q: np.ndarray, fused: bool) -> np.float32:
    """a q0^2 + b q1^2 + c q2^2, each term (w q) q, summed in the same order; ik's build fuses the last term for
    the shift -delta only (for +delta its products are shared with code in other branches)."""
    t = (a * q[0]) * q[0] + (b * q[1]) * q[1]
    return fmaf(c * q[2], q[2], t) if fused else t + (c * q[2]) * q[2]


@njit(**NJIT)
def _levels_of_split(order: np.ndarray, n: int, cut1: int, cut2: int, L: np.ndarray) -> None:
    for j in range(n):
        L[order[j]] = 0 if j < cut1 else (1 if j < cut2 else 2)


@njit(**NJIT)
def iq1s_best_split(sums: np.ndarray, n: int, marks: np.ndarray, every: bool,
                    scale: np.float32) -> tuple[np.float32, int, int, int]:
    """ik's scan of IQ1_S's splits, over every split (`every`) or over those marked (iq1_lanes.iq1s_contenders,
    which takes the same split): (scale, cut1, cut2, shift), cut1 -1 (and `scale` as given) where no split fits.
    sums: the prefix sums of w x and w over the sorted block."""
    sumx, sumw = sums[0], sums[1]
    best = -FLT_MIN
    cut1 = -1
    cut2 = -1
    shift = 0
    for i1 in range(n + 1):
        a = sumx[i1] - sumx[0]
        wa = sumw[i1] - sumw[0]
        todo = (np.int64(-1) << i1) & ((np.int64(2) << n) - 1) if every else marks[i1]
        while todo:
            i2 = lowest_bit(todo)
            todo &= todo - 1
            b = sumx[i2] - sumx[i1]
            c = sumx[n] - sumx[i2]
            wb = sumw[i2] - sumw[i1]
            wc = sumw[n] - sumw[i2]
            for s in (1, -1):
                q = SHIFT_PLUS if s == 1 else SHIFT_MINUS
                sqx = _fit3(a, b, c, q)
                sq2 = _norm3(wa, wb, wc, q, s == -1)
                if sq2 > 0 and sqx * sqx > best * sq2:
                    scale = sqx / sq2
                    best = scale * sqx
                    cut1, cut2, shift = i1, i2, s
    return scale, cut1, cut2, shift


@njit(**NJIT)
def iq1s_block(x: np.ndarray, o: int, weight: np.ndarray, grid: tuple, L: np.ndarray,  # type: ignore[type-arg]
               order: np.ndarray, sums: np.ndarray, index: np.ndarray,
               marks: np.ndarray) -> tuple[np.float32, int, bool]:
    """ik's iq1s_process_1block on the 32 values x[o:o+32], importances weight[:32]: (scale >= 0, shift +1 or -1,
    found), the 4 grid indices into index. found is False where ik aborts (no split fits)."""
    n = IQ1S_BLOCK
    mx = abs(x[o])
    for i in range(1, n):
        mx = max(mx, abs(x[o + i]))
    index[:] = 0
    if mx < GROUP_MAX_EPS_IQ1_S:
        return np.float32(0.0), 1, True
    stable_order(x[o : o + n], order)
    sumx, sumw = sums[0], sums[1]
    sumx[0] = 0
    sumw[0] = 0
    magnitude = np.float32(0.0)
    for j in range(n):
        i = order[j]
        sumx[j + 1] = fmaf(weight[i], x[o + i], sumx[j])
        sumw[j + 1] = sumw[j] + weight[i]
        magnitude += abs(weight[i] * x[o + i])
    bounded = sumw[n] <= SUM_W_MAX and magnitude <= SUM_WX_MAX  # so that no sum or score of a split overflows
    every = not (bounded and iq1s_contenders(sums, n, marks))
    scale, cut1, cut2, shift = iq1s_best_split(sums, n, marks, every, mx)
    if cut1 < 0:
        return np.float32(0.0), 1, False
    _levels_of_split(order, n, cut1, cut2, L)
    if scale < 0:
        for j in range(n):
            L[j] = 2 - L[j]
        scale = -scale
        shift = -shift
    shifted = SHIFT_PLUS if shift == 1 else SHIFT_MINUS
    on_grid = True
    for k in range(n // 8):
        g, hit = _grid_point(grid, x, o + 8 * k, weight, 8 * k, scale, shifted, L, 8 * k)
        index[k] = g
        on_grid &= hit
    if not on_grid:
        sumqx = np.float32(0.0)
        sumq2 = np.float32(0.0)
        for j in range(n):
            wq = weight[j] * shifted[L[j]]
            sumqx = fmaf(wq, x[o + j], sumqx)
            sumq2 = fmaf(wq, shifted[L[j]], sumq2)
        if sumqx > 0 and sumq2 > 0:
            scale = sumqx / sumq2
    return scale, shift, True


@njit(**NJIT)
def _combo(k: int, group: int) -> np.ndarray:
    """The shifted levels of group 0 or 1 under IQ1_M's shift combination k."""
    minus = k >= 2 if group == 0 else k % 2 == 1
    return SHIFT_MINUS if minus else SHIFT_PLUS


@njit(**NJIT)
def iq1m_best_split(sums: np.ndarray, n: int, marks: np.ndarray, every: bool) -> tuple[np.float32, int, int, int]:
    """ik's scan of IQ1_M's splits and shift combinations, over every split (`every`) or over those marked
    (iq1_lanes.iq1m_contenders): (scale, cut1, cut2, combination), the combination -1 where no split fits. sums:
    the prefix sums of w x and w of the block's first 8 values and of its second 8, over the sorted block."""
    sx1, sw1, sx2, sw2 = sums[0], sums[1], sums[2], sums[3]
    best = np.float32(0.0)
    scale = np.float32(0.0)
    cut1 = -1
    cut2 = -1
    combo = -1
    for i1 in range(n + 1):
        a1 = sx1[i1] - sx1[0]
        a2 = sx2[i1] - sx2[0]
        wa1 = sw1[i1] - sw1[0]
        wa2 = sw2[i1] - sw2[0]
        todo = (np.int64(-1) << i1) & ((np.int64(2) << n) - 1) if every else marks[i1]
        while todo:
            i2 = lowest_bit(todo)
            todo &= todo - 1
            b1 = sx1[i2] - sx1[i1]
            c1 = sx1[n] - sx1[i2]
            b2 = sx2[i2] - sx2[i1]
            c2 = sx2[n] - sx2[i2]
            wb1 = sw1[i2] - sw1[i1]
            wc1 = sw1[n] - sw1[i2]
            wb2 = sw2[i2] - sw2[i1]
            wc2 = sw2[n] - sw2[i2]
            for k in range(4):
                q1 = _combo(k, 0)
                q2 = _combo(k, 1)
                t = fmaf(c1, q1[2], fmaf(b1, q1[1], a1 * q1[0])) + a2 * q2[0]
                sqx = fmaf(c2, q2[2], fmaf(b2, q2[1], t))
                t = fmaf(wc1 * q1[2], q1[2], fmaf(wb1 * q1[1], q1[1], (wa1 * q1[0]) * q1[0])) + (wa2 * q2[0]) * q2[0]
                sq2 = fmaf(wc2 * q2[2], q2[2], fmaf(wb2 * q2[1], q2[1], t))
                if sq2 > 0 and sqx * sqx > best * sq2:
                    scale = sqx / sq2
                    best = scale * sqx
                    cut1, cut2, combo = i1, i2, k
    return scale, cut1, cut2, combo


@njit(**NJIT)
def iq1m_block(x: np.ndarray, o: int, weight: np.ndarray, wo: int, grid: tuple, L: np.ndarray,  # type: ignore[type-arg]
               order: np.ndarray, sums: np.ndarray, index: np.ndarray, io: int,
               marks: np.ndarray) -> tuple[np.float32, int, bool]:
    """ik's iq1m_process_1block on the 16 values x[o:o+16], importances weight[wo:wo+16]: (scale, shift combination
    0..3, found), the 2 grid indices into index[io:io+2]. found is False where ik aborts (no split fits)."""
    n = IQ1M_BLOCK
    stable_order(x[o : o + n], order)
    sx1, sw1, sx2, sw2 = sums[0], sums[1], sums[2], sums[3]
    sx1[0] = sw1[0] = sx2[0] = sw2[0] = 0
    magnitude = np.float32(0.0)
    for j in range(n):  # ik's build rounds w x here (unlike IQ1_S's prefix sums, which it fuses)
        i = order[j]
        w = weight[wo + i]
        wx = w * x[o + i]
        first = i < n // 2
        sx1[j + 1] = sx1[j] + wx if first else sx1[j]
        sw1[j + 1] = sw1[j] + w if first else sw1[j]
        sx2[j + 1] = sx2[j] if first else sx2[j] + wx
        sw2[j + 1] = sw2[j] if first else sw2[j] + w
        magnitude += abs(wx)
    bounded = sw1[n] + sw2[n] <= SUM_W_MAX and magnitude <= SUM_WX_MAX  # so that no sum or score overflows
    every = not (bounded and iq1m_contenders(sums, n, marks))
    scale, cut1, cut2, combo = iq1m_best_split(sums, n, marks, every)
    if combo < 0:
        return np.float32(0.0), 0, False
    _levels_of_split(order, n, cut1, cut2, L)
    if scale < 0:
        for j in range(n):
            L[j] = 2 - L[j]
        scale = -scale
        combo = 3 - combo
    on_grid = True
    for k in range(n // 8):
        g, hit = _grid_point(grid, x, o + 8 * k, weight, wo + 8 * k, scale, _combo(combo, k), L, 8 * k)
        index[io + k] = g
        on_grid &= hit
    if not on_grid:
        sqx = np.zeros(4, np.float32)
        sq2 = np.zeros(4, np.float32)
        for j in range(n):  # each product serves two sums: ik's build rounds it and adds
            w = weight[wo + j]
            wx = w * x[o + j]
            qp = SHIFT_PLUS[L[j]]
            qm = SHIFT_MINUS[L[j]]
            xp, xm = wx * qp, wx * qm
            np2, nm2 = (w * qp) * qp, (w * qm) * qm
            mixed = 1 if j < n // 2 else 2  # the combination in which this value's shift is +
            sqx[0] += xp
            sq2[0] += np2
            sqx[mixed] += xp
            sq2[mixed] += np2
            sqx[3] += xm
            sq2[3] += nm2
            sqx[3 - mixed] += xm
            sq2[3 - mixed] += nm2
        best = np.float32(0.0)
        for k in range(4):
            if sqx[k] > 0 and sq2[k] > 0 and sqx[k] * sqx[k] > best * sq2[k]:
                scale = sqx[k] / sq2[k]
                best = scale * sqx[k]
                combo = k
    return scale, combo, True


@njit(**NJIT)
def sum_squares(x: np.ndarray, o: int, n: int, fused: bool) -> np.float32:
    """sum of x^2 over x[o:o+n] in order; GCC vectorizes the squares of some of these loops (each rounded, then
    added in order) and fuses the others."""
    s = np.float32(0.0)
    for i in range(n):
        s = fmaf(x[o + i], x[o + i], s) if fused else s + x[o + i] * x[o + i]
    return s


@njit(**NJIT)
def _store_u16(blk: np.ndarray, pos: int, v: int) -> None:
    blk[pos] = v & 0xFF
    blk[pos + 1] = (v >> 8) & 0xFF


@njit(**NJIT)
def scale_code(id_: np.float32, scale: np.float32) -> int:
    """A block scale's 3-bit code: nearest((id scale - 1) / 2) clamped to 0..7."""
    return max(0, min(7, nearest_int(np.float32(0.5) * fmaf(id_, scale, np.float32(-1.0)))))


@njit(**KERNEL)
def quantize_iq1_s(x: np.ndarray, qw: np.ndarray, out: np.ndarray, grid: tuple) -> None:  # type: ignore[type-arg]
    """IQ1_S rows; qw empty: unit importance (ik's quantize_row_iq1_s_ref)."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        weight, L, order, sums, index, marks = scratch()
        scales = np.zeros(QK_K // IQ1S_BLOCK, np.float32)
        shifts = np.zeros(QK_K // IQ1S_BLOCK, np.int64)
        xr = x[r]
        for ibl in range(n // QK_K):
            blk = out[r, ibl * IQ1_S_BYTES : (ibl + 1) * IQ1_S_BYTES]
            blk[:] = 0
            xo = ibl * QK_K
            sigma2 = np.float32(2.0) * sum_squares(xr, xo, QK_K, False) / np.float32(QK_K)
            max_scale = np.float32(0.0)
            aborted = False
            for ib in range(QK_K // IQ1S_BLOCK):
                o = xo + IQ1S_BLOCK * ib
                for i in range(IQ1S_BLOCK):
                    root = np.sqrt(fmaf(xr[o + i], xr[o + i], sigma2))
                    weight[i] = qw[o + i] * root if qw.size else root
                scale, shift, found = iq1s_block(xr, o, weight, grid, L, order, sums, index, marks)
                aborted |= not found
                h = 0
                for k in range(4):
                    blk[2 + 4 * ib + k] = index[k] & 255
                    h |= (index[k] >> 8) << (3 * k)
                _store_u16(blk, 34 + 2 * ib, h)
                scales[ib] = scale
                shifts[ib] = shift
                max_scale = max(max_scale, scale)
            if aborted:
                _store_u16(blk, 0, NAN_F16)
                continue
            if max_scale == 0:
                continue
            d = max_scale / np.float32(15.0)
            store_f16(blk, 0, d * np.float32(1.125))
            id_ = np.float32(1.0) / d
            for ib in range(QK_K // IQ1S_BLOCK):
                code = scale_code(id_, scales[ib]) | (8 if shifts[ib] == -1 else 0)
                blk[35 + 2 * ib] |= code << 4


@njit(**NJIT)
def _iq1m_weights(xr: np.ndarray, o: int, qw: np.ndarray, sigma2: np.float32, weight: np.ndarray) -> None:
    """IQ1_M's importances of the 16 values at o: qw sqrt(sigma2 + x^2), or x^2 without an importance vector."""
    for i in range(IQ1M_BLOCK):
        v = xr[o + i]
        weight[i] = qw[o + i] * np.sqrt(fmaf(v, v, sigma2)) if qw.size else v * v


@njit(**NJIT)
def _iq1m_sigma2(xr: np.ndarray, xo: int, sigma2: np.ndarray) -> None:
    for ib in range(QK_K // 32):
        sigma2[ib] = np.float32(1.5) * sum_squares(xr, xo + 32 * ib, 32, False) / np.float32(32.0)


@njit(**KERNEL)
def search_iq1_m(x: np.ndarray, qw: np.ndarray, out: np.ndarray, grid: tuple, scales: np.ndarray,  # type: ignore[type-arg]
                 shifts: np.ndarray, max_scales: np.ndarray) -> None:
    """IQ1_M's first pass: every 16-value block's grid indices (into out), scale and shift combination (NO_SHIFT
    below the threshold), and each super-block's largest scale (NaN where ik aborts)."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        weight, L, order, sums, index, marks = scratch()
        sigma2 = np.zeros(QK_K // 32, np.float32)
        xr = x[r]
        for ibl in range(n // QK_K):
            blk = out[r, ibl * IQ1_M_BYTES : (ibl + 1) * IQ1_M_BYTES]
            blk[:] = 0
            xo = ibl * QK_K
            _iq1m_sigma2(xr, xo, sigma2)
            max_scale = np.float32(0.0)
            aborted = False
            for ib in range(QK_K // IQ1M_BLOCK):
                o = xo + IQ1M_BLOCK * ib
                _iq1m_weights(xr, o, qw, sigma2[ib // 2], weight)
                mx = abs(xr[o])
                sumwx = np.float32(0.0)
                for i in range(1, IQ1M_BLOCK):
                    ax = abs(xr[o + i])
                    mx = max(mx, ax)
                    sumwx = fmaf(weight[i], ax, sumwx)
                scales[r, ibl, ib] = 0
                shifts[r, ibl, ib] = NO_SHIFT
                if mx < GROUP_MAX_EPS_IQ1_M:
                    continue
                if sumwx == 0:
                    _iq1m_weights(xr, o, np.empty(0, np.float32), sigma2[0], weight)
                scale, combo, found = iq1m_block(xr, o, weight, 0, grid, L, order, sums, index, 0, marks)
                aborted |= not found
                blk[2 * ib] = index[0] & 255
                blk[2 * ib + 1] = index[1] & 255
                blk[32 + ib] = (index[0] >> 8) | ((index[1] >> 8) << 4)
                scales[r, ibl, ib] = scale
                shifts[r, ibl, ib] = combo
                max_scale = max(max_scale, scale)
            max_scales[r, ibl] = np.float32(np.nan) if aborted else max_scale


@njit(cache=True, nogil=True)
def carry_shifts(shifts: np.ndarray) -> None:
    """Give each NO_SHIFT entry of shifts [..., positions] the value its position held last, in the order of the
    leading axes (ik's shift variables reused from block to block; 0 before any). Negative entries other than
    NO_SHIFT are blocks that neither store nor set a shift."""
    flat = shifts.reshape(-1, shifts.shape[-1])
    for p in range(flat.shape[1]):
        carry = 0
        for i in range(flat.shape[0]):
            if flat[i, p] == NO_SHIFT:
                flat[i, p] = carry
            elif flat[i, p] >= 0:
                carry = flat[i, p]


@njit(**NJIT)
def _store_iq1m_scales(blk: np.ndarray, codes: np.ndarray, d_bits: int) -> None:
    """The 4 u16 at 48: the 3-bit scale codes of 4 blocks each in bits 0-11, a nibble of d's f16 bits on top."""
    for t in range(4):
        v = codes[4 * t] | (codes[4 * t + 1] << 3) | (codes[4 * t + 2] << 6) | (codes[4 * t + 3] << 9)
        _store_u16(blk, 48 + 2 * t, v | (((d_bits >> (4 * t)) & 15) << 12))


@njit(**KERNEL)
def finish_iq1_m(x: np.ndarray, qw: np.ndarray, out: np.ndarray, grid: tuple, scales: np.ndarray,  # type: ignore[type-arg]
                 shifts: np.ndarray, max_scales: np.ndarray) -> None:
    """IQ1_M's second pass: the 3-bit scales, the shift bits and d, refitted over the super-block's decoded
    levels."""
    levels = grid[2]
    n_rows, n = x.shape
    for r in prange(n_rows):
        weight = np.empty(IQ1M_BLOCK, np.float32)
        sigma2 = np.zeros(QK_K // 32, np.float32)
        codes = np.zeros(QK_K // IQ1M_BLOCK, np.int64)
        xr = x[r]
        for ibl in range(n // QK_K):
            blk = out[r, ibl * IQ1_M_BYTES : (ibl + 1) * IQ1_M_BYTES]
            max_scale = max_scales[r, ibl]
            if max_scale != max_scale:
                codes[:] = 0
                _store_iq1m_scales(blk, codes, NAN_F16)
                continue
            if max_scale == 0:
                continue
            xo = ibl * QK_K
            _iq1m_sigma2(xr, xo, sigma2)
            d = max_scale / np.float32(15.0)
            id_ = np.float32(1.0) / d
            sumqx = np.float32(0.0)
            sumq2 = np.float32(0.0)
            for ib in range(QK_K // IQ1M_BLOCK):
                codes[ib] = scale_code(id_, scales[r, ibl, ib])
                combo = shifts[r, ibl, ib]
                blk[32 + ib] |= IQ1M_SHIFT_MASKS[combo]
                o = xo + IQ1M_BLOCK * ib
                _iq1m_weights(xr, o, qw, sigma2[ib // 2], weight)
                mult = np.float32(2 * codes[ib] + 1)
                for k in range(2):
                    shifted = _combo(combo, k)
                    g = np.int64(blk[2 * ib + k]) | ((np.int64(blk[32 + ib]) << (8 - 4 * k)) & 0x700)
                    for j in range(8):
                        w = weight[8 * k + j]
                        q = shifted[levels[g, j]] * mult
                        sumqx = fmaf(w * q, xr[o + 8 * k + j], sumqx)
                        sumq2 = fmaf(w * q, q, sumq2)
            if sumq2 > 0:
                d = sumqx / sumq2
            _store_iq1m_scales(blk, codes, f32_to_f16_bits(d * np.float32(1.085)))


def quantize_iq1_m(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """IQ1_M rows (qw empty: importance x^2): the parallel search, ik's shift carry-over, the parallel finish."""
    n_rows, n = x.shape
    scales = np.empty((n_rows, n // QK_K, QK_K // IQ1M_BLOCK), np.float32)
    shifts = np.empty((n_rows, n // QK_K, QK_K // IQ1M_BLOCK), np.int64)
    max_scales = np.empty((n_rows, n // QK_K), np.float32)
    search_iq1_m(x, qw, out, iq1_grid(), scales, shifts, max_scales)
    carry_shifts(shifts)
    finish_iq1_m(x, qw, out, iq1_grid(), scales, shifts, max_scales)
