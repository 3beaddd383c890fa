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

- `Q8_K` (IQ4_KS, IQ3_K, IQ2_K, IQ4_XS): blocks of 256; d = max|x| / 127 in float32 (not rounded),
  q = round-half-even(x * (127 / max|x|)) saturated to int8, x' = q * d.

For some types ik's kernels also convert the weights before multiplying, once the matmul has enough activation
rows (`IkKernel.convert_rows`; below it the native kernel multiplies the exact weights) and the weight has at
least 32 rows (a multiple of 16):

- Q4_K (32 rows) to Q8_1: per 32-value block the scale f16(d * sc) and the offset f16(-dmin * m), values kept;
- Q6_K (64 rows) to Q8_0_R8: per 32-value block p = (q - 32) * sc, re-quantized to int8 against max|p| / 127,
  scale f16(d * max|p| / 127);
- IQ4_KS, IQ3_K, IQ4_XS (32 rows) and IQ2_K (32 rows, against 120 instead of 127) to Q8_K_R16: per 256 values the
  integers p = sub-block scale x grid value, kept when max|p| < 127 (c), else re-quantized to int8 against
  max|p| / c, scale f16(d * that).
Routed experts are decided per expert, on the tokens routed to each (ik's mul_mat_id runs the same test per
expert). ik splits a dense weight's rows over its threads and falls back to the native kernels when a thread gets
fewer than 32 rows; the emulation assumes it does not (true for real models at any thread count ik runs with; for a tiny model
it means a thread count of at most rows / 32).

Types not listed (i-quants, trellis types, the rest of the IQK and K families) are not emulated: `ik_kernel` names
them so a run refuses them before any compute instead of printing a number ik would not print.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import f32_bits, f32_from_bits
from ikrun.ops.parallel import pick

Q8_2_X4 = "Q8_2_X4"
Q8_K = "Q8_K"
BF16 = "BF16"
UNROUNDED = "F32"
BLOCK = 32  # values per Q8_2_X4 block
SUPER = 256  # values per Q8_K block
#: the formats as the Numba kernels take them (round_row)
FMT_NONE, FMT_Q8_2_X4, FMT_BF16, FMT_Q8_K = 0, 1, 2, 3
FORMAT_CODES = {UNROUNDED: FMT_NONE, Q8_2_X4: FMT_Q8_2_X4, BF16: FMT_BF16, Q8_K: FMT_Q8_K}


class NumericsError(ValueError):
    """A weight type whose ik arithmetic the runtime does not reproduce."""


#: raw rows [rows, row bytes] and their exact decoding [rows, n] -> the weights ik's converted kernel multiplies
Convert = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class IkKernel:
    """How ik multiplies a weight type: the activation format, and from how many activation rows on it converts
    the weights first (0: never, or only losslessly)."""

    activation: str
    convert_rows: int = 0
    convert: Convert | None = None

    def converts(self, n_act_rows: int, n_weight_rows: int) -> bool:
        return self.convert is not None and n_act_rows >= self.convert_rows and n_weight_rows >= 32 \
            and n_weight_rows % 16 == 0


def _f16(x: np.ndarray) -> np.ndarray:
    """Round to f16 (nearest even) and widen back."""
    return x.astype(np.float16).astype(np.float32)


