"""Per-tensor sensitivity sweeps: what each tensor (or layer, or class) costs in KL-divergence at each type.

The base model is loaded once and its logits computed once (kept as an ik base-logits file); then, for every
group and type, the group's tensors are quantized from the base's own encoding, hot-swapped in, measured against
the base logits, and swapped back. Nothing else is reloaded or recomputed. Results are appended to a JSON file
after each measurement, so an interrupted sweep resumes where it stopped.

Layer-local propagation: the base run's input to every block is recorded once (stream.BlockInputs), so a group
whose earliest tensor is in block L runs blocks L..end only; blocks before L cannot see the change. The rows are
bit-identical to full forwards (`full_forward=True`, the CLI's --full-forward, checks it).

A tensor the measured forward never reads (attn_k_b / attn_v_b under the MLA prefill path, attn_kv_b under the
decode one, NextN/MTP blocks: ArchModel.unread_tensors) is left out of the groups and listed in the header's
`unmeasured` with why: swapping it would change nothing, and a KLD of 0 would tell a mix it is free.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numba
import numpy as np

from ikquant.errors import QuantizeError
from ikquant.imatrix import Imatrix
from ikquant.quantize import quantize_rows
from ikquant.recipes import eligible, with_row_fallback
from ikquant.sweepfile import check_resumable, file_sha256, read_sweep_file, write_sweep_file
from ikquant.types import GGMLType
from ikrun.errors import SweepError
from ikrun.eval.evaluate import kl_divergence
from ikrun.eval.metrics import BaseLogitsFile, KLDAccumulator, kld_stats, mean_and_uncertainty
from ikrun.eval.stream import BlockInputs, plan_run
from ikrun.model import Model
from ikrun.models.base import block_of

GROUP_MODES = ("tensor", "layer", "class")
# Quantizations queued ahead of the evaluation. Types alternate between slow (IQ4_KS) and fast (Q4_0) ones; with two
# in the queue the quantizing thread runs on through a fast one instead of leaving the evaluation waiting after a
# slow one (2.8% of a tiny sweep's time with one).
LOOKAHEAD = 2


@dataclass
class Measured:
    """What every sweep row says of its candidate, whatever the metric."""

    group: str
    tensors: list[str]
    type: str  # as asked
    type_used: str  # after ik's row-length fallback
    n_weights: int
    bytes_base: int
    bytes_new: int
    bpw: float

    @property
    def key(self) -> tuple[str, str]:
        return self.group, self.type


@dataclass
class SweepRow(Measured):
    kld_mean: float
    #: standard error of kld_mean over the scored tokens (ik's ±)
    kld_sem: float
    kld_p99: float
    same_top_p: float
    ppl_ratio: float
    #: the paired (correlation-aware) mean of ln PPL(Q) - ln PPL(base) over the same tokens, and its standard error
    ln_ppl_ratio: float
    ln_ppl_ratio_err: float
    seconds: float
    #: why a tensor of the group is stored as another type than asked (ik's fallback), None when none is
    fallback: str | None = None
    #: False for a row a pruned sweep (--target-bpw) predicted instead of measuring: kld_mean is the prediction,
    #: the other statistics NaN
    measured: bool = True
    #: a pruned sweep's predicted mean KLD (also on the rows it measured besides the anchors) and what it rests on
    prediction: float | None = None
    basis: str | None = None
    #: the mean KLD the swap adds to the unmodified model's own KLD against the base, token by token, and the
    #: standard error of those differences: what a mix minimises. The unmodified model's own KLD is not zero (the
    #: base file holds 16-bit log-probabilities: e.g. -2.5e-07 ± 2.3e-07), and it errs on the same tokens as every
    #: swap of a small effect, so the paired error is a small fraction of kld_sem (NaN in files older than it; a
    #: predicted row's is its prediction)
    kld_added: float = math.nan
    kld_added_sem: float = math.nan

    @property
    def cost(self) -> float:
        """What a mix minimises: kld_added (kld_mean in a row older than it)."""
        return self.kld_mean if math.isnan(self.kld_added) else self.kld_added

    @property
    def within_noise(self) -> bool:
        """Whether the tensor's effect on perplexity is within two standard errors of none."""
        return abs(self.ln_ppl_ratio) < 2 * self.ln_ppl_ratio_err


def tensor_class(name: str) -> str:
    """`blk.12.ffn_down_exps.weight` -> `ffn_down_exps`; non-layer tensors are their own class."""
    m = re.fullmatch(r"blk\.\d+\.(.+)\.weight", name)
    return m.group(1) if m else name.removesuffix(".weight")


def layer_of(name: str) -> int | None:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _quantizable(model: Model, pattern: str | None) -> list[str]:
    """Every quantizable weight of the model whose name the regex `pattern` finds (all without one)."""
    rx = re.compile(pattern) if pattern else None
    names = []
    for name in model.weights.names():
        info = model.weights.info(name)
        if eligible(name, info.n_dims, info.type) and (rx is None or rx.search(name)):
            names.append(name)
    return names


def unmeasured_tensors(model: Model, n_ctx: int, pattern: str | None = None, batch: int | None = None,
                       ) -> dict[str, str]:
    """The quantizable weights (matching `pattern`) a sweep at chunks of n_ctx tokens (fed `batch` tokens at a
    time) cannot measure, with why."""
    unread = model.unread_tensors(n_ctx, batch)
    return {name: unread[name] for name in _quantizable(model, pattern) if name in unread}


def sweep_groups(model: Model, mode: str, pattern: str | None = None, n_ctx: int | None = None,
                 batch: int | None = None) -> dict[str, list[str]]:
    """The groups to measure: every quantizable weight (optionally filtered by regex) the forward at chunks of
    n_ctx tokens (fed `batch` tokens at a time) reads (every one without n_ctx), grouped by `mode`."""
    if mode not in GROUP_MODES:
        raise SweepError(f"--group must be one of {', '.join(GROUP_MODES)}, not {mode!r}")
    unread = model.unread_tensors(n_ctx, batch) if n_ctx is not None else {}
    groups: dict[str, list[str]] = {}
    for name in _quantizable(model, pattern):
        if name in unread:
            continue
        if mode == "tensor":
            key = name
        elif mode == "layer":
            layer = layer_of(name)
            key = f"blk.{layer}" if layer is not None else name
        else:
            key = tensor_class(name)
        groups.setdefault(key, []).append(name)
    if not groups:
        why = f"; the forward does not read {', '.join(sorted(unread)[:3])} ..." if unread else ""
        raise SweepError((f"no quantizable tensor matches {pattern!r}" if pattern else "no quantizable tensors")
                         + why)
    return groups


def stored_type(model: Model, name: str, gtype: GGMLType) -> tuple[GGMLType, str | None]:
    """The type tensor `name` is stored as when a sweep asks for `gtype`, and why when it is another: ik's
    row-length fallback, or, where no fallback's blocks fit the rows, the tensor's own encoding (what ikquant
    writes for it)."""
    info = model.weights.info(name)
    try:
        fb = with_row_fallback(gtype, info.n_per_row, name)
    except QuantizeError:
        fb = None
    used = fb.type if fb is not None else gtype
    if info.n_per_row % used.block_size == 0:
        return used, fb.reason if fb is not None else None
    own = model.weights.source_encoding(name).type
    return own, (f"{name}: {info.n_per_row} columns cannot hold {used.name} blocks and ik has no type for "
                 f"{gtype.name} that fits: kept as {own.name}")


def quantized_copy(model: Model, name: str, gtype: GGMLType, imatrix: Imatrix | None) -> tuple[GGMLType, np.ndarray]:
    """Tensor `name` stored as a sweep stores it when asked for `gtype` (stored_type), from the base's encoding."""
    info = model.weights.info(name)
    used, _ = stored_type(model, name, gtype)
    source = model.weights.source_encoding(name)
    if used is source.type:
        return used, source.raw
    raw = quantize_rows(source.raw, info, used, used.require_codec(), imatrix, numba.get_num_threads())
    return used, raw


def start_block(model: Model, names: list[str]) -> int | None:
    """The first block a change of `names` can affect (n_active: only the head), None for the embedding (a full
    forward)."""
    starts = []
    for name in names:
        block = block_of(name)
        if block is None and name.startswith("token_embd."):
            return None
        starts.append(model.impl.n_active if block is None else min(block, model.impl.n_active))
    return min(starts)


#: bytes from each end of every tensor's data that a model's fingerprint takes
FINGERPRINT_BYTES = 64


