"""The IQK scale search's inner loop as 8-lane vector IR: for eight trial inverse scales at once, each value of a
sub-block scaled, rounded to ik's nearest entry of one grid half, and summed into (sum w q x, sum w q^2), each
lane one chain over the values in ik's order.

ik looks the nearest entry up in a table indexed by the scaled value's integer part; a table slot holds either the
entry or a pair whose midpoint lies inside the slot, compared then on rounded differences. Here each slot holds its
two candidate values (equal where it answers alone), both read with a gather, and the nearer kept by the same
comparison: no branch on the value, and the same floats as ik's lookup for every input, NaN and overflow included.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils

from ikquant.formats.jit import intrinsic, require_array
from ikquant.formats.vector_ir import I32, I64, LANES, V8F, V8I, fma, gather, load_vector, splat, store_vector

INT_MIN = -(2**31)


def table_slot(builder: ir.IRBuilder, t: ir.Value, offset: ir.Value, limit: ir.Value) -> ir.Value:
    """ik's lookup-table slot of each lane of t (8 floats; offset and limit 8 int32): clamp(trunc(t) - offset, -1,
    limit) + 1, trunc as x86's (INT_MIN outside int32 and for NaN) in int32 arithmetic; slots 0 and limit + 1 are
    ik's clamps below and above the table."""
    fits = builder.and_(builder.fcmp_ordered(">", t, ir.Constant(V8F, [-2147483648.0] * LANES)),
                        builder.fcmp_ordered("<", t, ir.Constant(V8F, [2147483648.0] * LANES)))
    truncated = builder.select(fits, builder.fptosi(builder.select(fits, t, ir.Constant(V8F, [0.0] * LANES)), V8I),
                               ir.Constant(V8I, [INT_MIN] * LANES))
    minus_one = ir.Constant(V8I, [-1] * LANES)
    ix = builder.sub(truncated, offset)
    ix = builder.select(builder.icmp_signed("<", ix, minus_one), minus_one, ix)
    ix = builder.select(builder.icmp_signed(">", ix, limit), limit, ix)
    return builder.add(ix, ir.Constant(V8I, [1] * LANES))


@intrinsic
def slot_lane_sums(typingctx, xb, wb, inv, low, high, shift, offset, limit, sumqx, sumq2):  # type: ignore[no-untyped-def]
    """sumqx[l] = sum_j w_j q x_j and sumq2[l] = sum_j w_j q^2 (q = wq then fmaf, as ik forms them) for every lane
    l of inv (its size a multiple of LANES), q the grid value nearest a = inv[l] x_j: slot = clamp(trunc(a - shift)
    - offset, -1, limit) + 1 (trunc as x86's: INT_MIN outside int32 and for NaN; int32 arithmetic), candidates
    low[slot] and high[slot], low kept when a - low < high - a. ik's grids 3-5 index by trunc(a) - grid[base]
    (shift 0, exact: a - 0 is a), grid 6 by trunc(a - grid[base]) (offset 0)."""
    for name, arg in (("xb", xb), ("wb", wb), ("inv", inv), ("low", low), ("high", high), ("sumqx", sumqx),
                      ("sumq2", sumq2)):
        require_array("slot_lane_sums", name, arg, 1, types.float32)
    sig = types.void(xb, wb, inv, low, high, types.float32, types.int64, types.int64, sumqx, sumq2)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        xb_v, wb_v, inv_v, low_v, high_v, shift_v, offset_v, limit_v, sumqx_v, sumq2_v = args

        def data(i: int, value: ir.Value) -> ir.Value:
            return context.make_array(signature.args[i])(context, builder, value=value)

        xs, ws, invs, lows, highs = (data(i, v) for i, v in enumerate((xb_v, wb_v, inv_v, low_v, high_v)))
        qx_out, q2_out = data(8, sumqx_v), data(9, sumq2_v)
        n = builder.extract_value(xs.shape, 0)
        vectors = builder.sdiv(builder.extract_value(invs.shape, 0), ir.Constant(I64, LANES))
        vshift = splat(builder, shift_v, V8F)
        voffset = splat(builder, builder.trunc(offset_v, I32), V8I)
        vlimit = splat(builder, builder.trunc(limit_v, I32), V8I)
        zero = ir.Constant(V8F, [0.0] * LANES)
        qx_p = cgutils.alloca_once_value(builder, zero)
        q2_p = cgutils.alloca_once_value(builder, zero)
        with cgutils.for_range(builder, vectors) as outer:
            at = builder.mul(outer.index, ir.Constant(I64, LANES))
            vinv = load_vector(builder, invs.data, at, V8F)
            builder.store(zero, qx_p)
            builder.store(zero, q2_p)
            with cgutils.for_range(builder, n) as inner:
                x = splat(builder, builder.load(builder.gep(xs.data, [inner.index])), V8F)
                w = splat(builder, builder.load(builder.gep(ws.data, [inner.index])), V8F)
                a = builder.fmul(vinv, x)
                slot = table_slot(builder, builder.fsub(a, vshift), voffset, vlimit)
                lo = gather(builder, lows.data, slot)
                hi = gather(builder, highs.data, slot)
                q = builder.select(builder.fcmp_ordered("<", builder.fsub(a, lo), builder.fsub(hi, a)), lo, hi)
                wq = builder.fmul(w, q)
                builder.store(fma(builder, wq, x, builder.load(qx_p)), qx_p)
                builder.store(fma(builder, wq, q, builder.load(q2_p)), q2_p)
            store_vector(builder, builder.load(qx_p), qx_out.data, at)
            store_vector(builder, builder.load(q2_p), q2_out.data, at)
        return context.get_dummy_value()

    return sig, codegen
