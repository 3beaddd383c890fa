"""ik's attention arithmetic (--numerics ik): causal grouped attention, DeepSeek's absorbed latent attention and
openPangu's latent attention with param sinks, as ik's CPU backend computes them without flash attention.

ik multiplies f32 queries with its f16 keys in a float kernel of 16 lanes: lane l sums the products of dims l,
l + 16, ... (the first a product, the rest fused multiply-adds), then the 16 lanes are added as a tree (8 + 8,
4 + 4, then (0 + 2) + (1 + 3)). The softmax scales, takes the row maximum, exponentiates with ik's own exp
(ops/activations.ik_expf), sums the exponentials in 16 lanes by key (the same tree, then float64) and multiplies by
float32(1 / sum). The values multiply the float32 probabilities the same way, lanes by key. gpt-oss's per-head
sink logits join the maximum and, through expf, the float64 sum after the lanes (ggml's soft_max with sinks); its
sliding window masks the keys before it (-inf, as ik's mask cells).

ik's AVX2 build (`lanes` = 8, `avx2`, --numerics ik-avx2) multiplies in 8 lanes (ikgemm.py), exponentiates with its
AVX2 exponential (ik_expf_avx2), and its softmax adds each 8 exponentials' sum (4 + 4, then (0 + 2) + (1 + 3)) to
the float64 sum in turn.
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange

from ikquant.formats.numeric import fmaf
from ikrun.numerics.ik.ikgemm import AVX2_LANES, DOTS, LANES, XROWS, dots, ik_dot_grid
from ikrun.ops.activations import ik_exp
from ikrun.ops.parallel import claim_items, task_items


@njit(cache=True, nogil=True, inline="always")
def _lane_sum(lanes: np.ndarray) -> np.float32:
    """16 (or 8) float32 lanes added as ik's reduction adds them: 8 + 8, 4 + 4, then (0 + 2) + (1 + 3)."""
    t = np.empty(4, np.float32)
    if lanes.shape[0] == AVX2_LANES:
        for j in range(4):
            t[j] = lanes[j + 4] + lanes[j]
    else:
        for j in range(4):
            t[j] = (lanes[j + 12] + lanes[j + 4]) + (lanes[j + 8] + lanes[j])
    return (t[0] + t[2]) + (t[1] + t[3])


@njit(cache=True, nogil=True, inline="always")
def _exp_sum(r: np.ndarray, whole: int, avx2: bool) -> np.float64:
    """The float64 sum of the exponentials r[:whole] (a whole number of vectors) as ik's softmax adds them: in 16
    lanes reduced by its tree, or (`avx2`) each 8's tree sum added in turn."""
    total = np.float64(0.0)
    if avx2:
        for c in range(0, whole, AVX2_LANES):
            total += np.float64(_lane_sum(r[c : c + AVX2_LANES]))
        return total
    lanes = np.zeros(LANES, np.float32)
    for c in range(0, whole, LANES):
        for lane in range(LANES):
            lanes[lane] += r[c + lane]
    return total + np.float64(_lane_sum(lanes))


@njit(cache=True, nogil=True, inline="always")
def _ik_softmax(r: np.ndarray, first: int, n_keys: int, scale: np.float32, sink: np.float32,
                keep: np.ndarray, avx2: bool) -> None:
    """ik's softmax of the scores r[first:n_keys] in place (the module docstring), zeros before and after them (r's
    length a multiple of 16), and of the keys `keep` marks among them when it is not empty (GLM's DSA: ik adds
    -1e30 to the others' scaled scores, whose exponentials are then 0 as for -inf). Each pass is a loop LLVM
    vectorises (on a view from 0: an offset start keeps it scalar): the maximum and the sum in 16 lanes (the
    maximum's order changes nothing; the sum's is ik's), or with `avx2` as ik's AVX2 build sums (the module
    docstring). A sink logit (-inf: none) joins the maximum, and its expf joins the float64 sum after the lanes
    (ggml's soft_max with sinks)."""
    step = AVX2_LANES if avx2 else LANES
    whole = n_keys + (-n_keys % step)
    for j in range(n_keys):
        r[j] *= scale
    if keep.shape[0]:
        for j in range(n_keys):
            if not keep[j]:
                r[j] = -np.inf
    for j in range(first):
        r[j] = -np.inf  # a sliding window's masked keys
    for j in range(n_keys, whole):
        r[j] = -np.inf  # ik_expf(-inf) is 0
    lanes = np.full(LANES, -np.inf, np.float32)
    for c in range(0, whole, step):
        for lane in range(step):
            lanes[lane] = max(lanes[lane], r[c + lane])
    m = max(lanes.max(), sink)
    for j in range(whole):
        r[j] = ik_exp(r[j] - m, avx2)
    total = _exp_sum(r, whole, avx2)
    if sink > -np.inf:
        total += np.float64(np.exp(np.float32(sink - m)))
    inv = np.float32(1.0 / total)
    for j in range(n_keys):
        r[j] *= inv
    for j in range(whole, r.shape[0]):
        r[j] = np.float32(0.0)


