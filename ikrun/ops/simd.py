"""LLVM vector IR shared by the kernels written as Numba intrinsics: 16-lane vector types, a broadcast, and the
largest absolute value of a run of floats held in registers (a float maximum in a Numba loop stays scalar: LLVM may
not reorder its NaN cases)."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic

from ikquant.formats import vector_ir

I32 = ir.IntType(32)
V16I, V16F = ir.VectorType(I32, 16), ir.VectorType(ir.FloatType(), 16)


def splat(builder: ir.IRBuilder, value: ir.Value, vty: ir.VectorType = V16F) -> ir.Value:
    """`value` broadcast to every lane of a vector of type vty (16 floats unless said)."""
    return vector_ir.splat(builder, value, vty)


@intrinsic
def absmax(typingctx, x, start, count):  # type: ignore[no-untyped-def]
    """max |x[start + j]| for j < count (float32, count a multiple of 16), in vectors of 16: the same maximum as a
    scalar loop wherever no value is NaN (a NaN is then ignored unless all are)."""
    sig = types.float32(x, types.int64, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        data = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        start, count = args[1], args[2]
        fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F]), "llvm.fabs.v16f32")
        maxnum = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F, V16F]),
                                                "llvm.maxnum.v16f32")
        reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.FloatType(), [V16F]),
                                                "llvm.vector.reduce.fmax.v16f32")
        slot = cgutils.alloca_once_value(builder, ir.Constant(V16F, [0.0] * 16))
        with cgutils.for_range(builder, builder.udiv(count, ir.Constant(count.type, 16))) as loop:
            at = builder.add(start, builder.mul(loop.index, ir.Constant(count.type, 16)))
            values = builder.load(builder.bitcast(builder.gep(data, [at]), V16F.as_pointer()), align=4)
            builder.store(builder.call(maxnum, [builder.load(slot), builder.call(fabs, [values])]), slot)
        return builder.call(reduce, [builder.load(slot)])

    return sig, codegen
