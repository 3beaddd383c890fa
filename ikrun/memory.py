"""The runtime's memory budget: what the machine has, what the process holds (sizes: ikquant/sizes.py).

Everything the runtime keeps between operations (decoded weights, hidden states of streamed chunks, per-chunk
attention state, logits) is charged against one budget; a decoded-weight cache lives in what the rest leaves.
"""

from __future__ import annotations

import os
import resource
import shutil
from pathlib import Path

#: share of the memory available at start-up that the default budget takes
DEFAULT_SHARE = 0.75


def available_memory() -> int:
    """MemAvailable of /proc/meminfo (what can be used without swapping), else total physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budget() -> int:
    return int(available_memory() * DEFAULT_SHARE)


def peak_resident_memory() -> int:
    """The process's peak resident set so far (ru_maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def free_disk(path: Path) -> int:
    return shutil.disk_usage(path).free
