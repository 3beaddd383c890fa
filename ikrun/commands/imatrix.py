"""`ikrun imatrix`: an importance matrix from a model's activations on a text."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from ikquant.cli_common import err, fail
from ikquant.errors import IkError
from ikrun.commands.common import BATCH_HELP, check_batch, load_model, read_text, run_plan, tracked
from ikrun.commands.options import Evaluation, evaluation_options

if TYPE_CHECKING:
    pass


@evaluation_options
def imatrix(
    model: Path = typer.Argument(..., help="GGUF model (ideally the unquantized one)."),
    text: Path = typer.Option(..., "--text", help="Calibration text (UTF-8)."),
    output: Path = typer.Option(Path("imatrix.dat"), "--output", "-o", help="Output: ik's .dat layout, or "
                                "mainline's GGUF imatrix when the name ends in .gguf."),
    ctx: int = typer.Option(512, "--ctx", "-c", help="Chunk length in tokens."),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="Use at most this many chunks."),
    batch: Optional[int] = typer.Option(None, "--batch", "-b", help=BATCH_HELP + " Each batch is one call of "
                                        "ik's (llama-imatrix -b): ncall counts them, and a batch under 16 tokens "
                                        "gives the weights that are not experts no data, as in ik."),
    in_file: list[Path] = typer.Option([], "--in-file", help="Earlier imatrix to merge in (repeatable)."),
    save_every: int = typer.Option(10, "--save-every", help="Rewrite the output every N chunks, so an interrupted "
                                   "run loses little (0: only at the end; a streamed run finishes all chunks "
                                   "together and saves at the end)."),
    process_output: bool = typer.Option(False, "--process-output", help="Also collect for output.weight."),
    mtp: bool = typer.Option(False, "--mtp", help="Also collect for the NextN/MTP head's tensors (GLM-4.x, "
                             "DeepSeek-V3; DeepSeek-V4: --mtp-model) by running the head at every position from "
                             "the target's hidden states (ik's llama-imatrix leaves them without data)."),
    mtp_model: Optional[Path] = typer.Option(None, "--mtp-model", help="With --mtp: the MTP export that drafts beside "
                                             "the model (DeepSeek-V4, ikconvert hf2gguf --mtp); its head's entries "
                                             "go into the same output."),
    ev: Evaluation = None,  # type: ignore[assignment]
) -> None:
    """Collect an importance matrix: per weight matrix, the mean square of its input activations per column.

    Example: ikrun imatrix model-f32.gguf --text calibration.txt --ctx 512 -o imatrix.dat
    """
    from ikquant.imatrix import read_imatrix
    from ikrun.eval.evaluate import collect_imatrix, tokenize_chunks
    from ikrun.eval.imatrix import MIN_ROWS, ImatrixCollector, collect_nextn
    from ikrun.eval.metrics import ppl_stats
    from ikrun.model import fed_batch

    check_batch(batch)
    if batch is not None and batch < min(MIN_ROWS, ctx):
        err.print(f"[yellow]warning:[/] --batch {batch}: a call of fewer than {MIN_ROWS} rows is not collected (as "
                  "in ik's llama-imatrix), so only routed experts can get data")
    if mtp_model is not None and not mtp:
        fail("--mtp-model goes with --mtp (the export's head is run only to collect its tensors)")
    m = load_model(model, ev)
    head = None if mtp_model is None else load_model(mtp_model, ev, beside=True)
    collector = ImatrixCollector(process_output=process_output)
    try:
        if head is not None:
            m.impl.check_head(head.impl)
        if mtp:
            (head or m).impl.nextn_head()
        chunk_tokens = tokenize_chunks(m, read_text(text), ctx, chunks)
        for f in in_file:
            collector.merge(read_imatrix(f), ctx)
    except IkError as exc:
        fail(str(exc))
    dataset = str(text)
    plan = run_plan(m, len(chunk_tokens), ctx, ev, batch=batch)
    with tracked(m, plan, "imatrix") as (on_chunk, on_block):

        def step(i: int, n: int) -> None:
            on_chunk(i, n)
            if save_every and i % save_every == 0 and i < n and not plan.streamed:
                collector.save(output, i, ctx, dataset)

        nll = collect_imatrix(m, chunk_tokens, collector, step, plan, on_block)
    if mtp:
        collect_nextn(m, chunk_tokens, collector, head)
    collector.save(output, len(chunk_tokens), ctx, dataset)
    stats = ppl_stats(nll)
    fed = f" in batches of {batch}" if fed_batch(ctx, batch) else ""
    err.print(f"wrote {output}: {len(collector.sums)} entries from {len(chunk_tokens)} chunks of {ctx} tokens{fed} "
              f"(PPL {stats['ppl']:.4f} +/- {stats['ppl_err']:.5f})")
    if not collector.sums:
        err.print("[yellow]warning:[/] no weight was shown rows: the file holds no data")
