"""ik's own IQ4_KS kernel of its AVX-512 build, for `--numerics ik`: what ik multiplies IQ4_KS weights with below the
activation rows from which it converts them (IkKernel.convert_rows: a routed expert's few tokens, a one-token
decode), Q8_K activations against the stored codes.

Per 256 values of a row and an activation row, the kernel holds 16 int32 lanes. It takes the codes as unsigned
bytes, the grid plus 128 (1 .. 241; a sub-block on the shifted grid, whose values are 4 more, moves those 4 to its
minimum): per 64 values, vpmaddubsw sums each pair of byte products into 16 bits, **saturating** at +-32767, and
vpdpwssd adds each two pair sums times their sub-block's scale (s = its byte & 254, minus 127) to a lane: lane l
takes values 4l .. 4l + 3 of each 64 (sub-block 2k for l < 8, 2k + 1 from 8 on). Lanes 0 .. 7 start from sub-block
l's minimum, s x (-128 + 4 x its shift bit), times the sum of its 32 activation integers. The lanes are then
converted to float and added as fma(d x the activations' d, lane, acc), the row's float32 d times the block's
scale, and the 16 accumulators summed as GCC's _mm512_reduce_add_ps sums them (8 + 8, 4 + 4, then (0 + 2) + (1 +
3)). The saturation is real: a Q8_K block's largest activation is +-127, and a pair of large codes against large
activations passes 32767 (on a Qwen3-MoE's first layer up to 0.4 of an output of 3.8), so the float path that
multiplied the decoded weights (the same sums unsaturated) was not ik's number. Checked bit for bit against ik's
ggml_mul_mat, ggml_mul_mat_id and ggml_moe_up_gate on random and on a model's rows (tests/test_iqk_native.py).

One 256-value block is one AVX-512BW call (vpmaddubsw, vpmaddwd: the same integers as vpdpwssd, which adds them
to the lanes with the same 32-bit wrap-around; then the 16 fused multiply-adds); a scalar loop computes the same
where the CPU lacks AVX-512BW and is what the vector form is tested against.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from ikquant.cpu import host_has
from ikquant.formats.iqk_grids import IQ4K_VALUES
from ikquant.formats.numeric import fmaf, load_f32
from ikrun.numerics.ik.qgemm import IntRows
from ikrun.ops.parallel import claim_items, task_items

#: the weight types whose own kernel (below their conversion threshold) is reproduced here
NATIVE_TYPES = ("IQ4_KS",)
HAS_AVX512BW = host_has("avx512bw")
SUPER = 256
SUB = 32
BLOCK_BYTES = 136  # per 256 values: 8 sub-block scale bytes, 128 bytes of codes
ROW_TILE = 16  # weight rows a task prepares and multiplies against all its tokens
#: the grid plus 128: the unsigned bytes ik's kernel multiplies
_UNSIGNED = (IQ4K_VALUES[:16].astype(np.int32) + 128).astype(np.uint8)
_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V64B, _V32S, _V16I, _V16F = (ir.VectorType(_I8, 64), ir.VectorType(_I16, 32), ir.VectorType(_I32, 16),
                              ir.VectorType(_F32, 16))


@intrinsic
def _block_vector(typingctx, row, ro, d, xu, n, tokens, m0, m1, sums, nsub, xd, nb, i, acc):  # type: ignore[no-untyped-def]
    """Block i of an IQ4_KS row (its 136 bytes at row[ro:]) against the activation rows tokens[m0:m1] (xu: their
    unsigned bytes, rows of n; sums: each token's 32-value integer sums, nsub a row, by its place in `tokens`; xd:
    the Q8_K scales, nb a row): the codes looked up as unsigned bytes (vpshufb) and the scales made once, then per
    token the 16 lanes (the minima's products in lanes 0 .. 7, per 64 values vpmaddwd(vpmaddubsw(codes, xu - 128),
    scales)) and acc[16 (m - m0) ...] = fma(d x the token's scale, float(lanes), acc)."""
    sig = types.void(row, types.int64, types.float32, xu, types.int64, tokens, types.int64, types.int64, sums,
                     types.int64, xd, types.int64, types.int64, acc)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        row_p, xu_p, tok_p, sums_p, xd_p, acc_p = (
            context.make_array(signature.args[k])(context, builder, value=args[k]).data for k in (0, 3, 5, 8, 10, 13))
        ro, d, n, m0, m1, nsub, nb, i = args[1], args[2], args[4], args[6], args[7], args[9], args[11], args[12]
        const = lambda v: ir.Constant(_I64, v)  # noqa: E731
        fn = lambda name, ret, *params: cgutils.get_or_insert_function(  # noqa: E731
            builder.module, ir.FunctionType(ret, list(params)), name)
        maddubs = fn("llvm.x86.avx512.pmaddubs.w.512", _V32S, _V64B, _V64B)
        maddwd = fn("llvm.x86.avx512.pmaddw.d.512", _V16I, _V32S, _V32S)
        shuffle_bytes = fn("llvm.x86.avx512.pshuf.b.512", _V64B, _V64B, _V64B)
        fma = fn("llvm.fma.v16f32", _V16F, _V16F, _V16F, _V16F)
        v8b, v8s, v8i, v32b = (ir.VectorType(_I8, 8), ir.VectorType(_I16, 8), ir.VectorType(_I32, 8),
                               ir.VectorType(_I8, 32))
        block = builder.gep(row_p, [ro])
        raw_scales = builder.load(builder.bitcast(block, v8b.as_pointer()), align=1)
        scales = builder.sub(builder.and_(builder.zext(raw_scales, v8s), ir.Constant(v8s, [254] * 8)),
                             ir.Constant(v8s, [127] * 8))
        shifts = builder.shl(builder.and_(builder.zext(raw_scales, v8i), ir.Constant(v8i, [1] * 8)),
                             ir.Constant(v8i, [2] * 8))
        minima = builder.mul(builder.sext(scales, v8i), builder.add(shifts, ir.Constant(v8i, [-128] * 8)))
        table = ir.Constant(_V64B, [int(v) - 256 if v > 127 else int(v) for v in _UNSIGNED.tolist()] * 4)
        order = ir.Constant(ir.VectorType(_I32, 64), list(range(16)) + list(range(32, 48)) + list(range(16, 32))
                            + list(range(48, 64)))
        weights, scale_vectors = [], []
        for k in range(4):
            codes = builder.load(builder.bitcast(builder.gep(block, [const(8 + 32 * k)]), v32b.as_pointer()),
                                 align=1)
            low = builder.and_(codes, ir.Constant(v32b, [15] * 32))
            high = builder.lshr(codes, ir.Constant(v32b, [4] * 32))
            weights.append(builder.call(shuffle_bytes, [table, builder.shuffle_vector(low, high, order)]))
            pick = ir.Constant(ir.VectorType(_I32, 32), [2 * k] * 16 + [2 * k + 1] * 16)
            scale_vectors.append(builder.shuffle_vector(scales, ir.Constant(v8s, ir.Undefined), pick))
        flip = ir.Constant(_V64B, [-128] * 64)
        widen = ir.Constant(ir.VectorType(_I32, 16), list(range(16)))
        with cgutils.for_range(builder, builder.sub(m1, m0)) as loop:
            j = builder.add(m0, loop.index)
            x = builder.load(builder.gep(tok_p, [j]))
            x_row = builder.gep(xu_p, [builder.add(builder.mul(x, n), builder.mul(i, const(SUPER)))])
            total = builder.mul(minima, builder.load(builder.bitcast(
                builder.gep(sums_p, [builder.add(builder.mul(j, nsub), builder.mul(i, const(8)))]),
                v8i.as_pointer()), align=4))
            lanes = builder.shuffle_vector(total, ir.Constant(v8i, [0] * 8), widen)
            for k in range(4):
                xs = builder.load(builder.bitcast(builder.gep(x_row, [const(64 * k)]), _V64B.as_pointer()), align=1)
                pairs = builder.call(maddubs, [weights[k], builder.xor(xs, flip)])
                lanes = builder.add(lanes, builder.call(maddwd, [pairs, scale_vectors[k]]))
            dd = builder.fmul(d, builder.load(builder.gep(xd_p, [builder.add(builder.mul(x, nb), i)])))
            splat = builder.insert_element(ir.Constant(_V16F, ir.Undefined), dd, ir.Constant(_I32, 0))
            splat = builder.shuffle_vector(splat, ir.Constant(_V16F, ir.Undefined), ir.Constant(_V16I, [0] * 16))
            out = builder.bitcast(builder.gep(acc_p, [builder.mul(loop.index, const(16))]), _V16F.as_pointer())
            builder.store(builder.call(fma, [splat, builder.sitofp(lanes, _V16F), builder.load(out, align=4)]), out,
                          align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def _block_scalar(wu: np.ndarray, wo: int, xu: np.ndarray, xo: int, sc: np.ndarray, so: int, lanes: np.ndarray,
                  dd: np.float32, acc: np.ndarray) -> None:
    """_block_vector in scalar code: each pair sum saturated to 16 bits, lanes wrapping at 32 bits."""
    for lane in range(16):
        total = np.int64(lanes[lane])
        for k in range(4):
            for half in range(2):
                a = 64 * k + 4 * lane + 2 * half
                p = (int(wu[wo + a]) * (int(xu[xo + a]) - 128)
                     + int(wu[wo + a + 1]) * (int(xu[xo + a + 1]) - 128))
                total += min(32767, max(-32768, p)) * int(sc[so + 32 * k + 2 * lane + half])
        acc[lane] = fmaf(dd, np.float32(np.int32(total)), acc[lane])


def _no_vector(row, ro, d, xu, n, tokens, m0, m1, sums, nsub, xd, nb, i, acc):  # type: ignore[no-untyped-def]
    """Where the CPU lacks AVX-512BW nothing calls the vector form (native_matmuls takes the scalar loop)."""


#: the vector form where it compiles, else a stand-in never called
_block_fast = _block_vector if HAS_AVX512BW else njit(cache=True, nogil=True)(_no_vector)


@njit(cache=True, nogil=True, inline="always")
def _prepare_row(row: np.ndarray, nb: int, wu: np.ndarray, wo: int, sc: np.ndarray, so: int, mins: np.ndarray,
                 mo: int) -> np.float32:
    """A row's codes as the kernel's unsigned bytes (wu[wo:]), each block's scales as vpmaddwd takes them (per 64
    values 32 int16: the first sub-block's scale 16 times, then the second's; sc[so:]), each sub-block's minimum
    (mins[mo:]); returns the row's scale d."""
    for i in range(nb):
        o = 4 + BLOCK_BYTES * i
        for m in range(8):
            b = np.int32(row[o + m])
            s = (b & 254) - 127
            mins[mo + 8 * i + m] = s * (-128 + 4 * (b & 1))
            for j in range(16):
                sc[so + 128 * i + 16 * m + j] = s
                c = np.int32(row[o + 8 + 16 * m + j])
                wu[wo + SUPER * i + SUB * m + j] = _UNSIGNED[c & 15]
                wu[wo + SUPER * i + SUB * m + 16 + j] = _UNSIGNED[c >> 4]
    return load_f32(row, 0)


@njit(cache=True, nogil=True, inline="always")
def _reduce16(acc: np.ndarray) -> np.float32:
    """GCC's _mm512_reduce_add_ps: the halves added, then the quarters, then (0 + 2) + (1 + 3)."""
    t0 = (acc[12] + acc[4]) + (acc[8] + acc[0])
    t1 = (acc[13] + acc[5]) + (acc[9] + acc[1])
    t2 = (acc[14] + acc[6]) + (acc[10] + acc[2])
    t3 = (acc[15] + acc[7]) + (acc[11] + acc[3])
    return (t0 + t2) + (t1 + t3)


@njit(cache=True, nogil=True, inline="always")
def _scalar_row(row, xu, xd, sub_sums, tokens, m0, m1, wu, sc, mins, lanes, acc):  # type: ignore[no-untyped-def]
    """One row against tokens[m0:m1] in the scalar loop (acc as _block_vector leaves it)."""
    nb = xd.shape[1]
    d = _prepare_row(row, nb, wu, 0, sc, 0, mins, 0)
    for m in range(m0, m1):
        x = tokens[m]
        for i in range(nb):
            for lane in range(8):
                lanes[lane] = mins[8 * i + lane] * sub_sums[m, 8 * i + lane]
            _block_scalar(wu, SUPER * i, xu[x], SUPER * i, sc, 128 * i, lanes, d * xd[x, i],
                          acc[16 * (m - m0) : 16 * (m - m0) + 16])


@njit(cache=True, nogil=True, inline="always")
def _task(raw, xu, xd, sub_sums, tokens, row_at, out, task, n_rows, vector, wu, sc, mins, lanes,  # type: ignore[no-untyped-def]
          acc):
    """Weight rows ROW_TILE x t .. of matrix j (task = j x tiles + t) against matrix j's tokens, row by row."""
    tiles = -(-n_rows // ROW_TILE)
    j, t = task // tiles, task % tiles
    m0, m1 = row_at[j], row_at[j + 1]
    if m0 == m1:
        return
    nb, n = xd.shape[1], xu.shape[1]
    for r in range(t * ROW_TILE, min(n_rows, (t + 1) * ROW_TILE)):
        row = raw[j, r]
        acc[: 16 * (m1 - m0)] = 0
        if vector:
            d = load_f32(row, 0)
            for i in range(nb):
                _block_fast(row, 4 + BLOCK_BYTES * i, d, xu.reshape(-1), n, tokens, m0, m1, sub_sums.reshape(-1),
                            nb * 8, xd.reshape(-1), nb, i, acc)
        else:
            _scalar_row(row, xu, xd, sub_sums, tokens, m0, m1, wu, sc, mins, lanes, acc)
        for m in range(m0, m1):
            out[m, r] = _reduce16(acc[16 * (m - m0) : 16 * (m - m0) + 16])


@njit(cache=True, nogil=True, parallel=True)
def _matmuls(raw, xu, xd, sub_sums, tokens, row_at, out, vector, most, threads):  # type: ignore[no-untyped-def]
    """Every (matrix, row tile) task, claimed by the threads (ikrun/ops/parallel.py); `most`: the most tokens a
    matrix takes."""
    n_rows, nb = raw.shape[1], xd.shape[1]
    tasks = (len(row_at) - 1) * -(-n_rows // ROW_TILE)
    per, counter = task_items(tasks, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        wu = np.empty(nb * SUPER, np.uint8)
        sc = np.empty(nb * 128, np.int16)
        mins = np.empty(nb * 8, np.int32)
        lanes = np.zeros(16, np.int32)
        acc = np.empty(16 * most, np.float32)
        t0, t1 = claim_items(counter, per, tasks)
        while t0 < t1:
            for task in range(t0, t1):
                _task(raw, xu, xd, sub_sums, tokens, row_at, out, task, n_rows, vector, wu, sc, mins, lanes, acc)
            t0, t1 = claim_items(counter, per, tasks)


@njit(cache=True, nogil=True)
def _sub_block_sums(xu: np.ndarray, tokens: np.ndarray, sums: np.ndarray) -> None:
    """The sum of each 32 activation integers of the rows `tokens` (what the minima multiply)."""
    for m in range(len(tokens)):
        row = xu[tokens[m]]
        for b in range(sums.shape[1]):
            total = 0
            for j in range(SUB):
                total += int(row[SUB * b + j]) - 128
            sums[m, b] = total


def native_matmuls(x: IntRows, raw: np.ndarray, tokens: np.ndarray, row_at: np.ndarray,
                   vector: bool = HAS_AVX512BW) -> np.ndarray:
    """Rows `tokens` of the Q8_K activations x times IQ4_KS matrices as ik's own kernel computes them: matrix j
    (raw [E, rows, row bytes], the file's rows) takes tokens[row_at[j] : row_at[j + 1]]; float32 [len(tokens),
    rows]. `vector` False (or a CPU without AVX-512BW): the scalar loop (the same bits)."""
    if x.block != SUPER:
        raise ValueError(f"ik's IQ4_KS kernel takes Q8_K activations (blocks of {SUPER}), not blocks of {x.block}")
    raw = np.ascontiguousarray(raw)
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    row_at = np.ascontiguousarray(row_at, dtype=np.int64)
    sums = np.empty((len(tokens), x.u.shape[1] // SUB), np.int32)
    _sub_block_sums(x.u, tokens, sums)
    out = np.empty((len(tokens), raw.shape[1]), np.float32)
    most = int(np.diff(row_at).max(initial=0))
    _matmuls(raw, x.u, x.scale, sums, tokens, row_at, out, vector and HAS_AVX512BW, most, get_num_threads())
    return out


def native_matmul(x: IntRows, raw: np.ndarray, vector: bool = HAS_AVX512BW) -> np.ndarray:
    """x (Q8_K rows) @ an IQ4_KS matrix's rows `raw` [rows, row bytes]^T in ik's own kernel: float32 [x.rows,
    rows]."""
    return native_matmuls(x, raw[None], np.arange(x.rows, dtype=np.int64), np.array([0, x.rows], np.int64), vector)
