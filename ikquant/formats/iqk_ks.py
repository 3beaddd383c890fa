"""ik_llama.cpp's row-scaled IQK types: IQ2_KS, IQ2_KL, IQ3_KS, IQ4_KS, IQ4_KSS, IQ5_KS.

Each row starts with one row scale (f16 for IQ2_KS/IQ2_KL/IQ3_KS, f32 for the others) followed by 256-value
blocks of 32-value sub-blocks. Every sub-block stores a small integer scale relative to the row scale and, for
most types, a bit that picks one of two shifted non-linear value grids.

The quantizers follow ik's two passes per row: first an importance-weighted search for each sub-block's best
float scale (and grid), then one row scale from the largest of those, integer sub-block scales relative to it,
a final choice of codes, and a least-squares refit of the row scale. IQ2_KS has two first-pass searches in ik,
an exhaustive scalar one and a faster AVX2 one; llama-quantize runs the AVX2 one, so it is the default here and
the scalar one is selected through `with_user_data`.

Multiply-adds are fused exactly where ik's GCC build fuses them (read off its assembly): a product feeding an add
becomes one FMA, and in a sum of several products only the first product is fused into the add that follows it.
With that, every golden case and every random row tried against ik's library gives identical bytes.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.base import Codec
from ikquant.formats.grid_lookup import scaled_nibbles
from ikquant.formats.iq2ks_lanes import iq2ks_trial_sums
from ikquant.formats.iq4kss_lanes import iq4kss_lane_sums
from ikquant.formats.iqk_grids import (
    IQ2NL,
    IQ2NL_VALUES,
    IQ3NL,
    IQ4_SLOT_HIGH,
    IQ4_SLOT_LOW,
    IQ4K,
    IQ5NL,
    grid_search,
    importance,
    iqk_qx_quants,
    keep_better,
    nearest,
    nearest_iq2,
    nearest_plain_iq3,
    slot_values,
    sum_squares,
)
from ikquant.formats.numeric import abs_max, fmaf, load_f16, load_f32, nearest_int_fma, store_f16, store_f32
from ikquant.formats.ordering import stable_order
from ikquant.formats.vector_ir import whole_vectors

NJIT = dict(cache=True, nogil=True, error_model="numpy")
KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")
QK = 256
SUB = 32

# ---------------------------------------------------------------------------------------------------------------
# IQ2_KL: 32 value pairs, each u16 packing two int8 (low byte first), all drawn from the plain IQ3 grid.
IQ2KL_VALUES = np.array(
    [0xe9c1, 0x0dc1, 0xc1d8, 0xf6d8, 0x0dd8, 0x2fd8, 0xd8e9, 0xe9e9, 0x01e9, 0x0de9, 0x1ce9, 0xc1f6, 0x01f6, 0x0df6,
     0x2ff6, 0xe901, 0xf601, 0x0101, 0x0d01, 0x1c01, 0xd80d, 0xe90d, 0xf60d, 0x010d, 0x0d0d, 0xc11c, 0xe91c, 0x011c,
     0x1c1c, 0x2f1c, 0xe92f, 0x0d2f], dtype=np.uint16)  # fmt: skip
IQ2KL_PAIRS = IQ2KL_VALUES.view(np.int8).reshape(32, 2).copy()

# IQ2_KL's search (iqk_quantize.cpp): which pair an (i1, i2) grid-index combination maps to (>= 0), or -(list+1)
# of the 8 candidate pairs to score when the combination itself is not a stored pair.
IQ2KL_INDEX = np.array(
    [-1, -2, 0, -3, -4, 1, -5, -6, 2, -7, -8, 3, -9, 4, -10, 5, -11, 6, 7, -12, 8, 9, 10, -13, 11, -14, -15, -16,
     12, 13, -17, 14, -18, -19, 15, 16, 17, 18, 19, -20, -21, 20, 21, 22, 23, 24, -22, -23, 25, -24, 26, -25, 27,
     -26, 28, 29, -27, -28, 30, -29, -30, 31, -31, -32], dtype=np.int8)  # fmt: skip
IQ2KL_NEIGHBOURS = np.array(
    [[2, 0, 6, 11, 7, 3, 8, 15], [0, 2, 3, 6, 7, 1, 8, 4], [0, 1, 3, 4, 8, 7, 9, 6], [1, 0, 3, 4, 8, 9, 7, 10],
     [1, 4, 5, 10, 9, 3, 8, 0], [5, 1, 4, 10, 9, 14, 8, 3], [6, 2, 7, 0, 3, 11, 8, 15], [3, 7, 0, 6, 8, 4, 12, 9],
     [3, 4, 8, 9, 1, 7, 12, 10], [4, 10, 5, 9, 1, 8, 13, 14], [11, 2, 6, 7, 20, 15, 25, 21],
     [8, 7, 3, 12, 9, 16, 17, 13], [14, 5, 10, 19, 9, 13, 4, 18], [6, 15, 7, 11, 20, 21, 16, 2],
     [15, 7, 16, 6, 21, 12, 17, 22], [12, 16, 17, 8, 15, 7, 13, 22], [19, 10, 13, 18, 14, 9, 12, 24],
     [11, 20, 25, 6, 15, 2, 21, 7], [20, 15, 21, 6, 11, 7, 16, 26], [14, 19, 29, 10, 28, 18, 13, 24],
     [25, 11, 20, 21, 15, 6, 26, 30], [19, 24, 28, 18, 29, 23, 13, 17], [29, 19, 14, 28, 24, 18, 10, 13],
     [20, 26, 21, 25, 30, 15, 22, 16], [27, 26, 22, 23, 21, 30, 16, 24], [27, 24, 28, 31, 23, 18, 22, 17],
     [25, 30, 20, 26, 21, 11, 15, 22], [30, 26, 25, 20, 21, 27, 22, 15], [30, 27, 31, 26, 22, 23, 21, 24],
     [31, 27, 30, 26, 28, 23, 22, 24], [31, 28, 29, 27, 24, 23, 19, 18], [29, 28, 31, 24, 19, 27, 14, 18]],
    dtype=np.int8)  # fmt: skip


# Working copies for the hot loops (see iqk_grids: the per-value helpers read module constants, not arguments).
_KL_PAIRS, _KL_PAIRS_I = IQ2KL_PAIRS.astype(np.float32), IQ2KL_PAIRS.astype(np.int64)
_KL_INDEX, _KL_NEIGHBOURS = IQ2KL_INDEX.astype(np.int64), IQ2KL_NEIGHBOURS.astype(np.int64)
#: each neighbour list's pairs as two [list, 8] float32 tables: the 8 scores read contiguous rows, no index chase
_KL_NEAR1, _KL_NEAR2 = _KL_PAIRS[IQ2KL_NEIGHBOURS, 0].copy(), _KL_PAIRS[IQ2KL_NEIGHBOURS, 1].copy()


# ---------------------------------------------------------------------------------------------------------------
# Byte access and shared scalar pieces


@njit(**NJIT)
def _load_u16(row: np.ndarray, pos: int) -> np.int64:
    return np.int64(row[pos]) | (np.int64(row[pos + 1]) << 8)


@njit(**NJIT)
def _weights(qw: np.ndarray, xb: np.ndarray, sigma2: np.float32, weighted: bool, plain: int,
             out: np.ndarray) -> None:
    """A sub-block's importance weights as ik forms them.

    With an imatrix: imatrix * sqrt(sigma2 + x^2) (sum fused). Without, by `plain`: 0 -> x^2 (IQ3_KS, IQ4_KS,
    IQ4_KSS, IQ5_KS), 1 -> sigma2/4 + x^2 (IQ2_KS, fused), 2 -> |x| (IQ2_KL).
    """
    if weighted:
        for j in range(xb.size):
            out[j] = qw[j] * np.sqrt(fmaf(xb[j], xb[j], sigma2))
    elif plain == 0:
        for j in range(xb.size):
            out[j] = xb[j] * xb[j]
    elif plain == 1:
        base = np.float32(0.25) * sigma2
        for j in range(xb.size):
            out[j] = fmaf(xb[j], xb[j], base)
    else:
        for j in range(xb.size):
            out[j] = abs(xb[j])


# ---------------------------------------------------------------------------------------------------------------
# IQ2_KS: header f16 d; block = extra u16 (bits 0-7: shifted grid per sub-block, bits 8-15: scale bit 4),
# scales[4] (low 4 bits of the 5-bit scale, two per byte), qs[64] (2-bit codes, 4 sub-blocks per 32 bytes).

IQ2KS_BYTES = 70


@njit(**NJIT)
def _sigma2_iq2ks(xbl: np.ndarray) -> np.float32:
    return (np.float32(1.5) * sum_squares(xbl)) * np.float32(1.0 / QK)


@njit(**NJIT)
def _dot4(a0: np.float32, a1: np.float32, a2: np.float32, a3: np.float32, v0: np.float32, v1: np.float32,
          v2: np.float32, v3: np.float32) -> np.float32:
    """a0*v0 + a1*v1 + a2*v2 + a3*v3 as GCC contracts it: the first product fused into the first add."""
    return fmaf(a3, v3, fmaf(a2, v2, fmaf(a0, v0, a1 * v1)))


@njit(**NJIT)
def _dot4_sq(a0: np.float32, a1: np.float32, a2: np.float32, a3: np.float32, v0: np.float32, v1: np.float32,
             v2: np.float32, v3: np.float32) -> np.float32:
    """a0*v0*v0 + ... + a3*v3*v3 contracted the same way ((a*v) rounded, then fused with the second v)."""
    return fmaf(a3 * v3, v3, fmaf(a2 * v2, v2, fmaf(a0 * v0, v0, (a1 * v1) * v1)))


@njit(**NJIT)
def _iq2ks_slow_search(xb: np.ndarray, weight: np.ndarray, order: np.ndarray, sumx: np.ndarray,
                       sumw: np.ndarray) -> tuple[np.float32, bool]:
    """ik's scalar IQ2_KS sub-block search: every split of the sorted values into 4 runs of equal codes, both
    grids, both orientations. Returns the best scale and whether the shifted grid won."""
    stable_order(xb, order)
    sumx[0] = np.float32(0.0)
    sumw[0] = np.float32(0.0)
    for j in range(SUB):
        jj = order[j]
        sumw[j + 1] = sumw[j] + weight[jj]
        sumx[j + 1] = sumx[j] + weight[jj] * xb[jj]
    a0, a1, a2, a3 = IQ2NL[0], IQ2NL[1], IQ2NL[2], IQ2NL[3]
    b0, b1, b2, b3 = IQ2NL[4], IQ2NL[5], IQ2NL[6], IQ2NL[7]
    best = np.float32(0.0)
    d = np.float32(0.0)
    shifted = False
    for i1 in range(3 * SUB // 4):
        for i2 in range(i1, SUB):
            for i3 in range(max(i2, SUB // 4), SUB):
                x0, x1, x2, x3 = sumx[i1] - sumx[0], sumx[i2] - sumx[i1], sumx[i3] - sumx[i2], sumx[SUB] - sumx[i3]
                w0, w1, w2, w3 = sumw[i1] - sumw[0], sumw[i2] - sumw[i1], sumw[i3] - sumw[i2], sumw[SUB] - sumw[i3]
                for variant in range(4):
                    if variant == 0:
                        v0, v1, v2, v3 = a0, a1, a2, a3
                    elif variant == 1:
                        v0, v1, v2, v3 = b0, b1, b2, b3
                    elif variant == 2:
                        v0, v1, v2, v3 = a3, a2, a1, a0
                    else:
                        v0, v1, v2, v3 = b3, b2, b1, b0
                    sumqx = _dot4(x0, x1, x2, x3, v0, v1, v2, v3)
                    sumq2 = _dot4_sq(w0, w1, w2, w3, v0, v1, v2, v3)
                    d, best, better = keep_better(sumqx, sumq2, d, best)
                    if better:
                        shifted = variant % 2 == 1
    return d, shifted


@njit(**NJIT)
def _fold8(a0: np.float32, a1: np.float32, a2: np.float32, a3: np.float32, a4: np.float32, a5: np.float32,
           a6: np.float32, a7: np.float32) -> np.float32:
    """ik's hsum_float_8 of 8 AVX lanes: fold 4+4, then 2+2, then 1+1."""
    return ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))


