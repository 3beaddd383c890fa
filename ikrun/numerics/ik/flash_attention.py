"""ggml's generic CPU flash-attention kernel (ggml_compute_forward_flash_attn_ext_f16) with F16 keys, as
an AVX-512 build (16 float lanes: --numerics ik) or an AVX2 build (8 lanes: --numerics ik-avx2) computes it: what ik
runs at head sizes its own iqk kernels do not take, for MLA's prefill path (keys and values materialised through
attn_kv_b) and for grouped-query attention with flash attention on (-fa on, ik's default).

Per query row: the query rounded to f16; for each visible key in order, s = f16 dot product (four FMA accumulators
of the build's lanes over whole steps of 4 x lanes values, folded 0+2, 1+3, 0+1, then the lanes summed: AVX2 in
halves and two horizontal adds, (0+4 + 1+5) + (2+6 + 3+7); AVX-512 in halves down to four, (0+2) + (1+3); the
remaining values' products added in double), s * scale; an online softmax whose value sums stay in f16 (on a new
maximum the sums are scaled by expf(old - new) and rounded, else the key's weight is expf(s - max); then
sums = f16(fma(v, weight, sums))), the weight total S = S * ms + vs (two roundings: ik's build does not fuse it);
at the end the sums times 1 / S. A value cache of another type (a quantized one) has its rows decoded to float32
and the sums kept in float32: the same steps without the f16 roundings (ggml_vec_scale_f32, ggml_vec_mad_f32's
fused multiply-adds).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import fmaf, round_f16


@njit(cache=True, nogil=True, error_model="numpy")
def _dot_f16(x: np.ndarray, y: np.ndarray, lanes: int, acc: np.ndarray) -> np.float32:
    """ggml_vec_dot_f16 of a build with `lanes` float lanes (module docstring); acc: room for [4, lanes] floats."""
    n = x.shape[0]
    step = 4 * lanes
    n_steps = n - n % step
    acc[:, :] = 0.0
    for i in range(0, n_steps, step):
        for j in range(4):
            for lane in range(lanes):
                e = i + j * lanes + lane
                acc[j, lane] = fmaf(x[e], y[e], acc[j, lane])
    for lane in range(lanes):
        acc[0, lane] = acc[0, lane] + acc[2, lane]
        acc[1, lane] = acc[1, lane] + acc[3, lane]
    for lane in range(lanes):
        acc[0, lane] = acc[0, lane] + acc[1, lane]
    a = acc[0]
    if lanes == 16:
        for lane in range(8):
            a[lane] = a[lane] + a[8 + lane]
    t0, t1, t2, t3 = a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]
    folded = (t0 + t2) + (t1 + t3) if lanes == 16 else (t0 + t1) + (t2 + t3)
    total = np.float64(folded)
    for e in range(n_steps, n):
        total += np.float64(np.float32(x[e] * y[e]))
    return np.float32(total)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _key_step(score: np.float32, v: np.ndarray, sums: np.ndarray, total: np.float32, top: np.float32,
              f16_sums: bool) -> tuple[np.float32, np.float32]:
    """One key's scaled score folded into the value sums `sums` (f16 ones, `f16_sums`, else float32), the weight
    total and the maximum (module docstring); `v` the key's values; returns the new (total, top)."""
    ms = np.float32(1.0)
    vs = np.float32(1.0)
    if score > top:
        old = top
        top = score
        ms = np.exp(np.float32(old - top))
        for d in range(sums.shape[0]):
            scaled = np.float32(sums[d] * ms)
            sums[d] = round_f16(scaled) if f16_sums else scaled
    else:
        vs = np.exp(np.float32(score - top))
    for d in range(sums.shape[0]):
        added = fmaf(v[d], vs, sums[d])
        sums[d] = round_f16(added) if f16_sums else added
    return np.float32(total * ms) + vs, top


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _store(sums: np.ndarray, total: np.float32, out: np.ndarray) -> None:
    inv = np.float32(0.0) if total == 0 else np.float32(np.float32(1.0) / total)
    for d in range(sums.shape[0]):
        out[d] = sums[d] * inv


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def generic_flash_attention(q: np.ndarray, k: np.ndarray, scores: np.ndarray, v: np.ndarray, scale: float, first: int,
                            out: np.ndarray, lanes: int, f16_values: bool) -> None:
    """Causal attention of q [H, n, Dk] (float32) against k [H_kv, n_keys, Dk] and v [H_kv, n_keys, Dv] (f16 values
    held in float32, or with `f16_values` False a value cache of another type, decoded; query head h reads key/value
    head h // (H / H_kv), ggml's broadcast), query t at position first + t
    seeing keys 0..first + t; out [H, n, Dv]. `scores` [H, n, n_keys]: the products q . k ik's integer kernel computed
    one query row and one key at a time over a quantized key cache (key_cache.single_row_key_products), or empty
    (iqk_flash_attention.NO_SCORES): the f16 dot over F16 keys, in the order of a build with `lanes` float lanes (8
    or 16)."""
    n_head, n = out.shape[0], out.shape[1]
    dk = q.shape[2]
    group = n_head // v.shape[0]
    given = scores.size > 0
    sc = np.float32(scale)
    for job in prange(n_head * n):
        h, t = job // n, job % n
        g = h // group
        qh = np.empty(0 if given else dk, dtype=np.float32)
        acc = np.empty((4, lanes), dtype=np.float32)
        for d in range(qh.size):
            qh[d] = round_f16(q[h, t, d])
        sums = np.zeros(v.shape[2], dtype=np.float32)
        total = np.float32(0.0)
        top = np.float32(-np.inf)
        for s in range(first + t + 1):
            score = scores[h, t, s] if given else _dot_f16(k[g, s], qh, lanes, acc)
            total, top = _key_step(np.float32(score * sc), v[g, s], sums, total, top, f16_values)
        _store(sums, total, out[h, t])
