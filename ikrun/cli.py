"""`ikrun`: evaluate GGUF models with ik_llama.cpp's numerics: logits, perplexity, KL-divergence, validation."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ikquant.cli_common import err, fail, new_app, out
from ikquant.errors import IkError
from ikrun.commands.options import Evaluation, evaluation_options

if TYPE_CHECKING:
    from ikquant.types import GGMLType
    from ikrun.eval.stream import StreamPlan
    from ikrun.model import Model

app = new_app(__doc__, "Evaluate GGUF models: logits, perplexity, KL-divergence against a base, validation against HF.")


def _threads(n: Optional[int]) -> None:
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


def _budget(ev: Evaluation) -> int:
    """The memory budget in bytes."""
    from ikquant.sizes import parse_size

    if ev.mem is None:
        return _default_budget()
    try:
        return parse_size(ev.mem)
    except IkError as exc:
        fail(str(exc))


def _load(path: Path, ev: Evaluation, beside: bool = False) -> Model:
    """The model at `path`; one that runs only beside another (a DFlash draft) only where `beside`."""
    from ikrun.model import Model

    _threads(ev.threads)
    try:
        m = Model(path, ev.threads, ev.kv_cache, ev.options, _budget(ev), ev.stream)
    except (IkError, FileNotFoundError, NotImplementedError) as exc:
        fail(str(exc))
    if not m.impl.standalone and not beside:
        fail(f"{path} is a {m.arch} model: it runs with its target (ikrun accept TARGET.gguf {path.name})")
    return m


def _plan(m: Model, n_chunk: int, ctx: int, ev: Evaluation, one_pass: bool = True) -> StreamPlan:
    from ikrun.eval.stream import plan_run

    try:
        plan = plan_run(m, n_chunk, ctx, one_pass, ev.spill_dir)
    except IkError as exc:
        fail(str(exc))
    err.print(f"{m.path.name}: {plan.describe()}", highlight=False)
    return plan


def _progress() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=err, transient=True)


@contextmanager
def _tracked(m: Model, plan: StreamPlan, label: str) -> Iterator[tuple[Callable[[int, int], None],
                                                                      Callable[[int, int, int], None]]]:
    """Progress callbacks (per chunk, per streamed block: bytes decoded, projected time) and the closing report."""
    from ikquant.sizes import format_size
    from ikrun.eval.stream import RunReport
    from ikrun.memory import peak_resident_memory

    t0 = time.perf_counter()
    read0 = sum(m.weights.reads.values())
    with _progress() as bar:
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


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        fail(f"--text {path}: no such file")
    except UnicodeDecodeError as exc:
        fail(f"--text {path}: not UTF-8 ({exc})")
    return ""


@app.command()
@evaluation_options
def logits(
    model: Path = typer.Argument(..., help="GGUF model."),
    text: Optional[Path] = typer.Option(None, "--text", help="UTF-8 text file to tokenize with the model's vocab."),
    tokens: Optional[str] = typer.Option(None, "--tokens", help="Comma-separated token ids instead of --text."),
    output: Path = typer.Option(Path("logits.npy"), "--output", "-o", help="Where to write float32 logits "
                                "[n_tokens, n_vocab] (.npy)."),
    ev: Evaluation = None,  # type: ignore[assignment]
) -> None:
    """Run one forward pass over a token sequence (positions 0..n-1) and save all logits.

    Example: ikrun logits model.gguf --tokens 1,2,3,4 -o logits.npy
    """
    m = _load(model, ev)
    if (text is None) == (tokens is None):
        fail("give exactly one of --text or --tokens")
    try:
        if tokens is not None:
            try:
                ids = np.array([int(t) for t in tokens.split(",") if t.strip()], dtype=np.int64)
            except ValueError:
                fail(f"--tokens {tokens!r} is not a comma-separated list of token ids")
        else:
            ids = np.array(m.tokenizer().encode(_read_text(text)), dtype=np.int64)  # type: ignore[arg-type]
        _plan(m, 1, len(ids), ev)
        result = m.logits(ids)
    except IkError as exc:
        fail(str(exc))
    from ikquant.outputs import output_file

    try:
        with output_file(output, result.nbytes + 128) as tmp, open(tmp, "wb") as fh:
            np.save(fh, result)
    except IkError as exc:
        fail(str(exc))
    err.print(f"wrote {output}: logits of {len(ids)} tokens x {result.shape[1]} vocab")


@app.command()
@evaluation_options
def ppl(
    model: Path = typer.Argument(..., help="GGUF model."),
    text: Path = typer.Option(..., "--text", help="UTF-8 text file."),
    ctx: int = typer.Option(512, "--ctx", "-c", help="Chunk length in tokens (ik's -c)."),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="Evaluate at most this many chunks."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object {n_tokens, ppl, ppl_err}."),
    ev: Evaluation = None,  # type: ignore[assignment]
) -> None:
    """Perplexity over the text, chunked and scored exactly like ik's llama-perplexity.

    Example: ikrun ppl model.gguf --text wiki.test.raw --ctx 512 --json
    """
    from ikrun.eval.evaluate import perplexity, tokenize_chunks
    from ikrun.eval.metrics import ppl_stats

    m = _load(model, ev)
    try:
        chunk_tokens = tokenize_chunks(m, _read_text(text), ctx, chunks)
    except IkError as exc:
        fail(str(exc))
    plan = _plan(m, len(chunk_tokens), ctx, ev)
    with _tracked(m, plan, "perplexity") as (on_chunk, on_block):
        res = perplexity(m, chunk_tokens, progress=on_chunk, plan=plan, on_block=on_block)
    stats = ppl_stats(res.nll)
    if json_out:
        out.print_json(json.dumps(stats))
    else:
        out.print(f"Final estimate: PPL over {res.n_chunk} chunks for n_ctx={ctx} = {stats['ppl']:.4f} +/- "
                  f"{stats['ppl_err']:.5f}  ({stats['n_tokens']} tokens scored)")


@app.command()
@evaluation_options
def kld(
    model: Path = typer.Argument(..., help="GGUF model under test."),
    base: Optional[Path] = typer.Option(None, "--base", help="Base GGUF (the reference model; the runtime options "
                                        "apply to it too)."),
    base_logits: Optional[Path] = typer.Option(None, "--base-logits", help="Base-logits file (ik's "
                                               "--kl-divergence-base layout); tokens, ctx and base log-probs come "
                                               "from it."),
    text: Optional[Path] = typer.Option(None, "--text", help="UTF-8 text file (with --base)."),
    ctx: int = typer.Option(512, "--ctx", "-c", help="Chunk length in tokens (with --base)."),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="Evaluate at most this many chunks (with --base)."),
    save_base_logits: Optional[Path] = typer.Option(None, "--save-base-logits", help="Also keep the base run's "
                                                    "logits file, reusable with --base-logits and by ik."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object with every statistic."),
    ev: Evaluation = None,  # type: ignore[assignment]
) -> None:
    """KL-divergence of a model against a base model or a base-logits file, with all of ik's statistics.

    Example: ikrun kld model-q4_0.gguf --base model-f32.gguf --text wiki.test.raw --ctx 512
    Example: ikrun kld model-q4_0.gguf --base-logits base.kld --json
    """
    import tempfile

    from ikrun.eval.evaluate import kl_divergence, open_base, perplexity, tokenize_chunks

    if (base is None) == (base_logits is None):
        fail("give exactly one of --base (with --text) or --base-logits")
    m = _load(model, ev)
    tmpdir = None
    try:
        if base is not None:
            if text is None:
                fail("--base needs --text")
            bm = _load(base, ev)
            if bm.n_vocab != m.n_vocab:
                fail(f"{base} has {bm.n_vocab} tokens, {model} has {m.n_vocab}: not the same vocabulary")
            chunk_tokens = tokenize_chunks(bm, _read_text(text), ctx, chunks)  # type: ignore[arg-type]
            if save_base_logits is None:
                tmpdir = tempfile.TemporaryDirectory()
                save_base_logits = Path(tmpdir.name) / "base.kld"
            plan = _plan(bm, len(chunk_tokens), ctx, ev)
            with _tracked(bm, plan, "base model") as (on_chunk, on_block):
                perplexity(bm, chunk_tokens, save_base_logits, on_chunk, plan, on_block)
            bm.drop_cache()
            base_logits = save_base_logits
        bf = open_base(base_logits, m)  # type: ignore[arg-type]
        plan = _plan(m, bf.n_chunk, bf.n_ctx, ev)
        with _tracked(m, plan, "KL-divergence") as (on_chunk, on_block):
            acc = kl_divergence(m, bf, on_chunk, plan=plan, on_block=on_block)
    except (IkError, FileNotFoundError) as exc:
        fail(str(exc))
    finally:
        if tmpdir is not None:
            tmpdir.cleanup()
    from ikrun.eval.metrics import kld_stats

    stats = kld_stats(acc)
    if json_out:
        out.print_json(json.dumps({k: (float(v) if isinstance(v, (float, np.floating)) else v)
                                   for k, v in stats.items()}))
        return
    if stats["n_tokens"] < 100:
        err.print(f"[yellow]warning:[/] only {stats['n_tokens']} tokens scored; ik prints no final statistics "
                  "below 100")
    out.print(kld_table(stats, str(model)))


def kld_table(stats: dict, title: str) -> Table:
    """ik's three statistics blocks as one rich table."""
    t = Table(title=f"{title}: {stats['n_tokens']} tokens")
    t.add_column("statistic")
    t.add_column("value", justify="right")
    t.add_column("±", justify="right")

    def row(label: str, key: str, scale: float = 1.0, fmt: str = "{:.6f}", suffix: str = "") -> None:
        err_key = key + "_err"
        e = fmt.format(stats[err_key] * scale) + suffix if err_key in stats else ""
        t.add_row(label, fmt.format(stats[key] * scale) + suffix, e)

    row("Mean PPL(Q)", "ppl_q")
    row("Mean PPL(base)", "ppl_base")
    t.add_row("Cor(ln(PPL(Q)), ln(PPL(base)))", f"{stats['cor_ln_ppl']:.2f}%", "")
    row("Mean ln(PPL(Q)/PPL(base))", "ln_ppl_ratio")
    row("Mean PPL(Q)/PPL(base)", "ppl_ratio")
    row("Mean PPL(Q)-PPL(base)", "ppl_diff")
    t.add_section()
    row("Mean KLD", "kld_mean")
    for label, key in (("Maximum", "kld_max"), ("99.9%", "kld_p999"), ("99.0%", "kld_p99"), ("95.0%", "kld_p95"),
                       ("90.0%", "kld_p90"), ("Median", "kld_median"), ("10.0%", "kld_p10"), ("5.0%", "kld_p05"),
                       ("1.0%", "kld_p01"), ("0.1%", "kld_p001"), ("Minimum", "kld_min")):
        if key in stats:
            row(f"{label} KLD", key)
    t.add_section()
    row("Mean Δp", "dp_mean", 100, "{:.3f}", "%")
    for label, key in (("Maximum", "dp_max"), ("99.9%", "dp_p999"), ("99.0%", "dp_p99"), ("95.0%", "dp_p95"),
                       ("90.0%", "dp_p90"), ("75.0%", "dp_p75"), ("Median", "dp_median"), ("25.0%", "dp_p25"),
                       ("10.0%", "dp_p10"), ("5.0%", "dp_p05"), ("1.0%", "dp_p01"), ("0.1%", "dp_p001"),
                       ("Minimum", "dp_min")):
        if key in stats:
            row(f"{label} Δp", key, 100, "{:.3f}", "%")
    row("RMS Δp", "dp_rms", 100, "{:.3f}", "%")
    row("Same top p", "same_top_p", 100, "{:.3f}", "%")
    return t


