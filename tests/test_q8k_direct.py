"""IQ4_KS packed for the integer matmul straight from its bytes: the same PackedInts as decoding, converting and
packing (the general path), every field, every bit."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from ikquant.types import type_by_name
from ikrun.numerics.ik.formats import ik_kernel
from ikrun.numerics.ik.q8k_direct import iq4_ks_packed
from ikrun.numerics.ik.qgemm import PackedInts, pack

CODEC = type_by_name("IQ4_KS").require_codec()
N = 512


def _general(raw: np.ndarray) -> PackedInts:
    convert = ik_kernel("IQ4_KS").convert
    assert convert is not None
    return pack(convert(raw, CODEC.dequantize(raw, N)))


def _assert_same(got: PackedInts | None, want: PackedInts) -> None:
    assert got is not None
    for f in fields(PackedInts):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), f.name
        else:
            assert a == b, f.name


def _quantized(rows: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, N)).astype(np.float32)
    x *= np.logspace(-3, 2, rows, dtype=np.float32)[:, None]  # row scales over five decades
    return CODEC.quantize(x).reshape(rows, -1)


@pytest.mark.parametrize("rows", [32, 40, 77])
def test_quantized_rows_pack_as_the_general_path(rows: int) -> None:
    """Rows the codec wrote (not a whole number of 32-row calls but for the first: padding groups too)."""
    raw = _quantized(rows, rows)
    _assert_same(iq4_ks_packed(raw, 127), _general(raw))


def test_every_code_and_sub_block_scale_packs_as_the_general_path() -> None:
    """Random bytes under a valid row scale: every sub-block scale (both grid halves, ls from -127 to 127) and
    code; scale bytes 128/129 (ls = +-1 ... 1: |p| <= 123 < 127) keep whole blocks' integers unconverted."""
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, (64, 4 + 2 * 136), dtype=np.uint8)
    raw[:, :4] = np.frombuffer(np.float32(0.0123).tobytes(), np.uint8)
    raw[48:, 4:12] = rng.choice(np.array([128, 129], np.uint8), (16, 8))  # ls = 1, the shifted grid on 129
    raw[48:, 140:148] = 129
    got = iq4_ks_packed(raw, 127)
    _assert_same(got, _general(raw))
    assert got is not None and (got.scale[-16:] == np.float32(np.float16(0.0123))).all()  # d x 1: kept as is


@pytest.mark.parametrize("d", [0.0, 1e-40, 2.0**-101, 2.0**101, np.inf, np.nan])
def test_a_row_scale_whose_decoding_is_not_exact_declines(d: float) -> None:
    """Zero, subnormal, tiny, huge, infinite and NaN row scales: the direct path declines the whole tensor (the
    general path handles them as ik's float emulation does)."""
    raw = _quantized(32, 3)
    raw[5, :4] = np.frombuffer(np.float32(d).tobytes(), np.uint8)
    assert iq4_ks_packed(raw, 127) is None
