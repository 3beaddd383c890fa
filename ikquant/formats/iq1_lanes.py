"""Which splits IQ1_S's and IQ1_M's searches must score, found eight second cut points at a time as 8-lane vector IR.

The searches (iq1_search.iq1s_best_split, iq1m_best_split) score every pair of cut points (i1 <= i2) of a sorted block for
each shift (IQ1_S: 2, IQ1_M: 4 combinations) in order and take a split wherever `sumqx^2 > best * sumq2`, best
being the last taken split's (sumqx / sumq2) sumqx: about 50 of IQ1_S's 1,122 candidates are taken, each depending
on the one before, so the scalar loop is a chain of branches on rounded floats (over half of IQ1_S's time). The
split taken last has, to within rounding, the greatest score sumqx^2 / sumq2 of all; a split scoring below
(1 - CONTENDER_GAP) times the greatest, a gap far wider than rounding can move a score through the whole scan, is
never taken last, and while only such splits have been taken the best stays below every contender's score, so the
first contender well above the gap is taken in any case and the scan after it is the same. The scalar loop
therefore scans the contenders alone, in order, from the start, and takes the same last split: `iq1s_contenders` /
`iq1m_contenders` mark them (6-20 of the 561 splits of a gaussian IQ1_S block). Their lanes compute sumqx and sumq2
with the scalar loop's float operations; where a sum or score could be a subnormal or overflow (blocks near zero, or
of huge values), that rounding argument does not hold and they return False: the caller scans every split.
Written as IR so that the speed does not hang on whether LLVM vectorises a loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError

from ikquant.formats.jit import intrinsic, require_array
from ikquant.formats.vector_ir import F32, I1, I32, I64, LANES, V8F, V8I, fma, fold, load_vector, splat

#: contenders score at least (1 - CONTENDER_GAP) times the greatest score (rounding moves a score ~1e-7 a step)
CONTENDER_GAP = 2.0**-8
#: usable sumq2 and nonzero scores at least _LOW, scores at most _HIGH: there the scan's products keep their precision
_LOW, _HIGH = 2.0**-60, 2.0**100
#: the callers rule out overflow beforehand: sum w and sum |w x| of a block at most these
SUM_W_MAX = 2.0**100
SUM_WX_MAX = 2.0**48
V8B1 = ir.VectorType(I1, LANES)
#: a level (-1, 0, +1) plus the group's shift, for shift +1/8 and -1/8 (iq1_search's SHIFT_PLUS, SHIFT_MINUS)
PLUS = (-1 + 0.125, 0.125, 1 + 0.125)
MINUS = (-1 - 0.125, -0.125, 1 - 0.125)

#: (a, b, c) of one prefix-sum row: its sums below i1, from i1 to i2, from i2 on
Parts = tuple[ir.Value, ir.Value, ir.Value]
#: a chunk's (sumqx, sumq2) per shift, from its rows' parts
Scores = Callable[[ir.IRBuilder, Sequence[Parts]], list[tuple[ir.Value, ir.Value]]]


def _const(v: float) -> ir.Value:
    return ir.Constant(V8F, [v] * LANES)


def _iq1s_scores(builder: ir.IRBuilder, rows: Sequence[Parts]) -> list[tuple[ir.Value, ir.Value]]:
    """IQ1_S's (iq1_search._fit3, _norm3): sumqx = (a q0 + b q1) + c q2 with the last product fused; sumq2 the terms
    (w q) q added in order, the last fused for the shift -1/8 only."""
    (a, b, c), (wa, wb, wc) = rows
    out = []
    for (q0, q1, q2), fused in ((PLUS, False), (MINUS, True)):
        sqx = fma(builder, c, _const(q2), builder.fadd(builder.fmul(a, _const(q0)), builder.fmul(b, _const(q1))))
        t = builder.fadd(builder.fmul(builder.fmul(wa, _const(q0)), _const(q0)),
                         builder.fmul(builder.fmul(wb, _const(q1)), _const(q1)))
        wq2 = builder.fmul(wc, _const(q2))
        out.append((sqx, fma(builder, wq2, _const(q2), t) if fused else builder.fadd(t, builder.fmul(wq2, _const(q2)))))
    return out


def _iq1m_scores(builder: ir.IRBuilder, rows: Sequence[Parts]) -> list[tuple[ir.Value, ir.Value]]:
    """IQ1_M's (iq1_search.iq1m_block), combinations 0..3 (first group's shift - from 2 on, second's - when odd)."""
    (a1, b1, c1), (wa1, wb1, wc1), (a2, b2, c2), (wa2, wb2, wc2) = rows
    out = []
    for k in range(4):
        p, q = (MINUS if k >= 2 else PLUS), (MINUS if k % 2 else PLUS)
        t = builder.fadd(fma(builder, c1, _const(p[2]), fma(builder, b1, _const(p[1]), builder.fmul(a1, _const(p[0])))),
                         builder.fmul(a2, _const(q[0])))
        sqx = fma(builder, c2, _const(q[2]), fma(builder, b2, _const(q[1]), t))
        first = builder.fmul(builder.fmul(wa1, _const(p[0])), _const(p[0]))
        t = fma(builder, builder.fmul(wc1, _const(p[2])), _const(p[2]),
                fma(builder, builder.fmul(wb1, _const(p[1])), _const(p[1]), first))
        t = builder.fadd(t, builder.fmul(builder.fmul(wa2, _const(q[0])), _const(q[0])))
        sq2 = fma(builder, builder.fmul(wc2, _const(q[2])), _const(q[2]),
                  fma(builder, builder.fmul(wb2, _const(q[1])), _const(q[1]), t))
        out.append((sqx, sq2))
    return out


