"""`ikrun logits`, `ikrun ppl`, `ikrun kld`: a model's logits, perplexity, and KL-divergence against a base."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import typer
from rich.table import Table

from ikquant.cli_common import err, fail, out
from ikquant.errors import IkError
from ikrun.commands.common import (
    BATCH_HELP,
    batch_report,
    check_batch,
    check_output,
    load_model,
    read_text,
    run_plan,
    tracked,
)
from ikrun.commands.options import Evaluation, evaluation_options

if TYPE_CHECKING:
    from ikrun.eval.stream import StreamPlan
    from ikrun.model import Model

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
    m = load_model(model, ev)
    if (text is None) == (tokens is None):
        fail("give exactly one of --text or --tokens")
    try:
        if tokens is not None:
            ids_text = [t.strip() for t in tokens.split(",") if t.strip()]
            if not all(t.lstrip("-").isdigit() for t in ids_text):
                fail(f"--tokens {tokens!r} is not a comma-separated list of token ids")
            ids = np.array([int(t) for t in ids_text], dtype=np.int64)
        else:
            ids = np.array(m.tokenizer().encode(read_text(text)), dtype=np.int64)  # type: ignore[arg-type]
        run_plan(m, 1, len(ids), ev)
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


@evaluation_options
def ppl(
    model: Path = typer.Argument(..., help="GGUF model."),
    text: Path = typer.Option(..., "--text", help="UTF-8 text file."),
    ctx: int = typer.Option(512, "--ctx", "-c", help="Chunk length in tokens (ik's -c)."),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="Evaluate at most this many chunks."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object {n_tokens, ppl, ppl_err, "
                                  "cache_type_k, cache_type_v}."),
    save_base_logits: Optional[Path] = typer.Option(None, "--save-base-logits", help="Also write the run's "
                                                    "base-logits file (ik's --kl-divergence-base), for ikrun kld "
                                                    "--base-logits and for ik."),
    batch: Optional[int] = typer.Option(None, "--batch", "-b", help=BATCH_HELP),
    ev: Evaluation = None,  # type: ignore[assignment]
) -> None:
    """Perplexity over the text, chunked and scored exactly like ik's llama-perplexity.

    Example: ikrun ppl model.gguf --text wiki.test.raw --ctx 512 --json
    Example: ikrun ppl model-bf16.gguf --text wiki.test.raw --save-base-logits base.kld
    """
    from ikrun.eval.evaluate import perplexity, tokenize_chunks
    from ikrun.eval.metrics import ppl_stats

    check_output(save_base_logits, "--save-base-logits")
    check_batch(batch)
    m = load_model(model, ev)
    try:
        chunk_tokens = tokenize_chunks(m, read_text(text), ctx, chunks)
    except IkError as exc:
        fail(str(exc))
    plan = run_plan(m, len(chunk_tokens), ctx, ev, batch=batch)
    with tracked(m, plan, "perplexity") as (on_chunk, on_block):
        try:
            res = perplexity(m, chunk_tokens, save_base_logits, on_chunk, plan, on_block)
        except IkError as exc:
            fail(str(exc))
    stats = {**ppl_stats(res.nll), **run_paths(m, ctx, plan), **batch_report(plan)}
    if json_out:
        out.print_json(json.dumps({**stats, **m.cache.report()}))
    else:
        out.print(f"Final estimate: PPL over {res.n_chunk} chunks for n_ctx={ctx} = {stats['ppl']:.4f} +/- "
                  f"{stats['ppl_err']:.5f}  ({stats['n_tokens']} tokens scored; {settings(m, ctx, plan)})")
    if save_base_logits is not None:
        err.print(f"wrote {save_base_logits}: base logits of {res.n_chunk} chunks")


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
    versus: Optional[Path] = typer.Option(None, "--versus", help="A second model under test, scored on the same "
                                          "tokens against the same base: the report adds the two mean KLDs' "
                                          "difference and ratio, with errors from the per-token differences."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object with every statistic."),
    batch: Optional[int] = typer.Option(None, "--batch", "-b", help=BATCH_HELP + " The base model's run too."),
    ev: Evaluation = None,  # type: ignore[assignment]
) -> None:
    """KL-divergence of a model against a base model or a base-logits file, with all of ik's statistics.

    Example: ikrun kld model-q4_0.gguf --base model-f32.gguf --text wiki.test.raw --ctx 512
    Example: ikrun kld model-q4_0.gguf --base-logits base.kld --json
    Example: ikrun kld mix.gguf --base-logits base.kld --versus recipe.gguf
    """
    from contextlib import ExitStack

    from ikquant.outputs import scratch_folder
    from ikrun.eval.evaluate import kl_divergence, open_base, perplexity, tokenize_chunks

    if (base is None) == (base_logits is None):
        fail("give exactly one of --base (with --text) or --base-logits")
    if save_base_logits is not None and base is None:
        fail("--save-base-logits writes the base model's run: give it with --base (--base-logits is such a file)")
    check_output(save_base_logits, "--save-base-logits")
    check_batch(batch)
    m = load_model(model, ev)
    other = None if versus is None else load_model(versus, ev)
    if other is not None and other.n_vocab != m.n_vocab:
        fail(f"--versus {versus}: {other.n_vocab} tokens, {model} has {m.n_vocab}: not the same vocabulary")
    scratch = ExitStack()
    try:
        if base is not None:
            if text is None:
                fail("--base needs --text")
            bm = load_model(base, ev)
            if bm.n_vocab != m.n_vocab:
                fail(f"{base} has {bm.n_vocab} tokens, {model} has {m.n_vocab}: not the same vocabulary")
            chunk_tokens = tokenize_chunks(bm, read_text(text), ctx, chunks)  # type: ignore[arg-type]
            if save_base_logits is None:
                save_base_logits = scratch.enter_context(scratch_folder("kld", ev.spill_dir)) / "base.kld"
            plan = run_plan(bm, len(chunk_tokens), ctx, ev, batch=batch)
            with tracked(bm, plan, "base model") as (on_chunk, on_block):
                perplexity(bm, chunk_tokens, save_base_logits, on_chunk, plan, on_block)
            bm.drop_cache()
            base_logits = save_base_logits
        bf = open_base(base_logits, m)  # type: ignore[arg-type]
        plan = run_plan(m, bf.n_chunk, bf.n_ctx, ev, batch=batch)
        with tracked(m, plan, "KL-divergence") as (on_chunk, on_block):
            acc = kl_divergence(m, bf, on_chunk, plan=plan, on_block=on_block)
        other_acc = None
        if other is not None:
            m.drop_cache()
            plan = run_plan(other, bf.n_chunk, bf.n_ctx, ev, batch=batch)
            with tracked(other, plan, f"KL-divergence of {other.path.name}") as (on_chunk, on_block):
                other_acc = kl_divergence(other, bf, on_chunk, plan=plan, on_block=on_block)
    except IkError as exc:
        fail(str(exc))
    finally:
        scratch.close()
    from ikrun.eval.metrics import kld_stats, paired_kld_stats

    stats = kld_stats(acc)
    paired = None if other_acc is None else {"model": str(versus), **paired_kld_stats(acc, other_acc)}
    if json_out:
        out.print_json(json.dumps({**{k: (float(v) if isinstance(v, (float, np.floating)) else v)
                                      for k, v in stats.items()}, **m.cache.report(),
                                   **run_paths(m, bf.n_ctx, plan), **batch_report(plan),
                                   **({"versus": paired} if paired else {})}))
        return
    if stats["n_tokens"] < 100:
        err.print(f"[yellow]warning:[/] only {stats['n_tokens']} tokens scored; ik prints no final statistics "
                  "below 100")
    out.print(kld_table(stats, f"{model} ({settings(m, bf.n_ctx, plan)})"))
    if paired is not None:
        out.print(paired_table(paired, str(model)))


def paired_table(paired: dict, name: str) -> Table:
    """The two models' mean KLDs on the same tokens, their difference and ratio with the paired errors."""
    t = Table(title=f"{name} against {paired['model']}: {paired['n_tokens']} tokens, each scored by both")
    t.add_column("statistic")
    t.add_column("value", justify="right")
    t.add_column("±", justify="right")
    t.add_row(f"Mean KLD, {name}", f"{paired['kld_mean']:.6f}", f"{paired['kld_mean_err']:.6f}")
    t.add_row(f"Mean KLD, {paired['model']}", f"{paired['versus_kld_mean']:.6f}",
              f"{paired['versus_kld_mean_err']:.6f}")
    t.add_row("Difference (per-token, paired)", f"{paired['kld_diff']:.6f}", f"{paired['kld_diff_err']:.6f}")
    t.add_row("Ratio of the means", f"{paired['kld_ratio']:.4f}", f"{paired['kld_ratio_err']:.4f}")
    t.add_row("Cor(KLD, KLD)", f"{paired['kld_cor']:.2f}%", "")
    t.add_row(f"Tokens where {name} is lower", f"{100 * paired['lower_kld_tokens']:.1f}%", "")
    return t


def settings(m: Model, n_ctx: int, plan: StreamPlan | None = None) -> str:
    """The run's cache types and the computation paths its n_ctx-token chunks (or their batches) took (MLA's,
    ik's flash attention or not), as its console report names them."""
    had = "".join(f", {side} Hadamard blocks of {b}" for side, b in (("K", m.cache.k_hadamard),
                                                                     ("V", m.cache.v_hadamard)) if b)
    named = {"flash_attn": "flash attention {}", "ik_defect": "reproducing {}"}
    paths = "".join(", " + named.get(key, key.removesuffix("_path").upper() + " {} path").format(path)
                    for key, path in run_paths(m, n_ctx, plan).items())
    fed = f", batches of {plan.batch} tokens" if plan is not None and plan.batch else ""
    return f"K cache {m.cache.k}, V cache {m.cache.v}{had}{paths}{fed}"


def run_paths(m: Model, n_ctx: int, plan: StreamPlan | None) -> dict[str, str]:
    """The computation paths a run took (Model.computed_paths, at its plan's batches)."""
    return m.computed_paths(n_ctx, plan.batch if plan is not None else None)


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
