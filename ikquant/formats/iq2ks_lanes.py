"""IQ2_KS's trial-scale fit as 8-lane vector IR, the way ik's AVX2 search computes it (compute_1block_iq2ks): the
32 values of a sub-block as four vectors, each value's code the grid entry nearest x for +scale and for -scale (in
squared distance, the first least of the four), and the fit sums (sum w q x, sum w q^2) of both signs, each lane a
chain over the values 8 apart. Written as IR so that the search's speed does not hang on whether LLVM vectorises
the scalar loop (it did not: 70 ns a trial, ik's AVX2 build about 3 times faster)."""

from __future__ import annotations

from llvmlite import ir
from numba import types

from ikquant.formats.jit import intrinsic, require_array
from ikquant.formats.vector_ir import I64, LANES, V8F, fma, hsum8, load_vector, splat

SUB = 32


@intrinsic
def iq2ks_trial_sums(typingctx, xb, wb, grid, off, scale, sums):  # type: ignore[no-untyped-def]
    """For the sub-block xb (32 values, weights wb) at trial scale `scale` on grid[off .. off + 3]: sums[0..3] =
    sum w q+ x, sum w q+^2, sum w q- x, sum w q-^2, q+ / q- the grid values nearest x / scale and -x / scale; each
    sum 8 lanes of fmaf chains (lane l over the values l, l + 8, l + 16, l + 24 in that order) added as ik's
    hsum_float_8 adds them: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))."""
    for name, arg in (("xb", xb), ("wb", wb), ("grid", grid), ("sums", sums)):
        require_array("iq2ks_trial_sums", name, arg, 1, types.float32)
    sig = types.void(xb, wb, grid, types.int64, types.float32, sums)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        xs, ws, gs, _, _, out = (context.make_array(t)(context, builder, value=v).data if isinstance(t, types.Array)
                                 else None for t, v in zip(signature.args, args))
        off, dt = args[3], args[4]
        values = [builder.load(builder.gep(gs, [builder.add(off, ir.Constant(I64, i))])) for i in range(4)]
        steps = [splat(builder, builder.fmul(dt, v), V8F) for v in values]
        grid_v = [splat(builder, v, V8F) for v in values]
        zero = ir.Constant(V8F, [0.0] * LANES)
        acc = [zero] * 4

        def nearest(x: ir.Value, sign: int) -> ir.Value:
            """The grid value whose step lies nearest x (sign +1) or -x (sign -1)."""
            def error(i: int) -> ir.Value:
                e = builder.fsub(x, steps[i]) if sign > 0 else builder.fadd(x, steps[i])
                return builder.fmul(e, e)

            best, q = error(0), grid_v[0]
            for i in (1, 2, 3):
                e = error(i)
                closer = builder.fcmp_ordered("<", e, best)
                if i < 3:
                    best = builder.select(closer, e, best)
                q = builder.select(closer, grid_v[i], q)
            return q

        for k in range(SUB // LANES):
            at = ir.Constant(I64, LANES * k)
            x, w = load_vector(builder, xs, at, V8F), load_vector(builder, ws, at, V8F)
            for half, sign in ((0, 1), (2, -1)):
                q = nearest(x, sign)
                wq = builder.fmul(w, q)
                acc[half] = fma(builder, wq, x, acc[half])
                acc[half + 1] = fma(builder, wq, q, acc[half + 1])
        for r in range(4):
            builder.store(hsum8(builder, acc[r]), builder.gep(out, [ir.Constant(I64, r)]))
        return context.get_dummy_value()

    return sig, codegen
