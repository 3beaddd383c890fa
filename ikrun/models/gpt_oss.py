"""gpt-oss (`gpt-oss`): ik's build_openai_moe graph, which is transformers' GptOssForCausalLM.

Per layer: RMSNorm; Q/K/V projections with biases; NEOX rope with YaRN; causal GQA attention with one learned sink
logit per head (`attn_sinks.weight`) in every softmax, over a sliding window of `attention.sliding_window` keys on
layers 0, 2, 4... (ik's fixed pattern) and over every key on the others; attn_output with its bias; residual.
RMSNorm (`post_attention_norm`) and the routed MoE FFN: the router with its bias, the top-k of its raw logits
weighted by a softmax over those k, the experts' projections each with its bias and gpt-oss's clamped SwiGLU
((up + 1) * gate * sigmoid(1.702 gate), gate clamped at most 7, up to [-7, 7]); residual.

YaRN: ext_factor 1, beta 32/1, cos/sin times 1 + 0.1 ln(factor). ggml rounds the correction range out to whole
dims; the exact mode computes transformers' model and so keeps it fractional when the file carries our key
`gpt-oss.rope.scaling.yarn_truncate = false` (ikconvert writes it for `rope_scaling.truncate: false`; without the key,
ik's rounding; `--numerics ik` always rounds, as ik does). `--numerics ik` computes ik's graph in ik's float order
(ikrun/numerics/ik/): its attention kernel with the sinks in the softmax and the window as masked cells, the MXFP4
experts in its integer kernels on 8-bit activations, chosen per expert by the tokens ik's batch routes to it (a
chunk; in the last block only the rows whose logits ik is asked for).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ikrun.errors import ModelError
from ikrun.models.base import Sequence
from ikrun.models.llama import LlamaFamily
from ikrun.modules.attention import GqaAttention
from ikrun.modules.ffn import MoeConfig, moe_ffn
from ikrun.ops.moe import GATING_SOFTMAX_WEIGHT
from ikrun.ops.rope import Yarn, yarn_rope_cache

if TYPE_CHECKING:
    from ikrun.context import Context

#: gpt-oss's SwiGLU: sigmoid slope and clamp (fixed in transformers' GptOssExperts and ik's graph)
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
#: every other layer slides, starting with layer 0 (ik's build_openai_moe)
SLIDING_PATTERN = 2


class GptOss(LlamaFamily):
    ffn_norm = "post_attention_norm.weight"
    archs = ("gpt-oss",)

    def __init__(self, ctx: Context):
        hp = ctx.hparam
        self.moe = MoeConfig(int(hp("expert_count")), int(hp("expert_used_count")),
                             int(hp("expert_feed_forward_length")), 0, 1.0, False, GATING_SOFTMAX_WEIGHT)
        if not 0 < self.moe.n_used <= self.moe.n_expert:
            raise self._refuse(ctx, f"gpt-oss.expert_used_count {self.moe.n_used} must be in 1..expert_count "
                                    f"{self.moe.n_expert}")
        self.window = int(hp("attention.sliding_window"))
        scaling = hp("rope.scaling.type", "none")
        if scaling not in ("none", "yarn"):
            raise self._refuse(ctx, f"gpt-oss.rope.scaling.type = {scaling!r} is not implemented for gpt-oss "
                                    "(yarn or none)")
        super().__init__(ctx)
        factor = float(hp("rope.scaling.factor", 0.0) or 0.0)
        yarn = scaling == "yarn" and factor != 0.0
        self.freq_scale = float(np.float32(1.0) / np.float32(factor)) if yarn else 1.0
        self.yarn = Yarn(ext_factor=1.0 if yarn else 0.0,
                         n_ctx_orig=int(hp("rope.scaling.original_context_length", 0) or hp("context_length", 0)),
                         truncate=ctx.numerics.yarn_truncates(bool(hp("rope.scaling.yarn_truncate", True))))

    @staticmethod
    def _refuse(ctx: Context, message: str) -> ModelError:
        """A ModelError about the file, before the base class is set up."""
        return ModelError(f"{ctx.path}: {message}")

    def make_attention(self) -> GqaAttention:
        return GqaAttention(self.n_head, self.n_head_kv, self.head_dim, self.head_dim_v, self.n_rot, self.eps,
                            neox=True, qk_norm=False, sinks=True)

    def _expected(self) -> dict[str, tuple[int, ...]]:
        want = super()._expected()
        e, q, kv = self.n_embd, self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        x, ff = self.moe.n_expert, self.moe.n_ff
        for i in range(self.n_layer):
            b = f"blk.{i}."
            want.update({b + "attn_q.bias": (q,), b + "attn_k.bias": (kv,), b + "attn_v.bias": (kv,),
                         b + "attn_output.bias": (e,), b + "ffn_gate_inp.bias": (x,), b + "ffn_up_exps.bias": (x, ff),
                         b + "ffn_gate_exps.bias": (x, ff), b + "ffn_down_exps.bias": (x, e)})
        return want

    def _ffn_expected(self, i: int, b: str) -> dict[str, tuple[int, ...]]:
        return self.moe.expected(b, self.n_embd)

    def begin(self, seq: Sequence) -> None:
        def table() -> tuple[np.ndarray, np.ndarray]:
            return yarn_rope_cache(np.arange(seq.start, seq.start + len(seq)), self.n_rot, self.rope_base,
                                   self.freq_scale, self.yarn)

        seq.state["rope"] = self.table(("rope", len(seq)), table) if seq.start == 0 else table()

    def attention_window(self, i: int) -> int:
        return self.window if i % SLIDING_PATTERN < SLIDING_PATTERN - 1 else 0

    def ffn(self, i: int, hs: list[np.ndarray], seqs: list[Sequence]) -> list[np.ndarray]:
        return moe_ffn(self.ctx, hs, seqs, f"blk.{i}.", self.moe, limit=SWIGLU_LIMIT, alpha=SWIGLU_ALPHA)
