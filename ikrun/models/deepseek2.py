"""DeepSeek-V2/V3 (GGUF arch `deepseek2`): ik's build_deepseek2 graph as it runs on the CPU (mla=3).

Per layer: RMSNorm; the query through the q LoRA (attn_q_a, its RMSNorm, attn_q_b), or attn_q for the lite models
without one; attn_kv_a_mqa gives the KV latent plus the shared rope key; NORM rope with ggml's YaRN on the rope
parts; RMSNorm of the latent; multi-head latent attention (ikrun/ops/mla.py) in one of ik's two forms (--mla,
ikrun/options.py): prefill, keys and values materialised through attn_kv_b (ik's defaults, flash attention, for
batches of 128 tokens or more), or decode, absorbed through attn_k_b / attn_v_b (ik with -fa off, and single-token
generation); attn_output; residual. Then RMSNorm and either the dense SwiGLU FFN (the leading dense layers)
or the MoE FFN (ikrun/ops/moe.py) plus the shared experts; residual. NextN/MTP blocks at the end
(nextn_predict_layers) take no part in the main forward; DeepSeek-V3's MTP layer (a file `ikconvert --keep-mtp`
wrote: ik drops the layer and runs no DeepSeek-V3 MTP) drafts as the NextN head of ikrun/modules/nextn.py
(`nextn_head`): DeepSeek's MTP module (the V3 report's section 2.2, as vLLM's and SGLang's DeepSeekMTP run it):
RMSNorm of the token's embedding and of the main model's output-normed hidden state, concatenated embedding first,
eh_proj, the layer's MLA + MoE block with its own cache, shared_head's norm and head (under `--numerics ik` in ik's
kernels, with no ik run to check it against). A sequence continues through the latent cache (`continues`: a
speculative-decoding target, its MTP head's drafts too).

Files with half of the MLA tensors run both forms, with the other half derived as ik derives it at load
(numerics/exact.py; as ik's kernels multiply them, numerics/ik/mla_weights.py): attn_k_b / attn_v_b from attn_kv_b
alone, attn_kv_b (Q8_0 unless both are F16 or BF16) from attn_k_b / attn_v_b alone (mainline's layout).

YaRN as ik sets it up for this architecture: ext_factor 1 for rope scaling type yarn, beta 32/1, the rope's
magnitude factor pre-divided by 1 + 0.1 ln(1/freq_scale) (which ggml's rope multiplies back in), and the attention
scale mscale^2 / sqrt(key_length) with mscale = attn_factor (1 + yarn_log_multiplier ln(1/freq_scale)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ikrun.models.base import ArchModel, Hparam, Sequence
from ikrun.modules.attention import MlaAttention
from ikrun.modules.ffn import MoeConfig, dense_ffn, moe_ffn
from ikrun.modules.nextn import NextnHead
from ikrun.ops.moe import GATING_SIGMOID, GATING_SOFTMAX
from ikrun.ops.rope import Yarn, yarn_log_scale, yarn_rope_cache

if TYPE_CHECKING:
    from ikrun.context import Context

#: rope scaling types ik knows for this architecture (llama_rope_scaling_type_from_string)
ROPE_SCALING = ("none", "linear", "yarn")


class Deepseek2(ArchModel):
    archs = ("deepseek2",)
    runtime_options: ClassVar[tuple[str, ...]] = ("mla", "flash_attn")
    continues = True
    #: where a file without an MTP layer comes from, said when --mtp asks for one
    no_mtp_hint = " (ik's converter drops DeepSeek-V3's MTP layer; ikconvert --keep-mtp keeps it)"

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        hp = ctx.hparam
        self.n_layer = int(hp("block_count"))
        self.n_embd = int(hp("embedding_length"))
        self.n_head = int(hp("attention.head_count"))
        n_head_kv = int(hp("attention.head_count_kv", self.n_head))
        self.eps = float(hp("attention.layer_norm_rms_epsilon"))
        self.kv_lora = int(hp("attention.kv_lora_rank"))
        self.q_lora = int(hp("attention.q_lora_rank", 0))
        self.n_rot = int(hp("rope.dimension_count", 0))
        key_length = int(hp("attention.key_length", self.n_embd // self.n_head))
        value_length = int(hp("attention.value_length", key_length))
        if n_head_kv == 1 and self.n_head > 1:
            # mainline llama.cpp's MLA layout: the cache row is the key, the per-head sizes come from *_mla
            if key_length != self.kv_lora + self.n_rot or value_length != self.kv_lora:
                raise self.fail("head_count_kv 1 (mainline MLA layout) needs key_length = kv_lora_rank + "
                                "rope.dimension_count and value_length = kv_lora_rank; got "
                                f"{key_length}, {value_length} for kv_lora_rank {self.kv_lora}")
            key_length = int(hp("attention.key_length_mla", 192))
            value_length = int(hp("attention.value_length_mla", 128))
        self.head_k, self.head_v = key_length, value_length
        self.n_nope = key_length - self.n_rot
        if self.n_rot <= 0 or self.n_rot % 2 or self.n_nope <= 0:
            raise self.fail(f"{ctx.arch}.rope.dimension_count {self.n_rot} must be even, positive and below the "
                            f"key length {key_length}")
        self.n_dense = int(hp("leading_dense_block_count"))
        self.n_mtp = int(hp("nextn_predict_layers", 0))
        if not 0 <= self.n_mtp < self.n_layer:
            raise self.fail(f"{ctx.arch}.nextn_predict_layers {self.n_mtp} leaves no main layers of "
                            f"{self.n_layer}")
        self.n_active = self.n_layer - self.n_mtp
        if self.n_dense < self.n_layer:
            self.moe = MoeConfig.read(hp, self._default_gating(), lambda why: self.fail(f"{ctx.arch}.{why}"))
        self._read_rope(hp)
        self.attention = MlaAttention(self.n_head, self.q_lora, self.kv_lora, self.n_rot, self.head_k, self.head_v,
                                      self.eps, self.kq_scale)
        if not ctx.has("token_embd.weight"):
            raise self.fail("tensor token_embd.weight is missing")
        self.n_vocab = ctx.shape("token_embd.weight")[0]
        self._check_tensors()

    def _default_gating(self) -> int:
        """The gating of a file without expert_gating_func: older DeepSeek 2/2.5 files route by softmax;
        GLM-4.7-Flash (47 or 48 layers) by sigmoid."""
        return GATING_SIGMOID if self.n_layer in (47, 48) else GATING_SOFTMAX

    def _read_rope(self, hp: Hparam) -> None:
        f32 = np.float32
        self.freq_base = float(hp("rope.freq_base", 10000.0))
        scaling = str(hp("rope.scaling.type", "linear"))
        if scaling not in ROPE_SCALING:
            raise self.fail(f"{self.ctx.arch}.rope.scaling.type {scaling!r} is not one of "
                              f"{', '.join(ROPE_SCALING)}")
        factor = float(hp("rope.scaling.factor", 0.0) or hp("rope.scale_linear", 0.0) or 0.0)
        freq_scale = f32(1.0) if scaling == "none" or factor == 0.0 else f32(1.0) / f32(factor)
        self.freq_scale = float(freq_scale)
        attn_factor = f32(hp("rope.scaling.attn_factor", 1.0))
        log_mul = f32(hp("rope.scaling.yarn_log_multiplier", 0.0))
        mscale = f32(attn_factor * f32(yarn_log_scale(float(log_mul), float(freq_scale))))
        self.kq_scale = float(f32(mscale * mscale) / np.sqrt(f32(self.head_k)))
        self.yarn = Yarn(ext_factor=1.0 if scaling == "yarn" else 0.0,
                         attn_factor=float(f32(1.0) / f32(yarn_log_scale(0.1, float(freq_scale)))),
                         n_ctx_orig=int(hp("rope.scaling.original_context_length", 0) or hp("context_length", 0)))

    def _expected(self, i: int) -> dict[str, tuple[int, ...]]:
        """Block i's tensors and their numpy shapes (attn_k_b / attn_v_b are checked apart: 2-D or 3-D)."""
        e, h, c, r = self.n_embd, self.n_head, self.kv_lora, self.n_rot
        b = f"blk.{i}."
        want = {b + "attn_norm.weight": (e,), b + "attn_kv_a_norm.weight": (c,),
                b + "attn_kv_a_mqa.weight": (c + r, e), b + "attn_output.weight": (e, h * self.head_v),
                b + "ffn_norm.weight": (e,)}
        if self.q_lora:
            want.update({b + "attn_q_a_norm.weight": (self.q_lora,), b + "attn_q_a.weight": (self.q_lora, e),
                         b + "attn_q_b.weight": (h * self.head_k, self.q_lora)})
        else:
            want[b + "attn_q.weight"] = (h * self.head_k, e)
        if i < self.n_dense:
            ff = int(self.ctx.hparam("feed_forward_length"))
            want.update({b + "ffn_gate.weight": (ff, e), b + "ffn_up.weight": (ff, e),
                         b + "ffn_down.weight": (e, ff)})
            return want
        want.update(self.moe.expected(b, e))
        return want

    def _mla_shapes(self, i: int) -> dict[str, tuple[tuple[int, ...], ...]]:
        """attn_k_b / attn_v_b: ik's 2-D layout or mainline's 3-D one (same bytes per head); attn_kv_b optional."""
        h, c, d, v = self.n_head, self.kv_lora, self.n_nope, self.head_v
        b = f"blk.{i}."
        return {b + "attn_k_b.weight": ((h * c, d), (h, c, d)), b + "attn_v_b.weight": ((h * v, c), (h, v, c)),
                b + "attn_kv_b.weight": ((h * (d + v), c),)}

    def _check_tensors(self) -> None:
        """Every main block's tensors must be there; the NextN/MTP blocks' are checked where present."""
        cx = self.ctx
        want = {"token_embd.weight": (self.n_vocab, self.n_embd), "output_norm.weight": (self.n_embd,),
                "output.weight": (self.n_vocab, self.n_embd)}
        for i in range(self.n_active):
            want.update(self._expected(i))
        self.kv_b_only = all(cx.has(f"blk.{i}.attn_kv_b.weight") and not cx.has(f"blk.{i}.attn_k_b.weight")
                             and not cx.has(f"blk.{i}.attn_v_b.weight") for i in range(self.n_active))
        missing = [] if self.kv_b_only else \
            [n for i in range(self.n_active) for n in list(self._mla_shapes(i))[:2] if not cx.has(n)]
        self.check_tensors({**want, **{n: cx.shape(n) if cx.has(n) else () for n in missing}},
                           {n: s for i in range(self.n_active, self.n_layer) for n, s in self._expected(i).items()})

        for i in range(self.n_layer):
            for name, shapes in self._mla_shapes(i).items():
                if cx.has(name) and cx.shape(name) not in shapes:
                    raise self.fail(f"tensor {name} has shape {list(cx.shape(name))}, the hyperparameters imply "
                                    f"{' or '.join(str(list(s)) for s in shapes)}")
        for i in range(self.n_dense, self.n_layer):
            bias = f"blk.{i}.exp_probs_b.bias"
            if cx.has(bias) and cx.shape(bias) != (self.moe.n_expert,):
                raise self.fail(f"tensor {bias} has shape {list(cx.shape(bias))}, the hyperparameters imply "
                                f"{[self.moe.n_expert]}")

    def mla_path(self, n_tokens: int) -> str:
        """The MLA form ("prefill" or "decode") a sequence of `n_tokens` tokens runs (--mla). An imatrix collection
        (observers attached) runs decode unless told otherwise: its attn_k_b / attn_v_b entries are what recipes
        quantize with, and the prefill form has no per-head inputs for them."""
        if self.ctx.options.mla == "auto" and self.ctx.observers:
            return "decode"
        return self.ctx.options.mla_path(n_tokens)

    def check_context(self, n_ctx: int, batches: tuple[int, ...] = ()) -> None:
        """A latent cache the arithmetic does not reproduce in an MLA form the chunks' batches take, refused."""
        for path in dict.fromkeys(self.mla_path(n) for n in batches or (n_ctx,)):
            for name in (f"blk.{i}.attn_kv_b.weight" for i in range(self.n_active)):
                kind = self.ctx.weights.encoding(name).type.name if self.ctx.has(name) else "absent"
                heads = (self.head_k, self.head_v) if path == "prefill" else (self.n_rot + self.kv_lora, self.kv_lora)
                problem = self.ctx.numerics.latent_cache_problem(self.ctx.cache, path, (name, kind), heads)
                if problem is not None:
                    raise self.fail(problem)

    def computed_paths(self, n_ctx: int) -> dict[str, str]:
        """The MLA form, and under ik's arithmetic its attention graph (--flash-attn)."""
        graph = self.ctx.numerics.attention_graph(self.ctx.arch, self.ctx.cache, self.attention.head_k)
        return {"mla_path": self.mla_path(n_ctx), **({} if graph is None else {"flash_attn": graph})}

    def unread_tensors(self, n_ctx: int, batches: tuple[int, ...] = ()) -> dict[str, str]:
        """attn_kv_b under the decode form, attn_k_b / attn_v_b under the prefill form (each only where the file
        has the other: else the form reads it through ik's derivation), where every batch takes that form, and the
        NextN/MTP blocks' tensors."""
        paths = {self.mla_path(n) for n in batches or (n_ctx,)}
        unread = {n: "a NextN/MTP block: the main forward does not run it" for i in range(self.n_active, self.n_layer)
                  for n in self.block_tensors(i)}
        if len(paths) > 1:
            return unread
        path = paths.pop()
        unused, needed = ("attn_k_b", "attn_kv_b") if path == "prefill" else ("attn_kv_b", "attn_k_b")
        for i in range(self.n_active):
            b = f"blk.{i}."
            if self.ctx.has(b + needed + ".weight"):
                for name in (["attn_k_b", "attn_v_b"] if unused == "attn_k_b" else ["attn_kv_b"]):
                    if self.ctx.has(b + name + ".weight"):
                        unread[b + name + ".weight"] = f"the MLA {path} path (--mla) does not read it"
        return unread

    def begin(self, seq: Sequence) -> None:
        n = len(seq)

        def table() -> tuple[np.ndarray, np.ndarray]:
            return yarn_rope_cache(np.arange(seq.start, seq.start + n), self.n_rot, self.freq_base, self.freq_scale,
                                   self.yarn)

        seq.state["rope"] = self.table(("rope", n), table) if seq.start == 0 else table()

    def embed(self, seq: Sequence) -> np.ndarray:
        return self.ctx.embed_rows("token_embd.weight", seq.tokens)

    def block(self, i: int, xs: list[np.ndarray], seqs: list[Sequence]) -> list[np.ndarray]:
        cx, b = self.ctx, f"blk.{i}."

        def attention(x: np.ndarray, seq: Sequence) -> np.ndarray:
            cos, sin = seq.state["rope"]
            return x + self._attention(b, self.norm(x, cx.weight(b + "attn_norm.weight")), cos, sin, seq)

        xs = self.output_rows(i, self.each(xs, seqs, attention), seqs)
        hs = [self.norm(x, cx.weight(b + "ffn_norm.weight")) for x in xs]
        if i < self.n_dense:
            ys = self.each(hs, seqs, lambda h, seq: dense_ffn(cx, h, b))
        else:
            ys = moe_ffn(cx, hs, seqs, b, self.moe)
        return [x + y for x, y in zip(xs, ys)]

    def head(self, x: np.ndarray, seq: Sequence) -> np.ndarray:
        return self.output_projection(self.final_norm(x))

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        return self.norm(x, self.ctx.weight("output_norm.weight"))

    def output_projection(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.ctx.project(x, "output.weight"), dtype=np.float32)

    def _attention(self, b: str, h: np.ndarray, cos: np.ndarray, sin: np.ndarray, seq: Sequence) -> np.ndarray:
        return self._latent_attention(b, h, self.attention.query(self.ctx, b, h)[1], cos, sin,
                                      kv=seq.state.get("kv"))

    def _latent_attention(self, b: str, h: np.ndarray, q: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                          keep: np.ndarray | None = None, kv: dict[str, Any] | None = None) -> np.ndarray:
        """The attention block's output from its query; `keep` [n, cache rows] limits the keys each query sees; `kv` holds
        the cache rows of a continued sequence's earlier positions under `b` (prepended, then kept with these)."""
        cache = self.attention.cache_rows(self.ctx, b, h, cos, sin)
        if kv is not None:
            if b in kv:
                cache = np.concatenate([kv[b], cache])
            kv[b] = cache
        prefill = self.mla_path(len(h)) == "prefill"
        return self.attention(self.ctx, b, q, cache, cos, sin, keep=keep, prefill=prefill)

    def keep_cache(self, cache: dict[str, Any], length: int) -> dict[str, Any]:
        """The latent cache rows of every block cut at `length`."""
        return {b: rows[:length] for b, rows in cache.items()}

    def nextn_head(self) -> NextnHead:
        """The MTP layer's head (the last block; a file without one, or without its nextn tensors, is refused)."""
        i = self.n_layer - 1
        if not self.n_mtp:
            raise self.fail(f"{self.ctx.arch}.nextn_predict_layers is 0: the file has no MTP head to draft with"
                            + self.no_mtp_hint)
        missing = NextnHead.missing(self.ctx, i)
        if missing:
            raise self.fail(f"NextN/MTP tensors missing: {', '.join(missing)}")
        return NextnHead.of(self.ctx, i, "output.weight", lambda x, seq: self.block(i, [x], [seq])[0], self.norm)
