"""The plain decoder family (`llama`, `qwen2`, `qwen3`): ik's build_llama / build_qwen2 / build_qwen3 graphs.

Per layer: RMSNorm, Q/K/V projections (+bias for qwen2), per-head Q/K RMSNorm (qwen3), rope (NORM for llama,
whose converter permuted q/k; NEOX for qwen), causal GQA attention, output projection, residual; RMSNorm, SwiGLU
FFN, residual. Then the output norm and the output projection (token_embd when the model ties them).
"""

from __future__ import annotations

import numpy as np

from ikrun.ops.activations import swiglu
from ikrun.ops.attention import causal_attention
from ikrun.ops.norm import rms_norm
from ikrun.ops.rope import apply_rope, rope_cache


class LlamaFamily:
    archs = ("llama", "qwen2", "qwen3")

    def __init__(self, model):  # type: ignore[no-untyped-def]
        from ikrun.model import ModelError

        self.m = model
        hp = model.hparam
        self.n_layer = int(hp("block_count"))
        self.n_embd = int(hp("embedding_length"))
        self.n_head = int(hp("attention.head_count"))
        self.n_head_kv = int(hp("attention.head_count_kv", self.n_head))
        self.head_dim = int(hp("attention.key_length", self.n_embd // self.n_head))
        self.head_dim_v = int(hp("attention.value_length", self.head_dim))
        self.n_rot = int(hp("rope.dimension_count", self.head_dim))
        self.eps = float(hp("attention.layer_norm_rms_epsilon"))
        self.rope_base = float(hp("rope.freq_base", 10000.0))
        scaling = hp("rope.scaling.type", None)
        factor = float(hp("rope.scaling.factor", 1.0))
        self.freq_scale = 1.0 / factor if scaling == "linear" and factor else 1.0
        self.neox = model.arch != "llama"
        self.qk_norm = model.arch == "qwen3"
        self.output = "output.weight" if model.has("output.weight") else "token_embd.weight"
        if not model.has("token_embd.weight"):
            raise ModelError(f"{model.path}: tensor token_embd.weight is missing")
        self.n_vocab = model.shape("token_embd.weight")[0]
        if self.n_head % self.n_head_kv:
            raise ModelError(f"{model.path}: head_count {self.n_head} is not a multiple of head_count_kv "
                             f"{self.n_head_kv}")
        self._check_tensors(ModelError)

    def _expected(self) -> dict[str, tuple[int, ...]]:
        e, q, kv, kvv = self.n_embd, self.n_head * self.head_dim, self.n_head_kv * self.head_dim, \
            self.n_head_kv * self.head_dim_v
        ff = int(self.m.hparam("feed_forward_length"))
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

    def _check_tensors(self, error: type) -> None:
        missing = [n for n in self._expected() if not self.m.has(n)]
        if missing:
            raise error(f"{self.m.path}: {len(missing)} tensors missing for {self.m.arch}: {', '.join(missing[:8])}"
                        + (" ..." if len(missing) > 8 else ""))
        for name, shape in self._expected().items():
            if self.m.shape(name) != shape:
                raise error(f"{self.m.path}: tensor {name} has shape {list(self.m.shape(name))}, the hyperparameters "
                            f"imply {list(shape)}")

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        m = self.m
        n = len(tokens)
        x = m.weight("token_embd.weight")[tokens]
        factors = m.weight("rope_freqs.weight") if m.has("rope_freqs.weight") else None
        cos, sin = rope_cache(np.arange(n), self.n_rot, self.rope_base, self.freq_scale, factors)
        scale = 1.0 / np.sqrt(self.head_dim)
        for i in range(self.n_layer):
            b = f"blk.{i}."
            h = rms_norm(x, m.weight(b + "attn_norm.weight"), self.eps)
            q = m.linear(h, b + "attn_q").reshape(n, self.n_head, self.head_dim)
            k = m.linear(h, b + "attn_k").reshape(n, self.n_head_kv, self.head_dim)
            v = m.linear(h, b + "attn_v").reshape(n, self.n_head_kv, self.head_dim_v)
            if self.qk_norm:
                q = rms_norm(q, m.weight(b + "attn_q_norm.weight"), self.eps)
                k = rms_norm(k, m.weight(b + "attn_k_norm.weight"), self.eps)
            q = np.ascontiguousarray(q)
            k = np.ascontiguousarray(k)
            apply_rope(q, cos, sin, self.n_rot, self.neox)
            apply_rope(k, cos, sin, self.n_rot, self.neox)
            attn = causal_attention(q, m.kv_store(k), m.kv_store(v), scale).reshape(n, -1)
            x = x + m.linear(attn, b + "attn_output")
            h = rms_norm(x, m.weight(b + "ffn_norm.weight"), self.eps)
            x = x + m.linear(swiglu(m.linear(h, b + "ffn_gate"), m.linear(h, b + "ffn_up")),
                                 b + "ffn_down")
        x = rms_norm(x, m.weight("output_norm.weight"), self.eps)
        return np.ascontiguousarray(x @ m.weight(self.output).T, dtype=np.float32)
