"""Serial or parallel execution of a row kernel, chosen by the amount of work.

Starting Numba's thread pool costs tens of microseconds and, on a busy machine, far more (threads wait for a core
while BLAS threads spin); for the small per-op arrays of small models a serial loop is faster. Each kernel is a
per-row function inlined into a serial and a parallel driver; `pick` chooses by element count.
"""

from __future__ import annotations

from collections.abc import Callable

#: below this many elements an op runs on one thread
PARALLEL_MIN_ELEMENTS = 1 << 18


def pick(serial: Callable, parallel: Callable, n_elements: int) -> Callable:
    return parallel if n_elements >= PARALLEL_MIN_ELEMENTS else serial
