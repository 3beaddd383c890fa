"""The IQ4 grids' sub-block lookup (ikquant/formats/grid_lookup.py): its AVX-512 permutes and its scalar loop."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from ikquant.cpu import host_has
from ikquant.formats.grid_lookup import _looked_up, _permuted
from ikquant.formats.iqk_grids import IQ4K


@njit(cache=True)
def _both(row: np.ndarray, scales: np.ndarray, p: np.ndarray, q: np.ndarray) -> None:
    for m in range(len(scales) // 2):
        off, off_high = 16 * (m % 2), 16 * ((m // 2) % 2)
        _permuted(row, 16 * m, IQ4K, off, scales[2 * m], off_high, scales[2 * m + 1], p, 32 * m)
        _looked_up(row, 16 * m, IQ4K, off, scales[2 * m], off_high, scales[2 * m + 1], q, 32 * m)


@pytest.mark.skipif(not host_has("avx512f"), reason="the permuted lookup needs AVX-512")
def test_the_permuted_lookup_gives_the_scalar_loops_products() -> None:
    """Every byte (both nibbles), both grid halves in each half, scales of both signs, zero and subnormal: the
    same float32 products bit for bit."""
    rng = np.random.default_rng(0)
    row = np.arange(256, dtype=np.uint8)
    scales = np.concatenate([rng.standard_normal(28), [0.0, -0.0, 1e-42, -3e38]]).astype(np.float32)
    p, q = np.full(16 * len(scales), np.nan, np.float32), np.zeros(16 * len(scales), np.float32)
    _both(row, scales, p, q)
    np.testing.assert_array_equal(p.view(np.uint32), q.view(np.uint32))
