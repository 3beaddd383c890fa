"""IQ2_XXS, IQ2_XS and IQ2_S writing: what ik refuses, the neighbour tables, and bytes independent of threading."""

from __future__ import annotations

import warnings

import numba
import numpy as np
import pytest

from ikquant.errors import QuantInputError
from ikquant.formats.iq2_search import GRIDS, grid_tables
from ikquant.types import type_by_name

IQ2_TYPES = ["IQ2_XXS", "IQ2_XS", "IQ2_S"]


def _rows(rows: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.standard_t(3, (rows, n)) * 0.02).astype(np.float32)
    w = ((rng.standard_normal((64, n)) ** 2).mean(axis=0) * np.exp(rng.standard_normal(n))).astype(np.float32)
    return x, w


@pytest.mark.parametrize("type_name", ["IQ2_XXS", "IQ2_XS"])
def test_no_importance_matrix_is_refused_as_ik_does(type_name: str) -> None:
    x, _ = _rows(2, 256, 0)
    with pytest.raises(QuantInputError, match=f"^{type_name} needs an importance matrix"):
        type_by_name(type_name).require_codec().quantize(x)


def test_iq2_s_quantizes_without_an_importance_matrix() -> None:
    x, _ = _rows(2, 512, 1)
    codec = type_by_name("IQ2_S").require_codec()
    y = codec.dequantize(codec.quantize(x), 512)
    assert np.sqrt(np.mean((y - x) ** 2)) < 0.5 * np.sqrt(np.mean(x**2))


@pytest.mark.parametrize("type_name", IQ2_TYPES)
def test_bytes_do_not_depend_on_the_thread_count(type_name: str) -> None:
    threads = min(2, numba.config.NUMBA_NUM_THREADS)
    if threads < 2:
        pytest.skip("needs 2 Numba threads")
    codec = type_by_name(type_name).require_codec()
    x, w = _rows(6, 1024, 2)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = codec.quantize(x, w)
        numba.set_num_threads(threads)
        two = codec.quantize(x, w)
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(one, two)
    assert np.array_equal(codec.quantize(x[3:4], w), one[3:4])  # a row's bytes depend on that row alone


@pytest.mark.parametrize("type_name", ["IQ2_XXS", "IQ2_XS"])
def test_vanishing_importance_weights_redo_the_row_without_them(type_name: str) -> None:
    codec = type_by_name(type_name).require_codec()
    x, w = _rows(2, 512, 3)
    w[:256] = 0.0
    with warnings.catch_warnings(record=True), np.errstate(all="ignore"):
        warnings.simplefilter("always")
        y = codec.dequantize(codec.quantize(x, w), 512)
    assert np.isfinite(y).all()


@pytest.mark.parametrize("grid", sorted(GRIDS))
def test_neighbour_lists_follow_iks_rule(grid: str) -> None:
    """For sampled off-grid keys: every grid point within the `nearest` smallest distances, by distance then
    index (ik's iq2xs_init_impl), and each grid point maps to itself."""
    tables, nearest = grid_tables(grid), GRIDS[grid][1]
    points = tables.levels
    assert all(tables.kmap[(points[g] << (2 * np.arange(8))).sum()] == g for g in range(len(points)))
    rng = np.random.default_rng(4)
    keys = rng.integers(0, 3, (300, 8))
    for levels in keys:
        key = int((levels << (2 * np.arange(8))).sum())
        if tables.kmap[key] >= 0:
            continue
        dist = ((points - levels[None, :]) ** 2).sum(axis=1)
        limit = np.unique(dist)[nearest - 1]
        want = sorted((int(d), g) for g, d in enumerate(dist) if d <= limit)
        start = -tables.kmap[key] - 1
        listed = tables.neighbours[start + 1 : start + 1 + tables.neighbours[start]]
        assert listed.tolist() == [g for _, g in want]
