"""Weights converted as ik converts them, straight from their bytes (no float decoding first): IQ4_KS, IQ5_KS,
IQ4_K, IQ2_K, IQ3_K, IQ2_KS, IQ3_KS, Q8_0 and MXFP4 packed for the integer matmul, the same PackedInts as decoding, converting and packing (the general path); Q6_K's Q8_0 and
Q4_K / Q5_K's Q8_1 integers and Q8_0's own, the same as from the decoding / as an independent numpy formulation;
every field, every bit."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from ikquant.types import type_by_name
from ikrun.numerics.ik.formats import (
    _k_to_q8_1,
    _q6_k_from_decoding,
    _q6_k_ints,
    _q6_k_to_q8_0,
    _q8_0_ints,
    ik_kernel,
)
from ikrun.numerics.ik.q8k_direct import (
    iq2_k_packed,
    iq2_ks_packed,
    iq3_k_packed,
    iq3_ks_packed,
    iq4_k_packed,
    iq4_ks_packed,
    iq5_ks_packed,
)
from ikrun.numerics.ik.qgemm import ORDER_Q8_1, BlockInts, PackedInts, pack

N = 512
#: the types with a float32 row scale: (their direct packer, block bytes)
F32_SCALED = {"IQ4_KS": (iq4_ks_packed, 136), "IQ5_KS": (iq5_ks_packed, 168)}


def _general(type_name: str, raw: np.ndarray) -> PackedInts:
    convert = ik_kernel(type_name).convert
    assert convert is not None
    return pack(convert(raw, type_by_name(type_name).require_codec().dequantize(raw, N)))


def _assert_same(got: PackedInts | BlockInts | None, want: PackedInts | BlockInts) -> None:
    assert got is not None
    for f in fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), f.name
        else:
            assert a == b, f.name


def _quantized(type_name: str, rows: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, N)).astype(np.float32)
    x *= np.logspace(-3, 2, rows, dtype=np.float32)[:, None]  # row scales over five decades
    return type_by_name(type_name).require_codec().quantize(x).reshape(rows, -1)


@pytest.mark.parametrize("type_name", list(F32_SCALED))
@pytest.mark.parametrize("rows", [32, 40, 77])
def test_quantized_rows_pack_as_the_general_path(type_name: str, rows: int) -> None:
    """Rows the codec wrote (not a whole number of 32-row calls but for the first: padding groups too)."""
    raw = _quantized(type_name, rows, rows)
    _assert_same(F32_SCALED[type_name][0](raw, 127), _general(type_name, raw))


@pytest.mark.parametrize("type_name", list(F32_SCALED))
def test_every_code_and_sub_block_scale_packs_as_the_general_path(type_name: str) -> None:
    """Random bytes under a valid row scale: every sub-block scale (both grid halves, ls from -127 to 127) and
    code; scale bytes 128/129 (ls = 1: |p| <= 126 < 127) keep whole blocks' integers unconverted."""
    packer, block = F32_SCALED[type_name]
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, (64, 4 + 2 * block), dtype=np.uint8)
    raw[:, :4] = np.frombuffer(np.float32(0.0123).tobytes(), np.uint8)
    raw[48:, 4:12] = rng.choice(np.array([128, 129], np.uint8), (16, 8))  # ls = 1, the shifted grid on 129
    raw[48:, 4 + block:12 + block] = 129
    got = packer(raw, 127)
    _assert_same(got, _general(type_name, raw))
    assert got is not None and (got.scale[-16:] == np.float32(np.float16(0.0123))).all()  # d x 1: kept as is


@pytest.mark.parametrize("type_name", list(F32_SCALED))
@pytest.mark.parametrize("d", [0.0, 1e-40, 2.0**-101, 2.0**101, np.inf, np.nan])
def test_a_row_scale_whose_decoding_is_not_exact_declines(type_name: str, d: float) -> None:
    """Zero, subnormal, tiny, huge, infinite and NaN row scales: the direct path declines the whole tensor (the
    general path handles them as ik's float emulation does)."""
    raw = _quantized(type_name, 32, 3)
    raw[5, :4] = np.frombuffer(np.float32(d).tobytes(), np.uint8)
    assert F32_SCALED[type_name][0](raw, 127) is None