@app.command()
@evaluation_options
def imatrix(
    model: Path = typer.Argument(..., help="GGUF model (ideally the unquantized one)."),
    text: Path = typer.Option(..., "--text", help="Calibration text (UTF-8)."),
    output: Path = typer.Option(Path("imatrix.dat"), "--output", "-o", help="Output: ik's .dat layout, or "
                                "mainline's GGUF imatrix when the name ends in .gguf."),
    ctx: int = typer.Option(512, "--ctx", "-c", help="Chunk length in tokens."),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="Use at most this many chunks."),
    in_file: list[Path] = typer.Option([], "--in-file", help="Earlier imatrix to merge in (repeatable)."),
    save_every: int = typer.Option(10, "--save-every", help="Rewrite the output every N chunks, so an interrupted "
                                   "run loses little (0: only at the end; a streamed run finishes all chunks "
                                   "together and saves at the end)."),
    process_output: bool = typer.Option(False, "--process-output", help="Also collect for output.weight."),
    ev: Evaluation = None,  # type: ignore[assignment]
) -> None:
    """Collect an importance matrix: per weight matrix, the mean square of its input activations per column.

    Example: ikrun imatrix model-f32.gguf --text calibration.txt --ctx 512 -o imatrix.dat
    """
    from ikquant.imatrix import read_imatrix
    from ikrun.eval.evaluate import collect_imatrix, tokenize_chunks
    from ikrun.eval.imatrix import ImatrixCollector
    from ikrun.eval.metrics import ppl_stats

    m = _load(model, ev)
    collector = ImatrixCollector(process_output=process_output)
    try:
        chunk_tokens = tokenize_chunks(m, _read_text(text), ctx, chunks)
        for f in in_file:
            collector.merge(read_imatrix(f), ctx)
    except IkError as exc:
        fail(str(exc))
    dataset = str(text)
    plan = _plan(m, len(chunk_tokens), ctx, ev)
    with _tracked(m, plan, "imatrix") as (on_chunk, on_block):

        def step(i: int, n: int) -> None:
            on_chunk(i, n)
            if save_every and i % save_every == 0 and i < n and not plan.streamed:
                collector.save(output, i, ctx, dataset)

        nll = collect_imatrix(m, chunk_tokens, collector, step, plan, on_block)
    collector.save(output, len(chunk_tokens), ctx, dataset)
    stats = ppl_stats(nll)
    err.print(f"wrote {output}: {len(collector.sums)} entries from {len(chunk_tokens)} chunks of {ctx} tokens "
              f"(PPL {stats['ppl']:.4f} +/- {stats['ppl_err']:.5f})")


