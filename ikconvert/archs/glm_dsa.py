"""GlmMoeDsaForCausalLM (GLM-5, GLM-5.2) -> arch `glm-dsa`, the layout ik's runtime loads.

ik's converter has no class for it. The model is DeepSeek-V3's MLA + MoE with a lightning indexer, so this is the
DeepSeek-V2/V3 converter (expert merge, router bias, routing keys, DeepSeek-format FP8 tiles) with GLM's differences:

- MLA keys in ik's own form at every size: head_count_kv = num_attention_heads, key_length = qk_nope + qk_rope,
  value_length = v_head_dim. config.json's `head_dim` (64 in GLM-5, 192 in GLM-5.2; transformers replaces it by
  the rope width) is not a key length, and mainline's head_count_kv = 1 form loads in ik only at GLM-5's dims.
- `kv_b_proj` split into 3-D `attn_k_b` {dn, kl, nh} (each head's nope rows, transposed) and `attn_v_b`
  {kl, dv, nh}; no fused tensor (the GLM-DSA loader rejects it and the 2-D pair).
- The indexer (`self_attn.indexer.*`) on every layer that has it, and `attention.indexer.types`: the per-layer
  full/shared schedule as transformers derives it (an explicit `indexer_types`, else `index_topk_pattern`, else
  `index_topk_freq` / `index_skip_topk_offset`). A "full" layer without indexer tensors is an error.
- The NextN/MTP block kept as block num_hidden_layers with its `nextn.*` tensors and `nextn_predict_layers`.
- `expert_gating_func` written explicitly (ik falls back to softmax without it), `rope_parameters.rope_theta`.
- GLM's special tokens: bos [gMASK], eot <|user|>, unk <|endoftext|>, eom <|observation|>, as ik's GLM-4.5
  converter sets them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGUFWriter

from ikconvert.archs.base import OutTensor, register
from ikconvert.archs.deepseek2 import DeepseekV2Arch
from ikconvert.checkpoint import Checkpoint, block_id
from ikconvert.errors import ConvertError
from ikconvert.safetensors_io import SafeTensor

INDEXER = ("indexer.attn_q_b.weight", "indexer.attn_k.weight", "indexer.k_norm.weight", "indexer.k_norm.bias",
           "indexer.proj.weight")
#: special token type -> the GLM token ik's converter assigns it
SPECIAL_TOKENS = {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>", "eom": "<|observation|>"}


def indexer_types(config: dict[str, Any], n_layer: int) -> list[str]:
    """Per main layer "full" (runs its indexer) or "shared" (reuses the last full layer's top-k), as
    transformers' GlmMoeDsaConfig derives it; GLM-5 (no IndexShare keys) is full everywhere."""
    types = config.get("indexer_types")
    if types is None and (pattern := config.get("index_topk_pattern")) is not None:
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else pattern
    if types is None:
        freq = max(int(config.get("index_topk_freq", 1)), 1)
        offset = int(config.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layer)]
    return list(types)


