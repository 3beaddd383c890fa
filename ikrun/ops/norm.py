"""RMS normalisation as ggml computes it: the sum of squares in float64, the scale and product in float32; the
normalised value times the weight as transformers multiplies them, or under --numerics ik (`ik`) the scale times the
weight first, then the value (ik's fused RMS norm)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikrun.ops.parallel import claim_items, run_claimed, task_items


@njit(cache=True, nogil=True, inline="always")
def _row(x: np.ndarray, w: np.ndarray, eps: float, ik: bool, out: np.ndarray) -> None:
    s = 0.0
    for j in range(x.shape[0]):
        v = x[j]
        s += np.float64(v * v)
    _scaled(x, w, s, eps, ik, out)


@njit(cache=True, nogil=True, inline="always")
def _scaled(x: np.ndarray, w: np.ndarray, s: float, eps: float, ik: bool, out: np.ndarray) -> None:
    """A row times its scale from the sum of squares s, and the weight."""
    d = x.shape[0]
    scale = np.float32(1.0) / np.sqrt(np.float32(s / d) + np.float32(eps))
    for j in range(d):
        out[j] = (scale * w[j]) * x[j] if ik else (x[j] * scale) * w[j]


@njit(cache=True, nogil=True, inline="always")
def _rows(x: np.ndarray, w: np.ndarray, eps: float, ik: bool, out: np.ndarray, i0: int, i1: int) -> None:
    """Rows i0 .. i1 - 1, four at a time where there are four: their float64 sums of squares (each in ggml's order,
    one chain a row, 4 cycles a value) run side by side."""
    i = i0
    while i + 4 <= i1:
        s0 = s1 = s2 = s3 = 0.0
        for j in range(x.shape[1]):
            v0, v1, v2, v3 = x[i, j], x[i + 1, j], x[i + 2, j], x[i + 3, j]
            s0 += np.float64(v0 * v0)
            s1 += np.float64(v1 * v1)
            s2 += np.float64(v2 * v2)
            s3 += np.float64(v3 * v3)
        _scaled(x[i], w, s0, eps, ik, out[i])
        _scaled(x[i + 1], w, s1, eps, ik, out[i + 1])
        _scaled(x[i + 2], w, s2, eps, ik, out[i + 2])
        _scaled(x[i + 3], w, s3, eps, ik, out[i + 3])
        i += 4
    for r in range(i, i1):
        _row(x[r], w, eps, ik, out[r])


@njit(cache=True, nogil=True)
def _serial(x: np.ndarray, w: np.ndarray, eps: float, ik: bool, out: np.ndarray) -> None:
    _rows(x, w, eps, ik, out, 0, x.shape[0])


@njit(cache=True, nogil=True, parallel=True)
def _parallel(x: np.ndarray, w: np.ndarray, eps: float, ik: bool, out: np.ndarray, threads: int) -> None:
    """The rows in tasks the threads claim (ikrun/ops/parallel.py)."""
    per, counter = task_items(x.shape[0], threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        i0, i1 = claim_items(counter, per, x.shape[0])
        while i0 < i1:
            _rows(x, w, eps, ik, out, i0, i1)
            i0, i1 = claim_items(counter, per, x.shape[0])


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, ik: bool = False) -> np.ndarray:
    """RMSNorm over the last axis of `x` (any leading shape), times `weight` (`ik`: in ik's order)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat = x.reshape(-1, x.shape[-1])
    out = np.empty_like(flat)
    run_claimed(_serial, _parallel, flat.size, flat, np.ascontiguousarray(weight, dtype=np.float32), float(eps), ik, out)
    return out.reshape(x.shape)


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis as ggml_norm then the weight and bias: mean and variance summed in float64,
    the centred values, scale and affine part in float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    d = x.shape[-1]
    centred = x - (x.sum(axis=-1, dtype=np.float64, keepdims=True) / d).astype(np.float32)
    var = ((centred * centred).sum(axis=-1, dtype=np.float64, keepdims=True) / d).astype(np.float32)
    return centred * (np.float32(1.0) / np.sqrt(var + np.float32(eps))) * weight + bias
