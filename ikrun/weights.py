"""The weights of a loaded model: where each tensor's bytes live, their float32 decoding, and hot swapping.

A model may be one GGUF or a split one (`name-00001-of-00005.gguf`, ...). Each tensor has a source (its file and
descriptor) and may be overridden by a swapped-in encoding of the same logical shape (another type, other bytes),
from another GGUF or from memory. Decoded float32 copies are cached with a fingerprint of the bytes they came from
(unless `track_changes` is off), so `reload_changed` can tell which tensors of a rewritten file really changed,
like ik's on-demand reload but without its mmap and restore restrictions.

The cache is bounded (`capacity` bytes, least recently used first out): a model far larger than memory is decoded
piece by piece, whole tensors, single expert matrices of a 3-D expert tensor, or single rows (embeddings). After a
file's bytes are decoded, their mapped pages are dropped from the process (they stay in the page cache), so
reading a 300 GB file does not pile its pages up in the resident set. `reads` counts the encoded bytes decoded per
tensor, which is how the streaming tests see that each block is read once.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import numpy as np

from ikquant.errors import GGUFFormatError, InputNotFoundError
from ikquant.gguf_io import GGUFFile, TensorInfo, file_stamp
from ikquant.shards import GGUFModel
from ikquant.types import GGMLType
from ikrun.errors import SwapError
from ikrun.ops.fgemm import HALF_BITS, PANEL_TYPES, FileExperts
from ikrun.ops.parallel import threads_for

#: integer ggml types -> their little-endian numpy dtype
INTEGER_TYPES = {"I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}

#: a cache key: a whole tensor, (tensor, expert) for one matrix of a 3-D expert tensor, (tensor, kind) for what
#: ik's kernels make of a tensor (DERIVED floats, PACKED integers, HEADS integers per head slice, FILE_ROWS the
#: file's rows its own kernel reads; each with CONVERTED added where ik converts the weights first, which makes
#: other values), (tensor, expert, kind) for that of one expert
CacheKey = str | tuple[str, int] | tuple[str, int, int]
DERIVED = -1
PACKED = -2
HEADS = -3
FILE_ROWS = -4
CONVERTED = -10


def select_experts(stack: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """stack[experts] for a stack of expert matrices [E, ...]: a view where `experts` are consecutive (a batch
    that reaches every expert of a layer, the usual case, then copies nothing), else a copy."""
    if len(experts) and np.array_equal(experts, np.arange(experts[0], experts[0] + len(experts))):
        return stack[int(experts[0]) : int(experts[0]) + len(experts)]
    return stack[experts]


class Sized(Protocol):
    """A cached value: a float32 array, or ik's integers packed for qmatmul."""

    @property
    def nbytes(self) -> int: ...


D = TypeVar("D", bound=Sized)


@dataclass(frozen=True)
class Encoding:
    """One way to store a tensor: its type and rows of raw bytes (a view into a file, or owned memory)."""

    type: GGMLType
    raw: np.ndarray
    origin: str

    def fingerprint(self) -> bytes:
        return hashlib.blake2b(self.type.name.encode() + np.ascontiguousarray(self.raw).data, digest_size=16).digest()


@dataclass
class _Shard:
    path: Path
    file: GGUFFile
    stamp: tuple[int, int, int, int]  # gguf_io.file_stamp when loaded


