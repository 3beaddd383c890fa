"""Independent numpy reference for GptOssForCausalLM, written from the Hugging Face model definition
(transformers' modeling_gpt_oss.py, eager attention and experts; its mxfp4 integration's dequantisation).

It shares nothing with the runtime's forward: the released MXFP4 experts (`*_blocks`, `*_scales`) dequantised here
(E2M1 nibbles, element 2j in the low nibble of byte j, times 2^(scale - 127)) into the fused `gate_up_proj` whose
output columns alternate gate, up; transformers' YaRN inverse frequencies (a fractional correction range unless
`rope_scaling.truncate` is true) with cos/sin times 0.1 ln(factor) + 1 and rotate-half; attention over
`layer_types` (sliding: the last `sliding_window` keys, the own included) with each head's sink logit appended to
the scores before the softmax and dropped after; the router's top-k logits softmaxed; each expert's clamped SwiGLU
(up + 1) * gate * sigmoid(1.702 gate) with its biases, weighted and summed. float32 throughout, like transformers on
CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

Observe = Callable[[str, np.ndarray], None]

#: E2M1 code -> value
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      dtype=np.float32)
ALPHA = np.float32(1.702)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[E, rows, n/32, 16] U8 codes + [E, rows, n/32] U8 exponents -> [E, rows, n] float32."""
    vals = np.empty((*blocks.shape[:-1], 32), dtype=np.float32)
    vals[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    vals[..., 1::2] = FP4_VALUES[blocks >> 4]
    vals = np.ldexp(vals, scales.astype(np.int32)[..., None] - 127).astype(np.float32)
    return vals.reshape(*blocks.shape[:2], -1)


class GptOssReference:
    architectures = ("GptOssForCausalLM",)

    def __init__(self, config: dict, tensors: dict):  # type: ignore[type-arg]
        self.cfg = config
        self.tensors = tensors
        self.head_dim = int(config["head_dim"])
        self.inv_freq, self.attention_scaling = self._yarn(config)
        n_layer = int(config["num_hidden_layers"])
        self.layer_types = config.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]

    def _yarn(self, cfg: dict) -> tuple[np.ndarray, float]:  # type: ignore[type-arg]
        """transformers' _compute_yarn_parameters (no mscale keys: attention factor 0.1 ln(factor) + 1)."""
        d, base = self.head_dim, float(cfg.get("rope_theta", 10000.0))
        pos_freqs = (base ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d))).astype(np.float32)
        scaling = cfg.get("rope_scaling")
        if not isinstance(scaling, dict):
            return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
        factor = float(scaling["factor"])
        orig = float(scaling["original_max_position_embeddings"])

        def correction_dim(rotations: float) -> float:
            return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(float(scaling.get("beta_fast", 32.0))), correction_dim(
            float(scaling.get("beta_slow", 1.0)))
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0.0), min(high, d - 1.0)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        extrapolation = np.float32(1.0) - ramp.astype(np.float32)
        inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
        extra = np.float32(1.0) / pos_freqs
        inv = inter * (np.float32(1.0) - extrapolation) + extra * extrapolation
        return inv.astype(np.float32), 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def w(self, name: str) -> np.ndarray:
        return self.tensors[name].to_f32()

    def _rmsnorm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        var = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
        return weight * (x / np.sqrt(var + np.float32(self.cfg["rms_norm_eps"]))).astype(np.float32)

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        freqs = positions[:, None].astype(np.float32) * self.inv_freq[None, :]
        s = np.float32(self.attention_scaling)
        cos, sin = (np.cos(freqs) * s)[:, None, :], (np.sin(freqs) * s)[:, None, :]
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(np.float32)

    def logits(self, tokens: np.ndarray, observe: Observe | None = None) -> np.ndarray:
        """float32 logits of one sequence; `observe(hf_weight_name, x)` sees the dense projections' input rows."""
        cfg = self.cfg
        n, hd = len(tokens), self.head_dim
        n_head = int(cfg["num_attention_heads"])
        n_kv = int(cfg.get("num_key_value_heads") or n_head)
        positions = np.arange(n)
        i_idx, j_idx = np.arange(n)[:, None], np.arange(n)[None, :]
        x = self.w("model.embed_tokens.weight")[tokens]

        def proj(h: np.ndarray, name: str) -> np.ndarray:
            if observe is not None:
                observe(name + ".weight", h)
            y = h @ self.w(name + ".weight").T
            if name + ".bias" in self.tensors:
                y = y + self.w(name + ".bias")
            return y.astype(np.float32)

        for i in range(int(cfg["num_hidden_layers"])):
            p = f"model.layers.{i}."
            h = self._rmsnorm(x, self.w(p + "input_layernorm.weight"))
            q = self._rope(proj(h, p + "self_attn.q_proj").reshape(n, n_head, hd), positions)
            k = self._rope(proj(h, p + "self_attn.k_proj").reshape(n, n_kv, hd), positions)
            v = proj(h, p + "self_attn.v_proj").reshape(n, n_kv, hd)
            k, v = np.repeat(k, n_head // n_kv, axis=1), np.repeat(v, n_head // n_kv, axis=1)
            seen = j_idx <= i_idx
            if self.layer_types[i] == "sliding_attention":
                seen &= i_idx - j_idx < int(cfg["sliding_window"])
            att = np.einsum("ihd,jhd->hij", q, k) * np.float32(hd ** -0.5)
            att = np.where(seen[None], att, np.float32(-np.inf))
            sinks = np.broadcast_to(self.w(p + "self_attn.sinks")[:, None, None], (n_head, n, 1))
            att = np.concatenate([att, sinks], axis=-1)
            att = np.exp(att - att.max(-1, keepdims=True))
            att = (att / att.sum(-1, keepdims=True))[..., :-1]
            o = np.einsum("hij,jhd->ihd", att, v).reshape(n, n_head * hd)
            x = x + proj(o, p + "self_attn.o_proj")
            h = self._rmsnorm(x, self.w(p + "post_attention_layernorm.weight"))
            x = x + self._experts(h, p + "mlp.", proj)
        x = self._rmsnorm(x, self.w("model.norm.weight"))
        return (x @ self.w("lm_head.weight").T).astype(np.float32)

    def _experts(self, h: np.ndarray, p: str, proj: Callable[[np.ndarray, str], np.ndarray]) -> np.ndarray:
        """GptOssMLP: the router's top-k logits softmaxed, each chosen expert's clamped SwiGLU."""
        logits = proj(h, p + "router")
        k = int(self.cfg["num_experts_per_tok"])
        top = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        vals = np.take_along_axis(logits, top, axis=-1)
        weights = np.exp(vals - vals.max(-1, keepdims=True))
        weights = (weights / weights.sum(-1, keepdims=True)).astype(np.float32)
        e = p + "experts."
        raw = {name: self.tensors[e + name].raw().view(np.uint8) for name in
               ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")}
        gate_up = dequantize_mxfp4(raw["gate_up_proj_blocks"].reshape(self.tensors[e + "gate_up_proj_blocks"].shape),
                                   raw["gate_up_proj_scales"].reshape(self.tensors[e + "gate_up_proj_scales"].shape))
        down = dequantize_mxfp4(raw["down_proj_blocks"].reshape(self.tensors[e + "down_proj_blocks"].shape),
                                raw["down_proj_scales"].reshape(self.tensors[e + "down_proj_scales"].shape))
        gate_up_bias, down_bias = self.w(e + "gate_up_proj_bias"), self.w(e + "down_proj_bias")
        limit = np.float32(self.cfg.get("swiglu_limit", 7.0))
        out = np.zeros_like(h)
        for x in np.unique(top):
            rows, slot = np.nonzero(top == x)
            gu = h[rows] @ gate_up[x].T + gate_up_bias[x]
            gate, up = np.minimum(gu[:, 0::2], limit), np.clip(gu[:, 1::2], -limit, limit)
            glu = gate / (np.float32(1.0) + np.exp(-gate * ALPHA))
            y = ((up + np.float32(1.0)) * glu) @ down[x].T + down_bias[x]
            out[rows] += weights[rows, slot, None] * y.astype(np.float32)
        return out
