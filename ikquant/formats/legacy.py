"""Legacy 32-value block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q6_0 and Q8_0.

Q8_0 ignores importance weights (ik's quantize_q8_0 always takes the reference path). With weights, Q4_0, Q5_0 and
Q6_0 run ik's symmetric weighted scale search (make_qx_quants), Q4_1 and Q5_1 its scale-and-min search
(make_qkx3_quants). Without weights they take the reference rounding, except Q6_0, which always searches (with
weights x^2).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.base import Codec
from ikquant.formats.numeric import (
    f16_bits_to_f32,
    f32_to_f16_bits,
    fma64,
    fmaf,
    nearest_int_fma,
    roundf,
)
from ikquant.types import register_codec

QK = 32
# int32 constants keep the integer code arithmetic 32-bit wide (a plain literal widens it to int64 and halves the
# vector lanes)
I4 = np.int32(4)
I8 = np.int32(8)
I15 = np.int32(15)
I16 = np.int32(16)
KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")
SCALAR = dict(cache=True, nogil=True, error_model="numpy")

# The dequantizers take the block length as a run-time argument `qk` (always QK): with a compile-time trip count
# LLVM unrolls the 32-value loop completely and then fails to vectorise it, which costs 4x in throughput. Their
# inner loops index block slices with the bare loop counter: an index like `o + j` keeps numba's negative-index
# wrap-around test in the loop, which blocks vectorisation of the nibble loops (Q8_0's single loop is unaffected).


@njit(**SCALAR)
def _store_f16(out: np.ndarray, pos: int, v: np.float32) -> None:
    h = f32_to_f16_bits(v)
    out[pos] = np.uint8(h & np.uint16(0xFF))
    out[pos + 1] = np.uint8(h >> np.uint16(8))


@njit(**SCALAR)
def _load_f16(q: np.ndarray, pos: int) -> np.float32:
    return f16_bits_to_f32(np.uint16(q[pos]) | (np.uint16(q[pos + 1]) << np.uint16(8)))


@njit(**SCALAR)
def _row_sigma2(xr: np.ndarray) -> np.float32:
    """Mean of x^2 over the row. ik's build vectorises this sum: squares are rounded, then added in order."""
    s = np.float32(0.0)
    for j in range(xr.size):
        s += xr[j] * xr[j]
    return s / np.float32(xr.size)


@njit(**SCALAR)
def _block_weights(xb: np.ndarray, qw: np.ndarray, sigma2: np.float32, weight: np.ndarray) -> None:
    """ik's per-value importance: imatrix * sqrt(sigma2 + x^2), the sum fused as ik's build fuses it."""
    for j in range(xb.size):
        weight[j] = qw[j] * np.sqrt(fmaf(xb[j], xb[j], sigma2))


@njit(**SCALAR)
def _pack_nibbles(L: np.ndarray, out: np.ndarray, pos: int) -> None:
    """Low 4 bits of 32 codes: value j in the low nibble of byte j, value j+16 in its high nibble."""
    for j in range(16):
        out[pos + j] = (np.uint8(L[j]) & np.uint8(15)) | ((np.uint8(L[j + 16]) & np.uint8(15)) << np.uint8(4))


@njit(**SCALAR)
def _store_qh5(L: np.ndarray, out: np.ndarray, pos: int) -> None:
    """Bit 4 of code j as bit j of a little-endian u32 (Q5_0, Q5_1)."""
    qh = np.uint32(0)
    for j in range(QK):
        qh |= np.uint32((np.uint8(L[j]) >> np.uint8(4)) & np.uint8(1)) << np.uint32(j)
    for k in range(4):
        out[pos + k] = np.uint8((qh >> np.uint32(8 * k)) & np.uint32(0xFF))


