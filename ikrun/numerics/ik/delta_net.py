"""ik's gated delta-net arithmetic (--numerics ik), as its CPU backend computes a sequence (a continued one from the
state its cache holds: the kernel runs token by token, so pieces give the whole sequence's floats bit for bit):

- the short convolution (ops/conv.causal_conv_silu with `ik`): taps summed from the oldest as fused multiply-adds,
  then ggml's SiLU apart (ik's AVX-512 exponential, ik_expf). ik's 4-tap AVX2 kernel can apply an AVX2 SiLU in
  place, but only when the SiLU's buffer does not overlap the input's; measured against ik's printed Q8_0 figures, the graphs ran the SiLU apart (in place,
  qwen35-moe's mean KLD moves 9e-6 further from ik's);
- q and k by ggml_l2_norm: the squares' sum in float64, scale 1 / max(sqrtf(sum), eps) with the model's rms eps;
- g = softplus(a + dt_bias) * ssm_a with softplus log(1 + expf(x)) (x above 20 kept), beta = 1 / (1 + expf(-b))
  (libm expf);
- the fused delta-net kernel (AVX-512, 16 lanes), token by token: q.k in 16 lanes of fused multiply-adds added as a
  tree; with decay = expf(min(g, 50)), per value row r: p = sum_c S[c, r] k_c and o = sum_c S[c, r] q_c as fused
  multiply-add chains over the key dim c, v' = v beta - p (beta decay) (one fused multiply-add: GCC contracts the
  kernel's mul, mul, sub into a rounded v beta minus the exact product), out = v' (q.k / sqrt(d)) + o (decay /
  sqrt(d)) (one fused multiply-add), S[c, r] = clamp(v'_r k_c + S[c, r] decay, +-1e6) (one fused multiply-add).
  F32 weights show each of these roundings in ik's saved logits (tests/test_runtime_qwen3next.py); Q8_0 files'
  8-bit activations mostly round them away.
  The kernel keeps one head dim for keys and values; ik runs it for head dims 64 and 128 only.
  Its AVX2 build (`avx2`, --numerics ik-avx2) sums q.k in 8 lanes and computes the value update in scalar code that
  GCC contracts otherwise: v' = fma(v, beta, -((p beta) decay)), out = fma(o decay, 1 / sqrt(d), v' (q.k / sqrt(d)));
  its SiLU after the convolution is ggml's AVX2 one (ik_expf_avx2, 8 channels at a time).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import fmaf
from ikrun.numerics.ik.attention import _lane_sum
from ikrun.numerics.ik.ikgemm import AVX2_LANES
from ikrun.ops.delta_net import initial_state

LANES = 16
#: the head dims ik's fused delta-net kernel computes right (its generic fallback does not)
FUSED_HEAD_DIMS = (64, 128)

@njit(cache=True, nogil=True, inline="always")
def ik_sigmoid(x: np.float32) -> np.float32:
    """1 / (1 + expf(-x)) with libm's expf, as ggml_sigmoid and ik's gates compute it."""
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


@njit(cache=True, nogil=True)
def _decay_and_beta(a: np.ndarray, b: np.ndarray, ssm_a: np.ndarray, dt: np.ndarray, g: np.ndarray,
                    beta: np.ndarray) -> None:
    for t in range(a.shape[0]):
        for h in range(a.shape[1]):
            x = a[t, h] + dt[h]
            soft = x if x > np.float32(20.0) else np.float32(np.log(np.float32(1.0) + np.exp(x)))
            g[t, h] = soft * ssm_a[h]
            beta[t, h] = ik_sigmoid(b[t, h])


@njit(cache=True, nogil=True)
def _sigmoid(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.shape[0]):
        out[i] = ik_sigmoid(x[i])


def ik_sigmoid_array(x: np.ndarray) -> np.ndarray:
    """ik_sigmoid of every element (the attention output gate, the shared expert's gate)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _sigmoid(x.reshape(-1), out.reshape(-1))
    return out


def ik_decay_and_beta(a: np.ndarray, b: np.ndarray, ssm_a: np.ndarray,
                      dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(g, beta) [T, H] in ik's order (module docstring)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    g, beta = np.empty_like(a), np.empty_like(a)
    _decay_and_beta(a, np.ascontiguousarray(b, dtype=np.float32), np.ascontiguousarray(ssm_a, dtype=np.float32),
                    np.ascontiguousarray(dt_bias, dtype=np.float32), g, beta)
    return g, beta


@njit(cache=True, nogil=True, inline="always")
def _l2(x: np.ndarray, eps: np.float32, out: np.ndarray) -> None:
    s = 0.0
    for j in range(x.shape[0]):
        s += np.float64(x[j] * x[j])
    scale = np.float32(1.0) / max(np.sqrt(np.float32(s)), eps)
    for j in range(x.shape[0]):
        out[j] = scale * x[j]


@njit(cache=True, nogil=True, parallel=True)
def _delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, k_head: np.ndarray,
                eps: float, state: np.ndarray, avx2: bool, out: np.ndarray) -> None:
    n, d = v.shape[0], v.shape[2]
    width = AVX2_LANES if avx2 else LANES
    scale = np.float32(1.0) / np.sqrt(np.float32(d))
    for h in prange(v.shape[1]):
        kh = k_head[h]
        s = state[h]  # [key dim c, value dim r]
        qn = np.empty(d, dtype=np.float32)
        kn = np.empty(d, dtype=np.float32)
        lanes = np.empty(width, dtype=np.float32)
        p = np.empty(d, dtype=np.float32)
        o = np.empty(d, dtype=np.float32)
        for t in range(n):
            _l2(q[t, kh], np.float32(eps), qn)
            _l2(k[t, kh], np.float32(eps), kn)
            for lane in range(width):
                acc = np.float32(0.0)
                for i in range(lane, d, width):
                    acc = fmaf(kn[i], qn[i], acc)
                lanes[lane] = acc
            score = _lane_sum(lanes) * scale
            decay = np.exp(min(g[t, h], np.float32(50.0)))
            bt = beta[t, h]
            c2 = bt * decay
            c3 = decay * scale
            for r in range(d):
                p[r] = np.float32(0.0)
                o[r] = np.float32(0.0)
            for c in range(d):
                for r in range(d):
                    p[r] = fmaf(s[c, r], kn[c], p[r])
                    o[r] = fmaf(s[c, r], qn[c], o[r])
            for r in range(d):
                if avx2:  # the AVX2 build's scalar code as GCC contracts it
                    p[r] = fmaf(v[t, h, r], bt, -((p[r] * bt) * decay))
                    out[t, h, r] = fmaf(o[r] * decay, scale, p[r] * score)
                else:
                    p[r] = fmaf(-p[r], c2, v[t, h, r] * bt)
                    out[t, h, r] = fmaf(p[r], score, o[r] * c3)
            for c in range(d):
                for r in range(d):
                    s[c, r] = min(np.float32(1e6), max(np.float32(-1e6), fmaf(p[r], kn[c], s[c, r] * decay)))


def ik_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, k_head: np.ndarray,
                  eps: float, state: np.ndarray | None = None, avx2: bool = False) -> np.ndarray:
    """The gated delta rule [T, Hv, d] in ik's fused kernel's order (module docstring); q/k [T, Hk, d] before the
    L2 norm, one head dim d (a multiple of 16) for keys and values; from `state` [Hv, d, d] (advanced in place) where
    the sequence continues, else from zero."""
    d = v.shape[2]
    if q.shape[2] != d or d % LANES:
        raise ValueError(f"ik's fused delta-net takes one head dim, a multiple of {LANES}: keys {q.shape[2]}, "
                         f"values {d}")
    out = np.empty(v.shape, dtype=np.float32)
    f32 = [np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v, g, beta)]
    _delta_rule(*f32, np.ascontiguousarray(k_head, dtype=np.int64), float(eps), initial_state(q, v, state), avx2,
                out)
    return out
