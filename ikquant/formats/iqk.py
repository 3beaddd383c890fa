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
from ikquant.formats.iqk_grids import (
    IQ2NL,
    IQ3NL,
    IQ4K,
    IQ5NL,
    IQ6NL,
    grid,
    grid_search,
    importance,
    iqk_qx_quants,
    keep_better,
    nearest,
    nearest_iq2,
    sum_squares,
)
from ikquant.formats.numeric import abs_max, fmaf, load_f16, nearest_int_fma, store_f16
from ikquant.formats.ordering import stable_order

QK_K = 256
NJIT = dict(cache=True, nogil=True, error_model="numpy")
KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")
F = np.float32

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
def _refit(kind: int, base: int, xb: np.ndarray, wb: np.ndarray, d: np.float32) -> np.float32:
    """Least-squares scale for the codes that rounding x/d gives (ik refines each sub-block scale once)."""
    values = grid(kind)[0]
    inv = F(1.0) / d
    sqx = F(0.0)
    sq2 = F(0.0)
    for j in range(16):
        x = xb[j]
        q = values[base + nearest(kind, base, inv * x)]
        wq = wb[j] * q
        sqx = fmaf(wq, x, sqx)
        sq2 = fmaf(wq, q, sq2)
    if sq2 > 0:
        return sqx / sq2
    return d


# ------------------------------------------------------------------------------------------------------------ IQ2_K


#: IQ2_K's grids: plain -31, -13, 1, 17 and shifted -26, -8, 6, 22
_V0, _V1, _V3 = F(-31.0), F(-13.0), F(17.0)
_S0, _S1, _S2, _S3 = F(-26.0), F(-8.0), F(6.0), F(22.0)


@njit(inline="always", **NJIT)
def _split_fits(i3: int, sumw: np.ndarray, sumx: np.ndarray, swi2: np.float32, sxi2: np.float32, tw: np.float32,
                tx: np.float32, w1: np.float32, x1: np.float32, w2: np.float32, x2: np.float32, w3: np.float32,
                x3: np.float32, w4: np.float32, x4: np.float32
                ) -> tuple[np.float32, np.float32, np.float32, np.float32, np.float32, np.float32, np.float32,
                           np.float32]:
    """(sum w q^2, sum w q x) of the split whose last two runs start at i2 and i3, for the plain grid, the shifted
    one, the plain reversed and the shifted reversed (w1..x4: the first two runs' sums of each)."""
    cw = sumw[i3] - swi2
    ew = tw - sumw[i3]
    cx = sumx[i3] - sxi2
    ex = tx - sumx[i3]
    return (fmaf(ew * _V3, _V3, w1 + cw), fmaf(ex, _V3, x1 + cx),
            fmaf(ew * _S3, _S3, fmaf(cw * _S2, _S2, w2)), fmaf(ex, _S3, fmaf(cx, _S2, x2)),
            fmaf(ew * _V0, _V0, fmaf(cw * _V1, _V1, w3)), fmaf(ex, _V0, fmaf(cx, _V1, x3)),
            fmaf(ew * _S0, _S0, fmaf(cw * _S1, _S1, w4)), fmaf(ex, _S0, fmaf(cx, _S1, x4)))


@njit(inline="always", **NJIT)
def _beats(sq2: np.float32, sqx: np.float32, best: np.float32) -> np.bool_:
    """keep_better's test, without a branch."""
    return (sq2 > 0) & (sqx * sqx > best * sq2)


