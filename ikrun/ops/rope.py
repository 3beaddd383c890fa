"""Rotary position embedding in ggml's two layouts.

ggml builds the angles the way its rope cache does: theta starts at the position and is multiplied by theta_scale =
base^(-2/n_rot) once per pair, in float32; each pair's angle is freq_scale x theta (divided first by the pair's
factor from rope_freqs). The rotation is x0 cos - x1 sin and x0 sin + x1 cos; ik's build fuses each first product
into the addition for NEOX (not for NORM), which `fused` reproduces.
NORM rotates adjacent pairs (x[2i], x[2i+1]); NEOX rotates (x[i], x[i + n_rot/2]). `yarn_rope_cache` adds
ggml's YaRN (rope_yarn): per-pair ramp between interpolated and extrapolated angles, magnitude factor on cos/sin.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import fmaf
from ikrun.ops.parallel import claim_items, run_claimed, task_items


@njit(cache=True, nogil=True)
def _angles(positions: np.ndarray, n_rot: int, base: float, freq_scale: float, factors: np.ndarray,
            cos: np.ndarray, sin: np.ndarray) -> None:
    theta_scale = np.float32(np.float32(base) ** (np.float32(-2.0) / np.float32(n_rot)))
    for p in range(positions.shape[0]):
        theta = np.float32(positions[p])
        for i in range(n_rot // 2):
            t = np.float32(freq_scale) * (theta / factors[i] if factors.size else theta)
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
def _row(x: np.ndarray, c_row: np.ndarray, s_row: np.ndarray, n_rot: int, neox: bool, fused: bool) -> None:
    half = n_rot // 2
    for h in range(x.shape[0]):
        for i in range(half):
            c = c_row[i]
            s = s_row[i]
            if neox:
                a = x[h, i]
                b = x[h, i + half]
                if fused:
                    x[h, i] = fmaf(a, c, -(b * s))
                    x[h, i + half] = fmaf(a, s, b * c)
                else:
                    x[h, i] = a * c - b * s
                    x[h, i + half] = a * s + b * c
            else:
                a = x[h, 2 * i]
                b = x[h, 2 * i + 1]
                x[h, 2 * i] = a * c - b * s
                x[h, 2 * i + 1] = a * s + b * c


@njit(cache=True, nogil=True)
def _serial(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, neox: bool, fused: bool) -> None:
    for p in range(x.shape[0]):
        _row(x[p], cos[p], sin[p], n_rot, neox, fused)


@njit(cache=True, nogil=True, parallel=True)
def _parallel(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, neox: bool, fused: bool,
              threads: int) -> None:
    """The positions in tasks the threads claim (ikrun/ops/parallel.py)."""
    per, counter = task_items(x.shape[0], threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        p0, p1 = claim_items(counter, per, x.shape[0])
        while p0 < p1:
            for p in range(p0, p1):
                _row(x[p], cos[p], sin[p], n_rot, neox, fused)
            p0, p1 = claim_items(counter, per, x.shape[0])


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, neox: bool, fused: bool = False) -> None:
    """Rotate the first n_rot dims of every head of x [n_pos, heads, head_dim] in place; `fused`: NEOX's products
    fused into the additions as ik's build computes them (--numerics ik)."""
    run_claimed(_serial, _parallel, x.size, x, cos, sin, n_rot, neox, fused)


@dataclass(frozen=True)
class Yarn:
    """ggml's YaRN rope parameters: ext_factor 0 leaves plain (linearly scaled) angles; attn_factor scales cos/sin."""

    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0
    #: round the correction range out to whole dims as ggml always does; False keeps it fractional (transformers'
    #: `rope_scaling.truncate: false`, gpt-oss)
    truncate: bool = True


def _corr_dim(n_rot: int, n_ctx_orig: int, rotations: float, base: float) -> np.float32:
    f32 = np.float32
    return f32(f32(n_rot) * np.log(f32(n_ctx_orig) / (f32(rotations) * f32(2.0) * f32(np.pi)))
               / (f32(2.0) * np.log(f32(base))))


@njit(cache=True, nogil=True)
def yarn_log_scale(mul: float, freq_scale: float) -> float:
    """1 + mul x ln(1 / freq_scale) in ik's float32 arithmetic: logf, and the multiply-add fused (GCC contracts
    it)."""
    return fmaf(np.float32(mul), np.log(np.float32(1.0) / np.float32(freq_scale)), np.float32(1.0))


