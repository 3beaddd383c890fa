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
cache is padded to 256 with flash attention) weigh exactly 0 and are skipped. So the kernel here takes ROWS rows of
one head through the keys together, as ik's tiles do, each key and value vector loaded once for all of them, the dot
accumulators and value sums held in vector registers over a block (LLVM intrinsics: Numba's loops kept them in memory
and reloaded every key from the second-level cache for every row), each row's operations in the order above.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from ikquant.cpu import host_has
from ikquant.formats.numeric import fmaf
from ikrun.ops.activations import ik_expf, ik_expf_avx2
from ikrun.ops.parallel import claim_items, task_items
from ikrun.ops.simd import V16F, splat

#: float lanes of ik's AVX2 and AVX-512 builds
AVX2_LANES, AVX512_LANES = 8, 16
#: the `scores` of a flash attention over F16 keys: none, the kernel takes the float dot
NO_SCORES = np.zeros((0, 0, 0), np.float32)
#: head sizes whose kernel ik instantiates with 32-key blocks whatever the cache length (iqk_fa_320_256 / 576_512)
SHORT_BLOCK_HEADS = ((320, 256), (576, 512))


def k_step_for(head_k: int, head_v: int, n_kv: int) -> int:
    """The keys per block ik's kernel for these head sizes takes on a cache of `n_kv` keys (a multiple of 32)."""
    if (head_k, head_v) in SHORT_BLOCK_HEADS:
        return 32
    return 128 if n_kv % 128 == 0 else 64 if n_kv % 64 == 0 else 32


def bf16_k_step_for(head_k: int, head_v: int, n_kv: int) -> int:
    """The keys per block of ik's kernel over bf16 K and V caches (FlashAttnBF16), at every head size it takes."""
    return 64 if n_kv % 64 == 0 else 32


#: the head sizes ik's kernel takes through its DeepSeek helper (iqk_deepseek_helper: steps of 16, 8, 4, then the
#: rest as one step)
MLA_FA_HEADS = (576, 512)


def kernel_row_calls(n: int, n_head: int, threads: int, n_cells: int,
                     heads: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per query row of a batch of `n` > 1 tokens, how many rows ik's own kernel hands the K x Q call that takes it,
    over `n_head` query heads among `threads`, the cache `n_cells` long: its threads split heads, then rows
    (iqk_flash_attn_noalibi); each thread takes its rows in steps (iqk_flash_helper: 64 / 32 / 16 from 512 cells
    on, 12 when exactly 12, then 8, else 4, else 2, the rest one at a time; at `heads` MLA_FA_HEADS 16, 8, 4, then
    the rest), a step's rows in calls of 8 (kMaxQ) and the rest. And per row whether its steps were a single one
    of 4 rows or more (where compute_helper_q repacks a Q8_0 cache block by block to Q8_0_R8)."""
    ntg = threads // math.gcd(n_head, threads)
    per = -(-n // ntg)
    calls = np.empty(n, dtype=np.int64)
    single = np.zeros(n, dtype=np.bool_)
    row = 0

    def steps(q_step: int, rows: int) -> None:
        nonlocal row
        single[row : row + rows] = rows == q_step >= 4
        for part in (q_step,) * (rows // q_step) + ((rows % q_step,) if rows % q_step else ()):
            for size in (8,) * (part // 8) + ((part % 8,) if part % 8 else ()):
                calls[row : row + size] = size
                row += size

    for first in range(0, n, per):
        left = min(per, n - first)
        if heads == MLA_FA_HEADS:
            for q_step in (16, 8, 4):
                if left >= q_step:
                    steps(q_step, q_step * (left // q_step))
                    left -= q_step * (left // q_step)
            if left:
                steps(left, left)
            continue
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
    return calls, single


#: query rows of one head a job takes through the keys together, each key and value vector loaded once for all of
#: them (the accumulators of four rows fill AVX-512's 32 vector registers; AVX2's 16 hold two rows' worth)
ROWS = 4 if host_has("avx512f") else 2
#: value columns _accumulate keeps in registers over a block's keys for one row, and for ROWS rows
_SPAN_ONE, _SPAN_ROWS = 128, 64


class _Rows:
    """A 2-D array argument of an intrinsic: its rows' addresses and the floats within them."""

    def __init__(self, context, builder: ir.IRBuilder, typ, value: ir.Value) -> None:  # type: ignore[no-untyped-def]
        arr = context.make_array(typ)(context, builder, value=value)
        self.builder, self.data = builder, arr.data
        self.stride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
        self.rows = cgutils.unpack_tuple(builder, arr.shape, 2)[0]
        self.base = builder.ptrtoint(arr.data, self.stride.type)

    def at(self, row: ir.Value, column: ir.Value) -> ir.Value:
        """The address of [row, column] (a row's floats contiguous)."""
        b = self.builder
        start = b.inttoptr(b.add(self.base, b.mul(row, self.stride)), self.data.type)
        return b.gep(start, [column])

    def vector(self, row: ir.Value, column: ir.Value) -> ir.Value:
        return self.builder.bitcast(self.at(row, column), V16F.as_pointer())


def _fma(builder: ir.IRBuilder) -> ir.Function:
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F] * 3), "llvm.fma.v16f32")


