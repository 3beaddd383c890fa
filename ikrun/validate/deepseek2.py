"""Independent numpy reference for DeepseekV3ForCausalLM, written from the Hugging Face model definition.

It shares nothing with the runtime's forward: HF tensor names and layouts (kv_b_proj expanded into per-head keys and
values, no latent absorption), HF's YaRN inverse frequencies with interleaved rotate-half rope, the HF router
(sigmoid scores, e_score_correction_bias for the choice only, group-limited top-k, weights renormalised with
+1e-20 and scaled) and experts summed in expert order. float32 throughout, like transformers on CPU (`dtype`
float64 for a check of the runtime's float32 that rounds nothing of its own; rope frequencies stay transformers'
float32 values). `mtp_logits`: DeepSeek-V3's multi-token-prediction module (below), which transformers' model
leaves out.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ikrun.errors import HFReferenceError

Observe = Callable[[str, np.ndarray], None]
BlockHook = Callable[[int, np.ndarray], None]
Proj = Callable[[np.ndarray, str], np.ndarray]


class DeepseekV3Reference:
    architectures = ("DeepseekV3ForCausalLM",)
    #: HF builds q_a_layernorm and kv_a_layernorm without the config's eps, so they keep RMSNorm's default
    latent_norm_eps = 1e-6

    def __init__(self, config: dict, tensors: dict, dtype: type = np.float32):  # type: ignore[type-arg]
        self.cfg = config
        self.tensors = tensors
        self.dtype = dtype
        self.inv_freq, self.rope_factor = self._rope_frequencies()
        self.scaling = self._attention_scaling()

    def w(self, name: str) -> np.ndarray:
        return self.tensors[name].to_f32().astype(self.dtype, copy=False)

    def _rope_frequencies(self) -> tuple[np.ndarray, float]:
        """HF's default or YaRN inverse frequencies for the rope part, and the cos/sin attention factor."""
        cfg = self.cfg
        dim = cfg["qk_rope_head_dim"]
        base = float(cfg.get("rope_theta", 10000.0))
        pos_freqs = (base ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(np.float32)
        scaling = cfg.get("rope_scaling")
        if not scaling:
            return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "yarn":


            raise HFReferenceError(f"rope_scaling type {kind!r} is not implemented in the DeepSeek-V3 reference")
        factor = float(scaling["factor"])
        original = scaling.get("original_max_position_embeddings")
        if original:
            factor = cfg["max_position_embeddings"] / original
        else:
            original = cfg["max_position_embeddings"]

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
        extrapolation = (np.float32(1.0) - ramp).astype(np.float32)
        inv_extra = (np.float32(1.0) / pos_freqs).astype(np.float32)
        inv_inter = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
        inv = inv_inter * (np.float32(1.0) - extrapolation) + inv_extra * extrapolation
        return inv.astype(np.float32), float(attention_factor)

    def _attention_scaling(self) -> np.float32:
        cfg = self.cfg
        scaling = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
        rope_scaling = cfg.get("rope_scaling") or {}
        m_all = rope_scaling.get("mscale_all_dim", 0)
        if m_all:
            factor = rope_scaling["factor"]
            m = 0.1 * m_all * math.log(factor) + 1.0 if factor > 1 else 1.0
            scaling = scaling * m * m
        return np.float32(scaling)

    def _rmsnorm(self, x: np.ndarray, name: str, eps: float | None = None) -> np.ndarray:
        """HF's RMSNorm; eps defaults to rms_norm_eps (HF builds q_a/kv_a_layernorm with its own 1e-6)."""
        var = np.mean(x.astype(self.dtype) ** 2, axis=-1, keepdims=True)
        eps = self.cfg["rms_norm_eps"] if eps is None else eps
        return self.w(name) * (x / np.sqrt(var + self.dtype(eps))).astype(self.dtype)

    def _rope(self, x: np.ndarray, positions: np.ndarray, interleave: bool | None = None) -> np.ndarray:
        """x [n, heads, d]: HF's interleaved variant (pairs de-interleaved first; config rope_interleave unless
        `interleave` says), then rotate-half."""
        n, heads, d = x.shape
        if self.cfg.get("rope_interleave", True) if interleave is None else interleave:
            x = x.reshape(n, heads, d // 2, 2).transpose(0, 1, 3, 2).reshape(n, heads, d)
        freqs: np.ndarray = positions[:, None].astype(self.dtype) * self.inv_freq[None, :].astype(self.dtype)
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos = (np.cos(emb) * self.dtype(self.rope_factor))[:, None, :]
        sin = (np.sin(emb) * self.dtype(self.rope_factor))[:, None, :]
        rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
        return (x * cos + rotated * sin).astype(self.dtype)

    def logits(self, tokens: np.ndarray, observe: Observe | None = None,
               on_block: BlockHook | None = None) -> np.ndarray:
        """float32 logits of one sequence; `observe(hf_weight_name, x)` sees every projection's input rows (each
        routed expert only its own tokens), `on_block(i, hidden)` the hidden state after each decoder layer."""
        cfg = self.cfg

        def proj(h: np.ndarray, name: str) -> np.ndarray:
            if observe is not None:
                observe(name + ".weight", h)
            return h @ self.w(name + ".weight").T

        x = self.w("model.embed_tokens.weight")[tokens]
        positions = np.arange(len(tokens))
        for i in range(cfg["num_hidden_layers"]):
            x = self._layer(i, x, positions, proj)
            if on_block is not None:
                on_block(i, x)
        x = self._rmsnorm(x, "model.norm.weight")
        return (x @ self.w("lm_head.weight").T).astype(self.dtype)

    def _layer(self, i: int, x: np.ndarray, positions: np.ndarray, proj: Proj) -> np.ndarray:
        """Decoder layer i on the hidden rows x of `positions`."""
        p = f"model.layers.{i}."
        h = self._rmsnorm(x, p + "input_layernorm.weight")
        x = x + self._attention(h, p + "self_attn.", positions, proj)
        h = self._rmsnorm(x, p + "post_attention_layernorm.weight")
        moe = i >= self.cfg.get("first_k_dense_replace", 0)
        return x + (self._moe(h, p + "mlp.", proj) if moe else self._mlp(h, p + "mlp.", proj))

    def mtp_logits(self, hidden: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The MTP module's logits (layer num_hidden_layers: DeepSeek-V3 report, section 2.2, as vLLM's and SGLang's
        DeepSeekMTP run it): position p takes token p and row p of `hidden`, the main model's output-normed hidden
        state of position p - 1; RMSNorm each (enorm, hnorm), [embedding | hidden] through eh_proj, the decoder
        layer over these positions (causal, positions from 0), then shared_head's norm and head (the model's
        embedding and lm_head where the layer has none of its own, as GLM-5's)."""
        i = self.cfg["num_hidden_layers"]
        p = f"model.layers.{i}."
        embed, head = p + "embed_tokens.weight", p + "shared_head.head.weight"
        embed = embed if embed in self.tensors else "model.embed_tokens.weight"
        head = head if head in self.tensors else "lm_head.weight"
        e = self._rmsnorm(self.w(embed)[tokens], p + "enorm.weight")
        x = np.concatenate([e, self._rmsnorm(hidden, p + "hnorm.weight")], axis=-1) @ self.w(p + "eh_proj.weight").T
        x = self._layer(i, x, np.arange(len(tokens)), lambda h, name: h @ self.w(name + ".weight").T)
        x = self._rmsnorm(x, p + "shared_head.norm.weight")
        return (x @ self.w(head).T).astype(self.dtype)

    def _attention(self, h: np.ndarray, p: str, positions: np.ndarray, proj: Proj) -> np.ndarray:
        cfg = self.cfg
        n = h.shape[0]
        n_head = cfg["num_attention_heads"]
        nope, rope, v_dim, lora = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"],
                                   cfg["kv_lora_rank"])
        q_resid = None if cfg.get("q_lora_rank") is None else \
            self._rmsnorm(proj(h, p + "q_a_proj"), p + "q_a_layernorm.weight", self.latent_norm_eps)
        q = proj(h, p + "q_proj") if q_resid is None else proj(q_resid, p + "q_b_proj")
        q = q.reshape(n, n_head, nope + rope)
        compressed = proj(h, p + "kv_a_proj_with_mqa")
        kv = proj(self._rmsnorm(compressed[:, :lora], p + "kv_a_layernorm.weight", self.latent_norm_eps),
                  p + "kv_b_proj")
        kv = kv.reshape(n, n_head, nope + v_dim)
        q_rot = self._rope(q[..., nope:], positions)
        k_rot = self._rope(compressed[:, None, lora:], positions)
        query = np.concatenate([q[..., :nope], q_rot], axis=-1)
        key = np.concatenate([kv[..., :nope], np.repeat(k_rot, n_head, axis=1)], axis=-1)
        mask = self._mask(h, q_resid, p, positions, proj)
        att = np.einsum("ihd,jhd->hij", query, key) * self.scaling + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att = att / att.sum(-1, keepdims=True)
        out = np.einsum("hij,jhd->ihd", att, kv[..., nope:]).reshape(n, n_head * v_dim)
        return proj(out.astype(self.dtype), p + "o_proj")

    def _mask(self, h: np.ndarray, q_resid: np.ndarray | None, p: str, positions: np.ndarray,
              proj: Proj) -> np.ndarray:
        """The additive attention mask [n, n] of the attention block `p` (causal here; sparse-attention models
        add their own selection from the block's input h and q latent q_resid)."""
        n = h.shape[0]
        return np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)

    def _mlp(self, h: np.ndarray, p: str, proj: Proj) -> np.ndarray:
        g = proj(h, p + "gate_proj")
        return proj((g / (1 + np.exp(-g))) * proj(h, p + "up_proj"), p + "down_proj")

    def _route(self, h: np.ndarray, p: str, proj: Proj) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.cfg
        n_expert, top_k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
        n_group, topk_group = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
        scores = 1 / (1 + np.exp(-proj(h, p + "gate")))
        choice = scores + self.w(p + "gate.e_score_correction_bias")[None, :]
        grouped = choice.reshape(len(h), n_group, n_expert // n_group)
        group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
        best_groups = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
        keep = np.zeros_like(group_scores, dtype=bool)
        np.put_along_axis(keep, best_groups, True, axis=-1)
        choice = np.where(np.repeat(keep, n_expert // n_group, axis=-1), choice, 0.0)
        chosen = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
        weights = np.take_along_axis(scores, chosen, axis=-1)
        if cfg.get("norm_topk_prob"):
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        return chosen, (weights * cfg["routed_scaling_factor"]).astype(self.dtype)

    def _moe(self, h: np.ndarray, p: str, proj: Proj) -> np.ndarray:
        chosen, weights = self._route(h, p, proj)
        out = np.zeros_like(h)
        for e in range(self.cfg["n_routed_experts"]):
            tok, slot = np.nonzero(chosen == e)
            if tok.size:
                out[tok] += self._mlp(h[tok], f"{p}experts.{e}.", proj) * weights[tok, slot][:, None]
        return out + self._mlp(h, p + "shared_experts.", proj)
