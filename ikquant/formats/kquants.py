"""k-quants: Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (256-value super-blocks of 16- or 32-value sub-blocks).

ik picks one of two quantizers per call, by whether an importance vector is given. Without one it runs the
reference search (make_qkx2_quants, make_q3_quants, or make_qx_quants weighted by x^2) and rounds the sub-block
scales against their maximum. With one it runs the weighted search (make_qkx3_quants, make_qx_quants) and then
fits the sub-block scales themselves with a weighted search (make_qp_quants, make_qx_quants). Q2_K without weights
first tests whether everything passed in one call is ternary ({-max, 0, +max}); that test spans all rows of one
`quantize` call, exactly as it spans one ggml_quantize_chunk call in ik.

The float arithmetic follows ik's GCC build (-O3, FMA contraction on) operation by operation, read from its
assembly: `fmaf`/`fma64` where GCC fused a multiply-add, separately rounded products summed in order where it
vectorised a loop. Quantized bytes match ik's build on the golden cases and on random data.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.base import Codec
from ikquant.formats.numeric import abs_max, fmaf, load_f16, nearest_int_fma, store_f16
from ikquant.formats.scale_search import (
    LANES32,
    lane_error_f32,
    lane_trial_f32,
    make_qkx3_blocks,
    make_qx_quants,
    qkx3_scratch,
    qx_scratch,
)

QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)
# error_model numpy: float division by zero gives inf/nan as in C instead of raising
NJ = dict(cache=True, nogil=True, error_model="numpy")
KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")
FP16_MAX = 65504.0
FP16_STEP = 2.0**-24


@njit(**NJ)
def _nearest_int_div(x: np.float32, d: np.float32) -> np.int32:
    """ggml's nearest_int(x / d): the quotient is rounded first, so there is no product to fuse into the add."""
    return nearest_int_fma(x / d, np.float32(1.0))


# ---------------------------------------------------------------------------------------------------------------
# Scale searches only the k-quants run (ik's make_*_quants, specialised to their sizes and flags)
# ---------------------------------------------------------------------------------------------------------------


@njit(**NJ)
def make_q3_quants16(x: np.ndarray, L: np.ndarray) -> np.float32:
    """ik's make_q3_quants(16, 4, do_rmse=true): x^2-weighted symmetric scale with coordinate-wise refinement.

    Returns the scale; L receives codes in [0, 8).
    """
    nmax = 4
    amax, fmax = abs_max(x[:16])
    if amax < GROUP_MAX_EPS:
        for i in range(16):
            L[i] = 0
        return np.float32(0.0)
    iscale = np.float32(-4.0) / fmax
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(16):
        l = min(nmax - 1, max(-nmax, nearest_int_fma(iscale, x[i])))
        L[i] = l
        fl = np.float32(l)
        w = x[i] * x[i]
        sumlx = fmaf(w * x[i], fl, sumlx)
        suml2 = fmaf(w * fl, fl, suml2)
    for _ in range(5):
        n_changed = 0
        for i in range(16):
            w = x[i] * x[i]
            wx = w * x[i]
            li = np.float32(L[i])
            slx = fmaf(-wx, li, sumlx)
            if slx > 0:
                sl2 = fmaf(-(w * li), li, suml2)
                new_l = min(nmax - 1, max(-nmax, _nearest_int_div(x[i] * sl2, slx)))
                if new_l != L[i]:
                    fl = np.float32(new_l)
                    slx = fmaf(wx, fl, slx)
                    sl2 = fmaf(w * fl, fl, sl2)
                    if sl2 > 0 and (slx * slx) * suml2 > (sumlx * sumlx) * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(16):
        L[i] += nmax
    return sumlx / suml2


@njit(**NJ)
def _qkx2_start(nmax: int, x: np.ndarray, w: np.ndarray, L: np.ndarray, use_mad: bool, fused_sum_x: bool
                ) -> tuple[bool, np.float32, np.float32, np.float32, np.float32, np.float32, np.float32]:
    """make_qkx2_quants up to its trials: (whether the block has a range, min clamped to <= 0, max, sum w, sum w x,
    the plain grid's scale, its weighted error), L the plain grid's codes (zeros for a flat block)."""
    n = x.size
    fmin = x[0]
    fmax = x[0]
    sum_w = w[0]
    sum_x = w[0] * x[0]
    for i in range(1, n):
        fmin = min(fmin, x[i])
        fmax = max(fmax, x[i])
        sum_w += w[i]
        sum_x = fmaf(w[i], x[i], sum_x) if fused_sum_x else sum_x + w[i] * x[i]
    if fmin > 0:
        fmin = np.float32(0.0)
    if fmax - fmin < np.float32(1e-10):
        for i in range(n):
            L[i] = 0
        return False, fmin, fmax, sum_w, sum_x, np.float32(0.0), np.float32(0.0)
    iscale = np.float32(nmax) / (fmax - fmin)
    scale = np.float32(1.0) / iscale
    best_mad = np.float32(0.0)
    for i in range(n):
        l = min(nmax, max(0, nearest_int_fma(iscale, x[i] - fmin)))
        L[i] = l
        diff = fmaf(np.float32(l), scale, fmin) - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best_mad = fmaf(w[i], diff, best_mad)
    return True, fmin, fmax, sum_w, sum_x, scale, best_mad


@njit(**NJ)
def _qkx2_fit(sum_w: np.float32, sum_x: np.float32, sum_l: np.float32, sum_l2: np.float32, sum_xl: np.float32
              ) -> tuple[bool, np.float32, np.float32]:
    """A trial's least-squares (scale, min), min clamped to <= 0: (whether it has a fit, scale, min)."""
    D = fmaf(sum_w, sum_l2, -(sum_l * sum_l))
    if not D > 0:
        return False, np.float32(0.0), np.float32(0.0)
    this_min = fmaf(sum_l2, sum_x, -(sum_l * sum_xl)) / D
    if this_min > 0:
        return True, sum_xl / sum_l2, np.float32(0.0)
    return True, fmaf(-sum_x, sum_l, sum_w * sum_xl) / D, this_min


