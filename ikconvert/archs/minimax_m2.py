"""MiniMaxM2ForCausalLM -> arch `minimax-m2` (ik's MiniMaxM2Model): plain renames, the router
`block_sparse_moe.gate` as `ffn_gate_inp`, `e_score_correction_bias` as `exp_probs_b.bias`, and each layer's routed
experts `block_sparse_moe.experts.X.w{1,2,3}` (w1 gate, w2 down, w3 up) merged into 3-D `ffn_{gate,down,up}_exps`
in that order. Keys: ik's base set plus the gating function, the expert FFN width and `rotary_dim` as the rope
dimension count. No q/k permutation: the rope is NEOX over the first `rotary_dim` dims of each head.

ik's own converter stops at the first expert (its gguf-py has no name for the merged `block_sparse_moe.experts.w*`);
we write the layout ik's runtime loads, which is that converter with the three names added.

Refused before any tensor is read, naming key and value: configs that ask for what neither ik nor ikrun computes
(MiniMax-01's linear attention layers in `attn_type_list`, shared experts, a sliding window, rope scaling, q/k norm
switched off or per head) and a `scoring_func` other than sigmoid (transformers' router is sigmoid whatever the
config says, while ik would write and compute softmax for "softmax", so the file could not be both).
"""

from __future__ import annotations

from typing import Any

from gguf import ExpertGatingFuncType, GGUFWriter

from ikconvert.archs.base import Arch, ExpertMerger, ExpertNames, OutTensor, lazy, register
from ikconvert.archs.llama import DECODER_MAP
from ikconvert.checkpoint import Checkpoint, block_id
from ikconvert.errors import ConvertError
from ikconvert.safetensors_io import SafeTensor

#: MiniMax's expert names, in ik's merge order (w1, w2, w3)
MINIMAX_EXPERTS = ExpertNames("model.layers.{bid}.block_sparse_moe.experts.{x}.{proj}.weight",
                              (("w1", "gate"), ("w2", "down"), ("w3", "up")))


def unsupported_settings(h: dict[str, Any]) -> list[tuple[str, Any]]:
    """The (key, value) pairs of a config asking for a MiniMax variant that is not computed (the module docstring)."""
    bad: list[tuple[str, Any]] = []
    if any(t != 1 for t in h.get("attn_type_list") or []):
        bad.append(("attn_type_list", h["attn_type_list"]))
    if h.get("use_qk_norm") is False:
        bad.append(("use_qk_norm", False))
    if h.get("qk_norm_type", "per_layer") != "per_layer":
        bad.append(("qk_norm_type", h["qk_norm_type"]))
    if int(h.get("shared_intermediate_size") or 0) or h.get("shared_moe_layer_indices"):
        key = "shared_intermediate_size" if int(h.get("shared_intermediate_size") or 0) else "shared_moe_layer_indices"
        bad.append((key, h[key]))
    for key in ("sliding_window", "rope_scaling"):
        if h.get(key) is not None:
            bad.append((key, h[key]))
    return bad


@register
class MiniMaxM2Arch(Arch):
    hf_architectures = ("MiniMaxM2ForCausalLM",)
    gguf_arch = "minimax-m2"
    tensor_map = {
        **{hf: gguf for hf, gguf in DECODER_MAP.items() if ".mlp." not in hf},
        "model.layers.{bid}.self_attn.q_norm": "blk.{bid}.attn_q_norm",
        "model.layers.{bid}.self_attn.k_norm": "blk.{bid}.attn_k_norm",
        "model.layers.{bid}.block_sparse_moe.gate": "blk.{bid}.ffn_gate_inp",
        "model.layers.{bid}.block_sparse_moe.e_score_correction": "blk.{bid}.exp_probs_b",
    }

    def __init__(self, ckpt: Checkpoint, options: dict[str, Any] | None = None):
        super().__init__(ckpt, options)
        config = self.ckpt.dir / "config.json"
        for key, value in unsupported_settings(self.hparams):
            raise ConvertError(f"{config}: {key} = {value!r} is not supported for MiniMaxM2ForCausalLM (only the "
                               "released MiniMax-M2 layout: full attention, no shared experts, per-layer q/k norm)")
        if self.hparams.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConvertError(f"{config}: scoring_func = {self.hparams['scoring_func']!r} is not supported for "
                               "MiniMaxM2ForCausalLM: transformers' router is sigmoid whatever it says, ik would "
                               "compute softmax")
        self._experts = ExpertMerger(int(self.require("num_local_experts")), "num_local_experts",
                                     names=MINIMAX_EXPERTS)

    def set_gguf_parameters(self, gw: GGUFWriter) -> None:
        super().set_gguf_parameters(gw)
        gw.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        gw.add_expert_feed_forward_length(self.require("intermediate_size"))
        gw.add_rope_dimension_count(self.require("rotary_dim"))

    def map_tensor(self, name: str, t: SafeTensor) -> list[OutTensor]:
        if ".block_sparse_moe.experts." in name:
            return self._experts.add(name, t)
        if name.endswith("e_score_correction_bias"):
            gguf = self.gguf_name(name.replace("e_score_correction_bias", "e_score_correction.bias"))
            return [OutTensor(gguf, t.shape, name, lazy(t), t.dtype)]
        return super().map_tensor(name, t)

    def finish(self) -> None:
        self._experts.finish()

    def check_shapes(self, out: OutTensor) -> None:
        h = self.hparams
        embd, vocab = int(self.require("hidden_size")), int(self.require("vocab_size"))
        n_head = int(self.require("num_attention_heads"))
        head = int(self.require("head_dim"))
        q, kv = n_head * head, int(h.get("num_key_value_heads") or n_head) * head
        x, ff = int(self.require("num_local_experts")), int(self.require("intermediate_size"))
        want = {
            "token_embd.weight": (vocab, embd), "output.weight": (vocab, embd), "output_norm.weight": (embd,),
            "attn_norm.weight": (embd,), "ffn_norm.weight": (embd,),
            "attn_q.weight": (q, embd), "attn_k.weight": (kv, embd), "attn_v.weight": (kv, embd),
            "attn_output.weight": (embd, q), "attn_q_norm.weight": (q,), "attn_k_norm.weight": (kv,),
            "ffn_gate_inp.weight": (x, embd), "exp_probs_b.bias": (x,),
            "ffn_gate_exps.weight": (x, ff, embd), "ffn_up_exps.weight": (x, ff, embd),
            "ffn_down_exps.weight": (x, embd, ff),
        }.get(out.name.split(".", 2)[2] if block_id(out.name) is not None else out.name)
        if want is not None and tuple(out.shape) != want:
            raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} -> {out.name} has shape {list(out.shape)} "
                               f"but config.json implies {list(want)}")
