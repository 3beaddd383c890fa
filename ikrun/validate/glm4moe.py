"""Independent numpy reference for Glm4MoeForCausalLM (GLM-4.5 / 4.6 / 4.7), written from transformers' definition.

GLM-4.x's MoE is DeepSeek-V3's (sigmoid router with e_score_correction_bias for the choice only, group-limited top-k,
+1e-20 renormalisation, routed_scaling_factor, shared experts, first_k_dense_replace dense layers), so the DeepSeek-V3
reference's routing and experts serve; the attention is GLM's own: q/k/v projections with their biases, per-head
q/k RMSNorm when use_qk_norm, rotate-half rope on the first head_dim x partial_rotary_factor dims of each head,
grouped-query softmax attention scaled by head_dim^-0.5. The NextN/MTP layers are not part of the forward
(transformers ignores their weights). Nothing is shared with the runtime.
"""

from __future__ import annotations

import numpy as np

from ikrun.errors import HFReferenceError
from ikrun.validate.deepseek2 import DeepseekV3Reference, Proj


class Glm4MoeReference(DeepseekV3Reference):
    architectures = ("Glm4MoeForCausalLM",)

    def _head_dim(self) -> int:
        cfg = self.cfg
        return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])

    def _rope_frequencies(self) -> tuple[np.ndarray, float]:
        """transformers' default inverse frequencies over the rotary part of a head."""
        cfg = self.cfg
        params = cfg.get("rope_parameters") or {}
        kind = (cfg.get("rope_scaling") or {}).get("rope_type", params.get("rope_type", "default"))
        if kind != "default":
            raise HFReferenceError(f"rope type {kind!r} is not implemented in the GLM-4.x reference")
        base = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        dim = int(self._head_dim() * factor)
        inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)))
        return inv_freq.astype(np.float32), 1.0

    def _attention_scaling(self) -> np.float32:
        return np.float32(self._head_dim() ** -0.5)

    def _attention(self, h: np.ndarray, p: str, positions: np.ndarray, proj: Proj) -> np.ndarray:
        cfg = self.cfg
        n, hd = len(h), self._head_dim()
        n_head = cfg["num_attention_heads"]
        n_kv = cfg.get("num_key_value_heads") or n_head

        def heads(name: str, count: int) -> np.ndarray:
            y = proj(h, p + name)
            if p + name + ".bias" in self.tensors:
                y = y + self.w(p + name + ".bias")
            return y.reshape(n, count, hd)

        q, k, v = heads("q_proj", n_head), heads("k_proj", n_kv), heads("v_proj", n_kv)
        if cfg.get("use_qk_norm"):
            q, k = self._rmsnorm(q, p + "q_norm.weight"), self._rmsnorm(k, p + "k_norm.weight")
        rot = 2 * len(self.inv_freq)
        q = np.concatenate([self._rope(q[..., :rot], positions, interleave=False), q[..., rot:]], axis=-1)
        k = np.concatenate([self._rope(k[..., :rot], positions, interleave=False), k[..., rot:]], axis=-1)
        k, v = np.repeat(k, n_head // n_kv, axis=1), np.repeat(v, n_head // n_kv, axis=1)
        mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
        att = np.einsum("ihd,jhd->hij", q, k) * self.scaling + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att = att / att.sum(-1, keepdims=True)
        out = np.einsum("hij,jhd->ihd", att, v).reshape(n, n_head * hd)
        return proj(out.astype(np.float32), p + "o_proj")