@njit(**NJ)
def _trial_iscale2(step: int, rdelta: np.float32, rmin: np.float32, nmax: int, fmin: np.float32, fmax: np.float32
                   ) -> np.float32:
    return (fmaf(np.float32(step), rdelta, rmin) + np.float32(nmax)) / (fmax - fmin)


@njit(**NJ)
def make_qkx2_quants(
    nmax: int, x: np.ndarray, w: np.ndarray, L: np.ndarray, Laux: np.ndarray,
    rmin: np.float32, rdelta: np.float32, nstep: int, use_mad: bool, fused_sum_x: bool,
) -> tuple[np.float32, np.float32]:
    """ik's make_qkx2_quants: asymmetric (scale, min) search over nstep+1 trial scales, float32 sums.

    Returns (scale, -min); L receives codes in [0, nmax]. GCC contracts the weighted sum of x into FMAs in the
    16-value copy (Q2_K) but not in the 32-value one (Q4_K, Q5_K): `fused_sum_x` selects which.
    """
    n = x.size
    live, fmin, fmax, sum_w, sum_x, scale, best_mad = _qkx2_start(nmax, x, w, L, use_mad, fused_sum_x)
    if not live:
        return np.float32(0.0), -fmin
    for step in range(nstep + 1):
        iscale = _trial_iscale2(step, rdelta, rmin, nmax, fmin, fmax)
        sum_l = np.float32(0.0)
        sum_l2 = np.float32(0.0)
        sum_xl = np.float32(0.0)
        for i in range(n):
            l = min(nmax, max(0, nearest_int_fma(iscale, x[i] - fmin)))
            Laux[i] = l
            fl = np.float32(l)
            wl = w[i] * fl
            sum_l += wl
            sum_l2 = fmaf(wl, fl, sum_l2)
            sum_xl = fmaf(wl, x[i], sum_xl)
        fits, this_scale, this_min = _qkx2_fit(sum_w, sum_x, sum_l, sum_l2, sum_xl)
        if fits:
            mad = np.float32(0.0)
            for i in range(n):
                diff = fmaf(np.float32(Laux[i]), this_scale, this_min) - x[i]
                diff = abs(diff) if use_mad else diff * diff
                mad = fmaf(w[i], diff, mad)
            if mad < best_mad:
                for i in range(n):
                    L[i] = Laux[i]
                best_mad = mad
                scale = this_scale
                fmin = this_min
    return scale, -fmin


@njit(**NJ)
def qkx2_scratch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """make_qkx2_blocks' working arrays for blocks of n values: the lanes' values, weights and codes
    [n, LANES32], their float32 state, which lanes are live."""
    return (np.empty((n, LANES32), np.float32), np.empty((n, LANES32), np.float32),
            np.empty((n, LANES32), np.int32), np.zeros((13, LANES32), np.float32), np.zeros(LANES32, np.bool_))


