"""The split searches' block sort (ordering.stable_order) against numpy's stable argsort."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from ikquant.formats.ordering import stable_order


@numba.njit(cache=True)
def _order(x: np.ndarray) -> np.ndarray:
    order = np.full(x.size, -1, np.int64)
    stable_order(x, order)
    return order


@pytest.mark.parametrize("n", [16, 32])
def test_stable_order_is_a_stable_ascending_sort(n: int) -> None:
    rng = np.random.default_rng(3)
    for _ in range(300):
        x = rng.standard_normal(n).astype(np.float32)
        if rng.random() < 0.5:  # ties, and zeros of both signs (equal, so kept in position order)
            x = rng.choice(np.array([-1.5, -0.0, 0.0, 0.25, 2.0], np.float32), n)
        assert np.array_equal(_order(x), np.argsort(x, kind="stable"))