def model_fingerprint(model: Model) -> str:
    """What identifies the model's weights without reading them all: every tensor's name, type and shape and the
    first and last bytes of its data (a requantized or rewritten model changes it; the same model split into shards
    or joined again does not)."""
    h = hashlib.blake2b(model.arch.encode(), digest_size=16)
    for shard in model.weights.shards:
        for t in shard.file.tensors.values():
            flat = shard.file.raw(t.name).reshape(-1)
            h.update(f"{t.name}|{t.type.name}|{t.ne}|{t.nbytes}|".encode() + flat[:FINGERPRINT_BYTES].tobytes()
                     + flat[-FINGERPRINT_BYTES:].tobytes() + b";")
    return h.hexdigest()


def sweep_header(model: Model, text: Path, ctx: int, chunks: int, group: str, imatrix: Path | None,
                 metric: str = "kld", batch: int | None = None) -> dict:
    """The identity of a sweep's measurements (ikquant/sweepfile.py): what a resumed sweep must match; a KLD
    sweep's `cost` names the column a mix minimises (kld_added: files without it have only kld_mean); `batch`:
    the tokens each chunk was fed at a time, where fewer than the chunk (ik's micro-batches)."""
    runtime = {"kv_cache": model.kv_cache, **{k: getattr(model.options, k) for k in model.options.given()},
               **model.computed_paths(ctx, batch)}
    # the paths resolved: `ikrun mix` reads the text and imatrix from here, maybe run from another directory
    return {"metric": metric, **({"cost": "kld_added"} if metric == "kld" else {}), "model": str(model.path),
            "model_fingerprint": model_fingerprint(model),
            "text": str(text.resolve()), "text_sha256": file_sha256(text), "ctx": ctx, "chunks": chunks,
            **({"batch": batch} if batch is not None else {}),
            "group": group, "imatrix": str(imatrix.resolve()) if imatrix else None,
            "imatrix_sha256": file_sha256(imatrix) if imatrix else None, "runtime": runtime,
            "unmeasured": unmeasured_tensors(model, ctx, batch=batch)}


def load_rows(path: Path, header: dict, row_class: type = SweepRow) -> list[Any]:
    """The rows of an earlier run of this sweep (none if `path` does not exist); refused if measured otherwise."""
    if not path.exists():
        return []
    theirs, rows = read_sweep_file(path)
    check_resumable(path, header, theirs)
    return [row_class(**r) for r in rows]


def save_rows(path: Path, header: dict, rows: list[Any]) -> None:
    """Write the sweep (JSON, or CSV when the name ends in .csv) atomically."""
    write_sweep_file(path, header, [asdict(r) for r in rows])


#: a sweep's file is rewritten after a new row only once the time since the last rewrite is this many times what
#: that rewrite took (RowSaver)
SAVE_EVERY = 50.0


class RowSaver:
    """A sweep's rows as they are measured, each written to its file soon after (a killed sweep resumes from
    them): after every row while rewriting the file is quick, less often as it grows, so that the rewrites take
    at most 1 / SAVE_EVERY of the sweep's time. A rewrite after every row made saving quadratic in the rows (a
    rewrite took 33 ms at 680 rows: ~11 s over a 680-row sweep, ~3.5 min over a 2,900-row one). Each row is
    converted once."""

    def __init__(self, path: Path, header: dict, rows: list[Any]):
        self.path, self.header = path, header
        self.rows = list(rows)
        self._dicts = [asdict(r) for r in rows]
        self._due = 0.0  # the monotonic time after which the next row is written at once
        self._pending = False

    def add(self, row: Any) -> None:
        self.rows.append(row)
        self._dicts.append(asdict(row))
        self._pending = True
        if time.monotonic() >= self._due:
            self.flush()

    def flush(self) -> None:
        """Write every row not written yet."""
        if not self._pending:
            return
        t0 = time.monotonic()
        write_sweep_file(self.path, self.header, self._dicts)
        t1 = time.monotonic()
        self._due, self._pending = t1 + SAVE_EVERY * (t1 - t0), False


@dataclass
class Candidate:
    group: str
    names: list[str]
    type: GGMLType
    encodings: list[tuple[GGMLType, np.ndarray]]
    seconds: float
    #: the reasons its tensors are stored as other types than asked (stored_type)
    fallbacks: list[str]

    @property
    def fallback(self) -> str | None:
        return "; ".join(self.fallbacks) or None