@njit(**NJ)
def make_qkx2_blocks(nmax: int, x: np.ndarray, w: np.ndarray, L: np.ndarray, rmin: np.float32, rdelta: np.float32,
                     nstep: int, use_mad: bool, fused_sum_x: bool, scales: np.ndarray, mins: np.ndarray,
                     scratch: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> None:
    """make_qkx2_quants over every block (row) of x [blocks, n] (w, L alike) into scales and (negated) mins, the
    same bits, LANES32 blocks side by side: each trial's float32 sums and error are chains of dependent
    multiply-adds in ik's order, so one block waits on latency while eight lanes of a vector advance together.
    Blocks past the last whole group of LANES32 take the one-block search. `scratch`: qkx2_scratch(n)."""
    nb, n = x.shape
    top = np.int32(nmax)
    xt, wt, codes, state, live = scratch
    fmin, fmax, sum_w, sum_x, scale, best_mad, iscale = (state[0], state[1], state[2], state[3], state[4], state[5],
                                                         state[6])
    t_scale, t_min, mad, sums = state[7], state[8], state[9], state[10:13]
    for b0 in range(0, nb - nb % LANES32, LANES32):
        for k in range(LANES32):
            b = b0 + k
            live[k], fmin[k], fmax[k], sum_w[k], sum_x[k], scale[k], best_mad[k] = _qkx2_start(
                nmax, x[b], w[b], L[b], use_mad, fused_sum_x)
            if not live[k]:
                fmax[k] = fmin[k] + np.float32(1.0)  # a flat lane computes on a harmless range, never read
            for i in range(n):
                xt[i, k] = x[b, i]
                wt[i, k] = w[b, i]
        for step in range(nstep + 1):
            for k in range(LANES32):
                iscale[k] = _trial_iscale2(step, rdelta, rmin, nmax, fmin[k], fmax[k])
            lane_trial_f32(xt, wt, fmin, iscale, top, codes, sums)
            any_fit = False
            for k in range(LANES32):
                fits, t_scale[k], t_min[k] = _qkx2_fit(sum_w[k], sum_x[k], sums[0, k], sums[1, k], sums[2, k])
                if not (fits and live[k]):
                    t_scale[k] = np.nan  # no fit: its error is NaN, never below the best
                any_fit |= fits and live[k]
            if not any_fit:
                continue
            lane_error_f32(xt, wt, codes, t_scale, t_min, use_mad, mad)
            for k in range(LANES32):
                if mad[k] < best_mad[k]:
                    for i in range(n):
                        L[b0 + k, i] = codes[i, k]
                    best_mad[k] = mad[k]
                    scale[k] = t_scale[k]
                    fmin[k] = t_min[k]
        for k in range(LANES32):
            b = b0 + k
            scales[b], mins[b] = scale[k], -fmin[k]
    laux = np.empty(n, L.dtype)
    for b in range(nb - nb % LANES32, nb):
        scales[b], mins[b] = make_qkx2_quants(nmax, x[b], w[b], L[b], laux, rmin, rdelta, nstep, use_mad,
                                              fused_sum_x)


@njit(**NJ)
def make_qp_quants(nmax: int, x: np.ndarray, L: np.ndarray, w: np.ndarray) -> np.float32:
    """ik's make_qp_quants: weighted scale for non-negative values (the sub-block scales/mins) on codes 0..nmax.

    L is uint8 as in ik (a code from a negative input wraps exactly as there). Where no weight falls on a non-zero
    code the result is 0/0 = NaN, as in ik; Codec.quantize then redoes such rows without weights.
    """
    n = x.size
    fmax = np.float32(0.0)
    for i in range(n):
        fmax = max(fmax, x[i])
    if fmax < np.float32(1e-16):
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    iscale = np.float32(nmax) / fmax
    for i in range(n):
        L[i] = nearest_int_fma(iscale, x[i]) & 255
    scale = np.float32(1.0) / iscale
    best_mse = np.float32(0.0)
    for i in range(n):
        diff = fmaf(-np.float32(L[i]), scale, x[i])
        best_mse = fmaf(w[i] * diff, diff, best_mse)
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = fmaf(np.float32(step), np.float32(0.1), np.float32(nmax)) / fmax
        scale_is = np.float32(1.0) / iscale_is
        mse = np.float32(0.0)
        for i in range(n):
            l = min(nmax, nearest_int_fma(iscale_is, x[i]))
            diff = fmaf(-np.float32(l), scale_is, x[i])
            mse = fmaf(w[i] * diff, diff, mse)
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        l = min(nmax, nearest_int_fma(iscale, x[i]))
        L[i] = l & 255
        fl = np.float32(l)
        sumlx = fmaf(w[i] * x[i], fl, sumlx)
        suml2 = fmaf(w[i] * fl, fl, suml2)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            li = np.float32(L[i])
            wx = w[i] * x[i]
            slx = fmaf(-wx, li, sumlx)
            if slx > 0:
                sl2 = fmaf(-(w[i] * li), li, suml2)
                if sl2 > 0:
                    new_l = min(nmax, _nearest_int_div(x[i] * sl2, slx))
                    if new_l != np.int32(L[i]):
                        fl = np.float32(new_l)
                        slx = fmaf(wx, fl, slx)
                        sl2 = fmaf(w[i] * fl, fl, sl2)
                        if (slx * slx) * suml2 > (sumlx * sumlx) * sl2:
                            L[i] = new_l & 255
                            sumlx = slx
                            suml2 = sl2
                            n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2


# ---------------------------------------------------------------------------------------------------------------
# Q2_K: 16 x 16 values, 2-bit codes, 4-bit scales and mins, fp16 d and dmin
# ---------------------------------------------------------------------------------------------------------------


@njit(**NJ)
def _pack_2bit(ob: np.ndarray, pos: int, L: np.ndarray) -> None:
    """256 2-bit codes into 64 bytes at ob[pos:] (byte l of each 32-byte half holds values l, l+32, l+64, l+96)."""
    for h in range(2):
        for l in range(32):
            b = 128 * h + l
            ob[pos + 32 * h + l] = (
                np.uint8(L[b]) | (np.uint8(L[b + 32]) << np.uint8(2))
                | (np.uint8(L[b + 64]) << np.uint8(4)) | (np.uint8(L[b + 96]) << np.uint8(6))
            )


@njit(**NJ)
def _q2_k_ternary_max(x: np.ndarray) -> np.float32:
    """max|x| over everything when snapping to {-max, 0, max} keeps 90% of the energy (ik's TriNet test), else -1.

    ik runs this over all rows passed in one call, sequentially, so it is one float32 chain here too.
    """
    fmax = np.float32(0.0)
    for v in x.flat:
        fmax = max(fmax, abs(v))
    half = np.float32(0.5) * fmax
    mse0 = np.float32(0.0)
    mse = np.float32(0.0)
    for v in x.flat:
        mse0 = fmaf(v, v, mse0)
        diff = v + fmax if v < -half else (v if v < half else v - fmax)
        mse = fmaf(diff, diff, mse)
    return fmax if mse < np.float32(0.1) * mse0 else np.float32(-1.0)


@njit(**KERNEL)
def _quantize_q2_k_ternary(x: np.ndarray, fmax: np.float32, out: np.ndarray) -> None:
    """Every value snapped to -max, 0 or +max: d = dmin = max, all 4-bit scales and mins 1, codes 0/1/2."""
    n_rows, n = x.shape
    half = np.float32(0.5) * fmax
    for r in prange(n_rows):
        L = np.empty(QK_K, dtype=np.uint8)
        for ib in range(n // QK_K):
            xb = x[r, ib * QK_K : (ib + 1) * QK_K]
            ob = out[r, ib * 84 : (ib + 1) * 84]
            store_f16(ob, 80, fmax)
            store_f16(ob, 82, fmax)
            for j in range(16):
                ob[j] = 0x11
            for j in range(QK_K):
                L[j] = 0 if xb[j] < -half else (1 if xb[j] < half else 2)
            _pack_2bit(ob, 16, L)


@njit(**NJ)
def _requantize_q2_k(ob: np.ndarray, xb: np.ndarray, L: np.ndarray) -> None:
    """Codes for each 16-value sub-block from the stored fp16 d/dmin and 4-bit scale/min."""
    d = load_f16(ob, 80)
    dmin = load_f16(ob, 82)
    for j in range(16):
        dl = d * np.float32(ob[j] & np.uint8(15))
        if dl == 0:
            continue
        ml = dmin * np.float32(ob[j] >> np.uint8(4))
        for i in range(16):
            L[16 * j + i] = min(3, max(0, _nearest_int_div(xb[16 * j + i] + ml, dl)))


@njit(**KERNEL)
def _quantize_q2_k_ref(x: np.ndarray, out: np.ndarray) -> None:
    """|x|-weighted (scale, min) per 16 values, 4-bit against their maxima; codes re-derived from what is stored."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        L = np.empty(QK_K, dtype=np.uint8)
        w = np.empty((16, 16), dtype=np.float32)
        scales = np.empty(16, dtype=np.float32)
        mins = np.empty(16, dtype=np.float32)
        scratch = qkx2_scratch(16)
        for ib in range(n // QK_K):
            xb = x[r, ib * QK_K : (ib + 1) * QK_K]
            ob = out[r, ib * 84 : (ib + 1) * 84]
            max_scale = np.float32(0.0)
            max_min = np.float32(0.0)
            for j in range(16):
                for i in range(16):
                    w[j, i] = abs(xb[16 * j + i])
            make_qkx2_blocks(3, xb.reshape(16, 16), w, L.reshape(16, 16), np.float32(-0.5), np.float32(0.1), 15, True,
                             True, scales, mins, scratch)
            for j in range(16):
                max_scale = max(max_scale, scales[j])
                max_min = max(max_min, mins[j])
            if max_scale > 0:
                iscale = np.float32(15.0) / max_scale
                for j in range(16):
                    ob[j] = np.uint8(nearest_int_fma(iscale, scales[j]) & 255)
                store_f16(ob, 80, max_scale / np.float32(15.0))
            else:
                for j in range(16):
                    ob[j] = 0
                store_f16(ob, 80, np.float32(0.0))
            if max_min > 0:
                iscale = np.float32(15.0) / max_min
                for j in range(16):
                    ob[j] |= np.uint8((nearest_int_fma(iscale, mins[j]) << 4) & 255)
                store_f16(ob, 82, max_min / np.float32(15.0))
            else:
                store_f16(ob, 82, np.float32(0.0))
            _requantize_q2_k(ob, xb, L)
            _pack_2bit(ob, 16, L)


@njit(**KERNEL)
def _quantize_q2_k_imat(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Unlike the other types, ik re-derives the codes here from the unrounded dm, mm (not their fp16) via 1/d."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        scratch = qkx3_scratch(16)
        L = np.empty(QK_K, dtype=np.uint8)
        Ls = np.empty(16, dtype=np.uint8)
        Lm = np.empty(16, dtype=np.uint8)
        w = np.empty((16, 16), dtype=np.float32)
        sw = np.empty(16, dtype=np.float32)
        scales = np.empty(16, dtype=np.float32)
        mins = np.empty(16, dtype=np.float32)
        for ib in range(n // QK_K):
            xb = x[r, ib * QK_K : (ib + 1) * QK_K]
            ob = out[r, ib * 84 : (ib + 1) * 84]
            sumx2 = np.float32(0.0)
            for i in range(QK_K):
                sumx2 += xb[i] * xb[i]
            sigma2 = np.float32(0.75) * sumx2 * np.float32(1.0 / QK_K)
            for j in range(16):
                xs = xb[16 * j : 16 * j + 16]
                sumw = np.float32(0.0)
                for i in range(16):
                    w[j, i] = qw[ib * QK_K + 16 * j + i] * np.sqrt(fmaf(xs[i], xs[i], sigma2))
                    sumw += w[j, i]
                sw[j] = sumw
            make_qkx3_blocks(3, xb.reshape(16, 16), w, L.reshape(16, 16), True, scales, mins, scratch)
            for j in range(16):
                mins[j] = -mins[j]
            dm = make_qp_quants(15, scales, Ls, sw)
            mm = make_qp_quants(15, mins, Lm, sw)
            store_f16(ob, 80, dm)
            store_f16(ob, 82, mm)
            for j in range(16):
                d = dm * np.float32(Ls[j])
                idv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
                fm = np.float32(Lm[j])
                for i in range(16):
                    q = nearest_int_fma(fmaf(mm, fm, xb[16 * j + i]), idv)
                    L[16 * j + i] = min(3, max(0, q))
                ob[j] = Ls[j] | (Lm[j] << np.uint8(4))
            _pack_2bit(ob, 16, L)


@njit(**KERNEL)
def _dequantize_q2_k(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        dls = np.empty(16, dtype=np.float32)
        mls = np.empty(16, dtype=np.float32)
        for ib in range(n // QK_K):
            qb = q[r, ib * 84 : (ib + 1) * 84]
            y = out[r, ib * QK_K : (ib + 1) * QK_K]
            d = load_f16(qb, 80)
            dmin = load_f16(qb, 82)
            for j in range(16):
                dls[j] = d * np.float32(qb[j] & np.uint8(15))
                mls[j] = dmin * np.float32(qb[j] >> np.uint8(4))
            for e in range(QK_K):
                c = (np.int32(qb[16 + 32 * (e // 128) + e % 32]) >> (2 * ((e % 128) // 32))) & 3
                y[e] = dls[e // 16] * np.float32(c) - mls[e // 16]


# ---------------------------------------------------------------------------------------------------------------
# Q3_K: 16 x 16 values, 3-bit codes (2 bits + high-bit mask), signed 6-bit scales, fp16 d
# ---------------------------------------------------------------------------------------------------------------


@njit(**NJ)
def _pack_q3_k(ob: np.ndarray, L: np.ndarray, Ls: np.ndarray, xb: np.ndarray, d_block: np.float32) -> None:
    """Store Q3_K's 6-bit scales Ls (0..63, offset 32) and d, requantize x with the stored scales, pack the codes."""
    for j in range(12):
        ob[96 + j] = 0
    for j in range(16):
        l = np.uint8(Ls[j])
        if j < 8:
            ob[96 + j] = l & np.uint8(15)
        else:
            ob[96 + j - 8] |= (l & np.uint8(15)) << np.uint8(4)
        ob[104 + j % 4] |= (l >> np.uint8(4)) << np.uint8(2 * (j // 4))
    store_f16(ob, 108, d_block)
    d = load_f16(ob, 108)
    for j in range(16):
        dl = d * np.float32(np.int32(Ls[j]) - 32)
        if dl == 0:
            continue
        for i in range(16):
            L[16 * j + i] = min(3, max(-4, _nearest_int_div(xb[16 * j + i], dl))) + 4
    for j in range(32):
        ob[j] = 0
    for j in range(QK_K):
        if L[j] > 3:
            ob[j % 32] |= np.uint8(1) << np.uint8(j // 32)
            L[j] -= 4
    _pack_2bit(ob, 32, L)


@njit(**KERNEL)
def _quantize_q3_k_ref(x: np.ndarray, out: np.ndarray) -> None:
    """Sub-block scales rounded to 6 bits against the largest |scale|, d = that scale / -32."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        L = np.empty(QK_K, dtype=np.int8)
        Ls = np.empty(16, dtype=np.int8)
        scales = np.empty(16, dtype=np.float32)
        for ib in range(n // QK_K):
            xb = x[r, ib * QK_K : (ib + 1) * QK_K]
            ob = out[r, ib * 110 : (ib + 1) * 110]
            max_scale = np.float32(0.0)
            amax = np.float32(0.0)
            for j in range(16):
                s = make_q3_quants16(xb[16 * j : 16 * j + 16], L[16 * j : 16 * j + 16])
                scales[j] = s
                if abs(s) > amax:
                    amax = abs(s)
                    max_scale = s
            if max_scale != 0:
                iscale = np.float32(-32.0) / max_scale
                for j in range(16):
                    Ls[j] = min(31, max(-32, int(np.int8(nearest_int_fma(iscale, scales[j]))))) + 32
                d_block = np.float32(1.0) / iscale
            else:
                for j in range(16):
                    Ls[j] = 0
                d_block = np.float32(0.0)
            _pack_q3_k(ob, L, Ls, xb, d_block)


@njit(**KERNEL)
def _quantize_q3_k_imat(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Sub-block scales themselves quantized by a weighted make_qx_quants (codes -32..31, weights = their sums)."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        scratch = qx_scratch(16)
        L = np.empty(QK_K, dtype=np.int8)
        Ls = np.empty(16, dtype=np.int8)
        scales = np.empty(16, dtype=np.float32)
        sw = np.empty(16, dtype=np.float32)
        w = np.empty(16, dtype=np.float32)
        for ib in range(n // QK_K):
            xb = x[r, ib * QK_K : (ib + 1) * QK_K]
            ob = out[r, ib * 110 : (ib + 1) * 110]
            sumx2 = np.float32(0.0)
            for j in range(QK_K):
                sumx2 += xb[j] * xb[j]
            sigma2 = (sumx2 + sumx2) * np.float32(1.0 / QK_K)
            for j in range(16):
                sumw = np.float32(0.0)
                for i in range(16):
                    v = xb[16 * j + i]
                    w[i] = qw[ib * QK_K + 16 * j + i] * np.sqrt(fmaf(v, v, sigma2))
                    sumw += w[i]
                sw[j] = sumw
                scales[j] = make_qx_quants(16, 4, xb[16 * j : 16 * j + 16], L[16 * j : 16 * j + 16], w, scratch)
            d_block = make_qx_quants(16, 32, scales, Ls, sw, scratch)
            _pack_q3_k(ob, L, Ls, xb, d_block)


@njit(**KERNEL)
def _dequantize_q3_k(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        dls = np.empty(16, dtype=np.float32)
        for ib in range(n // QK_K):
            qb = q[r, ib * 110 : (ib + 1) * 110]
            y = out[r, ib * QK_K : (ib + 1) * QK_K]
            d = load_f16(qb, 108)
            for j in range(16):
                lo = (np.int32(qb[96 + j % 8]) >> (4 * (j // 8))) & 15
                hi = (np.int32(qb[104 + j % 4]) >> (2 * (j // 4))) & 3
                dls[j] = d * np.float32((lo | (hi << 4)) - 32)
            for e in range(QK_K):
                c = (np.int32(qb[32 + 32 * (e // 128) + e % 32]) >> (2 * ((e % 128) // 32))) & 3
                hb = (np.int32(qb[e % 32]) >> (e // 32)) & 1
                y[e] = dls[e // 16] * np.float32(c - 4 + 4 * hb)


# ---------------------------------------------------------------------------------------------------------------
# Q4_K and Q5_K: 8 x 32 values, 4- or 5-bit codes, 6-bit scales and mins, fp16 d and dmin
# ---------------------------------------------------------------------------------------------------------------


@njit(**NJ)
def _pack_scales_k4(ob: np.ndarray, Ls: np.ndarray, Lm: np.ndarray) -> None:
    """Q4_K/Q5_K 12-byte packing of eight 6-bit scales and eight 6-bit mins at ob[4:16]."""
    for j in range(8):
        ls = np.uint8(Ls[j])
        lm = np.uint8(Lm[j])
        if j < 4:
            ob[4 + j] = ls
            ob[8 + j] = lm
        else:
            ob[8 + j] = (ls & np.uint8(15)) | ((lm & np.uint8(15)) << np.uint8(4))
            ob[j] |= (ls >> np.uint8(4)) << np.uint8(6)
            ob[4 + j] |= (lm >> np.uint8(4)) << np.uint8(6)


@njit(**NJ)
def scale_min_k4(ob: np.ndarray, j: int) -> tuple[np.int32, np.int32]:
    """Unpack the 6-bit (scale, min) of sub-block j from Q4_K/Q5_K's 12 scale bytes at ob[4:16]."""
    if j < 4:
        return np.int32(ob[4 + j] & np.uint8(63)), np.int32(ob[8 + j] & np.uint8(63))
    sc = np.int32(ob[8 + j] & np.uint8(15)) | (np.int32(ob[j] >> np.uint8(6)) << 4)
    mn = np.int32(ob[8 + j] >> np.uint8(4)) | (np.int32(ob[4 + j] >> np.uint8(6)) << 4)
    return sc, mn


@njit(**NJ)
def _k4_ref_scales(ob: np.ndarray, scales: np.ndarray, mins: np.ndarray, Ls: np.ndarray, Lm: np.ndarray) -> None:
    """Reference path: quantize the 8 sub-block scales and mins to 6 bits against their maxima, store d and dmin."""
    max_scale = np.float32(0.0)
    max_min = np.float32(0.0)
    for j in range(8):
        max_scale = max(max_scale, scales[j])
        max_min = max(max_min, mins[j])
    inv_scale = np.float32(63.0) / max_scale if max_scale > 0 else np.float32(0.0)
    inv_min = np.float32(63.0) / max_min if max_min > 0 else np.float32(0.0)
    for j in range(8):
        Ls[j] = min(63, nearest_int_fma(inv_scale, scales[j]) & 255)
        Lm[j] = min(63, nearest_int_fma(inv_min, mins[j]) & 255)
    store_f16(ob, 0, max_scale / np.float32(63.0))
    store_f16(ob, 2, max_min / np.float32(63.0))


@njit(**NJ)
def _requantize_k4(ob: np.ndarray, xb: np.ndarray, L: np.ndarray, nmax: int) -> None:
    """Codes for each 32-value sub-block from the stored fp16 d/dmin and 6-bit scale/min (as ik re-derives them)."""
    d = load_f16(ob, 0)
    dmin = load_f16(ob, 2)
    for j in range(8):
        sc, mn = scale_min_k4(ob, j)
        dl = d * np.float32(sc)
        if dl == 0:
            continue
        ml = dmin * np.float32(mn)
        for i in range(32):
            L[32 * j + i] = min(nmax, max(0, _nearest_int_div(xb[32 * j + i] + ml, dl)))


@njit(**NJ)
def _pack_q4_k_codes(ob: np.ndarray, L: np.ndarray) -> None:
    """Codes 0..15 as nibbles at ob[16:144]: byte l of each 32-byte group holds values l (lo) and l+32 (hi)."""
    for c in range(4):
        for l in range(32):
            ob[16 + 32 * c + l] = L[64 * c + l] | (L[64 * c + 32 + l] << np.uint8(4))


@njit(**NJ)
def _pack_q5_k_codes(ob: np.ndarray, L: np.ndarray) -> None:
    """Codes 0..31: fifth bits in qh at ob[16:48] (bit 2c / 2c+1 for group c), low nibbles as Q4_K from ob[48]."""
    for l in range(32):
        ob[16 + l] = 0
    for c in range(4):
        for l in range(32):
            l1 = L[64 * c + l]
            l2 = L[64 * c + 32 + l]
            if l1 > 15:
                l1 -= np.uint8(16)
                ob[16 + l] |= np.uint8(1) << np.uint8(2 * c)
            if l2 > 15:
                l2 -= np.uint8(16)
                ob[16 + l] |= np.uint8(2) << np.uint8(2 * c)
            ob[48 + 32 * c + l] = l1 | (l2 << np.uint8(4))


@njit(**KERNEL)
def _quantize_k45_ref(x: np.ndarray, out: np.ndarray, nmax: int, rmin: np.float32, nstep: int) -> None:
    """Q4_K (nmax 15) / Q5_K (nmax 31) without importance weights."""
    n_rows, n = x.shape
    bsize = out.shape[1] * QK_K // n
    for r in prange(n_rows):
        L = np.empty(QK_K, dtype=np.uint8)
        Ls = np.empty(8, dtype=np.uint8)
        Lm = np.empty(8, dtype=np.uint8)
        w = np.empty((8, 32), dtype=np.float32)
        scales = np.empty(8, dtype=np.float32)
        mins = np.empty(8, dtype=np.float32)
        scratch = qkx2_scratch(32)
        for ib in range(n // QK_K):
            xb = x[r, ib * QK_K : (ib + 1) * QK_K]
            ob = out[r, ib * bsize : (ib + 1) * bsize]
            for j in range(8):
                xs = xb[32 * j : 32 * j + 32]
                sum_x2 = np.float32(0.0)
                for i in range(32):
                    sum_x2 += xs[i] * xs[i]
                av_x = np.sqrt(sum_x2 * np.float32(1.0 / 32))
                for i in range(32):
                    w[j, i] = av_x + abs(xs[i])
            make_qkx2_blocks(nmax, xb.reshape(8, 32), w, L.reshape(8, 32), rmin, np.float32(0.1), nstep, False, False,
                             scales, mins, scratch)
            _k4_ref_scales(ob, scales, mins, Ls, Lm)
            _pack_scales_k4(ob, Ls, Lm)
            _requantize_k4(ob, xb, L, nmax)
            if nmax == 15:
                _pack_q4_k_codes(ob, L)
            else:
                _pack_q5_k_codes(ob, L)


@njit(**KERNEL)
def _quantize_k45_imat(x: np.ndarray, qw: np.ndarray, out: np.ndarray, nmax: int) -> None:
    """Q4_K (nmax 15) / Q5_K (nmax 31) with importance weights."""
    n_rows, n = x.shape
    bsize = out.shape[1] * QK_K // n
    for r in prange(n_rows):
        scratch = qkx3_scratch(32)
        L = np.empty(QK_K, dtype=np.uint8)
        Ls = np.empty(8, dtype=np.uint8)
        Lm = np.empty(8, dtype=np.uint8)
        w = np.empty((8, 32), dtype=np.float32)
        sw = np.empty(8, dtype=np.float32)
        scales = np.empty(8, dtype=np.float32)
        mins = np.empty(8, dtype=np.float32)
        for ib in range(n // QK_K):
            xb = x[r, ib * QK_K : (ib + 1) * QK_K]
            ob = out[r, ib * bsize : (ib + 1) * bsize]
            sum_x2 = np.float32(0.0)
            for i in range(QK_K):
                sum_x2 += xb[i] * xb[i]
            sigma2 = (sum_x2 + sum_x2) * np.float32(1.0 / QK_K)
            for j in range(8):
                xs = xb[32 * j : 32 * j + 32]
                sumw = np.float32(0.0)
                for i in range(32):
                    w[j, i] = qw[ib * QK_K + 32 * j + i] * np.sqrt(fmaf(xs[i], xs[i], sigma2))
                    sumw += w[j, i]
                sw[j] = sumw
            make_qkx3_blocks(nmax, xb.reshape(8, 32), w, L.reshape(8, 32), False, scales, mins, scratch)
            for j in range(8):
                mins[j] = -mins[j]
            d_block = make_qp_quants(63, scales, Ls, sw)
            m_block = make_qp_quants(63, mins, Lm, sw)
            if nmax == 31:
                for j in range(8):
                    Ls[j] = min(Ls[j], np.uint8(63))
                    Lm[j] = min(Lm[j], np.uint8(63))
            _pack_scales_k4(ob, Ls, Lm)
            store_f16(ob, 0, d_block)
            store_f16(ob, 2, m_block)
            _requantize_k4(ob, xb, L, nmax)
            if nmax == 15:
                _pack_q4_k_codes(ob, L)
            else:
                _pack_q5_k_codes(ob, L)


@njit(**KERNEL)
def _dequantize_q4_k(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        for ib in range(n // QK_K):
            q4_k_block(q[r], ib, out[r], ib * QK_K)


@njit(cache=True, nogil=True, inline="always")
def _pair_scales_k4(qb: np.ndarray, c: int) -> tuple[np.float32, np.float32, np.float32, np.float32]:
    """Q4_K's and Q5_K's sub-blocks 2c and 2c + 1: scale d x sc and offset dmin x m of each (the block's f16 d and
    dmin at its start)."""
    d, dmin = load_f16(qb, 0), load_f16(qb, 2)
    sc0, mn0 = scale_min_k4(qb, 2 * c)
    sc1, mn1 = scale_min_k4(qb, 2 * c + 1)
    return d * np.float32(sc0), dmin * np.float32(mn0), d * np.float32(sc1), dmin * np.float32(mn1)


@njit(cache=True, nogil=True, inline="always")
def q4_k_block(row: np.ndarray, ib: int, out: np.ndarray, at: int) -> None:
    """Values 256 ib .. 256 ib + 255 of a Q4_K row (its bytes) into out[at : at + 256]: the decoding, shared with
    the runtime's expert kernel, which decodes a block of rows at a time."""
    qb = row[ib * 144 : (ib + 1) * 144]
    y = out[at : at + QK_K]
    for c in range(4):
        d0, m0, d1, m1 = _pair_scales_k4(qb, c)
        for l in range(32):
            b = qb[16 + 32 * c + l]
            y[64 * c + l] = d0 * np.float32(b & np.uint8(15)) - m0
            y[64 * c + 32 + l] = d1 * np.float32(b >> np.uint8(4)) - m1


@njit(**KERNEL)
def _dequantize_q5_k(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        for ib in range(n // QK_K):
            q5_k_block(q[r], ib, out[r], ib * QK_K)


@njit(cache=True, nogil=True, inline="always")
def q5_k_block(row: np.ndarray, ib: int, out: np.ndarray, at: int) -> None:
    """Values 256 ib .. of a Q5_K row into out[at : at + 256] (as q4_k_block)."""
    qb = row[ib * 176 : (ib + 1) * 176]
    y = out[at : at + QK_K]
    for c in range(4):
        d0, m0, d1, m1 = _pair_scales_k4(qb, c)
        for l in range(32):
            b = np.int32(qb[48 + 32 * c + l])
            h = np.int32(qb[16 + l]) >> (2 * c)
            y[64 * c + l] = d0 * np.float32((b & 15) | ((h & 1) << 4)) - m0
            y[64 * c + 32 + l] = d1 * np.float32((b >> 4) | ((h & 2) << 3)) - m1


# ---------------------------------------------------------------------------------------------------------------
# Q6_K: 16 x 16 values, 6-bit codes, signed 8-bit scales, fp16 d
# ---------------------------------------------------------------------------------------------------------------


@njit(**KERNEL)
def _quantize_q6_k(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    """Both paths: sub-block scales weighted by the importance vector when given, else by x^2."""
    n_rows, n = x.shape
    weighted = qw.size > 0
    for r in prange(n_rows):
        scratch = qx_scratch(16)
        L = np.empty(QK_K, dtype=np.int8)
        scales = np.empty(16, dtype=np.float32)
        w = np.empty(16, dtype=np.float32)
        xr = x[r]
        o = out[r]
        for ib in range(n // QK_K):
            xb = xr[ib * QK_K : (ib + 1) * QK_K]
            ob = o[ib * 210 : (ib + 1) * 210]
            max_scale = np.float32(0.0)
            max_abs_scale = np.float32(0.0)
            for j in range(16):
                xs = xb[16 * j : 16 * j + 16]
                for i in range(16):
                    w[i] = qw[ib * QK_K + 16 * j + i] if weighted else xs[i] * xs[i]
                s = make_qx_quants(16, 32, xs, L[16 * j : 16 * j + 16], w, scratch)
                scales[j] = s
                if abs(s) > max_abs_scale:
                    max_abs_scale = abs(s)
                    max_scale = s
            if max_abs_scale < GROUP_MAX_EPS:
                ob[:] = 0
                continue
            iscale = np.float32(-128.0) / max_scale
            store_f16(ob, 208, np.float32(1.0) / iscale)
            d = load_f16(ob, 208)
            for j in range(16):
                sc = np.int8(min(127, nearest_int_fma(iscale, scales[j])))
                ob[192 + j] = np.uint8(sc)
                dl = d * np.float32(sc)
                if dl == 0:
                    continue
                for i in range(16):
                    L[16 * j + i] = min(31, max(-32, _nearest_int_div(xb[16 * j + i], dl))) + 32
            for h in range(2):
                for l in range(32):
                    q1 = np.uint8(L[128 * h + l])
                    q2 = np.uint8(L[128 * h + l + 32])
                    q3 = np.uint8(L[128 * h + l + 64])
                    q4 = np.uint8(L[128 * h + l + 96])
                    ob[64 * h + l] = (q1 & np.uint8(15)) | ((q3 & np.uint8(15)) << np.uint8(4))
                    ob[64 * h + l + 32] = (q2 & np.uint8(15)) | ((q4 & np.uint8(15)) << np.uint8(4))
                    ob[128 + 32 * h + l] = (
                        (q1 >> np.uint8(4))
                        | ((q2 >> np.uint8(4)) << np.uint8(2))
                        | ((q3 >> np.uint8(4)) << np.uint8(4))
                        | ((q4 >> np.uint8(4)) << np.uint8(6))
                    )


@njit(**KERNEL)
def _dequantize_q6_k(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        for ib in range(n // QK_K):
            q6_k_block(q[r], ib, out[r], ib * QK_K)


@njit(cache=True, nogil=True, inline="always")
def q6_k_block(row: np.ndarray, ib: int, out: np.ndarray, at: int) -> None:
    """Values 256 ib .. of a Q6_K row into out[at : at + 256] (as q4_k_block)."""
    qb = row[ib * 210 : (ib + 1) * 210]
    y = out[at : at + QK_K]
    d = load_f16(qb, 208)
    for h in range(2):
        for half in range(2):
            s = 8 * h + half
            d0, d1 = d * np.float32(np.int8(qb[192 + s])), d * np.float32(np.int8(qb[194 + s]))
            d2, d3 = d * np.float32(np.int8(qb[196 + s])), d * np.float32(np.int8(qb[198 + s]))
            for l in range(16 * half, 16 * half + 16):
                ql0 = np.int32(qb[64 * h + l])
                ql1 = np.int32(qb[64 * h + l + 32])
                qh = np.int32(qb[128 + 32 * h + l])
                y[128 * h + l] = d0 * np.float32(((ql0 & 15) | ((qh & 3) << 4)) - 32)
                y[128 * h + l + 32] = d1 * np.float32(((ql1 & 15) | (((qh >> 2) & 3) << 4)) - 32)
                y[128 * h + l + 64] = d2 * np.float32(((ql0 >> 4) | (((qh >> 4) & 3) << 4)) - 32)
                y[128 * h + l + 96] = d3 * np.float32(((ql1 >> 4) | (((qh >> 6) & 3) << 4)) - 32)


# ---------------------------------------------------------------------------------------------------------------
# Codecs
# ---------------------------------------------------------------------------------------------------------------


def _in_range_weights(w: np.ndarray) -> np.ndarray:
    """The importance vector, scaled by a power of two when its largest entry is beyond 2^+-40.

    Every k-quant search is homogeneous in the weights and a power-of-two scale is exact, so this changes no
    decision; it only keeps ik's float32 weighted sums from overflowing to NaN (or underflowing to nothing) on
    absurd vectors. Ordinary vectors pass through untouched, so the bytes stay ik's.
    """
    wmax = float(w.max()) if w.size else 0.0
    if wmax == 0.0 or 2.0**-40 <= wmax <= 2.0**40:
        return w
    return np.ldexp(w, -int(np.frexp(wmax)[1])).astype(np.float32)


class Q2_KCodec(Codec, type_name="Q2_K"):
    # without importance weights, ternary storage is decided over all rows of one call
    rows_interact = True
    # Ternary storage (plain calls only) keeps max|x| of the call itself as the fp16 d and dmin.
    max_abs_input = FP16_MAX
    # Ternary storage zeroes every value under half the call's max|x|, so a block can lose all of its content
    # (2^-10: fp16 rounding of that max). Ordinary storage (2-bit codes on a grid of up to range/2.5 per step,
    # 4-bit scales and mins) stayed below 0.75 of the block's max|x| in fuzzing.
    rel_error_bound = 1.0 + 2.0**-10
    # d and dmin near the fp16 subnormal step, times the largest code products (15*3 and 15)
    abs_error_floor = 60 * FP16_STEP

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        if w.size:
            _quantize_q2_k_imat(x, _in_range_weights(w), out)
            return
        fmax = _q2_k_ternary_max(x)
        if fmax >= 0:
            _quantize_q2_k_ternary(x, fmax, out)
        else:
            _quantize_q2_k_ref(x, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q2_k(q, out)


class Q3_KCodec(Codec, type_name="Q3_K"):
    block_scale_f16 = 108  # after hmask, qs and the scales
    # d = |largest sub-block scale| / 32 in fp16, and a sub-block scale never exceeds its max|x|; halved because
    # the weighted fit of the scales can land above the plain max-based d
    max_abs_input = FP16_MAX * 32 / 2
    # A sub-block whose max maps to code -4 clips an equally large opposite value at +3 (1/4 of the max), plus
    # rounding its scale to 6 bits of the largest one (4 codes x half of 1/32), plus fp16 d.
    rel_error_bound = 0.33
    # d near the fp16 subnormal step times the largest code product (32*4)
    abs_error_floor = 128 * FP16_STEP

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        if w.size:
            _quantize_q3_k_imat(x, _in_range_weights(w), out)
        else:
            _quantize_q3_k_ref(x, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q3_k(q, out)


class Q4_KCodec(Codec, type_name="Q4_K"):
    # dmin = largest sub-block min / 63 in fp16, a min is at most max|x|; halved because the least-squares min
    # can overshoot the data
    max_abs_input = FP16_MAX * 63 / 2
    # One whole step of the widest sub-block grid (trial steps go up to range/14 <= max/7, and the search may
    # clip the top value by a step for a better fit), plus 6-bit rounding of scale and min (15/7/126 + 1/126).
    rel_error_bound = 0.17
    # d and dmin near the fp16 subnormal step times the largest code products (63*15 and 63)
    abs_error_floor = 1008 * FP16_STEP

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        if w.size:
            _quantize_k45_imat(x, _in_range_weights(w), out, 15)
        else:
            _quantize_k45_ref(x, out, 15, np.float32(-1.0), 20)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q4_k(q, out)


class Q5_KCodec(Codec, type_name="Q5_K"):
    # as Q4_K: dmin = largest sub-block min / 63 in fp16, halved for the least-squares min
    max_abs_input = FP16_MAX * 63 / 2
    # One whole step of the widest grid (range/30.5 <= max/15.25), plus 6-bit scale and min rounding
    # (31/15.25/126 + 1/126).
    rel_error_bound = 0.09
    # d and dmin near the fp16 subnormal step times the largest code products (63*31 and 63)
    abs_error_floor = 2016 * FP16_STEP

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        if w.size:
            _quantize_k45_imat(x, _in_range_weights(w), out, 31)
        else:
            _quantize_k45_ref(x, out, 31, np.float32(-0.5), 15)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q5_k(q, out)


class Q6_KCodec(Codec, type_name="Q6_K"):
    block_scale_f16 = 208  # after ql, qh and the scales
    # d = |largest sub-block scale| / 128 in fp16, a sub-block scale never exceeds its max|x|; halved as for Q3_K
    max_abs_input = FP16_MAX * 128 / 2
    # The largest sub-block may settle on code +-1 (scale = max|x|), so the 8-bit sub-block scales count in units
    # of max/128: half a unit over 32 codes (1/8), plus one step of the sub-block's own grid (1/32), plus fp16 d.
    rel_error_bound = 0.16
    # d near the fp16 subnormal step times the largest code product (128*32)
    abs_error_floor = 4096 * FP16_STEP

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_q6_k(x, _in_range_weights(w), out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q6_k(q, out)