def _contenders(name: str, max_n: int, n_rows: int, n_scores: int, scores: Scores) -> Callable[..., bool]:
    """An intrinsic (sums, n, marks) -> bool: mark in marks[i1] (bit i2) the splits (i1, i2), i1 <= i2 <= n, whose
    score sumqx^2 / sumq2 (sumq2 > 0, any shift) is within CONTENDER_GAP of the greatest, and return True; False
    (marks undefined) where the argument of the module's docstring may not hold: a usable split's sumq2 below
    2^-60, or the greatest score above 2^100 or, unless 0, below 2^-60. sums: [rows, >= n + 1 + 8] float32 prefix
    sums over the sorted block (n <= max_n), rows as `scores` takes them; marks: n + 1 int64."""
    chunks = n_scores * sum((max_n - i1) // LANES + 1 for i1 in range(max_n + 1))

    def definition(typingctx, sums, n, marks):  # type: ignore[no-untyped-def]
        require_array(name, "sums", sums, 2, types.float32)
        require_array(name, "marks", marks, 1, types.int64, contiguous=False)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            sums_a = context.make_array(signature.args[0])(context, builder, value=args[0])
            marks_a = context.make_array(signature.args[2])(context, builder, value=args[2])
            n = args[1]
            zero, one, lanes = ir.Constant(I64, 0), ir.Constant(I64, 1), ir.Constant(I64, LANES)
            row_len = builder.extract_value(sums_a.shape, 1)
            starts = [builder.gep(sums_a.data, [builder.mul(ir.Constant(I64, r), row_len)]) for r in range(n_rows)]

            def at(r: int, i: ir.Value) -> ir.Value:
                return builder.load(builder.gep(starts[r], [i]))

            stored = cgutils.alloca_once(builder, V8F, size=ir.Constant(I64, chunks))
            ends = [splat(builder, at(r, n), V8F) for r in range(n_rows)]
            n32 = splat(builder, builder.trunc(n, I32), V8I)
            slot_p = cgutils.alloca_once_value(builder, zero)

            def each_chunk(body: Callable[[ir.Value, ir.Value, Callable[[], list[tuple[ir.Value, ir.Value]]]], None],
                           ) -> None:
                """body(i1, base, chunk scores) for every chunk of splits (i1, base .. base + 7) in scan order."""
                with cgutils.for_range(builder, builder.add(n, one)) as rows:
                    i1 = rows.index
                    firsts = [splat(builder, at(r, i1), V8F) for r in range(n_rows)]
                    below = [splat(builder, builder.fsub(at(r, i1), at(r, zero)), V8F) for r in range(n_rows)]
                    count = builder.add(builder.sdiv(builder.sub(n, i1), lanes), one)
                    with cgutils.for_range(builder, count) as loop:
                        base = builder.add(i1, builder.mul(loop.index, lanes))

                        def chunk_scores() -> list[tuple[ir.Value, ir.Value]]:
                            parts = []
                            for r in range(n_rows):
                                v = load_vector(builder, starts[r], base, V8F)
                                parts.append((below[r], builder.fsub(v, firsts[r]), builder.fsub(ends[r], v)))
                            return scores(builder, parts)

                        body(i1, base, chunk_scores)

            # pass 1: every split's scores (-inf where sumq2 <= 0 or past n), the greatest, the least usable sumq2
            top_p = cgutils.alloca_once_value(builder, _const(float("-inf")))
            low_p = cgutils.alloca_once_value(builder, _const(float("inf")))

            def first_pass(i1: ir.Value, base: ir.Value, chunk_scores) -> None:  # type: ignore[no-untyped-def]
                lane = builder.add(splat(builder, builder.trunc(base, I32), V8I), ir.Constant(V8I, list(range(LANES))))
                split = builder.icmp_signed("<=", lane, n32)
                top, low, slot = builder.load(top_p), builder.load(low_p), builder.load(slot_p)
                for k, (sqx, sq2) in enumerate(chunk_scores()):
                    usable = builder.and_(builder.fcmp_ordered(">", sq2, _const(0.0)), split)
                    score = builder.select(usable, builder.fdiv(builder.fmul(sqx, sqx), sq2), _const(float("-inf")))
                    builder.store(score, builder.gep(stored, [builder.add(slot, ir.Constant(I64, k))]))
                    top = builder.select(builder.fcmp_ordered(">", score, top), score, top)
                    usable_sq2 = builder.select(usable, sq2, _const(float("inf")))
                    low = builder.select(builder.fcmp_ordered("<", usable_sq2, low), usable_sq2, low)
                builder.store(top, top_p)
                builder.store(low, low_p)
                builder.store(builder.add(slot, ir.Constant(I64, n_scores)), slot_p)

            each_chunk(first_pass)

            best, least = (builder.extract_element(fold(builder, builder.load(p), op, True), ir.Constant(I32, 0))
                           for p, op in ((top_p, ">"), (low_p, "<")))
            no_split = builder.fcmp_ordered("==", best, ir.Constant(F32, float("-inf")))
            best_ok = builder.or_(builder.or_(no_split, builder.fcmp_ordered("==", best, ir.Constant(F32, 0.0))),
                                  builder.and_(builder.fcmp_ordered(">=", best, ir.Constant(F32, _LOW)),
                                               builder.fcmp_ordered("<=", best, ir.Constant(F32, _HIGH))))
            safe = builder.and_(best_ok, builder.fcmp_ordered(">=", least, ir.Constant(F32, _LOW)))
            with builder.if_then(safe):
                # pass 2: the marks, from the stored scores in the same order
                thr = splat(builder, builder.select(no_split, ir.Constant(F32, float("inf")),
                                                    builder.fmul(best, ir.Constant(F32, 1.0 - CONTENDER_GAP))), V8F)
                builder.store(zero, slot_p)
                with cgutils.for_range(builder, builder.add(n, one)) as rows:
                    builder.store(zero, builder.gep(marks_a.data, [rows.index]))

                def second_pass(i1: ir.Value, base: ir.Value, chunk_scores) -> None:  # type: ignore[no-untyped-def]
                    slot = builder.load(slot_p)
                    hit = ir.Constant(V8B1, [0] * LANES)
                    for k in range(n_scores):
                        score = builder.load(builder.gep(stored, [builder.add(slot, ir.Constant(I64, k))]))
                        hit = builder.or_(hit, builder.fcmp_ordered(">=", score, thr))
                    bits = builder.shl(builder.zext(builder.bitcast(hit, ir.IntType(LANES)), I64), base)
                    mark_p = builder.gep(marks_a.data, [i1])
                    builder.store(builder.or_(builder.load(mark_p), bits), mark_p)
                    builder.store(builder.add(slot, ir.Constant(I64, n_scores)), slot_p)

                each_chunk(second_pass)
            return safe

        return types.boolean(sums, types.int64, marks), codegen

    definition.__name__ = name
    return intrinsic(definition)


#: IQ1_S's contenders (sums rows: w x, w) over up to 32 values
iq1s_contenders = _contenders("iq1s_contenders", 32, 2, 2, _iq1s_scores)
#: IQ1_M's contenders (sums rows: w x and w of the first 8 values, then of the second 8) over up to 16 values
iq1m_contenders = _contenders("iq1m_contenders", 16, 4, 4, _iq1m_scores)


@intrinsic
def lowest_bit(typingctx, bits):  # type: ignore[no-untyped-def]
    """The position of the lowest set bit of a nonzero int64."""
    if bits != types.int64:
        raise TypingError(f"lowest_bit: bits must be an int64, not {bits}")

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I64, [I64, I1]), "llvm.cttz.i64")
        return builder.call(fn, [args[0], ir.Constant(I1, 1)])

    return types.int64(types.int64), codegen

