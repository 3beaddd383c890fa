"""Serial or parallel execution of a row kernel, chosen by the amount of work.

Starting Numba's thread pool costs tens of microseconds and, on a busy machine, far more (threads wait for a core
while BLAS threads spin); for the small per-op arrays of small models a serial loop is faster. Each kernel is a
per-row function inlined into a serial and a parallel driver; `pick` chooses by element count.

Numba's `prange` hands each thread a fixed equal share of the iterations (its OpenMP layer schedules statically,
whatever `set_parallel_chunksize` says; the workqueue layer too), so with another process busy on one core every
parallel op waits for the thread that shares it. The hot kernels instead cut their work into many small tasks and
let each thread take the next untaken one from a shared counter (`claim`): a thread that runs slower takes fewer.
Which thread computes a task never changes what the task computes, so the bits do not depend on it.
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
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.core.extending import intrinsic  # noqa: E402

#: below this many elements an op runs on one thread
PARALLEL_MIN_ELEMENTS = 1 << 18


#: tasks per thread a kernel that claims its work aims for: a thread slowed to a tenth waits on at most about one
#: task of its own at the end, a small share of the op
TASKS_PER_THREAD = 8


@intrinsic
def _fetch_add(typingctx, counter):  # type: ignore[no-untyped-def]
    """counter[0] += 1 atomically; the value before."""
    sig = types.int64(counter)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        array = context.make_array(signature.args[0])(context, builder, args[0])
        slot = cgutils.get_item_pointer(context, builder, signature.args[0], array, [context.get_constant(types.intp, 0)])
        return builder.atomic_rmw("add", slot, ir.Constant(ir.IntType(64), 1), "monotonic")

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def claim(counter: np.ndarray) -> int:
    """The next untaken task of a parallel op (0, 1, ... across all its threads; `counter` a 1-element int64 array
    starting at 0): its threads loop `for _ in prange(threads)` taking tasks until one is past the last (the thread
    count comes as an argument: `numba.get_num_threads()` inside a kernel keeps it from Numba's cache)."""
    return _fetch_add(counter)  # type: ignore[call-arg]  # Numba passes the typing context


@njit(cache=True, nogil=True, inline="always")
def task_items(items: int, threads: int) -> int:
    """Items per task when `items` independent items (rows, heads, tiles) are shared by `threads` threads:
    TASKS_PER_THREAD tasks a thread."""
    return max(1, -(-items // (threads * TASKS_PER_THREAD)))


@njit(cache=True, nogil=True, inline="always")
def claim_items(counter: np.ndarray, per: int, items: int) -> tuple[int, int]:
    """The items [start, stop) of the next untaken task of `per` items (`claim`); start >= stop once all are
    taken. A row kernel's threads loop `for _ in prange(threads)` over `claim_items` until it returns nothing."""
    start = claim(counter) * per
    return start, min(items, start + per)


def pick(serial: Callable, parallel: Callable, n_elements: int) -> Callable:
    return parallel if n_elements >= PARALLEL_MIN_ELEMENTS else serial


def run_claimed(serial: Callable[..., None], claimed: Callable[..., None], n_elements: int, *args: object) -> None:
    """serial(*args) on little work, else claimed(*args, threads): a kernel whose threads claim their tasks
    (`claim_items`), given this thread's Numba thread count."""
    if n_elements >= PARALLEL_MIN_ELEMENTS:
        claimed(*args, numba.get_num_threads())
    else:
        serial(*args)


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
