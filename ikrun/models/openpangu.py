"""openPangu-2.0 (GGUF arch `openpangu`): ik's build_openpangu graph as llama-perplexity runs it on the CPU.

The hidden state is S residual streams (mHC, ikrun/ops/hyperconn.py); the embedding starts in all of them. Per base
layer, twice (attention, then FFN): mixes from the RMS-normed streams through *_mhc_phi, Sinkhorn-normalised stream
mixing (hc_pre), the sub-layer on the pre-weighted sum of the streams, its output RMS-normed (sandwich norms:
attn_norm / post_attention_norm, ffn_norm / post_ffw_norm) and scattered back (hc_post). Layers carrying
block_post_norm then RMS-normalise all S*H numbers of a token at once. After the last base layer the merge module
weighs the streams (sigmoid gates from merge_mhc_phi) into one, then output_norm and the output projection.

Attention is DeepSeek's absorbed MLA (ikrun/ops/mla.py) plus:
- MoME causal convolutions (x + depthwise conv, kernel 3, zero history at position 0) on the q LoRA latent before
  attn_q_a_norm, on the KV latent before attn_kv_a_norm, and on the heads' outputs before attn_output;
- param sinks: attn_param_sink_kv RMS-normed with attn_kv_a_norm (the latent, key and value) plus the unroped
  attn_param_sink_k_pe, prepended to every query's keys outside all masks;
- the layer schedule: layers listed in swa_layers (with a window > 0 in sliding_window_list) see the last `window`
  positions; the other base layers run the DSA lightning indexer (ikrun/ops/indexer.py) when they carry its tensors
  and the file has a schedule: q from attn_indexer_q_b on the normed q latent, k = RMSNorm(attn_indexer_k . x),
  both NEOX-roped on their first rope.dimension_count dims, weights attn_indexer_weights_proj . x unscaled;
  each query keeps its top_k keys (all while it has at most top_k), ties broken as ik's fused
  iqk_indexer_topk breaks them. A file without the schedule keys runs every layer dense, as ik does.
NEOX rope, scale 1/sqrt(key_length). MoE: sigmoid routing with exp_probs_b, normalised, scaled, plus the shared
experts; the leading dense layers use ffn_gate/up/down. NextN/MTP blocks (nextn_predict_layers, at the end) are
shape-checked where present and take no part in the forward. With --kv-cache f16 the latent cache and the indexer
keys are rounded to f16, as ik's default caches (-ctk f16, -ictk f16) hold them; -ictk sets the indexer's alone.

Beyond ik: sliding windows may differ per layer (ik refuses a file whose base windows differ).

ik's CPU build with AVX-512 (the golden data's) computes the sinks' values wrongly when a file has fewer than 16
sinks (ikrun/ops/mla.py explains the over-read). The forward is exact by default; the runtime option
`ik_sink_overread` (`--ik-sink-overread`) reproduces ik's numbers for such small test models. Real models have 128
sinks and are unaffected either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ikrun.models.base import ArchModel, Hparam, Sequence
from ikrun.modules.attention import MlaAttention
from ikrun.modules.ffn import MoeConfig, dense_ffn, moe_ffn
from ikrun.ops.hyperconn import hc_combine, stream_gates
from ikrun.ops.indexer import TIE_PARTIAL_SORT, select_top_k
from ikrun.ops.moe import GATING_SIGMOID
from ikrun.ops.norm import rms_norm
from ikrun.ops.rope import rope_cache

if TYPE_CHECKING:
    from ikrun.context import Context

CONV_KERNEL = 3  # ik's MoME convolution width
INDEXER = ("attn_indexer_q_b", "attn_indexer_k", "attn_indexer_k_norm", "attn_indexer_weights_proj")


@dataclass(frozen=True)
class LayerKind:
    """How a base layer's attention chooses its keys: a window (> 0), the DSA indexer, or all causal keys."""

    window: int = 0
    indexer: bool = False


