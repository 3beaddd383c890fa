"""Serial or parallel execution of a row kernel, chosen by the amount of work.

Starting Numba's thread pool costs tens of microseconds and, on a busy machine, far more (threads wait for a core
while BLAS threads spin); for the small per-op arrays of small models a serial loop is faster. Each kernel is a
per-row function inlined into a serial and a parallel driver; `pick` chooses by element count.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# libgomp (Numba's OpenMP layer) keeps idle workers spinning for 300000 iterations after each parallel op; in a
# forward pass the next op is often an OpenBLAS matmul whose threads then wait for those cores (0.38B model, F16,
# 2 threads: 109 tok/s, 165 with a spin count of 1000). Set before libgomp loads; a user's own setting wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import numba  # noqa: E402  (after the environment libgomp reads when Numba loads it)

#: below this many elements an op runs on one thread
PARALLEL_MIN_ELEMENTS = 1 << 18


def pick(serial: Callable, parallel: Callable, n_elements: int) -> Callable:
    return parallel if n_elements >= PARALLEL_MIN_ELEMENTS else serial


@contextmanager
def threads_for(n_elements: int) -> Iterator[None]:
    """Numba's thread count for this thread held to one while a kernel that is always parallel (the quant codecs)
    runs on little work; the setting is per thread, so another thread's kernels keep theirs."""
    if n_elements >= PARALLEL_MIN_ELEMENTS:
        yield
        return
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(before)
