"""How a GGUF model is split into shards: the names, the split.* keys and which tensor goes to which shard, as
llama.cpp's gguf-split and mainline's converter define them (the facts both the reader and the writer need)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ikquant.errors import SizeError, SplitError

#: the keys every shard carries: split.no (0-based, u16), split.count (u16), split.tensors.count (i32, the whole
#: model's)
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
SHARD_NAME = re.compile(r"(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")


def shard_path(prefix: str | Path, no: int, count: int) -> Path:
    """The name of shard `no` (1-based) of `count`: PREFIX-0000no-of-0000count.gguf."""
    return Path(f"{prefix}-{no:05d}-of-{count:05d}.gguf")


def split_prefix(path: Path) -> Path:
    """An output path without its `.gguf` suffix: what its shards' names are built from."""
    return path.with_suffix("") if path.suffix == ".gguf" else path


def parse_split_size(text: str) -> int:
    """--split-max-size as mainline's converter reads it: a number of bytes, or one followed by K, M or G (powers of
    1000: 48G is 48e9 bytes); binary units (48GiB) are taken as well."""
    from ikquant.sizes import parse_size

    m = re.fullmatch(r"\s*(\d+)\s*([KMGT])\s*", text, re.IGNORECASE)
    if m:
        size = int(m.group(1)) * 1000 ** "KMGT".index(m.group(2).upper()) * 1000
    else:
        size = parse_size(text, "--split-max-size")
    if size <= 0:
        raise SizeError(f"--split-max-size {text!r} must be positive")
    return size


@dataclass(frozen=True)
class SplitLimits:
    """How an output is split: a new shard starts before a tensor that would take the current one past `max_bytes`
    of tensor data or `max_tensors` tensors (a shard holds at least one tensor); `metadata_first` keeps the first
    shard to the metadata alone (--no-tensor-first-split)."""

    max_bytes: int = 0
    max_tensors: int = 0
    metadata_first: bool = False

    @property
    def splits(self) -> bool:
        return bool(self.max_bytes or self.max_tensors or self.metadata_first)


def assign_shards(sizes: list[int], limits: SplitLimits) -> list[int]:
    """The 0-based shard of each tensor (given its data size, in file order), by mainline's GGUFWriter rule."""
    shard = 1 if limits.metadata_first else 0
    in_shard, bytes_in_shard = 0, 0
    out = []
    for n in sizes:
        if in_shard and ((limits.max_tensors and in_shard >= limits.max_tensors)
                         or (limits.max_bytes and bytes_in_shard + n > limits.max_bytes)):
            shard, in_shard, bytes_in_shard = shard + 1, 0, 0
        out.append(shard)
        in_shard += 1
        bytes_in_shard += n
    return out


@dataclass(frozen=True)
class OutputShards:
    """How an output is laid out in files: split by `limits`, or in the input's shards (`keep_input`, ik's
    --keep-split); with `partial` (ik's --partial-requant), existing shards this run would write identically are left
    as they are."""

    limits: SplitLimits = SplitLimits()
    keep_input: bool = False
    partial: bool = False

    def __post_init__(self) -> None:
        if self.keep_input and self.limits.splits:
            raise SplitError("--keep-split keeps the input's shards: it does not go with --split-max-size, "
                             "--split-max-tensors or --no-tensor-first-split")


def output_shards(max_size: str | None, max_tensors: int, metadata_first: bool, keep_input: bool = False,
                  partial: bool = False) -> OutputShards:
    """The command-line split options (--split-max-size, --split-max-tensors, --no-tensor-first-split,
    --keep-split, --partial-requant) as one OutputShards."""
    if max_tensors < 0:
        raise SplitError(f"--split-max-tensors {max_tensors} must be positive")
    limits = SplitLimits(parse_split_size(max_size) if max_size else 0, max_tensors, metadata_first)
    return OutputShards(limits, keep_input, partial)


def shard_names(path: Path, layout: list[int], metadata_first: bool = False) -> list[Path]:
    """The files of an output to `path` whose tensors go to the shards `layout` says: `path` itself when that is one
    shard, else its shards' names."""
    count = max([*layout, 1 if metadata_first else 0]) + 1
    return [path] if count == 1 else [shard_path(split_prefix(path), i + 1, count) for i in range(count)]


def shard_plan(path: Path, sizes: list[int], limits: SplitLimits) -> list[tuple[Path, int, int]]:
    """(file, tensors, tensor bytes) of each shard `limits` makes of tensors of `sizes` written to `path`."""
    layout = assign_shards(sizes, limits)
    return [(name, layout.count(i), sum(n for n, s in zip(sizes, layout) if s == i))
            for i, name in enumerate(shard_names(path, layout, limits.metadata_first))]
