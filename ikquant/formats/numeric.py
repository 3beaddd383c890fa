"""Scalar building blocks for the Numba kernels: exact float32 bit casts, fused multiply-add, fp16/bf16/E8M0, and
the little-endian scale fields of a block.

ik's quantizers run in float32 and some of their results hinge on a single rounding (which is why ik's bytes
move when the compiler fuses a multiply-add). These helpers make each rounding explicit: `f32` arithmetic stays
float32 as long as every constant is wrapped in `np.float32`, and `fmaf` is LLVM's fused multiply-add.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils

from ikquant.cpu import host_has
from ikquant.formats.jit import intrinsic

NJIT = dict(cache=True, nogil=True)


def _link_half_conversions() -> None:
    """On a CPU without F16C (or with NUMBA_CPU_NAME naming a generic one) LLVM compiles a float <-> half conversion
    into a call of __truncsfhf2 / __extendhfsf2, which Numba's JIT cannot resolve: the process aborts when the
    first kernel converting an f16 scale is linked. They are libgcc's (GCC 12 and later); point the JIT at them.
    Both round as F16C does (nearest even, subnormals kept; the test compares them on every f16 neighbourhood)."""
    if host_has("f16c"):
        return
    try:
        libgcc = ctypes.CDLL(ctypes.util.find_library("gcc_s") or "libgcc_s.so.1")
        for name in ("__truncsfhf2", "__extendhfsf2"):
            binding.add_symbol(name, ctypes.cast(getattr(libgcc, name), ctypes.c_void_p).value)
    except (OSError, AttributeError):
        pass  # no GCC 12 runtime: the kernels that convert f16 then cannot be linked on this CPU


_link_half_conversions()


def _bitcast(result: types.Type, argument: types.Type, target: ir.Type):  # type: ignore[no-untyped-def]
    """An intrinsic reinterpreting the bits of an `argument` value as a `result` (LLVM type `target`)."""

    @intrinsic
    def cast(typingctx, x):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            return builder.bitcast(args[0], target)

        return result(argument), codegen

    return cast


#: a float32's bits as uint32, and back; a uint64's bits as float64, and back
f32_bits = _bitcast(types.uint32, types.float32, ir.IntType(32))
f32_from_bits = _bitcast(types.float32, types.uint32, ir.FloatType())
f64_from_bits = _bitcast(types.float64, types.uint64, ir.DoubleType())
f64_bits = _bitcast(types.uint64, types.float64, ir.IntType(64))


@intrinsic
def fmaf(typingctx, a, b, c):  # type: ignore[no-untyped-def]
    """a*b + c with one rounding (llvm.fma.f32), as GCC emits when it contracts a multiply-add."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32")
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def fma64(typingctx, a, b, c):  # type: ignore[no-untyped-def]
    """a*b + c in float64 with one rounding (llvm.fma.f64), for ik's double-precision moment sums."""
    sig = types.float64(types.float64, types.float64, types.float64)

    def codegen(context, builder, signature, args):
        f64 = ir.DoubleType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f64, [f64, f64, f64]), "llvm.fma.f64")
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def f32_to_f16_bits(typingctx, f):  # type: ignore[no-untyped-def]
    """IEEE binary16 bits of a float32: LLVM's fptrunc to half, one vcvtps2ph with F16C (round to nearest even,
    subnormals kept, NaN made quiet, as ik's F16C builds store every f16 scale). A scalar function of ~40 branchy
    operations cost k-quant blocks more than their codes."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def widen_16(typingctx, v):  # type: ignore[no-untyped-def]
    """A 16-bit float pattern as float32, exactly, in one instruction the vectoriser can batch: uint16 as f16
    (LLVM's half type: vcvtph2ps), int16 as bf16 (the top half of a float32)."""
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        if signature.args[0] == types.uint16:
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return builder.bitcast(builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16)),
                               ir.FloatType())

    return types.float32(v), codegen


@njit(**NJIT, inline="always")
def hsum_float_8(v: np.ndarray) -> np.float32:
    """ik's hsum_float_8 of 8 float32 lanes v[:8] (its AVX2 horizontal sum): lane i + lane i + 4, then (0 + 2) +
    (1 + 3); vector_ir.hsum8 is the same order on a vector."""
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))


@njit(**NJIT)
def f16_bits_to_f32(h: np.uint16) -> np.float32:
    """The float32 value of IEEE binary16 bits, exactly (vcvtph2ps with F16C; a signalling NaN comes back quiet, as
    ik's F16C builds read it)."""
    return widen_16(np.uint16(h))


@njit(**NJIT, inline="always")
def round_f16(v: np.float32) -> np.float32:
    """v rounded to f16 (nearest even, as vcvtps2ph) and widened back: an f16 scale or cache value as ik holds it."""
    return f16_bits_to_f32(f32_to_f16_bits(np.float32(v)))


