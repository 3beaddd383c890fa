"""Two formats with one scale for many values: Q8_KV (ik's 8-bit rows with a per-row f32 scale, the format its
K-cache uses) and Q1_0_G128 (the 1-bit "Bonsai" blocks: 128 signs and one f16 magnitude).

Q8_KV rows are an 8-byte header (f32 scale amax/127, int32 sum of the codes) followed by one int8 code per value,
rounded to nearest even after multiplying by the f32 reciprocal of the scale. Q1_0_G128 stores the mean absolute
value of each 128-value block (summed in order in float32) as f16 and a bit per value that is set for x >= 0;
decoding gives +d or -d. Neither reads importance weights (ik ignores them for both).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.base import Codec
from ikquant.formats.numeric import finite_abs_max, load_f16, load_f32, store_f16, store_f32

KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")
QK1 = 128


@njit(**KERNEL)
def _quantize_q8_kv(x: np.ndarray, out: np.ndarray, limit: float) -> bool:
    """Q8_KV rows; False when some |x| is beyond `limit` or not finite (its row's max |x| is then beyond it, NaN or
    infinite)."""
    lim = np.float32(limit)
    n_rows, n = x.shape
    codes = out.view(np.int8)
    bad = np.zeros(n_rows, np.bool_)
    for r in prange(n_rows):
        amax = finite_abs_max(x[r])
        if not amax <= lim:
            bad[r] = True
            continue
        if amax == 0:
            out[r, :] = 0
            continue
        d = amax / np.float32(127.0)
        total = _q8_kv_codes(x[r], np.float32(1.0) / d, codes[r, 8:])
        store_f32(out[r], 0, d)
        u = np.uint32(np.int64(total) & 0xFFFFFFFF)
        for k in range(4):
            out[r, 4 + k] = np.uint8((u >> np.uint32(8 * k)) & np.uint32(0xFF))
    return not bad.any()


@njit(cache=True, nogil=True)
def _q8_kv_codes(xr: np.ndarray, mul: np.float32, codes: np.ndarray) -> np.int32:
    """One row's codes (saturated to int8) and the sum of the unsaturated ones. x86's float-to-int conversion gives
    INT_MIN for out-of-range values (the reciprocal overflows when max|x| < 127/FLT_MAX); the saturating packs then
    store -128. With a finite multiplier no product exceeds ~127, and the loop without range tests vectorises; its
    sum is kept in 32 bits (wrapping, as the int32 result does), where Numba's int64 sum halved the vector lanes."""
    if abs(mul) < np.inf:
        acc = np.int32(0)
        for j in range(xr.size):
            q = np.int32(np.rint(mul * xr[j]))
            codes[j] = np.int8(min(max(q, np.int32(-128)), np.int32(127)))
            acc = np.int32(acc + q)
        return acc
    total = np.int32(0)
    for j in range(xr.size):
        v = mul * xr[j]
        q = np.int32(np.rint(v)) if abs(v) < np.float32(2147483648.0) else np.int32(-2147483648)
        codes[j] = np.int8(min(max(q, np.int32(-128)), np.int32(127)))
        total += q
    return total


@njit(**KERNEL)
def _dequantize_q8_kv(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    codes = q.view(np.int8)
    for r in prange(n_rows):
        d = load_f32(q[r], 0)
        for j in range(n):
            out[r, j] = d * np.float32(codes[r, 8 + j])


@njit(**KERNEL)
def _quantize_q1_0(x: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    for r in prange(n_rows):
        for ib in range(n // QK1):
            base, o = ib * QK1, ib * 18
            s = np.float32(0.0)
            for j in range(QK1):
                s += abs(x[r, base + j])
            store_f16(out[r], o, s / np.float32(QK1))
            for k in range(QK1 // 8):
                bits = np.uint8(0)
                for j in range(8):
                    if x[r, base + 8 * k + j] >= 0:
                        bits |= np.uint8(1 << j)
                out[r, o + 2 + k] = bits


@njit(**KERNEL)
def _dequantize_q1_0(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        for ib in range(n // QK1):
            o = ib * 18
            d = load_f16(q[r], o)
            for k in range(QK1 // 8):
                bits = q[r, o + 2 + k]
                for j in range(8):
                    out[r, ib * QK1 + 8 * k + j] = d if (bits >> j) & 1 else -d


class Q8KVCodec(Codec, type_name="Q8_KV"):
    uses_imatrix = False
    # rounding to the nearest code costs half a step (amax/254), the f32 reciprocal a few ulps; below
    # amax = 127/FLT_MAX the reciprocal overflows and ik stores -128 codes: the error there is at most 2*amax
    rel_error_bound = 0.5 / 127 + 2.0**-20
    abs_error_floor = 2 * 127 / float(np.finfo(np.float32).max)
    checks_values = True

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        self._quantize_checked(x, w, out)

    def _quantize_checked(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> bool:
        return bool(_quantize_q8_kv(x, out, self.max_abs_input))

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q8_kv(q, out)


class Q1_0G128Codec(Codec, type_name="Q1_0_G128"):
    uses_imatrix = False
    # the f16 magnitude is the block's mean |x|, at most amax; a value is off by at most max(|x|, d) <= amax, plus
    # the f16 rounding of d
    max_abs_input = 65504.0
    rel_error_bound = 1.0 + 2.0**-10
    abs_error_floor = 2.0**-24

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_q1_0(x, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q1_0(q, out)