@app.command()
@evaluation_options
def sweep(
    model: Path = typer.Argument(..., help="Base GGUF (unquantized, or the model whose tensors you want to vary)."),
    text: Path = typer.Option(..., "--text", help="Evaluation text (UTF-8)."),
    types: str = typer.Option(..., "--types", help="Comma-separated types to try, e.g. IQ2_KS,IQ3_K,IQ4_KS."),
    output: Path = typer.Option(Path("sweep.json"), "--output", "-o", help="Results (.json, or .csv). Rerunning "
                                "with the same output skips the rows already measured."),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", help="Importance matrix for the quantizations."),
    tensors: Optional[str] = typer.Option(None, "--tensors", help="Regex: only tensors whose name matches."),
    group: str = typer.Option("tensor", "--group", help="Measure each tensor, each layer, or each tensor class "
                              "(tensor | layer | class)."),
    ctx: int = typer.Option(512, "--ctx", "-c", help="Chunk length in tokens."),
    chunks: Optional[str] = typer.Option(None, "--chunks", help="Evaluate at most this many chunks; auto: 4 "
                                         "chunks, then 8, 16, ... (each round scores only its new chunks) until "
                                         "the ranking of the groups is stable (Kendall tau >= 0.9 between two "
                                         "rounds, for every type) or the text runs out. The output holds the "
                                         "latest round."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw a heatmap (.png or .svg; needs "
                                        "pip install 'iktools[plot]')."),
    full_forward: bool = typer.Option(False, "--full-forward", help="Run every candidate through the whole model "
                                      "instead of from the first block it changes (the same rows, slower: a check)."),
    ray: Optional[str] = typer.Option(None, "--ray", help="Measure on Ray workers of --threads CPUs each: local or "
                                      "local:N starts N local workers (sharing --mem), else a cluster address "
                                      "(auto, HOST:PORT, ray://HOST:10001) whose nodes read the model and "
                                      "--imatrix at the same paths. Needs pip install 'iktools[ray]'."),
    metric: str = typer.Option("kld", "--metric", help="kld: KL-divergence against the base's logits on --text; "
                               "acceptance: a DFlash draft's mean acceptance length with --target on prompts from "
                               "--text (--prompts, --prompt-len, --max-new, --block as ikrun accept)."),
    target: Optional[Path] = typer.Option(None, "--target", help="With --metric acceptance: the draft's target GGUF."),
    recipe: str = typer.Option("ik", "--recipe", help="mainline: accept only --types that mainline llama.cpp loads "
                               "(for mixes made with ikquant --recipe mainline)."),
    prompts: int = typer.Option(6, "--prompts", help="With --metric acceptance: number of prompts."),
    prompt_len: int = typer.Option(24, "--prompt-len", help="With --metric acceptance: tokens per prompt."),
    max_new: int = typer.Option(96, "--max-new", help="With --metric acceptance: new tokens per prompt."),
    block: Optional[int] = typer.Option(None, "--block", help="With --metric acceptance: block size (default: the "
                                        "draft's)."),
    ev: Evaluation = None,  # type: ignore[assignment]
) -> None:
    """How much each tensor costs: quantize one tensor (or group) at a time, swap it in, measure KL-divergence
    (or, for a DFlash draft, the acceptance length it loses).

    The base model is loaded once and its logits computed once; each measurement hot-swaps the group's tensors
    and swaps them back.

    Example: ikrun sweep model-bf16.gguf --text wiki.test.raw --ctx 512 --chunks 20 --types IQ2_KS,IQ4_KS
    --imatrix imatrix.dat -o sweep.json --plot sweep.png
    """
    from ikquant.imatrix import read_imatrix
    from ikrun.eval.evaluate import tokenize_chunks
    from ikrun.sweep.measure import auto_rounds, load_rows, sweep_groups, sweep_header

    if metric not in ("kld", "acceptance"):
        fail(f"--metric must be kld or acceptance, not {metric!r}")
    if recipe not in ("ik", "mainline"):
        fail(f"--recipe must be ik or mainline, not {recipe!r}")
    if recipe == "mainline":
        from ikquant.recipes_mainline import require_mainline_type

        try:
            for t in types.split(","):
                if t.strip():
                    require_mainline_type(t.strip(), f"--types {t.strip()}")
        except IkError as exc:
            fail(str(exc))
    if (metric == "acceptance") != (target is not None):
        fail("--metric acceptance and --target go together (a draft is measured with its target)")
    if metric == "acceptance":
        if ray is not None or chunks is not None or full_forward:
            fail("--ray, --chunks and --full-forward apply to KLD sweeps; an acceptance sweep decodes --prompts")
        assert target is not None
        _acceptance_sweep(model, target, text, types, output, imatrix, tensors, group, prompts, prompt_len, max_new,
                          block, plot, ev)
        return
    auto = chunks is not None and chunks.strip().lower() == "auto"
    if chunks is not None and not auto and not chunks.strip().isdigit():
        fail(f"--chunks must be a number of chunks or auto, not {chunks!r}")
    m = _load(model, ev)
    try:
        type_list = _candidate_types(m, types)
        imat = read_imatrix(imatrix) if imatrix else None
        groups = sweep_groups(m, group, tensors)
        all_tokens = tokenize_chunks(m, _read_text(text), ctx, None if auto or chunks is None else int(chunks))
        rounds = auto_rounds(len(all_tokens)) if auto else [len(all_tokens)]
        if output.exists() and auto:  # resume the round the file was measured in
            from ikquant.sweepfile import read_sweep_file

            theirs = read_sweep_file(output)[0]
            if theirs.get("chunks") in rounds:
                stopped = theirs.get("ranking", {}).get("stable", False)
                rounds = [n for n in rounds if n == theirs["chunks"] or (n > theirs["chunks"] and not stopped)]
        done = load_rows(output, sweep_header(m, text, ctx, rounds[0], group, imatrix))
    except (NotImplementedError, IkError) as exc:
        fail(str(exc))
    with ExitStack() as stack:
        cluster = None
        if ray is not None:
            from ikquant.cluster import open_cluster

            try:
                cluster = stack.enter_context(open_cluster(ray, ev.threads or 1))
            except IkError as exc:
                fail(str(exc))
            err.print(f"Ray {ray}: {cluster.workers} workers of {cluster.threads} thread(s)", highlight=False)
        rows = _sweep_rounds(m, ev, text, all_tokens, rounds, group, imatrix, imat, groups, type_list, done, output,
                             full_forward, cluster, auto)
    out.print(sweep_table(rows))
    err.print(f"wrote {output}: {len(rows)} measurements ({len(rows) - len(done)} new)")
    if plot is not None:
        from ikrun.sweep.plot import plot_sweep

        try:
            plot_sweep(rows, plot, f"{model.name}: mean KLD per tensor and type")
        except RuntimeError as exc:
            fail(str(exc))
        err.print(f"wrote {plot}")


def _candidate_types(m: Model, types: str) -> list[GGMLType]:
    """A sweep's --types: each one iktools can write and the run's numerics can evaluate."""
    from ikquant.types import type_by_name

    out = [type_by_name(t) for t in types.split(",") if t.strip()]
    for t in out:
        t.require_codec()
        m.check_numerics_type(t)
    return out


def _draft_pair(target: Path, draft: Path, ev: Evaluation, text: Path, prompts: int, prompt_len: int, max_new: int,
                block: Optional[int]) -> tuple[Model, Model, int, list[np.ndarray]]:
    """Target and DFlash draft loaded and checked against each other, the block size, and the prompts cut from
    the text (tokenized without BOS), before any compute."""
    from ikrun.eval.speculative import prompt_starts
    from ikrun.models.dflash import DFlashDraft

    t, d = _load(target, ev), _load(draft, ev, beside=True)
    try:
        if not isinstance(d.impl, DFlashDraft):
            fail(f"{draft} is a {d.arch} model, not a DFlash draft (dflash-draft)")
        d.impl.check_target(t.impl)
        bs = block or d.impl.block_size
        if bs < 2:
            fail(f"--block {bs}: a block holds the known token and at least one proposal")
        ids = np.asarray(t.tokenizer().encode(_read_text(text), add_special=False), dtype=np.int64)
        starts = prompt_starts(len(ids), prompts, prompt_len, max_new)
    except IkError as exc:
        fail(str(exc))
    return t, d, bs, [ids[s : s + prompt_len] for s in starts]


def _acceptance_sweep(model: Path, target: Path, text: Path, types: str, output: Path, imatrix: Optional[Path],  # type: ignore[no-untyped-def]
                      tensors: Optional[str], group: str, prompts: int, prompt_len: int, max_new: int,
                      block: Optional[int], plot: Optional[Path], ev: Evaluation) -> None:
    """`ikrun sweep DRAFT --target T --metric acceptance`: the acceptance length each draft tensor costs."""
    from ikquant.imatrix import read_imatrix
    from ikrun.sweep.acceptance import AcceptanceRow, decoding_identity, run_acceptance_sweep
    from ikrun.sweep.measure import load_rows, save_rows, sweep_groups, sweep_header

    t, d, bs, chunks = _draft_pair(target, model, ev, text, prompts, prompt_len, max_new, block)
    try:
        type_list = _candidate_types(d, types)
        imat = read_imatrix(imatrix) if imatrix else None
        groups = sweep_groups(d, group, tensors)
        header = {**sweep_header(d, text, 0, 0, group, imatrix), "metric": "acceptance", "ctx": None,
                  "chunks": None, "decoding": decoding_identity(t, chunks, max_new, bs)}
        done = load_rows(output, header, AcceptanceRow)
    except IkError as exc:
        fail(str(exc))
    rows = list(done)
    with _progress() as bar:
        task = bar.add_task("acceptance sweep", total=len(groups) * len(type_list) - len(done))

        def on_row(row) -> None:  # type: ignore[no-untyped-def]
            rows.append(row)
            save_rows(output, header, rows)
            bar.update(task, advance=1, description=f"{row.group} {row.type}")

        run_acceptance_sweep(d, t, chunks, max_new, bs, groups, type_list, imat, done, on_row)
    table = Table(title="acceptance length lost per group (most first)")
    for col in ("type", "group", "bpw", "acceptance", "lost", "first position"):
        table.add_column(col, justify="left" if col in ("type", "group") else "right")
    for r in sorted(rows, key=lambda r: (r.type, -r.acceptance_loss)):
        table.add_row(r.type, r.group, f"{r.bpw:.2f}", f"{r.acceptance_mean:.3f}", f"{r.acceptance_loss:+.3f}",
                      f"{100 * r.acceptance_first:.0f}%")
    out.print(table)
    err.print(f"wrote {output}: {len(rows)} measurements ({len(rows) - len(done)} new)")
    if plot is not None:
        err.print("[yellow]warning:[/] --plot draws KLD sweeps; nothing drawn for an acceptance sweep")


def _sweep_rounds(m: Model, ev: Evaluation, text: Path, all_tokens, rounds: list[int], group: str,  # type: ignore[no-untyped-def]
                  imatrix: Optional[Path], imat, groups: dict[str, list[str]], type_list: list, done: list,
                  output: Path, full_forward: bool, cluster, auto: bool) -> list:  # type: ignore[type-arg]
    """Measure the sweep on the first n chunks for every n of `rounds` (one round unless --chunks auto), each
    round extending the last one's per-token scores; stop once two rounds rank the groups alike."""
    import tempfile

    from ikrun.eval.evaluate import open_base, perplexity
    from ikrun.sweep.measure import AUTO_STABLE_TAU, Scored, rank_agreement, run_sweep, save_rows, sweep_header

    scored: Scored = {}
    previous: list | None = None  # type: ignore[type-arg]
    rows: list = list(done)  # type: ignore[type-arg]
    for k, n in enumerate(rounds):
        header = sweep_header(m, text, all_tokens.shape[1], n, group, imatrix)
        chunk_tokens = all_tokens[:n]
        todo = len(groups) * len(type_list) - sum(1 for r in done if r.group in groups)
        base_plan = _plan(m, n, all_tokens.shape[1], ev)
        with tempfile.TemporaryDirectory() as tmp, _progress() as bar:
            base_path = Path(tmp) / "base.kld"
            task = bar.add_task(f"base logits ({n} chunks)", total=n)
            perplexity(m, chunk_tokens, base_path, lambda i, _: bar.update(task, completed=i), base_plan)
            bar.update(task, description="sweep", completed=0, total=max(todo, 0))
            rows = list(done)

            def on_row(row) -> None:  # type: ignore[no-untyped-def]
                rows.append(row)
                save_rows(output, header, rows)
                bar.update(task, advance=1, description=f"{row.group} {row.type}")

            try:
                if cluster is None:
                    run_sweep(m, open_base(base_path, m), groups, type_list, imat, done, on_row, ev.spill_dir,
                              full_forward, scored)
                else:
                    from ikrun.sweep.cluster import run_sweep_on_cluster

                    run_sweep_on_cluster(cluster, _worker_spec(m, ev, cluster, imatrix, full_forward), base_path,
                                         groups, type_list, done, on_row, lambda msg: err.print(msg), scored)
            except IkError as exc:
                bar.stop()
                fail(str(exc))
        if auto:
            if previous is not None:
                tau = rank_agreement(previous, rows)
                stable = tau >= AUTO_STABLE_TAU
                err.print(f"--chunks auto: {rounds[k - 1]} -> {n} chunks, rank agreement "
                          f"(least Kendall tau over types) {tau:.3f}"
                          + (f" >= {AUTO_STABLE_TAU}: stable, stopping at {n} chunks" if stable else ""),
                          highlight=False)
                if stable:
                    save_rows(output, {**header, "ranking": {"after_chunks": rounds[k - 1], "kendall_tau": tau,
                                                             "stable": True}}, rows)
                    break
            if k == len(rounds) - 1:
                err.print(f"--chunks auto: stopped at {n} chunks: " + (
                    f"{output} says the ranking was stable here" if n < len(all_tokens) else
                    "the text has no more" + ("" if previous is not None else " (one round: no ranking compared)")),
                    highlight=False)
            previous, done = rows, []
    return rows


def _worker_spec(m: Model, ev: Evaluation, cluster, imatrix: Optional[Path], full_forward: bool):  # type: ignore[no-untyped-def]
    """What every Ray worker loads: a local cluster's workers share this machine's budget, a remote cluster's
    workers take --mem each (default: their node's share)."""
    from ikquant.sizes import parse_size
    from ikrun.sweep.cluster import WorkerSpec

    local = cluster.address.strip().startswith("local")
    mem = _budget(ev) // cluster.workers if local else (parse_size(ev.mem) if ev.mem else None)
    return WorkerSpec(str(m.path.resolve()), cluster.threads, m.kv_cache, m.options, mem, ev.stream,
                      str(imatrix.resolve()) if imatrix else None, str(ev.spill_dir) if ev.spill_dir else None,
                      full_forward)


@app.command()
@evaluation_options
def mix(
    model: Path = typer.Argument(..., help="The base GGUF the sweep was measured on (the KLD reference)."),
    output: Path = typer.Argument(..., help="The mixed GGUF to write (temporary name, renamed when complete)."),
    sweep: Path = typer.Option(..., "--sweep", help="An `ikrun sweep` result (.json or .csv)."),
    type_name: str = typer.Option(..., "--type", help="File type for every tensor the sweep did not measure, as "
                                  "ikquant --type (e.g. IQ4_KS)."),
    target_bpw: Optional[float] = typer.Option(None, "--target-bpw", help="The whole file's bits per weight."),
    target_size: Optional[str] = typer.Option(None, "--target-size", help="The whole file's tensor bytes, e.g. "
                                              "200GiB."),
    budget: list[str] = typer.Option([], "--budget", help="Repeatable REGEX=SIZE (rest=SIZE for the others), as "
                                     "ikquant --budget."),
    refine: int = typer.Option(0, "--refine", help="Re-measure the N groups of highest predicted KLD at every swept "
                               "type on top of the assembled mix, choose again with those costs, and keep the "
                               "refined file if it measures lower."),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", help="Importance matrix for the quantization "
                                           "(default: the sweep's)."),
    text: Optional[Path] = typer.Option(None, "--text", help="Text to measure on (default: the sweep's)."),
    ctx: Optional[int] = typer.Option(None, "--ctx", "-c", help="Chunk length (default: the sweep's)."),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="Chunks to measure (default: the sweep's)."),
    recipe: str = typer.Option("ik", "--recipe", help="ik or mainline: whose rules type the unswept tensors, and "
                               "with mainline only mainline-loadable types are chosen (as ikquant --recipe)."),
    json_out: bool = typer.Option(False, "--json", help="Print the mixes' sizes, predicted and measured KLD as JSON."),
    ev: Evaluation = None,  # type: ignore[assignment]
) -> None:
    """Build the mix a sweep predicts best within a target, then measure it: predicted vs measured mean KLD.

    The prediction adds up KLDs measured one group at a time; tensors interact, so the assembled file is measured
    against the base on the sweep's text. --refine re-measures the most sensitive groups inside the mix.

    Example: ikrun mix model-bf16.gguf mix.gguf --sweep sweep.json --type IQ4_KS --target-bpw 3.5 --refine 8
    """
    import tempfile

    from ikquant.cli import print_mix
    from ikquant.gguf_io import GGUFFile
    from ikquant.imatrix import read_imatrix
    from ikquant.mix import MixTarget, plan_mix, read_sweep
    from ikquant.quantize import QuantizeOptions
    from ikquant.recipes_mainline import recipe_file_type
    from ikquant.sweepfile import file_sha256, read_sweep_file
    from ikrun.eval.evaluate import open_base, perplexity, tokenize_chunks
    from ikrun.sweep.measure import model_fingerprint

    targets = [t for t in (target_bpw is not None, target_size is not None, bool(budget)) if t]
    if len(targets) != 1:
        fail("give exactly one of --target-bpw, --target-size or --budget")
    m = _load(model, ev)
    try:
        header = read_sweep_file(sweep)[0]
        groups, options = read_sweep(sweep)
        defaults = []  # the sweep's own files, used unless named: they must still be what it measured on
        if text is None:
            text = Path(header["text"])
            defaults.append((text, "text_sha256", "text"))
        if imatrix is None and header.get("imatrix"):
            imatrix = Path(header["imatrix"])
            defaults.append((imatrix, "imatrix_sha256", "imatrix"))
        for path, key, what in defaults:
            if file_sha256(path) != header[key]:
                fail(f"{sweep}'s {what} {path} has changed since the sweep; name it with --{what} to use it anyway")
        if model_fingerprint(m) != header["model_fingerprint"]:
            err.print(f"[yellow]warning:[/] {sweep} was measured on another file than {model}: its predictions "
                      "may not hold", soft_wrap=True)
        imat = read_imatrix(imatrix) if imatrix else None
        opts = QuantizeOptions(recipe_file_type(recipe, type_name), imatrix=imat, recipe=recipe)
        target = MixTarget(target_bpw, target_size, budget)
        plan = plan_mix(GGUFFile(model), opts, groups, options, target, str(sweep))
        chunk_tokens = tokenize_chunks(m, _read_text(text), ctx or header["ctx"], chunks or header["chunks"])
    except (IkError, FileNotFoundError, KeyError) as exc:
        fail(str(exc) if not isinstance(exc, KeyError) else f"{sweep}: its header has no {exc}")
    print_mix(plan)
    n_chunk, n_ctx = chunk_tokens.shape
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        base_path = Path(tmp) / "base.kld"
        with _progress() as bar:
            task = bar.add_task("base logits", total=n_chunk)
            perplexity(m, chunk_tokens, base_path, lambda i, _: bar.update(task, completed=i),
                       _plan(m, n_chunk, n_ctx, ev))
        base = open_base(base_path, m)
        first = _assemble_and_measure(model, output, opts, plan.tensor_types, base, ev)
        summary.append({"mix": "sweep", "bytes": plan.total_bits // 8, "bpw": plan.total_bits / plan.n_weights,
                        "predicted_kld": plan.predicted_kld, **first, "kept": True})
        if refine > 0:
            refined = _refine(m, output, opts, groups, options, plan, target, sweep, base, first, refine, imat, ev)
            if refined is not None:
                summary.append(refined)
                summary[0]["kept"] = not refined["kept"]
    if json_out:
        out.print_json(json.dumps(summary))
        return
    table = Table(title=f"{output.name}: predicted vs measured mean KLD ({n_chunk} chunks of {n_ctx})")
    for col in ("mix", "MiB", "bpw", "predicted", "measured", "±", "measured/predicted", "kept"):
        table.add_column(col, justify="right")
    for row in summary:
        table.add_row(row["mix"], f"{row['bytes'] / 2**20:.3f}", f"{row['bpw']:.4f}", f"{row['predicted_kld']:.6f}",
                      f"{row['kld_mean']:.6f}", f"{row['kld_mean_err']:.6f}",
                      f"{row['kld_mean'] / row['predicted_kld']:.3f}" if row["predicted_kld"] > 0 else "-",
                      "yes" if row["kept"] else "no")
    out.print(table)


