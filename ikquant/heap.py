"""The command-line tools keep the memory they free for their next allocations, as ik allocates its buffers once.

A run allocates the same large arrays layer after layer (decoded weights, an expert batch's products, attention
scores). glibc serves every allocation over its mmap threshold (at most 32 MiB) with a fresh mapping and unmaps it
on free, so each layer faults its buffers in again page by page, and a freed heap top is trimmed back to the
kernel. On a virtual machine whose host reclaims freed guest pages that is the slowest memory there is: 48 MiB
of decoded f16 weights written to a fresh array took 20-228 ms here, against ~7 ms into memory written before; the
0.95B DeepSeek-V3-shaped F16 file (4 chunks of 256, 2 threads) ran in 2.79-2.83 s against 3.08-3.42 s with glibc's
defaults, 5% more peak RSS. Large blocks therefore come from the heap and freed memory stays with the process
(glibc only: elsewhere nothing changes). The process's peak is still what it holds at once, plus the heap's
fragmentation.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: the largest trim threshold mallopt takes (an int): a free heap top below it (2 GiB) stays with the process
TRIM_ABOVE = 2**31 - 1

_done = False


def retain_freed_memory() -> bool:
    """Serve large allocations from the heap and trim it only past TRIM_ABOVE (once a process; later allocations
    only). False where the C library is not glibc."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_ABOVE))
    return _done
