"""ik's arithmetic for `--numerics ik`: the activation rounding of its CPU backend before a matmul.

ik multiplies a quantized (or bf16) weight with activation rows it first converts to the format the weight type
pairs with (ggml's vec_dot_type on an AVX2/AVX-512 build), then sums integer (or bf16) products and scales them. The
rounding of the activations is what moves ik's KL-divergence above the weights-alone figure. Because every such
rounding is a step function, any other float order anywhere before it (a norm, a rope, a scale sum) flips a few
roundings and moves PPL(Q) by up to 0.1% on a small model; so --numerics ik computes ik's float order everywhere:
its gemm kernels' (ikrun/numerics/ik/qgemm.py, ORDER_R8 for Q8_0_R8, ORDER_Q8_1, ORDER_R16 for Q8_K_R16), its fused RMS norm,
its NEOX rope, its attention kernels and exponential (ikrun/ops/attention.py). On the test models (dense qwen3 for
every kernel family, DeepSeek's MLA with routed experts) the logits are ik's bit for bit. Where the weights are
held as int8 blocks (`IkKernel.integers`: the 32-value types as stored, the converted K/IQK types) the matmul is
ik's own: integer block sums scaled block by block (ikrun/numerics/ik/qgemm.py, `integer_rows` for the activations), and
so are the own kernels of IQ4_KS and IQ5_KS (ikrun/numerics/ik/iqk_native.py: their byte-pair sums saturate at 16
bits) and of Q4_K, Q5_K and Q6_K (kquant_native.py) below the conversion threshold (native.py). Elsewhere (bf16,
per-head slices of the types without such a kernel, the other types' own kernels below the conversion threshold,
the interleaved types) the activations are rounded to the format and widened back (every value is
representable in float32), then multiplied in float32 with the exactly decoded (or converted) weights, which
differs from ik's integer sums in the float32 order of the per-block scalings and, for the kernels that sum byte
pairs in 16 bits (vpmaddubsw) as IQ4_KS's does, where those sums saturate.

The formats:

- `Q8_2_X4` (Q8_0, Q4_0, Q5_0, Q6_0, IQ4_NL, MXFP4, Q4_K, Q5_K, Q6_K, the trellis types and the row-interleaved
  forms): blocks of 32; the scale
  d = max|x| / 127 rounded to bf16 (nearest even), then q = round-half-even(x * (1/d)) saturated to int8 and
  x' = q * d. ik converts these weights at 32 rows and more to Q8_0_R8, whose integers and f16 scales are the
  weights' own (only the gemm's float order changes).
- `BF16` (bf16 weights on a build with AVX512-BF16): activations rounded to bf16 (nearest even).
- F32 and F16 weights take the float32 activations unrounded (ik's float kernels).

- `Q8_K` (the IQK types, IQ4_XS and the 1- and 2-bit i-quants): blocks of 256; d = max|x| / 127 in float32 (not
  rounded), q = round-half-even(x * (127 / max|x|)) saturated to int8, x' = q * d.

For some types ik's kernels also convert the weights before multiplying, once the matmul has enough activation
rows (`IkKernel.convert_rows`; below it the native kernel multiplies the exact weights) and the weight has at
least 32 rows (a multiple of 16):

- Q4_K and Q5_K (32 rows) to Q8_1: per 32-value block the scale f16(d * sc) and the offset f16(-dmin * m), values
  kept;
- Q6_K (64 rows) to Q8_0_R8: per 32-value block p = (q - 32) * sc, re-quantized to int8 against max|p| / 127,
  scale f16(d * max|p| / 127);
- the IQK types and IQ4_XS (32 rows) to Q8_K_R16: per 256 values the integers p = sub-block scale x grid value
  (p = decoding / d, d the block's f16 scale or the row's scale), kept when max|p| < c, else re-quantized to int8
  against max|p| / c, scale f16(d * that); c = 127, but 120 for IQ2_K and 125 for IQ2_KS and IQ2_KL. IQ6_K's
  kernels take the grid value from iq6nl_values, where its decoding evaluates a cubic the table rounds (up to half
  a step apart), so its integers come from the codes, not the decoding (`_iq6_k_table_ints`).
- the 1- and 2-bit i-quants the same way, with d = the block's f16 scale / 8 (IQ1_M's f16 is spread over the top
  nibbles of its scale bytes): p = (2 s + 1) x grid level (IQ2_XXS, IQ2_XS, IQ2_S: levels 8, 25, 43, signed) or
  (2 s + 1) x (8 level +- 1) (IQ1_S, IQ1_M: levels -1, 0, 1); c = 124 for the IQ2 types (IQ2_S from 16 activation
  rows on, the others from 32) and 126 for IQ1_S and IQ1_M. IQ3_XXS against d / 4 (p = (2 s + 1) x its grid
  value, c = 124) and IQ3_S against d (c = 127), from 32 rows; Q3_K too (p = value x sub-block scale against its
  f16 d, c = 127). All take Q8_K activations, and so does Q2_K, whose block is requantized from its floats (the
  decoding) against max|v| / 127, its scale f16 of that (no integers kept).
Routed experts are decided per expert, on the tokens routed to each (ik's mul_mat_id runs the same test per
expert). ik splits a dense weight's rows over its threads and falls back to the native kernels when a thread gets
fewer than 32 rows; the emulation assumes it does not (true for real models at any thread count ik runs with; for a tiny model
it means a thread count of at most rows / 32).

The trellis types (IQ1_KT, IQ2_KT, IQ3_KT, IQ4_KT; Q8_2_X4 activations) multiply the generator's integers (-126..126) with
a block scale (d x factor) x sub-block scale, in float32 below 16 activation rows (24 for IQ4_KT) and rounded to
f16 from there on (converted to Q8_0_R8). The factor is 1.05 for IQ2_KT and 1.01 for IQ3_KT, which ik's own
dequantization does not apply (`IkKernel.rescales`): under --numerics ik those files multiply as other weights than
they decode to, and every float path (per-head slices, experts below the threshold) uses the rescaled values too.

Types not listed (Q4_1, Q5_1, the interleaved i-quants, Q8_KV, Q1_0_G128) are not
emulated: `ik_kernel` names them so
a run refuses them before any compute instead of printing a number ik would not print.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from numba import get_num_threads, njit, prange

from ikquant.formats.iqk_grids import IQ4K_VALUES, IQ6NL_VALUES
from ikquant.formats.jit import read_only
from ikquant.formats.numeric import f32_bits, f32_from_bits, load_f16, round_f16
from ikrun.errors import NumericsError
from ikrun.numerics.ik.q8k_direct import (
    f16_fields_finite,
    iq2_k_packed,
    iq2_ks_packed,
    iq3_k_packed,
    iq3_ks_packed,
    iq4_k_packed,
    iq4_ks_packed,
    iq5_ks_packed,
    mxfp4_packed,
    q8_0_packed,
    requantize_q8_k,
)
from ikrun.numerics.ik.qgemm import (
    ORDER_Q8_1,
    ORDER_QX_0_NATIVE,
    ORDER_R8,
    ORDER_R16,
    TILE,
    BlockInts,
    IntRows,
    PackedInts,
    pack,
)
from ikrun.ops.f16 import f16_rounded
from ikrun.ops.parallel import claim_items, run_claimed, task_items
from ikrun.ops.simd import absmax

Q8_2_X4 = "Q8_2_X4"
Q8_K = "Q8_K"
BF16 = "BF16"
UNROUNDED = "F32"
BLOCK = 32  # values per Q8_2_X4 block
SUPER = 256  # values per Q8_K block
#: the formats as the Numba kernels take them (_round_row)
FMT_NONE, FMT_Q8_2_X4, FMT_BF16, FMT_Q8_K = 0, 1, 2, 3
FORMAT_CODES = {UNROUNDED: FMT_NONE, Q8_2_X4: FMT_Q8_2_X4, BF16: FMT_BF16, Q8_K: FMT_Q8_K}


#: raw rows [rows, row bytes] and their exact decoding [rows, n] -> the integers ik's kernel multiplies
ToInts = Callable[[np.ndarray, np.ndarray], BlockInts]


@dataclass(frozen=True)
class IkKernel:
    """How ik multiplies a weight type: the activation format; the weights' own integers where ik's integer kernel
    multiplies them as stored (`ints`); and from how many activation rows on it converts the weights first
    (`convert`, to other integers)."""

    activation: str
    convert_rows: int = 0
    convert: ToInts | None = None
    ints: ToInts | None = None
    #: the stored integers multiply as other values than the file decodes to (the trellis types' factor)
    rescales: bool = False
    #: the values ik's native kernel multiplies where they are neither the decoding nor `ints` (IQ6_K's table)
    native: ToInts | None = None
    #: `convert` packed for qmatmul straight from the raw rows (q8k_direct.py); None where it declines the rows
    convert_packed: Callable[[np.ndarray], PackedInts | None] | None = None
    #: `ints` packed for qmatmul straight from the raw rows
    ints_packed: Callable[[np.ndarray], PackedInts | None] | None = None

    def converts(self, n_act_rows: int, n_weight_rows: int, threads: int | None = None, row_group: int = 16) -> bool:
        """Whether ik converts the weights of a matmul with `n_act_rows` activation rows and `n_weight_rows` weight
        rows (a multiple of `row_group`, the rows its converted form interleaves: 16 in the AVX-512 build, 8 in the
        AVX2 one): from `convert_rows` activation rows on. `threads`: the ik threads that share a plain matmul's
        rows, which takes the type's own kernel when they get fewer than 32 rows each; None for ik's MoE and fused
        up-gate ops, which choose by the activation rows alone."""
        rows_ok = n_weight_rows % row_group == 0 and (threads is None or n_weight_rows // threads >= 32)
        return self.convert is not None and n_act_rows >= self.convert_rows and rows_ok

    def integers(self, n_act_rows: int, n_weight_rows: int, threads: int | None = None,
                 row_group: int = 16) -> ToInts | None:
        """The integers of such a matmul, None where ik multiplies floats or the stored weights of a type not held
        as integers here."""
        return self.convert if self.converts(n_act_rows, n_weight_rows, threads, row_group) else self.ints

    def packed(self, n_act_rows: int, n_weight_rows: int, threads: int | None = None,
               row_group: int = 16) -> Callable[[np.ndarray], PackedInts | None] | None:
        """`convert_packed` where such a matmul converts the weights (`converts`), else `ints_packed`."""
        converts = self.converts(n_act_rows, n_weight_rows, threads, row_group)
        return self.convert_packed if converts else self.ints_packed

    def float_values(self, n_act_rows: int, n_weight_rows: int, threads: int | None = None,
                     row_group: int = 16) -> ToInts | None:
        """Where a float matmul must multiply other values than the exact decoding (converted weights, or stored
        integers that rescale), the integers whose values it multiplies; None: the decoding itself."""
        if self.converts(n_act_rows, n_weight_rows, threads, row_group):
            return self.convert
        return self.ints if self.rescales else self.native


def _f16(x: np.ndarray) -> np.ndarray:
    """Round to f16 (nearest even) and widen back."""
    return f16_rounded(x)


def _block_f16(raw: np.ndarray, block_bytes: int, offset: int = 0) -> np.ndarray:
    """The f16 field at `offset` of every block of rows `raw`, as float32 [rows, blocks]."""
    blocks = raw.reshape(raw.shape[0], -1, block_bytes)
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _e8m0_half(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    """MXFP4's block exponent byte as the scale its values multiply: 2^(e - 128)."""
    e = raw.reshape(raw.shape[0], -1, block_bytes)[..., 0].astype(np.int32)
    return np.ldexp(np.float32(1), e - 128).astype(np.float32)


