"""ikrun.ops.f16.f16_rounded against numpy's float16 round trip, bit for bit (NaN: a NaN)."""

import numpy as np
import pytest

from ikrun.ops.f16 import f16_rounded


def _same(x: np.ndarray) -> None:
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    got = f16_rounded(x)
    assert got.shape == x.shape and got.dtype == np.float32
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_every_4093rd_float32_bit_pattern() -> None:
    _same(np.arange(0, 2**32, 4093, dtype=np.uint64).astype(np.uint32).view(np.float32))


@pytest.mark.parametrize("value", [0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.99, 65520.0, 6e-8, 2.9802322e-08,
                                   -2.9802326e-08, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 5.96e-8 * 1.5])
def test_ties_overflow_and_subnormals(value: float) -> None:
    _same(np.full(3, value, np.float32))


def test_strided_input_keeps_its_shape() -> None:
    x = np.random.default_rng(0).standard_normal((40, 30)).astype(np.float32) * 1e3
    _same(x[:, ::3])
    _same(x.T)
