"""Sweeps spread over a Ray cluster (`ikrun sweep --ray`): one worker process per `--threads` CPUs, each with the
model memory-mapped from the same path, the base logits (sent once through Ray's object store) and its own
recorded block inputs; the driver hands out candidates, writes the rows and resumes.

A worker lost mid-candidate (killed, its node gone) is replaced and the candidate rerun on the replacement: rows are
recorded only when a worker returns one, once, so none is lost and none counted twice. The rows equal a local
sweep's at the same thread count (the same kernels on the same inputs).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ikquant.cluster import Cluster
from ikquant.imatrix import read_imatrix
from ikquant.outputs import scratch_folder
from ikquant.types import GGMLType, type_by_name
from ikrun.errors import SweepError
from ikrun.eval.metrics import KLDAccumulator
from ikrun.kvcache import CacheRequest
from ikrun.model import Model
from ikrun.options import RuntimeOptions
from ikrun.sweep.measure import (
    Candidate,
    Measurer,
    Scored,
    SweepRow,
    concurrent_kernels_are_safe,
    pending_jobs,
    prepare_candidate,
)

#: a candidate as sent to a worker: (group, tensors, type name)
Job = tuple[str, list[str], str]

#: workers that may be lost (and replaced) per worker started before the sweep gives up
LOSSES_PER_WORKER = 3


@dataclass(frozen=True)
class WorkerSpec:
    """How every worker loads the model and measures: the driver's options, as the workers' node sees them."""

    model: str
    threads: int
    #: the cache options the driver's model was given (ikrun/kvcache.py)
    cache: CacheRequest
    options: RuntimeOptions
    #: each worker's memory budget in bytes; None: 75% of its node's available memory shared by its workers
    mem: int | None
    stream: bool | None
    imatrix: str | None
    spill_dir: str | None
    full_forward: bool
    #: tokens fed at a time through each chunk's cache (ik's micro-batches); None: each chunk whole
    batch: int | None = None


class SweepWorker:
    """A Ray actor: the model, the base and its block inputs, measuring one candidate a call."""

    def __init__(self, spec: WorkerSpec, base_blob: np.ndarray):
        import numba

        from ikrun.memory import default_budget

        numba.set_num_threads(max(1, min(spec.threads, numba.config.NUMBA_NUM_THREADS)))
        mem = spec.mem if spec.mem is not None else default_budget() * spec.threads // (os.cpu_count() or 1)
        self.spec = spec
        self.model = Model(spec.model, spec.threads, options=spec.options, mem=mem, stream=spec.stream,
                           track_changes=False, **asdict(spec.cache))
        self.imatrix = read_imatrix(Path(spec.imatrix)) if spec.imatrix else None
        from ikrun.eval.evaluate import open_base

        # the base file is memory-mapped, then its folder removed at once: the mapping keeps the bytes, and a worker
        # that is killed (ray.kill, a lost node) leaves nothing behind in the temporary folder
        with scratch_folder("sweep-worker") as folder:
            path = folder / "base.kld"
            base_blob.tofile(path)
            base = open_base(path, self.model)
        spill = Path(spec.spill_dir) if spec.spill_dir else None
        self.measurer = Measurer(self.model, base, spill, spec.full_forward, spec.batch)
        # the worker's next candidate is quantized in a second thread while this one is evaluated (as run_sweep does)
        self.pool = ThreadPoolExecutor(max_workers=1) if concurrent_kernels_are_safe() else None
        self.ahead: dict[tuple[str, str], Future[Candidate]] = {}

    def pid(self) -> int:
        return os.getpid()

    def _prepare(self, job: Job) -> Candidate:
        return prepare_candidate(self.model, job[0], job[1], type_by_name(job[2]), self.imatrix)

    def measure(self, job: Job, prior: tuple[KLDAccumulator, float] | None,
                then: Job | None = None) -> tuple[SweepRow, KLDAccumulator]:
        """Measure `job`; start quantizing `then`, the job this worker gets next."""
        ready = self.ahead.pop((job[0], job[2]), None)
        if then is not None and self.pool is not None:
            self.ahead[(then[0], then[2])] = self.pool.submit(self._prepare, then)
        return self.measurer.measure(ready.result() if ready is not None else self._prepare(job), prior)


class WorkerPool:
    """The Ray workers of one sweep round, kept between its batches of measurements (a pruned sweep asks for its
    measurements in several): started by the first batch, each loading the model and recording its block inputs
    once; the caller closes the pool."""

    def __init__(self) -> None:
        self.workers: list[Any] = []
        self.actor: Any = None
        self.blob: Any = None

    def close(self, ray: Any) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers.clear()


def measure_on_cluster(cluster: Cluster, spec: WorkerSpec, base_path: Path, groups: dict[str, list[str]],
                       types: list[GGMLType], done: list[SweepRow], on_row: Callable[[SweepRow], None],
                       on_event: Callable[[str], None], scored: Scored | None = None,
                       on_workers: Callable[[list[Any]], None] | None = None,
                       only: set[tuple[str, str]] | None = None, pool: WorkerPool | None = None) -> list[SweepRow]:
    """run_sweep's rows (ikrun/sweep/__init__.py), measured by `cluster.workers` Ray workers (`on_workers` sees the
    worker handles once they are started, and again when one is replaced), those of `pool` when given (started
    there if it has none; left running), else workers started and stopped for this call."""
    ray = cluster.ray
    from ray.exceptions import RayActorError

    jobs = deque(pending_jobs(groups, types, done, only))
    rows = list(done)
    if not jobs:
        return rows
    own = pool is None
    pool = pool if pool is not None else WorkerPool()
    if not pool.workers:
        pool.blob = ray.put(np.fromfile(base_path, dtype=np.uint8))
        pool.actor = ray.remote(num_cpus=cluster.threads, max_restarts=0, max_task_retries=0)(SweepWorker)
        pool.workers.extend(pool.actor.remote(spec, pool.blob) for _ in range(min(cluster.workers, len(jobs))))
        _ready(ray, pool.workers)
        if on_workers is not None:
            on_workers(list(pool.workers))
    workers, actor, blob = pool.workers, pool.actor, pool.blob
    losses, allowed = 0, LOSSES_PER_WORKER * len(workers)
    inflight: dict[Any, tuple[Any, tuple[str, list[str], GGMLType]]] = {}
    reserved: dict[Any, tuple[str, list[str], GGMLType]] = {}  # the job each worker is quantizing ahead
    idle = list(workers)
    try:
        while jobs or inflight or reserved:
            while True:  # every idle worker with a job reserved, or any idle worker while jobs remain
                worker = next((w for w in idle if w in reserved), idle[-1] if idle and jobs else None)
                if worker is None:
                    break
                idle.remove(worker)
                job = reserved.pop(worker) if worker in reserved else jobs.popleft()
                then = jobs.popleft() if jobs else None
                if then is not None:
                    reserved[worker] = then
                prior = scored.get((job[0], job[2].name)) if scored is not None else None
                inflight[worker.measure.remote((job[0], job[1], job[2].name), prior,
                                               (then[0], then[1], then[2].name) if then else None)] = (worker, job)
            ready, _ = ray.wait(list(inflight), num_returns=1)
            worker, job = inflight.pop(ready[0])
            try:
                row, acc = ray.get(ready[0])
            except RayActorError as exc:
                losses += 1
                if losses > allowed:
                    raise SweepError(f"--ray {cluster.address}: {losses} workers lost; giving up (the rows so far "
                                     f"are saved; rerun to resume): {_cause(exc)}") from None
                on_event(f"a Ray worker was lost while measuring {job[0]} {job[2].name}; rerunning it on a new "
                         "worker")
                if worker in reserved:
                    jobs.appendleft(reserved.pop(worker))
                jobs.appendleft(job)
                workers.remove(worker)
                replacement = actor.remote(spec, blob)
                _ready(ray, [replacement])
                workers.append(replacement)
                idle.append(replacement)
                if on_workers is not None:
                    on_workers(list(workers))
                continue
            idle.append(worker)
            if scored is not None:
                scored[row.key] = (acc, row.seconds)
            rows.append(row)
            on_row(row)
    finally:
        if own:
            pool.close(ray)
    return rows


def _ready(ray: Any, workers: list[Any]) -> None:
    """Wait until every worker has loaded the model; a worker that cannot (a path its node cannot read) fails the
    sweep with its reason."""
    from ray.exceptions import RayActorError

    try:
        ray.get([w.pid.remote() for w in workers])
    except RayActorError as exc:
        raise SweepError(f"a Ray worker could not load the model: {_cause(exc)}") from None


def _cause(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error:" in line]
    return (errors[-1] if errors else lines[-1] if lines else type(exc).__name__).strip()
