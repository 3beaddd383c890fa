"""Causal multi-head attention with grouped KV heads, scores through BLAS, the masked softmax in Numba; and
`ik_causal_attention`, ik's own arithmetic of the same (--numerics ik).

ik (no flash attention) multiplies f32 queries with its f16 keys in a float kernel of 16 lanes: lane l sums the
products of dims l, l + 16, ... (the first a product, the rest fused multiply-adds), then the 16 lanes are added
as a tree (8 + 8, 4 + 4, then (0 + 2) + (1 + 3)). The softmax scales, takes the row maximum, exponentiates with
ik's own exp (activations.ik_expf), sums the exponentials in 16 lanes by key (the same tree, then float64) and
multiplies by float32(1 / sum). The values multiply the float32 probabilities the same way, lanes by key.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikrun.ops.activations import ik_expf
from ikrun.ops.ikgemm import DOTS, LANES, dots
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


@njit(cache=True, nogil=True, inline="always")
def _ik_query(q: np.ndarray, q0: int, k: np.ndarray, k0: int, vt: np.ndarray, v0: int, d: int, dv: int,
              stride_k: int, stride_v: int, scale: np.float32, n_keys: int, p: np.ndarray, out: np.ndarray,
              o0: int, tail: np.ndarray) -> None:
    """One query row (q[q0 : q0 + d]) against keys 0 .. n_keys - 1 (rows of k from k0, stride_k apart) and the
    transposed values (rows of vt from v0, stride_v apart): ik's scores, softmax and weighted values into
    out[o0 : o0 + dv]; p is a scratch row of at least n_keys rounded up to 16."""
    dots(q, q0, k, k0, stride_k, d, n_keys, p, 0, tail, False)
    m = -np.inf
    for j in range(n_keys):
        w = p[j] * scale
        p[j] = w
        m = max(m, w)
    lanes = np.zeros(LANES, np.float32)
    width = n_keys + (-n_keys % LANES)
    for c in range(0, width, LANES):
        for lane in range(LANES):
            e = ik_expf(p[c + lane] - m)
            e = e if c + lane < n_keys else np.float32(0.0)
            p[c + lane] = e
            lanes[lane] += e
    t = np.empty(8, np.float32)
    for j in range(8):
        t[j] = lanes[j + 8] + lanes[j]
    total = ((t[4] + t[0]) + (t[6] + t[2])) + ((t[5] + t[1]) + (t[7] + t[3]))
    inv = np.float32(1.0 / np.float64(total))
    for j in range(n_keys):
        p[j] *= inv
    dots(p, 0, vt, v0, stride_v, width, dv, out, o0, tail, False)


@njit(cache=True, nogil=True, parallel=True)
def _ik_attention(q: np.ndarray, k: np.ndarray, vt: np.ndarray, scale: float, past: int, out: np.ndarray) -> None:
    """q [H, n, d], k [Hkv, p + n, d], vt [Hkv, dv, keys padded], out [H, n, dv] (all C-contiguous)."""
    n_head, n, d = q.shape
    n_kv, n_all, dv, padded = k.shape[0], k.shape[1], vt.shape[1], vt.shape[2]
    group = n_head // n_kv
    qf, kf, vf, of = q.reshape(-1), k.reshape(-1), vt.reshape(-1), out.reshape(-1)
    for t in prange(n_head * n):
        h, i = t // n, t % n
        g = h // group
        p = np.zeros(padded, np.float32)
        tail = np.empty(DOTS, np.float32)
        _ik_query(qf, t * d, kf, g * n_all * d, vf, g * dv * padded, d, dv, d, padded, np.float32(scale),
                  past + i + 1, p, of, t * dv, tail)


def ik_causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """causal_attention in ik's arithmetic (the module docstring); head dims a multiple of 16."""
    n, n_head, d = q.shape
    if d % LANES:
        raise ValueError(f"ik's attention arithmetic takes head dims in multiples of {LANES}, not {d}")
    n_keys = k.shape[0]
    padded = n_keys + (-n_keys % LANES)
    qh = np.ascontiguousarray(q.transpose(1, 0, 2), dtype=np.float32)
    kh = np.ascontiguousarray(k.transpose(1, 0, 2), dtype=np.float32)
    vt = np.zeros((k.shape[1], v.shape[2], padded), np.float32)
    vt[:, :, :n_keys] = v.transpose(1, 2, 0)
    out = np.empty((n_head, n, v.shape[2]), np.float32)
    _ik_attention(qh, kh, vt, float(scale), n_keys - n, out)
    return out.transpose(1, 0, 2)


def ik_latent_attention(q: np.ndarray, cache: np.ndarray, n_rope: int, scale: float) -> np.ndarray:
    """DeepSeek's absorbed attention (ops/mla.py) in ik's arithmetic: queries q [H, n, R + C] ([q_rope | q_lat])
    against the cache rows [n, R + C] ([k_rope | c_kv], as the f16 cache holds them), the latents c_kv as values:
    [H, n, C]; dims a multiple of 16."""
    n_head, n, d = q.shape
    if d % LANES:
        raise ValueError(f"ik's attention arithmetic takes head dims in multiples of {LANES}, not {d}")
    padded = n + (-n % LANES)
    vt = np.zeros((1, d - n_rope, padded), np.float32)
    vt[0, :, :n] = cache[:, n_rope:].T
    out = np.empty((n_head, n, d - n_rope), np.float32)
    _ik_attention(np.ascontiguousarray(q, dtype=np.float32), np.ascontiguousarray(cache, dtype=np.float32)[None],
                  vt, float(scale), 0, out)
    return out


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
                        comp_keep: np.ndarray | None = None) -> np.ndarray:
    """Attention of a fresh sequence whose single key head is also its value (DeepSeek-V4).

    q [n, H, d]; kv [n, d] the per-position key = value rows (query t sees row s when s <= t and, with a window,
    t - s < window); `comp` [T, d] extra key = value rows (compressed entries) seen where `comp_keep` [n, T] says;
    `sinks` [H] one logit per head in every softmax's denominator. Returns [n, H, d]. Scores and values go through
    BLAS per block of queries over the raw rows the block can see, the masked softmax in Numba."""
    n, n_head, d = q.shape
    extra = np.zeros((0, d), dtype=np.float32) if comp is None else np.ascontiguousarray(comp, dtype=np.float32)
    keep = np.zeros((n, 0), dtype=np.bool_) if comp_keep is None else np.ascontiguousarray(comp_keep, dtype=np.bool_)
    if keep.shape != (n, extra.shape[0]):
        raise ValueError(f"comp_keep has shape {list(keep.shape)}, expected {[n, extra.shape[0]]}")
    sink = np.full(n_head, -np.inf, dtype=np.float32) if sinks is None else np.ascontiguousarray(sinks, np.float32)
    out = np.empty((n, n_head, d), dtype=np.float32)
    for q0 in range(0, n, QUERY_BLOCK):
        q1 = min(n, q0 + QUERY_BLOCK)
        lo = max(0, q0 - window + 1) if window > 0 else 0
        keys = np.concatenate([kv[lo:q1], extra])  # [visible raw span + T, d]
        scores = np.matmul(q[q0:q1], keys.T)  # [nq, H, keys]
        pick(_sink_serial, _sink_parallel, scores.size)(scores, float(scale), sink, q0, lo, q1 - lo, int(window),
                                                         keep[q0:q1])
        np.matmul(scores, keys, out=out[q0:q1])
    return out
