"""IQK weights (IQ4_KS, IQ5_KS, IQ4_K, IQ2_KS, IQ3_KS, IQ2_K, IQ3_K) straight from their bytes to qgemm's packed
Q8_K_R16 integers, for `--numerics ik`; and Q8_0 and MXFP4 to their own integers packed (`q8_0_packed`,
`mxfp4_packed`).

ik converts an IQK weight to Q8_K_R16 from its integers: per 256 values p = sub-block scale x grid value, kept
when max|p| / c < 1, else re-quantized to int8 against max|p| / c (formats.py, `_to_q8_k`). The general path
recovers p from the float decoding (p = rint(decoding / d)) and packs the int8 rows afterwards (qgemm.pack): three
passes over the weight, the first two in float32. Here one pass reads the bytes and writes the packed layout,
the scales and the block sums, with the same integers, so the same PackedInts to the bit
(test_conversions_from_bytes.py).

The decoding's p is exactly the integer product wherever the scale d is a finite float not so small or large that
d x ls x v leaves float32's normal range (it then rounds by a few ulps of at most 127 x 127, far from a half; d = 0
gives p = 0, as the general path takes it): IQ4_KS's and IQ5_KS's row scale within 2^-100 .. 2^100, the f16
scales of the others (IQ4_K's, IQ2_K's and IQ3_K's per block, IQ2_KS's and IQ3_KS's per row) finite. A tensor with
another scale takes the general path. IQ4_KS's and IQ4_K's 16-value grids are looked up with AVX-512 permutes where
the CPU has them; the 2-, 3- and 5-bit codes of the others in scalar loops.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types

from ikquant.formats.grid_lookup import scaled_nibbles
from ikquant.formats.iqk_grids import IQ2NL_VALUES, IQ3NL_VALUES, IQ4K_VALUES, IQ5NL_VALUES
from ikquant.formats.jit import intrinsic, read_only, require_array
from ikquant.formats.mxfp4 import V16B, code_nibbles, e2m1_doubled
from ikquant.formats.numeric import e8m0_half_to_f32, f32_from_bits, load_f16, load_f32, round_f16
from ikrun.numerics.ik.qgemm import GROUPS, LANES, ORDER_QX_0_NATIVE, ORDER_R8, ORDER_R16, PackedInts
from ikrun.ops.parallel import claim_items, task_items

SUPER = 256  # values per Q8_K block
#: the 32-value block kinds packed from their bytes (_block32_packed): a Q8_0 block is an f16 scale, then 32 int8
#: values; an MXFP4 block an exponent byte, then 16 bytes of two 4-bit codes (values j and j + 16)
KIND_Q8_0, KIND_MXFP4 = 0, 1
BLOCK32, Q8_0_BLOCK_BYTES, MXFP4_BLOCK_BYTES = 32, 34, 17
BLOCK32_BYTES = {KIND_Q8_0: Q8_0_BLOCK_BYTES, KIND_MXFP4: MXFP4_BLOCK_BYTES}
MXFP4_MAX_EXPONENT = 252  # 12 x 2^(e - 128) is finite in float32 up to here
#: the layouts: IQ4_KS a float32 row scale, then per 256 values 8 sub-block scale bytes and 128 bytes of 4-bit
#: codes; IQ4_K per 256 values an f16 scale, 16 bits of grid halves, 4 + 8 bytes of 6-bit scales, 128 of codes;
#: IQ2_KS / IQ3_KS an f16 row scale, then per 256 values 16 bits of grid halves and scale high bits, 4 bytes of
#: 4-bit scales, 64 bytes of 2-bit codes (IQ3_KS: and 32 bytes of their third bits); IQ5_KS as IQ4_KS, its codes'
#: low 4 bits two sub-blocks to 32 bytes, then 32 bytes of their fifth bits
#: IQ2_K / IQ3_K per 256 values an f16 scale, 16 bits of grid halves (IQ3_K: and 16 of scale signs), 8 bytes of
#: 4-bit scales, 64 bytes of 2-bit codes (IQ3_K: and 32 bytes of their third bits), sub-blocks of 16
KIND_IQ4_KS, KIND_IQ4_K, KIND_IQ2_KS, KIND_IQ3_KS, KIND_IQ5_KS, KIND_IQ2_K, KIND_IQ3_K = range(7)
ROW_BYTES_KS, BLOCK_BYTES_IQ2_KS, BLOCK_BYTES_IQ3_KS = 2, 70, 102
ROW_BYTES = {KIND_IQ4_KS: 4, KIND_IQ4_K: 0, KIND_IQ2_KS: ROW_BYTES_KS, KIND_IQ3_KS: ROW_BYTES_KS, KIND_IQ5_KS: 4,
             KIND_IQ2_K: 0, KIND_IQ3_K: 0}
BLOCK_BYTES = {KIND_IQ4_KS: 136, KIND_IQ4_K: 144, KIND_IQ2_KS: BLOCK_BYTES_IQ2_KS, KIND_IQ3_KS: BLOCK_BYTES_IQ3_KS,
               KIND_IQ5_KS: 168, KIND_IQ2_K: 76, KIND_IQ3_K: 110}
#: the row scales whose decoding gives the exact integers (module docstring)
SAFE_SCALES = (2.0**-100, 2.0**100)
#: the grid values as float32: sub-block scale x value is exact in float32 (|ls x v| < 2^24)
_IQ4K_FLOATS = IQ4K_VALUES.astype(np.float32)
_IQ2NL_FLOATS, _IQ3NL_FLOATS = IQ2NL_VALUES.astype(np.float32), IQ3NL_VALUES.astype(np.float32)
_IQ5NL_FLOATS = IQ5NL_VALUES.astype(np.float32)
_I64 = ir.IntType(64)


def iq4_ks_packed(raw: np.ndarray, c: float) -> PackedInts | None:
    """IQ4_KS rows `raw` [rows, row bytes] as ik converts them to Q8_K_R16, packed for qmatmul; None where a row
    scale is outside SAFE_SCALES (the general path then decodes them)."""
    raw = read_only(np.ascontiguousarray(raw))
    return _packed(raw, KIND_IQ4_KS, c) if _safe_row_scales(raw) else None


def iq5_ks_packed(raw: np.ndarray, c: float) -> PackedInts | None:
    """IQ5_KS rows as ik converts them to Q8_K_R16, packed; None where a row scale is outside SAFE_SCALES."""
    raw = read_only(np.ascontiguousarray(raw))
    return _packed(raw, KIND_IQ5_KS, c) if _safe_row_scales(raw) else None


@njit(cache=True, nogil=True)
def _safe_row_scales(raw: np.ndarray) -> bool:
    """Whether every float32 row scale (the rows' first 4 bytes) is within SAFE_SCALES (a NaN is not): a loop
    over the rows (numpy's copy of the first 4 bytes of each and three array operations took ~55 us an expert)."""
    lo, hi = np.float32(SAFE_SCALES[0]), np.float32(SAFE_SCALES[1])
    for r in range(raw.shape[0]):
        d = abs(load_f32(raw[r], 0))
        if not (d >= lo and d <= hi):
            return False
    return True


def iq4_k_packed(raw: np.ndarray, c: float) -> PackedInts | None:
    """IQ4_K rows as ik converts them to Q8_K_R16, packed for qmatmul; None where a block scale is infinite or NaN."""
    return _block_scaled(raw, KIND_IQ4_K, c)


def iq2_k_packed(raw: np.ndarray, c: float) -> PackedInts | None:
    """IQ2_K rows as ik converts them to Q8_K_R16, packed; None where a block scale is infinite or NaN."""
    return _block_scaled(raw, KIND_IQ2_K, c)


def iq3_k_packed(raw: np.ndarray, c: float) -> PackedInts | None:
    """IQ3_K rows as ik converts them to Q8_K_R16, packed; None where a block scale is infinite or NaN."""
    return _block_scaled(raw, KIND_IQ3_K, c)


def _block_scaled(raw: np.ndarray, kind: int, c: float) -> PackedInts | None:
    """A type with an f16 scale at the start of every block: packed unless one is infinite or NaN."""
    raw = read_only(np.ascontiguousarray(raw))
    return _packed(raw, kind, c) if f16_fields_finite(raw, BLOCK_BYTES[kind]) else None


def iq2_ks_packed(raw: np.ndarray, c: float) -> PackedInts | None:
    """IQ2_KS rows as ik converts them to Q8_K_R16, packed; None where a row scale is infinite or NaN."""
    raw = read_only(np.ascontiguousarray(raw))
    return _packed(raw, KIND_IQ2_KS, c) if f16_fields_finite(raw, raw.shape[1]) else None


def iq3_ks_packed(raw: np.ndarray, c: float) -> PackedInts | None:
    """IQ3_KS rows as ik converts them to Q8_K_R16, packed; None where a row scale is infinite or NaN."""
    raw = read_only(np.ascontiguousarray(raw))
    return _packed(raw, KIND_IQ3_KS, c) if f16_fields_finite(raw, raw.shape[1]) else None


def f16_fields_finite(raw: np.ndarray, block_bytes: int, offset: int = 0) -> bool:
    """Whether the f16 at `offset` of every `block_bytes` bytes of the rows `raw` is finite (a block or row scale
    whose decoding gives the exact integers)."""
    bits = raw.reshape(raw.shape[0], -1, block_bytes)[..., offset:offset + 2].copy().view(np.uint16)
    return not bool(np.any((bits & 0x7C00) == 0x7C00))


def _packed(raw: np.ndarray, kind: int, c: float) -> PackedInts:
    """Rows `raw` of `kind`, contiguous and read-only (each public entry makes them so once), packed."""
    rows = raw.shape[0]
    nb = (raw.shape[1] - ROW_BYTES[kind]) // BLOCK_BYTES[kind]
    n = nb * SUPER
    groups = -(-rows // (GROUPS * LANES)) * GROUPS
    q = np.empty(groups * LANES * n, np.int8)
    scale = np.empty(groups * nb * LANES, np.float32)
    corr = np.empty(groups * nb * LANES, np.int32)
    low = np.zeros(groups, np.uint8)
    _groups(raw, kind, nb, np.float32(np.float32(1) / np.float32(c)), q.view(np.int32), scale, corr, low,
            get_num_threads())
    return PackedInts(q=q, scale=scale, corr=corr, offset=np.empty(0, np.float32), rows=rows, n=n, block=SUPER,
                      order=ORDER_R16, full_range=bool(low.any()))


def q8_0_packed(raw: np.ndarray, bias: int = 0) -> PackedInts:
    """Q8_0 rows `raw` [rows, row bytes] packed for qmatmul in one pass over the bytes, its integers and f16 scales
    as stored: as ik converts them to Q8_0_R8 (`bias` 0), or as its own kernel multiplies them, each value + `bias`
    as an unsigned byte (ORDER_QX_0_NATIVE, qgemm.pack). Reading them into int8 rows first (and decoding them, for
    the second) and packing those took two or three passes, each into a fresh array."""
    raw = read_only(np.ascontiguousarray(raw))
    return _block32_packed(raw, KIND_Q8_0, bias)


def mxfp4_packed(raw: np.ndarray, bias: int = 0) -> PackedInts | None:
    """MXFP4 rows as q8_0_packed packs Q8_0's: the doubled E2M1 values (kvalues_mxfp4) under the scale 2^(e - 128)
    of each block's exponent byte e, ik's integers; None where an e is above 252 (12 x 2^(e - 128) overflows),
    whose decodings the general path takes as they come. An e of 0 (an all-zero block's) keeps its codes' values
    under the float32 subnormal 2^-128, as ik's own kernel has them (its conversion stores the scale as f16 0: either
    way a product of at most 12 x 2^-128 x |x|, no float sum of normal terms sees it; a gpt-oss file with such blocks
    prints ik's PPL to the digit)."""
    raw = read_only(np.ascontiguousarray(raw))
    exponents = raw.reshape(raw.shape[0], -1, MXFP4_BLOCK_BYTES)[..., 0]
    if exponents.max(initial=0) > MXFP4_MAX_EXPONENT:
        return None
    return _block32_packed(raw, KIND_MXFP4, bias)


def _block32_packed(raw: np.ndarray, kind: int, bias: int) -> PackedInts:
    """Rows `raw` of a 32-value block `kind`, contiguous and read-only (as in _packed), packed."""
    rows = raw.shape[0]
    nb = raw.shape[1] // BLOCK32_BYTES[kind]
    n = nb * BLOCK32
    groups = -(-rows // (GROUPS * LANES)) * GROUPS
    q = np.empty(groups * LANES * n, np.int8)
    scale = np.empty(groups * nb * LANES, np.float32)
    offset = np.empty(groups * nb * LANES if bias else 0, np.float32)
    corr = np.empty(groups * nb * LANES, np.int32)
    low = np.zeros(groups, np.uint8)
    _block32_groups(raw, kind, nb, bias, q.view(np.int32), scale, offset, corr, low, get_num_threads())
    return PackedInts(q=q, scale=scale, corr=corr, offset=offset, rows=rows, n=n, block=BLOCK32,
                      order=ORDER_QX_0_NATIVE if bias else ORDER_R8, full_range=bool(low.any()))


@njit(cache=True, nogil=True, parallel=True)
def _block32_groups(raw: np.ndarray, kind: int, nb: int, bias: int, out4: np.ndarray, scale: np.ndarray,
                    offset: np.ndarray, corr: np.ndarray, low: np.ndarray, threads: int) -> None:
    """_groups for the 32-value block kinds: the groups in tasks the threads claim (ikrun/ops/parallel.py)."""
    groups = low.size
    per, counter = task_items(groups, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        values = np.empty(BLOCK32, np.int8)
        total = np.empty(LANES, np.int32)
        least = np.empty(LANES, np.int32)
        i0, i1 = claim_items(counter, per, groups)
        while i0 < i1:
            for g in range(i0, i1):
                _block32_group(raw, kind, nb, bias, g, out4, scale, offset, corr, values, total, least)
                low[g] = least.min() == -128
            i0, i1 = claim_items(counter, per, groups)


@intrinsic
def _mxfp4_block_values(typingctx, row, start, values):  # type: ignore[no-untyped-def]
    """values[j] (int8, 32 of them) = kvalues_mxfp4 of the low nibble of byte start + j of `row`, values[16 + j] of
    its high nibble, as vector arithmetic on the 16 bytes (mxfp4.e2m1_doubled). A value at a time, the scalar loop
    took 0.19 of the 0.44 ms an MXFP4 matrix of 1024 x 1024 took to pack on one thread."""
    for name, arg, dtype in (("row", row, types.uint8), ("values", values, types.int8)):
        require_array("_mxfp4_block_values", name, arg, 1, dtype)
    sig = types.void(row, types.int64, values)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        src = context.make_array(signature.args[0])(context, builder, value=args[0]).data
        dst = context.make_array(signature.args[2])(context, builder, value=args[2]).data
        codes = builder.load(builder.bitcast(builder.gep(src, [args[1]]), V16B.as_pointer()), align=1)
        for half, nibbles in enumerate(code_nibbles(builder, codes)):
            at = builder.gep(dst, [ir.Constant(_I64, 16 * half)])
            builder.store(e2m1_doubled(builder, nibbles), builder.bitcast(at, V16B.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _block32_group(raw: np.ndarray, kind: int, nb: int, bias: int, g: int, out4: np.ndarray, scale: np.ndarray,
                   offset: np.ndarray, corr: np.ndarray, values: np.ndarray, total: np.ndarray,
                   least: np.ndarray) -> None:
    """Group g: each row's 4-value steps stored to the group's layout (Q8_0's read as two 16-bit halves: a block's
    values start 2 bytes in; MXFP4's computed into `values` first), then over the group's 16 rows as vector lanes
    each value + bias (a byte-wise add, wrapping; with bias 0 the words are only read: rewriting them unchanged
    took a tenth of the pack), the block sums and the least value (`least`, per row); a padding
    row is `bias` throughout, with scale and offset 0 (pack's padding). A byte loop per row took 2.1x as long
    (0.30 against 0.15 ms for 512 x 1024)."""
    rows = raw.shape[0]
    words_per_block = np.uint64(BLOCK32 // 4)
    lanes = np.uint64(LANES)
    words = np.uint64(g * nb * BLOCK32 // 4 * LANES)
    quads = values.view(np.uint32)
    for r in range(LANES):
        row_index = g * LANES + r
        if row_index < rows:
            row = raw[row_index]
            # Q8_0's rows are whole 34-byte blocks; an MXFP4 row of an odd number of blocks has no 16-bit view
            halves = (row if kind == KIND_Q8_0 else row[:0]).view(np.uint16)
            for b in range(nb):
                dst = words + np.uint64(b) * words_per_block * lanes + np.uint64(r)
                at = (g * nb + b) * LANES + r
                if kind == KIND_Q8_0:
                    src = np.uint64(Q8_0_BLOCK_BYTES // 2 * b + 1)
                    for k in range(words_per_block):
                        word = np.uint32(halves[src + 2 * k]) | (np.uint32(halves[src + 2 * k + 1]) << np.uint32(16))
                        out4[dst + k * lanes] = np.int32(word)
                    scale[at] = load_f16(row, Q8_0_BLOCK_BYTES * b)
                else:
                    _mxfp4_block_values(row, MXFP4_BLOCK_BYTES * b + 1, values)
                    for k in range(words_per_block):
                        out4[dst + k * lanes] = np.int32(quads[k])
                    scale[at] = e8m0_half_to_f32(row[MXFP4_BLOCK_BYTES * b])  # 2^(e - 128)
        else:
            for b in range(nb):
                dst = words + np.uint64(b) * words_per_block * lanes + np.uint64(r)
                for k in range(words_per_block):
                    out4[dst + k * lanes] = 0
                scale[(g * nb + b) * LANES + r] = 0
    least[:] = 0
    bias4 = np.uint32(np.uint8(bias)) * np.uint32(0x01010101)
    high_bits, low_bits = np.uint32(0x80808080), np.uint32(0x7F7F7F7F)
    minus_bias = np.float32(-bias)
    for b in range(nb):
        total[:] = 0
        base = words + np.uint64(b) * words_per_block * lanes
        for k in range(words_per_block):
            for r in range(lanes):
                w = np.uint32(out4[base + k * lanes + r])
                if bias:
                    w = ((w & low_bits) + (bias4 & low_bits)) ^ ((w ^ bias4) & high_bits)
                    out4[base + k * lanes + r] = np.int32(w)
                b0, b1 = np.int32(np.int8(w)), np.int32(np.int8(w >> np.uint32(8)))
                b2, b3 = np.int32(np.int8(w >> np.uint32(16))), np.int32(np.int8(w >> np.uint32(24)))
                total[r] += b0 + b1 + b2 + b3
                least[r] = min(least[r], min(min(b0, b1), min(b2, b3)))
        for r in range(LANES):
            at = (g * nb + b) * LANES + r
            corr[at] = 128 * total[r]
            if offset.size:  # pack's: the scale x -bias of a row, 0 for padding
                offset[at] = scale[at] * minus_bias if g * LANES + r < rows else 0


@njit(cache=True, nogil=True, inline="always")
def _block_ints(row: np.ndarray, kind: int, b: int, p: np.ndarray) -> np.float32:
    """Block b's integers sub-block scale x grid value as float32 p[256]; returns the scale d they multiply: the
    row's (IQ4_KS, IQ5_KS: float32; IQ2_KS, IQ3_KS: f16) or the block's (IQ4_K, IQ2_K, IQ3_K: f16); p = 0 where an
    f16 d is 0."""
    if kind == KIND_IQ4_KS:
        o = 4 + b * 136
        for m in range(8):
            s = np.int32(row[o + m])
            ls, off = np.float32((s & 254) - 127), 16 * (s & 1)
            scaled_nibbles(row, o + 8 + 16 * m, _IQ4K_FLOATS, off, ls, off, ls, p, 32 * m)
        return load_f32(row, 0)
    if kind == KIND_IQ2_KS or kind == KIND_IQ3_KS:
        return _ks_ints(row, kind, b, p)
    if kind == KIND_IQ2_K or kind == KIND_IQ3_K:
        return _k_ints(row, kind, b, p)
    if kind == KIND_IQ5_KS:
        o = 4 + b * 168
        for ib in range(8):
            s = np.int32(row[o + ib])
            ls, off = np.float32((s & 254) - 127), 32 * (s & 1)
            codes, shift = o + 8 + 32 * (ib // 2), 4 * (ib % 2)
            for j in range(32):
                k = ((np.int32(row[codes + j]) >> shift) & 15) | (((np.int32(row[o + 136 + j]) >> ib) & 1) << 4)
                p[32 * ib + j] = ls * _IQ5NL_FLOATS[off + k]
        return load_f32(row, 0)
    o = b * 144
    d = load_f16(row, o)
    extra = np.int32(row[o + 2]) | (np.int32(row[o + 3]) << 8)
    for m in range(8):  # sub-blocks 2m (low nibbles) and 2m + 1 (high) of 16 values
        low_bits, high_byte = np.int32(row[o + 8 + m]), np.int32(row[o + 4 + m // 2])
        ls_lo = (low_bits & 15) | (((high_byte >> (4 * (m % 2))) & 3) << 4)
        ls_hi = (low_bits >> 4) | (((high_byte >> (4 * (m % 2) + 2)) & 3) << 4)
        scaled_nibbles(row, o + 16 + 16 * m, _IQ4K_FLOATS, 16 * ((extra >> (2 * m)) & 1), np.float32(ls_lo - 32),
                   16 * ((extra >> (2 * m + 1)) & 1), np.float32(ls_hi - 32), p, 32 * m)
    if d == 0:
        p[:] = 0
    return d


@njit(cache=True, nogil=True, inline="always")
def ks_block_at(kind: int, b: int) -> int:
    """Where block b of an IQ2_KS / IQ3_KS row starts (after the row's f16 scale)."""
    return ROW_BYTES_KS + b * (BLOCK_BYTES_IQ2_KS if kind == KIND_IQ2_KS else BLOCK_BYTES_IQ3_KS)


@njit(cache=True, nogil=True, inline="always")
def ks_sub_block(row: np.ndarray, kind: int, o: int, ib: int) -> tuple[np.int32, np.int32]:
    """Sub-block ib of the IQ2_KS / IQ3_KS block at o: its scale (4 bits, the fifth in the 16-bit flags word, minus
    16) and where its half of the grid starts (the flags' shift bit)."""
    extra = np.int32(row[o]) | (np.int32(row[o + 1]) << 8)
    if kind == KIND_IQ2_KS:
        ls = ((np.int32(row[o + 2 + ib // 2]) >> (4 * (ib % 2))) & 15) | (((extra >> (8 + ib)) & 1) << 4)
        return ls - 16, 4 * ((extra >> ib) & 1)
    ls = ((np.int32(row[o + 2 + ib % 4]) >> (4 * (ib // 4))) & 15) | (((extra >> ib) & 1) << 4)
    return ls - 16, 8 * ((extra >> (8 + ib)) & 1)


@njit(cache=True, nogil=True, inline="always")
def ks_code(row: np.ndarray, kind: int, o: int, ib: int, j: int) -> np.int32:
    """The code of value j of sub-block ib of the IQ2_KS / IQ3_KS block at o: bits 2 (ib % 4) of code byte
    32 (ib // 4) + j (IQ3_KS: and bit ib of its high-bit byte j as the third)."""
    k = (np.int32(row[o + 6 + 32 * (ib // 4) + j]) >> (2 * (ib % 4))) & 3
    if kind == KIND_IQ3_KS:
        k |= ((np.int32(row[o + 70 + j]) >> ib) & 1) << 2
    return k


@njit(cache=True, nogil=True, inline="always")
def _ks_ints(row: np.ndarray, kind: int, b: int, p: np.ndarray) -> np.float32:
    """_block_ints of IQ2_KS and IQ3_KS: each sub-block's scale x its values' grid values (ks_sub_block,
    ks_code)."""
    o = ks_block_at(kind, b)
    d = load_f16(row, 0)
    for ib in range(8):
        ls, off = ks_sub_block(row, kind, o, ib)
        scale = np.float32(ls)
        for j in range(32):
            k = ks_code(row, kind, o, ib, j)
            if kind == KIND_IQ2_KS:
                p[32 * ib + j] = scale * _IQ2NL_FLOATS[off + k]
            else:
                p[32 * ib + j] = scale * _IQ3NL_FLOATS[off + k]
    if d == 0:
        p[:] = 0
    return d


@njit(cache=True, nogil=True, inline="always")
def _k_ints(row: np.ndarray, kind: int, b: int, p: np.ndarray) -> np.float32:
    """_block_ints of IQ2_K and IQ3_K: sub-block ib's 16 values from bits 2 ((ib / 2) % 4) of 16 code bytes (the
    first or second 16 of a 32-byte group; IQ3_K: and bit ib / 2 of 16 more), its scale from 4 bits (IQ2_K: minus
    8; IQ3_K: 2 x + 1, negated where its sign bit is set)."""
    iq2 = kind == KIND_IQ2_K
    o = b * (76 if iq2 else 110)
    d = load_f16(row, o)
    extra = np.int32(row[o + 2]) | (np.int32(row[o + 3]) << 8)
    signs = np.int32(row[o + 4]) | (np.int32(row[o + 5]) << 8)
    for ib in range(16):
        pair = ib // 2
        nibble = (np.int32(row[o + (4 if iq2 else 6) + pair]) >> (4 * (ib % 2))) & 15
        if iq2:
            ls = nibble - 8
        else:
            ls = -(2 * nibble + 1) if (signs >> ib) & 1 else 2 * nibble + 1
        scale = np.float32(ls)
        off = (4 if iq2 else 8) * ((extra >> ib) & 1)
        codes = o + (12 if iq2 else 14) + 32 * (pair // 4) + 16 * (ib % 2)
        high, shift = o + 78 + 16 * (ib % 2), 2 * (pair % 4)
        if iq2:
            for j in range(16):
                p[16 * ib + j] = scale * _IQ2NL_FLOATS[off + ((np.int32(row[codes + j]) >> shift) & 3)]
        else:
            for j in range(16):
                k = ((np.int32(row[codes + j]) >> shift) & 3) | (((np.int32(row[high + j]) >> pair) & 1) << 2)
                p[16 * ib + j] = scale * _IQ3NL_FLOATS[off + k]
    if d == 0:
        p[:] = 0
    return d


@njit(cache=True, nogil=True, inline="always")
def requantize_q8_k(p: np.ndarray, p_bits: np.ndarray, inv_c: np.float32, q: np.ndarray) -> np.float32:
    """ik's convert_to_q8_k_r8 on one block's integers p (float32 [SUPER]; p_bits: the same memory as int32): into
    q the int8 values, p itself where max|p| x inv_c < 1, else rint(p / dnew) clamped to int8 with dnew = max|p| x
    inv_c; returns dnew (1 where p is kept). Each loop is one vector loop: max|p| is the largest of the values'
    bits without the sign (a float maximum stays scalar: LLVM may not reorder its NaN cases), the int8 values go
    through int32 (a direct float -> int8 conversion stayed scalar)."""
    most = np.int32(0)
    for j in range(SUPER):
        most = max(most, p_bits[j] & np.int32(0x7FFFFFFF))
    dnew = f32_from_bits(np.uint32(most)) * inv_c
    if dnew < 1:
        for j in range(SUPER):
            q[j] = np.int8(np.int32(p[j]))
        return np.float32(1.0)
    inv = np.float32(1.0) / dnew
    for j in range(SUPER):
        q[j] = np.int8(np.int32(min(np.float32(127.0), max(np.float32(-128.0), np.rint(p[j] * inv)))))
    return dnew


@njit(cache=True, nogil=True)
def _group(g: int, raw: np.ndarray, kind: int, nb: int, inv_c: np.float32, out4: np.ndarray, scale: np.ndarray,
           corr: np.ndarray, low: np.ndarray, p: np.ndarray, p_bits: np.ndarray, q: np.ndarray,
           q4: np.ndarray) -> None:
    """_groups' task: group g through the thread's buffers. A function of its own rather than inlined in the
    parallel loop, whose body Numba types and compiles twice (an IQ4_KS pack's first call 18.1 -> 13.7 s on a
    2-core Zen 3)."""
    rows = raw.shape[0]
    steps = nb * SUPER // 4
    least = np.int32(0)
    for r in range(LANES):
        row_index = g * LANES + r
        for b in range(nb):
            at = (g * nb + b) * LANES + r
            words = (g * steps + b * (SUPER // 4)) * LANES + r
            if row_index >= rows:
                scale[at], corr[at] = 0, 0
                for k in range(SUPER // 4):
                    out4[words + k * LANES] = 0
                continue
            d = _block_ints(raw[row_index], kind, b, p)
            dnew = requantize_q8_k(p, p_bits, inv_c, q)
            total = np.int32(0)
            for j in range(SUPER):
                total += np.int32(q[j])
                least = min(least, np.int32(q[j]))
            corr[at] = 128 * total
            scale[at] = round_f16(d * dnew)
            for k in range(SUPER // 4):
                out4[words + k * LANES] = q4[k]
    low[g] = least == -128


@njit(cache=True, nogil=True, parallel=True)
def _groups(raw: np.ndarray, kind: int, nb: int, inv_c: np.float32, out4: np.ndarray, scale: np.ndarray,
            corr: np.ndarray, low: np.ndarray, threads: int) -> None:
    """Each 16-row group's rows converted block by block into out4 [group, step, 16 rows] (4 values each),
    scale and corr [group, block, 16] (corr = 128 x the block's int8 sum; padding rows all zero) and low[group]
    (a value is -128); the groups in tasks the threads claim (ikrun/ops/parallel.py)."""
    groups = low.size
    per, counter = task_items(groups, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        p = np.empty(SUPER, np.float32)
        p_bits = p.view(np.int32)
        q = np.empty(SUPER, np.int8)
        q4 = q.view(np.int32)
        i0, i1 = claim_items(counter, per, groups)
        while i0 < i1:
            for g in range(i0, i1):
                _group(g, raw, kind, nb, inv_c, out4, scale, corr, low, p, p_bits, q, q4)
            i0, i1 = claim_items(counter, per, groups)
