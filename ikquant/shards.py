"""Models split over several GGUF files, as llama.cpp's gguf-split and its converters write them.

A split model is `PREFIX-00001-of-0000N.gguf` ... `PREFIX-0000N-of-0000N.gguf`: the first shard holds every
metadata key, every shard holds `split.no` (0-based), `split.count` and `split.tensors.count` (the whole model's
tensor count), and each tensor lives in exactly one shard. `GGUFModel` opens one through its first shard and reads
like a single GGUFFile, so that every tool takes split and unsplit inputs alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ikquant.errors import GGUFFormatError, InputNotFoundError
from ikquant.gguf_io import GGUFFile, KeyValue, TensorInfo
from ikquant.split_layout import SHARD_NAME, SPLIT_KEYS, shard_path


def _split_ints(file: GGUFFile) -> tuple[int, int, int | None]:
    """(split.no, split.count, split.tensors.count) of one file; (0, 1, None) for an unsplit one."""
    count = file.get("split.count")
    if count is None:
        return 0, 1, None
    no, total = file.get("split.no"), file.get("split.tensors.count")
    if no is None or total is None:
        missing = "split.no" if no is None else "split.tensors.count"
        raise GGUFFormatError(f"{file.path}: has split.count but no {missing}: not a shard gguf-split wrote")
    return int(no), int(count), int(total)


class GGUFModel:
    """A GGUF model in one file or in shards, opened through its first (or only) file: its metadata, every tensor
    in shard order (the unsplit file's order), zero-copy bytes from whichever shard holds them."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        first = GGUFFile(self.path)
        no, count, total = _split_ints(first)
        self.shards: list[GGUFFile] = [first]
        if count > 1:
            self.shards = self._open_shards(first, no, count)
        elif no != 0:
            raise GGUFFormatError(f"{self.path}: split.no is {no} but split.count is {count}")
        self.tensors: dict[str, TensorInfo] = {}
        self._home: dict[str, int] = {}  # tensor -> its shard's index
        for i, shard in enumerate(self.shards):
            for name, info in shard.tensors.items():
                if name in self._home:
                    raise GGUFFormatError(f"{shard.path}: tensor {name!r} is also in {self._file(name).path}; "
                                          "these shards are not one split model")
                self.tensors[name] = info
                self._home[name] = i
        if total is not None and total != len(self.tensors):
            raise GGUFFormatError(f"{self.path}: split.tensors.count is {total}, but its {count} shards hold "
                                  f"{len(self.tensors)} tensors")
        self.alignment = first.alignment

    def _open_shards(self, first: GGUFFile, no: int, count: int) -> list[GGUFFile]:
        m = SHARD_NAME.fullmatch(self.path.name)
        if no != 0:
            named = f"; name the first, {shard_path(self.path.parent / m['prefix'], 1, count)}" if m else ""
            raise GGUFFormatError(f"{self.path} is shard {no + 1} of {count} of a split model{named}")
        if m is None or int(m["count"]) != count or int(m["no"]) != 1:
            raise GGUFFormatError(f"{self.path}: the first of {count} shards, but not named "
                                  f"<prefix>-00001-of-{count:05d}.gguf, so its other shards cannot be found")
        prefix = self.path.parent / m["prefix"]
        total = first.get("split.tensors.count")
        shards = [first]
        for i in range(1, count):
            path = shard_path(prefix, i + 1, count)
            if not path.is_file():
                raise InputNotFoundError(f"{self.path}: shard {i + 1} of {count}, {path}, is missing")
            shard = GGUFFile(path)
            s_no, s_count, s_total = _split_ints(shard)
            if s_count != count:
                raise GGUFFormatError(f"{path}: split.count is {s_count}, the first shard {self.path.name} says "
                                      f"{count}: shards of two different splits")
            if s_no != i:
                raise GGUFFormatError(f"{path}: split.no is {s_no}, its name says shard {i + 1} (split.no {i})")
            if s_total != total:
                raise GGUFFormatError(f"{path}: split.tensors.count is {s_total}, the first shard {self.path.name} "
                                      f"says {total}: shards of two different splits")
            shards.append(shard)
        return shards

    def __repr__(self) -> str:
        return f"GGUFModel({str(self.path)!r}, {len(self.shards)} shards, {len(self.tensors)} tensors)"

    @property
    def is_split(self) -> bool:
        return len(self.shards) > 1

    def shard_of(self, name: str) -> int:
        """The 0-based shard that holds tensor `name`."""
        try:
            return self._home[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def kv(self) -> Iterator[KeyValue]:
        """The model's metadata (the first shard's keys, without the split.* keys)."""
        return (kv for kv in self.shards[0].kv() if kv.key not in SPLIT_KEYS)

    def get(self, key: str, default: Any = None) -> Any:
        return self.shards[0].get(key, default)

    def require(self, key: str) -> Any:
        return self.shards[0].require(key)

    @property
    def architecture(self) -> str:
        return self.shards[0].architecture

    def _file(self, name: str) -> GGUFFile:
        return self.shards[self.shard_of(name)]

    def info(self, name: str) -> TensorInfo:
        return self._file(name).info(name)

    def raw(self, name: str, check: bool = True) -> np.ndarray:
        return self._file(name).raw(name, check)

    def release(self, name: str, row0: int = 0, row1: int | None = None) -> None:
        self._file(name).release(name, row0, row1)

    def dequantize(self, name: str) -> np.ndarray:
        return self._file(name).dequantize(name)

    def check_unchanged(self) -> None:
        for shard in self.shards:
            shard.check_unchanged()

    def close(self) -> None:
        for shard in self.shards:
            shard.close()
