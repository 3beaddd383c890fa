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
from numba.core.errors import TypingError

from ikquant.formats.jit import intrinsic, require_array
from ikquant.formats.vector_ir import FLT_MAX, I32, I64, LANES, V8B, V8F, V8I, V8L, fma, fold, load_vector, splat


@intrinsic
def nearest_listed(typingctx, dense, at, count, neg_x, w, scale, mul, add):  # type: ignore[no-untyped-def]
    """Position (0 .. count - 1) in its list of the neighbour with the least sum over the group of
    w_i (scale q_i - x_i)^2 (fmaf(scale, q, -x), then fmaf(w diff, diff, sum) from 0, as ik forms it), the first
    of equal sums; -1 when no sum is below FLT_MAX. dense[at + i * lanes + j] is value i of neighbour j (lanes:
    count in whole vectors, vector_ir.whole_vectors), stored as an integer v with q = fmaf(v, mul, add) (1 and 0
    where it is q itself); neg_x and w are tuples of the group's -x and weights (4 or 8 values)."""
    group = len(neg_x)
    sig = types.int64(dense, types.int64, types.int64, neg_x, w, types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        dense_v, at_v, count_v, neg_x_v, w_v, scale_v, mul_v, add_v = args
        vectors = builder.sdiv(builder.add(count_v, ir.Constant(I64, LANES - 1)), ir.Constant(I64, LANES))
        lanes_v = builder.mul(vectors, ir.Constant(I64, LANES))
        data = context.make_array(signature.args[0])(context, builder, value=dense_v).data
        vscale = splat(builder, scale_v, V8F)
        vmul = splat(builder, mul_v, V8F)
        vadd = splat(builder, add_v, V8F)
        vx = [splat(builder, builder.extract_value(neg_x_v, i), V8F) for i in range(group)]
        vw = [splat(builder, builder.extract_value(w_v, i), V8F) for i in range(group)]
        count32 = splat(builder, builder.trunc(count_v, I32), V8I)
        inf = ir.Constant(V8F, [float("inf")] * LANES)
        zero = ir.Constant(V8F, [0.0] * LANES)
        best_p = cgutils.alloca_once_value(builder, inf)
        pos_p = cgutils.alloca_once_value(builder, ir.Constant(V8I, [-1] * LANES))
        cur_p = cgutils.alloca_once_value(builder, ir.Constant(V8I, list(range(LANES))))
        with cgutils.for_range(builder, vectors) as loop:
            off = builder.add(at_v, builder.mul(loop.index, ir.Constant(I64, LANES)))
            d2 = zero
            for i in range(group):
                row = builder.gep(data, [builder.add(off, builder.mul(ir.Constant(I64, i), lanes_v))])
                v = builder.uitofp(builder.load(builder.bitcast(row, V8B.as_pointer()), align=1), V8F)
                q = fma(builder, v, vmul, vadd)
                diff = fma(builder, vscale, q, vx[i])
                d2 = fma(builder, builder.fmul(vw[i], diff), diff, d2)
            cur = builder.load(cur_p)
            better = builder.and_(builder.fcmp_ordered("<", d2, builder.load(best_p)),
                                  builder.icmp_signed("<", cur, count32))
            builder.store(builder.select(better, d2, builder.load(best_p)), best_p)
            builder.store(builder.select(better, cur, builder.load(pos_p)), pos_p)
            builder.store(builder.add(cur, ir.Constant(V8I, [LANES] * LANES)), cur_p)
        best = builder.load(best_p)
        least = fold(builder, best, "<", True)
        at_least = builder.and_(builder.fcmp_ordered("==", best, least),
                                builder.fcmp_ordered("<", least, ir.Constant(V8F, [FLT_MAX] * LANES)))
        big = ir.Constant(V8I, [2**31 - 1] * LANES)
        first = fold(builder, builder.select(at_least, builder.load(pos_p), big), "<", False)
        winner = builder.extract_element(first, ir.Constant(I32, 0))
        found = builder.icmp_signed("!=", winner, ir.Constant(I32, 2**31 - 1))
        return builder.sext(builder.select(found, winner, ir.Constant(I32, -1)), I64)

    return sig, codegen


@intrinsic
def nearest_listed_lanes(typingctx, packed, starts, counts, steps, neg_x, w, scales, out):  # type: ignore[no-untyped-def]
    """nearest_listed for eight searches at once, one a lane: the same group of four values (-x neg_x, weights w)
    at eight scales (scales[l]), each over its own list of counts[l] neighbours (0: no search) whose grid points'
    four magnitudes are the bytes of packed[starts[l] + j] (q itself, as nearest_listed's mul 1, add 0). out[l] =
    the position of the first least sum below FLT_MAX in lane l's list, or -1; steps = the largest count. Each lane
    scores its list in order with nearest_listed's float operations. Where the trials of a sub-block search one
    group, their short lists one at a time left the CPU waiting on each search's chain of loads and sums (~60 ns a
    search, most of IQ3_S's time); eight chains side by side hide that."""
    arrays = (("packed", packed, types.uint32), ("starts", starts, types.int32), ("counts", counts, types.int32),
              ("scales", scales, types.float32), ("out", out, types.int32))
    for name, arg, dtype in arrays:
        require_array("nearest_listed_lanes", name, arg, 1, dtype)
    if len(neg_x) != 4 or len(w) != 4:
        raise TypingError("nearest_listed_lanes: groups of 4 values")
    sig = types.void(packed, starts, counts, types.int64, neg_x, w, scales, out)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        packed_a, starts_a, counts_a, _, _, _, scales_a, out_a = (
            context.make_array(t)(context, builder, value=v) if isinstance(t, types.Array) else None
            for t, v in zip(signature.args, args))
        steps_v, neg_x_v, w_v = args[3], args[4], args[5]
        zero = ir.Constant(I64, 0)
        lane_starts = load_vector(builder, starts_a.data, zero, V8I)
        lane_counts = load_vector(builder, counts_a.data, zero, V8I)
        vscale = load_vector(builder, scales_a.data, zero, V8F)
        vx = [splat(builder, builder.extract_value(neg_x_v, i), V8F) for i in range(4)]
        vw = [splat(builder, builder.extract_value(w_v, i), V8F) for i in range(4)]
        base = splat(builder, builder.ptrtoint(packed_a.data, I64), V8L)
        pointers_t = ir.VectorType(I32.as_pointer(), LANES)
        mask_t = ir.VectorType(ir.IntType(1), LANES)
        gather = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(V8I, [pointers_t, I32, mask_t, V8I]), "llvm.masked.gather.v8i32.v8p0")
        best_p = cgutils.alloca_once_value(builder, ir.Constant(V8F, [float("inf")] * LANES))
        pos_p = cgutils.alloca_once_value(builder, ir.Constant(V8I, [-1] * LANES))
        with cgutils.for_range(builder, steps_v) as loop:
            j = splat(builder, builder.trunc(loop.index, I32), V8I)
            live = builder.icmp_signed("<", j, lane_counts)
            offsets = builder.mul(builder.sext(builder.add(lane_starts, j), V8L), ir.Constant(V8L, [4] * LANES))
            pointers = builder.inttoptr(builder.add(base, offsets), pointers_t)
            words = builder.call(gather, [pointers, ir.Constant(I32, 4), live, ir.Constant(V8I, [0] * LANES)])
            d2 = ir.Constant(V8F, [0.0] * LANES)
            for i in range(4):
                byte = builder.and_(builder.lshr(words, ir.Constant(V8I, [8 * i] * LANES)),
                                    ir.Constant(V8I, [255] * LANES))
                diff = fma(builder, vscale, builder.uitofp(byte, V8F), vx[i])
                d2 = fma(builder, builder.fmul(vw[i], diff), diff, d2)
            best = builder.load(best_p)
            better = builder.and_(live, builder.fcmp_ordered("<", d2, best))
            builder.store(builder.select(better, d2, best), best_p)
            builder.store(builder.select(better, j, builder.load(pos_p)), pos_p)
        found = builder.fcmp_ordered("<", builder.load(best_p), ir.Constant(V8F, [FLT_MAX] * LANES))
        result = builder.select(found, builder.load(pos_p), ir.Constant(V8I, [-1] * LANES))
        builder.store(result, builder.bitcast(out_a.data, V8I.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen
