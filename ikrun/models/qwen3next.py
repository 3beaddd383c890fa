"""Qwen3-Next (`qwen3next`): a hybrid of gated delta-net layers (linear attention, ikrun/modules/delta_net.py) and
gated full attention every `full_attention_interval`-th layer, each followed by a MoE FFN with a gated shared expert.

Per layer: RMSNorm (attn_norm; the file holds the zero-centred gains plus 1), the token mixer (the delta-net, or
Qwen3's attention with per-head q/k RMSNorm and partial NEOX rope whose attn_q also gives a sigmoid output gate),
residual; RMSNorm (post_attention_norm), the FFN: without `expert_count` (dense Qwen3.5) a SwiGLU, else the MoE FFN: softmax router, top-k renormalised, plus the shared expert
times sigmoid(ffn_gate_inp_shexp . x) (a layer holding ffn_gate/up/down instead of a router is dense), residual.
The delta-net's V heads come in the file's grouped order with b and a fused in ssm_ba (Qwen3.5, ikrun/models/
qwen35moe.py, changes both); its input projection is attn_qkv and attn_gate, or the fused ssm_in of older mainline
conversions, which ik's qwen3next loads too (Qwen3.5's do not). Every evaluated sequence starts from zero state, as ik resets it per chunk; a sequence
continued through its cache (`continues`: a speculative-decoding target) carries each delta-net layer's conv tail
and recurrent state there beside the attention layers' keys and values (ikrun/modules/delta_net.py), and rolls
them back by recomputing the last call's kept rows (`keep_cache`). transformers (4.57.1) continues its cache one
token at a time only: a continued call of several tokens restarts both from zero there; here pieces of any length
give the whole sequence's logits.

ik's own qwen3next hard-codes every 4th layer as full attention; this runtime reads `full_attention_interval` as
transformers' config does (files ik can load say 4).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ikrun.errors import ModelError
from ikrun.models.base import Sequence, block_of
from ikrun.models.llama import LlamaFamily
from ikrun.modules.attention import GqaAttention
from ikrun.modules.delta_net import GatedDeltaNet
from ikrun.modules.ffn import MoeConfig, moe_ffn
from ikrun.ops.moe import GATING_SOFTMAX

if TYPE_CHECKING:
    from ikrun.context import Context

#: rope scaling types the hybrid families run (none: transformers' default rope)
ROPE_SCALINGS = (None, "none", "linear")


class Qwen3Next(LlamaFamily):
    archs: ClassVar[tuple[str, ...]] = ("qwen3next",)
    ffn_norm: ClassVar[str] = "post_attention_norm.weight"
    continues = True
    #: value heads in tiled order, b and a in two tensors (Qwen3.5's layout)
    qwen35_layout: ClassVar[bool] = False

    def __init__(self, ctx: Context):
        hp = ctx.hparam

        def fail(key: str, why: str) -> ModelError:
            return ModelError(f"{ctx.path}: {ctx.arch}.{key} {why}")

        n_layer = int(hp("block_count"))
        interval = int(hp("full_attention_interval", 4))
        if interval < 1:
            raise fail("full_attention_interval", f"{interval} names no layer type (it must be at least 1)")
        why = ctx.numerics.check_full_attention_interval(ctx.arch, interval)
        if why:
            raise fail("full_attention_interval", f"{interval}: {why}")
        self.full_attention = {i for i in range(n_layer) if (i + 1) % interval == 0}
        for i in range(n_layer):
            if self.qwen35_layout and ctx.has(f"blk.{i}.ssm_in.weight"):
                raise ModelError(f"{ctx.path}: tensor blk.{i}.ssm_in.weight (a fused delta-net input projection) is "
                                 f"a layout ik's {ctx.arch} does not load; convert with attn_qkv / attn_gate")
        self.delta_net = net = self._read_delta_net(ctx, fail)
        why = ctx.numerics.check_delta_net(net.head_k, net.head_v)
        if why:
            raise fail("ssm.state_size", f"{net.head_k} (value head dim {net.head_v}): {why}")
        scaling = hp("rope.scaling.type", None)
        if scaling not in ROPE_SCALINGS:
            raise fail("rope.scaling.type", f"{scaling!r} is a rope scheme ikrun does not implement for {ctx.arch}")
        n_expert = int(hp("expert_count", 0))
        self.moe = MoeConfig(n_expert, int(hp("expert_used_count")), int(hp("expert_feed_forward_length")),
                             1 if hp("expert_shared_feed_forward_length", 0) else 0, 1.0,
                             bool(hp("expert_weights_norm", True)), GATING_SOFTMAX,
                             n_ff_shared=int(hp("expert_shared_feed_forward_length", 0)),
                             shared_gate=any(ctx.has(f"blk.{i}.ffn_gate_inp_shexp.weight") for i in range(n_layer))) \
            if n_expert else None
        if self.moe is not None and not 0 < self.moe.n_used <= self.moe.n_expert:
            raise fail("expert_used_count", f"{self.moe.n_used} must be in 1..expert_count {self.moe.n_expert}")
        self.dense = {i for i in range(n_layer) if self.moe is None or not ctx.has(f"blk.{i}.ffn_gate_inp.weight")}
        super().__init__(ctx)
        if self.n_rot % 2 or not 0 < self.n_rot <= self.head_dim:
            self.fail_hparam("rope.dimension_count", f"{self.n_rot} must be even and in 2..key_length "
                                                     f"{self.head_dim}")

    def _read_delta_net(self, ctx: Context, fail: Callable[[str, str], ModelError]) -> GatedDeltaNet:
        """The delta-net's shape from the ssm.* keys, each checked against the others and against attn_qkv."""
        hp = ctx.hparam
        state, groups = int(hp("ssm.state_size")), int(hp("ssm.group_count"))
        v_heads, inner, kernel = int(hp("ssm.time_step_rank")), int(hp("ssm.inner_size")), int(hp("ssm.conv_kernel"))
        if kernel < 1:
            raise fail("ssm.conv_kernel", f"{kernel}: a convolution needs at least one tap")
        if groups < 1 or v_heads < 1 or state < 1:
            raise fail("ssm.group_count", f"{groups}, time_step_rank {v_heads} and state_size {state} must be "
                                            "positive")
        if v_heads % groups:
            raise fail("ssm.time_step_rank", f"{v_heads} (value heads) is not a multiple of group_count {groups} "
                                               "(key heads)")
        if inner % v_heads:
            raise fail("ssm.inner_size", f"{inner} is not a multiple of time_step_rank {v_heads} (value heads)")
        net = GatedDeltaNet(groups, v_heads, state, inner // v_heads, kernel, float(hp("attention.layer_norm_rms_epsilon")),
                            tiled=self.qwen35_layout, fused_ba=not self.qwen35_layout)
        for i in range(int(hp("block_count"))):
            for proj, rows, extra in ((f"blk.{i}.attn_qkv.weight", net.conv_channels, ""),
                                      (f"blk.{i}.ssm_in.weight", net.conv_channels + inner, " + inner_size")):
                if ctx.has(proj) and ctx.shape(proj)[0] != rows:
                    raise fail("ssm.state_size", f"{state} disagrees with the heads: {proj} has "
                                                   f"{ctx.shape(proj)[0]} rows, 2 x group_count {groups} x "
                                                   f"state_size {state} + inner_size {inner}{extra} = {rows}")
        return net

    def make_attention(self) -> GqaAttention:
        return GqaAttention(self.n_head, self.n_head_kv, self.head_dim, self.head_dim_v, self.n_rot, self.eps,
                            neox=True, qk_norm=True, output_gate=True)

    def _mixer_expected(self, i: int, b: str) -> dict[str, tuple[int, ...]]:
        if i in self.full_attention:
            return self.attention.expected(b, self.n_embd)
        return self.delta_net.expected(b, self.n_embd, self.delta_net.fused_qkvz(self.ctx, b))

    def _ffn_expected(self, i: int, b: str) -> dict[str, tuple[int, ...]]:
        if i in self.dense or self.moe is None:
            return super()._ffn_expected(i, b)
        want = self.moe.expected(b, self.n_embd)
        if self.moe.shared_gate:  # ik's quantizer writes it as a vector, the F32 conversion as one row
            gate = b + "ffn_gate_inp_shexp.weight"
            want[gate] = (self.n_embd,) if self.ctx.has(gate) and self.ctx.shape(gate) == (self.n_embd,) \
                else (1, self.n_embd)
        return want

    def mixer(self, i: int, h: np.ndarray, seq: Sequence) -> np.ndarray:
        if i in self.full_attention:
            return super().mixer(i, h, seq)
        return self.delta_net(self.ctx, f"blk.{i}.", h, seq.state.get("kv"))

    def keep_cache(self, cache: dict[str, Any], length: int) -> dict[str, Any]:
        """Attention layers' keys and values cut at `length`, delta-net layers' state recomputed to it."""
        kept = super().keep_cache({b: c for b, c in cache.items() if block_of(b) in self.full_attention}, length)
        return {b: kept[b] if b in kept else self.delta_net.keep(self.ctx, c, length) for b, c in cache.items()}

    def ffn_residual(self, i: int, xs: list[np.ndarray], hs: list[np.ndarray],
                     seqs: list[Sequence]) -> list[np.ndarray]:
        if i in self.dense or self.moe is None:
            return super().ffn_residual(i, xs, hs, seqs)
        return moe_ffn(self.ctx, hs, seqs, f"blk.{i}.", self.moe, residual=xs)
