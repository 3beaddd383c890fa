"""`ikrun validate`: a GGUF's logits against the numpy reference forward of its Hugging Face checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import typer

from ikquant.cli_common import fail, out
from ikquant.errors import IkError
from ikrun.commands.common import load_model, progress_bar, read_text, run_plan, tracked
from ikrun.commands.options import Evaluation, evaluation_options

if TYPE_CHECKING:
    pass


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

    m = load_model(gguf, ev)
    try:
        ref = HFReference(hf)
        chunk_tokens = tokenize_chunks(m, read_text(text or CORPUS), ctx, chunks)
    except IkError as exc:
        fail(str(exc))
    plan = run_plan(m, len(chunk_tokens), ctx, ev)
    gots = []
    with tracked(m, plan, "runtime") as (on_chunk, on_block):
        for i, got in evaluate_chunks(m, chunk_tokens, plan, on_block, as_perplexity=False):
            gots.append(got)
            on_chunk(i + 1, len(chunk_tokens))
    refs = []
    with progress_bar() as bar:
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
