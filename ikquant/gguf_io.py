"""GGUF reading and writing that understands every ik_llama.cpp type.

Reading goes through PyPI `gguf`'s parser for the header and key/values; tensor descriptors are built here from
our type registry (the PyPI reader raises on ik's type ids and does not know per-row headers). The file is
memory-mapped: opening a 100 GB model reads only its header.

Writing serializes the header, key/values and tensor infos with PyPI `gguf`'s GGUFWriter, then streams tensor data
one tensor at a time into a temporary file that is renamed over the target only when everything was written; a
split output is several such files, renamed together (ikquant/split_layout.py says how a model is split).
"""

from __future__ import annotations

import io
import math
import mmap
import os
import sys
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.gguf_reader import ReaderField
from gguf.gguf_writer import GGUFValue, WriterState

from ikquant.errors import GGUFFormatError, InputChangedError, InputNotFoundError, SplitError, UnknownTypeError
from ikquant.outputs import partial_path, prepare_output, require_space, write_errors
from ikquant.sizes import format_size
from ikquant.split_layout import SplitLimits, assign_shards, shard_names
from ikquant.types import GGMLType, type_by_id


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's descriptor in a GGUF file. `ne` is ggml order (fastest dim first); `shape` is numpy order."""

    name: str
    ne: tuple[int, ...]
    type: GGMLType
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def n_dims(self) -> int:
        """ggml_n_dims: trailing size-1 dims do not count ({H, 1} is 1-D), at least 1. ik's quantizer decides on
        this, and writes this many dims."""
        dims = len(self.ne)
        while dims > 1 and self.ne[dims - 1] == 1:
            dims -= 1
        return max(dims, 1)

    @property
    def written_shape(self) -> tuple[int, ...]:
        """The numpy-order shape ggml writes for this tensor: `n_dims` dims (a 0-d scalar stays 0-d)."""
        return tuple(reversed(self.ne[:self.n_dims])) if self.ne else ()

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def n_per_row(self) -> int:
        return self.ne[0] if self.ne else 1

    @property
    def n_rows(self) -> int:
        return self.n_elements // self.n_per_row


class _IkReader(GGUFReader):
    """PyPI's reader with tensor descriptors built from the ik type registry."""

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        self.ik_tensors: list[TensorInfo] = []
        seen: set[str] = set()
        file_size = int(self.data.shape[0])
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8")
            if name in seen:
                raise GGUFFormatError(f"duplicated tensor name {name!r}")
            seen.add(name)
            try:
                gtype = type_by_id(int(raw_dtype[0]))
            except UnknownTypeError as exc:
                raise GGUFFormatError(f"tensor {name!r}: {exc}") from None
            ne = tuple(int(d) for d in dims)
            try:
                nbytes = gtype.tensor_bytes(ne)
            except ValueError as exc:
                raise GGUFFormatError(f"tensor {name!r} of type {gtype.name} and dims {ne}: {exc}") from None
            offset = int(start_offs + offset_tensor[0])
            if offset + nbytes > file_size:
                raise GGUFFormatError(
                    f"tensor {name!r} needs bytes {offset}..{offset + nbytes} but the file has only {file_size} "
                    "bytes (truncated?)"
                )
            self.ik_tensors.append(TensorInfo(name, ne, gtype, offset, nbytes))


def _field_value(field: ReaderField) -> Any:
    if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.types) == 1:
        return []
    return field.contents()


@dataclass
class KeyValue:
    """One metadata entry with the exact GGUF value type it was stored as."""

    key: str
    value: Any
    type: GGUFValueType
    sub_type: GGUFValueType | None = None


