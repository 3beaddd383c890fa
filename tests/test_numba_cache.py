"""The Numba cache folder: one per version of the kernels' sources, so no kernel runs another version's inlined code."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import ikquant


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
