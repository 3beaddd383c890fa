"""Gated DeltaNet hybrids: Qwen3NextForCausalLM -> arch `qwen3next`, Qwen3.5 MoE -> `qwen35moe`, dense Qwen3.5 ->
`qwen35`. ik's converter has no class for any of them (its users convert with mainline llama.cpp and ik's runtime
loads the result); the layout written is mainline's (`Qwen3NextModel`, `Qwen3_5TextModel`, `Qwen3_5MoeTextModel`).

Transforms, as mainline writes them:
- every `*norm.weight` except the delta-net's gated `linear_attn.norm` gets +1 (HF stores zero-centred gains);
- `A_log` -> `ssm_a` = -exp(A_log) (computed in float64, rounded once to float32), `dt_bias` -> `ssm_dt.bias`,
  `conv1d.weight` [C, 1, K] -> `ssm_conv1d` ne {K, C}, `shared_expert_gate` [1, H] -> `ffn_gate_inp_shexp` ne
  {H, 1} (not squeezed);
- Qwen3-Next: `in_proj_qkvz` (per key head: q, k, v x r, z x r rows) split into `attn_qkv` = [all q | all k | all
  v] and `attn_gate` = [all z], value heads left grouped by key head; `in_proj_ba` -> `ssm_ba` as stored;
- Qwen3.5: `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a` -> `attn_qkv` / `attn_gate` / `ssm_beta` /
  `ssm_alpha`; with fewer key than value heads, every value-head axis (v rows of `attn_qkv` and of `ssm_conv1d`, rows
  of `attn_gate`, `ssm_beta`, `ssm_alpha`, `ssm_a`, `ssm_dt`, columns of `ssm_out`) goes from grouped to tiled order
  (ik broadcasts the key heads with `head % n_k` for these arches, `head / r` for qwen3next: each order only works
  with its own arch); experts either per expert (merged) or fused (`gate_up_proj` [E, 2F, H] split in halves).
Tensors are written in the reference layout's order (token_embd, each block's norms, mixer, FFN, then the output).
Vision towers (`model.visual.*`) and MTP layers (`mtp.*`) are skipped and listed by --dry-run; a multimodal
checkpoint's `model.language_model.` prefix and `text_config` are read as the text model's.

ik's qwen3next ignores `full_attention_interval` (every 4th layer is full attention in its loader): another interval
is converted (the file says it; ikrun computes it) with a warning that ik will not load the file; so is a Qwen3.5
value head size other than the key head size (ik's qwen35 / qwen35moe loaders take it from ssm.state_size), and
head sizes other than 64 and 128 (ik loads the file but its generic delta-net path computes something else).
Refused before any tensor is read, naming the key: rope scaling (the layout has plain rope), `layer_types` that no
interval describes (GGUF has no key for another pattern), value heads that are not a multiple of the key heads;
tensors whose shapes disagree with the heads (a conv kernel or channel count, a state size) name the tensor and the
config keys.
"""

from __future__ import annotations

import logging
import re
from functools import partial
from typing import Any, ClassVar

import numpy as np
from gguf import GGUFWriter

from ikconvert.archs.base import Arch, ExpertMerger, OutTensor, lazy, register
from ikconvert.archs.llama import DECODER_MAP
from ikconvert.checkpoint import Checkpoint, block_id
from ikconvert.errors import ConvertError
from ikconvert.safetensors_io import SafeTensor

log = logging.getLogger(__name__)

#: the interval ik's qwen3next loader assumes whatever the file says
IK_QWEN3NEXT_INTERVAL = 4
#: the delta-net head sizes ik's fused kernels compute right (its generic fallback does not)
IK_DELTA_NET_HEAD_SIZES = (64, 128)
LAYER_TYPES = ("linear_attention", "full_attention")
#: per block, the GGUF tensors in the reference layout's order; `{exps}` stands for the routed experts
BLOCK_ORDER = ("attn_norm.weight", "post_attention_norm.weight",
               "attn_qkv.weight", "attn_gate.weight", "ssm_ba.weight", "ssm_beta.weight", "ssm_alpha.weight",
               "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight", "ssm_out.weight",
               "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight",
               "attn_k_norm.weight",
               "ffn_gate_inp.weight", "{exps}", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
               "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight", "ffn_gate.weight", "ffn_up.weight",
               "ffn_down.weight")
