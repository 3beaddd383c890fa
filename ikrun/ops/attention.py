"""Causal multi-head attention with grouped KV heads (causal_attention: one Numba kernel in the exact mode's matmul
tiles, a fixed summation order), and one shared key/value head with sinks, a window and extra masked rows
(DeepSeek-V4: scores through BLAS, the masked softmax in Numba; causal_softmax also serves ops/mla.py). ik's own
arithmetic of these lives in ikrun/numerics/ik/attention.py.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikrun.ops.activations import exp64
from ikrun.ops.fgemm import K_STEP, LANES, ROWS, tile_groups, token_groups
from ikrun.ops.parallel import claim_items, pick, run_claimed, task_items

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


@njit(cache=True, nogil=True, inline="always")
def _exps_summed(r: np.ndarray, top: float, sums: np.ndarray) -> float:
    """r[j] <- exp64(r[j] - top) rounded to float32, for every j (-inf gives 0); returns the sum of the float64
    values: value j into running sum j % 16, in order, the 16 added pairwise at the end (a fixed order, and loops
    that run 16 values at a time in vectors; one running sum kept them a value at a time). `sums`: a 16-value
    float64 scratch array."""
    sums[:] = 0.0
    whole = r.shape[0] // LANES
    for b in range(whole):
        block = r[b * LANES : (b + 1) * LANES]
        for lane in range(LANES):
            e = exp64(np.float64(block[lane]) - top)
            block[lane] = np.float32(e)
            sums[lane] += e
    tail = r[whole * LANES :]
    for lane in range(tail.shape[0]):
        e = exp64(np.float64(tail[lane]) - top)
        tail[lane] = np.float32(e)
        sums[lane] += e
    width = LANES // 2
    while width:
        for lane in range(width):
            sums[lane] += sums[lane + width]
        width //= 2
    return sums[0]


@njit(cache=True, nogil=True, inline="always")
def _softmax_row(r: np.ndarray, sc: np.float32, first: int, last: int, sink: np.float32, sums: np.ndarray) -> None:
    """softmax(sc * r) over keys first..last plus a `sink` logit (-inf: none) that takes weight but has no value;
    0 for the other keys (r's length a multiple of 16). The scaled scores less their maximum through _exps_summed
    over the 16-key blocks the row sees, then the sink's exponential added; every loop in vectors (with one running
    sum and libm's exp a value at a time, the softmax took 1.5 of the 3.5 ms of 256 queries of 16 heads; now
    ~0.6)."""
    b0, b1 = first // LANES, last // LANES + 1
    r[: b0 * LANES] = 0
    r[b1 * LANES :] = 0
    span = r[b0 * LANES : b1 * LANES]
    for j in range(span.shape[0]):
        span[j] *= sc
    m = sink
    for j in range(first - b0 * LANES, last + 1 - b0 * LANES):
        m = span[j] if span[j] > m else m
    span[: first - b0 * LANES] = -np.inf
    span[last + 1 - b0 * LANES :] = -np.inf
    top = np.float64(m)
    total = _exps_summed(span, top, sums) + (exp64(np.float64(sink) - top) if sink > -np.inf else 0.0)
    inv = np.float32(1.0 / total)
    for j in range(span.shape[0]):
        span[j] *= inv


@njit(cache=True, nogil=True, inline="always")
def _panel_row(panel: np.ndarray, i: int, src: np.ndarray) -> None:
    """Row i of a tile's panel (rows K_STEP apart) starts with src (at most K_STEP values)."""
    dst = panel[i * K_STEP : i * K_STEP + src.shape[0]]
    for j in range(src.shape[0]):
        dst[j] = src[j]


