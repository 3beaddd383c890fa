"""ik's float matmul kernels, for --numerics ik: the dot products of its AVX-512 f32/f16 kernel and of its bf16
kernel, those of its AVX2 f32/f16 kernel (--numerics ik-avx2), and the matmuls built from them.

ik multiplies F32 and F16 weights (and the attention's f16 cache) with f32 activations in a kernel of 16 lanes: lane
l sums the products of values l, l + 16, l + 32, ... (the first a product, the rest fused multiply-adds); the 16
lanes are then added as a tree (8 + 8, 4 + 4, then (0 + 2) + (1 + 3)). BF16 weights multiply activations rounded to
bf16 with vdpbf16ps: per 32 values, lane l takes values 2l + 1 then 2l, each a fused multiply-add (the products
are exact), then the same tree. (vdpbf16ps also flushes subnormal inputs and results to zero, which only values
below 1.2e-38 would show; ik's bf16 kernel drops the last values of rows that are no multiple of 32, which no model
has.) ik's AVX2 build sums in 8 lanes the same way (lane l: values l, l + 8, ...), then adds them as 4 + 4 and
(0 + 2) + (1 + 3); it multiplies bf16 weights in that kernel too, on activations rounded to bf16. Every dot product
here is computed with LLVM's vectors of the kernel's width in exactly that order.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from ikquant.formats.jit import read_only
from ikrun.ops.parallel import claim_items, task_items

LANES = 16  # ik's float kernels' vector width (AVX-512)
AVX2_LANES = 8  # that of its AVX2 build


def _tree(builder: ir.IRBuilder, v: ir.Value, lanes: int) -> ir.Value:
    """The `lanes` lanes of v added as ik's reduction adds them: halves (8 + 8 for 16 lanes, then 4 + 4), then
    (0 + 2) + (1 + 3)."""
    i32 = ir.IntType(32)

    def halves(v: ir.Value, width: int) -> ir.Value:
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width), list(range(width))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width), list(range(width, 2 * width))))
        return builder.fadd(hi, lo)

    u, width = v, lanes // 2
    while width >= 4:
        u = halves(u, width)
        width //= 2
    e = [builder.extract_element(u, ir.Constant(i32, j)) for j in range(4)]
    return builder.fadd(builder.fadd(e[0], e[2]), builder.fadd(e[1], e[3]))


#: weight rows per call of the dot-product kernels (independent chains of fused multiply-adds hide their latency)
DOTS = 4


#: activation rows ik_dot_grid takes at once (with DOTS weight rows: XROWS x DOTS chains, each weight vector
#: loaded once for all of them; 6 x 4 accumulators fit AVX-512's 32 registers: f32 108 -> 118 GFLOP/s a core
#: against 4 x 4)
XROWS = 6
#: the activation rows of the AVX2 kernel's grid: AVX2 has 16 registers, and 2 x 4 accumulators with their 6
#: vector loads fit them (3 x 4 spill: ~50 -> 80 GFLOP/s on a 2-core Zen 3, 2 x 4 ~140), so ik_dot_grid runs it
#: XROWS / AVX2_XROWS times
AVX2_XROWS = 2


def _make_grid(bf16: bool, xrows: int, lanes: int = LANES):  # type: ignore[no-untyped-def]
    """An intrinsic computing the xrows x DOTS dot products of activation rows x0 + a xs and weight rows y0 + t ys
    (n values each, a multiple of `lanes`, or of 32 with `bf16`) into out[o0 + a os + t], each summed as ik's kernel
    sums it (the module docstring): f32/f16, lane l takes values l, l + lanes, ... (the first a product, the rest
    fused multiply-adds); bf16, per 32 values lane l takes value 2l + 1 then 2l; then ik's tree over the lanes."""
    vec = ir.VectorType(ir.FloatType(), lanes)

    @intrinsic
    def grid(typingctx, x, x0, xs, y, y0, ys, n, out, o0, os):  # type: ignore[no-untyped-def]
        sig = types.void(x, types.int64, types.int64, y, types.int64, types.int64, types.int64, out, types.int64,
                         types.int64)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            xa, x0_v, xs_v, ya, y0_v, ys_v, n_v, oa, o0_v, os_v = args
            xp = context.make_array(signature.args[0])(context, builder, value=xa).data
            yp = context.make_array(signature.args[3])(context, builder, value=ya).data
            op = context.make_array(signature.args[7])(context, builder, value=oa).data
            fma_fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vec, [vec, vec, vec]), f"llvm.fma.v{lanes}f32")
            i64, i32 = ir.IntType(64), ir.IntType(32)
            const = lambda v: ir.Constant(i64, v)  # noqa: E731

            def load(p: ir.Value, off: ir.Value) -> ir.Value:
                if p.type.pointee == ir.IntType(16):  # a weight's f16 (uint16) or bf16 (int16) bits, widened
                    bits = builder.load(builder.bitcast(builder.gep(p, [off]), ir.VectorType(ir.IntType(16), lanes)
                                                        .as_pointer()), align=2)
                    if signature.args[3].dtype == types.uint16:
                        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), lanes)), vec)
                    wide = builder.zext(bits, ir.VectorType(i32, lanes))
                    return builder.bitcast(builder.shl(wide, ir.Constant(ir.VectorType(i32, lanes), [16] * lanes)),
                                           vec)
                return builder.load(builder.bitcast(builder.gep(p, [off]), vec.as_pointer()), align=4)

            xrows_v = [builder.add(x0_v, builder.mul(xs_v, const(a))) for a in range(xrows)]
            yrows = [builder.add(y0_v, builder.mul(ys_v, const(t))) for t in range(DOTS)]
            keys = [(a, t) for a in range(xrows) for t in range(DOTS)]
            if bf16:
                even = ir.Constant(ir.VectorType(i32, lanes), list(range(0, 2 * lanes, 2)))
                odd = ir.Constant(ir.VectorType(i32, lanes), list(range(1, 2 * lanes, 2)))

                def pairs(p: ir.Value, off: ir.Value) -> tuple[ir.Value, ir.Value]:
                    lo, hi = load(p, off), load(p, builder.add(off, const(lanes)))
                    return builder.shuffle_vector(lo, hi, odd), builder.shuffle_vector(lo, hi, even)

                accs = {key: cgutils.alloca_once_value(builder, ir.Constant(vec, [0.0] * lanes)) for key in keys}
                with cgutils.for_range(builder, builder.udiv(n_v, const(2 * lanes))) as loop:
                    off = builder.mul(loop.index, const(2 * lanes))
                    xv = [pairs(xp, builder.add(r, off)) for r in xrows_v]
                    yv = [pairs(yp, builder.add(r, off)) for r in yrows]
                    for a, t in keys:
                        acc = builder.call(fma_fn, [xv[a][0], yv[t][0], builder.load(accs[(a, t)])])
                        builder.store(builder.call(fma_fn, [xv[a][1], yv[t][1], acc]), accs[(a, t)])
            else:
                xv0 = [load(xp, r) for r in xrows_v]
                yv0 = [load(yp, r) for r in yrows]
                accs = {(a, t): cgutils.alloca_once_value(builder, builder.fmul(xv0[a], yv0[t])) for a, t in keys}
                with cgutils.for_range(builder, builder.sub(builder.udiv(n_v, const(lanes)), const(1))) as loop:
                    off = builder.mul(builder.add(loop.index, const(1)), const(lanes))
                    xv = [load(xp, builder.add(r, off)) for r in xrows_v]
                    yv = [load(yp, builder.add(r, off)) for r in yrows]
                    for a, t in keys:
                        builder.store(builder.call(fma_fn, [xv[a], yv[t], builder.load(accs[(a, t)])]), accs[(a, t)])
            for a, t in keys:
                dest = builder.add(o0_v, builder.add(builder.mul(os_v, const(a)), const(t)))
                builder.store(_tree(builder, builder.load(accs[(a, t)]), lanes), builder.gep(op, [dest]))
            return context.get_dummy_value()

        return sig, codegen

    return grid


