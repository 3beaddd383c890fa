"""`ikquant`: quantize a GGUF with ik_llama.cpp's formats and per-tensor decisions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
err = Console(stderr=True)
out = Console()


def _fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@app.command()
def quantize(
    src: Path = typer.Argument(..., help="Input GGUF (f32/f16/bf16, or quantized with --allow-requantize)."),
    dst: Path = typer.Argument(..., help="Output GGUF (written to a temporary name, renamed when complete)."),
    type_name: str = typer.Option(..., "--type", help="Target file type, as ik names it (case-insensitive): "
                                  "Q4_0, Q8_0, Q4_K_M, IQ4_KS, IQ2_KT, F16, BF16, ..."),
    pure: bool = typer.Option(False, "--pure", help="Give every eligible 2-D/3-D weight the target type (1-D "
                              "tensors and norms stay F32); only ik's row-length fallback still applies."),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", help="Importance matrix (ik's .dat layout)."),
    allow_requantize: bool = typer.Option(False, "--allow-requantize", help="Accept already-quantized input "
                                          "tensors (dequantized exactly, then requantized)."),
    leave_output_tensor: bool = typer.Option(False, "--leave-output-tensor", help="Copy output.weight as it is."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help="Worker threads (default: all cores)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (tensor, type, reason, sizes, bpw) and "
                                 "write nothing."),
    json_out: bool = typer.Option(False, "--json", help="With --dry-run: print the plan as a JSON list of "
                                  "{name, type, ...} (types spelled as ik prints them, e.g. q4_K, iq4_ks, f32)."),
) -> None:
    """Quantize IN.gguf into OUT.gguf.

    Example: ikquant model-f32.gguf model-q4_0.gguf --type Q4_0
    Example: ikquant model-bf16.gguf model-q8_0.gguf --type q8_0 --pure --dry-run
    """
    from ikquant.ftypes import UnknownFileTypeError, file_type
    from ikquant.gguf_io import GGUFFile, GGUFFormatError
    from ikquant.imatrix import ImatrixError, read_imatrix_dat
    from ikquant.quantize import QuantizeError, QuantizeOptions, make_plan, quantize_model

    if threads:
        import numba

        numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    try:
        ftype = file_type(type_name)
        imat = read_imatrix_dat(imatrix) if imatrix is not None else None
        opts = QuantizeOptions(ftype, pure, imat, allow_requantize, leave_output_tensor)
        source = GGUFFile(src)
        plans = make_plan(source, opts)
    except FileNotFoundError as exc:
        _fail(str(exc))
        return
    except (UnknownFileTypeError, GGUFFormatError, ImatrixError, QuantizeError) as exc:
        _fail(str(exc))
        return
    for p in plans:
        for note in p.notes:
            err.print(f"[yellow]warning:[/] {p.name}: {note}")
    if imat is not None:
        missing = [p.name for p in plans if p.quantize and p.imatrix_entry is None]
        if missing:
            err.print(f"[yellow]warning:[/] no imatrix entry for {len(missing)} tensors: {', '.join(missing[:6])}"
                      + (" ..." if len(missing) > 6 else ""))
    if dry_run:
        if json_out:
            out.print_json(json.dumps([{"name": p.name, "type": p.type.ggml_name, "quantize": p.quantize,
                                        "reason": p.reason, "bytes_in": p.info.nbytes, "bytes_out": p.new_bytes,
                                        "imatrix": p.imatrix_entry} for p in plans]))
        else:
            _print_plan(plans)
        return
    total = sum(p.info.nbytes for p in plans)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err) as bar:
        task = bar.add_task("quantizing", total=total)
        try:
            quantize_model(src, dst, opts, lambda p: bar.update(task, advance=p.info.nbytes, description=p.name))
        except (QuantizeError, ImatrixError, GGUFFormatError, NotImplementedError, ValueError) as exc:
            bar.stop()
            _fail(str(exc))
            return
    size_in = sum(p.info.nbytes for p in plans)
    size_out = sum(p.new_bytes for p in plans)
    err.print(f"wrote [bold]{dst}[/]: {size_in / 2**20:.2f} MiB -> {size_out / 2**20:.2f} MiB, "
              f"{_bpw(plans):.3f} bits per weight")


def _bpw(plans) -> float:  # type: ignore[no-untyped-def]
    n = sum(p.info.n_elements for p in plans)
    return 8.0 * sum(p.new_bytes for p in plans) / max(n, 1)


def _print_plan(plans) -> None:  # type: ignore[no-untyped-def]
    table = Table(title="quantization plan (nothing written: --dry-run)")
    for col in ("tensor", "from", "to", "MiB in", "MiB out", "why"):
        table.add_column(col, overflow="fold")
    for p in plans:
        table.add_row(p.name, p.info.type.ggml_name, p.type.ggml_name, f"{p.info.nbytes / 2**20:.3f}",
                      f"{p.new_bytes / 2**20:.3f}", p.reason + ("; " + "; ".join(p.notes) if p.notes else ""))
    out.print(table)
    out.print(f"{len(plans)} tensors, {sum(p.info.nbytes for p in plans) / 2**20:.2f} MiB -> "
              f"{sum(p.new_bytes for p in plans) / 2**20:.2f} MiB, {_bpw(plans):.3f} bits per weight")