@njit(**NJIT)
def _any_better(sumw: np.ndarray, sumx: np.ndarray, i2: int, swi2: np.float32, sxi2: np.float32, tw: np.float32,
                tx: np.float32, w1: np.float32, x1: np.float32, w2: np.float32, x2: np.float32, w3: np.float32,
                x3: np.float32, w4: np.float32, x4: np.float32, best: np.float32) -> bool:
    """Whether any split i3 >= i2 of _iq2k_search's innermost loop beats `best`, computed with the loop's own
    arithmetic (_split_fits) eight splits at a time (fixed lanes, those below i2 masked). While none does, best
    does not change inside the loop, so the loop can be skipped; when one does, the loop runs as before, in order."""
    hit = False
    for first in range(0 if i2 < 8 else 8, 16, 8):
        for lane in range(8):
            i3 = first + lane
            q1, p1, q2, p2, q3, p3, q4, p4 = _split_fits(i3, sumw, sumx, swi2, sxi2, tw, tx, w1, x1, w2, x2, w3, x3,
                                                         w4, x4)
            better = _beats(q1, p1, best) | _beats(q2, p2, best) | _beats(q3, p3, best) | _beats(q4, p4, best)
            hit |= better & (i3 >= i2)
    return hit


@njit(**NJIT)
def _iq2k_search(xb: np.ndarray, wb: np.ndarray, order: np.ndarray, sumx: np.ndarray, sumw: np.ndarray
                 ) -> tuple[np.float32, bool]:
    """IQ2_K's exhaustive sub-block fit: every split of the sorted values into four runs, on each grid, both ways up.

    Prefix sums over the values sorted by (x, index) make each split O(1). The four-term sums are written in the
    order and with the fusing of ik's build: the first product is fused into the second, then each further
    product is fused into the running sum (a grid entry of 1 makes its term a plain add).
    """
    stable_order(xb, order)
    sumw[0] = F(0.0)
    sumx[0] = F(0.0)
    for j in range(16):
        jj = order[j]
        sumw[j + 1] = sumw[j] + wb[jj]
        sumx[j + 1] = fmaf(wb[jj], xb[jj], sumx[j])
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
            w1 = fmaf(aw * _V0, _V0, (bw * _V1) * _V1)
            x1 = fmaf(ax, _V0, bx * _V1)
            w2 = fmaf(aw * _S0, _S0, (bw * _S1) * _S1)
            x2 = fmaf(ax, _S0, bx * _S1)
            w3 = fmaf(aw * _V3, _V3, bw)
            x3 = fmaf(ax, _V3, bx)
            w4 = fmaf(aw * _S3, _S3, (bw * _S2) * _S2)
            x4 = fmaf(ax, _S3, bx * _S2)
            swi2 = sumw[i2]
            sxi2 = sumx[i2]
            if not _any_better(sumw, sumx, i2, swi2, sxi2, tw, tx, w1, x1, w2, x2, w3, x3, w4, x4, best):
                continue
            for i3 in range(i2, 16):
                q1, p1, q2, p2, q3, p3, q4, p4 = _split_fits(i3, sumw, sumx, swi2, sxi2, tw, tx, w1, x1, w2, x2, w3,
                                                             x3, w4, x4)
                for sq2, sqx, on_shifted in ((q1, p1, False), (q2, p2, True), (q3, p3, False), (q4, p4, True)):
                    d, best, better = keep_better(sqx, sq2, d, best)
                    if better:
                        shifted = on_shifted
    return d, shifted


