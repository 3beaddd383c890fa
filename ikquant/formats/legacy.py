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
from ikquant.formats.numeric import fmaf, load_f16, roundf, store_f16
from ikquant.formats.scale_search import make_qkx3_blocks, make_qx_quants, qkx3_scratch, qx_scratch

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
            store_f16(out[r], o, d)
            for j in range(QK):
                out[r, o + 2 + j] = np.uint8(np.int8(roundf(x[r, base + j] * idv)))


@njit(**KERNEL)
def _dequantize_q8_0(q: np.ndarray, out: np.ndarray, qk: int) -> None:
    n_rows, n = out.shape
    qi = q.view(np.int8)
    for r in prange(n_rows):
        for ib in range(n // qk):
            o = ib * 34
            d = load_f16(q[r], o)
            for j in range(qk):
                out[r, ib * qk + j] = np.float32(qi[r, o + 2 + j]) * d


# ---------------------------------------------------------------------------------------------------- Q4_0, Q5_0


@njit(**SCALAR)
def _plain_sym_row(xr: np.ndarray, nmax: int, orow: np.ndarray, type_size: int) -> None:
    """A row of Q4_0 / Q5_0 blocks without importance weights (a function of its own: inside the prange body the
    same loops ran at half this speed)."""
    for ib in range(xr.size // QK):
        _plain_sym_block(xr[ib * QK : (ib + 1) * QK], nmax, orow, ib * type_size)


@njit(**SCALAR)
def _plain_sym_block(xb: np.ndarray, nmax: int, orow: np.ndarray, o: int) -> None:
    """A Q4_0 / Q5_0 block without importance weights, as ik's reference: d = (the first value of largest
    magnitude) / -nmax, each code the truncation of x*id + nmax + 0.5 (one fused rounding) to int8, capped at the
    top code. Codes j and j+16 are computed and packed into byte j in one loop, as ik's loop does (to a runtime
    bound: LLVM vectorises that loop, where it unrolls a constant 16 into scalar code)."""
    fn = np.float32(nmax)
    amax = np.float32(0.0)
    vmax = np.float32(0.0)
    for j in range(xb.size):
        if amax < abs(xb[j]):
            amax = abs(xb[j])
            vmax = xb[j]
    d = vmax / -fn
    idv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    off = fn + np.float32(0.5)
    top = np.int32(2 * nmax - 1)
    half = xb.size // 2
    store_f16(orow, o, d)
    if nmax == 8:
        qs = orow[o + 2 : o + 2 + half]
        for j in range(half):
            c0 = min(top, np.int32(np.int8(np.int32(fmaf(xb[j], idv, off)))))
            c1 = min(top, np.int32(np.int8(np.int32(fmaf(xb[j + half], idv, off)))))
            qs[j] = np.uint8(c0 | (c1 << 4))
        return
    qs = orow[o + 6 : o + 6 + half]
    qh = np.uint32(0)
    for j in range(half):
        c0 = min(top, np.int32(np.int8(np.int32(fmaf(xb[j], idv, off)))))
        c1 = min(top, np.int32(np.int8(np.int32(fmaf(xb[j + half], idv, off)))))
        qs[j] = np.uint8((c0 & 15) | ((c1 & 15) << 4))
        qh |= (np.uint32((c0 >> 4) & 1) << np.uint32(j)) | (np.uint32((c1 >> 4) & 1) << np.uint32(j + half))
    for k in range(4):
        orow[o + 2 + k] = np.uint8((qh >> np.uint32(8 * k)) & np.uint32(0xFF))


@njit(**KERNEL)
def _quantize_sym(x: np.ndarray, qw: np.ndarray, out: np.ndarray, nmax: int, type_size: int) -> None:
    """Q4_0 (nmax 8) and Q5_0 (nmax 16): codes q in [0, 2*nmax), y = (q - nmax)*d."""
    n_rows, n = x.shape
    weighted = qw.size > 0
    for r in prange(n_rows):
        if not weighted:
            _plain_sym_row(x[r], nmax, out[r], type_size)
            continue
        scratch = qx_scratch(QK)
        xr = x[r]
        L = np.empty(QK, dtype=np.int8)
        weight = np.empty(QK, dtype=np.float32)
        sigma2 = _row_sigma2(xr)
        for ib in range(n // QK):
            base = ib * QK
            xb = xr[base : base + QK]
            o = ib * type_size
            _block_weights(xb, qw[base : base + QK], sigma2, weight)
            d = make_qx_quants(QK, nmax, xb, L, weight, scratch)
            store_f16(out[r], o, d)
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
            d = load_f16(qr, o)
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
            d = load_f16(qr, o)
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


@njit(**SCALAR)
def _plain_affine_row(xr: np.ndarray, nmax: int, orow: np.ndarray, type_size: int) -> None:
    """A row of Q4_1 / Q5_1 blocks without importance weights (in a function of its own, as _plain_sym_row)."""
    for ib in range(xr.size // QK):
        _plain_affine_block(xr[ib * QK : (ib + 1) * QK], nmax, orow, ib * type_size)


@njit(**SCALAR)
def _plain_affine_block(xb: np.ndarray, nmax: int, orow: np.ndarray, o: int) -> None:
    """A Q4_1 / Q5_1 block without importance weights, as ik's reference: d = (max - min) / nmax, each code the
    truncation of (x - min)*id + 0.5 (one fused rounding), Q4_1's capped at 15 through int8, Q5_1's kept to 8 bits;
    codes j and j+16 packed into byte j in one loop (as _plain_sym_block)."""
    m = np.float32(np.finfo(np.float32).max)
    mx = -m
    for j in range(xb.size):
        if xb[j] < m:
            m = xb[j]
        if xb[j] > mx:
            mx = xb[j]
    d = (mx - m) / np.float32(nmax)
    idv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    half = xb.size // 2
    store_f16(orow, o, d)
    store_f16(orow, o + 2, m)
    if nmax == 15:
        qs = orow[o + 4 : o + 4 + half]
        for j in range(half):
            c0 = min(np.int32(15), np.int32(np.int8(np.int32(fmaf(xb[j] - m, idv, np.float32(0.5))))))
            c1 = min(np.int32(15), np.int32(np.int8(np.int32(fmaf(xb[j + half] - m, idv, np.float32(0.5))))))
            qs[j] = np.uint8((c0 & 15) | ((c1 & 15) << 4))
        return
    qs = orow[o + 8 : o + 8 + half]
    qh = np.uint32(0)
    for j in range(half):
        c0 = np.int32(fmaf(xb[j] - m, idv, np.float32(0.5)))
        c1 = np.int32(fmaf(xb[j + half] - m, idv, np.float32(0.5)))
        qs[j] = np.uint8((c0 & 15) | ((c1 & 15) << 4))
        qh |= (np.uint32((c0 >> 4) & 1) << np.uint32(j)) | (np.uint32((c1 >> 4) & 1) << np.uint32(j + half))
    for k in range(4):
        orow[o + 4 + k] = np.uint8((qh >> np.uint32(8 * k)) & np.uint32(0xFF))


@njit(**KERNEL)
def _quantize_affine(x: np.ndarray, qw: np.ndarray, out: np.ndarray, nmax: int, type_size: int) -> None:
    """Q4_1 (nmax 15) and Q5_1 (nmax 31): codes q in [0, nmax], y = q*d + m."""
    n_rows, n = x.shape
    nb = n // QK
    weighted = qw.size > 0
    for r in prange(n_rows):
        if not weighted:
            _plain_affine_row(x[r], nmax, out[r], type_size)
            continue
        xr = x[r]
        codes = np.empty((nb, QK), dtype=np.uint8)
        weight = np.empty((nb, QK), dtype=np.float32)
        ds = np.empty(nb, dtype=np.float32)
        ms = np.empty(nb, dtype=np.float32)
        # the row's blocks searched together (make_qkx3_blocks runs several side by side)
        sigma2 = _row_sigma2(xr)
        for ib in range(nb):
            _block_weights(xr[ib * QK : (ib + 1) * QK], qw[ib * QK : (ib + 1) * QK], sigma2, weight[ib])
        make_qkx3_blocks(nmax, xr.reshape(nb, QK), weight, codes, False, ds, ms, qkx3_scratch(QK))
        for ib in range(nb):
            o = ib * type_size
            L = codes[ib]
            d, m = ds[ib], ms[ib]
            store_f16(out[r], o, d)
            store_f16(out[r], o + 2, m)
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
            d = load_f16(qr, o)
            m = load_f16(qr, o + 2)
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
            d = load_f16(qr, o)
            m = load_f16(qr, o + 2)
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
        scratch = qx_scratch(QK)
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
            d = make_qx_quants(QK, 32, xb, L, weight, scratch)
            store_f16(out[r], o, d)
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
            d = load_f16(qr, o)
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


class Q8_0Codec(Codec, type_name="Q8_0"):
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


class Q4_0Codec(Codec, type_name="Q4_0"):
    block_scale_f16 = 0
    # plain: d = max/-8 (fp16); the far side of the range clips at 7*|d| (error amax/8), rounding elsewhere costs
    # |d|/2, the fp16 rounding of d at most 8*|d|*2^-11
    max_abs_input = 65504.0
    rel_error_bound = 1.0 / 8 + 2.0**-10
    abs_error_floor = 8 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_sym(x, w, out, 8, 18)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q4_0(q, out, QK)


class Q5_0Codec(Codec, type_name="Q5_0"):
    block_scale_f16 = 0
    # as Q4_0 with d = max/-16: clipping at 15*|d| costs amax/16
    max_abs_input = 65504.0
    rel_error_bound = 1.0 / 16 + 2.0**-10
    abs_error_floor = 16 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_sym(x, w, out, 16, 22)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q5_0(q, out, QK)


class Q4_1Codec(Codec, type_name="Q4_1"):
    # plain: d = (max - min)/15 and m = min as fp16; rounding costs d/2 <= amax/15, the fp16 rounding of d and m
    # at most 15*d*2^-11 + |m|*2^-11 <= 3*amax*2^-11
    max_abs_input = 65504.0 / 4
    rel_error_bound = 1.0 / 15 + 3 * 2.0**-11
    abs_error_floor = 16 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_affine(x, w, out, 15, 20)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q4_1(q, out, QK)


class Q5_1Codec(Codec, type_name="Q5_1"):
    # as Q4_1 with d = (max - min)/31
    max_abs_input = 65504.0 / 4
    rel_error_bound = 1.0 / 31 + 3 * 2.0**-11
    abs_error_floor = 32 * 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_affine(x, w, out, 31, 24)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q5_1(q, out, QK)


class Q6_0Codec(Codec, type_name="Q6_0"):
    block_scale_f16 = 0
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

