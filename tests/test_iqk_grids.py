"""The IQK searches' branch-free grid lookup against ik's own lookup (table entry, then a midpoint comparison)."""

import numpy as np
from numba import njit

from ikquant.formats.iqk_grids import grid, nearest, nearest_plain_iq3, nearest_value, nearest_value_counted


@njit
def _mismatches(xs: np.ndarray) -> int:
    bad = 0
    for kind in (3, 4, 5, 6):
        values = grid(kind)[0]
        n = grid(kind)[3]
        for base in (0, n):
            for x in xs:
                if nearest_value(kind, base, x) != values[base + nearest(kind, base, x)]:
                    bad += 1
    return bad


@njit
def _plain_iq3_mismatches(xs: np.ndarray) -> int:
    bad = 0
    for x in xs:
        if nearest_plain_iq3(x) != nearest(3, 0, x):
            bad += 1
    return bad


@njit
def _counted_mismatches(xs: np.ndarray) -> int:
    bad = 0
    for kind in (3, 4, 5):
        n = grid(kind)[3]
        for base in (0, n):
            for x in xs:
                if nearest_value_counted(kind, base, x) != nearest_value(kind, base, x):
                    bad += 1
    return bad


def _inputs() -> np.ndarray:
    """Every slot of every table, both sides of each midpoint, the clamps at both ends, and what ik's truncation
    does with NaN and values beyond int32."""
    rng = np.random.default_rng(0)
    xs = np.concatenate([np.arange(-300, 300, 1 / 64), rng.standard_normal(200_000) * 80,
                         [np.nan, np.inf, -np.inf, 3e9, -3e9, 2147483520.0, -2147483520.0, 2147483648.0,
                          -2147483648.0, 0.0, -0.0]])
    xs = xs.astype(np.float32)
    return np.concatenate([xs, np.nextafter(xs, np.float32(np.inf)), np.nextafter(xs, np.float32(-np.inf))])


def test_nearest_value_is_iks_lookup() -> None:
    assert _mismatches(_inputs()) == 0


def test_midpoint_count_is_iks_plain_iq3_lookup() -> None:
    """nearest_plain_iq3 (IQ2_KL's search in vector lanes) on the same inputs, and on every 4093rd float32."""
    every = (np.arange(0, 1 << 32, 4093, dtype=np.uint64)).astype(np.uint32).view(np.float32)
    assert _plain_iq3_mismatches(_inputs()) == 0
    assert _plain_iq3_mismatches(every) == 0


def test_midpoint_sums_are_iks_lookup() -> None:
    """nearest_value_counted (the IQK searches' trials in vector lanes) on the same inputs, and on every 4093rd
    float32, for both halves of grids 3, 4 and 5."""
    every = (np.arange(0, 1 << 32, 4093, dtype=np.uint64)).astype(np.uint32).view(np.float32)
    assert _counted_mismatches(_inputs()) == 0
    assert _counted_mismatches(every) == 0
