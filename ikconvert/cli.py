"""`ikconvert`: Hugging Face checkpoints -> GGUF files that ik_llama.cpp loads."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from ikquant.cli_common import (
    NO_TENSOR_FIRST_SPLIT,
    OVERRIDE_KV,
    SPLIT_MAX_SIZE,
    SPLIT_MAX_TENSORS,
    err,
    fail,
    new_app,
    out,
    print_shard_plan,
    report_outputs,
)
from ikquant.errors import IkError

app = new_app(__doc__, "Convert Hugging Face checkpoints into GGUF files for ik_llama.cpp.")


@app.command("hf2gguf")
def hf2gguf(
    src: str = typer.Argument(..., help="Checkpoint folder, or hf://org/repo[@revision] (uses the local HF cache "
                              "when offline)."),
    outfile: Optional[Path] = typer.Option(None, "--outfile", "-o", help="Output .gguf path (default: "
                                           "<checkpoint folder name>-<OUTTYPE>.gguf in the current folder)."),
    outtype: str = typer.Option("f16", "--outtype", help="f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q6_0, or "
                                "auto (f16 if the checkpoint is stored in f16, else bf16), as ik's converter defines "
                                "them (q4_*/q5_* keep embeddings, output, attn_k/attn_v at q5_0/q6_0)."),
    pre_tokenizer: Optional[str] = typer.Option(None, "--pre-tokenizer", help="Force tokenizer.ggml.pre (e.g. "
                                                "qwen2, llama-bpe, deepseek-v3) instead of identifying it from "
                                                "tokenizer.json."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Override general.name."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (HF tensor -> GGUF name, shape, type, "
                                 "transform) and write nothing."),
    allow_nonfinite: bool = typer.Option(False, "--allow-nonfinite", help="Keep NaN/Inf weights instead of "
                                         "stopping (float output types only)."),
    target_model_dir: Optional[Path] = typer.Option(None, "--target-model-dir", help="DFlash drafts: the target "
                                                    "model's folder (tokenizer, vocabulary size, hidden size)."),
    mtp: bool = typer.Option(False, "--mtp", help="DeepSeek-V4: export only the standalone MTP predictor, as ik's "
                             "converter does with --mtp."),
    keep_mtp: bool = typer.Option(False, "--keep-mtp", help="DeepSeek-V3: keep the MTP layer as the last block "
                                  "(nextn.* tensors, as GLM's NextN blocks), for ikrun accept --mtp. ik's converter "
                                  "drops it and ik's loader refuses such a file (ik runs no DeepSeek-V3 MTP)."),
    split_max_size: Optional[str] = SPLIT_MAX_SIZE,
    split_max_tensors: int = SPLIT_MAX_TENSORS,
    no_tensor_first_split: bool = NO_TENSOR_FIRST_SPLIT,
    override_kv: list[str] = OVERRIDE_KV,
) -> None:
    """Convert a Hugging Face checkpoint to GGUF, key for key and byte for byte what ik's converter writes.

    Example: ikconvert hf2gguf ./Qwen3-0.6B --outtype bf16 --outfile qwen3-0.6b-bf16.gguf
    """
    from ikconvert.checkpoint import hub_repo, resolve_source
    from ikconvert.convert import Converter
    from ikquant.kv_override import parse_override
    from ikquant.split_layout import output_shards

    try:
        shards = output_shards(split_max_size, split_max_tensors, no_tensor_first_split)
        overrides = [parse_override(text) for text in override_kv]
        folder = resolve_source(src)
        options = {"target_model_dir": target_model_dir, "mtp": mtp, "keep_mtp": keep_mtp}
        conv = Converter(folder, outtype, pre_tokenizer, allow_nonfinite, model_name, options, hub_repo(src))
        plan = conv.build_plan()
    except IkError as exc:
        fail(str(exc))
    if dry_run:
        _print_plan(conv)
        print_shard_plan(outfile or Path(f"{folder.name}-{conv.outtype.upper()}.gguf"),
                         [p.type.tensor_bytes(tuple(reversed(p.shape))) for p in plan], shards.limits)
        return
    if outfile is None:
        outfile = Path(f"{folder.name}-{conv.outtype.upper()}.gguf")
    if outfile.exists() and outfile.is_dir():
        fail(f"--outfile {outfile} is a folder")
    total = sum(p.type.tensor_bytes(tuple(reversed(p.shape))) for p in plan)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, transient=False) as bar:
        task = bar.add_task("converting", total=total)

        def step(p, nbytes: int) -> None:  # type: ignore[no-untyped-def]
            bar.update(task, advance=nbytes, description=p.out.name)

        try:
            path = conv.write(outfile, step, shards.limits, overrides)
        except IkError as exc:
            bar.stop()
            fail(str(exc))
    report_outputs(conv.outputs, [])
    notes = [p for p in plan if p.note]
    for p in notes:
        err.print(f"[yellow]warning:[/] {p.out.name}: {p.note}")
    in_shards = f" in {len(conv.outputs)} shards" if len(conv.outputs) > 1 else ""
    err.print(f"wrote [bold]{path}[/]{in_shards} ({len(plan)} tensors, {total / 2**20:.1f} MiB, arch {conv.arch.gguf_arch}, "
              f"pre-tokenizer {conv.pre_tokenizer})")


def _print_plan(conv) -> None:  # type: ignore[no-untyped-def]
    table = Table(title=f"{conv.ckpt.dir} -> {conv.arch.gguf_arch} ({conv.outtype})")
    for col in ("HF tensor", "GGUF tensor", "ne (ggml order)", "type", "transform"):
        table.add_column(col, overflow="fold")
    for p in conv.plan:
        ne = "{" + ", ".join(str(d) for d in reversed(p.shape)) + "}"
        table.add_row(p.out.source, p.out.name, ne, p.type.name, "; ".join(x for x in (p.out.transform, p.note) if x))
    out.print(table)
    total = sum(p.type.tensor_bytes(tuple(reversed(p.shape))) for p in conv.plan)
    if conv.skipped:
        shown = ", ".join(conv.skipped[:8]) + (", ..." if len(conv.skipped) > 8 else "")
        out.print(f"{len(conv.skipped)} HF tensors skipped on purpose, as ik does: {shown}", highlight=False)
    out.print(f"{len(conv.plan)} tensors, {total / 2**20:.1f} MiB; nothing written (--dry-run)")