def prepare_candidate(model: Model, group: str, names: list[str], gtype: GGMLType, imatrix: Imatrix | None) -> Candidate:
    t0 = time.perf_counter()
    encodings = [quantized_copy(model, name, gtype, imatrix) for name in names]
    fallbacks = [why for name in names if (why := stored_type(model, name, gtype)[1]) is not None]
    return Candidate(group, names, gtype, encodings, time.perf_counter() - t0, fallbacks)


def concurrent_kernels_are_safe() -> bool:
    """Numba's OpenMP and TBB layers run parallel regions from two threads at once; its workqueue layer cannot."""
    import numba

    try:
        return numba.threading_layer() in ("omp", "tbb")
    except ValueError:  # no parallel region has run yet
        return False


#: per (group, type): what a measurement has scored so far (its per-token values) and the seconds it took, kept by
#: `--chunks auto` between rounds so that a round scores only the chunks that are new to it
Scored = dict[tuple[str, str], tuple[KLDAccumulator, float]]


class Measurer:
    """One model's measurements against one base: the evaluation plan and the recorded block inputs, made once and
    shared by every candidate (in this process, or in one cluster worker); `batch`: each chunk fed that many tokens
    at a time, as the base was (ik's micro-batches)."""

    def __init__(self, model: Model, base: BaseLogitsFile, spill_dir: Path | None = None,
                 full_forward: bool = False, batch: int | None = None):
        self.model, self.base = model, base
        # every candidate is a full evaluation: chunk by chunk with cached weights when they fit, else streamed
        self.plan = plan_run(model, base.n_chunk, base.n_ctx, one_pass=False, spill_dir=spill_dir, batch=batch)
        self.inputs = None if full_forward else BlockInputs(model, np.asarray(base.tokens[: base.n_chunk]), spill_dir,
                                                            self.plan.batch)
        if self.inputs is not None and self.plan.cache_capacity is not None:
            self.plan.cache_capacity = max(self.plan.cache_capacity - self.inputs.resident_bytes, 0)
        self._own: np.ndarray | None = None

    def own_kld(self) -> np.ndarray:
        """The unmodified model's per-token KLD against the base on every chunk (from the head's recorded inputs:
        one pass through the output alone), computed at the first call."""
        if self._own is None:
            resume = (self.inputs, self.model.impl.n_active) if self.inputs is not None else None
            self._own = kl_divergence(self.model, self.base, plan=self.plan, resume=resume).arrays()["kld"]
        return self._own

    def measure(self, job: Candidate, prior: tuple[KLDAccumulator, float] | None = None,
                ) -> tuple[SweepRow, KLDAccumulator]:
        """The row of one prepared candidate (scoring only the chunks `prior` has not), and its per-token values."""
        model = self.model
        t0 = time.perf_counter()
        acc = prior[0] if prior is not None else KLDAccumulator()
        start = len(acc.kld)
        try:
            for name, (used, raw) in zip(job.names, job.encodings):
                model.swap(name, used, raw)
            first = start_block(model, job.names) if self.inputs is not None else None
            resume = (self.inputs, first) if self.inputs is not None and first is not None else None
            acc = acc.merged(kl_divergence(model, self.base, plan=self.plan, resume=resume, start=start))
        finally:
            for name in job.names:
                model.restore(name)
        stats = kld_stats(acc)
        kld = acc.arrays()["kld"]
        added = kld - self.own_kld()[: len(kld)]
        added_mean, added_sem = mean_and_uncertainty(float(added.sum()), float((added * added).sum()), len(added))
        bytes_base = sum(model.weights.source_encoding(n).raw.nbytes for n in job.names)
        bytes_new = sum(raw.nbytes for _, raw in job.encodings)
        n_weights = sum(model.weights.info(n).n_elements for n in job.names)
        used_types = "+".join(sorted({u.name for u, _ in job.encodings}))
        seconds = job.seconds + time.perf_counter() - t0 + (prior[1] if prior is not None else 0.0)
        row = SweepRow(job.group, job.names, job.type.name, used_types, n_weights, bytes_base, bytes_new,
                       8.0 * bytes_new / n_weights, float(stats["kld_mean"]), float(stats["kld_mean_err"]),
                       float(stats["kld_p99"]), float(stats["same_top_p"]), float(stats["ppl_ratio"]),
                       float(stats["ln_ppl_ratio"]), float(stats["ln_ppl_ratio_err"]), seconds, job.fallback,
                       kld_added=added_mean, kld_added_sem=added_sem)
        return row, acc

    def close(self) -> None:
        if self.inputs is not None:
            self.inputs.close()


