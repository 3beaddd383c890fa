"""Float32 matmul of a routed expert's tokens with a fixed summation order: the exact mode's expert kernel.

The exact runtime must give the same bits whatever the batching (chunk by chunk, layer-streamed, any grouping of
experts) and thread count, which BLAS does not promise. Here every output y[t, r] = sum_k w[r, k] x[t, k] is one
fused multiply-add chain over k in order, whoever computes it: 16 tokens share a vector (their lanes), each weight
value is broadcast to them, and a call keeps 4 weight rows x 2 token groups of accumulators, so the FMA units stay
busy without summing across lanes. The weights are read in place (row-major, as decoded); only the tokens are
transposed, 16 to a group.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from ikrun.ops.parallel import pick

LANES = 16  # tokens per vector
ROWS = 4  # weight rows per call
GROUPS = 2  # token groups per call
K_STEP = 256  # values of a row per pass over the tokens (their panel stays in the first-level cache)
_I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16F = ir.VectorType(_F32, LANES)


@intrinsic
def _tile(typingctx, w, r0, xt, g0, k0, k1, n, out, n_tok):  # type: ignore[no-untyped-def]
    """out[r, 16 g : 16 g + 16] += sum_{k0 <= k < k1} w[r, k] xt[g, k, :] for rows r0 .. r0 + ROWS - 1 and token
    groups g0 .. g0 + GROUPS - 1, k in order, one fused multiply-add at a time per lane."""
    sig = types.void(w, types.int64, xt, types.int64, types.int64, types.int64, types.int64, out, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        w_p = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        x_p = context.make_array(signature.args[2])(context, builder, value=args[2]).data
        o_p = context.make_array(signature.args[7])(context, builder, value=args[7]).data
        r0, g0, k0, k1, n, n_tok = args[1], args[3], args[4], args[5], args[6], args[8]
        const = lambda v: ir.Constant(_I64, v)  # noqa: E731
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
        rows = [builder.add(r0, const(i)) for i in range(ROWS)]
        groups = [builder.add(g0, const(h)) for h in range(GROUPS)]
        outs = {(i, h): builder.bitcast(builder.gep(o_p, [builder.add(builder.mul(rows[i], n_tok), builder.mul(
            groups[h], const(LANES)))]), _V16F.as_pointer()) for i in range(ROWS) for h in range(GROUPS)}
        accs = {key: cgutils.alloca_once_value(builder, builder.load(o, align=4)) for key, o in outs.items()}
        with cgutils.for_range(builder, builder.sub(k1, k0)) as loop:
            k = builder.add(k0, loop.index)
            xs = [builder.load(builder.bitcast(builder.gep(x_p, [builder.mul(builder.add(builder.mul(g, n), k),
                                                                              const(LANES))]),
                                               _V16F.as_pointer()), align=4) for g in groups]
            for i in range(ROWS):
                wv = builder.load(builder.gep(w_p, [builder.add(builder.mul(rows[i], n), k)]))
                splat = builder.shuffle_vector(builder.insert_element(ir.Constant(_V16F, ir.Undefined), wv,
                                                                      ir.Constant(_I32, 0)),
                                               ir.Constant(_V16F, ir.Undefined), ir.Constant(
                                                   ir.VectorType(_I32, LANES), [0] * LANES))
                for h in range(GROUPS):
                    builder.store(builder.call(fma, [splat, xs[h], builder.load(accs[(i, h)])]), accs[(i, h)])
        for key, o in outs.items():
            builder.store(builder.load(accs[key]), o, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def _rows(w, xt, out, t, n, n_groups, n_tok):  # type: ignore[no-untyped-def]
    """Weight rows ROWS x t .. against every token group, K_STEP values at a time."""
    for k0 in range(0, n, K_STEP):
        k1 = min(n, k0 + K_STEP)
        for g0 in range(0, n_groups, GROUPS):
            _tile(w, t * ROWS, xt, g0, k0, k1, n, out, n_tok)


@njit(cache=True, nogil=True, parallel=True)
def _gemm_parallel(w, xt, out, n_rows, n, n_groups, n_tok):  # type: ignore[no-untyped-def]
    for t in prange(n_rows // ROWS):
        _rows(w, xt, out, t, n, n_groups, n_tok)


@njit(cache=True, nogil=True)
def _gemm_serial(w, xt, out, n_rows, n, n_groups, n_tok):  # type: ignore[no-untyped-def]
    for t in range(n_rows // ROWS):
        _rows(w, xt, out, t, n, n_groups, n_tok)


def token_groups(x: np.ndarray) -> np.ndarray:
    """Tokens x [m, n] as the kernel takes them: [groups, n, 16], m padded with zero rows to whole call groups."""
    m, n = x.shape
    groups = -(-m // (LANES * GROUPS)) * GROUPS
    xt = np.zeros((groups * LANES, n), np.float32)
    xt[:m] = x
    return np.ascontiguousarray(xt.reshape(groups, LANES, n).transpose(0, 2, 1))


def expert_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [m, n] @ w[rows, n]^T in float32, each output one FMA chain over n in order: [m, rows]."""
    m, n = x.shape
    rows = w.shape[0]
    xt = token_groups(x)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if rows % ROWS:
        w = np.concatenate([w, np.zeros((-rows % ROWS, n), np.float32)])
    out = np.zeros((w.shape[0], xt.shape[0] * LANES), np.float32)  # the kernel adds each pass to what is there
    pick(_gemm_serial, _gemm_parallel, w.shape[0] * n * xt.shape[0])(
        w.reshape(-1), xt.reshape(-1), out.reshape(-1), w.shape[0], n, xt.shape[0], out.shape[1])
    return out[:rows, :m].T