@njit(cache=True, nogil=True, inline="always")
def _round_bf16(bits: np.ndarray, start: int, stop: int) -> None:
    """The floats whose bits are bits[start:stop] rounded to bf16 in place, to nearest, ties to even (the
    conversion of the activations of ik's bf16 matmul)."""
    for j in range(start, stop):
        u = bits[j]
        bits[j] = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)


@njit(cache=True, nogil=True)
def _ik_attention_task(task: int, q: np.ndarray, k: np.ndarray, vt: np.ndarray, sc: np.float32, past: int,
                       window: int, sinks: np.ndarray, keep: np.ndarray, scores: np.ndarray, out: np.ndarray,
                       avx2: bool, bf16_values: bool, p: np.ndarray, bits: np.ndarray, tail: np.ndarray,
                       keep_all: np.ndarray, lanes: int) -> None:
    """_ik_attention's task: XROWS queries of one head through the thread's buffers. A function of its own rather
    than inlined in the parallel loop, whose body Numba types and compiles twice."""
    n_head, n, d = q.shape
    n_kv, padded, dv = k.shape[0], k.shape[1], vt.shape[1]
    group, n_groups = n_head // n_kv, (n + XROWS - 1) // XROWS
    qf, kf, vf, of = q.reshape(-1), k.reshape(-1), vt.reshape(-1), out.reshape(-1)
    h, i0 = task // n_groups, task % n_groups * XROWS
    rows = min(XROWS, n - i0)
    g = h // group
    k0, v0 = g * padded * d, g * dv * padded
    last = past + i0 + rows  # keys the group's last query sees
    width = last + (-last % (32 if bf16_values else lanes))
    q0 = (h * n + i0) * d
    if scores.shape[0]:
        for a in range(rows):
            p[a * padded : a * padded + last] = scores[h, i0 + a, :last]
    elif rows == XROWS:
        for j in range(0, last + (-last % DOTS), DOTS):
            ik_dot_grid(qf, q0, d, kf, k0 + j * d, d, d, p, j, padded, False, lanes)
    else:
        for a in range(rows):
            dots(qf, q0 + a * d, kf, k0, d, d, last, p, a * padded, tail, False, lanes)
    sink = sinks[h] if sinks.shape[0] else np.float32(-np.inf)
    for a in range(rows):
        seen = past + i0 + a + 1
        first = max(0, seen - window) if window > 0 else 0
        row = keep[i0 + a] if keep.shape[0] else keep_all
        _ik_softmax(p[a * padded : a * padded + width], first, seen, sc, sink, row, avx2)
        if bf16_values:
            _round_bf16(bits, a * padded, a * padded + width)
    o0 = (h * n + i0) * dv
    full = dv - dv % DOTS if rows == XROWS else 0
    for c in range(0, full, DOTS):
        ik_dot_grid(p, 0, padded, vf, v0 + c * padded, padded, width, of, o0 + c, dv, bf16_values, lanes)
    for a in range(rows):
        dots(p, a * padded, vf, v0 + full * padded, padded, width, dv - full, of, o0 + a * dv + full,
             tail, bf16_values, lanes)


