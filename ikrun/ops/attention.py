"""Causal multi-head attention with grouped KV heads (causal_attention: one Numba kernel in the exact mode's matmul
tiles, a fixed summation order), also for one shared key/value head with sinks, a window and extra masked rows
(DeepSeek-V4); causal_softmax serves ops/mla.py. ik's own arithmetic of these lives in
ikrun/numerics/ik/attention.py.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikrun.ops.activations import exp64
from ikrun.ops.fgemm import K_STEP, LANES, ROWS, tile_groups, token_groups
from ikrun.ops.parallel import claim_items, pick, run_claimed, task_items

# Query rows per block: bounds the score buffer to heads x block x n_kv floats for long chunks.
QUERY_BLOCK = 256


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
def _normalised_exps(r: np.ndarray, m: np.float32, sink: np.float32, sums: np.ndarray) -> None:
    """The softmax's end over scaled scores r whose largest seen value (or the sink) is m, the keys not seen -inf:
    r[j] <- exp(r[j] - m) (_exps_summed) over their sum plus the `sink`'s exponential (-inf: none)."""
    top = np.float64(m)
    total = _exps_summed(r, top, sums) + (exp64(np.float64(sink) - top) if sink > -np.inf else 0.0)
    inv = np.float32(1.0 / total)
    for j in range(r.shape[0]):
        r[j] *= inv


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
    _normalised_exps(span, m, sink, sums)


@njit(cache=True, nogil=True, inline="always")
def _extra_softmax_row(r: np.ndarray, sc: np.float32, first: int, last: int, n_raw: int, keep: np.ndarray,
                       sink: np.float32, sums: np.ndarray) -> None:
    """_softmax_row over raw keys first..last of r[:n_raw] and the extra entries r[n_raw + t] that `keep[t]` lets
    the query see (r's length a multiple of 16; entries past keep's are padding): the others -inf before the
    exponentials (_exps_summed gives them 0)."""
    m = sink
    for j in range(r.shape[0]):
        if j < n_raw:
            visible = first <= j <= last
        else:
            visible = j - n_raw < keep.shape[0] and keep[j - n_raw]
        if visible:
            v = r[j] * sc
            r[j] = v
            m = v if v > m else m
        else:
            r[j] = -np.inf
    _normalised_exps(r, m, sink, sums)


@njit(cache=True, nogil=True, inline="always")
def _panel_row(panel: np.ndarray, i: int, src: np.ndarray) -> None:
    """Row i of a tile's panel (rows K_STEP apart) starts with src (at most K_STEP values)."""
    dst = panel[i * K_STEP : i * K_STEP + src.shape[0]]
    for j in range(src.shape[0]):
        dst[j] = src[j]


@njit(cache=True, nogil=True, inline="always")
def _kept_prefix(keep: np.ndarray, i0: int, i1: int) -> int:
    """1 + the last extra entry any of queries i0 .. i1 - 1 keeps (0: none; a causal compressed cache grows with
    the position, so early tiles see few entries)."""
    used = 0
    for i in range(i0, i1):
        row = keep[i]
        for t in range(row.shape[0] - 1, used - 1, -1):
            if row[t]:
                used = t + 1
                break
    return used