@njit(**KERNEL)
def _quantize_iq2_k(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    weighted = qw.size > 0
    for r in prange(n_rows):
        xr = x[r]
        o = out[r]
        rw = np.empty(n if weighted else 0, dtype=np.float32)
        if weighted:
            importance(qw, xr, 16, rw)
        weight = np.empty(QK_K, dtype=np.float32)
        scales = np.empty(16, dtype=np.float32)
        sw = np.empty(16, dtype=np.float32)
        Ls = np.empty(16, dtype=np.int64)
        order = np.empty(16, dtype=np.int64)
        sumx = np.empty(17, dtype=np.float32)
        sumw = np.empty(17, dtype=np.float32)
        for ibl in range(n // QK_K):
            xbl = xr[ibl * QK_K : (ibl + 1) * QK_K]
            ob = o[ibl * 76 : (ibl + 1) * 76]
            ob[:] = 0
            sigma2 = F(1.5) * sum_squares(xbl) / F(QK_K)
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
                if abs_max(xb)[0] < F(1e-16):
                    scales[ib] = F(0.0)
                    continue
                d, shifted = _iq2k_search(xb, wb, order, sumx, sumw)
                scales[ib] = d
                if shifted:
                    extra |= 1 << ib
                max_abs_scale = max(max_abs_scale, abs(d))
            if max_abs_scale == 0:
                continue
            d = iqk_qx_quants(scales, sw, 8, Ls)
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
                    k = nearest_iq2(base, idl * xv)
                    ob[qpos + j] |= np.uint8(k << shift)
                    q = F(np.int64(IQ2NL[base + k]) * ls)
                    wq = weight[16 * ib + j] * q
                    sumqx = fmaf(wq, xv, sumqx)
                    sumq2 = fmaf(wq, q, sumq2)
            store_f16(ob, 0, F(1.03) * (sumqx / sumq2 if sumq2 > 0 else d))


@njit(**KERNEL)
def _dequantize_iq2_k(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        qr = q[r]
        y = out[r]
        lut = np.empty(4, dtype=np.float32)
        for ibl in range(n // QK_K):
            o = 76 * ibl
            d = load_f16(qr, o)
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
            importance(qw, xr, 16, rw)
        weight = np.empty(QK_K, dtype=np.float32)
        scales = np.empty(16, dtype=np.float32)
        for ibl in range(n // QK_K):
            xbl = xr[ibl * QK_K : (ibl + 1) * QK_K]
            ob = o[ibl * 110 : (ibl + 1) * 110]
            ob[:] = 0
            sigma2 = F(1.5) * sum_squares(xbl) / F(QK_K)
            _block_weights(xbl, rw[ibl * QK_K : (ibl + 1) * QK_K], weighted, sigma2, F(0.25) * sigma2, weight)
            extra = 0
            max_abs_scale = F(0.0)
            for ib in range(16):
                xb = xbl[16 * ib : 16 * ib + 16]
                wb = weight[16 * ib : 16 * ib + 16]
                amax, vmax = abs_max(xb)
                if amax < F(1e-16):
                    scales[ib] = F(0.0)
                    continue
                d, shifted = grid_search(3, xb, wb, vmax, 3, 2, True)
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
                    k = nearest(3, base, idl * xv)
                    ob[qpos + j] |= np.uint8((k & 3) << (2 * (ib32 % 4)))
                    ob[hpos + j] |= np.uint8((k >> 2) << ib32)
                    q = F(np.int64(IQ3NL[base + k]) * ls)
                    wq = weight[16 * ib + j] * q
                    sumqx = fmaf(wq, xv, sumqx)
                    sumq2 = fmaf(wq, q, sumq2)
            store_f16(ob, 0, F(1.01) * (sumqx / sumq2 if sumq2 > 0 else d))


@njit(**KERNEL)
def _dequantize_iq3_k(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        qr = q[r]
        y = out[r]
        lut = np.empty(8, dtype=np.float32)
        for ibl in range(n // QK_K):
            o = 110 * ibl
            d = load_f16(qr, o)
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
            importance(qw, xr, 16, rw)
        weight = np.empty(QK_K, dtype=np.float32)
        scales = np.empty(16, dtype=np.float32)
        codes = np.empty(QK_K, dtype=np.uint8)
        for ibl in range(n // QK_K):
            xbl = xr[ibl * QK_K : (ibl + 1) * QK_K]
            ob = o[ibl * 144 : (ibl + 1) * 144]
            ob[:] = 0
            sigma2 = sum_squares(xbl) * F(2.0 / QK_K)
            # without importances IQ4_K weighs by x^2 alone
            _block_weights(xbl, rw[ibl * QK_K : (ibl + 1) * QK_K], weighted, sigma2, F(0.0), weight)
            extra = 0
            max_scale = F(0.0)
            amax_scale = F(0.0)
            for ib in range(16):
                xb = xbl[16 * ib : 16 * ib + 16]
                amax, vmax = abs_max(xb)
                if amax < F(1e-16):
                    scales[ib] = F(0.0)
                    continue
                d, shifted = grid_search(4, xb, weight[16 * ib : 16 * ib + 16], vmax, 7, 1, False)
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
                    k = nearest(4, base, idl * xv)
                    codes[16 * ib + j] = k
                    q = F(np.int64(IQ4K[base + k]) * ls)
                    wq = weight[16 * ib + j] * q
                    sumqx = fmaf(wq, xv, sumqx)
                    sumq2 = fmaf(wq, q, sumq2)
                ls += 32
                ob[8 + ib // 2] |= np.uint8((ls & 15) << (4 * (ib % 2)))
                ob[4 + ib // 4] |= np.uint8((ls >> 4) << (2 * (ib % 4)))
            store_f16(ob, 0, sumqx / sumq2 if sumq2 > 0 else d)
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
            d = load_f16(qr, o)
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
    n = grid(kind)[3]  # entries per grid half: where the shifted half starts
    extra = 0
    max_scale = F(0.0)
    max_abs_scale = F(0.0)
    for ib in range(16):
        xb = xbl[16 * ib : 16 * ib + 16]
        wb = weight[16 * ib : 16 * ib + 16]
        amax, vmax = abs_max(xb)
        if amax < F(1e-16):
            scales[ib] = F(0.0)
            continue
        d, shifted = grid_search(kind, xb, wb, vmax, 5, 1, False)
        if d != 0:
            d = _refit(kind, n if shifted else 0, xb, wb, d)
        scales[ib] = d
        if shifted:
            extra |= 1 << ib
        if abs(d) > max_abs_scale:
            max_abs_scale = abs(d)
            max_scale = d
    return extra, max_scale


@njit(**KERNEL)
def _quantize_iq56_k(x: np.ndarray, qw: np.ndarray, out: np.ndarray, kind: int) -> None:
    """IQ5_K (kind 5) or IQ6_K (kind 6): the same search and refit; IQ6_K has 8-bit sub-block scales and 6-bit codes."""
    n_rows, n = x.shape
    weighted = qw.size > 0
    nbytes = 212 if kind == 6 else 176
    lmin, lmax = (-127, 127) if kind == 6 else (-32, 31)
    values = IQ6NL if kind == 6 else IQ5NL
    for r in prange(n_rows):
        xr = x[r]
        o = out[r]
        rw = np.empty(n if weighted else 0, dtype=np.float32)
        if weighted:
            importance(qw, xr, 16, rw)
        weight = np.empty(QK_K, dtype=np.float32)
        scales = np.empty(16, dtype=np.float32)
        for ibl in range(n // QK_K):
            xbl = xr[ibl * QK_K : (ibl + 1) * QK_K]
            ob = o[ibl * nbytes : (ibl + 1) * nbytes]
            ob[:] = 0
            sigma2 = F(2.0) * sum_squares(xbl) / F(QK_K)
            _block_weights(xbl, rw[ibl * QK_K : (ibl + 1) * QK_K], weighted, sigma2, F(0.25) * sigma2, weight)
            # a literal grid number lets Numba specialise the search (see iqk_grids)
            if kind == 6:
                extra, max_scale = _search_iq56(6, xbl, weight, scales)
            else:
                extra, max_scale = _search_iq56(5, xbl, weight, scales)
            if max_scale == 0:
                continue
            d = -max_scale / F(-lmin)
            store_f16(ob, 0, d)
            ob[2] = extra & 0xFF
            ob[3] = extra >> 8
            inv = F(1.0) / d
            sumqx = F(0.0)
            sumq2 = F(0.0)
            for ib in range(16):
                ls = min(lmax, max(lmin, nearest_int_fma(inv, scales[ib])))
                if kind == 6:
                    ob[4 + ib] = np.uint8(ls & 0xFF)
                else:
                    ob[8 + ib // 2] |= np.uint8(((ls + 32) & 15) << (4 * (ib % 2)))
                    ob[4 + ib // 4] |= np.uint8(((ls + 32) >> 4) << (2 * (ib % 4)))
                dl = d * F(ls)
                if dl == 0:
                    continue
                base = values.size // 2 if (extra >> ib) & 1 else 0
                idl = F(1.0) / dl
                ib32 = ib // 2
                if kind == 6:
                    qpos = 20 + 32 * (ib32 // 2) + 16 * (ib % 2)
                    hpos = 148 + 32 * (ib32 // 4) + 16 * (ib % 2)
                    hshift = 2 * (ib32 % 4)
                else:
                    qpos = 16 + 32 * (ib32 // 2) + 16 * (ib % 2)
                    hpos = 144 + 16 * (ib % 2)
                    hshift = ib32
                for j in range(16):
                    xv = xbl[16 * ib + j]
                    k = nearest(6, base, idl * xv) if kind == 6 else nearest(5, base, idl * xv)
                    ob[qpos + j] |= np.uint8((k & 15) << (4 * (ib32 % 2)))
                    ob[hpos + j] |= np.uint8((k >> 4) << hshift)
                    q = values[base + k] * F(ls)
                    wq = weight[16 * ib + j] * q
                    sumqx = fmaf(wq, xv, sumqx)
                    sumq2 = fmaf(wq, q, sumq2)
            if sumq2 > 0:
                store_f16(ob, 0, sumqx / sumq2)


@njit(**KERNEL)
def _dequantize_iq5_k(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        qr = q[r]
        y = out[r]
        lut = np.empty(32, dtype=np.float32)
        for ibl in range(n // QK_K):
            o = 176 * ibl
            d = load_f16(qr, o)
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
def _dequantize_iq6_k(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        qr = q[r]
        y = out[r]
        for ibl in range(n // QK_K):
            o = 212 * ibl
            d = load_f16(qr, o)
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


class IQ2_KCodec(Codec, type_name="IQ2_K"):
    block_scale_f16 = 0
    max_abs_input = _search_limit(31, 1.5)
    rel_error_bound = _error_bound(IQ2NL)
    # codes are grid (|v| <= 31) times a sub-block scale in [-8, 7], and d is stored 3 % larger
    abs_error_floor = _error_floor(256)

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq2_k(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq2_k(q, out)


class IQ3_KCodec(Codec, type_name="IQ3_K"):
    block_scale_f16 = 0
    max_abs_input = _search_limit(63, 1.5)
    rel_error_bound = _error_bound(IQ3NL)
    # grid |v| <= 63 times an odd sub-block scale |2n + 1| <= 31
    abs_error_floor = _error_floor(63 * 31)

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq3_k(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq3_k(q, out)


class IQ4_KCodec(Codec, type_name="IQ4_K"):
    block_scale_f16 = 0
    # without importances IQ4_K weighs by x^2 alone
    max_abs_input = _search_limit(127, 1.0)
    rel_error_bound = _error_bound(IQ4K)
    abs_error_floor = _error_floor(127 * 32)

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq4_k(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq4_k(q, out)


class IQ5_KCodec(Codec, type_name="IQ5_K"):
    block_scale_f16 = 0
    max_abs_input = _search_limit(126, 1.5)
    rel_error_bound = _error_bound(IQ5NL)
    abs_error_floor = _error_floor(126 * 32)

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq56_k(x, w, out, 5)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq5_k(q, out)


class IQ6_KCodec(Codec, type_name="IQ6_K"):
    block_scale_f16 = 0
    max_abs_input = _search_limit(127, 1.5)
    # the decoder's cubic strays from the quantizer's integer grid by up to 0.49
    rel_error_bound = _error_bound(IQ6NL, 0.49)
    abs_error_floor = _error_floor(127 * 127)

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq56_k(x, w, out, 6)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq6_k(q, out)

