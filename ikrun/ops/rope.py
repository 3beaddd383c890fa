"""Rotary position embedding in ggml's two layouts.

ggml builds the angles the way its rope cache does: theta starts at the (scaled) position and is multiplied by
theta_scale = base^(-2/n_rot) once per pair, in float32, optionally divided by per-frequency factors (rope_freqs).
NORM rotates adjacent pairs (x[2i], x[2i+1]); NEOX rotates (x[i], x[i + n_rot/2]).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikrun.ops.parallel import pick


@njit(cache=True, nogil=True)
def _angles(positions: np.ndarray, n_rot: int, base: float, freq_scale: float, factors: np.ndarray,
            cos: np.ndarray, sin: np.ndarray) -> None:
    theta_scale = np.float32(np.float32(base) ** (np.float32(-2.0) / np.float32(n_rot)))
    for p in range(positions.shape[0]):
        theta = np.float32(freq_scale) * np.float32(positions[p])
        for i in range(n_rot // 2):
            t = theta / factors[i] if factors.size else theta
            cos[p, i] = np.cos(t)
            sin[p, i] = np.sin(t)
            theta = theta * theta_scale


def rope_cache(positions: np.ndarray, n_rot: int, base: float, freq_scale: float = 1.0,
               factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [n_pos, n_rot/2] for the given positions."""
    n = len(positions)
    cos = np.empty((n, n_rot // 2), dtype=np.float32)
    sin = np.empty_like(cos)
    f = np.empty(0, dtype=np.float32) if factors is None else np.ascontiguousarray(factors, dtype=np.float32)
    _angles(np.asarray(positions, dtype=np.int64), n_rot, float(base), float(freq_scale), f, cos, sin)
    return cos, sin


@njit(cache=True, nogil=True, inline="always")
def _row(x: np.ndarray, c_row: np.ndarray, s_row: np.ndarray, n_rot: int, neox: bool) -> None:
    half = n_rot // 2
    for h in range(x.shape[0]):
        for i in range(half):
            c = c_row[i]
            s = s_row[i]
            if neox:
                a = x[h, i]
                b = x[h, i + half]
                x[h, i] = a * c - b * s
                x[h, i + half] = a * s + b * c
            else:
                a = x[h, 2 * i]
                b = x[h, 2 * i + 1]
                x[h, 2 * i] = a * c - b * s
                x[h, 2 * i + 1] = a * s + b * c


@njit(cache=True, nogil=True)
def _serial(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, neox: bool) -> None:
    for p in range(x.shape[0]):
        _row(x[p], cos[p], sin[p], n_rot, neox)


@njit(cache=True, nogil=True, parallel=True)
def _parallel(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, neox: bool) -> None:
    for p in prange(x.shape[0]):
        _row(x[p], cos[p], sin[p], n_rot, neox)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, neox: bool) -> None:
    """Rotate the first n_rot dims of every head of x [n_pos, heads, head_dim] in place."""
    pick(_serial, _parallel, x.size)(x, cos, sin, n_rot, neox)
