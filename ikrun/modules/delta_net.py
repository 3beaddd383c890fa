"""The gated delta-net token mixer (Qwen3-Next's and Qwen3.5's linear attention), owning its tensors under a block
prefix `b` ("blk.7.").

attn_qkv projects the normed hidden rows to [all q heads | all k heads | all v heads], attn_gate to the output gate
z, ssm_ba (Qwen3-Next: per key head [b of its value heads | a of them]) or ssm_beta / ssm_alpha (Qwen3.5) to the
write-strength and decay inputs. q/k/v go through the causal short convolution ssm_conv1d and SiLU, the gated delta
rule runs per value head (ikrun/ops/delta_net.py) with g = ssm_a * softplus(a + ssm_dt.bias) and beta = sigmoid(b),
the output is RMS-normed per head by ssm_norm times SiLU(z), then projected by ssm_out.

Qwen3-Next files of older mainline conversions hold one ssm_in in place of attn_qkv and attn_gate: per key head [its
q | its k | its value heads' v | their z] rows. Its product is split into attn_qkv's and attn_gate's columns as ik's
views of it split them (one matmul, so imatrix, sweeps and swaps see ssm_in as stored); a block holding both layouts
runs attn_qkv and attn_gate, as ik does.

Value heads share key heads in one of two orders the file's layout fixes: grouped (value head h reads key head
h // (Hv / Hk): transformers' repeat_interleave, kept by Qwen3-Next files) or tiled (h % Hk: Qwen3.5 files, whose
converter reorders the value heads).

A sequence continued through its cache (speculative decoding's target) carries per layer a `DeltaNetCache`: the last
conv_kernel - 1 rows entering the convolution and the delta rule's state [Hv, dk, dv]. Unlike keys and values, that
state cannot be cut back to an earlier position, so the cache also keeps where the last call began (its tail and
state) and that call's delta-rule inputs: `keep` recomputes the state over the kept rows alone, which is the state a
call of just those tokens leaves, to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ikrun.context import Context


@dataclass(frozen=True)
class DeltaNetCache:
    """One delta-net layer's state after `length` positions of a continued sequence (the module docstring)."""

    length: int
    #: the last conv_kernel - 1 (fewer at the start) attn_qkv rows, which the next call's convolution reads first
    tail: np.ndarray
    #: the delta rule's state [Hv, dk, dv]
    state: np.ndarray
    #: positions before the last call, and that call's starting tail and state
    start: int
    start_tail: np.ndarray
    start_state: np.ndarray
    #: the last call's attn_qkv rows and its delta-rule inputs (q, k, v, g, beta) per row
    qkv: np.ndarray
    rule: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class GatedDeltaNet:
    """The gated delta-net (the module docstring)."""

    n_k_heads: int
    n_v_heads: int
    head_k: int
    head_v: int
    conv_kernel: int
    eps: float
    #: value heads in tiled order (Qwen3.5) instead of grouped (Qwen3-Next)
    tiled: bool
    #: b and a from one projection ssm_ba (Qwen3-Next) instead of ssm_beta and ssm_alpha (Qwen3.5)
    fused_ba: bool

    @property
    def conv_channels(self) -> int:
        return 2 * self.n_k_heads * self.head_k + self.n_v_heads * self.head_v

    @staticmethod
    def fused_qkvz(cx: Context, b: str) -> bool:
        """Whether block `b` projects q, k, v and z with one ssm_in (the module docstring)."""
        return cx.has(b + "ssm_in.weight") and not (cx.has(b + "attn_qkv.weight") and cx.has(b + "attn_gate.weight"))

    def expected(self, b: str, n_embd: int, fused_qkvz: bool = False) -> dict[str, tuple[int, ...]]:
        """The block's delta-net tensors and their numpy shapes (`fused_qkvz`: with ssm_in)."""
        hv, inner = self.n_v_heads, self.n_v_heads * self.head_v
        projections: dict[str, tuple[int, ...]] = \
            {b + "ssm_in.weight": (self.conv_channels + inner, n_embd)} if fused_qkvz else \
            {b + "attn_qkv.weight": (self.conv_channels, n_embd), b + "attn_gate.weight": (inner, n_embd)}
        want: dict[str, tuple[int, ...]] = {
            **projections,
            b + "ssm_conv1d.weight": (self.conv_channels, self.conv_kernel), b + "ssm_dt.bias": (hv,),
            b + "ssm_a": (hv,), b + "ssm_norm.weight": (self.head_v,), b + "ssm_out.weight": (n_embd, inner)}
        if self.fused_ba:
            want[b + "ssm_ba.weight"] = (2 * hv, n_embd)
        else:
            want.update({b + "ssm_beta.weight": (hv, n_embd), b + "ssm_alpha.weight": (hv, n_embd)})
        return want

    def key_heads(self) -> np.ndarray:
        """The key head each value head reads."""
        heads = np.arange(self.n_v_heads)
        return heads % self.n_k_heads if self.tiled else heads // (self.n_v_heads // self.n_k_heads)

    def split_qkvz(self, qkvz: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ssm_in's product [n, per key head (q, k, v x r, z x r)] as attn_qkv's [n, all q | all k | all v] and
        attn_gate's [n, all z], value heads in grouped order (ik's views of the fused product, in its order)."""
        n, hk, dk, vr = len(qkvz), self.n_k_heads, self.head_k, self.n_v_heads // self.n_k_heads * self.head_v
        per_head = qkvz.reshape(n, hk, 2 * dk + 2 * vr)
        q, k, v, z = (per_head[:, :, a:e].reshape(n, -1) for a, e in
                      ((0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + vr), (2 * dk + vr, 2 * dk + 2 * vr)))
        return np.concatenate([q, k, v], axis=1), z

    def _tail(self, rows: np.ndarray) -> np.ndarray:
        return rows[max(0, len(rows) - (self.conv_kernel - 1)) :]

    def __call__(self, cx: Context, b: str, h: np.ndarray, cache: dict[str, Any] | None = None) -> np.ndarray:
        """The mixer's output [n, n_embd] for the normed hidden rows h of a fresh sequence, or of one that continues
        the sequence whose state `cache[b]` holds (which the call then advances; with a cache and no entry for b the
        sequence starts here)."""
        nx, n = cx.numerics, len(h)
        hk, hv, dk, dv = self.n_k_heads, self.n_v_heads, self.head_k, self.head_v
        gates = [b + "ssm_ba"] if self.fused_ba else [b + "ssm_beta", b + "ssm_alpha"]
        if self.fused_qkvz(cx, b):
            qkvz, *ba = cx.linears(h, [b + "ssm_in", *gates])
            qkv, z = self.split_qkvz(qkvz)
        else:
            qkv, z, *ba = cx.linears(h, [b + "attn_qkv", b + "attn_gate", *gates])
        if self.fused_ba:
            per_head = ba[0].reshape(n, hk, 2, hv // hk)
            beta_in, alpha = per_head[:, :, 0].reshape(n, hv), per_head[:, :, 1].reshape(n, hv)
        else:
            beta_in, alpha = ba
        prev: DeltaNetCache | None = cache.get(b) if cache is not None else None
        tail = prev.tail if prev is not None else qkv[:0]
        conv = nx.conv_silu(np.concatenate([tail, qkv]), cx.weight(b + "ssm_conv1d.weight"))[len(tail) :]
        q = conv[:, : hk * dk].reshape(n, hk, dk)
        k = conv[:, hk * dk : 2 * hk * dk].reshape(n, hk, dk)
        v = conv[:, 2 * hk * dk :].reshape(n, hv, dv)
        g, beta = nx.decay_and_beta(alpha, beta_in, cx.weight(b + "ssm_a"), cx.weight(b + "ssm_dt.bias"))
        start_state = prev.state if prev is not None else np.zeros((hv, dk, dv), dtype=np.float32)
        state = start_state.copy()
        out = nx.delta_rule(q, k, v, g, beta, self.key_heads(), self.eps, state)
        if cache is not None:
            start = prev.length if prev is not None else 0
            cache[b] = DeltaNetCache(start + n, self._tail(np.concatenate([tail, qkv])), state, start, tail,
                                     start_state, qkv, (q, k, v, g, beta))
        out = nx.gated_norm(out, z.reshape(n, hv, dv), cx.weight(b + "ssm_norm.weight"), self.eps)
        return cx.linear(out.reshape(n, hv * dv), b + "ssm_out")

    def keep(self, cx: Context, entry: DeltaNetCache, length: int) -> DeltaNetCache:
        """The layer's cache as if the last call had stopped at position `length` (the rejected rest of a verified
        block forgotten): the delta rule rerun from that call's starting state over the kept rows."""
        n = length - entry.start
        if not 0 <= n <= len(entry.qkv):
            raise ValueError(f"a delta-net state after {entry.length} positions rolls back only within its last call "
                             f"(positions {entry.start}..{entry.length}), not to {length}")
        if length == entry.length:
            return entry
        q, k, v, g, beta = (a[:n] for a in entry.rule)
        state = entry.start_state.copy()
        cx.numerics.delta_rule(q, k, v, g, beta, self.key_heads(), self.eps, state)
        return DeltaNetCache(length, self._tail(np.concatenate([entry.start_tail, entry.qkv[:n]])), state,
                             entry.start, entry.start_tail, entry.start_state, entry.qkv[:n], (q, k, v, g, beta))
