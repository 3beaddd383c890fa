"""ik's 8-bit interleaved forms (Q8_K_R8, Q8_K_R16, Q8_KV_R8) quantized straight into their layout, and decoded
straight from it.

Each of them stores every row's codes four at a time, the group's rows side by side: quantize-then-regroup spends
most of its time moving those bytes a second time. Here a row's codes are computed in a vectorised pass into a
buffer of the group's rows and written to their interleaved places as 4-byte words, with the same arithmetic as
the plain rows' kernels (tests/test_interleaved.py checks the bytes against quantize-then-repack); decoding gathers
the words back into such a buffer and scales it row by row (checked against regroup-then-decode).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils

from ikquant.formats.jit import intrinsic, require_array
from ikquant.formats.numeric import (
    abs_bits_max,
    f32_bits,
    f32_from_bits,
    fmaf,
    load_f16,
    load_f32,
    store_f16,
    store_f32,
)
from ikquant.formats.vector_ir import I32, I64, load_vector, store_vector

KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")
#: int32 conversion is exact below this magnitude; beyond it x86 gives INT_MIN (ik's saturating packs store -128)
I32_LIMIT = np.float32(2147483648.0)
U = np.uint64

# The loops index x with unsigned offsets (x[row, start + j]) instead of taking a slice per 256-value block (a
# signed index keeps Numba's negative-index test in the vector loop), keep every integer 32-bit (Numba widens a
# plain literal to 64 bits, which halves the vector lanes), and are written out in the kernels: called as
# functions, the same loops ran Q8_K_R8 at 0.62x ik's speed instead of 0.97x.


@njit(cache=True, nogil=True, error_model="numpy")
def _overflowing_codes(x: np.ndarray, row: np.uint64, start: np.uint64, count: int, mul: np.float32, offset: int,
                       codes: np.ndarray, k: int) -> None:
    """codes[k, :count] as the kernels' vector loops compute them, for an infinite multiplier (max |x| below
    127 / FLT_MAX): a product beyond int32 converts to INT_MIN on x86, which saturates to -128."""
    off = np.int32(offset)
    for j in range(count):
        p = mul * x[row, start + U(j)]
        q = np.int32(np.rint(p)) if abs(p) < I32_LIMIT else np.int32(-2147483648)
        codes[k, j] = np.uint8((min(max(q, np.int32(-128)), np.int32(127)) + off) & np.int32(255))


def _quads_transposer(n: int):  # type: ignore[no-untyped-def]
    """An intrinsic (codes, words, start) for groups of n rows (n a multiple of 8): the rows' codes [n, 4 m]
    (C-contiguous uint8, m a multiple of 4) to words[start + n j + k] = row k's codes 4 j .. 4 j + 3 as one 32-bit
    word. Each step takes 16 bytes of every row: rows k and k + 4 of each eight joined into one 256-bit vector, then
    two rounds of 32-bit and 64-bit interleaves within the vectors' halves leave each vector holding one quad of
    all eight rows, stored whole. A word at a time, the interleaving took 27% of Q8_KV_R8's quantize time; as one
    concatenation of all rows shuffled into place (lowered to lane-crossing permutes and blends) 16 us for 8 x 4096
    codes, 9 us this way."""
    quad = ir.VectorType(I32, 4)

    def mask(values: list[int]) -> ir.Constant:
        return ir.Constant(ir.VectorType(I32, 8), values)

    join = mask(list(range(8)))
    interleaves = (
        (mask([0, 8, 1, 9, 4, 12, 5, 13]), mask([2, 10, 3, 11, 6, 14, 7, 15])),  # 32-bit low / high pairs
        (mask([0, 1, 8, 9, 4, 5, 12, 13]), mask([2, 3, 10, 11, 6, 7, 14, 15])),  # 64-bit low / high pairs
    )

    @intrinsic
    def transpose(typingctx, codes, words, start):  # type: ignore[no-untyped-def]
        require_array("_quads_transposer", "codes", codes, 2, types.uint8)
        require_array("_quads_transposer", "words", words, 1, types.uint32, contiguous=False)
        sig = types.void(codes, words, types.int64)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            src = context.make_array(signature.args[0])(context, builder, value=args[0])
            dst = context.make_array(signature.args[1])(context, builder, value=args[1])
            row_words = builder.sdiv(builder.extract_value(src.shape, 1), ir.Constant(I64, 4))
            src_words = builder.bitcast(src.data, I32.as_pointer())
            dst_words = builder.bitcast(dst.data, I32.as_pointer())
            rows = [builder.mul(row_words, ir.Constant(I64, k)) for k in range(n)]
            (lo32, hi32), (lo64, hi64) = interleaves
            with cgutils.for_range(builder, builder.sdiv(row_words, ir.Constant(I64, 4))) as loop:
                j = builder.mul(loop.index, ir.Constant(I64, 4))
                base = builder.add(args[2], builder.mul(j, ir.Constant(I64, n)))
                for h in range(0, n, 8):
                    q = [load_vector(builder, src_words, builder.add(rows[h + k], j), quad) for k in range(8)]
                    m = [builder.shuffle_vector(q[k], q[k + 4], join) for k in range(4)]  # [row k | row k + 4]
                    t = [builder.shuffle_vector(m[a], m[a + 1], sel) for sel in (lo32, hi32) for a in (0, 2)]
                    quads = [builder.shuffle_vector(t[a], t[a + 1], sel) for a in (0, 2) for sel in (lo64, hi64)]
                    for step, v in enumerate(quads):
                        store_vector(builder, v, dst_words, builder.add(base, ir.Constant(I64, n * step + h)))
            return context.get_dummy_value()

        return sig, codegen

    return transpose


_interleave8 = _quads_transposer(8)
_interleave16 = _quads_transposer(16)


@njit(**KERNEL)
def quantize_q8_k_interleaved(x: np.ndarray, n: int, offset: int, limit: float, out: np.ndarray) -> bool:
    """Q8_K_R8 (n = 8, offset 0) / Q8_K_R16 (n = 16, offset 128): per group of n rows and block of 256 values, the
    rows' f16 d = max|x| / 127, then byte 4 n j + 4 k + i = row k's code 4 j + i (rint(x 127 / max|x|), as ik's
    AVX2 quantize_row_q8_K32). `out` is the groups' bytes [rows / n, n row bytes]. False when some |x| is beyond
    `limit` or not finite (a block's max |x| is then beyond it, NaN or infinite)."""
    lim = np.float32(limit)
    nb = x.shape[1] // 256
    off = np.int32(offset)
    bad = np.zeros(x.shape[0] // n, np.bool_)
    for g in prange(x.shape[0] // n):
        dst = out[g]
        words = dst.view(np.uint32)
        codes = np.empty((n, 256), np.uint8)
        for b in range(nb):
            o = b * n * 258
            start = U(256 * b)
            for k in range(n):
                row = U(g * n + k)
                m = np.uint32(0)
                for j in range(256):
                    m = abs_bits_max(m, f32_bits(x[row, start + U(j)]))
                amax = f32_from_bits(m)
                bad[g] |= not amax <= lim
                store_f16(dst, o + 2 * k, amax / np.float32(127.0))
                mul = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
                if abs(mul) < np.inf:
                    for j in range(256):
                        v = min(max(np.int32(np.rint(mul * x[row, start + U(j)])), np.int32(-128)), np.int32(127))
                        codes[k, j] = np.uint8((v + off) & np.int32(255))
                else:
                    _overflowing_codes(x, row, start, 256, mul, offset, codes, k)
            if n == 8:
                _interleave8(codes, words, (o + 2 * n) // 4)
            else:
                _interleave16(codes, words, (o + 2 * n) // 4)
    return not bad.any()


@njit(**KERNEL)
def quantize_q8_kv_r8(x: np.ndarray, out: np.ndarray, limit: float) -> bool:
    """Q8_KV_R8: per group of 8 rows their f32 scales d = max|x| / 127, then byte 32 m + 4 k + i (after the 32
    scale bytes) = row k's code 4 m + i, rint(x / d) (as Q8_KV's rows; an all-zero row has d = 0 and zero codes).
    `out` is the groups' bytes [rows / 8, 8 row bytes]. False as quantize_q8_k_interleaved."""
    lim = np.float32(limit)
    bad = np.zeros(x.shape[0] // 8, np.bool_)
    for g in prange(x.shape[0] // 8):
        dst = out[g]
        codes = np.empty((8, x.shape[1]), np.uint8)
        for k in range(8):
            row = U(8 * g + k)
            m = np.uint32(0)
            for j in range(x.shape[1]):
                m = abs_bits_max(m, f32_bits(x[row, U(j)]))
            amax = f32_from_bits(m)
            bad[g] |= not amax <= lim
            d = amax / np.float32(127.0)
            mul = np.float32(1.0) / d
            if amax == 0:
                codes[k] = 0
            elif abs(mul) < np.inf:
                for j in range(x.shape[1]):
                    codes[k, j] = np.uint8(min(max(np.int32(np.rint(mul * x[row, U(j)])), np.int32(-128)),
                                               np.int32(127)) & np.int32(255))
            else:
                _overflowing_codes(x, row, U(0), x.shape[1], mul, 0, codes, k)
            store_f32(dst, 4 * k, d)
        _interleave8(codes, dst.view(np.uint32), 8)
    return not bad.any()


@njit(cache=True, nogil=True)
def _gather_quads(words: np.ndarray, start: int, codes: np.ndarray) -> None:
    """The quads' interleaving (_quads_transposer) undone: codes [n, 4 m] from words[start + n j + k] (row k's codes 4 j .. 4 j + 3)."""
    n = U(codes.shape[0])
    quads = codes.view(np.uint32)
    for k in range(codes.shape[0]):
        for j in range(quads.shape[1]):
            quads[k, j] = words[U(start) + n * U(j) + U(k)]


@njit(**KERNEL)
def dequantize_q8_k_interleaved(q: np.ndarray, n: int, offset: int, out: np.ndarray) -> None:
    """Q8_K_R8 / Q8_K_R16 groups [rows / n, n row bytes] -> rows: d x code, with an offset as ik's Q8_K_R16 decoding
    computes it, d x stored byte - 128 d (one rounding: ik's build fuses the multiply-add)."""
    off = np.float32(-offset)
    for g in prange(q.shape[0]):
        src = q[g]
        words = src.view(np.uint32)
        codes = np.empty((n, 256), np.uint8)
        signed = codes.view(np.int8)
        for b in range(out.shape[1] // 256):
            o = b * n * 258
            _gather_quads(words, (o + 2 * n) // 4, codes)
            start = U(256 * b)
            for k in range(n):
                d = load_f16(src, o + 2 * k)
                row = U(g * n + k)
                if offset:
                    m = off * d
                    for j in range(256):
                        out[row, start + U(j)] = fmaf(d, np.float32(codes[k, j]), m)
                else:
                    for j in range(256):
                        out[row, start + U(j)] = d * np.float32(signed[k, j])


@njit(**KERNEL)
def dequantize_q8_kv_r8(q: np.ndarray, out: np.ndarray) -> None:
    """Q8_KV_R8 groups [rows / 8, 8 row bytes] -> rows: each row's f32 scale x its int8 codes."""
    for g in prange(q.shape[0]):
        src = q[g]
        codes = np.empty((8, out.shape[1]), np.uint8)
        signed = codes.view(np.int8)
        _gather_quads(src.view(np.uint32), 8, codes)
        for k in range(8):
            d = load_f32(src, 4 * k)
            row = U(8 * g + k)
            for j in range(out.shape[1]):
                out[row, U(j)] = d * np.float32(signed[k, j])
