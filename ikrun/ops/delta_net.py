"""The gated delta rule (Qwen3-Next's and Qwen3.5's linear attention), as transformers defines it for a prompt
(`torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule`; the short convolution + SiLU before it is
ops/conv.causal_conv_silu).

Per value head h (its key head given by `k_head[h]`: grouped or tiled order is the caller's choice) and token t, with
q and k L2-normalised (rsqrt(sum x^2 + 1e-6)), q scaled by 1/sqrt(d_k), decay exp(g_t) and write strength beta_t:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S^T_{t-1,decayed} k_t))^T,     o_t = S_t^T q_t

`delta_rule_recurrent` runs that token by token; `delta_rule_chunked` is transformers' chunked form for prompts
(chunks of 64: within a chunk the WY representation from a forward substitution, across chunks the state), the same
function up to float rounding. Every head and chunk is computed from its own sequence alone, in a fixed order, so a
sequence's output does not depend on what else runs beside it. The state starts at zero for a fresh sequence (ik
resets it per chunk like its KV cache); a sequence continued through its cache passes the state [Hv, dk, dv] its
earlier part left, which the call advances in place.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikrun.ops.norm import rms_norm

#: transformers' L2-norm epsilon inside the delta rule (fixed, not the model's rms epsilon)
L2_EPS = 1e-6
#: transformers' chunk length for the chunked prompt form
CHUNK = 64


def decay_and_beta(a: np.ndarray, b: np.ndarray, ssm_a: np.ndarray, dt_bias: np.ndarray) -> tuple[np.ndarray,
                                                                                                       np.ndarray]:
    """(g, beta) [T, H] from the projections a, b [T, H]: g = ssm_a * softplus(a + dt_bias) (ssm_a = -exp(A_log),
    softplus linear above 20 as torch's), beta = sigmoid(b)."""
    x = (a + dt_bias).astype(np.float32)
    soft = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)
    beta = (np.float32(1.0) / (np.float32(1.0) + np.exp(-b))).astype(np.float32)
    return (ssm_a * soft).astype(np.float32), beta


@njit(cache=True, nogil=True, inline="always")
def _unit(x: np.ndarray, scale: np.float32, out: np.ndarray) -> None:
    s = np.float32(0.0)
    for j in range(x.shape[0]):
        s += x[j] * x[j]
    inv = np.float32(1.0) / np.sqrt(s + np.float32(L2_EPS))
    for j in range(x.shape[0]):
        out[j] = x[j] * inv * scale