@njit(**NJIT)
def _hsum8(acc: np.ndarray, r: int) -> np.float32:
    return _fold8(acc[r, 0], acc[r, 1], acc[r, 2], acc[r, 3], acc[r, 4], acc[r, 5], acc[r, 6], acc[r, 7])


@njit(**NJIT)
def _iq2ks_fast_search(xb: np.ndarray, w: np.ndarray, vmax: np.float32, sums: np.ndarray) -> tuple[np.float32, bool]:
    """ik's AVX2 IQ2_KS sub-block search (compute_1block_iq2ks over 55 trial scales): for each trial scale the
    codes nearest (in squared distance) to x for +scale and for -scale, each refitted by weighted least squares
    with 8-lane fused sums (iq2ks_trial_sums, into `sums`). Returns the best scale and whether the shifted
    grid won."""
    d = vmax / IQ2NL[7]
    best = np.float32(0.0)
    shifted = False
    for t in range(55):
        off = 4 if t > 27 else 0
        if t == 0:
            dt = d
        else:
            dt = vmax / fmaf(np.float32(0.5), np.float32((t - 1) % 27 - 13), IQ2NL[off])
        iq2ks_trial_sums(xb, w, IQ2NL, off, dt, sums)
        sumqx_p, sumq2_p, sumqx_m, sumq2_m = sums[0], sums[1], sums[2], sums[3]
        found = False
        this_d = np.float32(0.0)
        score = np.float32(0.0)
        if sumq2_p > 0:
            this_d = sumqx_p / sumq2_p
            score = sumqx_p * this_d
            found = True
        if sumq2_m > 0 and (not found or sumqx_m * sumqx_m > score * sumq2_m):
            this_d = sumqx_m / sumq2_m
            score = sumqx_m * this_d
            found = True
        if found and (t == 0 or score > best):
            best = score
            d = this_d
            shifted = off == 4
    return d, shifted


@njit(**NJIT)
def _iq2ks_rmse(dl: np.float32, xb: np.ndarray, w: np.ndarray, off: int, idx: np.ndarray,
                acc: np.ndarray) -> np.float32:
    """ik's compute_1block_iq2ks_rmse: codes nearest (squared distance) to x at scale dl, and their weighted
    squared error in 8 fused lanes."""
    s0, s1, s2, s3 = dl * IQ2NL[off], dl * IQ2NL[off + 1], dl * IQ2NL[off + 2], dl * IQ2NL[off + 3]
    acc[0, :] = np.float32(0.0)
    for j in range(SUB):
        x = xb[j]
        e = x - s0
        best = e * e
        bi = 0
        e = x - s1
        e = e * e
        if e < best:
            best = e
            bi = 1
        e = x - s2
        e = e * e
        if e < best:
            best = e
            bi = 2
        e = x - s3
        if e * e < best:
            bi = 3
        idx[j] = bi
        diff = fmaf(-dl, IQ2NL[off + bi], x)
        acc[0, j % 8] = fmaf(w[j] * diff, diff, acc[0, j % 8])
    return _hsum8(acc, 0)


