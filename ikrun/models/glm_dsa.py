"""GLM-5 / GLM-5.2 (GGUF arch `glm-dsa`): DeepSeek-V3's MLA + MoE forward (ikrun/models/deepseek2.py) with DeepSeek
Sparse Attention: a lightning indexer picks, per query, the `attention.indexer.top_k` earlier keys its attention
may see.

The indexer, as ik's build_deepseek2_dsa_indexer computes it (-fa off), on a layer that runs it:

- query: `indexer.attn_q_b` on the normalised q LoRA latent, [n, heads, key_length]; key: `indexer.attn_k` on the
  attention input, one head shared by all, through a LayerNorm with weight and bias (eps = rms eps, as ik);
  NORM rope on the *first* rope.dimension_count dims of both (the main attention ropes its last dims);
- head weights `indexer.proj` on the attention input, times 1/sqrt(heads * key_length);
- score = sum over heads of weight * relu(q . k) (ikrun/ops/indexer.py), causal; the top_k keys are kept, ties going
  to the later key as ik's argsort orders them.

Which layers run it follows the file: `attention.indexer.types` (true = "full"), every layer when the key is absent
(GLM-5 has no IndexShare). A "shared" layer reuses the last full layer's selection. ik ignores that key and
hard-codes GLM-5.2's schedule, which is wrong for GLM-5 (whose layers all run their indexer).

With `--kv-cache f16` the runtime reproduces ik's default caches: the MLA latent rounded to f16 (as for DeepSeek)
and the indexer keys Walsh-Hadamard-rotated (the queries too) and rounded to f16, as ik's indexer key cache holds
them (another type with -ictk, ikrun/kvcache.py); the few near-tie selections ik's caches flip then flip here too.

A sequence continues through the latent cache and an indexer key cache (each full layer's roped, normed keys, as
ik's indexer cache holds them): a continued query selects among every cached key (`continues`, a speculative
decoding target). The NextN/MTP block (`nextn_head`, ikrun/modules/nextn.py) is a full layer with its own indexer,
sparse as the model defines it (vLLM's and SGLang's GLM-5 MTP); ik's MTP graph runs its attention dense, which
`--numerics ik` follows (Numerics.nextn_sparse_attention).

Runtime options (ikrun/ctx.RuntimeOptions): by default the model's semantics, sparse attention with no sink;
`dsa=False` runs dense attention everywhere (ik without --dsa); `dsa_top_k` replaces the file's top-k (ik's
-dsatk); `dsa_sink` adds ik's boost that always keeps each
sequence's first token (ik's --dsa default, not in the model). A file without `expert_gating_func` routes by
sigmoid, GLM-5's scoring function (ik falls back to softmax there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ikrun.models.base import Sequence
from ikrun.models.deepseek2 import Deepseek2
from ikrun.modules.nextn import NextnHead
from ikrun.ops.indexer import TIE_LATER_INDEX, hadamard, select_top_k
from ikrun.ops.moe import GATING_SIGMOID
from ikrun.ops.norm import layer_norm

if TYPE_CHECKING:
    from ikrun.context import Context

INDEXER = ("indexer.attn_q_b.weight", "indexer.attn_k.weight", "indexer.k_norm.weight", "indexer.k_norm.bias",
           "indexer.proj.weight")
#: ik's sink boost: added to the score of each sequence's first key before the top-k
SINK_BOOST = np.float32(1e20)


class GlmDsa(Deepseek2):
    archs = ("glm-dsa",)
    runtime_options = ("dsa", "dsa_sink", "mla", "dsa_top_k")
    continues = True
    no_mtp_hint = " (its checkpoint's num_nextn_predict_layers was 0, or the layer was dropped)"

    def __init__(self, ctx: Context):
        hp = ctx.hparam
        self.n_ihead = int(hp("attention.indexer.head_count"))
        self.i_dim = int(hp("attention.indexer.key_length"))
        self.top_k = ctx.options.dsa_top_k or int(hp("attention.indexer.top_k"))
        self.sparse = ctx.options.dsa is not False
        self.sink = ctx.options.dsa_sink
        super().__init__(ctx)

    def _default_gating(self) -> int:
        return GATING_SIGMOID

    def _expected(self, i: int) -> dict[str, tuple[int, ...]]:
        """DeepSeek's block tensors, plus the indexer's and the NextN block's where the file has them (which layers
        must have an indexer is the schedule's business, checked below)."""
        want = super()._expected(i)
        e, b = self.n_embd, f"blk.{i}."
        extra = {"indexer.attn_q_b.weight": (self.n_ihead * self.i_dim, self.q_lora),
                 "indexer.attn_k.weight": (self.i_dim, e), "indexer.k_norm.weight": (self.i_dim,),
                 "indexer.k_norm.bias": (self.i_dim,), "indexer.proj.weight": (self.n_ihead, e),
                 "nextn.eh_proj.weight": (e, 2 * e), "nextn.enorm.weight": (e,), "nextn.hnorm.weight": (e,),
                 "nextn.shared_head_norm.weight": (e,)}
        want.update({b + name: shape for name, shape in extra.items() if self.ctx.has(b + name)})
        return want

    def _check_tensors(self) -> None:
        cx, arch = self.ctx, self.ctx.arch
        if not self.q_lora:
            raise self.fail(f"{arch}.attention.q_lora_rank is missing; the indexer's query is built from "
                              "the q LoRA latent")
        if not self.n_rot < self.i_dim or self.top_k <= 0 or self.n_ihead <= 0:
            raise self.fail(f"{arch}.attention.indexer.key_length {self.i_dim} must exceed "
                              f"rope.dimension_count {self.n_rot}, and head_count {self.n_ihead} and top_k "
                              f"{self.top_k} must be positive")
        super()._check_tensors()
        if self.sparse and cx.cache.indexer != "f32" and self.i_dim & (self.i_dim - 1):
            raise self.fail(f"an indexer key cache of {cx.cache.indexer} (-ictk, f16 unless the K cache is f32) is "
                            "ik's, whose Hadamard rotation needs a power-of-two "
                            f"{arch}.attention.indexer.key_length (got {self.i_dim})")
        types = cx.hparam("attention.indexer.types", None)
        full = [True] * self.n_active if types is None else [bool(t) for t in types]
        if len(full) != self.n_active or not full[0]:
            raise self.fail(f"{arch}.attention.indexer.types must have one entry per main layer "
                              f"({self.n_active}), the first true (layer 0 has no earlier selection to reuse); "
                              f"got {types}")
        #: block prefix -> whether the block runs its own indexer (the NextN head's: as the arithmetic runs it)
        self.full = {f"blk.{i}.": f for i, f in enumerate(full)}
        self.full.update({f"blk.{i}.": cx.numerics.nextn_sparse_attention() for i in range(self.n_active, self.n_layer)})
        for i in range(self.n_layer):
            b = f"blk.{i}."
            present = [n for n in INDEXER if cx.has(b + n)]
            needed = self.sparse and i < self.n_active and self.full[b]
            if (needed or present) and len(present) < len(INDEXER):
                missing = ", ".join(b + n for n in INDEXER if n not in present)
                why = "runs its lightning indexer (attention.indexer.types)" if needed else "has part of an indexer"
                raise self.fail(f"layer {i} {why} but lacks {missing}"
                                  + ("; --dsa off runs the file with dense attention" if needed else ""))

    def check_context(self, n_ctx: int, batches: tuple[int, ...] = ()) -> None:
        super().check_context(n_ctx, batches)
        top_k = self.ctx.options.dsa_top_k
        if top_k > n_ctx:
            raise self.fail(f"--dsa-top-k {top_k} exceeds the context of {n_ctx} tokens: every query would see all "
                            "its keys")

    def sequence_state_bytes(self, n_ctx: int) -> int:
        return n_ctx * n_ctx if self.sparse else 0  # the last full layer's keep mask, for the shared layers

    def nextn_head(self) -> NextnHead:
        """The last block's NextN head: the model's layer, sparse through its own indexer (or dense, as ik's MTP
        graph runs it: Numerics.nextn_sparse_attention)."""
        head = super().nextn_head()
        b = f"blk.{head.block}."
        missing = [b + n for n in INDEXER if not self.ctx.has(b + n)]
        if self.sparse and self.full[b] and missing:
            raise self.fail(f"the NextN/MTP head attends sparsely through its own indexer but lacks "
                            f"{', '.join(missing)}; --dsa off runs it dense")
        return head

    def _attention(self, b: str, h: np.ndarray, cos: np.ndarray, sin: np.ndarray, seq: Sequence) -> np.ndarray:
        qa, q = self.attention.query(self.ctx, b, h)
        kv = seq.state.get("kv")
        if self.sparse and self.full[b]:
            assert qa is not None
            seq.state["keep"] = self._select(b, h, qa, cos, sin, kv)
        return self._latent_attention(b, h, q, cos, sin, seq.state.get("keep"), kv)

    def _select(self, b: str, h: np.ndarray, qa: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                kv: dict[str, Any] | None) -> np.ndarray:
        """The lightning indexer's keep mask [n, cache rows] for the queries h (attention input) with q latent qa;
        `kv` holds a continued sequence's indexer keys of earlier positions under `b + "indexer"` (prepended, then
        kept with these, as ik's indexer key cache)."""
        cx = self.ctx
        n = h.shape[0]
        q = cx.linear(qa, b + "indexer.attn_q_b").reshape(n, self.n_ihead, self.i_dim)
        k = layer_norm(cx.linear(h, b + "indexer.attn_k"), cx.weight(b + "indexer.k_norm.weight"),
                       cx.weight(b + "indexer.k_norm.bias"), self.eps).reshape(n, 1, self.i_dim)
        self.rope(q, cos, sin, False)
        self.rope(k, cos, sin, False)
        if cx.cache.indexer != "f32":  # ik's indexer key cache (-ictk): Hadamard-rotated keys, queries to match
            q, k = hadamard(q), hadamard(k)
        keys = k.reshape(n, self.i_dim)
        if kv is not None:  # a continued sequence: the cache's earlier keys, rounded again to the same rows
            if b + "indexer" in kv:
                keys = np.concatenate([kv[b + "indexer"], keys])
            kv[b + "indexer"] = keys
        w = cx.linear(h, b + "indexer.proj") * (np.float32(1.0) / np.sqrt(np.float32(self.n_ihead * self.i_dim)))
        scores = cx.indexer_scores(q, keys, w, len(keys) - n)
        if self.sink:
            scores[:, 0] += SINK_BOOST
        return select_top_k(scores, self.top_k, TIE_LATER_INDEX)
