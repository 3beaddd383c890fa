"""DFlashDraftModel (z-lab block-diffusion drafts) -> arch `dflash-draft`, as ik's converter writes it.

A draft is a small Qwen3-style stack (optionally with attention biases, as the gpt-oss-20b draft has) plus `fc`
and `hidden_norm`, which project the target's hidden states into it. It has no tokenizer and usually no embeddings
or LM head: those come from the target model, so `--target-model-dir` is required and supplies the vocabulary,
the target vocab_size (text_config first) and the target hidden size used to infer n_target_features.

The block tensors are Qwen3's, except that post_attention_layernorm becomes `post_attention_norm`: the
dflash-draft tensor list has ATTN_POST_NORM and no FFN_NORM. Like ik: rope.dimension_count defaults to head_dim 128 when the
config has no head_dim, and a draft with output.weight but no token_embd is rejected. Unlike ik, a transformers-5
config with rope_theta (or partial_rotary_factor) only inside `rope_parameters` gets rope.freq_base (and the rotary
width) from there: ik writes no freq_base for it and its runtime then ropes at 10000, not what the draft computes. Unlike ik, tensor shapes are checked against the configs (ik's
runtime would refuse the file later), and a target folder without tokenizer.json is an error before anything is
written rather than whatever the installed transformers makes of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFWriter, RopeScalingType

from ikconvert.archs.base import Arch, OutTensor, lazy, register, with_rope_parameters
from ikconvert.checkpoint import Checkpoint, block_id
from ikconvert.errors import ConvertError
from ikconvert.safetensors_io import SafeTensor

_SINK_SUFFIX = ".self_attn.attention_sink_bias"


@dataclass
class DFlashKeys:
    """The draft-specific metadata, resolved (and validated) before anything is written."""

    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    n_target_features: int
    sliding_window: int | None
    swa_pattern: list[bool]


@register
class DFlashDraftArch(Arch):
    hf_architectures = ("DFlashDraftModel",)
    gguf_arch = "dflash-draft"
    accepted_options = ("target_model_dir",)
    # HF names after ik's normalisation (a bare `layers.N.*`, `norm`, `embed_tokens` gain the `model.` prefix)
    tensor_map = {
        "model.embed_tokens": "token_embd",
        "lm_head": "output",
        "output": "output",
        "model.norm": "output_norm",
        "model.layers.{bid}.input_layernorm": "blk.{bid}.attn_norm",
        "model.layers.{bid}.post_attention_layernorm": "blk.{bid}.post_attention_norm",
        "model.layers.{bid}.self_attn.q_proj": "blk.{bid}.attn_q",
        "model.layers.{bid}.self_attn.k_proj": "blk.{bid}.attn_k",
        "model.layers.{bid}.self_attn.v_proj": "blk.{bid}.attn_v",
        "model.layers.{bid}.self_attn.o_proj": "blk.{bid}.attn_output",
        "model.layers.{bid}.self_attn.q_norm": "blk.{bid}.attn_q_norm",
        "model.layers.{bid}.self_attn.k_norm": "blk.{bid}.attn_k_norm",
        "model.layers.{bid}.self_attn.g_proj": "blk.{bid}.attn_gate",
        "model.layers.{bid}.self_attn.attention_sink_bias": "blk.{bid}.attn_sinks",
        "model.layers.{bid}.mlp.gate_proj": "blk.{bid}.ffn_gate",
        "model.layers.{bid}.mlp.up_proj": "blk.{bid}.ffn_up",
        "model.layers.{bid}.mlp.down_proj": "blk.{bid}.ffn_down",
    }

    def __init__(self, ckpt: Checkpoint, options: dict[str, Any] | None = None):
        super().__init__(ckpt, options)
        self.hparams = with_rope_parameters(self.hparams)
        self.config_path = ckpt.dir / "config.json"
        self.target_dir = self._target_dir()
        self.target_raw = self._target_config()
        text = self.target_raw.get("text_config")
        self.target_text = {**self.target_raw, **text} if isinstance(text, dict) else self.target_raw
        self._check_target_tokenizer()
        cfg = self.hparams.get("dflash_config")
        self.dflash_cfg: dict[str, Any] = cfg if isinstance(cfg, dict) else {}
        self.keys = self._resolve_keys()
        self._seen: set[str] = set()
        self._vocab_size: int | None = None

    # ---- target model -----------------------------------------------------------------------------------
    def _target_dir(self) -> Path:
        folder = self.options.get("target_model_dir")
        if folder is None:
            raise ConvertError(
                f"{self.ckpt.dir}: a DFlashDraftModel draft has no tokenizer of its own; pass --target-model-dir "
                "<the target model's folder> (it supplies the tokenizer, vocab_size and hidden size)"
            )
        folder = Path(folder)
        if not folder.is_dir():
            raise ConvertError(f"--target-model-dir {folder}: not a folder")
        return folder

    def _target_config(self) -> dict[str, Any]:
        path = self.target_dir / "config.json"
        if not path.is_file():
            raise ConvertError(f"--target-model-dir {self.target_dir}: no config.json")
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ConvertError(f"{path}: invalid JSON ({exc})") from None
        if not isinstance(cfg, dict):
            raise ConvertError(f"{path}: not a JSON object")
        model_type = str(cfg.get("model_type", ""))
        archs = cfg.get("architectures")
        if not isinstance(archs, list):
            archs = []
        if model_type.startswith("gemma4") or any(str(a).startswith("Gemma4") for a in archs):
            raise ConvertError(f"{path}: Gemma4 targets use a SentencePiece vocabulary, which is not supported yet")
        return cfg

    def _check_target_tokenizer(self) -> None:
        if not (self.target_dir / "tokenizer.json").is_file():
            raise ConvertError(
                f"--target-model-dir {self.target_dir}: no tokenizer.json (the draft's vocabulary is its target's)"
            )

    def tokenizer_dir(self) -> Path:
        return self.target_dir

    def _target_hidden_size(self) -> int:
        raw = self.target_raw
        for value in (raw.get("hidden_size"), raw.get("backbone_hidden_size")):
            if value is not None:
                return int(value)
        text = raw.get("text_config")
        if isinstance(text, dict) and text.get("hidden_size") is not None:
            return int(text["hidden_size"])
        raise ConvertError(
            f"{self.target_dir / 'config.json'}: none of hidden_size, backbone_hidden_size, text_config.hidden_size "
            f"is set (needed for dflash.n_target_features, which {self.config_path} does not give)"
        )

    def vocab_size(self) -> int:
        """ik's choice: the target's (text_config) vocab_size, else the draft's, else the tokenizer's size."""
        from ikconvert.vocab import HFTokenizerFiles

        if self._vocab_size is None:
            size = self.target_text.get("vocab_size") or self.hparams.get("vocab_size")
            self._vocab_size = int(size) if size else len(HFTokenizerFiles(self.target_dir).vocab)
        return self._vocab_size

    def set_vocab(self, gw: GGUFWriter, pre_tokenizer: str) -> None:
        from ikconvert.vocab import write_bpe_vocab

        write_bpe_vocab(gw, self.target_dir, self.vocab_size(), pre_tokenizer)

    # ---- metadata ---------------------------------------------------------------------------------------
    def _required(self, name: str) -> Any:
        value = self.dflash_cfg[name] if name in self.dflash_cfg else self.hparams.get(name)
        if value is None:
            raise ConvertError(f"{self.config_path}: dflash_config.{name} (or top-level {name}) is required")
        return value

    def _as_int(self, name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise ConvertError(f"{self.config_path}: {name} must be an integer, got {value!r}")
        return int(value)

    def _resolve_keys(self) -> DFlashKeys:
        cfg, h = self.dflash_cfg, self.hparams
        block_size = self._as_int("block_size", self._required("block_size"))
        mask_token_id = self._as_int("mask_token_id", self._required("mask_token_id"))
        ids = self._required("target_layer_ids")
        if not isinstance(ids, list) or not ids:
            raise ConvertError(f"{self.config_path}: target_layer_ids must be a non-empty list, got {ids!r}")
        target_layer_ids = [self._as_int("target_layer_ids", i) for i in ids]
        if "n_target_features" in cfg:
            n_target_features = self._as_int("dflash_config.n_target_features", cfg["n_target_features"])
        elif "n_target_features" in h:
            n_target_features = self._as_int("n_target_features", h["n_target_features"])
        else:
            n_target_features = self._target_hidden_size() * len(target_layer_ids)
        use_swa, window = h.get("use_sliding_window"), h.get("sliding_window")
        if use_swa is None and "use_swa" in cfg:
            use_swa = bool(cfg["use_swa"])
        if window is None and "swa_window_size" in cfg:
            window = self._as_int("dflash_config.swa_window_size", cfg["swa_window_size"])
        pattern: list[bool] = []
        if not (use_swa and window):
            window = None
        elif h.get("layer_types"):
            pattern = [str(t) == "sliding_attention" for t in h["layer_types"]]
        else:
            pattern = [True] * int(h.get("num_hidden_layers", self.block_count))
        return DFlashKeys(block_size, mask_token_id, target_layer_ids, n_target_features,
                          None if window is None else int(window), pattern)

    def set_gguf_parameters(self, gw: GGUFWriter) -> None:
        super().set_gguf_parameters(gw)
        h, k, arch = self.hparams, self.keys, self.gguf_arch
        gw.add_causal_attention(False)
        gw.add_rope_dimension_count(int(h.get("partial_rotary_factor", 1.0) * h.get("head_dim", 128)))
        self._rope_scaling(gw)
        if (base := self.dflash_cfg.get("backbone_rotary_base")) is not None:
            gw.add_float32(f"{arch}.dflash.backbone_rotary_base", float(base))
        if (scale := self.dflash_cfg.get("attention_value_scale", h.get("attention_value_scale"))) is not None:
            gw.add_float32(f"{arch}.attention.value_scale", float(scale))
        gw.add_uint32(f"{arch}.dflash.block_size", k.block_size)
        gw.add_uint32(f"{arch}.dflash.mask_token_id", k.mask_token_id)
        gw.add_array(f"{arch}.dflash.target_layer_ids", k.target_layer_ids)
        gw.add_uint32(f"{arch}.dflash.n_target_features", k.n_target_features)
        if k.sliding_window is not None:
            gw.add_sliding_window(k.sliding_window)
            gw.add_sliding_window_pattern(k.swa_pattern)

    def _rope_scaling(self, gw: GGUFWriter) -> None:
        scaling = self.hparams.get("rope_scaling")
        if not isinstance(scaling, dict):
            return
        kind = scaling.get("rope_type", scaling.get("type"))
        factor = scaling.get("factor")
        if factor is None or kind not in ("linear", "yarn"):
            return
        gw.add_rope_scaling_type(RopeScalingType.LINEAR if kind == "linear" else RopeScalingType.YARN)
        gw.add_rope_scaling_factor(factor)
        if kind != "yarn":
            return
        if (orig := scaling.get("original_max_position_embeddings")) is not None:
            gw.add_rope_scaling_orig_ctx_len(orig)
        if (ext := scaling.get("extrapolation_factor")) is not None:
            gw.add_rope_scaling_yarn_ext_factor(ext)
        if (attn := scaling.get("attention_factor", scaling.get("attn_factor"))) is not None:
            gw.add_rope_scaling_yarn_attn_factor(attn)
        if (fast := scaling.get("beta_fast")) is not None:
            gw.add_rope_scaling_yarn_beta_fast(fast)
        if (slow := scaling.get("beta_slow")) is not None:
            gw.add_rope_scaling_yarn_beta_slow(slow)

    # ---- tensors ----------------------------------------------------------------------------------------
    def map_tensor(self, name: str, t: SafeTensor) -> list[OutTensor]:
        top = name[len("model."):] if name.startswith("model.") else name
        if top == "fc.weight":
            gguf = "dflash_fc.weight"
        elif top == "hidden_norm.weight":
            gguf = "dflash_hidden_norm.weight"
        elif top.endswith(_SINK_SUFFIX):
            bid = block_id(name)
            if bid is None:
                raise ConvertError(f"{self.ckpt.dir}: tensor {name!r} has no block number")
            gguf = f"blk.{bid}.attn_sinks.weight"
        elif name in ("norm.weight", "embed_tokens.weight") or name.startswith("layers."):
            gguf = self.gguf_name("model." + name)
        else:
            gguf = self.gguf_name(name)
        self._seen.add(gguf)
        return [OutTensor(gguf, t.shape, name, lazy(t), t.dtype)]

    def finish(self) -> None:
        if not self._seen:
            raise ConvertError(
                f"{self.ckpt.dir}: the draft has no tensors; a DFlash draft takes token_embd/output from its target "
                "but must hold its own block weights"
            )
        if "output.weight" in self._seen and "token_embd.weight" not in self._seen:
            raise ConvertError(
                f"{self.ckpt.dir}: the draft has an LM head (output.weight) but no embed_tokens (token_embd.weight); "
                "ik requires token_embd whenever a draft carries its own output"
            )

    def check_shapes(self, out: OutTensor) -> None:
        h = self.hparams
        embd = int(self.find_hparam(["hidden_size"]))
        n_head = int(self.find_hparam(["num_attention_heads"]))
        n_kv = int(h.get("num_key_value_heads") or n_head)
        head = int(h.get("head_dim") or embd // n_head)
        ff = int(self.find_hparam(["intermediate_size"]))
        vocab = self.vocab_size()
        q, kv = n_head * head, n_kv * head
        expected = {
            "token_embd.weight": (vocab, embd), "output.weight": (vocab, embd), "output_norm.weight": (embd,),
            "dflash_fc.weight": (embd, self.keys.n_target_features), "dflash_hidden_norm.weight": (embd,),
            "attn_norm.weight": (embd,), "post_attention_norm.weight": (embd,),
            "attn_q.weight": (q, embd), "attn_k.weight": (kv, embd), "attn_v.weight": (kv, embd),
            "attn_output.weight": (embd, q), "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
            "attn_output.bias": (embd,), "attn_q_norm.weight": (head,), "attn_k_norm.weight": (head,),
            "attn_gate.weight": (n_head, embd), "attn_sinks.weight": (n_head,),
            "ffn_gate.weight": (ff, embd), "ffn_up.weight": (ff, embd), "ffn_down.weight": (embd, ff),
        }
        key = out.name.split(".", 2)[-1] if out.name.startswith("blk.") else out.name
        if out.name.startswith("blk.") and int(out.name.split(".")[1]) >= self.block_count:
            raise ConvertError(f"{self.ckpt.dir}: tensor {out.source!r} is beyond num_hidden_layers={self.block_count}")
        want = expected.get(key)
        if want is not None and tuple(out.shape) != want:
            raise ConvertError(
                f"{self.ckpt.dir}: tensor {out.source!r} has shape {list(out.shape)} but {self.config_path.name} "
                f"(and the target's) imply {list(want)}"
            )
