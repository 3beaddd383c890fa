"""Importance matrices from the runtime: per weight matrix, the sum of squared input activations per column.

What is collected follows ik's llama-imatrix: every matmul of a `blk.*` weight whose activation batch has at least
16 rows (the output tensor only on request), one `ncall` per evaluation of the graph (here: per chunk that showed
the weight rows, whatever order a layer-streamed run shows them in, or per batch of a chunk fed in batches, which
ik evaluates one at a time: a batch of fewer than 16 tokens shows the weights that are not experts no rows), and
the stored value mean(x^2) * ncall. Sums are kept in float64 (ik: float32).

ik's forward never runs a NextN/MTP block, so its imatrix has no data for one; `collect_nextn` runs the head at
every position of each chunk (one draft step per position, from the target's hidden state of the position before,
as its speculative decoding computes them) so that the head's tensors get theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ikquant.imatrix import Imatrix, ImatrixEntry, write_imatrix_dat, write_imatrix_gguf

if TYPE_CHECKING:
    from ikrun.model import Model

MIN_ROWS = 16


@dataclass
class ImatrixCollector:
    """Observer for Model.observers: accumulates Σx² and row counts per weight (per expert slice for 3-D)."""

    process_output: bool = False
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    #: calls merged in from earlier files
    merged_calls: dict[str, int] = field(default_factory=dict)
    _calls: dict[str, set[tuple[int, int]]] = field(default_factory=dict)

    def wants(self, name: str) -> bool:
        return name.startswith("blk.") or (self.process_output and name == "output.weight")

    @property
    def ncall(self) -> dict[str, int]:
        """Per entry: the evaluations (chunks, or their batches) that showed it rows, plus the calls of merged
        files."""
        return {name: self.merged_calls.get(name, 0) + len(self._calls.get(name, ())) for name in self.sums}

    def __call__(self, name: str, x: np.ndarray, expert: int = 0, n_experts: int = 1,
                 evaluation: tuple[int, int] = (0, 0)) -> None:
        if not self.wants(name) or (n_experts == 1 and x.shape[0] < MIN_ROWS):
            return
        x64 = x.reshape(-1, x.shape[-1]).astype(np.float64)
        if name not in self.sums:
            self.sums[name] = np.zeros((n_experts, x64.shape[1]))
            self.counts[name] = np.zeros(n_experts)
        self.sums[name][expert] += np.einsum("ij,ij->j", x64, x64)
        self.counts[name][expert] += x64.shape[0]
        self._calls.setdefault(name, set()).add(evaluation)

    def merge(self, earlier: Imatrix, rows_per_call: int) -> None:
        """Add an earlier imatrix as if its calls had `rows_per_call` rows each (ik mixes units here: it adds
        a whole call's mean as a single row, which all but erases earlier files once new data arrives)."""
        for name, entry in earlier.entries.items():
            n_mat = len(self.counts[name]) if name in self.counts else 1
            mean = entry.mean_sq().reshape(n_mat, -1).astype(np.float64)
            rows = float(max(entry.ncall, 1) * rows_per_call)
            if name not in self.sums:
                self.sums[name] = np.zeros_like(mean)
                self.counts[name] = np.zeros(n_mat)
            self.sums[name] += mean * rows
            self.counts[name] += rows
            self.merged_calls[name] = self.merged_calls.get(name, 0) + max(entry.ncall, 0)

    def to_imatrix(self, chunks: int, dataset: str, path: Path | None = None) -> Imatrix:
        """ik's stored form: values = mean(x^2) * ncall; matrices (experts) that saw no rows read as ones, as ik
        writes them. Unlike ik, an entry is never dropped for its unreached experts (ik drops one with round(5%)
        or more of them, and the quantizer then works without importance data for that whole tensor)."""
        imat = Imatrix(chunks=chunks, dataset=dataset, path=path)
        ncall = self.ncall
        for name, s in self.sums.items():
            c = self.counts[name]
            mean = np.ones_like(s)
            mean[c > 0] = s[c > 0] / c[c > 0, None]
            imat.entries[name] = ImatrixEntry((mean * ncall[name]).reshape(-1).astype(np.float32), ncall[name])
        return imat

    def save(self, path: Path, chunks: int, chunk_size: int, dataset: str) -> None:
        """Write ik's .dat, or mainline's GGUF imatrix when the name ends in .gguf (both atomically). The .dat's
        count is ik's: the most calls of any entry (the chunks, where each is evaluated whole; its batches, where
        fed in batches; 0 where nothing was collected), mainline's the chunks run."""
        if path.suffix == ".gguf":
            write_imatrix_gguf(path, self.sums, self.counts, chunks, chunk_size, dataset)
        else:
            write_imatrix_dat(path, self.to_imatrix(max(self.ncall.values(), default=0), dataset))


def collect_nextn(model: Model, chunks: np.ndarray, collector: ImatrixCollector, head: Model | None = None) -> None:
    """The NextN head's activations on every chunk (the model's own head, or `head`'s: an MTP export beside it),
    shown to `collector` alone (the target's forward that gives the head its hidden states is not observed: its
    tensors were collected by the main pass)."""
    from ikrun.eval.speculative import NextnDecoder, TargetDecoder, previous_states

    drafter = head or model
    for i, tokens in enumerate(chunks):
        _, features = TargetDecoder(model, [model.impl.n_active - 1], nextn=True).run(tokens)
        drafter.observers.append(collector)
        try:
            NextnDecoder(drafter, i).run(previous_states(features), tokens)
        finally:
            drafter.observers.remove(collector)