@njit(cache=True, nogil=True, parallel=True)
def _ik_attention(q: np.ndarray, k: np.ndarray, vt: np.ndarray, scale: float, past: int, window: int,
                  sinks: np.ndarray, keep: np.ndarray, scores: np.ndarray, out: np.ndarray, avx2: bool,
                  threads: int, bf16_values: bool = False) -> None:
    """q [H, n, d], k [Hkv, keys padded, d], vt [Hkv, dv, keys padded], out [H, n, dv] (all C-contiguous; the
    padding, to a multiple of 16 keys, zeros); a query sees its last `window` keys (0: all) and those `keep`
    [n, keys] marks (no rows: all), `sinks` one logit per head (empty: none); `scores` [H, n, keys padded] the
    q . k products where another kernel made them (ik's integer K x Q of a quantized K cache; no heads: computed
    here from q and k); `avx2`: ik's AVX2 build's arithmetic; `bf16_values`: vt holds a bf16 V cache's values,
    which ik multiplies by the probabilities rounded to bf16 in its bf16 kernel (keys padded to 32).

    XROWS queries of a head at a time: their scores against DOTS keys, and their weighted values of DOTS dims, per
    kernel call (each key and value vector loaded once for all of them). The scores a query may not see are
    computed with the others' and then dropped, and its probabilities are zero past its last key, so each dot
    product sums exactly what a query alone would (a product of zero adds nothing). The (head, query group) pairs go
    in tasks the `threads` threads claim (ikrun/ops/parallel.py)."""
    n_head, n = q.shape[0], q.shape[1]
    padded = k.shape[1]
    n_groups = (n + XROWS - 1) // XROWS
    sc = np.float32(scale)
    items = n_head * n_groups
    per, counter = task_items(items, threads), np.zeros(1, np.int64)
    keep_all = np.empty(0, np.bool_)
    lanes = AVX2_LANES if avx2 else LANES
    for _ in prange(threads):
        p = np.empty(XROWS * padded, np.float32)
        bits = p.view(np.uint32)
        tail = np.empty(DOTS, np.float32)
        t0, t1 = claim_items(counter, per, items)
        while t0 < t1:
            for task in range(t0, t1):
                _ik_attention_task(task, q, k, vt, sc, past, window, sinks, keep, scores, out, avx2, bf16_values, p,
                                   bits, tail, keep_all, lanes)
            t0, t1 = claim_items(counter, per, items)


def ik_causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, window: int = 0,
                        sinks: np.ndarray | None = None, avx2: bool = False,
                        scores: np.ndarray | None = None, bf16_values: bool = False) -> np.ndarray:
    """causal_attention in ik's arithmetic (the module docstring; `avx2`: its AVX2 build's); head dims a multiple of
    its lanes; a sliding `window` (keys seen, the own included; ik's masked cells) and per-head `sinks` logits
    (ggml's soft_max with sinks); `scores` [H, n, keys]: the products q . k as ik's integer kernel of a quantized K
    cache made them (then k gives its shape alone); `bf16_values`: v as a bf16 V cache holds it, multiplied in ik's
    bf16 kernel (AVX-512)."""
    n, n_head, d = q.shape
    lanes = AVX2_LANES if avx2 else LANES
    if d % lanes:
        raise ValueError(f"ik's attention arithmetic takes head dims in multiples of {lanes}, not {d}")
    n_keys = k.shape[0]
    padded = n_keys + (-n_keys % (32 if bf16_values else LANES))
    qh = np.ascontiguousarray(q.transpose(1, 0, 2), dtype=np.float32)
    kh = np.zeros((k.shape[1], padded, d), np.float32)
    kh[:, :n_keys] = k.transpose(1, 0, 2)
    vt = np.zeros((k.shape[1], v.shape[2], padded), np.float32)
    vt[:, :, :n_keys] = v.transpose(1, 2, 0)
    out = np.empty((n_head, n, v.shape[2]), np.float32)
    sink = np.empty(0, np.float32) if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
    products = np.zeros((0, 0, 0), np.float32)
    if scores is not None:
        products = np.zeros((n_head, n, padded), np.float32)
        products[:, :, :n_keys] = scores
    _ik_attention(qh, kh, vt, float(scale), n_keys - n, window, sink, np.empty((0, 0), np.bool_), products, out,
                  avx2, get_num_threads(), bf16_values)
    return out.transpose(1, 0, 2)


