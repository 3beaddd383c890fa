"""What every architecture module provides, and the mechanics they share.

An architecture is a declarative tensor map (HF name template -> GGUF name template, `{bid}` for the block index)
plus the handful of transforms it really needs. The converter core asks it for metadata and, tensor by tensor,
for the GGUF tensors an HF tensor becomes; loading is deferred (`OutTensor.load`) so a whole plan is known, and
the header written, before any weight is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from gguf import GGUFWriter

from ikconvert.checkpoint import Checkpoint
from ikconvert.errors import CheckpointError, ConvertError
from ikconvert.safetensors_io import SafeTensor


@dataclass
class OutTensor:
    """One GGUF tensor to write: its name, numpy-order shape (before ik's squeeze), the HF tensor it came from."""

    name: str
    shape: tuple[int, ...]
    source: str
    load: Callable[[], np.ndarray]
    src_dtype: str
    transform: str = ""
    #: ggml type name when `load` returns the stored bytes already encoded (MXFP4 blocks, I32 tables): written
    #: as they are, whatever the output type
    encoded: str = ""
    #: False keeps the size-1 dims ik's squeeze would drop (a shape the runtime reads exactly as stored)
    squeeze: bool = True


def lazy(t: SafeTensor, fn: Callable[[np.ndarray], np.ndarray] | None = None) -> Callable[[], np.ndarray]:
    """A loader that reads `t` as float32 only when called, optionally transformed."""
    if fn is None:
        return t.to_f32
    return lambda: fn(t.to_f32())


def dequantize_fp8(w: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> None:
    """W[r, c] *= scale[r // br, c // bc] in float32, in place, one tile row at a time (no full-size scale grid);
    edge tiles are partial. DeepSeek-V3 stores the scales as F32, V4 as E8M0 powers of two."""
    br, bc = block
    for i in range(scale.shape[0]):
        rows = w[i * br:(i + 1) * br]
        rows *= np.repeat(scale[i], bc)[: w.shape[1]]


#: writes one tensor's values into a given array (in place: merged experts decode straight into their stack)
Fill = Callable[[np.ndarray], None]


def with_rope_parameters(hparams: dict[str, Any]) -> dict[str, Any]:
    """The config with rope_theta and partial_rotary_factor lifted from a transformers-5 `rope_parameters` where the
    top level lacks them (top-level keys win): what the model computes, so the file says it too."""
    params = hparams.get("rope_parameters")
    if not isinstance(params, dict):
        return hparams
    return {**{k: params[k] for k in ("rope_theta", "partial_rotary_factor") if k in params}, **hparams}


def stacked(fills: Sequence[Fill], shape: tuple[int, ...], dtype: type = np.float32) -> Callable[[], np.ndarray]:
    """A layer's experts merged into one [E, *shape] array, each written in place one at a time (the peak is the
    stack, not the stack plus every expert's copy)."""

    def load() -> np.ndarray:
        out: np.ndarray = np.empty((len(fills), *shape), dtype=dtype)
        for i, fill in enumerate(fills):
            fill(out[i])
        return out

    return load


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names one routed-expert tensor (`template` with {bid}, {x} the expert, {proj}), and its
    projections in the order ik merges them, each with the `ffn_{kind}_exps` it becomes."""

    template: str
    projs: tuple[tuple[str, str], ...]

    def pattern(self) -> re.Pattern[str]:
        """A full-match regex with groups bid, x and proj."""
        alternatives = "|".join(re.escape(p) for p, _ in self.projs)
        fields = {"bid": r"(?P<bid>\d+)", "x": r"(?P<x>\d+)", "proj": f"(?P<proj>{alternatives})"}
        parts = re.split(r"(\{bid\}|\{x\}|\{proj\})", self.template)
        return re.compile("".join(fields[p[1:-1]] if p in ("{bid}", "{x}", "{proj}") else re.escape(p) for p in parts))

    def name(self, bid: int | str, x: int | str, proj: str) -> str:
        return self.template.format(bid=bid, x=x, proj=proj)


#: `model.layers.L.mlp.experts.X.{down,gate,up}_proj.weight`, merged down, gate, up (DeepSeek, Qwen3-MoE)
MLP_EXPERTS = ExpertNames("model.layers.{bid}.mlp.experts.{x}.{proj}.weight",
                          (("down_proj", "down"), ("gate_proj", "gate"), ("up_proj", "up")))


class ExpertMerger:
    """A model's routed experts (by default `MLP_EXPERTS`), buffered as they arrive (no data read) and merged into
    ik's 3-D `blk.L.ffn_{kind}_exps` in `names.projs` order when a layer's last one arrives; `count_key` is the
    config key that says how many there are, `filler` reads one expert into a given array (and says how: a
    transform note); by default a plain float32 copy."""

    def __init__(self, n_experts: int, count_key: str,
                 filler: Callable[[str, SafeTensor], tuple[Fill, str]] | None = None,
                 names: ExpertNames = MLP_EXPERTS):
        self.n_experts, self.count_key, self.names = n_experts, count_key, names
        self.filler = filler or (lambda name, t: ((lambda dst: np.copyto(dst, t.to_f32())), ""))
        self._pattern = names.pattern()
        #: per layer, the expert tensors seen so far: (expert, projection) -> (HF name, tensor)
        self._layers: dict[int, dict[tuple[int, str], tuple[str, SafeTensor]]] = {}

    def add(self, name: str, t: SafeTensor) -> list[OutTensor]:
        """Buffer one routed-expert tensor; the layer's three merged tensors on its last one."""
        n, projs = self.n_experts, self.names.projs
        m = self._pattern.fullmatch(name)
        if m is None or int(m.group("x")) >= n:
            raise ConvertError(f"{t.path}: tensor {name!r} is not one of experts 0..{n - 1} ({self.count_key}) "
                               + self.names.name("L", "X", "{" + ",".join(p for p, _ in projs) + "}"))
        bid = int(m.group("bid"))
        layer = self._layers.setdefault(bid, {})
        layer[(int(m.group("x")), m.group("proj"))] = (name, t)
        if len(layer) < len(projs) * n:
            return []
        del self._layers[bid]
        outs = []
        for proj, kind in projs:
            parts = [layer[(x, proj)] for x in range(n)]
            shape = parts[0][1].shape
            for pname, pt in parts:
                if pt.shape != shape:
                    raise ConvertError(f"{pt.path}: expert tensor {pname!r} has shape {list(pt.shape)}, expert 0's "
                                       f"is {list(shape)}")
            fills = [self.filler(pname, pt) for pname, pt in parts]
            note = f"expert merge: {n} x {list(shape)} stacked"
            if fills[0][1]:
                note += f"; each {fills[0][1]}"
            source = self.names.name(bid, f"{{0..{n - 1}}}", proj)
            outs.append(OutTensor(f"blk.{bid}.ffn_{kind}_exps.weight", (n, *shape), source,
                                  stacked([f for f, _ in fills], shape), parts[0][1].dtype, note))
        return outs

    def finish(self) -> None:
        """ik raises 'Unprocessed experts' for a layer whose experts never completed; so do we, naming them."""
        projs = self.names.projs
        for bid, layer in sorted(self._layers.items()):
            missing = [self.names.name(bid, x, p) for x in range(self.n_experts) for p, _ in projs
                       if (x, p) not in layer]
            some = next(iter(layer.values()))[1].path
            raise ConvertError(
                f"{some.parent}: layer {bid} has {len(layer)} of {len(projs) * self.n_experts} routed-expert tensors "
                f"({self.count_key}={self.n_experts}); missing {len(missing)}: " + ", ".join(missing[:6])
                + (" ..." if len(missing) > 6 else "")
            )


class Arch:
    """Base class: ik's `Model` behaviour shared by every architecture."""

    hf_architectures: ClassVar[tuple[str, ...]] = ()
    gguf_arch: ClassVar[str] = ""
    #: HF name template -> GGUF name template; `{bid}` stands for the block index; tried with .weight and .bias
    tensor_map: ClassVar[dict[str, str]] = {}
    #: converter options (Converter arch_options keys) this architecture reads; others must not be given
    accepted_options: ClassVar[tuple[str, ...]] = ()
    #: HF names ik drops on purpose (regexes, full match)
    skipped: ClassVar[tuple[str, ...]] = (r".*\.attention\.masked_bias", r".*\.attention\.bias",
                                          r".*\.rotary_emb\.inv_freq")
    #: general.file_type of the output (the Converter sets it); ik writes it last among the base keys, so keys an
    #: architecture adds after super().set_gguf_parameters() follow it
    file_type: int = 0
    #: False for layouts whose reference writer has no general.size_label (ik derives one from the tensor count)
    writes_size_label: ClassVar[bool] = True

    def __init__(self, ckpt: Checkpoint, options: dict[str, Any] | None = None):
        #: converter options an architecture may read (e.g. target_model_dir for DFlash drafts, mtp for DeepSeek-V4)
        self.options: dict[str, Any] = {k: v for k, v in (options or {}).items() if v}
        for key in self.options:
            if key not in self.accepted_options:
                flag = "--" + key.replace("_", "-")
                raise ConvertError(f"{flag} does not apply to {'/'.join(self.hf_architectures)} checkpoints")
        self.ckpt = ckpt
        self.hparams: dict[str, Any] = ckpt.config
        self._patterns = [(self._compile(hf), gg) for hf, gg in self.tensor_map.items()]
        self._skipped = [re.compile(p) for p in self.skipped]

    # ---- config -------------------------------------------------------------------------------------------
    def require(self, key: str) -> Any:
        """config.json's `key`; a ConvertError naming the file and key when it is missing or null."""
        value = self.hparams.get(key)
        if value is None:
            raise ConvertError(f"{self.ckpt.dir / 'config.json'}: {key!r} is required for {self.hf_architectures[0]}")
        return value

    def fp8_tile(self, name: str, t: SafeTensor) -> tuple[int, int]:
        """The (rows, cols) tile one FP8 scale covers, from quantization_config.weight_block_size: never guessed
        from the scale grid (a 192-row weight with 128-row tiles has a 2-row grid either way)."""
        qc = self.hparams.get("quantization_config")
        block = qc.get("weight_block_size") if isinstance(qc, dict) else None
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ConvertError(
                f"{t.path}: tensor {name!r} is {t.dtype}, but config.json quantization_config.weight_block_size "
                f"is {block!r}, not a pair of positive tile sizes (rows, columns): the tile size of its scales is "
                "not guessed")
        return block[0], block[1]

    def find_hparam(self, keys: Iterable[str], optional: bool = False) -> Any:
        for key in keys:
            if key in self.hparams:
                return self.hparams[key]
        if optional:
            return None
        raise ConvertError(f"{self.ckpt.dir / 'config.json'}: none of {list(keys)} is set")

    @property
    def block_count(self) -> int:
        return int(self.find_hparam(["n_layers", "num_hidden_layers", "n_layer", "num_layers"]))

    def set_gguf_parameters(self, gw: GGUFWriter) -> None:
        """ik's Model.set_gguf_parameters: the keys every architecture writes, in ik's order."""
        gw.add_block_count(self.block_count)
        if (n_ctx := self.find_hparam(["max_position_embeddings", "n_ctx"], optional=True)) is not None:
            gw.add_context_length(n_ctx)
        gw.add_embedding_length(self.find_hparam(["hidden_size", "n_embd"]))
        if (n_ff := self.find_hparam(["intermediate_size", "n_inner"], optional=True)) is not None:
            gw.add_feed_forward_length(n_ff)
        gw.add_head_count(self.find_hparam(["num_attention_heads", "n_head"]))
        if (n_head_kv := self.hparams.get("num_key_value_heads")) is not None:
            gw.add_head_count_kv(n_head_kv)
        if (rope_theta := self.hparams.get("rope_theta")) is not None:
            gw.add_rope_freq_base(rope_theta)
        if (eps := self.hparams.get("rms_norm_eps")) is not None:
            gw.add_layer_norm_rms_eps(eps)
        if (eps := self.find_hparam(["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"], optional=True)) is not None:
            gw.add_layer_norm_eps(eps)
        if (n_experts := self.hparams.get("num_local_experts")) is not None:
            gw.add_expert_count(n_experts)
        if (n_used := self.hparams.get("num_experts_per_tok")) is not None:
            gw.add_expert_used_count(n_used)
        if (head_dim := self.hparams.get("head_dim")) is not None:
            gw.add_key_length(head_dim)
            gw.add_value_length(head_dim)
        gw.add_file_type(self.file_type)

    def tokenizer_dir(self) -> Path:
        """The folder whose tokenizer files describe the vocabulary (DFlash drafts use their target's)."""
        return self.ckpt.dir

    def detect_pre_tokenizer(self) -> str:
        from ikconvert.vocab import HFTokenizerFiles

        return HFTokenizerFiles(self.tokenizer_dir()).detect_pre_tokenizer()

    def set_vocab(self, gw: GGUFWriter, pre_tokenizer: str) -> None:
        from ikconvert.vocab import HFTokenizerFiles, write_bpe_vocab

        folder = self.tokenizer_dir()
        vocab_size = int(self.hparams.get("vocab_size") or 0) or len(HFTokenizerFiles(folder).vocab)
        write_bpe_vocab(gw, folder, vocab_size, pre_tokenizer)

    # ---- tensors ------------------------------------------------------------------------------------------
    @staticmethod
    def _compile(template: str) -> re.Pattern[str]:
        return re.compile(re.escape(template).replace(re.escape("{bid}"), r"(?P<bid>\d+)"))

    def is_skipped(self, name: str) -> bool:
        return any(p.fullmatch(name) for p in self._skipped)

    def gguf_name(self, name: str) -> str:
        """The GGUF name of an HF tensor through the declarative map (suffix .weight/.bias kept)."""
        for suffix in (".weight", ".bias"):
            if not name.endswith(suffix):
                continue
            base = name[: -len(suffix)]
            for pattern, target in self._patterns:
                m = pattern.fullmatch(base)
                if m:
                    bid = m.groupdict().get("bid")
                    if bid is not None and int(bid) >= self.block_count:
                        break
                    return target.format(bid=bid) + suffix
        raise ConvertError(
            f"{self.ckpt.dir}: tensor {name!r} has no mapping for {self.gguf_arch}; the converter will not drop it "
            "silently (is this checkpoint really a " + "/".join(self.hf_architectures) + "?)"
        )

    def map_tensor(self, name: str, t: SafeTensor) -> list[OutTensor]:
        """The GGUF tensors an HF tensor becomes (default: a plain rename)."""
        return [OutTensor(self.gguf_name(name), t.shape, name, lazy(t), t.dtype)]

    def extra_tensors(self) -> list[OutTensor]:
        """Tensors ik generates before walking the checkpoint (e.g. rope_freqs)."""
        return []

    def trailing_tensors(self) -> list[OutTensor]:
        """Tensors written after the whole walk (e.g. the MXFP4 experts ik appends last with DeepSeek-V4 --mtp)."""
        return []

    def check_shapes(self, out: OutTensor) -> None:
        """Raise if `out`'s shape disagrees with config.json (subclasses know their shapes)."""

    def finish(self) -> None:
        """Called after the walk: raise about anything left half-processed."""


_REGISTRY: dict[str, type[Arch]] = {}


def register(cls: type[Arch]) -> type[Arch]:
    for name in cls.hf_architectures:
        _REGISTRY[name] = cls
    return cls


def arch_for(ckpt: Checkpoint, options: dict[str, Any] | None = None) -> Arch:
    """The architecture module for a checkpoint's config.json `architectures[0]`."""
    import ikconvert.archs  # noqa: F401  (registers every architecture)

    try:
        name = ckpt.architecture
    except CheckpointError as exc:
        raise ConvertError(str(exc)) from None
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ConvertError(
            f"{ckpt.dir / 'config.json'}: architecture {name!r} is not supported; supported: "
            + ", ".join(sorted(_REGISTRY))
        )
    return cls(ckpt, options)


def architectures() -> dict[str, type[Arch]]:
    """Every Hugging Face architecture name ikconvert converts, in name order, with its converter class."""
    import ikconvert.archs  # noqa: F401  (registers every architecture)

    return dict(sorted(_REGISTRY.items()))
