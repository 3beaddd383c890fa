"""The plain decoder family (`llama`, `qwen2`, `qwen3`): ik's build_llama / build_qwen2 / build_qwen3 graphs.

Per layer: RMSNorm, Q/K/V projections (+bias for qwen2), per-head Q/K RMSNorm (qwen3), rope (NORM for llama,
whose converter permuted q/k; NEOX for qwen), causal GQA attention, output projection, residual; RMSNorm, SwiGLU
FFN, residual. Then the output norm and the output projection (token_embd when the model ties them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ikrun.models.base import ArchModel, Sequence
from ikrun.modules.attention import GqaAttention
from ikrun.modules.ffn import dense_ffn
from ikrun.ops.rope import rope_cache

if TYPE_CHECKING:
    from ikrun.context import Context


class LlamaFamily(ArchModel):
    archs: ClassVar[tuple[str, ...]] = ("llama", "qwen2", "qwen3")
    runtime_options: ClassVar[tuple[str, ...]] = ("flash_attn",)
    #: the norm before a block's FFN
    ffn_norm: ClassVar[str] = "ffn_norm.weight"
    continues = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        hp = ctx.hparam
        self.read_gqa_hparams()
        self.head_dim_v = int(hp("attention.value_length", self.head_dim))
        scaling = hp("rope.scaling.type", None)
        factor = float(hp("rope.scaling.factor", 1.0))
        self.freq_scale = 1.0 / factor if scaling == "linear" and factor else 1.0
        self.attention = self.make_attention()
        self.output = "output.weight" if ctx.has("output.weight") else "token_embd.weight"
        if not ctx.has("token_embd.weight"):
            raise self.fail("tensor token_embd.weight is missing")
        self.n_vocab = ctx.shape("token_embd.weight")[0]
        self.n_active = self.n_layer - self._n_trailing()
        self.check_tensors(self._expected())

    def computed_paths(self, n_ctx: int) -> dict[str, str]:
        """ik's attention graph under its arithmetic (--flash-attn), and an error of ik's it reproduces."""
        nx, arch, cache = self.ctx.numerics, self.ctx.arch, self.ctx.cache
        graph = nx.attention_graph(arch, cache, self.head_dim)
        defect = nx.reproduced_defect(arch, cache, self.head_dim)
        return {**({} if graph is None else {"flash_attn": graph}), **({} if defect is None else {"ik_defect": defect})}

    def make_attention(self) -> GqaAttention:
        """The attention block: NORM rope for llama (its converter permuted q/k), NEOX otherwise."""
        return GqaAttention(self.n_head, self.n_head_kv, self.head_dim, self.head_dim_v, self.n_rot, self.eps,
                            neox=self.ctx.arch != "llama", qk_norm=self._qk_norm())

    def _qk_norm(self) -> bool:
        """Whether the blocks RMSNorm each query and key head (attn_q_norm / attn_k_norm)."""
        return self.ctx.arch.startswith("qwen3")

    def _n_trailing(self) -> int:
        """Blocks at the end of the file the main forward skips (NextN/MTP layers)."""
        return 0

    def _expected(self) -> dict[str, tuple[int, ...]]:
        """The main blocks' tensors and shapes (the NextN/MTP blocks': the architecture's own check, where present)."""
        e = self.n_embd
        want: dict[str, tuple[int, ...]] = {"token_embd.weight": (self.n_vocab, e), "output_norm.weight": (e,)}
        if self.output == "output.weight":
            want["output.weight"] = (self.n_vocab, e)
        for i in range(self.n_active):
            want.update(self._block_expected(i))
        return want

    def _block_expected(self, i: int) -> dict[str, tuple[int, ...]]:
        b, e = f"blk.{i}.", self.n_embd
        return {b + "attn_norm.weight": (e,), **self._mixer_expected(i, b), b + self.ffn_norm: (e,),
                **self._ffn_expected(i, b)}

    def _mixer_expected(self, i: int, b: str) -> dict[str, tuple[int, ...]]:
        return self.attention.expected(b, self.n_embd)

    def _ffn_expected(self, i: int, b: str) -> dict[str, tuple[int, ...]]:
        e, ff = self.n_embd, int(self.ctx.hparam("feed_forward_length"))
        return {b + "ffn_gate.weight": (ff, e), b + "ffn_up.weight": (ff, e), b + "ffn_down.weight": (e, ff)}

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
        """Attention (each sequence), then the FFN block on the normed states of all of them (`ffn`; the last block's
        on the output rows)."""
        cx, b = self.ctx, f"blk.{i}."

        def attention(x: np.ndarray, seq: Sequence) -> np.ndarray:
            return x + self.mixer(i, self.norm(x, cx.weight(b + "attn_norm.weight")), seq)

        xs = self.output_rows(i, self.each(xs, seqs, attention), seqs)
        return self.ffn_residual(i, xs, [self.norm(x, cx.weight(b + self.ffn_norm)) for x in xs], seqs)

    def ffn_residual(self, i: int, xs: list[np.ndarray], hs: list[np.ndarray],
                     seqs: list[Sequence]) -> list[np.ndarray]:
        """The residual stream after block `i`'s FFN: each x plus the FFN of its normed states hs."""
        return [x + y for x, y in zip(xs, self.ffn(i, hs, seqs))]

    def mixer(self, i: int, h: np.ndarray, seq: Sequence) -> np.ndarray:
        """Block `i`'s token mixer on one sequence's normed states: the attention (hybrid families put their
        linear attention here)."""
        cos, sin = seq.state["rope"]
        return self.attention(self.ctx, f"blk.{i}.", h, cos, sin, seq.state.get("kv"), self.attention_window(i))

    def attention_window(self, i: int) -> int:
        """The keys block `i` attends to, its own included (0: every earlier one)."""
        return 0

    def ffn(self, i: int, hs: list[np.ndarray], seqs: list[Sequence]) -> list[np.ndarray]:
        """Block `i`'s FFN on each sequence's normed states: the SwiGLU FFN (MoE families route where their layers
        do)."""
        return self.each(hs, seqs, lambda h, seq: dense_ffn(self.ctx, h, f"blk.{i}."))

    def head(self, x: np.ndarray, seq: Sequence) -> np.ndarray:
        return self.output_projection(self.final_norm(x))

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        return self.norm(x, self.ctx.weight("output_norm.weight"))

    def output_projection(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self.ctx.project(x, self.output), dtype=np.float32)
