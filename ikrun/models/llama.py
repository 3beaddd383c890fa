"""The plain decoder family (`llama`, `qwen2`, `qwen3`): ik's build_llama / build_qwen2 / build_qwen3 graphs.

Per layer: RMSNorm, Q/K/V projections (+bias for qwen2), per-head Q/K RMSNorm (qwen3), rope (NORM for llama,
whose converter permuted q/k; NEOX for qwen), causal GQA attention, output projection, residual; RMSNorm, SwiGLU
FFN, residual. Then the output norm and the output projection (token_embd when the model ties them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ikrun.models.base import ArchModel, Sequence
from ikrun.modules.ffn import dense_ffn
from ikrun.ops.rope import rope_cache

if TYPE_CHECKING:
    from ikrun.context import Context


class LlamaFamily(ArchModel):
    archs = ("llama", "qwen2", "qwen3")
    continues = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        hp = ctx.hparam
        self.read_gqa_hparams()
        self.head_dim_v = int(hp("attention.value_length", self.head_dim))
        scaling = hp("rope.scaling.type", None)
        factor = float(hp("rope.scaling.factor", 1.0))
        self.freq_scale = 1.0 / factor if scaling == "linear" and factor else 1.0
        self.neox = ctx.arch != "llama"
        self.qk_norm = ctx.arch == "qwen3"
        self.output = "output.weight" if ctx.has("output.weight") else "token_embd.weight"
        if not ctx.has("token_embd.weight"):
            raise self.fail("tensor token_embd.weight is missing")
        self.n_vocab = ctx.shape("token_embd.weight")[0]
        self.n_active = self.n_layer
        self.check_tensors(self._expected())

    def _expected(self) -> dict[str, tuple[int, ...]]:
        e, q, kv, kvv = self.n_embd, self.n_head * self.head_dim, self.n_head_kv * self.head_dim, \
            self.n_head_kv * self.head_dim_v
        ff = int(self.ctx.hparam("feed_forward_length"))
        want: dict[str, tuple[int, ...]] = {"token_embd.weight": (self.n_vocab, e), "output_norm.weight": (e,)}
        if self.output == "output.weight":
            want["output.weight"] = (self.n_vocab, e)
        for i in range(self.n_layer):
            b = f"blk.{i}."
            want.update({
                b + "attn_norm.weight": (e,), b + "attn_q.weight": (q, e), b + "attn_k.weight": (kv, e),
                b + "attn_v.weight": (kvv, e), b + "attn_output.weight": (e, self.n_head * self.head_dim_v),
                b + "ffn_norm.weight": (e,), b + "ffn_gate.weight": (ff, e), b + "ffn_up.weight": (ff, e),
                b + "ffn_down.weight": (e, ff),
            })
            if self.qk_norm:
                want[b + "attn_q_norm.weight"] = (self.head_dim,)
                want[b + "attn_k_norm.weight"] = (self.head_dim,)
        return want

    def begin(self, seq: Sequence) -> None:
        cx = self.ctx
        factors = cx.weight("rope_freqs.weight") if cx.has("rope_freqs.weight") else None

        def table() -> tuple[np.ndarray, np.ndarray]:
            return rope_cache(np.arange(seq.start, seq.start + len(seq)), self.n_rot, self.rope_base,
                              self.freq_scale, factors)

        seq.state["rope"] = self.table(("rope", len(seq)), table) if seq.start == 0 else table()

    def embed(self, seq: Sequence) -> np.ndarray:
        return self.ctx.embed_rows("token_embd.weight", seq.tokens)

    def block(self, i: int, xs: list[np.ndarray], seqs: list[Sequence]) -> list[np.ndarray]:
        return self.each(xs, seqs, lambda x, seq: self._block(i, x, seq))

    def _block(self, i: int, x: np.ndarray, seq: Sequence) -> np.ndarray:
        cx, b, n = self.ctx, f"blk.{i}.", len(x)
        cos, sin = seq.state["rope"]
        h = self.norm(x, cx.weight(b + "attn_norm.weight"))
        q, k, v = cx.linears(h, [b + "attn_q", b + "attn_k", b + "attn_v"])
        q = q.reshape(n, self.n_head, self.head_dim)
        k = k.reshape(n, self.n_head_kv, self.head_dim)
        v = v.reshape(n, self.n_head_kv, self.head_dim_v)
        if self.qk_norm:
            q = self.norm(q, cx.weight(b + "attn_q_norm.weight"))
            k = self.norm(k, cx.weight(b + "attn_k_norm.weight"))
        q = np.ascontiguousarray(q)
        k = np.ascontiguousarray(k)
        self.rope(q, cos, sin, self.neox)
        self.rope(k, cos, sin, self.neox)
        k, v = cx.kv_store(k), cx.kv_store(v)
        cache = seq.state.get("kv")
        if cache is not None:  # a continuation: earlier positions' keys and values first
            if i in cache:
                k, v = np.concatenate([cache[i][0], k]), np.concatenate([cache[i][1], v])
            cache[i] = (k, v)
        attn = cx.numerics.causal_attention(q, k, v, self.head_dim).reshape(n, -1)
        x = x + cx.linear(attn, b + "attn_output")
        return x + dense_ffn(cx, self.norm(x, cx.weight(b + "ffn_norm.weight")), b)

    def head(self, x: np.ndarray, seq: Sequence) -> np.ndarray:
        return self.output_projection(self.norm(x, self.ctx.weight("output_norm.weight")))

    def output_projection(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.ctx.project(x, self.output), dtype=np.float32)
