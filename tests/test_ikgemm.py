"""ik's float kernels (ikrun/numerics/ik/ikgemm.py) against their arithmetic written out with numpy: 16 lanes (8 in
its AVX2 build) of fused multiply-adds along the row and ik's tree over the lanes (f32/f16), the vdpbf16ps pairs
(bf16)."""

from __future__ import annotations

import numpy as np
import pytest

from ikquant.formats.numeric import f32_to_bf16_bits
from ikrun.numerics.ik.ikgemm import ik_float_matmul
from tests.test_numerics import bf16_bits_to_f32
from tests.test_qgemm import _fma32


def _tree(acc: np.ndarray) -> np.ndarray:
    """[..., 16] or [..., 8] lanes added as ik's reduction adds them."""
    t = acc[..., 8:] + acc[..., :8] if acc.shape[-1] == 16 else acc
    u = t[..., 4:] + t[..., :4]
    return (u[..., 0] + u[..., 2]) + (u[..., 1] + u[..., 3])


def _reference(x: np.ndarray, w: np.ndarray, bf16: bool, lanes: int = 16) -> np.ndarray:
    xs, ws = x[:, None, :], w[None, :, :]
    if bf16:  # per 32 values, lane l: value 2l + 1 then 2l
        acc = np.zeros((x.shape[0], w.shape[0], 16), np.float32)
        for b in range(0, x.shape[1], 32):
            for first in (1, 0):
                lanes = slice(b + first, b + 32, 2)
                acc = _fma32(xs[..., lanes], ws[..., lanes], acc)
        return _tree(acc)
    acc = (xs[..., :lanes] * ws[..., :lanes]).astype(np.float32)
    for c in range(lanes, x.shape[1], lanes):
        acc = _fma32(xs[..., c : c + lanes], ws[..., c : c + lanes], acc)
    return _tree(acc)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(3, 5, 64), (17, 70, 256), (9, 64, 1024), (40, 64, 1024)])
def test_float_kernels_are_iks_arithmetic(bf16: bool, m: int, n: int, k: int) -> None:
    """Every output bit equals the written-out order (row counts that are no whole group of 4 or 64 rows; 40
    activation rows of 1,024 values: a block of 30 that stays in the cache, then 10); a plain float64 product
    differs, so the order is what is tested."""
    rng = np.random.default_rng(k + bf16)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 100, (m, 1))).astype(np.float32)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 10, (n, 1))).astype(np.float32)
    if bf16:
        x, w = bf16_bits_to_f32(f32_to_bf16_bits(x)).reshape(x.shape), bf16_bits_to_f32(f32_to_bf16_bits(w)).reshape(w.shape)
    got = ik_float_matmul(x, w, bf16)
    np.testing.assert_array_equal(got, _reference(x, w, bf16))
    assert np.any(got != (x.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32))


@pytest.mark.parametrize(("m", "n", "k"), [(3, 5, 64), (17, 70, 256), (13, 64, 1024), (40, 70, 1024)])
def test_avx2_float_kernel_is_iks_arithmetic(m: int, n: int, k: int) -> None:
    """The AVX2 build's 8 lanes, in grids of 2 activation rows (13 rows: six-row groups and a leftover row); the
    16-lane order gives other bits, so the lane count is what is tested."""
    rng = np.random.default_rng(k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.01, 100, (m, 1))).astype(np.float32)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 10, (n, 1))).astype(np.float32)
    got = ik_float_matmul(x, w, lanes=8)
    np.testing.assert_array_equal(got, _reference(x, w, False, 8))
    assert np.any(got != _reference(x, w, False))


@pytest.mark.parametrize(("bits", "bf16"), [("f16", False), ("bf16", False), ("bf16", True)])
@pytest.mark.parametrize("lanes", [16, 8])
def test_weights_given_as_their_16_bit_patterns_give_the_same_bits(bits: str, bf16: bool, lanes: int) -> None:
    """F16 (uint16) and BF16 (int16) weights widened as the kernels load them: the bits of their float32 values,
    in every kernel that takes them (f32/f16 of 16 and 8 lanes, bf16), including the rows past whole groups."""
    if bf16 and lanes == 8:
        pytest.skip("the bf16 kernel is AVX-512's (16 lanes)")
    rng = np.random.default_rng(lanes + bf16)
    x = (rng.standard_normal((17, 256)) * rng.uniform(0.01, 100, (17, 1))).astype(np.float32)
    w = (rng.standard_normal((70, 256)) * rng.uniform(0.01, 10, (70, 1))).astype(np.float32)
    if bits == "f16":
        patterns = w.astype(np.float16).view(np.uint16)
        values = patterns.view(np.float16).astype(np.float32)
    else:
        patterns = f32_to_bf16_bits(w).reshape(w.shape).view(np.int16)
        values = bf16_bits_to_f32(patterns.view(np.uint16)).reshape(w.shape)
    if bf16:
        x = bf16_bits_to_f32(f32_to_bf16_bits(x)).reshape(x.shape)
    want = ik_float_matmul(x, values, bf16, lanes)
    np.testing.assert_array_equal(ik_float_matmul(x, patterns, bf16, lanes).view(np.uint32), want.view(np.uint32))


def test_rows_the_kernels_do_not_take_whole_are_refused() -> None:
    with pytest.raises(ValueError, match="multiples of 32"):
        ik_float_matmul(np.zeros((2, 48), np.float32), np.zeros((3, 48), np.float32), bf16=True)
    with pytest.raises(ValueError, match="multiples of 16"):
        ik_float_matmul(np.zeros((2, 40), np.float32), np.zeros((3, 40), np.float32))