_grid16, _bf16_grid = _make_grid(False, XROWS), _make_grid(True, XROWS)
_grid8 = _make_grid(False, AVX2_XROWS, AVX2_LANES)
#: one activation row against DOTS weight rows (attention, and the rows the grid leaves)
_dots16, _bf16_dots, _dots8 = _make_grid(False, 1), _make_grid(True, 1), _make_grid(False, 1, AVX2_LANES)


@njit(cache=True, nogil=True, inline="always")
def ik_dot_grid(x: np.ndarray, x0: int, xs: int, y: np.ndarray, y0: int, ys: int, n: int, out: np.ndarray, o0: int,
                os: int, bf16: bool, lanes: int) -> None:
    """XROWS x DOTS dot products (_make_grid) in ik's bf16 kernel, or its f32/f16 kernel of `lanes` lanes."""
    if bf16:
        _bf16_grid(x, x0, xs, y, y0, ys, n, out, o0, os)
    elif lanes == AVX2_LANES:
        for a in range(0, XROWS, AVX2_XROWS):
            _grid8(x, x0 + a * xs, xs, y, y0, ys, n, out, o0 + a * os, os)
    else:
        _grid16(x, x0, xs, y, y0, ys, n, out, o0, os)


@njit(cache=True, nogil=True, inline="always")
def _row_dots(x: np.ndarray, x0: int, y: np.ndarray, y0: int, ys: int, n: int, out: np.ndarray, o0: int,
              bf16: bool, lanes: int) -> None:
    """One activation row against DOTS weight rows, as ik_dot_grid."""
    if bf16:
        _bf16_dots(x, x0, 0, y, y0, ys, n, out, o0, 0)
    elif lanes == AVX2_LANES:
        _dots8(x, x0, 0, y, y0, ys, n, out, o0, 0)
    else:
        _dots16(x, x0, 0, y, y0, ys, n, out, o0, 0)


