"""A GGUF model loaded for evaluation: the facade over its tensors, its arithmetic and its architecture.

Weights are decoded exactly (whatever their ggml type) into float32 when a layer needs them and kept in a cache
bounded by the memory budget (`mem`, bytes; None: no bound), so the KL-divergence measures the error of the stored
weights alone and a model larger than memory is decoded piece by piece (ikrun/weights.py). The arithmetic is
chosen once from the options (ikrun/numerics); the architecture (ikrun/models/, the contract in
ikrun/models/base.py) is built on a Context (ikrun/context.py) and checks hyperparameters and tensor shapes when the
model is opened, before any compute.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import numpy as np
from threadpoolctl import ThreadpoolController

from ikquant.gguf_io import GGUFFile
from ikquant.types import GGMLType
from ikrun.context import Context, Observer
from ikrun.errors import ModelError, SwapError
from ikrun.kvcache import CacheRequest, check_cache, requested_cache
from ikrun.models.base import ArchModel
from ikrun.numerics import make_numerics
from ikrun.options import RuntimeOptions
from ikrun.weights import WeightStore

__all__ = ["Model"]

# Weight matrices smaller than this run their matmuls on one BLAS thread: threads cost more than they save there.
SMALL_MATRIX = 1 << 20


@lru_cache(maxsize=1)
def _threadpools() -> ThreadpoolController:
    return ThreadpoolController()


def fed_batch(n_ctx: int, batch: int | None) -> int | None:
    """The tokens an n_ctx-token chunk is fed at a time when asked for `batch`; None where it goes whole (a batch of
    the whole chunk, or more, is the chunk)."""
    return batch if batch is not None and batch < n_ctx else None


def batch_sizes(n_ctx: int, batch: int | None) -> tuple[int, ...]:
    """The sizes of the batches an n_ctx-token chunk is fed in, `batch` tokens at a time: the full ones' and a
    shorter last one's; none when the chunk goes whole."""
    fed = fed_batch(n_ctx, batch)
    if fed is None:
        return ()
    return (fed,) + ((n_ctx % fed,) if n_ctx % fed else ())