@njit(cache=True, nogil=True)
def _yarn_angles(positions: np.ndarray, n_rot: int, base: float, freq_scale: float, ext_factor: float,
                 attn_factor: float, low: float, high: float, cos: np.ndarray, sin: np.ndarray) -> None:
    theta_scale = np.float32(np.float32(base) ** (np.float32(-2.0) / np.float32(n_rot)))
    fs = np.float32(freq_scale)
    ext = np.float32(ext_factor)
    ms = np.float32(attn_factor)
    if ext != np.float32(0.0):
        ms = ms * np.float32(yarn_log_scale(0.1, freq_scale))
    lo = np.float32(low)
    span = max(np.float32(0.001), np.float32(high) - lo)
    for p in range(positions.shape[0]):
        theta_extrap = np.float32(positions[p])
        for i in range(n_rot // 2):
            theta = fs * theta_extrap
            if ext != np.float32(0.0):
                y = (np.float32(i) - lo) / span
                mix = (np.float32(1.0) - min(np.float32(1.0), max(np.float32(0.0), y))) * ext
                theta = fmaf(theta, np.float32(1.0) - mix, theta_extrap * mix)
            cos[p, i] = np.cos(theta) * ms
            sin[p, i] = np.sin(theta) * ms
            theta_extrap = theta_extrap * theta_scale


def yarn_rope_cache(positions: np.ndarray, n_rot: int, base: float, freq_scale: float,
                    yarn: Yarn) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [n_pos, n_rot/2] as ggml's rope_yarn builds them (magnitude scaling folded in).

    With ext_factor != 0, each pair mixes the interpolated and extrapolated angle by a ramp between the correction
    dims (from beta_fast/beta_slow and n_ctx_orig; rounded out to whole dims unless `yarn.truncate` is False) and
    cos/sin are scaled by 1 + 0.1 ln(1/freq_scale).
    """
    f32 = np.float32
    low = high = f32(0.0)
    if yarn.ext_factor != 0.0:
        fast = float(_corr_dim(n_rot, yarn.n_ctx_orig, yarn.beta_fast, base))
        slow = float(_corr_dim(n_rot, yarn.n_ctx_orig, yarn.beta_slow, base))
        if yarn.truncate:
            fast, slow = float(np.floor(fast)), float(np.ceil(slow))
        low, high = f32(max(0.0, fast)), f32(min(n_rot - 1.0, slow))
    n = len(positions)
    cos = np.empty((n, n_rot // 2), dtype=np.float32)
    sin = np.empty_like(cos)
    _yarn_angles(np.asarray(positions, dtype=np.int64), n_rot, float(base), float(freq_scale),
                 float(yarn.ext_factor), float(yarn.attn_factor), float(low), float(high), cos, sin)
    return cos, sin


def inv_freq_default(base: float, n_rot: int) -> np.ndarray:
    """transformers' default inverse frequencies 1 / base^(2i / n_rot), float32 [n_rot/2]."""
    exponent = np.arange(0, n_rot, 2, dtype=np.int64).astype(np.float32) / np.float32(n_rot)
    return (1.0 / (base ** exponent)).astype(np.float32)


def inv_freq_yarn(base: float, n_rot: int, factor: float, n_ctx_orig: int, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, truncate: bool = True) -> np.ndarray:
    """transformers' YaRN inverse frequencies (_compute_yarn_parameters): per pair a linear ramp between the
    extrapolated 1/base^(2i/d) and the interpolated 1/(factor base^(2i/d)), between the correction dims of
    beta_fast and beta_slow rotations over the original context."""
    f32 = np.float32

    def correction_dim(rotations: float) -> float:
        return n_rot * float(np.log(n_ctx_orig / (rotations * 2 * np.pi))) / (2 * float(np.log(base)))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = float(np.floor(low)), float(np.ceil(high))
    low, high = max(low, 0.0), min(high, n_rot - 1.0)
    if low == high:
        high += 0.001
    pos_freqs = (base ** (np.arange(0, n_rot, 2).astype(np.float32) / f32(n_rot))).astype(np.float32)
    ramp = np.clip((np.arange(n_rot // 2, dtype=np.float32) - f32(low)) / f32(high - low), 0, 1).astype(np.float32)
    extrapolation = (f32(1.0) - ramp).astype(np.float32)
    extra = (f32(1.0) / pos_freqs).astype(np.float32)
    inter = (f32(1.0) / (f32(factor) * pos_freqs)).astype(np.float32)
    return (inter * (f32(1.0) - extrapolation) + extra * extrapolation).astype(np.float32)


def inv_freq_rope_cache(positions: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [n_pos, n_rot/2] as transformers builds them: one float32 product position x inv_freq per
    angle (not ggml's running product), cos and sin times `scale` (its attention_factor)."""
    angles = (np.asarray(positions).astype(np.float32)[:, None] * inv_freq[None, :]).astype(np.float32)
    s = np.float32(scale)
    return np.ascontiguousarray(np.cos(angles) * s, dtype=np.float32), np.ascontiguousarray(np.sin(angles) * s,
                                                                                               dtype=np.float32)