class WeightStore:
    """Every tensor of a (possibly split) GGUF model, decodable to float32, swappable one at a time."""

    def __init__(self, path: Path):
        model = GGUFModel(path)  # finds and checks the shards of a split model
        self.shards = [_Shard(f.path, f, f.stamp) for f in model.shards]
        self._source: dict[str, tuple[int, TensorInfo]] = {name: (model.shard_of(name), info)
                                                           for name, info in model.tensors.items()}
        self._override: dict[str, Encoding] = {}
        self._cache: OrderedDict[CacheKey, tuple[Any, bytes]] = OrderedDict()  # arrays, and PACKED integers
        self._cached_bytes = 0
        #: most bytes the decoded-weight cache may hold (None: no bound)
        self.capacity: int | None = None
        #: set while a layer-streamed pass runs (ikrun/eval/stream.py): every weight is used once, nothing worth
        #: caching
        self.streaming = False
        #: set while a layer-streamed pass takes its chunks through each block in several groups: every group meets
        #: the block's experts again, so what is decoded or converted of single experts is kept for the next group
        #: (until the block's tensors are evicted) where it fits beside what the cache holds; never in place of
        #: other entries: the experts come back in the same order each group, so evicting the first for the last
        #: would keep none of them until they are needed again
        self.regrouped = False
        #: encoded bytes decoded so far, per tensor (whole tensors, expert matrices and rows alike)
        self.reads: Counter[str] = Counter()
        #: fingerprint the file bytes of each decoded tensor, so that `reload_changed` can tell which tensors of a
        #: file rewritten in place really changed; a run that never reloads (the commands) turns it off: hashing
        #: reads every byte once more (blake2b, ~0.75 GB/s a core: 2.9 s of a 1.1B F16 file's run)
        self.track_changes = True
        # the file encoding's decoded copy, set aside while a swap is in place: a sweep restores every tensor it
        # swaps, and decoding and fingerprinting it again cost a tiny model's sweep 3% of its time
        self._stash: dict[str, tuple[np.ndarray, bytes]] = {}
        #: tensor -> cache keys of values made from it among others (`derived`'s `also`), forgotten with it
        self._made_from: dict[str, set[CacheKey]] = {}

    @property
    def keeps_experts(self) -> bool:
        """Whether single experts' decodings and conversions are cached: outside a streamed pass (each evaluation
        meets them again), or in one that meets a block in several groups."""
        return not self.streaming or self.regrouped

    def fits(self, n_bytes: int) -> bool:
        """Whether a decoded copy of `n_bytes` may be cached."""
        return self.capacity is None or n_bytes <= self.capacity

    @property
    def metadata(self) -> GGUFFile:
        return self.shards[0].file

    def names(self) -> list[str]:
        return list(self._source)

    def has(self, name: str) -> bool:
        return name in self._source

    def info(self, name: str) -> TensorInfo:
        """The tensor's file descriptor (its logical shape; the stored type may be overridden by a swap)."""
        try:
            return self._source[name][1]
        except KeyError:
            raise KeyError(f"the model has no tensor named {name!r}") from None

    def source_encoding(self, name: str) -> Encoding:
        i, info = self._source[name]
        return Encoding(info.type, self.shards[i].file.raw(name), str(self.shards[i].path))

    def encoding(self, name: str) -> Encoding:
        """What the tensor is stored as right now (a swapped-in encoding, or its file's)."""
        return self._override.get(name) or self.source_encoding(name)

    def decoded_bytes(self, name: str) -> int:
        """The size of tensor `name` decoded to float32."""
        return 4 * math.prod(self.info(name).ne)

    def encoded_bytes(self, name: str) -> int:
        return self.encoding(name).raw.nbytes

    def _lookup(self, key: CacheKey) -> Any:
        """The value cached under `key` (marked most recently used), else None."""
        hit = self._cache.get(key)
        if hit is None:
            return None
        self._cache.move_to_end(key)
        return hit[0]

    def cached_array(self, name: str) -> np.ndarray | None:
        """The whole tensor's decoded copy if it is cached (the per-matmul fast path), else None."""
        return cast("np.ndarray | None", self._lookup(name))

    def _decode_rows(self, name: str, enc: Encoding, raw: np.ndarray, n_per_row: int,
                     out: np.ndarray | None = None) -> np.ndarray:
        """`raw` (rows of `enc`) decoded to float32 (into `out` where given), counted in `reads`."""
        with threads_for(raw.shape[0] * n_per_row):
            w = enc.type.require_codec().dequantize(raw, n_per_row, out)
        self.reads[name] += raw.nbytes
        return w

    def release(self, names: list[str]) -> None:
        """Drop the mapped pages of these tensors from the process: after the expert kernel has read the views
        half_experts and panel_experts handed it."""
        for name in names:
            self._release(name)

    def _release(self, name: str) -> None:
        """Drop the mapped pages of the file's encoding of `name` from the process."""
        if name not in self._override:
            i = self._source[name][0]
            self.shards[i].file.release(name)

    def _keep(self, key: CacheKey, value: Sized, fingerprint: bytes, make_room: bool = True) -> None:
        """Cache `value` under `key` if it fits the capacity, evicting the least recently used entries first
        (`make_room`), else only into room left free."""
        if self.capacity is not None and value.nbytes > self.capacity - (0 if make_room else self._cached_bytes):
            return
        if self.capacity is not None:
            self._stash.clear()  # set-aside copies are the first thing a bounded cache gives up
            while self._cache and self._cached_bytes + value.nbytes > self.capacity:
                _, (old, _) = self._cache.popitem(last=False)
                self._cached_bytes -= old.nbytes
        self._cache[key] = (value, fingerprint)
        self._cached_bytes += value.nbytes

    def _forget(self, key: CacheKey) -> tuple[np.ndarray, bytes] | None:
        hit = self._cache.pop(key, None)
        if hit is not None:
            self._cached_bytes -= hit[0].nbytes
        return hit

    def decode(self, name: str) -> np.ndarray:
        """float32 (numpy order) of the current encoding, cached with its fingerprint while the capacity allows."""
        hit = self.cached_array(name)
        if hit is not None:
            return hit
        info = self.info(name)
        enc = self.encoding(name)
        w = self._decode_rows(name, enc, enc.raw, info.n_per_row).reshape(info.shape)
        # only a file's bytes can change under us (reload_changed compares them); a swapped-in encoding needs none
        fingerprint = enc.fingerprint() if self.track_changes and name not in self._override else b""
        self._release(name)
        self._keep(name, w, fingerprint)
        return w

    def derived(self, name: str, make: Callable[[np.ndarray, np.ndarray], D], kind: int = DERIVED,
                also: tuple[str, ...] = (), direct: Callable[[np.ndarray], D | None] | None = None) -> D:
        """make(raw rows, their float32 decoding [rows, n_per_row]) for tensor `name`'s current encoding (ik's
        converted weights: DERIVED for their floats, PACKED for the integers qmatmul takes); cached while the
        capacity allows and forgotten with the tensor (swaps, restores, evictions), and with the tensors `also`
        that `make` reads too. The decoding itself is not cached: only what is made from it is used. `direct`
        makes the same from the raw rows alone where it can (None where it declines): then nothing is decoded."""
        key = (name, kind)
        for other in also:
            self._made_from.setdefault(other, set()).add(key)
        hit = self._lookup(key)
        if hit is not None:
            return cast(D, hit)
        info, enc = self.info(name), self.encoding(name)
        value = self._make(name, enc, enc.raw, info.n_per_row, make, direct)
        self._release(name)
        self._keep(key, value, b"")
        return value

    def derived_expert(self, name: str, expert: int, make: Callable[[np.ndarray, np.ndarray], D],
                       keep: bool = True, kind: int = PACKED,
                       direct: Callable[[np.ndarray], D | None] | None = None) -> D:
        """What `derived` makes, for one matrix of a 3-D expert tensor (ik's integers of a routed expert); cached
        when `keep` (`keeps_experts`: a layer-streamed pass that meets each expert once keeps nothing)."""
        key = (name, expert, kind)
        hit = self._lookup(key)
        if hit is not None:
            return cast(D, hit)
        n_expert, rows, cols = self.info(name).shape
        enc = self.encoding(name)
        raw = enc.raw.reshape(n_expert, rows, -1)[expert]
        whole = self.cached_array(name)
        value = make(raw, whole[expert]) if whole is not None else self._make(name, enc, raw, cols, make, direct)
        self._release(name)
        if keep:
            self._keep(key, value, b"", make_room=not self.streaming)
        return value

    def _make(self, name: str, enc: Encoding, raw: np.ndarray, n_per_row: int,
              make: Callable[[np.ndarray, np.ndarray], D], direct: Callable[[np.ndarray], D | None] | None) -> D:
        """direct(raw) where given and it does not decline (counted in `reads` as a decoding is), else make(raw,
        its decoding)."""
        if direct is not None:
            with threads_for(raw.shape[0] * n_per_row):
                value = direct(raw)
            if value is not None:
                self.reads[name] += raw.nbytes
                return value
        return make(raw, self._decode_rows(name, enc, raw, n_per_row))

    def integers(self, name: str) -> np.ndarray:
        """An integer tensor (I8/I16/I32/I64: a routing table, not a weight) as int64 in numpy order."""
        enc = self.encoding(name)
        if enc.type.name not in INTEGER_TYPES:
            raise SwapError(f"tensor {name!r} is {enc.type.name}; an integer table must be one of "
                            f"{', '.join(INTEGER_TYPES)}")
        values = np.ascontiguousarray(enc.raw).view(INTEGER_TYPES[enc.type.name]).astype(np.int64)
        self._release(name)
        return values.reshape(self.info(name).shape)

    def decode_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows `rows` of a 2-D tensor (an embedding lookup) in float32: the whole tensor is never decoded for it."""
        hit = self.cached_array(name)
        if hit is not None:
            return hit[rows]
        uniq, inverse = np.unique(np.asarray(rows, dtype=np.int64), return_inverse=True)
        enc = self.encoding(name)
        g = enc.type.row_group
        # an interleaved type stores rows in groups: decode the groups that hold the rows asked for
        needed = uniq if g == 1 else (np.unique(uniq // g)[:, None] * g + np.arange(g)).reshape(-1)
        out = self._decode_rows(name, enc, np.ascontiguousarray(enc.raw[needed]), self.info(name).n_per_row)
        self._release(name)
        if g > 1:
            out = out[np.searchsorted(needed, uniq)]
        return out[inverse.reshape(-1)]

    def decode_experts(self, name: str, experts: np.ndarray, keep: bool = True) -> np.ndarray:
        """Matrices `experts` of a 3-D expert tensor [E, rows, cols] in float32, [len(experts), rows, cols].

        Taken from the whole tensor's decoded copy when it is cached (a view of it for consecutive experts:
        select_experts; not to be written), else decoded per expert (and cached when `keep`: `keeps_experts`).
        A batch that reaches every expert outside a layer-streamed pass caches the stack as the whole tensor
        instead, so the next batches take views of it rather than copying each expert out of the cache.
        """
        whole = self.cached_array(name)
        if whole is not None:
            return select_experts(whole, experts)
        n_expert, rows, cols = self.info(name).shape
        stack = (keep and not self.streaming and np.array_equal(experts, np.arange(n_expert))
                 and self.fits(self.decoded_bytes(name)))  # else the per-expert entries it replaces are kept
        out = np.empty((len(experts), rows, cols), dtype=np.float32)
        enc: Encoding | None = None
        raw = np.empty((0, 0, 0), dtype=np.uint8)
        for j, e in enumerate(experts.tolist()):
            hit = self._cache.get((name, e))
            if hit is not None:
                self._cache.move_to_end((name, e))
                out[j] = hit[0]
                continue
            if enc is None:  # the file's bytes are touched only for experts not cached
                enc = self.encoding(name)
                raw = enc.raw.reshape(n_expert, rows, -1)
            self._decode_rows(name, enc, raw[e], cols, out[j])
            if keep and not stack:
                self._keep((name, e), out[j].copy(), b"", make_room=not self.streaming)
        if enc is not None:
            self._release(name)
        if stack:
            for e in range(n_expert):
                self._forget((name, e))
            self._keep(name, out, b"")
            return select_experts(out, experts)
        return out

    def half_experts(self, name: str, experts: np.ndarray) -> FileExperts | None:
        """Matrices `experts` of an F16 or BF16 expert tensor as the file's 16-bit patterns (what ikrun/ops/fgemm.py's
        kernel widens itself), nothing decoded or copied (`_mapped_experts`); None for other types or when the
        tensor's float32 copy is cached."""
        enc = self.encoding(name)
        if enc.type.name not in HALF_BITS or self.cached_array(name) is not None:
            return None
        return self._mapped_experts(name, enc, experts)

    def is_half(self, name: str) -> bool:
        """Whether `name` is a 2-D tensor stored as F16 or BF16 (now: a swap may change it), its file unread."""
        override = self._override.get(name)
        stored = override.type if override is not None else self.info(name).type
        return stored.name in HALF_BITS and len(self.info(name).shape) == 2

    def half_rows(self, name: str) -> np.ndarray:
        """The 2-D F16 or BF16 tensor `name` (`is_half`) as its stored 16-bit patterns [rows, cols] (uint16 / int16,
        what ikrun/ops/fgemm.py's kernel widens itself: nothing decoded or copied), counted in `reads`."""
        enc = self.encoding(name)
        self.reads[name] += enc.raw.nbytes
        return enc.raw.view(HALF_BITS[enc.type.name]).reshape(self.info(name).shape)

    def panel_experts(self, name: str, experts: np.ndarray, even_if_cached: bool = False) -> FileExperts | None:
        """Matrices `experts` of an expert tensor of a type ikrun/ops/fgemm.py's kernel decodes itself, a panel
        at a time (PANEL_TYPES), as the file's rows, nothing decoded or copied (`_mapped_experts`); None for other
        types or when the tensor's float32 copy is cached, unless `even_if_cached`: a kernel that reads the rows
        (ik's own kernel of the type, numerics/ik/native.py), which takes them of any type, cached or not."""
        enc = self.encoding(name)
        if not even_if_cached and (enc.type.name not in PANEL_TYPES or self.cached_array(name) is not None):
            return None
        return self._mapped_experts(name, enc, experts)

    def _mapped_experts(self, name: str, enc: Encoding, experts: np.ndarray) -> FileExperts:
        """Matrices `experts` of `name` as the tensor's mapped rows and the experts' ids (the kernels read each
        expert where it lies; the caller releases the pages once they have: `release`)."""
        n_expert, rows, n = self.info(name).shape
        matrices = enc.raw.reshape(n_expert, rows, -1)
        self.reads[name] += int(matrices[0].nbytes) * len(experts)
        return FileExperts(matrices, enc.type.name, n, np.ascontiguousarray(experts, dtype=np.int64))

    def _forget_tensors(self, names: set[str]) -> None:
        """Remove every cache entry (whole and per expert) of the tensors `names`."""
        for key in [k for k in self._cache if (k if isinstance(k, str) else k[0]) in names]:
            self._forget(key)
        for name in names:
            for key in self._made_from.get(name, ()):
                self._forget(key)

    def evict(self, names: list[str]) -> None:
        """Drop the decoded copies of `names` (whole and per expert) and their mapped pages."""
        self._forget_tensors(set(names))
        for name in names:
            if name in self._source:
                self._release(name)

    def _forget_tensor(self, name: str) -> tuple[np.ndarray, bytes] | None:
        """Remove every cache entry of `name`; returns the whole tensor's entry if there was one."""
        whole = self._forget(name)
        self._forget_tensors({name})
        return whole

    def drop_cache(self) -> None:
        self._cache.clear()
        self._cached_bytes = 0
        self._stash.clear()

    # ---- swapping ------------------------------------------------------------------------------------------
    def swap(self, name: str, gtype: GGMLType, raw: np.ndarray, origin: str = "memory") -> None:
        """Store tensor `name` as `raw` bytes of `gtype` from now on (same logical shape, any type)."""
        info = self.info(name)
        try:
            expected = gtype.tensor_bytes(info.ne)
        except ValueError as exc:
            raise SwapError(f"tensor {name!r} {list(info.ne)} cannot be stored as {gtype.name}: {exc}") from None
        raw = np.ascontiguousarray(raw).view(np.uint8)
        if raw.nbytes != expected:
            raise SwapError(f"tensor {name!r} {list(info.ne)} as {gtype.name} needs {expected} bytes, got {raw.nbytes}")
        raw = raw.reshape(info.n_rows, -1)
        hit = self._forget_tensor(name)
        if hit is not None and name not in self._override:
            self._stash[name] = hit
        self._override[name] = Encoding(gtype, raw, origin)

    def swap_from_file(self, name: str, path: Path) -> None:
        """Take tensor `name` from another GGUF file, which must hold it with the same logical shape."""
        try:
            other = GGUFFile(path)
        except (GGUFFormatError, InputNotFoundError) as exc:
            raise SwapError(f"cannot swap {name!r} from {path}: {exc}") from None
        if name not in other.tensors:
            raise SwapError(f"{path} has no tensor named {name!r}")
        theirs, ours = other.info(name), self.info(name)
        if theirs.ne != ours.ne:
            raise SwapError(f"{path}: tensor {name!r} has dims {list(theirs.ne)}, the model's are {list(ours.ne)}; "
                            "a swap cannot change a tensor's logical shape")
        self.swap(name, theirs.type, other.raw(name), str(path))

    def restore(self, name: str | None = None) -> None:
        """Back to the file's encoding: one tensor, or all of them."""
        for n in [name] if name is not None else list(self._override):
            if self._override.pop(n, None) is not None:
                self._forget_tensor(n)
                if n in self._stash:
                    value, fingerprint = self._stash.pop(n)
                    self._keep(n, value, fingerprint)

    def swapped(self) -> list[str]:
        return list(self._override)

    # ---- reloading rewritten files -------------------------------------------------------------------------
    def reload_changed(self) -> list[str]:
        """Re-read every shard file that changed on disk; returns the tensors whose type or bytes changed.

        All changed files are parsed and checked first (every tensor still present, same logical shapes); any
        problem raises SwapError and changes nothing. Swapped-in tensors keep their swap.
        """
        fresh: dict[int, GGUFFile] = {}
        for i, shard in enumerate(self.shards):
            try:
                stamp = file_stamp(shard.path)
            except FileNotFoundError:
                raise SwapError(f"{shard.path} no longer exists; nothing was reloaded") from None
            if stamp == shard.stamp:
                continue
            try:
                f = GGUFFile(shard.path)
            except GGUFFormatError as exc:
                raise SwapError(f"{shard.path} no longer parses ({exc}); nothing was reloaded") from None
            for name, info in shard.file.tensors.items():
                new = f.tensors.get(name)
                if new is None:
                    raise SwapError(f"{shard.path} no longer holds tensor {name!r}; nothing was reloaded")
                if new.ne != info.ne:
                    raise SwapError(f"{shard.path}: tensor {name!r} now has dims {list(new.ne)} instead of "
                                    f"{list(info.ne)}; a reload cannot change a logical shape; nothing was reloaded")
            extra = set(f.tensors) - set(shard.file.tensors)
            if extra:
                raise SwapError(f"{shard.path} now holds tensor {sorted(extra)[0]!r}, which the model did not load "
                                "from it; nothing was reloaded")
            fresh[i] = f
        changed = []
        for i, f in fresh.items():
            old = self.shards[i]
            rewritten_in_place = file_stamp(old.path)[:2] == old.stamp[:2]  # the same device and inode
            for name, info in f.tensors.items():
                after = Encoding(info.type, f.raw(name), str(old.path))
                hit = self._stash.get(name) if name in self._override else self._cache.get(name)
                if hit is not None and hit[1]:
                    differs = hit[1] != after.fingerprint()
                elif rewritten_in_place:
                    differs = True  # the old mapping shows the new bytes (or none): nothing to compare against
                else:
                    # a file replaced by rename still maps its old bytes
                    prev = old.file.info(name)
                    differs = prev.type is not info.type or old.file.raw(name, check=False).tobytes() != after.raw.tobytes()
                self._source[name] = (i, info)
                if differs:
                    changed.append(name)
                    if name in self._override:
                        self._stash.pop(name, None)
                    else:
                        self._forget_tensor(name)
            self.shards[i] = _Shard(old.path, f, f.stamp)
        return changed
