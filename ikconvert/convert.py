"""The architecture-independent conversion pipeline: plan every tensor, write the header, stream the data.

Order of work mirrors ik's converter so that the file is identical: tensors in the order the architecture emits
them while walking the checkpoint (sorted per shard), ik's squeeze, ik's output-type rules, then metadata in ik's
key order (general.*, architecture keys, tokenizer keys, quantization version). Unlike ik, data is read and written
one tensor at a time after the header (memory bounded by the largest tensor), problems are found before the
output exists, and the output appears only once complete.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import Metadata, size_label
from gguf.gguf_writer import GGUFValue

from ikconvert.archs.base import Arch, OutTensor, arch_for
from ikconvert.checkpoint import Checkpoint
from ikconvert.errors import ConvertError
from ikquant.errors import QuantInputError
from ikquant.formats.base import find_bad_value
from ikquant.ftypes import FileType, file_type
from ikquant.gguf_io import GGUFStreamWriter, KeyValue
from ikquant.split_layout import SplitLimits
from ikquant.types import GGMLType, type_by_name

log = logging.getLogger(__name__)

#: --outtype values: ik's file types of the same name (their ids and base types live in ikquant/ftypes.py)
OUTTYPES: dict[str, FileType] = {name: file_type(name.upper())
                                 for name in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q6_0")}
# ik's converter keeps these tensors at Q5_0 (q4_* outtypes) or Q6_0 (q5_* outtypes): a small but usable file
RAISED_NAMES = ("token_embd.weight", "output.weight")
RAISED_SUFFIXES = (".attn_v.weight", ".attn_k.weight", ".attn_qkv.weight")
ALWAYS_F32_NAMES = ("position_embd.weight", "token_types.weight")
#: block tensors mainline's converter keeps in F32 whatever the output type (routers, the delta-net's conv kernel)
ALWAYS_F32_SUFFIXES = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight")


@dataclass
class PlannedTensor:
    """An OutTensor with its final (squeezed) shape and storage type decided."""

    out: OutTensor
    shape: tuple[int, ...]
    type: GGMLType
    note: str = ""


def squeeze_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """ik squeezes every tensor: all size-1 dims go, [1] becomes a 0-d scalar."""
    return tuple(d for d in shape if d != 1)


def choose_type(out: OutTensor, shape: tuple[int, ...], outtype: str) -> tuple[GGMLType, str]:
    """ik's prepare_tensors type rules, including the F16 fallback for rows Q8_0 cannot hold."""
    if out.encoded:
        return type_by_name(out.encoded), ""
    if len(shape) <= 1 or out.name.endswith("_norm.weight"):
        return type_by_name("F32"), ""
    always_f32 = out.name.startswith("blk.") and out.name.endswith(ALWAYS_F32_SUFFIXES)
    # a source without `.weight` is a bias or a raw parameter, except transformers 5's fused experts (mainline
    # names them `.weight` and quantizes them)
    is_weight = out.source.endswith(".weight") or out.name.endswith("_exps.weight")
    if always_f32 or out.name in ALWAYS_F32_NAMES or not is_weight:
        return type_by_name("F32"), ""
    gtype = OUTTYPES[outtype].base
    if out.name in RAISED_NAMES or (out.name.startswith("blk.") and out.name.endswith(RAISED_SUFFIXES)):
        if outtype in ("q4_0", "q4_1"):
            gtype = type_by_name("Q5_0")
        elif outtype in ("q5_0", "q5_1"):
            gtype = type_by_name("Q6_0")
    if shape[-1] % gtype.block_size:
        return type_by_name("F16"), f"row length {shape[-1]} is not a multiple of {gtype.block_size}: F16"
    return gtype, ""


def resolve_outtype(outtype: str, ckpt: Checkpoint) -> str:
    """`auto` as ik defines it: f16 when the first tensor is stored as F16, else bf16."""
    outtype = outtype.lower()
    if outtype == "auto":
        first = next(ckpt.iter_tensors(), None)
        return "f16" if first is not None and first[1].dtype == "F16" else "bf16"
    if outtype not in OUTTYPES:
        raise ConvertError(f"--outtype {outtype!r} is not one of: {', '.join([*OUTTYPES, 'auto'])}")
    return outtype


