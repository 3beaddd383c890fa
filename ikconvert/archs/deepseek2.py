"""DeepseekV2ForCausalLM / DeepseekV3ForCausalLM -> arch `deepseek2` (ik's DeepseekV2Model).

What ik does, reproduced: MLA attention tensors renamed, `kv_b_proj` written fused *and* split per head into
`attn_k_b` (each head's nope rows, transposed) and `attn_v_b` (its v rows); routed experts merged per layer into
3-D `ffn_{down,gate,up}_exps` emitted when the layer's last expert tensor arrives; `e_score_correction_bias` as
`exp_probs_b.bias`; MTP/NextN layers (index >= num_hidden_layers) dropped; routing and YaRN metadata. A
vocab_size of 163840 means Kimi-K2 (DeepSeek-V3's layout) and its tiktoken vocabulary (ikconvert.tiktoken_vocab).

Beyond ik, on request (`--keep-mtp`): DeepSeek-V3's MTP layer kept as the last block, in the layout ik gives the
NextN blocks of GLM-4.x and GLM-5 (block_count counts it, `nextn_predict_layers`, its decoder layer under the usual
names, `enorm`/`hnorm`/`eh_proj`/`embed_tokens`/`shared_head.{norm,head}` as `nextn.*`). ik does not run DeepSeek-V3's
MTP: its converter drops the layer (DeepseekV2Model.modify_tensors), its deepseek2 hyperparameters never read
nextn_predict_layers (llama-hparams.cpp, LLM_ARCH_DEEPSEEK2), create_deepseek2_tensors loads no nextn tensor, and
build_deepseek2's MTP tail aborts for any architecture but GLM_DSA. Such a file is for ikrun (`ikrun accept --mtp`);
ik's loader refuses it (a block it runs as a main layer, and tensors it never creates).

Beyond ik: FP8 checkpoints (F8_E4M3 weights with an F32 `weight_scale_inv` per tile, DeepSeek's published format,
which ik rejects) are dequantized here tile by tile in float32, the tile taken from config.json
`quantization_config.weight_block_size` and never guessed from the scale grid (a 192-row weight with 128-row tiles
has a [2, 1] grid whose second tile covers 64 rows). Inconsistencies ik would only trip over at load time (a dense
MLP in a MoE layer, q_proj next to a q_lora_rank, missing experts, a scale without its weight) are errors naming
the file and tensor, found before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
from gguf import GGUFWriter, RopeScalingType

from ikconvert.archs.base import Arch, ExpertMerger, Fill, OutTensor, dequantize_fp8, register
from ikconvert.checkpoint import Checkpoint, block_id
from ikconvert.errors import ConvertError
from ikconvert.safetensors_io import E4M3_TABLE, SafeTensor
from ikconvert.tiktoken_vocab import KIMI_VOCAB_SIZE, TiktokenFiles, write_tiktoken_vocab

# ik's ExpertGatingFuncType (the PyPI gguf package lacks sqrtsoftplus)
GATING_FUNCS = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE_SUFFIX = "_scale_inv"
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")


@register
class DeepseekV2Arch(Arch):
    hf_architectures: ClassVar[tuple[str, ...]] = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
    gguf_arch = "deepseek2"
    tensor_map = {
        "model.embed_tokens": "token_embd",
        "lm_head": "output",
        "model.norm": "output_norm",
        "model.layers.{bid}.input_layernorm": "blk.{bid}.attn_norm",
        "model.layers.{bid}.post_attention_layernorm": "blk.{bid}.ffn_norm",
        "model.layers.{bid}.self_attn.q_proj": "blk.{bid}.attn_q",
        "model.layers.{bid}.self_attn.q_a_proj": "blk.{bid}.attn_q_a",
        "model.layers.{bid}.self_attn.q_a_layernorm": "blk.{bid}.attn_q_a_norm",
        "model.layers.{bid}.self_attn.q_b_proj": "blk.{bid}.attn_q_b",
        "model.layers.{bid}.self_attn.kv_a_proj_with_mqa": "blk.{bid}.attn_kv_a_mqa",
        "model.layers.{bid}.self_attn.kv_a_layernorm": "blk.{bid}.attn_kv_a_norm",
        "model.layers.{bid}.self_attn.kv_b_proj": "blk.{bid}.attn_kv_b",
        "model.layers.{bid}.self_attn.o_proj": "blk.{bid}.attn_output",
        "model.layers.{bid}.mlp.gate_proj": "blk.{bid}.ffn_gate",
        "model.layers.{bid}.mlp.up_proj": "blk.{bid}.ffn_up",
        "model.layers.{bid}.mlp.down_proj": "blk.{bid}.ffn_down",
        "model.layers.{bid}.mlp.gate": "blk.{bid}.ffn_gate_inp",
        "model.layers.{bid}.mlp.gate.e_score_correction": "blk.{bid}.exp_probs_b",
        "model.layers.{bid}.mlp.shared_experts.gate_proj": "blk.{bid}.ffn_gate_shexp",
        "model.layers.{bid}.mlp.shared_experts.up_proj": "blk.{bid}.ffn_up_shexp",
        "model.layers.{bid}.mlp.shared_experts.down_proj": "blk.{bid}.ffn_down_shexp",
        "model.layers.{bid}.eh_proj": "blk.{bid}.nextn.eh_proj",
        "model.layers.{bid}.enorm": "blk.{bid}.nextn.enorm",
        "model.layers.{bid}.hnorm": "blk.{bid}.nextn.hnorm",
        "model.layers.{bid}.embed_tokens": "blk.{bid}.nextn.embed_tokens",
        "model.layers.{bid}.shared_head.head": "blk.{bid}.nextn.shared_head_head",
        "model.layers.{bid}.shared_head.norm": "blk.{bid}.nextn.shared_head_norm",
    }
    accepted_options: ClassVar[tuple[str, ...]] = ("keep_mtp",)

    def __init__(self, ckpt: Checkpoint, options: dict[str, Any] | None = None):
        super().__init__(ckpt, options)
        self._experts = ExpertMerger(int(self.hparams.get("n_routed_experts") or 0), "n_routed_experts",
                                     self._filler)
        #: the MTP layers written (--keep-mtp), 0 as ik
        self.kept_mtp = int(self.hparams.get("num_nextn_predict_layers") or 0) if self.options.get("keep_mtp") else 0
        if self.options.get("keep_mtp") and self.kept_mtp != 1:
            raise ConvertError(f"{ckpt.dir / 'config.json'}: --keep-mtp keeps one MTP layer; num_nextn_predict_layers "
                               f"is {self.hparams.get('num_nextn_predict_layers')!r}")

    @property
    def block_count(self) -> int:
        """The main layers, and with --keep-mtp the MTP layer after them."""
        return int(self.require("num_hidden_layers")) + self.kept_mtp

    # ---- vocabulary ---------------------------------------------------------------------------------------
    @property
    def _kimi_vocab(self) -> bool:
        """ik reads Kimi-K2's tiktoken vocabulary instead of tokenizer.json exactly when vocab_size is 163840."""
        return self.hparams.get("vocab_size") == KIMI_VOCAB_SIZE

    def detect_pre_tokenizer(self) -> str:
        if self._kimi_vocab:
            return TiktokenFiles(self.tokenizer_dir()).detect_pre_tokenizer()
        return super().detect_pre_tokenizer()

    def set_vocab(self, gw: GGUFWriter, pre_tokenizer: str) -> None:
        if self._kimi_vocab:
            write_tiktoken_vocab(gw, self.tokenizer_dir(), KIMI_VOCAB_SIZE, pre_tokenizer)
        else:
            super().set_vocab(gw, pre_tokenizer)

    # ---- config -------------------------------------------------------------------------------------------
    def _key_length(self) -> int:
        head_dim = self.hparams.get("head_dim")
        return int(head_dim) if head_dim is not None else int(self.require("qk_nope_head_dim")) + int(
            self.require("qk_rope_head_dim"))

    def set_gguf_parameters(self, gw: GGUFWriter) -> None:
        super().set_gguf_parameters(gw)
        h = self.hparams
        gw.add_leading_dense_block_count(h.get("first_k_dense_replace", 0))
        gw.add_vocab_size(self.require("vocab_size"))
        if h.get("q_lora_rank") is not None:
            gw.add_q_lora_rank(h["q_lora_rank"])
        if h.get("kv_lora_rank") is not None:
            gw.add_kv_lora_rank(h["kv_lora_rank"])
        key_length = self._key_length()
        gw.add_key_length(key_length)
        gw.add_value_length(h.get("v_head_dim", key_length))
        gw.add_expert_feed_forward_length(self.require("moe_intermediate_size"))
        gw.add_expert_count(self.require("n_routed_experts"))
        gw.add_expert_shared_count(self.require("n_shared_experts"))
        gw.add_expert_weights_scale(self.require("routed_scaling_factor"))
        gw.add_expert_weights_norm(self.require("norm_topk_prob"))
        scoring = h.get("scoring_func")
        if scoring not in GATING_FUNCS:
            raise ConvertError(f"{self.ckpt.dir / 'config.json'}: scoring_func {scoring!r} is not one of "
                               + ", ".join(GATING_FUNCS))
        gw.add_uint32(f"{self.gguf_arch}.expert_gating_func", GATING_FUNCS[scoring])
        gw.add_rope_dimension_count(self.require("qk_rope_head_dim"))
        scaling = h.get("rope_scaling")
        # ik's condition: a `factor`, `type` (not `rope_type`) == "yarn", and `mscale_all_dim`
        if isinstance(scaling, dict) and "factor" in scaling and scaling.get("type") == "yarn" \
                and "mscale_all_dim" in scaling:
            if "original_max_position_embeddings" not in scaling:
                raise ConvertError(f"{self.ckpt.dir / 'config.json'}: rope_scaling of type yarn needs "
                                   "'original_max_position_embeddings'")
            gw.add_rope_scaling_type(RopeScalingType.YARN)
            gw.add_rope_scaling_factor(scaling["factor"])
            gw.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
            gw.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
        if self.kept_mtp:
            gw.add_nextn_predict_layers(self.kept_mtp)

    # ---- skipping -----------------------------------------------------------------------------------------
    def is_skipped(self, name: str) -> bool:
        """ik's skips, plus every tensor of an MTP/NextN layer (index >= num_hidden_layers), scales included."""
        m = _LAYER_RE.match(name)
        return (m is not None and int(m.group(1)) >= self.block_count) or super().is_skipped(name)

    # ---- FP8 ----------------------------------------------------------------------------------------------
    def _filler(self, name: str, t: SafeTensor) -> tuple[Fill, str]:
        """Writes one HF weight as float32 into a given array (FP8 ones dequantized by their scale); and the
        transform note. Filling in place lets merged experts decode straight into the stacked tensor."""
        if t.dtype not in FP8_DTYPES:
            return (lambda dst: np.copyto(dst, t.to_f32())), ""
        scale = self.ckpt.find(name + SCALE_SUFFIX)
        if scale is None:
            raise ConvertError(f"{t.path}: FP8 tensor {name!r} ({t.dtype}) has no {name + SCALE_SUFFIX!r} in any "
                               "shard; it cannot be dequantized")
        br, bc = self.fp8_tile(name, t)
        if len(t.shape) != 2:
            raise ConvertError(f"{t.path}: FP8 tensor {name!r} has shape {list(t.shape)}; only 2-D weights are tiled")
        grid = (-(-t.shape[0] // br), -(-t.shape[1] // bc))
        if scale.shape != grid:
            raise ConvertError(
                f"{scale.path}: {scale.name!r} has shape {list(scale.shape)}, but {name!r} {list(t.shape)} in "
                f"{br}x{bc} tiles (config.json quantization_config.weight_block_size) needs {list(grid)}: the block "
                "size does not fit this weight"
            )
        note = f"fp8 dequant x weight_scale_inv {list(grid)} ({br}x{bc} tiles)"

        def fill(dst: np.ndarray) -> None:
            if t.dtype == "F8_E4M3":
                np.take(E4M3_TABLE, t.raw(), out=dst, mode="clip")  # uint8 codes: always in the 256-entry table
            else:
                np.copyto(dst, t.to_f32())
            dequantize_fp8(dst, scale.to_f32(), (br, bc))

        return fill, note

    def _check_scale(self, name: str, t: SafeTensor) -> None:
        weight = self.ckpt.find(name[: -len(SCALE_SUFFIX)])
        if weight is None or weight.dtype not in FP8_DTYPES:
            what = "no such tensor" if weight is None else f"it is {weight.dtype}, not FP8"
            raise ConvertError(f"{t.path}: scale {name!r} belongs to {name[: -len(SCALE_SUFFIX)]!r}, but {what}")

    # ---- tensors ------------------------------------------------------------------------------------------
    def _rename(self, name: str, t: SafeTensor) -> str:
        try:
            return self.gguf_name(name)
        except ConvertError:
            raise ConvertError(
                f"{t.path}: tensor {name!r} has no mapping for {self.gguf_arch} (is this checkpoint really a "
                f"{'/'.join(self.hf_architectures)}, as config.json says?)"
            ) from None

    def map_tensor(self, name: str, t: SafeTensor) -> list[OutTensor]:
        if name.endswith(SCALE_SUFFIX):
            self._check_scale(name, t)
            return []  # consumed by its weight's loader
        if "mlp.experts" in name:
            return self._experts.add(name, t)
        fill, note = self._filler(name, t)
        load = _allocating(fill, t.shape) if t.dtype in FP8_DTYPES else t.to_f32
        if name.endswith("e_score_correction_bias"):
            gguf = self._rename(name.replace("e_score_correction_bias", "e_score_correction.bias"), t)
            return [OutTensor(gguf, t.shape, name, load, t.dtype, note)]
        gguf = self._rename(name, t)
        if name.endswith("kv_b_proj.weight"):
            return self._split_kv_b(name, t, gguf, load, note)
        return [OutTensor(gguf, t.shape, name, load, t.dtype, note)]

    def _split_kv_b(self, name: str, t: SafeTensor, gguf: str, load: Callable[[], np.ndarray],
                    note: str) -> list[OutTensor]:
        """ik keeps the fused kv_b and adds per-head k_b (nope rows, transposed) and v_b, split by KV head."""
        n_kv = int(self.require("num_key_value_heads"))
        nope, v = int(self.require("qk_nope_head_dim")), int(self.require("v_head_dim"))
        rows, rank = t.shape if len(t.shape) == 2 else (-1, -1)
        if rows != n_kv * (nope + v):
            raise ConvertError(
                f"{t.path}: tensor {name!r} has shape {list(t.shape)}; config.json implies "
                f"num_key_value_heads x (qk_nope_head_dim + v_head_dim) = {n_kv * (nope + v)} rows"
            )
        sep = "; " if note else ""

        def k_b() -> np.ndarray:
            return load().reshape(n_kv, nope + v, rank)[:, :nope].transpose(0, 2, 1).reshape(n_kv * rank, nope)

        def v_b() -> np.ndarray:
            return load().reshape(n_kv, nope + v, rank)[:, nope:].reshape(n_kv * v, rank)

        base = gguf.replace(".attn_kv_b.", ".")
        return [
            OutTensor(gguf, t.shape, name, load, t.dtype, note + sep + "kept fused; also split into k_b/v_b"),
            OutTensor(base.replace(".weight", ".attn_k_b.weight"), (n_kv * rank, nope), name, k_b, t.dtype,
                      note + sep + "kv_b split: k_b (nope rows per head, transposed)"),
            OutTensor(base.replace(".weight", ".attn_v_b.weight"), (n_kv * v, rank), name, v_b, t.dtype,
                      note + sep + "kv_b split: v_b (v rows per head)"),
        ]

    def finish(self) -> None:
        self._experts.finish()

    # ---- shape checks -------------------------------------------------------------------------------------
    def check_shapes(self, out: OutTensor) -> None:
        h = self.hparams
        hidden, vocab = int(self.require("hidden_size")), int(self.require("vocab_size"))
        if not out.name.startswith("blk."):
            want = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden),
                    "output_norm.weight": (hidden,)}.get(out.name)
            self._expect(out, want)
            return
        bid = block_id(out.name)
        assert bid is not None
        key = out.name.split(".", 2)[2]
        n_head = int(self.require("num_attention_heads"))
        nope, rope = int(self.require("qk_nope_head_dim")), int(self.require("qk_rope_head_dim"))
        v, kv_lora = int(self.require("v_head_dim")), int(self.require("kv_lora_rank"))
        q_lora = h.get("q_lora_rank")
        n_exp, moe_ff = int(self.require("n_routed_experts")), int(self.require("moe_intermediate_size"))
        sh_ff = int(self.require("n_shared_experts")) * moe_ff
        dense = bid < int(h.get("first_k_dense_replace", 0))
        ff = int(h.get("intermediate_size") or 0)
        attn = {
            "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
            "attn_kv_a_mqa.weight": (kv_lora + rope, hidden), "attn_kv_a_norm.weight": (kv_lora,),
            "attn_output.weight": (hidden, n_head * v),
        }
        if q_lora is None:
            attn["attn_q.weight"] = (n_head * (nope + rope), hidden)
        else:
            attn |= {"attn_q_a.weight": (int(q_lora), hidden), "attn_q_a_norm.weight": (int(q_lora),),
                     "attn_q_b.weight": (n_head * (nope + rope), int(q_lora))}
        ffn = {"ffn_gate.weight": (ff, hidden), "ffn_up.weight": (ff, hidden), "ffn_down.weight": (hidden, ff)}
        moe = {
            "ffn_gate_inp.weight": (n_exp, hidden), "exp_probs_b.bias": (n_exp,),
            "ffn_gate_exps.weight": (n_exp, moe_ff, hidden), "ffn_up_exps.weight": (n_exp, moe_ff, hidden),
            "ffn_down_exps.weight": (n_exp, hidden, moe_ff),
            "ffn_gate_shexp.weight": (sh_ff, hidden), "ffn_up_shexp.weight": (sh_ff, hidden),
            "ffn_down_shexp.weight": (hidden, sh_ff),
        }
        nextn = {"nextn.eh_proj.weight": (hidden, 2 * hidden), "nextn.enorm.weight": (hidden,),
                 "nextn.hnorm.weight": (hidden,), "nextn.shared_head_norm.weight": (hidden,),
                 "nextn.embed_tokens.weight": (vocab, hidden), "nextn.shared_head_head.weight": (vocab, hidden)}
        if key in attn:
            self._expect(out, attn[key])
        elif key in nextn:
            self._expect(out, nextn[key])
        elif key in ffn or key in moe:
            table, other = (ffn, moe) if dense else (moe, ffn)
            if key in other:
                kind = "dense (first_k_dense_replace)" if dense else "MoE (past first_k_dense_replace)"
                raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} -> {out.name} does not belong in layer "
                                   f"{bid}, which config.json makes {kind}")
            self._expect(out, table[key] if ff or not dense else None)  # no intermediate_size: nothing to check
        elif key in ("attn_q.weight", "attn_q_a.weight", "attn_q_b.weight", "attn_q_a_norm.weight"):
            raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} does not fit config.json q_lora_rank "
                               f"{q_lora!r} (q_proj without it, q_a_proj/q_b_proj with it)")

    def _expect(self, out: OutTensor, want: tuple[int, ...] | None) -> None:
        if want is not None and tuple(out.shape) != want:
            raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} -> {out.name} has shape {list(out.shape)} "
                               f"but config.json implies {list(want)}")


def _allocating(fill: Fill, shape: tuple[int, ...]) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        out = np.empty(shape, dtype=np.float32)
        fill(out)
        return out

    return load
