#!/usr/bin/env python3
"""The whole flow on a tiny Qwen3 checkpoint the project makes itself: convert, validate, quantize, measure.

Every step runs the real command-line tools (printed as they run); the outputs land in ./demo-out.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ikconvert import CORPUS, TinySpec, make_tiny_checkpoint

OUT = Path("demo-out")
BIN = Path(sys.executable).parent
console = Console()


def run(*args: str, capture: bool = False) -> str:
    cmd = [str(BIN / args[0]), *args[1:]]
    console.print(f"[bold cyan]$ {shlex.join(args)}[/]")
    res = subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE if capture else None)
    return res.stdout or ""


def main() -> None:
    OUT.mkdir(exist_ok=True)
    # 256-wide rows, so the 256-value super-block types (k-quants, IQK, trellis) apply without fallbacks
    hf = make_tiny_checkpoint(OUT / "tiny-qwen3", TinySpec(arch="qwen3", hidden=256, layers=2, heads=4, kv_heads=2,
                                                           head_dim=64, ffn=768))
    console.print(f"[bold]tiny Qwen3 checkpoint:[/] {hf}")
    f32 = OUT / "tiny-qwen3-f32.gguf"
    run("ikconvert", "hf2gguf", str(hf), "--outtype", "f32", "--pre-tokenizer", "qwen2", "--outfile", str(f32))
    run("ikrun", "validate", "--hf", str(hf), "--gguf", str(f32))
    imatrix = OUT / "imatrix.dat"
    run("ikrun", "imatrix", str(f32), "--text", str(CORPUS), "--ctx", "64", "-o", str(imatrix))
    base = OUT / "base-logits.kld"
    rows = []
    for qtype in ("Q8_0", "Q4_0", "Q4_K_M", "IQ4_KS", "IQ2_KT"):
        q = OUT / f"tiny-qwen3-{qtype.lower()}.gguf"
        run("ikquant", str(f32), str(q), "--type", qtype, "--imatrix", str(imatrix))
        if base.exists():
            src = ["--base-logits", str(base)]
        else:
            src = ["--base", str(f32), "--text", str(CORPUS), "--ctx", "64", "--save-base-logits", str(base)]
        stats = json.loads(run("ikrun", "kld", str(q), *src, "--json", capture=True))
        rows.append((qtype, q.stat().st_size, stats))
    first = rows[0][2]
    table = Table(title=f"KL-divergence against F32 (PPL {first['ppl_base']:.2f}, {first['n_tokens']} tokens)")
    for col in ("type", "KiB", "PPL(Q)", "mean KLD", "99% KLD", "same top"):
        table.add_column(col, justify="right")
    table.add_row("F32", f"{f32.stat().st_size / 1024:.0f}", f"{first['ppl_base']:.2f}", "0", "0", "100%")
    for qtype, size, s in rows:
        table.add_row(qtype, f"{size / 1024:.0f}", f"{s['ppl_q']:.2f}", f"{s['kld_mean']:.6f}",
                      f"{s['kld_p99']:.6f}", f"{100 * s['same_top_p']:.2f}%")
    console.print(table)


if __name__ == "__main__":
    main()
