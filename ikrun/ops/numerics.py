"""ik's arithmetic for `--numerics ik`: the activation rounding of its CPU backend before a matmul.

ik multiplies a quantized (or bf16) weight with activation rows it first converts to the format the weight type
pairs with (ggml's vec_dot_type on an AVX2/AVX-512 build), then sums integer (or bf16) products and scales them. The
rounding of the activations is what moves ik's KL-divergence above the weights-alone figure. It is emulated
exactly: the activations are rounded to that format and widened back (every value is representable in float32),
then multiplied in float32 with the exactly decoded weights, so the result differs from ik's integer sums only in
the float32 order of the per-block scalings.

The formats:

- `Q8_2_X4` (Q8_0, Q4_0, Q5_0, Q6_0, IQ4_NL, MXFP4 and their row-interleaved forms): blocks of 32; the scale
  d = max|x| / 127 rounded to bf16 (nearest even), then q = round-half-even(x * (1/d)) saturated to int8 and
  x' = q * d. ik converts these weights at 32 rows and more to Q8_0_R8, whose integers and f16 scales are the
  weights' own, so nothing else rounds.
- `BF16` (bf16 weights on a build with AVX512-BF16): activations rounded to bf16 (nearest even).
- F32 and F16 weights take the float32 activations unrounded (ik's float kernels).

Types whose ik kernels also re-quantize the weights (K-quants, IQK types, i-quants and trellis types are converted
to Q8_1, Q8_K_R8/R16 or Q8_0_R8 with new scales at 16-64 rows) are not emulated: `activation_format` names them
so a run refuses them before any compute instead of printing a number ik would not print.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import f32_bits, f32_from_bits
from ikrun.ops.parallel import pick

Q8_2_X4 = "Q8_2_X4"
BF16 = "BF16"
UNROUNDED = "F32"
#: weight type -> the activation format ik's CPU backend pairs with it (types not listed are not emulated)
ACTIVATION_FORMAT = {
    "F32": UNROUNDED, "F16": UNROUNDED, "BF16": BF16,
    **{t: Q8_2_X4 for t in ("Q8_0", "Q4_0", "Q5_0", "Q6_0", "IQ4_NL", "MXFP4", "Q8_0_R8", "Q4_0_R8", "IQ4_NL_R4",
                            "MXFP4_R8")},
}
BLOCK = 32  # values per Q8_2_X4 block
#: the formats as the Numba kernels take them (round_row)
FMT_NONE, FMT_Q8_2_X4, FMT_BF16 = 0, 1, 2
FORMAT_CODES = {UNROUNDED: FMT_NONE, Q8_2_X4: FMT_Q8_2_X4, BF16: FMT_BF16}


class NumericsError(ValueError):
    """A weight type whose ik arithmetic the runtime does not reproduce."""


def activation_format(type_name: str) -> str:
    """The activation format of a weight type under --numerics ik."""
    try:
        return ACTIVATION_FORMAT[type_name]
    except KeyError:
        raise NumericsError(type_name) from None


@njit(cache=True, nogil=True, inline="always")
def _bf16(x: np.float32) -> np.float32:
    """float32 -> nearest-even bf16, widened back (finite values)."""
    u = f32_bits(x)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return f32_from_bits(u)


@njit(cache=True, nogil=True, inline="always")
def _q8_2_row(x: np.ndarray, out: np.ndarray) -> None:
    for b0 in range(0, x.shape[0], BLOCK):
        amax = np.float32(0.0)
        for j in range(b0, b0 + BLOCK):
            amax = max(amax, abs(x[j]))
        d = _bf16(amax / np.float32(127.0))
        inv = np.float32(1.0) / d if d > np.float32(0.0) else np.float32(0.0)
        for j in range(b0, b0 + BLOCK):
            q = min(np.float32(127.0), max(np.float32(-128.0), np.float32(np.rint(x[j] * inv))))
            out[j] = q * d


@njit(cache=True, nogil=True, inline="always")
def round_row(x: np.ndarray, fmt: int, out: np.ndarray) -> None:
    """One row rounded to format code `fmt` (FMT_Q8_2_X4 or FMT_BF16) into out, for kernels that round as they go."""
    if fmt == FMT_Q8_2_X4:
        _q8_2_row(x, out)
    else:
        for j in range(x.shape[0]):
            out[j] = _bf16(x[j])


@njit(cache=True, nogil=True)
def _q8_2_serial(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        _q8_2_row(x[i], out[i])


@njit(cache=True, nogil=True, parallel=True)
def _q8_2_parallel(x: np.ndarray, out: np.ndarray) -> None:
    for i in prange(x.shape[0]):
        _q8_2_row(x[i], out[i])


@njit(cache=True, nogil=True)
def _bf16_serial(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[i, j] = _bf16(x[i, j])


@njit(cache=True, nogil=True, parallel=True)
def _bf16_parallel(x: np.ndarray, out: np.ndarray) -> None:
    for i in prange(x.shape[0]):
        for j in range(x.shape[1]):
            out[i, j] = _bf16(x[i, j])


def round_activations(x: np.ndarray, fmt: str) -> np.ndarray:
    """x (any leading shape, the dot-product axis last) as ik feeds it to a weight of activation format `fmt`."""
    if fmt == UNROUNDED:
        return x
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat = x.reshape(-1, x.shape[-1])
    out = np.empty_like(flat)
    if fmt == Q8_2_X4:
        if flat.shape[1] % BLOCK:
            raise NumericsError(f"rows of {flat.shape[1]} values are not whole {BLOCK}-value Q8_2_X4 blocks")
        pick(_q8_2_serial, _q8_2_parallel, flat.size)(flat, out)
    elif fmt == BF16:
        pick(_bf16_serial, _bf16_parallel, flat.size)(flat, out)
    else:
        raise ValueError(f"unknown activation format {fmt!r}")
    return out.reshape(x.shape)