@register
class GlmDsaArch(DeepseekV2Arch):
    hf_architectures = ("GlmMoeDsaForCausalLM",)
    gguf_arch = "glm-dsa"
    tensor_map = {
        **DeepseekV2Arch.tensor_map,
        "model.layers.{bid}.self_attn.indexer.wq_b": "blk.{bid}.indexer.attn_q_b",
        "model.layers.{bid}.self_attn.indexer.wk": "blk.{bid}.indexer.attn_k",
        "model.layers.{bid}.self_attn.indexer.k_norm": "blk.{bid}.indexer.k_norm",
        "model.layers.{bid}.self_attn.indexer.weights_proj": "blk.{bid}.indexer.proj",
    }
    accepted_options = ()  # GLM-5 keeps its NextN block always, as ik does

    def __init__(self, ckpt: Checkpoint, options: dict[str, Any] | None = None):
        super().__init__(ckpt, options)
        self.hparams = self._as_deepseek(ckpt.config)
        self.n_layer = int(self.require("num_hidden_layers"))
        self.n_nextn = int(self.hparams.get("num_nextn_predict_layers") or 0)
        self.types = indexer_types(ckpt.config, self.n_layer)
        self._check_schedules()
        self._shapes = self._glm_shapes()
        #: per block, the GGUF names mapped so far (to find missing indexer / NextN tensors)
        self._seen: dict[int, set[str]] = {}

    def _as_deepseek(self, config: dict[str, Any]) -> dict[str, Any]:
        """config.json as the DeepSeek-V2 keys see it: ik's MLA form (no `head_dim` key length, KV heads = heads),
        the rope base from `rope_parameters`, transformers' default of 3 leading dense layers."""
        h = {k: v for k, v in config.items() if k != "head_dim"}
        h["num_key_value_heads"] = self.require("num_attention_heads")
        h.setdefault("first_k_dense_replace", 3)
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
            raise ConvertError(f"{self.ckpt.dir / 'config.json'}: rope scaling "
                               f"{rope.get('rope_type') or config.get('rope_scaling')!r} is not supported for "
                               "GlmMoeDsaForCausalLM (GLM-5 uses plain RoPE)")
        if "rope_theta" not in h and "rope_theta" in rope:
            h["rope_theta"] = rope["rope_theta"]
        return h

    def _check_schedules(self) -> None:
        where = self.ckpt.dir / "config.json"
        if len(self.types) != self.n_layer or set(self.types) - {"full", "shared"}:
            raise ConvertError(f"{where}: indexer_types must give 'full' or 'shared' for each of the "
                               f"{self.n_layer} layers (num_hidden_layers), got {self.types!r}")
        if self.types and self.types[0] != "full":
            raise ConvertError(f"{where}: indexer_types starts with {self.types[0]!r}; layer 0 has no earlier "
                               "full layer whose top-k it could reuse")
        n_dense = int(self.hparams["first_k_dense_replace"])
        mlp = self.hparams.get("mlp_layer_types")
        if mlp is not None and list(mlp) != ["dense"] * n_dense + ["sparse"] * (self.n_layer - n_dense):
            raise ConvertError(f"{where}: mlp_layer_types {mlp!r} is not {n_dense} dense layers "
                               "(first_k_dense_replace) then sparse ones, the only layout a GGUF can describe")

    @property
    def block_count(self) -> int:
        """The main layers plus the NextN/MTP blocks, which ik loads as the last blocks."""
        return self.n_layer + self.n_nextn

    def set_gguf_parameters(self, gw: GGUFWriter) -> None:
        super().set_gguf_parameters(gw)
        arch = self.gguf_arch
        if self.n_nextn:
            gw.add_nextn_predict_layers(self.n_nextn)
        gw.add_uint32(f"{arch}.attention.indexer.head_count", int(self.require("index_n_heads")))
        gw.add_uint32(f"{arch}.attention.indexer.key_length", int(self.require("index_head_dim")))
        gw.add_uint32(f"{arch}.attention.indexer.top_k", int(self.require("index_topk")))
        gw.add_array(f"{arch}.attention.indexer.types", [t == "full" for t in self.types])

    def set_vocab(self, gw: GGUFWriter, pre_tokenizer: str) -> None:
        from ikconvert.vocab import HFTokenizerFiles, write_bpe_vocab

        folder = self.tokenizer_dir()
        added = {tok["content"]: tid for tid, tok in HFTokenizerFiles(folder).added.items()}
        ids = {}
        for typ, token in SPECIAL_TOKENS.items():
            if token not in added:
                raise ConvertError(f"{folder / 'tokenizer.json'}: no added token {token!r}, which GLM tokenizers "
                                   f"use as their {typ} token")
            ids[typ] = added[token]
        write_bpe_vocab(gw, folder, int(self.require("vocab_size")), pre_tokenizer, ids)

    # ---- tensors ------------------------------------------------------------------------------------------
    def map_tensor(self, name: str, t: SafeTensor) -> list[OutTensor]:
        outs = super().map_tensor(name, t)
        for out in outs:
            bid = block_id(out.name)
            if bid is not None:
                self._seen.setdefault(bid, set()).add(out.name.split(".", 2)[2])
        return outs

    def _split_kv_b(self, name: str, t: SafeTensor, gguf: str, load: Callable[[], np.ndarray],
                    note: str) -> list[OutTensor]:
        """DeepSeek's per-head split, kept 3-D ({dn, kl, nh} and {kl, dv, nh}) and without the fused tensor."""
        _, k_b, v_b = super()._split_kv_b(name, t, gguf, load, note)
        n_head = int(self.require("num_attention_heads"))
        for out in (k_b, v_b):
            rows, cols = out.shape
            out.shape = (n_head, rows // n_head, cols)
            out.load = _reshaped(out.load, out.shape)
            out.transform += ", 3-D per head"
            out.squeeze = False  # a single head must stay 3-D for ik's loader
        return [k_b, v_b]

    def finish(self) -> None:
        super().finish()
        for bid in range(self.block_count):
            have = self._seen.get(bid, set())
            if "attn_norm.weight" not in have:
                what = "NextN/MTP block (num_nextn_predict_layers)" if bid >= self.n_layer else "layer"
                raise ConvertError(f"{self.ckpt.dir}: config.json implies {what} {bid}, but the checkpoint has no "
                                   f"model.layers.{bid}.* tensors")
            indexer = [n for n in INDEXER if n in have]
            needed = bid < self.n_layer and self.types[bid] == "full"
            if (needed or indexer) and len(indexer) < len(INDEXER):
                why = "is 'full' in indexer_types" if needed else "has only part of an indexer"
                missing = ", ".join(f"blk.{bid}.{n}" for n in INDEXER if n not in have)
                raise ConvertError(f"{self.ckpt.dir}: layer {bid} {why}, but the checkpoint lacks {missing} "
                                   f"(from model.layers.{bid}.self_attn.indexer.*)")

    # ---- shape checks -------------------------------------------------------------------------------------
    def check_shapes(self, out: OutTensor) -> None:
        key = out.name.split(".", 2)[2] if out.name.startswith("blk.") else ""
        bid = block_id(out.name)
        if key.startswith("nextn.") and bid is not None and bid < self.n_layer:
            raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} is a NextN/MTP tensor, but layer {bid} is a "
                               f"main layer (num_hidden_layers {self.n_layer})")
        want = self._shapes.get(key)
        if want is None:
            super().check_shapes(out)
        else:
            self._expect(out, want)

    def _glm_shapes(self) -> dict[str, tuple[int, ...]]:
        d = {k: int(self.require(k)) for k in ("hidden_size", "vocab_size", "num_attention_heads", "kv_lora_rank",
                                            "qk_nope_head_dim", "v_head_dim", "q_lora_rank", "index_n_heads",
                                            "index_head_dim")}
        hidden, heads, kl, ih, idim = (d["hidden_size"], d["num_attention_heads"], d["kv_lora_rank"],
                                       d["index_n_heads"], d["index_head_dim"])
        return {
            "attn_k_b.weight": (heads, kl, d["qk_nope_head_dim"]), "attn_v_b.weight": (heads, d["v_head_dim"], kl),
            "indexer.attn_q_b.weight": (ih * idim, d["q_lora_rank"]), "indexer.attn_k.weight": (idim, hidden),
            "indexer.k_norm.weight": (idim,), "indexer.k_norm.bias": (idim,), "indexer.proj.weight": (ih, hidden),
            "nextn.eh_proj.weight": (hidden, 2 * hidden), "nextn.enorm.weight": (hidden,),
            "nextn.hnorm.weight": (hidden,), "nextn.shared_head_norm.weight": (hidden,),
            "nextn.embed_tokens.weight": (d["vocab_size"], hidden),
            "nextn.shared_head_head.weight": (d["vocab_size"], hidden),
        }


def _reshaped(load: Callable[[], np.ndarray], shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    return lambda: load().reshape(shape)