def _assemble_and_measure(model: Path, output: Path, opts, types: dict[str, str], base, ev: Evaluation) -> dict:  # type: ignore[no-untyped-def, type-arg]
    """Quantize `model` with `types` into `output` and measure its KLD against `base`."""
    import dataclasses

    from ikquant.quantize import quantize_model
    from ikrun.eval.evaluate import kl_divergence
    from ikrun.eval.metrics import kld_stats

    try:
        quantize_model(model, output, dataclasses.replace(opts, tensor_types=types))
    except (IkError, NotImplementedError) as exc:
        fail(str(exc))
    mixed = _load(output, ev)
    with _progress() as bar:
        task = bar.add_task(f"measuring {output.name}", total=base.n_chunk)
        stats = kld_stats(kl_divergence(mixed, base, lambda i, _: bar.update(task, completed=i)))
    err.print(f"{output}: measured mean KLD {stats['kld_mean']:.6f} ± {stats['kld_mean_err']:.6f}", highlight=False)
    return {"kld_mean": float(stats["kld_mean"]), "kld_mean_err": float(stats["kld_mean_err"]),
            "same_top_p": float(stats["same_top_p"])}


def _refine(m: Model, output: Path, opts, groups, options, plan, target, sweep: Path, base, first: dict,  # type: ignore[no-untyped-def, type-arg]
            refine: int, imat, ev: Evaluation) -> dict | None:  # type: ignore[type-arg]
    """Re-cost the most sensitive groups inside the assembled mix, choose again, keep the better-measured file
    (None: the same mix is chosen again)."""
    from ikquant.cli import print_mix
    from ikquant.gguf_io import GGUFFile
    from ikquant.mix import plan_mix
    from ikquant.outputs import partial_path
    from ikrun.sweep.refine import most_sensitive, refined_options

    chosen = most_sensitive(plan.choice, refine)
    mixed = _load(output, ev)
    with _progress() as bar:
        task = bar.add_task("refining", total=sum(len(options[g]) - 1 for g in chosen))
        new_options = refined_options(m, mixed, base, groups, options, plan.choice, chosen, first["kld_mean"], imat,
                                      ev.spill_dir, lambda g, t, d: bar.update(task, advance=1,
                                                                               description=f"{g} {t}"))
    del mixed
    refined = plan_mix(GGUFFile(m.path), opts, groups, new_options, target, str(sweep))
    row = {"mix": f"refined ({len(chosen)} groups)", "bytes": refined.total_bits // 8,
           "bpw": refined.total_bits / refined.n_weights, "predicted_kld": refined.predicted_kld}
    if refined.tensor_types == plan.tensor_types:
        err.print(f"--refine {refine}: the re-measured costs choose the same mix", highlight=False)
        return None
    print_mix(refined)
    candidate = partial_path(output.with_name(output.stem + "-refined.gguf"))
    try:
        second = _assemble_and_measure(m.path, candidate, opts, refined.tensor_types, base, ev)
        kept = second["kld_mean"] < first["kld_mean"]
        if kept:
            os.replace(candidate, output)
        err.print(f"--refine {refine}: the refined mix measures {second['kld_mean']:.6f} against "
                  f"{first['kld_mean']:.6f}: {output} holds the " + ("refined" if kept else "first") + " mix",
                  highlight=False)
    finally:
        candidate.unlink(missing_ok=True)
    return {**row, **second, "kept": kept}


