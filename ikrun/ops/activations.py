"""Element-wise activations."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikrun.ops.parallel import pick


@njit(cache=True, nogil=True, inline="always")
def _row(gate: np.ndarray, up: np.ndarray, limit: np.float32, out: np.ndarray) -> None:
    for j in range(gate.shape[0]):
        g = min(gate[j], limit)
        u = max(-limit, min(up[j], limit))
        out[j] = (g / (np.float32(1.0) + np.exp(-g))) * u


@njit(cache=True, nogil=True)
def _serial(gate: np.ndarray, up: np.ndarray, limit: float, out: np.ndarray) -> None:
    for i in range(gate.shape[0]):
        _row(gate[i], up[i], np.float32(limit), out[i])


@njit(cache=True, nogil=True, parallel=True)
def _parallel(gate: np.ndarray, up: np.ndarray, limit: float, out: np.ndarray) -> None:
    for i in prange(gate.shape[0]):
        _row(gate[i], up[i], np.float32(limit), out[i])


def swiglu(gate: np.ndarray, up: np.ndarray, limit: float = np.inf) -> np.ndarray:
    """silu(gate) * up, as ggml's fused up-gate computes it; a finite `limit` first clamps gate to at most limit and
    up to [-limit, limit] (DeepSeek-V4's SwiGLU clamps; with the default nothing changes, not even a bit)."""
    gate = np.ascontiguousarray(gate, dtype=np.float32)
    d = gate.shape[-1]
    out = np.empty_like(gate)
    pick(_serial, _parallel, gate.size)(gate.reshape(-1, d), np.ascontiguousarray(up, dtype=np.float32).reshape(-1, d),
                                        float(limit), out.reshape(-1, d))
    return out
