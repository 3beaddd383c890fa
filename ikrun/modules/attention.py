"""The attention blocks the architectures share, each owning its tensors under a block prefix `b` ("blk.7.").

- `GqaAttention`: grouped-query attention (the llama family): attn_q/k/v (+ biases where the file has them),
  q/k RMSNorm per head (qwen3) or over all heads' projection at once (minimax-m2), rope on the first n_rot dims (NORM
  or NEOX pairing), the KV cache, per-head sinks and a sliding window per call (gpt-oss), an output gate (Qwen3-Next,
  Qwen3.5: attn_q gives each head its query and a gate, the heads' output is multiplied by the gate's sigmoid),
  attn_output.
- `MlaAttention`: DeepSeek's multi-head latent attention: the query through the q LoRA (attn_q_a, its norm,
  attn_q_b) or attn_q, attn_kv_a_mqa's latent and shared rope key, attn_kv_a_norm, the latent cache, then either
  the absorbed form through attn_k_b / attn_v_b per head or ik's prefill form (keys and values materialised through
  attn_kv_b; DeepSeek and GLM-DSA only, without sinks or a window), attn_output. Variants are data: the rope
  pairing, openPangu's MoME convolutions (attn_qa_conv, attn_compresskv_conv, attn_o_conv), param sinks, a window or a keep mask per call,
  and whether attn_v_b's per-head inputs are shown to observers.

Every arithmetic step goes through `cx.numerics`; a block's configuration is read by its architecture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ikrun.context import Context


@dataclass(frozen=True)
class GqaAttention:
    """Grouped-query attention (the module docstring)."""

    n_head: int
    n_head_kv: int
    head_dim: int
    head_dim_v: int
    n_rot: int
    eps: float
    neox: bool
    qk_norm: bool
    #: the q/k norms span the whole projection (every head together, MiniMax-M2) instead of one head
    qk_norm_all_heads: bool = False
    #: one learned logit per head in every softmax's denominator (gpt-oss's `attn_sinks.weight`)
    sinks: bool = False
    #: attn_q's rows per head are [query | gate], the attention output times sigmoid(gate) (Qwen3-Next, Qwen3.5)
    output_gate: bool = False

    def expected(self, b: str, n_embd: int) -> dict[str, tuple[int, ...]]:
        """The block's attention tensors and their numpy shapes (biases are optional)."""
        q, kv, kvv = self.n_head * self.head_dim, self.n_head_kv * self.head_dim, self.n_head_kv * self.head_dim_v
        want: dict[str, tuple[int, ...]] = {
            b + "attn_q.weight": (2 * q if self.output_gate else q, n_embd), b + "attn_k.weight": (kv, n_embd),
            b + "attn_v.weight": (kvv, n_embd),
            b + "attn_output.weight": (n_embd, self.n_head * self.head_dim_v)}
        if self.sinks:
            want[b + "attn_sinks.weight"] = (self.n_head,)
        if self.qk_norm:
            want[b + "attn_q_norm.weight"] = (q,) if self.qk_norm_all_heads else (self.head_dim,)
            want[b + "attn_k_norm.weight"] = (kv,) if self.qk_norm_all_heads else (self.head_dim,)
        return want

    def __call__(self, cx: Context, b: str, h: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                 cache: dict[str, Any] | None = None, window: int = 0) -> np.ndarray:
        """The attention output [n, n_embd] for the normed hidden rows h of positions cos/sin cover; `cache` holds
        the keys and values of earlier positions under `b` (a continuation: they are prepended, then the block's own
        are kept for the next call); a `window` > 0 lets each query see only that many keys (its own included)."""
        nx, n = cx.numerics, len(h)
        q, k, v = cx.linears(h, [b + "attn_q", b + "attn_k", b + "attn_v"])
        if self.output_gate:
            q, gate = np.split(q.reshape(n, self.n_head, 2 * self.head_dim), 2, axis=2)
        if self.qk_norm and self.qk_norm_all_heads:
            q = nx.norm(q, cx.weight(b + "attn_q_norm.weight"), self.eps)
            k = nx.norm(k, cx.weight(b + "attn_k_norm.weight"), self.eps)
        q = q.reshape(n, self.n_head, self.head_dim)
        k = k.reshape(n, self.n_head_kv, self.head_dim)
        v = v.reshape(n, self.n_head_kv, self.head_dim_v)
        if self.qk_norm and not self.qk_norm_all_heads:
            q = nx.norm(q, cx.weight(b + "attn_q_norm.weight"), self.eps)
            k = nx.norm(k, cx.weight(b + "attn_k_norm.weight"), self.eps)
        q = np.ascontiguousarray(q)
        k = np.ascontiguousarray(k)
        nx.rope(q, cos, sin, self.n_rot, self.neox)
        nx.rope(k, cos, sin, self.n_rot, self.neox)
        k, v = cx.kv_store(k), cx.kv_store(v, value=True)
        if cache is not None:
            if b in cache:
                k, v = np.concatenate([cache[b][0], k]), np.concatenate([cache[b][1], v])
            cache[b] = (k, v)
        sinks = cx.weight(b + "attn_sinks.weight") if self.sinks else None
        flash = nx.attention_graph(cx.arch, cx.cache, self.head_dim) == "on"
        attn = nx.causal_attention(q, k, v, self.head_dim, window=window, sinks=sinks, kv=cx.cache,
                                   flash=flash).reshape(n, -1)
        if self.output_gate:
            attn = attn * nx.sigmoid(gate.reshape(n, -1))
        return cx.linear(attn, b + "attn_output")


