"""ik's own kernels of the IQK types, IQ4_XS, Q2_K and Q3_K (IQ4_KS, IQ5_KS, IQ3_KS, IQ2_KS, IQ2_KL, IQ4_KSS, IQ2_K
... IQ6_K, IQ4_XS, Q2_K, Q3_K) in its AVX-512 build, for `--numerics ik`, and in its AVX2 build, for `ik-avx2`: what
ik multiplies those weights with below the activation rows from which it converts them (IkKernel.convert_rows: a
routed expert's few tokens, a one-token decode), Q8_K activations against the stored codes.
IQ5_KS's is IQ4_KS's with 5-bit codes (the fifth bits picking one of two 16-byte tables) and a grid shift of 2. IQ3_KS's
and IQ2_KS's have the same lanes over their unshifted grid plus 64 and plus 32 (unsigned bytes whose pair sums stay
below 32767: no saturation), each sub-block's minimum its scale x (the grid half's shift, 4 and 5, minus 64 and 32), and
the row's f16 scale; they run in the scalar loop on every CPU. The types of 16-value sub-blocks and a block scale d
(IQ3_K, IQ4_K, IQ5_K, IQ6_K) take another kernel (mul_mat_iqX_k_q8_K_AVX512, _scalar_row_xk): the same 16 lanes of
saturated pair sums times their sub-block's scale, the minima in 8 lanes of their own, the two lane sets added up only
at the end (checked bit for bit against ggml_mul_mat; the 4-6 bit types' pair sums saturate as IQ4_KS's). IQ2_K's
(mul_mat_qX_K_q8_K_AVX512) groups its values into the 16 lanes otherwise (_lanes_iq2_k), its sums exact; Q2_K's
and Q3_K's are that kernel too, over their unsigned values (0 .. 3; 0 .. 7, the high bit added), Q2_K's minima its
high nibbles scaled by -dmin, Q3_K's its signed 6-bit scales by -4 d (the value's offset). IQ4_KSS's is
mul_mat_iqX_k_q8_K_AVX512's over 32-value sub-blocks (each scale and minimum held twice) and the row's f32 d, IQ4_XS's
the same with block scales; IQ2_KL's is IQ2_KS's over its pair table plus 64, no shifted half. ik's AVX2 build
multiplies IQ2_K ... IQ6_K in mul_mat_qY_K_q8_K_T (_scalar_row_xk_avx2): 8 exact lanes, the minima (none for IQ4_K,
whose values it takes signed on the sub-block's grid half) in a fused multiply-add of their own first; IQ5_KS,
IQ4_XS, IQ4_KSS and IQ2_KL in mul_mat_qX_K_q8_K_T, the same lanes over 32-value sub-blocks and unsigned values, whose
pair sums saturate.

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

ik's AVX2 build (`--numerics ik-avx2`) multiplies IQ4_KS otherwise: the signed grid values (the shifted grid's
for a sub-block whose scale byte is odd) against the activation integers in 8 lanes, lane l summing values
4 l .. 4 l + 3 of every sub-block times the sub-block's scale (|value| x |activation| pairs stay below 32767, so
the lanes are exact), then per block fma(d x the token's scale, float(lane), acc), and the 8 accumulators summed as
its hsum_float_8 (_scalar_row_avx2, a scalar loop; checked byte for byte against that build's base logits on the
Qwen3-MoE). Its IQ3_KS kernel is the same over IQ3_KS's signed grid values (the shifted half of the table where a
sub-block's flag says) and 16-bit sub-block scales, with the row's f16 scale; its IQ2_KS kernel multiplies the
unshifted grid plus 32 as unsigned bytes and adds each sub-block's minimum, scale x (-32, + 5 where shifted),
times the sum of its 32 activations to lane k in a fused multiply-add of its own before the block's lanes (both
bit for bit against its ggml_mul_mat, and the Qwen3-MoE's base logits).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from ikquant.cpu import host_has
from ikquant.formats.iqk_grids import IQ2NL_VALUES, IQ3NL_VALUES, IQ4K_VALUES, IQ5NL_VALUES, IQ6NL_VALUES
from ikquant.formats.iqk_ks import IQ2KL_PAIRS
from ikquant.formats.jit import read_only
from ikquant.formats.numeric import fmaf, hsum_float_8, load_f16, load_f32
from ikrun.numerics.ik.q8k_direct import (
    KIND_IQ2_K,
    KIND_IQ2_KS,
    KIND_IQ3_K,
    KIND_IQ3_KS,
    KIND_IQ4_K,
    KIND_IQ4_KS,
    KIND_IQ5_KS,
    ks_block_at,
    ks_code,
    ks_sub_block,
)
from ikrun.numerics.ik.qgemm import IntRows
from ikrun.ops.parallel import claim_items, task_items
from ikrun.ops.simd import splat

#: IQ5_K's, IQ6_K's, IQ4_KSS's, IQ2_KL's, IQ4_XS's, Q2_K's and Q3_K's kinds here, after q8k_direct's (which packs
#: none of them)
KIND_IQ5_K, KIND_IQ6_K, KIND_IQ4_KSS, KIND_IQ2_KL, KIND_IQ4_XS, KIND_Q2_K, KIND_Q3_K = 7, 8, 9, 10, 11, 12, 13
#: the weight types whose own kernel (below their conversion threshold) is reproduced, in ik's AVX-512 and AVX2 builds
#: alike, by q8k_direct's kind
NATIVE_TYPES = {"IQ4_KS": KIND_IQ4_KS, "IQ5_KS": KIND_IQ5_KS, "IQ3_KS": KIND_IQ3_KS, "IQ2_KS": KIND_IQ2_KS,
                "IQ2_K": KIND_IQ2_K, "IQ3_K": KIND_IQ3_K, "IQ4_K": KIND_IQ4_K, "IQ5_K": KIND_IQ5_K,
                "IQ6_K": KIND_IQ6_K, "IQ4_KSS": KIND_IQ4_KSS, "IQ2_KL": KIND_IQ2_KL,
                "IQ4_XS": KIND_IQ4_XS, "Q2_K": KIND_Q2_K, "Q3_K": KIND_Q3_K}
#: IQ2_KS's unshifted grid plus 32, the unsigned bytes ik's AVX2 kernel multiplies (a shifted sub-block's +5 and the
#: -32 go to its minimum)
_IQ2KS_UNSIGNED = (IQ2NL_VALUES[:4].astype(np.int32) + 32).astype(np.int8)


HAS_AVX512BW = host_has("avx512bw")
SUPER = 256
SUB = 32
#: IQ4_KS's and IQ5_KS's bytes per 256 values, by kind: 8 sub-block scale bytes and the codes (IQ4_KS 128 bytes of 4
#: bits; IQ5_KS 128 of their low 4 bits, two sub-blocks to 32 bytes, then 32 of their fifth bits)
BLOCK_BYTES = np.zeros(max(NATIVE_TYPES.values()) + 1, np.int64)
BLOCK_BYTES[[KIND_IQ4_KS, KIND_IQ5_KS]] = 136, 168
#: the 16-value sub-block types' bytes per 256 values (each block's f16 d first)
BLOCK_BYTES[[KIND_IQ2_K, KIND_IQ3_K, KIND_IQ4_K, KIND_IQ5_K, KIND_IQ6_K]] = 76, 110, 144, 176, 212
#: IQ4_KSS's, after the row's f32 d: 64 16-bit words (their low bits the sub-block scales); IQ4_XS's: f16 d, the
#: scales' high bits (16), their low nibbles (4 bytes), the codes
BLOCK_BYTES[[KIND_IQ4_KSS, KIND_IQ4_XS]] = 128, 136
#: IQ2_KL's, after the row's f16 d: 2 + 4 scale bytes, 64 of 4-bit pair codes, 16 of their fifth bits
BLOCK_BYTES[KIND_IQ2_KL] = 86
#: Q2_K's: 16 scale bytes, 64 of 2-bit values, f16 d and dmin; Q3_K's: 32 bytes of high bits, 64 of 2-bit values,
#: 12 of 6-bit scales, f16 d
BLOCK_BYTES[[KIND_Q2_K, KIND_Q3_K]] = 84, 110
#: what a sub-block on the shifted grid adds to every value of IQ4_KS (4) and IQ5_KS (2), by kind
GRID_SHIFT = np.zeros_like(BLOCK_BYTES)
GRID_SHIFT[[KIND_IQ4_KS, KIND_IQ5_KS]] = 4, 2
ROW_TILE = 16  # weight rows a task multiplies (row by row) against all its matrix's tokens
#: the unshifted grids plus 128: the unsigned bytes ik's kernels multiply
_UNSIGNED4 = (IQ4K_VALUES[:16].astype(np.int32) + 128).astype(np.uint8)
_UNSIGNED5 = (IQ5NL_VALUES[:32].astype(np.int32) + 128).astype(np.uint8)
#: IQ3_KS's unshifted grid plus 64, the unsigned bytes ik's AVX-512 kernel multiplies (the shift and the -64 go to
#: the sub-block's minimum; IQ2_KS's are _IQ2KS_UNSIGNED there too)
_UNSIGNED3 = (IQ3NL_VALUES[:8].astype(np.int32) + 64).astype(np.uint8)
#: IQ6_K's unshifted table plus 128
_UNSIGNED6 = (IQ6NL_VALUES[:64].astype(np.int32) + 128).astype(np.uint8)
#: IQ2_KL's value pairs plus 64
_UNSIGNED_KL = (IQ2KL_PAIRS.astype(np.int32) + 64).astype(np.uint8)
#: the 16-value sub-block types' minimum factor: the unsigned bias and what a shifted sub-block adds, by kind
XK_BIAS = np.zeros_like(BLOCK_BYTES)
XK_BIAS[[KIND_IQ2_K, KIND_IQ3_K, KIND_IQ4_K, KIND_IQ5_K, KIND_IQ6_K]] = 32, 64, 128, 128, 128
XK_SHIFT = np.zeros_like(BLOCK_BYTES)
XK_SHIFT[[KIND_IQ2_K, KIND_IQ3_K, KIND_IQ4_K, KIND_IQ5_K, KIND_IQ6_K]] = 5, 4, 4, 2, 1
#: their unshifted grids plus XK_BIAS, by kind and code
_XK_UNSIGNED = np.zeros((len(BLOCK_BYTES), 64), np.int32)
for _kind, _grid in ((KIND_IQ2_K, _IQ2KS_UNSIGNED), (KIND_IQ3_K, _UNSIGNED3), (KIND_IQ4_K, _UNSIGNED4),
                     (KIND_IQ5_K, _UNSIGNED5), (KIND_IQ6_K, _UNSIGNED6)):
    _XK_UNSIGNED[_kind, : len(_grid)] = _grid
_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V64B, _V32S, _V16I, _V16F = (ir.VectorType(_I8, 64), ir.VectorType(_I16, 32), ir.VectorType(_I32, 16),
                              ir.VectorType(_F32, 16))
_V64I = ir.VectorType(_I32, 64)


def _unsigned_codes(builder: ir.IRBuilder, block: ir.Value, kind: int, k: int) -> ir.Value:
    """Values 64 k .. 64 k + 63 of a block (its bytes at `block`) as the unsigned bytes ik's kernel multiplies:
    the codes looked up in the unshifted grid plus 128 (vpshufb; IQ5_KS's fifth bit picks one of two tables)."""
    v32b = ir.VectorType(_I8, 32)
    shuffle_bytes = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V64B, [_V64B, _V64B]),
                                                   "llvm.x86.avx512.pshuf.b.512")
    signed = [int(v) - 256 if v > 127 else int(v) for v in (_UNSIGNED4 if kind == KIND_IQ4_KS else _UNSIGNED5).tolist()]
    codes = builder.load(builder.bitcast(builder.gep(block, [ir.Constant(_I64, 8 + 32 * k)]), v32b.as_pointer()),
                         align=1)
    low = builder.and_(codes, ir.Constant(v32b, [15] * 32))
    high = builder.lshr(codes, ir.Constant(v32b, [4] * 32))
    if kind == KIND_IQ4_KS:  # sub-block m's codes: 16 bytes, low nibbles its first 16 values, high its last
        order = list(range(16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))
        return builder.call(shuffle_bytes, [ir.Constant(_V64B, signed * 4),
                                            builder.shuffle_vector(low, high, ir.Constant(_V64I, order))])
    nibbles = builder.shuffle_vector(low, high, ir.Constant(_V64I, list(range(64))))  # sub-blocks 2k, 2k + 1
    top = builder.load(builder.bitcast(builder.gep(block, [ir.Constant(_I64, 136)]), v32b.as_pointer()), align=1)
    bits = [builder.and_(builder.lshr(top, ir.Constant(v32b, [2 * k + h] * 32)), ir.Constant(v32b, [1] * 32))
            for h in range(2)]
    fifth = builder.icmp_unsigned("!=", builder.shuffle_vector(bits[0], bits[1], ir.Constant(_V64I, list(range(64)))),
                                  ir.Constant(_V64B, [0] * 64))
    return builder.select(fifth, builder.call(shuffle_bytes, [ir.Constant(_V64B, signed[16:] * 4), nibbles]),
                          builder.call(shuffle_bytes, [ir.Constant(_V64B, signed[:16] * 4), nibbles]))


