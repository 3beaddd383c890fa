"""The plain decoder family: LlamaForCausalLM (arch `llama`), Qwen2ForCausalLM (`qwen2`), Qwen3ForCausalLM (`qwen3`).

Qwen2/Qwen3 tensors are pure renames. Llama's q/k projections are permuted back from HF's rotate-half layout to
the interleaved pairs llama.cpp's NORM rope expects, and Llama writes vocab_size, rope.dimension_count and rope
scaling keys. (ik's current LlamaModel.set_gguf_parameters reads `num_experts_per_tok` and
`prefix_dense_intermediate_size` unconditionally and so raises KeyError on every plain Llama config; we write
what that method evidently intends: the base keys, then vocab_size, rope dimension and scaling.)
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGUFWriter, RopeScalingType

from ikconvert.archs.base import Arch, OutTensor, lazy, register
from ikconvert.errors import ConvertError
from ikconvert.safetensors_io import SafeTensor

DECODER_MAP = {
    "model.embed_tokens": "token_embd",
    "lm_head": "output",
    "model.norm": "output_norm",
    "model.layers.{bid}.input_layernorm": "blk.{bid}.attn_norm",
    "model.layers.{bid}.post_attention_layernorm": "blk.{bid}.ffn_norm",
    "model.layers.{bid}.self_attn.q_proj": "blk.{bid}.attn_q",
    "model.layers.{bid}.self_attn.k_proj": "blk.{bid}.attn_k",
    "model.layers.{bid}.self_attn.v_proj": "blk.{bid}.attn_v",
    "model.layers.{bid}.self_attn.o_proj": "blk.{bid}.attn_output",
    "model.layers.{bid}.mlp.gate_proj": "blk.{bid}.ffn_gate",
    "model.layers.{bid}.mlp.up_proj": "blk.{bid}.ffn_up",
    "model.layers.{bid}.mlp.down_proj": "blk.{bid}.ffn_down",
}


class DecoderArch(Arch):
    """Shared shape checks of the plain decoders."""

    def _dims(self) -> dict[str, int]:
        h = self.hparams
        n_embd = int(self.find_hparam(["hidden_size"]))
        n_head = int(self.find_hparam(["num_attention_heads"]))
        n_kv = int(h.get("num_key_value_heads") or n_head)
        head_dim = int(h.get("head_dim") or n_embd // n_head)
        return {"embd": n_embd, "q": n_head * head_dim, "kv": n_kv * head_dim, "ff": int(h["intermediate_size"]),
                "vocab": int(h.get("vocab_size") or 0), "head": head_dim}

    def check_shapes(self, out: OutTensor) -> None:
        d = self._dims()
        expected = {
            "token_embd.weight": (d["vocab"], d["embd"]),
            "output.weight": (d["vocab"], d["embd"]),
            "output_norm.weight": (d["embd"],),
            "attn_norm.weight": (d["embd"],),
            "ffn_norm.weight": (d["embd"],),
            "attn_q.weight": (d["q"], d["embd"]),
            "attn_k.weight": (d["kv"], d["embd"]),
            "attn_v.weight": (d["kv"], d["embd"]),
            "attn_output.weight": (d["embd"], d["q"]),
            "attn_q.bias": (d["q"],),
            "attn_k.bias": (d["kv"],),
            "attn_v.bias": (d["kv"],),
            "attn_q_norm.weight": (d["head"],),
            "attn_k_norm.weight": (d["head"],),
            "ffn_gate.weight": (d["ff"], d["embd"]),
            "ffn_up.weight": (d["ff"], d["embd"]),
            "ffn_down.weight": (d["embd"], d["ff"]),
        }
        key = out.name.split(".", 2)[-1] if out.name.startswith("blk.") else out.name
        want = expected.get(key)
        if want is None or (not d["vocab"] and key in ("token_embd.weight", "output.weight")):
            return
        if tuple(out.shape) != want:
            raise ConvertError(
                f"{self.ckpt.dir}: tensor {out.source!r} has shape {list(out.shape)} but config.json implies "
                f"{list(want)}"
            )


@register
class Qwen3Arch(DecoderArch):
    hf_architectures = ("Qwen3ForCausalLM",)
    gguf_arch = "qwen3"
    tensor_map = {
        **DECODER_MAP,
        "model.layers.{bid}.self_attn.q_norm": "blk.{bid}.attn_q_norm",
        "model.layers.{bid}.self_attn.k_norm": "blk.{bid}.attn_k_norm",
    }


@register
class Qwen2Arch(DecoderArch):
    hf_architectures = ("Qwen2ForCausalLM",)
    gguf_arch = "qwen2"
    tensor_map = DECODER_MAP


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half row order -> interleaved pairs, per head (ik's LlamaModel.permute)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@register
class LlamaArch(DecoderArch):
    hf_architectures = ("LlamaForCausalLM",)
    gguf_arch = "llama"
    tensor_map = DECODER_MAP

    def set_gguf_parameters(self, gw: GGUFWriter) -> None:
        super().set_gguf_parameters(gw)
        h = self.hparams
        gw.add_vocab_size(h["vocab_size"])
        gw.add_rope_dimension_count(int(h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]))
        scaling = h.get("rope_scaling")
        if isinstance(scaling, dict) and "factor" in scaling and scaling.get("type") == "linear":
            gw.add_rope_scaling_type(RopeScalingType.LINEAR)
            gw.add_rope_scaling_factor(scaling["factor"])
        tok_cfg = self.ckpt.tokenizer_config() or {}
        if "add_prefix_space" in tok_cfg:
            gw.add_add_space_prefix(tok_cfg["add_prefix_space"])
        if h.get("vocab_size") == 49152:
            gw.add_add_bos_token(False)

    def map_tensor(self, name: str, t: SafeTensor) -> list[OutTensor]:
        n_head = int(self.hparams["num_attention_heads"])
        n_kv = int(self.hparams.get("num_key_value_heads") or n_head)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return [OutTensor(self.gguf_name(name), t.shape, name, lazy(t, lambda w: permute_rope_rows(w, n_head)),
                              t.dtype, "rope permute")]
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return [OutTensor(self.gguf_name(name), t.shape, name, lazy(t, lambda w: permute_rope_rows(w, n_kv)),
                              t.dtype, "rope permute")]
        return super().map_tensor(name, t)

    def extra_tensors(self) -> list[OutTensor]:
        """Llama 3.1-style rope scaling ships as a rope_freqs tensor of per-frequency divisors."""
        scaling = self.hparams.get("rope_scaling")
        if not isinstance(scaling, dict) or str(scaling.get("rope_type", "")).lower() != "llama3":
            return []
        factors = llama3_rope_factors(self.hparams)
        return [OutTensor("rope_freqs.weight", factors.shape, "rope_freqs.weight", lambda: factors, "F32",
                          "generated from rope_scaling")]


def llama3_rope_factors(h: dict) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1's rope scaling, in float32 arithmetic as ik's converter (torch) does."""
    scaling = h["rope_scaling"]
    f32 = np.float32
    base = f32(h.get("rope_theta", 10000.0))
    dim = h["hidden_size"] // h["num_attention_heads"]
    freqs = f32(1.0) / (base ** (np.arange(0, dim, 2, dtype=np.float32) / f32(dim)))
    factor = f32(scaling.get("factor", 8.0))
    low = f32(scaling.get("low_freq_factor", 1.0))
    high = f32(scaling.get("high_freq_factor", 4.0))
    old_ctx = f32(h.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    out = []
    for freq in freqs:
        wavelen = f32(2 * math.pi) / freq
        if wavelen < high_wavelen:
            out.append(f32(1.0))
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(f32(1.0) / ((f32(1.0) - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)
