"""Faults: full disks, write limits, kills, inputs that change underneath, OS errors: one-line errors, exit 2,
nothing partial left, and the next run recovers. Real file systems (tmpfs mounts), real limits, real signals."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ikconvert.cli import app as ikconvert_app
from ikconvert.tiny import CORPUS, TinySpec, make_tiny_checkpoint
from ikquant.cli import app as ikquant_app
from ikquant.errors import InputChangedError
from ikquant.gguf_io import GGUFFile
from ikrun.cli import app as ikrun_app
from tests.test_quantize_streaming import sparse_f16_model

runner = CliRunner()
BIN = Path(sys.executable).parent


@contextmanager
def tmpfs(folder: Path, size: str, *options: str) -> Iterator[Path]:
    """A real small file system (needs root, as the CI runs)."""
    folder.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(folder)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("faults") / "hf", TinySpec(
        arch="qwen3", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, seed=7))


@pytest.fixture(scope="module")
def model(hf: Path) -> Path:
    from ikconvert.convert import Converter

    return Converter(hf, "f32", "qwen2").write(hf.parent / "m-f32.gguf")


def _one_line_error(output: str, *needles: str) -> None:
    assert "Traceback" not in output and "╭" not in output, output
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_no_room_is_refused_before_any_work(model: Path, hf: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "1m") as small:
        res = runner.invoke(ikquant_app, [str(model), str(small / "q8.gguf"), "--type", "Q8_0"])
        assert res.exit_code == 2
        _one_line_error(res.output, str(small / "q8.gguf"), "needs 1.", "free")
        res = runner.invoke(ikconvert_app, ["hf2gguf", str(hf), "--outtype", "f32", "--pre-tokenizer", "qwen2",
                                            "--outfile", str(small / "c.gguf")])
        assert res.exit_code == 2
        _one_line_error(res.output, str(small / "c.gguf"), "needs", "free")
        assert list(small.iterdir()) == []
    with tmpfs(tmp_path / "tiny", "64k") as tiny:
        res = runner.invoke(ikrun_app, ["kld", str(model), "--base", str(model), "--text", str(CORPUS), "--ctx", "64",
                                        "--save-base-logits", str(tiny / "base.kld")])
        assert res.exit_code == 2
        _one_line_error(res.output, str(tiny / "base.kld"), "needs", "free")
        assert list(tiny.iterdir()) == []


def test_a_write_that_stops_short_is_one_line_and_leaves_nothing(model: Path, tmp_path: Path) -> None:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))

    # a write the kernel cuts short (EFBIG here; a disk filled by another process after the free-space check passed
    # gives ENOSPC the same way)
    out = tmp_path / "q8.gguf"
    res = subprocess.run([str(BIN / "ikquant"), str(model), str(out), "--type", "Q8_0"], preexec_fn=limit,
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"})
    assert res.returncode == 2
    _one_line_error(res.stderr, str(out), "file size limit reached")
    assert list(tmp_path.iterdir()) == []


def _kill_when(proc: subprocess.Popen, ready, what: str) -> None:  # type: ignore[no-untyped-def, type-arg]
    deadline = time.time() + 120
    while not ready() and time.time() < deadline:
        assert proc.poll() is None, f"finished before {what}"
        time.sleep(0.01)
    assert proc.poll() is None, f"finished before {what}"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def test_a_killed_quantization_is_cleaned_up_by_the_next_run(tmp_path: Path) -> None:
    src = tmp_path / "src-f16.gguf"
    sparse_f16_model(src, 4, 4096, 8192)  # long enough to quantize to be killed mid-way
    whole = tmp_path / "whole.gguf"
    args = ["--type", "IQ4_KS", "--pure"]
    assert subprocess.run([str(BIN / "ikquant"), str(src), str(whole), *args], capture_output=True).returncode == 0
    out = tmp_path / "out.gguf"
    proc = subprocess.Popen([str(BIN / "ikquant"), str(src), str(out), *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    partial = tmp_path / f".out.gguf.partial-{proc.pid}"
    _kill_when(proc, lambda: partial.exists() and partial.stat().st_size > 1 << 20, "its output was half written")
    assert partial.exists() and not out.exists()  # SIGKILL cannot clean up: the name says whose it is
    res = subprocess.run([str(BIN / "ikquant"), str(src), str(out), *args], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert f"removed {partial}" in res.stderr and "killed" in res.stderr
    assert out.read_bytes() == whole.read_bytes()
    assert not list(tmp_path.glob(".*partial*"))


def test_a_live_writer_of_the_same_output_is_reported(model: Path, tmp_path: Path) -> None:
    other = subprocess.Popen(["sleep", "60"])
    try:
        theirs = tmp_path / f".q.gguf.partial-{other.pid}"
        theirs.write_bytes(b"another run's half-written file")
        res = subprocess.run([str(BIN / "ikquant"), str(model), str(tmp_path / "q.gguf"), "--type", "Q8_0"],
                             capture_output=True, text=True)
        assert res.returncode == 0 and f"pid {other.pid}" in res.stderr and "last" in res.stderr
        assert theirs.exists() and GGUFFile(tmp_path / "q.gguf").tensors
    finally:
        other.kill()
        other.wait()


def test_a_killed_sweep_resumes_to_the_uninterrupted_rows(model: Path, tmp_path: Path) -> None:
    common = ["--text", str(CORPUS), "--ctx", "64", "--chunks", "4", "--types", "Q4_0,IQ4_KS,IQ2_KS", "--threads", "1"]
    whole = tmp_path / "whole.json"
    assert subprocess.run([str(BIN / "ikrun"), "sweep", str(model), *common, "-o", str(whole)],
                          capture_output=True).returncode == 0
    out = tmp_path / "killed.json"

    def rows_so_far() -> int:
        try:
            return len(json.loads(out.read_text())["rows"])
        except (FileNotFoundError, json.JSONDecodeError):
            return 0

    temp = tmp_path / "tmp"  # the killed run's temporary base logits: SIGKILL leaves them, the next run removes them
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    proc = subprocess.Popen([str(BIN / "ikrun"), "sweep", str(model), *common, "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _kill_when(proc, lambda: rows_so_far() >= 3, "three rows were saved")
    n_before = rows_so_far()
    left = list(temp.iterdir())
    assert [p.name.startswith(f"iktools-sweep-{proc.pid}-") and (p / "base.kld").is_file() for p in left] == [True]
    res = subprocess.run([str(BIN / "ikrun"), "sweep", str(model), *common, "-o", str(out)], capture_output=True,
                         text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert f"removed {left[0]}, left by a run that was killed (pid {proc.pid})" in " ".join(res.stderr.split())
    assert list(temp.iterdir()) == []

    def rows(path: Path) -> list[tuple]:  # type: ignore[type-arg]
        return sorted((r["group"], r["type"], r["kld_mean"], r["kld_p99"], r["bytes_new"])
                      for r in json.loads(path.read_text())["rows"])

    assert rows(out) == rows(whole) and len(rows(out)) == len({r[:2] for r in rows(out)})
    assert n_before < len(rows(whole))
    assert not list(tmp_path.glob(".*partial*"))


def test_inputs_that_change_underneath_are_errors(model: Path, hf: Path, tmp_path: Path) -> None:
    from ikconvert.errors import SafetensorsError
    from ikconvert.safetensors_io import SafetensorsFile
    from ikquant.ftypes import file_type
    from ikquant.quantize import QuantizeOptions, quantize_model
    from ikrun.model import Model

    copy = tmp_path / "copy.gguf"
    copy.write_bytes(model.read_bytes())
    g = GGUFFile(copy)
    name = next(iter(g.tensors))
    os.truncate(copy, copy.stat().st_size // 2)  # reading the mapping past the end now would be a SIGBUS
    with pytest.raises(InputChangedError, match=f"{copy} was truncated"):
        g.raw(name)
    # a runtime whose file is replaced between two evaluations
    copy.write_bytes(model.read_bytes())
    m = Model(copy)
    m.logits([1, 2, 3])
    replacement = tmp_path / "new.gguf"
    replacement.write_bytes(model.read_bytes())
    os.replace(replacement, copy)
    m.weights.evict(m.weights.names())
    with pytest.raises(InputChangedError, match="replaced"):
        m.logits([1, 2, 3])
    # the quantizer: the source truncated after its first tensor
    dst = tmp_path / "q.gguf"

    def truncate_source(plan) -> None:  # type: ignore[no-untyped-def]
        os.truncate(copy, 4096)

    with pytest.raises(InputChangedError, match=str(copy)):
        quantize_model(copy, dst, QuantizeOptions(file_type("Q8_0")), truncate_source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.gguf"]
    # a safetensors shard rewritten while the converter reads it
    shard = next(hf.glob("*.safetensors"))
    f = SafetensorsFile(shard)
    tensor = next(iter(f.tensors.values()))
    data = shard.read_bytes()
    time.sleep(0.01)
    shard.write_bytes(data)
    with pytest.raises(SafetensorsError, match="rewritten or replaced"):
        tensor.raw()


def test_os_errors_are_one_line_messages(model: Path, tmp_path: Path) -> None:
    res = runner.invoke(ikquant_app, [str(model), str(tmp_path / "no" / "q.gguf"), "--type", "Q8_0"])
    assert res.exit_code == 2
    _one_line_error(res.output, "the folder", "does not exist")
    with tmpfs(tmp_path / "ro", "1m", "ro") as ro:
        res = runner.invoke(ikquant_app, [str(model), str(ro / "q.gguf"), "--type", "Q8_0"])
        assert res.exit_code == 2
        _one_line_error(res.output, str(ro / "q.gguf"), "read-only file system")
        res = runner.invoke(ikrun_app, ["sweep", str(model), "--text", str(CORPUS), "--ctx", "64", "--chunks", "2",
                                        "--types", "Q4_0", "--tensors", "ffn_down", "-o", str(ro / "s.json")])
        assert res.exit_code == 2
        _one_line_error(res.output, str(ro / "s.json"), "read-only file system")


def test_scratch_folders_of_killed_runs_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    from ikquant.outputs import SCRATCH_LOCK, SCRATCH_UNLOCKED_GRACE_S, scratch_folder

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from ikquant.outputs import scratch_folder\n"
                               f"with scratch_folder('sweep', {str(tmp_path)!r}) as f:\n"
                               "    print(f, flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        live = Path(holder.stdout.readline().strip())
        assert live.name.startswith(f"iktools-sweep-{holder.pid}-") and (live / SCRATCH_LOCK).exists()
        fresh = tmp_path / "iktools-kld-1-abcdefgh"  # no lock yet: a run between making the folder and locking it
        stale = tmp_path / "iktools-mix-2-ijklmnop"  # no lock for longer than any run takes to lock
        other = tmp_path / "iktools-notes"  # not a scratch folder's name
        for folder in (fresh, stale, other):
            folder.mkdir()
            (folder / "data").write_bytes(b"x")
        old = time.time() - SCRATCH_UNLOCKED_GRACE_S - 60
        os.utime(stale, (old, old))
        with scratch_folder("sweep", tmp_path) as mine:
            assert live.exists() and fresh.exists() and other.exists() and not stale.exists()
            (mine / "base.kld").write_bytes(b"logits")
        assert not mine.exists()
        holder.kill()
        holder.wait()
        with pytest.raises(RuntimeError), scratch_folder("sweep", tmp_path) as mine:
            assert not live.exists()  # its lock died with its process
            raise RuntimeError
        assert not mine.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([fresh.name, other.name])
    finally:
        holder.kill()
        holder.wait()


def test_a_scratch_folder_under_a_missing_spill_dir_is_one_line(tmp_path: Path) -> None:
    from ikquant.errors import OutputError
    from ikquant.outputs import scratch_folder

    with pytest.raises(OutputError, match=f"{tmp_path / 'missing'}: no such file or folder"):
        with scratch_folder("kld", tmp_path / "missing"):
            pass
