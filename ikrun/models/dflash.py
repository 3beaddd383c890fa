"""DFlash drafts (`dflash-draft`): block-diffusion speculative drafters that propose a whole block of tokens in one
forward from the target's hidden states (z-lab/dflash's DFlashDraftModel).

The target's hidden states after the draft's `target_layer_ids` blocks, concatenated, go through `dflash_fc` and
`dflash_hidden_norm` once; every draft layer projects them with its own K/V weights (K through `attn_k_norm`, both
roped at the context positions) into a context its block attends to. The block is the target's embeddings of
`[last known token, mask x (block_size - 1)]` at the next positions; each layer attends non-causally to the whole
context plus the block, a sliding-window layer causally within its window (Qwen3 layers otherwise: q/k norms, NEOX
rope, SwiGLU; attention biases where the file has them). The draft's output norm ends it; the proposals are the target's output head on rows 1.. of it.
MiMo drafts add, as ik's draft graph computes them: values scaled by `attention.value_scale`, the context's keys
roped at `dflash.backbone_rotary_base`, a sink logit per head (`attn_sinks`), rope over `rope.dimension_count`
dims only (partial rotary).

A draft runs only with its target (`ikrun accept`); the context a draft has seen stays in a DraftContext, so each
verified token's features are projected once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ikrun.errors import ModelError
from ikrun.models.base import ArchModel, Sequence
from ikrun.modules.ffn import dense_ffn
from ikrun.ops.rope import rope_cache

if TYPE_CHECKING:
    from ikrun.context import Context

FC, HIDDEN_NORM = "dflash_fc.weight", "dflash_hidden_norm.weight"


@dataclass
class DraftContext:
    """The keys and values of the context rows, per draft layer, and the positions they were roped at.

    `limit` keeps only the newest rows (ik's `cross_ctx`: the draft attends to a window of the target's features);
    None keeps every row, as the reference does."""

    k: list[np.ndarray] = field(default_factory=list)
    v: list[np.ndarray] = field(default_factory=list)
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    limit: int | None = None

    @property
    def length(self) -> int:
        return len(self.positions)

    @property
    def next_position(self) -> int:
        """The position after the newest row (where the reference's next block starts)."""
        return int(self.positions[-1]) + 1 if len(self.positions) else 0


class DFlashDraft(ArchModel):
    archs = ("dflash-draft",)
    standalone = False

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        hp = ctx.hparam
        self.read_gqa_hparams()
        self.block_size = int(hp("dflash.block_size"))
        self.mask_token_id = int(hp("dflash.mask_token_id"))
        self.target_layer_ids = [int(i) for i in hp("dflash.target_layer_ids")]
        self.n_target_features = int(hp("dflash.n_target_features"))
        window = hp("attention.sliding_window", None)
        pattern = hp("attention.sliding_window_pattern", None)
        self.windows: list[int | None] = [
            int(window) if window and (pattern is None or bool(pattern[i])) else None for i in range(self.n_layer)]
        # MiMo drafts: values scaled (context and block alike), the context's keys roped at the target backbone's
        # base, a per-head sink logit in every softmax (ik's build_dflash)
        self.value_scale = float(hp("attention.value_scale", 1.0))
        backbone = float(hp("dflash.backbone_rotary_base", 0.0))
        self.context_rope_base = backbone if backbone > 0 else self.rope_base
        # no forward of its own: n_vocab is the target's; n_active 0 keeps the runtime's block loops off it
        self.n_vocab, self.n_active = 0, 0
        if any(ctx.has(f"blk.{i}.attn_gate.weight") for i in range(self.n_layer)):
            raise self.fail("draft layers with attn_gate tensors are not supported by the runtime yet (ik's draft "
                            "graph applies a gate to Laguna drafts only)")
        self.check_tensors(self._expected(), {f"blk.{i}.attn_sinks.weight": (self.n_head,)
                                              for i in range(self.n_layer)})

    def _expected(self) -> dict[str, tuple[int, ...]]:
        e, q, kv = self.n_embd, self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        ff = int(self.ctx.hparam("feed_forward_length"))
        want: dict[str, tuple[int, ...]] = {FC: (e, self.n_target_features), HIDDEN_NORM: (e,),
                                            "output_norm.weight": (e,)}
        for i in range(self.n_layer):
            b = f"blk.{i}."
            want.update({
                b + "attn_norm.weight": (e,), b + "attn_q.weight": (q, e), b + "attn_k.weight": (kv, e),
                b + "attn_v.weight": (kv, e), b + "attn_output.weight": (e, q), b + "attn_q_norm.weight":
                (self.head_dim,), b + "attn_k_norm.weight": (self.head_dim,), b + "post_attention_norm.weight": (e,),
                b + "ffn_gate.weight": (ff, e), b + "ffn_up.weight": (ff, e), b + "ffn_down.weight": (e, ff),
            })
        return want

    def check_target(self, target: ArchModel) -> None:
        """The target must give the features this draft was trained on (layers, widths) and serve as a target."""
        from ikrun.models import model_class, supported_architectures

        t = target.ctx
        if not (target.continues and target.one_hidden_stream):
            targets = [a for a in supported_architectures()
                       if model_class(a).continues and model_class(a).one_hidden_stream]
            raise self.fail(f"{t.path} ({t.arch}) gives no hidden-state output to serve as a DFlash target "
                            f"(targets: {', '.join(targets)})")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.n_active]
        if bad:
            raise self.fail(f"{self.ctx.arch}.dflash.target_layer_ids: target layer {bad[0]} is not a block of "
                            f"{t.path} ({target.n_active} blocks)")
        width = len(self.target_layer_ids) * target.n_embd
        if width != self.n_target_features:
            raise self.fail(f"{self.ctx.arch}.dflash.n_target_features: the draft takes {self.n_target_features} target features, "
                            f"{t.path} gives {len(self.target_layer_ids)} layers x {target.n_embd} = {width}")
        if self.n_embd != target.n_embd:
            raise self.fail(f"{self.ctx.arch}.embedding_length: the draft's hidden size {self.n_embd} is not the target's "
                            f"{target.n_embd} ({t.path}), whose embeddings and output head it uses")
        tokens = self.ctx.weights.metadata.get("tokenizer.ggml.tokens")
        if tokens is not None and len(tokens) != target.n_vocab:
            raise self.fail(f"tokenizer.ggml.tokens: the draft's vocabulary has {len(tokens)} tokens, the target "
                            f"{t.path} has {target.n_vocab}: a draft of another model")
        if not 0 <= self.mask_token_id < target.n_vocab:
            raise self.fail(f"{self.ctx.arch}.dflash.mask_token_id: mask token {self.mask_token_id} is not in the target's "
                            f"vocabulary of {target.n_vocab}")

    # ---- the runtime contract: a draft has no forward of its own ---------------------------------------------
    def _alone(self) -> ModelError:
        return self.fail("a DFlash draft runs with its target: ikrun accept TARGET.gguf DRAFT.gguf")

    def embed(self, seq: Sequence) -> np.ndarray:
        raise self._alone()

    def block(self, i: int, xs: list[np.ndarray], seqs: list[Sequence]) -> list[np.ndarray]:
        raise self._alone()

    def head(self, x: np.ndarray, seq: Sequence) -> np.ndarray:
        raise self._alone()

    # ---- drafting ---------------------------------------------------------------------------------------------
    def _rope(self, positions: np.ndarray, base: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        return rope_cache(positions, self.n_rot, self.rope_base if base is None else base)

    def _kv(self, i: int, h: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cx, b, n = self.ctx, f"blk.{i}.", len(h)
        k = self.norm(cx.linear(h, b + "attn_k").reshape(n, self.n_head_kv, self.head_dim),
                     cx.weight(b + "attn_k_norm.weight"))
        k = np.ascontiguousarray(k)
        self.rope(k, cos, sin, True)
        v = cx.linear(h, b + "attn_v").reshape(n, self.n_head_kv, self.head_dim)
        return k, v * np.float32(self.value_scale) if self.value_scale != 1.0 else v

    def extend_context(self, ctx: DraftContext, features: np.ndarray, positions: np.ndarray | None = None) -> None:
        """Append the context rows of the target's features of len(features) tokens, roped at `positions` (default:
        the positions after the newest row); past ctx.limit the oldest rows are dropped."""
        cx = self.ctx
        t = self.norm(cx.linear(np.ascontiguousarray(features, dtype=np.float32), "dflash_fc"), cx.weight(HIDDEN_NORM))
        if positions is None:
            positions = np.arange(ctx.next_position, ctx.next_position + len(t))
        cos, sin = self._rope(positions, self.context_rope_base)
        keep = -ctx.limit if ctx.limit is not None else 0
        for i in range(self.n_layer):
            k, v = self._kv(i, t, cos, sin)
            if len(ctx.k) <= i:
                ctx.k.append(k[keep:])
                ctx.v.append(v[keep:])
            else:
                ctx.k[i] = np.concatenate([ctx.k[i], k])[keep:]
                ctx.v[i] = np.concatenate([ctx.v[i], v])[keep:]
        ctx.positions = np.concatenate([ctx.positions, np.asarray(positions, dtype=np.int64)])[keep:]

    def draft(self, ctx: DraftContext, block_embeddings: np.ndarray,
              on_layer: Callable[[int, np.ndarray], None] | None = None, start: int | None = None) -> np.ndarray:
        """The draft's output rows [block, n_embd] for a block at positions start.. (default: after the newest
        context row; the context unchanged); `on_layer(i, x)` sees each layer's output."""
        cx, n = self.ctx, len(block_embeddings)
        p0 = ctx.next_position if start is None else start
        cos, sin = self._rope(np.arange(p0, p0 + n))
        x = np.ascontiguousarray(block_embeddings, dtype=np.float32)
        group = self.n_head // self.n_head_kv
        for i in range(self.n_layer):
            b = f"blk.{i}."
            h = self.norm(x, cx.weight(b + "attn_norm.weight"))
            q = self.norm(cx.linear(h, b + "attn_q").reshape(n, self.n_head, self.head_dim),
                         cx.weight(b + "attn_q_norm.weight"))
            q = np.ascontiguousarray(q)
            self.rope(q, cos, sin, True)
            k_blk, v_blk = self._kv(i, h, cos, sin)
            k = np.concatenate([ctx.k[i], k_blk]) if ctx.k else k_blk
            v = np.concatenate([ctx.v[i], v_blk]) if ctx.v else v_blk
            kh = np.repeat(k.transpose(1, 0, 2), group, axis=0)  # [H, keys, d]
            vh = np.repeat(v.transpose(1, 0, 2), group, axis=0)
            scores = np.matmul(q.transpose(1, 0, 2), kh.transpose(0, 2, 1)) * np.float32(self.head_dim ** -0.5)
            window = self.windows[i]
            if window is not None:  # sliding layers are causal within their window (the reference's mask)
                qpos = np.arange(p0, p0 + n)[:, None]
                kpos = np.concatenate([ctx.positions, np.arange(p0, p0 + n)])[None, :]
                visible = (kpos <= qpos) & (qpos - kpos < window)
                scores = np.where(visible, scores, np.float32(-np.inf))
            top = scores.max(axis=-1, keepdims=True)
            sink = b + "attn_sinks.weight"
            if cx.has(sink):  # one more logit per head in the softmax's denominator, attending to nothing
                sinks = cx.weight(sink).astype(np.float32)[:, None, None]
                top = np.maximum(top, sinks)
                denominator = np.exp(sinks - top)
            else:
                denominator = np.float32(0.0)
            scores = np.exp(scores - top)
            attn = np.matmul(scores / (scores.sum(axis=-1, keepdims=True) + denominator), vh)  # [H, n, d]
            x = x + cx.linear(np.ascontiguousarray(attn.transpose(1, 0, 2)).reshape(n, -1), b + "attn_output")
            x = x + dense_ffn(cx, self.norm(x, cx.weight(b + "post_attention_norm.weight")), b)
            if on_layer is not None:
                on_layer(i, x)
        return self.norm(x, cx.weight("output_norm.weight"))
