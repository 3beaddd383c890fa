"""GLM-4.5 / 4.6 / 4.7 (`glm4moe`): ik's build_glm4_moe graph, which is transformers' Glm4MoeForCausalLM.

Per layer: RMSNorm; Q/K/V projections with their biases, per-head Q/K RMSNorm where the file has attn_q_norm /
attn_k_norm (GLM-4.5's use_qk_norm), NEOX rope on the first rope.dimension_count dims of each head (partial
rotary: 64 of 128 in the released models), causal GQA attention, attn_output, residual. Then RMSNorm by
`post_attention_norm` (ik loads it as the FFN norm) and either the dense SwiGLU FFN (the leading_dense_block_count
first layers) or the MoE FFN: sigmoid scores, the top-k chosen on scores + exp_probs_b.bias and weighted by the
plain scores, renormalised when expert_weights_norm, times expert_weights_scale, plus the shared experts; residual.
The NextN/MTP blocks at the end (nextn_predict_layers) are loaded and shape-checked but take no part in the main
forward, as in both ik and transformers; the last of them drafts tokens for speculative decoding (`nextn_head`:
ikrun/modules/nextn.py, the block run as the layer it is, as ik's build_glm4_moe_mtp does; with its own
nextn.embed_tokens / shared_head_head, which ik's loader ignores, so that `--numerics ik` takes token_embd / output).

Where ik and transformers differ, the default (exact) arithmetic computes transformers' model and `--numerics ik`
computes ik's: with expert groups (`expert_group_count` > 1, which ikconvert writes from n_group) transformers
limits the top-k to the `expert_group_used_count` best groups, ik's graph takes a plain top-k over all experts. The
released GLM-4.x models have one group, where the two agree.

A file asking for something not computed here (a rope scaling type other than linear, an unknown gating function,
groups that do not divide the experts) is refused when the model loads, key and value named.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ikrun.models.base import Sequence
from ikrun.models.llama import LlamaFamily
from ikrun.modules.ffn import MoeConfig, moe_ffn
from ikrun.modules.nextn import NextnHead
from ikrun.ops.moe import GATING_SIGMOID

if TYPE_CHECKING:
    from ikrun.context import Context

#: rope scaling types computed for this architecture (ik's converter writes none)
ROPE_SCALING = ("none", "linear")


class Glm4Moe(LlamaFamily):
    ffn_norm = "post_attention_norm.weight"  # ik loads GLM's post-attention norm as the FFN norm
    archs = ("glm4moe",)

    def __init__(self, ctx: Context):
        hp = ctx.hparam
        self.ctx = ctx  # self.fail names the file before LlamaFamily's checks (which need what is read here) run
        scaling = hp("rope.scaling.type", "none")
        if scaling not in ROPE_SCALING:
            raise self.fail(f"glm4moe.rope.scaling.type {scaling!r} is not computed here (only "
                            f"{', '.join(ROPE_SCALING)})")
        moe = MoeConfig.read(hp, GATING_SIGMOID, lambda why: self.fail(f"glm4moe.{why}"))
        n_group, topk_group = int(hp("expert_group_count", 1) or 1), int(hp("expert_group_used_count", 1) or 1)
        if n_group < 1 or moe.n_expert % n_group or not 1 <= topk_group <= n_group:
            raise self.fail(f"glm4moe.expert_group_count {n_group} / expert_group_used_count {topk_group} do not "
                            f"split expert_count {moe.n_expert} into groups of which some are used")
        if n_group > 1 and moe.gating != GATING_SIGMOID:
            raise self.fail(f"glm4moe.expert_group_count {n_group} with expert_gating_func {moe.gating}: expert "
                            "groups are computed for sigmoid gating only")
        self.moe = MoeConfig(moe.n_expert, moe.n_used, moe.n_ff, moe.n_shared, moe.w_scale, moe.w_norm, moe.gating,
                             (n_group, topk_group))
        self.n_dense = int(hp("leading_dense_block_count", 0))
        self.n_mtp = int(hp("nextn_predict_layers", 0))
        super().__init__(ctx)

    def _qk_norm(self) -> bool:
        return self.ctx.has("blk.0.attn_q_norm.weight")

    def _n_trailing(self) -> int:
        if not 0 <= self.n_mtp < self.n_layer:
            raise self.fail(f"glm4moe.nextn_predict_layers {self.n_mtp} leaves no main layers of {self.n_layer}")
        return self.n_mtp

    def _block_expected(self, i: int) -> dict[str, tuple[int, ...]]:
        b, e = f"blk.{i}.", self.n_embd
        want = {b + "attn_norm.weight": (e,), b + "post_attention_norm.weight": (e,),
                **self.attention.expected(b, e)}
        if i < self.n_dense:
            return {**want, **self._ffn_expected(i, b)}
        return {**want, **self.moe.expected(b, e), b + "exp_probs_b.bias": (self.moe.n_expert,)}

    def _nextn_expected(self, i: int) -> dict[str, tuple[int, ...]]:
        b, e, v = f"blk.{i}.nextn.", self.n_embd, self.n_vocab
        return {**self._block_expected(i), b + "eh_proj.weight": (e, 2 * e), b + "enorm.weight": (e,),
                b + "hnorm.weight": (e,), b + "shared_head_norm.weight": (e,), b + "embed_tokens.weight": (v, e),
                b + "shared_head_head.weight": (v, e)}

    def check_tensors(self, want: dict[str, tuple[int, ...]], optional: dict[str, tuple[int, ...]] | None = None,
                      hint: str = "") -> None:
        nextn = {n: s for i in range(self.n_active, self.n_layer) for n, s in self._nextn_expected(i).items()}
        super().check_tensors(want, {**(optional or {}), **nextn}, hint)

    def nextn_head(self) -> NextnHead:
        """The last block's NextN head (ik drafts with block n_layer - 1, the only one GLM-4.x carries)."""
        i = self.n_layer - 1
        if not self.n_mtp:
            raise self.fail("glm4moe.nextn_predict_layers is 0: the file has no NextN/MTP head to draft with")
        missing = NextnHead.missing(self.ctx, i)
        if missing:
            raise self.fail(f"NextN/MTP tensors missing: {', '.join(missing)}")
        return NextnHead.of(self.ctx, i, self.output, lambda x, seq: self.block(i, [x], [seq])[0], self.norm,
                            self.ctx.numerics.nextn_own_tables(self.ctx.arch))

    def ffn_residual(self, i: int, xs: list[np.ndarray], hs: list[np.ndarray],
                     seqs: list[Sequence]) -> list[np.ndarray]:
        if i < self.n_dense:
            return super().ffn_residual(i, xs, hs, seqs)
        return moe_ffn(self.ctx, hs, seqs, f"blk.{i}.", self.moe, residual=xs)
