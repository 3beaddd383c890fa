"""Causal multi-head attention with grouped KV heads, scores through BLAS, the masked softmax in Numba."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikrun.ops.parallel import pick

# Query rows per block: bounds the score buffer to heads x block x n_kv floats for long chunks.
QUERY_BLOCK = 256


@njit(cache=True, nogil=True, inline="always")
def _row(r: np.ndarray, sc: np.float32, last: int) -> None:
    m = -np.inf
    for j in range(last + 1):
        v = r[j] * sc
        r[j] = v
        if v > m:
            m = v
    s = 0.0
    for j in range(last + 1):
        e = np.exp(r[j] - m)
        r[j] = e
        s += np.float64(e)
    inv = np.float32(1.0 / s)
    for j in range(last + 1):
        r[j] *= inv
    for j in range(last + 1, r.shape[0]):
        r[j] = np.float32(0.0)


@njit(cache=True, nogil=True)
def _serial(scores: np.ndarray, scale: float, q0: int) -> None:
    heads, n_q, n_kv = scores.shape
    for h in range(heads):
        for i in range(n_q):
            _row(scores[h, i], np.float32(scale), min(q0 + i, n_kv - 1))


@njit(cache=True, nogil=True, parallel=True)
def _parallel(scores: np.ndarray, scale: float, q0: int) -> None:
    heads, n_q, n_kv = scores.shape
    for h in prange(heads):
        for i in range(n_q):
            _row(scores[h, i], np.float32(scale), min(q0 + i, n_kv - 1))


def causal_softmax(scores: np.ndarray, scale: float, q0: int) -> None:
    """scores [heads, n_q, n_kv] -> softmax(scale*scores) in place, keys after query q0+i masked out."""
    pick(_serial, _parallel, scores.size)(scores, scale, q0)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """q [n, H, d], k/v [p + n, Hkv, d(v)] -> [n, H, dv]; the queries are positions p..p+n-1 (p = 0 for a fresh
    sequence; a continuation's earlier keys and values come first) and query i attends to keys 0..p+i."""
    n, n_head, _ = q.shape
    past = k.shape[0] - n
    n_kv_head = k.shape[1]
    group = n_head // n_kv_head
    dv = v.shape[2]
    qh = np.ascontiguousarray(q.transpose(1, 0, 2)).reshape(n_kv_head, group, n, -1)
    kh = np.ascontiguousarray(k.transpose(1, 2, 0))[:, None]  # [Hkv, 1, d, n]
    vh = np.ascontiguousarray(v.transpose(1, 0, 2))[:, None]  # [Hkv, 1, n, dv]
    out = np.empty((n_kv_head, group, n, dv), dtype=np.float32)
    for q0 in range(0, n, QUERY_BLOCK):
        q1 = min(n, q0 + QUERY_BLOCK)
        n_keys = past + q1
        scores = np.matmul(qh[:, :, q0:q1], kh[..., :n_keys])  # [Hkv, g, nq, n_keys]
        flat = scores.reshape(n_kv_head * group, q1 - q0, n_keys)
        causal_softmax(flat, scale, past + q0)
        out[:, :, q0:q1] = np.matmul(scores, vh[:, :, :n_keys])
    return out.reshape(n_head, n, dv).transpose(1, 0, 2)
