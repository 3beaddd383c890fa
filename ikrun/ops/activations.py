"""Element-wise activations; the exact mode's exponential (`exp64`, in vectors), and the ones ik's vector kernels use
for `--numerics ik` (`ik_expf`, its AVX-512 build's) and `--numerics ik-avx2` (`ik_expf_avx2`)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import f32_bits, f32_from_bits, f64_bits, f64_from_bits, fma64, fmaf
from ikrun.ops.parallel import claim_items, run_claimed, task_items

# ik's AVX-512 exponential: n = round(x log2 e) by the 1.5 x 2^23 trick, the reduced argument in two fused steps,
# a degree-5 polynomial, then j x 2^n (vscalefps), 0 or inf beyond |n| > 192
_LOG2E, _SHIFT = np.float32(float.fromhex("0x1.715476p+0")), np.float32(float.fromhex("0x1.8p23"))
_LN2_HI, _LN2_LO = np.float32(float.fromhex("0x1.62e4p-1")), np.float32(float.fromhex("0x1.7f7d1cp-20"))
_P5, _P4 = np.float32(float.fromhex("0x1.0e4020p-7")), np.float32(float.fromhex("0x1.573e2ep-5"))
_P3, _P2 = np.float32(float.fromhex("0x1.555e66p-3")), np.float32(float.fromhex("0x1.fffdb6p-2"))
_P1 = np.float32(float.fromhex("0x1.ffffecp-1"))


@njit(cache=True, nogil=True, inline="always")
def ik_expf(x: np.float32) -> np.float32:
    """exp(x) as ik's AVX-512 kernels compute it (softmax, SiLU): within 3 ulp of expf, and not the same bits.
    Branch-free, so loops over it vectorise."""
    z = fmaf(x, _LOG2E, _SHIFT)
    n = z - _SHIFT
    b = fmaf(-n, _LN2_LO, fmaf(-n, _LN2_HI, x))
    u = b * b
    j = fmaf(fmaf(fmaf(_P5, b, _P4), u, fmaf(_P3, b, _P2)), u, fmaf(_P1, b, np.float32(1.0)))
    big = abs(n) > np.float32(192.0)
    e = np.int64(0) if big else np.int64(n)
    two_n = f64_from_bits(np.uint64(e + 1023) << np.uint64(52))  # 2^n, |n| <= 192
    value = np.float32(np.float64(j) * two_n)  # exact in float64, rounded once (subnormals too)
    limit = np.float32(0.0) if n <= 0 else np.float32(np.inf)
    return limit if big else value


#: e^x in float64 (exp64): n = round(x log2 e) by adding 1.5 x 2^52, r = x - n ln 2 in two fused steps, e^r by its
#: Taylor series to r^12 / 12! (|r| <= 0.35: the next term under 2^-52), then x 2^n from n's bits
_LOG2E64 = 1.4426950408889634
_SHIFT64 = 6755399441055744.0
_LN2_HI64, _LN2_LO64 = float.fromhex("0x1.62e42fee00000p-1"), float.fromhex("0x1.a39ef35793c76p-33")
_SHIFT64_BITS = 0x4338000000000000
#: beyond these e^x leaves float64's normal range: 0 below, inf above (and in float32 long before)
_EXP64_LOW, _EXP64_HIGH = -708.0, 709.0
_C3, _C4, _C5, _C6, _C7, _C8, _C9, _C10, _C11, _C12 = (1.0 / math.factorial(k) for k in range(3, 13))


@njit(cache=True, nogil=True, inline="always")
def exp64(x: float) -> float:
    """e^x in float64 within two ulp of libm's, branch-free so loops over it vectorise (libm's exp and expf are a
    call a value); 0 below -708, inf above 709, NaN for NaN. Rounded to float32 it is expf correctly rounded but
    for values within 2^-51 of a rounding boundary."""
    z = fma64(x, _LOG2E64, _SHIFT64)
    n = z - _SHIFT64
    r = fma64(-n, _LN2_LO64, fma64(-n, _LN2_HI64, x))
    p = fma64(_C12, r, _C11)
    p = fma64(p, r, _C10)
    p = fma64(p, r, _C9)
    p = fma64(p, r, _C8)
    p = fma64(p, r, _C7)
    p = fma64(p, r, _C6)
    p = fma64(p, r, _C5)
    p = fma64(p, r, _C4)
    p = fma64(p, r, _C3)
    p = fma64(p, r, 0.5)
    p = fma64(p, r, 1.0)
    p = fma64(p, r, 1.0)
    two_n = f64_from_bits((f64_bits(z) - np.uint64(_SHIFT64_BITS) + np.uint64(1023)) << np.uint64(52))
    return 0.0 if x < _EXP64_LOW else np.inf if x > _EXP64_HIGH else p * two_n


_U32 = np.uint64(0xFFFFFFFF)


@njit(cache=True, nogil=True, inline="always")
def _u32(v: np.uint64) -> np.uint32:
    """v modulo 2^32 (AVX2's 32-bit integer lanes)."""
    return np.uint32(v & _U32)


@njit(cache=True, nogil=True, inline="always")
def ik_expf_avx2(x: np.float32) -> np.float32:
    """exp(x) as ik's AVX2 kernels compute it (softmax, SiLU): the same reduction and polynomial as ik_expf without
    its constant term, then k + j k with k = 2^n built from the exponent bits; beyond |n| > 126 two scale factors
    (s2 + j s2) s1, beyond |n| > 192 s1 s1 (0 or inf)."""
    z = fmaf(x, _LOG2E, _SHIFT)
    n = z - _SHIFT
    b = fmaf(-n, _LN2_LO, fmaf(-n, _LN2_HI, x))
    e = _u32(np.uint64(f32_bits(z)) << np.uint64(23))
    k = f32_from_bits(_u32(np.uint64(e) + np.uint64(0x3F800000)))
    u = b * b
    j = fmaf(fmaf(fmaf(_P5, b, _P4), u, fmaf(_P3, b, _P2)), u, _P1 * b)
    if not abs(n) > np.float32(126.0):
        return fmaf(j, k, k)
    g = np.uint64(0x82000000) if n <= np.float32(0.0) else np.uint64(0)
    s1 = f32_from_bits(_u32(g + np.uint64(0x7F000000)))
    if abs(n) > np.float32(192.0):
        return s1 * s1
    s2 = f32_from_bits(_u32(np.uint64(e) - g))
    return fmaf(s2, j, s2) * s1


@njit(cache=True, nogil=True, inline="always")
def ik_exp(x: np.float32, avx2: bool) -> np.float32:
    """ik's exponential of its AVX2 build (`avx2`) or of its AVX-512 one."""
    return ik_expf_avx2(x) if avx2 else ik_expf(x)


@njit(cache=True, nogil=True, inline="always")
def swiglu_value(g: np.float32, u: np.float32, limit: np.float32, alpha: np.float32, ik: bool,
                 avx2: bool) -> np.float32:
    """One clamped SwiGLU value from the gate and up projections, the exponential exp64's rounded to float32 (`ik`:
    with ik's exponential, `avx2` its AVX2 build's); a positive `alpha` is gpt-oss's form (up + 1) * gate *
    sigmoid(alpha * gate), whose exponential ik takes from libm."""
    g = min(g, limit)
    u = max(-limit, min(u, limit))
    if alpha > np.float32(0.0):
        x = -g * alpha
        return (u + np.float32(1.0)) * (g / (np.float32(1.0) + (np.exp(x) if ik else np.float32(exp64(x)))))
    e = ik_exp(-g, avx2) if ik else np.float32(exp64(-g))
    return (g / (np.float32(1.0) + e)) * u


@njit(cache=True, nogil=True, inline="always")
def _row(gate: np.ndarray, up: np.ndarray, limit: np.float32, ik: bool, avx2: bool, out: np.ndarray) -> None:
    for j in range(gate.shape[0]):
        out[j] = swiglu_value(gate[j], up[j], limit, np.float32(0.0), ik, avx2)


@njit(cache=True, nogil=True, error_model="numpy")
def _serial(gate: np.ndarray, up: np.ndarray, limit: float, ik: bool, avx2: bool, out: np.ndarray) -> None:
    for i in range(gate.shape[0]):
        _row(gate[i], up[i], np.float32(limit), ik, avx2, out[i])


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _parallel(gate: np.ndarray, up: np.ndarray, limit: float, ik: bool, avx2: bool, out: np.ndarray,
              threads: int) -> None:
    """The rows in tasks the threads claim (ikrun/ops/parallel.py)."""
    per, counter = task_items(gate.shape[0], threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        i0, i1 = claim_items(counter, per, gate.shape[0])
        while i0 < i1:
            for i in range(i0, i1):
                _row(gate[i], up[i], np.float32(limit), ik, avx2, out[i])
            i0, i1 = claim_items(counter, per, gate.shape[0])


def swiglu(gate: np.ndarray, up: np.ndarray, limit: float = np.inf, ik: bool = False, avx2: bool = False) -> np.ndarray:
    """silu(gate) * up, as ggml's fused up-gate computes it; a finite `limit` first clamps gate to at most limit and
    up to [-limit, limit] (DeepSeek-V4's SwiGLU clamps; with the default nothing changes, not even a bit); the
    exponential exp64's, rounded to float32 (libm's expf, a call a value, took 2.2-3.1 ms for 256 x 6,144 values on
    2 threads, this 0.8-0.9; of 4 M values 2,459 differ, each by an ulp, and this one is nearer e^x in all); `ik`:
    with ik's exponential (ik_expf, or with `avx2` its AVX2 build's), as --numerics ik computes it."""
    gate = np.ascontiguousarray(gate, dtype=np.float32)
    d = gate.shape[-1]
    out = np.empty_like(gate)
    run_claimed(_serial, _parallel, gate.size, gate.reshape(-1, d),
                np.ascontiguousarray(up, dtype=np.float32).reshape(-1, d), float(limit), ik, avx2,
                out.reshape(-1, d))
    return out
