"""GptOssForCausalLM -> arch `gpt-oss`: the layout ik's runtime loads (ik's converter has no class for it; the
tensor names and order are mainline llama.cpp's gpt-oss converter's).

Renames, plus: `post_attention_layernorm` -> `post_attention_norm`, the per-head `self_attn.sinks` ->
`attn_sinks.weight`, the router `mlp.router` -> `ffn_gate_inp`, and the released MXFP4 experts (`*_blocks` U8
[E, rows, n/32, 16] + `*_scales` U8 E8M0 [E, rows, n/32]) repacked byte for byte into ggml MXFP4 blocks (the
E8M0 byte kept, DeepSeek-V4's repack). `gate_up_proj` rows alternate gate, up: even rows are `ffn_gate_exps`, odd
rows `ffn_up_exps`, and the same for `gate_up_proj_bias`. Everything else is written in the output type;
`general.file_type` is 38 (MOSTLY_MXFP4) as mainline writes it, whatever the output type.

Beyond the reference layout, one key of our own: `gpt-oss.rope.scaling.yarn_truncate` (bool), written when
`rope_scaling.truncate` is false. transformers then uses the fractional YaRN correction range, which ggml always
rounds to whole dimensions; ikrun's exact mode reads the key (absent: ik's rounding), ik ignores it.

Refused, naming key and value: a `layer_types` entry other than sliding_attention / full_attention, or one off
ik's fixed pattern (layers 0, 2, 4... sliding: GGUF has no key for it), a rope type other than yarn, a
`swiglu_limit` other than ik's 7; MXFP4 blocks
without their scales (or scales without blocks) name the tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from gguf import GGUFWriter, RopeScalingType

from ikconvert.archs.base import Arch, OutTensor, lazy, register
from ikconvert.archs.deepseek4 import MX_GROUP, e8m0_bytes, repack_fp4_as_mxfp4
from ikconvert.checkpoint import Checkpoint
from ikconvert.errors import ConvertError
from ikconvert.safetensors_io import SafeTensor

#: general.file_type LLAMA_FTYPE_MOSTLY_MXFP4
MOSTLY_MXFP4 = 38
#: our key: transformers' YaRN with a fractional correction range (rope_scaling.truncate false)
YARN_TRUNCATE_KEY = "{arch}.rope.scaling.yarn_truncate"
LAYER_TYPES = ("sliding_attention", "full_attention")
#: the SwiGLU clamp ik's graph (and ikrun) computes with
SWIGLU_LIMIT = 7.0

#: per block, the GGUF tensors in the order they are written (mainline's order)
BLOCK_ORDER = ("attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_q.bias", "attn_k.weight",
               "attn_k.bias", "attn_v.weight", "attn_v.bias", "attn_output.weight", "attn_output.bias",
               "attn_sinks.weight", "ffn_gate_inp.weight", "ffn_gate_inp.bias", "ffn_gate_exps.weight",
               "ffn_gate_exps.bias", "ffn_up_exps.weight", "ffn_up_exps.bias", "ffn_down_exps.weight",
               "ffn_down_exps.bias")
_EXPERTS = re.compile(r"model\.layers\.(?P<bid>\d+)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)_"
                      r"(?P<part>blocks|scales|bias)")


@register
class GptOssArch(Arch):
    hf_architectures = ("GptOssForCausalLM",)
    gguf_arch = "gpt-oss"
    writes_size_label = False  # the reference layout (mainline's converter, no ik class) has none
    tensor_map = {
        "model.embed_tokens": "token_embd",
        "lm_head": "output",
        "model.norm": "output_norm",
        "model.layers.{bid}.input_layernorm": "blk.{bid}.attn_norm",
        "model.layers.{bid}.post_attention_layernorm": "blk.{bid}.post_attention_norm",
        "model.layers.{bid}.self_attn.q_proj": "blk.{bid}.attn_q",
        "model.layers.{bid}.self_attn.k_proj": "blk.{bid}.attn_k",
        "model.layers.{bid}.self_attn.v_proj": "blk.{bid}.attn_v",
        "model.layers.{bid}.self_attn.o_proj": "blk.{bid}.attn_output",
        "model.layers.{bid}.mlp.router": "blk.{bid}.ffn_gate_inp",
    }

    def __init__(self, ckpt: Checkpoint, options: dict[str, Any] | None = None):
        super().__init__(ckpt, options)
        config = self.ckpt.dir / "config.json"
        layer_types = self.hparams.get("layer_types") or []
        for i, kind in enumerate(layer_types):
            if kind not in LAYER_TYPES:
                raise ConvertError(f"{config}: layer_types[{i}] = {kind!r} is not one of {', '.join(LAYER_TYPES)}")
            if kind != LAYER_TYPES[i % 2]:
                raise ConvertError(f"{config}: layer_types[{i}] = {kind!r}: the gpt-oss layout has no key for the "
                                   "layer pattern and ik slides layers 0, 2, 4... only")
        if float(self.hparams.get("swiglu_limit", SWIGLU_LIMIT)) != SWIGLU_LIMIT:
            raise ConvertError(f"{config}: swiglu_limit = {self.hparams['swiglu_limit']!r} is not supported for "
                               f"GptOssForCausalLM: GGUF has no key for it and ik's graph clamps at {SWIGLU_LIMIT}")
        scaling = self.rope_scaling
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "yarn":
            raise ConvertError(f"{config}: rope_scaling.rope_type = {scaling.get('rope_type', scaling.get('type'))!r}"
                               " is not supported for GptOssForCausalLM (only yarn)")
        #: GGUF name -> tensor, emitted in mainline's order once the walk is over
        self._outs: dict[str, OutTensor] = {}
        #: (bid, proj) -> {"blocks"|"scales": (HF name, tensor)}
        self._mx: dict[tuple[int, str], dict[str, tuple[str, SafeTensor]]] = {}

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        scaling = self.hparams.get("rope_scaling")
        return scaling if isinstance(scaling, dict) else None

    def set_gguf_parameters(self, gw: GGUFWriter) -> None:
        self.file_type = MOSTLY_MXFP4
        super().set_gguf_parameters(gw)
        gw.add_sliding_window(self.require("sliding_window"))
        gw.add_expert_feed_forward_length(self.require("intermediate_size"))
        scaling = self.rope_scaling
        if scaling is not None:
            gw.add_rope_scaling_type(RopeScalingType.YARN)
            gw.add_rope_scaling_factor(scaling["factor"])
            gw.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
            if scaling.get("truncate", True) is False:
                gw.add_bool(YARN_TRUNCATE_KEY.format(arch=self.gguf_arch), False)

    # ---- tensors ------------------------------------------------------------------------------------------
    def map_tensor(self, name: str, t: SafeTensor) -> list[OutTensor]:
        m = _EXPERTS.fullmatch(name)
        if m is not None:
            self._expert_part(name, t, int(m["bid"]), m["proj"], m["part"])
        elif name.endswith(".self_attn.sinks"):
            bid = name.split(".")[2]
            self._keep(OutTensor(f"blk.{bid}.attn_sinks.weight", t.shape, name, lazy(t), t.dtype))
        else:
            for out in super().map_tensor(name, t):
                self._keep(out)
        return []

    def _keep(self, out: OutTensor) -> None:
        self._outs[out.name] = out

    def _expert_part(self, name: str, t: SafeTensor, bid: int, proj: str, part: str) -> None:
        kinds = ("gate", "up") if proj == "gate_up_proj" else ("down",)
        if part == "bias":
            for i, kind in enumerate(kinds):
                self._keep(OutTensor(f"blk.{bid}.ffn_{kind}_exps.bias", (t.shape[0], t.shape[1] // len(kinds)),
                                     name, lazy(t, partial(_every_other, first=i, step=len(kinds))), t.dtype,
                                     "even rows gate, odd rows up" if len(kinds) == 2 else ""))
            return
        group = self._mx.setdefault((bid, proj), {})
        group[part] = (name, t)
        if len(group) < 2:
            return
        del self._mx[(bid, proj)]
        (bname, blocks), (sname, scales) = group["blocks"], group["scales"]
        if len(blocks.shape) != 4 or blocks.shape[3] != MX_GROUP // 2 or tuple(scales.shape) != blocks.shape[:3]:
            raise ConvertError(f"{self.ckpt.dir}: MXFP4 tensor {bname!r} {list(blocks.shape)} and its scales "
                               f"{sname!r} {list(scales.shape)} are not [E, rows, n/32, 16] and [E, rows, n/32]")
        n_exp, rows, n_blk, _ = blocks.shape
        for j, kind in enumerate(kinds):
            out_rows = rows // len(kinds)
            self._keep(OutTensor(
                f"blk.{bid}.ffn_{kind}_exps.weight", (n_exp, out_rows, n_blk * MX_GROUP), bname,
                _mxfp4_loader(blocks, scales, j, len(kinds)), blocks.dtype,
                "mxfp4 repack (e8m0 byte kept)" + (", even rows gate, odd rows up" if len(kinds) == 2 else ""),
                encoded="MXFP4"))

    def finish(self) -> None:
        for (_, _), group in sorted(self._mx.items()):
            name, _ = next(iter(group.values()))
            other = "scales" if "blocks" in group else "blocks"
            raise ConvertError(f"{self.ckpt.dir}: MXFP4 tensor {name!r} has no "
                               f"{name.rsplit('_', 1)[0]}_{other} partner")

    def trailing_tensors(self) -> list[OutTensor]:
        names = ["token_embd.weight", "output_norm.weight", "output.weight"]
        names += [f"blk.{bid}.{key}" for bid in range(self.block_count) for key in BLOCK_ORDER]
        missing = [n for n in names if n not in self._outs]
        if missing:
            raise ConvertError(f"{self.ckpt.dir}: the checkpoint lacks {len(missing)} tensor(s) the gpt-oss layout "
                               f"needs, first {missing[0]}")
        extra = sorted(set(self._outs) - set(names))
        if extra:
            out = self._outs[extra[0]]
            raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} -> {out.name} is not part of the gpt-oss "
                               f"layout (num_hidden_layers = {self.block_count})")
        return [self._outs[n] for n in names]

    def check_shapes(self, out: OutTensor) -> None:
        h = self.hparams
        embd, vocab = int(self.require("hidden_size")), int(self.require("vocab_size"))
        n_head, head = int(self.require("num_attention_heads")), int(self.require("head_dim"))
        q, kv = n_head * head, int(h.get("num_key_value_heads") or n_head) * head
        x, ff = int(self.require("num_local_experts")), int(self.require("intermediate_size"))
        want = {
            "token_embd.weight": (vocab, embd), "output.weight": (vocab, embd), "output_norm.weight": (embd,),
            "attn_norm.weight": (embd,), "post_attention_norm.weight": (embd,),
            "attn_q.weight": (q, embd), "attn_k.weight": (kv, embd), "attn_v.weight": (kv, embd),
            "attn_output.weight": (embd, q), "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
            "attn_output.bias": (embd,), "attn_sinks.weight": (n_head,),
            "ffn_gate_inp.weight": (x, embd), "ffn_gate_inp.bias": (x,),
            "ffn_gate_exps.weight": (x, ff, embd), "ffn_up_exps.weight": (x, ff, embd),
            "ffn_down_exps.weight": (x, embd, ff), "ffn_gate_exps.bias": (x, ff), "ffn_up_exps.bias": (x, ff),
            "ffn_down_exps.bias": (x, embd),
        }.get(out.name.split(".", 2)[2] if out.name.startswith("blk.") else out.name)
        if want is not None and tuple(out.shape) != want:
            raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} -> {out.name} has shape {list(out.shape)} "
                               f"but config.json implies {list(want)}")


def _every_other(b: np.ndarray, first: int, step: int) -> np.ndarray:
    """Columns first, first+step, ... of every expert's bias row (gate_up_proj_bias alternates gate, up)."""
    return np.ascontiguousarray(b[:, first::step])


def _mxfp4_loader(blocks: SafeTensor, scales: SafeTensor, first: int, step: int) -> Callable[[], np.ndarray]:
    """Rows first, first+step, ... of every expert as ggml MXFP4 rows, read when written."""

    def load() -> np.ndarray:
        codes = blocks.raw().view(np.uint8)
        n_exp, rows, n_blk, half = blocks.shape
        codes = codes.reshape(n_exp, rows, n_blk * half)[:, first::step]
        scale = e8m0_bytes(scales).reshape(n_exp, rows, n_blk)[:, first::step]
        return np.stack([repack_fp4_as_mxfp4(np.ascontiguousarray(c), np.ascontiguousarray(s))
                         for c, s in zip(codes, scale)])

    return load