class OpenPangu(ArchModel):
    """The hidden state between blocks is the S streams [T, S, H]."""

    archs = ("openpangu",)
    runtime_options = ("ik_sink_overread",)

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        hp = ctx.hparam
        self.n_layer = int(hp("block_count"))
        self.n_embd = int(hp("embedding_length"))
        self.n_head = int(hp("attention.head_count"))
        self.eps = float(hp("attention.layer_norm_rms_epsilon"))
        self.kv_lora = int(hp("attention.kv_lora_rank"))
        self.q_lora = int(hp("attention.q_lora_rank"))
        self.n_rot = int(hp("rope.dimension_count"))
        self.head_k = int(hp("attention.key_length"))
        self.head_v = int(hp("attention.value_length"))
        self.n_nope = self.head_k - self.n_rot
        self.n_dense = int(hp("leading_dense_block_count"))
        self.n_mtp = int(hp("nextn_predict_layers", 0))
        self.n_stream = int(hp("mhc_num_stream"))
        self.sinkhorn_iters = int(hp("mhc_recur_norm"))
        self.n_sink = int(hp("param_sink_number"))
        self.freq_base = float(hp("rope.freq_base", 10000.0))
        self.kq_scale = float(np.float32(1.0) / np.sqrt(np.float32(self.head_k)))
        self.attention = MlaAttention(self.n_head, self.q_lora, self.kv_lora, self.n_rot, self.head_k, self.head_v,
                                      self.eps, self.kq_scale, neox=True, convolutions=True, observe_values=True,
                                      latent_first=True)
        self._check_sizes()
        self.n_active = self.n_layer - self.n_mtp
        if self.n_dense < self.n_layer:
            # ik: absent or "none" gating means sigmoid
            self.moe = MoeConfig.read(hp, GATING_SIGMOID, lambda why: self.fail(f"{ctx.arch}.{why}"))
        self.freq_scale = self._read_rope(hp)
        if not ctx.has("token_embd.weight"):
            raise self.fail("tensor token_embd.weight is missing")
        self.n_vocab = ctx.shape("token_embd.weight")[0]
        self.n_idx_head = self.idx_dim = self.top_k = 0  # read when a layer runs the indexer
        self.kinds = self._read_schedule(hp)
        self._check_tensors()

    # ---- hyperparameters ------------------------------------------------------------------------------------
    def hidden_width(self) -> int:
        return self.n_stream * self.n_embd

    def _check_sizes(self) -> None:
        if self.n_rot <= 0 or self.n_rot % 2 or self.n_nope <= 0:
            self.fail_hparam("rope.dimension_count", f"{self.n_rot} must be even, positive and below the key length "
                             f"{self.head_k}")
        if not 0 <= self.n_mtp < self.n_layer:
            self.fail_hparam("nextn_predict_layers", f"{self.n_mtp} leaves no main layers of {self.n_layer}")
        if not 1 <= self.n_stream <= 8:
            self.fail_hparam("mhc_num_stream", f"{self.n_stream} must be 1..8 (ggml's hyper-connection ops)")
        if self.sinkhorn_iters < 1:
            self.fail_hparam("mhc_recur_norm", f"{self.sinkhorn_iters}: Sinkhorn needs at least one iteration")
        if self.n_sink < 1:
            self.fail_hparam("param_sink_number", f"{self.n_sink}: the attention needs at least one param sink")
        for key, value in (("attention.q_lora_rank", self.q_lora), ("attention.kv_lora_rank", self.kv_lora),
                           ("attention.value_length", self.head_v)):
            if value <= 0:
                self.fail_hparam(key, f"{value} must be positive")

    def _read_rope(self, hp: Hparam) -> float:
        scaling = str(hp("rope.scaling.type", "none"))
        if scaling not in ("none", "linear"):
            self.fail_hparam("rope.scaling.type", f"{scaling!r} is not supported for openpangu (none, linear)")
        factor = float(hp("rope.scaling.factor", 0.0) or 0.0)
        return 1.0 / factor if scaling == "linear" and factor else 1.0

    def _read_schedule(self, hp: Hparam) -> list[LayerKind]:
        """Per base layer: its window, or whether the DSA indexer chooses its keys (ik's reading of the arrays)."""
        ids, windows = hp("swa_layers", None), hp("sliding_window_list", None)
        if ids is None or windows is None:
            return [LayerKind() for _ in range(self.n_active)]  # ik: no schedule (or half of one) runs dense
        ids, windows = [int(v) for v in ids], [int(v) for v in windows]
        if len(ids) != len(windows):
            self.fail_hparam("sliding_window_list", f"has {len(windows)} entries, swa_layers has {len(ids)}")
        window = [0] * self.n_layer
        for il, w in zip(ids, windows):
            if not 0 <= il < self.n_layer:
                self.fail_hparam("swa_layers", f"names layer {il}, outside 0..{self.n_layer - 1}")
            if w < 0:
                self.fail_hparam("sliding_window_list", f"has a negative window {w} (layer {il})")
            window[il] = w
        if not any(window[: self.n_active]):
            return [LayerKind() for _ in range(self.n_active)]  # ik runs dense without a base window
        kinds = [LayerKind(window=w) if w else LayerKind(indexer=self.ctx.has(f"blk.{i}.attn_indexer_q_b.weight"))
                 for i, w in enumerate(window[: self.n_active])]
        if any(k.indexer for k in kinds):
            self.n_idx_head = int(hp("attention.indexer.head_count"))
            self.idx_dim = int(hp("attention.indexer.key_length"))
            self.top_k = int(hp("attention.indexer.top_k"))
            if self.n_idx_head <= 0 or self.top_k <= 0:
                self.fail_hparam("attention.indexer.top_k", f"{self.top_k} and head_count {self.n_idx_head} must be "
                                 "positive on layers that run the indexer")
            if self.idx_dim < self.n_rot:
                self.fail_hparam("attention.indexer.key_length", f"{self.idx_dim} is below rope.dimension_count "
                                 f"{self.n_rot} (the indexer ropes its first {self.n_rot} dims)")
        return kinds

    # ---- tensors --------------------------------------------------------------------------------------------
    def _expected(self, i: int) -> dict[str, tuple[int, ...]]:
        """Block i's tensors and their numpy shapes (the mHC ones on base layers only)."""
        e, h, c, r, ql = self.n_embd, self.n_head, self.kv_lora, self.n_rot, self.q_lora
        b = f"blk.{i}."
        hv = h * self.head_v
        want = {b + "attn_norm.weight": (e,), b + "post_attention_norm.weight": (e,), b + "ffn_norm.weight": (e,),
                b + "post_ffw_norm.weight": (e,), b + "attn_q_a_norm.weight": (ql,), b + "attn_kv_a_norm.weight": (c,),
                b + "attn_q_a.weight": (ql, e), b + "attn_q_b.weight": (h * self.head_k, ql),
                b + "attn_kv_a_mqa.weight": (c + r, e), b + "attn_k_b.weight": (h * c, self.n_nope),
                b + "attn_v_b.weight": (hv, c), b + "attn_output.weight": (e, hv),
                b + "attn_qa_conv.weight": (ql, CONV_KERNEL), b + "attn_compresskv_conv.weight": (c, CONV_KERNEL),
                b + "attn_o_conv.weight": (hv, CONV_KERNEL), b + "attn_param_sink_kv": (self.n_sink, c),
                b + "attn_param_sink_k_pe": (self.n_sink, r)}
        if i < self.n_active:
            s, mixes = self.n_stream * e, (2 + self.n_stream) * self.n_stream
            for sub in ("attn", "mlp"):
                want.update({f"{b}{sub}_mhc_phi.weight": (mixes, s), f"{b}{sub}_mhc_alpha": (3,),
                             f"{b}{sub}_mhc_beta": (mixes,), f"{b}{sub}_mhc_gamma": (s,)})
        if i < self.n_dense:
            ff = int(self.ctx.hparam("feed_forward_length"))
            want.update({b + "ffn_gate.weight": (ff, e), b + "ffn_up.weight": (ff, e), b + "ffn_down.weight": (e, ff)})
            return want
        want.update({**self.moe.expected(b, e), b + "exp_probs_b.bias": (self.moe.n_expert,)})
        return want

    def _optional(self, i: int) -> dict[str, tuple[int, ...]]:
        """Tensors checked where present: block_post_norm, the indexer's, and a NextN block's own."""
        e, b = self.n_embd, f"blk.{i}."
        want: dict[str, tuple[int, ...]] = {b + "block_post_norm.weight": (self.n_stream * e,)}
        if self.top_k:
            di, ih = self.idx_dim, self.n_idx_head
            want.update({b + "attn_indexer_q_b.weight": (ih * di, self.q_lora), b + "attn_indexer_k.weight": (di, e),
                         b + "attn_indexer_k_norm.weight": (di,), b + "attn_indexer_weights_proj.weight": (ih, e)})
        if i >= self.n_active:
            want.update({b + "nextn.eh_proj.weight": (e, 2 * e), b + "nextn.enorm.weight": (e,),
                         b + "nextn.hnorm.weight": (e,), b + "nextn.shared_head_norm.weight": (e,),
                         b + "nextn.embed_tokens.weight": (self.n_vocab, e),
                         b + "nextn.shared_head_head.weight": (self.n_vocab, e)})
        return want

    def _check_tensors(self) -> None:
        """Every main block's tensors and the globals must be there, the indexer's on layers that run it; tensors of
        NextN blocks and optional ones are shape-checked where present."""
        cx, e, s = self.ctx, self.n_embd, self.n_stream
        want = {"token_embd.weight": (self.n_vocab, e), "output_norm.weight": (e,), "output.weight": (self.n_vocab, e),
                "merge_mhc_phi.weight": (s, s * e), "merge_mhc_beta": (s,), "merge_mhc_gamma": (s * e,)}
        for i in range(self.n_active):
            want.update(self._expected(i))
            if self.kinds[i].indexer:
                want.update({f"blk.{i}.{name}.weight": self._optional(i)[f"blk.{i}.{name}.weight"]
                             for name in INDEXER})
        if not cx.has("merge_mhc_alpha"):
            want["merge_mhc_alpha"] = (1,)  # () or (1,): named as missing here, its shape is checked below
        optional: dict[str, tuple[int, ...]] = {}
        for i in range(self.n_layer):
            optional.update(self._optional(i) if i < self.n_active else {**self._expected(i), **self._optional(i)})
        self.check_tensors(want, optional)
        if cx.shape("merge_mhc_alpha") not in ((), (1,)):
            raise self.fail(f"tensor merge_mhc_alpha has shape {list(cx.shape('merge_mhc_alpha'))}, expected one "
                            "number")

    # ---- forward --------------------------------------------------------------------------------------------
    def begin(self, seq: Sequence) -> None:
        n = len(seq)
        seq.state["rope"] = self.table(("rope", n), lambda: rope_cache(np.arange(n), self.n_rot, self.freq_base,
                                                                       self.freq_scale))

    def embed(self, seq: Sequence) -> np.ndarray:
        """The embedding in all S streams."""
        return np.repeat(self.ctx.embed_rows("token_embd.weight", seq.tokens)[:, None, :], self.n_stream, axis=1)

    def block(self, i: int, xs: list[np.ndarray], seqs: list[Sequence]) -> list[np.ndarray]:
        cx, b = self.ctx, f"blk.{i}."

        def attention(streams: np.ndarray, seq: Sequence) -> np.ndarray:
            cos, sin = seq.state["rope"]
            return self._sublayer(streams, b + "attn_mhc", b + "attn_norm.weight", b + "post_attention_norm.weight",
                                  lambda h: self._attention(i, h, cos, sin))

        xs = self.each(xs, seqs, attention)
        if i < self.n_dense:
            xs = self.each(xs, seqs, lambda streams, seq: self._sublayer(
                streams, b + "mlp_mhc", b + "ffn_norm.weight", b + "post_ffw_norm.weight",
                lambda h: dense_ffn(cx, h, b)))
        else:
            xs = self._moe_sublayer(b, xs, seqs)
        if cx.has(b + "block_post_norm.weight"):
            xs = [rms_norm(x.reshape(len(x), -1), cx.weight(b + "block_post_norm.weight"), self.eps).reshape(x.shape)
                  for x in xs]
        return self.output_rows(i, xs, seqs)  # ik cuts the output rows after the last block, before the head

    def head(self, streams: np.ndarray, seq: Sequence) -> np.ndarray:
        cx = self.ctx
        x = hc_combine(streams, self._merge_weights(streams))
        x = self.norm(x, cx.weight("output_norm.weight"))
        return np.ascontiguousarray(cx.project(x, "output.weight"), dtype=np.float32)

    def _moe_sublayer(self, b: str, xs: list[np.ndarray], seqs: list[Sequence]) -> list[np.ndarray]:
        """The mHC-wrapped MoE FFN for a batch: mixes and sandwich norms per sequence, the experts once for all."""
        mixed = self.each(xs, seqs, lambda streams, seq: self._mix_in(streams, b + "mlp_mhc", b + "ffn_norm.weight"))
        ys = moe_ffn(self.ctx, [h for h, _ in mixed], seqs, b, self.moe)
        return [self._mix_out(y, b + "post_ffw_norm.weight", streams, mix)
                for y, streams, (_, mix) in zip(ys, xs, mixed)]

    def _sublayer(self, streams: np.ndarray, mhc: str, norm: str, post_norm: str,
                  body: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """One mHC-wrapped sub-layer: mix the streams in, run `body` between its sandwich norms, scatter back."""
        h, mix = self._mix_in(streams, mhc, norm)
        return self._mix_out(body(h), post_norm, streams, mix)

    def _mix_in(self, streams: np.ndarray, mhc: str, norm: str) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """(the sub-layer's normed input from the pre-weighted streams, the (post, mix) weights hc_post needs)."""
        cx = self.ctx
        flat = self.norm(streams.reshape(len(streams), -1), cx.weight(mhc + "_gamma"))
        pre, post, mix = cx.numerics.hc_pre(cx.linear(flat, mhc + "_phi"), cx.weight(mhc + "_alpha"),
                                            cx.weight(mhc + "_beta"), self.n_stream, self.sinkhorn_iters)
        return self.norm(cx.numerics.hc_combine(streams, pre), cx.weight(norm)), (post, mix)

    def _mix_out(self, y: np.ndarray, post_norm: str, streams: np.ndarray, weights: tuple[np.ndarray, ...]) -> np.ndarray:
        post, mix = weights
        return self.ctx.numerics.hc_post(self.norm(y, self.ctx.weight(post_norm)), post, streams, mix)

    def _merge_weights(self, streams: np.ndarray) -> np.ndarray:
        """The merge module's per-stream gates sigmoid(alpha * phi . (RMSNorm(streams) * gamma) + beta) [T, S]."""
        cx = self.ctx
        flat = rms_norm(streams.reshape(len(streams), -1), cx.weight("merge_mhc_gamma"), self.eps)
        logits = cx.linear(flat, "merge_mhc_phi") * cx.weight("merge_mhc_alpha").reshape(-1)[0] \
            + cx.weight("merge_mhc_beta")
        return stream_gates(logits)

    def _attention(self, i: int, h: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        cx, b, attention, kind = self.ctx, f"blk.{i}.", self.attention, self.kinds[i]
        q_lat, q = attention.query(cx, b, h)
        assert q_lat is not None, "openPangu's query always goes through its q LoRA"
        cache = attention.cache_rows(cx, b, h, cos, sin)
        keep = self._indexer(b, h, q_lat, cos, sin) if kind.indexer else None
        return attention(cx, b, q, cache, cos, sin, sinks=attention.sink_rows(cx, b), window=kind.window, keep=keep)

    def _indexer(self, b: str, h: np.ndarray, q_lat: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray | None:
        """Keys each query keeps [n, n] (None while no query has more than top_k candidates: all are kept)."""
        cx, n = self.ctx, len(h)
        k = self.norm(cx.linear(h, b + "attn_indexer_k"), cx.weight(b + "attn_indexer_k_norm.weight"))
        k = np.ascontiguousarray(k).reshape(n, 1, self.idx_dim)
        self.rope(k, cos, sin, True)
        if n <= self.top_k:
            return None
        q = np.ascontiguousarray(cx.linear(q_lat, b + "attn_indexer_q_b")).reshape(n, self.n_idx_head, self.idx_dim)
        self.rope(q, cos, sin, True)
        w = cx.linear(h, b + "attn_indexer_weights_proj")
        return select_top_k(cx.indexer_scores(q, k.reshape(n, self.idx_dim), w), self.top_k,
                            TIE_PARTIAL_SORT)