@njit(cache=True, nogil=True)
def _query_tile(q, kt, vt, out, scale, past, window, sinks, group, n_tiles, task, panel, scores, acc, sums,  # type: ignore[no-untyped-def]
                extra_at, keep):
    """Task `task` of causal_attention's kernel: ROWS queries of one head (the costliest tiles first) against the
    key groups they see. Scores: for each query and key, one FMA chain over the head's values in order
    (fgemm.tile_groups, the keys in the lanes); the masked softmax (_softmax_row); values: per query and value
    channel one FMA chain over the keys in order (the channels in the lanes), from the tile's first seen key group
    to its last key. Keys a query may not see weigh 0 in that chain, which leaves it as it was, so every output has
    the same bits whichever tile, block or continuation computes it. Extra entries (keep [n, T], T > 0) are the key
    groups from `extra_at` on: a tile scores those up to the last one any of its queries keeps, and their values
    continue each chain after the raw keys', in order. Called, not inlined, by its serial and parallel kernels:
    Numba typed and compiled an inlined body in each (causal_attention's first call 47 -> 21 s on a 2-core Zen 3,
    the same bits and speed)."""
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
    n_raw = (g_hi - g_lo) * LANES
    n_extra = -(-_kept_prefix(keep, i0, i0 + rows) // LANES)
    n_keys = n_raw + n_extra * LANES
    flat = kt.reshape(-1)
    keys = flat[g_lo * width * LANES : g_hi * width * LANES]
    extra_keys = flat[extra_at * width * LANES :]
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
        if n_extra:
            tile_groups(panel, extra_keys, n_extra, hk * d + k0, hk * d + k1, width, s[n_raw:], n_keys)
    sink = sinks[h] if sinks.shape[0] else np.float32(-np.inf)
    key0 = g_lo * LANES
    for i in range(rows):
        pos = past + i0 + i
        first = max(0, pos - window + 1) if window > 0 else 0
        row = s[i * n_keys : (i + 1) * n_keys]
        if n_extra:
            _extra_softmax_row(row, np.float32(scale), first - key0, pos - key0, n_raw, keep[i0 + i], sink, sums)
        else:
            _softmax_row(row, np.float32(scale), first - key0, pos - key0, sink, sums)
    a = acc[: ROWS * dv_pad]
    a[:] = 0
    values = vt[hk].reshape(-1)
    for k0 in range(key0, last + 1, K_STEP):
        k1 = min(last + 1, k0 + K_STEP)
        for i in range(ROWS):
            _panel_row(panel, i, s[i * n_keys + k0 - key0 : i * n_keys + k1 - key0])
        tile_groups(panel, values, vt.shape[1], k0, k1, n_groups * LANES, a, dv_pad)
    for c0 in range(0, n_extra * LANES, K_STEP):
        c1 = min(n_extra * LANES, c0 + K_STEP)
        for i in range(ROWS):
            _panel_row(panel, i, s[i * n_keys + n_raw + c0 : i * n_keys + n_raw + c1])
        tile_groups(panel, values, vt.shape[1], extra_at * LANES + c0, extra_at * LANES + c1, n_groups * LANES, a,
                    dv_pad)
    dv = out.shape[2]
    for i in range(rows):
        dst = out[i0 + i, h]
        for c in range(dv):
            dst[c] = a[i * dv_pad + c]


@njit(cache=True, nogil=True)
def _attention_serial(q, kt, vt, out, scale, past, window, sinks, group, extra_at, keep):  # type: ignore[no-untyped-def]
    n_tiles = -(-q.shape[0] // ROWS)
    panel = np.empty(ROWS * K_STEP, np.float32)
    scores = np.empty(ROWS * kt.shape[0] * LANES, np.float32)
    acc = np.empty(ROWS * vt.shape[1] * LANES, np.float32)
    sums = np.empty(LANES, np.float64)
    for task in range(n_tiles * q.shape[1]):
        _query_tile(q, kt, vt, out, scale, past, window, sinks, group, n_tiles, task, panel, scores, acc, sums,
                    extra_at, keep)


@njit(cache=True, nogil=True, parallel=True)
def _attention_parallel(q, kt, vt, out, scale, past, window, sinks, group, extra_at, keep,  # type: ignore[no-untyped-def]
                        threads):
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
                _query_tile(q, kt, vt, out, scale, past, window, sinks, group, n_tiles, task, panel, scores, acc, sums,
                            extra_at, keep)
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
                     sinks: np.ndarray | None = None,
                     extra: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """q [n, H, d], k/v [p + n, Hkv, d(v)] -> [n, H, dv]; the queries are positions p..p+n-1 (p = 0 for a fresh
    sequence; a continuation's earlier keys and values come first) and query i attends to keys 0..p+i (with a
    `window`, only the last `window` of them, its own included); `sinks` [H] (causal_softmax); `extra` (keys [T,
    Hkv, d], values [T, Hkv, dv], keep [n, T]): entries beside the positions that query i sees where keep[i] says
    (DeepSeek-V4's compressed rows).

    Each score is one FMA chain over d in order and each output one over the seen keys in order (_query_tile), in
    the exact mode's matmul tiles (ikrun/ops/fgemm.py); a query tile skips the key groups it may not see, which
    BLAS over whole blocks of queries computed and masked (256 queries of 16 heads of 128 over 8 KV heads, 2
    threads, a call in a loop: 12.8-14.5 ms through BLAS and causal_softmax, 2.3-2.7 ms here)."""
    n, n_head, _ = q.shape
    n_keys, n_kv_head, dv = v.shape
    keys = np.ascontiguousarray(k, dtype=np.float32).reshape(n_keys, -1)
    values = np.ascontiguousarray(v, dtype=np.float32)
    keep = np.zeros((n, 0), np.bool_)
    extra_at = -(-n_keys // LANES)
    if extra is not None and extra[2].shape[1]:
        ek, ev, keep = extra
        if keep.shape != (n, len(ek)) or len(ev) != len(ek):
            raise ValueError(f"extra entries: {len(ek)} keys, {len(ev)} values, keep {list(keep.shape)} for {n} queries")
        pad = extra_at * LANES - n_keys  # the extra entries start a key group of their own
        keys = np.concatenate([keys, np.zeros((pad, keys.shape[1]), np.float32),
                               np.ascontiguousarray(ek, dtype=np.float32).reshape(len(ek), -1)])
        values = np.concatenate([values, np.zeros((pad, n_kv_head, dv), np.float32),
                                 np.ascontiguousarray(ev, dtype=np.float32)])
        keep = np.ascontiguousarray(keep, dtype=np.bool_)
    kt, _ = token_groups(keys, np.arange(len(keys), dtype=np.int64), np.array([0, len(keys)], np.int64))
    vt = np.empty((n_kv_head, -(-dv // LANES), kt.shape[0] * LANES, LANES), np.float32)
    run_claimed(_channels_serial, _channels_parallel, vt.size, values, vt)
    sink = np.empty(0, np.float32) if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
    out = np.empty((n, n_head, dv), np.float32)
    run_claimed(_attention_serial, _attention_parallel, q.size * len(keys), np.ascontiguousarray(q, dtype=np.float32),
                kt, vt, out, np.float32(scale), n_keys - n, int(window), sink, n_head // n_kv_head, extra_at, keep)
    return out


def shared_kv_attention(q: np.ndarray, kv: np.ndarray, scale: float, *, window: int = 0,
                        sinks: np.ndarray | None = None, comp: np.ndarray | None = None,
                        comp_keep: np.ndarray | None = None, start: int = 0) -> np.ndarray:
    """Attention of a sequence whose single key head is also its value (DeepSeek-V4).

    q [n, H, d] the queries at positions start..start+n-1 (start > 0: a continued sequence); kv [start + n, d] the
    per-position key = value rows (query t sees row s when s <= t and, with a window, t - s < window); `comp` [T, d]
    extra key = value rows (compressed entries) seen where `comp_keep` [n, T] says; `sinks` [H] one logit per head in
    every softmax's denominator. Returns [n, H, d]: causal_attention with the one head as keys and values and the
    compressed entries as its extra ones. Through BLAS per block of 32 queries and a masked softmax, 16 heads of 256
    with a window of 128 and sinks (2 threads, a call in a loop) took 4.5-4.8 ms at 256 queries and 22.6-28.5 ms at
    1,024 (52.8-59.5 ms with 256 compressed entries, 64 kept a query); in the kernel's tiles 3.05, 15.4-16.0 and
    30.2-31.9 ms."""
    n = len(q)
    if len(kv) != start + n:
        raise ValueError(f"kv has {len(kv)} rows, expected {start + n} (start {start} + {n} queries)")
    extra = None
    if comp is not None and len(comp):
        rows = np.ascontiguousarray(comp, dtype=np.float32)[:, None, :]
        keep = np.zeros((n, len(rows)), np.bool_) if comp_keep is None else comp_keep
        if keep.shape != (n, len(rows)):
            raise ValueError(f"comp_keep has shape {list(keep.shape)}, expected {[n, len(rows)]}")
        extra = (rows, rows, keep)
    shared = np.ascontiguousarray(kv, dtype=np.float32)[:, None, :]
    return causal_attention(q, shared, shared, scale, window=window, sinks=sinks, extra=extra)
