"""Independent numpy reference for one DFlashDraftModel forward, written from z-lab/dflash's definition (MiMo's
additions as ik's draft graph defines them).

HF tensor names read from the draft's safetensors (bf16 widened to float32), the target's embedding and lm_head
from the target's: `hidden_norm(fc(target_hidden))` as every layer's context; per layer input_layernorm on the
block only, q/k/v projections, q_norm and k_norm per head (k_norm on the context keys and the block keys alike),
rotate-half rope from inverse frequencies (rope_theta, from `rope_parameters` in a transformers-5 config; the
context's keys at dflash_config.backbone_rotary_base where set) over head_dim x partial_rotary_factor dims at the
context positions then the block positions, values times attention_value_scale where set, attention with no mask
(grouped KV heads repeated; per-head sink logits, attention_sink_bias, in the softmax where present), o_proj,
residual, post_attention_layernorm, SwiGLU, residual; the final norm. float32 throughout, softmax in float64. The
runtime's draft (ikrun/models/dflash.py) is checked against this layer by layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ikconvert.archs.base import with_rope_parameters
from ikconvert.safetensors_io import SafetensorsFile


def _load(folder: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for path in sorted(folder.glob("*.safetensors")):
        f = SafetensorsFile(path)
        tensors.update({name: t.to_f32() for name, t in f.tensors.items()})
    return tensors


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    v = x.astype(np.float64)
    return (v / np.sqrt((v * v).mean(-1, keepdims=True) + eps)).astype(np.float32) * w


def _rope(x: np.ndarray, positions: np.ndarray, theta: float, d: int) -> np.ndarray:
    """Rotate-half rope over the first d dims of each head (partial rotary), the rest unchanged."""
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    emb = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(emb).astype(np.float32)[:, None, :], np.sin(emb).astype(np.float32)[:, None, :]
    r = x[..., :d]
    rot = np.concatenate([-r[..., d // 2 :], r[..., : d // 2]], axis=-1)
    return np.concatenate([r * cos + rot * sin, x[..., d:]], axis=-1)


def target_embeddings(target_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """The target checkpoint's token embeddings and lm_head (the embeddings when tied)."""
    target = _load(target_dir)
    embed = target["model.embed_tokens.weight"]
    return embed, target.get("lm_head.weight", embed)


class DFlashReference:
    """A draft checkpoint folder."""

    def __init__(self, draft_dir: Path):
        self.cfg = with_rope_parameters(json.loads((draft_dir / "config.json").read_text(encoding="utf-8")))
        self.w = {k.removeprefix("model."): v for k, v in _load(draft_dir).items()}

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.w[name + ".weight"].T
        return y + self.w[name + ".bias"] if name + ".bias" in self.w else y

    def forward(self, context_features: np.ndarray, block_embeddings: np.ndarray) -> list[np.ndarray]:
        """Each layer's output, then the final norm's, for the block following len(context_features) tokens."""
        c, g = self.cfg, self.w
        eps, theta = float(c["rms_norm_eps"]), float(c.get("rope_theta", 10000.0))
        n_head, n_kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        rot = int(float(c.get("partial_rotary_factor", 1.0)) * d)
        dflash = c.get("dflash_config") or {}
        context_theta = float(dflash.get("backbone_rotary_base") or theta)
        v_scale = np.float32(dflash.get("attention_value_scale", c.get("attention_value_scale", 1.0)))
        n_ctx, n = len(context_features), len(block_embeddings)
        ctx = _rms(context_features @ g["fc.weight"].T, g["hidden_norm.weight"], eps)
        x = block_embeddings.astype(np.float32)
        q_pos, k_pos = np.arange(n_ctx, n_ctx + n), np.arange(n_ctx + n)
        kinds = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
        outs = []
        for i in range(c["num_hidden_layers"]):
            p = f"layers.{i}."
            a = p + "self_attn."
            h = _rms(x, g[p + "input_layernorm.weight"], eps)
            q = _rms(self._linear(h, a + "q_proj").reshape(n, n_head, d), g[a + "q_norm.weight"], eps)
            both = np.concatenate([ctx, h])
            k = _rms(self._linear(both, a + "k_proj").reshape(n_ctx + n, n_kv, d), g[a + "k_norm.weight"], eps)
            v = self._linear(both, a + "v_proj").reshape(n_ctx + n, n_kv, d) * v_scale
            q = _rope(q, q_pos, theta, rot)
            k = np.concatenate([_rope(k[:n_ctx], k_pos[:n_ctx], context_theta, rot),
                                _rope(k[n_ctx:], k_pos[n_ctx:], theta, rot)])
            k, v = np.repeat(k, n_head // n_kv, axis=1), np.repeat(v, n_head // n_kv, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k).astype(np.float64) / np.sqrt(d)
            if kinds[i] == "sliding_attention":  # causal within the window
                rel = q_pos[:, None] - k_pos[None, :]
                scores = np.where((rel >= 0) & (rel < int(c["sliding_window"])), scores, -np.inf)
            if a + "attention_sink_bias" in g:  # a column of sink logits joins the softmax, then is dropped
                sinks = np.broadcast_to(g[a + "attention_sink_bias"].astype(np.float64)[:, None, None],
                                        (*scores.shape[:2], 1))
                scores = np.concatenate([scores, sinks], axis=-1)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs = (probs / probs.sum(-1, keepdims=True))[..., : n_ctx + n].astype(np.float32)
            attn = np.einsum("hqk,khd->qhd", probs, v).reshape(n, n_head * d)
            x = x + self._linear(attn, a + "o_proj")
            h = _rms(x, g[p + "post_attention_layernorm.weight"], eps)
            gate, up = h @ g[p + "mlp.gate_proj.weight"].T, h @ g[p + "mlp.up_proj.weight"].T
            x = x + ((gate / (1.0 + np.exp(-gate))) * up) @ g[p + "mlp.down_proj.weight"].T
            outs.append(x)
        outs.append(_rms(x, g["norm.weight"], eps))
        return outs
