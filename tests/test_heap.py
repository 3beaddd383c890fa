"""The command-line tools keep the memory they free (ikquant/heap.py): large arrays come from the heap, and a freed
one is there for the next."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: in a fresh process: a 64 MiB array's bytes in mmapped blocks while alive, and the heap's size after it is freed
PROBE = """
import ctypes, sys
import numpy as np
from ikquant.heap import retain_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "retain":
    assert retain_freed_memory()
a = np.ones(16 << 20, np.float32)
mapped = libc.mallinfo2().hblkhd
del a
print(mapped, libc.mallinfo2().arena)
"""


def _probe(mode: str) -> tuple[int, int]:
    res = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    mapped, arena = res.stdout.split()
    return int(mapped), int(arena)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_arrays_come_from_the_heap_and_stay_after_free() -> None:
    mapped, arena = _probe("default")
    assert mapped >= 64 << 20 and arena < 64 << 20  # glibc's own choice: a mapping of its own, unmapped on free
    mapped, arena = _probe("retain")
    assert mapped < 1 << 20 and arena >= 64 << 20


def test_a_cli_invocation_retains() -> None:
    """Every tool's app callback calls it (ikquant/cli_common.new_app): its second call reports the first's."""
    from typer.testing import CliRunner

    from ikquant import heap
    from ikrun.cli import app

    heap._done = False
    CliRunner().invoke(app, ["ppl", "--help"])
    assert heap._done == sys.platform.startswith("linux")
