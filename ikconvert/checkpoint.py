"""A Hugging Face checkpoint on disk (or fetched from the hub): config, shards, and its tensors in ik's order.

ik's converter walks the shards in sorted file-name order and, inside a shard, tensors in sorted name order; the
GGUF tensor order follows that walk, so `iter_tensors` reproduces it. Unlike ik, an index that names a missing
shard, or disagrees with the shards' contents, is an error before anything is written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ikconvert.errors import CheckpointError, SafetensorsError
from ikconvert.safetensors_io import SafeTensor, SafetensorsFile
from ikquant.errors import InputNotFoundError

INDEX_NAME = "model.safetensors.index.json"
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "README.md", "additional_chat_templates/*"]


def hub_repo(source: str) -> str | None:
    """`org/repo` of an `hf://org/repo[@rev]` source (None for a local folder)."""
    if not source.startswith("hf://"):
        return None
    return source[len("hf://"):].partition("@")[0]


def resolve_source(source: str) -> Path:
    """A local folder, or `hf://org/repo[@rev]` downloaded (or taken from the offline cache) by huggingface_hub."""
    if source.startswith("hf://"):
        spec = source[len("hf://"):]
        repo, _, revision = spec.partition("@")
        if repo.count("/") != 1:
            raise CheckpointError(f"{source!r}: expected hf://org/repo[@revision]")
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

        try:
            return Path(snapshot_download(repo, revision=revision or None, allow_patterns=HUB_PATTERNS))
        except (HfHubHTTPError, HFValidationError, LocalEntryNotFoundError, OSError) as exc:
            # the hub's own failures (unknown repo or revision, gated, offline without a cached copy, no network)
            raise CheckpointError(f"{source}: could not fetch from the Hugging Face hub ({exc})") from None
    path = Path(source)
    if not path.exists():
        raise InputNotFoundError(f"{source}: no such folder (and not an hf://org/repo reference)")
    if not path.is_dir():
        raise CheckpointError(f"{source}: not a folder (and not an hf://org/repo reference)")
    return path


class Checkpoint:
    """Config, tokenizer files and lazily opened safetensors shards of one model folder."""

    def __init__(self, folder: str | os.PathLike[str]):
        self.dir = Path(folder)
        config_path = self.dir / "config.json"
        if not config_path.is_file():
            raise CheckpointError(f"{self.dir}: no config.json")
        try:
            self.config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{config_path}: invalid JSON ({exc})") from None
        self.part_names = self._find_parts()
        self._weight_map = self._read_index()
        self._open: dict[str, SafetensorsFile] = {}

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures")
        if not isinstance(archs, list) or not archs:
            raise CheckpointError(f"{self.dir / 'config.json'}: no 'architectures' entry")
        return str(archs[0])

    def _find_parts(self) -> list[str]:
        parts = sorted(n for n in os.listdir(self.dir) if n.startswith("model") and n.endswith(".safetensors"))
        if parts:
            return parts
        index = self.dir / INDEX_NAME
        if index.is_file():
            wm = self._load_weight_map(index)
            return sorted(set(wm.values()))
        if any(n.endswith(".bin") for n in os.listdir(self.dir)):
            raise CheckpointError(f"{self.dir}: only PyTorch .bin weights found; convert them to safetensors first")
        raise CheckpointError(f"{self.dir}: no model*.safetensors files")

    @staticmethod
    def _load_weight_map(index: Path) -> dict[str, str]:
        try:
            wm = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{index}: invalid JSON ({exc})") from None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        return {str(k): str(v) for k, v in wm.items()}

    def _read_index(self) -> dict[str, str] | None:
        index = self.dir / INDEX_NAME
        if not index.is_file():
            if len(self.part_names) > 1:
                raise CheckpointError(f"{self.dir}: {len(self.part_names)} shards but no {INDEX_NAME}")
            return None
        wm = self._load_weight_map(index)
        missing = sorted({f for f in wm.values() if not (self.dir / f).is_file()})
        if missing:
            names = [k for k, v in wm.items() if v == missing[0]]
            raise CheckpointError(
                f"{index}: shard {missing[0]} is missing (it holds {len(names)} tensors, e.g. {names[0]!r})"
            )
        return wm

    def shard(self, part: str) -> SafetensorsFile:
        if part not in self._open:
            path = self.dir / part
            if not path.is_file():
                raise CheckpointError(f"{path}: shard is missing")
            try:
                self._open[part] = SafetensorsFile(path)
            except SafetensorsError as exc:
                raise CheckpointError(str(exc)) from None
        return self._open[part]

    def verify_index(self) -> None:
        """The index's tensor names must be exactly the shards' tensor names (checked before converting)."""
        if self._weight_map is None:
            return
        seen: dict[str, str] = {}
        for part in self.part_names:
            for name in self.shard(part).tensors:
                seen[name] = part
        not_in_shards = sorted(set(self._weight_map) - set(seen))
        if not_in_shards:
            n = not_in_shards[0]
            raise CheckpointError(
                f"{self.dir / INDEX_NAME}: tensor {n!r} is listed in shard {self._weight_map[n]} but no shard holds it"
            )
        not_in_index = sorted(set(seen) - set(self._weight_map))
        if not_in_index:
            n = not_in_index[0]
            raise CheckpointError(f"{self.dir / seen[n]}: tensor {n!r} is missing from {INDEX_NAME}")

    def find(self, name: str) -> SafeTensor | None:
        """Tensor `name` from whichever shard holds it (e.g. an FP8 weight's scale), or None."""
        if self._weight_map is not None and name in self._weight_map:
            return self.shard(self._weight_map[name]).tensors.get(name)
        for part in self.part_names:
            t = self.shard(part).tensors.get(name)
            if t is not None:
                return t
        return None

    def iter_tensors(self) -> Iterator[tuple[str, SafeTensor]]:
        """(name, lazy tensor) in ik's order: shards by file name, names sorted inside each shard."""
        for part in self.part_names:
            yield from self.shard(part).tensors.items()

    def tokenizer_json(self) -> dict[str, Any] | None:
        return self._json("tokenizer.json")

    def tokenizer_config(self) -> dict[str, Any] | None:
        return self._json("tokenizer_config.json")

    def _json(self, name: str) -> dict[str, Any] | None:
        path = self.dir / name
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: invalid JSON ({exc})") from None


def block_id(name: str) -> int | None:
    """ik's block id: the first dot-separated part of the HF name that is all digits."""
    for part in name.split("."):
        if part.isdecimal():
            return int(part)
    return None


