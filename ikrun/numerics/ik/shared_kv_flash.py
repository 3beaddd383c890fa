"""ik's flash-attention graph of DeepSeek-V4's attention (-fa on, its default): one shared key = value head (f16
cache rows), a sliding window of raw rows, the compressed entries a query sees, per-head sink logits.

ik hands each layer's flash attention to one of two kernels (build_deepseek4's dsv4_build_attn):
- ggml's generic kernel (the iqk kernel disabled) where the layer has no compressed entries (a raw-only layer, or an
  HCA layer before its first complete window) or where the entries a query may see, padded to 256, are not fewer
  than the key columns of the mask (the raw cells, padded to 256 and cut to the window's span, plus the compressor's
  cells, padded to 256). Per query and head: the query rounded to f16, the visible keys in cache order (raw rows, then
  compressed entries), the f16 dot, the online softmax with the value sums in f16 (flash_attention.generic_flash_attention
  without the causal bound), then the sink: above the maximum M it scales the sums by expf(M - sink) and the total to
  total x that + 1, else adds expf(sink - M) to the total (ggml.c's floats: no fused multiply-add).
- otherwise ik's own kernel over the visible keys alone (ggml_mask_to_index gathers them, in cache order, into a
  buffer of 32-key steps), the heads of one token its rows: iqk_flash_attention's blocks, exponential and float32
  value sums, the block size by the gathered count (k_step_for), then the sink as above but with the total fused
  (fma(total, expf(M - sink), 1)). With one token in the batch ik's threads split the heads and each thread reads the
  sinks from head 0 on, not from its first head: head h takes sink h - (its thread's first head) (reproduced from
  `threads`).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import fmaf, round_f16
from ikrun.numerics.ik.flash_attention import _key_step
from ikrun.numerics.ik.iqk_flash_attention import _accumulate, _scores_range, _softmax_step, k_step_for

#: ik pads its key cells and its compressors' cells to this under flash attention, and its windowed raw view to
#: steps of it
FA_CELLS = 256


def _pad(x: int, to: int = FA_CELLS) -> int:
    return -(-x // to) * to


def ik_gathers(ratio: int, window: int, top_k: int, start: int, n: int) -> bool:
    """Whether ik's flash-attention graph gives a layer with compress `ratio` (0: raw rows only; 4: CSA with
    `top_k`; 128: HCA) its own kernel over the gathered visible keys (else ggml's generic kernel), for a batch of `n`
    tokens at positions start .. start + n - 1 of a fresh sequence (module docstring)."""
    end = start + n
    if ratio == 0 or end // ratio == 0 and ratio != 4:
        return False
    cells = max(FA_CELLS, _pad(end))
    raw = min(cells, FA_CELLS * -(-(max(FA_CELLS, n) + window) // FA_CELLS))
    entries = top_k if ratio == 4 and n == 1 and top_k < max(FA_CELLS, _pad(end // ratio)) \
        else max(FA_CELLS, _pad(end // ratio))
    seen = window + (top_k if ratio == 4 else -(-cells // ratio))
    return _pad(seen) < raw + entries


def visible_keys(n: int, start: int, window: int, n_raw: int, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per query (position start + t) the rows of [raw rows | compressed entries] it sees, in cache order: the raw
    rows of its window, then the entries `keep` [n, T] marks (indices offset by `n_raw`). Returns (rows [n, most],
    counts [n])."""
    pos = start + np.arange(n)
    lo = np.maximum(0, pos - window + 1) if window > 0 else np.zeros(n, np.int64)
    counts = (pos - lo + 1) + keep.sum(axis=1)
    rows = np.zeros((n, int(counts.max()) if n else 0), dtype=np.int64)
    for t in range(n):
        raw = np.arange(lo[t], pos[t] + 1)
        comp = n_raw + np.flatnonzero(keep[t])
        rows[t, : counts[t]] = np.concatenate([raw, comp])
    return rows, counts


def sink_heads(n_head: int, threads: int) -> np.ndarray:
    """Per head the sink ik's own kernel gives it in a one-token batch: its threads take ceil(H / threads) heads (the
    last ones one fewer where that overshoots) and each reads the sinks from head 0 on."""
    per = -(-n_head // threads)
    first = np.empty(n_head, dtype=np.int64)
    mid = threads if per * threads <= n_head else n_head - threads * (per - 1)
    for ith in range(threads):
        lo = ith * per if ith < mid else mid * per + (ith - mid) * (per - 1)
        hi = min(n_head, lo + (per if ith < mid else per - 1))
        first[lo:hi] = lo
    return np.arange(n_head) - first


def shared_kv_flash_attention(q: np.ndarray, keys: np.ndarray, rows: np.ndarray, counts: np.ndarray,
                              sinks: np.ndarray, scale: float, gathered: bool, lanes: int,
                              sink_of: np.ndarray) -> np.ndarray:
    """q [n, H, d] (float32), keys [K, d] the key = value rows (f16 values in float32), rows / counts
    (visible_keys) -> [n, H, d] as ik's kernel (`gathered`: its own, else ggml's generic) computes it; `sinks` [H]
    (none: empty); head h adds sink sinks[sink_of[h]]."""
    out = np.empty_like(q)
    sc = np.float32(scale)
    if gathered:
        steps = np.array([k_step_for(q.shape[2], q.shape[2], 32 * -(-int(c) // 32)) for c in counts], np.int64)
        _gathered(q, keys, rows, counts, steps, sinks, sink_of, sc, lanes, out)
    else:
        _generic(q, keys, rows, counts, sinks, sc, lanes, out)
    return out


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _sink_generic(sums: np.ndarray, total: np.float32, top: np.float32, sink: np.float32) -> np.float32:
    if sink > top:
        ms = np.exp(np.float32(top - sink))
        for d in range(sums.shape[0]):
            sums[d] = sums[d] * ms
        return np.float32(total * ms) + np.float32(1.0)
    return total + np.exp(np.float32(sink - top))


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _f16_dots(kt: np.ndarray, n_keys: int, qh: np.ndarray, lanes: int, acc: np.ndarray, out: np.ndarray) -> None:
    """out[k] = flash_attention._dot_f16(key k, qh) for the keys kt [Dk, >= n_keys rounded up to 16] (transposed),
    16 keys at a time as the vector lanes: the same fused chains and folds, each of a key's accumulators a row of
    acc [4 x lanes, 16]."""
    d = qh.shape[0]
    step = 4 * lanes
    n_steps = d - d % step
    for k0 in range(0, n_keys, 16):
        acc[:, :] = 0.0
        for i in range(0, n_steps, step):
            for c in range(step):
                qe = qh[i + c]
                a = acc[c]
                for k in range(16):
                    a[k] = fmaf(kt[i + c, k0 + k], qe, a[k])
        for lane in range(lanes):
            for k in range(16):
                acc[lane, k] = acc[lane, k] + acc[2 * lanes + lane, k]
                acc[lanes + lane, k] = acc[lanes + lane, k] + acc[3 * lanes + lane, k]
        for lane in range(lanes):
            for k in range(16):
                acc[lane, k] = acc[lane, k] + acc[lanes + lane, k]
        if lanes == 16:
            for lane in range(8):
                for k in range(16):
                    acc[lane, k] = acc[lane, k] + acc[8 + lane, k]
        for k in range(min(16, n_keys - k0)):
            t0, t1 = acc[0, k] + acc[4, k], acc[1, k] + acc[5, k]
            t2, t3 = acc[2, k] + acc[6, k], acc[3, k] + acc[7, k]
            total = np.float64((t0 + t2) + (t1 + t3) if lanes == 16 else (t0 + t1) + (t2 + t3))
            for e in range(n_steps, d):
                total += np.float64(np.float32(kt[e, k0 + k] * qh[e]))
            out[k0 + k] = np.float32(total)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _gather(keys: np.ndarray, rows: np.ndarray, count: int, multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """A query's `count` visible key = value rows: transposed (kt [Dk, count rounded up to `multiple`], zeros
    after) and as rows (v, the same length)."""
    cap = multiple * -(-count // multiple)
    kt = np.zeros((keys.shape[1], cap), dtype=np.float32)
    v = np.zeros((cap, keys.shape[1]), dtype=np.float32)
    for j in range(count):
        v[j] = keys[rows[j]]
        kt[:, j] = v[j]
    return kt, v


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _generic(q: np.ndarray, keys: np.ndarray, rows: np.ndarray, counts: np.ndarray, sinks: np.ndarray,
             sc: np.float32, lanes: int, out: np.ndarray) -> None:
    """Per query: its visible keys gathered once, then per head the f16 dots of all of them (_f16_dots) and the
    online softmax over them in order."""
    n, n_head, d = q.shape
    for t in prange(n):
        c = counts[t]
        kt, v = _gather(keys, rows[t], c, 16)
        scores = np.empty(kt.shape[1], dtype=np.float32)
        acc = np.empty((4 * lanes, 16), dtype=np.float32)
        qh = np.empty(d, dtype=np.float32)
        sums = np.empty(d, dtype=np.float32)
        for h in range(n_head):
            for i in range(d):
                qh[i] = round_f16(q[t, h, i])
            _f16_dots(kt, c, qh, lanes, acc, scores)
            sums[:] = 0.0
            total, top = np.float32(0.0), np.float32(-np.inf)
            for j in range(c):
                total, top = _key_step(np.float32(scores[j] * sc), v[j], sums, total, top, True)
            if sinks.size:
                total = _sink_generic(sums, total, top, sinks[h])
            inv = np.float32(0.0) if total == 0 else np.float32(np.float32(1.0) / total)
            for i in range(d):
                out[t, h, i] = sums[i] * inv


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _gathered(q: np.ndarray, keys: np.ndarray, rows: np.ndarray, counts: np.ndarray, steps: np.ndarray,
              sinks: np.ndarray, sink_of: np.ndarray, sc: np.float32, lanes: int, out: np.ndarray) -> None:
    n, n_head, d = q.shape
    for t in prange(n):
        c = counts[t]
        kt, v = _gather(keys, rows[t], c, 32)
        k_step = steps[t]
        s = np.empty((1, k_step), dtype=np.float32)
        p = np.empty((1, k_step), dtype=np.float32)
        acc = np.empty((lanes // 4, k_step), dtype=np.float32)
        sums = np.empty((1, d), dtype=np.float32)
        for h in range(n_head):
            sums[0, :] = 0.0
            total, top = np.float32(0.0), np.float32(-np.inf)
            for b0 in range(0, c, k_step):
                n_in = min(k_step, c - b0)
                _scores_range(q[t, h:h + 1], kt, b0, 0, n_in, acc, lanes, sc, s)
                total, top = _softmax_step(s[0], n_in, p[0], sums[0], total, top, lanes)
                _accumulate(v, b0, 0, n_in, p, sums)
            if sinks.size:
                sink = sinks[sink_of[h]]
                if sink > top:
                    m = np.exp(np.float32(top - sink))
                    for i in range(d):
                        sums[0, i] = m * sums[0, i]
                    total = fmaf(total, m, np.float32(1.0))
                else:
                    total = total + np.exp(np.float32(sink - top))
            inv = np.float32(np.float32(1.0) / total) if total > 0 else np.float32(0.0)
            for i in range(d):
                out[t, h, i] = inv * sums[0, i]
