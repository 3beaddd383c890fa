"""Manifold-constrained hyper-connections (mHC) as ik's ggml_hc_pre / ggml_hc_post compute them.

The hidden state is S parallel residual streams R [T, S, H]. Around every sub-layer the model computes
mixes = phi . (RMSNorm(R flattened to S*H) * gamma), 2S + S*S numbers per token (a matmul, in the model module), and:

- `hc_pre(mixes, alpha, beta, S, iters, eps)`:
    pre[s]  = sigmoid(alpha[0] * mixes[s] + beta[s]) + eps              how much of each stream enters the sub-layer
    post[s] = 2 * sigmoid(alpha[1] * mixes[S + s] + beta[S + s])        how much of its output goes back to each
    M[r, c] = alpha[2] * mixes[2S + rS + c] + beta[2S + rS + c], then Sinkhorn towards a doubly stochastic matrix:
              each row softmaxed, + eps; each column divided by (eps + its sum); then iters - 1 rounds of
              row and column division (every sum starting at eps). Sums run in index order in float32.
- `hc_combine(R, pre)`: the sub-layer input x = sum_s pre[s] * R[s] (streams in order).
- `hc_post(y, post, R, M)`: the new streams R'[i] = post[i] * y + sum_j M[j, i] * R[j] (y = sub-layer output).

openPangu passes eps = 0 (ik's build_openpangu); the row-major M layout is ggml_hc_pre's. `fused` (--numerics ik):
each product-plus-sum as the single fused multiply-add ik's compiled ops compute (GCC contracts them: the affine
maps of hc_pre; in hc_post y x post fused into the first stream's rounded product, then each further stream fused;
ik's mul_multi_add for hc_combine); otherwise each rounded apart, as transformers computes them.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import fmaf
from ikrun.ops.parallel import claim_items, pick, run_claimed, task_items


@njit(cache=True, nogil=True, inline="always")
def _sigmoid(x: np.float32) -> np.float32:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


@njit(cache=True, nogil=True)
def _sigmoid_all(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        out[i] = _sigmoid(x[i])


def stream_gates(logits: np.ndarray) -> np.ndarray:
    """1 / (1 + expf(-x)) of every logit with libm's expf, value by value, as ggml_sigmoid computes the gates of a
    merge of streams (numpy's own vectorised exp rounds other bits)."""
    x = np.ascontiguousarray(logits, dtype=np.float32)
    out = np.empty_like(x)
    _sigmoid_all(x.reshape(-1), out.reshape(-1))
    return out


@njit(cache=True, nogil=True, inline="always")
def _mul_add(a: np.float32, b: np.float32, c: np.float32, fused: bool) -> np.float32:
    return fmaf(a, b, c) if fused else a * b + c


@njit(cache=True, nogil=True, inline="always")
def _pre_row(x: np.ndarray, alpha: np.ndarray, beta: np.ndarray, n: int, iters: int, eps: np.float32,
             fused: bool, pre: np.ndarray, post: np.ndarray, m: np.ndarray) -> None:
    for i in range(n):
        pre[i] = _sigmoid(_mul_add(x[i], alpha[0], beta[i], fused)) + eps
        post[i] = np.float32(2.0) * _sigmoid(_mul_add(x[n + i], alpha[1], beta[n + i], fused))
    for r in range(n):
        for c in range(n):
            m[r, c] = _mul_add(x[2 * n + r * n + c], alpha[2], beta[2 * n + r * n + c], fused)
    for r in range(n):
        mx = m[r, 0]
        for c in range(1, n):
            mx = max(mx, m[r, c])
        s = np.float32(0.0)
        for c in range(n):
            m[r, c] = np.exp(m[r, c] - mx)
            s += m[r, c]
        for c in range(n):
            m[r, c] = m[r, c] / s + eps
    for c in range(n):
        s = eps
        for r in range(n):
            s += m[r, c]
        for r in range(n):
            m[r, c] /= s
    for _ in range(iters - 1):
        for r in range(n):
            s = eps
            for c in range(n):
                s += m[r, c]
            for c in range(n):
                m[r, c] /= s
        for c in range(n):
            s = eps
            for r in range(n):
                s += m[r, c]
            for r in range(n):
                m[r, c] /= s


@njit(cache=True, nogil=True)
def _pre_serial(x: np.ndarray, alpha: np.ndarray, beta: np.ndarray, n: int, iters: int, eps: float, fused: bool,
                pre: np.ndarray, post: np.ndarray, m: np.ndarray) -> None:
    for t in range(x.shape[0]):
        _pre_row(x[t], alpha, beta, n, iters, np.float32(eps), fused, pre[t], post[t], m[t])


@njit(cache=True, nogil=True, parallel=True)
def _pre_parallel(x: np.ndarray, alpha: np.ndarray, beta: np.ndarray, n: int, iters: int, eps: float, fused: bool,
                  pre: np.ndarray, post: np.ndarray, m: np.ndarray) -> None:
    for t in prange(x.shape[0]):
        _pre_row(x[t], alpha, beta, n, iters, np.float32(eps), fused, pre[t], post[t], m[t])


def hc_pre(mixes: np.ndarray, alpha: np.ndarray, beta: np.ndarray, n_stream: int, iters: int,
           eps: float = 0.0, fused: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pre [T, S], post [T, S], M [T, S, S]) from mixes [T, 2S + S*S], alpha [3], beta [2S + S*S]."""
    if iters < 1:
        raise ValueError(f"Sinkhorn needs at least one iteration (got {iters})")
    mixes = np.ascontiguousarray(mixes, dtype=np.float32)
    t = mixes.shape[0]
    pre = np.empty((t, n_stream), dtype=np.float32)
    post = np.empty_like(pre)
    m = np.empty((t, n_stream, n_stream), dtype=np.float32)
    # each token costs about iters * 2S^2 divisions: weigh it like that many elements
    kernel = pick(_pre_serial, _pre_parallel, t * iters * 2 * n_stream * n_stream)
    kernel(mixes, np.ascontiguousarray(alpha, dtype=np.float32), np.ascontiguousarray(beta, dtype=np.float32),
           n_stream, iters, float(eps), fused, pre, post, m)
    return pre, post, m


@njit(cache=True, nogil=True, inline="always")
def _combine_row(r: np.ndarray, w: np.ndarray, fused: bool, out: np.ndarray) -> None:
    for h in range(out.shape[0]):
        out[h] = r[0, h] * w[0]
    for s in range(1, r.shape[0]):
        ws = w[s]
        for h in range(out.shape[0]):
            out[h] = _mul_add(r[s, h], ws, out[h], fused)


@njit(cache=True, nogil=True)
def _combine_serial(r: np.ndarray, w: np.ndarray, fused: bool, out: np.ndarray) -> None:
    for t in range(r.shape[0]):
        _combine_row(r[t], w[t], fused, out[t])


@njit(cache=True, nogil=True, parallel=True)
def _combine_parallel(r: np.ndarray, w: np.ndarray, fused: bool, out: np.ndarray) -> None:
    for t in prange(r.shape[0]):
        _combine_row(r[t], w[t], fused, out[t])


def hc_combine(streams: np.ndarray, weights: np.ndarray, fused: bool = False) -> np.ndarray:
    """sum_s weights[t, s] * streams[t, s] -> [T, H] for streams [T, S, H] (streams summed in order)."""
    streams = np.ascontiguousarray(streams, dtype=np.float32)
    out = np.empty((streams.shape[0], streams.shape[2]), dtype=np.float32)
    pick(_combine_serial, _combine_parallel, streams.size)(streams, np.ascontiguousarray(weights, np.float32), fused,
                                                           out)
    return out


@njit(cache=True, nogil=True, inline="always")
def _post_row(y: np.ndarray, post: np.ndarray, r: np.ndarray, m: np.ndarray, fused: bool, out: np.ndarray) -> None:
    """Stream i's row: each value's sums in stream order, a stream's values at a time (loops over h that run in
    vectors; value by value, with strided stores, 1,024 tokens of 4 streams of 1,024 took 3.9-4.2 ms on 2 threads,
    now 1.25-1.29 ms, the same bits)."""
    n = post.shape[0]
    for i in range(n):
        row, first, p, m0 = out[i], r[0], post[i], m[0, i]
        for h in range(y.shape[0]):
            if fused:  # GCC fuses y x post into the first sum, the first stream's product rounded apart
                row[h] = fmaf(y[h], p, m0 * first[h])
            else:
                row[h] = y[h] * p + m0 * first[h]
        for j in range(1, n):
            rj, mj = r[j], m[j, i]
            for h in range(y.shape[0]):
                row[h] = _mul_add(mj, rj[h], row[h], fused)


@njit(cache=True, nogil=True)
def _post_serial(y: np.ndarray, post: np.ndarray, r: np.ndarray, m: np.ndarray, fused: bool, out: np.ndarray) -> None:
    for t in range(y.shape[0]):
        _post_row(y[t], post[t], r[t], m[t], fused, out[t])


@njit(cache=True, nogil=True, parallel=True)
def _post_parallel(y: np.ndarray, post: np.ndarray, r: np.ndarray, m: np.ndarray, fused: bool,
                   out: np.ndarray, threads: int) -> None:
    """The tokens in tasks the threads claim (ikrun/ops/parallel.py)."""
    per, counter = task_items(y.shape[0], threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        t0, t1 = claim_items(counter, per, y.shape[0])
        while t0 < t1:
            for t in range(t0, t1):
                _post_row(y[t], post[t], r[t], m[t], fused, out[t])
            t0, t1 = claim_items(counter, per, y.shape[0])


def hc_post(y: np.ndarray, post: np.ndarray, streams: np.ndarray, m: np.ndarray, fused: bool = False) -> np.ndarray:
    """New streams [T, S, H]: post[t, i] * y[t] + sum_j m[t, j, i] * streams[t, j]."""
    streams = np.ascontiguousarray(streams, dtype=np.float32)
    out = np.empty_like(streams)
    run_claimed(_post_serial, _post_parallel, streams.size, np.ascontiguousarray(y, dtype=np.float32),
                np.ascontiguousarray(post, np.float32), streams, np.ascontiguousarray(m, np.float32), fused, out)
    return out