def pending_jobs(groups: dict[str, list[str]], types: list[GGMLType], done: Sequence[Measured],
                 only: set[tuple[str, str]] | None = None) -> list[tuple[str, list[str], GGMLType]]:
    """Every (group, tensors, type) that `done` has no row for (and `only` names, when given), in sweep order."""
    finished = {r.key for r in done}
    return [(g, names, t) for g, names in groups.items() for t in types
            if (g, t.name) not in finished and (only is None or (g, t.name) in only)]


def measure_locally(model: Model, base: BaseLogitsFile, groups: dict[str, list[str]], types: list[GGMLType],
                    imatrix: Imatrix | None, done: list[SweepRow], on_row: Callable[[SweepRow], None],
                    spill_dir: Path | None = None, full_forward: bool = False,
                    scored: Scored | None = None, only: set[tuple[str, str]] | None = None,
                    measurer: Measurer | None = None, batch: int | None = None) -> list[SweepRow]:
    """run_sweep in this process (ikrun/sweep/__init__.py).

    The next measurement's quantization runs in a second thread while the current one is evaluated (the kernels
    release the GIL), so the sweep costs little more than its evaluations. Each evaluation starts at the first
    block its group can change, unless `full_forward`. `measurer` (made for this model, base and `spill_dir`;
    closed by its owner) keeps the recorded block inputs between calls: the rounds of a pruned sweep record them
    once. `batch`: each chunk fed that many tokens at a time (Measurer).
    """
    jobs = pending_jobs(groups, types, done, only)
    rows = list(done)
    if not jobs:
        return rows
    pool = ThreadPoolExecutor(max_workers=1) if concurrent_kernels_are_safe() else None

    def start(k: int) -> Future[Candidate] | Candidate:
        g, names, t = jobs[k]
        return pool.submit(prepare_candidate, model, g, names, t, imatrix) if pool else prepare_candidate(model, g, names, t, imatrix)

    ahead = LOOKAHEAD if pool else 1  # without a second thread, quantizing early only holds more bytes
    own = measurer is None
    if measurer is None:
        measurer = Measurer(model, base, spill_dir, full_forward, batch)
    pending = [start(k) for k in range(min(ahead, len(jobs)))]
    try:
        for k in range(len(jobs)):
            head = pending.pop(0)
            job = head.result() if isinstance(head, Future) else head
            if k + ahead < len(jobs):
                pending.append(start(k + ahead))
            key = (job.group, job.type.name)
            row, acc = measurer.measure(job, scored.get(key) if scored is not None else None)
            if scored is not None:
                scored[key] = (acc, row.seconds)
            rows.append(row)
            on_row(row)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if own:
            measurer.close()
    return rows


#: `--chunks auto`: the first round's chunks; each later round doubles them
AUTO_FIRST_CHUNKS = 4
#: `--chunks auto` stops when, for every type, Kendall's tau between the groups' mean-KLD ranks of two successive
#: rounds reaches this
AUTO_STABLE_TAU = 0.9


def auto_rounds(n_available: int) -> list[int]:
    """The chunk counts of `--chunks auto`'s rounds: 4, 8, 16, ... and finally all the text has."""
    rounds = []
    n = AUTO_FIRST_CHUNKS
    while n < n_available:
        rounds.append(n)
        n *= 2
    return [*rounds, n_available]


def kendall_tau(x: np.ndarray, y: np.ndarray) -> float:
    """Kendall's tau-b of two paired samples (1: the same order, -1: reversed; ties count as neither)."""
    dx = np.sign(x[:, None] - x[None, :])
    dy = np.sign(y[:, None] - y[None, :])
    denom = np.sqrt(float((dx * dx).sum()) * float((dy * dy).sum()))
    return float((dx * dy).sum()) / denom if denom > 0 else 1.0


def rank_agreement(before: list[SweepRow], after: list[SweepRow]) -> float:
    """The least, over types, of Kendall's tau between the groups' mean-KLD ranks in two measurements."""
    taus = []
    for t in sorted({r.type for r in after}):
        a = {r.group: r.cost for r in before if r.type == t}
        b = {r.group: r.cost for r in after if r.type == t}
        common = sorted(a.keys() & b.keys())
        if len(common) > 1:
            taus.append(kendall_tau(np.array([a[g] for g in common]), np.array([b[g] for g in common])))
    return min(taus, default=1.0)
