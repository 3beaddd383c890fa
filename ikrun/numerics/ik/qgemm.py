"""Integer matmul for `--numerics ik`: int8 weights with a scale per block of values times int8 activation rows.

ik's CPU backend multiplies a quantized weight in integers: the weight's values (or what its kernel converts them
to) are int8 with one float scale per block of 32 or 256 values of a row, the activation rows are rounded to int8
blocks of the same length (ikrun/numerics/ik/formats.py), each block's integer dot product is exact, and the float result
sums, block by block, isum * (weight scale * activation scale) (+ offset * activation block sum for Q8_1 weights),
in the float order of the ik kernel that multiplies the weights (ORDER_*: its fused multiply-adds, its unsigned
weights' corrections). That is what this kernel computes, so `--numerics ik` is both ik's arithmetic, bit for bit,
and its speed class.

The weights are packed 16 rows a group: per block and per step of 4 values, the 16 rows' 4 values form one 64-byte
vector. On a CPU with AVX-512 VNNI one `vpdpbusd` multiplies that vector by 4 activation values broadcast to every
lane (unsigned: the activation plus 128, corrected by 128 x the block's weight sum), so 16 rows accumulate at once
and nothing is summed across lanes. Without VNNI, on AVX2, the same tile kernels sum each lane's 4 byte products
with vpmaddwd (bytes widened to 16 bits, pairs multiplied and summed in 32: exact integers as vpdpbusd's), one
weight group and two rows a pass so the accumulators stay in the 16 registers; on other CPUs in plain vector code
that LLVM lowers as it can. A scalar loop computes the same integers and the same
float operations in the same order (the reference the tile kernels are tested against), so all give identical
bits; at any thread count too, since a thread owns whole 16-row groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from ikquant.cpu import host_has
from ikquant.formats.numeric import fmaf
from ikrun.ops.parallel import TASKS_PER_THREAD, claim, claim_items, pick, task_items
from ikrun.ops.simd import splat

#: the float order of a block's contribution: ORDER_PLAIN acc += f32(isum) x (w scale x a scale); ORDER_R8 ik's Q8_0_R8 gemm: the weights made unsigned (+127), acc = fma(w scale x a scale, f32(isum + 127 x
#: a's integer sum), acc), a second acc1 = fma(w scale, a scale x a's integer sum, acc1), and at the end
#: fma(-127, acc1, acc); ORDER_R16 ik's Q8_K_R16 gemm: the weights unsigned (+128), per block acc = fma(w scale x a
#: scale, f32(isum + 128 x a's integer sum), acc) then acc = fma(w scale x -128, a scale x a's integer sum, acc)
#: ORDER_Q8_1 ik's Q8_1 gemm (Q4_K, Q5_K converted), four blocks at a time: acc = fma(offset, a scale x a's integer
#: sum, acc) for each of the four, then acc = fma(w scale x a scale, f32(isum), acc) for each; ORDER_QX_0_NATIVE ik's
#: own kernel of the 32-value block types (Q8_0, Q4_0, Q5_0, Q6_0, IQ4_NL, MXFP4; below the activation rows it
#: converts them from): the weights made unsigned (+ the type's bias, BlockInts.bias), eight accumulators, a block of
#: a group of four adding its first 16 products to accumulator j and its last 16 to 4 + j (j its place in the
#: group), d = w scale x a scale as fma(d, f32(half sum), acc), and its correction (w scale x -bias) x (a scale x a's
#: integer sum) to a sum of its own (accm[j]); a block past the last whole group adds its eight 4-value sums to the
#: eight accumulators and a quarter of its correction to each accm; at the end (acc[j] + acc[4 + j]) + accm[j],
#: summed (0 + 2) + (1 + 3); ORDER_R8_AVX2 ik's Q8_0_R8 gemm in its AVX2 build, and its Q8_K_R8 gemm (256-value
#: blocks; the AVX-512 build's Q8_K_R16): signed weights, per block acc = fma(w scale x a scale, f32(isum), acc); ORDER_Q8_1_AVX2 ik's Q8_1_R8 gemm in its AVX2 build (Q4_1, Q5_1
#: converted): ORDER_Q8_1's offsets of four blocks first, then per block its first and its last 16 products each
#: acc = fma(w scale x a scale, f32(half sum), acc); the blocks past the last whole group of four add nothing (the
#: kernel has no loop for them); ORDER_QX_0_AVX2 ik's own Q8_0 kernel in its AVX2 build: ORDER_QX_0_NATIVE's eight
#: accumulators on the signed weights (no bias, no correction sums), at the end (acc[j] + acc[4 + j]) summed
#: (0 + 2) + (1 + 3)
ORDER_PLAIN, ORDER_R8, ORDER_R16, ORDER_Q8_1, ORDER_QX_0_NATIVE, ORDER_R8_AVX2, ORDER_Q8_1_AVX2 = 0, 1, 2, 3, 4, 5, 6
ORDER_QX_0_AVX2 = 7
LANES = 16  # weight rows per packed group: one 512-bit vector of int32 lanes
TILE = 4  # activation rows per kernel call, sharing each weight vector
GROUPS = 2  # weight groups per kernel call, sharing each activation broadcast
CHAINS = 2  # independent integer accumulators per block and lane
PANEL_BYTES = 256 << 10
K_BYTES = 512  # values of a row per pass of the weight groups over a panel
_I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16I, _V16F = ir.VectorType(_I32, LANES), ir.VectorType(_F32, LANES)


HAS_VNNI = host_has("avx512vnni")
HAS_AVX2 = host_has("avx2")
#: the tiles of _make_tile multiply in AVX2's signed byte products (host_signed_dot)
SIGNED_TILES = HAS_AVX2 and not HAS_VNNI


@dataclass(frozen=True)
class BlockInts:
    """A weight as ik's integer kernels hold it: int8 values q [rows, n] (wider integers where only the float path
    multiplies them), a float32 scale per block of `block` values of a row [rows, n // block], and for Q8_1 weights
    an offset per block added to every value."""

    q: np.ndarray
    scale: np.ndarray
    block: int
    offset: np.ndarray | None = None
    #: the float order of ik's gemm that multiplies them (ORDER_*)
    order: int = ORDER_PLAIN
    #: ORDER_QX_0_NATIVE: what ik's kernel adds to every value to make it unsigned (Q8_0 127, Q4_0 8, ...)
    bias: int = 0

    def to_float(self) -> np.ndarray:
        """The weight as float32 [rows, n]: scale x q (+ offset), every value exact."""
        shape = (*self.scale.shape, self.block)
        w = self.scale[..., None] * self.q.reshape(shape).astype(np.float32)
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.reshape(self.q.shape).astype(np.float32)


@dataclass(frozen=True)
class PackedInts:
    """BlockInts in the kernel's layout: rows padded to whole kernel calls (GROUPS x 16 rows); per group, block and
    4-value step the 16 rows' values (q; ORDER_QX_0_NATIVE: + bias, unsigned), per group and block the 16 rows'
    scales, offsets (ORDER_QX_0_NATIVE: scale x -bias) and 128 x block sums (corr)."""

    q: np.ndarray
    scale: np.ndarray
    corr: np.ndarray
    offset: np.ndarray
    rows: int
    n: int
    block: int
    order: int = ORDER_PLAIN
    #: a value is -128, beyond what AVX2's signed byte products sum exactly (_DOT_SIGN): the scalar kernel takes it
    full_range: bool = False

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + self.corr.nbytes + self.offset.nbytes

    @property
    def has_offset(self) -> bool:
        return self.offset.size > 0


@dataclass(frozen=True)
class PackedHeads:
    """A weight's equal row slices (one per attention head), each packed for qmatmul."""

    heads: tuple[PackedInts, ...]

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.heads)


