"""ik's flash-attention graph of DeepSeek-V4's attention (-fa on, its default): one shared key = value head (its
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

Over a q8_0 or bf16 key cache both kernels take q . k from another kernel (the `scores`: ik's integer kernels; over
bf16 ggml_vec_dot_bf16, generic_bf16_products, which ggml's generic kernel also runs for the BF16 caches of other
architectures, or ik's bf16 kernel) and the decoded rows as values, summed in float32.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from ikquant.formats.numeric import f32_to_bf16_bits, fmaf, round_f16
from ikrun.numerics.ik.flash_attention import _key_step
from ikrun.numerics.ik.iqk_flash_attention import (
    ROWS,
    _accumulate,
    _accumulate_all,
    _fma,
    _Rows,
    _scores_range,
    _softmax_step,
    bf16_k_step_for,
    k_step_for,
    scores_rows,
)
from ikrun.ops.parallel import claim_items, task_items
from ikrun.ops.simd import V16F, splat

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
    if ratio == 0 or (ratio != 4 and end // ratio == 0):  # no compressed entry: the raw-only graph (CSA keeps its own)
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


#: the `scores` of an attention over F16 keys: none, the kernel takes the float dot
NO_SCORES = np.zeros((0, 0, 0), np.float32)


def generic_bf16_products(q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """q . k [n, H, K] of queries q [n, H, d] and key rows [K, d] (bf16 values) as ggml's generic flash-attention
    kernel takes them over a BF16 cache in ik's AVX512-BF16 build: the query rounded to bf16 (nearest even), then
    ggml_vec_dot_bf16: two 16-lane accumulators, each 64 values a step (vdpbf16ps: lane l adds the products of
    values 2l + 1, then 2l, each exact, each sum rounded), each folded as _mm512_reduce_add_ps (lanes l + (l + 8),
    then l + (l + 4), then (0 + 2) + (1 + 3)) and added to a double, the values past the whole steps' products
    added in double."""
    rounded = (f32_to_bf16_bits(q).astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(q.shape)
    out = np.empty((q.shape[0], q.shape[1], len(keys)), dtype=np.float32)
    _bf16_products(rounded, np.ascontiguousarray(keys, dtype=np.float32), out)
    return out


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _reduce_16(c: np.ndarray) -> np.float32:
    a = np.empty(8, dtype=np.float32)
    for i in range(8):
        a[i] = c[i] + c[8 + i]
    b0, b1, b2, b3 = a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]
    return (b0 + b2) + (b1 + b3)


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _bf16_products(q: np.ndarray, keys: np.ndarray, out: np.ndarray) -> None:
    n, n_head, d = q.shape
    whole = d - d % 64
    for job in prange(n * n_head):
        t, h = job // n_head, job % n_head
        y = q[t, h]
        c1 = np.empty(16, dtype=np.float32)
        c2 = np.empty(16, dtype=np.float32)
        for key in range(len(keys)):
            x = keys[key]
            c1[:] = 0.0
            c2[:] = 0.0
            for i in range(0, whole, 64):
                for lane in range(16):
                    c1[lane] = c1[lane] + x[i + 2 * lane + 1] * y[i + 2 * lane + 1]
                    c1[lane] = c1[lane] + x[i + 2 * lane] * y[i + 2 * lane]
                    c2[lane] = c2[lane] + x[i + 32 + 2 * lane + 1] * y[i + 32 + 2 * lane + 1]
                    c2[lane] = c2[lane] + x[i + 32 + 2 * lane] * y[i + 32 + 2 * lane]
            total = np.float64(_reduce_16(c1))
            total += np.float64(_reduce_16(c2))
            for e in range(whole, d):
                total += np.float64(x[e] * y[e])
            out[t, h, key] = np.float32(total)


def shared_kv_flash_attention(q: np.ndarray, keys: np.ndarray, rows: np.ndarray, counts: np.ndarray,
                              sinks: np.ndarray, scale: float, gathered: bool, lanes: int, sink_of: np.ndarray,
                              scores: np.ndarray = NO_SCORES, bf16: bool = False) -> np.ndarray:
    """q [n, H, d] (float32), keys [K, d] the key = value rows (f16 values in float32), rows / counts
    (visible_keys) -> [n, H, d] as ik's kernel (`gathered`: its own, else ggml's generic) computes it; `sinks` [H]
    (none: empty); head h adds sink sinks[sink_of[h]]. Over a quantized cache `scores` [n, H, K] are the products
    q . k ik's integer kernel computed and `keys` the decoded rows: the generic kernel then sums the values in
    float32; over a `bf16` one ik's own kernel takes its bf16 kernel's blocks (bf16_k_step_for)."""
    out = np.empty_like(q)
    sc = np.float32(scale)
    if gathered:
        step_for = bf16_k_step_for if bf16 else k_step_for
        steps = np.array([step_for(q.shape[2], q.shape[2], 32 * -(-int(c) // 32)) for c in counts], np.int64)
        _gathered(q, keys, rows, counts, steps, sinks, sink_of, sc, lanes, out, get_num_threads(), scores)
    else:
        _generic(q, keys, rows, counts, sinks, sc, lanes, out, get_num_threads(), scores)
    return out


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _sink_generic(sums: np.ndarray, total: np.float32, top: np.float32, sink: np.float32) -> np.float32:
    if sink > top:
        ms = np.exp(np.float32(top - sink))
        for d in range(sums.shape[0]):
            sums[d] = sums[d] * ms
        return np.float32(total * ms) + np.float32(1.0)
    return total + np.exp(np.float32(sink - top))


def _dots_intrinsic(lanes: int):  # type: ignore[no-untyped-def]
    """An intrinsic (kt, q, key0, out): out[0, key0 + k] = ggml_vec_dot_f16 of key key0 + k of kt [Dk, keys]
    (transposed) and the query row q [1, Dk] over the dims of whole steps of 4 x lanes, for 16 keys as the vector
    lanes: chain c (c < 4 x lanes) the fused products of the dims c, c + 4 x lanes, ... in turn, the chains held in
    registers sixteen at a time, then folded as flash_attention._dot_f16 folds them."""
    step = 4 * lanes

    @intrinsic
    def dots(typingctx, kt, q, key0, out):  # type: ignore[no-untyped-def]
        sig = types.void(kt, q, types.int64, out)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            keys_t, q_t, out_t = (_Rows(context, builder, signature.args[i], args[i]) for i in (0, 1, 3))
            key0, fma = args[2], _fma(builder)

            def const(x: int) -> ir.Constant:
                return ir.Constant(key0.type, x)

            slots = [cgutils.alloca_once(builder, V16F) for _ in range(step)]
            for g0 in range(0, step, 16):
                group = slots[g0 : g0 + 16]
                for slot in group:
                    builder.store(ir.Constant(V16F, [0.0] * 16), slot)
                with cgutils.for_range(builder, builder.udiv(keys_t.rows, const(step))) as loop:
                    first = builder.mul(loop.index, const(step))
                    for j, slot in enumerate(group):
                        dim = builder.add(first, const(g0 + j))
                        keys = builder.load(keys_t.vector(dim, key0), align=4)
                        weight = splat(builder, builder.load(q_t.at(const(0), dim)))
                        builder.store(builder.call(fma, [keys, weight, builder.load(slot)]), slot)
            c = [builder.load(slot) for slot in slots]
            a = [builder.fadd(builder.fadd(c[x], c[2 * lanes + x]), builder.fadd(c[lanes + x], c[3 * lanes + x]))
                 for x in range(lanes)]
            if lanes == 16:
                a = [builder.fadd(a[x], a[8 + x]) for x in range(8)]
            t = [builder.fadd(a[x], a[4 + x]) for x in range(4)]
            total = builder.fadd(builder.fadd(t[0], t[2]), builder.fadd(t[1], t[3])) if lanes == 16 else \
                builder.fadd(builder.fadd(t[0], t[1]), builder.fadd(t[2], t[3]))
            builder.store(total, out_t.vector(const(0), key0), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return dots


_dots_8, _dots_16 = _dots_intrinsic(8), _dots_intrinsic(16)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _f16_dots(kt: np.ndarray, n_keys: int, qh: np.ndarray, lanes: int, out: np.ndarray) -> None:
    """out[0, k] = flash_attention._dot_f16(key k, qh[0]) for the keys kt [Dk, >= n_keys rounded up to 16]
    (transposed), 16 keys at a time as the vector lanes (_dots_intrinsic), the dims past the whole steps added in
    float64 as _dot_f16 adds them."""
    d = qh.shape[1]
    n_steps = d - d % (4 * lanes)
    for k0 in range(0, n_keys, 16):
        if lanes == 16:
            _dots_16(kt, qh, k0, out)
        else:
            _dots_8(kt, qh, k0, out)
    if n_steps < d:
        for k in range(n_keys):
            total = np.float64(out[0, k])
            for e in range(n_steps, d):
                total += np.float64(np.float32(kt[e, k] * qh[0, e]))
            out[0, k] = np.float32(total)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _transpose(keys: np.ndarray, rows: np.ndarray, count: int, cap: int, kt: np.ndarray) -> None:
    """A query's `count` visible key rows transposed into kt[:, :cap] (zeros from count to cap)."""
    kt[:, count:cap] = 0.0
    for j0 in range(0, count, 16):
        for e in range(keys.shape[1]):
            for j in range(j0, min(count, j0 + 16)):
                kt[e, j] = keys[rows[j], e]


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _generic(q: np.ndarray, keys: np.ndarray, rows: np.ndarray, counts: np.ndarray, sinks: np.ndarray,
             sc: np.float32, lanes: int, out: np.ndarray, threads: int, given: np.ndarray) -> None:
    """Per query: its visible keys transposed once, then per head the f16 dots of all of them (_f16_dots; or the
    `given` scores, the values then summed in float32) and the online softmax over them in order; the queries in
    tasks the threads claim, each thread with its own buffers."""
    per, counter = task_items(q.shape[0], threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        _generic_thread(q, keys, rows, counts, sinks, sc, lanes, out, given, counter, per)


@njit(cache=True, nogil=True, error_model="numpy")
def _generic_thread(q: np.ndarray, keys: np.ndarray, rows: np.ndarray, counts: np.ndarray, sinks: np.ndarray,
                    sc: np.float32, lanes: int, out: np.ndarray, given: np.ndarray, counter: np.ndarray,
                    per: int) -> None:
    """One thread of _generic: its buffers, then the queries it claims (ikquant/formats/jit.py: why a task is a
    function of its own)."""
    n, n_head, d = q.shape
    f16_values = given.size == 0
    most = 16 * -(-counts.max() // 16) if f16_values else 16
    kt = np.empty((d, most), dtype=np.float32)
    scores = np.empty((1, most), dtype=np.float32)
    qh = np.empty((1, d), dtype=np.float32)
    sums = np.empty(d, dtype=np.float32)
    t0, t1 = claim_items(counter, per, n)
    while t0 < t1:
        for t in range(t0, t1):
            c = counts[t]
            if f16_values:
                _transpose(keys, rows[t], c, 16 * -(-c // 16), kt)
            for h in range(n_head):
                if f16_values:
                    for i in range(d):
                        qh[0, i] = round_f16(q[t, h, i])
                    _f16_dots(kt, c, qh, lanes, scores)
                sums[:] = 0.0
                total, top = np.float32(0.0), np.float32(-np.inf)
                for j in range(c):
                    dot = scores[0, j] if f16_values else given[t, h, rows[t, j]]
                    total, top = _key_step(np.float32(dot * sc), keys[rows[t, j]], sums, total, top, f16_values)
                if sinks.size:
                    total = _sink_generic(sums, total, top, sinks[h])
                inv = np.float32(0.0) if total == 0 else np.float32(np.float32(1.0) / total)
                for i in range(d):
                    out[t, h, i] = sums[i] * inv
        t0, t1 = claim_items(counter, per, n)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _sink_store(sums: np.ndarray, total: np.float32, top: np.float32, sinks: np.ndarray, sink: int,
                out: np.ndarray) -> None:
    """ik's own kernel's last step for one row: the sink (sinks[sink]; none where sinks is empty) and R x (1 / S)."""
    if sinks.size:
        if sinks[sink] > top:
            m = np.exp(np.float32(top - sinks[sink]))
            for i in range(sums.shape[0]):
                sums[i] = m * sums[i]
            total = fmaf(total, m, np.float32(1.0))
        else:
            total = total + np.exp(np.float32(sinks[sink] - top))
    inv = np.float32(np.float32(1.0) / total) if total > 0 else np.float32(0.0)
    for i in range(sums.shape[0]):
        out[i] = inv * sums[i]


@njit(cache=True, nogil=True, error_model="numpy")
def _gathered_query(t: int, q: np.ndarray, keys: np.ndarray, rows: np.ndarray, counts: np.ndarray, steps: np.ndarray,
                    sinks: np.ndarray, sink_of: np.ndarray, sc: np.float32, lanes: int, out: np.ndarray,
                    given: np.ndarray, grouped: int, kt: np.ndarray, v: np.ndarray, s: np.ndarray, p: np.ndarray,
                    acc: np.ndarray, sums: np.ndarray, totals: np.ndarray, tops: np.ndarray) -> None:
    """_gathered's task: query t through the thread's buffers. A function of its own rather than inlined in the
    parallel loop, whose body Numba types and compiles twice (61.5 -> 34.3 s to compile on a 2-core Zen 3)."""
    n_head = q.shape[1]
    c, k_step = counts[t], steps[t]
    if given.size == 0:  # the float dots read the keys transposed
        _transpose(keys, rows[t], c, 32 * -(-c // 32), kt)
    for j in range(c):
        v[j] = keys[rows[t, j]]
    for h0 in range(0, grouped, ROWS):
        sums[:, :] = 0.0
        totals[:] = 0.0
        tops[:] = -np.inf
        for b0 in range(0, c, k_step):
            n_in = min(k_step, c - b0)
            spanned = n_in // 16 * 16
            scores_rows(kt, q[t, h0:h0 + ROWS], b0, spanned, sc, s, lanes)
            for r in range(ROWS):
                _scores_range(q[t, h0 + r:h0 + r + 1], kt, b0, spanned, n_in, acc, lanes, sc,
                              s[r:r + 1])
                totals[r], tops[r] = _softmax_step(s[r, :k_step], n_in, p[r, :k_step], sums[r],
                                                   totals[r], tops[r], lanes)
            _accumulate_all(v, b0, n_in, p, sums)
        for r in range(ROWS):
            _sink_store(sums[r], totals[r], tops[r], sinks, sink_of[h0 + r], out[t, h0 + r])
    for h in range(grouped, n_head):
        sums[0, :] = 0.0
        total, top = np.float32(0.0), np.float32(-np.inf)
        for b0 in range(0, c, k_step):
            n_in = min(k_step, c - b0)
            if given.size:
                for l in range(n_in):
                    s[0, l] = given[t, h, rows[t, b0 + l]] * sc
            else:
                _scores_range(q[t, h:h + 1], kt, b0, 0, n_in, acc, lanes, sc, s)
            total, top = _softmax_step(s[0, :k_step], n_in, p[0, :k_step], sums[0], total, top, lanes)
            _accumulate(v, b0, 0, n_in, p, sums)
        _sink_store(sums[0], total, top, sinks, sink_of[h], out[t, h])


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _gathered(q: np.ndarray, keys: np.ndarray, rows: np.ndarray, counts: np.ndarray, steps: np.ndarray,
              sinks: np.ndarray, sink_of: np.ndarray, sc: np.float32, lanes: int, out: np.ndarray,
              threads: int, given: np.ndarray) -> None:
    """Per query: its visible keys gathered once; its heads through them ROWS at a time (every head sees every
    gathered key: each key and value vector loaded once for all of them, as iqk_flash_attention._rows_together),
    the heads left over one at a time (all of them where the scores are `given`); each row's arithmetic the one
    ik's kernel does. The queries in tasks the threads claim, each thread with its own buffers."""
    n, n_head, d = q.shape
    grouped = n_head - n_head % ROWS if given.size == 0 else 0
    most, k_most = 32 * -(-counts.max() // 32), steps.max()
    per, counter = task_items(n, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        kt = np.empty((d, most if given.size == 0 else 0), dtype=np.float32)
        v = np.empty((most, d), dtype=np.float32)
        s = np.empty((ROWS, k_most), dtype=np.float32)
        p = np.empty((ROWS, k_most), dtype=np.float32)
        acc = np.empty((lanes // 4, k_most), dtype=np.float32)
        sums = np.empty((ROWS, d), dtype=np.float32)
        totals = np.empty(ROWS, dtype=np.float32)
        tops = np.empty(ROWS, dtype=np.float32)
        t0, t1 = claim_items(counter, per, n)
        while t0 < t1:
            for t in range(t0, t1):
                _gathered_query(t, q, keys, rows, counts, steps, sinks, sink_of, sc, lanes, out, given, grouped, kt, v,
                                s, p, acc, sums, totals, tops)
            t0, t1 = claim_items(counter, per, n)
