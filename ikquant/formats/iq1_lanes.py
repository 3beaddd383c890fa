"""Which splits IQ1_S's search must score, found eight second cut points at a time as 8-lane vector IR.

The search (iq1_search.iq1s_block) scores every pair of cut points (i1 <= i2) of a sorted block for both shifts in
order and takes a split wherever `sumqx^2 > best * sumq2`, best being the last taken split's (sumqx / sumq2) sumqx:
about 50 of its 1,122 candidates are taken, each depending on the one before, so the scalar loop is a chain of
branches on rounded floats (over half of IQ1_S's time). The split taken last has, to within rounding, the greatest score
sumqx^2 / sumq2 of all; a split scoring below (1 - CONTENDER_GAP) times the greatest, a gap far wider than rounding
can move a score through the whole scan, is never taken last, and while only such splits have been taken the best
stays below every contender's score, so the first contender well above the gap is taken in any case and the scan
after it is the same. The scalar loop therefore scans the contenders alone, in order, from the start, and takes the
same last split: `split_contenders` marks them (6-20 of the 561 splits of a gaussian block). Its lanes compute sumqx and sumq2 with the scalar
loop's float operations; where a sum or score could be a subnormal or overflow (blocks near zero, or of huge
values), that rounding argument does not hold and it returns False: the caller scans every split.
Written as IR so that the speed does not hang on whether LLVM vectorises a loop."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError

from ikquant.formats.jit import intrinsic
from ikquant.formats.vector_ir import F32, I1, I32, I64, LANES, V8F, V8I, fma, load_vector, splat

#: the shifted levels -1, 0, +1 plus +1/8 and plus -1/8 (iq1_search.SHIFT_PLUS, SHIFT_MINUS); ik's build fuses the
#: last term of sumq2 for the shift -1/8 only
_SHIFTS = (((-1 + 0.125, 0.125, 1 + 0.125), False), ((-1 - 0.125, -0.125, 1 - 0.125), True))
#: contenders score at least (1 - CONTENDER_GAP) times the greatest score (rounding moves a score ~1e-7 a step)
CONTENDER_GAP = 2.0**-8
#: usable sumq2 and nonzero scores at least _LOW, scores at most _HIGH: there the scan's products keep their precision
_LOW, _HIGH = 2.0**-60, 2.0**100
V8B1 = ir.VectorType(I1, LANES)
#: the most splits a block may have (IQ1_S's 32 values), and the vectors of eight second cut points they take
MAX_BLOCK = 32
_MAX_CHUNKS = sum((MAX_BLOCK - i1) // LANES + 1 for i1 in range(MAX_BLOCK + 1))


@intrinsic
def split_contenders(typingctx, sumx, sumw, n, marks):  # type: ignore[no-untyped-def]
    """Mark in marks[i1] (bit i2) the splits (i1, i2), i1 <= i2 <= n, whose score sumqx^2 / sumq2 (sumq2 > 0, either
    shift) is within CONTENDER_GAP of the greatest, and return True; False (marks undefined) where the argument of
    the module's docstring may not hold: a usable split's sumq2 below 2^-60, or the greatest score above 2^100 or,
    unless 0, below 2^-60. The caller rules out overflow beforehand (sum w <= 2^100, sum |w x| <= 2^48). sumx, sumw:
    the prefix sums of w x and w over the sorted block (n + 1 of them, n <= MAX_BLOCK, readable to n + 8); marks:
    n + 1 int64."""
    for name, arg in (("sumx", sumx), ("sumw", sumw)):
        if not (isinstance(arg, types.Array) and arg.ndim == 1 and arg.layout == "C" and arg.dtype == types.float32):
            raise TypingError(f"split_contenders: {name} must be a contiguous 1-d float32 array, not {arg}")
    if not (isinstance(marks, types.Array) and marks.ndim == 1 and marks.dtype == types.int64):
        raise TypingError(f"split_contenders: marks must be a 1-d int64 array, not {marks}")
    sig = types.boolean(sumx, sumw, types.int64, marks)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        sx, sw, _, mk = (context.make_array(t)(context, builder, value=v) if isinstance(t, types.Array) else None
                         for t, v in zip(signature.args, args))
        n = args[2]
        zero64, one64, lanes64 = ir.Constant(I64, 0), ir.Constant(I64, 1), ir.Constant(I64, LANES)

        def const(v: float) -> ir.Value:
            return ir.Constant(V8F, [v] * LANES)

        def at(data: ir.Value, i: ir.Value) -> ir.Value:
            return builder.load(builder.gep(data, [i]))

        scores = cgutils.alloca_once(builder, V8F, size=ir.Constant(I64, 2 * _MAX_CHUNKS))
        sxn, swn = splat(builder, at(sx.data, n), V8F), splat(builder, at(sw.data, n), V8F)
        n32 = splat(builder, builder.trunc(n, I32), V8I)
        slot_p = cgutils.alloca_once_value(builder, zero64)
        top_p = cgutils.alloca_once_value(builder, const(float("-inf")))
        low_p = cgutils.alloca_once_value(builder, const(float("inf")))

        # pass 1: every split's score for both shifts (-inf where sumq2 <= 0), the greatest, the least usable sumq2
        with cgutils.for_range(builder, builder.add(n, one64)) as rows:
            i1 = rows.index
            a = splat(builder, builder.fsub(at(sx.data, i1), at(sx.data, zero64)), V8F)
            wa = splat(builder, builder.fsub(at(sw.data, i1), at(sw.data, zero64)), V8F)
            sx1, sw1 = splat(builder, at(sx.data, i1), V8F), splat(builder, at(sw.data, i1), V8F)
            with cgutils.for_range(builder, builder.add(builder.sdiv(builder.sub(n, i1), lanes64), one64)) as chunks:
                base = builder.add(i1, builder.mul(chunks.index, lanes64))
                x_i2, w_i2 = load_vector(builder, sx.data, base, V8F), load_vector(builder, sw.data, base, V8F)
                b, c = builder.fsub(x_i2, sx1), builder.fsub(sxn, x_i2)
                wb, wc = builder.fsub(w_i2, sw1), builder.fsub(swn, w_i2)
                lane = builder.add(splat(builder, builder.trunc(base, I32), V8I), ir.Constant(V8I, list(range(LANES))))
                split = builder.icmp_signed("<=", lane, n32)
                top, low, slot = builder.load(top_p), builder.load(low_p), builder.load(slot_p)
                for k, ((q0, q1, q2), fused) in enumerate(_SHIFTS):
                    sqx = fma(builder, c, const(q2), builder.fadd(builder.fmul(a, const(q0)), builder.fmul(b, const(q1))))
                    t = builder.fadd(builder.fmul(builder.fmul(wa, const(q0)), const(q0)),
                                     builder.fmul(builder.fmul(wb, const(q1)), const(q1)))
                    wq2 = builder.fmul(wc, const(q2))
                    sq2 = fma(builder, wq2, const(q2), t) if fused else builder.fadd(t, builder.fmul(wq2, const(q2)))
                    usable = builder.and_(builder.fcmp_ordered(">", sq2, const(0.0)), split)
                    score = builder.select(usable, builder.fdiv(builder.fmul(sqx, sqx), sq2), const(float("-inf")))
                    builder.store(score, builder.gep(scores, [builder.add(slot, ir.Constant(I64, k))]))
                    top = builder.select(builder.fcmp_ordered(">", score, top), score, top)
                    usable_sq2 = builder.select(usable, sq2, const(float("inf")))
                    low = builder.select(builder.fcmp_ordered("<", usable_sq2, low), usable_sq2, low)
                builder.store(top, top_p)
                builder.store(low, low_p)
                builder.store(builder.add(slot, ir.Constant(I64, 2)), slot_p)

        def across(v: ir.Value, op: str) -> ir.Value:
            r = builder.extract_element(v, ir.Constant(I32, 0))
            for k in range(1, LANES):
                e = builder.extract_element(v, ir.Constant(I32, k))
                r = builder.select(builder.fcmp_ordered(op, e, r), e, r)
            return r

        best, least = across(builder.load(top_p), ">"), across(builder.load(low_p), "<")
        no_split = builder.fcmp_ordered("==", best, ir.Constant(F32, float("-inf")))
        best_ok = builder.or_(builder.or_(no_split, builder.fcmp_ordered("==", best, ir.Constant(F32, 0.0))),
                              builder.and_(builder.fcmp_ordered(">=", best, ir.Constant(F32, _LOW)),
                                           builder.fcmp_ordered("<=", best, ir.Constant(F32, _HIGH))))
        safe = builder.and_(best_ok, builder.fcmp_ordered(">=", least, ir.Constant(F32, _LOW)))
        with builder.if_then(safe):
            # pass 2: the marks, from the stored scores in the same order
            thr = splat(builder, builder.select(no_split, ir.Constant(F32, float("inf")),
                                                builder.fmul(best, ir.Constant(F32, 1.0 - CONTENDER_GAP))), V8F)
            builder.store(zero64, slot_p)
            with cgutils.for_range(builder, builder.add(n, one64)) as rows:
                i1 = rows.index
                mark_p = builder.gep(mk.data, [i1])
                builder.store(zero64, mark_p)
                with cgutils.for_range(builder, builder.add(builder.sdiv(builder.sub(n, i1), lanes64), one64)) as chunks:
                    base = builder.add(i1, builder.mul(chunks.index, lanes64))
                    slot = builder.load(slot_p)
                    hit = ir.Constant(V8B1, [0] * LANES)
                    for k in range(2):
                        score = builder.load(builder.gep(scores, [builder.add(slot, ir.Constant(I64, k))]))
                        hit = builder.or_(hit, builder.fcmp_ordered(">=", score, thr))
                    bits = builder.zext(builder.bitcast(hit, ir.IntType(LANES)), I64)
                    builder.store(builder.or_(builder.load(mark_p), builder.shl(bits, base)), mark_p)
                    builder.store(builder.add(slot, ir.Constant(I64, 2)), slot_p)
        return safe

    return sig, codegen


@intrinsic
def lowest_bit(typingctx, bits):  # type: ignore[no-untyped-def]
    """The position of the lowest set bit of a nonzero int64."""
    if bits != types.int64:
        raise TypingError(f"lowest_bit: bits must be an int64, not {bits}")

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I64, [I64, I1]), "llvm.cttz.i64")
        return builder.call(fn, [args[0], ir.Constant(I1, 1)])

    return types.int64(types.int64), codegen
