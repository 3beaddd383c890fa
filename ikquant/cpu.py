"""What the CPU the kernels are compiled for can do, so a kernel can pick the vector width or register tile that fits
it.

Numba compiles for the host unless NUMBA_CPU_NAME names another CPU (a cache shared between machines): then no
feature is assumed and the kernels take their portable shapes.
"""

from __future__ import annotations

from functools import cache

from llvmlite import binding
from numba import config


@cache
def host_has(feature: str) -> bool:
    """Whether the CPU Numba compiles for has `feature`, as LLVM names it ("avx2", "fma", "avx512vnni", ...)."""
    return config.CPU_NAME is None and bool(binding.get_host_cpu_features().get(feature, False))
