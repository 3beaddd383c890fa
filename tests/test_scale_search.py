"""make_qkx3_blocks and make_qkx2_blocks (several blocks' trial scales side by side) against make_qkx3_quants and
make_qkx2_quants block by block: the same codes, scales and mins, bit for bit, on blocks that take every branch (flat blocks, all-positive blocks, zeros of
both signs, a lone outlier) and block counts that leave a remainder."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from ikquant.formats.kquants import make_qkx2_blocks, make_qkx2_quants, qkx2_scratch
from ikquant.formats.scale_search import LANES, LANES32, make_qkx3_blocks, make_qkx3_quants, qkx3_scratch


@njit(cache=True)
def _one_by_one(nmax: int, x: np.ndarray, w: np.ndarray, L: np.ndarray, fused: bool, scales: np.ndarray,
                mins: np.ndarray) -> None:
    for b in range(x.shape[0]):
        scales[b], mins[b] = make_qkx3_quants(nmax, x[b], w[b], L[b], fused)


def _blocks(n: int, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, n)).astype(np.float32)
    w = (rng.lognormal(0, 1, (count, n)) * (x * x + 1)).astype(np.float32)
    special = [np.full(n, 0.25), np.abs(rng.standard_normal(n)), np.zeros(n), np.where(np.arange(n) % 2, 0.0, -0.0),
               np.where(np.arange(n) == 3, 40.0, 0.01), -np.abs(rng.standard_normal(n)), np.full(n, -1e-12)]
    for i, row in enumerate(special[:count]):
        x[i] = row
    w[min(count - 1, 8)] = 0.0  # a block whose weights vanish (its fit divides 0 by 0)
    return x, w


@pytest.mark.parametrize("n, nmax, fused", [(32, 15, False), (32, 31, False), (16, 3, True)])
@pytest.mark.parametrize("count", [1, LANES - 1, LANES, 2 * LANES + 3, 64])
def test_blocks_equal_one_by_one(n: int, nmax: int, fused: bool, count: int) -> None:
    x, w = _blocks(n, count, seed=count + n + nmax)
    got = (np.zeros((count, n), np.uint8), np.zeros(count, np.float32), np.zeros(count, np.float32))
    want = (np.zeros((count, n), np.uint8), np.zeros(count, np.float32), np.zeros(count, np.float32))
    make_qkx3_blocks(nmax, x, w, got[0], fused, got[1], got[2], qkx3_scratch(n))
    _one_by_one(nmax, x, w, want[0], fused, want[1], want[2])
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1].view(np.uint32), want[1].view(np.uint32))
    np.testing.assert_array_equal(got[2].view(np.uint32), want[2].view(np.uint32))


@njit(cache=True)
def _qkx2_one_by_one(nmax: int, x: np.ndarray, w: np.ndarray, L: np.ndarray, rmin: np.float32, use_mad: bool,
                     fused: bool, scales: np.ndarray, mins: np.ndarray) -> None:
    laux = np.empty(x.shape[1], np.uint8)
    for b in range(x.shape[0]):
        scales[b], mins[b] = make_qkx2_quants(nmax, x[b], w[b], L[b], laux, rmin, np.float32(0.1), 20, use_mad, fused)


@pytest.mark.parametrize("n, nmax, rmin, use_mad, fused", [(32, 15, -1.0, False, False), (32, 31, -0.5, False, False),
                                                            (16, 3, -0.5, True, True)])
@pytest.mark.parametrize("count", [1, LANES32 - 1, LANES32, 2 * LANES32 + 3, 64])
def test_qkx2_blocks_equal_one_by_one(n: int, nmax: int, rmin: float, use_mad: bool, fused: bool,
                                      count: int) -> None:
    """make_qkx2_blocks (eight blocks' float32 trials side by side) against make_qkx2_quants block by block."""
    x, w = _blocks(n, count, seed=3 * count + n + nmax)
    w = np.abs(x) + np.float32(0.5) * np.abs(w) ** 0.25  # ik's reference weights are |x|-based; one block all 0
    w[min(count - 1, 8)] = 0.0
    got = (np.zeros((count, n), np.uint8), np.zeros(count, np.float32), np.zeros(count, np.float32))
    want = (np.zeros((count, n), np.uint8), np.zeros(count, np.float32), np.zeros(count, np.float32))
    make_qkx2_blocks(nmax, x, w.astype(np.float32), got[0], np.float32(rmin), np.float32(0.1), 20, use_mad, fused,
                     got[1], got[2], qkx2_scratch(n))
    _qkx2_one_by_one(nmax, x, w.astype(np.float32), want[0], np.float32(rmin), use_mad, fused, want[1], want[2])
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1].view(np.uint32), want[1].view(np.uint32))
    np.testing.assert_array_equal(got[2].view(np.uint32), want[2].view(np.uint32))
