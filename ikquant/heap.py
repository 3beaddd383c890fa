"""ikrun and ikconvert keep the memory they free for their next allocations, as ik allocates its buffers once.

A run allocates the same large arrays layer after layer (decoded weights, an expert batch's products, attention
scores). glibc serves every allocation over its mmap threshold (at most 32 MiB) with a fresh mapping and unmaps it
on free, so each layer faults its buffers in again page by page, and a freed heap top is trimmed back to the
kernel. On a virtual machine whose host reclaims freed guest pages that is the slowest memory there is: 48 MiB
of decoded f16 weights written to a fresh array took 20-228 ms here, against ~7 ms into memory written before; the
0.95B DeepSeek-V3-shaped F16 file (4 chunks of 256, 2 threads) ran in 2.79-2.83 s against 3.08-3.42 s with glibc's
defaults, 5% more peak RSS. Large blocks therefore come from the heap and freed memory stays with the process
(glibc only: elsewhere nothing changes). The process's peak is still what it holds at once, plus the heap's
fragmentation.

ikrun's heap pages are ordinary ones (no_huge_page_advice): numpy asks the kernel for transparent huge pages on
every array of 4 MiB or more (madvise), and a kernel that honours the advice at the fault (THP set to "madvise", its
default defrag) compacts memory first when no huge page is free. A fresh 16 MiB array took 25-126 ms to write here
under the advice where ordinary pages took 6.4-9.8 ms (2.4 ms in a run that found huge pages free); the
DeepSeek-V3-shaped IQ4_KS file under --numerics ik (4 chunks of 256, 2 threads, whole processes, 8 alternated
pairs) ran in 2.41 s against 2.74 s, system time 0.25 s against 0.53. ik asks for no huge pages for its buffers
either. For the quantizer (which does not keep freed memory) the same setting measured both ways: the 0.95B
DeepSeek-V3-shaped F16 file to Q8_0 took 5.66 s against 4.69 s in 3 pairs, the 0.35B DeepSeek-V4-shaped one 2.52
s against 1.59 s in 5 pairs, then with freed memory kept 1.67 s against 2.10 s in 6 pairs, as this machine's memory
state drifted; so only ikrun sets it. A user who sets NUMPY_MADVISE_HUGEPAGE keeps numpy's own choice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: the largest trim threshold mallopt takes (an int): a free heap top below it (2 GiB) stays with the process
TRIM_ABOVE = 2**31 - 1

_done = False


def no_huge_page_advice() -> bool:
    """Turn off numpy's transparent-huge-page advice for the arrays it allocates from now on; False where the user
    chose through NUMPY_MADVISE_HUGEPAGE or this numpy has no such advice."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return False
    import numpy as np

    multiarray = getattr(np, "_core", None) or np.core  # numpy 2.x, 1.x
    advise = getattr(multiarray.multiarray, "_set_madvise_hugepage", None)
    if advise is None:
        return False
    advise(False)
    return True


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