def row_slice(w: BlockInts, r0: int, r1: int) -> BlockInts:
    """Rows r0 .. r1 - 1 of w."""
    return BlockInts(q=w.q[r0:r1], scale=w.scale[r0:r1], block=w.block,
                     offset=None if w.offset is None else w.offset[r0:r1], order=w.order, bias=w.bias)


def _by_group(a: np.ndarray, groups: int) -> np.ndarray:
    """[rows, nb] per-block values -> flat [group, nb, 16]."""
    return np.ascontiguousarray(a.reshape(groups, LANES, -1).transpose(0, 2, 1)).reshape(-1)


def pack(w: BlockInts) -> PackedInts:
    """Lay `w` out for `qmatmul` (padding rows have zero values and scales, so they add nothing)."""
    rows, n = w.q.shape
    pad = -rows % (GROUPS * LANES)
    groups, nb = (rows + pad) // LANES, n // w.block

    def padded(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a, np.zeros((pad, a.shape[1]), a.dtype)]) if pad else a

    q = padded(np.ascontiguousarray(w.q, dtype=np.int8))
    offset = np.empty(0, np.float32) if w.offset is None else _by_group(padded(w.offset).astype(np.float32), groups)
    if w.order == ORDER_QX_0_NATIVE:  # ik's kernel multiplies the values + bias as bytes (wrapping, as ik adds them)
        q = (q.view(np.uint8) + np.uint8(w.bias)).view(np.int8)
        offset = _by_group(padded(w.scale * np.float32(-w.bias)), groups)  # its float32 product, rounded once
    packed = np.empty(q.size, np.int8)
    corr = np.empty(groups * nb * LANES, np.int32)
    low = np.zeros(groups, np.uint8)
    _pack_groups(q, q.view(np.int32), w.block, packed.view(np.int32), corr, low, get_num_threads())
    return PackedInts(q=packed, scale=_by_group(padded(w.scale), groups), corr=corr, offset=offset, rows=rows, n=n,
                      block=w.block, order=w.order, full_range=bool(low.any()))


@njit(cache=True, nogil=True, parallel=True)
def _pack_groups(q: np.ndarray, q4: np.ndarray, block: int, out4: np.ndarray, corr: np.ndarray, low: np.ndarray,
                 threads: int) -> None:
    """q [rows, n] (q4: its 4-value steps as int32) into out4 [group, block, step, 16 rows] (4 values each),
    corr [group, block, 16] = 128 x block sums, and low[group] = 1 where a value is -128; the groups in tasks the
    threads claim (ikrun/ops/parallel.py). The value loops index q flat with unsigned offsets: with a row's
    signed indices LLVM left them scalar (0.8-0.9 ns a value; now 0.1)."""
    n = q.shape[1]
    nb, steps = n // block, n // 4
    flat = q.reshape(-1)
    items = q.shape[0] // LANES
    per, counter = task_items(items, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        i0, i1 = claim_items(counter, per, items)
        while i0 < i1:
            for g in range(i0, i1):
                base = g * steps * LANES
                for j in range(steps):
                    for r in range(LANES):
                        out4[base + j * LANES + r] = q4[g * LANES + r, j]
                for r in range(LANES):
                    for b in range(nb):
                        start = np.uint64((g * LANES + r) * n + b * block)
                        total = np.int32(0)
                        for k in range(np.uint64(block)):
                            total += np.int32(flat[start + np.uint64(k)])
                        corr[(g * nb + b) * LANES + r] = 128 * total
                least = np.int8(0)
                start = np.uint64(g * LANES * n)
                for k in range(np.uint64(LANES * n)):
                    least = min(least, flat[start + np.uint64(k)])
                low[g] = least == -128
            i0, i1 = claim_items(counter, per, items)


def _vector(builder: ir.IRBuilder, base: ir.Value, index: ir.Value, vty: ir.VectorType) -> ir.Value:
    return builder.load(builder.bitcast(builder.gep(base, [index]), vty.as_pointer()), align=1)


@dataclass(frozen=True)
class _Dot:
    """How a tile sums 4-byte products per lane: an accumulator's zero, one step acc + u x s (64 unsigned bytes
    times 64 signed ones), the finished [16] int32 sums of an accumulator, and how many weight groups and
    activation rows of a call one pass over the blocks takes (as many as keep the accumulators in registers)."""

    zero: ir.Constant
    step: Callable[[ir.IRBuilder, ir.Value, ir.Value, ir.Value], ir.Value]
    finish: Callable[[ir.IRBuilder, ir.Value], ir.Value]
    pass_groups: int = 2
    pass_rows: int = 4
    #: the step sums (u - 128) x s, the activations' bytes signed again: no 128 x weight-sum correction follows
    signed: bool = False


def _dot_vnni(builder: ir.IRBuilder) -> _Dot:
    """vpdpbusd itself (AVX-512 VNNI): its accumulator is the sums."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16I, [_V16I, _V16I, _V16I]),
                                        "llvm.x86.avx512.vpdpbusd.512")
    return _Dot(ir.Constant(_V16I, [0] * LANES), lambda b, acc, unsigned, signed: b.call(fn, [acc, unsigned, signed]),
                lambda b, acc: acc)


_V32I = ir.VectorType(_I32, 2 * LANES)


def _pair_step(builder: ir.IRBuilder, acc: ir.Value, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
    """acc [32] + the sums of byte pairs 2p, 2p + 1 of u x s, widened to 16 bits (exact: |255 x 128| < 2^15) and
    multiplied in 32: the pattern LLVM lowers to vpmaddwd."""
    i16 = ir.IntType(16)
    v64, w64 = ir.VectorType(ir.IntType(8), 64), ir.VectorType(i16, 64)
    u = builder.zext(builder.bitcast(unsigned, v64), w64)
    s = builder.sext(builder.bitcast(signed, v64), w64)
    undef = ir.Constant(w64, ir.Undefined)

    def products(parity: int) -> ir.Value:
        pick = ir.Constant(_V32I, [2 * p + parity for p in range(2 * LANES)])
        return builder.mul(builder.sext(builder.shuffle_vector(u, undef, pick), _V32I),
                           builder.sext(builder.shuffle_vector(s, undef, pick), _V32I))

    return builder.add(acc, builder.add(products(0), products(1)))


def _pair_finish(builder: ir.IRBuilder, acc: ir.Value) -> ir.Value:
    """Lane r's sum: its two pair sums (2r, 2r + 1), added once per block rather than per step."""
    undef = ir.Constant(_V32I, ir.Undefined)
    halves = [builder.shuffle_vector(acc, undef, ir.Constant(_V16I, [2 * r + h for r in range(LANES)]))
              for h in range(2)]
    return builder.add(halves[0], halves[1])


#: vpdpbusd's integers in plain vector code, for CPUs without VNNI: pair sums accumulated in 32 lanes, each
#: lane's two added when the block is done; all integers exact, so the sums are vpdpbusd's to the bit. A pass
#: takes one weight group and two rows (a 32-lane accumulator is 4 of AVX2's registers)
_DOT_PAIRS = _Dot(ir.Constant(_V32I, [0] * 2 * LANES), _pair_step, _pair_finish, 1, 2)


def _pmadd_step(builder: ir.IRBuilder, acc: ir.Value, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
    """_pair_step with AVX2's vpmaddwd called directly: each quarter of the 64 bytes (4 rows' 4 values) widened to
    16 x 16 bits, one vpmaddwd giving those 4 rows' two pair sums (a broadcast activation is widened once)."""
    i8, i16 = ir.IntType(8), ir.IntType(16)
    v16s, v8i = ir.VectorType(i16, 16), ir.VectorType(_I32, 8)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8i, [v16s, v16s]), "llvm.x86.avx2.pmadd.wd")
    u, s = (builder.bitcast(v, ir.VectorType(i8, 64)) for v in (unsigned, signed))
    undef = ir.Constant(ir.VectorType(i8, 64), ir.Undefined)

    def quarter(v: ir.Value, q: int) -> ir.Value:
        return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, 16), list(range(16 * q, 16 * q + 16))))

    parts = [builder.call(fn, [builder.zext(quarter(u, q), v16s), builder.sext(quarter(s, q), v16s)])
             for q in range(4)]
    halves = [builder.shuffle_vector(parts[2 * h], parts[2 * h + 1], ir.Constant(_V16I, list(range(16))))
              for h in range(2)]
    return builder.add(acc, builder.shuffle_vector(halves[0], halves[1], ir.Constant(_V32I, list(range(32)))))


