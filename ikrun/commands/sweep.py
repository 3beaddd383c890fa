"""`ikrun sweep`: each tensor group's KLD (or a DFlash draft's or NextN head's acceptance) per candidate type."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.table import Table

from ikquant.cli_common import MIN_TYPE, NO_DEFAULT_TIES, TIE, err, fail, out
from ikquant.errors import IkError
from ikrun.commands.accept import draft_pair, mtp_settings, mtp_target
from ikrun.commands.common import (
    BATCH_HELP,
    check_batch,
    load_model,
    memory_budget,
    progress_bar,
    read_text,
    run_plan,
)
from ikrun.commands.options import Evaluation, evaluation_options

if TYPE_CHECKING:
    from ikquant.types import GGMLType
    from ikrun.model import Model
    from ikrun.sweep.prune import Pruning


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
    batch: Optional[int] = typer.Option(None, "--batch", "-b", help=BATCH_HELP + " The base's run, every "
                                        "candidate's and the tensors measured follow it (an MLA model's "
                                        "attn_kv_b is read by batches of 128 tokens or more)."),
    target_bpw: Optional[str] = typer.Option(None, "--target-bpw", help="Comma-separated whole-file bits per "
                                             "weight (e.g. 3.5,4.5) the sweep serves: measure each group at the "
                                             "cheapest type only, predict the other types from the weighted "
                                             "quantization error, and measure just the types the mixes at these "
                                             "budgets choose (until they choose only measured ones), under "
                                             "--tie/--min-type as ikrun mix chooses; the other rows are written as "
                                             "predicted (\"measured\": false)."),
    prediction_spread: Optional[float] = typer.Option(
        None, "--prediction-spread", help="With --target-bpw: measure every 4th block of each tensor class (and "
        "its last; the first and the later half at two types), predict the other blocks and types from them, and "
        "measure only the options whose predicted KLD saved per bit is within this factor of the mixes' Lagrange "
        "multiplier (e.g. 2)."),
    resolution: Optional[float] = typer.Option(
        None, "--resolution", help="With --prediction-spread: of the options near the frontier, measure only those "
        "whose predicted KLD differs from the chosen option's by more than this many standard errors of a "
        "measurement (the group's measured rows' median; e.g. 1): a difference a measurement cannot resolve is "
        "one the mix cannot choose by."),
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
                               "acceptance: a DFlash draft's mean acceptance length with --target (or, --mtp, the "
                               "model's own NextN head's) on prompts from --text (--prompts, --prompt-len, "
                               "--max-new, --block / --n-max, --p-min as ikrun accept)."),
    target: Optional[Path] = typer.Option(None, "--target", help="With --metric acceptance: the draft's target GGUF."),
    mtp: bool = typer.Option(False, "--mtp", help="With --metric acceptance: sweep the model's own NextN/MTP head's "
                             "tensors (or, with --target, those of the MTP export MODEL: DeepSeek-V4) by the "
                             "acceptance length its drafts lose (ikrun accept --mtp); the rows feed "
                             "ikquant --mtp-sweep / ikrun mix --mtp-sweep with --max-acceptance-loss."),
    n_max: Optional[int] = typer.Option(None, "--n-max", help="With --mtp: tokens drafted per step (default 3)."),
    p_min: Optional[float] = typer.Option(None, "--p-min", help="With --mtp: ik's --draft-p-min (default 0)."),
    recipe: str = typer.Option("ik", "--recipe", help="mainline: accept only --types that mainline llama.cpp loads "
                               "(for mixes made with ikquant --recipe mainline)."),
    prompts: int = typer.Option(6, "--prompts", help="With --metric acceptance: number of prompts."),
    prompt_len: int = typer.Option(24, "--prompt-len", help="With --metric acceptance: tokens per prompt."),
    max_new: int = typer.Option(96, "--max-new", help="With --metric acceptance: new tokens per prompt."),
    block: Optional[int] = typer.Option(None, "--block", help="With --metric acceptance: block size (default: the "
                                        "draft's)."),
    tie: list[str] = TIE,
    no_default_ties: bool = NO_DEFAULT_TIES,
    min_type: list[str] = MIN_TYPE,
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
    from ikrun.model import fed_batch
    from ikrun.sweep.measure import auto_rounds, load_rows, sweep_groups, sweep_header, unmeasured_tensors

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
    if metric != "acceptance" and (target is not None or mtp):
        fail("--target and --mtp go with --metric acceptance (a KLD sweep lists a NextN head's tensors as "
             "unmeasured: the forward it scores never reads them)")
    if not mtp and (n_max is not None or p_min is not None):
        fail("--n-max and --p-min go with --mtp (a DFlash draft drafts a block: --block)")
    if metric == "acceptance":
        if mtp and block is not None:
            fail("--mtp sweeps a NextN/MTP head: it takes no --block (--n-max drafts per step)")
        if not mtp and target is None:
            fail("--metric acceptance and --target go together (a draft is measured with its target; --mtp for the "
                 "model's own NextN head)")
        if ray is not None or chunks is not None or full_forward or batch is not None:
            fail("--ray, --chunks, --full-forward and --batch apply to KLD sweeps; an acceptance sweep decodes "
                 "--prompts")
        _acceptance_sweep(model, target, text, types, output, imatrix, tensors, group, prompts, prompt_len, max_new,
                          block, plot, ev, mtp_settings(n_max, p_min) if mtp else None)
        return
    check_batch(batch)
    fed = fed_batch(ctx, batch)
    auto = chunks is not None and chunks.strip().lower() == "auto"
    if chunks is not None and not auto and not chunks.strip().isdigit():
        fail(f"--chunks must be a number of chunks or auto, not {chunks!r}")
    bpws = _target_bpws(target_bpw) if target_bpw is not None else None
    if prediction_spread is not None and (bpws is None or not prediction_spread >= 1):
        fail(f"--prediction-spread {prediction_spread:g}: give a factor of 1 or more, with --target-bpw")
    if resolution is not None and (prediction_spread is None or not resolution >= 0):
        fail(f"--resolution {resolution:g}: give a number of standard errors (0 or more), with --prediction-spread")
    if bpws is None and (tie or no_default_ties or min_type):
        fail("--tie, --no-default-ties and --min-type decide what a --target-bpw sweep measures; an exhaustive "
             "sweep measures every type (give them to ikrun mix)")
    from ikquant.mix_constraints import MixConstraints
    from ikrun.sweep.prune import Pruning

    constraints = MixConstraints(tuple(tie), not no_default_ties, tuple(min_type))
    m = load_model(model, ev)
    try:
        type_list = _candidate_types(m, types)
        imat = read_imatrix(imatrix) if imatrix else None
        m.check_context(ctx, fed)
        groups = sweep_groups(m, group, tensors, ctx, fed)
        unmeasured = unmeasured_tensors(m, ctx, tensors, fed)
        if unmeasured:
            first = next(iter(unmeasured))
            err.print(f"{len(unmeasured)} tensors left unmeasured (listed in the sweep's header), e.g. {first}: "
                      f"{unmeasured[first]}", soft_wrap=True)
        all_tokens = tokenize_chunks(m, read_text(text), ctx, None if auto or chunks is None else int(chunks))
        rounds = auto_rounds(len(all_tokens)) if auto else [len(all_tokens)]
        if output.exists() and auto:  # resume the round the file was measured in
            from ikquant.sweepfile import read_sweep_file

            theirs = read_sweep_file(output)[0]
            if theirs.get("chunks") in rounds:
                stopped = theirs.get("ranking", {}).get("stable", False)
                rounds = [n for n in rounds if n == theirs["chunks"] or (n > theirs["chunks"] and not stopped)]
        # a pruned sweep's predicted rows are no measurements: a sweep resumed on its file measures them
        done = [r for r in load_rows(output, sweep_header(m, text, ctx, rounds[0], group, imatrix, batch=fed))
                if r.measured]
        if bpws is not None:
            from ikrun.sweep.prune import check_budgets

            check_budgets(m, groups, type_list, bpws, constraints)
    except IkError as exc:
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
        pruning = (Pruning(bpws, constraints, prediction_spread, resolution or 0.0) if bpws is not None else None)
        rows = _sweep_rounds(m, ev, text, all_tokens, rounds, group, imatrix, imat, groups, type_list, done, output,
                             full_forward, cluster, auto, pruning, fed)
    out.print(sweep_table(rows))
    if bpws is not None:
        err.print(f"wrote {output}: {len(rows)} rows ({sum(1 for r in rows if r.measured)} measured)")
    else:
        err.print(f"wrote {output}: {len(rows)} measurements ({len(rows) - len(done)} new)")
    if plot is not None:
        from ikrun.sweep.plot import plot_sweep

        try:
            plot_sweep(rows, plot, f"{model.name}: mean KLD each tensor adds, per type")
        except IkError as exc:
            fail(str(exc))
        err.print(f"wrote {plot}")


def _candidate_types(m: Model, types: str) -> list[GGMLType]:
    """A sweep's --types: each one iktools can write and the run's numerics can evaluate."""
    from ikquant.types import type_by_name

    out = [type_by_name(t) for t in types.split(",") if t.strip()]
    for t in out:
        t.require_codec()
        m.check_type(t)
    return out


def _acceptance_sweep(model: Path, target: Optional[Path], text: Path, types: str, output: Path,  # type: ignore[no-untyped-def]
                      imatrix: Optional[Path], tensors: Optional[str], group: str, prompts: int, prompt_len: int,
                      max_new: int, block: Optional[int], plot: Optional[Path], ev: Evaluation,
                      mtp: tuple[int, float] | None) -> None:
    """`ikrun sweep DRAFT --target T --metric acceptance`: the acceptance length each draft tensor costs; with
    `mtp` = (n_max, p_min), `ikrun sweep T --metric acceptance --mtp`: each tensor of T's NextN head (`ikrun sweep
    MTP --target T ... --mtp`: of the MTP export MTP drafting for T)."""
    from functools import partial

    from ikquant.imatrix import read_imatrix
    from ikrun.eval.speculative import mtp_generate, speculative_generate
    from ikrun.sweep.acceptance import AcceptanceRow, Decode, decoding_identity, run_acceptance_sweep
    from ikrun.sweep.measure import RowSaver, load_rows, sweep_groups, sweep_header

    decode: Decode
    if mtp is not None:
        n_max, p_min = mtp
        # the model's own head, or (--target T) the model is an MTP export that drafts beside T (DeepSeek-V4)
        t, h, head, chunks = (mtp_target(model, ev, text, prompts, prompt_len, max_new) if target is None else
                              mtp_target(target, ev, text, prompts, prompt_len, max_new, model))
        d, bs, drafter = h or t, n_max + 1, f"blk.{head}."
        decode = partial(mtp_generate, t, max_new=max_new, n_max=n_max, p_min=p_min, head=h)
    else:
        assert target is not None
        t, d, bs, chunks = draft_pair(target, model, ev, text, prompts, prompt_len, max_new, block)
        drafter = ""
        decode = partial(speculative_generate, t, d, max_new=max_new, block=bs)
    try:
        type_list = _candidate_types(d, types)
        imat = read_imatrix(imatrix) if imatrix else None
        groups = {g: kept for g, names in sweep_groups(d, group, tensors).items()
                  if (kept := [n for n in names if n.startswith(drafter)])}
        if not groups:
            fail(f"--tensors {tensors!r} matches none of {model}'s NextN head tensors ({drafter}*)")
        decoding = decoding_identity(t, chunks, max_new, bs, None if mtp is None else
                                     {"n_max": mtp[0], "p_min": mtp[1]})
        # an --mtp sweep measures the head the file's KLD forward never reads: nothing of what it sweeps is unmeasured
        header = {**sweep_header(d, text, 0, 0, group, imatrix, "acceptance"), "ctx": None,
                  "chunks": None, "decoding": decoding, **({"unmeasured": {}} if mtp is not None else {})}
        done = load_rows(output, header, AcceptanceRow)
    except IkError as exc:
        fail(str(exc))
    saver = RowSaver(output, header, done)
    with progress_bar() as bar:
        task = bar.add_task("acceptance sweep", total=len(groups) * len(type_list) - len(done))

        def on_row(row) -> None:  # type: ignore[no-untyped-def]
            saver.add(row)
            bar.update(task, advance=1, description=f"{row.group} {row.type}")

        try:
            run_acceptance_sweep(d, decode, chunks, bs, groups, type_list, imat, done, on_row)
        finally:
            saver.flush()
    rows = saver.rows
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
                  output: Path, full_forward: bool, cluster, auto: bool,
                  pruning: Pruning | None = None, batch: int | None = None) -> list:  # type: ignore[type-arg]
    """Measure the sweep on the first n chunks for every n of `rounds` (one round unless --chunks auto), each
    round extending the last one's per-token scores; stop once two rounds rank the groups alike. With `pruning`
    (the --target-bpw budgets and the mix's constraints) each round is a pruned sweep (ikrun/sweep/prune.py): its
    measurements are those the pruning asks for, locally or on the cluster, and its rows the measured and
    predicted ones together; rounds are compared on the rows both measured. `batch`: each chunk fed that many
    tokens at a time, the base's run and every candidate's."""
    from ikquant.outputs import scratch_folder
    from ikrun.eval.evaluate import open_base, perplexity
    from ikrun.sweep import run_sweep
    from ikrun.sweep.measure import AUTO_STABLE_TAU, Measurer, RowSaver, Scored, rank_agreement, save_rows, sweep_header
    from ikrun.sweep.prune import run_pruned_sweep

    scored: Scored = {}
    previous: list | None = None  # type: ignore[type-arg]
    rows: list = list(done)  # type: ignore[type-arg]
    for k, n in enumerate(rounds):
        header = sweep_header(m, text, all_tokens.shape[1], n, group, imatrix, batch=batch)
        if pruning is not None:
            header = {**header, **pruning.header()}
        chunk_tokens = all_tokens[:n]
        todo = len(groups) * len(type_list) - sum(1 for r in done if r.group in groups)
        base_plan = run_plan(m, n, all_tokens.shape[1], ev, batch=batch)
        with scratch_folder("sweep", ev.spill_dir) as tmp, progress_bar() as bar:
            base_path = tmp / "base.kld"
            task = bar.add_task(f"base logits ({n} chunks)", total=n)
            perplexity(m, chunk_tokens, base_path, lambda i, _: bar.update(task, completed=i), base_plan)
            bar.update(task, description="pruned sweep" if pruning else "sweep", completed=0,
                       total=None if pruning else max(todo, 0))
            saver = RowSaver(output, header, done)
            base = open_base(base_path, m)
            pool = None
            if cluster is not None:
                from ikrun.sweep.cluster import WorkerPool

                pool = WorkerPool()  # the round's workers, for all its batches
            kept: list[Measurer] = []  # a local pruned sweep's rounds share one recording of the block inputs

            def on_row(row) -> None:  # type: ignore[no-untyped-def]
                saver.add(row)
                bar.update(task, advance=1, description=f"{row.group} {row.type}")

            def measure(jobs: set[tuple[str, str]] | None, already: list) -> list:  # type: ignore[type-arg]
                if cluster is None and pruning is not None and not kept:
                    kept.append(Measurer(m, base, ev.spill_dir, full_forward, batch))
                return run_sweep(m, base, groups, type_list, imat, already, on_row, spill_dir=ev.spill_dir,
                                 full_forward=full_forward, scored=scored, cluster=cluster,
                                 worker_mem=_worker_mem(ev, cluster) if cluster is not None else None,
                                 on_event=lambda msg: err.print(msg), only=jobs, pool=pool,
                                 measurer=kept[0] if kept else None, batch=batch)

            try:
                if pruning is None:
                    measure(None, done)
                    rows = saver.rows
                else:
                    result = run_pruned_sweep(m, groups, type_list, imat, pruning.bpws, done,
                                              lambda jobs: measure(jobs, []), pruning.constraints, pruning.spread,
                                              pruning.resolution)
                    saver.flush()  # before the whole file, which the finally clause must not overwrite
                    rows = result.rows
                    save_rows(output, header, rows)
            except IkError as exc:
                bar.stop()
                fail(str(exc))
            finally:
                saver.flush()  # what was measured, for a resumed run, also when interrupted
                if pool is not None:
                    pool.close(cluster.ray)
                for measurer in kept:
                    measurer.close()
        if pruning is not None:
            err.print(result.summary(), highlight=False)
        if auto:
            if previous is not None:
                tau = rank_agreement([r for r in previous if r.measured], [r for r in rows if r.measured])
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


def _target_bpws(value: str) -> list[float]:
    """--target-bpw B1,B2,...: positive numbers."""
    try:
        bpws = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        fail(f"--target-bpw {value!r} is not a comma-separated list of bits per weight (e.g. 3.5,4.5)")
    if not bpws or any(not b > 0 for b in bpws):
        fail(f"--target-bpw {value!r} is not a comma-separated list of bits per weight (e.g. 3.5,4.5)")
    return bpws


def _worker_mem(ev: Evaluation, cluster) -> int | None:  # type: ignore[no-untyped-def]
    """Each Ray worker's budget: a local cluster's workers share this machine's budget, a remote cluster's workers
    take --mem each (default: their node's share)."""
    from ikquant.sizes import parse_size

    if cluster.address.strip().startswith("local"):
        return memory_budget(ev) // cluster.workers
    return parse_size(ev.mem) if ev.mem else None


def sweep_table(rows: list) -> Table:  # type: ignore[type-arg]
    """The most and least sensitive groups per type (by the KLD each adds to the unmodified model's, paired token by
    token); `~` marks a group whose effect on perplexity is within noise (the paired ln PPL ratio against the base
    within two standard errors of 0)."""
    t = Table(title="most and least sensitive (mean KLD, and what the swap adds to the unmodified model's, paired; "
                    "~ : PPL effect within noise)")
    for col in ("type", "group", "bpw", "mean KLD", "±", "added", "±", "99% KLD", "same top"):
        t.add_column(col, justify="right" if col not in ("type", "group") else "left")
    for qtype in dict.fromkeys(r.type for r in rows):
        ranked = sorted((r for r in rows if r.type == qtype), key=lambda r: -r.cost)
        shown = ranked if len(ranked) <= 8 else ranked[:4] + ranked[-4:]
        for i, r in enumerate(shown):
            if len(ranked) > 8 and i == 4:
                t.add_row("", "...", "", "", "", "", "", "", "")
            t.add_row(qtype, ("~ " if r.within_noise else "") + r.group, f"{r.bpw:.2f}", f"{r.kld_mean:.6f}",
                      f"{r.kld_sem:.6f}", f"{r.kld_added:.3e}", f"{r.kld_added_sem:.1e}", f"{r.kld_p99:.6f}",
                      f"{100 * r.same_top_p:.1f}%")
        t.add_section()
    return t
