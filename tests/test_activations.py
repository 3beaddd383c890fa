"""The exact mode's exponential (ikrun/ops/activations.py exp64): libm's to two ulp in float64, and rounded to
float32 nearer e^x than libm's expf wherever the two differ."""

from __future__ import annotations

import numpy as np
from numba import njit

from ikrun.ops.activations import exp64, swiglu


@njit(cache=True)
def _exps(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for j in range(x.shape[0]):
        out[j] = exp64(x[j])
    return out


@njit(cache=True)
def _expf_libm(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for j in range(x.shape[0]):
        out[j] = np.exp(x[j])
    return out


def test_exp64_is_within_two_ulp_of_libm() -> None:
    tiny = np.geomspace(1e-300, 1.0, 20_001)
    x = np.concatenate([-np.geomspace(1e-300, 707.9, 200_001), np.geomspace(1e-300, 708.9, 200_001), tiny - 1,
                        [0.0, -0.0, -1e-320, 0.5 * np.log(2), -0.5 * np.log(2)]])
    got, want = _exps(x), np.exp(x)
    assert np.all(np.abs(got - want) <= 2 * np.spacing(want))
    edges = _exps(np.array([-708.5, -1e4, -np.inf, 709.5, 1e30, np.inf, np.nan]))
    assert edges[:6].tolist() == [0.0, 0.0, 0.0, np.inf, np.inf, np.inf] and np.isnan(edges[6])


def test_exp64_rounded_to_float32_is_nearer_than_expf() -> None:
    x = (np.random.default_rng(0).standard_normal(1_000_000) * 10).astype(np.float32)
    ours = _exps(x.astype(np.float64)).astype(np.float32)
    libm, true = _expf_libm(x), np.exp(x.astype(np.float64))
    differ = ours != libm
    assert differ.any()
    assert np.all(np.abs(ours[differ] - true[differ]) < np.abs(libm[differ] - true[differ]))
    assert np.all(np.abs(ours - true) <= 0.5 * np.spacing(ours))


def test_swiglu_is_silu_times_up_to_an_ulp() -> None:
    rng = np.random.default_rng(1)
    g, u = (rng.standard_normal((3, 500)) * 8).astype(np.float32), rng.standard_normal((3, 500)).astype(np.float32)
    want = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u
    np.testing.assert_allclose(swiglu(g, u), want, rtol=4 * 2**-24, atol=1e-30)
