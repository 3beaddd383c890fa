#!/usr/bin/env python3
"""Convert throughput (MB/s of input) and peak RSS on a generated ~1 GB bf16 Qwen3-shaped checkpoint.

Each conversion runs in its own process (its peak RSS is what is reported). The baseline in the same run is a
plain copy of the same shards (the I/O ceiling on this disk).

Example: python tools/bench_convert.py --workdir /tmp/bench --outtype f16 --outtype q8_0
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ikconvert.tiny import TinySpec, make_tiny_checkpoint


def run_child(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one command, measured from a small parent (tools/peak_rss.py)."""
    res = subprocess.run([sys.executable, str(Path(__file__).parent / "peak_rss.py"), *cmd],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if res.returncode:
        sys.exit(f"command failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr}")
    _, rss, dt = res.stderr.strip().splitlines()[-1].split()
    return float(dt), float(rss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("bench-convert"))
    ap.add_argument("--outtype", action="append", help="output types to measure (default: f16, q8_0)")
    ap.add_argument("--layers", type=int, default=11, help="11 layers of a 2048-wide model are about 1 GB in bf16")
    a = ap.parse_args()
    outtypes = a.outtype or ["f16", "q8_0"]
    hf = a.workdir / "hf"
    if not (hf / "config.json").exists():
        print(f"generating checkpoint in {hf} ...", flush=True)
        make_tiny_checkpoint(hf, TinySpec(arch="qwen3", hidden=2048, layers=a.layers, heads=16, kv_heads=4,
                                          head_dim=128, ffn=6144, shards=4))
    size = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    print(f"checkpoint: {size / 1e6:.0f} MB in {len(list(hf.glob('*.safetensors')))} shards")
    rows = []
    copy_dir = a.workdir / "copy"
    copy_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for p in hf.glob("*.safetensors"):
        shutil.copyfile(p, copy_dir / p.name)
    copy_s = time.perf_counter() - t0
    shutil.rmtree(copy_dir)
    rows.append(("copy shards (baseline)", copy_s, float("nan")))
    exe = str(Path(sys.executable).parent / "ikconvert")
    for outtype in outtypes:
        out = a.workdir / f"out-{outtype}.gguf"
        dt, peak_mib = run_child([exe, "hf2gguf", str(hf), "--outtype", outtype, "--pre-tokenizer", "qwen2",
                                  "--outfile", str(out)])
        rows.append((f"ikconvert --outtype {outtype}", dt, peak_mib))
        out.unlink()
    print(f"{'step':32s} {'seconds':>8s} {'MB/s in':>8s} {'x copy':>7s} {'peak RSS MiB':>13s}")
    for name, dt, rss in rows:
        print(f"{name:32s} {dt:8.2f} {size / 1e6 / dt:8.1f} {copy_s / dt:7.2f} {rss:13.0f}")


if __name__ == "__main__":
    main()
