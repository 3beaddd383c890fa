"""Element-wise activations, and the exponentials ik's vector kernels use for `--numerics ik` (`ik_expf`, its AVX-512
build's) and `--numerics ik-avx2` (`ik_expf_avx2`)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import f32_bits, f32_from_bits, f64_from_bits, fmaf
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
def _row(gate: np.ndarray, up: np.ndarray, limit: np.float32, ik: bool, avx2: bool, out: np.ndarray) -> None:
    for j in range(gate.shape[0]):
        g = min(gate[j], limit)
        u = max(-limit, min(up[j], limit))
        e = ik_exp(-g, avx2) if ik else np.exp(-g)
        out[j] = (g / (np.float32(1.0) + e)) * u


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
    up to [-limit, limit] (DeepSeek-V4's SwiGLU clamps; with the default nothing changes, not even a bit); `ik`:
    with ik's exponential (ik_expf, or with `avx2` its AVX2 build's), as --numerics ik computes it."""
    gate = np.ascontiguousarray(gate, dtype=np.float32)
    d = gate.shape[-1]
    out = np.empty_like(gate)
    run_claimed(_serial, _parallel, gate.size, gate.reshape(-1, d),
                np.ascontiguousarray(up, dtype=np.float32).reshape(-1, d), float(limit), ik, avx2,
                out.reshape(-1, d))
    return out
