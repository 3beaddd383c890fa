"""`ikrun mix`: a per-tensor type mix at a size budget from a sweep, assembled, measured and refined."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.table import Table

from ikquant.cli_common import MAX_ACCEPTANCE_LOSS, MIN_TYPE, MTP_SWEEP, NO_DEFAULT_TIES, TIE, err, fail, out
from ikquant.errors import IkError
from ikrun.commands.common import check_batch, load_model, progress_bar, read_text, run_plan
from ikrun.commands.options import Evaluation, evaluation_options
from ikrun.errors import SweepError

if TYPE_CHECKING:
    from ikrun.model import Model


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
    text: Optional[Path] = typer.Option(None, "--text", help="Text to measure and --refine on (default: the "
                                        "sweep's)."),
    eval_text: Optional[Path] = typer.Option(None, "--eval-text", help="Also measure the kept file on this text "
                                             "(same --ctx and --chunks); the report says held-out when it is not "
                                             "the text the sweep was measured on, else in-sample."),
    ctx: Optional[int] = typer.Option(None, "--ctx", "-c", help="Chunk length (default: the sweep's)."),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="Chunks to measure (default: the sweep's)."),
    batch: Optional[int] = typer.Option(None, "--batch", "-b", help="Feed each chunk this many tokens at a time "
                                        "through its cache, as ik's micro-batches (ikrun sweep --batch; default: "
                                        "the sweep's, else each chunk whole)."),
    mtp_sweep: Optional[Path] = MTP_SWEEP,
    max_acceptance_loss: Optional[float] = MAX_ACCEPTANCE_LOSS,
    tie: list[str] = TIE,
    no_default_ties: bool = NO_DEFAULT_TIES,
    min_type: list[str] = MIN_TYPE,
    recipe: str = typer.Option("ik", "--recipe", help="ik or mainline: whose rules type the unswept tensors, and "
                               "with mainline only mainline-loadable types are chosen (as ikquant --recipe)."),
    json_out: bool = typer.Option(False, "--json", help="Print the mixes' sizes, predicted and measured KLD as JSON."),
    allow_requantize: bool = typer.Option(False, "--allow-requantize", help="Quantize tensors the base file holds "
                                          "quantized already (MXFP4 experts, say), as ikquant --allow-requantize."),
    recipe_out: Optional[Path] = typer.Option(None, "--recipe-out", help="Also write the kept mix's per-tensor "
                                              "types as ik --custom-q rules, with its predicted and measured KLD "
                                              "(as ikquant --recipe-out)."),
    ev: Evaluation = None,  # type: ignore[assignment]
) -> None:
    """Build the mix a sweep predicts best within a target, then measure it: predicted vs measured mean KLD.

    The prediction adds up KLDs measured one group at a time; tensors interact, so the assembled file is measured
    against the base on the sweep's text. --refine re-measures the most sensitive groups inside the mix. With
    --mtp-sweep the NextN head is typed within --max-acceptance-loss and the kept file's head is measured on the
    head sweep's prompts: predicted vs measured acceptance loss.

    Example: ikrun mix model-bf16.gguf mix.gguf --sweep sweep.json --type IQ4_KS --target-bpw 3.5 --refine 8
    """
    from ikquant.cli import head_from_sweep, print_mix, print_unmeasured
    from ikquant.imatrix import read_imatrix
    from ikquant.mix import MixTarget, plan_mix, read_sweep
    from ikquant.mix_constraints import MixConstraints
    from ikquant.outputs import scratch_folder
    from ikquant.quantize import QuantizeOptions
    from ikquant.recipes_mainline import recipe_file_type
    from ikquant.shards import GGUFModel
    from ikquant.sweepfile import file_sha256, read_sweep_file
    from ikrun.eval.evaluate import tokenize_chunks
    from ikrun.model import fed_batch
    from ikrun.sweep.measure import model_fingerprint

    targets = [t for t in (target_bpw is not None, target_size is not None, bool(budget)) if t]
    if len(targets) != 1:
        fail("give exactly one of --target-bpw, --target-size or --budget")
    if (mtp_sweep is None) != (max_acceptance_loss is None):
        fail("--mtp-sweep and --max-acceptance-loss go together (the head's types within a bound on its loss)")
    check_batch(batch)
    m = load_model(model, ev)
    try:
        header = read_sweep_file(sweep)[0]
        missing = [key for key in ("ctx", "chunks", "model_fingerprint") if key not in header]
        if missing:
            raise SweepError(f"{sweep}: its header has no {', '.join(missing)}")
        groups, options, unmeasured = read_sweep(sweep)
        defaults = []  # the sweep's own files, used unless named: they must still be what it measured on
        if text is None:
            text = Path(header["text"])
            defaults.append((text, "text_sha256", "text"))
        if imatrix is None and header.get("imatrix"):
            imatrix = Path(header["imatrix"])
            defaults.append((imatrix, "imatrix_sha256", "imatrix"))
        for path, key, what in defaults:
            if file_sha256(path) != header[key]:
                fail(f"--sweep {sweep}: its {what} {path} has changed since the sweep; name it with --{what} to use "
                     "it anyway")
        if model_fingerprint(m) != header["model_fingerprint"]:
            fail(f"--sweep {sweep} was measured on another model file ({header.get('model')}) than {model}: its "
                 "costs are against another base; sweep this file")
        imat = read_imatrix(imatrix) if imatrix else None
        opts = QuantizeOptions(recipe_file_type(recipe, type_name), imatrix=imat, recipe=recipe,
                               allow_requantize=allow_requantize)
        target = MixTarget(target_bpw, target_size, budget)
        constraints = MixConstraints(tuple(tie), not no_default_ties, tuple(min_type))
        head = None
        if mtp_sweep is not None and max_acceptance_loss is not None:
            decoding = read_sweep_file(mtp_sweep)[0].get("decoding") or {}
            if "mtp" in decoding and decoding.get("target_fingerprint") != model_fingerprint(m):
                raise SweepError(f"--mtp-sweep {mtp_sweep} was measured on another model file than {model}: sweep "
                                 "this file's head")
            head = head_from_sweep(GGUFModel(model), mtp_sweep, max_acceptance_loss, constraints)
            opts.tensor_types = dict(head.tensor_types)
        plan = plan_mix(GGUFModel(model), opts, groups, options, target, str(sweep), constraints)
        chunk_tokens = tokenize_chunks(m, read_text(text), ctx or header["ctx"], chunks or header["chunks"])
        eval_tokens = None
        if eval_text is not None:
            try:
                eval_tokens = tokenize_chunks(m, read_text(eval_text), chunk_tokens.shape[1],
                                              chunks or header["chunks"])
            except IkError as exc:
                raise SweepError(f"--eval-text {eval_text}: {exc}") from None
    except IkError as exc:
        fail(str(exc))
    print_mix(plan)
    print_unmeasured(unmeasured)
    n_chunk, n_ctx = chunk_tokens.shape
    fed = fed_batch(n_ctx, batch if batch is not None else header.get("batch"))
    summary = []
    with scratch_folder("mix", ev.spill_dir) as tmp:
        base = _base_logits(m, chunk_tokens, tmp / "base.kld", ev, "base logits", fed)
        first, written = _assemble_and_measure(model, output, opts, plan.tensor_types, base, ev, fed)
        summary.append({"mix": "sweep", "bytes": plan.total_bits // 8, "bpw": plan.total_bits / plan.n_weights,
                        "predicted_kld": plan.predicted_kld, **first, "kept": True})
        kept = (written, plan, first["kld_mean"])
        if refine > 0:
            refined = _refine(m, output, opts, plan, target, constraints, sweep, base, first, refine, imat, ev, fed)
            if refined is not None:
                row, refined_written, refined_plan = refined
                summary.append(row)
                summary[0]["kept"] = not row["kept"]
                if row["kept"]:
                    kept = (refined_written, refined_plan, row["kld_mean"])
    def sample(path: Path) -> str:
        return "held-out" if file_sha256(path) != header["text_sha256"] else "in-sample"

    for row in summary:
        row["text"], row["sample"] = str(text), sample(text)
    if eval_text is not None and eval_tokens is not None:
        summary.append(_measure_on(m, output, eval_tokens, ev, kept[1], eval_text, sample(eval_text), fed))
    if head is not None:
        kept_row = next(r for r in summary if r["kept"])
        kept_row["head"] = _head_acceptance(m, output, ev, head.decoding, head.predicted_loss)
    if recipe_out is not None:
        from ikquant.recipe_out import recipe_text, write_recipe

        try:
            write_recipe(recipe_out, recipe_text(kept[0], type_name, kept[1], kept[2]))
        except IkError as exc:
            fail(str(exc))
        err.print(f"wrote {recipe_out}: the kept mix as --custom-q rules", highlight=False)
    if json_out:
        out.print_json(json.dumps(summary))
        return
    table = Table(title=f"{output.name}: predicted vs measured mean KLD ({n_chunk} chunks of {n_ctx} per text; "
                        "in-sample: the sweep's text, held-out: another)")
    for col in ("mix", "MiB", "bpw", "text", "predicted", "measured", "±", "measured/predicted", "kept"):
        table.add_column(col, justify="right")
    for row in summary:
        table.add_row(row["mix"], f"{row['bytes'] / 2**20:.3f}", f"{row['bpw']:.4f}",
                      f"{Path(row['text']).name} ({row['sample']})", f"{row['predicted_kld']:.6f}",
                      f"{row['kld_mean']:.6f}", f"{row['kld_mean_err']:.6f}",
                      f"{row['kld_mean'] / row['predicted_kld']:.3f}" if row["predicted_kld"] > 0 else "-",
                      "yes" if row["kept"] else "no")
    out.print(table)


def _base_logits(m: Model, tokens, path: Path, ev: Evaluation, what: str, batch: int | None):  # type: ignore[no-untyped-def]
    """The base model's logits on `tokens` (each chunk fed `batch` tokens at a time), written to `path` and opened
    as the KLD reference."""
    from ikrun.eval.evaluate import open_base, perplexity

    n_chunk, n_ctx = tokens.shape
    plan = run_plan(m, n_chunk, n_ctx, ev, batch=batch)
    with progress_bar() as bar:
        task = bar.add_task(what, total=n_chunk)
        perplexity(m, tokens, path, lambda i, _: bar.update(task, completed=i), plan)
    return open_base(path, m)


def _measured(path: Path, base, ev: Evaluation, what: str, batch: int | None) -> dict:  # type: ignore[no-untyped-def, type-arg]
    """The KLD statistics of the GGUF at `path` against `base` (each chunk fed `batch` tokens at a time), printed
    as `what`."""
    from ikrun.eval.evaluate import kl_divergence
    from ikrun.eval.metrics import kld_stats
    from ikrun.eval.stream import plan_run

    mixed = load_model(path, ev)
    try:
        plan = plan_run(mixed, base.n_chunk, base.n_ctx, one_pass=True, batch=batch)
    except IkError as exc:
        fail(str(exc))
    with progress_bar() as bar:
        task = bar.add_task(f"measuring {what}", total=base.n_chunk)
        stats = kld_stats(kl_divergence(mixed, base, lambda i, _: bar.update(task, completed=i), plan=plan))
    err.print(f"{what}: measured mean KLD {stats['kld_mean']:.6f} ± {stats['kld_mean_err']:.6f}", highlight=False)
    return {"kld_mean": float(stats["kld_mean"]), "kld_mean_err": float(stats["kld_mean_err"]),
            "same_top_p": float(stats["same_top_p"])}


def _measure_on(m: Model, output: Path, tokens, ev: Evaluation, plan, eval_text: Path,  # type: ignore[no-untyped-def]
                label: str, batch: int | None) -> dict:  # type: ignore[type-arg]
    """The kept file `output` measured against the base on another text (--eval-text): its summary row."""
    from ikquant.outputs import scratch_folder

    with scratch_folder("mix", ev.spill_dir) as tmp:
        base = _base_logits(m, tokens, tmp / "eval-base.kld", ev, f"base logits on {eval_text.name}", batch)
        stats = _measured(output, base, ev, f"{output} on {eval_text} ({label})", batch)
    return {"mix": "kept, on --eval-text", "bytes": plan.total_bits // 8, "bpw": plan.total_bits / plan.n_weights,
            "predicted_kld": plan.predicted_kld, **stats, "kept": True, "text": str(eval_text), "sample": label}


def _assemble_and_measure(model: Path, output: Path, opts, types: dict[str, str], base, ev: Evaluation,  # type: ignore[no-untyped-def]
                          batch: int | None):
    """Quantize `model` with `types` into `output` and measure its KLD against `base`: (statistics, the executed
    quantization plan)."""
    import dataclasses

    from ikquant.quantize import quantize_model

    try:  # the types already in opts (a NextN head's) stay
        written = quantize_model(model, output, dataclasses.replace(opts, tensor_types={**opts.tensor_types, **types}))
    except IkError as exc:
        fail(str(exc))
    return _measured(output, base, ev, str(output), batch), written


def _refine(m: Model, output: Path, opts, plan, target, constraints, sweep: Path, base, first: dict,  # type: ignore[no-untyped-def, type-arg]
            refine: int, imat, ev: Evaluation, batch: int | None):
    """Re-cost the most sensitive groups inside the assembled mix, choose again, keep the better-measured file:
    (its summary row, its quantization plan, its mix), or None when the same mix is chosen again."""
    from ikquant.cli import print_mix
    from ikquant.mix import plan_mix
    from ikquant.outputs import partial_path
    from ikquant.shards import GGUFModel
    from ikrun.sweep.refine import most_sensitive, refined_options

    chosen = most_sensitive(plan.choice, refine)
    groups, options = plan.groups, plan.options
    mixed = load_model(output, ev)
    with progress_bar() as bar:
        task = bar.add_task("refining", total=sum(len(options[g]) - 1 for g in chosen))
        new_options = refined_options(m, mixed, base, groups, options, plan.choice, chosen, first["kld_mean"], imat,
                                      ev.spill_dir, lambda g, t, d: bar.update(task, advance=1,
                                                                               description=f"{g} {t}"), batch)
    del mixed
    refined = plan_mix(GGUFModel(m.path), opts, groups, new_options, target, str(sweep), constraints)
    row = {"mix": f"refined ({len(chosen)} groups)", "bytes": refined.total_bits // 8,
           "bpw": refined.total_bits / refined.n_weights, "predicted_kld": refined.predicted_kld}
    if refined.tensor_types == plan.tensor_types:
        err.print(f"--refine {refine}: the re-measured costs choose the same mix", highlight=False)
        return None
    print_mix(refined)
    candidate = partial_path(output.with_name(output.stem + "-refined.gguf"))
    try:
        second, written = _assemble_and_measure(m.path, candidate, opts, refined.tensor_types, base, ev, batch)
        kept = second["kld_mean"] < first["kld_mean"]
        if kept:
            os.replace(candidate, output)
        err.print(f"--refine {refine}: the refined mix measures {second['kld_mean']:.6f} against "
                  f"{first['kld_mean']:.6f}: {output} holds the " + ("refined" if kept else "first") + " mix",
                  highlight=False)
    finally:
        candidate.unlink(missing_ok=True)
    return {**row, **second, "kept": kept}, written, refined


def _head_acceptance(m: Model, output: Path, ev: Evaluation, decoding: dict, predicted: float) -> dict:  # type: ignore[type-arg]
    """The kept file's NextN head against the base's on the head sweep's prompts: mean acceptance lengths and the
    loss, beside the predicted one."""
    import numpy as np

    from ikrun.eval.speculative import mean_acceptance_length, mtp_generate

    mtp = decoding["mtp"]

    def mean(model: Model) -> float:
        return mean_acceptance_length([mtp_generate(model, np.asarray(p), decoding["max_new"], mtp["n_max"],
                                                    mtp["p_min"]) for p in decoding["prompts"]])

    base, mixed = mean(m), mean(load_model(output, ev))
    err.print(f"NextN head: mean acceptance {mixed:.4f} against the base's {base:.4f} on the head sweep's "
              f"{len(decoding['prompts'])} prompts: loss {base - mixed:.4f} (predicted {predicted:.4f})",
              highlight=False)
    return {"acceptance_base": base, "acceptance": mixed, "acceptance_loss": base - mixed,
            "predicted_acceptance_loss": predicted}
