"""A stable ascending order of a few float32 values, eight comparisons an instruction (8-lane vector IR).

The split searches of IQ1_S, IQ1_M, IQ2_K and IQ2_KS sort each block of 16 or 32 values (ik: qsort or std::sort of
(value, index) pairs). An insertion sort branches on the data and mispredicts about every other move; here each
value's place is counted instead, the values below it and the equal ones before it, without a branch."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils

from ikquant.formats.jit import intrinsic, require_array
from ikquant.formats.vector_ir import I32, I64, LANES, V8F, V8I, load_vector, splat


@intrinsic
def stable_order(typingctx, x, order):  # type: ignore[no-untyped-def]
    """order[:x.size] = positions of x by ascending value, equal values in position order; x.size a multiple of 8."""
    require_array("stable_order", "x", x, 1, types.float32)
    require_array("stable_order", "order", order, 1, types.int64, contiguous=False)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        xa = context.make_array(signature.args[0])(context, builder, value=args[0])
        out = context.make_array(signature.args[1])(context, builder, value=args[1])
        n = builder.extract_value(xa.shape, 0)
        stride = builder.extract_value(out.strides, 0)
        lanes = ir.Constant(I64, LANES)
        with cgutils.for_range(builder, n) as values:
            i = values.index
            v = splat(builder, builder.load(builder.gep(xa.data, [i])), V8F)
            i32 = splat(builder, builder.trunc(i, I32), V8I)
            count_p = cgutils.alloca_once_value(builder, ir.Constant(V8I, [0] * LANES))
            with cgutils.for_range(builder, builder.sdiv(n, lanes)) as chunks:
                base = builder.mul(chunks.index, lanes)
                u = load_vector(builder, xa.data, base, V8F)
                j = builder.add(splat(builder, builder.trunc(base, I32), V8I), ir.Constant(V8I, list(range(LANES))))
                before = builder.or_(builder.fcmp_ordered("<", u, v),
                                     builder.and_(builder.fcmp_ordered("==", u, v), builder.icmp_signed("<", j, i32)))
                builder.store(builder.sub(builder.load(count_p), builder.sext(before, V8I)), count_p)
            count = builder.load(count_p)
            place = builder.extract_element(count, ir.Constant(I32, 0))
            for k in range(1, LANES):
                place = builder.add(place, builder.extract_element(count, ir.Constant(I32, k)))
            at = builder.add(builder.ptrtoint(out.data, I64), builder.mul(builder.sext(place, I64), stride))
            builder.store(i, builder.inttoptr(at, out.data.type))
        return context.get_dummy_value()

    return types.void(x, order), codegen
