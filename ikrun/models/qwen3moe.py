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
from ikrun.modules.ffn import MoeConfig, moe_ffn
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

    def ffn(self, i: int, hs: list[np.ndarray], seqs: list[Sequence]) -> list[np.ndarray]:
        return super().ffn(i, hs, seqs) if i in self.dense else moe_ffn(self.ctx, hs, seqs, f"blk.{i}.", self.moe)
