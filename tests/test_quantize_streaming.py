"""Streaming: quantizing a multi-GB model keeps memory bounded by its largest tensor, not the model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ikquant.gguf_io import GGUFFile, GGUFStreamWriter
from ikquant.types import type_by_name

PEAK_RSS = Path(__file__).parents[1] / "tools" / "peak_rss.py"
ROWS, COLS, N_TENSORS = 8192, 16384, 9  # 9 x 256 MiB of f16 = 2.25 GiB


def sparse_f16_model(path: Path, n: int = N_TENSORS, rows: int = ROWS, cols: int = COLS) -> None:
    """A GGUF of n zero f16 matrices, written as a sparse file (no gigabytes of writes)."""
    f16 = type_by_name("F16")
    with GGUFStreamWriter(path, "llama") as w:
        for i in range(n):
            w.add_tensor_info(f"blk.{i}.ffn_up.weight", (rows, cols), f16)
        w._start()  # the header, padded
        fout = w._shards[0].file
        assert fout is not None
        fout.truncate(fout.tell() + n * f16.tensor_bytes((cols, rows)))
        w._next = n
        w.finish()


@pytest.mark.slow
def test_peak_memory_is_bounded_by_the_largest_tensor(tmp_path: Path) -> None:
    src = tmp_path / "big-f16.gguf"
    sparse_f16_model(src)
    largest = type_by_name("F16").tensor_bytes((COLS, ROWS))
    assert src.stat().st_size > 2 * 2**30
    dst = tmp_path / "big-q8_0.gguf"
    exe = Path(sys.executable).parent / "ikquant"
    res = subprocess.run([sys.executable, str(PEAK_RSS), str(exe), str(src), str(dst), "--type", "q8_0", "--pure"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert res.returncode == 0, res.stderr
    peak = float(res.stderr.strip().splitlines()[-1].split()[1]) * 2**20
    fixed_overhead = 400 << 20  # interpreter, numpy, numba and the compiled kernels
    assert peak < 2 * largest + fixed_overhead, f"peak RSS {peak / 2**20:.0f} MiB"
    out = GGUFFile(dst)
    assert all(t.type is type_by_name("Q8_0") for t in out.tensors.values())
    assert out.raw("blk.8.ffn_up.weight")[-1].max() == 0


@pytest.mark.slow
def test_a_killed_run_leaves_no_file(tmp_path: Path) -> None:
    import signal
    import time

    src = tmp_path / "big-f16.gguf"
    sparse_f16_model(src)
    dst = tmp_path / "out.gguf"
    exe = Path(sys.executable).parent / "ikquant"
    proc = subprocess.Popen([str(exe), str(src), str(dst), "--type", "q8_0", "--pure"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not any(p.name.startswith(".out.gguf.partial") for p in tmp_path.iterdir()) and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "finished before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big-f16.gguf"]
