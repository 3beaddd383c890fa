#!/usr/bin/env python3
"""Sweep cost: seconds per swap + evaluation on a tiny model, and the share spent outside the forward pass; with
--layer-local, what layer-local propagation saves on a generated deeper model.

Everything but the forward pass proper (quantizing the tensor, swapping, decoding it, KLD statistics, restoring) is
overhead the sweep adds to the evaluation itself; decoding happens lazily inside `forward`, so its time is
subtracted from the forward time. Target: under 10%. The first quantization has nothing to overlap with: on a
sweep this short, its wait is a visible share of "waiting for a quantization". (This part times full forwards.)

--layer-local: a whole-model tensor sweep's wall time with layer-local propagation over the same sweep with
--full-forward (goal: at most 0.55), and the time per candidate of the last block's tensors over the first block's
(goal: at most 0.5), on a --layers-deep Qwen3.

--ray N: the same layer-local sweep on a local Ray cluster of N one-thread workers against one local process of
one thread, and of N threads (rows identical to the one-thread run).

Example: python tools/bench_sweep.py --chunks 8
         python tools/bench_sweep.py --layer-local --layers 12 --chunks 4 --ctx 128
         python tools/bench_sweep.py --ray 2 --layers 12 --chunks 4 --ctx 128
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ikconvert import CORPUS, Converter, TinySpec, make_tiny_checkpoint
from ikquant import type_by_name
from ikrun import KLDAccumulator, Model, open_base, perplexity, run_sweep, sweep_groups, tokenize_chunks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--types", default="IQ4_KS,Q4_0")
    ap.add_argument("--layer-local", action="store_true", help="measure layer-local propagation instead")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ray", type=int, default=0, help="compare N local Ray workers with one process")
    a = ap.parse_args()
    if a.ray:
        on_ray(a.ray, a.layers, a.chunks, a.ctx, a.types)
        return
    if a.layer_local:
        layer_local(a.layers, a.chunks, a.ctx, [type_by_name(t) for t in a.types.split(",")])
        return
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


def _deep_model(folder: Path, layers: int) -> Path:
    hf = make_tiny_checkpoint(folder / "hf", TinySpec(arch="qwen3", hidden=512, layers=layers, heads=8, kv_heads=4,
                                                      head_dim=64, ffn=1536))
    return Converter(hf, "f32", "qwen2").write(folder / "m.gguf")


def on_ray(workers: int, layers: int, n_chunks: int, ctx: int, types: str) -> None:
    """Wall time of the whole ikrun sweep command: N Ray workers vs one process (1 and N threads)."""
    import json
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        gguf = _deep_model(Path(tmp), layers)
        text = Path(tmp) / "text.txt"
        text.write_text(CORPUS.read_text(encoding="utf-8") * 4, encoding="utf-8")
        wall, rows = {}, {}
        for name, extra in (("1 process, 1 thread", ["-t", "1"]), (f"1 process, {workers} threads",
                            ["-t", str(workers)]), (f"Ray local:{workers}, 1 thread each",
                            ["-t", "1", "--ray", f"local:{workers}"])):
            out = Path(tmp) / f"{len(wall)}.json"
            t0 = time.perf_counter()
            subprocess.run([str(Path(sys.executable).parent / "ikrun"), "sweep", str(gguf), "--text", str(text), "--ctx",
                            str(ctx), "--chunks", str(n_chunks), "--types", types, "-o", str(out), *extra],
                           check=True, capture_output=True)
            wall[name] = time.perf_counter() - t0
            rows[name] = {(r["group"], r["type"]): r["kld_mean"] for r in json.loads(out.read_text())["rows"]}
    first = next(iter(wall))
    same = rows[first] == rows[list(rows)[-1]]
    print(f"{layers} layers, {len(rows[first])} candidates, {n_chunks} chunks x {ctx} tokens (command wall time, "
          "start-up included):")
    for name, seconds in wall.items():
        print(f"  {name}: {seconds:.1f} s = {seconds / wall[first]:.2f}x")
    print(f"  Ray rows {'identical to' if same else 'DIFFER from'} the 1-thread rows")


def layer_local(layers: int, n_chunks: int, ctx: int, types: list) -> None:  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory() as tmp:
        model = Model(_deep_model(Path(tmp), layers))
        chunks = tokenize_chunks(model, CORPUS.read_text(encoding="utf-8") * 4, ctx, n_chunks)
        perplexity(model, chunks, Path(tmp) / "base.kld")
        base = open_base(Path(tmp) / "base.kld", model)
        groups = sweep_groups(model, "tensor")
        run_sweep(model, base, dict(list(groups.items())[:2]), types, None, [], lambda r: None)  # warm-up (JIT)
        wall = {}
        rows = {}
        for full in (True, False):
            t0 = time.perf_counter()
            rows[full] = run_sweep(model, base, groups, types, None, [], lambda r: None, full_forward=full)
            wall[full] = time.perf_counter() - t0
        assert [(r.group, r.kld_mean) for r in rows[True]] == [(r.group, r.kld_mean) for r in rows[False]]

    def per_candidate(block: int) -> float:
        mine = [r.seconds for r in rows[False] if r.group.startswith(f"blk.{block}.")]
        return sum(mine) / len(mine)

    print(f"{layers} layers, {len(rows[True])} candidates, {n_chunks} chunks x {ctx} tokens: whole sweep "
          f"{wall[False]:.1f} s layer-local vs {wall[True]:.1f} s full forward = {wall[False] / wall[True]:.2f}x; "
          f"per candidate: block 0 {per_candidate(0) * 1000:.0f} ms, block {layers - 1} "
          f"{per_candidate(layers - 1) * 1000:.0f} ms = {per_candidate(layers - 1) / per_candidate(0):.2f}x "
          "(rows identical)")


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