def _block_f16(raw: np.ndarray, block_bytes: int, offset: int = 0) -> np.ndarray:
    """The f16 field at `offset` of every block of rows `raw`, as float32 [rows, blocks]."""
    blocks = raw.reshape(raw.shape[0], -1, block_bytes)
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _q4_k_to_q8_1(raw: np.ndarray, decoded: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(raw.shape[0], -1, 144)
    d, dmin = _block_f16(raw, 144), _block_f16(raw, 144, 2)
    s = blocks[..., 4:16].astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(*blocks.shape[:2], 8, 32).astype(np.float32)
    scale = _f16(d[..., None] * sc.astype(np.float32))
    offset = _f16(-dmin[..., None] * mn.astype(np.float32))
    return (scale[..., None] * q + offset[..., None]).reshape(decoded.shape).astype(np.float32)


def _q6_k_to_q8_0(raw: np.ndarray, decoded: np.ndarray) -> np.ndarray:
    d = _block_f16(raw, 210, 208)  # [rows, nb]
    p = np.rint(np.divide(decoded.reshape(*d.shape, 8, 32), d[..., None, None],
                          out=np.zeros(d.shape + (8, 32), np.float32), where=d[..., None, None] != 0))
    mx = np.abs(p).max(axis=-1) / np.float32(127)
    inv = np.divide(np.float32(1), mx, out=np.zeros_like(mx), where=mx > np.float32(1e-9))
    q8 = np.clip(np.rint(p * inv[..., None]), -128, 127)
    return (_f16(d[..., None] * mx)[..., None] * q8).reshape(decoded.shape).astype(np.float32)


def _to_q8_k(decoded: np.ndarray, dsup: np.ndarray, c: float) -> np.ndarray:
    """ik's convert_to_q8_k_r8 on the integers p = decoded / dsup of each 256-value block (dsup [rows, nb])."""
    shape = dsup.shape + (SUPER,)
    p = np.rint(np.divide(decoded.reshape(shape), dsup[..., None], out=np.zeros(shape, np.float32),
                          where=dsup[..., None] != 0))
    dnew = np.abs(p).max(axis=-1) * np.float32(np.float32(1.0) / np.float32(c))
    small = dnew < 1
    dnew = np.where(small, np.float32(1), dnew).astype(np.float32)
    inv = np.where(np.abs(dnew) > np.float32(1e-9), np.float32(1) / dnew, np.float32(0)).astype(np.float32)
    q = np.where(small[..., None], p, np.clip(np.rint(p * inv[..., None]), -128, 127))
    return (_f16(dsup * dnew)[..., None] * q).reshape(decoded.shape).astype(np.float32)


def _iq4_ks_to_q8_k(raw: np.ndarray, decoded: np.ndarray) -> np.ndarray:
    d = raw[:, 0:4].copy().view(np.float32)[:, 0]
    return _to_q8_k(decoded, np.repeat(d[:, None], decoded.shape[1] // SUPER, axis=1), 127)


#: weight type -> how ik multiplies it (types not listed are not emulated)
IK_KERNELS: dict[str, IkKernel] = {
    "F32": IkKernel(UNROUNDED), "F16": IkKernel(UNROUNDED), "BF16": IkKernel(BF16),
    **{t: IkKernel(Q8_2_X4) for t in ("Q8_0", "Q4_0", "Q5_0", "Q6_0", "IQ4_NL", "MXFP4", "Q8_0_R8", "Q4_0_R8",
                                      "IQ4_NL_R4", "MXFP4_R8")},
    "Q4_K": IkKernel(Q8_2_X4, 32, _q4_k_to_q8_1),
    "Q6_K": IkKernel(Q8_2_X4, 64, _q6_k_to_q8_0),
    "IQ4_KS": IkKernel(Q8_K, 32, _iq4_ks_to_q8_k),
    "IQ3_K": IkKernel(Q8_K, 32, lambda raw, w: _to_q8_k(w, _block_f16(raw, 110), 127)),
    "IQ2_K": IkKernel(Q8_K, 32, lambda raw, w: _to_q8_k(w, _block_f16(raw, 76), 120)),
    "IQ4_XS": IkKernel(Q8_K, 32, lambda raw, w: _to_q8_k(w, _block_f16(raw, 136), 127)),
}


def ik_kernel(type_name: str) -> IkKernel:
    """How ik multiplies a weight type under --numerics ik."""
    try:
        return IK_KERNELS[type_name]
    except KeyError:
        raise NumericsError(type_name) from None


def activation_format(type_name: str) -> str:
    """The activation format of a weight type under --numerics ik."""
    return ik_kernel(type_name).activation


@njit(cache=True, nogil=True, inline="always")
def _bf16(x: np.float32) -> np.float32:
    """float32 -> nearest-even bf16, widened back (finite values)."""
    u = f32_bits(x)
    u = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return f32_from_bits(u)


@njit(cache=True, nogil=True, inline="always")
def _q8_row(x: np.ndarray, block: int, bf16_scale: bool, out: np.ndarray) -> None:
    """Blocks of `block` values to int8 and back: Q8_2_X4 (32, the scale rounded to bf16, q = x * (1/d)) or Q8_K
    (256, the float32 scale, q = x * (127 / max))."""
    for b0 in range(0, x.shape[0], block):
        amax = np.float32(0.0)
        for j in range(b0, b0 + block):
            amax = max(amax, abs(x[j]))
        if bf16_scale:
            d = _bf16(amax / np.float32(127.0))
            inv = np.float32(1.0) / d if d > np.float32(0.0) else np.float32(0.0)
        else:
            d = amax / np.float32(127.0)
            inv = np.float32(127.0) / amax if amax > np.float32(0.0) else np.float32(0.0)
        for j in range(b0, b0 + block):
            q = min(np.float32(127.0), max(np.float32(-128.0), np.float32(np.rint(x[j] * inv))))
            out[j] = q * d


@njit(cache=True, nogil=True, inline="always")
def round_row(x: np.ndarray, fmt: int, out: np.ndarray) -> None:
    """One row rounded to format code `fmt` (FMT_Q8_2_X4, FMT_Q8_K or FMT_BF16) into out, for kernels that round
    as they go."""
    if fmt == FMT_Q8_2_X4:
        _q8_row(x, BLOCK, True, out)
    elif fmt == FMT_Q8_K:
        _q8_row(x, SUPER, False, out)
    else:
        for j in range(x.shape[0]):
            out[j] = _bf16(x[j])


@njit(cache=True, nogil=True)
def _rows_serial(x: np.ndarray, fmt: int, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        round_row(x[i], fmt, out[i])


@njit(cache=True, nogil=True, parallel=True)
def _rows_parallel(x: np.ndarray, fmt: int, out: np.ndarray) -> None:
    for i in prange(x.shape[0]):
        round_row(x[i], fmt, out[i])


def round_activations(x: np.ndarray, fmt: str) -> np.ndarray:
    """x (any leading shape, the dot-product axis last) as ik feeds it to a weight of activation format `fmt`."""
    if fmt == UNROUNDED:
        return x
    if fmt not in FORMAT_CODES:
        raise ValueError(f"unknown activation format {fmt!r}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat = x.reshape(-1, x.shape[-1])
    block = {Q8_2_X4: BLOCK, Q8_K: SUPER}.get(fmt, 1)
    if flat.shape[1] % block:
        raise NumericsError(f"rows of {flat.shape[1]} values are not whole {block}-value {fmt} blocks")
    out = np.empty_like(flat)
    pick(_rows_serial, _rows_parallel, flat.size)(flat, FORMAT_CODES[fmt], out)
    return out.reshape(x.shape)
