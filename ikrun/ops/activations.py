"""Element-wise activations."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikrun.ops.parallel import pick


@njit(cache=True, nogil=True, inline="always")
def _row(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    for j in range(gate.shape[0]):
        g = gate[j]
        out[j] = (g / (np.float32(1.0) + np.exp(-g))) * up[j]


@njit(cache=True, nogil=True)
def _serial(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    for i in range(gate.shape[0]):
        _row(gate[i], up[i], out[i])


@njit(cache=True, nogil=True, parallel=True)
def _parallel(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    for i in prange(gate.shape[0]):
        _row(gate[i], up[i], out[i])


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, as ggml's fused up-gate computes it."""
    gate = np.ascontiguousarray(gate, dtype=np.float32)
    d = gate.shape[-1]
    out = np.empty_like(gate)
    pick(_serial, _parallel, gate.size)(gate.reshape(-1, d), np.ascontiguousarray(up, dtype=np.float32).reshape(-1, d),
                                        out.reshape(-1, d))
    return out
