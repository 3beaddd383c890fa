"""The runtime's memory budget: sizes as users write them, what the machine has, what the process holds.

Everything the runtime keeps between operations (decoded weights, hidden states of streamed chunks, per-chunk
attention state, logits) is charged against one budget; a decoded-weight cache lives in what the rest leaves.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
from pathlib import Path

from ikquant.errors import IkError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
#: share of the memory available at start-up that the default budget takes
DEFAULT_SHARE = 0.75


class BudgetError(IkError, ValueError):
    """A memory budget that cannot be met, or a size that does not parse."""


def parse_size(text: str) -> int:
    """`8GiB`, `512MiB`, `1.5TB`, `300000000` -> bytes (binary units KiB/MiB/GiB/TiB, decimal KB/MB/GB/TB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise BudgetError(f"--mem {text!r} is not a size (examples: 8GiB, 512MiB, 64GB)")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise BudgetError(f"--mem {text!r} must be positive")
    return size


def format_size(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


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
