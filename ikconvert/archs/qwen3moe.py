"""Qwen3MoeForCausalLM -> arch `qwen3moe` (ik's Qwen3MoeModel, a Qwen2MoeModel): Qwen3's attention tensors renamed,
the router `mlp.gate` as `ffn_gate_inp`, each layer's routed experts merged into 3-D `ffn_{down,gate,up}_exps`;
layers that `mlp_only_layers` / `decoder_sparse_step` make dense keep Qwen3's `ffn_{gate,up,down}`.

Beyond ik: `norm_topk_prob: false` is written as `qwen3moe.expert_weights_norm = false` (ik's converter drops the
fact and ik's graph always renormalises the top-k weights; every released Qwen3-MoE says true, and then the file is
ik's byte for byte).
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFWriter

from ikconvert.archs.base import ExpertMerger, OutTensor, register
from ikconvert.archs.llama import DECODER_MAP, DecoderArch
from ikconvert.checkpoint import Checkpoint, block_id
from ikconvert.errors import ConvertError
from ikconvert.safetensors_io import SafeTensor


def moe_layer(h: dict[str, Any], bid: int) -> bool:
    """Whether layer `bid` routes its FFN through experts, as transformers' Qwen3-MoE decides it."""
    sparse_step = int(h.get("decoder_sparse_step") or 1)
    return (bid not in (h.get("mlp_only_layers") or []) and int(h.get("num_experts") or 0) > 0
            and (bid + 1) % sparse_step == 0)


@register
class Qwen3MoeArch(DecoderArch):
    hf_architectures = ("Qwen3MoeForCausalLM",)
    gguf_arch = "qwen3moe"
    tensor_map = {
        **DECODER_MAP,
        "model.layers.{bid}.self_attn.q_norm": "blk.{bid}.attn_q_norm",
        "model.layers.{bid}.self_attn.k_norm": "blk.{bid}.attn_k_norm",
        "model.layers.{bid}.mlp.gate": "blk.{bid}.ffn_gate_inp",
    }

    def __init__(self, ckpt: Checkpoint, options: dict[str, Any] | None = None):
        super().__init__(ckpt, options)
        h = self.hparams
        if h.get("num_experts") is None and h.get("num_local_experts") is not None:
            # transformers 5 saves the expert count as num_local_experts (its attribute_map); the hub's checkpoints
            # and earlier releases as num_experts. One name from here on (the base class would add the other's
            # expert count a second time).
            self.hparams = {k: v for k, v in h.items() if k != "num_local_experts"} | {
                "num_experts": h["num_local_experts"]}
        self._experts = ExpertMerger(int(self.require("num_experts")), "num_experts")

    def set_gguf_parameters(self, gw: GGUFWriter) -> None:
        super().set_gguf_parameters(gw)
        h = self.hparams
        gw.add_expert_count(self.require("num_experts"))
        gw.add_expert_feed_forward_length(self.require("moe_intermediate_size"))
        if h.get("norm_topk_prob") is False:
            gw.add_expert_weights_norm(False)

    def map_tensor(self, name: str, t: SafeTensor) -> list[OutTensor]:
        if "mlp.experts." in name:
            return self._experts.add(name, t)
        return super().map_tensor(name, t)

    def finish(self) -> None:
        self._experts.finish()

    def check_shapes(self, out: OutTensor) -> None:
        bid = block_id(out.name)
        key = out.name.split(".", 2)[2] if bid is not None else out.name
        moe_keys = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
        dense_keys = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
        if bid is not None and key in moe_keys + dense_keys:
            moe = moe_layer(self.hparams, bid)
            if (key in moe_keys) != moe:
                kind = "MoE" if moe else "dense (mlp_only_layers / decoder_sparse_step)"
                raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} -> {out.name} does not belong in layer "
                                   f"{bid}, which config.json makes {kind}")
            if moe:
                x, ff, e = int(self.require("num_experts")), int(self.require("moe_intermediate_size")), \
                    int(self.require("hidden_size"))
                want = {"ffn_gate_inp.weight": (x, e), "ffn_gate_exps.weight": (x, ff, e),
                        "ffn_up_exps.weight": (x, ff, e), "ffn_down_exps.weight": (x, e, ff)}[key]
                if tuple(out.shape) != want:
                    raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} -> {out.name} has shape "
                                       f"{list(out.shape)} but config.json implies {list(want)}")
                return
        super().check_shapes(out)
