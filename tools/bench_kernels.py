#!/usr/bin/env python3
"""Throughput of the runtime's matmul kernels on one expert-sized product: the exact mode's float kernel
(ikrun/ops/fgemm.py, f16 and f32 weights) and the integer kernel of --numerics ik (ikrun/numerics/ik/qgemm.py, in
each of ik's float orders: R16 is what IQ4_KS and the other IQK types multiply as, Q8_0 native what Q8_0 does).

Reported: GFLOP/s (2 x tokens x rows x columns per second, best of --repeat) at the thread count given, by the
wall clock and by the process's CPU time (per thread: on a shared machine the steadier of the two).

Example: python tools/bench_kernels.py --threads 1
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable

# isort: off
import ikquant  # noqa: F401  (first: its import sets OpenBLAS's thread timeout before numpy loads)
# isort: on

import numba
import numpy as np

from ikrun.numerics.ik.formats import Q8_2_X4, Q8_K, integer_rows
from ikrun.numerics.ik.qgemm import (
    ORDER_PLAIN,
    ORDER_Q8_1,
    ORDER_QX_0_NATIVE,
    ORDER_R8,
    ORDER_R16,
    BlockInts,
    pack,
    qmatmul,
)
from ikrun.ops.fgemm import expert_matmul

#: label -> (block, activation format, order, bias)
ORDERS = {"IQ4_KS (R16)": (256, Q8_K, ORDER_R16, 0), "Q8_0 (native)": (32, Q8_2_X4, ORDER_QX_0_NATIVE, 127),
          "Q8_0_R8": (32, Q8_2_X4, ORDER_R8, 0), "Q4_K (Q8_1)": (32, Q8_2_X4, ORDER_Q8_1, 0),
          "plain 256": (256, Q8_K, ORDER_PLAIN, 0)}


def best_seconds(fn: Callable[[], object], repeat: int, threads: int) -> tuple[float, float]:
    """The best wall-clock and per-thread CPU seconds of `repeat` calls."""
    fn()  # compile / warm the caches
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append((time.process_time() - c0) / threads)
    return min(wall), min(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", default="", help="regex: only the kernels whose label matches (e.g. 'f16|R16')")
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    m, rows, n = args.tokens, args.rows, args.cols
    flops = 2.0 * m * rows * n
    x = rng.standard_normal((m, n)).astype(np.float32)
    w = rng.standard_normal((rows, n)).astype(np.float32)
    print(f"{m} tokens x [{rows}, {n}] weights, {args.threads} thread(s)")
    for label, weights in (("fgemm f32", w), ("fgemm f16", w.astype(np.float16).view(np.uint16))):
        if not re.search(args.only, label):
            continue
        wall, cpu = best_seconds(lambda weights=weights: expert_matmul(x, weights), args.repeat, args.threads)
        print(f"{label:>20} {flops / wall / 1e9:7.1f} GFLOP/s (wall) {flops / cpu / 1e9:7.1f} (CPU time)")
    for label, (block, fmt, order, bias) in ORDERS.items():
        if not re.search(args.only, "qgemm " + label):
            continue
        q = rng.integers(-127, 128, (rows, n)).astype(np.int8)  # the range ik's quantizers and conversions write
        scale = rng.random((rows, n // block)).astype(np.float32)
        offset = rng.standard_normal((rows, n // block)).astype(np.float32) if order == ORDER_Q8_1 else None
        packed = pack(BlockInts(q, scale, block, offset, order, bias))
        xi = integer_rows(x, fmt)
        wall, cpu = best_seconds(lambda packed=packed, xi=xi: qmatmul(xi, packed), args.repeat, args.threads)
        print(f"{'qgemm ' + label:>20} {flops / wall / 1e9:7.1f} GOP/s   (wall) {flops / cpu / 1e9:7.1f} (CPU time)")


if __name__ == "__main__":
    main()