def _scaled_ints(decoded: np.ndarray, scale: np.ndarray) -> BlockInts:
    """A 32-value block type's stored integers: every decoded value is scale x an integer of at most 8 bits, so
    rounding decoded x (1 / scale) recovers it exactly. A scale without a float32 inverse (MXFP4's 2^-128, an
    all-zero block's) gives 0s, where ik has the codes' values: products of at most 12 x 2^-128 x |x| either way."""
    with np.errstate(over="ignore"):
        inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale != 0)
    inv[~np.isfinite(inv)] = 0
    q = np.rint(decoded.reshape(*scale.shape, BLOCK) * inv[..., None])
    return BlockInts(q=q.reshape(decoded.shape).astype(np.int8), scale=scale, block=BLOCK)


def _q8_0_ints(raw: np.ndarray) -> BlockInts:
    """Q8_0 stores its integers: read them (and the f16 scales), not the decoding."""
    q, scale, _ = _rows_from_bytes(raw, BYTES_Q8_0, raw.shape[1] // 34 * BLOCK)
    return BlockInts(q=q, scale=scale, block=BLOCK)


@njit(cache=True, nogil=True, inline="always")
def _q8_0_row(row: np.ndarray, q: np.ndarray, scale: np.ndarray) -> None:
    for b in range(scale.shape[0]):
        scale[b] = load_f16(row, 34 * b)
        for j in range(BLOCK):
            q[BLOCK * b + j] = np.int8(row[34 * b + 2 + j])


def _in_r8(ints: ToInts) -> ToInts:
    """The same integers as ik multiplies them after converting them to Q8_0_R8 (its gemm's float order)."""
    return lambda raw, decoded: replace(ints(raw, decoded), order=ORDER_R8)


def _k_kernel(five_bits: bool) -> IkKernel:
    """Q4_K / Q5_K: converted to Q8_1 from 32 activation rows on (_k_to_q8_1), from the bytes alone."""
    return IkKernel(Q8_2_X4, 32, lambda raw, decoded: _k_to_q8_1(raw, five_bits),
                    convert_packed=lambda raw: pack(_k_to_q8_1(raw, five_bits)))


def _q6_k_packed(raw: np.ndarray) -> PackedInts | None:
    """Q6_K's conversion packed straight from the bytes (IkKernel.convert_packed); None where _q6_k_ints declines."""
    ints = _q6_k_ints(raw)
    return None if ints is None else pack(replace(ints, order=ORDER_R8))


def _r8_kernel(ints: ToInts, bias: int,
               packed: Callable[[np.ndarray, int], PackedInts | None] | None = None) -> IkKernel:
    """A 32-value block type whose integers ik keeps when it converts it to Q8_0_R8 (from 32 activation rows); below
    that its own kernel multiplies them, made unsigned by adding `bias` (qgemm.ORDER_QX_0_NATIVE). `packed(raw,
    bias)`: either packed from the raw rows alone (bias 0: converted; IkKernel.convert_packed, ints_packed)."""
    return IkKernel(Q8_2_X4, 32, _in_r8(ints),
                    lambda raw, decoded: replace(ints(raw, decoded), order=ORDER_QX_0_NATIVE, bias=bias),
                    convert_packed=None if packed is None else lambda raw: packed(raw, 0),
                    ints_packed=None if packed is None else lambda raw: packed(raw, bias))


def _f16_scaled(block_bytes: int) -> ToInts:
    return lambda raw, decoded: _scaled_ints(decoded, _block_f16(raw, block_bytes))


def _k_to_q8_1(raw: np.ndarray, five_bits: bool) -> BlockInts:
    """Q4_K / Q5_K as ik converts them to Q8_1: per 32-value block the values kept, the scale f16(d x sc) and the
    offset f16(-dmin x m); from the bytes alone."""
    q, scale, offset = _rows_from_bytes(raw, BYTES_Q5_K if five_bits else BYTES_Q4_K,
                                        raw.shape[1] // (176 if five_bits else 144) * 256)
    return BlockInts(q=q, scale=scale, block=BLOCK, offset=offset, order=ORDER_Q8_1)


@njit(cache=True, nogil=True, inline="always")
def _k_to_q8_1_row(row: np.ndarray, five_bits: bool, q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> None:
    """One row of _k_to_q8_1: per 256 values d, dmin (f16), 12 bytes of 6-bit scales and minimums, Q5_K's 32
    bytes of fifth bits (bit j of byte l: value l of sub-block j), then 128 bytes of nibbles (byte l of chunk c:
    value l of sub-block 2c low, of 2c + 1 high)."""
    size = 176 if five_bits else 144
    for b in range(q.shape[0] // 256):
        o = b * size
        d, dmin = load_f16(row, o), load_f16(row, o + 2)
        for j in range(8):
            if j < 4:
                sc, mn = np.int32(row[o + 4 + j]) & 63, np.int32(row[o + 8 + j]) & 63
            else:
                low, high_s, high_m = np.int32(row[o + 8 + j]), np.int32(row[o + j]), np.int32(row[o + 4 + j])
                sc, mn = (low & 15) | ((high_s >> 6) << 4), (low >> 4) | ((high_m >> 6) << 4)
            scale[8 * b + j] = round_f16(d * np.float32(sc))
            offset[8 * b + j] = round_f16(-dmin * np.float32(mn))
        codes = o + size - 128
        for c in range(4):
            for l in range(32):
                byte = np.int32(row[codes + 32 * c + l])
                lo, hi = byte & 15, byte >> 4
                if five_bits:
                    h = np.int32(row[o + 16 + l])
                    lo |= ((h >> (2 * c)) & 1) << 4
                    hi |= ((h >> (2 * c + 1)) & 1) << 4
                q[256 * b + 64 * c + l] = lo
                q[256 * b + 64 * c + 32 + l] = hi


def _q_1_to_q8_1(raw: np.ndarray, decoded: np.ndarray, five_bits: bool) -> BlockInts:
    """Q4_1 / Q5_1 as ik converts them to Q8_1_R8: per 32-value block the codes (0 .. 15 or 0 .. 31: value j of a
    block the low nibble of its byte j, value 16 + j the high one; Q5_1's fifth bit j of its 32-bit qh), the scale
    d and the offset m as stored."""
    size = 24 if five_bits else 20
    blocks = raw.reshape(raw.shape[0], -1, size)
    qs = blocks[..., size - 16 :].astype(np.int32)
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)
    if five_bits:
        qh = blocks[..., 4:8].copy().view(np.uint32).astype(np.int64)  # [rows, nb, 1]
        q = q | (((qh >> np.arange(32)) & 1) << 4).astype(np.int32)
    return BlockInts(q=q.reshape(decoded.shape).astype(np.int8), scale=_block_f16(raw, size),
                     block=BLOCK, offset=_block_f16(raw, size, 2), order=ORDER_Q8_1)


def _q6_k_to_q8_0(raw: np.ndarray, decoded: np.ndarray) -> BlockInts:
    """Q6_K as ik converts it to Q8_0: per 32-value block p = (q - 32) x sc re-quantized to int8 against max|p| /
    127, the scale f16(d x max|p| / 127). From the bytes where every block scale d is finite (_q6_k_ints), else
    with p = rint(decoding / d)."""
    ints = _q6_k_ints(raw)
    return ints if ints is not None else _q6_k_from_decoding(raw, decoded)


def _q6_k_from_decoding(raw: np.ndarray, decoded: np.ndarray) -> BlockInts:
    """_q6_k_to_q8_0 with p = rint(decoding / d) (0 where d = 0)."""
    d = _block_f16(raw, 210, 208)  # [rows, nb]
    p = np.rint(np.divide(decoded.reshape(*d.shape, 8, 32), d[..., None, None],
                          out=np.zeros(d.shape + (8, 32), np.float32), where=d[..., None, None] != 0))
    mx = np.abs(p).max(axis=-1) / np.float32(127)
    inv = np.divide(np.float32(1), mx, out=np.zeros_like(mx), where=mx > np.float32(1e-9))
    q8 = np.clip(np.rint(p * inv[..., None]), -128, 127)
    return BlockInts(q=q8.reshape(decoded.shape).astype(np.int8),
                     scale=_f16(d[..., None] * mx).reshape(raw.shape[0], -1), block=BLOCK)


def _q6_k_ints(raw: np.ndarray) -> BlockInts | None:
    """_q6_k_to_q8_0 from the bytes: p = sc x (q - 32) is what rint(decoding / d) recovers for every finite d (an
    f16 times at most 4064 is exact to far below a half in float32; d = 0 gives p = 0); None where a d is infinite
    or NaN."""
    if not f16_fields_finite(raw, 210, 208):
        return None
    q, scale, _ = _rows_from_bytes(raw, BYTES_Q6_K, raw.shape[1] // 210 * 256)
    return BlockInts(q=q, scale=scale, block=BLOCK)


@njit(cache=True, nogil=True, inline="always")
def _q6_k_ints_row(row: np.ndarray, q: np.ndarray, scale: np.ndarray, p: np.ndarray) -> None:
    """One row of _q6_k_ints (p: room for 256 float32). Per 256 values: 128 bytes of low nibbles, 64 of high bit
    pairs, 16 int8 scales (one per 16 values), the f16 d; value l + 32 k of each half (k = 0..3) from nibble and
    bit pair k of its bytes."""
    p_bits = p.view(np.int32)
    for b in range(q.shape[0] // 256):
        o = b * 210
        d = load_f16(row, o + 208)
        for h in range(2):
            for l in range(32):
                ql0, ql1 = np.int32(row[o + 64 * h + l]), np.int32(row[o + 64 * h + l + 32])
                qh = np.int32(row[o + 128 + 32 * h + l])
                s = o + 192 + 8 * h + l // 16
                p[128 * h + l] = np.float32(np.int32(np.int8(row[s])) * (((ql0 & 15) | ((qh & 3) << 4)) - 32))
                p[128 * h + l + 32] = np.float32(np.int32(np.int8(row[s + 2])) *
                                                 (((ql1 & 15) | (((qh >> 2) & 3) << 4)) - 32))
                p[128 * h + l + 64] = np.float32(np.int32(np.int8(row[s + 4])) *
                                                 (((ql0 >> 4) | (((qh >> 4) & 3) << 4)) - 32))
                p[128 * h + l + 96] = np.float32(np.int32(np.int8(row[s + 6])) *
                                                 (((ql1 >> 4) | (((qh >> 6) & 3) << 4)) - 32))
        if d == 0:
            p[:] = 0
        for j in range(8):
            most = np.int32(0)
            for i in range(32 * j, 32 * j + 32):
                most = max(most, p_bits[i] & np.int32(0x7FFFFFFF))
            mx = f32_from_bits(np.uint32(most)) / np.float32(127)
            inv = np.float32(1) / mx if mx > np.float32(1e-9) else np.float32(0)
            for i in range(32 * j, 32 * j + 32):
                q[256 * b + i] = np.int8(np.int32(min(np.float32(127), max(np.float32(-128), np.rint(p[i] * inv)))))
            scale[8 * b + j] = round_f16(d * mx)


#: the conversions read straight from a 32-value-block type's bytes (_rows_from_bytes)
BYTES_Q8_0, BYTES_Q4_K, BYTES_Q5_K, BYTES_Q6_K = 0, 1, 2, 3


def _rows_from_bytes(raw: np.ndarray, kind: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The int8 values [rows, n], scales and offsets [rows, n / 32] (offsets only for Q4_K / Q5_K) of the rows `raw`
    of a BYTES_* kind, a row a task."""
    rows = raw.shape[0]
    q = np.empty((rows, n), np.int8)
    scale = np.empty((rows, n // BLOCK), np.float32)
    offset = np.empty((rows, n // BLOCK if kind in (BYTES_Q4_K, BYTES_Q5_K) else 0), np.float32)
    run_claimed(_bytes_serial, _bytes_parallel, rows * n, read_only(np.ascontiguousarray(raw)), kind, q, scale, offset)
    return q, scale, offset


@njit(cache=True, nogil=True, inline="always")
def _row_from_bytes(row: np.ndarray, kind: int, q: np.ndarray, scale: np.ndarray, offset: np.ndarray,
                    p: np.ndarray) -> None:
    if kind == BYTES_Q8_0:
        _q8_0_row(row, q, scale)
    elif kind == BYTES_Q6_K:
        _q6_k_ints_row(row, q, scale, p)
    else:
        _k_to_q8_1_row(row, kind == BYTES_Q5_K, q, scale, offset)


@njit(cache=True, nogil=True)
def _bytes_serial(raw: np.ndarray, kind: int, q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> None:
    p = np.empty(256, np.float32)
    for r in range(raw.shape[0]):
        _row_from_bytes(raw[r], kind, q[r], scale[r], offset[r], p)


@njit(cache=True, nogil=True, parallel=True)
def _bytes_parallel(raw: np.ndarray, kind: int, q: np.ndarray, scale: np.ndarray, offset: np.ndarray,
                    threads: int) -> None:
    """The rows in tasks the threads claim (ikrun/ops/parallel.py)."""
    items = raw.shape[0]
    per, counter = task_items(items, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        p = np.empty(256, np.float32)
        i0, i1 = claim_items(counter, per, items)
        while i0 < i1:
            for r in range(i0, i1):
                _row_from_bytes(raw[r], kind, q[r], scale[r], offset[r], p)
            i0, i1 = claim_items(counter, per, items)


@njit(cache=True, nogil=True, parallel=True)
def _q8_k_blocks(decoded: np.ndarray, dsup: np.ndarray, dscale: np.ndarray, inv_c: np.float32, q: np.ndarray,
                 scale: np.ndarray, threads: int) -> None:
    """The rows in tasks the threads claim (ikrun/ops/parallel.py), each block's p = rint(decoded / dsup)
    requantized as q8k_direct's conversions do (requantize_q8_k); 2.1 -> 0.6 ns a value."""
    items = dsup.shape[0]
    per, counter = task_items(items, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        p = np.empty(SUPER, np.float32)
        p_bits = p.view(np.int32)
        i0, i1 = claim_items(counter, per, items)
        while i0 < i1:
            for r in range(i0, i1):
                for b in range(dsup.shape[1]):
                    ds = dsup[r, b]
                    src, dst = decoded[r, b * SUPER:(b + 1) * SUPER], q[r, b * SUPER:(b + 1) * SUPER]
                    if ds != 0:
                        for j in range(SUPER):
                            p[j] = np.rint(src[j] / ds)
                    else:
                        p[:] = 0
                    dnew = requantize_q8_k(p, p_bits, inv_c, dst)
                    scale[r, b] = round_f16(dscale[r, b] * dnew)
            i0, i1 = claim_items(counter, per, items)


def _to_q8_k(decoded: np.ndarray, dsup: np.ndarray, c: float, ints: np.ndarray | None = None) -> BlockInts:
    """ik's convert_to_q8_k_r8 on the integers p = decoded / dsup of each 256-value block (dsup [rows, nb]), or on
    `ints` where given (the integers ik's kernel multiplies, not the decoding's): p kept when max|p| / c < 1, else
    re-quantized to int8 against max|p| / c; the scale f16(dsup x that)."""
    q = np.empty(decoded.shape, np.int8)
    scale = np.empty(dsup.shape, np.float32)
    dsup = np.ascontiguousarray(dsup, dtype=np.float32)
    if ints is None:
        _q8_k_blocks(np.ascontiguousarray(decoded, dtype=np.float32), dsup, dsup, np.float32(np.float32(1) / np.float32(c)),
                     q, scale, get_num_threads())
    else:
        _q8_k_blocks(ints.astype(np.float32), np.ones_like(dsup), dsup, np.float32(np.float32(1) / np.float32(c)), q,
                     scale, get_num_threads())
    return BlockInts(q=q, scale=scale, block=SUPER, order=ORDER_R16)


def _q2_k_to_q8_k(decoded: np.ndarray) -> BlockInts:
    """Q2_K as ik converts it to Q8_K_R16: each 256-value block's floats fma(f32(value x scale), d, -dmin x min),
    which are its decoding exactly (value x scale x d has at most 6 + 11 significant bits, so the fused and the
    separate forms both round once, at the addition), re-quantized against d' = max|v| / 127: nearest-even
    rint(v x (1 / d')), the scale f16(d')."""
    v = decoded.reshape(decoded.shape[0], -1, SUPER)
    dv = np.abs(v).max(axis=-1) / np.float32(127)
    inv = np.divide(np.float32(1), dv, out=np.zeros_like(dv), where=dv != 0)
    q = np.clip(np.rint(v * inv[..., None]), -128, 127).astype(np.int8)
    return BlockInts(q=q.reshape(decoded.shape), scale=_f16(dv), block=SUPER, order=ORDER_R16)


def _iq6_k_table_ints(raw: np.ndarray) -> np.ndarray:
    """IQ6_K's values as ik's matmul kernels take them [rows, n]: sub-block scale x iq6nl_values[code] (+1 where
    the extra bit is set), where its to_float evaluates a cubic in the code instead (values up to 0.5 apart)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 212)
    nb = blocks.shape[1]
    extra = blocks[..., 2:4].copy().view(np.uint16)[..., 0].astype(np.int32)
    ls = blocks[..., 4:20].view(np.int8).astype(np.int32)  # [rows, nb, 16]
    qs = blocks[..., 20:148].reshape(rows, nb, 4, 32).astype(np.int32)  # per 64 values
    qh = blocks[..., 148:212].reshape(rows, nb, 2, 32).astype(np.int32)
    codes = np.empty((rows, nb, 4, 64), np.int32)
    for ib64 in range(4):
        h = qh[:, :, ib64 // 2] >> (4 * (ib64 % 2))
        codes[:, :, ib64, :32] = (qs[:, :, ib64] & 15) | ((h & 3) << 4)
        codes[:, :, ib64, 32:] = (qs[:, :, ib64] >> 4) | ((h & 12) << 2)
    codes = codes.reshape(rows, nb, 16, 16)
    bits = (extra[..., None] >> np.arange(16)) & 1
    values = IQ6NL_VALUES[codes + 64 * bits[..., None]].astype(np.int32)
    return (values * ls[..., None]).reshape(rows, -1)


def _iq6_k_to_q8_k(raw: np.ndarray, decoded: np.ndarray) -> BlockInts:
    return _to_q8_k(decoded, _block_f16(raw, 212), 127, _iq6_k_table_ints(raw))


def _iq6_k_native(raw: np.ndarray, decoded: np.ndarray) -> BlockInts:
    """IQ6_K's values as its native kernel multiplies them, for the float path only: d x the table integers (wider
    than int8)."""
    p = _iq6_k_table_ints(raw)
    return BlockInts(q=p, scale=_block_f16(raw, 212), block=SUPER)


def _row_scaled_to_q8_k(row_scale: str, c: float) -> ToInts:
    """An IQK type with one scale per row (f32 or f16, before the blocks) as ik converts it to Q8_K_R16."""

    def convert(raw: np.ndarray, decoded: np.ndarray) -> BlockInts:
        if row_scale == "f32":
            d = raw[:, 0:4].copy().view(np.float32)[:, 0]
        else:
            d = raw[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float32)
        return _to_q8_k(decoded, np.repeat(d[:, None], decoded.shape[1] // SUPER, axis=1), c)

    return convert


def _super_scaled_to_q8_k(block_bytes: int, c: float) -> ToInts:
    """An IQK type with an f16 scale at the start of every 256-value block as ik converts it to Q8_K_R16."""
    return lambda raw, decoded: _to_q8_k(decoded, _block_f16(raw, block_bytes), c)


def iq1_m_d(raw: np.ndarray) -> np.ndarray:
    """IQ1_M's block scale d [rows, nb]: the f16 whose four nibbles are the top nibbles of the block's four u16
    scale words (the last 8 of its 56 bytes), the first word's the lowest."""
    sc = raw.reshape(raw.shape[0], -1, 56)[..., 48:].copy().view(np.uint16)
    bits = (sc[..., 0] >> 12) | ((sc[..., 1] >> 8) & 0x00F0) | ((sc[..., 2] >> 4) & 0x0F00) | (sc[..., 3] & 0xF000)
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)


def _leading_f16(block_bytes: int) -> Callable[[np.ndarray], np.ndarray]:
    """The scale d of blocks of `block_bytes` that start with it, [rows, nb]."""
    return lambda raw: _block_f16(raw, block_bytes)


def _iqk_kernel(convert: ToInts, c: float,
                packed: Callable[[np.ndarray, float], PackedInts | None] | None) -> IkKernel:
    """A type ik converts to Q8_K_R16 (against c) from 32 activation rows on; `packed`: the same conversion from its
    bytes (q8k_direct.py), where there is one."""
    return IkKernel(Q8_K, 32, convert, convert_packed=None if packed is None else lambda raw: packed(raw, c))


def _iquant_to_q8_k(block_d: Callable[[np.ndarray], np.ndarray], c: float, step: float = 0.125) -> ToInts:
    """An i-quant as ik converts it to Q8_K_R16: the integers against d x step (d = block_d(raw), the block's f16
    scale; step 1/8 for the 1- and 2-bit types, 1/4 for IQ3_XXS, 1 for IQ3_S), which every value of the block is an
    integer multiple of: (2 s + 1) x the signed grid value, s the sub-block's scale."""
    return lambda raw, decoded: _to_q8_k(decoded, block_d(raw) * np.float32(step), c)


def _kt_sub_scales(raw: np.ndarray, n: int, type_name: str) -> np.ndarray:
    """The integer scale of every 32-value sub-block of a trellis row [rows, n // 32] (IQ1_KT, IQ2_KT: the IQ4_K
    grid value of its nibble; IQ3_KT: the nibble; IQ4_KT: bits 1-7 of its word, less 64)."""
    bsize = {"IQ1_KT": 56, "IQ2_KT": 68, "IQ3_KT": 100, "IQ4_KT": 128}[type_name]
    blocks = raw[:, 4:].reshape(raw.shape[0], n // SUPER, bsize)
    if type_name == "IQ1_KT":
        return IQ4K_VALUES[blocks[..., :8] & 15].reshape(raw.shape[0], -1).astype(np.float32)
    if type_name == "IQ4_KT":
        words = blocks[..., :32].copy().view(np.uint32).astype(np.int64)
        return (((words & 0xFF) >> 1) - 64).reshape(raw.shape[0], -1).astype(np.float32)
    t = np.arange(8)
    nib = (blocks[..., t % 4].astype(np.int32) >> (4 * (t // 4))) & 15
    ls = IQ4K_VALUES[nib] if type_name == "IQ2_KT" else nib
    return ls.reshape(raw.shape[0], -1).astype(np.float32)


#: ik's matmul multiplies a trellis row's scale d by this factor (its dequantization does not)
KT_MATMUL_FACTOR = {"IQ1_KT": None, "IQ2_KT": np.float32(1.05), "IQ3_KT": np.float32(1.01), "IQ4_KT": None}


def _kt_ints(type_name: str, f16_scale: bool) -> ToInts:
    """A trellis type as ik's matmul multiplies it: the generator's integers (-126..126, kept exactly: the decoding
    is (d x sub-block scale) x integer) with the block scale (d x factor) x sub-block scale, in float32 (the native
    kernel) or rounded to f16 (converted to Q8_0_R8)."""
    factor = KT_MATMUL_FACTOR[type_name]

    def ints(raw: np.ndarray, decoded: np.ndarray) -> BlockInts:
        d = raw[:, 0:4].copy().view(np.float32)[:, :1]
        ls = _kt_sub_scales(raw, decoded.shape[1], type_name)
        q = _scaled_ints(decoded, (d * ls).astype(np.float32)).q
        dm = d if factor is None else (d * factor).astype(np.float32)
        scale = (dm * ls).astype(np.float32)
        return BlockInts(q=q, scale=_f16(scale) if f16_scale else scale, block=BLOCK)

    return ints


def _kt_kernel(type_name: str, convert_rows: int) -> IkKernel:
    return IkKernel(Q8_2_X4, convert_rows, _in_r8(_kt_ints(type_name, True)), _kt_ints(type_name, False),
                    rescales=KT_MATMUL_FACTOR[type_name] is not None)


#: weight type -> how ik multiplies it (types not listed are not emulated)
IK_KERNELS: dict[str, IkKernel] = {
    "F32": IkKernel(UNROUNDED), "F16": IkKernel(UNROUNDED), "BF16": IkKernel(BF16),
    "Q8_0": _r8_kernel(lambda raw, decoded: _q8_0_ints(raw), 127, q8_0_packed),
    **{t: _r8_kernel(_f16_scaled(size), bias) for t, size, bias in (
        ("Q4_0", 18, 8), ("Q5_0", 22, 16), ("Q6_0", 26, 32), ("IQ4_NL", 18, 128))},
    "MXFP4": _r8_kernel(lambda raw, decoded: _scaled_ints(decoded, _e8m0_half(raw, 17)), 12, mxfp4_packed),
    **{t: IkKernel(Q8_2_X4) for t in ("Q8_0_R8", "Q4_0_R8", "IQ4_NL_R4", "MXFP4_R8")},
    "Q4_K": _k_kernel(five_bits=False),
    "Q5_K": _k_kernel(five_bits=True),
    "Q6_K": IkKernel(Q8_2_X4, 64, _in_r8(_q6_k_to_q8_0), convert_packed=_q6_k_packed),
    **{t: _iqk_kernel(_super_scaled_to_q8_k(size, c), c, packed) for t, size, c, packed in (
        ("IQ2_K", 76, 120, iq2_k_packed), ("IQ3_K", 110, 127, iq3_k_packed), ("IQ4_K", 144, 127, iq4_k_packed),
        ("IQ5_K", 176, 127, None), ("IQ4_XS", 136, 127, None))},
    "IQ6_K": IkKernel(Q8_K, 32, _iq6_k_to_q8_k, native=_iq6_k_native),
    **{t: _iqk_kernel(_row_scaled_to_q8_k(scale, c), c, packed) for t, scale, c, packed in (
        ("IQ2_KS", "f16", 125, iq2_ks_packed), ("IQ2_KL", "f16", 125, None), ("IQ3_KS", "f16", 127, iq3_ks_packed),
        ("IQ4_KS", "f32", 127, iq4_ks_packed), ("IQ4_KSS", "f32", 127, None), ("IQ5_KS", "f32", 127, iq5_ks_packed))},
    **{t: _kt_kernel(t, rows) for t, rows in (("IQ1_KT", 16), ("IQ2_KT", 16), ("IQ3_KT", 16), ("IQ4_KT", 24))},
    **{t: IkKernel(Q8_K, rows, _iquant_to_q8_k(block_d, c)) for t, block_d, rows, c in (
        ("IQ2_XXS", _leading_f16(66), 32, 124), ("IQ2_XS", _leading_f16(74), 32, 124),
        ("IQ2_S", _leading_f16(82), 16, 124), ("IQ1_S", _leading_f16(50), 32, 126), ("IQ1_M", iq1_m_d, 32, 126))},
    "IQ3_XXS": IkKernel(Q8_K, 32, _iquant_to_q8_k(_leading_f16(98), 124, 0.25)),
    "IQ3_S": IkKernel(Q8_K, 32, _iquant_to_q8_k(_leading_f16(110), 127, 1.0)),
    "Q2_K": IkKernel(Q8_K, 32, lambda raw, decoded: _q2_k_to_q8_k(decoded)),
    "Q3_K": IkKernel(Q8_K, 32, lambda raw, decoded: _to_q8_k(decoded, _block_f16(raw, 110, 108), 127)),
}


#: K cache types ik multiplies in a kernel of its own that no weight type of IK_KERNELS takes here: Q4_1 and Q5_1,
#: converted to Q8_1_R8 from 32 activation rows on (their own kernels below that are not reproduced)
KEY_CACHE_KERNELS: dict[str, IkKernel] = {
    "Q4_1": IkKernel(Q8_2_X4, 32, lambda raw, w: _q_1_to_q8_1(raw, w, False)),
    "Q5_1": IkKernel(Q8_2_X4, 32, lambda raw, w: _q_1_to_q8_1(raw, w, True)),
}


#: weight types ik multiplies in its float kernels (ikrun/numerics/ik/ikgemm.py)
IK_FLOAT_TYPES = ("F32", "F16", "BF16")


def ik_kernel(type_name: str) -> IkKernel:
    """How ik multiplies a weight type under --numerics ik."""
    try:
        return IK_KERNELS[type_name]
    except KeyError:
        raise NumericsError(type_name) from None


def key_cache_kernel(type_name: str) -> IkKernel:
    """How ik multiplies a K cache of GGML type `type_name` with the queries (its -fa off graph's matmul)."""
    kernel = KEY_CACHE_KERNELS.get(type_name)
    return ik_kernel(type_name) if kernel is None else kernel


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
def _q8_scale(x: np.ndarray, b0: np.uint64, block: int, bf16_scale: bool) -> tuple[np.float32, np.float32]:
    """The scale d of the block at b0 and the factor its values are multiplied by before rounding: Q8_2_X4 (the
    scale rounded to bf16, 1/d) or Q8_K (the float32 scale, 127 / max); the maximum taken in vector registers
    (ops/simd.absmax).

    Here and below, indices are unsigned (a signed one gets a check for negative values that keeps LLVM from
    vectorising the loop)."""
    amax: np.float32 = absmax(x, np.int64(b0), block)  # type: ignore[call-arg]  # Numba passes the typing context
    if bf16_scale:
        d = _bf16(amax / np.float32(127.0))
        return d, np.float32(1.0) / d if d > np.float32(0.0) else np.float32(0.0)
    return amax / np.float32(127.0), np.float32(127.0) / amax if amax > np.float32(0.0) else np.float32(0.0)


@njit(cache=True, nogil=True, inline="always")
def _q8(x: np.float32, inv: np.float32) -> np.float32:
    return min(np.float32(127.0), max(np.float32(-128.0), np.float32(np.rint(x * inv))))


@njit(cache=True, nogil=True, inline="always")
def _q8_row(x: np.ndarray, block: int, bf16_scale: bool, out: np.ndarray) -> None:
    """Blocks of `block` values to int8 and back (Q8_2_X4: 32, Q8_K: 256)."""
    for b in range(x.shape[0] // block):
        b0 = np.uint64(b * block)
        d, inv = _q8_scale(x, b0, block, bf16_scale)
        for j in range(block):
            k = b0 + np.uint64(j)
            out[k] = _q8(x[k], inv) * d


@njit(cache=True, nogil=True, inline="always")
def _q8_row_ints(x: np.ndarray, block: int, bf16_scale: bool, u: np.ndarray, scale: np.ndarray,
                 sums: np.ndarray, isums: np.ndarray) -> None:
    """The same rounding kept as integers: u = q + 128, and per block d, sum(q) and d x sum(q). The blocks' scales
    first, then their values: the scales' chains (maximum, rounding, reciprocal) overlap, and the rounding loop
    vectorises without waiting on them."""
    nb = x.shape[0] // block
    inv = np.empty(nb, np.float32)
    for b in range(nb):
        scale[b], inv[b] = _q8_scale(x, np.uint64(b * block), block, bf16_scale)
    for b in range(nb):
        b0, inv_b = np.uint64(b * block), inv[b]
        total = np.int32(0)  # int32 lanes, as wide as the floats': an int64 sum held the loop to 4 lanes
        for j in range(block):
            k = b0 + np.uint64(j)
            q = np.int32(_q8(x[k], inv_b))
            total += q
            u[k] = np.uint8(q + 128)
        isums[b] = total
        sums[b] = scale[b] * np.float32(total)


@njit(cache=True, nogil=True, inline="always")
def _round_row(x: np.ndarray, fmt: int, out: np.ndarray) -> None:
    """One row rounded to format code `fmt` (FMT_Q8_2_X4, FMT_Q8_K or FMT_BF16) into out."""
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
        _round_row(x[i], fmt, out[i])


@njit(cache=True, nogil=True, parallel=True)
def _rows_parallel(x: np.ndarray, fmt: int, out: np.ndarray, threads: int) -> None:
    """The rows in tasks the threads claim (ikrun/ops/parallel.py)."""
    per, counter = task_items(x.shape[0], threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        i0, i1 = claim_items(counter, per, x.shape[0])
        while i0 < i1:
            for i in range(i0, i1):
                _round_row(x[i], fmt, out[i])
            i0, i1 = claim_items(counter, per, x.shape[0])


def _block_of(fmt: str, n: int) -> int:
    """The block length of activation format `fmt`, checked to divide rows of n values."""
    block = {Q8_2_X4: BLOCK, Q8_K: SUPER}.get(fmt, 1)
    if n % block:
        raise NumericsError(f"rows of {n} values are not whole {block}-value {fmt} blocks")
    return block


def round_activations(x: np.ndarray, fmt: str) -> np.ndarray:
    """x (any leading shape, the dot-product axis last) as ik feeds it to a weight of activation format `fmt`."""
    if fmt == UNROUNDED:
        return x
    if fmt not in FORMAT_CODES:
        raise ValueError(f"unknown activation format {fmt!r}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    flat = x.reshape(-1, x.shape[-1])
    _block_of(fmt, flat.shape[1])
    out = np.empty_like(flat)
    run_claimed(_rows_serial, _rows_parallel, flat.size, flat, FORMAT_CODES[fmt], out)
    return out.reshape(x.shape)


@njit(cache=True, nogil=True)
def _ints_serial(x: np.ndarray, block: int, bf16_scale: bool, u: np.ndarray, scale: np.ndarray,
                 sums: np.ndarray, isums: np.ndarray) -> None:
    for i in range(x.shape[0]):
        _q8_row_ints(x[i], block, bf16_scale, u[i], scale[i], sums[i], isums[i])


@njit(cache=True, nogil=True, parallel=True)
def _ints_parallel(x: np.ndarray, block: int, bf16_scale: bool, u: np.ndarray, scale: np.ndarray,
                   sums: np.ndarray, isums: np.ndarray, threads: int) -> None:
    """The rows in tasks the threads claim (ikrun/ops/parallel.py)."""
    per, counter = task_items(x.shape[0], threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        i0, i1 = claim_items(counter, per, x.shape[0])
        while i0 < i1:
            for i in range(i0, i1):
                _q8_row_ints(x[i], block, bf16_scale, u[i], scale[i], sums[i], isums[i])
            i0, i1 = claim_items(counter, per, x.shape[0])


def integer_rows(x: np.ndarray, fmt: str) -> IntRows:
    """Rows x [m, n] rounded to the int8 blocks of format `fmt` (Q8_2_X4 or Q8_K), for `qmatmul`; the row count
    padded to whole kernel tiles with rows of zeros."""
    if fmt not in (Q8_2_X4, Q8_K):
        raise ValueError(f"no integer rows for activation format {fmt!r}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, n = x.shape
    block = _block_of(fmt, n)
    mp = m + (-m % TILE)
    u = np.full((mp, n), 128, np.uint8)
    scale = np.zeros((mp, n // block), np.float32)
    sums = np.zeros((mp, n // block), np.float32)
    isums = np.zeros((mp, n // block), np.int32)
    run_claimed(_ints_serial, _ints_parallel, x.size, x, block, fmt == Q8_2_X4, u, scale, sums, isums)
    return IntRows(u=u, scale=scale, sums=sums, rows=m, block=block, isums=isums)
