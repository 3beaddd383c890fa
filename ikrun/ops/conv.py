"""The causal depthwise (short) convolution: openPangu's MoME sites (with a residual, ik's ggml_ssm_conv + add) and
the gated delta-net's q/k/v (then SiLU, transformers' causal conv1d + SiLU and ik's ssm_conv then ggml_silu).

For every channel c of x [T, C] and a kernel w [C, K]:

    acc[t, c] = sum_{k=0}^{K-1} w[c, k] * x[t - (K-1) + k, c]

with the positions before the sequence start read as 0 (ik resets the conv state whenever a batch starts at position
0, which every evaluated chunk does; a continued delta-net sequence passes its kept tail as the first rows). The taps
are summed from 0 in order k = 0..K-1 in float32, as ggml's ssm_conv does; `fused` (--numerics ik): each tap as the
fused multiply-add ik's compiled ssm_conv computes (GCC contracts it), else rounded apart. One kernel, the epilogue
an argument: x[t, c] + acc (RESIDUAL), acc * sigmoid(acc) with libm's expf (SILU) or with ik's AVX-512 exponential
(SILU_IK_EXPF, ops/activations.ik_expf).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import fmaf
from ikrun.ops.activations import ik_expf, ik_expf_avx2
from ikrun.ops.parallel import pick

#: what follows the taps' sum (the module docstring)
RESIDUAL, SILU, SILU_IK_EXPF, SILU_IK_AVX2 = 0, 1, 2, 3


@njit(cache=True, nogil=True, inline="always")
def _row(x: np.ndarray, w: np.ndarray, t: int, fused: bool, epilogue: int, out: np.ndarray) -> None:
    n_tap = w.shape[1]
    for c in range(x.shape[1]):
        acc = np.float32(0.0)
        for k in range(n_tap):
            src = t - (n_tap - 1) + k
            if src >= 0:
                acc = fmaf(w[c, k], x[src, c], acc) if fused else acc + w[c, k] * x[src, c]
        if epilogue == RESIDUAL:
            out[t, c] = x[t, c] + acc
        elif epilogue == SILU or (epilogue == SILU_IK_AVX2 and c >= x.shape[1] - x.shape[1] % 8):
            out[t, c] = acc / (np.float32(1.0) + np.exp(-acc))
        elif epilogue == SILU_IK_AVX2:  # ggml's AVX2 SiLU: 8 channels at a time, libm's expf past the last 8
            out[t, c] = acc / (np.float32(1.0) + ik_expf_avx2(-acc))
        else:
            out[t, c] = acc / (np.float32(1.0) + ik_expf(-acc))


@njit(cache=True, nogil=True)
def _serial(x: np.ndarray, w: np.ndarray, fused: bool, epilogue: int, out: np.ndarray) -> None:
    for t in range(x.shape[0]):
        _row(x, w, t, fused, epilogue, out)


@njit(cache=True, nogil=True, parallel=True)
def _parallel(x: np.ndarray, w: np.ndarray, fused: bool, epilogue: int, out: np.ndarray) -> None:
    for t in prange(x.shape[0]):
        _row(x, w, t, fused, epilogue, out)


def causal_conv(x: np.ndarray, w: np.ndarray, epilogue: int, fused: bool = False) -> np.ndarray:
    """The causal depthwise convolution of x [T, C] (a fresh sequence, or one led by its kept tail) by taps w [C, K],
    then `epilogue` (RESIDUAL, SILU, SILU_IK_EXPF or SILU_IK_AVX2)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if w.ndim != 2 or w.shape[0] != x.shape[1]:
        raise ValueError(f"conv kernel {list(w.shape)} does not fit {x.shape[1]} channels")
    out = np.empty_like(x)
    pick(_serial, _parallel, x.size)(x, np.ascontiguousarray(w, dtype=np.float32), fused, epilogue, out)
    return out


def causal_conv_residual(x: np.ndarray, w: np.ndarray, fused: bool = False) -> np.ndarray:
    """x + causal depthwise conv(x) for x [T, C] (a fresh sequence), w [C, K]."""
    return causal_conv(x, w, RESIDUAL, fused)


def causal_conv_silu(x: np.ndarray, w: np.ndarray, ik: bool = False, avx2: bool = False) -> np.ndarray:
    """SiLU of the causal depthwise convolution of x [T, C] by taps w [C, K]: transformers' float order, or (`ik`)
    ik's, fused taps and its exponential (`avx2`: its AVX2 build's SiLU)."""
    return causal_conv(x, w, (SILU_IK_AVX2 if avx2 else SILU_IK_EXPF) if ik else SILU, fused=ik)