def _block_vector(kind: int) -> Callable[..., None]:
    """The block kernel of type code `kind` (NATIVE_TYPES): an intrinsic of its own."""

    @intrinsic
    def block(typingctx, row, ro, d, xu, n, tokens, m0, m1, sums, nsub, xd, nb, i, acc):  # type: ignore[no-untyped-def]
        return _block_signature(row, xu, tokens, sums, xd, acc), _block_codegen(kind)

    return block  # type: ignore[no-any-return]


def _block_signature(row, xu, tokens, sums, xd, acc):  # type: ignore[no-untyped-def]
    return types.void(row, types.int64, types.float32, xu, types.int64, tokens, types.int64, types.int64, sums,
                      types.int64, xd, types.int64, types.int64, acc)


def _block_codegen(kind: int) -> Callable[..., ir.Value]:
    """Block i of a row (its bytes at row[ro:]) against the activation rows tokens[m0:m1] (xu: their
    unsigned bytes, rows of n; sums: each token's 32-value integer sums, nsub a row, by its place in `tokens`; xd:
    the Q8_K scales, nb a row): the codes looked up as unsigned bytes (vpshufb) and the scales made once, then per
    token the 16 lanes (the minima's products in lanes 0 .. 7, per 64 values vpmaddwd(vpmaddubsw(codes, xu - 128),
    scales)) and acc[16 (m - m0) ...] = fma(d x the token's scale, float(lanes), acc)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        row_p, xu_p, tok_p, sums_p, xd_p, acc_p = (
            context.make_array(signature.args[k])(context, builder, value=args[k]).data for k in (0, 3, 5, 8, 10, 13))
        ro, d, n, m0, m1, nsub, nb, i = args[1], args[2], args[4], args[6], args[7], args[9], args[11], args[12]
        const = lambda v: ir.Constant(_I64, v)  # noqa: E731
        fn = lambda name, ret, *params: cgutils.get_or_insert_function(  # noqa: E731
            builder.module, ir.FunctionType(ret, list(params)), name)
        maddubs = fn("llvm.x86.avx512.pmaddubs.w.512", _V32S, _V64B, _V64B)
        maddwd = fn("llvm.x86.avx512.pmaddw.d.512", _V16I, _V32S, _V32S)
        fma = fn("llvm.fma.v16f32", _V16F, _V16F, _V16F, _V16F)
        v8b, v8s, v8i = ir.VectorType(_I8, 8), ir.VectorType(_I16, 8), ir.VectorType(_I32, 8)
        block = builder.gep(row_p, [ro])
        raw_scales = builder.load(builder.bitcast(block, v8b.as_pointer()), align=1)
        scales = builder.sub(builder.and_(builder.zext(raw_scales, v8s), ir.Constant(v8s, [254] * 8)),
                             ir.Constant(v8s, [127] * 8))
        shifts = builder.mul(builder.and_(builder.zext(raw_scales, v8i), ir.Constant(v8i, [1] * 8)),
                             ir.Constant(v8i, [int(GRID_SHIFT[kind])] * 8))
        minima = builder.mul(builder.sext(scales, v8i), builder.add(shifts, ir.Constant(v8i, [-128] * 8)))
        weights, scale_vectors = [], []
        for k in range(4):
            weights.append(_unsigned_codes(builder, block, kind, k))
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
            out = builder.bitcast(builder.gep(acc_p, [builder.mul(loop.index, const(16))]), _V16F.as_pointer())
            builder.store(builder.call(fma, [splat(builder, dd), builder.sitofp(lanes, _V16F),
                                             builder.load(out, align=4)]), out, align=4)
        return context.get_dummy_value()

    return codegen


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
    """Where the CPU lacks AVX-512BW nothing calls the vector form (iqk_matmuls takes the scalar loop)."""


#: the vector forms (IQ4_KS, IQ5_KS) where they compile, else a stand-in never called
_block_fast4, _block_fast5 = ((_block_vector(KIND_IQ4_KS), _block_vector(KIND_IQ5_KS)) if HAS_AVX512BW else
                              (njit(cache=True, nogil=True)(_no_vector),) * 2)


@njit(cache=True, nogil=True, inline="always")
def _iq5_ks_unsigned(row: np.ndarray, o: int, m: int, j: int) -> np.uint8:
    """Value j of sub-block m of the IQ5_KS block at o as its unsigned byte (the unshifted grid plus 128): the low 4
    bits of its code from the byte pairs' nibbles, the fifth from the sub-block's bit of the high-bit byte j."""
    c = (np.int32(row[o + 8 + 32 * (m // 2) + j]) >> (4 * (m % 2))) & 15
    return _UNSIGNED5[c | (((np.int32(row[o + 136 + j]) >> m) & 1) << 4)]


@njit(cache=True, nogil=True, inline="always")
def _prepare_row(row: np.ndarray, kind: int, nb: int, wu: np.ndarray, sc: np.ndarray, mins: np.ndarray) -> np.float32:
    """A row's codes as the kernel's unsigned bytes (wu), each block's scales as vpmaddwd takes them (per 64 values
    32 int16: the first sub-block's scale 16 times, then the second's; sc), each sub-block's minimum (mins);
    returns the row's scale d. IQ3_KS and IQ2_KS (read as q8k_direct reads them): the unshifted grid plus 64 and
    32, the minimum scale x (the grid half's shift, 4 and 5, minus that bias)."""
    if kind == KIND_IQ2_KL:
        return _prepare_row_iq2_kl(row, nb, wu, sc, mins, False)
    if kind == KIND_IQ2_KS or kind == KIND_IQ3_KS:
        grid = IQ2NL_VALUES if kind == KIND_IQ2_KS else IQ3NL_VALUES
        bias = 32 if kind == KIND_IQ2_KS else 64
        for i in range(nb):
            o = ks_block_at(kind, i)
            for m in range(8):
                s, off = ks_sub_block(row, kind, o, m)
                mins[8 * i + m] = s * (np.int32(grid[off]) - np.int32(grid[0]) - bias)
                for j in range(16):
                    sc[128 * i + 16 * m + j] = s
                for j in range(SUB):
                    k = ks_code(row, kind, o, m, j)
                    wu[SUPER * i + SUB * m + j] = _IQ2KS_UNSIGNED[k] if kind == KIND_IQ2_KS else _UNSIGNED3[k]
        return load_f16(row, 0)
    for i in range(nb):
        o = 4 + BLOCK_BYTES[kind] * i
        for m in range(8):
            b = np.int32(row[o + m])
            s = (b & 254) - 127
            mins[8 * i + m] = s * (-128 + GRID_SHIFT[kind] * (b & 1))
            for j in range(16):
                sc[128 * i + 16 * m + j] = s
            at = SUPER * i + SUB * m
            if kind == KIND_IQ4_KS:
                for j in range(16):
                    c = np.int32(row[o + 8 + 16 * m + j])
                    wu[at + j] = _UNSIGNED4[c & 15]
                    wu[at + 16 + j] = _UNSIGNED4[c >> 4]
            else:
                for j in range(SUB):
                    wu[at + j] = _iq5_ks_unsigned(row, o, m, j)
    return load_f32(row, 0)


@njit(cache=True, nogil=True, inline="always")
def _prepare_row_iq2_kl(row: np.ndarray, nb: int, wu: np.ndarray, sc: np.ndarray, mins: np.ndarray,
                        sixteens: bool) -> np.float32:
    """_prepare_row of IQ2_KL: each sub-block's 6-bit scale minus 32 (a nibble, its high 2 bits in the block's
    16-bit word), minimum scale x -64; each pair of values a 5-bit code (a nibble and a fifth bit) into the pair
    table, plus 64 as unsigned bytes. `sixteens`: the scales and minima laid out as _prepare_row_xk's (one per 16
    values, each twice), for ik's AVX2 kernel."""
    for i in range(nb):
        o = 2 + BLOCK_BYTES[KIND_IQ2_KL] * i
        high = np.int32(row[o]) | (np.int32(row[o + 1]) << 8)
        for ib in range(8):
            s = (((np.int32(row[o + 2 + ib % 4]) >> (4 * (ib // 4))) & 15) | (((high >> (2 * ib)) & 3) << 4)) - 32
            if sixteens:
                for half in range(2):
                    sc[16 * i + 2 * ib + half] = s
                    mins[16 * i + 2 * ib + half] = -64 * s
            else:
                mins[8 * i + ib] = -64 * s
                for j in range(16):
                    sc[128 * i + 16 * ib + j] = s
            for j in range(SUB // 2):
                k = (((np.int32(row[o + 6 + 16 * (ib // 2) + j]) >> (4 * (ib % 2))) & 15)
                     | (((np.int32(row[o + 70 + j]) >> ib) & 1) << 4))
                wu[SUPER * i + SUB * ib + 2 * j] = _UNSIGNED_KL[k, 0]
                wu[SUPER * i + SUB * ib + 2 * j + 1] = _UNSIGNED_KL[k, 1]
    return load_f16(row, 0)


@njit(cache=True, nogil=True, inline="always")
def _reduce16(acc: np.ndarray) -> np.float32:
    """GCC's _mm512_reduce_add_ps: the halves added, then the quarters, then (0 + 2) + (1 + 3)."""
    t0 = (acc[12] + acc[4]) + (acc[8] + acc[0])
    t1 = (acc[13] + acc[5]) + (acc[9] + acc[1])
    t2 = (acc[14] + acc[6]) + (acc[10] + acc[2])
    t3 = (acc[15] + acc[7]) + (acc[11] + acc[3])
    return (t0 + t2) + (t1 + t3)


@njit(cache=True, nogil=True, inline="always")
def _scalar_row(row, kind, xu, xd, sub_sums, tokens, m0, m1, wu, sc, mins, lanes, acc):  # type: ignore[no-untyped-def]
    """One row against tokens[m0:m1] in the scalar loop (acc as _block_vector leaves it)."""
    nb = xd.shape[1]
    d = _prepare_row(row, kind, nb, wu, sc, mins)
    for m in range(m0, m1):
        x = tokens[m]
        for i in range(nb):
            for lane in range(8):
                lanes[lane] = mins[8 * i + lane] * sub_sums[m, 8 * i + lane]
            _block_scalar(wu, SUPER * i, xu[x], SUPER * i, sc, 128 * i, lanes, d * xd[x, i],
                          acc[16 * (m - m0) : 16 * (m - m0) + 16])


@njit(cache=True, nogil=True, inline="always")
def _prepare_row_avx2(row: np.ndarray, kind: int, nb: int, wv: np.ndarray, sc: np.ndarray,
                      mins: np.ndarray) -> np.float32:
    """A row as ik's AVX2 kernel holds it: each value's signed grid value (wv) and each sub-block's scale (sc);
    returns the row's scale. IQ4_KS: the shifted grid for a sub-block whose scale byte is odd, the scale that byte
    & 254 minus 127. IQ3_KS: the code's 2 low bits and its third from the high-bit bytes, the shifted half
    of the grid where flag bit 8 + sub-block is set; the scale a nibble (sub-blocks t and t + 4 share byte t) plus
    16 where flag bit sub-block is set, minus 16. IQ2_KS: the unshifted grid plus 32 (unsigned), the sub-block's
    minimum, scale x (its grid half's first value minus that: -32, or -27 where shifted), apart (mins). Both read
    as q8k_direct reads them for the conversion (ks_sub_block, ks_code)."""
    if kind == KIND_IQ2_KS or kind == KIND_IQ3_KS:
        for i in range(nb):
            o = ks_block_at(kind, i)
            for ib in range(8):
                ls, off = ks_sub_block(row, kind, o, ib)
                sc[8 * i + ib] = ls
                if kind == KIND_IQ2_KS:
                    mins[8 * i + ib] = ls * (np.int32(IQ2NL_VALUES[off]) - np.int32(_IQ2KS_UNSIGNED[0]))
                for j in range(SUB):
                    k = ks_code(row, kind, o, ib, j)
                    v = _IQ2KS_UNSIGNED[k] if kind == KIND_IQ2_KS else IQ3NL_VALUES[off + k]
                    wv[SUPER * i + SUB * ib + j] = v
        return load_f16(row, 0)
    for i in range(nb):
        o = 4 + BLOCK_BYTES[KIND_IQ4_KS] * i
        for m in range(8):
            b = np.int32(row[o + m])
            sc[8 * i + m] = (b & 254) - 127
            table = 16 * (b & 1)
            at = SUPER * i + SUB * m
            for j in range(16):
                c = np.int32(row[o + 8 + 16 * m + j])
                wv[at + j] = IQ4K_VALUES[table + (c & 15)]
                wv[at + 16 + j] = IQ4K_VALUES[table + (c >> 4)]
    return load_f32(row, 0)


@njit(cache=True, nogil=True, inline="always")
def _scalar_row_avx2(row, kind, xu, xd, sub_sums, tokens, m0, m1, wv, sc, mins, acc):  # type: ignore[no-untyped-def]
    """One IQ4_KS / IQ3_KS row against tokens[m0:m1] as ik's AVX2 kernel multiplies it (mul_mat_qX_K_q8_K_T,
    multiply_add_avx2): per 256 values 8 int32 lanes, lane l the sum over the 8 sub-blocks of scale x (values
    4 l .. 4 l + 3 times the activation integers), exact (vpmaddubsw's pairs of |value| x +-activation stay below
    32767); then acc[l] = fma(d x the token's scale, float(lane), acc[l]), the 8 accumulators summed as ik's
    hsum_float_8. IQ2_KS first adds each sub-block k's minimum times its 32 activations' sum the same way to acc[k]
    (Scales8KBase::accum_mins)."""
    nb = xd.shape[1]
    d = _prepare_row_avx2(row, kind, nb, wv, sc, mins)
    for m in range(m0, m1):
        x = tokens[m]
        a = acc[8 * (m - m0) : 8 * (m - m0) + 8]
        for i in range(nb):
            dd = d * xd[x, i]
            if kind == KIND_IQ2_KS:
                for k in range(8):
                    a[k] = fmaf(dd, np.float32(mins[8 * i + k] * sub_sums[m, 8 * i + k]), a[k])
            for lane in range(8):
                total = np.int32(0)
                for k in range(8):
                    at = SUPER * i + SUB * k + 4 * lane
                    part = np.int32(0)
                    for t in range(4):
                        part += np.int32(wv[at + t]) * (np.int32(xu[x, at + t]) - 128)
                    total += np.int32(sc[8 * i + k]) * part
                a[lane] = fmaf(dd, np.float32(total), a[lane])


@njit(cache=True, nogil=True, inline="always")
def _pair_lanes(kind: int) -> bool:
    """Whether ik's AVX-512 build multiplies `kind` in mul_mat_qX_K_q8_K_AVX512 (_lanes_iq2_k's lanes)."""
    return kind == KIND_IQ2_K or kind == KIND_Q2_K or kind == KIND_Q3_K


@njit(cache=True, nogil=True, inline="always")
def _sixteens(kind: int) -> bool:
    """Whether `kind` is a type of 16-value sub-blocks and block scales, which ik's AVX-512 build multiplies in
    mul_mat_iqX_k_q8_K_AVX512 or (IQ2_K, Q2_K, Q3_K) mul_mat_qX_K_q8_K_AVX512 (_scalar_row_xk)."""
    return (kind == KIND_IQ2_K or kind == KIND_IQ3_K or kind == KIND_IQ4_K or kind == KIND_IQ5_K
            or kind == KIND_IQ6_K or kind == KIND_IQ4_KSS or kind == KIND_IQ4_XS or _pair_lanes(kind))


@njit(cache=True, nogil=True, inline="always")
def _xk_kernel(kind: int, avx2: bool) -> bool:
    """Whether rows of `kind` take _scalar_row_xk (`avx2`: _scalar_row_xk_avx2, which IQ5_KS and IQ2_KL take too),
    the kernels whose minima multiply 16-value activation sums."""
    return _sixteens(kind) or (avx2 and (kind == KIND_IQ5_KS or kind == KIND_IQ2_KL))


@njit(cache=True, nogil=True, inline="always")
def _xk_code(blk: np.ndarray, kind: int, ib: int, j: int) -> np.int32:
    """The code of value j of 16-value sub-block ib of an IQ2_K / IQ3_K / IQ4_K / IQ5_K / IQ6_K block (its bytes
    blk), as ikquant's decoders read it."""
    h = ib // 2
    if kind == KIND_IQ2_K:
        return (np.int32(blk[12 + 32 * (h // 4) + 16 * (ib % 2) + j]) >> (2 * (h % 4))) & 3
    if kind == KIND_IQ3_K:
        return (((np.int32(blk[14 + 32 * (h // 4) + 16 * (ib % 2) + j]) >> (2 * (h % 4))) & 3)
                | (((np.int32(blk[78 + 16 * (ib % 2) + j]) >> h) & 1) << 2))
    if kind == KIND_IQ4_K:
        return (np.int32(blk[16 + 16 * h + j]) >> (4 * (ib % 2))) & 15
    if kind == KIND_IQ5_K:
        return (((np.int32(blk[16 + 32 * (h // 2) + 16 * (ib % 2) + j]) >> (4 * (h % 2))) & 15)
                | (((np.int32(blk[144 + 16 * (ib % 2) + j]) >> h) & 1) << 4))
    return (((np.int32(blk[20 + 32 * (h // 2) + 16 * (ib % 2) + j]) >> (4 * (h % 2))) & 15)
            | (((np.int32(blk[148 + 32 * (h // 4) + 16 * (ib % 2) + j]) >> (2 * (h % 4))) & 3) << 4))


@njit(cache=True, nogil=True, inline="always")
def _xk_scale(blk: np.ndarray, kind: int, ib: int) -> np.int32:
    """16-value sub-block ib's integer scale: IQ2_K its nibble minus 8; IQ3_K 2 x its nibble + 1, negative where its
    sign bit is set; IQ4_K and IQ5_K 6 bits (a nibble and 2 high bits) minus 32; IQ6_K a signed byte."""
    if kind == KIND_IQ2_K:
        return ((np.int32(blk[4 + ib // 2]) >> (4 * (ib % 2))) & 15) - 8
    if kind == KIND_IQ6_K:
        return np.int32(np.int8(blk[4 + ib]))
    if kind == KIND_IQ3_K:
        ls = 2 * ((np.int32(blk[6 + ib // 2]) >> (4 * (ib % 2))) & 15) + 1
        signs = np.int32(blk[4]) | (np.int32(blk[5]) << 8)
        return -ls if (signs >> ib) & 1 else ls
    ls = ((np.int32(blk[8 + ib // 2]) >> (4 * (ib % 2))) & 15) | (((np.int32(blk[4 + ib // 4]) >> (2 * (ib % 4))) & 3)
                                                                  << 4)
    return ls - 32


@njit(cache=True, nogil=True, inline="always")
def _prepare_row_xk(row: np.ndarray, kind: int, nb: int, wu: np.ndarray, sc: np.ndarray, mins: np.ndarray,
                    dblk: np.ndarray, mblk: np.ndarray, avx2: bool) -> None:
    """An IQ2_K ... IQ6_K row as ik's AVX-512 kernel holds it: every value's unsigned byte, the unshifted grid plus
    XK_BIAS (wu), each 16-value sub-block's scale (sc[16 i + ib]) and minimum, scale x (-bias, + XK_SHIFT where the
    block's flag bit ib shifts the sub-block's grid) (mins), each block's f16 d (dblk) and the factor of its minima
    (mblk: d, but Q2_K's and Q3_K's, _prepare_row_q2_q3_k). IQ4_KSS and IQ4_XS (32-value sub-blocks) fill the same
    arrays: each sub-block's scale and minimum twice. `avx2`: as its AVX2 kernel holds it (wu int16): IQ4_K's,
    IQ5_K's and IQ6_K's values signed, IQ4_K's on the sub-block's grid half (no minima), IQ5_K's and IQ6_K's on the
    unshifted one, their minima scale x the shift; IQ5_KS (_prepare_row_iq5_ks) as IQ4_XS."""
    if kind == KIND_Q2_K or kind == KIND_Q3_K:
        _prepare_row_q2_q3_k(row, kind, nb, wu, sc, mins, dblk, mblk)
        return
    _prepare_row_xk_grid(row, kind, nb, wu, sc, mins, dblk, avx2)
    mblk[:nb] = dblk[:nb]


@njit(cache=True, nogil=True, inline="always")
def _prepare_row_q2_q3_k(row: np.ndarray, kind: int, nb: int, wu: np.ndarray, sc: np.ndarray, mins: np.ndarray,
                         dblk: np.ndarray, mblk: np.ndarray) -> None:
    """A Q2_K or Q3_K row as ik's mul_mat_qX_K_q8_K_AVX512 holds it: value 128 h + 32 l + j of a block from bits 2 l
    of its byte 32 h + j (Q3_K: plus 4 x bit 4 h + l of high-bit byte j), unsigned (0 .. 3, 0 .. 7); Q2_K's
    sub-block scales the low nibbles of its 16 scale bytes, its minima the high ones with factor -dmin; Q3_K's
    scales its 6-bit ones minus 32, its minima the same scales with factor -4 d."""
    for i in range(nb):
        blk = row[BLOCK_BYTES[kind] * i : BLOCK_BYTES[kind] * (i + 1)]
        q2 = 16 if kind == KIND_Q2_K else 32
        for h in range(2):
            for l in range(4):
                for j in range(32):
                    v = (np.int32(blk[q2 + 32 * h + j]) >> (2 * l)) & 3
                    if kind == KIND_Q3_K:
                        v |= ((np.int32(blk[j]) >> (4 * h + l)) & 1) << 2
                    wu[SUPER * i + 128 * h + 32 * l + j] = v
        if kind == KIND_Q2_K:
            dblk[i], mblk[i] = load_f16(blk, 80), -load_f16(blk, 82)
            for ib in range(16):
                sc[16 * i + ib] = np.int32(blk[ib]) & 15
                mins[16 * i + ib] = np.int32(blk[ib]) >> 4
        else:
            dblk[i] = load_f16(blk, 108)
            mblk[i] = np.float32(-4.0) * dblk[i]
            for ib in range(16):
                low = np.int32(blk[96 + ib]) & 15 if ib < 8 else np.int32(blk[96 + ib - 8]) >> 4
                high = (np.int32(blk[104 + ib % 4]) >> (2 * (ib // 4))) & 3
                sc[16 * i + ib] = (low | (high << 4)) - 32
                mins[16 * i + ib] = sc[16 * i + ib]


@njit(cache=True, nogil=True, inline="always")
def _prepare_row_xk_grid(row: np.ndarray, kind: int, nb: int, wu: np.ndarray, sc: np.ndarray, mins: np.ndarray,
                         dblk: np.ndarray, avx2: bool) -> None:
    """_prepare_row_xk of the types on a grid (all but Q2_K and Q3_K; IQ2_KL for ik's AVX2 kernel only)."""
    if kind == KIND_IQ2_KL:
        dblk[:nb] = _prepare_row_iq2_kl(row, nb, wu, sc, mins, True)
        return
    if kind == KIND_IQ4_KSS:
        _prepare_row_iq4_kss(row, nb, wu, sc, mins, dblk)
        return
    if kind == KIND_IQ4_XS:
        _prepare_row_iq4_xs(row, nb, wu, sc, mins, dblk)
        return
    if kind == KIND_IQ5_KS:
        _prepare_row_iq5_ks(row, nb, wu, sc, mins, dblk)
        return
    signed = avx2 and (kind == KIND_IQ4_K or kind == KIND_IQ5_K or kind == KIND_IQ6_K)
    for i in range(nb):
        blk = row[BLOCK_BYTES[kind] * i : BLOCK_BYTES[kind] * (i + 1)]
        dblk[i] = load_f16(blk, 0)
        extra = np.int32(blk[2]) | (np.int32(blk[3]) << 8)
        for ib in range(16):
            s = _xk_scale(blk, kind, ib)
            shifted = (extra >> ib) & 1
            sc[16 * i + ib] = s
            mins[16 * i + ib] = s * (XK_SHIFT[kind] * shifted - (0 if signed else XK_BIAS[kind]))
            # the signed values: the grid itself, IQ4_K's on the sub-block's half (its shift in the values)
            to_signed = XK_BIAS[kind] - (XK_SHIFT[kind] * shifted if kind == KIND_IQ4_K else 0) if signed else 0
            for j in range(16):
                wu[SUPER * i + 16 * ib + j] = _XK_UNSIGNED[kind, _xk_code(blk, kind, ib, j)] - to_signed


@njit(cache=True, nogil=True, inline="always")
def _prepare_row_iq4_kss(row: np.ndarray, nb: int, wu: np.ndarray, sc: np.ndarray, mins: np.ndarray,
                         dblk: np.ndarray) -> None:
    """_prepare_row_xk of IQ4_KSS: word k of a sub-block's 8 gives bit k of its scale byte (IQ4_KS's: byte & 254
    minus 127, the shifted grid where odd) and, as a = its other bits, a ^ (a >> 1), four codes (values 2 k,
    2 k + 16, 2 k + 1, 2 k + 17); a shifted sub-block's 4 go to its minimum, as IQ4_KS's."""
    d = load_f32(row, 0)
    for i in range(nb):
        dblk[i] = d
        o = 4 + BLOCK_BYTES[KIND_IQ4_KSS] * i
        for ib in range(8):
            b = np.int32(0)
            at = SUPER * i + SUB * ib
            for k in range(8):
                word = np.int32(row[o + 16 * ib + 2 * k]) | (np.int32(row[o + 16 * ib + 2 * k + 1]) << 8)
                a = word & 0xFFFE
                a ^= a >> 1
                b |= (word & 1) << k
                for h in range(2):
                    nib = (a >> (8 * h)) & 0xFF
                    wu[at + 2 * k + h] = _UNSIGNED4[nib & 15]
                    wu[at + 16 + 2 * k + h] = _UNSIGNED4[nib >> 4]
            s = (b & 254) - 127
            for half in range(2):
                sc[16 * i + 2 * ib + half] = s
                mins[16 * i + 2 * ib + half] = s * (GRID_SHIFT[KIND_IQ4_KS] * (b & 1) - 128)


@njit(cache=True, nogil=True, inline="always")
def _prepare_row_iq4_xs(row: np.ndarray, nb: int, wu: np.ndarray, sc: np.ndarray, mins: np.ndarray,
                        dblk: np.ndarray) -> None:
    """_prepare_row_xk of IQ4_XS: each sub-block's 6-bit scale minus 32 (a nibble, its 2 high bits in the block's
    16-bit word), its minimum scale x -128 (ik scales the minima's lane by -128 d instead, the same float), the
    codes in the unshifted grid (low nibbles values 0 .. 15, high 16 .. 31)."""
    for i in range(nb):
        o = BLOCK_BYTES[KIND_IQ4_XS] * i
        dblk[i] = load_f16(row, o)
        high = np.int32(row[o + 2]) | (np.int32(row[o + 3]) << 8)
        for ib in range(8):
            s = (((np.int32(row[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 15) | (((high >> (2 * ib)) & 3) << 4)) - 32
            for half in range(2):
                sc[16 * i + 2 * ib + half] = s
                mins[16 * i + 2 * ib + half] = -128 * s
            at = SUPER * i + SUB * ib
            for j in range(16):
                c = np.int32(row[o + 8 + 16 * ib + j])
                wu[at + j] = _UNSIGNED4[c & 15]
                wu[at + 16 + j] = _UNSIGNED4[c >> 4]


@njit(cache=True, nogil=True, inline="always")
def _minima_lanes(mins: np.ndarray, sums16: np.ndarray, i: int, dd: np.float32, a: np.ndarray) -> None:
    """Block i's 8 minima lanes (vpmaddwd of the sub-blocks' minima and the token's 16-value sums: lane j sub-blocks
    2 j and 2 j + 1, exact), each added as a[j] = fma(dd, float(lane), a[j])."""
    for j in range(8):
        total = mins[16 * i + 2 * j] * sums16[16 * i + 2 * j] + mins[16 * i + 2 * j + 1] * sums16[16 * i + 2 * j + 1]
        a[j] = fmaf(dd, np.float32(np.int32(total)), a[j])


@njit(cache=True, nogil=True, inline="always")
def _scalar_row_xk(row, kind, xu, xd, sums16, tokens, m0, m1, wu, sc, mins, dblk, mblk, acc):  # type: ignore[no-untyped-def]
    """One row of a _sixteens type against tokens[m0:m1] as ik's AVX-512 build multiplies it
    (mul_mat_iqX_k_q8_K_AVX512; IQ2_K's lanes: _lanes_iq2_k): per 256 values 16 lanes, lane l summing for
    k = 0 .. 3 the scale of sub-block 4 k + l // 4 times each of vpmaddubsw's two pair sums of values
    64 k + 4 l .. + 3 (unsigned bytes against the activation integers, saturated at 16 bits), and 8 minima lanes
    (_minima_lanes); both added per block as fma(d x the token's scale, float(lane), acc) (the minima: the block's
    minima factor x the token's scale), then the row's result hsum_float_8 of minima lane j + (lane j + lane j + 8).
    acc: per token 8 minima accumulators, then 16."""
    nb = xd.shape[1]
    _prepare_row_xk(row, kind, nb, wu, sc, mins, dblk, mblk, False)
    for m in range(m0, m1):
        x = tokens[m]
        a = acc[24 * (m - m0) : 24 * (m - m0) + 24]
        for i in range(nb):
            dd = dblk[i] * xd[x, i]
            _minima_lanes(mins, sums16[m], i, mblk[i] * xd[x, i], a)
            if _pair_lanes(kind):
                _lanes_iq2_k(wu, xu[x], sc, i, dd, a)
                continue
            for lane in range(16):
                total = np.int64(0)
                for k in range(4):
                    s = np.int64(sc[16 * i + 4 * k + lane // 4])
                    for half in range(2):
                        at = SUPER * i + 64 * k + 4 * lane + 2 * half
                        pair = (np.int32(wu[at]) * (np.int32(xu[x, at]) - 128)
                                + np.int32(wu[at + 1]) * (np.int32(xu[x, at + 1]) - 128))
                        total += min(32767, max(-32768, pair)) * s
                a[8 + lane] = fmaf(dd, np.float32(np.int32(total)), a[8 + lane])


@njit(cache=True, nogil=True, inline="always")
def _lanes_iq2_k(wu: np.ndarray, xu: np.ndarray, sc: np.ndarray, i: int, dd: np.float32, a: np.ndarray) -> None:
    """Block i's 16 lanes of IQ2_K's, Q2_K's and Q3_K's kernel (mul_mat_qX_K_q8_K_AVX512: vpdpbusd's 4-value sums,
    packed to 16 bits two 64-value groups at a time, vpdpwssd with the scales), exact: lane 4 c + q sums, over the groups g = q // 2
    and 2 + q // 2, sub-block 4 g + c's scale times its values 8 (q % 2) .. + 7; a[8 + lane] = fma(dd,
    float(lane), a[8 + lane])."""
    for lane in range(16):
        c, q = lane // 4, lane % 4
        total = np.int32(0)
        for g in (q // 2, 2 + q // 2):
            at = SUPER * i + 64 * g + 16 * c + 8 * (q % 2)
            part = np.int32(0)
            for t in range(8):
                part += np.int32(wu[at + t]) * (np.int32(xu[at + t]) - 128)
            total += np.int32(sc[16 * i + 4 * g + c]) * part
        a[8 + lane] = fmaf(dd, np.float32(total), a[8 + lane])


@njit(cache=True, nogil=True, inline="always")
def _prepare_row_iq5_ks(row: np.ndarray, nb: int, wu: np.ndarray, sc: np.ndarray, mins: np.ndarray,
                        dblk: np.ndarray) -> None:
    """_prepare_row_xk of IQ5_KS for ik's AVX2 kernel (the row's f32 d; IQ4_XS's layout of scales and minima): each
    sub-block's scale byte & 254 minus 127, its minimum scale x (-128, + 2 where the byte is odd), the 5-bit codes
    in the unshifted grid plus 128."""
    d = load_f32(row, 0)
    for i in range(nb):
        o = 4 + BLOCK_BYTES[KIND_IQ5_KS] * i
        dblk[i] = d
        for ib in range(8):
            b = np.int32(row[o + ib])
            s = (b & 254) - 127
            for half in range(2):
                sc[16 * i + 2 * ib + half] = s
                mins[16 * i + 2 * ib + half] = s * (GRID_SHIFT[KIND_IQ5_KS] * (b & 1) - 128)
            for j in range(SUB):
                wu[SUPER * i + SUB * ib + j] = _iq5_ks_unsigned(row, o, ib, j)


@njit(cache=True, nogil=True, inline="always")
def _scalar_row_xk_avx2(row, kind, xu, xd, sums16, tokens, m0, m1, wv, sc, mins, dblk, mblk, acc):  # type: ignore[no-untyped-def]
    """One IQ2_K ... IQ6_K, Q2_K, Q3_K, IQ5_KS, IQ4_XS, IQ4_KSS or IQ2_KL row against tokens[m0:m1] as ik's AVX2
    build multiplies it (mul_mat_qY_K_q8_K_T / mul_mat_qX_K_q8_K_T, multiply_add / multiply_add_avx2): per block, but
    for IQ4_K, minima lane j (sub-blocks 2 j and 2 j + 1 times their 16 activations' sums) added first as fma(the
    block's minima factor x the token's scale, float(lane), acc[j]); then 8 lanes, lane l summing over the 8 groups
    of 32 values the scale of sub-block 2 g + l // 4 times values 32 g + 4 l .. + 3 times the activation integers
    (vpmaddubsw's pair sums, which saturate at 16 bits only for the unsigned values of IQ5_KS, IQ4_XS, IQ4_KSS and
    IQ2_KL), each added as fma(d x the token's scale, float(lane), acc); the row's result hsum_float_8(acc)."""
    nb = xd.shape[1]
    _prepare_row_xk(row, kind, nb, wv, sc, mins, dblk, mblk, True)
    for m in range(m0, m1):
        x = tokens[m]
        a = acc[8 * (m - m0) : 8 * (m - m0) + 8]
        for i in range(nb):
            dd = dblk[i] * xd[x, i]
            if kind != KIND_IQ4_K:
                _minima_lanes(mins, sums16[m], i, mblk[i] * xd[x, i], a)
            for lane in range(8):
                total = np.int32(0)
                for g in range(8):
                    at = SUPER * i + 32 * g + 4 * lane
                    part = np.int32(0)
                    for t in range(0, 4, 2):
                        pair = (np.int32(wv[at + t]) * (np.int32(xu[x, at + t]) - 128)
                                + np.int32(wv[at + t + 1]) * (np.int32(xu[x, at + t + 1]) - 128))
                        part += min(32767, max(-32768, pair))
                    total += np.int32(sc[16 * i + 2 * g + lane // 4]) * part
                a[lane] = fmaf(dd, np.float32(total), a[lane])


@njit(cache=True, nogil=True, inline="always")
def _hsum_xk(a: np.ndarray) -> np.float32:
    """The row's result from _scalar_row_xk's accumulators a[:24] (consumed: the first 8 take the sums):
    hsum_float_8(minima + (low half + high half))."""
    for j in range(8):
        a[j] = a[j] + (a[8 + j] + a[16 + j])
    return hsum_float_8(a[:8])


@njit(cache=True, nogil=True, inline="always")
def _task(raw, which, kind, xu, xd, sub_sums, tokens, row_at, out, task, n_rows, vector, wu, sc,  # type: ignore[no-untyped-def]
          mins, lanes, acc, avx2, wv, sc8, dblk, mblk):
    """Weight rows ROW_TILE x t .. of matrix j (task = j x tiles + t; raw's matrix which[j]) against matrix j's
    tokens, row by row."""
    tiles = -(-n_rows // ROW_TILE)
    j, t = task // tiles, task % tiles
    m0, m1 = row_at[j], row_at[j + 1]
    if m0 == m1:
        return
    nb, n = xd.shape[1], xu.shape[1]
    xu_flat, sums_flat, xd_flat = xu.reshape(-1), sub_sums.reshape(-1), xd.reshape(-1)
    for r in range(t * ROW_TILE, min(n_rows, (t + 1) * ROW_TILE)):
        row = raw[which[j], r]
        if avx2 and _xk_kernel(kind, avx2):
            acc[: 8 * (m1 - m0)] = 0
            _scalar_row_xk_avx2(row, kind, xu, xd, sub_sums, tokens, m0, m1, wv, sc, mins, dblk, mblk, acc)
            for m in range(m0, m1):
                out[m, r] = hsum_float_8(acc[8 * (m - m0) : 8 * (m - m0) + 8])
            continue
        if _sixteens(kind):
            acc[: 24 * (m1 - m0)] = 0
            _scalar_row_xk(row, kind, xu, xd, sub_sums, tokens, m0, m1, wu, sc, mins, dblk, mblk, acc)
            for m in range(m0, m1):
                out[m, r] = _hsum_xk(acc[24 * (m - m0) : 24 * (m - m0) + 24])
            continue
        if avx2:
            acc[: 8 * (m1 - m0)] = 0
            _scalar_row_avx2(row, kind, xu, xd, sub_sums, tokens, m0, m1, wv, sc8, mins, acc)
            for m in range(m0, m1):
                out[m, r] = hsum_float_8(acc[8 * (m - m0) : 8 * (m - m0) + 8])
            continue
        acc[: 16 * (m1 - m0)] = 0
        if vector and (kind == KIND_IQ4_KS or kind == KIND_IQ5_KS):
            d = load_f32(row, 0)
            for i in range(nb):
                if kind == KIND_IQ4_KS:
                    _block_fast4(row, 4 + BLOCK_BYTES[kind] * i, d, xu_flat, n, tokens, m0, m1, sums_flat, nb * 8,
                                 xd_flat, nb, i, acc)
                else:
                    _block_fast5(row, 4 + BLOCK_BYTES[kind] * i, d, xu_flat, n, tokens, m0, m1, sums_flat, nb * 8,
                                 xd_flat, nb, i, acc)
        else:
            _scalar_row(row, kind, xu, xd, sub_sums, tokens, m0, m1, wu, sc, mins, lanes, acc)
        for m in range(m0, m1):
            out[m, r] = _reduce16(acc[16 * (m - m0) : 16 * (m - m0) + 16])


@njit(cache=True, nogil=True, parallel=True)
def _matmuls(raw, which, kind, xu, xd, sub_sums, tokens, row_at, out, vector, most,  # type: ignore[no-untyped-def]
             threads, avx2):
    """Every (matrix, row tile) task, claimed by the threads (ikrun/ops/parallel.py); `most`: the most tokens a
    matrix takes; `avx2`: ik's AVX2 build's kernel."""
    n_rows, nb = raw.shape[1], xd.shape[1]
    tasks = (len(row_at) - 1) * -(-n_rows // ROW_TILE)
    per, counter = task_items(tasks, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        wu = np.empty(nb * SUPER, np.uint8)
        sc = np.empty(nb * 128, np.int16)
        mins = np.empty(nb * 16, np.int32)
        lanes = np.zeros(16, np.int32)
        acc = np.empty(24 * most, np.float32)
        wv = np.empty(nb * SUPER, np.int16)
        sc8 = np.empty(nb * 8, np.int16)
        dblk = np.empty(nb, np.float32)
        mblk = np.empty(nb, np.float32)
        t0, t1 = claim_items(counter, per, tasks)
        while t0 < t1:
            for task in range(t0, t1):
                _task(raw, which, kind, xu, xd, sub_sums, tokens, row_at, out, task, n_rows, vector, wu, sc, mins,
                      lanes, acc, avx2, wv, sc8, dblk, mblk)
            t0, t1 = claim_items(counter, per, tasks)


@njit(cache=True, nogil=True)
def sub_block_sums(xu: np.ndarray, tokens: np.ndarray, sums: np.ndarray) -> None:
    """The sum of each 32 (or, for sums twice as wide, 16) activation integers of the rows `tokens` (what the
    minima multiply)."""
    width = xu.shape[1] // sums.shape[1]
    for m in range(len(tokens)):
        row = xu[tokens[m]]
        for b in range(sums.shape[1]):
            total = 0
            for j in range(width):
                total += int(row[width * b + j]) - 128
            sums[m, b] = total


def iqk_matmuls(x: IntRows, raw: np.ndarray, tokens: np.ndarray, row_at: np.ndarray, type_name: str,
                vector: bool = HAS_AVX512BW, which: np.ndarray | None = None, avx2: bool = False) -> np.ndarray:
    """Rows `tokens` of the Q8_K activations x times matrices of `type_name` (NATIVE_TYPES) as ik's own kernel
    computes them: matrix j (raw [E, rows, row bytes], the file's rows; with `which`, raw's matrix which[j]) takes
    tokens[row_at[j] : row_at[j + 1]]; float32 [len(tokens), rows]. `vector` False (or a CPU without AVX-512BW):
    the scalar loop (the same bits). `avx2`: its AVX2 build's kernel."""
    if type_name not in NATIVE_TYPES:
        raise ValueError(f"ik's own kernel of {type_name} is not reproduced here (only {', '.join(NATIVE_TYPES)})")
    if x.block != SUPER:
        raise ValueError(f"ik's {type_name} kernel takes Q8_K activations (blocks of {SUPER}), not blocks of "
                         f"{x.block}")
    raw = read_only(np.ascontiguousarray(raw))
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    row_at = np.ascontiguousarray(row_at, dtype=np.int64)
    sixteens = _xk_kernel(NATIVE_TYPES[type_name], avx2)
    sums = np.empty((len(tokens), x.u.shape[1] // (16 if sixteens else SUB)), np.int32)
    sub_block_sums(x.u, tokens, sums)
    out = np.empty((len(tokens), raw.shape[1]), np.float32)
    most = int(np.diff(row_at).max(initial=0))
    which = np.arange(raw.shape[0], dtype=np.int64) if which is None else np.ascontiguousarray(which, np.int64)
    _matmuls(raw, which, NATIVE_TYPES[type_name], x.u, x.scale, sums, tokens, row_at, out,
             vector and HAS_AVX512BW, most, get_num_threads(), avx2)
    return out


def iqk_matmul(x: IntRows, raw: np.ndarray, type_name: str, vector: bool = HAS_AVX512BW,
               avx2: bool = False) -> np.ndarray:
    """x (Q8_K rows) @ a matrix's rows `raw` [rows, row bytes]^T of `type_name` in ik's own kernel (`avx2`: its
    AVX2 build's): float32 [x.rows, rows]."""
    return iqk_matmuls(x, raw[None], np.arange(x.rows, dtype=np.int64), np.array([0, x.rows], np.int64),
                       type_name, vector, avx2=avx2)
