"""The IQK searches' vectorised grid lookups against ik's own lookup (table entry, then a midpoint comparison)."""

import numpy as np
from numba import njit

from ikquant.formats.iqk_grids import grid, lane_sums, nearest, nearest_plain_iq3
from ikquant.formats.numeric import fmaf
from ikquant.formats.vector_ir import LANES


@njit
def _scalar_sums(kind: int, base: int, xb: np.ndarray, wb: np.ndarray, inv: np.ndarray, sumqx: np.ndarray,
                 sumq2: np.ndarray) -> None:
    """lane_sums as ik forms them: one trial at a time, each value looked up with ik's table (nearest)."""
    values = grid(kind)[0]
    for lane in range(inv.size):
        sumqx[lane] = np.float32(0.0)
        sumq2[lane] = np.float32(0.0)
        for j in range(xb.size):
            q = values[base + nearest(kind, base, inv[lane] * xb[j])]
            wq = wb[j] * q
            sumqx[lane] = fmaf(wq, xb[j], sumqx[lane])
            sumq2[lane] = fmaf(wq, q, sumq2[lane])


@njit
def _sum_mismatches(xs: np.ndarray, inv: np.ndarray) -> int:
    """Rows of 16 values of xs through lane_sums and the scalar sums, for both halves of every grid; counts lanes
    whose sums differ in any bit."""
    bad = 0
    got = np.empty((2, inv.size), dtype=np.float32)
    want = np.empty((2, inv.size), dtype=np.float32)
    wb = np.linspace(0.25, 4.0, 16).astype(np.float32)
    for kind in (3, 4, 5, 6):
        n = grid(kind)[3]
        for base in (0, n):
            for start in range(0, xs.size - 15, 16):
                xb = xs[start : start + 16]
                lane_sums(kind, base, xb, wb, inv, got[0], got[1])
                _scalar_sums(kind, base, xb, wb, inv, want[0], want[1])
                for lane in range(inv.size):
                    same_qx = got[0, lane] == want[0, lane] or (np.isnan(got[0, lane]) and np.isnan(want[0, lane]))
                    same_q2 = got[1, lane] == want[1, lane] or (np.isnan(got[1, lane]) and np.isnan(want[1, lane]))
                    bad += not (same_qx and same_q2)
    return bad


@njit
def _plain_iq3_mismatches(xs: np.ndarray) -> int:
    bad = 0
    for x in xs:
        if nearest_plain_iq3(x) != nearest(3, 0, x):
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


def test_lane_sums_are_iks_lookups() -> None:
    """Every input of _inputs (each slot, both sides of each midpoint, NaN, infinities, int32's edges) in every
    lane: trial scale 1 reaches them as they are, the other scales move them across slots and out of int32."""
    inv = np.array([1.0, -1.0, 0.5, -2.0, 1e-3, 7.25, -1e9, 0.0, 3.0, -0.75, 2e5, 1.0 / 3.0, -13.0, 1.5, 0.1, -8.0],
                   dtype=np.float32)
    assert inv.size % LANES == 0
    assert _sum_mismatches(_inputs(), inv) == 0


def test_midpoint_count_is_iks_plain_iq3_lookup() -> None:
    """nearest_plain_iq3 (IQ2_KL's search in vector lanes) on the same inputs, and on every 4093rd float32."""
    every = (np.arange(0, 1 << 32, 4093, dtype=np.uint64)).astype(np.uint32).view(np.float32)
    assert _plain_iq3_mismatches(_inputs()) == 0
    assert _plain_iq3_mismatches(every) == 0
