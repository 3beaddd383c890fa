#!/usr/bin/env python3
"""Where an `ikrun` command spends its time: the command run in this process under cProfile, its time (own time of
each Python function, which includes the Numba kernels it calls: they are not Python frames) summed by the part of
the runtime it belongs to, then the functions that cost most.

The first run of a command compiles its kernels (minutes); --warm runs it once unprofiled first, so the profile is
of the steady state. --scalar-qgemm multiplies the integer matmuls of --numerics ik in the scalar reference kernel
(the same bits): the speed of the runtime before its tile kernels ran on CPUs without AVX-512 VNNI.

Example: python tools/profile_ppl.py --warm -- ppl model.gguf --text wiki.txt --ctx 256 --chunks 1 -t 2 --numerics ik
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

# isort: off
import ikquant  # noqa: F401  (first: its import sets OpenBLAS's thread timeout before numpy loads)
# isort: on

from ikrun.cli import app

#: (label, what a function's file path contains), first match wins; the rest is "other"
PARTS = (
    ("integer matmuls (qgemm)", "numerics/ik/qgemm"),
    ("ik's own IQ4_KS / IQ5_KS kernels (iqk_native)", "numerics/ik/iqk_native"),
    ("ik's own Q4_K / Q5_K / Q6_K kernels (kquant_native)", "numerics/ik/kquant_native"),
    ("IQK weights packed from their bytes (q8k_direct)", "numerics/ik/q8k_direct"),
    ("ik float matmuls (ikgemm)", "numerics/ik/ikgemm"),
    ("activation rounding (ik formats)", "numerics/ik/formats"),
    ("float matmuls (fgemm)", "ops/fgemm"),
    ("attention", "attention"),
    ("routed experts: routing, SwiGLU, combine", "ops/moe"),
    ("MoE / FFN modules", "modules/ffn"),
    ("norms", "ops/norm"),
    ("rope", "ops/rope"),
    ("weight decode / conversion", "ikquant/"),
    ("weights: cache, streaming, conversion", "ikrun/weights"),
    ("ik arithmetic glue", "numerics/ik/arithmetic"),
    ("exact arithmetic glue", "numerics/exact"),
    ("model forward (per layer Python)", "ikrun/models"),
    ("context / linear dispatch", "ikrun/context"),
    ("numpy", "numpy"),
    ("JIT compile / kernel cache load", "numba/"),
    ("JIT compile / kernel cache load", "llvmlite/"),
)


def part(filename: str) -> str:
    for label, key in PARTS:
        if key in filename:
            return label
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm", action="store_true", help="run the command once unprofiled first (compiles kernels)")
    ap.add_argument("--scalar-qgemm", action="store_true", help="integer matmuls in the scalar reference kernel")
    ap.add_argument("--top", type=int, default=20, help="functions listed")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the ikrun command line, after --")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if a.scalar_qgemm:
        from ikrun.numerics.ik import qgemm

        qgemm.qmatmul.__defaults__ = (False,)
    if a.warm:
        app(cmd, standalone_mode=False)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.runcall(app, cmd, standalone_mode=False)
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    by_part: dict[str, float] = {}
    rows = []
    for (filename, line, name), (_, _, tottime, _, _) in stats.items():
        by_part[part(filename)] = by_part.get(part(filename), 0.0) + tottime
        rows.append((tottime, f"{filename.split('site-packages/')[-1]}:{line} {name}"))
    print(f"\nprofiled wall time {wall:.1f} s (own time of every function, summed by part)")
    for label, seconds in sorted(by_part.items(), key=lambda kv: -kv[1]):
        print(f"  {label:42s} {seconds:8.2f} s {100 * seconds / wall:5.1f}%")
    print(f"\ntop {a.top} functions by own time")
    for seconds, where in sorted(rows, reverse=True)[: a.top]:
        print(f"  {seconds:8.2f} s {100 * seconds / wall:5.1f}%  {where}")


if __name__ == "__main__":
    main()