class Model:
    """A GGUF file plus the architecture module that evaluates it."""

    def __init__(self, path: str | os.PathLike[str], threads: int | None = None, kv_cache: str = "f32",
                 options: RuntimeOptions | None = None, mem: int | None = None, stream: bool | None = None,
                 cache_type_k: str | None = None, cache_type_v: str | None = None, k_cache_hadamard: bool = False,
                 v_cache_hadamard: bool = False, indexer_cache_type_k: str | None = None, track_changes: bool = True):
        """`track_changes`: keep what `reload_changed` needs to tell the tensors a file rewritten in place really
        changed (off, every cached tensor of such a file counts as changed; a run that never reloads saves a hash of
        every decoded byte)."""
        from ikrun.models import check_options, model_class

        #: the cache options as given (what a sweep's workers are handed)
        self.cache_request = CacheRequest(kv_cache, cache_type_k, cache_type_v, k_cache_hadamard, v_cache_hadamard,
                                          indexer_cache_type_k)
        requested = requested_cache(self.cache_request)
        self.path = Path(path)
        try:
            self.weights = WeightStore(self.path)
        except SwapError as exc:
            raise ModelError(str(exc)) from None
        self.weights.track_changes = track_changes
        self.arch = self.gguf.architecture
        #: switches the architecture reads (checked against the ones it honours before it is built)
        self.options = options or RuntimeOptions()
        impl_class = model_class(self.arch)
        check_options(self.options, self.path, self.arch)
        self.numerics = make_numerics(self.weights, self.options)
        #: the K and V caches' types and Hadamard blocks (ikrun/kvcache.py; ik's arithmetic keeps its F16 caches),
        #: resolved against the model below
        self.cache = self.numerics.kv_cache(requested)
        #: see the rows that meet each weight matrix (ikrun/context.Observer)
        self.observers: list[Observer] = []
        #: the memory budget in bytes (None: unbounded); the decoded-weight cache lives in what evaluation leaves
        self.mem = mem
        self.weights.capacity = mem
        #: layer-streamed evaluation: True always, False never, None when the model does not fit `mem`
        #: (ikrun/eval/stream.py)
        self.stream = stream
        self.ctx = Context(self.path, self.weights, self.numerics, self.options, self.cache, self.observers)
        self.cache = self.ctx.cache = check_cache(self.cache, self.ctx, self.numerics,
                                                  (cache_type_k, cache_type_v))
        #: the caches' --kv-cache shorthand: "f16" both F16, as ik's default caches, to reproduce ik's numbers;
        #: "k-f32" F32 keys and F16 values (ik's -ctk f32); other pairs `k-<type>,v-<type>`
        self.kv_cache = self.cache.label
        if self.options.flash_attn == "on":
            n_head = max(int(self.ctx.hparam("attention.head_count", 1)), 1)
            head_dim = int(self.ctx.hparam("attention.key_length", self.ctx.hparam("embedding_length", 0) // n_head))
            problem = self.numerics.check_flash_attention(self.arch, self.cache, head_dim)
            if problem is not None:
                raise ModelError(f"--flash-attn on: {problem}")
        self.impl: ArchModel = impl_class(self.ctx)
        for problem in self.numerics.check_weights():
            raise ModelError(f"{self.path}: {problem}")
        largest = max((self.weights.info(n).n_elements for n in self.weights.names()
                       if len(self.weights.info(n).ne) >= 2), default=0)
        self.blas_threads = 1 if largest < SMALL_MATRIX else (threads or os.cpu_count() or 1)
        self._tokenizer_flags: tuple[GGUFFile, tuple[bool, int | None]] | None = None
        self._blas_limited = False

    def __repr__(self) -> str:
        return f"Model({str(self.path)!r}, arch={self.arch})"

    @property
    def gguf(self) -> GGUFFile:
        """The (first) file holding the model's metadata."""
        return self.weights.metadata

    @property
    def tiled(self) -> set[str]:
        """Matmuls that had to decode their weight in tiles of rows (it did not fit the cache)."""
        return self.numerics.tiled

    def computed_paths(self, n_ctx: int, batch: int | None = None) -> dict[str, str]:
        """The architecture's alternative computations a run of n_ctx-token chunks (fed `batch` tokens at a time)
        takes (ArchModel.computed_paths); where a chunk's last, shorter batch takes another path than the others
        (DeepSeek's MLA form flips at 128 tokens), each with its batches' size: "prefill (192-token batches) +
        decode (64-token batches)"."""
        sizes = batch_sizes(n_ctx, batch)
        if not sizes:
            return self.impl.computed_paths(n_ctx)
        each = [self.impl.computed_paths(n) for n in sizes]
        return {key: each[0][key] if len({p[key] for p in each}) == 1
                else " + ".join(f"{p[key]} ({n}-token batches)" for n, p in zip(sizes, each)) for key in each[0]}

    def unread_tensors(self, n_ctx: int, batch: int | None = None) -> dict[str, str]:
        """The file's tensors a run of n_ctx-token chunks (fed `batch` tokens at a time) never reads, with why
        (ArchModel.unread_tensors)."""
        return self.impl.unread_tensors(n_ctx, batch_sizes(n_ctx, batch))

    def check_context(self, n_ctx: int, batch: int | None = None) -> None:
        """Refuse a chunk length (fed `batch` tokens at a time) the run's options cannot take (a ModelError
        before any compute)."""
        self.impl.check_context(n_ctx, batch_sizes(n_ctx, batch))

    # ---- hot swapping ----------------------------------------------------------------------------------------
    def _check_swappable(self, name: str) -> None:
        if not self.weights.has(name):
            raise SwapError(f"the model has no tensor named {name!r}")

    def check_type(self, gtype: GGMLType) -> None:
        """Refuse a weight type the run's arithmetic cannot multiply (before a swap brings it in)."""
        problem = self.numerics.check_type(gtype)
        if problem is not None:
            raise ModelError(problem)

    def swap(self, name: str, gtype: GGMLType, raw: np.ndarray) -> None:
        """Evaluate with tensor `name` stored as `raw` bytes of `gtype` (same logical shape) until restored."""
        self._check_swappable(name)
        self.check_type(gtype)
        self.weights.swap(name, gtype, raw)

    def swap_from_file(self, name: str, path: str | os.PathLike[str]) -> None:
        """Evaluate with tensor `name` as another GGUF file stores it (same logical shape) until restored."""
        self._check_swappable(name)
        self.weights.swap_from_file(name, Path(path))
        try:
            self.check_type(self.weights.encoding(name).type)
        except ModelError:
            self.weights.restore(name)
            raise

    def restore(self, name: str | None = None) -> None:
        """Undo swaps: of one tensor, or of all."""
        self.weights.restore(name)

    def reload_changed(self) -> list[str]:
        """Re-read the model's files that changed on disk; returns the tensors whose bytes or type changed."""
        return self.weights.reload_changed()

    def drop_cache(self) -> None:
        self.weights.drop_cache()

    # ---- evaluation -------------------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return int(self.impl.n_vocab)

    def check_tokens(self, tokens: np.ndarray) -> None:
        if tokens.ndim != 1 or tokens.size == 0:
            raise ModelError("tokens must be a non-empty 1-D sequence")
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise ModelError(f"token id {int(tokens.max() if tokens.max() >= self.n_vocab else tokens.min())} is "
                             f"outside the vocabulary (0..{self.n_vocab - 1})")

    def logits(self, tokens: np.ndarray, index: int = 0, outputs: int = 0, batch: int | None = None) -> np.ndarray:
        """float32 logits [len(tokens) - outputs, n_vocab] for one sequence at positions 0..n-1 (a fresh context):
        those of positions `outputs`.. only, as ik computes them (the last block's FFN and the head run on those
        rows alone, and ik's kernel choices by row count see that many); `index` tells observers which chunk of a
        run it is; `batch`: feed the sequence that many tokens at a time through its cache (ik's micro-batches)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        self.check_tokens(tokens)
        with self.blas_limit():
            fed = fed_batch(len(tokens), batch)
            if fed is not None:
                return self.impl.forward_in_batches(tokens, fed, index, outputs)
            return self.impl.forward(tokens, index=index, outputs=outputs)

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

    # ---- tokenizer --------------------------------------------------------------------------------------------
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