def sweep_table(rows: list) -> Table:  # type: ignore[type-arg]
    """The most and least sensitive groups per type; `~` marks a group whose effect on perplexity is within noise
    (the paired ln PPL ratio against the base within two standard errors of 0)."""
    t = Table(title="most and least sensitive (mean KLD; ~ : PPL effect within noise)")
    for col in ("type", "group", "bpw", "mean KLD", "±", "99% KLD", "same top"):
        t.add_column(col, justify="right" if col not in ("type", "group") else "left")
    for qtype in dict.fromkeys(r.type for r in rows):
        ranked = sorted((r for r in rows if r.type == qtype), key=lambda r: -r.kld_mean)
        shown = ranked if len(ranked) <= 8 else ranked[:4] + ranked[-4:]
        for i, r in enumerate(shown):
            if len(ranked) > 8 and i == 4:
                t.add_row("", "...", "", "", "", "", "")
            t.add_row(qtype, ("~ " if r.within_noise else "") + r.group, f"{r.bpw:.2f}", f"{r.kld_mean:.6f}",
                      f"{r.kld_sem:.6f}", f"{r.kld_p99:.6f}", f"{100 * r.same_top_p:.1f}%")
        t.add_section()
    return t


@app.command()
@evaluation_options
def accept(
    target: Path = typer.Argument(..., help="The target model's GGUF."),
    draft: Path = typer.Argument(..., help="The DFlash draft's GGUF (ikconvert hf2gguf ... --target-model-dir)."),
    text: Path = typer.Option(..., "--text", help="Text the prompts are cut from (tokenized without BOS)."),
    prompts: int = typer.Option(6, "--prompts", help="Number of prompts; prompt i starts at token i*floor((n-L-M)/N)."),
    prompt_len: int = typer.Option(24, "--prompt-len", help="Tokens per prompt (L)."),
    max_new: int = typer.Option(96, "--max-new", help="New tokens per prompt (M)."),
    block: Optional[int] = typer.Option(None, "--block", help="Block size (default: the draft's)."),
    compare: Optional[str] = typer.Option(None, "--compare", help="Comma-separated types: quantize the draft to each "
                                          "in memory (from its own weights) and measure it too, e.g. Q8_0,Q4_K,IQ4_KS."),
    check: bool = typer.Option(True, "--check/--no-check", help="Check every output against the target's own greedy "
                               "continuation (speculation must not change it)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    ev: Evaluation = None,  # type: ignore[assignment]
) -> None:
    """Greedy speculative decoding with a DFlash draft: acceptance length (tokens per target step) per prompt and
    per draft position, tokens/s, and the check that the output is the target's own.

    Example: ikrun accept qwen3-8b.gguf dflash-draft.gguf --text wiki.test.raw --prompts 8 --max-new 256
    --compare Q8_0,Q4_K
    """
    from ikquant.types import type_by_name
    from ikrun.eval.speculative import (
        acceptance_by_position,
        greedy_continuation,
        mean_acceptance_length,
        speculative_generate,
    )

    t, d, bs, chunks = _draft_pair(target, draft, ev, text, prompts, prompt_len, max_new, block)
    try:
        types = [type_by_name(x) for x in compare.split(",") if x.strip()] if compare else []
        for qt in types:
            qt.require_codec()
    except IkError as exc:
        fail(str(exc))

    def measure(label: str, used: list[str]) -> dict:  # type: ignore[type-arg]
        with _progress() as bar:
            task = bar.add_task(f"{label}: speculative decoding", total=len(chunks))
            runs = []
            for p in chunks:
                runs.append(speculative_generate(t, d, p, max_new, bs))
                bar.update(task, advance=1)
        mismatched = []
        if check:
            for i, (p, r) in enumerate(zip(chunks, runs)):
                if greedy_continuation(t, p, max_new) != r.output_ids:
                    mismatched.append(i)
        seconds = sum(r.seconds for r in runs)
        return {"draft": label, "types_used": used, "draft_bytes": sum(d.weights.encoding(n).raw.nbytes for n in d.weights.names()),
                "mean_acceptance_length": mean_acceptance_length(runs),
                "tokens_per_second": len(chunks) * max_new / seconds if seconds > 0 else 0.0,
                "output_matches_target": not mismatched if check else None, "mismatched_prompts": mismatched,
                "acceptance_by_position": acceptance_by_position(runs, bs),
                "runs": [{"prompt": r.prompt, "output_ids": r.output_ids, "acceptance_lengths": r.acceptance_lengths}
                         for r in runs]}

    results = [measure("as stored", sorted({d.weights.encoding(n).type.name for n in d.weights.names()}))]
    for qt in types:
        try:
            results.append(measure(qt.name, _quantize_draft_in_memory(d, qt)))
        except IkError as exc:
            fail(str(exc))
        finally:
            d.restore()
    if json_out:
        out.print_json(json.dumps(results[0] if not types else results))
    else:
        _print_acceptance(results, bs, len(chunks), prompt_len, max_new)
    if check and any(r["mismatched_prompts"] for r in results):
        bad = next(r for r in results if r["mismatched_prompts"])
        fail(f"draft {bad['draft']}: the speculative output of prompt {bad['mismatched_prompts'][0]} differs from the "
             "target's own greedy continuation (a runtime bug: please report it)")


def _quantize_draft_in_memory(d: Model, qtype) -> list[str]:  # type: ignore[no-untyped-def]
    """Every quantizable draft weight re-encoded as `qtype` from its stored encoding and swapped in; the types
    written (ik's fallback where a row does not hold `qtype`'s blocks)."""
    from ikquant.recipes import eligible
    from ikrun.sweep.measure import quantized_copy

    used_types = set()
    for name in d.weights.names():
        info = d.weights.info(name)
        if eligible(name, len(info.ne), info.type):
            used, raw = quantized_copy(d, name, qtype, None)
            d.swap(name, used, raw)
            used_types.add(used.name)
    return sorted(used_types)


def _print_acceptance(results: list, bs: int, n_prompts: int, prompt_len: int, max_new: int) -> None:  # type: ignore[type-arg]
    table = Table(title=f"acceptance length: {n_prompts} prompts of {prompt_len} tokens, {max_new} new, blocks of {bs}")
    for col in ("draft", "weights", "MiB", "mean acceptance", "per prompt", "tok/s", "= target"):
        table.add_column(col, justify="right")
    for r in results:
        per = [sum(x["acceptance_lengths"]) / len(x["acceptance_lengths"]) for x in r["runs"]]
        table.add_row(r["draft"], "+".join(r["types_used"]), f"{r['draft_bytes'] / 2**20:.3f}", f"{r['mean_acceptance_length']:.2f}",
                      " ".join(f"{v:.1f}" for v in per), f"{r['tokens_per_second']:.1f}",
                      "-" if r["output_matches_target"] is None else "yes" if r["output_matches_target"] else "NO")
    out.print(table)
    pos = Table(title="accepted share by draft position")
    pos.add_column("draft")
    for j in range(1, bs):
        pos.add_column(str(j), justify="right")
    for r in results:
        pos.add_row(r["draft"], *(f"{100 * v:.0f}%" for v in r["acceptance_by_position"]))
    out.print(pos)


@app.command()
@evaluation_options
def validate(
    hf: Path = typer.Option(..., "--hf", help="Hugging Face checkpoint folder."),
    gguf: Path = typer.Option(..., "--gguf", help="GGUF converted from it."),
    text: Optional[Path] = typer.Option(None, "--text", help="Text to evaluate (default: a built-in sample)."),
    ctx: int = typer.Option(64, "--ctx", "-c", help="Tokens per evaluated sequence."),
    chunks: int = typer.Option(2, "--chunks", help="Number of sequences."),
    tolerance: float = typer.Option(1e-4, "--tolerance", help="Largest acceptable relative logit error."),
    json_out: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
    ev: Evaluation = None,  # type: ignore[assignment]
) -> None:
    """Compare the runtime on a GGUF against a numpy reference written from the HF model definition (the reference
    always computes the model's semantics, whatever the runtime options say).

    Exit code 1 when the relative logit error exceeds --tolerance (right for F32 files; quantized files differ
    by their quantization error).

    Example: ikrun validate --hf ./Qwen3-0.6B --gguf qwen3-0.6b-f32.gguf
    """
    from ikconvert.tiny import CORPUS
    from ikrun.eval.evaluate import tokenize_chunks
    from ikrun.eval.stream import evaluate_chunks
    from ikrun.validate.hf import HFReference

    m = _load(gguf, ev)
    try:
        ref = HFReference(hf)
        chunk_tokens = tokenize_chunks(m, _read_text(text or CORPUS), ctx, chunks)
    except IkError as exc:
        fail(str(exc))
    plan = _plan(m, len(chunk_tokens), ctx, ev)
    gots = []
    with _tracked(m, plan, "runtime") as (on_chunk, on_block):
        for i, got in evaluate_chunks(m, chunk_tokens, plan, on_block, as_perplexity=False):
            gots.append(got)
            on_chunk(i + 1, len(chunk_tokens))
    refs = []
    with _progress() as bar:
        task = bar.add_task("reference", total=len(chunk_tokens))
        for i, c in enumerate(chunk_tokens):
            refs.append(ref.logits(c))
            bar.update(task, completed=i + 1)
    _report_validation(np.concatenate(refs), np.concatenate(gots), tolerance, json_out)


def _report_validation(refs: np.ndarray, gots: np.ndarray, tolerance: float, json_out: bool) -> None:
    from ikrun.validate.hf import compare_logits

    res = compare_logits(refs, gots)
    ok = res["max_rel_logit_err"] <= tolerance and math.isfinite(res["max_rel_logit_err"])
    if json_out:
        out.print_json(json.dumps({**res, "ok": ok, "tolerance": tolerance}))
    else:
        out.print(f"max relative logit error {res['max_rel_logit_err']:.3e} (tolerance {tolerance:g}), "
                  f"KLD mean {res['kld_mean']:.3e} max {res['kld_max']:.3e}, same top {res['same_top']:.1%}: "
                  + ("[green]OK[/]" if ok else "[red]MISMATCH[/]"))
    if not ok:
        raise typer.Exit(1)
