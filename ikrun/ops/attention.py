"""Causal multi-head attention with grouped KV heads, and one shared key/value head with sinks, a window and extra
masked rows (DeepSeek-V4): scores through BLAS, the masked softmax in Numba. ik's own arithmetic of these lives in
ikrun/numerics/ik/attention.py.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikrun.ops.parallel import pick

# Query rows per block: bounds the score buffer to heads x block x n_kv floats for long chunks.
QUERY_BLOCK = 256
#: query rows per block of a windowed shared key/value attention: a block's products span the window plus the block
#: (the keys every query of it may see), so smaller blocks compute fewer scores their queries cannot see. OpenBLAS's
#: SkylakeX kernel on 2 threads, DeepSeek-V4 Flash's 64 heads of 512, window 128, 512 queries, 4 extra rows: 270 ms
#: a call in blocks of 256, 103 ms in 64, 89 ms in 32 (the bench file's 16 heads of 256, 256 queries: 21.0 -> 14.8)
WINDOW_QUERY_BLOCK = 32


@njit(cache=True, nogil=True, inline="always")
def _row(r: np.ndarray, sc: np.float32, first: int, last: int, sink: np.float32) -> None:
    """softmax(sc * r) over keys first..last plus a `sink` logit (-inf: none) that takes weight but has no value;
    0 for the other keys."""
    m = np.float64(sink)  # the max and the exponentials in float64, as before sinks existed (bit for bit)
    for j in range(first, last + 1):
        v = r[j] * sc
        r[j] = v
        if v > m:
            m = v
    s = np.float64(np.exp(sink - m)) if sink > -np.inf else 0.0
    for j in range(first, last + 1):
        e = np.exp(r[j] - m)
        r[j] = e
        s += np.float64(e)
    inv = np.float32(1.0 / s)
    for j in range(first, last + 1):
        r[j] *= inv
    for j in range(first):
        r[j] = np.float32(0.0)
    for j in range(last + 1, r.shape[0]):
        r[j] = np.float32(0.0)


@njit(cache=True, nogil=True, inline="always")
def _head_rows(scores: np.ndarray, h: int, scale: float, q0: int, window: int, sinks: np.ndarray) -> None:
    n_kv = scores.shape[2]
    sink = sinks[h] if sinks.shape[0] else np.float32(-np.inf)
    for i in range(scores.shape[1]):
        last = min(q0 + i, n_kv - 1)
        first = max(0, q0 + i - window + 1) if window > 0 else 0
        _row(scores[h, i], np.float32(scale), first, last, sink)


@njit(cache=True, nogil=True)
def _serial(scores: np.ndarray, scale: float, q0: int, window: int, sinks: np.ndarray) -> None:
    for h in range(scores.shape[0]):
        _head_rows(scores, h, scale, q0, window, sinks)


@njit(cache=True, nogil=True, parallel=True)
def _parallel(scores: np.ndarray, scale: float, q0: int, window: int, sinks: np.ndarray) -> None:
    for h in prange(scores.shape[0]):
        _head_rows(scores, h, scale, q0, window, sinks)


def causal_softmax(scores: np.ndarray, scale: float, q0: int, window: int = 0,
                   sinks: np.ndarray | None = None) -> None:
    """scores [heads, n_q, n_kv] -> softmax(scale*scores) in place, keys after query q0+i masked out, and with a
    `window` the keys `window` or more positions before it; `sinks` [heads] one unscaled logit per head in every
    row's denominator (gpt-oss)."""
    sink = np.empty(0, np.float32) if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
    pick(_serial, _parallel, scores.size)(scores, scale, q0, int(window), sink)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, *, window: int = 0,
                     sinks: np.ndarray | None = None) -> np.ndarray:
    """q [n, H, d], k/v [p + n, Hkv, d(v)] -> [n, H, dv]; the queries are positions p..p+n-1 (p = 0 for a fresh
    sequence; a continuation's earlier keys and values come first) and query i attends to keys 0..p+i (with a
    `window`, only the last `window` of them, its own included); `sinks` [H] (causal_softmax)."""
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
        causal_softmax(flat, scale, past + q0, window, sinks)
        out[:, :, q0:q1] = np.matmul(scores, vh[:, :, :n_keys])
    return out.reshape(n_head, n, dv).transpose(1, 0, 2)


