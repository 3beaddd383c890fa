"""ik's own CPU flash-attention kernel (ggml/src/iqk/fa) with F16 keys and values, as its AVX-512 build computes it
(16 float lanes: what --numerics ik runs) or its AVX2 build (8 lanes: --numerics ik-avx2): what ik runs at the head
sizes in arithmetic.IQK_FA_HEADS for MLA's prefill path (keys and values materialised through attn_kv_b) and for
grouped-query attention with flash attention on (-fa on, ik's default; each query head reads its group's key/value
head); ggml's generic kernel (flash_attention.py) takes the others.

Per query row, the keys in blocks of `k_step` (k_step_for): q (float32, not rounded) dot k (f16) in lanes / 4 fused
accumulators, accumulator c taking the elements whose index mod lanes is 4c .. 4c + 3 (its float GEMM's 4-row
tiles), summed at the end as (0 + 1) (AVX2) or (0 + 1) + (2 + 3) (AVX-512); s = dot * scale, masked keys -inf. Per
block: the block's maximum; on a new maximum the running sum S and the value sums R are scaled by expf(old - new)
(libm), before any: S = R = 0; the weights p = ik's vector exponential of s - max (each build's own: the AVX2 one
builds 2^n in the exponent bits around a polynomial without its constant term, the AVX-512 one scales the whole
polynomial by 2^n with vscalefps), S += their sum in vectors of the build's lanes (vector 0 + 1, then each next one
added, then the lanes folded in halves: AVX2 i + (i+4), then (0+2) + (1+3); AVX-512 i + (i+8), i + (i+4), then
(0+2) + (1+3)), and R = fma(v, p, R) key after key, in float32. At the end R * (1 / S).

Over a quantized key cache ik's kernel takes the scores from an integer kernel instead of the float dot (Q8_0: from 8
query rows on the cache repacked to Q8_0_R8, the queries rounded to Q8_2_X4, key_cache.key_products; Q4_0, Q6_0,
IQ4_NL: the type's own kernel on the cache as stored, key_cache.iqk_fa_key_products), then the same softmax and F16
values (iqk_flash_attention's `scores`).

Each row's arithmetic depends on neither the rows ik tiles with it nor its thread count: for a batch of tokens
(rows of one head per call) ik's threads split heads and rows, never keys. Keys beyond the last visible one (ik's
cache is padded to 256 with flash attention) weigh exactly 0 and are skipped.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import f32_bits, f32_from_bits, fmaf

#: float lanes of ik's AVX2 and AVX-512 builds
AVX2_LANES, AVX512_LANES = 8, 16
#: the `scores` of a flash attention over F16 keys: none, the kernel takes the float dot
NO_SCORES = np.zeros((0, 0, 0), np.float32)
#: head sizes whose kernel ik instantiates with 32-key blocks whatever the cache length (iqk_fa_320_256 / 576_512)
SHORT_BLOCK_HEADS = ((320, 256), (576, 512))

# ik's AVX2 exponential (iqk_utils.h v_expf): n = round(x log2 e) by the 1.5 x 2^23 trick, the reduced argument in
# two fused steps, a degree-5 polynomial without its constant term, scaled by 2^n built in the exponent bits
_LOG2E, _SHIFT = np.float32(float.fromhex("0x1.715476p+0")), np.float32(float.fromhex("0x1.8p23"))
_LN2_HI, _LN2_LO = np.float32(float.fromhex("0x1.62e4p-1")), np.float32(float.fromhex("0x1.7f7d1cp-20"))
_P5, _P4 = np.float32(float.fromhex("0x1.0e4020p-7")), np.float32(float.fromhex("0x1.573e2ep-5"))
_P3, _P2 = np.float32(float.fromhex("0x1.555e66p-3")), np.float32(float.fromhex("0x1.fffdb6p-2"))
_P1 = np.float32(float.fromhex("0x1.ffffecp-1"))
_ONE_BITS = np.uint32(0x3F800000)


def k_step_for(head_k: int, head_v: int, n_kv: int) -> int:
    """The keys per block ik's kernel for these head sizes takes on a cache of `n_kv` keys (a multiple of 32)."""
    if (head_k, head_v) in SHORT_BLOCK_HEADS:
        return 32
    return 128 if n_kv % 128 == 0 else 64 if n_kv % 64 == 0 else 32