def ik_latent_attention(q: np.ndarray, cache: np.ndarray, n_rope: int, scale: float,
                        keep: np.ndarray | None = None, avx2: bool = False, scores: np.ndarray | None = None,
                        bf16_values: bool = False) -> np.ndarray:
    """DeepSeek's absorbed attention (ops/mla.py) in ik's arithmetic: queries q [H, n, R + C] ([q_rope | q_lat])
    against the cache rows [p + n, R + C] ([k_rope | c_kv], as the f16 cache holds them; p rows of a continued
    sequence's earlier positions first), the latents c_kv as values: [H, n, C]; dims a multiple of the lanes (16, or
    8 with `avx2`). `keep` [n, p + n]: the causal keys each query may see (GLM's DSA top-k, ik's sparse mask).
    `scores` [H, n, p + n] and `bf16_values`: as ik_causal_attention's (a BF16 latent cache, -ctv bf16 in ik's -fa
    off graph: its bf16 kernel's q . k given, the latents summed in that kernel)."""
    n_head, n, d = q.shape
    lanes = AVX2_LANES if avx2 else LANES
    if d % lanes:
        raise ValueError(f"ik's attention arithmetic takes head dims in multiples of {lanes}, not {d}")
    n_keys = len(cache)
    padded = n_keys + (-n_keys % (32 if bf16_values else LANES))
    products = np.zeros((0, 0, 0), np.float32)
    if scores is not None:
        products = np.zeros((n_head, n, padded), np.float32)
        products[:, :, :n_keys] = scores
    keys = np.zeros((1, padded, d), np.float32)
    keys[0, :n_keys] = cache
    vt = np.zeros((1, d - n_rope, padded), np.float32)
    vt[0, :, :n_keys] = cache[:, n_rope:].T
    out = np.empty((n_head, n, d - n_rope), np.float32)
    mask = np.empty((0, 0), np.bool_) if keep is None else np.ascontiguousarray(keep, dtype=np.bool_)
    _ik_attention(np.ascontiguousarray(q, dtype=np.float32), keys, vt, float(scale), n_keys - n, 0,
                  np.empty(0, np.float32), mask, products, out, avx2, get_num_threads(), bf16_values)
    return out


@njit(cache=True, nogil=True, inline="always")
def _ik_masked_softmax(r: np.ndarray, visible: np.ndarray, n_sink: int, scale: np.float32, avx2: bool) -> None:
    """ggml's soft_max_ext over a row of r (sinks first, always visible, then one score per cache cell, visible
    where `visible` says): scaled, -inf where masked, the maximum, then ik's exponential in 16 lanes and their
    sum reduced as ik's tree (`avx2`: its AVX2 exponential in 8 lanes, each 8's sum added to the float64 sum),
    the cells past the last whole vector with expf summed after it in float64, times float32(1 / sum)."""
    width = r.shape[0]
    m = -np.inf
    for j in range(width):
        v = r[j] * scale if j < n_sink or visible[j - n_sink] else -np.inf
        r[j] = v
        m = max(m, v)
    whole = width - width % (AVX2_LANES if avx2 else LANES)
    for j in range(whole):
        r[j] = ik_exp(r[j] - m, avx2)
    total = _exp_sum(r, whole, avx2)
    for j in range(whole, width):
        e = np.exp(np.float32(r[j] - m))
        r[j] = e
        total += np.float64(e)
    inv = np.float32(1.0 / total)
    for j in range(width):
        r[j] *= inv


