"""A GGUF model loaded for evaluation: memory-mapped tensors, exact dequantization just before use, one forward.

Weights are decoded exactly (whatever their ggml type) into float32 when a layer needs them and kept in a cache
bounded by the memory budget (`mem`, bytes; None: no bound), so the KL-divergence measures the error of the stored
weights alone and a model larger than memory is decoded piece by piece. The architecture module (ikrun/models/,
the contract in ikrun/models/base.py) checks hyperparameters and tensor shapes when the model is opened, before
any compute.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from ikquant.gguf_io import GGUFFile
from ikquant.types import GGMLType
from ikrun.models.base import ArchModel, ModelError
from ikrun.numerics.ik.formats import (
    IK_FLOAT_TYPES,
    IK_KERNELS,
    UNROUNDED,
    ToInts,
    activation_format,
    ik_kernel,
    integer_rows,
    round_activations,
)
from ikrun.numerics.ik.ikgemm import ik_float_matmul, takes_whole
from ikrun.numerics.ik.qgemm import IntRows, PackedHeads, PackedInts, pack, qmatmul, row_slice
from ikrun.weights import CONVERTED, DERIVED, HEADS, INTEGER_TYPES, PACKED, SwapError, WeightStore

__all__ = ["KV_CACHE_TYPES", "Model", "ModelError", "RuntimeOptions"]

KV_CACHE_TYPES = ("f32", "f16")
NUMERICS = ("exact", "ik")
# Weight matrices smaller than this run their matmuls on one BLAS thread: threads cost more than they save there.
SMALL_MATRIX = 1 << 20
#: rows of a weight decoded at a time by a matmul whose weight does not fit the cache (the output head of a big
#: vocabulary under a small budget); such a matmul may differ from the untiled one in the last bits
TILE_BYTES = 64 << 20


@dataclass(frozen=True)
class RuntimeOptions:
    """Evaluation switches that change what an architecture computes (the defaults are the model's semantics).

    An architecture lists the ones it honours in its class attribute `runtime_options`; setting any other is an
    error, so a flag never silently does nothing. Each field's metadata holds its command-line help: the CLI makes
    the option --name-with-dashes from it (ikrun/commands/options.py), a bool as a flag, None-defaulted as on/off, an
    int taking a value.
    """

    #: lightning-indexer sparse attention: None keeps the architecture's default (sparse, as the model was trained);
    #: False runs dense attention on every layer (ik without --dsa)
    dsa: bool | None = field(default=None, metadata={"help": (
        "Lightning-indexer sparse attention (glm-dsa): on (the default: the model's semantics) or off (dense attention "
        "on every layer, as ik without --dsa). An error for a model without an indexer.")})
    #: ik's attention-sink boost: the indexer always keeps each sequence's first token (ik's --dsa default)
    dsa_sink: bool = field(default=False, metadata={"help": (
        "Add ik's attention-sink boost to the indexer: each sequence's first token always survives the top-k (ik's "
        "--dsa default, not part of the model). An error for a model without an indexer.")})
    #: reproduce ik's AVX-512 f32 GEMM over-read of openPangu's param-sink values (only fewer than 16 sinks, i.e.
    #: small test models, are affected): the numbers ik prints for them, not the model's
    ik_sink_overread: bool = field(default=False, metadata={"help": (
        "openPangu: reproduce ik's AVX-512 f32 GEMM, which misreads the param-sink values of files with fewer than 16 "
        "sinks (small test models; real ones have 128), to get the numbers ik prints for them. Off: the model's "
        "exact forward.")})

    #: the arithmetic: "exact" (float32 on exactly decoded weights) or "ik" (ik's CPU backend: activations rounded
    #: to the format each weight type pairs with, ik's f16 KV cache); every architecture honours it
    numerics: str = field(default="exact", metadata={"choices": NUMERICS, "every_arch": True, "help": (
        "exact (default): float32 on the exactly decoded weights, the error of the stored weights alone. ik: the "
        "arithmetic of ik's CPU backend, to get the numbers llama-perplexity prints: activations rounded to the "
        "8-bit (or bf16) format ik pairs with each weight type, and ik's f16 KV cache (whatever --kv-cache says).")})

    #: the thread count whose kernel choices --numerics ik reproduces (ik's choice depends on it for matrices of fewer
    #: than 32 rows per thread)
    ik_threads: int = field(default=1, metadata={"every_arch": True, "help": (
        "With --numerics ik: make ik's kernel choices as llama-perplexity makes them with this many threads (-t). "
        "They differ only for matrices of fewer than 32 rows per thread, where ik multiplies with its own kernel "
        "instead of converting the weights first: small test models. Default 1.")})

    def given(self) -> list[str]:
        """The options that were set (field names; the command-line flag is --name with dashes)."""
        return [f.name for f in fields(self) if getattr(self, f.name) != f.default]


def _every_arch(option: str) -> bool:
    """Whether a RuntimeOptions field applies to every architecture (not listed in their runtime_options)."""
    return any(f.name == option and f.metadata.get("every_arch", False) for f in fields(RuntimeOptions))


@lru_cache(maxsize=1)
def _threadpools() -> ThreadpoolController:
    return ThreadpoolController()


class Model:
    """A GGUF file plus the architecture module that evaluates it."""

    def __init__(self, path: str | os.PathLike[str], threads: int | None = None, kv_cache: str = "f32",
                 options: RuntimeOptions | None = None, mem: int | None = None, stream: bool | None = None):
        from ikrun.models import model_class, supported_architectures

        if kv_cache not in KV_CACHE_TYPES:
            raise ModelError(f"kv cache type {kv_cache!r} is not one of {', '.join(KV_CACHE_TYPES)}")
        #: "f16" rounds K and V to half precision as ik's default KV cache stores them, to reproduce ik's numbers
        self.kv_cache = kv_cache
        self.path = Path(path)
        try:
            self.weights = WeightStore(self.path)
        except SwapError as exc:
            raise ModelError(str(exc)) from None
        self.arch = self.gguf.architecture
        #: called as observer(weight_name, x, expert, n_experts, chunk) with the activation rows about to meet each
        #: weight matrix (expert = which matrix of a 3-D expert tensor; 0 of 1 for plain matrices; chunk = which
        #: evaluated sequence the rows belong to)
        self.observers: list[Callable[..., None]] = []
        #: switches the architecture module reads (checked against the ones it honours before it is built)
        self.options = options or RuntimeOptions()
        impl_class = model_class(self.arch)
        if self.options.numerics not in NUMERICS:
            raise ModelError(f"--numerics {self.options.numerics!r} is not one of {', '.join(NUMERICS)}")
        #: --numerics ik: activations rounded before each matmul as ik's CPU backend rounds them
        self.ik_numerics = self.options.numerics == "ik"
        if self.ik_numerics:
            self.kv_cache = "f16"
        for option in self.options.given():
            if option not in impl_class.runtime_options and not _every_arch(option):
                honour = [a for a in supported_architectures() if option in model_class(a).runtime_options]
                raise ModelError(f"--{option.replace('_', '-')} applies only to {', '.join(honour)}; {self.path} "
                                 f"is {self.arch}")
        if self.options.ik_threads < 1:
            raise ModelError(f"--ik-threads must be at least 1, not {self.options.ik_threads}")
        if self.options.ik_threads != 1 and not self.ik_numerics:
            raise ModelError("--ik-threads chooses ik's kernels, which only --numerics ik runs")
        if self.options.dsa is False and self.options.dsa_sink:
            raise ModelError("--dsa-sink changes the indexer's top-k selection, which --dsa off does not run")
        #: the memory budget in bytes (None: unbounded); the decoded-weight cache lives in what evaluation leaves
        self.mem = mem
        self.weights.capacity = mem
        #: layer-streamed evaluation: True always, False never, None when the model does not fit `mem`
        #: (ikrun/eval/stream.py)
        self.stream = stream
        #: the chunk whose rows the observers are shown (set by the architectures' per-sequence steps)
        self.chunk = 0
        #: set while a layer-streamed pass runs (ikrun/eval/stream.py): every weight is used once, nothing worth caching
        self.streaming = False
        #: matmuls that had to decode their weight in tiles (it did not fit the cache)
        self.tiled: set[str] = set()
        self.impl: ArchModel = impl_class(self)
        if self.ik_numerics:
            self._check_ik_numerics()
        largest = max((self.weights.info(n).n_elements for n in self.weights.names()
                       if len(self.weights.info(n).ne) >= 2), default=0)
        self.blas_threads = 1 if largest < SMALL_MATRIX else (threads or os.cpu_count() or 1)
        self._tokenizer_flags: tuple[GGUFFile, tuple[bool, int | None]] | None = None
        self._blas_limited = False

    def __repr__(self) -> str:
        return f"Model({str(self.path)!r}, arch={self.arch})"

    def hparam(self, key: str, default: Any = ModelError) -> Any:
        """`{arch}.{key}` from the metadata (a clear error names the key when it is required and missing)."""
        value = self.gguf.get(f"{self.arch}.{key}")
        if value is None:
            if default is ModelError:
                raise ModelError(f"{self.path}: metadata key {self.arch}.{key} is missing")
            return default
        return value

    @property
    def gguf(self) -> GGUFFile:
        """The (first) file holding the model's metadata."""
        return self.weights.metadata

    def has(self, name: str) -> bool:
        return self.weights.has(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.weights.info(name).shape

    def weight(self, name: str) -> np.ndarray:
        """Tensor `name` decoded to float32 (numpy order), cached after the first use."""
        return self.weights.decode(name)

    def integers(self, name: str) -> np.ndarray:
        """Integer tensor `name` (a routing table) as int64."""
        return self.weights.integers(name)

    # ---- hot swapping ----------------------------------------------------------------------------------------
    def _check_swappable(self, name: str) -> None:
        if not self.weights.has(name):
            raise SwapError(f"the model has no tensor named {name!r}")

    def swap(self, name: str, gtype: GGMLType, raw: np.ndarray) -> None:
        """Evaluate with tensor `name` stored as `raw` bytes of `gtype` (same logical shape) until restored."""
        self._check_swappable(name)
        self.check_numerics_type(gtype)
        self.weights.swap(name, gtype, raw)

    def swap_from_file(self, name: str, path: str | os.PathLike[str]) -> None:
        """Evaluate with tensor `name` as another GGUF file stores it (same logical shape) until restored."""
        self._check_swappable(name)
        self.weights.swap_from_file(name, Path(path))
        try:
            self.check_numerics_type(self.weights.encoding(name).type)
        except ModelError:
            self.weights.restore(name)
            raise

    def restore(self, name: str | None = None) -> None:
        """Undo swaps: of one tensor, or of all."""
        self.weights.restore(name)

    def reload_changed(self) -> list[str]:
        """Re-read the model's files that changed on disk; returns the tensors whose bytes or type changed."""
        return self.weights.reload_changed()

    def observe(self, weight_name: str, x: np.ndarray, expert: int = 0, n_experts: int = 1) -> None:
        """Show the observers the rows `x` that meet `weight_name` (matrix `expert` of a 3-D expert tensor)."""
        for observer in self.observers:
            observer(weight_name, x, expert, n_experts, self.chunk)

    def fits(self, n_bytes: int) -> bool:
        """Whether a decoded copy of `n_bytes` may be cached."""
        cap = self.weights.capacity
        return cap is None or n_bytes <= cap

    def _check_ik_numerics(self) -> None:
        """Every weight a matmul reads must be of a type whose ik arithmetic is reproduced (before any compute)."""
        odd: dict[str, list[str]] = {}
        for name in self.weights.names():
            info = self.weights.info(name)
            if len(info.ne) >= 2 and name != "token_embd.weight" and info.type.name not in INTEGER_TYPES \
                    and info.type.name not in IK_KERNELS:
                odd.setdefault(info.type.name, []).append(name)
        if odd:
            kinds = "; ".join(f"{t} ({len(n)} tensors, e.g. {n[0]})" for t, n in odd.items())
            raise ModelError(f"{self.path}: --numerics ik does not reproduce ik's arithmetic for {kinds}: ik's kernels "
                             "re-quantize such weights in ways not emulated; reproduced: "
                             + ", ".join(sorted(IK_KERNELS)))

    def check_numerics_type(self, gtype: GGMLType) -> None:
        """Refuse a type a hot swap would bring in when --numerics ik cannot reproduce its arithmetic."""
        if self.ik_numerics and gtype.name not in IK_KERNELS:
            raise ModelError(f"--numerics ik does not reproduce ik's arithmetic for {gtype.name} weights; reproduced: "
                             + ", ".join(sorted(IK_KERNELS)))

    def activation_format(self, weight_name: str) -> str:
        """The activation format of `weight_name` under the run's numerics (UNROUNDED for exact runs)."""
        return activation_format(self.weights.encoding(weight_name).type.name) if self.ik_numerics else UNROUNDED

    def activations(self, x: np.ndarray, weight_name: str) -> np.ndarray:
        """x as the matmul with `weight_name` consumes it: unchanged, or with --numerics ik rounded as ik does."""
        return round_activations(x, self.activation_format(weight_name))

    def _ik_converted(self, name: str, n_act_rows: int, weight_rows: int, threads: int | None) -> np.ndarray | None:
        """Under --numerics ik, the weights ik's kernel multiplies `name` as in a matmul with `n_act_rows`
        activation rows (of matrices of `weight_rows` rows, `threads` ik threads each), in float32, where they are
        not its exact decoding (ikrun/numerics/ik/formats.py); else None."""
        if not self.ik_numerics:
            return None
        kernel = ik_kernel(self.weights.encoding(name).type.name)
        values = kernel.float_values(n_act_rows, weight_rows, threads)
        if values is None:
            return None
        kind = DERIVED + CONVERTED * kernel.converts(n_act_rows, weight_rows, threads)
        return self.weights.derived(name, lambda raw, decoded: values(raw, decoded).to_float().reshape(
            self.shape(name)), kind)

    def _ik_packed(self, name: str, n_act_rows: int, threads: int | None) -> PackedInts | None:
        """Under --numerics ik, the integers ik's kernel multiplies the 2-D weight `name` as (its rows shared by
        `threads` ik threads), packed for qmatmul; None where it multiplies floats (F32/F16/BF16 weights, a type not
        held as integers)."""
        if not self.ik_numerics:
            return None
        kernel = ik_kernel(self.weights.encoding(name).type.name)
        rows = self.shape(name)[0]
        ints = kernel.integers(n_act_rows, rows, threads)
        if ints is None:
            return None
        kind = PACKED + CONVERTED * kernel.converts(n_act_rows, rows, threads)
        return self.weights.derived(name, lambda raw, decoded: pack(ints(raw, decoded)), kind)

    def _ik_threads(self, n_matrices: int) -> int:
        """The threads ik gives each of `n_matrices` equal matrices it multiplies at once (one per head): its
        --ik-threads divided by their greatest common divisor with the count (ik's split of a batched matmul)."""
        return self.options.ik_threads // math.gcd(n_matrices, self.options.ik_threads)

    def _ik_float_kind(self, name: str) -> str | None:
        """F32, F16 or BF16 where ik multiplies weight `name` in its float kernels (ikrun/numerics/ik/ikgemm.py) on rows they
        take whole, else None."""
        type_name = self.weights.encoding(name).type.name
        whole = takes_whole(self.weights.info(name).n_per_row, type_name == "BF16")
        return type_name if type_name in IK_FLOAT_TYPES and whole else None

    def head_matmul(self, x: np.ndarray, name: str) -> np.ndarray | None:
        """Under --numerics ik, x [H, n, in] times each head's equal slice of the 2-D weight `name`'s rows, as ik's
        kernel multiplies them (the slice is the matrix it sees): [H, n, rows / H]; None where this runtime
        multiplies them as floats (the caller's float path applies) or without --numerics ik."""
        if not self.ik_numerics:
            return None
        n_head, n = x.shape[0], x.shape[1]
        rows = self.shape(name)[0] // n_head
        float_kind = self._ik_float_kind(name)
        if float_kind is not None:
            w = self.weight(name).reshape(n_head, rows, -1)
            xr = self.activations(x, name)
            return np.stack([ik_float_matmul(xr[h], w[h], float_kind == "BF16") for h in range(n_head)])
        kernel = ik_kernel(self.weights.encoding(name).type.name)
        threads = self._ik_threads(n_head)
        ints = kernel.integers(n, rows, threads)
        if ints is None:
            return None

        def make(raw: np.ndarray, decoded: np.ndarray) -> PackedHeads:
            whole = ints(raw, decoded)
            return PackedHeads(tuple(pack(row_slice(whole, h * rows, (h + 1) * rows)) for h in range(n_head)))

        heads = self.weights.derived(name, make, HEADS + CONVERTED * kernel.converts(n, rows, threads))
        fmt = self.activation_format(name)
        return np.stack([qmatmul(integer_rows(x[h], fmt), heads.heads[h]) for h in range(n_head)])

    def head_product(self, x: np.ndarray, name: str) -> np.ndarray:
        """x [H, n, in] times each head's equal slice of the 2-D weight `name`'s rows: head_matmul where it applies,
        else the slices as matmul_weight gives them against x as the matmul consumes it. [H, n, rows / H]."""
        got = self.head_matmul(x, name)
        if got is not None:
            return got
        n_head, n = x.shape[0], x.shape[1]
        rows = self.shape(name)[0] // n_head
        w = self.matmul_weight(name, n, rows).reshape(n_head, rows, -1)
        return np.matmul(self.activations(x, name), w.transpose(0, 2, 1))

    def matmul_weight(self, name: str, n_act_rows: int, weight_rows: int | None = None) -> np.ndarray:
        """Weight `name` (float32, numpy order) as a matmul with `n_act_rows` activation rows multiplies it: its exact
        decoding, or under --numerics ik the weights ik's kernel converts it to when it does; `weight_rows` is the
        row count of each matrix ik multiplies (a per-head slice), default all rows."""
        rows = self.weights.info(name).n_rows if weight_rows is None else weight_rows
        converted = self._ik_converted(name, n_act_rows, rows,
                                       self._ik_threads(self.weights.info(name).n_rows // rows))
        return self.weight(name) if converted is None else converted

    def _expert_ints(self, name: str, count: int) -> ToInts | None:
        return ik_kernel(self.weights.encoding(name).type.name).integers(count, self.shape(name)[1])

    def ik_expert_ints(self, name: str, expert: int, count: int) -> PackedInts | None:
        """Under --numerics ik, the packed integers ik's kernel multiplies expert `expert` of the 3-D tensor `name`
        as when `count` tokens are routed to it; None where it multiplies floats."""
        ints = self._expert_ints(name, count)
        if ints is None:
            return None
        converted = ik_kernel(self.weights.encoding(name).type.name).converts(count, self.shape(name)[1])
        return self.weights.derived_expert(name, expert, lambda raw, decoded: pack(ints(raw, decoded)),
                                           keep=not self.streaming, kind=PACKED + CONVERTED * converted)

    def ik_has_ints(self, name: str, count: int) -> bool:
        """Whether ik multiplies an expert of `name` with `count` routed tokens in integers held here."""
        return self._expert_ints(name, count) is not None

    def ik_convert_experts(self, name: str, ids: np.ndarray, counts: np.ndarray, mats: np.ndarray) -> None:
        """In place: the decoded matrices `mats` of experts `ids` of a 3-D expert tensor, each as ik multiplies it
        for its token count (ik decides per expert: is_dequant_better on the rows routed to it)."""
        kernel = ik_kernel(self.weights.encoding(name).type.name)
        n_expert, rows, _ = self.shape(name)
        raw = self.weights.encoding(name).raw.reshape(n_expert, rows, -1)
        for j, (e, count) in enumerate(zip(ids.tolist(), counts.tolist())):
            values = kernel.float_values(int(count), rows)
            if values is not None:
                mats[j] = values(np.ascontiguousarray(raw[e]), mats[j]).to_float()

    def project(self, x: np.ndarray, weight_name: str, rounded: dict[str, IntRows] | None = None,
                fused: bool = False) -> np.ndarray:
        """x @ W^T for the 2-D weight `weight_name`; decoded whole when it fits the cache, else a tile of rows at a
        time (the output head of a large vocabulary under a small budget). `fused`: ik multiplies it in its fused
        up-gate op, whose kernel choice does not depend on its thread count (--ik-threads)."""
        if self.ik_numerics:
            threads = None if fused else self.options.ik_threads
            packed = self._ik_packed(weight_name, len(x), threads)
            if packed is not None:
                fmt = self.activation_format(weight_name)
                rows = rounded.get(fmt) if rounded is not None else None
                if rows is None:
                    rows = integer_rows(x, fmt)
                    if rounded is not None:
                        rounded[fmt] = rows
                return qmatmul(rows, packed)
            x = self.activations(x, weight_name)
            converted = self._ik_converted(weight_name, len(x), self.shape(weight_name)[0], threads)
            if converted is not None:
                return x @ converted.T
            kind = self._ik_float_kind(weight_name)
            if kind is not None and self.fits(self.weights.decoded_bytes(weight_name)):
                return ik_float_matmul(x, self.weight(weight_name), kind == "BF16")
        w = self.weights
        hit = w.cached_array(weight_name)
        if hit is not None:
            return x @ hit.T
        if self.fits(w.decoded_bytes(weight_name)):
            return x @ self.weight(weight_name).T
        self.tiled.add(weight_name)
        n_rows, n_cols = self.shape(weight_name)
        step = max(1, TILE_BYTES // (4 * n_cols))
        y = np.empty((x.shape[0], n_rows), dtype=np.float32)
        for r0 in range(0, n_rows, step):
            rows = np.arange(r0, min(n_rows, r0 + step))
            y[:, r0 : r0 + len(rows)] = x @ w.decode_rows(weight_name, rows).T
        return y

    def linear(self, x: np.ndarray, name: str, rounded: dict[str, IntRows] | None = None,
               fused: bool = False) -> np.ndarray:
        """x @ W^T (+ bias) for the weight `name` (without the .weight suffix), shown to the observers first;
        `rounded` keeps x's integer rows per activation format for the next weight on the same input; `fused` as
        for project."""
        self.observe(name + ".weight", x)
        y = self.project(x, name + ".weight", rounded, fused)
        if self.has(name + ".bias"):
            y += self.weight(name + ".bias")
        return y

    def linears(self, x: np.ndarray, names: list[str], fused: bool = False) -> list[np.ndarray]:
        """linear(x, name) for weights that share the input x (q/k/v, gate/up): under --numerics ik x is rounded
        once per activation format, not once per weight; `fused`: the gate and up weights of a SwiGLU FFN, which
        ik multiplies in its fused up-gate op (project)."""
        rounded: dict[str, IntRows] = {}
        return [self.linear(x, name, rounded, fused) for name in names]

    def embed_rows(self, name: str, tokens: np.ndarray) -> np.ndarray:
        """Rows `tokens` of an embedding table: from its cached decoding when evaluations repeat and it fits, else
        decoding only those rows (a layer-streamed pass embeds every chunk once and moves on)."""
        if not self.streaming and self.fits(self.weights.decoded_bytes(name)):
            return self.weight(name)[tokens]
        return self.weights.decode_rows(name, tokens)

    def drop_cache(self) -> None:
        self.weights.drop_cache()

    def kv_store(self, x: np.ndarray) -> np.ndarray:
        """K or V as the KV cache holds them: unchanged in f32, rounded through half precision in f16."""
        return x.astype(np.float16).astype(np.float32) if self.kv_cache == "f16" else x

    @property
    def n_vocab(self) -> int:
        return int(self.impl.n_vocab)

    def check_tokens(self, tokens: np.ndarray) -> None:
        if tokens.ndim != 1 or tokens.size == 0:
            raise ModelError("tokens must be a non-empty 1-D sequence")
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise ModelError(f"token id {int(tokens.max() if tokens.max() >= self.n_vocab else tokens.min())} is "
                             f"outside the vocabulary (0..{self.n_vocab - 1})")

    def logits(self, tokens: np.ndarray, index: int = 0) -> np.ndarray:
        """float32 logits [len(tokens), n_vocab] for one sequence at positions 0..n-1 (a fresh context); `index`
        tells observers which chunk of a run it is."""
        tokens = np.asarray(tokens, dtype=np.int64)
        self.check_tokens(tokens)
        with self.blas_limit():
            return self.impl.forward(tokens, index=index)

    @contextmanager
    def blas_limit(self) -> Iterator[None]:
        """numpy's BLAS held to `blas_threads` (one thread for tiny matrices, where more only contend). Entering
        costs ~60 us, a tenth of a tiny model's forward pass, so evaluation loops hold it across all their chunks."""
        if self._blas_limited:
            yield
            return
        with _threadpools().limit(limits=self.blas_threads, user_api="blas"):
            self._blas_limited = True
            try:
                yield
            finally:
                self._blas_limited = False

    def tokenizer(self):  # type: ignore[no-untyped-def]
        from ikconvert.tokenizer import BPETokenizer

        return BPETokenizer.from_gguf(self.gguf)

    @property
    def add_bos(self) -> bool:
        """Whether llama.cpp would prepend BOS (and so swaps each chunk's first token for BOS in perplexity)."""
        return self.tokenizer_flags()[0]

    def tokenizer_flags(self) -> tuple[bool, int | None]:
        """(whether BOS is added, its id), read once per metadata file (every chunk asks; a reload may change it)."""
        meta = self.gguf
        if self._tokenizer_flags is None or self._tokenizer_flags[0] is not meta:
            self._tokenizer_flags = (meta, _read_tokenizer_flags(meta))
        return self._tokenizer_flags[1]


def _read_tokenizer_flags(meta: GGUFFile) -> tuple[bool, int | None]:
    from ikconvert.tokenizer import PRE_TOKENIZERS

    vocab_model = meta.get("tokenizer.ggml.model")
    pre = PRE_TOKENIZERS.get(meta.get("tokenizer.ggml.pre") or "default") if vocab_model == "gpt2" else None
    explicit = meta.get("tokenizer.ggml.add_bos_token")
    default = pre.add_bos if pre is not None else vocab_model in ("llama", "bert")  # SPM/WPM add BOS
    add_bos = bool(explicit) if explicit is not None else default
    bos = None if pre is not None and pre.no_bos_token else meta.get("tokenizer.ggml.bos_token_id")
    return add_bos and bos is not None, bos
