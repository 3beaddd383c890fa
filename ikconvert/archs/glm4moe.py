"""Glm4MoeForCausalLM (GLM-4.5, 4.6, 4.7) -> arch `glm4moe` (ik's Glm4MoeModel).

What ik does, reproduced: attention with q/k/v biases (and q/k norms where the checkpoint has them),
`post_attention_layernorm` as `post_attention_norm` (ik's loader reads it as the FFN norm), the router `mlp.gate` as
`ffn_gate_inp` and its `e_score_correction_bias` as `exp_probs_b.bias`, shared experts, routed experts merged per
layer, and the NextN/MTP layers (index >= num_hidden_layers) kept as the last blocks with their `nextn.*` tensors
(block_count counts them). Keys: rope.dimension_count = head_dim x partial_rotary_factor (0.5 when absent), sigmoid
gating, routed_scaling_factor, norm_topk_prob, leading dense blocks, nextn_predict_layers. A multimodal checkpoint's
`model.language_model.` prefix is dropped and its `model.visual.` tensors skipped, as ik does.

Beyond ik: `n_group` > 1 is written as `glm4moe.expert_group_count` / `expert_group_used_count` (transformers limits
the top-k to the best `topk_group` groups; ik's converter drops both and its graph takes no groups; every released
GLM-4.x says 1 group, and then the file is ik's byte for byte). A config asking for something neither ik nor ikrun
computes (another scoring function or top-k method, rope scaling, another activation) is refused, key and value named.
A transformers-5 config that keeps rope_theta / partial_rotary_factor only inside `rope_parameters` is read there
(ik's converter would drop the base, which its runtime then takes as 10000).
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFWriter

from ikconvert.archs.base import ExpertMerger, OutTensor, register, with_rope_parameters
from ikconvert.archs.llama import DECODER_MAP, DecoderArch
from ikconvert.checkpoint import Checkpoint, block_id
from ikconvert.errors import ConvertError
from ikconvert.safetensors_io import SafeTensor

#: ik's ExpertGatingFuncType.SIGMOID
GATING_SIGMOID = 2
#: special token type -> the GLM token ik's converter assigns it
SPECIAL_TOKENS = {"bos": "[gMASK]", "eot": "<|user|>", "unk": "<|endoftext|>", "eom": "<|observation|>"}
NEXTN_MAP = {
    "model.layers.{bid}.eh_proj": "blk.{bid}.nextn.eh_proj",
    "model.layers.{bid}.embed_tokens": "blk.{bid}.nextn.embed_tokens",
    "model.layers.{bid}.enorm": "blk.{bid}.nextn.enorm",
    "model.layers.{bid}.hnorm": "blk.{bid}.nextn.hnorm",
    "model.layers.{bid}.shared_head.head": "blk.{bid}.nextn.shared_head_head",
    "model.layers.{bid}.shared_head.norm": "blk.{bid}.nextn.shared_head_norm",
}
#: config keys whose other values ask for a computation neither ik's glm4moe graph nor ikrun has
_REQUIRED_VALUES = {"scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "hidden_act": ("silu",)}


def unsupported_config(h: dict[str, Any]) -> str | None:
    """What in a GLM-4.x config.json cannot be converted faithfully (key and value), or None."""
    for key, allowed in _REQUIRED_VALUES.items():
        if key in h and h[key] not in allowed:
            return f"{key} {h[key]!r} (only {', '.join(map(repr, allowed))} is computed)"
    scaling = h.get("rope_scaling")
    if scaling is not None:
        return f"rope_scaling {scaling!r} (ik's glm4moe has plain rope only)"
    params = h.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_type", "default") != "default":
        return f"rope_parameters.rope_type {params['rope_type']!r} (ik's glm4moe has plain rope only)"
    n_group, topk_group = int(h.get("n_group") or 1), int(h.get("topk_group") or 1)
    n_expert = int(h.get("n_routed_experts") or 0)
    if n_group < 1 or (n_expert and n_expert % n_group) or not 1 <= topk_group <= n_group:
        return (f"n_group {n_group} / topk_group {topk_group} (n_routed_experts {n_expert} must split into n_group "
                "groups, of which topk_group are kept)")
    return None


@register
class Glm4MoeArch(DecoderArch):
    hf_architectures = ("Glm4MoeForCausalLM",)
    gguf_arch = "glm4moe"
    tensor_map = {
        **DECODER_MAP,
        "model.layers.{bid}.post_attention_layernorm": "blk.{bid}.post_attention_norm",
        "model.layers.{bid}.self_attn.q_norm": "blk.{bid}.attn_q_norm",
        "model.layers.{bid}.self_attn.k_norm": "blk.{bid}.attn_k_norm",
        "model.layers.{bid}.mlp.gate": "blk.{bid}.ffn_gate_inp",
        "model.layers.{bid}.mlp.gate.e_score_correction": "blk.{bid}.exp_probs_b",
        "model.layers.{bid}.mlp.shared_experts.gate_proj": "blk.{bid}.ffn_gate_shexp",
        "model.layers.{bid}.mlp.shared_experts.up_proj": "blk.{bid}.ffn_up_shexp",
        "model.layers.{bid}.mlp.shared_experts.down_proj": "blk.{bid}.ffn_down_shexp",
        **NEXTN_MAP,
    }
    skipped = (*DecoderArch.skipped, r"model\.visual\..*")

    def __init__(self, ckpt: Checkpoint, options: dict[str, Any] | None = None):
        super().__init__(ckpt, options)
        self.hparams = with_rope_parameters(self.hparams)  # transformers 5: the rope keys inside rope_parameters
        why = unsupported_config(self.hparams)
        if why is not None:
            raise ConvertError(f"{ckpt.dir / 'config.json'}: {why}")
        self.n_layer = int(self.require("num_hidden_layers"))
        self.n_nextn = int(self.hparams.get("num_nextn_predict_layers") or 0)
        self._experts = ExpertMerger(int(self.require("n_routed_experts")), "n_routed_experts")

    @property
    def block_count(self) -> int:
        """The main layers plus the NextN/MTP layers, which ik keeps as the last blocks."""
        return self.n_layer + self.n_nextn

    def set_gguf_parameters(self, gw: GGUFWriter) -> None:
        super().set_gguf_parameters(gw)
        h = self.hparams
        head_dim = h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]
        gw.add_rope_dimension_count(int(head_dim * h.get("partial_rotary_factor", 0.5)))
        gw.add_expert_count(h["n_routed_experts"])
        if (ff := h.get("moe_intermediate_size")) is not None:
            gw.add_expert_feed_forward_length(ff)
        if (shared := h.get("n_shared_experts")) is not None:
            gw.add_expert_shared_count(shared)
        if (dense := h.get("first_k_dense_replace")) is not None:
            gw.add_leading_dense_block_count(dense)
        gw.add_uint32(f"{self.gguf_arch}.expert_gating_func", GATING_SIGMOID)
        if (scale := h.get("routed_scaling_factor")) is not None:
            gw.add_expert_weights_scale(scale)
        if (norm := h.get("norm_topk_prob")) is not None:
            gw.add_expert_weights_norm(norm)
        if (nextn := h.get("num_nextn_predict_layers")) is not None:
            gw.add_nextn_predict_layers(nextn)
        if int(h.get("n_group") or 1) > 1:
            gw.add_expert_group_count(int(h["n_group"]))
            gw.add_expert_group_used_count(int(h.get("topk_group") or 1))

    def set_vocab(self, gw: GGUFWriter, pre_tokenizer: str) -> None:
        from ikconvert.vocab import HFTokenizerFiles, write_bpe_vocab

        folder = self.tokenizer_dir()
        files = HFTokenizerFiles(folder)
        added = {tok["content"]: tid for tid, tok in files.added.items()}
        ids = {}
        for typ, token in SPECIAL_TOKENS.items():
            if token not in added:
                raise ConvertError(f"{folder / 'tokenizer.json'}: no added token {token!r}, which GLM tokenizers "
                                   f"use as their {typ} token")
            ids[typ] = added[token]
        vocab_size = int(self.hparams.get("vocab_size") or 0) or len(files.vocab)
        write_bpe_vocab(gw, folder, vocab_size, pre_tokenizer, ids)

    # ---- tensors ------------------------------------------------------------------------------------------
    def map_tensor(self, name: str, t: SafeTensor) -> list[OutTensor]:
        name = name.replace("model.language_model.", "model.", 1)
        if "mlp.experts." in name:
            return self._experts.add(name, t)
        if name.endswith("e_score_correction_bias"):
            gguf = self.gguf_name(name.replace("e_score_correction_bias", "e_score_correction.bias"))
            return [OutTensor(gguf, t.shape, name, t.to_f32, t.dtype)]
        return [OutTensor(self.gguf_name(name), t.shape, name, t.to_f32, t.dtype)]

    def finish(self) -> None:
        self._experts.finish()

    def check_shapes(self, out: OutTensor) -> None:
        bid = block_id(out.name)
        if bid is None:
            super().check_shapes(out)
            return
        key = out.name.split(".", 2)[2]
        h = self.hparams
        e, x = int(self.require("hidden_size")), int(self.require("n_routed_experts"))
        ff = int(h.get("moe_intermediate_size") or 0)
        sh = ff * int(h.get("n_shared_experts") or 0)
        vocab = int(h.get("vocab_size") or 0)
        nextn = {"nextn.eh_proj.weight": (e, 2 * e), "nextn.enorm.weight": (e,), "nextn.hnorm.weight": (e,),
                 "nextn.shared_head_norm.weight": (e,), "nextn.embed_tokens.weight": (vocab, e),
                 "nextn.shared_head_head.weight": (vocab, e)}
        moe = {"ffn_gate_inp.weight": (x, e), "exp_probs_b.bias": (x,), "ffn_gate_exps.weight": (x, ff, e),
               "ffn_up_exps.weight": (x, ff, e), "ffn_down_exps.weight": (x, e, ff),
               "ffn_gate_shexp.weight": (sh, e), "ffn_up_shexp.weight": (sh, e), "ffn_down_shexp.weight": (e, sh)}
        dense_keys = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
        if key in nextn:
            if bid < self.n_layer:
                raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} -> {out.name} is a NextN/MTP tensor in "
                                   f"main layer {bid} (num_hidden_layers {self.n_layer})")
            vocab_sized = key in ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight")
            want: tuple[int, ...] | None = None if vocab_sized and not vocab else nextn[key]
        elif key in moe or key in dense_keys:
            dense = bid < int(h.get("first_k_dense_replace") or 0)
            if (key in dense_keys) != dense:
                kind = "dense (first_k_dense_replace)" if dense else "MoE (past first_k_dense_replace)"
                raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} -> {out.name} does not belong in layer "
                                   f"{bid}, which config.json makes {kind}")
            if dense:
                super().check_shapes(out)
                return
            want = moe[key] if ff else None
        elif key == "post_attention_norm.weight":
            want = (e,)
        else:
            super().check_shapes(out)
            return
        if want is not None and tuple(out.shape) != want:
            raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} -> {out.name} has shape {list(out.shape)} "
                               f"but config.json implies {list(want)}")