def _scores_intrinsic(chains: int, rows: int):  # type: ignore[no-untyped-def]
    """An intrinsic (kt, q, key0, sc, s, at): s[r, at + l] = (q[r] . key key0 + l) x sc for the `rows` rows of q
    and 16 keys (32 for one row), each dot in _scores_range's order with `chains` accumulators, all of them held in
    registers over the dimensions, each key vector loaded once for all rows."""
    groups = 2 if rows == 1 else 1

    @intrinsic
    def scores(typingctx, kt, q, key0, sc, s, at):  # type: ignore[no-untyped-def]
        sig = types.void(kt, q, types.int64, types.float32, s, types.int64)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            keys_t, q_t, s_t = (_Rows(context, builder, signature.args[i], args[i]) for i in (0, 1, 4))
            key0, sc, at = args[2], args[3], args[5]
            fma, lanes = _fma(builder), 4 * chains

            def const(x: int) -> ir.Constant:
                return ir.Constant(key0.type, x)

            slots = {(c, r, g): cgutils.alloca_once(builder, V16F)
                     for c in range(chains) for r in range(rows) for g in range(groups)}
            for slot in slots.values():
                builder.store(ir.Constant(V16F, [0.0] * 16), slot)
            with cgutils.for_range(builder, builder.udiv(keys_t.rows, const(lanes))) as loop:
                first = builder.mul(loop.index, const(lanes))
                for c in range(chains):
                    for e in range(4):
                        dim = builder.add(first, const(4 * c + e))
                        keys = [builder.load(keys_t.vector(dim, builder.add(key0, const(16 * g))), align=4)
                                for g in range(groups)]
                        for r in range(rows):
                            weight = splat(builder, builder.load(q_t.at(const(r), dim)))
                            for g in range(groups):
                                slot = slots[(c, r, g)]
                                builder.store(builder.call(fma, [keys[g], weight, builder.load(slot)]), slot)
            scale = splat(builder, sc)
            for r in range(rows):
                for g in range(groups):
                    acc = [builder.load(slots[(c, r, g)]) for c in range(chains)]
                    total = builder.fadd(acc[0], acc[1]) if chains == 2 else builder.fadd(
                        builder.fadd(acc[0], acc[1]), builder.fadd(acc[2], acc[3]))
                    builder.store(builder.fmul(total, scale), s_t.vector(const(r), builder.add(at, const(16 * g))),
                                  align=4)
            return context.get_dummy_value()

        return sig, codegen

    return scores


