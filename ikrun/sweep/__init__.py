"""Per-tensor sensitivity sweeps, one entry point: `run_sweep` measures in this process, or on a Ray cluster when
given one (the cluster is an argument, the rows are the same). measure.py holds the measurement, cluster.py the
workers, acceptance.py a DFlash draft's sweep by acceptance length, refine.py a mix's re-costing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ikrun.errors import SweepError
from ikrun.sweep.measure import Measurer, Scored, SweepRow, measure_locally

if TYPE_CHECKING:
    from ikquant.cluster import Cluster
    from ikquant.imatrix import Imatrix
    from ikquant.types import GGMLType
    from ikrun.eval.metrics import BaseLogitsFile
    from ikrun.model import Model
    from ikrun.sweep.cluster import WorkerPool


def run_sweep(model: Model, base: BaseLogitsFile, groups: dict[str, list[str]], types: list[GGMLType],
              imatrix: Imatrix | None, done: list[SweepRow], on_row: Callable[[SweepRow], None], *,
              spill_dir: Path | None = None, full_forward: bool = False, scored: Scored | None = None,
              cluster: Cluster | None = None, worker_mem: int | None = None,
              on_event: Callable[[str], None] | None = None,
              on_workers: Callable[[list[Any]], None] | None = None,
              only: set[tuple[str, str]] | None = None, pool: WorkerPool | None = None,
              measurer: Measurer | None = None, batch: int | None = None) -> list[SweepRow]:
    """Measure every (group, type) not in `done` (of those in `only`, when given) against `base`; `on_row` sees each new row as soon as it exists.
    With `scored`, each measurement extends what was scored before (and its entry is updated). Each evaluation
    starts at the first block its group can change, unless `full_forward`.

    Locally the next candidate is quantized in a second thread while the current one is evaluated. With `cluster`,
    each Ray worker loads the model file (at `worker_mem` bytes each; None: its node's share) and the imatrix file
    itself and measures candidates the driver hands out; a lost worker is replaced and its candidate rerun
    (`on_event` hears of it, `on_workers` sees the worker handles); `pool` keeps the workers between calls (the
    batches of one pruned sweep round: ikrun/sweep/cluster.py), as `measurer` keeps a local run's recorded block
    inputs between calls (measure_locally). `batch`: each chunk fed that many tokens at a time, as the base was."""
    if cluster is None:
        return measure_locally(model, base, groups, types, imatrix, done, on_row, spill_dir, full_forward, scored,
                               only, measurer, batch)
    from ikrun.sweep.cluster import WorkerSpec, measure_on_cluster

    if imatrix is not None and imatrix.path is None:
        raise SweepError("a sweep on a cluster needs its importance matrix as a file the workers can read")
    spec = WorkerSpec(str(model.path.resolve()), cluster.threads, model.cache_request, model.options, worker_mem,
                      model.stream, str(imatrix.path.resolve()) if imatrix is not None and imatrix.path else None,
                      str(spill_dir) if spill_dir else None, full_forward, batch)
    return measure_on_cluster(cluster, spec, base.path, groups, types, done, on_row, on_event or (lambda _: None),
                              scored, on_workers, only, pool)
