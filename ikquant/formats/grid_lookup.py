"""32 values of a sub-block of 4-bit codes: each code's grid value times its half's scale, the IQ4 grids' decoding
(IQ4_KS, IQ4_K) shared by the codecs and the runtime's kernels that decode those rows themselves. The 16-value grid
is looked up with one AVX-512 permute per 16 codes where the CPU has them (LLVM does not vectorise the table lookup
of the scalar loop), the same products either way."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from ikquant.cpu import host_has
from ikquant.formats.vector_ir import splat

_I64, _V16B = ir.IntType(64), ir.VectorType(ir.IntType(8), 16)
_V16I, _V16F = ir.VectorType(ir.IntType(32), 16), ir.VectorType(ir.FloatType(), 16)


@intrinsic
def _permuted(typingctx, row, codes, grid, off, scale, off_high, scale_high, p, at):  # type: ignore[no-untyped-def]
    """p[at .. at + 15] = scale x grid[off + low nibbles], p[at + 16 .. at + 31] = scale_high x grid[off_high + high
    nibbles] of row[codes .. codes + 15]: each 16 values scaled in one register, then an AVX-512 permute of it (the
    values built in memory and loaded as a vector cost a failed store forwarding each sub-block)."""
    sig = types.void(row, types.int64, grid, types.int64, types.float32, types.int64, types.float32, p, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        row_p, grid_p, p_p = (context.make_array(signature.args[i])(context, builder, value=args[i]).data
                              for i in (0, 2, 7))
        permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F, _V16I]),
                                                 "llvm.x86.avx512.permvar.sf.512")
        codes = builder.load(builder.bitcast(builder.gep(row_p, [args[1]]), _V16B.as_pointer()), align=1)
        wide = builder.zext(codes, _V16I)

        def values(off: ir.Value, scale: ir.Value) -> ir.Value:
            grid_v = builder.load(builder.bitcast(builder.gep(grid_p, [off]), _V16F.as_pointer()), align=4)
            return builder.fmul(grid_v, splat(builder, scale, _V16F))

        out = builder.bitcast(builder.gep(p_p, [args[8]]), _V16F.as_pointer())
        low = builder.and_(wide, ir.Constant(_V16I, [15] * 16))
        high = builder.lshr(wide, ir.Constant(_V16I, [4] * 16))
        builder.store(builder.call(permute, [values(args[3], args[4]), low]), out, align=4)
        builder.store(builder.call(permute, [values(args[5], args[6]), high]), builder.gep(out, [ir.Constant(_I64, 1)]),
                      align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def _looked_up(row: np.ndarray, codes: int, grid: np.ndarray, off: int, scale: np.float32, off_high: int,
               scale_high: np.float32, p: np.ndarray, at: int) -> None:
    """_permuted in scalar code (CPUs without AVX-512)."""
    for j in range(16):
        code = np.int32(row[codes + j])
        p[at + j] = scale * grid[off + (code & 15)]
        p[at + j + 16] = scale_high * grid[off_high + (code >> 4)]


#: p[at .. at + 31] from row[codes .. codes + 15] (see _permuted)
scaled_nibbles: Callable[..., None] = _permuted if host_has("avx512f") else _looked_up