@njit(cache=True, nogil=True, inline="always")
def _query_tile(q, kt, vt, out, scale, past, window, sinks, group, n_tiles, task, panel, scores, acc, sums):  # type: ignore[no-untyped-def]
    """Task `task` of causal_attention's kernel: ROWS queries of one head (the costliest tiles first) against the
    key groups they see. Scores: for each query and key, one FMA chain over the head's values in order
    (fgemm.tile_groups, the keys in the lanes); the masked softmax (_softmax_row); values: per query and value
    channel one FMA chain over the keys in order (the channels in the lanes), from the tile's first seen key group
    to its last key. Keys a query may not see weigh 0 in that chain, which leaves it as it was, so every output has
    the same bits whichever tile, block or continuation computes it."""
    n, n_head, d = q.shape
    h, t = task % n_head, n_tiles - 1 - task // n_head
    hk = h // group
    n_groups, dv_pad = kt.shape[0], vt.shape[1] * LANES
    width = kt.shape[1]
    i0 = t * ROWS
    rows = min(ROWS, n - i0)
    last = past + i0 + rows - 1
    g_lo = max(0, past + i0 - window + 1) // LANES if window > 0 else 0
    g_hi = last // LANES + 1
    n_keys = (g_hi - g_lo) * LANES
    keys = kt.reshape(-1)[g_lo * width * LANES : g_hi * width * LANES]
    s = scores[: ROWS * n_keys]
    s[:] = 0
    for k0 in range(0, d, K_STEP):
        k1 = min(d, k0 + K_STEP)
        for i in range(ROWS):
            if i < rows:
                _panel_row(panel, i, q[i0 + i, h, k0:k1])
            else:
                panel[i * K_STEP : i * K_STEP + k1 - k0] = 0
        tile_groups(panel, keys, g_hi - g_lo, hk * d + k0, hk * d + k1, width, s, n_keys)
    sink = sinks[h] if sinks.shape[0] else np.float32(-np.inf)
    key0 = g_lo * LANES
    for i in range(rows):
        pos = past + i0 + i
        first = max(0, pos - window + 1) if window > 0 else 0
        _softmax_row(s[i * n_keys : (i + 1) * n_keys], np.float32(scale), first - key0, pos - key0, sink, sums)
    a = acc[: ROWS * dv_pad]
    a[:] = 0
    values = vt[hk].reshape(-1)
    for k0 in range(key0, last + 1, K_STEP):
        k1 = min(last + 1, k0 + K_STEP)
        for i in range(ROWS):
            _panel_row(panel, i, s[i * n_keys + k0 - key0 : i * n_keys + k1 - key0])
        tile_groups(panel, values, vt.shape[1], k0, k1, n_groups * LANES, a, dv_pad)
    dv = out.shape[2]
    for i in range(rows):
        dst = out[i0 + i, h]
        for c in range(dv):
            dst[c] = a[i * dv_pad + c]


