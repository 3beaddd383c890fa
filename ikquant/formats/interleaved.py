"""ik's row-interleaved types (`_R4`, `_R8`, `_R16`): groups of rows stored together so that its matrix kernels read
several rows at once. Most are a regrouping of their base type's bits, not another quantizer: quantizing means
quantizing the rows with the base codec and regrouping each group; decoding undoes the regrouping. A codec here is
the base codec plus, per block column of one group (and for row-scaled types the group's header of row scales),
where each interleaved bit comes from (ik's repack_* functions, as facts). Most regroupings move whole bytes or
nibbles; the IQK ones also spread 1- and 2-bit fields (block extras, high scale bits) over other bytes, so the maps
are kept per bit. Every block column of a group moves its bits alike, so one map per unit (the group's rows' blocks
at one column) does: a Numba kernel applies it 64 units at a time, transposed so that each unit byte is one vector
(whole-byte moves and nibble pairs take one or two vector operations, a byte of scattered bits eight). A few forms also rewrite fields reversibly before regrouping (a `Recode`): IQ2_XXS/IQ2_XS/IQ3_XXS
store every 7-bit sign group through ik's scrambling table, Q8_KV_R8 drops the rows' code sums. Q8_K_R8/Q8_K_R16
regroup rows that no file type stores (ik's 8-bit activation blocks), so they have no plain form to unpack to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numba import njit, prange

from ikquant.errors import QuantInputError
from ikquant.formats.base import Codec
from ikquant.formats.jit import read_only
from ikquant.formats.numeric import fmaf, load_f16, store_f16
from ikquant.formats.q8_direct import (
    dequantize_q8_k_interleaved,
    dequantize_q8_kv_r8,
    quantize_q8_k_interleaved,
    quantize_q8_kv_r8,
)
from ikquant.formats.r8_direct import dequantize_q4_0_r8, dequantize_q8_0_r8
from ikquant.types import register_codec, type_by_name


def _nibbles(byte_src: list[int]) -> list[int]:
    """Source nibbles (low then high of each byte) for output bytes taken whole from `byte_src`."""
    return [2 * b + h for b in byte_src for h in (0, 1)]


def _bits_of_nibbles(nibbles: list[int] | np.ndarray) -> np.ndarray:
    """The source bits of a nibble map (nibble n is bits 4n .. 4n + 3, little-endian within its byte)."""
    return (4 * np.asarray(nibbles, dtype=np.int64)[:, None] + np.arange(4)[None, :]).reshape(-1)


def _field(byte: int, lo: int, n: int) -> list[int]:
    """The source bits of an n-bit field starting at bit `lo` of byte `byte`."""
    return [8 * byte + lo + j for j in range(n)]


#: the order ik's IQK _R4 repacks store a sub-block's 4-bit codes in: per quarter, bytes 4 k + i of row k hold
#: (low nibble, high nibble) = values (lo + i, hi + i)
R4_QUARTERS = ((0, 8), (16, 24), (4, 12), (20, 28))
#: the values whose fifth bits a byte 4 k + i of IQ5_K_R4's qh holds, bit by bit (+ i)
R4_HIGH_BITS = (0, 8, 16, 24, 4, 12, 20, 28)
ValueBits = Callable[[int, int, int], list[int]]


def _r4_low_codes(value_bits: ValueBits, sub: int) -> list[int]:
    """Sub-block `sub`'s 4-bit codes of 4 rows in ik's _R4 order; value_bits(k, sub, m) are the source bits of row
    k's value m."""
    return [b for lo, hi in R4_QUARTERS for k in range(4) for i in range(4)
            for b in value_bits(k, sub, lo + i) + value_bits(k, sub, hi + i)]


def _iq4_codes(rows: list[int], qs: int) -> ValueBits:
    """IQ4_K / IQ4_KS codes: value m of sub-block s is nibble m // 16 of byte 16 s + m % 16."""
    return lambda k, sub, m: _field(rows[k] + qs + 16 * sub + m % 16, 4 * (m // 16), 4)


def _iq5_codes(rows: list[int], qs: int) -> ValueBits:
    """IQ5_K / IQ5_KS low codes: value m of sub-block s is nibble s % 2 of byte 32 (s // 2) + m."""
    return lambda k, sub, m: _field(rows[k] + qs + 32 * (sub // 2) + m, 4 * (sub % 2), 4)


def _iq5_fifth_bits(rows: list[int], qh: int, sub: int) -> list[int]:
    """IQ5_K(S)_R4's qh for sub-block `sub`: value m's fifth bit is bit s of qh byte m (ik's convert_iq5_k)."""
    return [b for k in range(4) for i in range(4) for t in R4_HIGH_BITS for b in _field(rows[k] + qh + t + i, sub, 1)]


def _r4_scale_bytes(rows: list[int]) -> list[int]:
    """The row-scaled IQK _R4 blocks' scale bytes: byte 4 s + k is row k's scale byte s."""
    return [b for s in range(8) for r in rows for b in _field(r + s, 0, 8)]


def iq4_ks_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """IQ4_KS_R4 (after the group's 4 row scales): the 4 rows' scale bytes per sub-block, then their codes."""
    rows = [k * row_bytes + 4 + 136 * ib for k in range(4)]
    out = _r4_scale_bytes(rows)
    for sub in range(8):
        out += _r4_low_codes(_iq4_codes(rows, 8), sub)
    return np.array(out, dtype=np.int64)


def iq5_ks_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """IQ5_KS_R4 (after the group's 4 row scales): scale bytes as IQ4_KS_R4's, the low codes, then the fifth bits."""
    rows = [k * row_bytes + 4 + 168 * ib for k in range(4)]
    out = _r4_scale_bytes(rows)
    for sub in range(8):
        out += _r4_low_codes(_iq5_codes(rows, 8), sub)
    for sub in range(8):
        out += _iq5_fifth_bits(rows, 136, sub)
    return np.array(out, dtype=np.int64)


def row_scales_r4(row_bytes: int) -> np.ndarray:
    """The header of a row-scaled type's 4-row group: each row's f32 scale, in row order."""
    return np.array([b for k in range(4) for b in _field(k * row_bytes, 0, 32)], dtype=np.int64)


def _iqk_r4_head(rows: list[int]) -> list[int]:
    """What the IQK _R4 blocks (IQ2_K, IQ3_K, IQ4_K) start with: the 4 rows' f16 d, then 8 bytes of extra bits
    (byte k: bit 2s of row k's u16 extra per sub-block s; byte 4 + k: bit 2s + 1); `rows` are the 4 source
    blocks' offsets, extra at +2."""
    out = [b for r in rows for b in _field(r, 0, 16)]
    for odd in (0, 1):
        for r in rows:
            out += [b for sub in range(8) for b in _field(r + 2 + (2 * sub + odd) // 8, (2 * sub + odd) % 8, 1)]
    return out


def _iqk_r4_low_scales(rows: list[int], scales: int) -> list[int]:
    """32 bytes of 4-bit scales: field i = 8 s + k (+4 for sub-block s's second half) at byte i % 32, nibble i // 32,
    from the low (high) nibble of row k's scale byte s at offset `scales`."""
    low = {8 * sub + k + 4 * half: _field(r + scales + sub, 4 * half, 4)
           for k, r in enumerate(rows) for sub in range(8) for half in (0, 1)}
    return [b for byte in range(32) for i in (byte, byte + 32) for b in low[i]]


def _iqk_r4_2bit_codes(rows: list[int], codes: int, sub: int) -> list[int]:
    """Sub-block `sub`'s 2-bit codes of 4 rows as the IQ2_K/IQ3_K _R4 blocks hold them: byte 4 k + i (+16) holds
    values i, i + 4, i + 8, i + 12 (16 + ...) of row k; a value's bits are bits 2 (sub % 4) of byte
    32 (sub // 4) + position of the row's codes at offset `codes`."""
    out: list[int] = []
    for second in (0, 16):
        for r in rows:
            for i in range(4):
                for t in range(4):
                    m = second + i + 4 * t
                    out += _field(r + codes + 32 * (sub // 4) + m, 2 * (sub % 4), 2)
    return out


def iq2_k_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """IQ2_K_R4: d and extra bits as IQ4_K_R4, 32 bytes of 4-bit scales, then per sub-block the 2-bit codes."""
    rows = [k * row_bytes + 76 * ib for k in range(4)]
    out = _iqk_r4_head(rows) + _iqk_r4_low_scales(rows, 4)
    for sub in range(8):
        out += _iqk_r4_2bit_codes(rows, 12, sub)
    return np.array(out, dtype=np.int64)


def iq3_k_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """IQ3_K_R4: d and extra bits as IQ4_K_R4; 8 bytes of the scales' sign bits (field i = 8 s + k (+4) at byte i % 8,
    bit i // 8, from bit 2 s (2 s + 1) of row k's u16 scales_h), 32 bytes of 4-bit scales, the 2-bit codes as
    IQ2_K_R4's, then per sub-block the codes' third bits: byte 4 k + i holds those of values i + 4 t, t = 0..7."""
    rows = [k * row_bytes + 110 * ib for k in range(4)]
    out = _iqk_r4_head(rows)
    sign = {8 * sub + k + 4 * half: _field(r + 4 + (2 * sub + half) // 8, (2 * sub + half) % 8, 1)
            for k, r in enumerate(rows) for sub in range(8) for half in (0, 1)}
    out += [b for byte in range(8) for t in range(8) for b in sign[byte + 8 * t]]
    out += _iqk_r4_low_scales(rows, 6)
    for sub in range(8):
        out += _iqk_r4_2bit_codes(rows, 14, sub)
    for sub in range(8):
        for r in rows:
            for i in range(4):
                out += [b for t in range(8) for b in _field(r + 78 + i + 4 * t, sub, 1)]
    return np.array(out, dtype=np.int64)


def _iqk_r4_scales_4_2(rows: list[int]) -> list[int]:
    """IQ4_K/IQ5_K _R4 scales: 16 bytes of 2-bit high scale bits, field i = 8 s + k (+4 for a sub-block's second
    half) at byte i % 16 bits 2 (i // 16), from scales_h (offset 4); then 32 bytes of 4-bit low ones (offset 8)."""
    high = {8 * sub + k + 4 * half: _field(r + 4 + sub // 2, 4 * (sub % 2) + 2 * half, 2)
            for k, r in enumerate(rows) for sub in range(8) for half in (0, 1)}
    out = [b for byte in range(16) for i in (byte, byte + 16, byte + 32, byte + 48) for b in high[i]]
    return out + _iqk_r4_low_scales(rows, 8)


def iq4_k_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """IQ4_K_R4: the 4 rows' f16 d and extra bits (_iqk_r4_head), the scales, then the codes."""
    rows = [k * row_bytes + 144 * ib for k in range(4)]
    out = _iqk_r4_head(rows) + _iqk_r4_scales_4_2(rows)
    for sub in range(8):
        out += _r4_low_codes(_iq4_codes(rows, 16), sub)
    return np.array(out, dtype=np.int64)


def iq5_k_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """IQ5_K_R4: as IQ4_K_R4 (its own code order), then the codes' fifth bits."""
    rows = [k * row_bytes + 176 * ib for k in range(4)]
    out = _iqk_r4_head(rows) + _iqk_r4_scales_4_2(rows)
    for sub in range(8):
        out += _r4_low_codes(_iq5_codes(rows, 16), sub)
    for sub in range(8):
        out += _iq5_fifth_bits(rows, 144, sub)
    return np.array(out, dtype=np.int64)


def _k_scale_bits(r: int, j: int) -> tuple[list[int], list[int]]:
    """The 6 bits of sub-block j's scale and min in a K-quant block at r (the 12 scale bytes at r + 4, ggml's
    get_scale_min_k4), lowest bit first."""
    q = r + 4
    if j < 4:
        return _field(q + j, 0, 6), _field(q + j + 4, 0, 6)
    return _field(q + j + 4, 0, 4) + _field(q + j - 4, 6, 2), _field(q + j + 4, 4, 4) + _field(q + j, 6, 2)


def _k_r4_head(rows: list[int]) -> list[int]:
    """What Q4_K_R4 and Q5_K_R4 start with: the 4 rows' f16 d then dmin; 16 bytes of high scale bits (field
    i = 4 s + k at byte i % 16, nibble i // 16: the scale's bits 4-5, then the min's); 32 bytes of (scale low 4 |
    min low 4 << 4), byte 4 s + k."""
    out = [b for r in rows for b in _field(r, 0, 16)] + [b for r in rows for b in _field(r + 2, 0, 16)]
    sm = {4 * sub + k: _k_scale_bits(r, sub) for k, r in enumerate(rows) for sub in range(8)}
    out += [b for byte in range(16) for i in (byte, byte + 16) for b in sm[i][0][4:] + sm[i][1][4:]]
    return out + [b for i in range(32) for b in sm[i][0][:4] + sm[i][1][:4]]


def q4_k_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """Q4_K_R4: the scales (_k_r4_head), then the codes in ik's _R4 order (value m of sub-block s: nibble s % 2 of
    byte 32 (s // 2) + m)."""
    rows = [k * row_bytes + 144 * ib for k in range(4)]
    out = _k_r4_head(rows)
    for sub in range(8):
        out += _r4_low_codes(_iq5_codes(rows, 16), sub)
    return np.array(out, dtype=np.int64)


def q5_k_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """Q5_K_R4: the scales as Q4_K_R4's; per sub-block 16 bytes of fifth bits (byte 4 k + i: values i + t, t in
    Q5_K_R4_HIGH_BITS order, of row k; value m's fifth bit is bit s of qh byte m), then the low codes as Q4_K_R4's
    (the Q5_K codes start at byte 48)."""
    rows = [k * row_bytes + 176 * ib for k in range(4)]
    out = _k_r4_head(rows)
    for sub in range(8):
        out += [b for k in range(4) for i in range(4) for t in Q5_K_R4_HIGH_BITS for b in _field(rows[k] + 16 + i + t, sub, 1)]
    for sub in range(8):
        out += _r4_low_codes(_iq5_codes(rows, 48), sub)
    return np.array(out, dtype=np.int64)


#: the values (+ i) whose fifth bits a Q5_K_R4 qh byte 4 k + i holds, bit by bit
Q5_K_R4_HIGH_BITS = (0, 8, 4, 12, 16, 24, 20, 28)


def _bytes(src: list[int]) -> list[int]:
    """The source bits of output bytes taken whole from the source bytes `src`."""
    return [b for byte in src for b in _field(byte, 0, 8)]


def _codes_2bit(value: Callable[[int, int], list[int]], k: int, first: int) -> list[int]:
    """4 bytes of 2-bit codes as the K-quant _R4 forms hold them: byte i holds values first + i + 4 t, t = 0..3, of
    row k (value(k, m) gives value m's source bits)."""
    return [b for i in range(4) for t in range(4) for b in value(k, first + i + 4 * t)]


def q5_0_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """Q5_0_R4: the 4 rows' f16 d; 16 bytes of fifth bits (byte 4 k + i, bit l: value i + o_l of row k, bit 4 + l:
    value i + o_l + 8, o_l = 4 (l // 2) + 16 (l % 2)); then per l byte 16 l + 4 k + i of (low 4 bits of value
    i + o_l | those of i + o_l + 8 << 4). A Q5_0 value m: low bits nibble m // 16 of qs byte 6 + m % 16, fifth bit
    bit m of the u32 qh at byte 2."""
    rows = [k * row_bytes + 22 * ib for k in range(4)]

    def low(k: int, m: int) -> list[int]:
        return _field(rows[k] + 6 + m % 16, 4 * (m // 16), 4)

    offsets = [4 * (l // 2) + 16 * (l % 2) for l in range(4)]
    out = _bytes([r + b for r in rows for b in (0, 1)])
    out += [b for k in range(4) for i in range(4) for extra in (0, 8) for o in offsets
            for b in _field(rows[k] + 2 + (i + o + extra) // 8, (i + o + extra) % 8, 1)]
    out += [b for o in offsets for k in range(4) for i in range(4) for b in low(k, i + o) + low(k, i + o + 8)]
    return np.array(out, dtype=np.int64)


def q6_0_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """Q6_0_R4: the 4 rows' f16 d; 32 bytes of top bits (byte 16 p + 4 k + i holds, 2 bits each, those of values
    i + 16 p, i + 4 + 16 p, i + 8 + 16 p, i + 12 + 16 p of row k); then the low codes as Q5_0_R4's. A Q6_0 value m:
    low bits nibble m // 16 of qs byte 10 + m % 16, top bits 4 (j // 8) + 2 (m // 16) of qh byte 2 + j % 8,
    j = m % 16."""
    rows = [k * row_bytes + 26 * ib for k in range(4)]

    def low(k: int, m: int) -> list[int]:
        return _field(rows[k] + 10 + m % 16, 4 * (m // 16), 4)

    def top(k: int, m: int) -> list[int]:
        j = m % 16
        return _field(rows[k] + 2 + j % 8, 4 * (j // 8) + 2 * (m // 16), 2)

    offsets = [4 * (l // 2) + 16 * (l % 2) for l in range(4)]
    out = _bytes([r + b for r in rows for b in (0, 1)])
    out += [b for p in (0, 1) for k in range(4) for i in range(4) for t in (0, 4, 8, 12) for b in top(k, i + 16 * p + t)]
    out += [b for o in offsets for k in range(4) for i in range(4) for b in low(k, i + o) + low(k, i + o + 8)]
    return np.array(out, dtype=np.int64)


def q2_k_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """Q2_K_R4: the 4 rows' f16 d then dmin, 64 scale bytes (byte 4 s + k: row k's scale byte s), then per sub-block
    of 32 the 2-bit codes (_codes_2bit, values 0.. then 16..). A Q2_K value m: bits 2 ((m % 128) // 32) of qs byte
    16 + 32 (m // 128) + m % 32."""
    rows = [k * row_bytes + 84 * ib for k in range(4)]

    def value(k: int, m: int) -> list[int]:
        return _field(rows[k] + 16 + 32 * (m // 128) + m % 32, 2 * ((m % 128) // 32), 2)

    out = _bytes([r + 80 + b for r in rows for b in (0, 1)] + [r + 82 + b for r in rows for b in (0, 1)])
    out += _bytes([r + s for s in range(16) for r in rows])
    out += [b for sub in range(8) for half in (0, 16) for k in range(4) for b in _codes_2bit(value, k, 32 * sub + half)]
    return np.array(out, dtype=np.int64)


def q3_k_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """Q3_K_R4: the 4 rows' f16 d; 16 bytes of the 6-bit scales' top 2 bits and 32 of their low 4 (field
    f = 8 (j // 2) + k + 4 (j % 2) for row k's scale j, at byte f % 16 bits 2 (f // 16), and byte f % 32 nibble
    f // 32); per sub-block 16 bytes of third bits (byte 4 k + i, bit t: value i + 4 t), then the 2-bit codes
    (_codes_2bit). A Q3_K value m = 128 n + 32 j + l: low bits 2 j of qs byte 32 + 32 n + l, third bit 4 n + j of
    hmask byte l; scale j: low nibble j // 8 of byte 96 + j % 8, top bits 2 (j // 4) of byte 104 + j % 4."""
    rows = [k * row_bytes + 110 * ib for k in range(4)]

    def low(k: int, m: int) -> list[int]:
        return _field(rows[k] + 32 + 32 * (m // 128) + m % 32, 2 * ((m % 128) // 32), 2)

    def high(k: int, m: int) -> list[int]:
        return _field(rows[k] + m % 32, 4 * (m // 128) + (m % 128) // 32, 1)

    field = {8 * (j // 2) + k + 4 * (j % 2): (_field(r + 96 + j % 8, 4 * (j // 8), 4), _field(r + 104 + j % 4, 2 * (j // 4), 2))
             for k, r in enumerate(rows) for j in range(16)}
    out = _bytes([r + 108 + b for r in rows for b in (0, 1)])
    out += [b for byte in range(16) for t in range(4) for b in field[byte + 16 * t][1]]
    out += [b for byte in range(32) for n in (0, 1) for b in field[byte + 32 * n][0]]
    out += [b for sub in range(8) for k in range(4) for i in range(4) for t in range(8) for b in high(k, 32 * sub + i + 4 * t)]
    out += [b for sub in range(8) for half in (0, 16) for k in range(4) for b in _codes_2bit(low, k, 32 * sub + half)]
    return np.array(out, dtype=np.int64)


def iq2_xxs_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """IQ2_XXS_R4 (over the recoded rows): the 4 rows' f16 d; per sub-block the 4 rows' u32 of scrambled signs and
    scale bits (u32 4 s + k); then per sub-block the rows' 4 grid index bytes (byte 16 s + 4 k + i)."""
    rows = [k * row_bytes + 66 * ib for k in range(4)]
    out = _bytes([r + b for r in rows for b in (0, 1)])
    out += _bytes([r + 2 + 8 * sub + 4 + b for sub in range(8) for r in rows for b in range(4)])
    out += _bytes([r + 2 + 8 * sub + i for sub in range(8) for r in rows for i in range(4)])
    return np.array(out, dtype=np.int64)


def iq3_xxs_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """IQ3_XXS_R4 (over the recoded rows): the 4 rows' f16 d; the u32 of scrambled signs and scale per sub-block
    (u32 4 s + k); then per sub-block the rows' 8 grid index bytes (byte 32 s + 8 k + i)."""
    rows = [k * row_bytes + 98 * ib for k in range(4)]
    out = _bytes([r + b for r in rows for b in (0, 1)])
    out += _bytes([r + 66 + 4 * sub + b for sub in range(8) for r in rows for b in range(4)])
    out += _bytes([r + 2 + 8 * sub + i for sub in range(8) for r in rows for i in range(8)])
    return np.array(out, dtype=np.int64)


def iq2_xs_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """IQ2_XS_R4 (over the recoded rows): the 4 rows' f16 d; u16 16 s + 4 k + i = row k's (index | scrambled signs)
    i of sub-block s; scale byte 4 s + k = row k's scale byte s."""
    rows = [k * row_bytes + 74 * ib for k in range(4)]
    out = _bytes([r + b for r in rows for b in (0, 1)])
    out += _bytes([r + 2 + 2 * (4 * sub + i) + b for sub in range(8) for r in rows for i in range(4) for b in (0, 1)])
    out += _bytes([r + 66 + sub for sub in range(8) for r in rows])
    return np.array(out, dtype=np.int64)


def iq2_s_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """IQ2_S_R4: the 4 rows' f16 d; index bytes 16 s + 4 k + i; the indices' top bits 4 s + k; sign bytes as the
    index bytes; scale bytes 4 s + k."""
    rows = [k * row_bytes + 82 * ib for k in range(4)]
    out = _bytes([r + b for r in rows for b in (0, 1)])
    out += _bytes([r + 2 + 4 * sub + i for sub in range(8) for r in rows for i in range(4)])
    out += _bytes([r + 66 + sub for sub in range(8) for r in rows])
    out += _bytes([r + 34 + 4 * sub + i for sub in range(8) for r in rows for i in range(4)])
    out += _bytes([r + 74 + sub for sub in range(8) for r in rows])
    return np.array(out, dtype=np.int64)


def iq3_s_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """IQ3_S_R4: the 4 rows' f16 d; index bytes (byte 32 s + 8 t + 4 h + k: row k's index 4 h + t of sub-block s);
    the indices' 9th bits (byte 4 s + k); the signs (byte 16 s + 4 k + i, bits 2 t and 2 t + 1: bits i and 4 + i
    of row k's sign byte 4 s + t); 16 bytes of 4-bit scales (field f = 8 j + k + 4 h, nibble h of row k's scale
    byte j, at byte f % 16 nibble f // 16)."""
    rows = [k * row_bytes + 110 * ib for k in range(4)]
    out = _bytes([r + b for r in rows for b in (0, 1)])
    out += _bytes([rows[k] + 2 + 8 * sub + t + 4 * h for sub in range(8) for t in range(4) for h in (0, 1) for k in range(4)])
    out += _bytes([r + 66 + sub for sub in range(8) for r in rows])
    out += [b for sub in range(8) for r in rows for i in range(4) for t in range(4)
            for b in _field(r + 74 + 4 * sub + t, i, 1) + _field(r + 74 + 4 * sub + t, 4 + i, 1)]
    scale = {8 * j + k + 4 * h: _field(r + 106 + j, 4 * h, 4) for k, r in enumerate(rows) for j in range(4) for h in (0, 1)}
    out += [b for byte in range(16) for n in (0, 1) for b in scale[byte + 16 * n]]
    return np.array(out, dtype=np.int64)


def q8_kv_r8_header(row_bytes: int) -> np.ndarray:
    """Q8_KV_R8's group header: the 8 rows' f32 scales."""
    return np.array(_bytes([k * row_bytes + b for k in range(8) for b in range(4)]), dtype=np.int64)


def q8_kv_r8_block(row_bytes: int, ib: int) -> np.ndarray:
    """Q8_KV_R8 (over rows of scale then codes): per 16 values 128 bytes, byte 32 l + 4 k + i = row k's value
    4 l + i."""
    src = [k * row_bytes + 4 + 16 * c + 4 * l + i for c in (2 * ib, 2 * ib + 1) for l in range(4) for k in range(8)
           for i in range(4)]
    return np.array(_bytes(src), dtype=np.int64)


def _q8_k_rows_block(n: int) -> Callable[[int, int], np.ndarray]:
    """Q8_K_R8 / Q8_K_R16 over rows of (f16 d, 256 codes) blocks: the n rows' d, then byte 4 n j + 4 k + i = row k's
    code 4 j + i."""
    def block(row_bytes: int, ib: int) -> np.ndarray:
        rows = [k * row_bytes + 258 * ib for k in range(n)]
        src = [r + b for r in rows for b in (0, 1)] + [rows[k] + 2 + 4 * j + i for j in range(64) for k in range(n)
                                                       for i in range(4)]
        return np.array(_bytes(src), dtype=np.int64)

    return block


#: ik's scrambling of a 7-bit sign group in the IQ2_XXS/IQ2_XS/IQ3_XXS _R4 forms (a table of facts)
SCRAMBLED_SIGNS = np.array([
    0x00, 0x7f, 0x7e, 0x01, 0x7c, 0x03, 0x02, 0x7d, 0x78, 0x07, 0x06, 0x79, 0x04, 0x7b, 0x7a, 0x05,
    0x70, 0x0f, 0x0e, 0x71, 0x0c, 0x73, 0x72, 0x0d, 0x08, 0x77, 0x76, 0x09, 0x74, 0x0b, 0x0a, 0x75,
    0x60, 0x1f, 0x1e, 0x61, 0x1c, 0x63, 0x62, 0x1d, 0x18, 0x67, 0x66, 0x19, 0x64, 0x1b, 0x1a, 0x65,
    0x10, 0x6f, 0x6e, 0x11, 0x6c, 0x13, 0x12, 0x6d, 0x68, 0x17, 0x16, 0x69, 0x14, 0x6b, 0x6a, 0x15,
    0x40, 0x3f, 0x3e, 0x41, 0x3c, 0x43, 0x42, 0x3d, 0x38, 0x47, 0x46, 0x39, 0x44, 0x3b, 0x3a, 0x45,
    0x30, 0x4f, 0x4e, 0x31, 0x4c, 0x33, 0x32, 0x4d, 0x48, 0x37, 0x36, 0x49, 0x34, 0x4b, 0x4a, 0x35,
    0x20, 0x5f, 0x5e, 0x21, 0x5c, 0x23, 0x22, 0x5d, 0x58, 0x27, 0x26, 0x59, 0x24, 0x5b, 0x5a, 0x25,
    0x50, 0x2f, 0x2e, 0x51, 0x2c, 0x53, 0x52, 0x2d, 0x28, 0x57, 0x56, 0x29, 0x54, 0x2b, 0x2a, 0x55,
], dtype=np.uint32)
UNSCRAMBLED_SIGNS = np.argsort(SCRAMBLED_SIGNS).astype(np.uint32)
assert (SCRAMBLED_SIGNS[UNSCRAMBLED_SIGNS] == np.arange(128)).all()


@dataclass(frozen=True)
class Recode:
    """A reversible rewrite of the base rows (uint8 [rows, base row bytes]) into the rows the bit map regroups
    (uint8 [rows, interleaved row bytes]), and back."""

    forward: Callable[[np.ndarray], np.ndarray]
    inverse: Callable[[np.ndarray], np.ndarray]


def _field_recode(block_bytes: int, offsets: list[int], dtype: type, forward: Callable[[np.ndarray], np.ndarray],
                  inverse: Callable[[np.ndarray], np.ndarray]) -> Recode:
    """A Recode that rewrites the little-endian `dtype` fields at `offsets` of every block with `forward` /
    `inverse` (arrays of field values in, same shape out)."""
    width = np.dtype(dtype).itemsize

    def apply(rows: np.ndarray, f: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        starts = np.arange(rows.shape[1] // block_bytes)[:, None] * block_bytes + np.array(offsets)[None, :]
        pos = starts.reshape(-1)[:, None] + np.arange(width)[None, :]
        values: np.ndarray = np.ascontiguousarray(rows[:, pos]).view(dtype)[..., 0]
        out = rows.copy()
        out[:, pos] = np.ascontiguousarray(f(values).astype(dtype))[..., None].view(np.uint8)
        return out

    return Recode(lambda rows: apply(rows, forward), lambda rows: apply(rows, inverse))


def _scramble_u32(v: np.ndarray) -> np.ndarray:
    """Four 7-bit sign groups and a 4-bit scale (top bits) -> four bytes of (scrambled group j << 1 | scale bit j)."""
    out = np.zeros_like(v)
    for j in range(4):
        out |= ((SCRAMBLED_SIGNS[(v >> (7 * j)) & 127] << 1) | ((v >> (28 + j)) & 1)) << (8 * j)
    return out


def _unscramble_u32(v: np.ndarray) -> np.ndarray:
    out = np.zeros_like(v)
    for j in range(4):
        b = (v >> (8 * j)) & 255
        out |= (UNSCRAMBLED_SIGNS[b >> 1] << (7 * j)) | ((b & 1) << (28 + j))
    return out


def _scramble_u16(v: np.ndarray) -> np.ndarray:
    """IQ2_XS: a 9-bit grid index and a 7-bit sign group -> the index and the scrambled group."""
    v = v.astype(np.uint32)
    return (v & 511) | (SCRAMBLED_SIGNS[v >> 9] << 9)


def _unscramble_u16(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.uint32)
    return (v & 511) | (UNSCRAMBLED_SIGNS[v >> 9] << 9)


IQ2_XXS_RECODE = _field_recode(66, [2 + 8 * s + 4 for s in range(8)], np.uint32, _scramble_u32, _unscramble_u32)
IQ3_XXS_RECODE = _field_recode(98, [66 + 4 * s for s in range(8)], np.uint32, _scramble_u32, _unscramble_u32)
IQ2_XS_RECODE = _field_recode(74, [2 + 2 * j for j in range(32)], np.uint16, _scramble_u16, _unscramble_u16)


def _drop_code_sums(rows: np.ndarray) -> np.ndarray:
    """Q8_KV rows (f32 scale, i32 code sum, codes) -> (scale, codes): the sum is ik's matmul's, recomputed on unpack."""
    return np.ascontiguousarray(np.concatenate([rows[:, :4], rows[:, 8:]], axis=1))


def _add_code_sums(rows: np.ndarray) -> np.ndarray:
    sums = rows[:, 4:].view(np.int8).sum(axis=1, dtype=np.int32)
    return np.ascontiguousarray(np.concatenate([rows[:, :4], sums[:, None].view(np.uint8), rows[:, 4:]], axis=1))


Q8_KV_RECODE = Recode(_drop_code_sums, _add_code_sums)


def q6_k_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """Q6_K_R4: the 4 rows' f16 d; 64 scale bytes (byte 8 s + 4 h + k: row k's scale 2 s + h); the codes' top 2
    bits (bytes 4 k + i of sub-block s hold values i, i + 8, i + 4, i + 12, then +16 those of 16 + ...); then their
    low 4 bits in ik's _R4 order. Value m of sub-block s of a Q6_K block: low bits nibble (s % 4) // 2 of ql byte
    64 (s // 4) + 32 (s % 2) + m, top bits 2 (s % 4) of qh byte 128 + 32 (s // 4) + m."""
    rows = [k * row_bytes + 210 * ib for k in range(4)]
    out = [b for r in rows for b in _field(r + 208, 0, 16)]
    out += [b for sub in range(8) for h in (0, 1) for r in rows for b in _field(r + 192 + 2 * sub + h, 0, 8)]

    def top(k: int, sub: int, m: int) -> list[int]:
        return _field(rows[k] + 128 + 32 * (sub // 4) + m, 2 * (sub % 4), 2)

    for sub in range(8):
        for second in (0, 16):
            out += [b for k in range(4) for i in range(4) for t in (0, 8, 4, 12) for b in top(k, sub, second + t + i)]
    for sub in range(8):
        out += _r4_low_codes(lambda k, s, m: _field(rows[k] + 64 * (s // 4) + 32 * (s % 2) + m, 4 * ((s % 4) // 2), 4),
                             sub)
    return np.array(out, dtype=np.int64)


def iq4_xs_r8_block(row_bytes: int, ib: int) -> np.ndarray:
    """IQ4_XS_R8: the 8 rows' f16 d; 16 bytes of 2-bit high scales and 32 of 4-bit low ones (field i = 8 s + k at
    byte i % 16 bits 2 (i // 16), and byte i % 32 nibble i // 32); then per sub-block 4 runs of 32 bytes, byte 4 k + i
    of run j holding row k's values (i + 8 j, i + 8 j + 4), each value m of a row nibble m // 16 of byte 16 s + m % 16.
    """
    rows = [k * row_bytes + 136 * ib for k in range(8)]
    out = [b for r in rows for b in _field(r, 0, 16)]
    high = {8 * sub + k: _field(r + 2 + sub // 4, 2 * (sub % 4), 2) for k, r in enumerate(rows) for sub in range(8)}
    low = {8 * sub + k: _field(r + 4 + sub // 2, 4 * (sub % 2), 4) for k, r in enumerate(rows) for sub in range(8)}
    out += [b for byte in range(16) for i in (byte, byte + 16, byte + 32, byte + 48) for b in high[i]]
    out += [b for byte in range(32) for i in (byte, byte + 32) for b in low[i]]
    value = _iq4_codes(rows, 8)
    for sub in range(8):
        out += [b for j in range(4) for k in range(8) for i in range(4)
                for b in value(k, sub, i + 8 * j) + value(k, sub, i + 8 * j + 4)]
    return np.array(out, dtype=np.int64)


def q8_0_r8_block(row_bytes: int, ib: int) -> np.ndarray:
    """Source nibble (within 8 consecutive Q8_0 rows, row k at byte k*row_bytes) of every nibble of interleaved
    block ib: the 8 rows' f16 scales, then their codes 4 at a time: values 0..15 of all rows, then 16..31."""
    src = [k * row_bytes + ib * 34 + b for k in range(8) for b in (0, 1)]
    for half in (0, 16):
        for lane in range(4):
            src += [k * row_bytes + ib * 34 + 2 + half + 4 * lane + i for k in range(8) for i in range(4)]
    return np.array(_nibbles(src), dtype=np.int64)


def q4_0_r8_block(row_bytes: int, ib: int) -> np.ndarray:
    """Q4_0_R8 (ik's block_iq4_nl_r8): the 8 rows' f16 scales, then their packed codes 4 bytes at a time."""
    src = [k * row_bytes + ib * 18 + b for k in range(8) for b in (0, 1)]
    for lane in range(4):
        src += [k * row_bytes + ib * 18 + 2 + 4 * lane + i for k in range(8) for i in range(4)]
    return np.array(_nibbles(src), dtype=np.int64)


def mxfp4_r8_block(row_bytes: int, ib: int) -> np.ndarray:
    """MXFP4_R8: the 8 rows' E8M0 exponents, then their packed codes 4 bytes at a time (as Q4_0_R8)."""
    src = [k * row_bytes + ib * 17 for k in range(8)]
    for lane in range(4):
        src += [k * row_bytes + ib * 17 + 1 + 4 * lane + i for k in range(8) for i in range(4)]
    return np.array(_nibbles(src), dtype=np.int64)


def iq4_nl_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """IQ4_NL_R4: the 4 rows' f16 scales, then bytes whose low and high nibbles come from different source bytes:
    per row 4 bytes of (values 0..3 | 8..11), then (16..19 | 24..27), (4..7 | 12..15), (20..23 | 28..31)."""
    nib = _nibbles([k * row_bytes + ib * 18 + b for k in range(4) for b in (0, 1)])
    for lo_byte, high in ((0, 0), (0, 1), (4, 0), (4, 1)):  # (first source byte, which nibble of it)
        for k in range(4):
            q = 2 * (k * row_bytes + ib * 18 + 2)
            nib += [n for i in range(4) for n in (q + 2 * (lo_byte + i) + high, q + 2 * (lo_byte + 8 + i) + high)]
    return np.array(nib, dtype=np.int64)


def _from_base(name: str) -> property:
    return property(lambda self: getattr(self.base, name), doc=f"the base codec's {name}")


class PlainRows(Protocol):
    """What an interleaved codec regroups when its rows are not the base type's: how to make and read them."""

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None: ...

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None: ...


class InterleavedCodec(Codec):
    """A base codec's rows regrouped `group` at a time; `block(row_bytes, ib)` maps one block column and
    `header(row_bytes)` (row-scaled types) the group's header, bit by bit: the source bit (within one group of
    plain rows) of every bit of the interleaved form. The plain rows are the base type's, rewritten by `recode`
    when there is one, or those `plain` makes (then the form has no base type to unpack to). `positive_zeros`: ik
    decodes the form as d x unsigned code - offset x d, so a zero value is always +0 where the base type's
    d x (code - offset) keeps the sign of d. `direct(x, groups)`, where given, quantizes rows x straight into the
    interleaved bytes of their groups ([rows / group, group row bytes]), with the bytes quantize-then-regroup gives."""

    def __init__(self, type_name: str, block: Callable[[int, int], np.ndarray],
                 header: Callable[[int], np.ndarray] | None = None, recode: Recode | None = None,
                 plain: PlainRows | None = None, positive_zeros: bool = False,
                 direct: Callable[[np.ndarray, np.ndarray, float], bool] | None = None,
                 decode: Callable[[np.ndarray, np.ndarray], None] | None = None) -> None:
        self.type_name = type_name
        gtype = type_by_name(type_name)
        assert gtype.base is not None
        self.base_name = gtype.base
        self.group = gtype.row_group
        self._block = block
        self._header = header
        self._recode = recode
        self._plain = plain
        self._positive_zeros = positive_zeros
        self._direct = direct
        self._decode = decode
        # a direct kernel finds values beyond max_abs_input in its own pass (it returns False on one)
        self.checks_values = direct is not None
        self._maps: dict[int, tuple[UnitMap, UnitMap, np.ndarray]] = {}

    # the base codec and its documented properties, looked up when first used (format modules register in any order)
    @property
    def base(self) -> Codec:
        return type_by_name(self.base_name).require_codec()

    @property
    def unpacks_to_base(self) -> bool:
        """Whether the form is a regrouping of base-type rows (so a file's tensors can be repacked and unpacked)."""
        return self._plain is None

    @property
    def decodes_directly(self) -> bool:
        """Whether rows are decoded straight from the interleaved layout (no regrouping pass)."""
        return self._decode is not None

    @property
    def quantizes_directly(self) -> bool:
        """Whether rows are quantized straight into the interleaved layout (no regrouping pass)."""
        return self._direct is not None

    can_quantize = _from_base("can_quantize")  # type: ignore[assignment]
    uses_imatrix = _from_base("uses_imatrix")  # type: ignore[assignment]
    max_abs_input = _from_base("max_abs_input")  # type: ignore[assignment]
    rel_error_bound = _from_base("rel_error_bound")  # type: ignore[assignment]
    abs_error_floor = _from_base("abs_error_floor")  # type: ignore[assignment]
    rows_interact = _from_base("rows_interact")  # type: ignore[assignment]

    def _maps_for(self, row_bytes: int) -> tuple[UnitMap, UnitMap, np.ndarray]:
        """For rows of `row_bytes`: the map of one block column (a unit: the group's rows' blocks at that column, row
        after row) forward and back, and the header's source bits. Every block column moves its bits alike, which the
        maps of the first two columns confirm."""
        hit = self._maps.get(row_bytes)
        if hit is None:
            gtype = self.ggml_type
            meta, ts = gtype.row_meta_size, gtype.type_size
            first = self._block(row_bytes, 0)
            if (row_bytes - meta) // ts > 1:
                assert (self._block(row_bytes, 1) == first + 8 * ts).all(), self.type_name
            row, within = np.divmod(first, 8 * row_bytes)
            assert ((within >= 8 * meta) & (within < 8 * (meta + ts))).all(), self.type_name
            unit = row * 8 * ts + within - 8 * meta
            assert len(unit) == 8 * ts * self.group and len(np.unique(unit)) == len(unit), self.type_name
            header = np.zeros(0, np.int64) if self._header is None else self._header(row_bytes)
            assert len(header) == 8 * meta * self.group, self.type_name
            local = (header // (8 * row_bytes)) * 8 * meta + header % (8 * row_bytes)  # in the rows' heads side by side
            hit = (UnitMap.of(unit), UnitMap.of(np.argsort(unit)), local)
            self._maps[row_bytes] = hit
        return hit

    def _groups(self, n_rows: int) -> int:
        if n_rows % self.group:
            raise QuantInputError(f"{self.type_name}: {n_rows} rows are not a whole number of {self.group}-row groups")
        return n_rows // self.group

    def _interleave(self, plain: np.ndarray) -> np.ndarray:
        """Plain rows [rows, row bytes] -> the interleaved rows (the same shape): the group's header, then each block
        column's unit mapped."""
        rows, row_bytes = plain.shape
        groups, g = self._groups(rows), self.group
        forward, _, header = self._maps_for(row_bytes)
        meta, ts = self.ggml_type.row_meta_size, self.ggml_type.type_size
        grouped = np.ascontiguousarray(plain).reshape(groups, g, row_bytes)
        units = np.ascontiguousarray(grouped[:, :, meta:].reshape(groups, g, -1, ts).transpose(0, 2, 1, 3))
        out = np.empty((groups, g * row_bytes), dtype=np.uint8)
        out[:, g * meta :] = forward.apply(units.reshape(-1, g * ts)).reshape(groups, -1)
        if meta:
            heads = np.unpackbits(np.ascontiguousarray(grouped[:, :, :meta]).reshape(groups, -1), axis=1,
                                  bitorder="little")
            out[:, : g * meta] = np.packbits(heads[:, header], axis=1, bitorder="little")
        return out.reshape(rows, row_bytes)

    def _deinterleave(self, q: np.ndarray) -> np.ndarray:
        rows, row_bytes = q.shape
        groups, g = self._groups(rows), self.group
        _, backward, header = self._maps_for(row_bytes)
        meta, ts = self.ggml_type.row_meta_size, self.ggml_type.type_size
        grouped = np.ascontiguousarray(q).reshape(groups, g * row_bytes)
        units = backward.apply(np.ascontiguousarray(grouped[:, g * meta :]).reshape(-1, g * ts))
        plain = np.empty((groups, g, row_bytes), dtype=np.uint8)
        plain[:, :, meta:] = units.reshape(groups, -1, g, ts).transpose(0, 2, 1, 3).reshape(groups, g, -1)
        if meta:
            bits = np.empty((groups, 8 * g * meta), dtype=np.uint8)
            bits[:, header] = np.unpackbits(grouped[:, : g * meta], axis=1, bitorder="little")
            plain[:, :, :meta] = np.packbits(bits, axis=1, bitorder="little").reshape(groups, g, meta)
        return plain.reshape(rows, row_bytes)

    def pack(self, rows: np.ndarray) -> np.ndarray:
        """Base-type rows [rows, base row bytes] -> this type's rows, values unchanged (`ikquant --repack`)."""
        assert self.unpacks_to_base, self.type_name
        return self._interleave(self._recode.forward(rows) if self._recode is not None else rows)

    def unpack(self, q: np.ndarray) -> np.ndarray:
        """This type's rows -> the base type's rows they regroup (`ikquant --unpack`)."""
        assert self.unpacks_to_base, self.type_name
        plain = self._deinterleave(q)
        return self._recode.inverse(plain) if self._recode is not None else plain

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        self._quantize_checked(x, w, out)

    def _quantize_checked(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> bool:
        groups = self._groups(x.shape[0])
        if self._direct is not None:
            return bool(self._direct(x, out.reshape(groups, -1), self.max_abs_input))
        self.quantize_then_regroup(x, w, out)
        return True

    def quantize_then_regroup(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        """The plain rows quantized, then regrouped (what a direct quantizer must equal byte for byte)."""
        self._groups(x.shape[0])
        if self._plain is not None:
            plain = np.empty_like(out)
            self._plain._quantize(x, w, plain)
            out[:] = self._interleave(plain)
            return
        rows = np.empty((x.shape[0], self.base.ggml_type.row_bytes(x.shape[1])), dtype=np.uint8)
        self.base._quantize(x, w, rows)
        out[:] = self.pack(rows)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        if self._decode is not None:
            self._decode(q.reshape(self._groups(q.shape[0]), -1), out)
        else:
            self.regroup_then_decode(q, out)

    def regroup_then_decode(self, q: np.ndarray, out: np.ndarray) -> None:
        """The rows regrouped into the plain form, then decoded (what a direct decoder must equal value for value)."""
        if self._plain is not None:
            self._plain._dequantize(read_only(self._deinterleave(q)), out)
        else:
            self.base._dequantize(read_only(self.unpack(q)), out)
        if self._positive_zeros:
            out[out == 0] = 0.0


#: units one pass of the regrouping kernel holds transposed (their bytes side by side: one vector per unit byte)
LANES = 64
COPY, NIBBLES, BITS = 0, 1, 2


@dataclass(frozen=True)
class UnitMap:
    """Where each byte of a unit comes from, by kind: COPY (a whole source byte `a`), NIBBLES (low nibble = source
    nibble `a`, high = `b`; nibble n is byte n // 2, high half when odd) or BITS (bit j = source bit bits[8 o + j])."""

    kind: np.ndarray
    a: np.ndarray
    b: np.ndarray
    bits: np.ndarray

    @classmethod
    def of(cls, bits: np.ndarray) -> UnitMap:
        runs = bits.reshape(-1, 8)
        whole = (runs[:, 0] % 8 == 0) & (runs == runs[:, :1] + np.arange(8)).all(axis=1)
        halves = runs.reshape(-1, 2, 4)
        nibbles = ((halves[:, :, 0] % 4 == 0) & (halves == halves[:, :, :1] + np.arange(4)).all(axis=2)).all(axis=1)
        kind = np.where(whole, COPY, np.where(nibbles, NIBBLES, BITS)).astype(np.int64)
        a = np.where(whole, runs[:, 0] // 8, halves[:, 0, 0] // 4).astype(np.int64)
        return cls(kind, a, (halves[:, 1, 0] // 4).astype(np.int64), bits.astype(np.int64))

    def apply(self, units: np.ndarray) -> np.ndarray:
        """units [n, unit bytes] -> the mapped units."""
        if (self.kind == COPY).all():  # a byte permutation (the 8-bit forms): a plain gather is faster
            return np.ascontiguousarray(np.take(units, self.a, axis=1))
        out = np.empty_like(units)
        if units.size:
            _map_units(read_only(units), self.kind, self.a, self.b, self.bits, out)
        return out


@njit(cache=True, nogil=True, parallel=True)
def _map_units(src: np.ndarray, kind: np.ndarray, a: np.ndarray, b: np.ndarray, bits: np.ndarray,
               out: np.ndarray) -> None:
    """out[u] = src[u] mapped (UnitMap), LANES units at a time transposed so that each unit byte is one vector."""
    n_units, ub = src.shape
    for t in prange((n_units + LANES - 1) // LANES):
        u0 = t * LANES
        m = min(n_units, u0 + LANES) - u0
        tile = np.zeros((ub, LANES), np.uint8)
        for u in range(m):
            for q in range(ub):
                tile[q, u] = src[u0 + u, q]
        res = np.empty((ub, LANES), np.uint8)
        for o in range(ub):
            r = res[o]
            if kind[o] == COPY:
                s = tile[a[o]]
                for lane in range(LANES):
                    r[lane] = s[lane]
            elif kind[o] == NIBBLES:
                s0, s1 = tile[a[o] >> 1], tile[b[o] >> 1]
                h0, h1 = np.uint8(4 * (a[o] & 1)), np.uint8(4 * (b[o] & 1))
                for lane in range(LANES):
                    r[lane] = ((s0[lane] >> h0) & np.uint8(15)) | (((s1[lane] >> h1) & np.uint8(15)) << np.uint8(4))
            else:
                r[:] = 0
                for j in range(8):
                    s = tile[bits[8 * o + j] >> 3]
                    mask = np.uint8(1) << np.uint8(bits[8 * o + j] & 7)
                    bit = np.uint8(1 << j)
                    for lane in range(LANES):
                        r[lane] |= bit if s[lane] & mask else np.uint8(0)
        for u in range(m):
            for o in range(ub):
                out[u0 + u, o] = res[o, u]


def _nibble_map(block):  # type: ignore[no-untyped-def]
    """A nibble map as a bit map."""
    return lambda row_bytes, ib: _bits_of_nibbles(block(row_bytes, ib))


@njit(cache=True, nogil=True, parallel=True)
def _quantize_q8_k_rows(x: np.ndarray, offset: int, out: np.ndarray) -> None:
    """ik's 8-bit activation blocks (its AVX2 quantize_row_q8_K32): per 256 values d = max|x| / 127 (stored f16) and
    codes rint(x 127 / max|x|), saturated to int8, plus `offset` (128: stored unsigned). A product beyond int32 (the
    reciprocal overflows when max|x| < 127/FLT_MAX) converts to INT_MIN as x86's does: code -128."""
    for r in prange(x.shape[0]):
        for b in range(x.shape[1] // 256):
            amax = np.float32(0.0)
            for j in range(256):
                amax = max(amax, abs(x[r, 256 * b + j]))
            store_f16(out[r], 258 * b, amax / np.float32(127.0))
            inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            for j in range(256):
                p = inv * x[r, 256 * b + j]
                v = min(127, max(-128, int(np.rint(p)) if abs(p) < np.float32(2147483648.0) else -2147483648))
                out[r, 258 * b + 2 + j] = (v + offset) & 255


@njit(cache=True, nogil=True, parallel=True)
def _dequantize_q8_k_rows(q: np.ndarray, offset: int, out: np.ndarray) -> None:
    """d x code; with an offset as ik's Q8_K_R16 decoding computes it: d x stored byte - 128 d (one rounding: ik's
    build fuses the multiply-add)."""
    for r in prange(q.shape[0]):
        for b in range(out.shape[1] // 256):
            d = load_f16(q[r], 258 * b)
            m = np.float32(-offset) * d
            for j in range(256):
                c = q[r, 258 * b + 2 + j]
                if offset:
                    out[r, 256 * b + j] = fmaf(d, np.float32(c), m)
                else:
                    out[r, 256 * b + j] = d * np.float32(np.int8(c))


class Q8KRows:
    """Rows of ik's 8-bit activation blocks (f16 d, 256 codes), which Q8_K_R8 and Q8_K_R16 regroup."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_q8_k_rows(x, self.offset, out)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_q8_k_rows(q, self.offset, out)


def bf16_r16_block(row_bytes: int, ib: int) -> np.ndarray:
    """BF16_R16: per pair of values 64 bytes, the 16 rows' pairs (4 bytes each) row after row."""
    return np.array(_bytes([k * row_bytes + 4 * ib + b for k in range(16) for b in range(4)]), dtype=np.int64)


class Bf16R16Codec(InterleavedCodec):
    """BF16_R16 regroups BF16 rows, but ik writes it from float32 by dropping each value's low 16 bits (BF16 rounds
    to nearest even): a regrouping of those truncated rows."""

    #: truncation errs up to one unit in the last place (rounding: half of it), subnormals included
    rel_error_bound = 2.0**-7
    abs_error_floor = 2.0**-133

    def __init__(self) -> None:
        super().__init__("BF16_R16", bf16_r16_block)

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        self._groups(x.shape[0])
        bits = (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        out[:] = self.pack(bits.view(np.uint8))


for _codec in (
        InterleavedCodec("Q8_0_R8", _nibble_map(q8_0_r8_block), decode=dequantize_q8_0_r8),
        InterleavedCodec("Q4_0_R8", _nibble_map(q4_0_r8_block), decode=dequantize_q4_0_r8),
        InterleavedCodec("IQ4_NL_R4", _nibble_map(iq4_nl_r4_block)),
        InterleavedCodec("MXFP4_R8", _nibble_map(mxfp4_r8_block)),
        InterleavedCodec("IQ2_K_R4", iq2_k_r4_block), InterleavedCodec("IQ3_K_R4", iq3_k_r4_block),
        InterleavedCodec("IQ4_K_R4", iq4_k_r4_block), InterleavedCodec("IQ5_K_R4", iq5_k_r4_block),
        InterleavedCodec("IQ4_KS_R4", iq4_ks_r4_block, row_scales_r4),
        InterleavedCodec("IQ5_KS_R4", iq5_ks_r4_block, row_scales_r4), InterleavedCodec("Q4_K_R4", q4_k_r4_block),
        InterleavedCodec("Q6_K_R4", q6_k_r4_block), InterleavedCodec("IQ4_XS_R8", iq4_xs_r8_block),
        InterleavedCodec("Q2_K_R4", q2_k_r4_block), InterleavedCodec("Q3_K_R4", q3_k_r4_block),
        InterleavedCodec("Q5_K_R4", q5_k_r4_block), InterleavedCodec("IQ2_S_R4", iq2_s_r4_block),
        InterleavedCodec("IQ3_S_R4", iq3_s_r4_block),
        InterleavedCodec("IQ2_XXS_R4", iq2_xxs_r4_block, recode=IQ2_XXS_RECODE),
        InterleavedCodec("IQ2_XS_R4", iq2_xs_r4_block, recode=IQ2_XS_RECODE),
        InterleavedCodec("IQ3_XXS_R4", iq3_xxs_r4_block, recode=IQ3_XXS_RECODE),
        InterleavedCodec("Q5_0_R4", q5_0_r4_block, positive_zeros=True),
        InterleavedCodec("Q6_0_R4", q6_0_r4_block, positive_zeros=True),
        InterleavedCodec("Q8_KV_R8", q8_kv_r8_block, q8_kv_r8_header, recode=Q8_KV_RECODE, direct=quantize_q8_kv_r8,
                         decode=dequantize_q8_kv_r8),
        InterleavedCodec("Q8_K_R8", _q8_k_rows_block(8), plain=Q8KRows(0),
                         direct=lambda x, groups, limit: quantize_q8_k_interleaved(x, 8, 0, limit, groups),
                         decode=lambda groups, out: dequantize_q8_k_interleaved(groups, 8, 0, out)),
        InterleavedCodec("Q8_K_R16", _q8_k_rows_block(16), plain=Q8KRows(128),
                         direct=lambda x, groups, limit: quantize_q8_k_interleaved(x, 16, 128, limit, groups),
                         decode=lambda groups, out: dequantize_q8_k_interleaved(groups, 16, 128, out)),
        Bf16R16Codec()):
    register_codec(_codec)
