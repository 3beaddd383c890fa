"""The streaming whole-model quantizer: GGUF in, GGUF out, one tensor at a time.

The plan (each tensor's new type and why) is made from the input's header alone. Then tensors are read from the
memory-mapped input, quantized in row batches (memory: one batch of float32 rows plus the output tensor), and
streamed to a temporary file that replaces the output only when complete. Metadata is copied as ik copies it:
every input key in place, general.quantization_version and general.file_type updated (or appended), the imatrix
provenance keys appended.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from ikquant.ftypes import FileType
from ikquant.gguf_io import GGUFFile, GGUFStreamWriter, KeyValue, TensorInfo
from ikquant.imatrix import Imatrix
from ikquant.recipes import RULES_COMPLETE, Decision, eligible, ftype_rule, with_row_fallback
from ikquant.types import GGMLType

FLOAT_TYPES = ("F32", "F16", "BF16")
#: float32 input held per quantization batch (bytes)
BATCH_BYTES = 64 << 20


class QuantizeError(ValueError):
    """A quantization that cannot proceed as asked (names the tensor or option at fault)."""


@dataclass
class QuantizeOptions:
    ftype: FileType
    pure: bool = False
    imatrix: Imatrix | None = None
    allow_requantize: bool = False
    leave_output_tensor: bool = False


@dataclass
class TensorPlan:
    info: TensorInfo
    type: GGMLType
    quantize: bool
    reason: str
    imatrix_entry: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def new_bytes(self) -> int:
        return self.type.tensor_bytes(self.info.ne) if self.quantize else self.info.nbytes


def make_plan(src: GGUFFile, opts: QuantizeOptions) -> list[TensorPlan]:
    """Each tensor's type and the reason, exactly as ik's llama-quantize would decide (no data is read)."""
    if not opts.pure and opts.ftype.name not in RULES_COMPLETE:
        raise QuantizeError(f"--type {opts.ftype.name}: ik's per-tensor rules for this type are not implemented yet; "
                            "pass --pure to give every eligible tensor that type")
    has_output = "output.weight" in src.tensors
    plans = []
    for info in src.tensors.values():
        plans.append(_plan_tensor(info, opts, has_output))
    return plans


def _plan_tensor(info: TensorInfo, opts: QuantizeOptions, has_output: bool) -> TensorPlan:
    name = info.name
    keep = TensorPlan(info, info.type, False, "")
    if not eligible(name, len(info.ne), info.type):
        keep.reason = "never quantized (1-D, norm, integer or excluded tensor)"
        return keep
    if opts.leave_output_tensor and name == "output.weight":
        keep.reason = "--leave-output-tensor"
        return keep
    base = opts.ftype.base
    decision = Decision(base, "--pure" if opts.pure else f"{opts.ftype.name} default")
    if not opts.pure and base.name not in FLOAT_TYPES:
        decision = ftype_rule(name, info.n_per_row, opts.ftype, has_output)
    notes = []
    fallback = with_row_fallback(decision.type, info.n_per_row)
    if fallback is not None:
        decision = fallback
        notes.append(fallback.reason)
    if decision.type is info.type and name != "output.weight":
        keep.reason = f"already {info.type.name}"
        return keep
    if info.n_per_row % decision.type.block_size:
        raise QuantizeError(f"tensor {name!r}: {info.n_per_row} columns are not a multiple of {decision.type.name}'s "
                            f"block size {decision.type.block_size}")
    if info.type.name not in FLOAT_TYPES and not opts.allow_requantize:
        raise QuantizeError(f"tensor {name!r} is already quantized ({info.type.name}); requantizing loses accuracy "
                            "twice, pass --allow-requantize to do it anyway")
    plan = TensorPlan(info, decision.type, True, decision.reason, notes=notes)
    if opts.imatrix is not None:
        n_mat = info.ne[2] if len(info.ne) > 2 else 1
        _, plan.imatrix_entry = opts.imatrix.lookup(name, info.n_per_row * n_mat)
    return plan


def output_metadata(src: GGUFFile, opts: QuantizeOptions) -> list[KeyValue]:
    """The output's key/values in ik's order: input keys (updated in place), then new ones."""
    kvs = [kv for kv in src.kv() if not kv.key.startswith("split.")]
    by_key = {kv.key: kv for kv in kvs}

    def set_u32(key: str, value: int) -> None:
        if key in by_key:
            by_key[key].value = value
        else:
            kv = KeyValue(key, value, GGUFValueType.UINT32)
            kvs.append(kv)
            by_key[key] = kv

    set_u32("general.quantization_version", 2)
    if opts.imatrix is not None:
        imat = opts.imatrix
        extra = [KeyValue("quantize.imatrix.file", str(imat.path), GGUFValueType.STRING)]
        if imat.dataset:
            extra.append(KeyValue("quantize.imatrix.dataset", imat.dataset, GGUFValueType.STRING))
        extra.append(KeyValue("quantize.imatrix.entries_count", len(imat.entries), GGUFValueType.INT32))
        if imat.chunks > 0:
            extra.append(KeyValue("quantize.imatrix.chunks_count", imat.chunks, GGUFValueType.INT32))
        for kv in extra:
            if kv.key in by_key:
                by_key[kv.key].value = kv.value
            else:
                kvs.append(kv)
                by_key[kv.key] = kv
    set_u32("general.file_type", opts.ftype.id)
    return kvs


def quantize_tensor(src: GGUFFile, plan: TensorPlan, imatrix: Imatrix | None) -> np.ndarray:
    """The new bytes of one tensor, quantized in row batches (bounded memory)."""
    info = plan.info
    codec = plan.type.require_codec()
    n = info.n_per_row
    n_mat = info.ne[2] if len(info.ne) > 2 else 1
    rows_per_mat = info.n_rows // n_mat
    weights = None
    if imatrix is not None and plan.imatrix_entry is not None:
        weights, _ = imatrix.lookup(info.name, n * n_mat)
    raw = src.raw(info.name)
    src_codec = info.type.require_codec()
    out = np.empty((info.n_rows, plan.type.row_bytes(n)), dtype=np.uint8)
    batch = max(1, min(rows_per_mat, BATCH_BYTES // (4 * n)))
    for m in range(n_mat):
        w = None if weights is None else weights[m * n : (m + 1) * n]
        for r0 in range(m * rows_per_mat, (m + 1) * rows_per_mat, batch):
            r1 = min(r0 + batch, (m + 1) * rows_per_mat)
            rows = src_codec.dequantize(raw[r0:r1], n)
            out[r0:r1] = codec.quantize(rows, w)
    return out


def quantize_model(src_path: Path, dst_path: Path, opts: QuantizeOptions,
                   progress: Callable[[TensorPlan], None] | None = None) -> list[TensorPlan]:
    """Quantize `src_path` into `dst_path` per `opts`; returns the executed plan."""
    if Path(src_path).resolve() == Path(dst_path).resolve():
        raise QuantizeError(f"output {dst_path} is the input file; choose another output path")
    src = GGUFFile(src_path)
    plans = make_plan(src, opts)
    with GGUFStreamWriter(dst_path, src.architecture, alignment=src.alignment) as writer:
        for kv in output_metadata(src, opts):
            if kv.key != "general.architecture":
                writer.add_kv(kv)
        for p in plans:
            writer.add_tensor_info(p.name, p.info.shape, p.type)
        for p in plans:
            data = quantize_tensor(src, p, opts.imatrix) if p.quantize else src.raw(p.name)
            writer.write_tensor(p.name, data)
            if progress is not None:
                progress(p)
        writer.finish()
    return plans
