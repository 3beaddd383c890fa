"""ikrun and ikconvert keep the memory they free (ikquant/heap.py): large arrays come from the heap, and a freed
one is there for the next."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    """Every tool's app callback calls it (ikquant/cli_common.new_app): its second call reports the first's; ikrun's
    turns numpy's huge-page advice off too, ikconvert's leaves it."""
    from typer.testing import CliRunner

    from ikconvert.cli import app as convert_app
    from ikquant import heap
    from ikrun.cli import app

    multiarray = np._core.multiarray
    before = multiarray._get_madvise_hugepage()
    heap._done = False
    multiarray._set_madvise_hugepage(True)
    try:
        CliRunner().invoke(convert_app, ["hf2gguf", "--help"])
        assert heap._done == sys.platform.startswith("linux") and multiarray._get_madvise_hugepage()
        CliRunner().invoke(app, ["ppl", "--help"])
        assert multiarray._get_madvise_hugepage() == ("NUMPY_MADVISE_HUGEPAGE" in os.environ)
    finally:
        multiarray._set_madvise_hugepage(before)


#: in a fresh process: whether the pages in the middle of a 32 MiB array carry the huge-page advice ("hg" among the
#: flags of the mapping that holds them, /proc/self/smaps)
ADVICE_PROBE = """
import sys
import numpy as np
from ikquant.heap import no_huge_page_advice

if sys.argv[1] == "set-up":
    no_huge_page_advice()
a = np.ones(8 << 20, np.float32)
middle = a.ctypes.data + a.nbytes // 2
inside = False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        lo, hi = (int(v, 16) for v in head.split("-"))
        inside = lo <= middle < hi
    elif inside and head == "VmFlags:":
        print("hg" in line.split()[1:])
        break
"""


def _advised(mode: str, env: dict[str, str]) -> bool:
    res = subprocess.run([sys.executable, "-c", ADVICE_PROBE, mode], capture_output=True, text=True, check=True,
                         env=env)
    return res.stdout.strip() == "True"


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                    reason="a kernel with transparent huge pages")
def test_arrays_take_ordinary_pages_unless_the_user_chose() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    assert _advised("default", env)  # numpy's own choice: the advice on every large array
    assert not _advised("set-up", env)
    assert _advised("set-up", {**env, "NUMPY_MADVISE_HUGEPAGE": "1"})