@njit(cache=True, nogil=True)
def _attention_serial(q, kt, vt, out, scale, past, window, sinks, group):  # type: ignore[no-untyped-def]
    n_tiles = -(-q.shape[0] // ROWS)
    panel = np.empty(ROWS * K_STEP, np.float32)
    scores = np.empty(ROWS * kt.shape[0] * LANES, np.float32)
    acc = np.empty(ROWS * vt.shape[1] * LANES, np.float32)
    sums = np.empty(LANES, np.float64)
    for task in range(n_tiles * q.shape[1]):
        _query_tile(q, kt, vt, out, scale, past, window, sinks, group, n_tiles, task, panel, scores, acc, sums)


@njit(cache=True, nogil=True, parallel=True)
def _attention_parallel(q, kt, vt, out, scale, past, window, sinks, group, threads):  # type: ignore[no-untyped-def]
    """The (head, query tile) tasks, claimed by the threads (ikrun/ops/parallel.py)."""
    n_tiles = -(-q.shape[0] // ROWS)
    tasks = n_tiles * q.shape[1]
    per, counter = task_items(tasks, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        panel = np.empty(ROWS * K_STEP, np.float32)
        scores = np.empty(ROWS * kt.shape[0] * LANES, np.float32)
        acc = np.empty(ROWS * vt.shape[1] * LANES, np.float32)
        sums = np.empty(LANES, np.float64)
        t0, t1 = claim_items(counter, per, tasks)
        while t0 < t1:
            for task in range(t0, t1):
                _query_tile(q, kt, vt, out, scale, past, window, sinks, group, n_tiles, task, panel, scores, acc, sums)
            t0, t1 = claim_items(counter, per, tasks)


@njit(cache=True, nogil=True, inline="always")
def _channel_task(v, vt, task):  # type: ignore[no-untyped-def]
    """vt[h, c, j, :] = v[j, h, 16 c : 16 c + 16] for every key j (zeros past v's keys and channels), task = h x
    channel groups + c."""
    h, c = task // vt.shape[1], task % vt.shape[1]
    c0 = c * LANES
    width = min(LANES, v.shape[2] - c0)
    dst = vt[h, c]
    for j in range(v.shape[0]):
        src = v[j, h, c0 : c0 + width]
        row = dst[j]
        for lane in range(width):
            row[lane] = src[lane]
        for lane in range(width, LANES):
            row[lane] = np.float32(0.0)
    dst[v.shape[0]:] = 0


@njit(cache=True, nogil=True)
def _channels_serial(v, vt):  # type: ignore[no-untyped-def]
    for task in range(vt.shape[0] * vt.shape[1]):
        _channel_task(v, vt, task)


@njit(cache=True, nogil=True, parallel=True)
def _channels_parallel(v, vt, threads):  # type: ignore[no-untyped-def]
    tasks = vt.shape[0] * vt.shape[1]
    per, counter = task_items(tasks, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        t0, t1 = claim_items(counter, per, tasks)
        while t0 < t1:
            for task in range(t0, t1):
                _channel_task(v, vt, task)
            t0, t1 = claim_items(counter, per, tasks)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, *, window: int = 0,
                     sinks: np.ndarray | None = None) -> np.ndarray:
    """q [n, H, d], k/v [p + n, Hkv, d(v)] -> [n, H, dv]; the queries are positions p..p+n-1 (p = 0 for a fresh
    sequence; a continuation's earlier keys and values come first) and query i attends to keys 0..p+i (with a
    `window`, only the last `window` of them, its own included); `sinks` [H] (causal_softmax).

    Each score is one FMA chain over d in order and each output one over the seen keys in order (_query_tile), in
    the exact mode's matmul tiles (ikrun/ops/fgemm.py); a query tile skips the key groups it may not see, which
    BLAS over whole blocks of queries computed and masked (256 queries of 16 heads of 128 over 8 KV heads, 2
    threads, a call in a loop: 12.8-14.5 ms through BLAS and causal_softmax, 2.3-2.7 ms here)."""
    n, n_head, _ = q.shape
    n_keys, n_kv_head, dv = v.shape
    keys = np.ascontiguousarray(k, dtype=np.float32).reshape(n_keys, -1)
    kt, _ = token_groups(keys, np.arange(n_keys, dtype=np.int64), np.array([0, n_keys], np.int64))
    values = np.ascontiguousarray(v, dtype=np.float32)
    vt = np.empty((n_kv_head, -(-dv // LANES), kt.shape[0] * LANES, LANES), np.float32)
    run_claimed(_channels_serial, _channels_parallel, vt.size, values, vt)
    sink = np.empty(0, np.float32) if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
    out = np.empty((n, n_head, dv), np.float32)
    run_claimed(_attention_serial, _attention_parallel, q.size * n_keys, np.ascontiguousarray(q, dtype=np.float32),
                kt, vt, out, np.float32(scale), n_keys - n, int(window), sink, n_head // n_kv_head)
    return out


@njit(cache=True, nogil=True, inline="always")
def _sink_row(r: np.ndarray, sc: np.float32, sink: np.float32, pos: int, lo: int, n_raw: int, window: int,
              comp_keep: np.ndarray, sums: np.ndarray) -> None:
    """softmax over the visible scores of r (raw keys lo + j for j < n_raw, then compressed entries) plus one sink
    logit that takes weight but has no value; 0 for keys the query may not see. The exponentials and their sum as
    _softmax_row's (_exps_summed)."""
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
    top = np.float64(m)
    total = _exps_summed(r, top, sums) + (exp64(np.float64(sink) - top) if sink > -np.inf else 0.0)
    inv = np.float32(1.0 / total)
    for j in range(r.shape[0]):
        r[j] *= inv


@njit(cache=True, nogil=True)
def _sink_serial(scores, scale, sinks, q0, lo, n_raw, window, comp_keep):  # type: ignore[no-untyped-def]
    n_q, heads, _ = scores.shape
    sums = np.empty(LANES, np.float64)
    for i in range(n_q):
        for h in range(heads):
            _sink_row(scores[i, h], np.float32(scale), sinks[h], q0 + i, lo, n_raw, window, comp_keep[i], sums)


@njit(cache=True, nogil=True, parallel=True)
def _sink_parallel(scores, scale, sinks, q0, lo, n_raw, window, comp_keep, threads):  # type: ignore[no-untyped-def]
    """The queries in tasks the threads claim (ikrun/ops/parallel.py)."""
    n_q, heads, _ = scores.shape
    per, counter = task_items(n_q, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        sums = np.empty(LANES, np.float64)
        i0, i1 = claim_items(counter, per, n_q)
        while i0 < i1:
            for i in range(i0, i1):
                for h in range(heads):
                    _sink_row(scores[i, h], np.float32(scale), sinks[h], q0 + i, lo, n_raw, window, comp_keep[i],
                              sums)
            i0, i1 = claim_items(counter, per, n_q)


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
        run_claimed(_sink_serial, _sink_parallel, scores.size, scores, float(scale), sink, p0, lo, p1 - lo,
                    int(window), keep[q0:q1])
        out[q0:q1] = (scores.reshape(nq * n_head, len(keys)) @ keys).reshape(nq, n_head, d)
    return out