def _k_quant_rows(type_name: str, block_bytes: int, seed: int) -> list[np.ndarray]:
    """Rows the codec wrote, and random bytes under its f16 scales (every bit of the 6-bit scales and minimums,
    the fifth bits, the codes)."""
    rng = np.random.default_rng(seed)
    codec = type_by_name(type_name).require_codec()
    written = codec.quantize(rng.standard_normal((48, N)).astype(np.float32)).reshape(48, -1)
    noise = rng.integers(0, 256, written.shape, dtype=np.uint8)
    scales = {"Q6_K": slice(208, 210)}.get(type_name, slice(0, 4))
    noise.reshape(48, -1, block_bytes)[..., scales] = written.reshape(48, -1, block_bytes)[..., scales]
    return [written, noise]


@pytest.mark.parametrize("which", [0, 1], ids=["written", "random"])
def test_q6_k_from_its_bytes_is_its_conversion_from_the_decoding(which: int) -> None:
    """Block scales d = 0 (its integers zero) included."""
    raw = _k_quant_rows("Q6_K", 210, 11)[which]
    raw.reshape(48, -1, 210)[3, 1, 208:210] = 0
    decoded = type_by_name("Q6_K").require_codec().dequantize(raw, N)
    _assert_same(_q6_k_ints(raw), _q6_k_from_decoding(raw, decoded))


@pytest.mark.parametrize("bits", [0x7C00, 0xFC00, 0x7E00], ids=["inf", "-inf", "nan"])
def test_q6_k_with_a_block_scale_not_finite_converts_from_the_decoding(bits: int) -> None:
    raw = _k_quant_rows("Q6_K", 210, 12)[0]
    raw.reshape(48, -1, 210)[7, 0, 208:210] = np.frombuffer(np.uint16(bits).tobytes(), np.uint8)
    decoded = type_by_name("Q6_K").require_codec().dequantize(raw, N)
    assert _q6_k_ints(raw) is None
    with np.errstate(invalid="ignore"):  # that block's integers are undefined, in ik too
        _assert_same(_q6_k_to_q8_0(raw, decoded), _q6_k_from_decoding(raw, decoded))