@njit(cache=True, nogil=True, inline="always")
def _normalised(q: np.ndarray, k: np.ndarray, kh: int, t0: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The L2-normalised (q scaled) query and key rows t0..t0+n-1 of key head kh."""
    dk = q.shape[2]
    scale = np.float32(1.0) / np.sqrt(np.float32(dk))
    qn = np.empty((n, dk), dtype=np.float32)
    kn = np.empty((n, dk), dtype=np.float32)
    for i in range(n):
        _unit(q[t0 + i, kh], scale, qn[i])
        _unit(k[t0 + i, kh], np.float32(1.0), kn[i])
    return qn, kn


@njit(cache=True, nogil=True, inline="always")
def _recurrent_head(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, h: int, kh: int,
                    s: np.ndarray, out: np.ndarray) -> None:
    n, dv = v.shape[0], v.shape[2]
    qn, kn = _normalised(q, k, kh, 0, n)
    dk = qn.shape[1]
    delta = np.empty(dv, dtype=np.float32)
    for t in range(n):
        decay = np.exp(g[t, h])
        for i in range(dk):
            for j in range(dv):
                s[i, j] *= decay
        for j in range(dv):
            mem = np.float32(0.0)
            for i in range(dk):
                mem += s[i, j] * kn[t, i]
            delta[j] = (v[t, h, j] - mem) * beta[t, h]
        for i in range(dk):
            for j in range(dv):
                s[i, j] += kn[t, i] * delta[j]
        for j in range(dv):
            acc = np.float32(0.0)
            for i in range(dk):
                acc += s[i, j] * qn[t, i]
            out[t, h, j] = acc


@njit(cache=True, nogil=True, inline="always")
def _chunk(qn: np.ndarray, kn: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, s: np.ndarray,
           out: np.ndarray) -> None:
    """One chunk of one head (rows already sliced): out [L, dv] from the state s [dk, dv], which it advances."""
    n, dk, dv = qn.shape[0], qn.shape[1], v.shape[1]
    gc = np.empty(n, dtype=np.float32)
    acc = np.float32(0.0)
    for i in range(n):
        acc += g[i]
        gc[i] = acc
    # the strictly lower triangular system of the WY form, then its inverse by forward substitution
    a = np.zeros((n, n), dtype=np.float32)
    for i in range(n):
        for j in range(i):
            dot = np.float32(0.0)
            for d in range(dk):
                dot += (kn[i, d] * beta[i]) * kn[j, d]
            a[i, j] = -(dot * np.exp(gc[i] - gc[j]))
    row = np.empty(n, dtype=np.float32)
    for i in range(1, n):
        for j in range(i):
            row[j] = a[i, j]
        for j in range(i):
            extra = np.float32(0.0)
            for m in range(i):
                extra += row[m] * a[m, j]
            a[i, j] = row[j] + extra
    for i in range(n):
        a[i, i] = np.float32(1.0)
    # u = T (v beta), w = T (k beta exp(gc))
    u = np.zeros((n, dv), dtype=np.float32)
    w = np.zeros((n, dk), dtype=np.float32)
    for i in range(n):
        for m in range(i + 1):
            t = a[i, m]
            bm = beta[m]
            em = np.exp(gc[m])
            for j in range(dv):
                u[i, j] += t * (v[m, j] * bm)
            for d in range(dk):
                w[i, d] += t * ((kn[m, d] * bm) * em)
    # v_new = u - w S; out = (q exp(gc)) S + (q k^T decayed, causal) v_new
    vn = np.empty((n, dv), dtype=np.float32)
    for i in range(n):
        for j in range(dv):
            ws = np.float32(0.0)
            for d in range(dk):
                ws += w[i, d] * s[d, j]
            vn[i, j] = u[i, j] - ws
    for i in range(n):
        ei = np.exp(gc[i])
        for j in range(dv):
            inter = np.float32(0.0)
            for d in range(dk):
                inter += (qn[i, d] * ei) * s[d, j]
            out[i, j] = inter
        for m in range(i + 1):
            dot = np.float32(0.0)
            for d in range(dk):
                dot += qn[i, d] * kn[m, d]
            p = dot * np.exp(gc[i] - gc[m])
            for j in range(dv):
                out[i, j] += p * vn[m, j]
    last = gc[n - 1]
    el = np.exp(last)
    for d in range(dk):
        for j in range(dv):
            s[d, j] *= el
    for m in range(n):
        em = np.exp(last - gc[m])
        for d in range(dk):
            kd = kn[m, d] * em
            for j in range(dv):
                s[d, j] += kd * vn[m, j]


@njit(cache=True, nogil=True, inline="always")
def _chunked_head(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, h: int, kh: int,
                  chunk: int, s: np.ndarray, out: np.ndarray) -> None:
    n, dv = v.shape[0], v.shape[2]
    for t0 in range(0, n, chunk):
        m = min(chunk, n - t0)
        qn, kn = _normalised(q, k, kh, t0, m)
        o = np.empty((m, dv), dtype=np.float32)
        _chunk(qn, kn, np.ascontiguousarray(v[t0 : t0 + m, h]), np.ascontiguousarray(g[t0 : t0 + m, h]),
               np.ascontiguousarray(beta[t0 : t0 + m, h]), s, o)
        out[t0 : t0 + m, h] = o


@njit(cache=True, nogil=True, parallel=True)
def _delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, k_head: np.ndarray,
                chunk: int, state: np.ndarray, out: np.ndarray) -> None:
    for h in prange(v.shape[1]):
        _head(q, k, v, g, beta, np.int64(h), k_head[h], chunk, state[h], out)


@njit(cache=True, nogil=True)
def _head(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, h: int, kh: int,
          chunk: int, s: np.ndarray, out: np.ndarray) -> None:
    """Value head h of _delta_rule (ikquant/formats/jit.py: why a task is a function of its own)."""
    if chunk > 0:
        _chunked_head(q, k, v, g, beta, h, kh, chunk, s, out)
    else:
        _recurrent_head(q, k, v, g, beta, h, kh, s, out)


def initial_state(q: np.ndarray, v: np.ndarray, state: np.ndarray | None) -> np.ndarray:
    """The state [Hv, dk, dv] a call advances: `state` itself (a continued sequence's), else zeros."""
    shape = (v.shape[1], q.shape[2], v.shape[2])
    if state is None:
        return np.zeros(shape, dtype=np.float32)
    if state.shape != shape or state.dtype != np.float32 or not state.flags.c_contiguous:
        raise ValueError(f"delta-net state {list(state.shape)} {state.dtype} is not a contiguous float32 {list(shape)}")
    return state


def _run(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, k_head: np.ndarray,
         chunk: int, state: np.ndarray | None) -> np.ndarray:
    out = np.empty(v.shape, dtype=np.float32)
    f32 = [np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v, g, beta)]
    _delta_rule(*f32, np.ascontiguousarray(k_head, dtype=np.int64), chunk, initial_state(q, v, state), out)
    return out


def delta_rule_chunked(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                       k_head: np.ndarray, chunk: int = CHUNK, state: np.ndarray | None = None) -> np.ndarray:
    """The gated delta rule's output [T, Hv, dv] in transformers' chunked form: q, k [T, Hk, dk] (before the L2
    norm), v [T, Hv, dv], g and beta [T, Hv], value head h reading key head k_head[h]; from `state` [Hv, dk, dv]
    (advanced in place) where the sequence continues, else from zero."""
    return _run(q, k, v, g, beta, k_head, chunk, state)


def delta_rule_recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                         k_head: np.ndarray, state: np.ndarray | None = None) -> np.ndarray:
    """The same output computed token by token (transformers' recurrent form)."""
    return _run(q, k, v, g, beta, k_head, 0, state)


def gated_rms_norm(x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """transformers' RMSNormGated: RMSNorm of x over the last axis times weight, times SiLU(z)."""
    z = np.asarray(z, dtype=np.float32)
    return rms_norm(x, weight, eps) * (z / (np.float32(1.0) + np.exp(-z)))