@njit(**NJIT)
def store_f16(out: np.ndarray, pos: int, v: np.float32) -> None:
    """Write v as little-endian fp16 at out[pos:pos + 2]."""
    h = f32_to_f16_bits(v)
    out[pos] = np.uint8(h & np.uint16(0xFF))
    out[pos + 1] = np.uint8(h >> np.uint16(8))


@njit(**NJIT)
def load_f16(q: np.ndarray, pos: int) -> np.float32:
    """The little-endian fp16 at q[pos:pos + 2] as float32."""
    return f16_bits_to_f32(np.uint16(q[pos]) | (np.uint16(q[pos + 1]) << np.uint16(8)))


@njit(**NJIT)
def store_f32(out: np.ndarray, pos: int, v: np.float32) -> None:
    """Write v as little-endian float32 at out[pos:pos + 4]."""
    u = f32_bits(v)
    for k in range(4):
        out[pos + k] = np.uint8((u >> np.uint32(8 * k)) & np.uint32(0xFF))


@njit(**NJIT)
def load_u32(q: np.ndarray, pos: int) -> np.uint32:
    """The little-endian uint32 at q[pos:pos + 4]."""
    u = np.uint32(0)
    for k in range(4):
        u |= np.uint32(q[pos + k]) << np.uint32(8 * k)
    return u


@njit(**NJIT)
def load_f32(q: np.ndarray, pos: int) -> np.float32:
    """The little-endian float32 at q[pos:pos + 4]."""
    return f32_from_bits(load_u32(q, pos))


@njit(**NJIT)
def e8m0_half_to_f32(e: np.uint8) -> np.float32:
    """Half the value of an E8M0 exponent byte, 2^(e-128), as ggml's GGML_E8M0_TO_FP32_HALF builds it (bit pattern
    (e-1) << 23, with the float32 subnormals 2^-128 and 2^-127 for e = 0 and 1; no NaN case)."""
    if e >= 2:
        return f32_from_bits((np.uint32(e) - np.uint32(1)) << np.uint32(23))
    return f32_from_bits(np.uint32(0x00200000) << np.uint32(e))


@njit(**NJIT)
def roundf(x: np.float32) -> np.float32:
    """C roundf: nearest integer, halfway cases away from zero."""
    t = np.float32(np.trunc(x))
    if abs(x - t) >= np.float32(0.5):
        t += np.float32(1.0) if x > 0 else np.float32(-1.0)
    return t


@njit(**NJIT)
def nearest_int(x: np.float32) -> np.int32:
    """ggml's nearest_int: round half to even (the 1.5*2^23 trick), valid for |x| < 2^22."""
    return np.int32(np.rint(x))


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """ggml's fp32 -> bf16: round to nearest even; NaN becomes a quiet NaN with the same sign."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(64)).astype(np.uint16)
    return rounded


@njit(**NJIT)
def nearest_int_fma(a: np.float32, b: np.float32) -> np.int32:
    """nearest_int(a*b) as ik's build computes it: GCC fuses the product into the 1.5*2^23 rounding add."""
    v = fmaf(a, b, np.float32(12582912.0))
    return np.int32(f32_bits(v) & np.uint32(0x007FFFFF)) - np.int32(0x00400000)


@njit(**NJIT)
def trunc_i32(x: np.float32) -> np.int32:
    """C's (int)x as x86 computes it (cvttss2si): toward zero, and INT_MIN when x is NaN or outside int32."""
    if x > np.float32(-2147483648.0) and x < np.float32(2147483648.0):
        return np.int32(x)
    return np.int32(-2147483648)


@intrinsic
def abs_bits_max(typingctx, m, bits):  # type: ignore[no-untyped-def]
    """max(m, bits without the sign bit) in 32-bit unsigned arithmetic. Numba widens 32-bit integer operations to
    64 bits, which halves the vector width of a maximum over float32 bit patterns; this keeps it at 32."""
    sig = types.uint32(types.uint32, types.uint32)

    def codegen(context, builder, signature, args):
        acc, value = args
        masked = builder.and_(value, ir.Constant(ir.IntType(32), 0x7FFFFFFF))
        return builder.select(builder.icmp_unsigned(">", masked, acc), masked, acc)

    return sig, codegen


@njit(**NJIT)
def finite_abs_max(xb: np.ndarray) -> np.float32:
    """max |x| of finite values (the codecs check their input first), as the largest of their bit patterns without
    the sign: for non-negative floats the integer order is the float order, and an integer maximum vectorises
    (a float one does not: NaN). Each value is reinterpreted in the loop: a uint32 view of a short slice costs more
    than the loop itself."""
    m = np.uint32(0)
    for j in range(xb.size):
        m = abs_bits_max(m, f32_bits(xb[j]))
    return f32_from_bits(m)


@njit(**NJIT)
def abs_max(xb: np.ndarray) -> tuple[np.float32, np.float32]:
    """(max |x|, the x that attains it first)."""
    amax = np.float32(0.0)
    vmax = np.float32(0.0)
    for j in range(xb.size):
        ax = abs(xb[j])
        if ax > amax:
            amax = ax
            vmax = xb[j]
    return amax, vmax