def _reference_k_to_q8_1(raw: np.ndarray, five_bits: bool) -> BlockInts:
    """ik's Q4_K / Q5_K conversion to Q8_1 in numpy: 6-bit scales sc and minimums m (the first four in the low
    bits of bytes 0-3 / 4-7, the last four in the nibbles of 8-11 with their top bits in bytes 0-7's), values
    kept (the fifth bit j of byte l for value l of sub-block j), scale f16(d x sc), offset f16(-dmin x m)."""
    size = 176 if five_bits else 144
    blocks = raw.reshape(raw.shape[0], -1, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = blocks[..., 4:16].astype(np.int32)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    qs = blocks[..., size - 128:].reshape(*blocks.shape[:2], 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(*blocks.shape[:2], 8, 32)
    if five_bits:
        qh = blocks[..., 16:48].astype(np.int32)
        q = q | (((qh[:, :, None, :] >> np.arange(8)[None, None, :, None]) & 1) << 4)
    f16 = lambda x: x.astype(np.float16).astype(np.float32)  # noqa: E731
    return BlockInts(q=q.reshape(raw.shape[0], -1).astype(np.int8),
                     scale=f16(d[..., None] * sc.astype(np.float32)).reshape(raw.shape[0], -1), block=32,
                     offset=f16(-dmin[..., None] * mn.astype(np.float32)).reshape(raw.shape[0], -1), order=ORDER_Q8_1)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
@pytest.mark.parametrize("which", [0, 1], ids=["written", "random"])
def test_k_quants_convert_to_q8_1_as_the_reference(type_name: str, which: int) -> None:
    five = type_name == "Q5_K"
    raw = _k_quant_rows(type_name, 176 if five else 144, 13)[which]
    _assert_same(_k_to_q8_1(raw, five), _reference_k_to_q8_1(raw, five))


@pytest.mark.parametrize("rows", [1, 48])
def test_q8_0_reads_its_integers_and_scales_from_its_bytes(rows: int) -> None:
    """Every byte pattern of the values, scales as written (one row: the kernel's serial path)."""
    rng = np.random.default_rng(rows)
    codec = type_by_name("Q8_0").require_codec()
    raw = codec.quantize(rng.standard_normal((rows, N)).astype(np.float32)).reshape(rows, -1)
    blocks = raw.reshape(rows, -1, 34)
    blocks[..., 2:] = rng.integers(0, 256, blocks[..., 2:].shape, dtype=np.uint8)
    want = BlockInts(q=blocks[..., 2:].copy().view(np.int8).reshape(rows, N),
                     scale=blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32), block=32)
    _assert_same(_q8_0_ints(raw), want)


#: the 32-value block types packed from their bytes: (block bytes, where the values start, the scale's field)
BLOCK32 = {"Q8_0": (34, 2), "MXFP4": (17, 1)}


def _block32_rows(type_name: str, rows: int, cols: int = N) -> np.ndarray:
    """Codec-written rows, then random value bytes (Q8_0: -128 in one row only, so the groups without it say so;
    MXFP4: every code) and scales: Q8_0's f16 scales as written with one 0 and one -0, MXFP4's exponents random
    over 1..252 (with both ends)."""
    rng = np.random.default_rng(rows)
    size, start = BLOCK32[type_name]
    raw = type_by_name(type_name).require_codec().quantize(rng.standard_normal((rows, cols)).astype(np.float32))
    blocks = raw.reshape(rows, -1, size)
    blocks[..., start:] = rng.integers(0, 256, blocks[..., start:].shape, dtype=np.uint8)
    if type_name == "Q8_0":
        blocks[..., start:][blocks[..., start:] == 128] = 0
        blocks[rows // 2, min(3, blocks.shape[1] - 1), 9] = 128
        blocks[0, 1, :2] = 0
        blocks[-1, 2, :2] = np.frombuffer(np.float16(-0.0).tobytes(), np.uint8)
    else:
        blocks[..., 0] = rng.integers(1, 253, blocks.shape[:2], dtype=np.uint8)
        blocks[0, :2, 0] = (1, 252)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", list(BLOCK32))
@pytest.mark.parametrize("converts", [True, False], ids=["Q8_0_R8", "own kernel"])
@pytest.mark.parametrize("rows", [1, 32, 45])
@pytest.mark.parametrize("cols", [N, 96], ids=["blocks in pairs", "an odd last block"])
def test_block32_types_pack_from_their_bytes_as_the_general_path(type_name: str, converts: bool, rows: int,
                                                                   cols: int) -> None:
    """Both of ik's forms (converted to Q8_0_R8; its own kernel's, every value + the type's bias as an unsigned
    byte) against the integers recovered from the decoding (MXFP4) or read (Q8_0), then packed; padding rows (not
    whole 32-row calls); rows of an odd number of blocks (the pack transposes blocks two at a time)."""
    raw = _block32_rows(type_name, rows, cols)
    kernel = ik_kernel(type_name)
    n_act = 32 if converts else 8
    direct, ints = kernel.packed(n_act, 64), kernel.integers(n_act, 64)
    assert direct is not None and ints is not None
    _assert_same(direct(raw), pack(ints(raw, type_by_name(type_name).require_codec().dequantize(raw, cols))))


@pytest.mark.parametrize("exponent", [253, 255])
def test_mxfp4_with_an_exponent_without_exact_integers_declines(exponent: int) -> None:
    """Exponents whose 12 x 2^(e - 128) overflows: the general path takes the whole tensor."""
    raw = _block32_rows("MXFP4", 32)
    raw.reshape(32, -1, 17)[7, 3, 0] = exponent
    direct = ik_kernel("MXFP4").packed(32, 64)
    assert direct is not None and direct(raw) is None


@pytest.mark.parametrize("converts", [True, False], ids=["Q8_0_R8", "own kernel"])
def test_mxfp4_exponent_0_keeps_its_codes_under_the_subnormal_scale(converts: bool) -> None:
    """An all-zero block's exponent 0 (2^-128: no float32 inverse, so the decoding cannot give its integers back)
    packs like any block: its codes' values, as ik's kernels multiply them, under the scale 2^-128 (exponent 1's
    block, the same codes, packs them alike under 2^-127)."""
    direct = ik_kernel("MXFP4").packed(32 if converts else 8, 64)
    assert direct is not None
    raw = _block32_rows("MXFP4", 32)
    blocks = raw.reshape(32, -1, 17)
    blocks[7, 3, 0] = 0
    zero = direct(raw)
    blocks[7, 3, 0] = 1
    one = direct(raw)
    assert zero is not None and one is not None
    assert np.array_equal(zero.q, one.q) and np.array_equal(zero.corr, one.corr)
    differs = np.flatnonzero(zero.scale != one.scale)
    assert len(differs) == 1
    assert (zero.scale[differs[0]], one.scale[differs[0]]) == (np.float32(2.0**-128), np.float32(2.0**-127))


#: type -> (its direct packer, c, where its f16 scales lie: (row bytes before the blocks, block bytes, whether
#: every block has one at its start; else one at the row's start))
F16_SCALED = {"IQ4_K": (iq4_k_packed, 127, 0, 144, True), "IQ2_K": (iq2_k_packed, 120, 0, 76, True),
              "IQ3_K": (iq3_k_packed, 127, 0, 110, True), "IQ2_KS": (iq2_ks_packed, 125, 2, 70, False),
              "IQ3_KS": (iq3_ks_packed, 127, 2, 102, False)}


def _scale_fields(type_name: str, raw: np.ndarray) -> np.ndarray:
    """A view of every f16 scale's two bytes [rows, scales, 2]."""
    *_, block, per_block = F16_SCALED[type_name]
    if per_block:
        return raw.reshape(raw.shape[0], -1, block)[..., 0:2]
    return raw[:, None, 0:2]


@pytest.mark.parametrize("type_name", list(F16_SCALED))
@pytest.mark.parametrize("rows", [32, 45])
def test_f16_scaled_iqk_rows_pack_as_the_general_path(type_name: str, rows: int) -> None:
    """Codec-written rows (magnitudes over five decades), then random bytes under their f16 scales (every
    sub-block scale bit, grid half and code), one scale 0 and one -0."""
    packer, c = F16_SCALED[type_name][:2]
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, N)).astype(np.float32) * np.logspace(-3, 2, rows, dtype=np.float32)[:, None]
    written = type_by_name(type_name).require_codec().quantize(x).reshape(rows, -1)
    _assert_same(packer(written, c), _general(type_name, written))
    noise = rng.integers(0, 256, written.shape, dtype=np.uint8)
    scales = _scale_fields(type_name, noise)
    scales[...] = _scale_fields(type_name, written)
    scales[3, 0] = 0
    scales[4, 0] = np.frombuffer(np.float16(-0.0).tobytes(), np.uint8)
    _assert_same(packer(noise, c), _general(type_name, noise))


@pytest.mark.parametrize("type_name", list(F16_SCALED))
@pytest.mark.parametrize("bits", [0x7C00, 0xFE00])
def test_an_f16_scale_not_finite_declines(type_name: str, bits: int) -> None:
    packer, c = F16_SCALED[type_name][:2]
    raw = type_by_name(type_name).require_codec().quantize(
        np.random.default_rng(5).standard_normal((32, N)).astype(np.float32)).reshape(32, -1)
    _scale_fields(type_name, raw)[9, -1] = np.frombuffer(np.uint16(bits).tobytes(), np.uint8)
    assert packer(raw, c) is None
