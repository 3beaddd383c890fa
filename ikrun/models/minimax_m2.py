"""MiniMax-M2 (`minimax-m2`): ik's build_minimaxm2 graph, which is transformers' MiniMaxM2ForCausalLM.

Per layer: RMSNorm, Q/K/V projections, RMSNorm over the whole Q and the whole K projection (every head at once, one
weight per row element, not per head), NEOX rope on the first `rope.dimension_count` dims of each head (partial
rotary), causal GQA attention, attn_output, residual; RMSNorm and the routed MoE FFN: sigmoid scores, the top-k
chosen on score + `exp_probs_b.bias`, weighted by their scores renormalised to sum 1; no shared experts, no dense
layers. ik and transformers compute the same model; the default (exact) mode follows transformers' float32
arithmetic and `--numerics ik` ik's (its fused sums and reciprocals), both through the shared modules. A rope
scaling other than linear (YaRN, which ik would apply) is refused by key and value before anything is computed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ikrun.errors import ModelError
from ikrun.models.base import Sequence
from ikrun.models.llama import LlamaFamily
from ikrun.modules.attention import GqaAttention
from ikrun.modules.ffn import MoeConfig, moe_ffn
from ikrun.ops.moe import GATING_NAMES, GATING_SOFTMAX

if TYPE_CHECKING:
    from ikrun.context import Context


class MiniMaxM2(LlamaFamily):
    archs = ("minimax-m2",)

    def __init__(self, ctx: Context):
        hp = ctx.hparam
        # ik reads the gating function as optional; its MoE FFN then takes softmax
        self.moe = MoeConfig(int(hp("expert_count")), int(hp("expert_used_count")),
                             int(hp("expert_feed_forward_length")), 0, 1.0, True,
                             int(hp("expert_gating_func", GATING_SOFTMAX)))
        if self.moe.gating not in GATING_NAMES:
            raise ModelError(f"{ctx.path}: minimax-m2.expert_gating_func {self.moe.gating} is not one of "
                             f"{sorted(GATING_NAMES)}")
        if not 0 < self.moe.n_used <= self.moe.n_expert:
            raise ModelError(f"{ctx.path}: minimax-m2.expert_used_count {self.moe.n_used} must be in "
                             f"1..expert_count {self.moe.n_expert}")
        scaling = hp("rope.scaling.type", None)
        if scaling not in (None, "none", "linear"):
            raise ModelError(f"{ctx.path}: minimax-m2.rope.scaling.type = {scaling!r} is not implemented for "
                             "minimax-m2 (linear or none)")
        super().__init__(ctx)

    def make_attention(self) -> GqaAttention:
        return GqaAttention(self.n_head, self.n_head_kv, self.head_dim, self.head_dim_v, self.n_rot, self.eps,
                            neox=True, qk_norm=True, qk_norm_all_heads=True)

    def _ffn_expected(self, i: int, b: str) -> dict[str, tuple[int, ...]]:
        return {**self.moe.expected(b, self.n_embd), b + "exp_probs_b.bias": (self.moe.n_expert,)}

    def ffn(self, i: int, hs: list[np.ndarray], seqs: list[Sequence]) -> list[np.ndarray]:
        return moe_ffn(self.ctx, hs, seqs, f"blk.{i}.", self.moe)
