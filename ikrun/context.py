"""What an architecture and its modules see of a loaded model: its hyperparameters and tensors, the arithmetic
(ikrun/numerics), the KV cache's precision, the run's options and the observers (imatrix) that see each matmul's
input rows. Modules get this and never the Model, so nothing below the facade calls back into it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ikrun.errors import ModelError
from ikrun.kvcache import KvCache, indexer_cache_holds
from ikrun.numerics.exact import Numerics
from ikrun.options import RuntimeOptions
from ikrun.weights import WeightStore

#: called as observer(weight_name, x, expert, n_experts, evaluation) with the activation rows about to meet each
#: weight matrix (expert = which matrix of a 3-D expert tensor; 0 of 1 for plain matrices; evaluation = which
#: evaluation of the graph the rows belong to: (chunk, first position of its batch), 0 for a chunk fed whole)
Observer = Callable[[str, np.ndarray, int, int, tuple[int, int]], None]


class Context:
    """A loaded model as its forward computes it (the module docstring)."""

    def __init__(self, path: Path, weights: WeightStore, numerics: Numerics, options: RuntimeOptions,
                 cache: KvCache, observers: list[Observer]):
        self.path = path
        self.weights = weights
        self.numerics = numerics
        self.options = options
        #: the K and V caches' types (ikrun/kvcache.py)
        self.cache = cache
        #: their --kv-cache shorthand ("f16": both F16 as ik's default caches, "k-f32": F32 keys, F16 values; other
        #: pairs `k-<type>,v-<type>`)
        self.kv_cache = cache.label
        self.observers = observers
        self.arch: str = weights.metadata.architecture
        #: the chunk whose rows the observers are shown (set by the per-sequence steps), and the first position of
        #: the batch it is fed in (ArchModel.forward_in_batches; 0 for a chunk fed whole)
        self.chunk = 0
        self.batch_start = 0

    def hparam(self, key: str, default: Any = ModelError) -> Any:
        """`{arch}.{key}` from the metadata (a clear error names the key when it is required and missing)."""
        value = self.weights.metadata.get(f"{self.arch}.{key}")
        if value is None:
            if default is ModelError:
                raise ModelError(f"{self.path}: metadata key {self.arch}.{key} is missing")
            return default
        return value

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

    def embed_rows(self, name: str, tokens: np.ndarray) -> np.ndarray:
        """Rows `tokens` of an embedding table: from its cached decoding when evaluations repeat and it fits, else
        decoding only those rows (a layer-streamed pass embeds every chunk once and moves on)."""
        if not self.weights.streaming and self.weights.fits(self.weights.decoded_bytes(name)):
            return self.weight(name)[tokens]
        return self.weights.decode_rows(name, tokens)

    def observe(self, weight_name: str, x: np.ndarray, expert: int = 0, n_experts: int = 1) -> None:
        """Show the observers the rows `x` that meet `weight_name` (matrix `expert` of a 3-D expert tensor)."""
        for observer in self.observers:
            observer(weight_name, x, expert, n_experts, (self.chunk, self.batch_start))

    def project(self, x: np.ndarray, weight_name: str) -> np.ndarray:
        """x @ W^T for the 2-D weight `weight_name`, unobserved (an output head)."""
        return self.numerics.project(x, weight_name)

    def linear(self, x: np.ndarray, name: str, shared: dict[str, Any] | None = None,
               fused: bool = False) -> np.ndarray:
        """x @ W^T (+ bias) for the weight `name` (without the .weight suffix), shown to the observers first;
        `shared` and `fused` as Numerics.project takes them."""
        self.observe(name + ".weight", x)
        y = self.numerics.project(x, name + ".weight", shared, fused)
        if self.has(name + ".bias"):
            y += self.weight(name + ".bias")
        return y

    def linears(self, x: np.ndarray, names: list[str], fused: bool = False) -> list[np.ndarray]:
        """linear(x, name) for weights that share the input x (q/k/v, gate/up): what one projection prepares of x
        (ik's rounded rows) serves the others; `fused`: the gate and up weights of a SwiGLU FFN."""
        shared: dict[str, Any] = {}
        return [self.linear(x, name, shared, fused) for name in names]

    def indexer_store(self, k: np.ndarray, hadamard_block: int) -> np.ndarray:
        """Indexer keys k [keys, d] as the indexer key cache (-ictk) holds them, rotated by ik's Hadamard transform
        over blocks of `hadamard_block` values around the write (kvcache.indexer_cache_holds)."""
        assert self.cache.indexer is not None, "a model without an indexer cache stores no indexer keys"
        return indexer_cache_holds(k, self.cache.indexer, hadamard_block)

    def indexer_scores(self, q: np.ndarray, k: np.ndarray, w: np.ndarray, q0: int = 0) -> np.ndarray:
        """The DSA indexer's causal scores [n, keys] of queries q [n, heads, d] (the first at position q0) against
        keys k [keys, d] written into the indexer key cache (-ictk), head weights w [n, heads]."""
        assert self.cache.indexer is not None, "a model without an indexer cache scores no indexer keys"
        return self.numerics.indexer_scores(q, k, w, self.cache.indexer, q0)

    def kv_store(self, x: np.ndarray, value: bool = False) -> np.ndarray:
        """Keys (or, `value`, values) as the KV cache holds them."""
        c = self.cache
        if value:
            return self.numerics.kv_store(x, c.v, c.v_hadamard, value=True)
        return self.numerics.kv_store(x, c.k, c.k_hadamard)
