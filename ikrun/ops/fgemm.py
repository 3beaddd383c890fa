"""Float32 matmul of a routed expert's tokens with a fixed summation order: the exact mode's expert kernel.

The exact runtime must give the same bits whatever the batching (chunk by chunk, layer-streamed, any grouping of
experts) and thread count, which BLAS does not promise. Here every output y[t, r] = sum_k w[r, k] x[t, k] is one
fused multiply-add chain over k in order, whoever computes it: 16 tokens share a vector (their lanes), each weight
value is broadcast to them, and a call keeps a register tile of accumulators (ROWS weight rows x GROUPS token
groups, sized to the host's vector registers), so the FMA units stay busy without summing across lanes. The
weights are read from the matrix itself: float32 as decoded, or the file's own f16 / bf16 bits, widened to float32
(exactly) a small panel at a time (ROWS rows x K_STEP values), so half-precision experts are never
decoded into a float32 copy. The tokens are transposed, 16 to a group.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic, overload

from ikquant.formats.numeric import widen_16
from ikrun.ops.cpu import host_has
from ikrun.ops.parallel import claim_items, run_claimed, task_items

LANES = 16  # tokens per vector
#: weight rows and token groups per call. AVX2 has 16 vector registers of 8 floats: 6 x 1 keeps 12 accumulators,
#: the group's two token vectors and the broadcast weight in registers (4 x 2 spilled accumulators to the stack
#: every step: f16 experts 38 -> 60 GFLOP/s per core of an EPYC); 4 x 2 elsewhere (AVX-512: eight registers)
AVX2_TILE = host_has("avx2") and host_has("fma") and not host_has("avx512f")
ROWS, GROUPS = (6, 1) if AVX2_TILE else (4, 2)
K_STEP = 256  # values of a row per pass over the tokens (their panel stays in the first-level cache)
_I32, _I64, _F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
_V16F = ir.VectorType(_F32, LANES)


@intrinsic
def _tile(typingctx, panel, xt, g0, k0, k1, n, out, r0, n_tok):  # type: ignore[no-untyped-def]
    """out[r, 16 g : 16 g + 16] += sum_{k0 <= k < k1} w[r, k] xt[g, k, :] for rows r0 .. r0 + ROWS - 1 and token
    groups g0 .. g0 + GROUPS - 1, k in order, one fused multiply-add at a time per lane; the weights come from
    `panel` (_panel: rows K_STEP apart, a constant, so each step's ROWS broadcasts are offsets of one pointer)."""
    sig = types.void(panel, xt, *[types.int64] * 4, out, types.int64, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        w_p = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        x_p = context.make_array(signature.args[1])(context, builder, value=args[1]).data
        o_p = context.make_array(signature.args[6])(context, builder, value=args[6]).data
        g0, k0, k1, n = args[2], args[3], args[4], args[5]
        r0, n_tok = args[7], args[8]
        const = lambda v: ir.Constant(_I64, v)  # noqa: E731
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
        rows = [builder.add(r0, const(i)) for i in range(ROWS)]
        groups = [builder.add(g0, const(h)) for h in range(GROUPS)]
        outs = {(i, h): builder.bitcast(builder.gep(o_p, [builder.add(builder.mul(rows[i], n_tok), builder.mul(
            groups[h], const(LANES)))]), _V16F.as_pointer()) for i in range(ROWS) for h in range(GROUPS)}
        accs = {key: cgutils.alloca_once_value(builder, builder.load(o, align=4)) for key, o in outs.items()}
        x_at = [builder.gep(x_p, [builder.mul(builder.add(builder.mul(g, n), k0), const(LANES))]) for g in groups]
        with cgutils.for_range(builder, builder.sub(k1, k0)) as loop:
            step = builder.mul(loop.index, const(LANES))
            xs = [builder.load(builder.bitcast(builder.gep(x, [step]), _V16F.as_pointer()), align=4) for x in x_at]
            for i in range(ROWS):
                wv = builder.load(builder.gep(w_p, [builder.add(loop.index, const(i * K_STEP))]))
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


def _value(w, at):  # type: ignore[no-untyped-def]
    """w[at] as float32: float32 as it is, f16 / bf16 bits widened (exactly)."""


@overload(_value, inline="always")
def _value_impl(w, at):  # type: ignore[no-untyped-def]
    if w.dtype == types.float32:
        return lambda w, at: w[at]
    return lambda w, at: widen_16(w[at])


@njit(cache=True, nogil=True, inline="always")
def _panel(w, r0, n, k0, k1, panel):  # type: ignore[no-untyped-def]
    """Rows r0 .. r0 + ROWS - 1, values k0 .. k1 of w as float32 in `panel` [ROWS, K_STEP] (a vector copy, or
    vcvtph2ps / shifts for 16-bit weights)."""
    for i in range(ROWS):
        for j in range(k1 - k0):
            panel[i * K_STEP + j] = _value(w, (r0 + i) * n + k0 + j)


@njit(cache=True, nogil=True, inline="always")
def _rows(w, xt, out, t, n, n_groups, n_tok):  # type: ignore[no-untyped-def]
    """Weight rows ROWS x t .. against every token group, K_STEP values at a time."""
    panel = np.empty(ROWS * K_STEP, np.float32)
    for k0 in range(0, n, K_STEP):
        k1 = min(n, k0 + K_STEP)
        _panel(w, t * ROWS, n, k0, k1, panel)
        for g0 in range(0, n_groups, GROUPS):
            _tile(panel, xt, g0, k0, k1, n, out, t * ROWS, n_tok)


@njit(cache=True, nogil=True, parallel=True)
def _gemm_parallel(w, xt, out, n_rows, n, n_groups, n_tok, threads):  # type: ignore[no-untyped-def]
    """The ROWS-row tiles in tasks the threads claim (ikrun/ops/parallel.py)."""
    tiles = n_rows // ROWS
    per, counter = task_items(tiles, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        t0, t1 = claim_items(counter, per, tiles)
        while t0 < t1:
            for t in range(t0, t1):
                _rows(w, xt, out, t, n, n_groups, n_tok)
            t0, t1 = claim_items(counter, per, tiles)


@njit(cache=True, nogil=True)
def _gemm_serial(w, xt, out, n_rows, n, n_groups, n_tok):  # type: ignore[no-untyped-def]
    for t in range(n_rows // ROWS):
        _rows(w, xt, out, t, n, n_groups, n_tok)


@njit(cache=True, nogil=True)
def _gather_groups(x: np.ndarray, tokens: np.ndarray, xt: np.ndarray) -> None:
    """xt[g, :, l] = x[tokens[16 g + l]] (xt zeroed beyond the last token)."""
    for i in range(tokens.size):
        g, lane = i // LANES, i % LANES
        src = x[tokens[i]]
        for k in range(x.shape[1]):
            xt[g, k, lane] = src[k]


def token_groups(x: np.ndarray, tokens: np.ndarray | None = None) -> np.ndarray:
    """Tokens x [m, n] (or the rows `tokens` of x) as the kernel takes them: [groups, n, 16], padded with zero rows to
    whole call groups, gathered and transposed in one pass."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    idx = np.arange(x.shape[0], dtype=np.int64) if tokens is None else np.ascontiguousarray(tokens, dtype=np.int64)
    groups = -(-idx.size // (LANES * GROUPS)) * GROUPS
    xt = np.zeros((groups, x.shape[1], LANES), np.float32)
    _gather_groups(x, idx, xt)
    return xt


@njit(cache=True, nogil=True)
def _untranspose(out: np.ndarray, m: int, rows: int, dst: np.ndarray) -> None:
    """dst[t, r] = out[r, t] for the m tokens and the weight's rows, 16 rows at a time (their values of one token
    are one cache line of dst)."""
    for r0 in range(0, rows, 16):
        r1 = min(rows, r0 + 16)
        for t in range(m):
            for r in range(r0, r1):
                dst[t, r] = out[r, t]


#: weight dtypes the kernel reads: float32, f16 bits (uint16) and bf16 bits (int16), the latter widened exactly
WEIGHT_DTYPES = (np.float32, np.uint16, np.int16)


def expert_matmul(x: np.ndarray, w: np.ndarray, tokens: np.ndarray | None = None) -> np.ndarray:
    """x [m, n] (or its rows `tokens`) @ w[rows, n]^T in float32, each output one FMA chain over n in order:
    [m, rows], C-contiguous. w is float32 (any other float dtype is converted), or 16-bit patterns: uint16 for f16,
    int16 for bf16."""
    m, n = (x.shape[0] if tokens is None else len(tokens)), x.shape[1]
    rows = w.shape[0]
    xt = token_groups(x, tokens)
    dtype = w.dtype.type if w.dtype.type in WEIGHT_DTYPES else np.float32
    w = np.ascontiguousarray(w, dtype=dtype)
    if rows % ROWS:
        w = np.concatenate([w, np.zeros((-rows % ROWS, n), dtype)])
    out = np.zeros((w.shape[0], xt.shape[0] * LANES), np.float32)  # the kernel adds each pass to what is there
    run_claimed(_gemm_serial, _gemm_parallel, w.shape[0] * n * xt.shape[0], w.reshape(-1), xt.reshape(-1),
                out.reshape(-1), w.shape[0], n, xt.shape[0], out.shape[1])
    result = np.empty((m, rows), np.float32)
    _untranspose(out, m, rows, result)
    return result
