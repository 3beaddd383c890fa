#!/usr/bin/env python3
"""Sweep cost: seconds per swap + evaluation on a tiny model, and the share spent outside the forward pass.

Everything outside `forward` (quantizing the tensor, swapping, decoding it, KLD statistics, restoring) is overhead
the sweep adds to the evaluation itself. Target: under 10%.

Example: python tools/bench_sweep.py --chunks 8
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from ikconvert.convert import Converter
from ikconvert.tiny import CORPUS, TinySpec, make_tiny_checkpoint
from ikquant.types import type_by_name
from ikrun.evaluate import open_base, perplexity, tokenize_chunks
from ikrun.model import Model
from ikrun.sweep import run_sweep, sweep_groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--types", default="IQ4_KS,Q4_0")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny_checkpoint(Path(tmp) / "hf", TinySpec(arch="qwen3", hidden=256, layers=2, heads=4, kv_heads=2,
                                                             head_dim=64, ffn=512))
        gguf = Converter(hf, "f32", "qwen2").write(Path(tmp) / "m.gguf")
        model = Model(gguf)
        chunks = tokenize_chunks(model, CORPUS.read_text(encoding="utf-8"), a.ctx, a.chunks)
        perplexity(model, chunks, Path(tmp) / "base.kld")
        base = open_base(Path(tmp) / "base.kld", model)
        forward_time = 0.0
        forward = model.impl.forward

        def timed(tokens):  # type: ignore[no-untyped-def]
            nonlocal forward_time
            t0 = time.perf_counter()
            result = forward(tokens)
            forward_time += time.perf_counter() - t0
            return result

        model.impl.forward = timed
        types = [type_by_name(t) for t in a.types.split(",")]
        groups = sweep_groups(model, "tensor")
        run_sweep(model, base, dict(list(groups.items())[:2]), types, None, [], lambda r: None)  # warm-up (JIT)
        forward_time = 0.0
        t0 = time.perf_counter()
        rows = run_sweep(model, base, groups, types, None, [], lambda r: None)
        total = time.perf_counter() - t0
    print(f"{len(rows)} swap+evaluations of {a.chunks} chunks x {a.ctx} tokens: {total / len(rows) * 1000:.1f} ms each; "
          f"forward {forward_time / total:.1%} of the time, everything else {1 - forward_time / total:.1%}")


if __name__ == "__main__":
    main()
