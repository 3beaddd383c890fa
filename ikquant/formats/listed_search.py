"""The i-quants' neighbour search in 8-lane vector IR: the listed grid point nearest a group of values.

ik's iq2/iq3_find_best_neighbour score each neighbour of an off-grid key in turn (sum over the group's values of
w (scale q - x)^2, one chain of multiply-adds each) and keep the first strict minimum below FLT_MAX. The lists are
short (median 4-6), so a vectorised loop's set-up cost more than it saved, and LLVM does not vectorise an argmin;
here eight neighbours are scored at once in one vector (each lane its own chain, in ik's order), lanes past the
list's end and NaN sums never win, and the first position of the least sum is found with vector minima.

The lists are laid out value-major (`dense`): a list of n neighbours padded to whole 8-lane chunks, value i of
neighbours j, j + 1, ... adjacent, as uint8 magnitudes.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils

from ikquant.formats.jit import intrinsic

LANES = 8
FLT_MAX = 3.4028234663852886e38
_F32 = ir.FloatType()
_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_V8F = ir.VectorType(_F32, LANES)
_V8I = ir.VectorType(_I32, LANES)
_V8B = ir.VectorType(_I8, LANES)


def _splat(builder: ir.IRBuilder, value: ir.Value, vector: ir.VectorType) -> ir.Value:
    v = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vector, ir.Undefined), ir.Constant(_V8I, [0] * LANES))


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F, [_V8F] * 3), "llvm.fma.v8f32")
    return builder.call(fn, [a, b, c])


def _fold(builder: ir.IRBuilder, v: ir.Value, pick: str, floats: bool) -> ir.Value:
    """The lanes' minimum in every lane: three halving steps of shuffle and min."""
    for width in (4, 2, 1):
        mask = [(lane + width) % LANES for lane in range(LANES)]
        other = builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), ir.Constant(_V8I, mask))
        less = builder.fcmp_ordered(pick, other, v) if floats else builder.icmp_signed(pick, other, v)
        v = builder.select(less, other, v)
    return v


@intrinsic
def nearest_listed(typingctx, dense, at, lanes, count, neg_x, w, scale, mul, add):  # type: ignore[no-untyped-def]
    """Position (0 .. count - 1) in its list of the neighbour with the least sum over the group of
    w_i (scale q_i - x_i)^2 (fmaf(scale, q, -x), then fmaf(w diff, diff, sum) from 0, as ik forms it), the first
    of equal sums; -1 when no sum is below FLT_MAX. dense[at + i * lanes + j] is value i of neighbour j, stored as
    an integer v with q = fmaf(v, mul, add) (1 and 0 where it is q itself); neg_x and w are tuples of the group's
    -x and weights (4 or 8 values)."""
    group = len(neg_x)
    sig = types.int64(dense, types.int64, types.int64, types.int64, neg_x, w, types.float32, types.float32,
                      types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        dense_v, at_v, lanes_v, count_v, neg_x_v, w_v, scale_v, mul_v, add_v = args
        data = context.make_array(signature.args[0])(context, builder, value=dense_v).data
        vscale = _splat(builder, scale_v, _V8F)
        vmul = _splat(builder, mul_v, _V8F)
        vadd = _splat(builder, add_v, _V8F)
        vx = [_splat(builder, builder.extract_value(neg_x_v, i), _V8F) for i in range(group)]
        vw = [_splat(builder, builder.extract_value(w_v, i), _V8F) for i in range(group)]
        count32 = _splat(builder, builder.trunc(count_v, _I32), _V8I)
        inf = ir.Constant(_V8F, [float("inf")] * LANES)
        zero = ir.Constant(_V8F, [0.0] * LANES)
        best_p = cgutils.alloca_once_value(builder, inf)
        pos_p = cgutils.alloca_once_value(builder, ir.Constant(_V8I, [-1] * LANES))
        cur_p = cgutils.alloca_once_value(builder, ir.Constant(_V8I, list(range(LANES))))
        with cgutils.for_range(builder, builder.sdiv(lanes_v, ir.Constant(_I64, LANES))) as loop:
            off = builder.add(at_v, builder.mul(loop.index, ir.Constant(_I64, LANES)))
            d2 = zero
            for i in range(group):
                row = builder.gep(data, [builder.add(off, builder.mul(ir.Constant(_I64, i), lanes_v))])
                v = builder.uitofp(builder.load(builder.bitcast(row, _V8B.as_pointer()), align=1), _V8F)
                q = _fma(builder, v, vmul, vadd)
                diff = _fma(builder, vscale, q, vx[i])
                d2 = _fma(builder, builder.fmul(vw[i], diff), diff, d2)
            cur = builder.load(cur_p)
            better = builder.and_(builder.fcmp_ordered("<", d2, builder.load(best_p)),
                                  builder.icmp_signed("<", cur, count32))
            builder.store(builder.select(better, d2, builder.load(best_p)), best_p)
            builder.store(builder.select(better, cur, builder.load(pos_p)), pos_p)
            builder.store(builder.add(cur, ir.Constant(_V8I, [LANES] * LANES)), cur_p)
        best = builder.load(best_p)
        least = _fold(builder, best, "<", True)
        at_least = builder.and_(builder.fcmp_ordered("==", best, least),
                                builder.fcmp_ordered("<", least, ir.Constant(_V8F, [FLT_MAX] * LANES)))
        big = ir.Constant(_V8I, [2**31 - 1] * LANES)
        first = _fold(builder, builder.select(at_least, builder.load(pos_p), big), "<", False)
        winner = builder.extract_element(first, ir.Constant(_I32, 0))
        found = builder.icmp_signed("!=", winner, ir.Constant(_I32, 2**31 - 1))
        return builder.sext(builder.select(found, winner, ir.Constant(_I32, -1)), _I64)

    return sig, codegen