class Converter:
    """One conversion: checkpoint folder + options -> a GGUF plan, then the file."""

    def __init__(self, src: Path, outtype: str = "f16", pre_tokenizer: str | None = None,
                 allow_nonfinite: bool = False, model_name: str | None = None,
                 arch_options: dict[str, Any] | None = None, hub_repo: str | None = None):
        self.ckpt = Checkpoint(src)
        self.arch: Arch = arch_for(self.ckpt, arch_options)
        self.outtype = resolve_outtype(outtype, self.ckpt)
        self.arch.file_type = OUTTYPES[self.outtype].id
        self.pre_tokenizer = pre_tokenizer
        self.allow_nonfinite = allow_nonfinite
        self.model_name = model_name
        #: `org/repo` when the checkpoint came from the hub: general.repo_url (and the name, when nothing else does)
        self.hub_repo = hub_repo
        self.plan: list[PlannedTensor] = []
        #: HF tensors the architecture drops on purpose, as ik does (e.g. DeepSeek's MTP layers)
        self.skipped: list[str] = []
        #: the files written: one, or the shards of a split output
        self.outputs: list[Path] = []

    def build_plan(self) -> list[PlannedTensor]:
        """Map every checkpoint tensor to its GGUF tensors (no weight data is read)."""
        self.ckpt.verify_index()
        planned: list[PlannedTensor] = []
        seen: dict[str, str] = {}
        outs = list(self.arch.extra_tensors())
        for name, tensor in self.ckpt.iter_tensors():
            if self.arch.is_skipped(name):
                self.skipped.append(name)
                continue
            outs.extend(self.arch.map_tensor(name, tensor))
        self.arch.finish()
        outs.extend(self.arch.trailing_tensors())
        for out in outs:
            if out.name in seen:
                raise ConvertError(f"{self.ckpt.dir}: {out.source!r} and {seen[out.name]!r} both map to {out.name!r}")
            seen[out.name] = out.source
            self.arch.check_shapes(out)
            shape = squeeze_shape(out.shape) if out.squeeze else tuple(out.shape)
            gtype, note = choose_type(out, shape, self.outtype)
            planned.append(PlannedTensor(out, shape, gtype, note))
        if not planned:
            raise ConvertError(f"{self.ckpt.dir}: the checkpoint has no tensors")
        if self.pre_tokenizer is None:
            self.pre_tokenizer = self.arch.detect_pre_tokenizer()
        self.plan = planned
        return planned

    def _metadata(self, writer: GGUFStreamWriter) -> None:
        gw = writer.gw
        gw.add_type("model")
        total, shared, expert, count = gw.get_total_parameter_count()
        meta = Metadata.load(None, self.ckpt.dir, self.model_name, total)
        for key in [k for k in vars(meta) if k.startswith("sampling_")]:
            setattr(meta, key, None)  # ik's converter does not write generation_config.json sampler keys
        if self.hub_repo is not None and meta.repo_url is None:
            meta.repo_url = f"https://huggingface.co/{self.hub_repo}"
        if meta.name is None:
            meta.name = self.hub_repo.split("/")[1] if self.hub_repo is not None else self.ckpt.dir.name
        if meta.size_label is None and total > 0 and self.arch.writes_size_label:
            meta.size_label = size_label(total, shared, expert, count)
        meta.set_gguf_meta_model(gw)
        self.arch.set_gguf_parameters(gw)
        assert self.pre_tokenizer is not None, "build_plan resolves the pre-tokenizer"
        self.arch.set_vocab(gw, self.pre_tokenizer)
        gw.add_quantization_version(2)

    def write(self, outfile: Path, progress: Callable[[PlannedTensor, int], None] | None = None,
              split: SplitLimits | None = None, overrides: list[KeyValue] | None = None) -> Path:
        """Write the GGUF (to a temporary name, renamed when complete), split per `split`, with `overrides` (ik's
        --override-kv) replacing or adding keys; returns the output path (the first shard of a split)."""
        if not self.plan:
            self.build_plan()
        with GGUFStreamWriter(outfile, self.arch.gguf_arch, split=split) as writer:
            for p in self.plan:
                writer.add_tensor_info(p.out.name, p.shape, p.type)
            self._metadata(writer)
            for kv in overrides or []:
                writer.gw.kv_data[0][kv.key] = GGUFValue(kv.value, kv.type, kv.sub_type)
            for p in self.plan:
                data = self._encode(p)
                writer.write_tensor(p.out.name, data)
                if progress is not None:
                    progress(p, data.nbytes)
            path = writer.finish()
        self.outputs = writer.outputs
        return path

    def _encode(self, p: PlannedTensor) -> np.ndarray:
        if p.out.encoded:
            return _encoded_bytes(p)
        x = np.ascontiguousarray(p.out.load(), dtype=np.float32)
        if x.shape != p.out.shape:
            raise ConvertError(f"{p.out.source!r}: transform produced shape {x.shape}, expected {p.out.shape}")
        rows = x.reshape(-1, p.shape[-1] if p.shape else 1)
        if find_bad_value(rows) is not None:
            bad = int(np.size(x) - np.count_nonzero(np.isfinite(x)))
            if not self.allow_nonfinite:
                raise ConvertError(
                    f"{self.ckpt.dir}: tensor {p.out.source!r} holds {bad} NaN/Inf values; "
                    "pass --allow-nonfinite to keep them (float output types only)"
                )
            if p.type.name not in ("F32", "F16", "BF16"):
                raise ConvertError(f"tensor {p.out.source!r}: NaN/Inf cannot be stored as {p.type.name}")
            return _float_bits(x, p.type.name)
        try:
            return p.type.require_codec().quantize(rows)
        except QuantInputError as exc:
            raise ConvertError(f"tensor {p.out.source!r} -> {p.out.name}: {exc}") from None


def _encoded_bytes(p: PlannedTensor) -> np.ndarray:
    """An architecture's pre-encoded tensor, checked against the size its declared type and shape imply."""
    data = np.ascontiguousarray(p.out.load())
    want = p.type.tensor_bytes(tuple(reversed(p.shape)))
    if data.nbytes != want:
        raise ConvertError(f"tensor {p.out.source!r} -> {p.out.name}: {data.nbytes} encoded bytes, {p.type.name} "
                           f"{list(p.shape)} needs {want}")
    return data


def _float_bits(x: np.ndarray, type_name: str) -> np.ndarray:
    """Plain float encodings that keep NaN/Inf (only reached with --allow-nonfinite)."""
    from ikquant.formats.numeric import f32_to_bf16_bits

    if type_name == "F32":
        return x
    if type_name == "F16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16)
    return f32_to_bf16_bits(x)
