"""ggml-quants.c's weighted scale searches that both the legacy types (legacy.py) and the k-quants (kquants.py) run.

make_qx_quants fits a symmetric scale (Q4_0, Q5_0, Q6_0; Q3_K and Q6_K, and Q3_K's sub-block scales), and
make_qkx3_quants a scale and a min (Q4_1, Q5_1; Q2_K, Q4_K, Q5_K). The float arithmetic follows ik's GCC build
operation by operation: `fmaf`/`fma64` where GCC fused a multiply-add, separately rounded products summed in order
where it vectorised a loop.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ikquant.formats.numeric import abs_max, fma64, fmaf, nearest_int_fma

NJIT = dict(cache=True, nogil=True, error_model="numpy")


@njit(**NJIT)
def make_qx_quants(n: int, nmax: int, x: np.ndarray, L: np.ndarray, w: np.ndarray) -> np.float32:
    """ik's importance-weighted symmetric scale search (rmse_type 1 with explicit weights).

    Returns the scale; L receives codes in [0, 2*nmax). The multiply-adds are fused where ik's GCC build fuses them.
    """
    amax, fmax = abs_max(x[:n])
    if amax < np.float32(1e-15):
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    fn = np.float32(nmax)
    # the code range as int32: Numba would clamp against int64 bounds in 64-bit lanes, half the vector width
    lo, hi = np.int32(-nmax), np.int32(nmax - 1)
    iscale = -fn / fmax
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        l = min(hi, max(lo, nearest_int_fma(iscale, x[i])))
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
            fl = np.float32(min(hi, max(lo, nearest_int_fma(iscales[c], xi))))
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
            L[i] = nmax + min(hi, max(lo, nearest_int_fma(iscales[winner], x[i])))
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



@njit(**NJIT)
def _qkx3_error(
    scale: float, mn: float, sum_w: float, sum_x: float, sum_x2: float, sum_l: float, sum_l2: float, sum_xl: float
) -> float:
    """Weighted squared error of (scale, min) from the moments, in the fused order of ik's build."""
    t = fma64(-(2.0 * scale), sum_xl, sum_x2)
    t = fma64(-sum_x, 2.0 * mn, t)
    t = fma64(sum_l, (2.0 * scale) * mn, t)
    t = fma64(sum_l2, scale * scale, t)
    return fma64(sum_w, mn * mn, t)


@njit(**NJIT)
def _qkx3_gain(
    scale: float, mn: float, sum_w: float, sum_x: float, sum_l: float, sum_l2: float, sum_xl: float
) -> float:
    """sum_x2 minus the weighted squared error of (scale, min), in the fused order of ik's build."""
    t = (2.0 * mn) * sum_x
    t = fma64(2.0 * scale, sum_xl, t)
    t = fma64(-((2.0 * scale) * mn), sum_l, t)
    t = fma64(-(scale * scale), sum_l2, t)
    return fma64(-(mn * mn), sum_w, t)


@njit(**NJIT)
def _qkx3_fit(sum_w: float, sum_x: float, sum_l: float, sum_l2: float, sum_xl: float) -> tuple[float, float, float]:
    """Least-squares (scale, min) for fixed codes, min clamped to <= 0; returns (D, scale, min), D <= 0: no fit."""
    D = fma64(sum_w, sum_l2, -(sum_l * sum_l))
    if D <= 0:
        return D, 0.0, 0.0
    this_min = fma64(sum_l2, sum_x, -(sum_l * sum_xl)) / D
    if this_min > 0:
        return D, sum_xl / sum_l2, 0.0
    return D, fma64(-sum_l, sum_x, sum_xl * sum_w) / D, this_min


@njit(**NJIT)
def make_qkx3_quants(nmax: int, x: np.ndarray, w: np.ndarray, L: np.ndarray, fused_sum_x2: bool
                     ) -> tuple[np.float32, np.float32]:
    """ik's weighted scale-and-min search (rmin -0.9, rdelta 0.05, nstep 36, squared error: the settings of every
    caller in ik) over len(x) values.

    Returns (scale, min) with min <= 0, so y = scale*L + min; L receives codes in [0, nmax]. The moments are in
    float64 as in ik; fused and unfused steps follow ik's GCC build, which fuses the x^2 sum in the 16-value copy
    (Q2_K) but not in the 32-value ones (Q4_K, Q5_K, Q4_1, Q5_1): `fused_sum_x2` selects which.
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
        sum_x2 = fma64(wx, xi, sum_x2) if fused_sum_x2 else sum_x2 + wx * xi
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
    # a trial's codes in a vectorised pass (32-bit clamp), then its float64 sums in ik's order
    Laux = np.empty(n, dtype=np.int32)
    top = np.int32(nmax)
    for step in range(37):
        iscale = (fmaf(np.float32(step), np.float32(0.05), np.float32(-0.9)) + fnmax) / (mx - mn)
        sum_l = 0.0
        sum_l2 = 0.0
        sum_xl = 0.0
        for i in range(n):
            Laux[i] = min(top, max(np.int32(0), nearest_int_fma(x[i] - mn, iscale)))
        for i in range(n):
            fl = np.float64(Laux[i])
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
