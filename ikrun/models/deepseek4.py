"""DeepSeek-V4 (GGUF arch `deepseek4`): DeepseekV4ForCausalLM as transformers 5.23 defines it, from the layout
ikconvert writes (docs/layouts.md) and ik's loader reads.

The hidden state is hc streams [T, c, H] (mHC, ikrun/ops/hyperconn.py); the embedding starts in all of them. Around
both sub-layers of every block: mixes = hc_*_fn . RMS(streams flattened, no weight), hc_pre with hc_*_scale /
hc_*_base, Sinkhorn (hyper_connection.sinkhorn_iterations, epsilon), the sub-layer on the pre-weighted sum of the
streams (attn_norm / ffn_norm first), hc_post. The head weighs the streams by sigmoid(output_hc_fn . RMS(streams) *
output_hc_scale + output_hc_base) + epsilon, then output_norm and the output projection.

Attention: q = per-head RMS (no weight) of attn_q_b . RMSNorm(attn_q_a . x); one shared key = value head
kv = RMSNorm(attn_kv . x); interleaved-pair rope on the trailing rope.dimension_count dims of both; scale
1/sqrt(key_length); a per-head sink logit (attn_sinks) in every softmax. Each layer's compress ratio
(attention.compress_ratios) chooses its keys:

- 0: the raw rows in the sliding window (query t sees s when t - s < sliding_window), the main rope (rope.freq_base);
- 4 (CSA): the window plus compressed entries, each pooling two overlapping windows of 4 rows (per channel a
  softmax over the rows of gate + ape weighs kv; RMSNorm; rope at position 4w); entry w is visible to query t when
  w < (t + 1) / 4, and the lightning indexer keeps the top attention.indexer.top_k of those per query:
  score = sum_h w_h relu(q_h . k) over the indexer's own compressed keys, w = indexer.proj . x / sqrt(heads *
  key_length), ties broken as torch.topk breaks them (ikrun/ops/indexer.py TIE_TORCH; under ik's arithmetic as
  its fused top-k breaks them, Numerics.fused_top_k_tie), the keys as the indexer key cache (-ictk) holds them;
- 128 (HCA): the window plus every visible compressed entry of plain 128-row windows.
Compressed layers use the compress rope: attention.compress_rope_freq_base with YaRN when rope.scaling.type says
so, cos/sin unscaled (transformers pins attention_factor to 1). The rope is transformers' (one product position x
inv_freq per angle). The output is inverse-roped, then attn_output_a per group of heads (attention.
output_group_count; group j uses rows j*ol..(j+1)*ol-1) and attn_output_b.

MoE: sqrt(softplus) scores; the first hash_layer_count layers route each token to its ffn_gate_tid2eid row (an
expert named twice counts twice), the others by top-k of score + exp_probs_b; the chosen scores are normalised
and times expert_weights_scale; SwiGLU experts clamped at swiglu_clamp_exp (gate <= limit, |up| <= limit), the
shared expert at swiglu_clamp_shexp.

MTP: ik loads the predictor from its own export (ikconvert hf2gguf --mtp: token_embd, output, output_hc_* and the
block num_hidden_layers with its nextn.* tensors, no main layers; `export`). It drafts beside its target as the NextN
head of ikrun/modules/nextn.py (`nextn_head`): the target's last-layer streams (before the output mix, ik's
result_mtp_embd) and the token's embedding, per stream hnorm / enorm and eh_proj, the block run dense (sliding window,
main rope, with its own cache), the export's output_hc_* mix, shared_head_norm and output.

Where ik differs (by default the model is computed): ik's f16 K cache (`--kv-cache f16` rounds the raw and
compressed rows through f16 as ik stores them), its indexer top-k's tie order (std::partial_sort) and, under its
arithmetic, the two flash-attention kernels of its default graph (ikrun/numerics/ik/shared_kv_flash.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ikrun.kvcache import hadamard_size
from ikrun.models.base import ArchModel, Sequence
from ikrun.modules.ffn import MoeConfig, moe_ffn
from ikrun.modules.nextn import NextnHead
from ikrun.ops.indexer import TIE_TORCH, indexer_scores, select_top_k
from ikrun.ops.moe import GATING_SQRT_SOFTPLUS
from ikrun.ops.rope import inv_freq_default, inv_freq_rope_cache, inv_freq_yarn

if TYPE_CHECKING:
    from ikrun.context import Context

#: compress ratio -> the layer kind transformers names it
RATIOS = {0: "sliding", 4: "CSA", 128: "HCA"}
CSA = 4
COMPRESSOR = ("kv.weight", "gate.weight", "ape.weight", "norm.weight")
INDEXER = ("indexer.attn_q_b.weight", "indexer.proj.weight",
           *(f"indexer_compressor_{t}" for t in COMPRESSOR))
SINKHORN_ITERS = 20  # transformers' hc_sinkhorn_iters default (ik's loader falls back to 3)


class Deepseek4(ArchModel):
    """The hidden state between blocks is the hc streams [T, c, H]."""

    archs = ("deepseek4",)
    #: --flash-attn: ik's arithmetic computes its flash-attention graph (its default) or its -fa off graph
    runtime_options: ClassVar[tuple[str, ...]] = ("flash_attn",)
    continues = True
    one_hidden_stream = False

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        hp = ctx.hparam
        self.n_layer = int(hp("block_count"))
        self.n_embd = int(hp("embedding_length"))
        self.n_head = int(hp("attention.head_count"))
        self.head_dim = int(hp("attention.key_length"))
        self.n_rot = int(hp("rope.dimension_count"))
        self.eps = float(hp("attention.layer_norm_rms_epsilon"))
        self.q_lora = int(hp("attention.q_lora_rank"))
        self.window = int(hp("attention.sliding_window", 0))
        self.n_stream = int(hp("hyper_connection.count"))
        self.sinkhorn_iters = int(hp("hyper_connection.sinkhorn_iterations", SINKHORN_ITERS))
        self.hc_eps = float(hp("hyper_connection.epsilon", self.eps))
        self.n_hash = int(hp("hash_layer_count", 0))
        self.kq_scale = float(np.float32(1.0) / np.sqrt(np.float32(self.head_dim)))
        if not ctx.has("token_embd.weight"):
            raise self.fail("tensor token_embd.weight is missing")
        self.n_vocab = ctx.shape("token_embd.weight")[0]
        self.n_mtp = sum(ctx.has(f"blk.{i}.nextn.eh_proj.weight") for i in range(self.n_layer))
        self.n_active = self.n_layer - self.n_mtp
        #: ik's standalone MTP export: the predictor block without the main layers, run only as a head
        self.export = self.n_mtp > 0 and not ctx.has("blk.0.attn_norm.weight")
        self._check_sizes()
        self.ratios = self._read_ratios() + [0] * self.n_mtp  # ik runs the predictor dense
        moe = MoeConfig.read(hp, GATING_SQRT_SOFTPLUS, lambda why: self.fail(f"{ctx.arch}.{why}"))
        if moe.gating != GATING_SQRT_SOFTPLUS:
            self.fail_hparam("expert_gating_func", f"is {moe.gating}; DeepSeek-V4 scores experts by sqrt(softplus) "
                             f"({GATING_SQRT_SOFTPLUS})")
        # transformers renormalises the chosen weights whatever norm_topk_prob says (ik follows expert_weights_norm)
        self.moe = replace(moe, w_norm=True)
        self.clamp_exp = self._per_layer("swiglu_clamp_exp", None)
        self.clamp_shexp = self._per_layer("swiglu_clamp_shexp", self.clamp_exp)
        self.n_groups = int(hp("attention.output_group_count", 0)) or self._infer_groups()
        self.o_lora = int(hp("attention.output_lora_rank", 0)) or ctx.shape("blk.0.attn_output_b.weight")[1] \
            // self.n_groups
        self.n_ihead = self.i_dim = self.top_k = 0
        if CSA in self.ratios[: self.n_active]:
            self.n_ihead = int(hp("attention.indexer.head_count"))
            self.i_dim = int(hp("attention.indexer.key_length"))
            self.top_k = int(hp("attention.indexer.top_k"))
        self._read_rope()
        self._check_tensors()
        self._ones: dict[int, np.ndarray] = {}

    # ---- hyperparameters ------------------------------------------------------------------------------------
    def hidden_width(self) -> int:
        return self.n_stream * self.n_embd

    def _check_sizes(self) -> None:
        if not 0 < self.n_rot < self.head_dim or self.n_rot % 2:
            self.fail_hparam("rope.dimension_count", f"{self.n_rot} must be even, positive and below the key length "
                             f"{self.head_dim}")
        if not 1 <= self.n_stream <= 8:
            self.fail_hparam("hyper_connection.count", f"{self.n_stream} must be 1..8 (ggml's hyper-connection ops)")
        if self.sinkhorn_iters < 1:
            self.fail_hparam("hyper_connection.sinkhorn_iterations", f"{self.sinkhorn_iters}: Sinkhorn needs at least "
                             "one iteration")
        if not 0 <= self.n_hash <= self.n_active:
            self.fail_hparam("hash_layer_count", f"{self.n_hash} must be within the {self.n_active} main layers")
        if int(self.ctx.hparam("leading_dense_block_count", 0)):
            self.fail_hparam("leading_dense_block_count", "is not 0: DeepSeek-V4 has no dense FFN layers")
        if self.window < 0:
            self.fail_hparam("attention.sliding_window", f"{self.window} is negative")

    def _read_ratios(self) -> list[int]:
        """One compress ratio per main layer: the file's list (the main layers', optionally then the MTP
        predictor's), or, without one, what each layer's tensors imply (as ik infers them)."""
        cx, n = self.ctx, self.n_active
        ratios = cx.hparam("attention.compress_ratios", None)
        if ratios is None:
            return [CSA if cx.has(f"blk.{i}.indexer.attn_q_b.weight") else
                    128 if cx.has(f"blk.{i}.attn_compressor_kv.weight") else 0 for i in range(n)]
        ratios = [int(r) for r in ratios]
        if not n <= len(ratios) <= self.n_layer + 1:
            self.fail_hparam("attention.compress_ratios", f"has {len(ratios)} entries; it needs one per main layer "
                             f"({n}), optionally followed by the MTP predictor's")
        for i, r in enumerate(ratios[:n]):
            if r not in RATIOS:
                self.fail_hparam("attention.compress_ratios", f"gives layer {i} ratio {r}; DeepSeek-V4 defines "
                                 f"{', '.join(f'{k} ({v})' for k, v in RATIOS.items())}")
        return ratios[:n]

    def _per_layer(self, key: str, default: list[float] | None) -> list[float]:
        """A float per layer from a scalar or an array key (ik's get_key_or_arr)."""
        value = self.ctx.hparam(key, None)
        if value is None:
            if default is None:
                self.fail_hparam(key, "is missing (DeepSeek-V4's SwiGLU clamp, transformers' swiglu_limit)")
            return default
        values = [float(v) for v in value] if isinstance(value, (list, tuple, np.ndarray)) \
            else [float(value)] * self.n_layer
        if len(values) < self.n_active:
            self.fail_hparam(key, f"has {len(values)} entries; it needs one per layer ({self.n_layer})")
        return values

    def _infer_groups(self) -> int:
        """output_group_count from attn_output_a's shape, as ik infers it."""
        cols = self.ctx.shape("blk.0.attn_output_a.weight")[1]
        if (self.n_head * self.head_dim) % cols:
            self.fail_hparam("attention.output_group_count", f"is missing and attn_output_a's {cols} columns do not "
                             f"divide head_count x key_length ({self.n_head * self.head_dim})")
        return self.n_head * self.head_dim // cols

    def _read_rope(self) -> None:
        """The main rope (sliding layers) and the compress rope (CSA/HCA layers), transformers' inverse
        frequencies."""
        hp = self.ctx.hparam
        self.inv_freq = {"main": inv_freq_default(float(hp("rope.freq_base", 10000.0)), self.n_rot)}
        base = float(hp("attention.compress_rope_freq_base", hp("rope.freq_base", 10000.0)))
        scaling = str(hp("rope.scaling.type", "none"))
        if scaling == "yarn":
            factor = float(hp("rope.scaling.factor"))
            n_ctx_orig = int(hp("rope.scaling.original_context_length", 0) or hp("context_length"))
            self.inv_freq["compress"] = inv_freq_yarn(base, self.n_rot, factor, n_ctx_orig,
                                                      float(hp("rope.scaling.yarn_beta_fast", 32.0)),
                                                      float(hp("rope.scaling.yarn_beta_slow", 1.0)))
        elif scaling in ("none", "linear"):
            self.inv_freq["compress"] = inv_freq_default(base, self.n_rot)
        else:
            self.fail_hparam("rope.scaling.type", f"{scaling!r} is not one DeepSeek-V4 uses (yarn, none)")

    # ---- tensors --------------------------------------------------------------------------------------------
    def _expected(self, i: int, main: bool = True) -> dict[str, tuple[int, ...]]:
        """Block i's tensors and their numpy shapes."""
        e, c, nh, hd, ql = self.n_embd, self.n_stream, self.n_head, self.head_dim, self.q_lora
        x, ff = self.moe.n_expert, self.moe.n_ff
        b, mix = f"blk.{i}.", (2 + c) * c
        want = {"attn_norm.weight": (e,), "ffn_norm.weight": (e,), "attn_q_a.weight": (ql, e),
                "attn_q_a_norm.weight": (ql,), "attn_q_b.weight": (nh * hd, ql), "attn_kv.weight": (hd, e),
                "attn_kv_a_norm.weight": (hd,), "attn_output_a.weight": (self.n_groups * self.o_lora,
                                                                         nh * hd // self.n_groups),
                "attn_output_b.weight": (e, self.n_groups * self.o_lora), "ffn_gate_inp.weight": (x, e),
                "ffn_gate_exps.weight": (x, ff, e), "ffn_up_exps.weight": (x, ff, e),
                "ffn_down_exps.weight": (x, e, ff)}
        if self.moe.n_shared:
            fs = ff * self.moe.n_shared
            want |= {"ffn_gate_shexp.weight": (fs, e), "ffn_up_shexp.weight": (fs, e), "ffn_down_shexp.weight": (e, fs)}
        for s in ("attn", "ffn"):
            want |= {f"hc_{s}_fn.weight": (mix, c * e), f"hc_{s}_base.weight": (mix,), f"hc_{s}_scale.weight": (3,)}
        if main:
            r = self.ratios[i]
            if r:
                w = (2 if r == CSA else 1) * hd
                want |= {"attn_compressor_kv.weight": (w, e), "attn_compressor_gate.weight": (w, e),
                         "attn_compressor_ape.weight": (r, w), "attn_compressor_norm.weight": (hd,)}
            if r == CSA:
                w = 2 * self.i_dim
                want |= {"indexer.attn_q_b.weight": (self.n_ihead * self.i_dim, ql),
                         "indexer.proj.weight": (self.n_ihead, e), "indexer_compressor_kv.weight": (w, e),
                         "indexer_compressor_gate.weight": (w, e), "indexer_compressor_ape.weight": (CSA, w),
                         "indexer_compressor_norm.weight": (self.i_dim,)}
            if i < self.n_hash:
                want["ffn_gate_tid2eid.weight"] = (self.n_vocab, self.moe.n_used)
            else:
                want["exp_probs_b.bias"] = (x,)
        else:
            want |= {"nextn.eh_proj.weight": (e, 2 * e), "nextn.enorm.weight": (e,), "nextn.hnorm.weight": (e,),
                     "nextn.shared_head_norm.weight": (e,)}
        return {b + k: v for k, v in want.items()}

    def _check_tensors(self) -> None:
        """Each main layer's tensors as its compress ratio and routing imply (named per layer when missing), the
        globals, and the MTP blocks' where present."""
        cx, e, c = self.ctx, self.n_embd, self.n_stream
        for i, r in enumerate(self.ratios[: 0 if self.export else self.n_active]):
            b = f"blk.{i}."
            parts = [("attn_compressor_" + t, "compressor") for t in COMPRESSOR] if r else []
            parts += [(t, "indexer") for t in INDEXER] if r == CSA else []
            missing = [b + t for t, _ in parts if not cx.has(b + t)]
            if missing:
                raise self.fail(f"layer {i} has compress ratio {r} ({RATIOS[r]}; attention.compress_ratios) but "
                                f"lacks {', '.join(missing)}")
            if i < self.n_hash and not cx.has(b + "ffn_gate_tid2eid.weight"):
                raise self.fail(f"layer {i} is hash-routed (hash_layer_count {self.n_hash}) but lacks "
                                f"{b}ffn_gate_tid2eid.weight")
        if self.top_k:
            csa = self.ratios.index(CSA)
            longest = int(cx.hparam("context_length", 1 << 62)) // CSA
            if not 1 <= self.top_k <= longest:
                self.fail_hparam("attention.indexer.top_k", f"{self.top_k} (layer {csa}, the first CSA layer) must be "
                                 f"in 1..{longest}, the compressed entries of context_length "
                                 f"{cx.hparam('context_length')}")
            if self.n_ihead <= 0 or self.i_dim < self.n_rot:
                self.fail_hparam("attention.indexer.key_length", f"{self.i_dim} must be at least rope.dimension_count "
                                 f"{self.n_rot} and head_count {self.n_ihead} must be positive (layer {csa})")
        want = {"token_embd.weight": (self.n_vocab, e), "output_norm.weight": (e,), "output.weight": (self.n_vocab, e),
                "output_hc_fn.weight": (c, c * e), "output_hc_base.weight": (c,), "output_hc_scale.weight": (1,)}
        for i in range(0 if self.export else self.n_active):
            want.update(self._expected(i))
        optional: dict[str, tuple[int, ...]] = {f"blk.{i}.attn_sinks.weight": (self.n_head,)
                                                for i in range(self.n_layer)}
        for i in range(self.n_active, self.n_layer):
            (want if self.export else optional).update(self._expected(i, main=False))
        self.check_tensors(want, optional)
        for i in range(0 if self.export else self.n_hash):
            table = f"blk.{i}.ffn_gate_tid2eid.weight"
            if cx.weights.encoding(table).type.name not in ("I32", "I64"):
                raise self.fail(f"tensor {table} is {cx.weights.encoding(table).type.name}; the hash routing table "
                                "must hold integer expert ids (I32)")

    def computed_paths(self, n_ctx: int) -> dict[str, str]:
        """Under ik's arithmetic its attention graph (--flash-attn; the two differ by a KLD of 1.3e-4 on the tiny model
        at 256 tokens: the generic kernel's f16 value sums)."""
        graph = self.ctx.numerics.attention_graph(self.ctx.arch, self.ctx.cache, self.head_dim)
        return {} if graph is None else {"flash_attn": graph}

    def unread_tensors(self, n_ctx: int, batches: tuple[int, ...] = ()) -> dict[str, str]:
        """A layer's compressor (a CSA layer's indexer too) where a chunk is shorter than the layer's compress
        ratio: no window of the chunk is complete, so no compressed entry exists for the attention (or the indexer)
        to read, however the chunk is fed."""
        unread: dict[str, str] = {}
        for i, r in enumerate(self.ratios[: 0 if self.export else self.n_active]):
            if r and n_ctx < r:
                why = (f"layer {i}'s compress ratio is {r} (attention.compress_ratios): a chunk of {n_ctx} tokens "
                       "completes no window, so no compressed entry exists")
                parts = [f"attn_compressor_{t}" for t in COMPRESSOR] + (list(INDEXER) if r == CSA else [])
                unread |= {f"blk.{i}.{t}": why for t in parts}
        return unread

    def check_context(self, n_ctx: int, batches: tuple[int, ...] = ()) -> None:
        if self.export:
            raise self.fail("is DeepSeek-V4's MTP export (ikconvert hf2gguf --mtp): it has no main layers and drafts "
                            f"beside its target (ikrun accept TARGET.gguf {self.ctx.path.name} --mtp)")

    # ---- MTP ------------------------------------------------------------------------------------------------
    def nextn_head(self) -> NextnHead:
        """The predictor of an MTP export (a full model carries none: ik exports it as its own file)."""
        if not self.export:
            raise self.fail("has no MTP block: ik loads DeepSeek-V4's MTP from its own export (ikconvert hf2gguf "
                            "--mtp), given after the target (ikrun accept TARGET.gguf MTP.gguf --mtp)")
        if self.n_mtp != 1:
            self.fail_hparam("nextn_predict_layers", f"is {self.n_mtp}; ik's export holds one predictor block")
        i = self.n_layer - 1
        return NextnHead.of(self.ctx, i, "output.weight", lambda x, seq: self.block(i, [x], [seq])[0], self.norm,
                            streams=self.n_stream, collapse=self._hc_head)

    def nextn_state(self, x: np.ndarray) -> np.ndarray:
        """The last layer's streams, flattened (what ik hands its MTP graph)."""
        return x.reshape(len(x), -1)

    def check_head(self, head: ArchModel) -> None:
        """Refuse an MTP export whose widths or vocabulary are not this model's."""
        if not isinstance(head, Deepseek4) or not head.export:
            raise head.fail("is not a DeepSeek-V4 MTP export (ikconvert hf2gguf --mtp)")
        mine = (self.n_embd, self.n_stream, self.n_vocab, self.n_active)
        theirs = (head.n_embd, head.n_stream, head.n_vocab, head.n_active)
        if mine != theirs:
            raise head.fail(f"has (embedding, streams, vocabulary, main layers) {theirs}; the target {mine}")

    # ---- forward --------------------------------------------------------------------------------------------
    def begin(self, seq: Sequence) -> None:
        """Rope tables of every position up to the sequence's last (a continued one's compressed entries start at
        0)."""
        n = seq.start + len(seq)
        seq.state["rope"] = {kind: self._rope_table(kind, n, shared=seq.start == 0) for kind in self.inv_freq}

    def _rope_table(self, kind: str, n: int, shared: bool) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin of positions 0..n-1; `shared` (fresh sequences) made once per length, a continued sequence's own
        (one table per length it passes through would grow without bound)."""
        freq = self.inv_freq[kind]
        if not shared:
            return inv_freq_rope_cache(np.arange(n), freq)
        table: tuple[np.ndarray, np.ndarray] = self.table(("rope", kind, n),
                                                          lambda: inv_freq_rope_cache(np.arange(n), freq))
        return table

    def embed(self, seq: Sequence) -> np.ndarray:
        """The embedding in all c streams."""
        return np.repeat(self.ctx.embed_rows("token_embd.weight", seq.tokens)[:, None, :], self.n_stream, axis=1)

    def block(self, i: int, xs: list[np.ndarray], seqs: list[Sequence]) -> list[np.ndarray]:
        cx, b = self.ctx, f"blk.{i}."

        def attention(streams: np.ndarray, seq: Sequence) -> np.ndarray:
            h, post, comb = self._mix_in(streams, b + "hc_attn", b + "attn_norm.weight")
            return cx.numerics.hc_post(self._attention(i, h, seq), post, streams, comb)

        xs = self.each(xs, seqs, attention)
        mixed = []
        for streams, seq in zip(xs, seqs):
            cx.chunk = seq.index
            mixed.append(self._mix_in(streams, b + "hc_ffn", b + "ffn_norm.weight"))
        table = self.table(("tid2eid", i), lambda: cx.integers(b + "ffn_gate_tid2eid.weight")) \
            if i < self.n_hash else None
        ys = moe_ffn(cx, [h for h, _, _ in mixed], seqs, b, self.moe, limit=self.clamp_exp[i],
                     shared_limit=self.clamp_shexp[i], hash_table=table)
        # ik cuts the output rows after the last block, before the head's stream mix
        return self.output_rows(i, [cx.numerics.hc_post(y, post, streams, comb)
                                    for y, streams, (_, post, comb) in zip(ys, xs, mixed)], seqs)

    def head(self, streams: np.ndarray, seq: Sequence) -> np.ndarray:
        x = self.norm(self._hc_head(streams), self.ctx.weight("output_norm.weight"))
        return np.ascontiguousarray(self.ctx.project(x, "output.weight"), dtype=np.float32)

    def _hc_head(self, streams: np.ndarray) -> np.ndarray:
        """The streams [n, c, H] mixed into one state [n, H] by the output_hc_* weights."""
        cx = self.ctx
        mix = cx.linear(self._unit_rms(streams.reshape(len(streams), -1)), "output_hc_fn")
        gate = mix * cx.weight("output_hc_scale.weight").reshape(-1)[0] + cx.weight("output_hc_base.weight")
        pre = np.float32(1.0) / (np.float32(1.0) + np.exp(-gate)) + np.float32(self.hc_eps)
        return cx.numerics.hc_combine(streams, pre)

    # ---- pieces ---------------------------------------------------------------------------------------------
    def _unit_rms(self, x: np.ndarray) -> np.ndarray:
        """RMS normalisation without a weight over the last axis."""
        d = x.shape[-1]
        if d not in self._ones:
            self._ones[d] = np.ones(d, dtype=np.float32)
        return self.norm(x, self._ones[d])

    def _mix_in(self, streams: np.ndarray, hc: str, norm: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the sub-layer's normed input from the pre-weighted streams, the post weights, the stream mix)."""
        cx = self.ctx
        mixes = cx.linear(self._unit_rms(streams.reshape(len(streams), -1)), hc + "_fn")
        pre, post, comb = cx.numerics.hc_pre(mixes, cx.weight(hc + "_scale.weight"), cx.weight(hc + "_base.weight"),
                                             self.n_stream, self.sinkhorn_iters, self.hc_eps)
        return self.norm(cx.numerics.hc_combine(streams, pre), cx.weight(norm)), post, comb

    def _rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Interleaved-pair rope on the trailing n_rot dims of every head of x [n, heads, d], in place."""
        self.rope(x[:, :, x.shape[2] - self.n_rot :], cos, sin, False)
        return x

    def _attention(self, i: int, h: np.ndarray, seq: Sequence) -> np.ndarray:
        """A continued sequence keeps each layer's inputs and key = value rows (`state["kv"]`): the new queries
        attend over every kept row, and the compressed entries are pooled again from the kept inputs, so a cut cache
        (keep_cache) rolls back exactly. The indexer then ranks, per query, the entries that exist when it is decoded
        alone: where its scores tie, the top-k it keeps can differ from the whole sequence's, whose rows also hold
        the entries not yet visible."""
        cx, b, n, ratio, start = self.ctx, f"blk.{i}.", len(h), self.ratios[i], seq.start
        cos, sin = (t[start:] for t in seq.state["rope"]["compress" if ratio else "main"])
        q_res = self.norm(cx.linear(h, b + "attn_q_a"), cx.weight(b + "attn_q_a_norm.weight"))
        q = self._rope(self._unit_rms(cx.linear(q_res, b + "attn_q_b").reshape(n, self.n_head, self.head_dim)),
                       cos, sin)
        kv = self.norm(cx.linear(h, b + "attn_kv"), cx.weight(b + "attn_kv_a_norm.weight"))
        kv = cx.kv_store(self._rope(kv.reshape(n, 1, self.head_dim), cos, sin).reshape(n, self.head_dim))
        inputs = h
        cache = seq.state.get("kv")
        if cache is not None:
            kept_h, kept_kv = cache.get(b, (h[:0], kv[:0]))
            if len(kept_h) != start:
                raise self.fail(f"layer {i}: the cache holds {len(kept_h)} positions, the sequence continues at {start}")
            inputs, kv = np.concatenate([kept_h, h]), np.concatenate([kept_kv, kv])
            cache[b] = (inputs, kv)
        comp = keep = None
        if ratio:
            comp = cx.kv_store(self._compress(b + "attn_compressor_", inputs, ratio, self.head_dim, seq))
            keep = np.arange(len(comp))[None, :] < ((start + np.arange(n) + 1) // ratio)[:, None]
            if ratio == CSA and len(comp):
                keep = self._select(b, inputs, q_res, keep, seq)
        sinks = cx.weight(b + "attn_sinks.weight") if cx.has(b + "attn_sinks.weight") else None
        flash = cx.numerics.attention_graph(cx.arch, cx.cache, self.head_dim) == "on"
        out = cx.numerics.shared_kv_attention(q, kv, self.kq_scale, window=self.window, sinks=sinks, comp=comp,
                                              comp_keep=keep, start=start, ratio=ratio, top_k=self.top_k, flash=flash,
                                              cache=cx.cache)
        out = self._rope(out, cos, -sin)  # the values carried the keys' rotation: undo it
        return cx.linear(self._grouped_output(b, out), b + "attn_output_b")

    def _grouped_output(self, b: str, out: np.ndarray) -> np.ndarray:
        """attn_output_a per group of heads: [n, heads, d] -> [n, groups * o_lora]."""
        cx, n, g = self.ctx, len(out), self.n_groups
        x = out.reshape(n, -1)
        name, per = b + "attn_output_a.weight", x.shape[1] // g
        if cx.observers:
            for j in range(g):
                cx.observe(name, x[:, j * per : (j + 1) * per], j, g)
        return cx.numerics.grouped_product(x, name, g)

    def _compress(self, p: str, h: np.ndarray, ratio: int, width: int, seq: Sequence) -> np.ndarray:
        """Compressed entries [n // ratio, width] of one compressor (`p`: its tensor prefix) over the complete
        windows of the sequence: per channel a softmax over the window's rows of gate + ape weighs the kv rows;
        RMSNorm; the compress rope at position w * ratio. CSA (ratio 4) pools window w's second half of the
        channels with window w-1's first half (window -1 empty)."""
        cx = self.ctx
        kv, gate = cx.linear(h, p + "kv"), cx.linear(h, p + "gate")
        windows = len(h) // ratio
        if windows == 0:
            return np.zeros((0, width), dtype=np.float32)
        used = windows * ratio
        kv = kv[:used].reshape(windows, ratio, -1)
        gate = gate[:used].reshape(windows, ratio, -1) + cx.weight(p + "ape.weight")
        if ratio == CSA:
            rows_kv = np.zeros((windows, 2 * ratio, width), dtype=np.float32)
            rows_gate = np.full((windows, 2 * ratio, width), -np.inf, dtype=np.float32)
            rows_kv[:, ratio:], rows_gate[:, ratio:] = kv[..., width:], gate[..., width:]
            rows_kv[1:, :ratio], rows_gate[1:, :ratio] = kv[:-1, :, :width], gate[:-1, :, :width]
            kv, gate = rows_kv, rows_gate
        weights = np.exp(gate - gate.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        pooled = self.norm((kv * weights).sum(axis=1), cx.weight(p + "norm.weight"))
        cos, sin = seq.state["rope"]["compress"]
        rows = np.arange(windows) * ratio
        return self._rope(pooled.reshape(windows, 1, width), cos[rows], sin[rows]).reshape(windows, width)

    def _select(self, b: str, inputs: np.ndarray, q_res: np.ndarray, visible: np.ndarray,
                seq: Sequence) -> np.ndarray:
        """The lightning indexer's choice among the visible compressed entries [n, T] (CSA layers) for the last n of
        the layer's `inputs` (every position's, from 0)."""
        cx, n = self.ctx, len(q_res)
        keys = cx.indexer_store(self._compress(b + "indexer_compressor_", inputs, CSA, self.i_dim, seq),
                                hadamard_size(self.i_dim))
        cos, sin = (t[seq.start:] for t in seq.state["rope"]["compress"])
        q = self._rope(np.ascontiguousarray(cx.linear(q_res, b + "indexer.attn_q_b")).reshape(n, self.n_ihead,
                                                                                              self.i_dim), cos, sin)
        scale = np.float32(1.0) / np.sqrt(np.float32(self.n_ihead)) / np.sqrt(np.float32(self.i_dim))
        w = cx.linear(inputs[len(inputs) - n :], b + "indexer.proj") * scale
        scores = indexer_scores(q, keys, w, q0=len(keys))
        scores[~visible] = -np.inf
        tie = cx.numerics.fused_top_k_tie(TIE_TORCH)
        if "kv" not in seq.state:  # the whole sequence: every query ranks all its entries, as transformers does
            return select_top_k(scores, self.top_k, tie) & visible
        # through a cache: each query ranks the entries that exist when it is decoded alone (those it sees), so how
        # the sequence is cut into calls (a verified block or one token a call) does not change the choice
        keep = np.zeros_like(visible)
        seen = visible.sum(axis=1)
        for count in np.unique(seen[seen > 0]):
            rows = np.flatnonzero(seen == count)
            keep[rows, :count] = select_top_k(scores[rows, :count], self.top_k, tie)
        return keep