#: the same integers and layout as _DOT_PAIRS, from vpmaddwd itself (AVX2)
_DOT_PMADD = _Dot(ir.Constant(_V32I, [0] * 2 * LANES), _pmadd_step, _pair_finish, 1, 2)


def _sign_step(builder: ir.IRBuilder, acc: ir.Value, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
    """acc [16] + each lane's 4 products (u - 128) x s as AVX2 multiplies signed bytes (ik's own AVX2 kernels):
    per 32-byte half, vpsignb gives s the sign of a = u - 128, vpmaddubsw multiplies |a| by it in pairs summed to 16
    bits, vpmaddwd by ones sums the pairs to 32. Exact while s > -128: a pair is at most 2 x 128 x 127 < 2^15
    (`PackedInts.full_range` sends weights holding -128 to the scalar kernel). The halves are taken as 8 int32
    lanes before any byte operation: on an AVX-512 target, LLVM's instruction selection of the same code over 64
    bytes split into halves afterwards ran for minutes."""
    i1, i8, i16 = ir.IntType(1), ir.IntType(8), ir.IntType(16)
    v32b, v16s, v8i = ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(_I32, 8)
    module = builder.module
    psign = cgutils.get_or_insert_function(module, ir.FunctionType(v32b, [v32b, v32b]), "llvm.x86.avx2.psign.b")
    maddubs = cgutils.get_or_insert_function(module, ir.FunctionType(v16s, [v32b, v32b]),
                                             "llvm.x86.avx2.pmadd.ub.sw")
    madd = cgutils.get_or_insert_function(module, ir.FunctionType(v8i, [v16s, v16s]), "llvm.x86.avx2.pmadd.wd")
    absolute = cgutils.get_or_insert_function(module, ir.FunctionType(v32b, [v32b, i1]), "llvm.abs.v32i8")
    undef, ones = ir.Constant(_V16I, ir.Undefined), ir.Constant(v16s, [1] * 16)

    def half(v: ir.Value, h: int) -> ir.Value:
        return builder.bitcast(builder.shuffle_vector(v, undef, ir.Constant(v8i, list(range(8 * h, 8 * h + 8)))), v32b)

    sums = []
    for h in range(2):
        a_h = builder.xor(half(unsigned, h), ir.Constant(v32b, [-128] * 32))
        pairs = builder.call(maddubs, [builder.call(absolute, [a_h, ir.Constant(i1, 0)]),
                                       builder.call(psign, [half(signed, h), a_h])])
        sums.append(builder.call(madd, [pairs, ones]))
    return builder.add(acc, builder.shuffle_vector(sums[0], sums[1], ir.Constant(_V16I, list(range(16)))))


#: the exact sums of (u - 128) x s per lane from AVX2's signed byte products: one weight group and four rows a
#: pass (a 16-lane accumulator is 2 of AVX2's registers)
_DOT_SIGN = _Dot(ir.Constant(_V16I, [0] * LANES), _sign_step, lambda builder, acc: acc, 1, 4, signed=True)


def host_dot(builder: ir.IRBuilder) -> _Dot:
    """The byte dot products the host runs fastest: vpdpbusd (AVX-512 VNNI), vpmaddwd (AVX2), else plain vector
    code."""
    return _dot_vnni(builder) if HAS_VNNI else _DOT_PMADD if HAS_AVX2 else _DOT_PAIRS


def host_signed_dot(builder: ir.IRBuilder) -> _Dot:
    """host_dot for tiles whose activations are the unsigned operand and whose weights stay above -128: AVX2's
    signed byte products there (_DOT_SIGN)."""
    return _DOT_SIGN if SIGNED_TILES else host_dot(builder)


@dataclass(frozen=True)
class _TileArgs:
    """What a tile's code generator works with: the LLVM builder, the data pointers of the kernel's arrays, its
    scalar arguments, and emitters for the byte dot products (vpdpbusd or its equivalent), the fused multiply-add
    and 64-bit constants."""

    builder: ir.IRBuilder
    wq: ir.Value
    ws: ir.Value
    wcorr: ir.Value
    wofs: ir.Value
    au: ir.Value
    asc: ir.Value
    asum: ir.Value
    aisum: ir.Value
    out: ir.Value
    g: ir.Value
    m0: ir.Value
    b0: ir.Value
    b1: ir.Value
    nb: ir.Value
    n: ir.Value
    dots: _Dot
    fma_fn: ir.Function

    def fma(self, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
        return self.builder.call(self.fma_fn, [a, b, c])

    def dot(self, acc: ir.Value, unsigned: ir.Value, signed: ir.Value) -> ir.Value:
        return self.dots.step(self.builder, acc, unsigned, signed)

    def dot_total(self, acc: ir.Value) -> ir.Value:
        """An accumulator's [16] int32 sums."""
        return self.dots.finish(self.builder, acc)

    def groups(self) -> list[ir.Value]:
        """The call's weight groups: GROUPS x g + h."""
        return [self.builder.add(self.builder.mul(self.g, _const(GROUPS)), _const(h)) for h in range(GROUPS)]

    def rows(self) -> list[ir.Value]:
        """The call's activation rows: m0 + i."""
        return [self.builder.add(self.m0, _const(i)) for i in range(TILE)]


def _const(v: int) -> ir.Constant:
    return ir.Constant(_I64, v)


def _tile_intrinsic(emit: Callable[[_TileArgs], None],  # type: ignore[no-untyped-def]
                    dot: Callable[[ir.IRBuilder], _Dot] = host_dot):
    """A tile kernel (wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, m0, b0, b1, nb, n) whose body `emit`
    generates, its byte dot products those `dot` emits."""

    @intrinsic
    def tile(typingctx, wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, m0, b0, b1, nb,  # type: ignore[no-untyped-def]
             n):
        sig = types.void(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, *[types.int64] * 6)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            arrays = [context.make_array(ty)(context, builder, value=v).data
                      for ty, v in zip(signature.args[:9], args[:9])]
            dots = dot(builder)
            fma_fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_V16F, [_V16F, _V16F, _V16F]), "llvm.fma.v16f32")
            emit(_TileArgs(builder, *arrays, *args[9:], dots, fma_fn))
            return context.get_dummy_value()

        return sig, codegen

    return tile


