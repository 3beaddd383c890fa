"""The exact arithmetic, and the interface every arithmetic implements.

`Numerics` is what an architecture and its modules compute with: projections (dense, per-head, routed experts),
norms, rope, attention, activations, routing, the hyper-connection and convolution sums, and how the KV cache
holds keys and values. This class computes them exactly: float32 on exactly decoded weights, in transformers'
float order where an engine's differs, so a KL-divergence measures the stored weights alone. Another arithmetic
(ikrun/numerics/ik: ik's CPU backend) is a subclass that overrides what it computes differently; an architecture
never asks which one it runs on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ikrun.ops.activations import swiglu
from ikrun.ops.attention import causal_attention
from ikrun.ops.conv import causal_conv_residual
from ikrun.ops.delta_net import causal_conv_silu, decay_and_beta, delta_rule_chunked, gated_rms_norm
from ikrun.ops.hyperconn import hc_combine, hc_post, hc_pre
from ikrun.ops.mla import latent_attention
from ikrun.ops.moe import (
    GATING_SIGMOID,
    ExpertFetch,
    ExpertGlu,
    RoutedExperts,
    group_limited_top_k,
    moe_experts,
    route,
)
from ikrun.ops.norm import rms_norm
from ikrun.ops.rope import apply_rope

if TYPE_CHECKING:
    from ikquant.types import GGMLType
    from ikrun.options import RuntimeOptions
    from ikrun.weights import WeightStore

#: rows of a weight decoded at a time by a matmul whose weight does not fit the cache (the output head of a big
#: vocabulary under a small budget); such a matmul may differ from the untiled one in the last bits
TILE_BYTES = 64 << 20


class Numerics:
    """The exact arithmetic (the module docstring); the base of every other."""

    #: the --numerics name
    name = "exact"

    def __init__(self, weights: WeightStore, options: RuntimeOptions):
        self.weights = weights
        self.options = options
        #: matmuls that had to decode their weight in tiles (it did not fit the cache)
        self.tiled: set[str] = set()

    # ---- what a file may hold ---------------------------------------------------------------------------------
    def kv_cache(self, requested: str) -> str:
        """The KV-cache precision a run keeps (one of options.KV_CACHE_TYPES) when `requested` was asked for."""
        return requested

    def check_weights(self) -> list[str]:
        """Why this arithmetic cannot run the loaded weights (empty: it can); checked before any compute."""
        return []

    def check_type(self, gtype: GGMLType) -> str | None:
        """Why a weight of `gtype` (a hot swap brings it in) cannot be multiplied here, None when it can."""
        return None

    # ---- element-wise -----------------------------------------------------------------------------------------
    def norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """RMSNorm over the last axis, times `weight`."""
        return rms_norm(x, weight, eps)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, neox: bool) -> None:
        """Rotate the first n_rot dims of every head of x [n, heads, d] in place (NEOX or NORM pairing)."""
        apply_rope(x, cos, sin, n_rot, neox)

    def swiglu(self, gate: np.ndarray, up: np.ndarray, limit: float = np.inf) -> np.ndarray:
        """silu(gate) * up, both clamped at a finite `limit`."""
        return swiglu(gate, up, limit)

    def route(self, logits: np.ndarray, bias: np.ndarray | None, n_used: int, gating: int, norm: bool,
              scale: float, chosen: np.ndarray | None = None,
              groups: tuple[int, int] = (1, 1)) -> tuple[np.ndarray, np.ndarray]:
        """(chosen experts, their weights) from router logits (ops/moe.route); `groups` (n_group, topk_group)
        limits a sigmoid top-k to the best groups as transformers does (ops/moe.group_limited_top_k)."""
        if chosen is None and groups[0] > 1 and gating == GATING_SIGMOID:
            chosen = group_limited_top_k(logits, bias, n_used, *groups)
        return route(logits, bias, n_used, gating, norm, scale, chosen)

    def hc_pre(self, mixes: np.ndarray, alpha: np.ndarray, beta: np.ndarray, n_stream: int, iters: int,
               eps: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A hyper-connection's (pre, post, mix) weights from its mixes (ops/hyperconn.hc_pre)."""
        return hc_pre(mixes, alpha, beta, n_stream, iters, eps)

    def hc_combine(self, streams: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """The streams weighted and summed into a sub-layer's input."""
        return hc_combine(streams, weights)

    def hc_post(self, y: np.ndarray, post: np.ndarray, streams: np.ndarray, mix: np.ndarray) -> np.ndarray:
        """A sub-layer's output scattered back over the mixed streams."""
        return hc_post(y, post, streams, mix)

    def conv(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x plus its causal short convolution by taps w (openPangu's MoME convolutions)."""
        return causal_conv_residual(x, w)

    def sigmoid(self, x: np.ndarray) -> np.ndarray:
        """1 / (1 + exp(-x)) in float32 (the output gates of gated attention and of a shared expert)."""
        return (np.float32(1.0) / (np.float32(1.0) + np.exp(-np.asarray(x, dtype=np.float32)))).astype(np.float32)

    # ---- the gated delta-net (ops/delta_net.py) -------------------------------------------------------------
    def conv_silu(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """SiLU of the causal short convolution of x [T, C] by taps w [C, K] (the delta-net's q/k/v)."""
        return causal_conv_silu(x, w)

    def decay_and_beta(self, a: np.ndarray, b: np.ndarray, ssm_a: np.ndarray,
                       dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The delta rule's log-decay g and write strength beta [T, H] from the a / b projections."""
        return decay_and_beta(a, b, ssm_a, dt_bias)

    def delta_rule(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                   k_head: np.ndarray, eps: float, state: np.ndarray | None = None) -> np.ndarray:
        """The gated delta rule [T, Hv, dv] (transformers' chunked prompt form, whose q/k L2 norm has its own fixed
        epsilon; an engine's may use the model's rms `eps`) from zero, or from a continued sequence's `state`
        [Hv, dk, dv], which it advances in place."""
        return delta_rule_chunked(q, k, v, g, beta, k_head, state=state)

    def gated_norm(self, x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """RMSNorm of x times weight, times SiLU(z) (the delta-net's output norm)."""
        return gated_rms_norm(x, z, weight, eps)

    def kv_store(self, x: np.ndarray, kv_cache: str, value: bool = False) -> np.ndarray:
        """Keys (or, `value`, values) as a KV cache of precision `kv_cache` holds them (ikrun/options.py)."""
        half = kv_cache == "f16" or (kv_cache == "k-f32" and value)
        return x.astype(np.float16).astype(np.float32) if half else x

    # ---- attention --------------------------------------------------------------------------------------------
    def causal_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, head_dim: int, *, window: int = 0,
                         sinks: np.ndarray | None = None) -> np.ndarray:
        """Causal grouped-query attention scaled by 1 / sqrt(head_dim): q [n, H, d], k/v [keys, H_kv, d] (the last
        n keys are the queries' own positions) -> [n, H, d_v]; a sliding `window` (keys seen, the own included) and
        per-head `sinks` logits (ops/attention.causal_attention)."""
        return causal_attention(q, k, v, 1.0 / np.sqrt(head_dim), window=window, sinks=sinks)

    def latent_attention(self, b: str, q_rope: np.ndarray, q_nope: np.ndarray, cache: np.ndarray, scale: float, *,
                         sinks: np.ndarray | None = None, window: int = 0, keep: np.ndarray | None = None,
                         on_latent: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """Multi-head latent attention in the absorbed form through block `b`'s attn_k_b / attn_v_b (ops/mla.py):
        q_rope [n, H, R] (roped), q_nope [n, H, D], cache rows [n, R + C] ([k_rope | latent]); `sinks` [S, R + C]
        seen by every query, a `window`, a `keep` mask [n, n]; `on_latent` sees the heads' latents [H, n, C] as they
        enter attn_v_b. Returns [n, H, V]."""
        n, n_head, _ = q_rope.shape
        n_lat = cache.shape[1] - q_rope.shape[2]
        kb, vb = b + "attn_k_b.weight", b + "attn_v_b.weight"
        head_v = self.weights.info(vb).n_elements // (n_head * n_lat)
        w_kb = self.matmul_weight(kb, n, n_lat).reshape(n_head, n_lat, q_nope.shape[2])
        w_vb = self.matmul_weight(vb, n, head_v).reshape(n_head, head_v, n_lat)
        return latent_attention(q_rope, self.activations(q_nope, kb), w_kb, cache, w_vb, scale, sinks=sinks,
                                window=window, keep=keep, ik_avx512_sinks=self.options.ik_sink_overread,
                                on_latent=on_latent, vb_input=lambda lat: self.activations(lat, vb))

    # ---- matmuls ----------------------------------------------------------------------------------------------
    def activations(self, x: np.ndarray, weight_name: str) -> np.ndarray:
        """x as the matmul with `weight_name` consumes it."""
        return x

    def project(self, x: np.ndarray, weight_name: str, shared: dict[str, object] | None = None,
                fused: bool = False) -> np.ndarray:
        """x @ W^T for the 2-D weight `weight_name`; decoded whole when it fits the cache, else a tile of rows at a
        time (the output head of a large vocabulary under a small budget). `shared` carries what projections of the
        same input may reuse (Context.linears); `fused`: the gate/up pair of a SwiGLU FFN."""
        w = self.weights
        hit = w.cached_array(weight_name)
        if hit is not None:
            return x @ hit.T
        if w.fits(w.decoded_bytes(weight_name)):
            return x @ w.decode(weight_name).T
        self.tiled.add(weight_name)
        n_rows, n_cols = w.info(weight_name).shape
        step = max(1, TILE_BYTES // (4 * n_cols))
        y = np.empty((x.shape[0], n_rows), dtype=np.float32)
        for r0 in range(0, n_rows, step):
            rows = np.arange(r0, min(n_rows, r0 + step))
            y[:, r0 : r0 + len(rows)] = x @ w.decode_rows(weight_name, rows).T
        return y

    def matmul_weight(self, name: str, n_act_rows: int, weight_rows: int | None = None) -> np.ndarray:
        """Weight `name` (float32, numpy order) as a matmul with `n_act_rows` activation rows multiplies it, each
        matrix of `weight_rows` rows (a per-head slice; default all rows)."""
        return self.weights.decode(name)

    def head_product(self, x: np.ndarray, name: str) -> np.ndarray:
        """x [H, n, in] times each head's equal slice of the 2-D weight `name`'s rows: [H, n, rows / H]."""
        return self.sliced_product(x, name)

    def sliced_product(self, x: np.ndarray, name: str) -> np.ndarray:
        """head_product as float32 products of the slices matmul_weight gives against x as activations gives it
        (in any arithmetic: DeepSeek-V4's grouped output keeps this order)."""
        n_head, n = x.shape[0], x.shape[1]
        rows = self.weights.info(name).shape[0] // n_head
        w = self.matmul_weight(name, n, rows).reshape(n_head, rows, -1)
        return np.matmul(self.activations(x, name), w.transpose(0, 2, 1))

    def routed_experts(self, x: np.ndarray, sel: np.ndarray, w: np.ndarray, n_expert: int, names: list[str],
                       group: int | None, glu: ExpertGlu, keep_act: bool) -> RoutedExperts:
        """The routed SwiGLU experts of the 3-D tensors `names` (up, gate, down) on x [n, n_embd] routed by sel/w
        [n, k], `group` experts decoded at a time, `glu` their SwiGLU's form and biases (ops/moe.moe_experts)."""
        counts = np.bincount(sel.reshape(-1), minlength=n_expert)
        return moe_experts(x, sel, w, n_expert, self.expert_fetch(names, counts), group, glu, keep_act=keep_act)

    def expert_fetch(self, names: list[str], counts: np.ndarray) -> ExpertFetch:
        """The routed experts' matrices, decoded (and cached) one expert at a time: a whole expert tensor is never
        decoded for a batch, only the experts that receive tokens; F16/BF16 experts are handed over as their bits
        (the expert kernel widens them), never decoded; `counts`: the tokens routed to each expert."""

        def matrices(name: str, ids: np.ndarray) -> np.ndarray:
            half = self.weights.half_experts(name, ids)
            if half is not None:
                return half
            return self.convert_experts(name, ids, counts[ids],
                                        self.weights.decode_experts(name, ids, not self.weights.streaming))

        def fetch(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            up, gate, down = (matrices(name, ids) for name in names)
            return up, gate, down

        return fetch

    def convert_experts(self, name: str, ids: np.ndarray, counts: np.ndarray, mats: np.ndarray) -> np.ndarray:
        """The decoded matrices `mats` of experts `ids` as the arithmetic multiplies them with `counts` routed
        tokens each."""
        return mats