@njit(**SCALAR)
def make_qx_quants(n: int, nmax: int, x: np.ndarray, L: np.ndarray, w: np.ndarray) -> np.float32:
    """ik's importance-weighted symmetric scale search (rmse_type 1 with explicit weights).

    Returns the scale; L receives codes in [0, 2*nmax). The multiply-adds are fused where ik's GCC build fuses them.
    """
    fmax = np.float32(0.0)
    amax = np.float32(0.0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            fmax = x[i]
    if amax < np.float32(1e-15):
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    fn = np.float32(nmax)
    iscale = -fn / fmax
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        l = min(nmax - 1, max(-nmax, nearest_int_fma(iscale, x[i])))
        L[i] = l + nmax
        fl = np.float32(l)
        sumlx = fmaf(w[i] * x[i], fl, sumlx)
        suml2 = fmaf(w[i] * fl, fl, suml2)
    scale = sumlx / suml2 if suml2 != 0 else np.float32(0.0)
    best = scale * sumlx
    best_sumlx = sumlx
    best_suml2 = suml2
    # The 38 trial scales, in ik's order. ik's build vectorises each trial's loop: products are rounded, then
    # summed in order without fusing. The trials are independent, so their sums are accumulated side by side
    # (same roundings, vectorised across trials) and ik's sequential acceptance test runs afterwards.
    ntrial = 38
    iscales = np.empty(ntrial, dtype=np.float32)
    for k in range(ntrial // 2):
        step = np.float32(0.1) * np.float32(k - 9)
        iscales[2 * k] = -(step + fn) / fmax
        iscales[2 * k + 1] = (step + (fn - np.float32(1.0))) / fmax
    t_sumlx = np.zeros(ntrial, dtype=np.float32)
    t_suml2 = np.zeros(ntrial, dtype=np.float32)
    for i in range(n):
        xi = x[i]
        wi = w[i]
        wxi = wi * xi
        for c in range(ntrial):
            fl = np.float32(min(nmax - 1, max(-nmax, nearest_int_fma(iscales[c], xi))))
            t_sumlx[c] += wxi * fl
            t_suml2[c] += (wi * fl) * fl
    winner = -1
    for c in range(ntrial):
        sumlx = t_sumlx[c]
        suml2 = t_suml2[c]
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            scale = sumlx / suml2
            best = scale * sumlx
            best_sumlx = sumlx
            best_suml2 = suml2
            winner = c
    if winner >= 0:
        for i in range(n):
            L[i] = nmax + min(nmax - 1, max(-nmax, nearest_int_fma(iscales[winner], x[i])))
    sumlx = best_sumlx
    suml2 = best_suml2
    for _ in range(n * (2 * nmax - 1)):
        abs_gmax = np.float32(0.0)
        gmax = np.float32(0.0)
        best_j = -1
        for j in range(n):
            l = np.int32(L[j]) - nmax
            g = scale * w[j] * fmaf(-scale, np.float32(l), x[j])
            if (g > 0 and l < nmax - 1) or (g < 0 and l > -nmax):
                ag = abs(g)
                if ag > abs_gmax:
                    abs_gmax = ag
                    gmax = g
                    best_j = j
        if best_j < 0:
            break
        wj = w[best_j]
        l = np.int32(L[best_j]) - nmax
        # ik's build rounds w*x before adding it, but fuses w*(2l +- 1) into the add
        wx = wj * x[best_j]
        if gmax > 0:
            new_sumlx = sumlx + wx
            new_suml2 = fmaf(wj, np.float32(2 * l + 1), suml2)
            l += 1
        else:
            new_sumlx = sumlx - wx
            new_suml2 = fmaf(-wj, np.float32(2 * l - 1), suml2)
            l -= 1
        if new_suml2 > 0 and new_sumlx * new_sumlx > best * new_suml2:
            sumlx = new_sumlx
            suml2 = new_suml2
            scale = sumlx / suml2
            best = scale * sumlx
            L[best_j] = l + nmax
        else:
            break
    return scale


@njit(**SCALAR)
def _qkx3_error(
    scale: float, mn: float, sum_w: float, sum_x: float, sum_x2: float, sum_l: float, sum_l2: float, sum_xl: float
) -> float:
    """Weighted squared error of (scale, min) from the moments, in the fused order of ik's build."""
    t = fma64(-(2.0 * scale), sum_xl, sum_x2)
    t = fma64(-sum_x, 2.0 * mn, t)
    t = fma64(sum_l, (2.0 * scale) * mn, t)
    t = fma64(sum_l2, scale * scale, t)
    return fma64(sum_w, mn * mn, t)


@njit(**SCALAR)
def _qkx3_gain(
    scale: float, mn: float, sum_w: float, sum_x: float, sum_l: float, sum_l2: float, sum_xl: float
) -> float:
    """sum_x2 minus the weighted squared error of (scale, min), in the fused order of ik's build."""
    t = (2.0 * mn) * sum_x
    t = fma64(2.0 * scale, sum_xl, t)
    t = fma64(-((2.0 * scale) * mn), sum_l, t)
    t = fma64(-(scale * scale), sum_l2, t)
    return fma64(-(mn * mn), sum_w, t)


@njit(**SCALAR)
def _qkx3_fit(sum_w: float, sum_x: float, sum_l: float, sum_l2: float, sum_xl: float) -> tuple[float, float, float]:
    """Least-squares (scale, min) for fixed codes, min clamped to <= 0; returns (D, scale, min), D <= 0: no fit."""
    D = fma64(sum_w, sum_l2, -(sum_l * sum_l))
    if D <= 0:
        return D, 0.0, 0.0
    this_min = fma64(sum_l2, sum_x, -(sum_l * sum_xl)) / D
    if this_min > 0:
        return D, sum_xl / sum_l2, 0.0
    return D, fma64(-sum_l, sum_x, sum_xl * sum_w) / D, this_min


@njit(**SCALAR)
def make_qkx3_quants(nmax: int, x: np.ndarray, w: np.ndarray, L: np.ndarray) -> tuple[np.float32, np.float32]:
    """ik's weighted scale-and-min search (rmin -0.9, rdelta 0.05, nstep 36, squared error) over len(x) values.

    Returns (scale, min) with min <= 0, so y = scale*L + min; L receives codes in [0, nmax]. The moments are in
    float64 as in ik; fused and unfused steps follow ik's GCC build.
    """
    n = x.size
    mn = x[0]
    mx = x[0]
    sum_w = np.float64(w[0])
    sum_x = sum_w * np.float64(x[0])
    sum_x2 = sum_x * np.float64(x[0])
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        wi = np.float64(w[i])
        xi = np.float64(x[i])
        sum_w += wi
        wx = xi * wi
        sum_x += wx
        sum_x2 += wx * xi
    if mn > 0:
        mn = np.float32(0.0)
    if mx - mn < np.float32(1e-10):
        for i in range(n):
            L[i] = 0
        return np.float32(0.0), mn
    fnmax = np.float32(nmax)
    iscale = fnmax / (mx - mn)
    scale = np.float32(1.0) / iscale
    best_mad = 0.0
    for i in range(n):
        l = min(nmax, max(0, nearest_int_fma(x[i] - mn, iscale)))
        L[i] = l
        diff = fma64(np.float64(l), np.float64(scale), np.float64(mn)) - np.float64(x[i])
        best_mad = fma64(np.float64(w[i]), diff * diff, best_mad)
    Laux = np.empty(n, dtype=np.uint8)
    for step in range(37):
        iscale = (fmaf(np.float32(step), np.float32(0.05), np.float32(-0.9)) + fnmax) / (mx - mn)
        sum_l = 0.0
        sum_l2 = 0.0
        sum_xl = 0.0
        for i in range(n):
            l = min(nmax, max(0, nearest_int_fma(x[i] - mn, iscale)))
            Laux[i] = l
            fl = np.float64(l)
            wl = np.float64(w[i]) * fl
            sum_l2 = fma64(fl, wl, sum_l2)
            sum_xl = fma64(np.float64(x[i]), wl, sum_xl)
            sum_l += wl
        D, this_scale, this_min = _qkx3_fit(sum_w, sum_x, sum_l, sum_l2, sum_xl)
        if D > 0:
            mad = _qkx3_error(this_scale, this_min, sum_w, sum_x, sum_x2, sum_l, sum_l2, sum_xl)
            if mad < best_mad:
                # an accepted trial moves min, which the following trials use
                for i in range(n):
                    L[i] = Laux[i]
                best_mad = mad
                scale = np.float32(this_scale)
                mn = np.float32(this_min)
    sum_l = 0.0
    sum_l2 = 0.0
    sum_xl = 0.0
    for i in range(n):
        fl = np.float64(L[i])
        wl = np.float64(w[i]) * fl
        sum_l2 = fma64(fl, wl, sum_l2)
        sum_l += wl
        sum_xl = fma64(np.float64(x[i]), wl, sum_xl)
    best = _qkx3_gain(np.float64(scale), np.float64(mn), sum_w, sum_x, sum_l, sum_l2, sum_xl)
    last_j = -1
    last_dir = 0
    for _ in range(nmax * n):
        gmax = np.float32(0.0)
        best_j = -1
        direction = 0
        for j in range(n):
            lj = np.int32(L[j])
            g = fmaf(-scale, np.float32(lj), x[j]) - mn
            if g > 0 and lj < nmax and g > gmax:
                gmax = g
                best_j = j
                direction = 1
            elif g < 0 and lj > 0 and -g > gmax:
                gmax = -g
                best_j = j
                direction = -1
        if best_j < 0 or (best_j == last_j and direction == -last_dir):
            break
        wj = np.float64(w[best_j])
        fd = np.float64(direction)
        lj = np.int32(L[best_j])
        sum_l = fma64(wj, fd, sum_l)
        sum_l2 = fma64(wj, np.float64(2 * lj * direction + 1), sum_l2)
        sum_xl = fma64(np.float64(x[best_j]) * wj, fd, sum_xl)
        D, this_scale, this_min = _qkx3_fit(sum_w, sum_x, sum_l, sum_l2, sum_xl)
        if D <= 0 or this_scale < 0:
            break
        score = _qkx3_gain(this_scale, this_min, sum_w, sum_x, sum_l, sum_l2, sum_xl)
        if score <= best:
            break
        best = score
        scale = np.float32(this_scale)
        mn = np.float32(this_min)
        L[best_j] = lj + direction
        last_j = best_j
        last_dir = direction
    return scale, mn


# ---------------------------------------------------------------------------------------------------- Q8_0


@njit(**KERNEL)
def _quantize_q8_0(x: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    for r in prange(n_rows):
        for ib in range(n // QK):
            base = ib * QK
            amax = np.float32(0.0)
            for j in range(QK):
                amax = max(amax, abs(x[r, base + j]))
            d = amax / np.float32(127.0)
            idv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            o = ib * 34
            _store_f16(out[r], o, d)
            for j in range(QK):
                out[r, o + 2 + j] = np.uint8(np.int8(roundf(x[r, base + j] * idv)))


@njit(**KERNEL)
def _dequantize_q8_0(q: np.ndarray, out: np.ndarray, qk: int) -> None:
    n_rows, n = out.shape
    qi = q.view(np.int8)
    for r in prange(n_rows):
        for ib in range(n // qk):
            o = ib * 34
            d = _load_f16(q[r], o)
            for j in range(qk):
                out[r, ib * qk + j] = np.float32(qi[r, o + 2 + j]) * d


# ---------------------------------------------------------------------------------------------------- Q4_0, Q5_0


@njit(**KERNEL)
def _quantize_sym(x: np.ndarray, qw: np.ndarray, out: np.ndarray, nmax: int, type_size: int) -> None:
    """Q4_0 (nmax 8) and Q5_0 (nmax 16): codes q in [0, 2*nmax), y = (q - nmax)*d."""
    n_rows, n = x.shape
    weighted = qw.size > 0
    fn = np.float32(nmax)
    for r in prange(n_rows):
        xr = x[r]
        L = np.empty(QK, dtype=np.int8)
        weight = np.empty(QK, dtype=np.float32)
        sigma2 = _row_sigma2(xr) if weighted else np.float32(0.0)
        for ib in range(n // QK):
            base = ib * QK
            xb = xr[base : base + QK]
            o = ib * type_size
            if weighted:
                _block_weights(xb, qw[base : base + QK], sigma2, weight)
                d = make_qx_quants(QK, nmax, xb, L, weight)
            else:
                amax = np.float32(0.0)
                vmax = np.float32(0.0)
                for j in range(QK):
                    if amax < abs(xb[j]):
                        amax = abs(xb[j])
                        vmax = xb[j]
                d = vmax / -fn
                idv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
                for j in range(QK):
                    # ik truncates x*id + nmax + 0.5 (one fused rounding) to int8, then caps the top code
                    v = fmaf(xb[j], idv, fn + np.float32(0.5))
                    L[j] = min(2 * nmax - 1, np.int32(np.int8(np.int32(v))))
            _store_f16(out[r], o, d)
            if nmax == 16:
                _store_qh5(L, out[r], o + 2)
                _pack_nibbles(L, out[r], o + 6)
            else:
                _pack_nibbles(L, out[r], o + 2)


@njit(**KERNEL)
def _dequantize_q4_0(q: np.ndarray, out: np.ndarray, qk: int) -> None:
    n_rows, n = out.shape
    half = qk // 2
    for r in prange(n_rows):
        qr = q[r]
        for ib in range(n // qk):
            o = ib * 18
            d = _load_f16(qr, o)
            src = qr[o + 2 : o + 2 + half]
            lo = out[r, ib * qk : ib * qk + half]
            hi = out[r, ib * qk + half : (ib + 1) * qk]
            for j in range(half):
                lo[j] = np.float32(np.int32((np.int32(src[j]) & I15) - I8)) * d
            for j in range(half):
                hi[j] = np.float32(np.int32((np.int32(src[j]) >> I4) - I8)) * d


@njit(**SCALAR)
def _load_u32(q: np.ndarray, pos: int) -> np.int32:
    return (
        np.int32(q[pos])
        | (np.int32(q[pos + 1]) << I8)
        | (np.int32(q[pos + 2]) << np.int32(16))
        | (np.int32(q[pos + 3]) << np.int32(24))
    )


@njit(**KERNEL)
def _dequantize_q5_0(q: np.ndarray, out: np.ndarray, qk: int) -> None:
    n_rows, n = out.shape
    half = qk // 2
    for r in prange(n_rows):
        qr = q[r]
        for ib in range(n // qk):
            o = ib * 22
            d = _load_f16(qr, o)
            qh = _load_u32(qr, o + 2)
            src = qr[o + 6 : o + 6 + half]
            lo = out[r, ib * qk : ib * qk + half]
            hi = out[r, ib * qk + half : (ib + 1) * qk]
            for j in range(half):
                v = (np.int32(src[j]) & I15) | (((qh >> np.int32(j)) << I4) & I16)
                lo[j] = np.float32(np.int32(v - I16)) * d
            for j in range(half):
                v = (np.int32(src[j]) >> I4) | ((qh >> np.int32(j + 12)) & I16)
                hi[j] = np.float32(np.int32(v - I16)) * d


# ---------------------------------------------------------------------------------------------------- Q4_1, Q5_1


@njit(**KERNEL)
def _quantize_affine(x: np.ndarray, qw: np.ndarray, out: np.ndarray, nmax: int, type_size: int) -> None:
    """Q4_1 (nmax 15) and Q5_1 (nmax 31): codes q in [0, nmax], y = q*d + m."""
    n_rows, n = x.shape
    weighted = qw.size > 0
    for r in prange(n_rows):
        xr = x[r]
        L = np.empty(QK, dtype=np.uint8)
        weight = np.empty(QK, dtype=np.float32)
        sigma2 = _row_sigma2(xr) if weighted else np.float32(0.0)
        for ib in range(n // QK):
            base = ib * QK
            xb = xr[base : base + QK]
            o = ib * type_size
            if weighted:
                _block_weights(xb, qw[base : base + QK], sigma2, weight)
                d, m = make_qkx3_quants(nmax, xb, weight, L)
            else:
                m = np.float32(np.finfo(np.float32).max)
                mx = -m
                for j in range(QK):
                    if xb[j] < m:
                        m = xb[j]
                    if xb[j] > mx:
                        mx = xb[j]
                d = (mx - m) / np.float32(nmax)
                idv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
                for j in range(QK):
                    # ik truncates (x - min)*id + 0.5 (one fused rounding); Q4_1 also caps the code at 15
                    v = np.int32(fmaf(xb[j] - m, idv, np.float32(0.5)))
                    if nmax == 15:
                        v = min(15, np.int32(np.int8(v)))
                    L[j] = v
            _store_f16(out[r], o, d)
            _store_f16(out[r], o + 2, m)
            if nmax == 31:
                _store_qh5(L, out[r], o + 4)
                _pack_nibbles(L, out[r], o + 8)
            else:
                _pack_nibbles(L, out[r], o + 4)


@njit(**KERNEL)
def _dequantize_q4_1(q: np.ndarray, out: np.ndarray, qk: int) -> None:
    n_rows, n = out.shape
    half = qk // 2
    for r in prange(n_rows):
        qr = q[r]
        for ib in range(n // qk):
            o = ib * 20
            d = _load_f16(qr, o)
            m = _load_f16(qr, o + 2)
            src = qr[o + 4 : o + 4 + half]
            lo = out[r, ib * qk : ib * qk + half]
            hi = out[r, ib * qk + half : (ib + 1) * qk]
            # q*d is exact (11-bit significand times a 4-bit code), so fusing the add cannot matter
            for j in range(half):
                lo[j] = np.float32(np.int32(np.int32(src[j]) & I15)) * d + m
            for j in range(half):
                hi[j] = np.float32(np.int32(np.int32(src[j]) >> I4)) * d + m


@njit(**KERNEL)
def _dequantize_q5_1(q: np.ndarray, out: np.ndarray, qk: int) -> None:
    n_rows, n = out.shape
    half = qk // 2
    for r in prange(n_rows):
        qr = q[r]
        for ib in range(n // qk):
            o = ib * 24
            d = _load_f16(qr, o)
            m = _load_f16(qr, o + 2)
            qh = _load_u32(qr, o + 4)
            src = qr[o + 8 : o + 8 + half]
            lo = out[r, ib * qk : ib * qk + half]
            hi = out[r, ib * qk + half : (ib + 1) * qk]
            for j in range(half):
                v = (np.int32(src[j]) & I15) | (((qh >> np.int32(j)) << I4) & I16)
                lo[j] = np.float32(np.int32(v)) * d + m
            for j in range(half):
                v = (np.int32(src[j]) >> I4) | ((qh >> np.int32(j + 12)) & I16)
                hi[j] = np.float32(np.int32(v)) * d + m


# ---------------------------------------------------------------------------------------------------- Q6_0


@njit(**KERNEL)
def _quantize_q6_0(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    weighted = qw.size > 0
    for r in prange(n_rows):
        xr = x[r]
        L = np.empty(QK, dtype=np.int8)
        weight = np.empty(QK, dtype=np.float32)
        sigma2 = _row_sigma2(xr) if weighted else np.float32(0.0)
        for ib in range(n // QK):
            base = ib * QK
            xb = xr[base : base + QK]
            o = ib * 26
            if weighted:
                _block_weights(xb, qw[base : base + QK], sigma2, weight)
            else:
                for j in range(QK):
                    weight[j] = xb[j] * xb[j]
            d = make_qx_quants(QK, 32, xb, L, weight)
            _store_f16(out[r], o, d)
            for k in range(8):
                out[r, o + 2 + k] = 0
            for j in range(16):
                h = (np.uint8(L[j]) >> np.uint8(4)) | ((np.uint8(L[j + 16]) >> np.uint8(4)) << np.uint8(2))
                out[r, o + 2 + j % 8] |= h << np.uint8(4 * (j // 8))
            _pack_nibbles(L, out[r], o + 10)


@njit(**KERNEL)
def _dequantize_q6_0(q: np.ndarray, out: np.ndarray, qk: int) -> None:
    n_rows, n = out.shape
    half = qk // 2
    quarter = qk // 4
    for r in prange(n_rows):
        qr = q[r]
        for ib in range(n // qk):
            o = ib * 26
            d = _load_f16(qr, o)
            qh = qr[o + 2 : o + 2 + quarter]
            y = out[r, ib * qk : (ib + 1) * qk]
            for k in range(2):
                src = qr[o + 10 + k * quarter : o + 10 + (k + 1) * quarter]
                lo = y[k * quarter : (k + 1) * quarter]
                hi = y[half + k * quarter : half + (k + 1) * quarter]
                shift = np.int32(4 * k)
                for j in range(quarter):
                    h = np.int32(qh[j]) >> shift
                    b = np.int32(src[j])
                    lo[j] = np.float32(np.int32(((b & I15) | ((h << I4) & np.int32(0x30))) - np.int32(32))) * d
                    hi[j] = np.float32(np.int32(((b >> I4) | ((h << np.int32(2)) & np.int32(0x30))) - np.int32(32))) * d


# ---------------------------------------------------------------------------------------------------- codecs


class Q8_0Codec(Codec):
    type_name = "Q8_0"
    uses_imatrix = False
    # d = amax/127 is stored as fp16
    max_abs_input = 65504.0 * 127
    rel_error_bound = 0.5 / 127 + 2.0**-11
    abs_error_floor = 127 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_q8_0(x, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q8_0(q, out, QK)


# max_abs_input of the searched types: with importance weights the scale is a weighted mean of x/l over codes
# |l| >= 1, so |d| <= amax and fp16 holds it up to 65504 (the plain paths would allow nmax times more). Q4_1 and
# Q5_1 also store the fitted min, which adversarial weights push to 2.4*amax, hence a quarter of that.


class Q4_0Codec(Codec):
    type_name = "Q4_0"
    # plain: d = max/-8 (fp16); the far side of the range clips at 7*|d| (error amax/8), rounding elsewhere costs
    # |d|/2, the fp16 rounding of d at most 8*|d|*2^-11
    max_abs_input = 65504.0
    rel_error_bound = 1.0 / 8 + 2.0**-10
    abs_error_floor = 8 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_sym(x, w, out, 8, 18)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q4_0(q, out, QK)


class Q5_0Codec(Codec):
    type_name = "Q5_0"
    # as Q4_0 with d = max/-16: clipping at 15*|d| costs amax/16
    max_abs_input = 65504.0
    rel_error_bound = 1.0 / 16 + 2.0**-10
    abs_error_floor = 16 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_sym(x, w, out, 16, 22)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q5_0(q, out, QK)


class Q4_1Codec(Codec):
    type_name = "Q4_1"
    # plain: d = (max - min)/15 and m = min as fp16; rounding costs d/2 <= amax/15, the fp16 rounding of d and m
    # at most 15*d*2^-11 + |m|*2^-11 <= 3*amax*2^-11
    max_abs_input = 65504.0 / 4
    rel_error_bound = 1.0 / 15 + 3 * 2.0**-11
    abs_error_floor = 16 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_affine(x, w, out, 15, 20)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q4_1(q, out, QK)


class Q5_1Codec(Codec):
    type_name = "Q5_1"
    # as Q4_1 with d = (max - min)/31
    max_abs_input = 65504.0 / 4
    rel_error_bound = 1.0 / 31 + 3 * 2.0**-11
    abs_error_floor = 32 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_affine(x, w, out, 31, 24)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q5_1(q, out, QK)


class Q6_0Codec(Codec):
    type_name = "Q6_0"
    # Always the weighted search (weights x^2 without an imatrix). Its trial scales are (32 +- 0.9)/max and
    # (31 +- 0.9)/max, so |d| >= amax/32.9 and a value clipped at the far code 31 is off by at most
    # amax*(1 - 31/32.9) < amax/16; rounding elsewhere costs |d|/2.
    max_abs_input = 65504.0
    rel_error_bound = 1.0 / 16
    abs_error_floor = 32 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_q6_0(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q6_0(q, out, QK)


for _codec in (Q8_0Codec(), Q4_0Codec(), Q4_1Codec(), Q5_0Codec(), Q5_1Codec(), Q6_0Codec()):
    register_codec(_codec.type_name, _codec)
