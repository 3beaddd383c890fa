"""Multi-head latent attention in ik's two forms: the absorbed one (mla=3 without flash attention, and single-token
generation) and the prefill one (`materialized_attention`: ik's pp_opt path for batches of 128 tokens or more with
flash attention, its defaults).

The KV cache holds one row per token: [k_rope | c_kv] (the roped key part shared by all heads, then the normalised
KV latent). Each head's no-rope query is absorbed into the latent space through attn_k_b
(q_lat = q_nope @ W_kb[h]^T); scores are [q_rope | q_lat] . cache row for every head against the same cache; the
softmax-weighted sum of latents is projected to the head's value through attn_v_b. No per-head keys or values are
ever expanded. The products run through BLAS (batched over heads), the masked softmax in Numba (ops/attention),
which measured 1.8x faster than a fused Numba loop from the tiny test model up to DeepSeek-V2-Lite sizes.

The prefill form materialises every head's key and value from the latent cache through attn_kv_b
([k_nope | v] = attn_kv_b @ c_kv per head), then runs plain attention with keys [k_rope | k_nope] and queries
[q_rope | q_nope]: the same function of the weights when attn_kv_b holds what attn_k_b / attn_v_b hold, but another
tensor (and another float order) once the file quantizes them differently.

Optional restrictions (openPangu, DSA models): learned sink rows that every query sees before the cache, a sliding
window (query t sees key s only when t - s < window) and a per-query keep mask from a DSA indexer
(ikrun/ops/indexer.py). A key outside them gets no weight, as ik's -inf / -1e30 masks give none.

`ik_avx512_sinks` reproduces what ik's CPU build with AVX-512 computes for the sinks' values when there are fewer
than 16 sinks (and a multiple of 4; otherwise ggml's plain kernel runs and is exact). ik multiplies the sinks'
probabilities into their latents with its f32 GEMM (iqk mul_mat_Qx_Qy_MxN), whose first step always loads 16 floats
of each operand and whose 4-float tail loop then covers the row again. With S < 16 sinks, each latent channel c
therefore gets: twice the true sum over the sinks, plus the next 16 - S floats past the sink probabilities (the
softmax row continues with the probabilities of cache keys 0, 1, ...) times the next 16 - S floats past channel c's
row of the transposed sink latents (the following channels' rows; past the last row ik reads whatever memory follows
the buffer, taken as 0 here). Real models have 128 sinks and are unaffected.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit, prange

from ikrun.ops.attention import QUERY_BLOCK, causal_attention, causal_softmax
from ikrun.ops.parallel import pick


def latent_attention(q_rope: np.ndarray, q_nope: np.ndarray, w_kb: np.ndarray, cache: np.ndarray,
                     w_vb: np.ndarray, scale: float, *, sinks: np.ndarray | None = None, window: int = 0,
                     keep: np.ndarray | None = None, ik_avx512_sinks: bool = False,
                     on_latent: Callable[[np.ndarray], None] | None = None,
                     vb_input: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """Causal MLA over the positions p..p+n-1 of a sequence (p = 0 for a fresh one).

    q_rope [n, H, R] (roped), q_nope [n, H, D], w_kb [H, C, D], cache [p + n, R + C] rows [k_rope | c_kv] (a
    continuation's earlier positions first), w_vb [H, V, C]; returns the heads' values [n, H, V]. Sinks and a window
    take a fresh sequence (p = 0).
    Optional: `sinks` [S, R + C] rows in the cache layout, seen by every query (key and value as a cache row's);
    `window` > 0 limits query t to keys s with t - s < window; `keep` [n, p + n] (bool) the keys each query may see;
    `ik_avx512_sinks` adds ik's AVX-512 GEMM over-read to the sinks' values (module docstring); `on_latent` sees
    the heads' latent outputs [H, n, C] as they enter attn_v_b (for imatrix observers); `vb_input` rounds them
    as the attn_v_b product consumes them (--numerics ik).
    """
    n, n_head, n_rope = q_rope.shape
    n_lat = w_kb.shape[1]
    q = np.empty((n_head, n, n_rope + n_lat), dtype=np.float32)
    q[:, :, :n_rope] = q_rope.transpose(1, 0, 2)
    np.matmul(q_nope.transpose(1, 0, 2), w_kb.transpose(0, 2, 1), out=q[:, :, n_rope:])
    past = len(cache) - n
    if sinks is not None or window > 0 or keep is not None:
        if past and (sinks is not None or window > 0):
            raise ValueError("a continued sequence's MLA takes no sinks or window")
        latent = _restricted(q, cache, n_rope, scale, sinks, window, keep, ik_avx512_sinks)
    else:
        latent = np.empty((n_head, n, n_lat), dtype=np.float32)
        for q0 in range(0, n, QUERY_BLOCK):
            q1 = past + min(n, q0 + QUERY_BLOCK)  # keys past the block's last query never count
            scores = np.matmul(q[:, q0 : q1 - past], cache[:q1].T)  # [H, nq, q1]
            causal_softmax(scores, scale, past + q0)
            np.matmul(scores, cache[:q1, n_rope:], out=latent[:, q0 : q1 - past])
    if on_latent is not None:
        on_latent(latent)
    if vb_input is not None:
        latent = vb_input(latent)
    return np.matmul(latent, w_vb.transpose(0, 2, 1)).transpose(1, 0, 2)


def materialized_attention(q_rope: np.ndarray, q_nope: np.ndarray, cache: np.ndarray, w_kvb: np.ndarray,
                           scale: float, *, keep: np.ndarray | None = None,
                           store: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """Causal MLA in the prefill form over the positions p..p+n-1 of a sequence (the module docstring).

    q_rope [n, H, R] (roped), q_nope [n, H, D], cache [p + n, R + C] rows [k_rope | c_kv] (a continuation's earlier
    positions first), w_kvb [H * (D + V), C]; returns the heads' values [n, H, V]. `keep` [n, p + n] (bool): the
    keys each query may see; `store` rounds the materialised keys and values as ik casts them to its
    cache type. Without `keep` the heads' keys and values go through ops/attention.causal_attention (a head a KV
    head); with it, scores through BLAS and the masked softmax.
    """
    n, n_head, n_rope = q_rope.shape
    n_nope = q_nope.shape[2]
    n_keys = len(cache)
    past = n_keys - n
    kv = np.matmul(cache[:, n_rope:], w_kvb.T).reshape(n_keys, n_head, -1)
    k_nope, v = kv[:, :, :n_nope], kv[:, :, n_nope:]
    if store is not None:
        k_nope, v = store(k_nope), store(v)
    if keep is None:  # plain causal attention of every head's own keys and values
        k = np.empty((n_keys, n_head, n_rope + n_nope), dtype=np.float32)
        k[:, :, :n_rope] = cache[:, None, :n_rope]
        k[:, :, n_rope:] = k_nope
        return causal_attention(np.concatenate([q_rope, q_nope], axis=2), k, v, scale)
    q = np.concatenate([q_rope, q_nope], axis=2).transpose(1, 0, 2)  # [H, n, R + D]
    k = np.empty((n_head, n_keys, n_rope + n_nope), dtype=np.float32)
    k[:, :, :n_rope] = cache[None, :, :n_rope]
    k[:, :, n_rope:] = k_nope.transpose(1, 0, 2)
    vt = np.ascontiguousarray(v.transpose(1, 0, 2))
    mask = np.ascontiguousarray(keep, dtype=np.bool_)
    out = np.empty((n_head, n, v.shape[2]), dtype=np.float32)
    for q0 in range(0, n, QUERY_BLOCK):
        q1 = min(n, q0 + QUERY_BLOCK)
        scores = np.matmul(q[:, q0:q1], k[:, : past + q1].transpose(0, 2, 1))  # [H, nq, p + q1]
        pick(_masked_serial, _masked_parallel, scores.size)(scores, float(scale), 0, past + q0, 0, 0, mask[q0:q1],
                                                             True)
        np.matmul(scores, vt[:, : past + q1], out=out[:, q0:q1])
    return out.transpose(1, 0, 2)


@njit(cache=True, nogil=True, inline="always")
def _masked_row(r: np.ndarray, sc: np.float32, n_sink: int, pos: int, lo: int, window: int, keep: np.ndarray,
                use_keep: bool) -> None:
    """softmax(sc * r) over the sink columns and the cache columns (key lo + j) that pos may see; 0 elsewhere."""
    n_cols = r.shape[0]
    m = -np.inf
    for j in range(n_cols):
        key = lo + j - n_sink
        if j >= n_sink and (key > pos or (window > 0 and pos - key >= window) or (use_keep and not keep[key])):
            r[j] = -np.inf
            continue
        v = r[j] * sc
        r[j] = v
        if v > m:
            m = v
    s = 0.0
    for j in range(n_cols):
        e = np.exp(r[j] - m) if r[j] > -np.inf else np.float32(0.0)
        r[j] = e
        s += np.float64(e)
    inv = np.float32(1.0 / s)
    for j in range(n_cols):
        r[j] *= inv


@njit(cache=True, nogil=True)
def _masked_serial(scores, scale, n_sink, q0, lo, window, keep, use_keep):  # type: ignore[no-untyped-def]
    heads, n_q, _ = scores.shape
    for h in range(heads):
        for i in range(n_q):
            _masked_row(scores[h, i], np.float32(scale), n_sink, q0 + i, lo, window, keep[i], use_keep)


@njit(cache=True, nogil=True, parallel=True)
def _masked_parallel(scores, scale, n_sink, q0, lo, window, keep, use_keep):  # type: ignore[no-untyped-def]
    heads, n_q, _ = scores.shape
    for h in prange(heads):
        for i in range(n_q):
            _masked_row(scores[h, i], np.float32(scale), n_sink, q0 + i, lo, window, keep[i], use_keep)


#: floats in one AVX-512 register: ik's f32 GEMM always reads this many of each operand first
AVX512_FLOATS = 16


def _overread_rows(sink_latent: np.ndarray) -> np.ndarray:
    """[16 - S, C]: for each channel c, the floats ik reads past row c of the transposed sink latents [C, S]
    (the next rows, then zeros past the end)."""
    n_sink, n_lat = sink_latent.shape
    flat = np.zeros(n_lat * n_sink + AVX512_FLOATS, dtype=np.float32)
    flat[: n_lat * n_sink] = np.ascontiguousarray(sink_latent.T).reshape(-1)
    start = np.arange(n_lat)[None, :] * n_sink + n_sink
    return flat[start + np.arange(AVX512_FLOATS - n_sink)[:, None]]


def overread_applies(n_sink: int) -> bool:
    """Whether ik's AVX-512 f32 GEMM misreads the sinks' values (fewer than 16 sinks, a multiple of 4)."""
    return 0 < n_sink < AVX512_FLOATS and n_sink % 4 == 0


def _restricted(q: np.ndarray, cache: np.ndarray, n_rope: int, scale: float, sinks: np.ndarray | None,
                window: int, keep: np.ndarray | None, ik_avx512_sinks: bool) -> np.ndarray:
    """Latent outputs [H, n, C] under sinks, a window and/or a keep mask: per query block, only the sinks and the
    cache span its queries may see enter the products (the queries are the cache's last n positions)."""
    n_head, n, _ = q.shape
    past = len(cache) - n
    n_sink = 0 if sinks is None else sinks.shape[0]
    sink_rows = np.zeros((0, cache.shape[1]), dtype=np.float32) if sinks is None else \
        np.ascontiguousarray(sinks, dtype=np.float32)
    overread = _overread_rows(sink_rows[:, n_rope:]) if ik_avx512_sinks and overread_applies(n_sink) else None
    use_keep = keep is not None
    mask = np.ascontiguousarray(keep, dtype=np.bool_) if use_keep else np.ones((n, 1), dtype=np.bool_)
    latent = np.empty((n_head, n, cache.shape[1] - n_rope), dtype=np.float32)
    for q0 in range(0, n, QUERY_BLOCK):
        q1 = min(n, q0 + QUERY_BLOCK)
        lo = max(0, past + q0 - window + 1) if window > 0 else 0
        keys = np.concatenate([sink_rows, cache[lo : past + q1]])  # [sinks + visible cache span, R + C]
        scores = np.matmul(q[:, q0:q1], keys.T)
        pick(_masked_serial, _masked_parallel, scores.size)(scores, float(scale), n_sink, past + q0, lo, int(window),
                                                             mask[q0:q1], use_keep)
        np.matmul(scores, keys[:, n_rope:], out=latent[:, q0:q1])
        if overread is not None:
            latent[:, q0:q1] += _overread_term(scores, n_sink, lo, keys[:n_sink, n_rope:], overread)
    return latent


def _overread_term(probs: np.ndarray, n_sink: int, lo: int, sink_latent: np.ndarray,
                   overread: np.ndarray) -> np.ndarray:
    """What ik's GEMM adds to the sinks' true contribution: the sink sum once more, plus the probabilities of cache
    keys 0..15-S (0 for keys outside the block's span: masked there) times the over-read latent rows."""
    extra = overread.shape[0]
    first = np.zeros(probs.shape[:2] + (extra,), dtype=np.float32)
    a, b = lo, min(extra, lo + probs.shape[2] - n_sink)  # keys 0..extra-1 within the block's span
    if a < b:
        first[:, :, a:b] = probs[:, :, n_sink + a - lo : n_sink + b - lo]
    return np.matmul(probs[:, :, :n_sink], sink_latent) + np.matmul(first, overread)
