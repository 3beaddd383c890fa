"""Sizes as users write them (`8GiB`, `512MiB`, `1.5TB`) and as the tools print them."""

from __future__ import annotations

import re

from ikquant.errors import SizeError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str, option: str = "--mem") -> int:
    """`8GiB`, `512MiB`, `1.5TB`, `300000000` -> bytes (binary units KiB/MiB/GiB/TiB, decimal KB/MB/GB/TB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise SizeError(f"{option} {text!r} is not a size (examples: 8GiB, 512MiB, 64GB)")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise SizeError(f"{option} {text!r} must be positive")
    return size


def format_size(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
