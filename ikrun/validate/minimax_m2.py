"""Independent numpy reference for MiniMaxM2ForCausalLM, written from the Hugging Face model definition
(transformers' modular_minimax_m2.py: FlexOlmo-style attention, Glm4-MoE partial rope, Mixtral experts with a sigmoid
router).

It shares nothing with the runtime's forward: HF tensor names (per-expert w1 gate / w2 down / w3 up, never merged),
q_norm / k_norm as RMSNorms over the whole q / k projection before the heads are split, HF's inverse frequencies over
`rotary_dim` (transformers' partial_rotary_factor) with rotate-half on those dims only, the router as
MiniMaxM2TopKRouter computes it (sigmoid scores, e_score_correction_bias for the choice only, the chosen scores
divided by their sum), experts summed in expert order. float32 throughout, like transformers on CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Observe = Callable[[str, np.ndarray], None]


class MiniMaxM2Reference:
    architectures = ("MiniMaxM2ForCausalLM",)

    def __init__(self, config: dict, tensors: dict):  # type: ignore[type-arg]
        self.cfg = config
        self.tensors = tensors
        self.head_dim = int(config["head_dim"])
        self.rotary_dim = int(config.get("rotary_dim") or self.head_dim)
        base = np.float32(config.get("rope_theta", 10000.0))
        exponents = np.arange(0, self.rotary_dim, 2).astype(np.float32) / np.float32(self.rotary_dim)
        self.inv_freq = (np.float32(1.0) / base ** exponents).astype(np.float32)

    def w(self, name: str) -> np.ndarray:
        return self.tensors[name].to_f32()

    def _rmsnorm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        var = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
        return weight * (x / np.sqrt(var + np.float32(self.cfg["rms_norm_eps"]))).astype(np.float32)

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate-half rope on the first rotary_dim dims of every head of x [n, heads, head_dim]."""
        d = self.rotary_dim
        freqs = positions[:, None].astype(np.float32) * self.inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
        rot = x[..., :d]
        rotated = np.concatenate([-rot[..., d // 2:], rot[..., : d // 2]], axis=-1)
        return np.concatenate([rot * cos + rotated * sin, x[..., d:]], axis=-1).astype(np.float32)

    def logits(self, tokens: np.ndarray, observe: Observe | None = None) -> np.ndarray:
        """float32 logits of one sequence; `observe(hf_weight_name, x)` sees every projection's input rows."""
        cfg = self.cfg
        n, hd = len(tokens), self.head_dim
        n_head = int(cfg["num_attention_heads"])
        n_kv = int(cfg.get("num_key_value_heads") or n_head)
        positions = np.arange(n)
        mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
        x = self.w("model.embed_tokens.weight")[tokens]

        def proj(h: np.ndarray, name: str) -> np.ndarray:
            if observe is not None:
                observe(name + ".weight", h)
            return (h @ self.w(name + ".weight").T).astype(np.float32)

        for i in range(int(cfg["num_hidden_layers"])):
            p = f"model.layers.{i}."
            h = self._rmsnorm(x, self.w(p + "input_layernorm.weight"))
            q = self._rmsnorm(proj(h, p + "self_attn.q_proj"), self.w(p + "self_attn.q_norm.weight"))
            k = self._rmsnorm(proj(h, p + "self_attn.k_proj"), self.w(p + "self_attn.k_norm.weight"))
            v = proj(h, p + "self_attn.v_proj").reshape(n, n_kv, hd)
            q = self._rope(q.reshape(n, n_head, hd), positions)
            k = np.repeat(self._rope(k.reshape(n, n_kv, hd), positions), n_head // n_kv, axis=1)
            v = np.repeat(v, n_head // n_kv, axis=1)
            att = np.einsum("ihd,jhd->hij", q, k) * np.float32(hd ** -0.5) + mask
            att = np.exp(att - att.max(-1, keepdims=True))
            att = att / att.sum(-1, keepdims=True)
            o = np.einsum("hij,jhd->ihd", att, v).reshape(n, n_head * hd)
            x = x + proj(o, p + "self_attn.o_proj")
            h = self._rmsnorm(x, self.w(p + "post_attention_layernorm.weight"))
            x = x + self._sparse_moe(h, p + "block_sparse_moe.", proj)
        x = self._rmsnorm(x, self.w("model.norm.weight"))
        head = "lm_head.weight" if "lm_head.weight" in self.tensors else "model.embed_tokens.weight"
        return (x @ self.w(head).T).astype(np.float32)

    def _sparse_moe(self, h: np.ndarray, p: str, proj: Callable[[np.ndarray, str], np.ndarray]) -> np.ndarray:
        """MiniMaxM2SparseMoeBlock: sigmoid router scores (whatever config.json's scoring_func says), the top-k of scores + correction bias, their scores
        divided by their sum, each expert a SwiGLU MLP (w1 gate, w3 up, w2 down) on the tokens routed to it."""
        scores = np.float32(1.0) / (np.float32(1.0) + np.exp(-proj(h, p + "gate")))
        bias_name = p + "e_score_correction_bias"
        choice = scores + self.w(bias_name) if bias_name in self.tensors else scores
        k = int(self.cfg["num_experts_per_tok"])
        top = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
        weights = np.take_along_axis(scores, top, axis=-1)
        weights = weights / weights.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)
            g = proj(h[rows], f"{p}experts.{e}.w1")
            act = (g / (np.float32(1.0) + np.exp(-g))) * proj(h[rows], f"{p}experts.{e}.w3")
            out[rows] += weights[rows, slot, None] * proj(act, f"{p}experts.{e}.w2")
        return out