def _make_tile(block: int, order: int = ORDER_PLAIN,  # type: ignore[no-untyped-def]
               dot: Callable[[ir.IRBuilder], _Dot] = host_signed_dot):
    """The tile micro-kernel for weight groups GROUPS x g .. GROUPS x g + GROUPS - 1 and activation rows m0 ..
    m0 + TILE - 1, blocks b0 .. b1 of the row, added to what out holds (from b0 = 0: written, out not read): per
    block f32(isum - corr) x (scale x a_scale[m, b]) (ORDER_Q8_1: + offset x a_sum[m, b]) for each group h, in the
    float order `order` (ORDER_R8: a call takes the whole row, its two sums meet at the end; ORDER_Q8_1 takes the
    blocks four at a time, offsets first). Each block's integer sum is split over CHAINS accumulators (exact, and
    the additions no longer wait for one another; one for the orders whose second terms need the registers)."""
    steps = block // 4
    r8, r16, q81 = order == ORDER_R8, order == ORDER_R16, order == ORDER_Q8_1
    halves = order == ORDER_Q8_1_AVX2  # a block's two 16-value sums scaled one at a time
    fused = q81 or order == ORDER_R8_AVX2  # acc = fma(d, f32(isum), acc)
    per_step = 4 if q81 or halves else 1  # blocks per step of the loop
    chains = 1 if q81 or halves or r8 or not HAS_VNNI else CHAINS  # their second terms leave no registers for more

    def emit_pass(t: _TileArgs, keys: list[tuple[int, int]]) -> None:
        """The blocks b0 .. b1 for the (group, row) pairs `keys` of the call."""
        builder = t.builder
        wq_p, ws_p, wc_p, wo_p, au_p, as_p, su_p, si_p, out_p = t.wq, t.ws, t.wcorr, t.wofs, t.au, t.asc, t.asum, \
            t.aisum, t.out
        b0_v, b1_v, nb_v, n_v = t.b0, t.b1, t.nb, t.n
        fma, const = t.fma, _const
        row_len = builder.mul(nb_v, const(block))
        groups, rows = t.groups(), t.rows()

        def out_vectors(base: ir.Value) -> dict:  # type: ignore[type-arg]
            return {(h, i): builder.bitcast(builder.gep(base, [builder.add(builder.mul(rows[i], n_v), builder.mul(
                groups[h], const(LANES)))]), _V16F.as_pointer()) for h, i in keys}

        outs = out_vectors(out_p)
        zero_f = ir.Constant(_V16F, [0.0] * LANES)
        first = builder.icmp_signed("==", b0_v, const(0))  # out holds nothing yet: its memory is not read
        accs = {key: cgutils.alloca_once_value(builder, builder.select(first, zero_f, builder.load(o, align=1)))
                for key, o in outs.items()}
        accs1 = {key: cgutils.alloca_once_value(builder, zero_f) for key in keys} if r8 else {}

        def integer_sums(b: ir.Value, first: int = 0, count: int = steps) -> dict:  # type: ignore[type-arg]
            """Block b's exact sums of u x q per (group, row) over its steps first .. first + count - 1: isum - corr
            (a part of a block only with signed dot products, which need no correction)."""
            assert count == steps or t.dots.signed, "the corrections are whole blocks'"
            gb = [builder.add(builder.mul(gh, nb_v), b) for gh in groups]
            wbase = [builder.mul(x, const(steps * 64)) for x in gb]
            abase = [builder.add(builder.mul(r, row_len), builder.mul(b, const(block))) for r in rows]
            slots = {(h, i, c): cgutils.alloca_once_value(builder, t.dots.zero) for h, i in keys for c in range(chains)}
            # a loop over the steps, not the steps unrolled: LLVM then keeps the widened values of one step in
            # registers instead of scheduling a block's loads together and spilling them
            with cgutils.for_range(builder, const(count // chains)) as loop:
                for c in range(chains):
                    s = builder.add(builder.mul(loop.index, const(chains)), const(first + c))
                    w = [_vector(builder, wq_p, builder.add(wb, builder.mul(s, const(64))), _V16I) for wb in wbase]
                    for i in sorted({i for _, i in keys}):
                        ap = builder.gep(au_p, [builder.add(abase[i], builder.mul(s, const(4)))])
                        a = splat(builder, builder.load(builder.bitcast(ap, _I32.as_pointer()), align=1), _V16I)
                        for h in sorted({h for h, _ in keys}):
                            slot = slots[(h, i, c)]
                            builder.store(t.dot(builder.load(slot), a, w[h]), slot)
            isum = {key: builder.load(slot) for key, slot in slots.items()}
            totals = {}
            for h, i in keys:
                total = isum[(h, i, 0)]
                for c in range(1, chains):
                    total = builder.add(total, isum[(h, i, c)])
                total = t.dot_total(total)
                totals[(h, i)] = total if t.dots.signed else builder.sub(
                    total, _vector(builder, wc_p, builder.mul(gb[h], const(LANES)), _V16I))
            return totals

        def weights(b: ir.Value, p: ir.Value) -> list[ir.Value]:
            return [_vector(builder, p, builder.mul(builder.add(builder.mul(gh, nb_v), b), const(LANES)), _V16F)
                    for gh in groups]

        def activations(b: ir.Value, p: ir.Value) -> list[ir.Value]:
            return [splat(builder, builder.load(builder.gep(p, [builder.add(builder.mul(r, nb_v), b)])), _V16F)
                    for r in rows]

        def add(key: tuple[int, int], value: ir.Value) -> None:
            builder.store(value, accs[key])

        with cgutils.for_range(builder, builder.udiv(builder.sub(b1_v, b0_v), const(per_step))) as loop:
            first = builder.add(b0_v, builder.mul(loop.index, const(per_step)))
            blocks = [builder.add(first, const(t)) for t in range(per_step)]
            if q81 or halves:  # ik's Q8_1 kernels: the four blocks' offset terms, then their scaled sums
                for b in blocks:
                    offset, a_sum = weights(b, wo_p), activations(b, su_p)
                    for h, i in keys:
                        add((h, i), fma(offset[h], a_sum[i], builder.load(accs[(h, i)])))
            for b in blocks:
                parts = [integer_sums(b, h * steps // 2, steps // 2) for h in range(2)] if halves else []
                totals = {} if halves else integer_sums(b)
                scale, a_scale = weights(b, ws_p), activations(b, as_p)
                a_sum = activations(b, su_p) if r8 or r16 else []
                a_int = []
                if r8 or r16:
                    unsigned = ir.Constant(_I32, 127 if r8 else 128)
                    a_int = [splat(builder, builder.mul(builder.load(builder.gep(si_p, [builder.add(
                        builder.mul(r, nb_v), b)])), unsigned), _V16I) for r in rows]
                for h, i in keys:
                    acc = builder.load(accs[(h, i)])
                    d = builder.fmul(scale[h], a_scale[i])
                    if r8 or r16:
                        f = builder.sitofp(builder.add(totals[(h, i)], a_int[i]), _V16F)
                        acc = fma(d, f, acc)
                        if r8:
                            builder.store(fma(scale[h], a_sum[i], builder.load(accs1[(h, i)])), accs1[(h, i)])
                        if r16:
                            minus = ir.Constant(_V16F, [-128.0] * LANES)
                            acc = fma(builder.fmul(scale[h], minus), a_sum[i], acc)
                    elif halves:
                        for part in parts:
                            acc = fma(d, builder.sitofp(part[(h, i)], _V16F), acc)
                    elif fused:
                        acc = fma(d, builder.sitofp(totals[(h, i)], _V16F), acc)
                    else:
                        acc = builder.fadd(acc, builder.fmul(builder.sitofp(totals[(h, i)], _V16F), d))
                    add((h, i), acc)
        minus127 = ir.Constant(_V16F, [-127.0] * LANES)
        for key, o in outs.items():
            value = builder.load(accs[key])
            if r8:  # a call covers the whole row (_tiles): fma(-127, acc1, acc)
                value = fma(minus127, builder.load(accs1[key]), value)
            builder.store(value, o, align=1)

    def emit(t: _TileArgs) -> None:
        """The call in passes of as many groups and rows as the dot products' accumulators leave registers for
        (each output's operations, and so its bits, are the same whichever pass computes it)."""
        pg, pr = t.dots.pass_groups, t.dots.pass_rows
        for g0 in range(0, GROUPS, pg):
            for r0 in range(0, TILE, pr):
                emit_pass(t, [(h, i) for h in range(g0, g0 + pg) for i in range(r0, r0 + pr)])

    return _tile_intrinsic(emit, dot)


def _make_native_tile(dot: Callable[[ir.IRBuilder], _Dot] = host_dot,  # type: ignore[no-untyped-def]
                      signed: bool = False):
    """The tile micro-kernel of ORDER_QX_0_NATIVE (32-value blocks) for weight groups GROUPS x g .. GROUPS x g +
    GROUPS - 1 and activation rows m0 .. m0 + TILE - 1, a whole row per call (b0 = 0, b1 = nb). The weights are
    packed unsigned (+ bias, `pack`) and the activations' bytes made signed again (u xor 0x80), so each vpdpbusd
    sums ik's own integers. `signed`: ORDER_QX_0_AVX2, the weights as they are, the activations' bytes as stored
    (`dot` a signed one, _DOT_SIGN), and no correction sums."""
    steps = 8

    def emit_pass(t: _TileArgs, keys: list[tuple[int, int]]) -> None:
        """The whole row for the (group, row) pairs `keys` of the call."""
        builder = t.builder
        wq_p, ws_p, wo_p, au_p, as_p, su_p, out_p = t.wq, t.ws, t.wofs, t.au, t.asc, t.asum, t.out
        nb_v, n_v = t.nb, t.n
        fma, const = t.fma, _const
        fconst = lambda v: ir.Constant(_V16F, [v] * LANES)  # noqa: E731
        row_len = builder.mul(nb_v, const(32))
        groups, rows = t.groups(), t.rows()
        zero_f = fconst(0.0)
        acc = {(h, i, lane): cgutils.alloca_once_value(builder, zero_f) for h, i in keys for lane in range(8)}
        accm = {} if signed else {(h, i, j): cgutils.alloca_once_value(builder, zero_f)
                                  for h, i in keys for j in range(4)}
        sign = ir.Constant(_I32, -0x7F7F7F80)  # 0x80808080

        def step_sums(b: ir.Value, chains: list[list[int]]) -> dict:  # type: ignore[type-arg]
            """Per (group, row, chain): the integer sum of block b's steps in that chain."""
            wbase = [builder.mul(builder.add(builder.mul(gh, nb_v), b), const(steps * 64)) for gh in groups]
            abase = [builder.add(builder.mul(r, row_len), builder.mul(b, const(32))) for r in rows]
            sums = {(h, i, c): t.dots.zero for h, i in keys for c in range(len(chains))}
            for c, chain in enumerate(chains):
                for s in chain:
                    w = [_vector(builder, wq_p, builder.add(wb, const(s * 64)), _V16I) for wb in wbase]
                    for i in sorted({i for _, i in keys}):
                        ap = builder.bitcast(builder.gep(au_p, [builder.add(abase[i], const(s * 4))]),
                                             _I32.as_pointer())
                        u = builder.load(ap, align=1)
                        a = splat(builder, u if signed else builder.xor(u, sign), _V16I)
                        for h in sorted({h for h, _ in keys}):
                            sums[(h, i, c)] = t.dot(sums[(h, i, c)], a, w[h]) if signed else \
                                t.dot(sums[(h, i, c)], w[h], a)
            return {key: t.dot_total(v) for key, v in sums.items()}

        def scales(b: ir.Value) -> tuple[dict, dict]:  # type: ignore[type-arg]
            """Per (group, row): d = w scale x a scale and the correction (w scale x -bias) x a's scaled sum (none
            with `signed`)."""
            at = [builder.mul(builder.add(builder.mul(gh, nb_v), b), const(LANES)) for gh in groups]
            w = [_vector(builder, ws_p, x, _V16F) for x in at]
            idx = [builder.add(builder.mul(r, nb_v), b) for r in rows]
            a_d = [splat(builder, builder.load(builder.gep(as_p, [x])), _V16F) for x in idx]
            d = {(h, i): builder.fmul(w[h], a_d[i]) for h, i in keys}
            if signed:  # no correction (and no offsets packed)
                return d, {}
            minus = [_vector(builder, wo_p, x, _V16F) for x in at]
            a_s = [splat(builder, builder.load(builder.gep(su_p, [x])), _V16F) for x in idx]
            return d, {(h, i): builder.fmul(minus[h], a_s[i]) for h, i in keys}

        def add(slot: ir.Value, value: ir.Value) -> None:
            builder.store(builder.fadd(builder.load(slot), value), slot)

        def fma_into(slot: ir.Value, d: ir.Value, isum: ir.Value) -> None:
            builder.store(fma(d, builder.sitofp(isum, _V16F), builder.load(slot)), slot)

        whole = builder.udiv(nb_v, const(4))
        with cgutils.for_range(builder, whole) as loop:  # whole groups of four blocks
            for pos in range(4):
                b = builder.add(builder.mul(loop.index, const(4)), const(pos))
                sums = step_sums(b, [[0, 1, 2, 3], [4, 5, 6, 7]])
                d, m = scales(b)
                for h, i in keys:
                    if not signed:
                        add(accm[(h, i, pos)], m[(h, i)])
                    fma_into(acc[(h, i, pos)], d[(h, i)], sums[(h, i, 0)])
                    fma_into(acc[(h, i, 4 + pos)], d[(h, i)], sums[(h, i, 1)])
        with cgutils.for_range(builder, builder.sub(nb_v, builder.mul(whole, const(4)))) as loop:  # the rest
            b = builder.add(builder.mul(whole, const(4)), loop.index)
            sums = step_sums(b, [[s] for s in range(steps)])
            d, m = scales(b)
            for h, i in keys:
                if not signed:
                    quarter = builder.fmul(m[(h, i)], fconst(0.25))
                    for j in range(4):
                        add(accm[(h, i, j)], quarter)
                for lane in range(8):
                    fma_into(acc[(h, i, lane)], d[(h, i)], sums[(h, i, lane)])
        for h, i in keys:
            tot = [builder.fadd(builder.load(acc[(h, i, j)]), builder.load(acc[(h, i, 4 + j)])) for j in range(4)]
            if not signed:
                tot = [builder.fadd(v, builder.load(accm[(h, i, j)])) for j, v in enumerate(tot)]
            value = builder.fadd(builder.fadd(tot[0], tot[2]), builder.fadd(tot[1], tot[3]))
            o = builder.gep(out_p, [builder.add(builder.mul(rows[i], n_v), builder.mul(groups[h], const(LANES)))])
            builder.store(value, builder.bitcast(o, _V16F.as_pointer()), align=1)

    def emit(t: _TileArgs) -> None:
        """The call in passes, as _make_tile's."""
        pg, pr = t.dots.pass_groups, t.dots.pass_rows
        for g0 in range(0, GROUPS, pg):
            for r0 in range(0, TILE, pr):
                emit_pass(t, [(h, i) for h in range(g0, g0 + pg) for i in range(r0, r0 + pr)])

    return _tile_intrinsic(emit, dot)


# The plain order's 256-value blocks keep vpmaddwd on AVX2: their correction comes once per 64 steps, and the signed
# products measured 10% slower there (tools/bench_kernels.py); 32-value blocks gain 20-25% from dropping the per-block
# correction, and so do ORDER_R16's and ORDER_R8_AVX2's 256-value blocks on a Zen 3 (256 x 2048 x 2048 .. 6144:
# 138-192 GOPS against 119-155 with vpmaddwd, two threads)
_tile32, _tile256 = _make_tile(32), _make_tile(256, dot=host_dot)
_tile32_r8, _tile256_r16 = _make_tile(32, ORDER_R8), _make_tile(256, ORDER_R16)
_tile32_q81, _tile32_r8_avx2 = _make_tile(32, ORDER_Q8_1), _make_tile(32, ORDER_R8_AVX2)
_tile256_r8_avx2 = _make_tile(256, ORDER_R8_AVX2)
#: ORDER_Q8_1_AVX2 sums half blocks, which AVX2's signed byte products do without a correction (hosts without AVX2
#: take the scalar kernel, qmatmul: their stand-in here is never called, and emits no AVX2 instruction)
_tile32_q81_avx2 = _make_tile(32, ORDER_Q8_1_AVX2, lambda builder: _DOT_SIGN) if HAS_AVX2 else _tile32_q81
_tile32_native = _make_native_tile()
#: ORDER_QX_0_AVX2 takes AVX2's signed byte products (hosts without AVX2: the scalar kernel, as ORDER_Q8_1_AVX2)
_tile32_native_avx2 = _make_native_tile(lambda builder: _DOT_SIGN, signed=True) if HAS_AVX2 else _tile32_native


@njit(cache=True, nogil=True)
def _tiles(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, m0, m1, block, nb, n,  # type: ignore[no-untyped-def]
                order):
    """Weight groups of call g against activation rows m0 .. m1, K_BYTES of each row at a time (so the groups'
    values stay in the core's first-level cache for all the rows). Called, not inlined: the serial and parallel
    kernels share its compiled tiles (_tiled_serial compiled in 4.3 instead of 9.2 s on a 2-core Zen 3)."""
    # ORDER_R8's two sums and ORDER_QX_0_NATIVE's twelve (ORDER_QX_0_AVX2's eight) meet after the row's last block:
    # one call per row
    chunk = nb if order == ORDER_R8 or order == ORDER_QX_0_NATIVE or order == ORDER_QX_0_AVX2 else \
        max(1, K_BYTES // block)
    for b0 in range(0, nb, chunk):
        b1 = min(nb, b0 + chunk)
        for t in range(m0, m1, TILE):
            if block == 256 and order == ORDER_R16:
                _tile256_r16(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, t, b0, b1, nb, n)
            elif block == 256 and order == ORDER_R8_AVX2:
                _tile256_r8_avx2(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, t, b0, b1, nb, n)
            elif block == 256:
                _tile256(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, t, b0, b1, nb, n)
            elif order == ORDER_Q8_1:
                _tile32_q81(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, t, b0, b1, nb, n)
            elif order == ORDER_Q8_1_AVX2:
                _tile32_q81_avx2(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, t, b0, b1, nb, n)
            elif order == ORDER_R8:
                _tile32_r8(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, t, b0, b1, nb, n)
            elif order == ORDER_R8_AVX2:
                _tile32_r8_avx2(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, t, b0, b1, nb, n)
            elif order == ORDER_QX_0_NATIVE:
                _tile32_native(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, t, b0, b1, nb, n)
            elif order == ORDER_QX_0_AVX2:
                _tile32_native_avx2(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, t, b0, b1, nb, n)
            else:
                _tile32(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, t, b0, b1, nb, n)


@njit(cache=True, nogil=True, parallel=True)
def _tiled_parallel(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, block, nb, n, mp, panel,  # type: ignore[no-untyped-def]
                   order, threads):
    """The serial loops' (panel, call) pairs as tasks the `threads` threads claim in that order
    (ikrun/ops/parallel.py)."""
    calls = n // (GROUPS * LANES)
    tasks = (mp + panel - 1) // panel * calls
    counter = np.zeros(1, np.int64)
    for _ in prange(threads):
        task = claim(counter)
        while task < tasks:
            p0 = task // calls * panel
            _tiles(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, task % calls, p0, min(mp, p0 + panel), block, nb,
                   n, order)
            task = claim(counter)


@njit(cache=True, nogil=True)
def _tiled_serial(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, block, nb, n, mp, panel,  # type: ignore[no-untyped-def]
                 order):
    for p0 in range(0, mp, panel):
        for g in range(n // (GROUPS * LANES)):
            _tiles(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, p0, min(mp, p0 + panel), block, nb,
                        n, order)


@njit(cache=True, nogil=True, inline="always")
def _portable_group(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, m0, m1, block, nb,  # type: ignore[no-untyped-def]
                    n, order):
    """The tile kernels' arithmetic in scalar code, one 16-row group against rows m0 .. m1, in the same order."""
    if order == ORDER_QX_0_NATIVE or order == ORDER_QX_0_AVX2:
        _portable_native(wq, ws, wofs, au, asc, asum, out, g, m0, m1, nb, n, order == ORDER_QX_0_AVX2)
        return
    if order == ORDER_Q8_1_AVX2:
        _portable_q81_avx2(wq, ws, wofs, au, asc, asum, out, g, m0, m1, nb, n)
        return
    steps = block // 4
    acc = np.empty(LANES, np.float32)
    acc1 = np.empty(LANES, np.float32)
    for m in range(m0, m1):
        acc[:] = 0
        acc1[:] = 0
        for b in range(nb):
            gb = g * nb + b
            a0 = m * nb * block + b * block
            d_a, a_sum = asc[m * nb + b], asum[m * nb + b]
            for r in range(LANES):
                if order == ORDER_Q8_1 and b % 4 == 0:  # the offsets of this block and the next three first
                    for t in range(4):
                        acc[r] = fmaf(wofs[(gb + t) * LANES + r], asum[m * nb + b + t], acc[r])
                s = np.int32(0)
                for k in range(steps):
                    w0 = (gb * steps + k) * 64 + r * 4
                    for t in range(4):
                        s = np.int32(s + np.int32(au[a0 + 4 * k + t]) * np.int32(wq[w0 + t]))
                w_scale = ws[gb * LANES + r]
                if order == ORDER_R8:
                    f = np.float32(s - wcorr[gb * LANES + r] + 127 * aisum[m * nb + b])
                    acc[r] = fmaf(w_scale * d_a, f, acc[r])
                    acc1[r] = fmaf(w_scale, a_sum, acc1[r])
                elif order == ORDER_R16:
                    f = np.float32(s - wcorr[gb * LANES + r] + 128 * aisum[m * nb + b])
                    acc[r] = fmaf(w_scale * d_a, f, acc[r])
                    acc[r] = fmaf(w_scale * np.float32(-128.0), a_sum, acc[r])
                elif order == ORDER_Q8_1 or order == ORDER_R8_AVX2:
                    acc[r] = fmaf(w_scale * d_a, np.float32(s - wcorr[gb * LANES + r]), acc[r])
                else:
                    acc[r] = acc[r] + np.float32(s - wcorr[gb * LANES + r]) * (w_scale * d_a)
        for r in range(LANES):
            out[m * n + g * LANES + r] = fmaf(np.float32(-127.0), acc1[r], acc[r]) if order == ORDER_R8 else acc[r]


@njit(cache=True, nogil=True, inline="always")
def _portable_q81_avx2(wq, ws, wofs, au, asc, asum, out, g, m0, m1, nb, n):  # type: ignore[no-untyped-def]
    """ORDER_Q8_1_AVX2 in scalar code, one 16-row group against rows m0 .. m1."""
    for m in range(m0, m1):
        for r in range(LANES):
            acc = np.float32(0.0)
            for b4 in range(0, nb // 4 * 4, 4):
                for b in range(b4, b4 + 4):
                    acc = fmaf(wofs[(g * nb + b) * LANES + r], asum[m * nb + b], acc)
                for b in range(b4, b4 + 4):
                    gb = g * nb + b
                    d = ws[gb * LANES + r] * asc[m * nb + b]
                    for half in range(2):
                        s = np.int32(0)
                        for k in range(4 * half, 4 * half + 4):
                            w0, a0 = (gb * 8 + k) * 64 + r * 4, m * nb * 32 + b * 32 + 4 * k
                            for t in range(4):
                                s += np.int32(wq[w0 + t]) * (np.int32(au[a0 + t]) - 128)
                        acc = fmaf(d, np.float32(s), acc)
            out[m * n + g * LANES + r] = acc


@njit(cache=True, nogil=True, inline="always")
def _portable_native(wq, ws, wofs, au, asc, asum, out, g, m0, m1, nb, n,  # type: ignore[no-untyped-def]
                     signed):
    """ORDER_QX_0_NATIVE in scalar code, one 16-row group against rows m0 .. m1 (weights packed + bias, wofs the
    scales x -bias); `signed`: ORDER_QX_0_AVX2 (the weights as they are, no correction)."""
    acc = np.empty(8, np.float32)
    accm = np.empty(4, np.float32)
    part = np.empty(8, np.int32)
    whole = nb // 4 * 4
    for m in range(m0, m1):
        for r in range(LANES):
            acc[:] = 0
            accm[:] = 0
            for b in range(nb):
                gb = g * nb + b
                for k in range(8):
                    s = np.int32(0)
                    w0, a0 = (gb * 8 + k) * 64 + r * 4, m * nb * 32 + b * 32 + 4 * k
                    for t in range(4):
                        v = np.int32(wq[w0 + t]) if signed else np.int32(np.uint8(wq[w0 + t]))
                        s += v * (np.int32(au[a0 + t]) - 128)
                    part[k] = s
                d = ws[gb * LANES + r] * asc[m * nb + b]
                corr = np.float32(0) if signed else wofs[gb * LANES + r] * asum[m * nb + b]
                if b < whole:
                    j = b % 4
                    accm[j] += corr
                    acc[j] = fmaf(d, np.float32(part[0] + part[1] + part[2] + part[3]), acc[j])
                    acc[4 + j] = fmaf(d, np.float32(part[4] + part[5] + part[6] + part[7]), acc[4 + j])
                else:
                    for j in range(4):
                        accm[j] += corr * np.float32(0.25)
                    for lane in range(8):
                        acc[lane] = fmaf(d, np.float32(part[lane]), acc[lane])
            t0, t1, t2, t3 = acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]
            if not signed:
                t0, t1, t2, t3 = t0 + accm[0], t1 + accm[1], t2 + accm[2], t3 + accm[3]
            out[m * n + g * LANES + r] = (t0 + t2) + (t1 + t3)


@njit(cache=True, nogil=True, parallel=True)
def _portable_parallel(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, block, nb, n, mp, panel,  # type: ignore[no-untyped-def]
                       order):
    for p0 in range(0, mp, panel):
        for g in prange(n // LANES):
            _portable_group(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, p0, min(mp, p0 + panel), block,
                            nb, n, order)


@njit(cache=True, nogil=True)
def _portable_serial(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, block, nb, n, mp, panel,  # type: ignore[no-untyped-def]
                     order):
    for p0 in range(0, mp, panel):
        for g in range(n // LANES):
            _portable_group(wq, ws, wcorr, wofs, au, asc, asum, aisum, out, g, p0, min(mp, p0 + panel), block,
                            nb, n, order)


@dataclass(frozen=True)
class IntRows:
    """Activation rows rounded to int8 blocks: u = q + 128 [rows padded to whole tiles, n], the scale d and
    d x sum(q) of every block [padded rows, n // block]; `rows` is the true row count."""

    u: np.ndarray
    scale: np.ndarray
    sums: np.ndarray
    rows: int
    block: int
    #: the integer sum of every block [padded rows, n // block] (ORDER_R8 multiplies it)
    isums: np.ndarray

    def take(self, rows: np.ndarray) -> IntRows:
        """Rows `rows` (of the true rows), padded to whole tiles again: the tokens routed to one expert."""
        m = len(rows)
        mp = m + (-m % TILE)
        nb = self.scale.shape[1]
        u = np.empty((mp, self.u.shape[1]), np.uint8)
        scale, sums = np.empty((mp, nb), np.float32), np.empty((mp, nb), np.float32)
        isums = np.empty((mp, nb), np.int32)
        _take_rows(self.u, self.scale, self.sums, self.isums, np.ascontiguousarray(rows, dtype=np.int64), u, scale,
                   sums, isums)
        return IntRows(u=u, scale=scale, sums=sums, rows=m, block=self.block, isums=isums)


@njit(cache=True, nogil=True)
def _take_rows(u: np.ndarray, scale: np.ndarray, sums: np.ndarray, isums: np.ndarray, rows: np.ndarray,
               u_out: np.ndarray, scale_out: np.ndarray, sums_out: np.ndarray, isums_out: np.ndarray) -> None:
    """IntRows.take in one pass: the rows copied, the padding rows as integer_rows makes them (u = 128: q = 0, and
    zero scales and sums)."""
    for i in range(u_out.shape[0]):
        if i < rows.size:
            r = rows[i]
            u_out[i] = u[r]
            scale_out[i], sums_out[i], isums_out[i] = scale[r], sums[r], isums[r]
        else:
            u_out[i] = 128
            scale_out[i], sums_out[i], isums_out[i] = 0, 0, 0


def panel_rows(n: int, mp: int = 0, calls: int = 0, threads: int = 1) -> int:
    """Activation rows multiplied by every weight group before the next rows: as many whole tiles as keep the
    panel within PANEL_BYTES (in the core's own cache while the weights stream past); fewer where `mp` rows against
    `calls` kernel calls' weight groups would leave `threads` threads fewer than TASKS_PER_THREAD tasks each."""
    panel = max(TILE, PANEL_BYTES // n // TILE * TILE)
    if calls:
        panels = -(-TASKS_PER_THREAD * threads // calls)
        panel = min(panel, max(TILE, -(-mp // panels // TILE) * TILE))
    return panel


def qmatmul(x: IntRows, w: PackedInts, tiled: bool = True) -> np.ndarray:
    """x @ w^T in ik's integer arithmetic: float32 [x.rows, w.rows]; `tiled` False: in the scalar kernel (the
    reference the tile kernels are tested against; the same bits)."""
    if x.block != w.block or x.u.shape[1] != w.n:
        raise ValueError(f"activations of {x.u.shape[1]} values in blocks of {x.block} against weights of {w.n} "
                         f"in blocks of {w.block}")
    if w.has_offset != (w.order in (ORDER_Q8_1, ORDER_Q8_1_AVX2, ORDER_QX_0_NATIVE)):
        raise ValueError("offsets belong to ik's Q8_1 weights (ORDER_Q8_1) and only to them")
    if w.order in (ORDER_QX_0_NATIVE, ORDER_QX_0_AVX2, ORDER_Q8_1_AVX2) and w.block != 32:
        raise ValueError(f"ik's kernel of the 32-value block types takes blocks of 32 values, not {w.block}")
    if w.order == ORDER_Q8_1 and (w.n // w.block) % 4:
        raise ValueError(f"ik's Q8_1 order takes blocks four at a time; rows of {w.n} values are not")
    mp, n_out = x.u.shape[0], w.scale.size // (w.n // w.block)
    out = np.empty((mp, n_out), np.float32)  # every kernel writes every element (a tile from its row's first block)
    avx2_only = w.order in (ORDER_Q8_1_AVX2, ORDER_QX_0_AVX2)  # tiles of AVX2's signed byte products alone
    signed = SIGNED_TILES or avx2_only  # the tile takes AVX2's signed byte products
    tiled = tiled and (HAS_AVX2 or not avx2_only) and \
        not (w.full_range and signed and w.order != ORDER_QX_0_NATIVE)
    serial, parallel = (_tiled_serial, _tiled_parallel) if tiled else (_portable_serial, _portable_parallel)
    kernel = pick(serial, parallel, mp * w.n * n_out // 64)
    args = (w.q, w.scale, w.corr, w.offset, x.u.reshape(-1), x.scale.reshape(-1), x.sums.reshape(-1),
            x.isums.reshape(-1), out.reshape(-1), w.block, w.n // w.block, n_out, mp)
    if kernel is _tiled_parallel:
        threads = get_num_threads()
        kernel(*args, panel_rows(w.n, mp, n_out // (GROUPS * LANES), threads), w.order, threads)
    else:
        kernel(*args, panel_rows(w.n), w.order)
    return out[: x.rows, : w.rows]
