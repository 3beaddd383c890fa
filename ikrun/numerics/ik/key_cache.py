"""ik's K x Q product over a quantized K cache without flash attention (-ctk q8_0, q4_0, ..., -fa off).

ik's graph multiplies the cache's view of a layer's keys (one matrix of its cells per KV head) with the queries in
its ordinary matmul: the K cache is the "weight". The queries are rounded to the K type's vec_dot_type (Q8_2_X4 on
AVX2 for every 32-value block type, the activations of such a weight), and each query head is one matmul of its own
against its group's keys (iqk_mul_mat_4d: the heads split over ik's threads, each head's keys over the threads left),
which takes the weights' kernel choice: with 32 query rows and more ik converts the cache rows to Q8_0_R8 (Q8_0,
Q4_0, Q5_0, Q6_0, IQ4_NL: their integers and scales kept) or Q8_1_R8 (Q4_1, Q5_1: their codes, scales and mins) and
multiplies integers (formats.py, qgemm.py); a Q8_KV cache takes its own kernel (q8_kv_key_products). The cache
holds what ik's ggml_cpy wrote (ikquant/formats/cache_rows.py), so the keys are written here as they are read: the
same rows, the same bytes. With -khad ik rotates both the keys
(before the write) and the queries by its Hadamard transform; the rotated queries are what is rounded.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from numba import njit, prange

from ikquant.formats.cache_rows import cache_row_bytes
from ikquant.formats.numeric import f16_bits_to_f32, f32_bits, fmaf, hsum_float_8
from ikquant.types import type_by_name
from ikrun.numerics.ik.attention import KV_CELL_PAD
from ikrun.numerics.ik.formats import Q8_2_X4, ToInts, integer_rows
from ikrun.numerics.ik.qgemm import ORDER_Q8_1, BlockInts, IntRows, pack, qmatmul


def key_cells(n_keys: int) -> int:
    """The rows of the K view ik multiplies for `n_keys` keys (its cache cells, padded: what its kernel choice
    sees)."""
    return n_keys + (-n_keys % KV_CELL_PAD)


def key_products(q: np.ndarray, k: np.ndarray, type_name: str, ints: ToInts, fmt: str) -> np.ndarray:
    """The scores q . k [H, n, keys] of queries q [n, H, d] against keys k [keys, H_kv, d] written into a K cache of
    GGML type `type_name`, multiplied as ik's kernel holds the cache rows (`ints`) against the queries rounded to
    activation format `fmt`. ik's Q8_1_R8 gemm (ORDER_Q8_1) has no loop for the blocks past a key head's last
    whole group of four: they add nothing."""
    n, n_head, d = q.shape
    held = _cache_ints(k, type_name, ints)
    block = held[0].block
    whole = d // (4 * block) * 4 * block
    if held[0].order == ORDER_Q8_1 and whole < d:
        if not whole:
            return np.zeros((n_head, n, len(k)), np.float32)
        q, held = q[..., :whole], [_first_values(rows, whole) for rows in held]
    packed = [pack(rows) for rows in held]
    group = n_head // len(packed)
    scores = np.empty((n_head, n, len(k)), np.float32)
    for h in range(n_head):
        scores[h] = qmatmul(integer_rows(q[:, h], fmt), packed[h // group])
    return scores


def _first_values(rows: BlockInts, n: int) -> BlockInts:
    """The first n values of each row (whole blocks), with their scales and offsets."""
    blocks = n // rows.block
    return replace(rows, q=np.ascontiguousarray(rows.q[:, :n]), scale=np.ascontiguousarray(rows.scale[:, :blocks]),
                   offset=None if rows.offset is None else np.ascontiguousarray(rows.offset[:, :blocks]))


def _cache_ints(k: np.ndarray, type_name: str, ints: ToInts) -> list[BlockInts]:
    """Per KV head, the integers ik's kernel holds for keys k [keys, H_kv, d] written into a K cache of GGML type
    `type_name` (the rows ik's ggml_cpy writes, then `ints` of them)."""
    n_keys, n_kv, d = k.shape
    codec = type_by_name(type_name).require_codec()
    held = []
    for g in range(n_kv):
        raw = cache_row_bytes(type_name, np.ascontiguousarray(k[:, g], dtype=np.float32))
        held.append(ints(raw, codec.dequantize(raw, d).reshape(n_keys, d)))
    return held


def _query_rows(q: np.ndarray) -> list[IntRows]:
    """Per query head, the queries q [n, H, d] rounded to Q8_2_X4 (the vec_dot_type of Q8_0 and Q4_0)."""
    return [integer_rows(q[:, h], Q8_2_X4) for h in range(q.shape[1])]


def _stacked_operands(q: np.ndarray, k: np.ndarray, type_name: str, ints: ToInts,
                      held: list[BlockInts] | None = None
                      ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]]:
    """What the per-score kernels take: the scores' array [H, n, keys] and their operands, the queries' Q8_2_X4
    bytes, scales and block sums per head, the cache rows' integers and scales per KV head (`held`, where the caller
    has them already), and the head group."""
    n, n_head, _ = q.shape
    held, rows = held or _cache_ints(k, type_name, ints), _query_rows(q)
    kq, kd = np.stack([x.q for x in held]), np.stack([x.scale for x in held])
    qu, qd = np.stack([r.u[:n] for r in rows]), np.stack([r.scale[:n] for r in rows])
    qsum = np.stack([r.isums[:n] for r in rows])
    return np.empty((n_head, n, len(k)), np.float32), (qu, qd, qsum, kq, kd, n_head // len(held))


#: the most 32-value blocks a head of ik's AVX2 single-row Q8_0 kernel may have: fewer than its 4-block groups,
#: whose other float order is not reproduced (its AVX-512 build's kernel is iqk_fa_key_products' at any head)
SINGLE_ROW_BLOCKS = 3
#: what ik's AVX-512 Q8_0 kernel (Q8_0_1_Unpacker) adds to the key's values to make them unsigned bytes
Q8_0_BIAS_AVX512 = 127


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _single_row_scores(qu: np.ndarray, qd: np.ndarray, kq: np.ndarray, kd: np.ndarray, group: int,
                       out: np.ndarray) -> None:
    """out[h, t, c] = q_t . k_c as ik's AVX2 Q8_0 kernel with one query row computes it (module function
    single_row_key_products)."""
    n_head, n, keys = out.shape
    nb = qd.shape[2]
    for job in prange(n_head * n):
        h, t = job // n, job % n
        g = h // group
        acc = np.empty(8, dtype=np.float32)
        for c in range(keys):
            acc[:] = 0.0
            for b in range(nb):
                d = np.float32(kd[g, c, b] * qd[h, t, b])
                for j in range(8):
                    p = np.int32(0)
                    for e in range(4):
                        i = b * 32 + 4 * j + e
                        p += np.int32(kq[g, c, i]) * (np.int32(qu[h, t, i]) - 128)
                    acc[j] = fmaf(d, np.float32(p), acc[j])
            out[h, t, c] = hsum_float_8(acc)


def single_row_key_products(q: np.ndarray, k: np.ndarray, type_name: str, ints: ToInts, avx2: bool) -> np.ndarray:
    """The scores q . k [H, n, keys] ggml's generic flash-attention kernel takes from ik's Q8_0 kernel, one query
    row (rounded to Q8_2_X4) against one cache row at a time. In ik's AVX2 build (`avx2`): per 32-value block
    d = k scale x q scale (bf16) and the block's products summed 4 bytes a lane into 8 int32 lanes, each lane
    fma(d, lane, acc); at the end the 8 lanes folded i + (i + 4), then (0 + 2) + (1 + 3). Its AVX-512 build takes
    the values unsigned (+ 127, Q8_0_1_Unpacker) in the kernel of iqk_fa_key_products. AVX2: heads of at most
    SINGLE_ROW_BLOCKS blocks."""
    d = q.shape[2]
    if not avx2:
        return iqk_fa_key_products(q, k, type_name, ints, False, np.zeros((q.shape[1], len(q)), np.bool_))
    if d // 32 > SINGLE_ROW_BLOCKS:
        raise ValueError(f"heads of {d} take ik's AVX2 4-block groups, not reproduced")
    scores, (qu, qd, _, kq, kd, group) = _stacked_operands(q, k, type_name, ints)
    _single_row_scores(qu, qd, kq, kd, group, scores)
    return scores


def _q8_kv_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows x [m, d] as ik's quantize_row_q8_KV writes them: their f32 scales [m] and int8 codes [m, d]."""
    raw = cache_row_bytes("Q8_KV", np.ascontiguousarray(x, dtype=np.float32))
    return raw[:, :4].copy().view(np.float32)[:, 0], raw[:, 8:].view(np.int8)


def q8_kv_key_products(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The scores q . k [H, n, keys] over a Q8_KV key cache as ik multiplies them (-fa off): each query head's row
    rounded to Q8_KV too (Q8_KV's vec_dot_type), and each score (key scale x query scale) x f32(the rows' integer
    dot product), in every kernel ik takes for it (mul_mat_q8_KV_q8_KV)."""
    n, n_head, d = q.shape
    n_keys, n_kv, _ = k.shape
    kd, kq = _q8_kv_rows(k.reshape(-1, d))
    qd, qq = _q8_kv_rows(q.reshape(-1, d))
    kd, kq = kd.reshape(n_keys, n_kv), kq.reshape(n_keys, n_kv, d).astype(np.int32)
    qd, qq = qd.reshape(n, n_head), qq.reshape(n, n_head, d).astype(np.int32)
    group = n_head // n_kv
    scores = np.empty((n_head, n, n_keys), np.float32)
    for h in range(n_head):
        scale = qd[:, h, None] * kd[None, :, h // group]  # float32 products
        scores[h] = scale * (qq[:, h] @ kq[:, h // group].T).astype(np.float32)
    return scores


@njit(cache=True, nogil=True, inline="always")
def _signed_byte(x: int) -> int:
    x &= 0xFF
    return x - 256 if x > 127 else x


@njit(cache=True, nogil=True, inline="always")
def _misread_query(qu: np.ndarray, qd: np.ndarray, qsum: np.ndarray, h: int, t: int, y: np.ndarray) -> np.float32:
    """Query row t of head h's Q8_2 block read as a Q8_0 one: y = its sum's two bytes and its first 30 values (the
    32 values), returned scale = its bf16 scale's bits as an f16."""
    y[0], y[1] = _signed_byte(qsum[h, t, 0]), _signed_byte(qsum[h, t, 0] >> 8)
    for i in range(y.size - 2):
        y[2 + i] = np.int32(qu[h, t, i]) - 128
    return f16_bits_to_f32(np.uint16(f32_bits(qd[h, t, 0]) >> np.uint32(16)))


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _q4_0_misread_scores(qu: np.ndarray, qd: np.ndarray, qsum: np.ndarray, kq: np.ndarray, kd: np.ndarray,
                         group: int, out: np.ndarray) -> None:
    """out[h, t, c] as ggml's AVX2 Q4_0 x Q8_0 dot reads one Q8_2 query block (q4_0_misread_key_products)."""
    n_head, n, keys = out.shape
    d = qu.shape[2]
    for job in prange(n_head * n):
        h, t = job // n, job % n
        g = h // group
        y = np.empty(d, dtype=np.int32)
        yd = _misread_query(qu, qd, qsum, h, t, y)
        acc = np.empty(8, dtype=np.float32)
        for c in range(keys):
            scale = np.float32(kd[g, c, 0] * yd)
            for j in range(8):
                p = np.int32(0)
                for e in range(4):
                    x = np.int32(kq[g, c, 4 * j + e])
                    sy = y[4 * j + e] if x > 0 else (0 if x == 0 else _signed_byte(-y[4 * j + e]))
                    p += abs(x) * sy
                acc[j] = scale * np.float32(p)
            out[h, t, c] = hsum_float_8(acc)


def q4_0_misread_key_products(q: np.ndarray, k: np.ndarray, ints: ToInts) -> np.ndarray:
    """The scores q . k [H, n, keys] ggml's generic flash-attention kernel takes over a Q4_0 key cache with heads of
    32 on ik's AVX2 build: it rounds the query to Q4_0's vec_dot_type, Q8_2_X4 (bf16 scale, int16 sum, 32 int8),
    but its dot asks ik's kernel for a Q8_0 query, which ik declines, so ggml's own AVX2 Q4_0 x Q8_0 dot reads the
    block as a Q8_0 one: the bf16 scale's bits as an f16 scale, the sum's two bytes and the first 30 values as the
    32 values. That dot: scale = k scale x that f16, the products summed 4 a lane (vpsignb on the key's signs: a
    -128 negated stays -128), each lane scale x lane, folded i + (i + 4), then (0 + 2) + (1 + 3)."""
    if q.shape[2] != 32:
        raise ValueError(f"heads of {q.shape[2]} read other bytes, not reproduced")
    scores, operands = _stacked_operands(q, k, "Q4_0", ints)
    _q4_0_misread_scores(*operands, scores)
    return scores


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _iq4_nl_misread_scores(qu: np.ndarray, qd: np.ndarray, qsum: np.ndarray, kq: np.ndarray, kd: np.ndarray,
                           group: int, out: np.ndarray) -> None:
    """out[h, t, c] as ggml's scalar IQ4_NL x Q8_0 dot reads one Q8_2 query block (iq4_nl_misread_key_products)."""
    n_head, n, keys = out.shape
    d = qu.shape[2]
    for job in prange(n_head * n):
        h, t = job // n, job % n
        g = h // group
        y = np.empty(d, dtype=np.int32)
        yd = _misread_query(qu, qd, qsum, h, t, y)
        for c in range(keys):
            total = np.int32(0)
            for e in range(d):
                total += y[e] * np.int32(kq[g, c, e])
            out[h, t, c] = np.float32(yd * kd[g, c, 0]) * np.float32(total)


def iq4_nl_misread_key_products(q: np.ndarray, k: np.ndarray, ints: ToInts) -> np.ndarray:
    """The scores q . k [H, n, keys] ggml's generic flash-attention kernel takes over an IQ4_NL key cache with heads
    of 32 on ik's AVX2 build: the query rounded to IQ4_NL's vec_dot_type, Q8_2_X4, read by a dot that asks ik's kernel
    for a Q8_0 query, which ik declines; ggml's own dot then reads the block as a Q8_0 one (as
    q4_0_misread_key_products) in its scalar tail (one block: its AVX2 loop takes pairs): d = that f16 scale x key
    scale, the score d x the integer sum of the 32 table values times those 32 bytes."""
    if q.shape[2] != 32:
        raise ValueError(f"heads of {q.shape[2]} read other bytes, not reproduced")
    scores, operands = _stacked_operands(q, k, "IQ4_NL", ints)
    _iq4_nl_misread_scores(*operands, scores)
    return scores


#: the 32-value block key caches (GGML names) ik's own flash-attention kernel multiplies on AVX2 in their own kernel
#: (iqk_gemm_legacy_fa), each -> what that kernel adds to the key's values to make them unsigned bytes (the query's
#: block sum x scale x this taken off again), 0 for a signed byte product
IQK_FA_KEY_BIAS = {"Q4_0": 8, "Q6_0": 32, "IQ4_NL": 0, "Q4_1": 0}
#: the key types whose blocks carry an offset m of their own (Q4_1: scale x code + m), summed as a biased type's
IQK_FA_KEY_OFFSET = ("Q4_1",)
#: the same on AVX-512, whose IQ4_NL kernel takes its values unsigned (the table + 128, IQ4_NL_UnpackerU)
IQK_FA_KEY_BIAS_AVX512 = {**IQK_FA_KEY_BIAS, "IQ4_NL": 128}
#: query rows per call of that kernel (kMaxQ); other counts take their own kernels
IQK_FA_KEY_ROWS = 8


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _iqk_fa_scores(qu: np.ndarray, qd: np.ndarray, qs: np.ndarray, kq: np.ndarray, kd: np.ndarray, km: np.ndarray,
                   bias: int, group: int, tx: np.ndarray, out: np.ndarray) -> None:
    """out[h, t, c] = q_t . k_c as ik's kernel of the key's type computes it, query row t in its Tx form where
    tx[h, t] (iqk_fa_key_products); km: each key block's offset (scale x -bias, Q4_1's m; no rows: none)."""
    n_head, n, keys = out.shape
    nb = qd.shape[2]
    offsets = km.shape[0] > 0
    for job in prange(n_head * n):
        h, t = job // n, job % n
        g = h // group
        acc = np.empty(8, dtype=np.float32)
        accm = np.empty(4, dtype=np.float32)
        for c in range(keys):
            acc[:] = 0.0
            accm[:] = 0.0
            for i in range(nb // 4):
                for j in range(4):
                    b = 4 * i + j
                    if offsets:
                        accm[j] += km[g, c, b] * np.float32(qd[h, t, b] * np.float32(qs[h, t, b]))
                    d = np.float32(kd[g, c, b] * qd[h, t, b])
                    for half in range(2):
                        p = np.int32(0)
                        for e in range(b * 32 + 16 * half, b * 32 + 16 * half + 16):
                            p += (np.int32(kq[g, c, e]) + bias) * (np.int32(qu[h, t, e]) - 128)
                        acc[4 * half + j] = fmaf(d, np.float32(p), acc[4 * half + j])
            for b in range(nb // 4 * 4, nb):
                if offsets:
                    m = km[g, c, b] * np.float32(qd[h, t, b] * np.float32(qs[h, t, b]))
                    for j in range(4):
                        accm[j] += np.float32(m * np.float32(0.25))
                d = np.float32(kd[g, c, b] * qd[h, t, b])
                for lane in range(8):
                    p = np.int32(0)
                    for e in range(b * 32 + 4 * lane, b * 32 + 4 * lane + 4):
                        p += (np.int32(kq[g, c, e]) + bias) * (np.int32(qu[h, t, e]) - 128)
                    acc[lane] = fmaf(d, np.float32(p), acc[lane])
            if offsets and tx[h, t]:
                s0, s1 = (acc[0] + accm[0]) + acc[4], (acc[1] + accm[1]) + acc[5]
                s2, s3 = (acc[2] + accm[2]) + acc[6], (acc[3] + accm[3]) + acc[7]
                out[h, t, c] = (s0 + s2) + (s1 + s3)
            elif offsets:
                s0, s1 = (acc[0] + acc[4]) + accm[0], (acc[1] + acc[5]) + accm[1]
                s2, s3 = (acc[2] + acc[6]) + accm[2], (acc[3] + acc[7]) + accm[3]
                out[h, t, c] = (s0 + s2) + (s1 + s3)
            else:
                out[h, t, c] = hsum_float_8(acc)


def iqk_fa_key_bias(type_name: str, avx2: bool) -> int:
    """What ik's own flash-attention kernel adds to the values of a `type_name` key (IQK_FA_KEY_BIAS; Q8_0 below
    FLASH_REPACK_ROWS query rows, where it does not repack them) in the AVX2 build (`avx2`) or the AVX-512 one."""
    if type_name == "Q8_0":
        return 0 if avx2 else Q8_0_BIAS_AVX512
    return (IQK_FA_KEY_BIAS if avx2 else IQK_FA_KEY_BIAS_AVX512)[type_name]


def iqk_fa_key_products(q: np.ndarray, k: np.ndarray, type_name: str, ints: ToInts, avx2: bool,
                        tx: np.ndarray) -> np.ndarray:
    """The scores q . k [H, n, keys] ik's own flash-attention kernel takes over a key cache of `type_name`
    (IQK_FA_KEY_BIAS; Q8_0 below FLASH_REPACK_ROWS query rows) in its AVX2 build (`avx2`) or its AVX-512 one: the
    type's own kernel (mul_mat_qX_1_q8_2_T, on AVX2 IQ4_NL's and Q8_0's mul_mat_qX_0_q8_0_T) on the cache rows as
    stored, the queries rounded to Q8_2_X4. Per 32-value block d = key scale x query scale; the integer products of
    (key value + bias) and query value summed, for the blocks of whole 4-block groups per block and 16-value half
    into lane (half, block in group), then for the blocks past them per 4 values of the block into lane 0-7; each lane fma(d, sum, lane). A biased type also sums (key scale x -bias) x (query scale x the query
    block's integer sum) per block position in its group (a quarter of it into each of 4 lanes past them); the score
    is then (t0 + t2) + (t1 + t3) over t_j = (lane j + lane j+4) + that sum (for the rows `tx` [H, n] marks, those of
    calls of 1, 2 or 4 rows, which take mul_mat_qX_0_q8_2_Tx: t_j = (lane j + that sum) + lane j+4), an unbiased one's the 8
    lanes folded i + (i + 4), then (0 + 2) + (1 + 3). Q4_1 (IQK_FA_KEY_OFFSET) is summed as a biased type, its
    codes as stored, each block's own offset m in place of scale x -bias."""
    held = _cache_ints(k, type_name, ints)
    scores, (qu, qd, qs, kq, kd, group) = _stacked_operands(q, k, type_name, ints, held)
    bias = iqk_fa_key_bias(type_name, avx2)
    if type_name in IQK_FA_KEY_OFFSET:
        offsets = [x.offset for x in held]
        assert all(o is not None for o in offsets), f"{type_name} blocks carry offsets (formats.KEY_CACHE_KERNELS)"
        km = np.stack(offsets).astype(np.float32)  # type: ignore[arg-type]
    else:
        km = kd * np.float32(-bias) if bias else np.zeros((0, 0, 0), np.float32)
    _iqk_fa_scores(qu, qd, qs, kq, kd, km, bias, group, tx, scores)
    return scores
