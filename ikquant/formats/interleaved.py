"""ik's row-interleaved types (`_R4`, `_R8`): groups of rows stored together so that its matrix kernels read several
rows at once. Each is a regrouping of its base type's bytes, not another quantizer: quantizing means quantizing the
rows with the base codec and regrouping each group; decoding undoes the regrouping. A codec here is the base codec
plus, per block column of one group, where each interleaved byte comes from (ik's repack_* functions, as facts).
"""

from __future__ import annotations

import numpy as np

from ikquant.formats.base import Codec, QuantInputError
from ikquant.types import register_codec, type_by_name


def _nibbles(byte_src: list[int]) -> list[int]:
    """Source nibbles (low then high of each byte) for output bytes taken whole from `byte_src`."""
    return [2 * b + h for b in byte_src for h in (0, 1)]


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
    """A base codec's rows regrouped `group` at a time; `block(row_bytes, ib)` maps one block column, nibble by
    nibble (a nibble granularity covers ik's byte regroupings and its nibble reshuffles alike)."""

    def __init__(self, type_name: str, block) -> None:  # type: ignore[no-untyped-def]
        self.type_name = type_name
        gtype = type_by_name(type_name)
        assert gtype.base is not None
        self.base_name = gtype.base
        self.group = gtype.row_group
        self._block = block
        self._perm: dict[int, np.ndarray] = {}

    # the base codec and its documented properties, looked up when first used (format modules register in any order)
    @property
    def base(self) -> Codec:
        return type_by_name(self.base_name).require_codec()

    uses_imatrix = _from_base("uses_imatrix")  # type: ignore[assignment]
    max_abs_input = _from_base("max_abs_input")  # type: ignore[assignment]
    rel_error_bound = _from_base("rel_error_bound")  # type: ignore[assignment]
    abs_error_floor = _from_base("abs_error_floor")  # type: ignore[assignment]
    rows_interact = _from_base("rows_interact")  # type: ignore[assignment]

    def _perm_for(self, row_bytes: int) -> np.ndarray:
        """Source nibble (within one group of base rows) of every nibble of the group's interleaved form."""
        perm = self._perm.get(row_bytes)
        if perm is None:
            n_blocks = row_bytes // self.base.ggml_type.type_size  # block columns: one interleaved block each
            perm = np.concatenate([self._block(row_bytes, ib) for ib in range(n_blocks)])
            self._perm[row_bytes] = perm
        return perm

    def _groups(self, n_rows: int) -> int:
        if n_rows % self.group:
            raise QuantInputError(f"{self.type_name}: {n_rows} rows are not a whole number of {self.group}-row groups")
        return n_rows // self.group

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        groups = self._groups(x.shape[0])
        plain = np.empty_like(out)
        self.base._quantize(x, w, plain)
        nib = _to_nibbles(plain.reshape(groups, -1))[:, self._perm_for(out.shape[1])]
        out.reshape(groups, -1)[:] = _from_nibbles(nib)

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        groups = self._groups(q.shape[0])
        nib = np.empty((groups, 2 * q.shape[1] * self.group), dtype=np.uint8)
        nib[:, self._perm_for(q.shape[1])] = _to_nibbles(np.ascontiguousarray(q).reshape(groups, -1))
        self.base._dequantize(_from_nibbles(nib).reshape(q.shape), out)


def _to_nibbles(b: np.ndarray) -> np.ndarray:
    return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], -1)


def _from_nibbles(n: np.ndarray) -> np.ndarray:
    return (n[:, 0::2] | (n[:, 1::2] << 4)).astype(np.uint8)


for _name, _block in (("Q8_0_R8", q8_0_r8_block), ("Q4_0_R8", q4_0_r8_block), ("IQ4_NL_R4", iq4_nl_r4_block),
                      ("MXFP4_R8", mxfp4_r8_block)):
    register_codec(_name, InterleavedCodec(_name, _block))
