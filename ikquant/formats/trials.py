"""The i-quant searches' trials side by side: a sub-block tried at every inverse scale at once.

ik's searches (IQ2_XXS/XS/S, IQ3_XXS/S) try a sub-block at a dozen or more inverse scales, one after another: round
every value, replace the groups that fell off the grid, fit, compare with the best so far. Each trial depends on
nothing but its own scale, so the searches here round all trials first (values outer, trials in vector lanes), then
search the off-grid groups, then form every trial's fit as its own chain of multiply-adds in ik's order (again the
trials in lanes), and compare the fits in ik's order last: the same bits as the loop, with the rounding and the
fits vectorised.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ikquant.formats.numeric import fmaf

NJIT = dict(cache=True, nogil=True, error_model="numpy")


@njit(**NJIT)
def fit_trials(weight: np.ndarray, xval: np.ndarray, levels_t: np.ndarray, sumqx: np.ndarray,
               sumq2: np.ndarray) -> None:
    """sum w x q and sum w q^2 (q = 2 l + 1) of every trial's levels levels_t[i, t]: each trial's sums one chain over
    i, as ik forms them one trial at a time."""
    for t in range(sumqx.size):
        sumqx[t] = np.float32(0.0)
        sumq2[t] = np.float32(0.0)
    for i in range(xval.size):
        w = weight[i]
        wx = w * xval[i]
        for t in range(sumqx.size):
            q = np.float32(2 * levels_t[i, t] + 1)
            sumqx[t] = fmaf(wx, q, sumqx[t])
            sumq2[t] = fmaf(w * q, q, sumq2[t])


@njit(**NJIT)
def best_trial(sumqx: np.ndarray, sumq2: np.ndarray, best: np.float32,
               scale: np.float32) -> tuple[int, np.float32, np.float32]:
    """ik's comparison of the trials in order: (the last trial that improved on best, or -1 when none did; the best
    sumqx^2 / sumq2; its scale sumqx / sumq2, else `scale` unchanged)."""
    chosen = -1
    for t in range(sumqx.size):
        if sumq2[t] > 0 and sumqx[t] * sumqx[t] > best * sumq2[t]:
            scale = sumqx[t] / sumq2[t]
            best = scale * sumqx[t]
            chosen = t
    return chosen, best, scale