@njit(cache=True, nogil=True, inline="always")
def _ik_sink_values(p: np.ndarray, s_lat: np.ndarray, c: int, n_sink: int, overread: bool,
                    lanes: int) -> np.float32:
    """Latent channel c of the sinks' weighted values as ik's f32 kernel of `lanes` lanes sums them: fused
    multiply-adds over the sink probabilities p[:n_sink] and the channel's row of the transposed sink latents
    (s_lat: [C x S] flat, 16 zeros after it). With fewer sinks than lanes its first step reads a whole vector of
    each anyway and its 4-float tail steps then add the row again (`overread`: ik's AVX-512 build; else the row
    alone)."""
    acc = np.zeros(lanes, np.float32)
    x0 = c * n_sink
    steps = n_sink // lanes
    iks = overread or n_sink >= lanes  # ik's kernel: a first step of a whole vector, then 4-float tail steps
    for lane in range(lanes if iks else n_sink):
        acc[lane] = p[lane] * s_lat[x0 + lane]
    for i in range(1, steps):
        for lane in range(lanes):
            acc[lane] = fmaf(p[i * lanes + lane], s_lat[x0 + i * lanes + lane], acc[lane])
    if iks:
        for i in range(steps * lanes // 4, n_sink // 4):
            for lane in range(4):
                acc[lane] = fmaf(p[4 * i + lane], s_lat[x0 + 4 * i + lane], acc[lane])
    return _lane_sum(acc)


@njit(cache=True, nogil=True, parallel=True)
def _ik_sink_attention(q: np.ndarray, cache: np.ndarray, vt: np.ndarray, sinks: np.ndarray, s_lat: np.ndarray,
                       visible: np.ndarray, scale: float, overread: bool, avx2: bool, out: np.ndarray) -> None:
    n_head, n, d = q.shape
    n_sink, n_cells, n_lat = sinks.shape[0], cache.shape[0], vt.shape[0]
    qf, kf, sf, vf, of = q.reshape(-1), cache.reshape(-1), sinks.reshape(-1), vt.reshape(-1), out.reshape(-1)
    lanes = AVX2_LANES if avx2 else LANES
    for task in prange(n_head * n):
        _ik_sink_task(qf, kf, sf, vf, s_lat, visible, scale, overread, avx2, of, np.int64(task), n, d, n_sink,
                      n_cells, n_lat, lanes)


@njit(cache=True, nogil=True)
def _ik_sink_task(qf: np.ndarray, kf: np.ndarray, sf: np.ndarray, vf: np.ndarray, s_lat: np.ndarray,
                  visible: np.ndarray, scale: float, overread: bool, avx2: bool, of: np.ndarray, task: int, n: int,
                  d: int, n_sink: int, n_cells: int, n_lat: int, lanes: int) -> None:
    """Query t of head h (task = h x n + t) of _ik_sink_attention (ikquant/formats/jit.py: why a task is a
    function of its own)."""
    h, t = task // n, task % n
    p = np.zeros(n_sink + n_cells + LANES, np.float32)
    tail = np.empty(DOTS, np.float32)
    q0 = (h * n + t) * d
    dots(qf, q0, sf, 0, d, d, n_sink, p, 0, tail, False, lanes)
    dots(qf, q0, kf, 0, d, d, n_cells, p, n_sink, tail, False, lanes)
    _ik_masked_softmax(p[: n_sink + n_cells], visible[t], n_sink, np.float32(scale), avx2)
    dots(p, n_sink, vf, 0, n_cells, n_cells, n_lat, of, (h * n + t) * n_lat, tail, False, lanes)
    for c in range(n_lat):
        of[(h * n + t) * n_lat + c] += _ik_sink_values(p, s_lat, c, n_sink, overread, lanes)


#: ik's KV cache grows in cells of this many tokens without flash attention: the rows its attention multiplies
KV_CELL_PAD = 32


def ik_sink_latent_attention(q: np.ndarray, cache: np.ndarray, sinks: np.ndarray, visible: np.ndarray,
                             n_lat: int, scale: float, overread: bool, avx2: bool = False) -> np.ndarray:
    """openPangu's latent attention as ik's CPU graph computes it (its unfused chain): queries q [H, n, C + R]
    ([q_lat | q_pe], ik's layout), the cache rows [n, C + R] ([c_kv | k_pe], f16 values) and the sinks [S, C + R]
    (f32), query t seeing cache row j where visible[t, j]. The scores of the sinks and of ik's whole cache (n
    rounded up to KV_CELL_PAD cells, the extra ones masked) in its 16-lane kernel, one softmax over [sinks | cells]
    (_ik_masked_softmax), the cells' latents weighted in the same kernel plus the sinks' (_ik_sink_values,
    `overread`: ik's AVX-512 over-read for fewer than 16 sinks, the floats past the last channel's row read as 0;
    `avx2`: ik's AVX2 build's kernels and softmax). Returns the latents [H, n, C]."""
    n_head, n, d = q.shape
    lanes = AVX2_LANES if avx2 else LANES
    if d % lanes:
        raise ValueError(f"ik's attention arithmetic takes head dims in multiples of {lanes}, not {d}")
    cells = n + (-n % KV_CELL_PAD)
    keys = np.zeros((cells, d), np.float32)
    keys[:n] = cache
    mask = np.zeros((n, cells), np.bool_)
    mask[:, :n] = visible
    vt = np.ascontiguousarray(keys[:, :n_lat].T)
    s_lat = np.zeros(n_lat * len(sinks) + LANES, np.float32)
    s_lat[: n_lat * len(sinks)] = np.ascontiguousarray(sinks[:, :n_lat].T).reshape(-1)
    out = np.empty((n_head, n, n_lat), np.float32)
    _ik_sink_attention(np.ascontiguousarray(q, dtype=np.float32), keys, vt, np.ascontiguousarray(sinks, np.float32),
                       s_lat, mask, float(scale), overread, avx2, out)
    return out