def _accumulate_intrinsic(rows: int, span: int):  # type: ignore[no-untyped-def]
    """An intrinsic (v, key0, n_keys, p, p_at, sums, d0): sums[r, d] = fma(v[key0 + l, d], p[r, p_at + l], sums[r,
    d]) for l = 0 .. n_keys - 1 in turn, the `rows` rows and the `span` columns d from d0 (v [keys, Dv], its rows
    contiguous): the fused chain per column of the plain loop, with the sums held in registers over the keys and
    each value vector loaded once for all rows."""
    vectors = span // 16

    @intrinsic
    def accumulate(typingctx, v, key0, n_keys, p, p_at, sums, d0):  # type: ignore[no-untyped-def]
        sig = types.void(v, types.int64, types.int64, p, types.int64, sums, types.int64)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            v_t, p_t, sums_t = (_Rows(context, builder, signature.args[i], args[i]) for i in (0, 3, 5))
            key0, n_keys, p_at, d0 = args[1], args[2], args[4], args[6]
            fma = _fma(builder)

            def const(x: int) -> ir.Constant:
                return ir.Constant(key0.type, x)

            ptrs = {(r, c): sums_t.vector(const(r), builder.add(d0, const(16 * c)))
                    for r in range(rows) for c in range(vectors)}
            slots = {key: cgutils.alloca_once(builder, V16F) for key in ptrs}
            for key, slot in slots.items():
                builder.store(builder.load(ptrs[key], align=4), slot)
            with cgutils.for_range(builder, n_keys) as loop:
                key = builder.add(key0, loop.index)
                values = [builder.load(v_t.vector(key, builder.add(d0, const(16 * c))), align=4)
                          for c in range(vectors)]
                for r in range(rows):
                    weight = splat(builder, builder.load(p_t.at(const(r), builder.add(p_at, loop.index))))
                    for c in range(vectors):
                        slot = slots[(r, c)]
                        builder.store(builder.call(fma, [values[c], weight, builder.load(slot)]), slot)
            for key, slot in slots.items():
                builder.store(builder.load(slot), ptrs[key], align=4)
            return context.get_dummy_value()

        return sig, codegen

    return accumulate