def file_stamp(path: Path) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime_ns): what changes when a file is replaced, truncated or rewritten."""
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class GGUFFile:
    """A memory-mapped GGUF file: metadata, tensor descriptors, zero-copy raw tensor bytes."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_file():
            raise InputNotFoundError(f"{self.path}: no such file")
        try:
            self._reader = _IkReader(self.path, "r")
        except GGUFFormatError as exc:
            raise GGUFFormatError(f"{self.path}: {exc}") from None
        except (ValueError, IndexError, OverflowError, KeyError) as exc:
            raise GGUFFormatError(f"{self.path}: not a readable GGUF file ({exc})") from None
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in self._reader.ik_tensors}
        self.alignment = int(self._reader.alignment)
        self.data_offset = int(self._reader.data_offset)
        #: file_stamp of the file as it was opened
        self.stamp = file_stamp(self.path)
        # a plain ndarray view of the map: slicing an np.memmap pays memmap.__getitem__ and __array_finalize__
        # (~10 us; a MoE layer's forward slices thousands of tensors and experts)
        self._bytes: np.ndarray = self._reader.data.view(np.ndarray)

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, {len(self.tensors)} tensors)"

    @property
    def keys(self) -> list[str]:
        return [k for k in self._reader.fields if not k.startswith("GGUF.")]

    def kv(self) -> Iterator[KeyValue]:
        """The metadata entries in file order, with their stored value types."""
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            sub = field.types[-1] if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.types) > 1 else None
            yield KeyValue(key, _field_value(field), field.types[0], sub)

    def get(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else _field_value(field)

    def require(self, key: str) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            raise GGUFFormatError(f"{self.path}: metadata key {key!r} is missing")
        return _field_value(field)

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def raw(self, name: str, check: bool = True) -> np.ndarray:
        """The stored bytes of tensor `name` as a read-only uint8 view [n_rows, row_bytes] (no copy).

        The file is first checked to be the one opened (`check`): reading a mapping past a truncated end kills
        the process (SIGBUS), and a file rewritten or replaced since would give another model's bytes."""
        if check:
            self.check_unchanged()
        info = self.info(name)
        return self._bytes[info.offset : info.offset + info.nbytes].reshape(info.n_rows, -1)

    def check_unchanged(self) -> None:
        """Raise InputChangedError if the file was truncated, rewritten, replaced or removed since it was opened."""
        try:
            now = file_stamp(self.path)
        except FileNotFoundError:
            raise InputChangedError(f"{self.path} was removed while being read") from None
        if now != self.stamp:
            what = ("replaced" if now[:2] != self.stamp[:2] else
                    "truncated" if now[2] < self.stamp[2] else "rewritten")
            raise InputChangedError(f"{self.path} was {what} while being read (it is not the file that was opened); "
                                    "start the command again")

    def release(self, name: str, row0: int = 0, row1: int | None = None) -> None:
        """Drop the pages of rows [row0, row1) of tensor `name` from this process (they stay in the page cache):
        once streamed, a tensor's input no longer counts against the resident memory of a tool walking a huge
        model."""
        mm = getattr(self._reader.data, "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        info = self.info(name)
        row_bytes = info.nbytes // max(info.n_rows, 1)
        begin = info.offset + row0 * row_bytes
        end = info.offset + (info.n_rows if row1 is None else row1) * row_bytes
        start = begin - begin % mmap.PAGESIZE
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in numpy order (exact decoding of whatever type it is stored in)."""
        import ikquant.formats  # noqa: F401  (registers codecs)

        info = self.info(name)
        codec = info.type.require_codec()
        out = codec.dequantize(self.raw(name), info.n_per_row)
        return out.reshape(info.shape)

    def close(self) -> None:
        mm = getattr(self._reader.data, "_mmap", None)
        self._reader = None  # type: ignore[assignment]
        self._bytes = None  # type: ignore[assignment]
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass


def exit_cleanly_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so `with` blocks (GGUFStreamWriter) delete their temporary files on a kill
    as they do on Ctrl-C."""
    import signal

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


@dataclass
class _Shard:
    """One output file of a GGUFStreamWriter: its header, and where it is written."""

    path: Path
    header: bytes
    data_bytes: int
    kept: bool = False
    file: BinaryIO | None = None

    @property
    def tmp_path(self) -> Path:
        return partial_path(self.path)


class GGUFStreamWriter:
    """Write a GGUF file, or a split one, tensor by tensor, never holding more than one tensor, renaming into place
    at the end.

    Usage: add metadata through `gw` (a gguf.GGUFWriter that only collects it), declare every tensor with
    `add_tensor_info`, then call `write_tensor` for each tensor in the same order, then `finish()`. Any exception
    (or `abort()`) deletes the temporary files, so a failed run never leaves a partial output. The tensor data's size
    is checked against the free space before the first byte of it is written (ikquant/outputs.py).

    With `split` (or shards given to `add_tensor_info`: an input's layout kept) the output is
    `OUT-00001-of-0000N.gguf` ... (OUT: `path` without `.gguf`), the metadata in the first shard and the split.*
    keys in each, as gguf-split writes them; every shard is renamed into place only once all are complete. A split
    that comes out as one shard is written as `path` itself, unsplit, as mainline's converter does. With `partial`,
    an existing shard whose header is the one this writer would write (its keys, its tensors' names, types and
    shapes) and whose size is right is left as it is (`kept`, and `is_kept` for its tensors), unless the first
    shard's metadata changed: then every shard is written.
    """

    def __init__(self, path: str | os.PathLike[str], arch: str, alignment: int | None = None,
                 split: SplitLimits | None = None, partial: bool = False):
        self.path = Path(path)
        prepare_output(self.path)
        self.split = split or SplitLimits()
        self.partial = partial
        self.gw = GGUFWriter(path=None, arch=arch)
        if alignment is not None and alignment != self.gw.data_alignment:
            self.gw.data_alignment = alignment
        self._order: list[tuple[str, int]] = []
        self._given_shard: list[int | None] = []
        self._next = 0
        self._shards: list[_Shard] = []
        self._started = False
        self._shard_of: dict[str, int] = {}

    def __enter__(self) -> GGUFStreamWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()

    def add_kv(self, kv: KeyValue) -> None:
        """Copy one metadata entry with its exact stored type."""
        self.gw.add_key_value(kv.key, kv.value, kv.type, sub_type=kv.sub_type)

    def copy_kvs(self, kvs: Iterable[KeyValue], skip: Collection[str] = ()) -> None:
        """Copy another file's metadata, less the keys in `skip`; general.architecture is never copied (the writer
        was given it and has written it first)."""
        for kv in kvs:
            if kv.key != "general.architecture" and kv.key not in skip:
                self.add_kv(kv)

    def add_tensor_info(self, name: str, shape: tuple[int, ...], gtype: GGMLType, shard: int | None = None) -> int:
        """Declare a tensor (numpy-order `shape`), in the 0-based `shard` when the layout is given; returns its byte
        size."""
        if self._shards:
            raise ValueError(f"tensor {name!r} declared after writing began")
        nbytes = gtype.tensor_bytes(tuple(reversed(shape)))
        self.gw.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=gtype.id)  # type: ignore[arg-type]
        self._order.append((name, nbytes))
        self._given_shard.append(shard)
        return nbytes

    @property
    def outputs(self) -> list[Path]:
        """The files this writer writes (or keeps): `path`, or its shards in order; known once writing began."""
        return [s.path for s in self._shards] or [self.path]

    @property
    def kept(self) -> list[Path]:
        """The shards left as they were (`partial`)."""
        return [s.path for s in self._shards if s.kept]

    def is_kept(self, name: str) -> bool:
        """Whether tensor `name` lies in a kept shard (its bytes are not to be written)."""
        if not self._shards:
            self._plan()
        return self._shards[self._shard_of[name]].kept

    def _layout(self) -> list[int]:
        if any(s is not None for s in self._given_shard):
            given = [-1 if s is None else s for s in self._given_shard]
            if self.split.splits or min(given) < 0 or any(b < a for a, b in zip(given, given[1:])):
                raise ValueError("a given shard layout names every tensor's shard, in order, without split limits")
            return given
        if not self.split.splits:
            return [0] * len(self._order)
        if self.split.max_bytes:
            name, nbytes = max(self._order, key=lambda t: t[1], default=("", 0))
            if nbytes > self.split.max_bytes:
                raise SplitError(f"--split-max-size ({self.split.max_bytes} bytes) is smaller than tensor {name} "
                                 f"({nbytes} bytes, {format_size(nbytes)}); nothing was written")
        return assign_shards([n for _, n in self._order], self.split)

    def _plan(self) -> None:
        """Decide the shards and their headers (and, with `partial`, which existing ones are kept)."""
        layout = self._layout()
        names = shard_names(self.path, layout, self.split.metadata_first)
        count = len(names)
        align = self.gw.data_alignment
        for i, path in enumerate(names):
            w = GGUFWriter(path=None, arch=self.gw.arch)
            w.data_alignment = align
            w.kv_data = [dict(self.gw.kv_data[0]) if i == 0 else {}]
            if count > 1:
                w.kv_data[0].update({"split.no": GGUFValue(i, GGUFValueType.UINT16),
                                     "split.count": GGUFValue(count, GGUFValueType.UINT16),
                                     "split.tensors.count": GGUFValue(len(self._order), GGUFValueType.INT32)})
            members = [name for (name, _), s in zip(self._order, layout) if s == i]
            w.tensors = [{name: self.gw.tensors[0][name] for name in members}]
            data = sum(-(-n // align) * align for (_, n), s in zip(self._order, layout) if s == i)
            self._shards.append(_Shard(path, _header_bytes(w), data))
            self._shard_of.update((name, i) for name in members)
            if i == 0:
                w.tensors = [{}]
                metadata = _header_bytes(w)
        if self.partial:
            self._keep_unchanged(metadata)

    def _keep_unchanged(self, metadata: bytes) -> None:
        """Mark the existing shards this writer would write identically as kept; none if the first shard's metadata
        (which names the file type and the imatrix, so every tensor's bytes) differs from `metadata`."""
        if not _same_bytes(self._shards[0].path, metadata, skip=(8, 16)):
            return
        for shard in self._shards:
            align = self.gw.data_alignment
            size = -(-len(shard.header) // align) * align + shard.data_bytes
            shard.kept = (shard.path.is_file() and shard.path.stat().st_size == size
                          and _same_bytes(shard.path, shard.header))

    def _start(self) -> None:
        self._started = True
        if not self._shards:
            self._plan()
        written = [s for s in self._shards if not s.kept]
        for shard in written:
            prepare_output(shard.path)
        align = self.gw.data_alignment
        for shard in written:
            with write_errors(shard.path):
                shard.file = open(shard.tmp_path, "wb")
                shard.file.write(shard.header)
                _pad(shard.file, align)
        require_space(self.path, sum(s.data_bytes for s in written))

    def write_tensor(self, name: str, data: np.ndarray) -> None:
        """Write the next tensor's bytes (any dtype; its raw bytes must be the declared size). Tensors of kept shards
        are not written (`is_kept`)."""
        if not self._started:
            self._start()
        self._skip_kept()
        if self._next >= len(self._order):
            raise ValueError(f"tensor {name!r} was not declared")
        want_name, want_bytes = self._order[self._next]
        if name != want_name:
            raise ValueError(f"tensors must be written in declared order: expected {want_name!r}, got {name!r}")
        shard = self._shards[self._shard_of[name]]
        self._next += 1
        data = np.ascontiguousarray(data)
        if data.nbytes != want_bytes:
            raise ValueError(f"tensor {name!r}: got {data.nbytes} bytes, declared {want_bytes}")
        if sys.byteorder != "little":
            raise RuntimeError("GGUF files are written little-endian; big-endian hosts are not supported")
        assert shard.file is not None
        with write_errors(shard.path):
            shard.file.write(data.reshape(-1).view(np.uint8).data)
            _pad(shard.file, self.gw.data_alignment)

    def _skip_kept(self) -> None:
        """Account for the next tensors that lie in kept shards (their bytes are not needed)."""
        while self._next < len(self._order) and self.is_kept(self._order[self._next][0]):
            self._next += 1

    def finish(self) -> Path:
        """Check every tensor was written, close, and atomically move the file(s) into place; returns `path` or the
        first shard."""
        if not self._started:
            self._start()
        self._skip_kept()
        if self._next != len(self._order):
            missing = [n for n, _ in self._order[self._next :]]
            self.abort()
            raise ValueError(f"{len(missing)} declared tensors were never written, first: {missing[0]!r}")
        written = [s for s in self._shards if not s.kept]
        for shard in written:
            assert shard.file is not None
            with write_errors(shard.path):
                shard.file.close()
        for shard in written:
            with write_errors(shard.path):
                os.replace(shard.tmp_path, shard.path)
        return self._shards[0].path

    def abort(self) -> None:
        """Close and delete the temporary files (nothing is left behind)."""
        for shard in self._shards:
            if shard.file is not None:
                shard.file.close()
                shard.tmp_path.unlink(missing_ok=True)


def _header_bytes(w: GGUFWriter) -> bytes:
    """The header, metadata and tensor table gguf's writer produces for `w` (one file, no tensor data)."""
    buf = io.BytesIO()
    w.fout = [buf]  # type: ignore[list-item]
    w.state = WriterState.EMPTY
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.fout = None
    return buf.getvalue()


def _pad(f: BinaryIO, align: int) -> None:
    f.write(bytes(-f.tell() % align))


def _same_bytes(path: Path, want: bytes, skip: tuple[int, int] | None = None) -> bool:
    """Whether `path` begins with `want` (bytes [skip[0], skip[1]) not compared: a header's tensor count)."""
    try:
        with open(path, "rb") as f:
            have = f.read(len(want))
    except OSError:
        return False
    if skip is not None:
        have, want = have[: skip[0]] + have[skip[1]:], want[: skip[0]] + want[skip[1]:]
    return have == want