@njit(cache=True, nogil=True, inline="always")
def dots(x: np.ndarray, x0: int, y: np.ndarray, y0: int, stride: int, n: int, count: int, out: np.ndarray,
         o0: int, tail: np.ndarray, bf16: bool, lanes: int) -> None:
    """out[o0 + t] = x[x0 :] . y[y0 + t stride :] (n values) for t < count as ik's f32/f16 kernel of `lanes` lanes
    (or with `bf16`, its bf16 kernel) sums them: DOTS at a time, the last count % DOTS one at a time through
    `tail`."""
    t = 0
    while t + DOTS <= count:
        _row_dots(x, x0, y, y0 + t * stride, stride, n, out, o0 + t, bf16, lanes)
        t += DOTS
    for u in range(t, count):  # stride 0: DOTS copies of row u
        _row_dots(x, x0, y, y0 + u * stride, 0, n, tail, 0, bf16, lanes)
        out[o0 + u] = tail[0]


#: weight rows a task multiplies by the activation rows (their floats stay in the core's cache meanwhile)
ROW_BLOCK = 64
#: bytes of activation rows multiplied by a task's weight rows at a time, so that they stay in the second-level cache
#: beside them (a 2-core Zen 3, 128 x 768 x 2,048 f16 with every activation row against a block: 68 GFLOP/s, the
#: rows read from the last-level cache for every 4 weight rows)
X_BLOCK_BYTES = 128 << 10


@njit(cache=True, nogil=True, inline="always")
def _rows_block(xf, i0, i1, k, wf, r0, rows, n, of, tail, bf16, lanes):  # type: ignore[no-untyped-def]
    """Activation rows i0 .. i1 - 1 against weight rows r0 .. r0 + rows - 1: XROWS x DOTS a grid call, the rows
    left over a dot product at a time."""
    full = rows - rows % DOTS
    i = i0
    while i + XROWS <= i1:
        for r in range(r0, r0 + full, DOTS):
            ik_dot_grid(xf, i * k, k, wf, r * k, k, k, of, i * n + r, n, bf16, lanes)
        for a in range(XROWS):
            dots(xf, (i + a) * k, wf, (r0 + full) * k, k, k, rows - full, of, (i + a) * n + r0 + full, tail, bf16,
                 lanes)
        i += XROWS
    for a in range(i, i1):
        dots(xf, a * k, wf, r0 * k, k, k, rows, of, a * n + r0, tail, bf16, lanes)


@njit(cache=True, nogil=True, parallel=True)
def _gemm(x: np.ndarray, w: np.ndarray, out: np.ndarray, bf16: bool, lanes: int, threads: int) -> None:
    """The ROW_BLOCK-row blocks in tasks the threads claim (ikrun/ops/parallel.py), each against X_BLOCK_BYTES of
    activation rows at a time."""
    m, k = x.shape
    n = w.shape[0]
    xf, wf, of = x.reshape(-1), w.reshape(-1), out.reshape(-1)
    blocks = (n + ROW_BLOCK - 1) // ROW_BLOCK
    x_block = max(1, X_BLOCK_BYTES // (4 * k) // XROWS) * XROWS
    per, counter = task_items(blocks, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        tail = np.empty(DOTS, np.float32)
        b0, b1 = claim_items(counter, per, blocks)
        while b0 < b1:
            for b in range(b0, b1):
                r0 = b * ROW_BLOCK
                for i0 in range(0, m, x_block):
                    _rows_block(xf, i0, min(m, i0 + x_block), k, wf, r0, min(ROW_BLOCK, n - r0), n, of, tail, bf16,
                                lanes)
            b0, b1 = claim_items(counter, per, blocks)


def takes_whole(k: int, bf16: bool, lanes: int = LANES) -> bool:
    """Whether ik's f32/f16 kernel of `lanes` lanes (or its AVX-512 bf16 kernel) takes rows of k values whole:
    multiples of the lanes (of 32)."""
    return k % (2 * lanes if bf16 else lanes) == 0


def ik_float_matmul(x: np.ndarray, w: np.ndarray, bf16: bool = False, lanes: int = LANES) -> np.ndarray:
    """x [m, k] @ w [n, k]^T as ik's f32/f16 kernel of `lanes` lanes computes it (k a multiple of them), or with
    `bf16` its AVX-512 bf16 kernel (x and w bf16 values held as float32, k a multiple of 32). w may be f16 (uint16)
    or bf16 (int16) bits, which the kernel widens as it loads them (exactly: the same floats)."""
    k = x.shape[1]
    if not takes_whole(k, bf16, lanes):
        raise ValueError(f"ik's {'bf16' if bf16 else 'float'} kernel takes rows in multiples of "
                         f"{2 * lanes if bf16 else lanes} values, not {k}")
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    weights = np.ascontiguousarray(w) if w.dtype in (np.uint16, np.int16) else np.ascontiguousarray(w, np.float32)
    weights = read_only(weights)
    _gemm(np.ascontiguousarray(x, dtype=np.float32), weights, out, bf16, lanes, get_num_threads())
    return out
