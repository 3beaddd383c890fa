"""The trellis types' cell scan (SCAN_LANES members a vector, coordinates stored two a word as bfloat16) against ik's
eight-lane search written out in numpy: scores w * (d * d) summed in ik's tree, each lane's first strict minimum, the
lanes merged in ik's order."""

import numpy as np
from numba import njit

from ikquant.formats.trellis import COORD_PAD, _bin5_scalar, _scan_cell, pair_coordinates


@njit
def _scan8(coords: np.ndarray, start: int, n: int, x: np.ndarray, w: np.ndarray) -> int:
    return _scan_cell(coords, start, n, (x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]),
                      (w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]))


@njit
def _scan4(coords: np.ndarray, start: int, n: int, x: np.ndarray, w: np.ndarray) -> int:
    return _scan_cell(coords, start, n, (x[0], x[1], x[2], x[3]), (w[0], w[1], w[2], w[3]))


def _iks_choice(cell: np.ndarray, x: np.ndarray, w: np.ndarray) -> int:
    t = w[:, None] * np.square(cell.astype(np.float32) - x[:, None])
    if len(x) == 8:
        s = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]))
        order = range(8)
    else:
        s = (t[0] + t[2]) + (t[1] + t[3])
        order = (0, 2, 4, 6, 1, 3, 5, 7)
    best, where = np.full(8, np.inf, np.float32), np.full(8, -1)
    for p, score in enumerate(s):
        if score < best[p % 8]:
            best[p % 8], where[p % 8] = score, p
    top, winner = np.float32(np.inf), 0
    for lane in order:
        if best[lane] < top:
            top, winner = best[lane], int(where[lane])
    return winner


def test_scan_is_iks_eight_lane_search() -> None:
    """Cells of 8 to 72 members (whole vectors and a half-filled last one) from three values, so that equal scores
    fall in every pair of lanes; a cell starts anywhere in the stored rows, and the rows end in their padding."""
    rng = np.random.default_rng(3)
    for group, scan in ((8, _scan8), (4, _scan4)):
        for trial in range(400):
            members = 8 * int(rng.integers(1, 10))
            start = int(rng.integers(0, 5))
            coords = np.zeros((group, start + members + COORD_PAD), dtype=np.int8)
            coords[:, start : start + members] = rng.integers(-1, 2, (group, members))
            x = rng.integers(-1, 2, group).astype(np.float32) * np.float32(0.5)
            w = rng.choice(np.array([0.0, 1.0, 2.5], dtype=np.float32), group)
            if trial % 5 == 0:
                x = rng.standard_normal(group).astype(np.float32)
            want = _iks_choice(coords[:, start : start + members], x, w)
            assert scan(pair_coordinates(coords.astype(np.float32)), start, members, x, w) == want, (group, trial)


def _iks_bin(v: float) -> int:
    for edge, b in ((-48.0, 0), (-16.0, 1), (16.0, 2), (48.0, 3)):
        if v < edge:
            return b
    return 4


def test_bins_are_iks() -> None:
    """IQ4_KT's cell bins at and beside each edge, at the extremes and for NaN (ik's comparisons put it on top)."""
    edges = np.array([-48.0, -16.0, 16.0, 48.0], dtype=np.float32)
    values = np.concatenate([edges, np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(-np.inf)),
                             np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3e38, -3e38], dtype=np.float32)])
    for v in values:
        assert _bin5_scalar(v) == _iks_bin(float(v)), v


def test_paired_coordinates_are_the_values() -> None:
    """Every codebook value (-126..126) in either half of a word reads back exactly, beside any other value."""
    values = np.arange(-126, 127, dtype=np.float32)
    grid = np.stack([np.repeat(values, values.size), np.tile(values, values.size)])
    words = pair_coordinates(grid)
    assert words.shape == (1, values.size**2) and words.dtype == np.uint32
    low = (words << np.uint32(16)).view(np.float32)
    high = (words & np.uint32(0xFFFF0000)).view(np.float32)
    assert np.array_equal(low[0], grid[0]) and np.array_equal(high[0], grid[1])
