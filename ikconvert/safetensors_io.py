"""Lazy safetensors reading (every dtype checkpoints use, bf16 and fp8 included) and writing.

The `safetensors` package's numpy API cannot return bf16 or fp8 tensors (numpy has no such dtypes), so the
documented format (8-byte little-endian header length, JSON header, raw little-endian data) is parsed here: nothing
is read until a tensor's data is used, and the header is validated up front (offsets inside the file, sizes matching shape x dtype) so a truncated shard fails before any output exists.
Tensor data is read with plain positioned reads when asked for (not memory-mapped): the memory it occupies is freed
as soon as the caller drops it, so converting a 1 TB checkpoint holds one tensor at a time, not the pages of every
tensor already visited.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ikconvert.errors import SafetensorsError
from ikquant.errors import InputNotFoundError
from ikquant.gguf_io import file_stamp

# safetensors dtype -> (numpy storage dtype, bytes per element). Float formats numpy lacks are kept as raw bits.
_DTYPES: dict[str, tuple[np.dtype, int]] = {
    "F64": (np.dtype("<f8"), 8),
    "F32": (np.dtype("<f4"), 4),
    "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2),
    "I64": (np.dtype("<i8"), 8),
    "I32": (np.dtype("<i4"), 4),
    "I16": (np.dtype("<i2"), 2),
    "I8": (np.dtype("i1"), 1),
    "U8": (np.dtype("u1"), 1),
    "BOOL": (np.dtype("?"), 1),
    "F8_E4M3": (np.dtype("u1"), 1),
    "F8_E5M2": (np.dtype("u1"), 1),
    "F8_E8M0": (np.dtype("u1"), 1),
}


def _file_stamp(path: Path) -> tuple[int, int, int, int]:
    try:
        return file_stamp(path)
    except FileNotFoundError:
        raise SafetensorsError(f"{path} was removed while being read") from None


@dataclass(frozen=True)
class SafeTensor:
    """One tensor of a safetensors file: name, dtype string, shape, and where its bytes are (read on demand)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    offset: int
    nbytes: int
    #: the file's (device, inode, size, mtime) when its header was read: a shard rewritten or replaced since holds
    #: other bytes at this offset
    stamp: tuple[int, int, int, int] | None = None

    def raw(self) -> np.ndarray:
        """The stored elements in their storage dtype (bf16/fp8 as unsigned integer bits), read from disk now."""
        if self.stamp is not None and _file_stamp(self.path) != self.stamp:
            raise SafetensorsError(f"{self.path} was rewritten or replaced while being read (tensor {self.name!r}); "
                                   "start the command again")
        np_dtype, itemsize = _DTYPES[self.dtype]
        count = self.nbytes // itemsize
        if count == 0:
            return np.zeros(self.shape, dtype=np_dtype)
        with open(self.path, "rb") as fh:
            data = np.fromfile(fh, dtype=np_dtype, count=count, offset=self.offset)
        if data.size != count:
            raise SafetensorsError(f"{self.path}: tensor {self.name!r} is truncated")
        return data.reshape(self.shape)

    def to_f32(self) -> np.ndarray:
        """The tensor as float32 (exact for every float dtype; fp8 is decoded without any scale)."""
        raw = self.raw()
        if self.dtype == "BF16":
            return (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
        if self.dtype == "F8_E4M3":
            return E4M3_TABLE[raw]
        if self.dtype == "F8_E5M2":
            return (raw.astype(np.uint16) << np.uint16(8)).view(np.float16).astype(np.float32)
        if self.dtype == "F8_E8M0":
            return E8M0_TABLE[raw]
        return raw.astype(np.float32)


def _e4m3_table() -> np.ndarray:
    """float32 value of every OCP FP8 E4M3 byte (bias 7, no inf, 0x7F/0xFF are NaN)."""
    codes = np.arange(256, dtype=np.uint32)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp.astype(np.float64) - 7))
    val = sign * val
    val[(codes & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


def _e8m0_table() -> np.ndarray:
    """float32 value of every E8M0 scale byte: 2^(e-127); 0xFF is NaN."""
    e = np.arange(256, dtype=np.float64)
    val = 2.0 ** (e - 127)
    val[255] = np.nan
    return val.astype(np.float32)


E4M3_TABLE = _e4m3_table()
E8M0_TABLE = _e8m0_table()


class SafetensorsFile:
    """A memory-mapped safetensors file; `tensors` maps name -> SafeTensor in the file's (sorted) key order."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise InputNotFoundError(f"{self.path}: no such file") from None
        self.stamp = _file_stamp(self.path)
        if size < 8:
            raise SafetensorsError(f"{self.path}: file too small to be safetensors ({size} bytes)")
        with open(self.path, "rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            if header_len > size - 8 or header_len > 100 * 1024 * 1024:
                raise SafetensorsError(f"{self.path}: header length {header_len} exceeds the file ({size} bytes)")
            try:
                header = json.loads(fh.read(header_len))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise SafetensorsError(f"{self.path}: corrupt header ({exc})") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        data_start = 8 + header_len
        data_len = size - data_start
        self.tensors: dict[str, SafeTensor] = {}
        for name in sorted(header):
            self.tensors[name] = self._tensor(name, header[name], data_start, data_len)

    def _tensor(self, name: str, entry: object, data_start: int, data_len: int) -> SafeTensor:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise SafetensorsError(f"{where}: malformed header entry")
        dtype = entry["dtype"]
        if dtype not in _DTYPES:
            raise SafetensorsError(f"{where}: unsupported dtype {dtype}")
        itemsize = _DTYPES[dtype][1]
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - begin != count * itemsize or begin < 0:
            raise SafetensorsError(f"{where}: {end - begin} bytes stored for shape {shape} of {dtype}")
        if end > data_len:
            raise SafetensorsError(
                f"{where}: data ends at byte {end} but the file holds only {data_len} data bytes (truncated?)"
            )
        return SafeTensor(name, dtype, shape, self.path, data_start + begin, end - begin, self.stamp)


def write_safetensors(path: str | os.PathLike[str], tensors: dict[str, tuple[str, np.ndarray]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write `{name: (dtype, raw array)}`; raw arrays hold the storage bits (uint16 for BF16, uint8 for FP8)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    blobs = []
    for name in sorted(tensors):
        dtype, arr = tensors[name]
        np_dtype, _ = _DTYPES[dtype]
        data = np.ascontiguousarray(arr, dtype=np_dtype).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(head)))
        fh.write(head)
        for blob in blobs:
            fh.write(blob)
