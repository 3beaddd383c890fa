"""A GGUF model loaded for evaluation: memory-mapped tensors, exact dequantization on first use, one forward.

Weights are decoded exactly (whatever their ggml type) into float32 the first time a layer needs them and kept,
so every forward pass after the first runs on cached float32 matrices and the KL-divergence measures the error of
the stored weights alone. The architecture module (ikrun/models/) checks hyperparameters and tensor shapes when
the model is opened, before any compute.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from ikquant.gguf_io import GGUFFile
from ikquant.types import GGMLType
from ikrun.weights import SwapError, WeightStore


class ModelError(ValueError):
    """A GGUF the runtime cannot evaluate: unsupported architecture, missing tensors, inconsistent shapes."""


KV_CACHE_TYPES = ("f32", "f16")
# Weight matrices smaller than this run their matmuls on one BLAS thread: threads cost more than they save there.
SMALL_MATRIX = 1 << 20


@dataclass(frozen=True)
class RuntimeOptions:
    """Evaluation switches that change what an architecture computes (the defaults are the model's semantics).

    An architecture lists the ones it honours in its class attribute `runtime_options`; setting any other is an
    error, so a flag never silently does nothing.
    """

    #: lightning-indexer sparse attention: None keeps the architecture's default (sparse, as the model was trained);
    #: False runs dense attention on every layer (ik without --dsa)
    dsa: bool | None = None
    #: ik's attention-sink boost: the indexer always keeps each sequence's first token (ik's --dsa default)
    dsa_sink: bool = False
    #: reproduce ik's AVX-512 f32 GEMM over-read of openPangu's param-sink values (only fewer than 16 sinks, i.e.
    #: small test models, are affected): the numbers ik prints for them, not the model's
    ik_sink_overread: bool = False

    def given(self) -> list[str]:
        """The options that were set (field names; the command-line flag is --name with dashes)."""
        return [name for name, unset in (("dsa", None), ("dsa_sink", False), ("ik_sink_overread", False))
                if getattr(self, name) != unset]


@lru_cache(maxsize=1)
def _threadpools() -> ThreadpoolController:
    return ThreadpoolController()


class Model:
    """A GGUF file plus the architecture module that evaluates it."""

    def __init__(self, path: str | os.PathLike[str], threads: int | None = None, kv_cache: str = "f32",
                 options: RuntimeOptions | None = None):
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
        #: called as observer(weight_name, x, expert, n_experts) with the activation rows about to meet each weight
        #: matrix (expert = which matrix of a 3-D expert tensor; 0 of 1 for plain matrices)
        self.observers: list[Callable[..., None]] = []
        #: switches the architecture module reads (checked against the ones it honours before it is built)
        self.options = options or RuntimeOptions()
        impl_class = model_class(self.arch)
        for option in self.options.given():
            if option not in getattr(impl_class, "runtime_options", ()):
                honour = [a for a in supported_architectures()
                          if option in getattr(model_class(a), "runtime_options", ())]
                raise ModelError(f"--{option.replace('_', '-')} applies only to {', '.join(honour)}; {self.path} "
                                 f"is {self.arch}")
        if self.options.dsa is False and self.options.dsa_sink:
            raise ModelError("--dsa-sink changes the indexer's top-k selection, which --dsa off does not run")
        self.impl = impl_class(self)
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

    # ---- hot swapping ----------------------------------------------------------------------------------------
    def _check_swappable(self, name: str) -> None:
        derived = getattr(self.impl, "derived_tensors", {})
        if name in derived:
            raise SwapError(f"tensor {name!r} is derived when the model is loaded, from {derived[name]}: swap that "
                            "instead (the derivation is redone)")
        if not self.weights.has(name):
            raise SwapError(f"the model has no tensor named {name!r}")

    def swap(self, name: str, gtype: GGMLType, raw: np.ndarray) -> None:
        """Evaluate with tensor `name` stored as `raw` bytes of `gtype` (same logical shape) until restored."""
        self._check_swappable(name)
        self.weights.swap(name, gtype, raw)
        self._changed([name])

    def swap_from_file(self, name: str, path: str | os.PathLike[str]) -> None:
        """Evaluate with tensor `name` as another GGUF file stores it (same logical shape) until restored."""
        self._check_swappable(name)
        self.weights.swap_from_file(name, Path(path))
        self._changed([name])

    def restore(self, name: str | None = None) -> None:
        """Undo swaps: of one tensor, or of all."""
        names = [name] if name is not None else self.weights.swapped()
        self.weights.restore(name)
        self._changed(names)

    def reload_changed(self) -> list[str]:
        """Re-read the model's files that changed on disk; returns the tensors whose bytes or type changed."""
        changed = self.weights.reload_changed()
        self._changed(changed)
        return changed

    def _changed(self, names: list[str]) -> None:
        invalidate = getattr(self.impl, "invalidate", None)
        if invalidate is not None and names:
            invalidate(names)

    def observe(self, weight_name: str, x: np.ndarray, expert: int = 0, n_experts: int = 1) -> None:
        """Show the observers the rows `x` that meet `weight_name` (matrix `expert` of a 3-D expert tensor)."""
        for observer in self.observers:
            observer(weight_name, x, expert, n_experts)

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        """x @ W^T (+ bias) for the weight `name` (without the .weight suffix), shown to the observers first."""
        self.observe(name + ".weight", x)
        y = x @ self.weight(name + ".weight").T
        if self.has(name + ".bias"):
            y += self.weight(name + ".bias")
        return y

    def drop_cache(self) -> None:
        self.weights.drop_cache()

    def kv_store(self, x: np.ndarray) -> np.ndarray:
        """K or V as the KV cache holds them: unchanged in f32, rounded through half precision in f16."""
        return x.astype(np.float16).astype(np.float32) if self.kv_cache == "f16" else x

    @property
    def n_vocab(self) -> int:
        return int(self.impl.n_vocab)

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """float32 logits [len(tokens), n_vocab] for one sequence at positions 0..n-1 (a fresh context)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError("tokens must be a non-empty 1-D sequence")
        if tokens.min() < 0 or tokens.max() >= self.n_vocab:
            raise ValueError(f"token id {int(tokens.max() if tokens.max() >= self.n_vocab else tokens.min())} is "
                             f"outside the vocabulary (0..{self.n_vocab - 1})")
        with self.blas_limit():
            return self.impl.forward(tokens)

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
        from ikrun.tokenizer import BPETokenizer

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
    from ikrun.tokenizer import PRE_TOKENIZERS

    vocab_model = meta.get("tokenizer.ggml.model")
    pre = PRE_TOKENIZERS.get(meta.get("tokenizer.ggml.pre") or "default") if vocab_model == "gpt2" else None
    explicit = meta.get("tokenizer.ggml.add_bos_token")
    default = pre.add_bos if pre is not None else vocab_model in ("llama", "bert")  # SPM/WPM add BOS
    add_bos = bool(explicit) if explicit is not None else default
    bos = None if pre is not None and pre.no_bos_token else meta.get("tokenizer.ggml.bos_token_id")
    return add_bos and bos is not None, bos