@njit(**NJIT)
def _iq2ks_pack_scale(blk: np.ndarray, ib: int, ls: int) -> None:
    blk[2 + ib // 2] |= np.uint8((ls & 0xF) << (4 * (ib % 2)))
    blk[1] |= np.uint8((ls >> 4) << ib)


@njit(**NJIT)
def _iq2ks_pack_code(blk: np.ndarray, ib: int, j: int, code: int) -> None:
    blk[6 + 32 * (ib // 4) + j] |= np.uint8(code << (2 * (ib % 4)))


@njit(**NJIT)
def _iq2ks_fast_codes(blk: np.ndarray, ib: int, xb: np.ndarray, weight: np.ndarray, off: int, d: np.float32,
                      ls: int, scale: np.float32, idx: np.ndarray, idx2: np.ndarray, acc: np.ndarray) -> None:
    """Fast path, final pass for one sub-block: codes at integer scale ls, or at ls -/+ 1 when the float scale
    lies on that side and the error is lower there; packs them and adds to the row's 8-lane refit sums."""
    dl = d * np.float32(ls - 16)
    rmse1 = _iq2ks_rmse(dl, xb, weight, off, idx, acc[2:])
    if ls > 0 and dl > scale:
        if _iq2ks_rmse(d * np.float32(ls - 17), xb, weight, off, idx2, acc[2:]) < rmse1:
            ls -= 1
            idx[:] = idx2
    elif ls < 15 and dl < scale:
        if _iq2ks_rmse(d * np.float32(ls - 15), xb, weight, off, idx2, acc[2:]) < rmse1:
            ls += 1
            idx[:] = idx2
    fl = np.float32(ls - 16)
    for j in range(SUB):
        q = fl * IQ2NL[off + idx[j]]
        wq = weight[j] * q
        acc[0, j % 8] = fmaf(wq, xb[j], acc[0, j % 8])
        acc[1, j % 8] = fmaf(wq, q, acc[1, j % 8])
        _iq2ks_pack_code(blk, ib, j, idx[j])
    _iq2ks_pack_scale(blk, ib, ls)


@njit(**KERNEL)
def _quantize_iq2_ks(x: np.ndarray, qw: np.ndarray, out: np.ndarray, slow: bool) -> None:
    n_rows, n = x.shape
    nblock = n // QK
    nsub = n // SUB
    weighted = qw.size > 0
    for r in prange(n_rows):
        xr = x[r]
        row = out[r]
        row[:] = 0
        w_row = np.empty(n, dtype=np.float32)
        if weighted:
            importance(qw, xr, SUB, w_row)
        scales = np.zeros(nsub, dtype=np.float32)
        sw = np.zeros(nsub, dtype=np.float32)
        Ls = np.zeros(nsub, dtype=np.int64)
        weight = np.empty(SUB, dtype=np.float32)
        idx = np.zeros(SUB, dtype=np.int64)
        idx2 = np.zeros(SUB, dtype=np.int64)
        order = np.empty(SUB, dtype=np.int64)
        sumx = np.empty(SUB + 1, dtype=np.float32)
        sumw = np.empty(SUB + 1, dtype=np.float32)
        sums = np.empty(4, dtype=np.float32)
        acc = np.zeros((4, 8), dtype=np.float32)
        for ibl in range(nblock):
            xbl = xr[ibl * QK : (ibl + 1) * QK]
            sigma2 = _sigma2_iq2ks(xbl)
            extra = 0
            for ib in range(8):
                s = ibl * 8 + ib
                xb = xbl[ib * SUB : (ib + 1) * SUB]
                _weights(w_row[s * SUB : (s + 1) * SUB], xb, sigma2, weighted, 1, weight)
                amax, vmax = abs_max(xb)
                sumw_b = np.float32(0.0)
                for j in range(SUB):
                    sumw_b += weight[j]
                sw[s] = sumw_b
                if amax < (np.float32(1e-16) if slow else np.float32(1e-14)):
                    continue
                if slow:
                    scales[s], shifted = _iq2ks_slow_search(xb, weight, order, sumx, sumw)
                else:
                    scales[s], shifted = _iq2ks_fast_search(xb, weight, vmax, sums)
                if shifted:
                    extra |= 1 << ib
            row[2 + ibl * IQ2KS_BYTES] = np.uint8(extra)
        d = iqk_qx_quants(scales, sw, 16, Ls)
        if d == 0:
            continue
        sumqx = np.float32(0.0)
        sumq2 = np.float32(0.0)
        acc[:, :] = np.float32(0.0)
        for ibl in range(nblock):
            blk = row[2 + ibl * IQ2KS_BYTES : 2 + (ibl + 1) * IQ2KS_BYTES]
            xbl = xr[ibl * QK : (ibl + 1) * QK]
            sigma2 = _sigma2_iq2ks(xbl)
            for ib in range(8):
                s = ibl * 8 + ib
                xb = xbl[ib * SUB : (ib + 1) * SUB]
                off = 4 if (blk[0] >> ib) & 1 else 0
                if not slow:
                    _weights(w_row[s * SUB : (s + 1) * SUB], xb, sigma2, weighted, 1, weight)
                    _iq2ks_fast_codes(blk, ib, xb, weight, off, d, Ls[s], scales[s], idx, idx2, acc)
                    continue
                ls = Ls[s] - 16
                _iq2ks_pack_scale(blk, ib, Ls[s])
                dl = d * np.float32(ls)
                if dl == 0:
                    continue
                _weights(w_row[s * SUB : (s + 1) * SUB], xb, sigma2, weighted, 1, weight)
                idl = np.float32(1.0) / dl
                for j in range(SUB):
                    k = nearest_iq2(off, idl * xb[j])
                    _iq2ks_pack_code(blk, ib, j, k)
                    q = np.float32(np.int64(IQ2NL_VALUES[off + k]) * ls)
                    wq = weight[j] * q
                    sumqx = fmaf(wq, xb[j], sumqx)
                    sumq2 = fmaf(wq, q, sumq2)
        if slow:
            dh = np.float32(1.03) * (sumqx / sumq2 if sumq2 > 0 else d)
        else:
            sumqx = _hsum8(acc, 0)
            sumq2 = _hsum8(acc, 1)
            dh = sumqx / sumq2 if sumq2 > 0 else d
        store_f16(row, 0, dh)


@njit(**KERNEL)
def _dequantize_iq2_ks(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        row = q[r]
        y = out[r]
        d = load_f16(row, 0)
        for ibl in range(n // QK):
            o = 2 + ibl * IQ2KS_BYTES
            extra = _load_u16(row, o)
            for ib in range(8):
                ls = ((row[o + 2 + ib // 2] >> (4 * (ib % 2))) & 0xF) | (((extra >> (8 + ib)) & 1) << 4)
                dl = d * np.float32(np.int64(ls) - 16)
                off = 4 if (extra >> ib) & 1 else 0
                qs = o + 6 + 32 * (ib // 4)
                shift = 2 * (ib % 4)
                base = ibl * QK + ib * SUB
                for j in range(SUB):
                    y[base + j] = dl * IQ2NL[off + ((row[qs + j] >> shift) & 3)]


# ---------------------------------------------------------------------------------------------------------------
# IQ2_KL: header f16 d; block = scales_h u16 (2 high bits of each 6-bit scale), scales_l[4] (low 4 bits),
# qs[64] (low 4 bits of a 5-bit pair index, two sub-blocks per 16 bytes), qh[16] (bit 4 of the pair index).
# Values come in pairs: each pair of neighbouring values takes one of 32 points of a 2-D grid built from the
# plain IQ3 grid.

IQ2KL_BYTES = 86


@njit(**NJIT)
def _iq2kl_index(id_: np.float32, x1: np.float32, x2: np.float32, w1: np.float32, w2: np.float32) -> int:
    """The grid pair for (x1, x2) at inverse scale id_: both coordinates rounded to the IQ3 grid, and when that
    combination is not a stored pair, the best of its 8 listed neighbours by weighted squared distance."""
    sx1 = id_ * x1
    sx2 = id_ * x2
    i = _KL_INDEX[8 * nearest(3, 0, sx1) + nearest(3, 0, sx2)]
    if i >= 0:
        return i
    return _iq2kl_neighbour(i, sx1, sx2, w1, w2)


@njit(**NJIT)
def _iq2kl_neighbour(i: int, sx1: np.float32, sx2: np.float32, w1: np.float32, w2: np.float32) -> int:
    """The best pair of neighbour list -(i + 1) for the scaled pair (sx1, sx2): the first of least weighted
    squared distance."""
    best = np.float32(np.finfo(np.float32).max)
    ibest = 0  # ik asserts instead when every score overflows
    near1 = _KL_NEAR1[-i - 1]
    near2 = _KL_NEAR2[-i - 1]
    for k in range(8):
        diff1 = near1[k] - sx1
        diff2 = near2[k] - sx2
        score = fmaf(w1 * diff1, diff1, (w2 * diff2) * diff2)
        if score < best:
            best = score
            ibest = k
    return _KL_NEIGHBOURS[-i - 1, ibest] if best < np.float32(np.finfo(np.float32).max) else 0


#: _iq2kl_search's lanes: inverse scale, pair index, the scaled pair, and the fit's two sums of each trial and sign
KlTrials = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
KL_TRIALS = 24  # 12 inverse scales, each with both signs


@njit(**NJIT)
def _kl_trials() -> KlTrials:
    return (np.empty(KL_TRIALS, dtype=np.float32), np.empty(KL_TRIALS, dtype=np.int64),
            np.empty(KL_TRIALS, dtype=np.float32), np.empty(KL_TRIALS, dtype=np.float32),
            np.empty(KL_TRIALS, dtype=np.float32), np.empty(KL_TRIALS, dtype=np.float32))


@njit(**NJIT)
def _iq2kl_search(xb: np.ndarray, w: np.ndarray, vmax: np.float32, trials: KlTrials) -> np.float32:
    """Best weighted least-squares scale of one sub-block over 12 inverse scales, both signs (ik's order: the
    first scale's + then -, then each further scale's + then -). The 24 trials run side by side in lanes
    (trials.py's scheme): pairs rounded to the grid in every lane (nearest_plain_iq3), the off-grid pairs' neighbours
    searched one by one, each lane's sums a chain over the pairs as ik forms them, the fits compared in order."""
    ids, idx, sx1, sx2, sumqx, sumq2 = trials
    ids[0] = np.float32(1.0) / (-vmax / IQ3NL[0])
    for itry in range(-5, 6):
        ids[2 * (itry + 6)] = np.float32(itry + np.int64(IQ3NL[0])) / vmax
    for t in range(0, KL_TRIALS, 2):
        ids[t + 1] = -ids[t]
        sumqx[t] = sumqx[t + 1] = sumq2[t] = sumq2[t + 1] = np.float32(0.0)
    for j in range(0, SUB, 2):
        x1, x2, w1, w2 = xb[j], xb[j + 1], w[j], w[j + 1]
        for t in range(KL_TRIALS):
            sx1[t] = ids[t] * x1
            sx2[t] = ids[t] * x2
            idx[t] = _KL_INDEX[8 * nearest_plain_iq3(sx1[t]) + nearest_plain_iq3(sx2[t])]
        for t in range(KL_TRIALS):
            if idx[t] < 0:
                idx[t] = _iq2kl_neighbour(idx[t], sx1[t], sx2[t], w1, w2)
        for t in range(KL_TRIALS):
            q1, q2 = _KL_PAIRS[idx[t], 0], _KL_PAIRS[idx[t], 1]
            wq1, wq2 = w1 * q1, w2 * q2
            sumqx[t] += fmaf(wq1, x1, wq2 * x2)
            sumq2[t] += fmaf(wq1, q1, wq2 * q2)
    d = sumqx[0] / sumq2[0]
    best = d * sumqx[0]
    for t in range(1, KL_TRIALS):
        d, best, _ = keep_better(sumqx[t], sumq2[t], d, best)
    return d


@njit(**NJIT)
def _iq2kl_level(xb: np.ndarray, w: np.ndarray, d: np.float32, ls: int) -> int:
    """Of the integer sub-block scales ls-1, ls, ls+1 (within [-32, 31]), the one with the lowest weighted error."""
    best_score = np.float32(np.finfo(np.float32).max)
    best_ls = ls
    for ils in range(max(-32, ls - 1), min(31, ls + 1) + 1):
        dl = d * np.float32(ils)
        idl = np.float32(1.0) / dl if dl != 0 else np.float32(0.0)
        score = np.float32(0.0)
        for j in range(0, SUB, 2):
            k = _iq2kl_index(idl, xb[j], xb[j + 1], w[j], w[j + 1])
            diff1 = fmaf(dl, _KL_PAIRS[k, 0], -xb[j])
            diff2 = fmaf(dl, _KL_PAIRS[k, 1], -xb[j + 1])
            score += fmaf(w[j] * diff1, diff1, (w[j + 1] * diff2) * diff2)
        if score < best_score:
            best_score = score
            best_ls = ils
    return best_ls


@njit(**KERNEL)
def _quantize_iq2_kl(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    nblock = n // QK
    weighted = qw.size > 0
    for r in prange(n_rows):
        xr = x[r]
        row = out[r]
        row[:] = 0
        w_row = np.empty(n, dtype=np.float32)
        if weighted:
            importance(qw, xr, SUB, w_row)
        scales = np.zeros(n // SUB, dtype=np.float32)
        weight = np.empty(SUB, dtype=np.float32)
        trials = _kl_trials()
        max_scale = np.float32(0.0)
        max_abs_scale = np.float32(0.0)
        for ibl in range(nblock):
            xbl = xr[ibl * QK : (ibl + 1) * QK]
            sigma2 = sum_squares(xbl) * np.float32(2.25 / QK)
            for ib in range(8):
                s = ibl * 8 + ib
                xb = xbl[ib * SUB : (ib + 1) * SUB]
                _weights(w_row[s * SUB : (s + 1) * SUB], xb, sigma2, weighted, 2, weight)
                amax, vmax = abs_max(xb)
                if amax < np.float32(1e-16):
                    continue
                scales[s] = _iq2kl_search(xb, weight, vmax, trials)
                if abs(scales[s]) > max_abs_scale:
                    max_abs_scale = abs(scales[s])
                    max_scale = scales[s]
        if max_abs_scale == 0:
            continue
        d = max_scale * np.float32(-1.0 / 32)
        id_ = np.float32(1.0) / d
        sumqx = np.float32(0.0)
        sumq2 = np.float32(0.0)
        for ibl in range(nblock):
            blk = row[2 + ibl * IQ2KL_BYTES : 2 + (ibl + 1) * IQ2KL_BYTES]
            xbl = xr[ibl * QK : (ibl + 1) * QK]
            sigma2 = sum_squares(xbl) * np.float32(2.25 / QK)
            for ib in range(8):
                s = ibl * 8 + ib
                xb = xbl[ib * SUB : (ib + 1) * SUB]
                _weights(w_row[s * SUB : (s + 1) * SUB], xb, sigma2, weighted, 2, weight)
                ls = _iq2kl_level(xb, weight, d, min(31, max(-32, np.int64(nearest_int_fma(id_, scales[s])))))
                blk[2 + ib % 4] |= np.uint8(((ls + 32) & 0xF) << (4 * (ib // 4)))
                blk[ib // 4] |= np.uint8(((ls + 32) >> 4) << (2 * (ib % 4)))
                if ls == 0:
                    continue
                idl = np.float32(1.0) / (d * np.float32(ls))
                for j in range(SUB // 2):
                    x1, x2, w1, w2 = xb[2 * j], xb[2 * j + 1], weight[2 * j], weight[2 * j + 1]
                    k = _iq2kl_index(idl, x1, x2, w1, w2)
                    blk[6 + 16 * (ib // 2) + j] |= np.uint8((k & 0xF) << (4 * (ib % 2)))
                    blk[70 + j] |= np.uint8((k >> 4) << ib)
                    q1 = np.float32(ls * _KL_PAIRS_I[k, 0])
                    q2 = np.float32(ls * _KL_PAIRS_I[k, 1])
                    wq1, wq2 = w1 * q1, w2 * q2
                    sumqx += fmaf(wq1, x1, wq2 * x2)
                    sumq2 += fmaf(wq1, q1, wq2 * q2)
        if sumq2 > 0:
            d = sumqx / sumq2
        store_f16(row, 0, np.float32(1.025) * d)


@njit(**KERNEL)
def _dequantize_iq2_kl(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        row = q[r]
        y = out[r]
        d = load_f16(row, 0)
        for ibl in range(n // QK):
            o = 2 + ibl * IQ2KL_BYTES
            scales_h = _load_u16(row, o)
            for ib in range(8):
                ls = ((row[o + 2 + ib % 4] >> (4 * (ib // 4))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)
                dl = d * np.float32(np.int64(ls) - 32)
                qs = o + 6 + 16 * (ib // 2)
                shift = 4 * (ib % 2)
                base = ibl * QK + ib * SUB
                for j in range(SUB // 2):
                    k = ((row[qs + j] >> shift) & 0xF) | (((row[o + 70 + j] >> ib) & 1) << 4)
                    y[base + 2 * j] = dl * _KL_PAIRS[k, 0]
                    y[base + 2 * j + 1] = dl * _KL_PAIRS[k, 1]


# ---------------------------------------------------------------------------------------------------------------
# IQ3_KS, IQ4_KS, IQ5_KS: one search over both halves of a non-linear grid (kind 3, 4 or 5) per sub-block.


@njit(**NJIT)
def _grid_first_pass(kind: int, xr: np.ndarray, w_row: np.ndarray, weighted: bool, ntry: int,
                     check_first: bool, scales: np.ndarray, shifted: np.ndarray) -> None:
    """Per sub-block best float scale (0 for an all-but-zero sub-block) and grid half, for a whole row."""
    weight = np.empty(SUB, dtype=np.float32)
    for ibl in range(xr.size // QK):
        xbl = xr[ibl * QK : (ibl + 1) * QK]
        sigma2 = sum_squares(xbl) * np.float32(2.0 / QK)
        for ib in range(8):
            s = ibl * 8 + ib
            xb = xbl[ib * SUB : (ib + 1) * SUB]
            _weights(w_row[s * SUB : (s + 1) * SUB], xb, sigma2, weighted, 0, weight)
            amax, vmax = abs_max(xb)
            scales[s] = np.float32(0.0)
            shifted[s] = False
            if amax >= np.float32(1e-16):
                scales[s], shifted[s] = grid_search(kind, xb, weight, vmax, ntry, 1, check_first)


# IQ3_KS: header f16 d; block = extra u16 (bits 0-7: scale bit 4, bits 8-15: shifted grid), scales[4] (low 4
# bits, sub-blocks t and t+4 share byte t), qs[64] (low 2 bits of the 3-bit codes), qh[32] (bit 2).

IQ3KS_BYTES = 102


@njit(**KERNEL)
def _quantize_iq3_ks(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    weighted = qw.size > 0
    for r in prange(n_rows):
        xr = x[r]
        row = out[r]
        row[:] = 0
        w_row = np.empty(n, dtype=np.float32)
        if weighted:
            importance(qw, xr, SUB, w_row)
        scales = np.empty(n // SUB, dtype=np.float32)
        shifted = np.empty(n // SUB, dtype=np.bool_)
        _grid_first_pass(3, xr, w_row, weighted, 5, True, scales, shifted)
        max_scale = np.float32(0.0)
        amax_scale = np.float32(0.0)
        for s in range(n // SUB):
            if abs(scales[s]) > amax_scale:
                amax_scale = abs(scales[s])
                max_scale = scales[s]
            if shifted[s]:
                row[2 + (s // 8) * IQ3KS_BYTES + 1] |= np.uint8(1 << (s % 8))
        d = max_scale * np.float32(-1.0 / 16)
        store_f16(row, 0, d)
        if d == 0:
            continue
        id_ = np.float32(1.0) / d
        weight = np.empty(SUB, dtype=np.float32)
        sumqx = np.float32(0.0)
        sumq2 = np.float32(0.0)
        for ibl in range(n // QK):
            blk = row[2 + ibl * IQ3KS_BYTES : 2 + (ibl + 1) * IQ3KS_BYTES]
            xbl = xr[ibl * QK : (ibl + 1) * QK]
            sigma2 = sum_squares(xbl) * np.float32(2.0 / QK)
            for ib in range(8):
                s = ibl * 8 + ib
                off = 8 if shifted[s] else 0
                l = min(15, max(-16, int(nearest_int_fma(id_, scales[s]))))
                blk[2 + ib % 4] |= np.uint8(((l + 16) & 0xF) << (4 * (ib // 4)))
                blk[0] |= np.uint8(((l + 16) >> 4) << ib)
                dl = d * np.float32(l)
                idl = np.float32(1.0) / dl if dl != 0 else np.float32(0.0)
                xb = xbl[ib * SUB : (ib + 1) * SUB]
                _weights(w_row[s * SUB : (s + 1) * SUB], xb, sigma2, weighted, 0, weight)
                for j in range(SUB):
                    k = nearest(3, off, idl * xb[j])
                    blk[6 + 32 * (ib // 4) + j] |= np.uint8((k & 3) << (2 * (ib % 4)))
                    blk[70 + j] |= np.uint8((k >> 2) << ib)
                    q = np.float32(np.int64(IQ3NL[off + k]) * l)
                    wq = weight[j] * q
                    sumqx = fmaf(wq, xb[j], sumqx)
                    sumq2 = fmaf(wq, q, sumq2)
        if sumq2 > 0:
            store_f16(row, 0, sumqx / sumq2)


@njit(**KERNEL)
def _dequantize_iq3_ks(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        row = q[r]
        y = out[r]
        d = load_f16(row, 0)
        for ibl in range(n // QK):
            o = 2 + ibl * IQ3KS_BYTES
            extra = _load_u16(row, o)
            for ib in range(8):
                ls = ((row[o + 2 + ib % 4] >> (4 * (ib // 4))) & 0xF) | (((extra >> ib) & 1) << 4)
                dl = d * np.float32(np.int64(ls) - 16)
                off = 8 if (extra >> (8 + ib)) & 1 else 0
                qs = o + 6 + 32 * (ib // 4)
                shift = 2 * (ib % 4)
                base = ibl * QK + ib * SUB
                for j in range(SUB):
                    k = ((row[qs + j] >> shift) & 3) | (((row[o + 70 + j] >> ib) & 1) << 2)
                    y[base + j] = dl * IQ3NL[off + k]


# IQ4_KS / IQ5_KS: header f32 d; block = one byte per sub-block (bit 0: shifted grid, bits 1-7: scale + 127),
# then the codes (IQ4_KS: nibbles, values j and j+16 of a sub-block share a byte; IQ5_KS: low nibbles with two
# sub-blocks per 32 bytes, plus qh[32] holding bit 4).

IQ4KS_BYTES = 136
IQ5KS_BYTES = 168


@njit(**NJIT)
def _scale_level(id_: np.float32, scale: np.float32) -> int:
    """Odd sub-block scale in [-127, 127] nearest to scale/d, as ik rounds it: 2*round((id*s + 127)/2) - 127."""
    l = int(nearest_int_fma(np.float32(0.5), fmaf(id_, scale, np.float32(127.0))))
    return (min(127, max(0, l)) << 1) - 127


@njit(**NJIT)
def _row_amax(scales: np.ndarray) -> np.float32:
    """max |scale| as ik's std::max chain computes it (a NaN scale is skipped)."""
    amax = np.float32(0.0)
    for s in range(scales.size):
        if amax < abs(scales[s]):
            amax = abs(scales[s])
    return amax


@njit(**KERNEL)
def _quantize_iq45_ks(x: np.ndarray, qw: np.ndarray, out: np.ndarray, kind: int) -> None:
    """IQ4_KS (kind 4: 16-point grid halves) or IQ5_KS (kind 5: 32-point halves): same search, other packing."""
    n_rows, n = x.shape
    weighted = qw.size > 0
    nv = 32 if kind == 5 else 16
    nbytes = IQ5KS_BYTES if kind == 5 else IQ4KS_BYTES
    for r in prange(n_rows):
        xr = x[r]
        row = out[r]
        row[:] = 0
        w_row = np.empty(n, dtype=np.float32)
        if weighted:
            importance(qw, xr, SUB, w_row)
        scales = np.empty(n // SUB, dtype=np.float32)
        shifted = np.empty(n // SUB, dtype=np.bool_)
        if kind == 5:  # a literal grid number lets Numba specialise the search (see iqk_grids)
            _grid_first_pass(5, xr, w_row, weighted, 5, False, scales, shifted)
        else:
            _grid_first_pass(4, xr, w_row, weighted, 7, False, scales, shifted)
        for s in range(n // SUB):
            if shifted[s]:
                row[4 + (s // 8) * nbytes + s % 8] = 1
        d = _row_amax(scales) / np.float32(127.0)
        store_f32(row, 0, d)
        if d == 0:
            continue
        id_ = np.float32(1.0) / d
        weight = np.empty(SUB, dtype=np.float32)
        sumqx = np.float32(0.0)
        sumq2 = np.float32(0.0)
        for ibl in range(n // QK):
            blk = row[4 + ibl * nbytes : 4 + (ibl + 1) * nbytes]
            xbl = xr[ibl * QK : (ibl + 1) * QK]
            sigma2 = sum_squares(xbl) * np.float32(2.0 / QK)
            for ib in range(8):
                s = ibl * 8 + ib
                off = nv if shifted[s] else 0
                l = _scale_level(id_, scales[s])
                blk[ib] |= np.uint8(l + 127)
                dl = d * np.float32(l)
                idl = np.float32(1.0) / dl if dl != 0 else np.float32(0.0)
                xb = xbl[ib * SUB : (ib + 1) * SUB]
                _weights(w_row[s * SUB : (s + 1) * SUB], xb, sigma2, weighted, 0, weight)
                if kind == 5:
                    for j in range(SUB):
                        k = nearest(5, off, idl * xb[j])
                        blk[8 + 32 * (ib // 2) + j] |= np.uint8((k & 0xF) << (4 * (ib % 2)))
                        blk[136 + j] |= np.uint8((k >> 4) << ib)
                        q = np.float32(np.int64(IQ5NL[off + k]) * l)
                        wq = weight[j] * q
                        sumqx = fmaf(wq, xb[j], sumqx)
                        sumq2 = fmaf(wq, q, sumq2)
                else:
                    for j in range(SUB // 2):
                        k1 = nearest(4, off, idl * xb[j])
                        k2 = nearest(4, off, idl * xb[j + 16])
                        blk[8 + 16 * ib + j] = np.uint8(k1 | (k2 << 4))
                        q1 = np.float32(np.int64(IQ4K[off + k1]) * l)
                        q2 = np.float32(np.int64(IQ4K[off + k2]) * l)
                        wq1 = weight[j] * q1
                        wq2 = weight[j + 16] * q2
                        sumqx += fmaf(wq1, xb[j], wq2 * xb[j + 16])
                        sumq2 += fmaf(wq1, q1, wq2 * q2)
        if sumq2 > 0:
            store_f32(row, 0, sumqx / sumq2)


@njit(cache=True, nogil=True, inline="always")
def iq4_ks_block(row: np.ndarray, ibl: int, y: np.ndarray, at: int) -> None:
    """Values 256 ibl .. 256 ibl + 255 of an IQ4_KS row (its bytes) into y[at : at + 256]: the decoding, shared
    with the runtime's expert kernel, which decodes a block of rows at a time into its first-level cache."""
    d = load_f32(row, 0)
    o = 4 + ibl * IQ4KS_BYTES
    for ib in range(8):
        b = np.int64(row[o + ib])
        dl = d * np.float32((b & 254) - 127)
        off = 16 * (b & 1)
        scaled_nibbles(row, o + 8 + 16 * ib, IQ4K, off, dl, off, dl, y, at + ib * SUB)


@njit(**KERNEL)
def _dequantize_iq4_ks(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        for ibl in range(n // QK):
            iq4_ks_block(q[r], ibl, out[r], ibl * QK)


@njit(**KERNEL)
def _dequantize_iq5_ks(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        for ibl in range(n // QK):
            iq5_ks_block(q[r], ibl, out[r], ibl * QK)


@njit(cache=True, nogil=True, inline="always")
def iq5_ks_block(row: np.ndarray, ibl: int, y: np.ndarray, at: int) -> None:
    """Values 256 ibl .. of an IQ5_KS row into y[at : at + 256] (as iq4_ks_block)."""
    d = load_f32(row, 0)
    o = 4 + ibl * IQ5KS_BYTES
    for ib in range(8):
        b = np.int64(row[o + ib])
        dl = d * np.float32((b & 254) - 127)
        off = 32 * (b & 1)
        qs = o + 8 + 32 * (ib // 2)
        shift = 4 * (ib % 2)
        base = at + ib * SUB
        for j in range(SUB):
            k = ((row[qs + j] >> shift) & 0xF) | (((row[o + 136 + j] >> ib) & 1) << 4)
            y[base + j] = dl * IQ5NL[off + k]


# ---------------------------------------------------------------------------------------------------------------
# IQ4_KSS: header f32 d; block = 64 LE u16 words, 8 per sub-block. Bit 0 of word k carries bit k of the
# sub-block's scale byte (as IQ4_KS); bits 1-15 carry 15 bits g whose image a ^ (a >> 1), a = g << 1, is 16 bits =
# four 4-bit IQ4 codes. Only code groups of even parity survive that, so the quantizer repairs odd-parity groups
# by changing one code. Group k of a sub-block holds its values 2k, 2k+16, 2k+1, 2k+17 (lowest nibble first).

IQ4KSS_BYTES = 128


def _parity_moves() -> tuple[np.ndarray, np.ndarray]:
    """For each code q, the codes within 2 steps of it whose bit count has the other parity, ascending (the order
    ik tries them in), and how many there are: the only moves ik's prune_iq4ks can choose."""
    moves = np.zeros((16, 4), dtype=np.int64)
    counts = np.zeros(16, dtype=np.int64)
    for q in range(16):
        for qq in range(max(q - 2, 0), min(q + 2, 15) + 1):
            if qq != q and (bin(qq).count("1") - bin(q).count("1")) % 2:
                moves[q, counts[q]] = qq
                counts[q] += 1
    return moves, counts


_MOVES, _N_MOVES = _parity_moves()
_PARITY = np.array([bin(q).count("1") % 2 for q in range(16)], dtype=np.int64)


@njit(**NJIT)
def _iq4kss_encode(v: int) -> int:
    """The 15 stored bits g of an even-parity 16-bit code group v, i.e. g ^ (g << 1) == v: bit k of g is the
    parity of bits 0..k of v (bit 15 is then 0)."""
    g = v
    g ^= g << 1
    g ^= g << 2
    g ^= g << 4
    g ^= g << 8
    return g & 0x7FFF


@njit(**NJIT)
def _group_pos(k: int, j: int) -> int:
    """Position in the sub-block of nibble j of code group k."""
    return 2 * k + (j >> 1) + 16 * (j & 1)


@njit(inline="always", **NJIT)
def _best_move(q: int, off: int, x: np.float32, w: np.float32, dl: np.float32, best_score: np.float32
               ) -> tuple[np.float32, int]:
    """The cheapest parity-changing move of code q (ik's score: weighted change of squared error, the current
    error measured on the plain grid) if it beats best_score, else -1."""
    diff0 = fmaf(dl, IQ4K[q], -x)
    e0 = diff0 * diff0
    bestq = -1
    for m in range(_N_MOVES[q]):
        qq = _MOVES[q, m]
        diff1 = fmaf(dl, IQ4K[off + qq], -x)
        score = w * fmaf(diff1, diff1, -e0)
        if score < best_score:
            best_score = score
            bestq = qq
    return best_score, bestq


@njit(inline="always", **NJIT)
def _iq4kss_prune(q0: int, q1: int, q2: int, q3: int, off: int, x0: np.float32, x1: np.float32, x2: np.float32,
                  x3: np.float32, w0: np.float32, w1: np.float32, w2: np.float32, w3: np.float32, dl: np.float32
                  ) -> tuple[int, int, int, int]:
    """ik's prune_iq4ks: give a group of four codes of odd parity even parity by moving the one code (by at most
    2 steps) whose change costs least weighted squared error; ties go to the earlier code and smaller move."""
    if _PARITY[q0] ^ _PARITY[q1] ^ _PARITY[q2] ^ _PARITY[q3] == 0:
        return q0, q1, q2, q3
    best, m0 = _best_move(q0, off, x0, w0, dl, np.float32(np.finfo(np.float32).max))
    best, m1 = _best_move(q1, off, x1, w1, dl, best)
    best, m2 = _best_move(q2, off, x2, w2, dl, best)
    best, m3 = _best_move(q3, off, x3, w3, dl, best)
    if m3 >= 0:
        return q0, q1, q2, m3
    if m2 >= 0:
        return q0, q1, m2, q3
    if m1 >= 0:
        return q0, m1, q2, q3
    return max(m0, 0), q1, q2, q3  # no finite score at all: code 0 set to 0, as the earlier port did


@njit(inline="always", **NJIT)
def _iq4kss_group(xb: np.ndarray, w: np.ndarray, k: int, off: int, id_: np.float32, dl: np.float32
                  ) -> tuple[int, int, int, int]:
    """Codes (grid half at `off`) of group k nearest to x*id_, parity-repaired at scale dl."""
    p = 2 * k
    x0, x1, x2, x3 = xb[p], xb[p + 16], xb[p + 1], xb[p + 17]
    return _iq4kss_prune(nearest(4, off, id_ * x0), nearest(4, off, id_ * x1), nearest(4, off, id_ * x2),
                         nearest(4, off, id_ * x3), off, x0, x1, x2, x3, w[p], w[p + 16], w[p + 1], w[p + 17], dl)


#: IQ4_KSS's trial inverse scales per grid half: itry in [-7, 7], each with both signs, in lanes 2 t + sign
KSS_TRIALS = 15
KSS_LANES = whole_vectors(2 * KSS_TRIALS)


@njit(**NJIT)
def _iq4kss_search(xb: np.ndarray, w: np.ndarray, vmax: np.float32) -> np.float32:
    """IQ4_KSS sub-block scale search: as IQ4_KS's, but every code group is parity-repaired before it is scored
    (both signs are repaired at the positive trial scale, as ik does). Every trial's sums are formed in lanes
    (iq4kss_lane_sums), then compared in ik's order (itry, then the grid half, then the sign)."""
    low, high = slot_values(4)
    inv = np.zeros((2, KSS_LANES), dtype=np.float32)
    dls = np.zeros((2, KSS_LANES), dtype=np.float32)
    sumqx = np.empty((2, KSS_LANES), dtype=np.float32)
    sumq2 = np.empty((2, KSS_LANES), dtype=np.float32)
    for h in range(2):
        off = 16 * h
        for t in range(KSS_TRIALS):
            id_ = np.float32(t - 7 + np.int64(IQ4K[off])) / vmax
            inv[h, 2 * t] = id_
            inv[h, 2 * t + 1] = -id_
            dls[h, 2 * t] = np.float32(1.0) / id_
            dls[h, 2 * t + 1] = dls[h, 2 * t]
        iq4kss_lane_sums(xb, w, inv[h], dls[h], low[h], high[h], IQ4_SLOT_LOW, IQ4_SLOT_HIGH, IQ4K[:16],
                         IQ4K[off : off + 16], np.int64(IQ4K[off]), 241, sumqx[h], sumq2[h])
    best = np.float32(0.0)
    d = -vmax / IQ4K[0]
    for t in range(KSS_TRIALS):
        for h in range(2):
            d, best, _ = keep_better(sumqx[h, 2 * t], sumq2[h, 2 * t], d, best)
            d, best, _ = keep_better(sumqx[h, 2 * t + 1], sumq2[h, 2 * t + 1], d, best)
    return d


@njit(**NJIT)
def _iq4kss_mse(xb: np.ndarray, w: np.ndarray, k: int, off: int, v: int, dl: np.float32,
                mse: np.float32) -> np.float32:
    """mse plus the weighted squared error of group k coded as v (grid half at `off`) at scale dl."""
    for j in range(4):
        p = _group_pos(k, j)
        diff = fmaf(-dl, IQ4K[off + ((v >> (4 * j)) & 0xF)], xb[p])
        mse = fmaf(w[p] * diff, diff, mse)
    return mse


@njit(**NJIT)
def _pack4(q0: int, q1: int, q2: int, q3: int) -> int:
    return q0 | (q1 << 4) | (q2 << 8) | (q3 << 12)


@njit(**KERNEL)
def _quantize_iq4_kss(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    for r in prange(x.shape[0]):
        _iq4kss_row(x[r], qw, out[r])


@njit(**NJIT)
def _iq4kss_row(xr: np.ndarray, qw: np.ndarray, row: np.ndarray) -> None:
    """One row of _quantize_iq4_kss (ikquant/formats/jit.py: why a task is a function of its own)."""
    n = xr.size
    weighted = qw.size > 0
    row[:] = 0
    w_row = np.empty(n, dtype=np.float32)
    if weighted:
        importance(qw, xr, SUB, w_row)
    scales = np.zeros(n // SUB, dtype=np.float32)
    weight = np.empty(SUB, dtype=np.float32)
    vps = np.empty(SUB // 4, dtype=np.int64)
    vms = np.empty(SUB // 4, dtype=np.int64)
    for ibl in range(n // QK):
        xbl = xr[ibl * QK : (ibl + 1) * QK]
        sigma2 = sum_squares(xbl) * np.float32(2.0 / QK)
        for ib in range(8):
            s = ibl * 8 + ib
            xb = xbl[ib * SUB : (ib + 1) * SUB]
            _weights(w_row[s * SUB : (s + 1) * SUB], xb, sigma2, weighted, 0, weight)
            amax, vmax = abs_max(xb)
            if amax >= np.float32(1e-16):
                scales[s] = _iq4kss_search(xb, weight, vmax)
    d = _row_amax(scales) / np.float32(127.0)
    store_f32(row, 0, d)
    if d == 0:
        return
    id_ = np.float32(1.0) / d
    sumqx = np.float32(0.0)
    sumq2 = np.float32(0.0)
    for ibl in range(n // QK):
        blk = row[4 + ibl * IQ4KSS_BYTES : 4 + (ibl + 1) * IQ4KSS_BYTES]
        xbl = xr[ibl * QK : (ibl + 1) * QK]
        sigma2 = sum_squares(xbl) * np.float32(2.0 / QK)
        for ib in range(8):
            s = ibl * 8 + ib
            xb = xbl[ib * SUB : (ib + 1) * SUB]
            _weights(w_row[s * SUB : (s + 1) * SUB], xb, sigma2, weighted, 0, weight)
            l = _scale_level(id_, scales[s])  # odd, so never 0: ik's branch for a zero level is dead
            dl = d * np.float32(l)
            idl = np.float32(1.0) / dl
            mse_p = np.float32(0.0)
            mse_m = np.float32(0.0)
            for k in range(SUB // 4):
                p0, p1, p2, p3 = _iq4kss_group(xb, weight, k, 0, idl, dl)
                m0, m1, m2, m3 = _iq4kss_group(xb, weight, k, 16, idl, dl)
                vps[k] = _pack4(p0, p1, p2, p3)
                vms[k] = _pack4(m0, m1, m2, m3)
                mse_p = _iq4kss_mse(xb, weight, k, 0, vps[k], dl, mse_p)
                mse_m = _iq4kss_mse(xb, weight, k, 16, vms[k], dl, mse_m)
            use_shifted = mse_m < mse_p
            v = vms if use_shifted else vps
            off = 16 if use_shifted else 0
            b = (l + 127) | (1 if use_shifted else 0)
            for k in range(SUB // 4):
                for j in range(4):
                    p = _group_pos(k, j)
                    q = np.float32(np.int64(IQ4K[off + ((v[k] >> (4 * j)) & 0xF)]) * l)
                    wq = weight[p] * q
                    sumqx = fmaf(wq, xb[p], sumqx)
                    sumq2 = fmaf(wq, q, sumq2)
                word = (_iq4kss_encode(v[k]) << 1) | ((b >> k) & 1)
                blk[16 * ib + 2 * k] = np.uint8(word & 0xFF)
                blk[16 * ib + 2 * k + 1] = np.uint8(word >> 8)
    if sumq2 > 0:
        store_f32(row, 0, (sumqx / sumq2) * np.float32(1.01))


@njit(**KERNEL)
def _dequantize_iq4_kss(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        row = q[r]
        y = out[r]
        d = load_f32(row, 0)
        nib = np.empty(16, dtype=np.int64)
        for ibl in range(n // QK):
            o = 4 + ibl * IQ4KSS_BYTES
            for ib in range(8):
                b = 0
                for k in range(8):
                    word = _load_u16(row, o + 16 * ib + 2 * k)
                    a = word & 0xFFFE
                    a ^= a >> 1
                    b |= (word & 1) << k
                    nib[2 * k] = a & 0xFF
                    nib[2 * k + 1] = a >> 8
                dl = d * np.float32((b & 254) - 127)
                off = 16 * (b & 1)
                base = ibl * QK + ib * SUB
                for j in range(16):
                    y[base + j] = dl * IQ4K[off + (nib[j] & 0xF)]
                    y[base + j + 16] = dl * IQ4K[off + (nib[j] >> 4)]


# ---------------------------------------------------------------------------------------------------------------
# Codecs
#
# Accuracy: all six share one row scale, so a 256-value block far smaller than the row's largest is coded with
# integer scales of 0 or +-1 relative to that row scale (IQ4_KS/IQ4_KSS/IQ5_KS cannot even express 0), and its
# error is bounded only by the ROW's largest |x|, not by its own block's. rel_error_bound is therefore relative
# to max|x| over the whole row. Each bound is half the widest gap of the value grid at the largest integer scale
# (the codes are nearest grid points), widened for the integer-scale step and the final least-squares refit of
# the row scale; each is at least 1.5x the worst error measured on random rows of varied shapes and scales.
#
# Range: without an imatrix ik's searches weight values by about x^2 and compare squared weighted sums, about
# (32 * 127 * max|x|^3)^2, which leave float32 beyond max|x| ~ 1.6e5; past that the search silently degrades and
# above ~1e11 it writes inf/NaN. max_abs_input = 1e5 keeps it exact. IQ2_KL weights by |x| and is limited by its
# f16 row scale instead (at most max|x| / 1400 measured): 3e7.
#
# Floors: f16 row scales (IQ2_KS, IQ2_KL, IQ3_KS) round by up to 2^-25 in the f16 subnormal range, which moves a
# value by 2^-25 * (largest |integer scale * grid value|); the floor is twice that. The f32-scaled types zero
# sub-blocks below 1e-16 and their float32 search loses precision below ~1e-10 (x^2 weights underflow): 1e-11.


class IQ2_KSCodec(Codec, type_name="IQ2_KS"):
    max_abs_input = 1e5
    # grid half-gaps up to 9 of a 31 span; measured worst 0.43 of max|x|
    rel_error_bound = 0.75
    abs_error_floor = 2 * 16 * 31 * 2.0**-25

    def __init__(self, slow_search: bool = False) -> None:
        self.slow_search = slow_search

    def with_user_data(self, user_data: dict | None) -> IQ2_KSCodec:
        """ik's quantize_user_data: None (ik's NULL pointer) selects the scalar search; a struct selects the AVX2
        search unless its slow_iq2_ks flag is set. llama-quantize passes a struct with the flag off, which is why
        the default codec uses the AVX2 search."""
        if user_data is None:
            return IQ2_KSCodec(slow_search=True)
        return IQ2_KSCodec(slow_search=bool(user_data.get("slow_iq2_ks", False)))

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq2_ks(x, w, out, self.slow_search)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq2_ks(q, out)


class IQ2_KLCodec(Codec, type_name="IQ2_KL"):
    max_abs_input = 3e7
    # 2-D pair grid: a pair far from every stored pair is coded with the nearest of 8 candidates; measured worst
    # 0.66 of max|x| (constant rows)
    rel_error_bound = 1.0
    abs_error_floor = 2 * 32 * 63 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq2_kl(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq2_kl(q, out)


class IQ3_KSCodec(Codec, type_name="IQ3_KS"):
    max_abs_input = 1e5
    # grid half-gaps up to 11.5 of a 110 span; measured worst 0.23 of max|x|
    rel_error_bound = 0.5
    abs_error_floor = 2 * 16 * 63 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq3_ks(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq3_ks(q, out)


class IQ4_KSCodec(Codec, type_name="IQ4_KS"):
    max_abs_input = 1e5
    # grid half-gaps up to 12 of a 240 span, odd integer scales up to 127; measured worst 0.11 of max|x|
    rel_error_bound = 0.2
    abs_error_floor = 1e-11

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq45_ks(x, w, out, 4)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq4_ks(q, out)


class IQ4_KSSCodec(Codec, type_name="IQ4_KSS"):
    max_abs_input = 1e5
    # as IQ4_KS, but a group of four codes may have one code moved by up to 2 grid steps to even its parity;
    # measured worst 0.23 of max|x|
    rel_error_bound = 0.35
    abs_error_floor = 1e-11

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq4_kss(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq4_kss(q, out)


class IQ5_KSCodec(Codec, type_name="IQ5_KS"):
    max_abs_input = 1e5
    # grid half-gaps up to 6 of a 247 span, odd integer scales up to 127; measured worst 0.06 of max|x|
    rel_error_bound = 0.1
    abs_error_floor = 1e-11

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq45_ks(x, w, out, 5)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq5_ks(q, out)

