"""IQ4_NL and IQ4_XS: 4-bit codes into the non-uniform grid kvalues_iq4nl.

Both run ik's importance-weighted grid search (quantize_row_iq4_nl_impl) on blocks of 32 values. IQ4_NL stores
each block's scale as fp16; IQ4_XS groups 8 blocks in a 256-value super-block with one fp16 scale and a 6-bit
signed integer scale per block, after which the codes are chosen again for the rounded block scales. Without an
imatrix ik weighs each value by x^2.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.base import Codec
from ikquant.formats.iqk_grids import IQ4K_VALUES, IQ4NL_INDEX
from ikquant.formats.numeric import abs_max, fmaf, load_f16, nearest_int_fma, store_f16, trunc_i32

BLOCK = 32
SUPER = 256
NTRY = 7
KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")
SCALAR = dict(cache=True, nogil=True, error_model="numpy")

# ggml-quants.c kvalues_iq4nl: the 16 grid points, the plain half of the IQK grid IQ4K. IQ4NL_INDEX (iqk_grids) maps
# trunc(x) + 127 in [0, 240] to the grid index nearest to every x with that integer part, or 16 + i when x lies
# between points i and i+1.
KVALUES_IQ4NL = IQ4K_VALUES[:16]
# Lookup forms for branch-free (vectorisable) search: the index table extended by the answers for trunc(x) + 127
# below 0 (code 0) and above 240 (code 15), and the grid as float32 with a pad entry so that "next point" is
# always in bounds.
_INDEX_EXT = np.concatenate(([0], IQ4NL_INDEX, [15])).astype(np.int32)
_FVALUES = np.concatenate((KVALUES_IQ4NL, [127])).astype(np.float32)
NTRIAL = 2 * (2 * NTRY + 1)


@njit(**SCALAR)
def best_index_iq4nl(x: np.float32) -> np.int32:
    """ik's best_index_iq4nl for x in grid units: ties and the table's choices exactly as ik, without branches."""
    ix = min(max(trunc_i32(x), np.int32(-128)), np.int32(114)) + np.int32(128)
    k = _INDEX_EXT[ix]
    between = k >= np.int32(16)
    lo = k - np.int32(16) if between else k
    # between points lo and lo+1: ik takes lo only when x is strictly nearer to it
    up = between and not (x - _FVALUES[lo] < _FVALUES[lo + 1] - x)
    return lo + np.int32(up)


@njit(**SCALAR)
def _trial_sums(xb: np.ndarray, weight: np.ndarray, ids: np.ndarray, sumqx: np.ndarray, sumq2: np.ndarray) -> None:
    """sum w*q*x and sum w*q^2 over the block for every trial scale 1/ids[t], q the grid point nearest x*ids[t].

    Each trial accumulates in ik's order with ik's fused multiply-adds; the trials run side by side (vectorised).
    """
    for t in range(ids.size):
        sumqx[t] = np.float32(0.0)
        sumq2[t] = np.float32(0.0)
    for j in range(xb.size):
        xj = xb[j]
        wj = weight[j]
        for t in range(ids.size):
            q = _FVALUES[best_index_iq4nl(ids[t] * xj)]
            wq = q * wj
            sumqx[t] = fmaf(wq, xj, sumqx[t])
            sumq2[t] = fmaf(q, wq, sumq2[t])


@njit(**SCALAR)
def block_scale_iq4nl(xb: np.ndarray, weight: np.ndarray, Lb: np.ndarray, trials: bool = True) -> np.float32:
    """ik's weighted search for one block's scale (ntry 7); Lb receives the codes. A zero block: 0, Lb untouched.
    Without `trials` (ntry -1, ik's KV cache writes) the first scale puts the block's extreme at the grid's low end
    and only the greedy moves follow."""
    n = xb.size
    amax, vmax = abs_max(xb)
    if amax < np.float32(1e-15):
        return np.float32(0.0)
    id_ = np.float32(1.0) / ((-vmax if trials else vmax) / _FVALUES[0])
    sumqx = np.float32(0.0)
    sumq2 = np.float32(0.0)
    for j in range(n):
        l = best_index_iq4nl(id_ * xb[j])
        Lb[j] = l
        q = _FVALUES[l]
        wq = q * weight[j]
        sumqx = fmaf(wq, xb[j], sumqx)
        sumq2 = fmaf(q, wq, sumq2)
    d = sumqx / sumq2
    best = d * sumqx
    if trials:
        d, best, sumqx, sumq2 = _best_trial(xb, weight, Lb, vmax, d, best, sumqx, sumq2)
    return _greedy_moves(xb, weight, Lb, d, best, sumqx, sumq2)


@njit(**SCALAR)
def _best_trial(xb: np.ndarray, weight: np.ndarray, Lb: np.ndarray, vmax: np.float32, d: np.float32,
                best: np.float32, sumqx: np.float32,
                sumq2: np.float32) -> tuple[np.float32, np.float32, np.float32, np.float32]:
    """ik's trial scales (ntry 7) after the first: (d, best, sumqx, sumq2) of the best fit, Lb its codes."""
    n = xb.size
    # ik tries id = (itry + grid end)/max for itry in -7..7, low end then high end, keeping a trial when it beats
    # the best so far; the trials do not depend on each other, so their sums are computed first, side by side
    ids = np.empty(NTRIAL, dtype=np.float32)
    for t in range(NTRIAL):
        edge = np.int32(KVALUES_IQ4NL[15 * (t % 2)])
        ids[t] = np.float32(np.int32(t // 2 - NTRY) + edge) / vmax
    t_sumqx = np.empty(NTRIAL, dtype=np.float32)
    t_sumq2 = np.empty(NTRIAL, dtype=np.float32)
    _trial_sums(xb, weight, ids, t_sumqx, t_sumq2)
    winner = -1
    for t in range(NTRIAL):
        if t_sumq2[t] > 0 and t_sumqx[t] * t_sumqx[t] > best * t_sumq2[t]:
            sumqx = t_sumqx[t]
            sumq2 = t_sumq2[t]
            d = sumqx / sumq2
            best = d * sumqx
            winner = t
    if winner >= 0:
        for j in range(n):
            Lb[j] = best_index_iq4nl(ids[winner] * xb[j])
    return d, best, sumqx, sumq2


@njit(**SCALAR)
def _greedy_moves(xb: np.ndarray, weight: np.ndarray, Lb: np.ndarray, d: np.float32, best: np.float32,
                  sumqx: np.float32, sumq2: np.float32) -> np.float32:
    """ik's greedy single-code moves after the scale search; returns the final scale, Lb the codes."""
    n = xb.size
    # greedy single-code moves: take the one with the smallest step to the next grid point while the fit improves
    for _ in range(32 * n):
        min_step = np.float32(np.inf)
        best_j = -1
        direction = 0
        for j in range(n):
            l = Lb[j]
            g = (d * weight[j]) * fmaf(-d, _FVALUES[l], xb[j])
            if g > 0 and l < 15:
                step = np.float32(np.int32(KVALUES_IQ4NL[l + 1]) - np.int32(KVALUES_IQ4NL[l])) / g
                if step < min_step:
                    min_step = step
                    best_j = j
                    direction = 1
            elif g < 0 and l > 0:
                step = np.float32(np.int32(KVALUES_IQ4NL[l - 1]) - np.int32(KVALUES_IQ4NL[l])) / g
                if step < min_step:
                    min_step = step
                    best_j = j
                    direction = -1
        if best_j < 0:
            break
        wj = weight[best_j]
        v0 = np.int32(KVALUES_IQ4NL[Lb[best_j]])
        v1 = np.int32(KVALUES_IQ4NL[Lb[best_j] + direction])
        new_sumqx = fmaf(wj * xb[best_j], np.float32(v1 - v0), sumqx)
        new_sumq2 = fmaf(wj, np.float32(v1 * v1 - v0 * v0), sumq2)
        if new_sumq2 > 0 and new_sumqx * new_sumqx > best * new_sumq2:
            sumqx = new_sumqx
            sumq2 = new_sumq2
            d = sumqx / sumq2
            best = d * sumqx
            Lb[best_j] += direction
        else:
            break
    return d


@njit(**SCALAR)
def _codes_for_scale(xb: np.ndarray, d: np.float32, Lb: np.ndarray) -> None:
    """Codes nearest x/d (all at the grid point nearest 0 when d is 0)."""
    id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    for j in range(xb.size):
        Lb[j] = best_index_iq4nl(id_ * xb[j])


@njit(**SCALAR)
def _sigma2(x: np.ndarray) -> np.float32:
    """2*mean(x^2) over the super-block; ik's build rounds each square and adds them in order."""
    s = np.float32(0.0)
    for j in range(x.size):
        s += x[j] * x[j]
    return s * (np.float32(2.0) / np.float32(x.size))


@njit(**SCALAR)
def _block_weights(xb: np.ndarray, qw: np.ndarray, sigma2: np.float32, weight: np.ndarray) -> None:
    """imatrix * sqrt(sigma2 + x^2) with ik's fused add, or x^2 without an imatrix."""
    if qw.size:
        for j in range(xb.size):
            weight[j] = qw[j] * np.sqrt(fmaf(xb[j], xb[j], sigma2))
    else:
        for j in range(xb.size):
            weight[j] = xb[j] * xb[j]


@njit(**SCALAR)
def _pack_codes(L: np.ndarray, out: np.ndarray, pos: int) -> None:
    for i in range(L.size // 32):
        for j in range(16):
            out[pos + 16 * i + j] = np.uint8(L[32 * i + j]) | (np.uint8(L[32 * i + 16 + j]) << np.uint8(4))


@njit(**KERNEL)
def _quantize_iq4_nl(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    for r in prange(n_rows):
        L = np.zeros(BLOCK, dtype=np.uint8)
        weight = np.empty(BLOCK, dtype=np.float32)
        for ib in range(n // BLOCK):
            xb = x[r, ib * BLOCK : (ib + 1) * BLOCK]
            # each block is its own super-block
            sigma2 = _sigma2(xb) if qw.size else np.float32(0.0)
            _block_weights(xb, qw[ib * BLOCK : (ib + 1) * BLOCK] if qw.size else qw, sigma2, weight)
            d = block_scale_iq4nl(xb, weight, L)
            store_f16(out[r], ib * 18, d)
            _codes_for_scale(xb, d, L)
            _pack_codes(L, out[r], ib * 18 + 2)


@njit(**KERNEL)
def _quantize_iq4_xs(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    nsub = SUPER // BLOCK
    for r in prange(n_rows):
        L = np.zeros(SUPER, dtype=np.uint8)
        weight = np.empty(BLOCK, dtype=np.float32)
        scales = np.empty(nsub, dtype=np.float32)
        for ibl in range(n // SUPER):
            xs = x[r, ibl * SUPER : (ibl + 1) * SUPER]
            sigma2 = _sigma2(xs) if qw.size else np.float32(0.0)
            max_scale = np.float32(0.0)
            amax_scale = np.float32(0.0)
            for ib in range(nsub):
                xb = xs[ib * BLOCK : (ib + 1) * BLOCK]
                lo = ibl * SUPER + ib * BLOCK
                _block_weights(xb, qw[lo : lo + BLOCK] if qw.size else qw, sigma2, weight)
                scales[ib] = block_scale_iq4nl(xb, weight, L[ib * BLOCK : (ib + 1) * BLOCK])
                if abs(scales[ib]) > amax_scale:
                    amax_scale = abs(scales[ib])
                    max_scale = scales[ib]
            o = ibl * 136
            d = -max_scale * np.float32(1.0 / 32)
            store_f16(out[r], o, d)
            id_ = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            scales_h = np.uint16(0)
            for ib in range(nsub):
                l = min(31, max(-32, nearest_int_fma(id_, scales[ib])))
                _codes_for_scale(xs[ib * BLOCK : (ib + 1) * BLOCK], d * np.float32(l), L[ib * BLOCK : (ib + 1) * BLOCK])
                ls = np.uint8(l + 32)
                if ib % 2 == 0:
                    out[r, o + 4 + ib // 2] = ls & np.uint8(15)
                else:
                    out[r, o + 4 + ib // 2] |= (ls & np.uint8(15)) << np.uint8(4)
                scales_h |= np.uint16(ls >> np.uint8(4)) << np.uint16(2 * ib)
            out[r, o + 2] = np.uint8(scales_h & np.uint16(0xFF))
            out[r, o + 3] = np.uint8(scales_h >> np.uint16(8))
            _pack_codes(L, out[r], o + 8)


# The dequantizers take the block length as a run-time argument and index block slices with the bare loop
# counter, which lets LLVM vectorise the 16-value loops (see legacy.py).


@njit(**KERNEL)
def _dequantize_iq4_nl(q: np.ndarray, out: np.ndarray, qk: int) -> None:
    n_rows, n = out.shape
    half = qk // 2
    for r in prange(n_rows):
        qr = q[r]
        for ib in range(n // qk):
            o = ib * 18
            d = load_f16(qr, o)
            src = qr[o + 2 : o + 2 + half]
            lo = out[r, ib * qk : ib * qk + half]
            hi = out[r, ib * qk + half : (ib + 1) * qk]
            for j in range(half):
                lo[j] = d * _FVALUES[src[j] & np.uint8(15)]
            for j in range(half):
                hi[j] = d * _FVALUES[src[j] >> np.uint8(4)]


@njit(**KERNEL)
def _dequantize_iq4_xs(q: np.ndarray, out: np.ndarray, qk: int) -> None:
    n_rows, n = out.shape
    half = qk // 2
    for r in prange(n_rows):
        qr = q[r]
        for ibl in range(n // SUPER):
            o = ibl * 136
            d = load_f16(qr, o)
            scales_h = np.int32(qr[o + 2]) | (np.int32(qr[o + 3]) << np.int32(8))
            for ib in range(SUPER // qk):
                ls = (np.int32(qr[o + 4 + ib // 2]) >> np.int32(4 * (ib % 2))) & np.int32(15)
                ls |= ((scales_h >> np.int32(2 * ib)) & np.int32(3)) << np.int32(4)
                dl = d * np.float32(ls - np.int32(32))
                src = qr[o + 8 + ib * half : o + 8 + (ib + 1) * half]
                y = ibl * SUPER + ib * qk
                lo = out[r, y : y + half]
                hi = out[r, y + half : y + qk]
                for j in range(half):
                    lo[j] = dl * _FVALUES[src[j] & np.uint8(15)]
                for j in range(half):
                    hi[j] = dl * _FVALUES[src[j] >> np.uint8(4)]


# Accuracy of ik's search without an imatrix: each value weighs x^2, so a zero carries no weight. When one value
# dominates a block, the fitted scale d can put it on grid point 1 (|d| up to amax, the fit being a weighted mean
# of x/q with |q| >= 1); the grid point nearest 0 is then d itself and a value of either sign can come back as d:
# an error up to |x| + |d| <= 2*amax, plus fp16 rounding of the scale. Typical blocks stay near amax/20; the
# worst seen on sparse random blocks is 1.005*amax. |d| <= amax also sets max_abs_input (fp16 scale).


class IQ4_NLCodec(Codec, type_name="IQ4_NL"):
    block_scale_f16 = 0
    max_abs_input = 65504.0
    rel_error_bound = 2.0 + 2.0**-9
    abs_error_floor = 128 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq4_nl(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq4_nl(q, out, BLOCK)


class IQ4_XSCodec(Codec, type_name="IQ4_XS"):
    block_scale_f16 = 0
    # as IQ4_NL: the block scale d*l (fp16 d = -max_scale/32, 6-bit l) stays within max_scale <= amax
    max_abs_input = 65504.0
    rel_error_bound = 2.0 + 2.0**-9
    abs_error_floor = 128 * 32 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq4_xs(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq4_xs(q, out, BLOCK)