@njit(cache=True, nogil=True, inline="always")
def _sink_row(r: np.ndarray, sc: np.float32, sink: np.float32, pos: int, lo: int, n_raw: int, window: int,
              comp_keep: np.ndarray) -> None:
    """softmax over the visible scores of r (raw keys lo + j for j < n_raw, then compressed entries) plus one sink
    logit that takes weight but has no value; 0 for keys the query may not see."""
    m = sink
    for j in range(r.shape[0]):
        if j < n_raw:
            key = lo + j
            visible = key <= pos and (window <= 0 or pos - key < window)
        else:
            visible = comp_keep[j - n_raw]
        if visible:
            v = r[j] * sc
            r[j] = v
            if v > m:
                m = v
        else:
            r[j] = -np.inf
    s = np.float64(np.exp(sink - m)) if sink > -np.inf else 0.0
    for j in range(r.shape[0]):
        e = np.exp(r[j] - m) if r[j] > -np.inf else np.float32(0.0)
        r[j] = e
        s += np.float64(e)
    inv = np.float32(1.0 / s)
    for j in range(r.shape[0]):
        r[j] *= inv


@njit(cache=True, nogil=True)
def _sink_serial(scores, scale, sinks, q0, lo, n_raw, window, comp_keep):  # type: ignore[no-untyped-def]
    n_q, heads, _ = scores.shape
    for i in range(n_q):
        for h in range(heads):
            _sink_row(scores[i, h], np.float32(scale), sinks[h], q0 + i, lo, n_raw, window, comp_keep[i])


@njit(cache=True, nogil=True, parallel=True)
def _sink_parallel(scores, scale, sinks, q0, lo, n_raw, window, comp_keep):  # type: ignore[no-untyped-def]
    n_q, heads, _ = scores.shape
    for i in prange(n_q):
        for h in range(heads):
            _sink_row(scores[i, h], np.float32(scale), sinks[h], q0 + i, lo, n_raw, window, comp_keep[i])


def shared_kv_attention(q: np.ndarray, kv: np.ndarray, scale: float, *, window: int = 0,
                        sinks: np.ndarray | None = None, comp: np.ndarray | None = None,
                        comp_keep: np.ndarray | None = None, start: int = 0) -> np.ndarray:
    """Attention of a sequence whose single key head is also its value (DeepSeek-V4).

    q [n, H, d] the queries at positions start..start+n-1 (start > 0: a continued sequence); kv [start + n, d] the
    per-position key = value rows (query t sees row s when s <= t and, with a window, t - s < window); `comp` [T, d]
    extra key = value rows (compressed entries) seen where `comp_keep` [n, T] says; `sinks` [H] one logit per head in
    every softmax's denominator. Returns [n, H, d]. Scores and values go through BLAS per block of queries over the
    raw rows the block can see, all heads of the block in one product (the heads share the keys), the masked softmax
    in Numba."""
    n, n_head, d = q.shape
    if len(kv) != start + n:
        raise ValueError(f"kv has {len(kv)} rows, expected {start + n} (start {start} + {n} queries)")
    extra = np.zeros((0, d), dtype=np.float32) if comp is None else np.ascontiguousarray(comp, dtype=np.float32)
    keep = np.zeros((n, 0), dtype=np.bool_) if comp_keep is None else np.ascontiguousarray(comp_keep, dtype=np.bool_)
    if keep.shape != (n, extra.shape[0]):
        raise ValueError(f"comp_keep has shape {list(keep.shape)}, expected {[n, extra.shape[0]]}")
    sink = np.full(n_head, -np.inf, dtype=np.float32) if sinks is None else np.ascontiguousarray(sinks, np.float32)
    out = np.empty((n, n_head, d), dtype=np.float32)
    block = WINDOW_QUERY_BLOCK if window > 0 else QUERY_BLOCK
    for q0 in range(0, n, block):
        q1 = min(n, q0 + block)
        p0, p1 = start + q0, start + q1  # the block's positions
        lo = max(0, p0 - window + 1) if window > 0 else 0
        keys = np.concatenate([kv[lo:p1], extra])  # [visible raw span + T, d]
        nq = q1 - q0
        scores = (q[q0:q1].reshape(nq * n_head, d) @ keys.T).reshape(nq, n_head, len(keys))
        pick(_sink_serial, _sink_parallel, scores.size)(scores, float(scale), sink, p0, lo, p1 - lo, int(window),
                                                         keep[q0:q1])
        out[q0:q1] = (scores.reshape(nq * n_head, len(keys)) @ keys).reshape(nq, n_head, d)
    return out
