"""Causal depthwise convolution with a residual, as openPangu's MoME sites use it (ik's ggml_ssm_conv + add).

For every channel c of x [T, C] and a kernel w [C, K]:

    out[t, c] = x[t, c] + sum_{k=0}^{K-1} w[c, k] * x[t - (K-1) + k, c]

with the positions before the sequence start read as 0: ik resets the conv state whenever a batch starts at
position 0, which every evaluated chunk does. The taps are summed from 0 in order k = 0..K-1 in float32, as ggml's
ssm_conv does, then the input is added; `fused` (--numerics ik): each tap as the fused multiply-add ik's compiled
ssm_conv computes (GCC contracts it), else rounded apart.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import fmaf
from ikrun.ops.parallel import pick


@njit(cache=True, nogil=True, inline="always")
def _row(x: np.ndarray, w: np.ndarray, t: int, fused: bool, out: np.ndarray) -> None:
    n_tap = w.shape[1]
    for c in range(x.shape[1]):
        acc = np.float32(0.0)
        for k in range(n_tap):
            src = t - (n_tap - 1) + k
            if src >= 0:
                acc = fmaf(w[c, k], x[src, c], acc) if fused else acc + w[c, k] * x[src, c]
        out[t, c] = x[t, c] + acc


@njit(cache=True, nogil=True)
def _serial(x: np.ndarray, w: np.ndarray, fused: bool, out: np.ndarray) -> None:
    for t in range(x.shape[0]):
        _row(x, w, t, fused, out)


@njit(cache=True, nogil=True, parallel=True)
def _parallel(x: np.ndarray, w: np.ndarray, fused: bool, out: np.ndarray) -> None:
    for t in prange(x.shape[0]):
        _row(x, w, t, fused, out)


def causal_conv_residual(x: np.ndarray, w: np.ndarray, fused: bool = False) -> np.ndarray:
    """x + causal depthwise conv(x) for x [T, C] (a fresh sequence), w [C, K]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if w.ndim != 2 or w.shape[0] != x.shape[1]:
        raise ValueError(f"conv kernel {list(w.shape)} does not fit {x.shape[1]} channels")
    out = np.empty_like(x)
    pick(_serial, _parallel, x.size)(x, np.ascontiguousarray(w, dtype=np.float32), fused, out)
    return out
