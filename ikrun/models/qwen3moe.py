"""Qwen3-MoE (`qwen3moe`): Qwen3's blocks (per-head Q/K RMSNorm, NEOX rope, GQA) whose FFN routes through experts.

The router is softmax over every expert, top-k, the k weights renormalised unless the file says
`expert_weights_norm = false` (ikconvert writes that for `norm_topk_prob: false`; ik's graph always renormalises);
no shared experts, no weight scale. A layer holding `ffn_gate`/`ffn_up`/`ffn_down` instead of a router is dense
(transformers' `mlp_only_layers` / `decoder_sparse_step`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ikrun.errors import ModelError
from ikrun.models.base import Sequence
from ikrun.models.llama import LlamaFamily
from ikrun.modules.ffn import MoeConfig, dense_ffn, moe_ffn
from ikrun.ops.moe import GATING_SOFTMAX

if TYPE_CHECKING:
    from ikrun.context import Context


class Qwen3Moe(LlamaFamily):
    archs = ("qwen3moe",)

    def __init__(self, ctx: Context):
        hp = ctx.hparam
        self.moe = MoeConfig(int(hp("expert_count")), int(hp("expert_used_count")),
                             int(hp("expert_feed_forward_length")), 0, 1.0, bool(hp("expert_weights_norm", True)),
                             GATING_SOFTMAX)
        if not 0 < self.moe.n_used <= self.moe.n_expert:
            raise ModelError(f"{ctx.path}: qwen3moe.expert_used_count {self.moe.n_used} must be in "
                             f"1..expert_count {self.moe.n_expert}")
        self.dense = {i for i in range(int(hp("block_count"))) if not ctx.has(f"blk.{i}.ffn_gate_inp.weight")}
        super().__init__(ctx)

    def _ffn_expected(self, i: int, b: str) -> dict[str, tuple[int, ...]]:
        return super()._ffn_expected(i, b) if i in self.dense else self.moe.expected(b, self.n_embd)

    def block(self, i: int, xs: list[np.ndarray], seqs: list[Sequence]) -> list[np.ndarray]:
        cx, b = self.ctx, f"blk.{i}."

        def attention(x: np.ndarray, seq: Sequence) -> np.ndarray:
            cos, sin = seq.state["rope"]
            return x + self.attention(cx, b, self.norm(x, cx.weight(b + "attn_norm.weight")), cos, sin,
                                      seq.state.get("kv"))

        xs = self.each(xs, seqs, attention)
        hs = [self.norm(x, cx.weight(b + "ffn_norm.weight")) for x in xs]
        if i in self.dense:
            ys = self.each(hs, seqs, lambda h, seq: dense_ffn(cx, h, b))
        else:
            ys = moe_ffn(cx, hs, seqs, b, self.moe)
        return [x + y for x, y in zip(xs, ys)]
