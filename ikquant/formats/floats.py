"""Plain float storage: F32, F16 and BF16 (no blocks, no importance weights)."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.base import Codec
from ikquant.formats.jit import read_only
from ikquant.formats.numeric import f32_bits, f32_to_f16_bits, widen_16


@njit(cache=True, nogil=True, parallel=True)
def _to_f16(x: np.ndarray, out: np.ndarray, limit: float) -> bool:
    """out = the f16 bits of x; False when some |x| is beyond `limit` or not finite (tested in the same vectorised
    pass: NaN fails every comparison)."""
    lim = np.float32(limit)
    bad = np.zeros(x.shape[0], np.bool_)
    for r in prange(x.shape[0]):
        b = False
        for c in range(x.shape[1]):
            v = x[r, c]
            b |= not (abs(v) <= lim)
            out[r, c] = f32_to_f16_bits(v)
        bad[r] = b
    return not bad.any()


@njit(cache=True, nogil=True, parallel=True)
def _to_bf16(x: np.ndarray, out: np.ndarray, limit: float) -> bool:
    """ggml's fp32 -> bf16: round to nearest even; NaN becomes a quiet NaN with the same sign. False as _to_f16."""
    lim = np.float32(limit)
    bad = np.zeros(x.shape[0], np.bool_)
    for r in prange(x.shape[0]):
        b = False
        for c in range(x.shape[1]):
            v = x[r, c]
            b |= not (abs(v) <= lim)
            u = f32_bits(v)
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                out[r, c] = np.uint16((u >> np.uint32(16)) | np.uint32(64))
            else:
                out[r, c] = np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))))
                                      >> np.uint32(16))
        bad[r] = b
    return not bad.any()


@njit(cache=True, nogil=True, parallel=True)
def _widen_rows(bits: np.ndarray, out: np.ndarray) -> None:
    """out = the f16 (uint16) or bf16 (int16) values `bits`, exactly: a vectorised widening, rows in parallel."""
    for r in prange(out.shape[0]):
        for j in range(out.shape[1]):
            out[r, j] = widen_16(bits[r, j])


def widen_bits(bits: np.ndarray) -> np.ndarray:
    """float32 values of f16 (uint16) or bf16 (int16) bit patterns, any shape, exactly."""
    out = np.empty(bits.shape, np.float32)
    _widen_rows(read_only(np.ascontiguousarray(bits).reshape(-1, bits.shape[-1])), out.reshape(-1, bits.shape[-1]))
    return out


class F32Codec(Codec, type_name="F32"):
    uses_imatrix = False
    rel_error_bound = 0.0

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        out.view(np.float32)[...] = x

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        out[...] = q.view(np.float32)


class F16Codec(Codec, type_name="F16"):
    uses_imatrix = False
    checks_values = True
    max_abs_input = 65504.0
    rel_error_bound = 2.0**-11
    abs_error_floor = 2.0**-25

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        self._quantize_checked(x, w, out)

    def _quantize_checked(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> bool:
        return bool(_to_f16(x, out.view(np.uint16), self.max_abs_input))

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _widen_rows(q.view(np.uint16), out)


class BF16Codec(Codec, type_name="BF16"):
    uses_imatrix = False
    # values that would round up past the largest finite bf16 become inf
    max_abs_input = 3.3895313892515355e38
    rel_error_bound = 2.0**-8
    abs_error_floor = 2.0**-134
    checks_values = True

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        self._quantize_checked(x, w, out)

    def _quantize_checked(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> bool:
        return bool(_to_bf16(x, out.view(np.uint16), self.max_abs_input))

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _widen_rows(q.view(np.int16), out)

