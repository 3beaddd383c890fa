"""ik's row-interleaved types (`_R4`, `_R8`): groups of rows stored together so that its matrix kernels read several
rows at once. Each is a regrouping of its base type's bits, not another quantizer: quantizing means quantizing the
rows with the base codec and regrouping each group; decoding undoes the regrouping. A codec here is the base codec
plus, per block column of one group (and for row-scaled types the group's header of row scales), where each
interleaved bit comes from (ik's repack_* functions, as facts). Most regroupings move whole nibbles; the IQK ones
also spread 1- and 2-bit fields (block extras, high scale bits) over other bytes, so the maps are kept per bit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit, prange

from ikquant.formats.base import Codec, QuantInputError
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


def q4_k_r4_block(row_bytes: int, ib: int) -> np.ndarray:
    """Q4_K_R4: the 4 rows' f16 d then dmin; 16 bytes of high scale bits (field i = 4 s + k at byte i % 16, nibble
    i // 16: the scale's bits 4-5, then the min's); 32 bytes of (scale low 4 | min low 4 << 4), byte 4 s + k; then
    the codes in ik's _R4 order (value m of sub-block s: nibble s % 2 of byte 32 (s // 2) + m)."""
    rows = [k * row_bytes + 144 * ib for k in range(4)]
    out = [b for r in rows for b in _field(r, 0, 16)] + [b for r in rows for b in _field(r + 2, 0, 16)]
    sm = {4 * sub + k: _k_scale_bits(r, sub) for k, r in enumerate(rows) for sub in range(8)}
    out += [b for byte in range(16) for i in (byte, byte + 16) for b in sm[i][0][4:] + sm[i][1][4:]]
    out += [b for i in range(32) for b in sm[i][0][:4] + sm[i][1][:4]]
    for sub in range(8):
        out += _r4_low_codes(_iq5_codes(rows, 16), sub)
    return np.array(out, dtype=np.int64)


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


class InterleavedCodec(Codec):
    """A base codec's rows regrouped `group` at a time; `block(row_bytes, ib)` maps one block column and
    `header(row_bytes)` (row-scaled types) the group's header, bit by bit: the source bit (within one group of base
    rows) of every bit of the interleaved form."""

    #: groups converted at a time: the bit maps hold 8 bytes per byte
    CHUNK_BYTES = 1 << 22

    def __init__(self, type_name: str, block, header=None) -> None:  # type: ignore[no-untyped-def]
        self.type_name = type_name
        gtype = type_by_name(type_name)
        assert gtype.base is not None
        self.base_name = gtype.base
        self.group = gtype.row_group
        self._block = block
        self._header = header
        self._perm: dict[int, tuple[np.ndarray, int]] = {}
        self._inverse: dict[int, np.ndarray] = {}

    # the base codec and its documented properties, looked up when first used (format modules register in any order)
    @property
    def base(self) -> Codec:
        return type_by_name(self.base_name).require_codec()

    uses_imatrix = _from_base("uses_imatrix")  # type: ignore[assignment]
    max_abs_input = _from_base("max_abs_input")  # type: ignore[assignment]
    rel_error_bound = _from_base("rel_error_bound")  # type: ignore[assignment]
    abs_error_floor = _from_base("abs_error_floor")  # type: ignore[assignment]
    rows_interact = _from_base("rows_interact")  # type: ignore[assignment]

    def _perm_for(self, row_bytes: int) -> tuple[np.ndarray, int]:
        """Where every unit of the group's interleaved form comes from (within one group of base rows), and the
        unit in bits: 8 when the bit map moves whole bytes, 4 whole nibbles, else 1."""
        hit = self._perm.get(row_bytes)
        if hit is None:
            base = self.base.ggml_type
            n_blocks = (row_bytes - base.row_meta_size) // base.type_size  # block columns: one interleaved block each
            parts = [] if self._header is None else [self._header(row_bytes)]
            bits = np.concatenate(parts + [self._block(row_bytes, ib) for ib in range(n_blocks)])
            assert len(bits) == 8 * row_bytes * self.group and len(np.unique(bits)) == len(bits), self.type_name
            hit = (bits, 1)
            for unit in (8, 4):
                runs = bits.reshape(-1, unit)
                if (runs[:, 0] % unit == 0).all() and (runs == runs[:, :1] + np.arange(unit)).all():
                    hit = (runs[:, 0] // unit, unit)
                    break
            self._perm[row_bytes] = hit
        return hit

    def _groups(self, n_rows: int) -> int:
        if n_rows % self.group:
            raise QuantInputError(f"{self.type_name}: {n_rows} rows are not a whole number of {self.group}-row groups")
        return n_rows // self.group

    def regroup(self, src: np.ndarray, out: np.ndarray, row_bytes: int, inverse: bool) -> None:
        """out (groups, group bytes) = src's groups interleaved (or, `inverse`, de-interleaved), a chunk at a time,
        moving whole bytes or nibbles where the map allows, else bit by bit in a Numba loop."""
        perm, unit = self._perm_for(row_bytes)
        if unit == 1:
            if inverse:
                perm = self._inverse.get(row_bytes)
                if perm is None:
                    perm = self._inverse[row_bytes] = np.argsort(self._perm_for(row_bytes)[0])
            _gather_bits(src, perm, out)
            return
        split, join = _UNITS[unit]
        step = max(1, self.CHUNK_BYTES // src.shape[1])
        for g0 in range(0, src.shape[0], step):
            units = split(src[g0 : g0 + step])
            if inverse:
                moved = np.empty_like(units)
                moved[:, perm] = units
            else:
                moved = units[:, perm]
            out[g0 : g0 + step] = join(moved)

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        groups = self._groups(x.shape[0])
        plain = np.empty_like(out)
        self.base._quantize(x, w, plain)
        self.regroup(plain.reshape(groups, -1), out.reshape(groups, -1), out.shape[1], inverse=False)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        groups = self._groups(q.shape[0])
        plain = np.empty((groups, q.shape[1] * self.group), dtype=np.uint8)
        self.regroup(np.ascontiguousarray(q).reshape(groups, -1), plain, q.shape[1], inverse=True)
        self.base._dequantize(plain.reshape(q.shape), out)


def _to_nibbles(b: np.ndarray) -> np.ndarray:
    return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], -1)


