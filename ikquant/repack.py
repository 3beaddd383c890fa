"""Converting a file's tensors to ik's row-interleaved forms and back, without requantizing (`ikquant --repack`).

An interleaved type regroups its base type's bits (ikquant/formats/interleaved.py), so repacking moves bytes and
changes no value: the repacked file decodes to the same floats. ik's rules: the token embeddings stay as they are
(ik's kernels never read them as a matrix), and a tensor whose rows are not whole groups keeps its base type.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ikquant.errors import RepackError
from ikquant.formats.interleaved import InterleavedCodec
from ikquant.gguf_io import GGUFStreamWriter, TensorInfo
from ikquant.shards import GGUFModel
from ikquant.split_layout import OutputShards
from ikquant.types import GGMLType, all_types, type_by_name


@dataclass(frozen=True)
class RepackStep:
    """One tensor of the output: its type, and why."""

    info: TensorInfo
    type: GGMLType
    reason: str

    @property
    def changed(self) -> bool:
        return self.type is not self.info.type


def _regroups_base(t: GGMLType) -> bool:
    """Whether `t` is an interleaved form whose bytes regroup its base type's (IQ1_S_R4 and Q8_K_R8 do not)."""
    import ikquant.formats  # noqa: F401  (registers the codecs)

    return t.base is not None and isinstance(t.codec, InterleavedCodec) and t.codec.unpacks_to_base


def interleaved_form(base: GGMLType) -> GGMLType | None:
    """The interleaved type that regroups `base` (None: it has none here)."""
    return next((t for t in all_types() if t.base == base.name and _regroups_base(t)), None)


def plan_repack(src: GGUFModel, pattern: str | None = None, unpack: bool = False) -> list[RepackStep]:
    """Each tensor's type in the output: interleaved where it can be (and `pattern` matches its name), or, with
    `unpack`, every interleaved tensor back to its base type."""
    try:
        regex = re.compile(pattern) if pattern is not None else None
    except re.error as exc:
        raise RepackError(f"--repack-pattern {pattern!r} is not a regular expression: {exc}") from None
    steps = []
    for name, info in src.tensors.items():
        t = info.type
        if unpack:
            if _regroups_base(t):
                assert t.base is not None
                steps.append(RepackStep(info, type_by_name(t.base), f"unpacked to {t.base}"))
            else:
                steps.append(RepackStep(info, t, "kept" if t.base is None else
                                        f"kept: {t.name} is not a regrouping of {t.base}, it has no plain form"))
            continue
        target = interleaved_form(t)
        if target is None or (regex is not None and not regex.search(name)):
            steps.append(RepackStep(info, t, "kept"))
        elif name == "token_embd.weight":
            steps.append(RepackStep(info, t, "token embeddings stay non-interleaved"))
        elif info.n_rows % target.row_group:
            steps.append(RepackStep(info, t, f"{info.n_rows} rows are not whole {target.row_group}-row groups"))
        else:
            steps.append(RepackStep(info, target, f"repacked to {target.name}"))
    return steps


def _regrouped(raw: np.ndarray, step: RepackStep) -> np.ndarray:
    """The tensor's bytes in the step's type: the interleaved codec's regrouping, forward or back."""
    inverse = step.info.type.base is not None
    codec = (step.info.type if inverse else step.type).require_codec()
    assert isinstance(codec, InterleavedCodec), step.info.type.name
    return codec.unpack(raw) if inverse else codec.pack(raw)


def repack_model(src_path: Path, dst_path: Path, pattern: str | None = None, unpack: bool = False,
                 progress: Callable[[RepackStep], None] | None = None,
                 shards: OutputShards | None = None) -> tuple[list[RepackStep], list[Path], list[Path]]:
    """Write `src_path`'s tensors (one file, or a split model) to `dst_path` repacked (or unpacked), laid out in
    files per `shards`; metadata and every other tensor copied. Returns the steps, the files (one, or the shards)
    and the shards left as they were."""
    if Path(src_path).resolve() == Path(dst_path).resolve():
        raise RepackError(f"output {dst_path} is the input file; choose another output path")
    src = GGUFModel(src_path)
    steps = plan_repack(src, pattern, unpack)
    shards = shards or OutputShards()
    keep = shards.keep_input and src.is_split
    with GGUFStreamWriter(dst_path, src.architecture, src.alignment, shards.limits, shards.partial) as writer:
        writer.copy_kvs(src.kv())
        for step in steps:
            writer.add_tensor_info(step.info.name, step.info.shape, step.type,
                                   src.shard_of(step.info.name) if keep else None)
        for step in steps:
            if writer.is_kept(step.info.name):
                continue
            raw = src.raw(step.info.name)
            writer.write_tensor(step.info.name, _regrouped(raw, step) if step.changed else raw)
            src.release(step.info.name)
            if progress is not None:
                progress(step)
        writer.finish()
    return steps, writer.outputs, writer.kept
