"""IQ4_KSS's scale search in vector lanes against the same trials formed one at a time with the scalar group
repair (ik's prune_iq4ks as the final pass runs it)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from numba import njit

from ikquant.formats.iq4kss_lanes import iq4kss_lane_sums
from ikquant.formats.iqk_grids import IQ4_SLOT_HIGH, IQ4_SLOT_LOW, IQ4K, slot_values
from ikquant.formats.iqk_ks import _iq4kss_group
from ikquant.formats.numeric import fmaf
from ikquant.formats.vector_ir import LANES


@njit
def _scalar_sums(xb: np.ndarray, w: np.ndarray, off: int, inv: np.ndarray, dls: np.ndarray, sumqx: np.ndarray,
                 sumq2: np.ndarray) -> None:
    for lane in range(inv.size):
        qx = np.float32(0.0)
        q2 = np.float32(0.0)
        for k in range(8):
            codes = _iq4kss_group(xb, w, k, off, inv[lane], dls[lane])
            for j in range(4):
                pos = 2 * k + (j >> 1) + 16 * (j & 1)
                q = IQ4K[off + codes[j]]
                wq = w[pos] * q
                qx = fmaf(wq, xb[pos], qx)
                q2 = fmaf(wq, q, q2)
        sumqx[lane] = qx
        sumq2[lane] = q2


@njit
def _lane_sums(xb: np.ndarray, w: np.ndarray, off: int, inv: np.ndarray, dls: np.ndarray, sumqx: np.ndarray,
               sumq2: np.ndarray) -> None:
    low, high = slot_values(4)
    h = off // 16
    iq4kss_lane_sums(xb, w, inv, dls, low[h], high[h], IQ4_SLOT_LOW, IQ4_SLOT_HIGH, IQ4K[:16], IQ4K[off : off + 16],
                     np.int64(IQ4K[off]), 241, sumqx, sumq2)


def test_lane_sums_are_the_scalar_trials() -> None:
    """Sub-blocks of gaussian, heavy-tailed, sparse and single-outlier values, zero and spread weights; trial
    scales around each half's start (as the search makes them) and far beyond the grid (slots past the table's
    ends), each lane's repair scale its own or a sign partner's."""
    rng = np.random.default_rng(7)
    checked = 0
    for case in range(400):
        kind = case % 4
        x = rng.standard_normal(32).astype(np.float32)
        if kind == 1:
            x = rng.standard_t(2, 32).astype(np.float32)
        elif kind == 2:
            x[rng.random(32) < 0.7] = 0.0
        elif kind == 3:
            x[rng.integers(32)] *= np.float32(40.0)
        w = rng.lognormal(0.0, 1.5, 32).astype(np.float32)
        w[rng.random(32) < 0.1] = 0.0
        vmax = x[np.argmax(np.abs(x))]
        for off in (0, 16):
            inv = np.zeros(4 * LANES, dtype=np.float32)
            dls = np.zeros(4 * LANES, dtype=np.float32)
            for t in range(15):
                inv[2 * t] = np.float32(t - 7 + int(IQ4K[off])) / vmax
                inv[2 * t + 1] = -inv[2 * t]
                dls[2 * t] = dls[2 * t + 1] = np.float32(1.0) / inv[2 * t]
            inv[30:] = rng.standard_normal(inv.size - 30).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 9)
            dls[30:] = rng.standard_normal(inv.size - 30).astype(np.float32)
            got = np.empty((2, inv.size), dtype=np.float32)
            want = np.empty((2, inv.size), dtype=np.float32)
            _lane_sums(x, w, off, inv, dls, got[0], got[1])
            _scalar_sums(x, w, off, inv, dls, want[0], want[1])
            assert np.array_equal(got.view(np.int32), want.view(np.int32)), (case, off)
            checked += inv.size
    assert checked == 400 * 2 * 4 * LANES


def test_ties_and_unscorable_groups_go_as_iks() -> None:
    """Crafted at scale 1 on the plain half: -29.5 rounds to code 5 (-35), whose two parity moves, codes 4 (-49)
    and 7 (-10), cost the same; group 0 holds one such value (ik moves it to the lower code), group 1 two equal
    ones (ik moves the first), the other codes sit on the grid with weights that make moving them dear. A lane
    whose repair scale makes every score of group 0 NaN (inf - inf: each move's value overflows) takes ik's
    fallback there: code 0 set to 0."""
    x = np.full(32, 113.0, dtype=np.float32)
    w = np.full(32, 1000.0, dtype=np.float32)
    x[[0, 16, 1, 17]] = [-29.5, 53.0, 89.0, -127.0]  # codes 5, 12, 14, 0: seven bits, odd
    x[[2, 18, 3, 19]] = [-29.5, -29.5, 1.0, 13.0]  # codes 5, 5, 8, 9: seven bits, odd
    w[[0, 2, 18]] = 1.0
    inv = np.zeros(LANES, dtype=np.float32)
    dls = np.zeros(LANES, dtype=np.float32)
    inv[:2] = 1.0
    dls[0] = 1.0
    dls[1] = 1e38
    got = np.empty((2, LANES), dtype=np.float32)
    want = np.empty((2, LANES), dtype=np.float32)
    _lane_sums(x, w, 0, inv, dls, got[0], got[1])
    _scalar_sums(x, w, 0, inv, dls, want[0], want[1])
    assert np.array_equal(got.view(np.int32), want.view(np.int32))
    codes = _iq4kss_group(x, w, 0, 0, np.float32(1.0), np.float32(1.0))
    assert codes == (4, 12, 14, 0)
    assert _iq4kss_group(x, w, 1, 0, np.float32(1.0), np.float32(1.0)) == (4, 5, 8, 9)
    assert _iq4kss_group(x, w, 0, 0, np.float32(1.0), np.float32(1e38)) == (0, 12, 14, 0)


def test_gathered_tables_where_there_is_no_avx512(tmp_path: Path) -> None:
    """A CPU without AVX-512 VL (NUMBA_CPU_NAME=haswell) looks the repair's values up by gathers, not permutes: the
    same lane sums."""
    program = ("from ikquant.formats import iq4kss_lanes\n"
               "assert not iq4kss_lanes.PERMUTE16\n"
               "from tests import test_iq4kss_lanes as t\n"
               "t.test_lane_sums_are_the_scalar_trials()\n")
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    subprocess.run([sys.executable, "-c", program], env=env, check=True, cwd=Path(__file__).resolve().parent.parent)
