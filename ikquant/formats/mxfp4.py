"""MXFP4: 32 FP4 (E2M1) codes sharing one E8M0 power-of-two scale.

ik's quantizer (iqk_quantize.cpp) ignores importance weights: the exponent comes from the block's max |x| and each
value takes the grid point nearest to it. Every step is exact or a correctly rounded single operation except
log2f, which numba takes from the same C library as ik, so the bytes match ik's exactly.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types

from ikquant.formats.base import Codec
from ikquant.formats.jit import intrinsic, require_array
from ikquant.formats.numeric import e8m0_half_to_f32, finite_abs_max, trunc_i32
from ikquant.formats.vector_ir import F32, I8, I64, splat

QK = 32
BLOCK_BYTES = 17
KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")

# ggml-common.h kvalues_mxfp4: the E2M1 values doubled (hence the half-valued scale); codes 8-15 negate 0-7
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
_FVALUES = KVALUES_MXFP4.astype(np.float32)


@njit(cache=True, nogil=True, error_model="numpy")
def _block_exponent(amax: np.float32) -> np.uint8:
    """ik's e = (uint8_t)(floor(log2f(amax)) - 2 + 127): x86 converts through int32, so tiny blocks wrap around."""
    e = (np.float32(math.floor(math.log2(amax))) - np.float32(2.0)) + np.float32(127.0)
    return np.uint8(trunc_i32(e) & np.int32(0xFF))


@njit(cache=True, nogil=True, error_model="numpy")
def _nearest_code(v: np.float32, grid: np.ndarray) -> np.int32:
    """ik takes the first code with the smallest float32 |x - d*v| over all 16. Rounding is symmetric, so
    |x + d*v| = ||x| - d*v|, and a grid point of the other sign never beats code 0; hence: search |x| over codes
    0-7 in order, then move a nonzero code of a negative x to its negated twin (8 + k). Written with selects only
    (and a 32-bit code, the floats' width), so that a loop over values vectorises."""
    a = abs(v)
    best = a
    code = np.int32(0)
    for k in range(1, 8):
        diff = abs(a - grid[k])
        better = diff < best
        best = diff if better else best
        code = np.int32(k) if better else code
    return code + np.int32(8) if v < 0 and code != 0 else code


@njit(**KERNEL)
def _quantize_mxfp4(x: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = x.shape
    for r in prange(n_rows):
        grid = np.empty(8, dtype=np.float32)
        code = np.empty(QK, dtype=np.int32)
        for ib in range(n // QK):
            xb = x[r, ib * QK : (ib + 1) * QK]
            o = ib * BLOCK_BYTES
            amax = finite_abs_max(xb)
            if amax == 0:
                for k in range(BLOCK_BYTES):
                    out[r, o + k] = 0
                continue
            e = _block_exponent(amax)
            out[r, o] = e
            d = e8m0_half_to_f32(e)
            for k in range(8):
                grid[k] = d * _FVALUES[k]
            for j in range(QK):
                code[j] = _nearest_code(xb[j], grid)
            for j in range(QK // 2):
                out[r, o + 1 + j] = np.uint8(code[j] | (code[j + QK // 2] << 4))


V16B = ir.VectorType(I8, QK // 2)
_V16F = ir.VectorType(F32, QK // 2)


def e2m1_doubled(builder: ir.IRBuilder, nibbles: ir.Value) -> ir.Value:
    """kvalues_mxfp4 of a vector of 16 4-bit codes (int8 lanes), as arithmetic: the doubled E2M1 value of exponent
    e = code >> 1 & 3 and mantissa bit m, m for e 0, else (2 + m) << (e - 1); code bit 8 negates it (a table
    lookup a value at a time kept LLVM from vectorising)."""
    const = lambda v: ir.Constant(V16B, [v] * 16)  # noqa: E731
    e = builder.and_(builder.lshr(nibbles, const(1)), const(3))
    m = builder.and_(nibbles, const(1))
    plain = builder.icmp_unsigned("==", e, const(0))
    shift = builder.select(plain, const(0), builder.sub(e, const(1)))
    v = builder.select(plain, m, builder.shl(builder.add(m, const(2)), shift))
    negative = builder.icmp_unsigned("!=", builder.and_(nibbles, const(8)), const(0))
    return builder.select(negative, builder.sub(const(0), v), v)


def code_nibbles(builder: ir.IRBuilder, codes: ir.Value) -> tuple[ir.Value, ir.Value]:
    """A block's 16 code bytes split into the codes of its values 0..15 (low nibbles) and 16..31 (high nibbles)."""
    fifteen, four = ir.Constant(V16B, [15] * 16), ir.Constant(V16B, [4] * 16)
    return builder.and_(codes, fifteen), builder.lshr(codes, four)


@intrinsic
def _block_floats(typingctx, row, start, d, y, at):  # type: ignore[no-untyped-def]
    """y[at + j] = d x kvalues_mxfp4 of the low nibble of row[start + j], y[at + 16 + j] of its high nibble (j <
    16): the codes as vector arithmetic (e2m1_doubled), widened and scaled 16 at a time, the products d x value of
    the table lookup it replaces, bit for bit."""
    for name, arg, dtype in (("row", row, types.uint8), ("y", y, types.float32)):
        require_array("_block_floats", name, arg, 1, dtype)
    sig = types.void(row, types.int64, types.float32, y, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        src = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        dst = context.make_array(signature.args[3])(context, builder, value=args[3]).data
        codes = builder.load(builder.bitcast(builder.gep(src, [args[1]]), V16B.as_pointer()), align=1)
        scale = splat(builder, args[2], _V16F)
        for half, nibbles in enumerate(code_nibbles(builder, codes)):
            values = builder.fmul(builder.sitofp(e2m1_doubled(builder, nibbles), _V16F), scale)
            at = builder.gep(dst, [builder.add(args[4], ir.Constant(I64, 16 * half))])
            builder.store(values, builder.bitcast(at, _V16F.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def mxfp4_values(row: np.ndarray, k0: int, k1: int, y: np.ndarray, at: int) -> None:
    """Values k0 .. k1 - 1 (multiples of QK) of an MXFP4 row (its bytes) into y[at : at + k1 - k0]: the decoding,
    of whole rows here and of a block of rows at a time in the runtime's expert kernel, which decodes into its
    first-level cache (a row's length need not be a multiple of the kernel's step, so the span is explicit)."""
    for ib in range(k0 // QK, k1 // QK):
        o = ib * BLOCK_BYTES
        _block_floats(row, o + 1, e8m0_half_to_f32(row[o]), y, at + ib * QK - k0)


@njit(**KERNEL)
def _dequantize_mxfp4(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        mxfp4_values(q[r], 0, n, out[r], 0)


class MXFP4Codec(Codec, type_name="MXFP4"):
    uses_imatrix = False
    # The scale puts amax/(2d) in [4, 8) (or just below 4 when log2f rounds up to the next power of two), where
    # the E2M1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6 is at most 2 apart, and clips at 6: the error stays below amax/4.
    # Blocks with amax < 2^-125 get a wrapped-around exponent and all-zero codes: an error below 2^-125. Every
    # finite float32 is representable (the largest exponent used is 253).
    rel_error_bound = 0.25 + 2.0**-20
    abs_error_floor = 2.0**-125

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_mxfp4(x, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_mxfp4(q, out)