def kernel_query_rows(n: int, n_head: int, threads: int, n_cells: int) -> set[int]:
    """The query-row counts ik's own kernel hands one K x Q call for a batch of `n` > 1 tokens over `n_head` query
    heads among `threads`, the cache `n_cells` long: its threads split heads, then rows (iqk_flash_attn_noalibi);
    each call takes its rows in steps (iqk_flash_helper: 64 / 32 / 16 from 512 cells on, 12 when exactly 12, then
    8, else 4, else 2, the rest one at a time), a step's rows in calls of 8 (kMaxQ) and the rest."""
    ntg = threads // math.gcd(n_head, threads)
    per = -(-n // ntg)
    counts: set[int] = set()

    def steps(q_step: int, rows: int) -> None:
        for part in (q_step,) * (rows // q_step) + ((rows % q_step,) if rows % q_step else ()):
            counts.update((8,) * (part // 8) + ((part % 8,) if part % 8 else ()))

    for first in range(0, n, per):
        left = min(per, n - first)
        if n_cells >= 512:
            for size, q_step in ((128, 64), (64, 64), (32, 32), (16, 16)):
                if left >= size:
                    steps(q_step, size * (left // size))
                    left -= size * (left // size)
        if left == 12:
            steps(12, 12)
            continue
        for size in (8, 4, 2):
            if left >= size:
                steps(size, size * (left // size))
                left -= size * (left // size)
                break
        if left:
            steps(1, left)
    return counts


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def avx2_expf(x: np.float32) -> np.float32:
    """exp(x) as ik's AVX2 vector kernels compute it (within a few ulp of expf, not the same bits); 0 for -inf."""
    z = fmaf(x, _LOG2E, _SHIFT)
    n = z - _SHIFT
    b = fmaf(-n, _LN2_LO, fmaf(-n, _LN2_HI, x))
    e = np.uint32(f32_bits(z) << np.uint32(23))
    k = f32_from_bits(np.uint32(e + _ONE_BITS))
    u = b * b
    j = fmaf(fmaf(fmaf(_P5, b, _P4), u, fmaf(_P3, b, _P2)), u, _P1 * b)
    if not abs(n) > np.float32(126.0):
        return fmaf(k, j, k)
    g = np.uint32(0x82000000) if n <= np.float32(0.0) else np.uint32(0)
    s1 = f32_from_bits(np.uint32(g + np.uint32(0x7F000000)))
    if abs(n) > np.float32(192.0):
        return s1 * s1
    s2 = f32_from_bits(np.uint32(e - g))
    return fmaf(s2, j, s2) * s1


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def avx512_expf(x: np.float32) -> np.float32:
    """exp(x) as ik's AVX-512 vector kernels compute it: the AVX2 kernel's reduction, the polynomial with its
    constant term, scaled by 2^n in one rounding (vscalefps; a float64 product rounded once gives the same bits,
    subnormal results included); 0 for n < -192 (-inf included), inf for n > 192."""
    z = fmaf(x, _LOG2E, _SHIFT)
    n = z - _SHIFT
    if abs(n) > np.float32(192.0):
        return np.float32(0.0) if n <= np.float32(0.0) else np.float32(np.inf)
    b = fmaf(-n, _LN2_LO, fmaf(-n, _LN2_HI, x))
    u = b * b
    j = fmaf(fmaf(fmaf(_P5, b, _P4), u, fmaf(_P3, b, _P2)), u, fmaf(_P1, b, np.float32(1.0)))
    return np.float32(np.float64(j) * np.ldexp(1.0, int(n)))


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _block_scores(q: np.ndarray, kt: np.ndarray, b0: int, n_in: int, acc: np.ndarray, lanes: int,
                  sc: np.float32, s: np.ndarray) -> None:
    """s[l] = (q . key b0 + l) x sc for the block's n_in keys, each dot in ik's float GEMM order (module docstring;
    acc: lanes / 4 rows of room for the accumulators). The keys are the vector lanes (kt [Dk, keys]: keys
    transposed), so the chains of one key's dot, which wait on each other, run side by side with other keys'."""
    chains = lanes // 4
    acc[:chains, :n_in] = 0.0
    for i in range(0, q.shape[0], lanes):
        for c in range(chains):
            row = acc[c]
            for e in range(4):
                qe, ke = q[i + 4 * c + e], kt[i + 4 * c + e, b0:b0 + n_in]
                for l in range(n_in):
                    row[l] = fmaf(ke[l], qe, row[l])
    if chains == 2:
        for l in range(n_in):
            s[l] = (acc[0, l] + acc[1, l]) * sc
    else:
        for l in range(n_in):
            s[l] = ((acc[0, l] + acc[1, l]) + (acc[2, l] + acc[3, l])) * sc


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _block_sum(p: np.ndarray, lanes: int) -> np.float32:
    """The weights of one block summed as ik's reduction of `lanes`-wide vectors adds them (module docstring)."""
    acc = np.empty(lanes, dtype=np.float32)
    for lane in range(lanes):
        acc[lane] = p[lane] + p[lanes + lane]
    for c in range(2, p.shape[0] // lanes):
        for lane in range(lanes):
            acc[lane] = acc[lane] + p[c * lanes + lane]
    if lanes == 16:
        for lane in range(8):
            acc[lane] = acc[lane] + acc[8 + lane]
    a0, a1, a2, a3 = acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]
    return (a0 + a2) + (a1 + a3)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _block_step(s: np.ndarray, n_in: int, p: np.ndarray, v: np.ndarray, g: int, b0: int, sums: np.ndarray,
                total: np.float32, top: np.float32, lanes: int) -> tuple[np.float32, np.float32]:
    """One block of `n_in` scaled scores `s` folded into the running sum `total`, maximum `top` and value sums
    (module docstring); returns the new (total, top)."""
    block_top = np.float32(-np.inf)
    for l in range(n_in):
        block_top = max(block_top, s[l])
    if block_top > top:
        if top > -np.inf:
            m = np.exp(np.float32(top - block_top))
            total = total * m
            for d in range(sums.shape[0]):
                sums[d] = sums[d] * m
        else:
            total = np.float32(0.0)
            sums[:] = 0.0
        top = block_top
    for l in range(p.shape[0]):
        if l >= n_in:
            p[l] = np.float32(0.0)
        elif lanes == 16:
            p[l] = avx512_expf(np.float32(s[l] - top))
        else:
            p[l] = avx2_expf(np.float32(s[l] - top))
    total = total + _block_sum(p, lanes)
    for l in range(n_in):
        for d in range(sums.shape[0]):
            sums[d] = fmaf(v[g, b0 + l, d], p[l], sums[d])
    return total, top


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _store(sums: np.ndarray, total: np.float32, out: np.ndarray) -> None:
    inv = np.float32(np.float32(1.0) / total) if total > 0 else np.float32(0.0)
    for d in range(sums.shape[0]):
        out[d] = inv * sums[d]


def iqk_flash_attention(q: np.ndarray, k: np.ndarray, scores: np.ndarray, v: np.ndarray, scale: float, first: int,
                        k_step: int, out: np.ndarray, lanes: int) -> None:
    """Causal attention of q [H, n, Dk] (float32) against k [H_kv, n_keys, Dk] and v [H_kv, n_keys, Dv] (f16 values
    held in float32; query head h reads key/value head h // (H / H_kv), ggml's broadcast), query t at position first + t
    seeing keys 0..first + t, in blocks of k_step keys; out [H, n, Dv], in the float order of ik's build with
    `lanes` float lanes (AVX512_LANES or AVX2_LANES). `scores` [H, n, n_keys]: the products q . k ik's integer
    kernel computed over a quantized key cache (key_cache.key_products), or empty (NO_SCORES): the float dot over
    F16 keys."""
    if lanes not in (AVX2_LANES, AVX512_LANES):
        raise ValueError(f"ik's flash attention runs in {AVX2_LANES} or {AVX512_LANES} float lanes, not {lanes}")
    kt = np.ascontiguousarray(k.transpose(0, 2, 1), dtype=np.float32) if scores.size == 0 else NO_SCORES
    _attention(q, kt, scores, v, np.float32(scale), first, k_step, lanes, out)


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _attention(q: np.ndarray, kt: np.ndarray, scores: np.ndarray, v: np.ndarray, sc: np.float32, first: int,
               k_step: int, lanes: int, out: np.ndarray) -> None:
    """iqk_flash_attention with the keys transposed (kt [H_kv, Dk, n_keys]; unused where `scores` are given)."""
    n_head, n = out.shape[0], out.shape[1]
    group = n_head // v.shape[0]
    given = scores.size > 0
    for job in prange(n_head * n):
        h, t = job // n, job % n
        g = h // group
        visible = first + t + 1
        s = np.empty(k_step, dtype=np.float32)
        p = np.empty(k_step, dtype=np.float32)
        acc = np.empty((lanes // 4, k_step), dtype=np.float32)
        sums = np.zeros(v.shape[2], dtype=np.float32)
        total = np.float32(0.0)
        top = np.float32(-np.inf)
        for b0 in range(0, visible, k_step):
            n_in = min(k_step, visible - b0)
            if given:
                for l in range(n_in):
                    s[l] = scores[h, t, b0 + l] * sc
            else:
                _block_scores(q[h, t], kt[g], b0, n_in, acc, lanes, sc, s)
            total, top = _block_step(s, n_in, p, v, g, b0, sums, total, top, lanes)
        _store(sums, total, out[h, t])
