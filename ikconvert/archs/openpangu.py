"""OpenPanguV2ForCausalLM (openPangu-2.0) -> arch `openpangu`, as ik's OpenPanguV2Model writes it.

openPangu is DeepSeek-style MLA + MoE plus four things of its own: mHC hyper-connections (several residual
streams mixed per sub-layer, and a global merge module), MoME causal convolutions on the attention latents, learned
"param sink" keys/values, and a DSA indexer on the windowless layers. The conversion differs from DeepSeek-V3's:
NextN layers are kept as ordinary blocks after the base layers, kv_b is split per head into k_b/v_b using
`num_attention_heads` with no fused copy, the router bias sits at mlp level, and several tensors have no `.weight`
suffix (so ik keeps them F32 and writes them without one). ik's squeeze turns the convs' [C,1,3] into {3,C} (rows
of 3 that Q8_0 cannot hold: F16) and the merge module's [1] alpha into a 0-d tensor; the pipeline does both.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from gguf import ExpertGatingFuncType, GGUFWriter

from ikconvert.archs.base import Arch, OutTensor, lazy, register
from ikconvert.checkpoint import Checkpoint
from ikconvert.errors import ConvertError
from ikconvert.safetensors_io import SafeTensor

_L = "model.layers.{bid}."
_B = "blk.{bid}."

_MAP = {
    "model.embed_tokens": "token_embd",
    "lm_head": "output",
    "model.norm": "output_norm",
    "model.merge_mhc_module.phi": "merge_mhc_phi",
    "model.merge_mhc_module.branch_alpha_pre": "merge_mhc_alpha",
    "model.merge_mhc_module.branch_beta_pre": "merge_mhc_beta",
    "model.merge_mhc_module.norm_gamma": "merge_mhc_gamma",
    **{_L + hf: _B + gg for hf, gg in {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_mlp_layernorm": "ffn_norm",
        "post_mlp_layernorm": "post_ffw_norm",
        "block_post_layernorm": "block_post_norm",
        "self_attn.q_a_proj": "attn_q_a",
        "self_attn.q_a_layernorm": "attn_q_a_norm",
        "self_attn.q_b_proj": "attn_q_b",
        "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm",
        "self_attn.o_proj": "attn_output",
        "self_attn.qa_conv": "attn_qa_conv",
        "self_attn.compresskv_conv": "attn_compresskv_conv",
        "self_attn.o_conv": "attn_o_conv",
        "self_attn.param_sink_compressed_kv": "attn_param_sink_kv",
        "self_attn.param_sink_k_pe": "attn_param_sink_k_pe",
        "self_attn.indexer.k_norm": "attn_indexer_k_norm",
        "self_attn.indexer.weights_proj": "attn_indexer_weights_proj",
        "self_attn.indexer.wk": "attn_indexer_k",
        "self_attn.indexer.wq_b": "attn_indexer_q_b",
        "attn_mhc_module.phi": "attn_mhc_phi",
        "attn_mhc_module.branch_alpha": "attn_mhc_alpha",
        "attn_mhc_module.branch_beta": "attn_mhc_beta",
        "attn_mhc_module.norm_gamma": "attn_mhc_gamma",
        "mlp_mhc_module.phi": "mlp_mhc_phi",
        "mlp_mhc_module.branch_alpha": "mlp_mhc_alpha",
        "mlp_mhc_module.branch_beta": "mlp_mhc_beta",
        "mlp_mhc_module.norm_gamma": "mlp_mhc_gamma",
        "mlp.gate": "ffn_gate_inp",
        # ik renames `mlp.e_score_correction_bias` to this before mapping (the DeepSeek spelling under
        # `mlp.gate.` is not in openPangu's table)
        "mlp.e_score_correction": "exp_probs_b",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
        "mlp.experts.gate_proj": "ffn_gate_exps",
        "mlp.experts.up_proj": "ffn_up_exps",
        "mlp.experts.down_proj": "ffn_down_exps",
        "self_attn.k_b_proj": "attn_k_b",
        "self_attn.v_b_proj": "attn_v_b",
        "eh_proj": "nextn.eh_proj",
        "enorm": "nextn.enorm",
        "hnorm": "nextn.hnorm",
        "embed_tokens": "nextn.embed_tokens",
        "shared_head.head": "nextn.shared_head_head",
        "shared_head.norm": "nextn.shared_head_norm",
    }.items()},
}

_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(down_proj|gate_proj|up_proj)\.weight")
_EXPERT_KINDS = ("down_proj", "gate_proj", "up_proj")  # ik's emission order
_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "first_k_dense_replace", "vocab_size",
             "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
             "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
             "routed_scaling_factor", "norm_topk_prob", "rope_theta", "index_n_heads", "index_head_dim",
             "index_topk", "mhc_num_stream", "mhc_recur_norm", "param_sink_number", "swa_layers")
_CONV_KERNEL = 3  # ik's runtime convolves over 3 positions


@register
class OpenPanguArch(Arch):
    hf_architectures = ("OpenPanguV2ForCausalLM",)
    gguf_arch = "openpangu"
    tensor_map = _MAP

    def __init__(self, ckpt: Checkpoint, options: dict[str, Any] | None = None):
        super().__init__(ckpt, options)
        for key in _REQUIRED:
            if self.hparams.get(key) is None:
                raise ConvertError(f"{ckpt.dir / 'config.json'}: {key!r} is required for OpenPanguV2ForCausalLM")
        self.n_nextn = int(self.hparams.get("num_nextn_predict_layers") or 0)
        self.n_experts = int(self.hparams["n_routed_experts"])
        #: per block: expert tensors seen but not yet merged (HF name -> tensor)
        self._experts: dict[int, dict[str, SafeTensor]] = {}
        self._shapes = self._expected_shapes()

    @property
    def block_count(self) -> int:
        """Base layers plus NextN layers: ik keeps the NextN layers as blocks L..L+n-1."""
        return int(self.hparams["num_hidden_layers"]) + self.n_nextn

    # ---- metadata -----------------------------------------------------------------------------------------
    def set_gguf_parameters(self, gw: GGUFWriter) -> None:
        """ik's Model keys (not DeepSeek-V2's) then openPangu's, in ik's order; a repeated key keeps its position."""
        with _overwrites_expected():
            self._set_keys(gw)

    def _set_keys(self, gw: GGUFWriter) -> None:
        super().set_gguf_parameters(gw)
        h = self.hparams
        arch = self.gguf_arch
        gw.add_leading_dense_block_count(h["first_k_dense_replace"])
        gw.add_vocab_size(h["vocab_size"])
        gw.add_q_lora_rank(h["q_lora_rank"])
        gw.add_kv_lora_rank(h["kv_lora_rank"])
        gw.add_key_length(h["qk_nope_head_dim"] + h["qk_rope_head_dim"])
        gw.add_value_length(h["v_head_dim"])
        gw.add_expert_feed_forward_length(h["moe_intermediate_size"])
        gw.add_expert_count(h["n_routed_experts"])
        gw.add_expert_used_count(h["num_experts_per_tok"])
        gw.add_expert_shared_count(h["n_shared_experts"])
        gw.add_expert_weights_scale(h["routed_scaling_factor"])
        gw.add_expert_weights_norm(h["norm_topk_prob"])
        gw.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)  # whatever scoring_func says
        gw.add_rope_dimension_count(h["qk_rope_head_dim"])
        gw.add_rope_freq_base(h["rope_theta"])
        gw.add_uint32(f"{arch}.nextn_predict_layers", self.n_nextn)
        gw.add_uint32(f"{arch}.attention.indexer.head_count", h["index_n_heads"])
        gw.add_uint32(f"{arch}.attention.indexer.key_length", h["index_head_dim"])
        gw.add_uint32(f"{arch}.attention.indexer.top_k", h["index_topk"])
        if h.get("sliding_window") is not None:
            gw.add_sliding_window(h["sliding_window"])
        gw.add_uint32(f"{arch}.mhc_num_stream", h["mhc_num_stream"])
        gw.add_uint32(f"{arch}.mhc_recur_norm", h["mhc_recur_norm"])
        gw.add_uint32(f"{arch}.param_sink_number", h["param_sink_number"])
        gw.add_array(f"{arch}.swa_layers", h["swa_layers"])
        if h.get("sliding_window_list") is not None:
            gw.add_array(f"{arch}.sliding_window_list", h["sliding_window_list"])

    def set_vocab(self, gw: GGUFWriter, pre_tokenizer: str) -> None:
        """GPT-2 BPE, then add_bos_token forced true (HF's post-processor prepends <|pangu_text_start|>)."""
        super().set_vocab(gw, pre_tokenizer)
        with _overwrites_expected():
            gw.add_add_bos_token(True)

    # ---- tensors ------------------------------------------------------------------------------------------
    def gguf_name(self, name: str) -> str:
        """Like ik's table lookup: the exact name first (tensors without a suffix), then with .weight/.bias."""
        for pattern, target in self._patterns:
            m = pattern.fullmatch(name)
            if m and self._in_range(m):
                return target.format(bid=m.groupdict().get("bid"))
        return super().gguf_name(name)

    def _in_range(self, m: re.Match[str]) -> bool:
        bid = m.groupdict().get("bid")
        return bid is None or int(bid) < self.block_count

    def map_tensor(self, name: str, t: SafeTensor) -> list[OutTensor]:
        if name.endswith("e_score_correction_bias"):
            renamed = name.replace("e_score_correction_bias", "e_score_correction.bias")
            try:
                target = self.gguf_name(renamed)
            except ConvertError:
                raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} has no mapping for openpangu (its router bias "
                                   "is model.layers.N.mlp.e_score_correction_bias)") from None
            return [OutTensor(target, t.shape, name, lazy(t), t.dtype, "router bias renamed")]
        if "mlp.experts" in name:
            return self._add_expert(name, t)
        if name.endswith("kv_b_proj.weight"):
            return self._split_kv_b(name, t)
        out = super().map_tensor(name, t)
        if 1 in t.shape:  # the convs' [C,1,3] and the merge module's [1] alpha
            out[0].transform = f"squeezed from {list(t.shape)}"
        return out

    def _add_expert(self, name: str, t: SafeTensor) -> list[OutTensor]:
        """Buffer one expert matrix; when a layer has all 3 x n_routed_experts, emit down, gate, up stacked."""
        m = _EXPERT.fullmatch(name)
        if m is None:
            raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} is not an expert matrix "
                               "(model.layers.N.mlp.experts.E.{down,gate,up}_proj.weight) and cannot be merged")
        bid, xid, kind = int(m.group(1)), int(m.group(2)), m.group(3)
        if bid >= self.block_count:
            raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} is in layer {bid}, but config.json has "
                               f"{self.block_count} layers (num_hidden_layers + num_nextn_predict_layers)")
        if xid >= self.n_experts:
            raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} is expert {xid}, but config.json has "
                               f"n_routed_experts = {self.n_experts}")
        want = self._shapes["ffn_down_exps.weight" if kind == "down_proj" else "ffn_gate_exps.weight"][1:]
        if tuple(t.shape) != want:
            raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} has shape {list(t.shape)} but config.json "
                               f"implies {list(want)}")
        layer = self._experts.setdefault(bid, {})
        layer[name] = t
        if len(layer) < 3 * self.n_experts:
            return []
        del self._experts[bid]
        outs = []
        for kind in _EXPERT_KINDS:
            parts = [layer[f"model.layers.{bid}.mlp.experts.{x}.{kind}.weight"] for x in range(self.n_experts)]
            # ik's F32 rule looks at the last expert's name; any of them ends in .weight, like this one
            outs.append(OutTensor(
                self.gguf_name(f"model.layers.{bid}.mlp.experts.{kind}.weight"), (self.n_experts, *parts[0].shape),
                f"model.layers.{bid}.mlp.experts.*.{kind}.weight", _stacked(parts), parts[0].dtype,
                f"stacked experts 0..{self.n_experts - 1} -> {[self.n_experts, *parts[0].shape]}"))
        return outs

    def _split_kv_b(self, name: str, t: SafeTensor) -> list[OutTensor]:
        """kv_b [H*(nope+v), kv_lora] -> k_b [H*kv_lora, nope] (each head transposed) and v_b [H*v, kv_lora]."""
        h = self.hparams
        n_head, nope, v = int(h["num_attention_heads"]), int(h["qk_nope_head_dim"]), int(h["v_head_dim"])
        rank = int(h["kv_lora_rank"])
        if tuple(t.shape) != (n_head * (nope + v), rank):
            raise ConvertError(
                f"{self.ckpt.dir}: tensor {name!r} has shape {list(t.shape)} but config.json implies "
                f"{[n_head * (nope + v), rank]} (num_attention_heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank)")

        def k_b(w: np.ndarray) -> np.ndarray:
            return w.reshape(n_head, nope + v, rank)[:, :nope].transpose(0, 2, 1).reshape(n_head * rank, nope)

        def v_b(w: np.ndarray) -> np.ndarray:
            return w.reshape(n_head, nope + v, rank)[:, nope:].reshape(n_head * v, rank)

        return [
            OutTensor(self.gguf_name(name.replace("kv_b_proj", "k_b_proj")), (n_head * rank, nope), name,
                      lazy(t, k_b), t.dtype, f"kv_b split: first {nope} rows of each of {n_head} heads, transposed"),
            OutTensor(self.gguf_name(name.replace("kv_b_proj", "v_b_proj")), (n_head * v, rank), name,
                      lazy(t, v_b), t.dtype, f"kv_b split: last {v} rows of each of {n_head} heads"),
        ]

    def finish(self) -> None:
        """Experts left unmerged mean a layer lacks some: ik raises 'Unprocessed experts' too."""
        for bid, layer in sorted(self._experts.items()):
            missing = [f"model.layers.{bid}.mlp.experts.{x}.{k}.weight" for x in range(self.n_experts)
                       for k in _EXPERT_KINDS if f"model.layers.{bid}.mlp.experts.{x}.{k}.weight" not in layer]
            raise ConvertError(
                f"{self.ckpt.dir}: layer {bid} has {len(layer)} of the {3 * self.n_experts} expert matrices "
                f"(n_routed_experts = {self.n_experts}); they cannot be merged. Missing: {missing[0]!r}"
                + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))

    # ---- shapes -------------------------------------------------------------------------------------------
    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """numpy-order shapes (before ik's squeeze) that config.json implies, keyed by GGUF name without blk.N."""
        h = self.hparams
        e, vocab, n_head = int(h["hidden_size"]), int(h["vocab_size"]), int(h["num_attention_heads"])
        q_lora, kv_lora = int(h["q_lora_rank"]), int(h["kv_lora_rank"])
        nope, rope, v = int(h["qk_nope_head_dim"]), int(h["qk_rope_head_dim"]), int(h["v_head_dim"])
        s = int(h["mhc_num_stream"])
        sh = s * e
        n_exp, ff_exp = self.n_experts, int(h["moe_intermediate_size"])
        ff_sh = ff_exp * int(h["n_shared_experts"])
        idx_heads, idx_dim = int(h["index_n_heads"]), int(h["index_head_dim"])
        sinks = int(h["param_sink_number"])
        shapes = {
            "token_embd.weight": (vocab, e), "output.weight": (vocab, e), "output_norm.weight": (e,),
            "merge_mhc_phi.weight": (s, sh), "merge_mhc_alpha": (1,), "merge_mhc_beta": (s,),
            "merge_mhc_gamma": (sh,),
            "attn_norm.weight": (e,), "post_attention_norm.weight": (e,), "ffn_norm.weight": (e,),
            "post_ffw_norm.weight": (e,), "block_post_norm.weight": (sh,),
            "attn_q_a.weight": (q_lora, e), "attn_q_a_norm.weight": (q_lora,),
            "attn_q_b.weight": (n_head * (nope + rope), q_lora),
            "attn_kv_a_mqa.weight": (kv_lora + rope, e), "attn_kv_a_norm.weight": (kv_lora,),
            "attn_k_b.weight": (n_head * kv_lora, nope), "attn_v_b.weight": (n_head * v, kv_lora),
            "attn_output.weight": (e, n_head * v),
            "attn_qa_conv.weight": (q_lora, 1, _CONV_KERNEL), "attn_compresskv_conv.weight": (kv_lora, 1, _CONV_KERNEL),
            "attn_o_conv.weight": (n_head * v, 1, _CONV_KERNEL),
            "attn_param_sink_kv": (sinks, kv_lora), "attn_param_sink_k_pe": (sinks, rope),
            "attn_indexer_k_norm.weight": (idx_dim,), "attn_indexer_weights_proj.weight": (idx_heads, e),
            "attn_indexer_k.weight": (idx_dim, e), "attn_indexer_q_b.weight": (idx_heads * idx_dim, q_lora),
            "ffn_gate_inp.weight": (n_exp, e), "exp_probs_b.bias": (n_exp,),
            "ffn_gate_exps.weight": (n_exp, ff_exp, e), "ffn_up_exps.weight": (n_exp, ff_exp, e),
            "ffn_down_exps.weight": (n_exp, e, ff_exp),
            "ffn_gate_shexp.weight": (ff_sh, e), "ffn_up_shexp.weight": (ff_sh, e), "ffn_down_shexp.weight": (e, ff_sh),
            "nextn.eh_proj.weight": (e, 2 * e), "nextn.enorm.weight": (e,), "nextn.hnorm.weight": (e,),
            "nextn.shared_head_norm.weight": (e,), "nextn.embed_tokens.weight": (vocab, e),
            "nextn.shared_head_head.weight": (vocab, e),
        }
        for sub in ("attn", "mlp"):
            shapes |= {f"{sub}_mhc_phi.weight": ((s + 2) * s, sh), f"{sub}_mhc_alpha": (3,),
                       f"{sub}_mhc_beta": (s * (s + 2),), f"{sub}_mhc_gamma": (sh,)}
        if h.get("intermediate_size") is not None:
            ff = int(h["intermediate_size"])
            shapes |= {"ffn_gate.weight": (ff, e), "ffn_up.weight": (ff, e), "ffn_down.weight": (e, ff)}
        return shapes

    def check_shapes(self, out: OutTensor) -> None:
        key = out.name.split(".", 2)[-1] if out.name.startswith("blk.") else out.name
        want = self._shapes.get(key)
        if want is not None and tuple(out.shape) != want:
            raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} has shape {list(out.shape)} but config.json "
                               f"implies {list(want)} for {out.name}")


def _stacked(parts: list[SafeTensor]) -> Callable[[], np.ndarray]:
    """A loader that reads the experts only when the merged tensor is written."""
    return lambda: np.stack([p.to_f32() for p in parts])


@contextmanager
def _overwrites_expected() -> Iterator[None]:
    """ik writes some keys twice on purpose (new value, first position); gguf-py would warn about each."""
    gguf_log = logging.getLogger("gguf.gguf_writer")

    def not_duplicate(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Duplicated key name")

    gguf_log.addFilter(not_duplicate)
    try:
        yield
    finally:
        gguf_log.removeFilter(not_duplicate)