#: routed experts as mainline emits them: merged per expert (Qwen2MoeModel's down, gate, up) or split from fused
MERGED_EXPS = ("ffn_down_exps.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight")
FUSED_EXPS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
#: the delta-net's parameters stored without a .weight / .bias suffix, and their GGUF names
_RAW_PARAMS = re.compile(r"model\.layers\.(?P<bid>\d+)\.linear_attn\.(?P<param>dt_bias|A_log)")
RAW_PARAM_NAMES = {"dt_bias": "ssm_dt.bias", "A_log": "ssm_a"}
_FUSED = re.compile(r"model\.layers\.(?P<bid>\d+)\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)")

MAP = {
    **DECODER_MAP,
    "model.layers.{bid}.post_attention_layernorm": "blk.{bid}.post_attention_norm",
    "model.layers.{bid}.self_attn.q_norm": "blk.{bid}.attn_q_norm",
    "model.layers.{bid}.self_attn.k_norm": "blk.{bid}.attn_k_norm",
    "model.layers.{bid}.linear_attn.conv1d": "blk.{bid}.ssm_conv1d",
    "model.layers.{bid}.linear_attn.norm": "blk.{bid}.ssm_norm",
    "model.layers.{bid}.linear_attn.out_proj": "blk.{bid}.ssm_out",
    "model.layers.{bid}.linear_attn.in_proj_ba": "blk.{bid}.ssm_ba",
    "model.layers.{bid}.linear_attn.in_proj_qkv": "blk.{bid}.attn_qkv",
    "model.layers.{bid}.linear_attn.in_proj_z": "blk.{bid}.attn_gate",
    "model.layers.{bid}.linear_attn.in_proj_b": "blk.{bid}.ssm_beta",
    "model.layers.{bid}.linear_attn.in_proj_a": "blk.{bid}.ssm_alpha",
    "model.layers.{bid}.mlp.gate": "blk.{bid}.ffn_gate_inp",
    "model.layers.{bid}.mlp.shared_expert.gate_proj": "blk.{bid}.ffn_gate_shexp",
    "model.layers.{bid}.mlp.shared_expert.up_proj": "blk.{bid}.ffn_up_shexp",
    "model.layers.{bid}.mlp.shared_expert.down_proj": "blk.{bid}.ffn_down_shexp",
    "model.layers.{bid}.mlp.shared_expert_gate": "blk.{bid}.ffn_gate_inp_shexp",
}


