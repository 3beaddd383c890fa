"""An independent reference: the Hugging Face model definition written directly in numpy over the safetensors.

It shares no code with the runtime's forward (HF tensor names and layouts, rotate-half rope with HF's inv_freq,
plain numpy softmax), so agreement between the two on a converted file checks the converter and the runtime at
once. float32 throughout, like transformers on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from ikconvert.checkpoint import Checkpoint
from ikrun.errors import HFReferenceError
from ikrun.validate import REFERENCES, reference_class
from ikrun.validate.dflash import DFlashReference


class HFReference:
    """Numpy forward of LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / Qwen3MoeForCausalLM from the HF
    checkpoint."""


    def __init__(self, folder: Path):
        self.ckpt = Checkpoint(folder)
        self.cfg = self.ckpt.config
        arch = self.ckpt.architecture
        own = reference_class(arch)
        if own is None or own is DFlashReference:
            raise HFReferenceError(f"{folder}: no numpy reference for {arch}; available: "
                                   + ", ".join(a for a in REFERENCES if reference_class(a) is not DFlashReference))
        self.tensors = dict(self.ckpt.iter_tensors())
        #: the architecture's own reference module, for those not written here
        self.other = own(self.cfg, self.tensors) if own is not HFReference else None

    def w(self, name: str) -> np.ndarray:
        return self.tensors[name].to_f32()

    def _rmsnorm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        var = np.mean(x.astype(np.float32) ** 2, axis=-1, keepdims=True)
        return (x / np.sqrt(var + np.float32(self.cfg["rms_norm_eps"]))).astype(np.float32) * weight

    def _rope(self, x: np.ndarray, positions: np.ndarray, dim: int) -> np.ndarray:
        base = float(self.cfg.get("rope_theta", 10000.0))
        inv_freq = (1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(np.float32)
        freqs = positions[:, None].astype(np.float32) * inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
        half = dim // 2
        rotated = np.concatenate([-x[..., half:dim], x[..., :half]], axis=-1)
        out = x.copy()
        out[..., :dim] = x[..., :dim] * cos + rotated * sin
        return out

    def logits(self, tokens: np.ndarray, observe: Callable[[str, np.ndarray], None] | None = None) -> np.ndarray:
        """float32 logits of one sequence; `observe(hf_weight_name, x)` sees every projection's input rows."""
        if self.other is not None:
            return self.other.logits(tokens, observe)
        cfg = self.cfg
        n = len(tokens)
        n_head = cfg["num_attention_heads"]
        n_kv = cfg.get("num_key_value_heads") or n_head
        hd = cfg.get("head_dim") or cfg["hidden_size"] // n_head
        qwen3 = self.ckpt.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        moe = self.ckpt.architecture == "Qwen3MoeForCausalLM"
        x = self.w("model.embed_tokens.weight")[tokens]
        pos = np.arange(n)
        mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."

            def proj(h: np.ndarray, name: str) -> np.ndarray:
                if observe is not None:
                    observe(p + name + ".weight", h)
                y = h @ self.w(p + name + ".weight").T
                bias = p + name + ".bias"
                return y + self.w(bias) if bias in self.tensors else y

            h = self._rmsnorm(x, self.w(p + "input_layernorm.weight"))
            q = proj(h, "self_attn.q_proj").reshape(n, n_head, hd)
            k = proj(h, "self_attn.k_proj").reshape(n, n_kv, hd)
            v = proj(h, "self_attn.v_proj").reshape(n, n_kv, hd)
            if qwen3:
                q = self._rmsnorm(q, self.w(p + "self_attn.q_norm.weight"))
                k = self._rmsnorm(k, self.w(p + "self_attn.k_norm.weight"))
            q, k = self._rope(q, pos, hd), self._rope(k, pos, hd)
            k = np.repeat(k, n_head // n_kv, axis=1)
            v = np.repeat(v, n_head // n_kv, axis=1)
            att = np.einsum("ihd,jhd->hij", q, k) / np.float32(np.sqrt(hd)) + mask
            att = np.exp(att - att.max(-1, keepdims=True))
            att = att / att.sum(-1, keepdims=True)
            o = np.einsum("hij,jhd->ihd", att, v).reshape(n, n_head * hd)
            x = x + proj(o, "self_attn.o_proj")
            h = self._rmsnorm(x, self.w(p + "post_attention_layernorm.weight"))
            if moe and p + "mlp.gate.weight" in self.tensors:
                x = x + self._sparse_moe(h, proj)
            else:
                x = x + self._mlp(h, proj, "mlp.")
        x = self._rmsnorm(x, self.w("model.norm.weight"))
        head = "lm_head.weight" if "lm_head.weight" in self.tensors else "model.embed_tokens.weight"
        return (x @ self.w(head).T).astype(np.float32)


    @staticmethod
    def _mlp(h: np.ndarray, proj: Callable[[np.ndarray, str], np.ndarray], prefix: str) -> np.ndarray:
        g = proj(h, prefix + "gate_proj")
        return proj((g / (1 + np.exp(-g))) * proj(h, prefix + "up_proj"), prefix + "down_proj")

    def _sparse_moe(self, h: np.ndarray, proj: Callable[[np.ndarray, str], np.ndarray]) -> np.ndarray:
        """Qwen3MoeSparseMoeBlock: softmax over the router logits, the top-k experts, their weights renormalised
        when norm_topk_prob, each expert a SwiGLU MLP on the tokens routed to it."""
        probs = proj(h, "mlp.gate")
        probs = np.exp(probs - probs.max(-1, keepdims=True))
        probs = probs / probs.sum(-1, keepdims=True)
        k = int(self.cfg["num_experts_per_tok"])
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
        weights = np.take_along_axis(probs, top, axis=-1)
        if self.cfg.get("norm_topk_prob", False):
            weights = weights / weights.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)
            out[rows] += weights[rows, slot, None] * self._mlp(h[rows], proj, f"mlp.experts.{e}.")
        return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def compare_logits(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    """Max relative logit error (|diff| / max|ref| per position, worst position), mean and max KL(ref || got)."""
    rel = np.abs(ref - got).max(-1) / np.maximum(np.abs(ref).max(-1), 1e-30)
    lr, lg = log_softmax(ref), log_softmax(got)
    kl = (np.exp(lr) * (lr - lg)).sum(-1)
    return {"max_rel_logit_err": float(rel.max()), "kld_mean": float(kl.mean()), "kld_max": float(kl.max()),
            "same_top": float((ref.argmax(-1) == got.argmax(-1)).mean())}
