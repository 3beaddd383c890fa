"""Legacy 32-value block formats: Q4_0 and Q8_0.

Q8_0 ignores importance weights (ik's quantize_q8_0 always takes the reference path). Q4_0 with weights runs ik's
weighted scale search (make_qx_quants, rmse_type 1); without weights it takes the reference rounding.
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
    roundf,
)
from ikquant.types import register_codec

QK = 32
KERNEL = dict(cache=True, nogil=True, parallel=True)


@njit(cache=True, nogil=True)
def _store_f16(out: np.ndarray, pos: int, v: np.float32) -> None:
    h = f32_to_f16_bits(v)
    out[pos] = np.uint8(h & np.uint16(0xFF))
    out[pos + 1] = np.uint8(h >> np.uint16(8))


@njit(cache=True, nogil=True)
def _load_f16(q: np.ndarray, pos: int) -> np.float32:
    return f16_bits_to_f32(np.uint16(q[pos]) | (np.uint16(q[pos + 1]) << np.uint16(8)))


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
def _dequantize_q8_0(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        for ib in range(n // QK):
            o = ib * 34
            d = _load_f16(q[r], o)
            for j in range(QK):
                out[r, ib * QK + j] = np.float32(np.int8(q[r, o + 2 + j])) * d


@njit(cache=True, nogil=True)
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
    for step in range(-9, 10):
        fis = np.float32(step)
        for sign in range(2):
            if sign == 0:
                iscale = -fmaf(np.float32(0.1), fis, fn) / fmax
            else:
                iscale = fmaf(np.float32(0.1), fis, fn - np.float32(1.0)) / fmax
            sumlx = np.float32(0.0)
            suml2 = np.float32(0.0)
            # ik's build vectorises this loop: products are rounded, then summed in order (no fused adds)
            for i in range(n):
                l = min(nmax - 1, max(-nmax, nearest_int_fma(iscale, x[i])))
                fl = np.float32(l)
                sumlx += (w[i] * x[i]) * fl
                suml2 += (w[i] * fl) * fl
            if suml2 > 0 and sumlx * sumlx > best * suml2:
                for i in range(n):
                    L[i] = nmax + min(nmax - 1, max(-nmax, nearest_int_fma(iscale, x[i])))
                scale = sumlx / suml2
                best = scale * sumlx
                best_sumlx = sumlx
                best_suml2 = suml2
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
        if gmax > 0:
            new_sumlx = fmaf(wj, x[best_j], sumlx)
            new_suml2 = fmaf(wj, np.float32(2 * l + 1), suml2)
            l += 1
        else:
            new_sumlx = fmaf(-wj, x[best_j], sumlx)
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


@njit(**KERNEL)
def _quantize_q4_0(x: np.ndarray, qw: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    weighted = qw.size > 0
    for r in prange(n_rows):
        xr = x[r]
        L = np.empty(QK, dtype=np.int8)
        weight = np.empty(QK, dtype=np.float32)
        sigma2 = np.float32(0.0)
        if weighted:
            sum_x2 = np.float32(0.0)
            for j in range(n):
                sum_x2 = fmaf(xr[j], xr[j], sum_x2)
            sigma2 = sum_x2 / np.float32(n)
        for ib in range(n // QK):
            base = ib * QK
            o = ib * 18
            if weighted:
                for j in range(QK):
                    weight[j] = qw[base + j] * np.sqrt(fmaf(xr[base + j], xr[base + j], sigma2))
                d = make_qx_quants(QK, 8, xr[base : base + QK], L, weight)
                _store_f16(out[r], o, d)
                for j in range(16):
                    out[r, o + 2 + j] = np.uint8(L[j]) | (np.uint8(L[j + 16]) << np.uint8(4))
            else:
                amax = np.float32(0.0)
                vmax = np.float32(0.0)
                for j in range(QK):
                    v = xr[base + j]
                    if amax < abs(v):
                        amax = abs(v)
                        vmax = v
                d = vmax / np.float32(-8.0)
                idv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
                _store_f16(out[r], o, d)
                for j in range(16):
                    x0 = fmaf(xr[base + j], idv, np.float32(8.5))
                    x1 = fmaf(xr[base + 16 + j], idv, np.float32(8.5))
                    q0 = min(15, np.int32(np.int8(np.int32(x0))))
                    q1 = min(15, np.int32(np.int8(np.int32(x1))))
                    out[r, o + 2 + j] = np.uint8(q0) | (np.uint8(q1) << np.uint8(4))


@njit(**KERNEL)
def _dequantize_q4_0(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        for ib in range(n // QK):
            o = ib * 18
            d = _load_f16(q[r], o)
            for j in range(16):
                b = q[r, o + 2 + j]
                out[r, ib * QK + j] = np.float32(np.int32(b & 15) - 8) * d
                out[r, ib * QK + j + 16] = np.float32(np.int32(b >> 4) - 8) * d


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
        _dequantize_q8_0(q, out)


class Q4_0Codec(Codec):
    type_name = "Q4_0"
    # d = max/-8 is stored as fp16; the far side of the range clips at 7*|d|
    max_abs_input = 65504.0 * 8
    rel_error_bound = 1.0 / 8 + 2.0**-10
    abs_error_floor = 8 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_q4_0(x, w, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q4_0(q, out)


for _codec in (Q8_0Codec(), Q4_0Codec()):
    register_codec(_codec.type_name, _codec)