def grouped_to_tiled(w: np.ndarray, axis: int, n_k: int, head: int) -> np.ndarray:
    """Value heads along `axis` (n_k groups of r heads of `head` rows) reordered from grouped
    [G0v0..G0v(r-1), G1v0..] to tiled [G0v0, G1v0, .., G0v1, ..] order (mainline's _reorder_v_heads)."""
    w = np.moveaxis(w, axis, 0)
    shape = w.shape
    w = w.reshape(n_k, shape[0] // (n_k * head), head, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(w, 0, axis))


def _middle_rows(w: np.ndarray, rows: slice) -> np.ndarray:
    """Rows `rows` of every expert of a stacked [E, rows, cols] tensor."""
    return np.ascontiguousarray(w[:, rows])


def full_attention_layers(h: dict[str, Any], n_layer: int, config: str) -> list[bool]:
    """Which layers are full attention: `layer_types` when given (it must be a fixed interval: the only pattern
    GGUF can say), else every `full_attention_interval`-th."""
    interval = int(h.get("full_attention_interval") or IK_QWEN3NEXT_INTERVAL)
    pattern = [(i + 1) % interval == 0 for i in range(n_layer)]
    types = h.get("layer_types")
    if types is None:
        return pattern
    for i, kind in enumerate(types):
        if kind not in LAYER_TYPES:
            raise ConvertError(f"{config}: layer_types[{i}] = {kind!r} is not one of {', '.join(LAYER_TYPES)}")
    if len(types) != n_layer or [t == "full_attention" for t in types] != pattern:
        raise ConvertError(f"{config}: layer_types {types} is not every full_attention_interval = {interval}-th "
                           "layer full attention, the only layer pattern the GGUF layout can say")
    return pattern


class GatedDeltaNetArch(Arch):
    """What the three hybrids share: config reading, keys in mainline's order, the reference tensor order and
    shape checks; subclasses say how the delta-net's input projections are stored."""

    writes_size_label = False  # the reference layout (mainline's converter, no ik class) has none
    tensor_map = MAP
    skipped = (*Arch.skipped, r"model\.visual\..*", r"mtp\..*", r"model\.mtp\..*")
    #: mainline's V-head reorder (Qwen3.5); qwen3next files keep HF's grouped order
    tiled_v_heads: ClassVar[bool] = False
    #: whether the delta-net's input projection is one fused qkvz tensor (Qwen3-Next)
    fused_qkvz: ClassVar[bool] = False
    #: rope.dimension_sections written when the config has no mrope_section (mainline's Qwen3.5 default: ik's
    #: qwen35 / qwen35moe loaders require the key)
    default_mrope_section: ClassVar[tuple[int, ...] | None] = None

    def __init__(self, ckpt: Checkpoint, options: dict[str, Any] | None = None):
        super().__init__(ckpt, options)
        text = self.hparams.get("text_config")
        if isinstance(text, dict):
            self.hparams = {**self.hparams, **text}
        self.config_path = ckpt.dir / "config.json"
        h = self.hparams
        self.n_k, self.n_v = int(self.require("linear_num_key_heads")), int(self.require("linear_num_value_heads"))
        if self.n_v % self.n_k:
            raise ConvertError(f"{self.config_path}: linear_num_value_heads = {self.n_v} is not a multiple of "
                               f"linear_num_key_heads = {self.n_k}")
        self.d_k, self.d_v = int(self.require("linear_key_head_dim")), int(self.require("linear_value_head_dim"))
        self.full = full_attention_layers(h, self.block_count, str(self.config_path))
        scaling, rope_type = h.get("rope_scaling"), self.rope_parameters.get("rope_type", "default")
        if scaling is not None or rope_type != "default":
            key, value = ("rope_scaling", scaling) if scaling is not None else ("rope_parameters.rope_type", rope_type)
            raise ConvertError(f"{self.config_path}: {key} = {value!r} is not supported for {self.hf_architectures[0]}"
                               " (the layout has plain rope only, as every released model)")
        self.n_expert = int(h.get("num_experts") or 0)
        self._experts = ExpertMerger(self.n_expert, "num_experts") if self.n_expert else None
        #: GGUF name -> tensor, emitted in the reference order once the walk is over
        self._outs: dict[str, OutTensor] = {}
        self._exps_order: dict[int, tuple[str, ...]] = {}

    # ---- config -------------------------------------------------------------------------------------------
    @property
    def rope_parameters(self) -> dict[str, Any]:
        """transformers 5's `rope_parameters`, else the older top-level keys."""
        params = self.hparams.get("rope_parameters")
        return params if isinstance(params, dict) else self.hparams

    def set_gguf_parameters(self, gw: GGUFWriter) -> None:
        """mainline's TextModel keys, then Qwen2MoeModel's and Qwen3NextModel's, in its order."""
        h, rope = self.hparams, self.rope_parameters
        gw.add_block_count(self.block_count)
        if (n_ctx := h.get("max_position_embeddings")) is not None:
            gw.add_context_length(n_ctx)
        gw.add_embedding_length(self.require("hidden_size"))
        if (n_ff := h.get("intermediate_size")) is not None:
            gw.add_feed_forward_length(n_ff)
        gw.add_head_count(self.require("num_attention_heads"))
        if (n_kv := h.get("num_key_value_heads")) is not None:
            gw.add_head_count_kv(n_kv)
        if (sections := rope.get("mrope_section")) is not None:
            gw.add_rope_dimension_sections([int(s) for s in sections] + [0] * (4 - len(sections)))
        if (theta := rope.get("rope_theta")) is not None:
            gw.add_rope_freq_base(theta)
        gw.add_layer_norm_rms_eps(self.require("rms_norm_eps"))
        if self.n_expert:
            gw.add_expert_count(self.n_expert)
        if (n_used := h.get("num_experts_per_tok")) is not None and self.n_expert:
            gw.add_expert_used_count(n_used)
        if (head_dim := h.get("head_dim")) is not None:
            gw.add_key_length(head_dim)
            gw.add_value_length(head_dim)
        gw.add_file_type(self.file_type)
        if (ff_exp := h.get("moe_intermediate_size")) is not None and self.n_expert:
            gw.add_expert_feed_forward_length(ff_exp)
        if (ff_sh := h.get("shared_expert_intermediate_size")) is not None and self.n_expert:
            gw.add_expert_shared_feed_forward_length(ff_sh)
        gw.add_ssm_conv_kernel(self.require("linear_conv_kernel_dim"))
        gw.add_ssm_state_size(self.d_k)
        gw.add_ssm_group_count(self.n_k)
        gw.add_ssm_time_step_rank(self.n_v)
        gw.add_ssm_inner_size(self.d_v * self.n_v)
        gw.add_full_attention_interval(int(h.get("full_attention_interval") or IK_QWEN3NEXT_INTERVAL))
        head_dim = int(h.get("head_dim") or int(self.require("hidden_size")) // int(self.require("num_attention_heads")))
        gw.add_rope_dimension_count(int(head_dim * float(rope.get("partial_rotary_factor", 0.25))))
        if rope.get("mrope_section") is None and self.default_mrope_section is not None:
            gw.add_rope_dimension_sections(list(self.default_mrope_section))

    # ---- tensors ------------------------------------------------------------------------------------------
    def map_tensor(self, name: str, t: SafeTensor) -> list[OutTensor]:
        name = name.replace("model.language_model.", "model.", 1)
        fused = _FUSED.fullmatch(name)
        if fused is not None:
            self._fused_experts(name, t, int(fused["bid"]), fused["proj"])
        elif ".mlp.experts." in name:
            if self._experts is None:
                raise ConvertError(f"{self.config_path}: tensor {name!r} is a routed expert but num_experts is not "
                                   "set")
            for out in self._experts.add(name, t):
                self._exps_order[int(out.name.split(".")[1])] = MERGED_EXPS
                self._keep(out)
        else:
            for out in self._mapped(name, t):
                self._keep(out)
        return []

    def _keep(self, out: OutTensor) -> None:
        self._outs[out.name] = out

    def _mapped(self, name: str, t: SafeTensor) -> list[OutTensor]:
        """One HF tensor (experts aside) as its GGUF tensors, transformed."""
        if name.endswith(".linear_attn.in_proj_qkvz.weight"):
            return self._split_qkvz(name, t)
        raw = _RAW_PARAMS.fullmatch(name)
        if raw is not None and int(raw["bid"]) < self.block_count:
            gname = f"blk.{raw['bid']}.{RAW_PARAM_NAMES[raw['param']]}"
        else:
            gname = self.gguf_name(name)
        shape, fn, note = tuple(t.shape), None, ""
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            fn, note = (lambda w: w + np.float32(1)), "+1 (zero-centred gain)"
        elif name.endswith(".A_log"):
            fn, note = (lambda w: (-np.exp(w.astype(np.float64))).astype(np.float32)), "-exp(A_log)"
        elif ".conv1d." in name:
            shape = tuple(d for d in t.shape if d != 1) if len(t.shape) == 3 else shape
            fn, note = (lambda w: w.reshape(shape)), f"squeezed from {list(t.shape)}"
        out = OutTensor(gname, shape, name, lazy(t, fn), t.dtype, note)
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            out.squeeze = False
        if self.tiled_v_heads and self.n_k != self.n_v:
            self._reorder_v_heads(out)
        return [out]

    def _reorder_v_heads(self, out: OutTensor) -> None:
        """mainline's grouped -> tiled value-head order on a Qwen3.5 delta-net tensor (in place on `out`)."""
        key = out.name.split(".", 2)[-1]
        n_k, kd = self.n_k, self.n_k * self.d_k
        if key in ("attn_qkv.weight", "ssm_conv1d.weight"):
            def fn(w: np.ndarray) -> np.ndarray:
                return np.concatenate([w[:2 * kd], grouped_to_tiled(w[2 * kd:], 0, n_k, self.d_v)])
        elif key == "attn_gate.weight":
            def fn(w: np.ndarray) -> np.ndarray:
                return grouped_to_tiled(w, 0, n_k, self.d_v)
        elif key in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
            def fn(w: np.ndarray) -> np.ndarray:
                return grouped_to_tiled(w, 0, n_k, 1)
        elif key == "ssm_out.weight":
            def fn(w: np.ndarray) -> np.ndarray:
                return grouped_to_tiled(w, 1, n_k, self.d_v)
        else:
            return
        load = out.load
        out.load = lambda: fn(load())
        out.transform = ", ".join(filter(None, [out.transform, "V heads grouped -> tiled"]))

    def _split_qkvz(self, name: str, t: SafeTensor) -> list[OutTensor]:
        """Qwen3-Next's per-key-head [q, k, v x r, z x r] rows as [all q | all k | all v] and [all z]."""
        if not self.fused_qkvz:
            raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} has no mapping for {self.gguf_arch} (it stores "
                               "in_proj_qkv / in_proj_z)")
        n_k, d_k, r_dv = self.n_k, self.d_k, self.n_v // self.n_k * self.d_v
        per_head = 2 * d_k + 2 * r_dv
        if len(t.shape) != 2 or t.shape[0] != n_k * per_head:
            raise ConvertError(
                f"{self.ckpt.dir}: tensor {name!r} has shape {list(t.shape)} but config.json implies "
                f"[{n_k * per_head}, {t.shape[-1]}] (linear_num_key_heads x (2 linear_key_head_dim + 2 "
                "linear_num_value_heads / linear_num_key_heads x linear_value_head_dim))")
        n_embd = t.shape[1]

        def heads() -> np.ndarray:
            return t.to_f32().reshape(n_k, per_head, n_embd)

        def qkv() -> np.ndarray:
            w = heads()
            return np.concatenate([w[:, :d_k].reshape(-1, n_embd), w[:, d_k:2 * d_k].reshape(-1, n_embd),
                                   w[:, 2 * d_k:2 * d_k + r_dv].reshape(-1, n_embd)])

        def z() -> np.ndarray:
            return np.ascontiguousarray(heads()[:, 2 * d_k + r_dv:].reshape(-1, n_embd))

        bid = block_id(self.gguf_name(name.replace("in_proj_qkvz", "in_proj_qkv")))
        note = "qkvz split per key head"
        return [OutTensor(f"blk.{bid}.attn_qkv.weight", (n_k * (2 * d_k + r_dv), n_embd), name, qkv, t.dtype, note),
                OutTensor(f"blk.{bid}.attn_gate.weight", (n_k * r_dv, n_embd), name, z, t.dtype, note)]

    def _fused_experts(self, name: str, t: SafeTensor, bid: int, proj: str) -> None:
        """transformers 5's fused experts: gate_up_proj [E, 2F, H] halves (gate first), down_proj [E, H, F]."""
        if bid >= self.block_count:
            raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} is beyond num_hidden_layers = {self.block_count}")
        self._exps_order[bid] = FUSED_EXPS
        if proj == "down_proj":
            self._keep(OutTensor(f"blk.{bid}.ffn_down_exps.weight", tuple(t.shape), name, lazy(t), t.dtype))
            return
        if len(t.shape) != 3 or t.shape[1] % 2:
            raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} has shape {list(t.shape)}, not [experts, 2 x "
                               "moe_intermediate_size, hidden_size]")
        n_exp, ff2, n_embd = t.shape
        for i, kind in enumerate(("gate", "up")):
            half = slice(i * (ff2 // 2), (i + 1) * (ff2 // 2))
            self._keep(OutTensor(f"blk.{bid}.ffn_{kind}_exps.weight", (n_exp, ff2 // 2, n_embd), name,
                                 lazy(t, partial(_middle_rows, rows=half)), t.dtype,
                                 f"{'first' if i == 0 else 'second'} half of gate_up_proj"))

    def finish(self) -> None:
        if self._experts is not None:
            self._experts.finish()
        interval = int(self.hparams.get("full_attention_interval") or IK_QWEN3NEXT_INTERVAL)
        if self.gguf_arch == "qwen3next" and interval != IK_QWEN3NEXT_INTERVAL:
            log.warning("%s: full_attention_interval = %d: ik's qwen3next loader assumes %d whatever the file says "
                        "and will not load this file (ikrun computes it)", self.config_path, interval,
                        IK_QWEN3NEXT_INTERVAL)
        if not {self.d_k, self.d_v} <= set(IK_DELTA_NET_HEAD_SIZES):
            log.warning("%s: linear_key_head_dim = %d, linear_value_head_dim = %d: ik's fused delta-net kernels "
                        "cover head sizes %s only; ik runs this file through its generic path, which computes "
                        "something else (ikrun computes it)", self.config_path, self.d_k, self.d_v,
                        " and ".join(map(str, IK_DELTA_NET_HEAD_SIZES)))
        if self.tiled_v_heads and self.d_v != self.d_k:
            log.warning("%s: linear_value_head_dim = %d differs from linear_key_head_dim = %d: ik's %s loader takes "
                        "the value head size from ssm.state_size and will not load this file (ikrun computes it)",
                        self.config_path, self.d_v, self.d_k, self.gguf_arch)

    def trailing_tensors(self) -> list[OutTensor]:
        names = ["token_embd.weight"]
        for bid in range(self.block_count):
            for key in BLOCK_ORDER:
                keys = self._exps_order.get(bid, ()) if key == "{exps}" else (key,)
                names += [f"blk.{bid}.{k}" for k in keys if f"blk.{bid}.{k}" in self._outs]
        names += [n for n in ("output_norm.weight", "output.weight") if n in self._outs]
        extra = sorted(set(self._outs) - set(names))
        if extra:
            out = self._outs[extra[0]]
            raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} -> {out.name} is not part of the "
                               f"{self.gguf_arch} layout")
        missing = [n for n in self._required() if n not in self._outs]
        if missing:
            raise ConvertError(f"{self.ckpt.dir}: the checkpoint lacks {len(missing)} tensor(s) the {self.gguf_arch} "
                               f"layout needs, first {missing[0]}")
        return [self._outs[n] for n in names]

    def _required(self) -> list[str]:
        """The tensors each block needs for its layer type (config.json) and FFN kind (what the walk found)."""
        names = ["token_embd.weight", "output_norm.weight"]
        ssm_in = ("ssm_ba.weight",) if self.fused_qkvz else ("ssm_beta.weight", "ssm_alpha.weight")
        for bid, full in enumerate(self.full):
            keys: tuple[str, ...] = ("attn_norm.weight", "post_attention_norm.weight")
            if full:
                keys += ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                         "attn_q_norm.weight", "attn_k_norm.weight")
            else:
                keys += ("attn_qkv.weight", "attn_gate.weight", *ssm_in, "ssm_conv1d.weight", "ssm_dt.bias",
                         "ssm_a", "ssm_norm.weight", "ssm_out.weight")
            if f"blk.{bid}.ffn_gate_inp.weight" in self._outs:
                keys += FUSED_EXPS
            else:
                keys += ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
            names += [f"blk.{bid}.{k}" for k in keys]
        return names

    def check_shapes(self, out: OutTensor) -> None:
        h = self.hparams
        e, vocab = int(self.require("hidden_size")), int(h.get("vocab_size") or 0)
        n_head, n_kv = int(self.require("num_attention_heads")), int(h.get("num_key_value_heads") or 0)
        hd = int(h.get("head_dim") or e // n_head)
        kd, vd = self.n_k * self.d_k, self.n_v * self.d_v
        x, ff_x, ff_s = self.n_expert, int(h.get("moe_intermediate_size") or 0), \
            int(h.get("shared_expert_intermediate_size") or 0)
        ff = int(h.get("intermediate_size") or 0)
        heads = "linear_num_key_heads x linear_key_head_dim, linear_num_value_heads x linear_value_head_dim"
        conv = (2 * kd + vd, int(self.require("linear_conv_kernel_dim")))
        want: dict[str, tuple[tuple[int, ...], str]] = {
            "token_embd.weight": ((vocab, e), "vocab_size, hidden_size"),
            "output.weight": ((vocab, e), "vocab_size, hidden_size"),
            "attn_qkv.weight": ((2 * kd + vd, e), heads),
            "attn_gate.weight": ((vd, e), heads),
            "ssm_ba.weight": ((2 * self.n_v, e), "linear_num_value_heads"),
            "ssm_beta.weight": ((self.n_v, e), "linear_num_value_heads"),
            "ssm_alpha.weight": ((self.n_v, e), "linear_num_value_heads"),
            "ssm_conv1d.weight": (conv, heads + ", linear_conv_kernel_dim"),
            "ssm_dt.bias": ((self.n_v,), "linear_num_value_heads"),
            "ssm_a": ((self.n_v,), "linear_num_value_heads"),
            "ssm_norm.weight": ((self.d_v,), "linear_value_head_dim"),
            "ssm_out.weight": ((e, vd), heads),
            "attn_q.weight": ((2 * n_head * hd, e), "num_attention_heads x head_dim x 2 (output gate)"),
            "attn_k.weight": ((n_kv * hd, e), "num_key_value_heads x head_dim"),
            "attn_v.weight": ((n_kv * hd, e), "num_key_value_heads x head_dim"),
            "attn_output.weight": ((e, n_head * hd), "num_attention_heads x head_dim"),
            "attn_q_norm.weight": ((hd,), "head_dim"),
            "attn_k_norm.weight": ((hd,), "head_dim"),
            "ffn_gate_inp.weight": ((x, e), "num_experts"),
            "ffn_gate_exps.weight": ((x, ff_x, e), "num_experts, moe_intermediate_size"),
            "ffn_up_exps.weight": ((x, ff_x, e), "num_experts, moe_intermediate_size"),
            "ffn_down_exps.weight": ((x, e, ff_x), "num_experts, moe_intermediate_size"),
            "ffn_gate_shexp.weight": ((ff_s, e), "shared_expert_intermediate_size"),
            "ffn_up_shexp.weight": ((ff_s, e), "shared_expert_intermediate_size"),
            "ffn_down_shexp.weight": ((e, ff_s), "shared_expert_intermediate_size"),
            "ffn_gate_inp_shexp.weight": ((1, e), "hidden_size"),
            "ffn_gate.weight": ((ff, e), "intermediate_size"),
            "ffn_up.weight": ((ff, e), "intermediate_size"),
            "ffn_down.weight": ((e, ff), "intermediate_size"),
        }
        key = out.name.split(".", 2)[2] if out.name.startswith("blk.") else out.name
        shape: tuple[int, ...]
        if key.endswith("norm.weight") and key not in want:
            shape, keys = (e,), "hidden_size"
        elif key in want:
            shape, keys = want[key]
        else:
            return
        if not vocab and key in ("token_embd.weight", "output.weight"):
            return
        if tuple(out.shape) != shape:
            raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} -> {out.name} has shape {list(out.shape)} "
                               f"but config.json implies {list(shape)} ({keys})")
        bid = block_id(out.name)
        linear = key.startswith(("attn_qkv.", "attn_gate.", "ssm_"))
        full = key.startswith(("attn_q.", "attn_k.", "attn_v.", "attn_output.", "attn_q_norm.", "attn_k_norm."))
        if bid is not None and (linear or full) and full != self.full[bid]:
            kind = "full attention" if self.full[bid] else "linear attention"
            raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} -> {out.name} does not belong in layer "
                               f"{bid}, which config.json (full_attention_interval / layer_types) makes {kind}")


@register
class Qwen3NextArch(GatedDeltaNetArch):
    hf_architectures = ("Qwen3NextForCausalLM",)
    gguf_arch = "qwen3next"
    fused_qkvz = True


@register
class Qwen35MoeArch(GatedDeltaNetArch):
    hf_architectures = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
    gguf_arch = "qwen35moe"
    tiled_v_heads = True
    default_mrope_section = (11, 11, 10, 0)


@register
class Qwen35Arch(GatedDeltaNetArch):
    hf_architectures = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
    gguf_arch = "qwen35"
    tiled_v_heads = True
    default_mrope_section = (11, 11, 10, 0)