@dataclass(frozen=True)
class MlaAttention:
    """Multi-head latent attention (the module docstring)."""

    n_head: int
    q_lora: int
    kv_lora: int
    n_rot: int
    head_k: int
    head_v: int
    eps: float
    kq_scale: float
    #: NEOX rope pairing (openPangu) instead of NORM (DeepSeek)
    neox: bool = False
    #: openPangu's MoME short convolutions on the q latent, the kv latent and the heads' output
    convolutions: bool = False
    #: show attn_v_b's per-head inputs to the observers (openPangu's imatrix records them)
    observe_values: bool = False
    #: ik's cache row is [latent | rope] (openPangu), not [rope | latent]: a quantized cache's blocks follow it
    latent_first: bool = False

    @property
    def n_nope(self) -> int:
        return self.head_k - self.n_rot

    def query(self, cx: Context, b: str, h: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """(the normalised q LoRA latent, or None without one; the query heads [n, H * key_length])."""
        if not self.q_lora:
            return None, cx.linear(h, b + "attn_q")
        qa = cx.linear(h, b + "attn_q_a")
        if self.convolutions:
            qa = cx.numerics.conv(qa, cx.weight(b + "attn_qa_conv.weight"))
        qa = cx.numerics.norm(qa, cx.weight(b + "attn_q_a_norm.weight"), self.eps)
        return qa, cx.linear(qa, b + "attn_q_b")

    def cache_rows(self, cx: Context, b: str, h: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """The cache rows [n, R + C] ([roped shared key | normed latent]) of the hidden rows h, as the KV cache
        holds them."""
        n = len(h)
        kv = cx.linear(h, b + "attn_kv_a_mqa")
        latent = kv[:, : self.kv_lora]
        if self.convolutions:
            latent = cx.numerics.conv(latent, cx.weight(b + "attn_compresskv_conv.weight"))
        latent = cx.numerics.norm(latent, cx.weight(b + "attn_kv_a_norm.weight"), self.eps)
        k_rope = np.ascontiguousarray(kv[:, self.kv_lora :]).reshape(n, 1, self.n_rot)
        cx.numerics.rope(k_rope, cos, sin, self.n_rot, self.neox)
        if self.latent_first:
            held = cx.kv_store(np.concatenate([latent, k_rope.reshape(n, self.n_rot)], axis=1))
            return np.concatenate([held[:, self.kv_lora :], held[:, : self.kv_lora]], axis=1)
        return cx.kv_store(np.concatenate([k_rope.reshape(n, self.n_rot), latent], axis=1))

    def sink_rows(self, cx: Context, b: str) -> np.ndarray:
        """The param sinks as cache rows [k_pe | RMSNorm(sink latent) * attn_kv_a_norm] (ik derives them at load)."""
        latent = cx.numerics.norm(cx.weight(b + "attn_param_sink_kv"), cx.weight(b + "attn_kv_a_norm.weight"),
                                  self.eps)
        return np.concatenate([cx.weight(b + "attn_param_sink_k_pe"), latent], axis=1)

    def __call__(self, cx: Context, b: str, q: np.ndarray, cache: np.ndarray, cos: np.ndarray, sin: np.ndarray, *,
                 sinks: np.ndarray | None = None, window: int = 0, keep: np.ndarray | None = None,
                 prefill: bool = False) -> np.ndarray:
        """The attention output [n, n_embd] from the query heads q [n, H * key_length] and the cache rows of the
        same positions; `sinks` cache rows every query sees, a `window`, a `keep` mask [n, cache rows]; `prefill`: ik's
        attn_kv_b form instead of the absorbed one."""
        n = len(q)
        q = q.reshape(n, self.n_head, self.head_k)
        q_nope = np.ascontiguousarray(q[:, :, : self.n_nope])
        q_rope = np.ascontiguousarray(q[:, :, self.n_nope :])
        cx.numerics.rope(q_rope, cos, sin, self.n_rot, self.neox)
        if prefill:
            if sinks is not None or window:
                raise ValueError("the prefill form takes no sinks and no window")
            if cx.observers and cx.has(b + "attn_kv_b.weight"):  # not a tensor ik derived at load
                cx.observe(b + "attn_kv_b.weight", cache[:, self.n_rot :])
            out = cx.numerics.materialized_attention(b, q_rope, q_nope, cache, self.kq_scale, cx.cache, keep=keep)
            return cx.linear(out.reshape(n, self.n_head * self.head_v), b + "attn_output")
        if cx.observers:
            self._observe_heads(cx, b + "attn_k_b.weight", q_nope.transpose(1, 0, 2))
        on_latent: Callable[[np.ndarray], None] | None = None
        if cx.observers and self.observe_values:
            on_latent = lambda lat: self._observe_heads(cx, b + "attn_v_b.weight", lat)  # noqa: E731
        out = cx.numerics.latent_attention(b, q_rope, q_nope, cache, self.kq_scale, cx.cache, sinks=sinks,
                                           window=window, keep=keep, on_latent=on_latent)
        out = out.reshape(n, self.n_head * self.head_v)
        if self.convolutions:
            out = cx.numerics.conv(out, cx.weight(b + "attn_o_conv.weight"))
        return cx.linear(out, b + "attn_output")

    def _observe_heads(self, cx: Context, name: str, rows: np.ndarray) -> None:
        """Per-head inputs [H, n, d] of a per-head weight (attn_k_b, attn_v_b), one matrix per head as ik's imatrix
        records them."""
        for head in range(self.n_head):
            cx.observe(name, rows[head], head, self.n_head)
