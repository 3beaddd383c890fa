"""Element-wise activations, and the exponential ik's vector kernels use (`ik_expf`) for `--numerics ik`."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import f64_from_bits, fmaf
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


@njit(cache=True, nogil=True, inline="always")
def _row(gate: np.ndarray, up: np.ndarray, limit: np.float32, ik: bool, out: np.ndarray) -> None:
    for j in range(gate.shape[0]):
        g = min(gate[j], limit)
        u = max(-limit, min(up[j], limit))
        e = ik_expf(-g) if ik else np.exp(-g)
        out[j] = (g / (np.float32(1.0) + e)) * u


@njit(cache=True, nogil=True)
def _serial(gate: np.ndarray, up: np.ndarray, limit: float, ik: bool, out: np.ndarray) -> None:
    for i in range(gate.shape[0]):
        _row(gate[i], up[i], np.float32(limit), ik, out[i])


@njit(cache=True, nogil=True, parallel=True)
def _parallel(gate: np.ndarray, up: np.ndarray, limit: float, ik: bool, out: np.ndarray, threads: int) -> None:
    """The rows in tasks the threads claim (ikrun/ops/parallel.py)."""
    per, counter = task_items(gate.shape[0], threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        i0, i1 = claim_items(counter, per, gate.shape[0])
        while i0 < i1:
            for i in range(i0, i1):
                _row(gate[i], up[i], np.float32(limit), ik, out[i])
            i0, i1 = claim_items(counter, per, gate.shape[0])


def swiglu(gate: np.ndarray, up: np.ndarray, limit: float = np.inf, ik: bool = False) -> np.ndarray:
    """silu(gate) * up, as ggml's fused up-gate computes it; a finite `limit` first clamps gate to at most limit and
    up to [-limit, limit] (DeepSeek-V4's SwiGLU clamps; with the default nothing changes, not even a bit); `ik`:
    with ik's exponential (ik_expf), as --numerics ik computes it."""
    gate = np.ascontiguousarray(gate, dtype=np.float32)
    d = gate.shape[-1]
    out = np.empty_like(gate)
    run_claimed(_serial, _parallel, gate.size, gate.reshape(-1, d),
                np.ascontiguousarray(up, dtype=np.float32).reshape(-1, d), float(limit), ik, out.reshape(-1, d))
    return out
