"""listed_search.nearest_listed against ik's neighbour loop written plainly: the first strict minimum below FLT_MAX."""

import numpy as np
import pytest
from numba import njit

from ikquant.formats.listed_search import nearest_listed, nearest_listed_lanes
from ikquant.formats.numeric import fmaf
from ikquant.formats.vector_ir import whole_vectors

FLT_MAX = np.float32(3.4028235e38)


@njit
def _reference(q: np.ndarray, neg_x: np.ndarray, w: np.ndarray, scale: np.float32, mul: np.float32,
               add: np.float32) -> int:
    best = FLT_MAX
    pos = -1
    for j in range(q.shape[0]):
        d2 = np.float32(0.0)
        for i in range(q.shape[1]):
            diff = fmaf(scale, fmaf(np.float32(q[j, i]), mul, add), neg_x[i])
            d2 = fmaf(w[i] * diff, diff, d2)
        if d2 < best:
            best = d2
            pos = j
    return pos


@njit
def _vector4(dense: np.ndarray, at: int, count: int, neg_x: np.ndarray, w: np.ndarray, scale: np.float32) -> int:
    return nearest_listed(dense, at, count, (neg_x[0], neg_x[1], neg_x[2], neg_x[3]),
                          (w[0], w[1], w[2], w[3]), scale, np.float32(1.0), np.float32(0.0))


@njit
def _vector8(dense: np.ndarray, at: int, count: int, neg_x: np.ndarray, w: np.ndarray, scale: np.float32) -> int:
    return nearest_listed(dense, at, count,
                          (neg_x[0], neg_x[1], neg_x[2], neg_x[3], neg_x[4], neg_x[5], neg_x[6], neg_x[7]),
                          (w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]), scale, np.float32(0.5),
                          np.float32(-1.25))


def _dense(q: np.ndarray, at: int) -> np.ndarray:
    """q [count, group] laid out value-major in whole vectors after `at` bytes of padding (the lists sit at
    offsets)."""
    lanes = whole_vectors(q.shape[0])
    block = np.full((q.shape[1], lanes), 255, dtype=np.uint8)  # padding lanes hold large magnitudes: they must lose
    block[:, : q.shape[0]] = q.T
    return np.concatenate([np.zeros(at, np.uint8), block.ravel()])


@pytest.mark.parametrize("group", [4, 8])
def test_first_least_sum_as_iks_loop(group: int) -> None:
    """Lists of 1-40 points (one to five vectors), ties within and across vectors (repeated points: the earlier
    must win), NaN and infinite weights (no finite sum: -1), scales that make every sum overflow; groups of 8 with
    IQ1_S's stored-to-value map q = v / 2 - 1.25."""
    rng = np.random.default_rng(group)
    vector = _vector4 if group == 4 else _vector8
    cases = 0
    for trial in range(3000):
        count = int(rng.integers(1, 41))
        q = rng.integers(1, 16 if group == 4 else 6, (count, group)).astype(np.uint8)
        if trial % 3 == 0:  # repeated points: equal sums, also in other vectors
            q[rng.integers(0, count, count // 2)] = q[0]
        neg_x = -(rng.random(group) * 12).astype(np.float32)
        w = rng.random(group).astype(np.float32)
        scale = np.float32(rng.random() * 2)
        if trial % 50 == 1:
            w[rng.integers(0, group)] = np.nan
        if trial % 50 == 2:
            w[rng.integers(0, group)] = np.inf
        if trial % 50 == 3:
            scale = np.float32(1e30)
        at = int(rng.integers(0, 5))
        dense = _dense(q, at)
        mul, add = (np.float32(1.0), np.float32(0.0)) if group == 4 else (np.float32(0.5), np.float32(-1.25))
        assert vector(dense, at, count, neg_x, w, scale) == _reference(q, neg_x, w, scale, mul, add), trial
        cases += 1
    assert cases == 3000


@njit
def _lanes(packed: np.ndarray, starts: np.ndarray, counts: np.ndarray, neg_x: np.ndarray, w: np.ndarray,
           scales: np.ndarray) -> np.ndarray:
    out = np.full(8, -7, np.int32)
    nearest_listed_lanes(packed, starts, counts, max(counts.max(), 0), (neg_x[0], neg_x[1], neg_x[2], neg_x[3]),
                         (w[0], w[1], w[2], w[3]), scales, out)
    return out


def test_eight_searches_at_once_as_iks_loop() -> None:
    """nearest_listed_lanes: eight lists (some empty: no search), eight scales, one group of four values; each lane
    the first strict minimum below FLT_MAX of its own list, ties, NaN and infinite weights and overflowing scales
    as in the single search's test."""
    rng = np.random.default_rng(11)
    for trial in range(1000):
        counts = rng.integers(0, 41, 8).astype(np.int32)
        counts[rng.random(8) < 0.2] = 0
        lists = [rng.integers(1, 16, (c, 4)).astype(np.uint8) for c in counts]
        for q in lists[::2]:
            if len(q) and trial % 3 == 0:
                q[rng.integers(0, len(q), len(q) // 2)] = q[0]
        starts = np.cumsum([3, *[len(q) + 5 for q in lists[:-1]]]).astype(np.int32)
        packed = np.full(int(starts[-1]) + 45, 0xFFFFFFFF, np.uint32)  # what lies around a list must never be read
        for s, q in zip(starts, lists):
            packed[s : s + len(q)] = (q.astype(np.uint32) << (8 * np.arange(4, dtype=np.uint32))).sum(axis=1)
        neg_x = -(rng.random(4) * 12).astype(np.float32)
        w = rng.random(4).astype(np.float32)
        scales = (rng.random(8) * 2).astype(np.float32)
        if trial % 50 == 1:
            w[rng.integers(0, 4)] = np.nan
        if trial % 50 == 2:
            w[rng.integers(0, 4)] = np.inf
        if trial % 50 == 3:
            scales[rng.integers(0, 8)] = np.float32(1e30)
        got = _lanes(packed, starts, counts, neg_x, w, scales)
        for lane, q in enumerate(lists):
            want = (_reference(q, neg_x, w, scales[lane], np.float32(1.0), np.float32(0.0)) if len(q) else -1)
            assert got[lane] == want, (trial, lane)
