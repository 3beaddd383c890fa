"""The Numba cache folder: one per version of the kernels' sources, so no kernel runs another version's inlined code."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numba
import numpy as np
import pytest

import ikquant
from ikquant.types import type_by_name


def test_one_folder_per_source_version_and_old_ones_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    base = tmp_path / "iktools" / "numba"
    base.mkdir(parents=True)
    for i in range(5):  # other versions' folders, oldest first
        (base / f"old{i}").mkdir()
        os.utime(base / f"old{i}", (time.time() - 100 + i, time.time() - 100 + i))
    here = ikquant._numba_cache_dir()
    assert here is not None and Path(here).parent == base
    assert ikquant._numba_cache_dir() == here  # stable while the sources are
    assert sorted(p.name for p in base.iterdir() if str(p) != here) == ["old2", "old3", "old4"]


def test_the_running_process_uses_it() -> None:
    """Set before Numba was imported (ikquant is imported first), unless the user chose a folder."""
    from numba.core import config

    assert os.environ["NUMBA_CACHE_DIR"] == config.CACHE_DIR


def test_a_program_that_imported_numba_first_uses_it(tmp_path: Path) -> None:
    """`import numba` before `import ikquant` (a script, a notebook): the kernels still cache in the per-version
    folder, none beside the sources."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    program = ("import numba, numpy as np, ikquant\n"
               "from numba.core import config\n"
               "x = np.ones((2, 256), dtype=np.float32)\n"
               "ikquant.type_by_name('Q4_0').require_codec().quantize(x, None)\n"
               "print(config.CACHE_DIR)\n")
    sources = Path(ikquant.__file__).parent
    before = set(sources.rglob("*.nbi"))
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).parent == tmp_path / "iktools" / "numba"
    assert set(sources.rglob("*.nbi")) == before
    assert any((tmp_path / "iktools" / "numba").rglob("*.nbi"))


def test_stored_bytes_reach_the_kernels_read_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Numba compiles a kernel for each mutability of an array it takes, and stored bytes come both ways (a
    memory-mapped file's are read-only, an array made in memory is not): the codecs hand them over read-only, also
    where an interleaved type regroups its rows before its base type decodes them, so one compile serves both."""
    codec, r8 = type_by_name("Q8_0").require_codec(), type_by_name("Q8_0_R8").require_codec()
    writable: list[bool] = []
    decode = type(codec)._dequantize

    def spy(self: object, q: np.ndarray, out: np.ndarray) -> None:
        writable.append(q.flags.writeable)
        decode(codec, q, out)

    x = np.linspace(-1, 1, 8 * 64, dtype=np.float32).reshape(8, 64)
    q, packed = codec.quantize(x), r8.quantize(x)
    frozen = q.copy()
    frozen.flags.writeable = False
    monkeypatch.setattr(type(codec), "_dequantize", spy)
    np.testing.assert_array_equal(codec.dequantize(q, 64), codec.dequantize(frozen, 64))
    out = np.empty((8, 64), np.float32)
    r8.regroup_then_decode(packed, out)
    np.testing.assert_array_equal(out, codec.dequantize(q, 64))
    assert writable == [False] * 4 and q.flags.writeable and packed.flags.writeable
    assert numba.typeof(q) != numba.typeof(frozen)  # what the kernels would otherwise be compiled for
