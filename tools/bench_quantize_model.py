#!/usr/bin/env python3
"""Whole-model quantization: wall time and peak RSS on a synthetic f16 model, per type and thread count.

The model is a stack of 4096 x 4096 and 4096 x 11008 f16 matrices of gaussian weights (default about 2 GB) with
an importance matrix; each run is a separate `ikquant` process whose own peak RSS is reported.

Example: python tools/bench_quantize_model.py --size-gb 2 --type Q4_0 --type IQ4_KS --type IQ2_KT --threads 1 --threads 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from ikquant import GGUFStreamWriter, Imatrix, ImatrixEntry, type_by_name, write_imatrix_dat

PEAK_RSS = Path(__file__).parent / "peak_rss.py"


def make_model(path: Path, size_gb: float) -> tuple[int, Path]:
    """Write the synthetic model and its imatrix; returns the number of weights."""
    shapes = [(4096, 4096), (11008, 4096), (4096, 11008)]
    per_layer = sum(r * c for r, c in shapes) * 2
    layers = max(1, round(size_gb * 1e9 / per_layer))
    rng = np.random.default_rng(0)
    f16 = type_by_name("F16")
    names = [(f"blk.{i}.{k}.weight", s) for i in range(layers) for k, s in zip(("attn_q", "ffn_up", "ffn_down"), shapes)]
    imat = Imatrix(chunks=10, dataset="synthetic")
    with GGUFStreamWriter(path, "llama") as w:
        for name, shape in names:
            w.add_tensor_info(name, shape, f16)
            imat.entries[name] = ImatrixEntry(rng.lognormal(0, 1, shape[1]).astype(np.float32) * 10, 10)
        for name, shape in names:
            w.write_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16))
        w.finish()
    dat = path.with_suffix(".imatrix.dat")
    write_imatrix_dat(dat, imat)
    return sum(r * c for _, (r, c) in names), dat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("bench-quantize"))
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--type", dest="types", action="append", help="default: Q4_0, IQ4_KS, IQ2_KT")
    ap.add_argument("--threads", type=int, action="append", help="default: 1 and all cores")
    a = ap.parse_args()
    types = a.types or ["Q4_0", "IQ4_KS", "IQ2_KT"]
    threads = a.threads or sorted({1, os.cpu_count() or 1})
    a.workdir.mkdir(parents=True, exist_ok=True)
    src = a.workdir / "model-f16.gguf"
    dat = src.with_suffix(".imatrix.dat")
    if not src.exists() or not dat.exists():
        print(f"writing a {a.size_gb:g} GB synthetic model ...", flush=True)
        n_weights, dat = make_model(src, a.size_gb)
    else:
        from ikquant import GGUFFile

        n_weights = sum(t.n_elements for t in GGUFFile(src).tensors.values())
    print(f"model: {src.stat().st_size / 1e9:.2f} GB, {n_weights / 1e6:.0f} M weights")
    print(f"{'type':8s} {'threads':>7s} {'seconds':>9s} {'M weights/s':>12s} {'peak RSS MiB':>13s}")
    exe = str(Path(sys.executable).parent / "ikquant")
    for t in types:
        for n in threads:
            out = a.workdir / f"out-{t}.gguf"
            res = subprocess.run([sys.executable, str(PEAK_RSS), exe, str(src), str(out), "--type", t, "--imatrix",
                                  str(dat), "--threads", str(n)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True)
            if res.returncode:
                sys.exit(f"ikquant failed for {t}: {res.stderr}")
            _, rss, dt = res.stderr.strip().splitlines()[-1].split()
            print(f"{t:8s} {n:7d} {float(dt):9.1f} {n_weights / 1e6 / float(dt):12.2f} {float(rss):13.0f}", flush=True)
            out.unlink()


if __name__ == "__main__":
    main()