def _from_nibbles(n: np.ndarray) -> np.ndarray:
    return (n[:, 0::2] | (n[:, 1::2] << 4)).astype(np.uint8)


#: unit in bits -> (bytes to units, units to bytes), rows of groups
_UNITS = {8: (lambda b: b, lambda u: u), 4: (_to_nibbles, _from_nibbles)}


@njit(cache=True, nogil=True, parallel=True)
def _gather_bits(src: np.ndarray, perm: np.ndarray, out: np.ndarray) -> None:
    """out bit i of every group row = src bit perm[i] (little-endian bits)."""
    for g in prange(src.shape[0]):
        for o in range(out.shape[1]):
            v = 0
            for j in range(8):
                b = perm[8 * o + j]
                v |= ((src[g, b >> 3] >> (b & 7)) & 1) << j
            out[g, o] = v


def _nibble_map(block):  # type: ignore[no-untyped-def]
    """A nibble map as a bit map."""
    return lambda row_bytes, ib: _bits_of_nibbles(block(row_bytes, ib))


for _name, _block, _header in (
        ("Q8_0_R8", _nibble_map(q8_0_r8_block), None), ("Q4_0_R8", _nibble_map(q4_0_r8_block), None),
        ("IQ4_NL_R4", _nibble_map(iq4_nl_r4_block), None), ("MXFP4_R8", _nibble_map(mxfp4_r8_block), None),
        ("IQ2_K_R4", iq2_k_r4_block, None), ("IQ3_K_R4", iq3_k_r4_block, None), ("IQ4_K_R4", iq4_k_r4_block, None),
        ("IQ5_K_R4", iq5_k_r4_block, None), ("IQ4_KS_R4", iq4_ks_r4_block, row_scales_r4),
        ("IQ5_KS_R4", iq5_ks_r4_block, row_scales_r4), ("Q4_K_R4", q4_k_r4_block, None),
        ("Q6_K_R4", q6_k_r4_block, None), ("IQ4_XS_R8", iq4_xs_r8_block, None)):
    register_codec(_name, InterleavedCodec(_name, _block, _header))
