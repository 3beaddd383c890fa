#!/usr/bin/env python3
"""Sweep cost: seconds per swap + evaluation on a tiny model, and the share spent outside the forward pass.

Everything but the forward pass proper (quantizing the tensor, swapping, decoding it, KLD statistics, restoring) is
overhead the sweep adds to the evaluation itself; decoding happens lazily inside `forward`, so its time is
subtracted from the forward time. Target: under 10%. The first quantization has nothing to overlap with: on a
sweep this short, its wait is a visible share of "waiting for a quantization".

Example: python tools/bench_sweep.py --chunks 8
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ikconvert.convert import Converter
from ikconvert.tiny import CORPUS, TinySpec, make_tiny_checkpoint
from ikquant.types import type_by_name
from ikrun.evaluate import open_base, perplexity, tokenize_chunks
from ikrun.metrics import KLDAccumulator
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
        spent: dict[str, float] = {}
        _time_calls(model.impl, "forward", spent, "forward")
        _time_calls(model.weights, "decode", spent, "decode")
        _time_calls(KLDAccumulator, "add", spent, "kld")
        _time_calls(Future, "result", spent, "wait")
        types = [type_by_name(t) for t in a.types.split(",")]
        groups = sweep_groups(model, "tensor")
        run_sweep(model, base, dict(list(groups.items())[:2]), types, None, [], lambda r: None)  # warm-up (JIT)
        spent.clear()
        t0 = time.perf_counter()
        rows = run_sweep(model, base, groups, types, None, [], lambda r: None)
        total = time.perf_counter() - t0
    compute = spent["forward"] - spent["decode"]
    print(f"{len(rows)} swap+evaluations of {a.chunks} chunks x {a.ctx} tokens: {total / len(rows) * 1000:.1f} ms each; "
          f"forward {compute / total:.1%} of the time, everything else {1 - compute / total:.1%}: "
          f"KLD statistics {spent['kld'] / total:.1%}, waiting for a quantization {spent.get('wait', 0) / total:.1%}, "
          f"decoding weights (lazy, cache lookups included) {spent['decode'] / total:.1%}")


def _time_calls(owner: Any, attr: str, spent: dict[str, float], key: str) -> None:
    """Replace owner.attr by a wrapper that adds the seconds of each call to spent[key]."""
    inner = getattr(owner, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0

    setattr(owner, attr, timed)


if __name__ == "__main__":
    main()
