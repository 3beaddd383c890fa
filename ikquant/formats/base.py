"""The codec contract every quant type implements, and the checks every codec shares.

A codec turns float32 rows into the type's bytes and back. Rows are the unit because ik quantizes and
dequantizes row by row (row-scaled types carry a per-row header), so every kernel takes a 2-D array of rows and
is free to parallelise over them.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from numba import njit, prange

from ikquant.errors import QuantInputError
from ikquant.formats.jit import read_only
from ikquant.types import GGMLType, register_codec, type_by_name


@njit(cache=True, nogil=True, parallel=True)
def _bad_columns(x: np.ndarray, limit: float, out: np.ndarray) -> None:
    """out[r] = first column of row r whose value is NaN/Inf or beyond `limit` in magnitude, else -1. A row is first
    tested without branching (one vectorised pass: NaN fails every comparison, and the limit is at most FLT_MAX so
    that infinities exceed it), and searched only when it holds such a value."""
    lim = np.float32(min(limit, 3.4028234663852886e38))
    for r in prange(x.shape[0]):
        out[r] = -1
        bad = False
        for c in range(x.shape[1]):
            bad |= not (abs(x[r, c]) <= lim)
        if bad:
            for c in range(x.shape[1]):
                if not (abs(x[r, c]) <= lim):
                    out[r] = c
                    break


def find_bad_value(x: np.ndarray, limit: float = np.inf) -> tuple[int, int] | None:
    """(row, column) of the first value in rows `x` that is non-finite or larger than `limit`, in one pass."""
    cols = np.empty(x.shape[0], dtype=np.int64)
    _bad_columns(x, float(limit), cols)
    rows = np.flatnonzero(cols >= 0)
    return (int(rows[0]), int(cols[rows[0]])) if rows.size else None


class Codec:
    """Base class: validation and array plumbing; subclasses supply `_quantize` and `_dequantize`.

    A subclass that names its type, `class Q4_0Codec(Codec, type_name="Q4_0")`, registers an instance as that
    type's codec when it is defined, so a new type's codec is written in one place; bases shared by several types
    name none. Codecs built per type by a factory (InterleavedCodec) are registered with `register_codec`."""

    type_name: str = ""
    #: False for a type iktools decodes but cannot encode yet (the plan check refuses to write it)
    can_quantize: bool = True
    #: whether importance weights change the result (ik ignores them for Q8_0, MXFP4, F16, BF16)
    uses_imatrix: bool = True
    #: ik refuses to quantize the type without importance weights (its ggml_quantize_requires_imatrix)
    requires_imatrix: bool = False
    #: largest |x| the type can represent (beyond it the stored scale overflows); larger inputs are refused
    max_abs_input: float = float(np.finfo(np.float32).max)
    #: documented accuracy: |x - dequantize(quantize(x))| <= rel_error_bound * max|x| over the value's block
    #: (the block_size group it belongs to), plus abs_error_floor for values near the type's smallest scale
    rel_error_bound: float = 0.0
    abs_error_floor: float = 0.0
    #: True when (without importance weights) the bytes of a row depend on the other rows of the same call, so
    #: callers must batch rows as ik does to reproduce its output
    rows_interact: bool = False
    #: the quantizing kernel itself finds a value that is non-finite or beyond max_abs_input, in the pass over the
    #: values it makes anyway (`_quantize_checked`); other codecs' input is searched in a pass of its own first
    checks_values: bool = False
    #: byte offset, in each block, of the f16 scale every decoded value of the block is a finite multiple of (its
    #: other fields are integers): a decoding holds a non-finite value exactly when one of these does, so the check
    #: after an importance-weighted quantization reads them instead of decoding the rows
    block_scale_f16: int | None = None

    def __init_subclass__(cls, type_name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if type_name is not None:
            cls.type_name = type_name
            register_codec(cls())

    @property
    def ggml_type(self) -> GGMLType:
        return type_by_name(self.type_name)

    def quantize(self, x: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        """Quantize rows `x` [n_rows, n_per_row] into [n_rows, row_bytes] uint8, optionally importance-weighted."""
        x = self._check_shape(x)
        if not self.checks_values:
            self.refuse_bad_values(x)
        n_rows, n_per_row = x.shape
        w = self._check_imatrix(imatrix, n_per_row)
        out = np.empty((n_rows, self.ggml_type.row_bytes(n_per_row)), dtype=np.uint8)
        if n_rows:
            if not self._quantize_checked(x, w, out):
                self.refuse_bad_values(x)
                raise AssertionError(f"{self.type_name}: the kernel met a bad value that the search did not find")
            if w.size:
                self._repair_degenerate_rows(x, out)
        return out

    def _repair_degenerate_rows(self, x: np.ndarray, out: np.ndarray) -> None:
        """Importance weights that vanish over a whole block make some of ik's searches divide 0 by 0 and store
        NaN scales (ik writes them as they are). Such rows are quantized again without the weights, with a warning,
        so that no NaN ever reaches a file."""
        if self.block_scale_f16 is None:
            bad = np.flatnonzero(~np.isfinite(self.dequantize(out, x.shape[1])).all(axis=1))
        else:
            bad = np.flatnonzero(self._nonfinite_block_scales(out).any(axis=1))
        if bad.size:
            warnings.warn(f"{self.type_name}: the importance weights gave NaN scales in {bad.size} row(s) (first: "
                          f"row {bad[0]}); those rows were quantized without importance weights", stacklevel=3)
            fixed = np.empty((bad.size, out.shape[1]), dtype=np.uint8)
            self._quantize(np.ascontiguousarray(x[bad]), np.empty(0, dtype=np.float32), fixed)
            out[bad] = fixed

    def _nonfinite_block_scales(self, out: np.ndarray) -> np.ndarray:
        """[rows, blocks]: whether the block's f16 scale (at block_scale_f16) is infinite or NaN."""
        assert self.block_scale_f16 is not None
        ts, at = self.ggml_type.type_size, self.block_scale_f16
        blocks = out.reshape(out.shape[0], -1, ts)
        h = blocks[:, :, at].astype(np.uint16) | (blocks[:, :, at + 1].astype(np.uint16) << 8)
        return (h & 0x7C00) == 0x7C00

    def dequantize(self, q: np.ndarray, n_per_row: int, out: np.ndarray | None = None) -> np.ndarray:
        """Decode [n_rows, row_bytes] (or flat) bytes of rows of `n_per_row` values into float32 [n_rows, n_per_row]
        (into `out`, a C-contiguous float32 array of that shape, where given: no second copy of a large decoding)."""
        row_bytes = self.ggml_type.row_bytes(n_per_row)
        q = np.ascontiguousarray(q).view(np.uint8)
        if q.size % row_bytes:
            raise QuantInputError(
                f"{self.type_name}: {q.size} bytes is not a whole number of rows of {row_bytes} bytes"
            )
        q = q.reshape(-1, row_bytes)
        if out is None:
            out = np.empty((q.shape[0], n_per_row), dtype=np.float32)
        elif out.shape != (q.shape[0], n_per_row) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"{self.type_name}: out must be C-contiguous float32 {(q.shape[0], n_per_row)}, not "
                             f"{out.dtype} {out.shape}")
        if q.shape[0]:
            self._dequantize(read_only(q), out)
        return out

    def _check_rows(self, x: np.ndarray) -> np.ndarray:
        """Rows `x` as a contiguous float32 [n_rows, n_per_row] array, refused when malformed or holding a value the
        type cannot store."""
        x = self._check_shape(x)
        self.refuse_bad_values(x)
        return x

    def _check_shape(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim == 1:
            x = x[None, :]
        if x.ndim != 2:
            raise QuantInputError(f"{self.type_name}: expected rows as a 2-D array, got shape {x.shape}")
        block = self.ggml_type.block_size
        if x.shape[1] % block:
            raise QuantInputError(
                f"{self.type_name}: row length {x.shape[1]} is not a multiple of the block size {block}"
            )
        return np.ascontiguousarray(x, dtype=np.float32)

    def refuse_bad_values(self, x: np.ndarray) -> None:
        """Raise, naming the first, when rows `x` hold a non-finite value or one beyond max_abs_input."""
        bad = find_bad_value(x, self.max_abs_input)
        if bad is not None:
            row, col = bad
            value = x[row, col]
            if not np.isfinite(value):
                raise QuantInputError(
                    f"{self.type_name}: row {row} holds a non-finite value ({value}) at column {col}; "
                    "NaN/Inf cannot be quantized"
                )
            raise QuantInputError(
                f"{self.type_name}: row {row} holds {value:g} at column {col}, beyond the largest magnitude "
                f"the type can store ({self.max_abs_input:g})"
            )

    def _check_imatrix(self, imatrix: np.ndarray | None, n_per_row: int) -> np.ndarray:
        if imatrix is None and self.requires_imatrix:
            raise QuantInputError(f"{self.type_name} needs an importance matrix (ik refuses to quantize it without one)")
        if imatrix is None or not self.uses_imatrix:
            return np.empty(0, dtype=np.float32)
        w = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1)
        if w.size != n_per_row:
            raise QuantInputError(
                f"{self.type_name}: importance vector has {w.size} entries, the rows have {n_per_row} columns"
            )
        if not np.isfinite(w).all() or (w < 0).any():
            raise QuantInputError(f"{self.type_name}: importance weights must be finite and non-negative")
        return w

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError

    def _quantize_checked(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> bool:
        """`_quantize`, False when a codec that `checks_values` met a value it cannot store (what it wrote is then
        discarded)."""
        self._quantize(x, w, out)
        return True

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError
