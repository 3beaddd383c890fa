"""DeepseekV4ForCausalLM (and the V4 Flash/Pro names) -> arch `deepseek4`.

ik's converter cannot convert a full DeepSeek-V4 checkpoint (DeepSeek's native tensor names are not in its table);
it only exports the standalone MTP predictor with `--mtp`. Both are done here:

- The full model in the layout ik's runtime loads (every tensor listed in `expected_tensors`): hyper-connection, CSA/HCA
  compressor and lightning-indexer tensors under the names ik's loader reads first; FP8 (E4M3) linears dequantized
  exactly, each E8M0 scale covering one `quantization_config.weight_block_size` tile (edge tiles partial); FP4
  (E2M1) experts repacked byte for byte into ggml MXFP4 blocks and stacked per projection; the hash-routing
  `tid2eid` tables as I32; the MTP block dropped. `block_count` is num_hidden_layers and `nextn_predict_layers` is
  not written: ik would otherwise run the last layers as MTP layers.
- `--mtp`: ik's export byte for byte: embed/norm/head plus `mtp.0.*` as block num_hidden_layers, e_proj|h_proj
  concatenated into `nextn.eh_proj`, the MXFP4 experts appended after everything else.

The MXFP4 exponent byte is the checkpoint's E8M0 scale byte unchanged: ggml stores the E2M1 values doubled
(0, 1, 2, 3, 4, 6, 8, 12) against a halved scale, so 2^(e-127)·v = 2^(e-128)·2v. MXFP4 experts and I32 tables
keep their type in every outtype, and no tensor is squeezed: ik's loader takes each shape from the file, and a
`tid2eid` of top-k 1 must stay {1, vocab}.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from gguf import GGUFWriter, RopeScalingType

from ikconvert.archs.base import Arch, OutTensor, dequantize_fp8, register, stacked
from ikconvert.checkpoint import Checkpoint
from ikconvert.errors import ConvertError
from ikconvert.safetensors_io import E8M0_TABLE, SafeTensor

Load = Callable[[], np.ndarray]

FP8 = ("F8_E4M3", "F8_E5M2")
FP4_PACKED = ("I8", "U8")  # two E2M1 codes per byte, the even element in the low nibble
FLOATS = ("BF16", "F16", "F32")
SCALE_DTYPE = "F8_E8M0"
MX_GROUP = 32  # E2M1 values per E8M0 scale, in the checkpoint and in a ggml MXFP4 block
SQRTSOFTPLUS = 4  # ik's ExpertGatingFuncType; its DeepSeek-V4 loader accepts nothing else
RATIOS = (0, 4, 128)  # compress ratios ik's runtime implements (CSA 4, HCA 128)
MAX_HC = 8  # ik's hc_pre supports at most 8 hyper-connection streams
MTP_ROOTS = ("embed.weight", "norm.weight", "head.weight", "head.scale")

ROOT = {
    "embed.weight": "token_embd.weight",
    "head.weight": "output.weight",
    "norm.weight": "output_norm.weight",
    "hc_head_fn": "output_hc_fn.weight",
    "hc_head_base": "output_hc_base.weight",
    "hc_head_scale": "output_hc_scale.weight",
}
# inside `layers.N.` (and the MTP block `mtp.0.`)
BLOCK = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    **{f"hc_{s}_{p}": f"hc_{s}_{p}.weight" for s in ("attn", "ffn") for p in ("fn", "base", "scale")},
    "attn.attn_sink": "attn_sinks.weight",
    "attn.wq_a.weight": "attn_q_a.weight",
    "attn.q_norm.weight": "attn_q_a_norm.weight",
    "attn.wq_b.weight": "attn_q_b.weight",
    "attn.wkv.weight": "attn_kv.weight",
    "attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "attn.wo_a.weight": "attn_output_a.weight",
    "attn.wo_b.weight": "attn_output_b.weight",
    "ffn.gate.weight": "ffn_gate_inp.weight",
    "ffn.gate.bias": "exp_probs_b.bias",
    "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
    "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight",
    "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
}
# main layers only: compressors (ratio != 0), the indexer (ratio 4), hash routing (the first num_hash_layers)
MAIN_ONLY = {
    **{f"attn.compressor.{k}": f"attn_compressor_{v}" for k, v in
       (("wkv.weight", "kv.weight"), ("wgate.weight", "gate.weight"), ("ape", "ape.weight"),
        ("norm.weight", "norm.weight"))},
    "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
    "attn.indexer.weights_proj.weight": "indexer.proj.weight",
    **{f"attn.indexer.compressor.{k}": f"indexer_compressor_{v}" for k, v in
       (("wkv.weight", "kv.weight"), ("wgate.weight", "gate.weight"), ("ape", "ape.weight"),
        ("norm.weight", "norm.weight"))},
    "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight",
}
# MTP block only (e_proj/h_proj are merged into nextn.eh_proj; its hc_head_* become the root output_hc_*)
MTP_ONLY = {
    "enorm.weight": "nextn.enorm.weight",
    "hnorm.weight": "nextn.hnorm.weight",
    "norm.weight": "nextn.shared_head_norm.weight",
}
MTP_HEAD = {k: v for k, v in ROOT.items() if k.startswith("hc_head_")}
EXPERT_PROJ = {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}
_BLOCK_NAME = re.compile(r"(layers|mtp)\.(\d+)\.(.+)")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")
_EH = ("e_proj.weight", "h_proj.weight")

REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "vocab_size", "max_position_embeddings",
            "rms_norm_eps", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
            "routed_scaling_factor", "norm_topk_prob", "scoring_func", "swiglu_limit", "sliding_window",
            "compress_ratios", "compress_rope_theta", "hc_mult", "hc_sinkhorn_iters", "hc_eps")


@register
class DeepseekV4Arch(Arch):
    hf_architectures = ("DeepseekV4ForCausalLM", "DeepseekV4FlashForCausalLM", "DeepseekV4ProForCausalLM")
    gguf_arch = "deepseek4"
    accepted_options = ("mtp",)

    def __init__(self, ckpt: Checkpoint, options: dict[str, Any] | None = None):
        super().__init__(ckpt, options)
        self.mtp = bool(self.options.get("mtp"))
        self.n_layer = int(self.require("num_hidden_layers"))
        for key in REQUIRED:
            self.require(key)
        self.dims = self._dims()
        self.ratios = self._ratios()
        self.n_hash = int(self.hparams.get("num_hash_layers") or 0)
        if not 0 <= self.n_hash <= self.n_layer:
            raise self._config_error("num_hash_layers", f"must be between 0 and num_hidden_layers ({self.n_layer})")
        if self.mtp and self.hparams.get("num_nextn_predict_layers") != 1:
            raise self._config_error("num_nextn_predict_layers", "must be 1 for --mtp (one predictor block), got "
                                     f"{self.hparams.get('num_nextn_predict_layers')!r}")
        #: (block, w1/w2/w3) -> expert index -> (HF name, weight)
        self._experts: dict[tuple[int, str], dict[int, tuple[str, SafeTensor]]] = {}
        self._eh_seen: dict[str, SafeTensor] = {}
        self._tail: list[OutTensor] = []
        self._made: set[str] = set()
        self._layout: dict[str, tuple[int, ...]] = {}

    # ---- config -------------------------------------------------------------------------------------------
    def _config_error(self, key: str, why: str) -> ConvertError:
        return ConvertError(f"{self.ckpt.dir / 'config.json'}: {key!r} {why}")

    def _dims(self) -> dict[str, int]:
        h = self.hparams
        d = {k: int(self.require(v)) for k, v in (
            ("H", "hidden_size"), ("V", "vocab_size"), ("nh", "num_attention_heads"), ("hd", "head_dim"),
            ("ql", "q_lora_rank"), ("g", "o_groups"), ("ol", "o_lora_rank"), ("E", "n_routed_experts"),
            ("k", "num_experts_per_tok"), ("m", "moe_intermediate_size"), ("shared", "n_shared_experts"),
            ("c", "hc_mult"), ("rope", "qk_rope_head_dim"))}
        d["ih"] = int(self.find_hparam(["num_indexer_heads", "index_n_heads"]))
        d["id"] = int(self.find_hparam(["indexer_head_dim", "index_head_dim"]))
        self.find_hparam(["indexer_topk", "index_topk"])
        if d["nh"] * d["hd"] % d["g"]:
            raise self._config_error("o_groups", f"({d['g']}) must divide num_attention_heads x head_dim")
        if not 0 < d["c"] <= MAX_HC:
            raise self._config_error("hc_mult", f"must be 1..{MAX_HC} (ik's hyper-connection kernel), got {d['c']}")
        if not 0 < d["rope"] < d["hd"]:
            raise self._config_error("qk_rope_head_dim", f"must be below head_dim ({d['hd']})")
        if h["scoring_func"] != "sqrtsoftplus":
            raise self._config_error("scoring_func", f"is {h['scoring_func']!r}; ik's DeepSeek-V4 runtime "
                                     "implements only 'sqrtsoftplus'")
        return d

    def _ratios(self) -> list[int]:
        ratios = self.hparams["compress_ratios"]
        if not isinstance(ratios, list) or len(ratios) < self.n_layer:
            raise self._config_error("compress_ratios", f"must list at least num_hidden_layers ({self.n_layer}) "
                                     "ratios")
        if any(r not in RATIOS for r in ratios):
            raise self._config_error("compress_ratios", f"{ratios} holds a ratio other than {RATIOS}, the ones ik's "
                                     "runtime implements")
        return [int(r) for r in ratios]

    @property
    def block_count(self) -> int:
        """The main layers; --mtp adds the predictor block after them, as ik's export does."""
        return self.n_layer + (1 if self.mtp else 0)

    def set_gguf_parameters(self, gw: GGUFWriter) -> None:
        """ik's base keys, then DeepseekV2Model's, then DeepseekV4Model's, in ik's order."""
        super().set_gguf_parameters(gw)
        h, d, arch = self.hparams, self.dims, self.gguf_arch
        gw.add_leading_dense_block_count(h.get("first_k_dense_replace", 0))
        gw.add_vocab_size(d["V"])
        gw.add_q_lora_rank(d["ql"])
        if h.get("kv_lora_rank") is not None:
            gw.add_kv_lora_rank(h["kv_lora_rank"])
        gw.add_expert_feed_forward_length(d["m"])
        gw.add_expert_count(d["E"])
        gw.add_expert_shared_count(d["shared"])
        gw.add_expert_weights_scale(h["routed_scaling_factor"])
        gw.add_expert_weights_norm(h["norm_topk_prob"])
        gw.add_uint32(f"{arch}.expert_gating_func", SQRTSOFTPLUS)
        gw.add_rope_dimension_count(d["rope"])
        self._rope_scaling(gw)
        limits = [float(h["swiglu_limit"])] * self.block_count
        gw.add_array(f"{arch}.swiglu_clamp_exp", limits)
        gw.add_array(f"{arch}.swiglu_clamp_shexp", limits)
        gw.add_sliding_window(int(h["sliding_window"]))
        gw.add_uint32(f"{arch}.attention.output_group_count", d["g"])
        gw.add_uint32(f"{arch}.attention.output_lora_rank", d["ol"])
        gw.add_array(f"{arch}.attention.compress_ratios", list(h["compress_ratios"]))
        gw.add_float32(f"{arch}.attention.compress_rope_freq_base", float(h["compress_rope_theta"]))
        gw.add_uint32(f"{arch}.hyper_connection.count", d["c"])
        gw.add_uint32(f"{arch}.hyper_connection.sinkhorn_iterations", int(h["hc_sinkhorn_iters"]))
        gw.add_float32(f"{arch}.hyper_connection.epsilon", float(h["hc_eps"]))
        if h.get("num_hash_layers") is not None:
            gw.add_uint32(f"{arch}.hash_layer_count", self.n_hash)
        if self.mtp:
            gw.add_embedding_length_out(d["H"] * d["c"])
        gw.add_uint32(f"{arch}.attention.indexer.head_count", d["ih"])
        gw.add_uint32(f"{arch}.attention.indexer.key_length", d["id"])
        gw.add_uint32(f"{arch}.attention.indexer.top_k", int(self.find_hparam(["indexer_topk", "index_topk"])))
        if self.mtp:
            gw.add_nextn_predict_layers(1)

    def _rope_scaling(self, gw: GGUFWriter) -> None:
        """--mtp: DeepseekV2Model's rule (YaRN keys only with mscale_all_dim). Full model: the YaRN keys ik's
        DeepSeek-V4 graph uses on compressed layers (without them it falls back to unscaled rope there)."""
        scaling = self.hparams.get("rope_scaling")
        if not isinstance(scaling, dict) or "factor" not in scaling:
            return
        if "original_max_position_embeddings" not in scaling:
            raise self._config_error("rope_scaling", "needs original_max_position_embeddings")
        if self.mtp:
            if scaling.get("type") == "yarn" and "mscale_all_dim" in scaling:
                gw.add_rope_scaling_type(RopeScalingType.YARN)
                gw.add_rope_scaling_factor(scaling["factor"])
                gw.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
                gw.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
            return
        kind = scaling.get("type", scaling.get("rope_type"))
        if kind != "yarn":
            raise self._config_error("rope_scaling", f"has type {kind!r}; DeepSeek-V4 uses (and ik implements) yarn")
        gw.add_rope_scaling_type(RopeScalingType.YARN)
        gw.add_rope_scaling_factor(float(scaling["factor"]))
        gw.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        if "beta_fast" in scaling:
            gw.add_rope_scaling_yarn_beta_fast(float(scaling["beta_fast"]))
        if "beta_slow" in scaling:
            gw.add_rope_scaling_yarn_beta_slow(float(scaling["beta_slow"]))

    # ---- tensors ------------------------------------------------------------------------------------------
    def is_skipped(self, name: str) -> bool:
        """Full model: the MTP block. --mtp: everything but the predictor and the embedding/output it shares."""
        if super().is_skipped(name):
            return True
        if self.mtp:
            return name not in MTP_ROOTS and not name.startswith("mtp.")
        return name.startswith("mtp.")

    def _out(self, name: str, shape: tuple[int, ...], source: str, load: Load, dtype: str, transform: str = "",
             encoded: str = "") -> OutTensor:
        self._made.add(name)
        return OutTensor(name, tuple(shape), source, load, dtype, transform, encoded=encoded, squeeze=False)

    def _locate(self, name: str) -> tuple[int | None, str]:
        """(block id or None for root tensors, name inside the block)."""
        m = _BLOCK_NAME.fullmatch(name)
        if m is None:
            return None, name
        kind, idx, rest = m.group(1), int(m.group(2)), m.group(3)
        if kind == "mtp":
            if idx != 0:
                raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} belongs to MTP predictor {idx}; DeepSeek-V4 "
                                   "has (and ik's --mtp export supports) predictor 0 only")
            return self.n_layer, rest
        if idx >= self.n_layer:
            raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} is in layer {idx}, but config.json has "
                               f"num_hidden_layers = {self.n_layer}")
        return idx, rest

    def _unmapped(self, name: str) -> ConvertError:
        where = "the MTP block" if name.startswith("mtp.") else "a DeepSeek-V4 checkpoint"
        return ConvertError(f"{self.ckpt.dir}: tensor {name!r} has no place in {where} for {self.gguf_arch}; "
                            "the converter will not drop it silently")

    def map_tensor(self, name: str, t: SafeTensor) -> list[OutTensor]:
        if name.endswith(".scale"):
            base = name[: -len(".scale")]
            if self.ckpt.find(base + ".weight") is None and self.ckpt.find(base) is None:
                raise ConvertError(f"{self.ckpt.dir}: scale {name!r} has no weight {base + '.weight'!r}")
            return []  # read with its weight
        bid, key = self._locate(name)
        if bid is None:
            if key not in ROOT:
                raise self._unmapped(name)
            return [self._plain(ROOT[key], name, t)]
        if (m := _EXPERT.fullmatch(key)) is not None:
            return self._add_expert(bid, int(m.group(1)), m.group(2), name, t)
        is_mtp = bid == self.n_layer
        if is_mtp and key in _EH:
            return self._add_eh_proj(bid, name, t)
        if is_mtp and key in MTP_HEAD:
            return [self._plain(MTP_HEAD[key], name, t)]
        table = {**BLOCK, **(MTP_ONLY if is_mtp else MAIN_ONLY)}
        if key not in table:
            raise self._unmapped(name)
        target = f"blk.{bid}.{table[key]}"
        if key == "ffn.gate.tid2eid":
            return [self._tid2eid(target, name, t)]
        return [self._plain(target, name, t)]

    def _plain(self, target: str, name: str, t: SafeTensor) -> OutTensor:
        load, transform = self._float_loader(name, t)
        return self._out(target, t.shape, name, load, t.dtype, transform)

    def _scale_of(self, name: str, t: SafeTensor, required: bool) -> SafeTensor | None:
        scale_name = name.removesuffix(".weight") + ".scale"
        s = self.ckpt.find(scale_name)
        if s is None and required:
            raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} is {t.dtype} but its scale {scale_name!r} is "
                               "missing; it cannot be dequantized")
        if s is not None and s.dtype != SCALE_DTYPE:
            raise ConvertError(f"{self.ckpt.dir}: scale {scale_name!r} is {s.dtype}, expected {SCALE_DTYPE} "
                               "(DeepSeek-V4's ue8m0 scales)")
        return s

    def _float_loader(self, name: str, t: SafeTensor) -> tuple[Load, str]:
        """float32 values of a weight: FP8 dequantized with its scale, float dtypes as they are."""
        if t.dtype in FP8:
            s = self._scale_of(name, t, required=True)
            assert s is not None
            block = self._fp8_block(name, t, s)
            return (lambda: dequantize_fp8_e8m0(t, s, block),
                    f"fp8 {t.dtype[3:].lower()} dequant: x 2^(e8m0-127) per {block[0]}x{block[1]} tile")
        if t.dtype in FLOATS:
            if self._scale_of(name, t, required=False) is not None:
                raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} is {t.dtype} but has a scale; scaled weights "
                                   f"must be FP8 ({'/'.join(FP8)}) or, for routed experts, FP4 packed in I8")
            return t.to_f32, ""
        hint = " (FP4 packed in I8 is for routed experts only)" if t.dtype in FP4_PACKED else ""
        raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} has dtype {t.dtype}; expected one of "
                           f"{', '.join(FLOATS + FP8)}{hint}")

    def _fp8_block(self, name: str, t: SafeTensor, s: SafeTensor) -> tuple[int, int]:
        """The tile of one scale, from quantization_config; the scale grid must cover the weight exactly."""
        block = self.fp8_tile(name, t)
        if len(t.shape) != 2:
            raise ConvertError(f"{self.ckpt.dir}: FP8 tensor {name!r} has shape {list(t.shape)}; expected 2-D")
        want = (math.ceil(t.shape[0] / block[0]), math.ceil(t.shape[1] / block[1]))
        if tuple(s.shape) != want:
            raise ConvertError(
                f"{self.ckpt.dir}: scale {s.name!r} has grid {list(s.shape)}, but weight_block_size {list(block)} tiles "
                f"{name!r} {list(t.shape)} into {list(want)}")
        return block[0], block[1]

    def _tid2eid(self, target: str, name: str, t: SafeTensor) -> OutTensor:
        """Hash routing table token -> experts; ik's get_rows needs I32 (an F32 table aborts)."""
        if t.dtype not in ("I64", "I32"):
            raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} has dtype {t.dtype}; the hash routing table must "
                               "be I64 or I32 expert ids")
        n_expert = self.dims["E"]

        def load() -> np.ndarray:
            ids = t.raw()
            bad = ids[(ids < 0) | (ids >= n_expert)]
            if bad.size:
                raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} holds expert id {int(bad[0])}; ids must be in "
                                   f"0..{n_expert - 1} (n_routed_experts)")
            return ids.astype("<i4")

        return self._out(target, t.shape, name, load, t.dtype, f"hash routing table {t.dtype} -> I32",
                         encoded="I32")

    def _add_eh_proj(self, bid: int, name: str, t: SafeTensor) -> list[OutTensor]:
        """MTP e_proj [H, H] and h_proj [H, H] -> nextn.eh_proj [H, 2H] (e first), when the second arrives."""
        self._eh_seen[name] = t
        prefix = name.rsplit(".", 2)[0]
        parts = [f"{prefix}.{p}" for p in _EH]
        if not all(p in self._eh_seen for p in parts):
            return []
        e, h = (self._eh_seen.pop(p) for p in parts)
        if len(e.shape) != 2 or e.shape != h.shape:
            raise ConvertError(f"{self.ckpt.dir}: {parts[0]!r} {list(e.shape)} and {parts[1]!r} {list(h.shape)} "
                               "cannot be concatenated into nextn.eh_proj")
        (load_e, note), (load_h, _) = self._float_loader(parts[0], e), self._float_loader(parts[1], h)
        return [self._out(f"blk.{bid}.nextn.eh_proj.weight", (e.shape[0], 2 * e.shape[1]), name,
                          lambda: np.concatenate([load_e(), load_h()], axis=1), t.dtype,
                          "e_proj | h_proj concatenated" + (f"; {note}" if note else ""))]

    def _add_expert(self, bid: int, xid: int, proj: str, name: str, t: SafeTensor) -> list[OutTensor]:
        """Collect one routed expert; when a projection has all n_routed_experts, emit it stacked [E, out, in]."""
        n = self.dims["E"]
        if xid >= n:
            raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} is expert {xid}, but config.json has "
                               f"n_routed_experts = {n}")
        if t.dtype in FP4_PACKED:
            self._fp4_scale(name, t)
        else:
            self._float_loader(name, t)
        group = self._experts.setdefault((bid, proj), {})
        group[xid] = (name, t)
        if len(group) < n:
            return []
        del self._experts[(bid, proj)]
        parts = [group[x] for x in range(n)]
        out = self._stack_experts(f"blk.{bid}.{EXPERT_PROJ[proj]}", parts, name.replace(f".{xid}.", ".*.", 1))
        if self.mtp:  # ik's --mtp writes the MXFP4 experts after every other tensor
            self._tail.append(out)
            return []
        return [out]

    def _stack_experts(self, target: str, parts: list[tuple[str, SafeTensor]], source: str) -> OutTensor:
        n = len(parts)
        first_name, first = parts[0]
        for name, t in parts:
            if (t.dtype, t.shape) != (first.dtype, first.shape):
                raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} is {t.dtype} {list(t.shape)}, but "
                                   f"{first_name!r} is {first.dtype} {list(first.shape)}; experts are stacked")
        if first.dtype not in FP4_PACKED:
            loaders = [self._float_loader(name, t) for name, t in parts]
            note = loaders[0][1]
            fills = [partial(_copy_into, f) for f, _ in loaders]
            return self._out(target, (n, *first.shape), source, stacked(fills, tuple(first.shape)), first.dtype,
                             f"stacked experts 0..{n - 1}" + (f"; {note}" if note else ""))
        pairs = [(t, self._fp4_scale(name, t)) for name, t in parts]
        rows, cols = first.shape
        repacked = [partial(_copy_into, partial(_fp4_as_mxfp4, w, s)) for w, s in pairs]
        mxfp4_row = 2 * cols // 32 * 17  # bytes: a 32-value block is one E8M0 byte and 16 packed bytes
        return self._out(target, (n, rows, 2 * cols), source, stacked(repacked, (rows, mxfp4_row), np.uint8),
                         first.dtype,
                         f"fp4 e2m1 -> mxfp4 repack (e8m0 byte kept), stacked experts 0..{n - 1}", encoded="MXFP4")

    def _fp4_scale(self, name: str, t: SafeTensor) -> SafeTensor:
        s = self._scale_of(name, t, required=True)
        assert s is not None
        if len(t.shape) != 2 or (2 * t.shape[1]) % MX_GROUP:
            raise ConvertError(f"{self.ckpt.dir}: FP4 tensor {name!r} has shape {list(t.shape)}; expected 2-D rows "
                               f"of a multiple of {MX_GROUP // 2} bytes ({MX_GROUP} values per scale)")
        want = (t.shape[0], 2 * t.shape[1] // MX_GROUP)
        if tuple(s.shape) != want:
            raise ConvertError(f"{self.ckpt.dir}: scale {s.name!r} has shape {list(s.shape)}; FP4 tensor {name!r} "
                               f"{list(t.shape)} needs one per {MX_GROUP} values: {list(want)}")
        return s

    def trailing_tensors(self) -> list[OutTensor]:
        return self._tail

    # ---- layout -------------------------------------------------------------------------------------------
    def layout(self) -> dict[str, tuple[int, ...]]:
        """Every GGUF tensor ik's runtime loads for the full model, with its numpy-order shape."""
        d = self.dims
        H, c, nh, hd, ql, E, m = d["H"], d["c"], d["nh"], d["hd"], d["ql"], d["E"], d["m"]
        out = {"token_embd.weight": (d["V"], H), "output.weight": (d["V"], H), "output_norm.weight": (H,),
               "output_hc_fn.weight": (c, c * H), "output_hc_base.weight": (c,), "output_hc_scale.weight": (1,)}
        for bid in ([self.n_layer] if self.mtp else range(self.n_layer)):
            mix, ms = (2 + c) * c, m * d["shared"]
            blk = {"attn_norm.weight": (H,), "ffn_norm.weight": (H,), "attn_sinks.weight": (nh,),
                   "attn_q_a.weight": (ql, H), "attn_q_a_norm.weight": (ql,), "attn_q_b.weight": (nh * hd, ql),
                   "attn_kv.weight": (hd, H), "attn_kv_a_norm.weight": (hd,),
                   "attn_output_a.weight": (d["g"] * d["ol"], nh * hd // d["g"]),
                   "attn_output_b.weight": (H, d["g"] * d["ol"]), "ffn_gate_inp.weight": (E, H),
                   "ffn_gate_exps.weight": (E, m, H), "ffn_up_exps.weight": (E, m, H),
                   "ffn_down_exps.weight": (E, H, m)}
            if ms:
                blk |= {"ffn_gate_shexp.weight": (ms, H), "ffn_up_shexp.weight": (ms, H),
                        "ffn_down_shexp.weight": (H, ms)}
            for s in ("attn", "ffn"):
                blk |= {f"hc_{s}_fn.weight": (mix, c * H), f"hc_{s}_base.weight": (mix,), f"hc_{s}_scale.weight": (3,)}
            r = 0 if self.mtp else self.ratios[bid]
            if r:
                w = (2 if r == 4 else 1) * hd
                blk |= {"attn_compressor_kv.weight": (w, H), "attn_compressor_gate.weight": (w, H),
                        "attn_compressor_ape.weight": (r, w), "attn_compressor_norm.weight": (hd,)}
            if r == 4:
                w = 2 * d["id"]
                blk |= {"indexer.attn_q_b.weight": (d["ih"] * d["id"], ql), "indexer.proj.weight": (d["ih"], H),
                        "indexer_compressor_kv.weight": (w, H), "indexer_compressor_gate.weight": (w, H),
                        "indexer_compressor_ape.weight": (4, w), "indexer_compressor_norm.weight": (d["id"],)}
            if bid < self.n_hash and not self.mtp:
                blk["ffn_gate_tid2eid.weight"] = (d["V"], d["k"])
            else:
                blk["exp_probs_b.bias"] = (E,)
            if self.mtp:
                blk |= {"nextn.eh_proj.weight": (H, 2 * H), "nextn.enorm.weight": (H,), "nextn.hnorm.weight": (H,),
                        "nextn.shared_head_norm.weight": (H,)}
            out |= {f"blk.{bid}.{k}": v for k, v in blk.items()}
        return out

    def check_shapes(self, out: OutTensor) -> None:
        want = self._layout.get(out.name)
        if want is None:
            bid = out.name.split(".")[1] if out.name.startswith("blk.") else None
            why = (f"layer {bid} has compress ratio {self.ratios[int(bid)]} and is "
                   f"{'' if int(bid) < self.n_hash else 'not '}hash-routed (num_hash_layers = {self.n_hash})"
                   if bid is not None and int(bid) < self.n_layer else "it is not part of the layout")
            raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} -> {out.name} does not belong in this "
                               f"model: {why} (config.json compress_ratios / num_hash_layers)")
        if tuple(out.shape) != want:
            raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} has shape {list(out.shape)} but config.json "
                               f"implies {list(want)} for {out.name}")

    def finish(self) -> None:
        """Everything the runtime needs must be there: ik fails at load, or later in the graph, otherwise."""
        for (bid, proj), group in sorted(self._experts.items()):
            missing = min(set(range(self.dims["E"])) - set(group))
            name = next(iter(group.values()))[0].replace(f".{next(iter(group))}.", f".{missing}.", 1)
            raise ConvertError(f"{self.ckpt.dir}: block {bid} has {len(group)} of the {self.dims['E']} "
                               f"{proj} experts (n_routed_experts); {name!r} is missing")
        if self._eh_seen:
            name = next(iter(self._eh_seen))
            raise ConvertError(f"{self.ckpt.dir}: {name!r} has no partner for nextn.eh_proj "
                               f"({' and '.join(_EH)} are concatenated)")
        self._layout = self.layout()
        absent = sorted(set(self._layout) - self._made)
        if absent:
            raise ConvertError(f"{self.ckpt.dir}: the checkpoint lacks {len(absent)} tensor(s) the {self.gguf_arch} "
                               f"layout needs (config.json compress_ratios, num_hash_layers), first {absent[0]}")


def e8m0_bytes(s: SafeTensor) -> np.ndarray:
    """The E8M0 scale bytes of `s`; code 255 is NaN in E8M0 and no usable scale."""
    raw = s.raw().view(np.uint8)
    if (raw == 255).any():
        raise ConvertError(f"{s.path}: scale {s.name!r} holds E8M0 code 255 (NaN)")
    return raw


def dequantize_fp8_e8m0(t: SafeTensor, scale: SafeTensor, block: tuple[int, int]) -> np.ndarray:
    """W[r, c] * 2^(scale[r // br, c // bc] - 127) in float32: exact (a power of two times an FP8 value)."""
    w = t.to_f32()
    dequantize_fp8(w, E8M0_TABLE[e8m0_bytes(scale)], block)
    return w


def repack_fp4_as_mxfp4(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """[out, in/2] E2M1 pairs (even element low) + [out, in/32] E8M0 -> [out, in/32 * 17] ggml block_mxfp4.

    A ggml block is the exponent byte then 16 bytes, byte j holding value j (low nibble) and value j+16 (high).
    """
    rows, half = codes.shape
    blocks = half * 2 // MX_GROUP
    src = codes.reshape(rows, blocks, MX_GROUP // 2)
    vals = np.empty((rows, blocks, MX_GROUP), dtype=np.uint8)
    vals[..., 0::2] = src & 0x0F
    vals[..., 1::2] = src >> 4
    packed = vals[..., : MX_GROUP // 2] | (vals[..., MX_GROUP // 2:] << 4)
    return np.concatenate([scale.reshape(rows, blocks, 1), packed], axis=-1).reshape(rows, blocks * 17)


def _copy_into(load: Callable[[], np.ndarray], dst: np.ndarray) -> None:
    """A stacked expert's fill: what `load` makes, written into the stack's slot."""
    np.copyto(dst, load())


def _fp4_as_mxfp4(codes: SafeTensor, scale: SafeTensor) -> np.ndarray:
    """One expert's FP4 codes and E8M0 scales as MXFP4 rows, read when its slot of the stack is filled."""
    return repack_fp4_as_mxfp4(codes.raw().view(np.uint8), e8m0_bytes(scale))
