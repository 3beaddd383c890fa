"""ik's row-interleaved types (`_R4`, `_R8`): groups of rows stored together so that its matrix kernels read several
rows at once. Each is a regrouping of its base type's bytes, not another quantizer: quantizing means quantizing the
rows with the base codec and regrouping each group; decoding undoes the regrouping. A codec here is the base codec
plus, per block column of one group, where each interleaved byte comes from (ik's repack_* functions, as facts).
"""

from __future__ import annotations

import numpy as np

from ikquant.formats.base import Codec, QuantInputError
from ikquant.types import register_codec, type_by_name


def q8_0_r8_block(row_bytes: int, ib: int) -> np.ndarray:
    """Source byte (within 8 consecutive Q8_0 rows, row k at k*row_bytes) of every byte of interleaved block ib:
    the 8 rows' f16 scales, then their codes 4 at a time: values 0..15 of all rows, then values 16..31."""
    src = [k * row_bytes + ib * 34 + b for k in range(8) for b in (0, 1)]
    for half in (0, 16):
        for lane in range(4):
            src += [k * row_bytes + ib * 34 + 2 + half + 4 * lane + i for k in range(8) for i in range(4)]
    return np.array(src, dtype=np.int64)


class InterleavedCodec(Codec):
    """A base codec's rows regrouped `group` at a time; `block(row_bytes, ib)` maps one block column."""

    def __init__(self, type_name: str, block_bytes: int, block) -> None:  # type: ignore[no-untyped-def]
        self.type_name = type_name
        gtype = type_by_name(type_name)
        assert gtype.base is not None
        self.base_name = gtype.base
        self.group = gtype.row_group
        self.block_bytes = block_bytes  # bytes of one interleaved block (one block column of a group)
        self._block = block
        self._perm: dict[int, np.ndarray] = {}

    # the base codec and its documented properties, looked up when first used (format modules register in any order)
    @property
    def base(self) -> Codec:
        return type_by_name(self.base_name).require_codec()

    @property
    def uses_imatrix(self) -> bool:  # type: ignore[override]
        return self.base.uses_imatrix

    @property
    def max_abs_input(self) -> float:  # type: ignore[override]
        return self.base.max_abs_input

    @property
    def rel_error_bound(self) -> float:  # type: ignore[override]
        return self.base.rel_error_bound

    @property
    def abs_error_floor(self) -> float:  # type: ignore[override]
        return self.base.abs_error_floor

    @property
    def rows_interact(self) -> bool:  # type: ignore[override]
        return self.base.rows_interact

    def _perm_for(self, row_bytes: int) -> np.ndarray:
        """Source index (within one group of base rows) of every byte of the group's interleaved form."""
        perm = self._perm.get(row_bytes)
        if perm is None:
            n_blocks = self.group * row_bytes // self.block_bytes
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
        perm = self._perm_for(out.shape[1])
        out.reshape(groups, -1)[:] = plain.reshape(groups, -1)[:, perm]

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        groups = self._groups(q.shape[0])
        perm = self._perm_for(q.shape[1])
        plain = np.empty_like(q).reshape(groups, -1)
        plain[:, perm] = q.reshape(groups, -1)
        self.base._dequantize(plain.reshape(q.shape), out)


register_codec("Q8_0_R8", InterleavedCodec("Q8_0_R8", 8 * 34, q8_0_r8_block))
