"""What the commands share: threads, the memory budget, loading a model, planning a run, progress bars."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ikquant.cli_common import err, fail
from ikquant.errors import IkError
from ikrun.commands.options import Evaluation

if TYPE_CHECKING:
    from ikrun.eval.stream import StreamPlan
    from ikrun.model import Model


def use_threads(n: Optional[int]) -> None:
    if n:
        import numba

        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


@lru_cache(maxsize=1)
def _default_budget() -> int:
    """75% of the memory available when the first model is loaded, announced then (kld loads two models)."""
    from ikquant.sizes import format_size
    from ikrun.memory import default_budget

    mem = default_budget()
    err.print(f"memory budget {format_size(mem)} (75% of the memory available; --mem sets it)", highlight=False)
    return mem


def memory_budget(ev: Evaluation) -> int:
    """The memory budget in bytes."""
    from ikquant.sizes import parse_size

    if ev.mem is None:
        return _default_budget()
    try:
        return parse_size(ev.mem)
    except IkError as exc:
        fail(str(exc))


def load_model(path: Path, ev: Evaluation, beside: bool = False) -> Model:
    """The model at `path`; one that runs only beside another (a DFlash draft) only where `beside`."""
    from ikrun.model import Model

    use_threads(ev.threads)
    try:
        m = Model(path, ev.threads, ev.kv_cache, ev.options, memory_budget(ev), ev.stream, ev.cache_type_k,
                  ev.cache_type_v, ev.k_cache_hadamard, ev.v_cache_hadamard, ev.indexer_cache_type_k,
                  track_changes=False)
    except IkError as exc:
        fail(str(exc))
    if not m.impl.standalone and not beside:
        fail(f"{path} is a {m.arch} model: it runs with its target (ikrun accept TARGET.gguf {path.name})")
    return m


BATCH_HELP = ("Feed each chunk this many tokens at a time through its key/value cache, as ik runs a chunk in "
              "micro-batches (llama-perplexity -b / -ub, the smaller: -ub defaults to 512): under --numerics ik "
              "its kernels see batches this size, and MLA models take the absorbed form below 128 tokens. Runs "
              "chunk by chunk. Default: each chunk whole.")


def check_batch(batch: int | None) -> None:
    """Refuse a --batch of no tokens before anything is loaded."""
    if batch is not None and batch < 1:
        fail(f"--batch {batch}: give 1 token or more")


def batch_report(plan: StreamPlan) -> dict[str, int]:
    """The JSON report's `batch`: the tokens a chunk was fed at a time, where fewer than the chunk."""
    return {"batch": plan.batch} if plan.batch else {}


def run_plan(m: Model, n_chunk: int, ctx: int, ev: Evaluation, one_pass: bool = True,
             batch: int | None = None) -> StreamPlan:
    from ikrun.eval.stream import plan_run

    try:
        m.check_context(ctx, batch)
        plan = plan_run(m, n_chunk, ctx, one_pass, ev.spill_dir, batch)
    except IkError as exc:
        fail(str(exc))
    err.print(f"{m.path.name}: {plan.describe()}", highlight=False)
    return plan


def progress_bar() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err, transient=True)


@contextmanager
def tracked(m: Model, plan: StreamPlan, label: str) -> Iterator[tuple[Callable[[int, int], None],
                                                                      Callable[[int, int, int], None]]]:
    """Progress callbacks (per chunk, per streamed block: bytes decoded, projected time) and the closing report."""
    from ikquant.sizes import format_size
    from ikrun.eval.stream import RunReport
    from ikrun.memory import peak_resident_memory

    t0 = time.perf_counter()
    read0 = sum(m.weights.reads.values())
    with progress_bar() as bar:
        blocks = bar.add_task(f"{label}: blocks", total=m.impl.n_active) if plan.streamed else None
        chunks = bar.add_task(label, total=plan.n_chunk)

        def on_block(i: int, n: int, read: int) -> None:
            bar.update(blocks, completed=i, description=f"{label}: block {i}/{n}, {format_size(read)} decoded")  # type: ignore[arg-type]

        yield (lambda i, n: bar.update(chunks, completed=i)), on_block
    report = RunReport(plan, time.perf_counter() - t0, peak_resident_memory(), sum(m.weights.reads.values()) - read0)
    err.print(f"{label}: {report.line()}", highlight=False)
    if m.tiled:
        err.print(f"note: {', '.join(sorted(m.tiled))} did not fit --mem and ran in tiles of rows (results may differ "
                  "from an untiled run in the last bits)", highlight=False)


def read_text(path: Path) -> str:
    """The --text file, or a one-line error."""
    from ikrun.eval.evaluate import read_text as read_corpus

    try:
        return read_corpus(path)
    except IkError as exc:
        fail(f"--text {exc}")
    return ""


def check_output(path: Optional[Path], option: str) -> None:
    """An output's folder checked before any model is loaded: a user's slip costs nothing, not a run."""
    if path is not None and not Path(path).parent.is_dir():
        fail(f"{option} {path}: the folder {Path(path).parent} does not exist")