_scores_1x2, _scores_1x4 = _scores_intrinsic(2, 1), _scores_intrinsic(4, 1)
_scores_rows2, _scores_rows4 = _scores_intrinsic(2, ROWS), _scores_intrinsic(4, ROWS)
_accumulate_one, _accumulate_rows = _accumulate_intrinsic(1, _SPAN_ONE), _accumulate_intrinsic(ROWS, _SPAN_ROWS)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _scores_range(q: np.ndarray, kt: np.ndarray, b0: int, start: int, n_in: int, acc: np.ndarray, lanes: int,
                  sc: np.float32, s: np.ndarray) -> None:
    """s[0, l] = (q[0] . key b0 + l) x sc for the block's keys l = start .. n_in - 1 (q, s: one row), each dot in
    ik's float GEMM order (module docstring; acc: lanes / 4 rows of room for the accumulators). The keys are the
    vector lanes (kt [Dk, keys]: keys transposed), so the chains of one key's dot, which wait on each other, run side
    by side with other keys'."""
    if n_in <= start:
        return
    chains = lanes // 4
    spanned = start + (n_in - start) // 32 * 32
    for l0 in range(start, spanned, 32):
        if chains == 2:
            _scores_1x2(kt, q, b0 + l0, sc, s, l0)
        else:
            _scores_1x4(kt, q, b0 + l0, sc, s, l0)
    rest = n_in - spanned
    if rest == 0:
        return
    acc[:chains, :rest] = 0.0
    for i in range(0, q.shape[1], lanes):
        for c in range(chains):
            row = acc[c]
            for e in range(4):
                qe, ke = q[0, i + 4 * c + e], kt[i + 4 * c + e, b0 + spanned:b0 + n_in]
                for l in range(rest):
                    row[l] = fmaf(ke[l], qe, row[l])
    for l in range(rest):
        if chains == 2:
            s[0, spanned + l] = (acc[0, l] + acc[1, l]) * sc
        else:
            s[0, spanned + l] = ((acc[0, l] + acc[1, l]) + (acc[2, l] + acc[3, l])) * sc


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
def _softmax_step(s: np.ndarray, n_in: int, p: np.ndarray, sums: np.ndarray, total: np.float32, top: np.float32,
                  lanes: int) -> tuple[np.float32, np.float32]:
    """One block of `n_in` scaled scores `s` folded into the running sum `total` and maximum `top`, the value sums
    rescaled on a new maximum, the block's weights into p (module docstring); returns the new (total, top)."""
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
    if lanes == 16:  # one loop per build's exponential, each vectorised
        for l in range(n_in):
            p[l] = ik_expf(np.float32(s[l] - top))
    else:
        for l in range(n_in):
            p[l] = ik_expf_avx2(np.float32(s[l] - top))
    p[n_in:] = 0.0
    return total + _block_sum(p, lanes), top


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _accumulate(vg: np.ndarray, b0: int, start: int, n_in: int, p: np.ndarray, sums: np.ndarray) -> None:
    """Row 0 of p and sums: sums[0, d] = fma(v[b0 + l, d], p[0, l], sums[0, d]) for the keys l = start .. n_in - 1
    in turn."""
    if n_in <= start:
        return
    d0 = 0
    while d0 + _SPAN_ONE <= sums.shape[1]:
        _accumulate_one(vg, b0 + start, n_in - start, p, start, sums, d0)
        d0 += _SPAN_ONE
    for l in range(start, n_in):
        for d in range(d0, sums.shape[1]):
            sums[0, d] = fmaf(vg[b0 + l, d], p[0, l], sums[0, d])


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _accumulate_all(vg: np.ndarray, b0: int, n_in: int, p: np.ndarray, sums: np.ndarray) -> None:
    """_accumulate of keys 0 .. n_in - 1 for all ROWS rows of p and sums, each value vector loaded once."""
    d0 = 0
    while d0 + _SPAN_ROWS <= sums.shape[1]:
        _accumulate_rows(vg, b0, n_in, p, 0, sums, d0)
        d0 += _SPAN_ROWS
    for r in range(sums.shape[0]):
        for l in range(n_in):
            for d in range(d0, sums.shape[1]):
                sums[r, d] = fmaf(vg[b0 + l, d], p[r, l], sums[r, d])


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
    _attention(q, kt, scores, np.ascontiguousarray(v, dtype=np.float32), np.float32(scale), first, k_step, lanes,
               out, get_num_threads())


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _attention(q: np.ndarray, kt: np.ndarray, scores: np.ndarray, v: np.ndarray, sc: np.float32, first: int,
               k_step: int, lanes: int, out: np.ndarray, threads: int) -> None:
    """iqk_flash_attention with the keys transposed (kt [H_kv, Dk, n_keys]; unused where `scores` are given): jobs of
    ROWS query rows of one head (_rows_together; fewer at the end: _one_row each) in tasks the threads claim
    (ikrun/ops/parallel.py), each thread with its own block buffers."""
    jobs = out.shape[0] * -(-out.shape[1] // ROWS)
    per, counter = task_items(jobs, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        _attention_thread(q, kt, scores, v, sc, first, k_step, lanes, out, counter, per)


@njit(cache=True, nogil=True, error_model="numpy")
def _attention_thread(q: np.ndarray, kt: np.ndarray, scores: np.ndarray, v: np.ndarray, sc: np.float32, first: int,
                      k_step: int, lanes: int, out: np.ndarray, counter: np.ndarray, per: int) -> None:
    """One thread of _attention: its buffers, then the jobs it claims (ikquant/formats/jit.py: why a task is a
    function of its own; its buffers are its own: passed in as arguments they made it slower, probably as the
    compiler no longer knew that nothing else writes them)."""
    n_head, n = out.shape[0], out.shape[1]
    group = n_head // v.shape[0]
    given = scores.size > 0
    per_head = -(-n // ROWS)
    jobs = n_head * per_head
    s = np.empty((ROWS, k_step), dtype=np.float32)
    p = np.empty((ROWS, k_step), dtype=np.float32)
    acc = np.empty((lanes // 4, k_step), dtype=np.float32)
    sums = np.empty((ROWS, v.shape[2]), dtype=np.float32)
    totals = np.empty(ROWS, dtype=np.float32)
    tops = np.empty(ROWS, dtype=np.float32)
    j0, j1 = claim_items(counter, per, jobs)
    while j0 < j1:
        for job in range(j0, j1):
            h, t0 = job // per_head, job % per_head * ROWS
            g = h // group
            if given or t0 + ROWS > n:
                for t in range(t0, min(n, t0 + ROWS)):
                    _one_row(q, kt, scores, v[g], sc, first, k_step, lanes, h, g, t, given, s, p, acc, sums, out)
            else:
                _rows_together(q, kt[g], v[g], sc, first, k_step, lanes, h, t0, s, p, acc, sums, totals, tops,
                               out)
        j0, j1 = claim_items(counter, per, jobs)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _one_row(q: np.ndarray, kt: np.ndarray, scores: np.ndarray, vg: np.ndarray, sc: np.float32, first: int,
             k_step: int, lanes: int, h: int, g: int, t: int, given: bool, s: np.ndarray, p: np.ndarray,
             acc: np.ndarray, sums: np.ndarray, out: np.ndarray) -> None:
    """Query row t of head h (its key/value head g) alone, in row 0 of the buffers."""
    visible = first + t + 1
    sums[0, :] = 0.0
    total, top = np.float32(0.0), np.float32(-np.inf)
    for b0 in range(0, visible, k_step):
        n_in = min(k_step, visible - b0)
        if given:
            for l in range(n_in):
                s[0, l] = scores[h, t, b0 + l] * sc
        else:
            _scores_range(q[h, t:t + 1], kt[g], b0, 0, n_in, acc, lanes, sc, s)
        total, top = _softmax_step(s[0], n_in, p[0], sums[0], total, top, lanes)
        _accumulate(vg, b0, 0, n_in, p, sums)
    _store(sums[0], total, out[h, t])


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def scores_rows(kt: np.ndarray, rows: np.ndarray, b0: int, spanned: int, sc: np.float32, s: np.ndarray,
                lanes: int) -> None:
    """s[r, l] = (rows[r] . key b0 + l) x sc for the ROWS query rows and the keys l < spanned (a multiple of 16) of
    kt [Dk, keys], 16 keys a call, each key vector loaded once for all rows (_scores_intrinsic)."""
    for l0 in range(0, spanned, 16):
        if lanes == 8:
            _scores_rows2(kt, rows, b0 + l0, sc, s, l0)
        else:
            _scores_rows4(kt, rows, b0 + l0, sc, s, l0)


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def _rows_together(q: np.ndarray, ktg: np.ndarray, vg: np.ndarray, sc: np.float32, first: int, k_step: int,
                   lanes: int, h: int, t0: int, s: np.ndarray, p: np.ndarray, acc: np.ndarray, sums: np.ndarray,
                   totals: np.ndarray, tops: np.ndarray, out: np.ndarray) -> None:
    """Query rows t0 .. t0 + ROWS - 1 of head h through the keys together: per block the keys every row sees (in
    whole vectors of 16) scored and their values summed for all rows at once, the others row by row; each row's
    arithmetic is the one _one_row does, in the same order."""
    sums[:, :] = 0.0
    totals[:] = 0.0
    tops[:] = -np.inf
    last = first + t0 + ROWS  # the last row's visible keys
    for b0 in range(0, last, k_step):
        n_last = min(k_step, last - b0)
        spanned = n_last // 16 * 16
        scores_rows(ktg, q[h, t0:t0 + ROWS], b0, spanned, sc, s, lanes)
        common = k_step
        for r in range(ROWS):
            n_in = min(k_step, first + t0 + r + 1 - b0)
            common = min(common, max(n_in, 0))
            if n_in <= 0:
                continue
            _scores_range(q[h, t0 + r:t0 + r + 1], ktg, b0, spanned, n_in, acc, lanes, sc, s[r:r + 1])
            totals[r], tops[r] = _softmax_step(s[r], n_in, p[r], sums[r], totals[r], tops[r], lanes)
        if common > 0:
            _accumulate_all(vg, b0, common, p, sums)
        for r in range(ROWS):
            _accumulate(vg, b0, common, min(k_step, first + t0 + r + 1 - b0), p[r:r + 1], sums[r:r + 1])
    for r in range(ROWS):
        _store(sums[r], totals[r], out[h, t0 + r])


def iqk_flash_attention_parts(q: np.ndarray, k: np.ndarray, scores: np.ndarray, v: np.ndarray, scale: float,
                              starts: np.ndarray, lengths: np.ndarray, k_steps: np.ndarray, out: np.ndarray,
                              lanes: int) -> None:
    """One query row per head (q [H, 1, Dk], the last of the n_keys positions of k / v, as iqk_flash_attention
    takes them) as ik's kernel computes a one-token batch whose keys its threads split (iqk_flash_attn_noalibi):
    each part (cells starts[i] .. starts[i] + lengths[i] - 1, in key blocks of k_steps[i]) through the kernel alone,
    its unnormalised value sums R, maximum M and weight total S kept, the parts merged in order (accumulate_qkv: a
    part with a new maximum M' takes c = exp(M - M'), S = fma(c, S, S'), R = fma(c, R, R'), else c = exp(M' - M),
    S = fma(c, S', S), R = fma(c, R', R), the exponential the C library's double one, rounded to float; a part with
    no visible key is skipped), then R x (1 / S); out [H, 1, Dv]."""
    kt = np.ascontiguousarray(k.transpose(0, 2, 1), dtype=np.float32) if scores.size == 0 else NO_SCORES
    _merged_parts(q, kt, scores, np.ascontiguousarray(v, dtype=np.float32), np.float32(scale), starts, lengths,
                  k_steps, lanes, out)


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _merged_parts(q: np.ndarray, kt: np.ndarray, scores: np.ndarray, v: np.ndarray, sc: np.float32,
                  starts: np.ndarray, lengths: np.ndarray, k_steps: np.ndarray, lanes: int, out: np.ndarray) -> None:
    given = scores.size > 0
    k_max = k_steps.max()
    for h in prange(out.shape[0]):
        _merged_head(q, kt, scores, v, sc, starts, lengths, k_steps, lanes, np.int64(h), given, k_max, out)


@njit(cache=True, nogil=True, error_model="numpy")
def _merged_head(q: np.ndarray, kt: np.ndarray, scores: np.ndarray, v: np.ndarray, sc: np.float32,
                 starts: np.ndarray, lengths: np.ndarray, k_steps: np.ndarray, lanes: int, h: int, given: bool,
                 k_max: int, out: np.ndarray) -> None:
    """Head h of _merged_parts (ikquant/formats/jit.py: why a task is a function of its own)."""
    n_keys, d_v = v.shape[1], v.shape[2]
    g = h // (out.shape[0] // v.shape[0])
    s = np.empty((1, k_max), dtype=np.float32)
    p = np.empty((1, k_max), dtype=np.float32)
    acc = np.empty((lanes // 4, k_max), dtype=np.float32)
    sums = np.empty((1, d_v), dtype=np.float32)
    r = np.zeros(d_v, dtype=np.float32)
    m, total_all = np.float32(-np.inf), np.float32(0.0)
    for i in range(len(starts)):
        a = starts[i]
        b = min(a + lengths[i], n_keys)
        if b <= a:
            continue
        k_step = k_steps[i]
        sums[0, :] = 0.0
        total, top = np.float32(0.0), np.float32(-np.inf)
        for b0 in range(a, b, k_step):
            n_in = min(k_step, b - b0)
            if given:
                for l in range(n_in):
                    s[0, l] = scores[h, 0, b0 + l] * sc
            else:
                _scores_range(q[h, 0:1], kt[g], b0, 0, n_in, acc, lanes, sc, s)
            total, top = _softmax_step(s[0], n_in, p[0], sums[0], total, top, lanes)
            _accumulate(v[g], b0, 0, n_in, p, sums)
        if top == -np.inf:
            continue
        if top > m:
            if m == -np.inf:
                r[:] = sums[0]
                total_all = total
            else:
                c = np.float32(np.exp(np.float64(m - top)))
                total_all = fmaf(c, total_all, total)
                for d in range(d_v):
                    r[d] = fmaf(c, r[d], sums[0, d])
            m = top
        else:
            c = np.float32(np.exp(np.float64(top - m)))
            total_all = fmaf(c, total, total_all)
            for d in range(d_v):
                r[d] = fmaf(c, sums[0, d], r[d])
    norm = np.float32(np.float32(1.0) / total_all) if total_all > 0 else np.float32(1.0)
    for d in range(d_v):
        out[h, 0, d] = r[d] * norm
