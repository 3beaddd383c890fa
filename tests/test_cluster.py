"""--ray: sweeps and quantization on a real local Ray cluster (127.0.0.1), and --chunks auto."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import ray  # the test extra installs it: a missing Ray fails here rather than skipping
from typer.testing import CliRunner

from ikconvert.tiny import CORPUS, TinySpec, make_tiny_checkpoint
from ikquant.cli import app as ikquant_app
from ikrun.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ikconvert.convert import Converter

    folder = tmp_path_factory.mktemp("cluster")
    hf = make_tiny_checkpoint(folder / "hf", TinySpec(arch="qwen3", hidden=256, layers=2, heads=4, kv_heads=2,
                                                      head_dim=64, ffn=512, seed=5))
    return Converter(hf, "f32", "qwen2").write(folder / "m-f32.gguf")


@pytest.fixture(scope="module")
def imatrix(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("imat") / "imatrix.dat"
    res = runner.invoke(app, ["imatrix", str(model), "--text", str(CORPUS), "--ctx", "64", "--chunks", "4", "-o",
                              str(path)])
    assert res.exit_code == 0, res.output
    return path


def _sweep(model: Path, out: Path, *extra: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["sweep", str(model), "--text", str(CORPUS), "--ctx", "64", "--types", "Q4_0,IQ4_KS",
                               "--tensors", r"blk\.1\.", "-o", str(out), "--threads", "1", *extra],
                         env={"COLUMNS": "200"})


def _rows(path: Path) -> dict[tuple[str, str], dict]:
    """Rows by (group, type), without the time each took."""
    rows = json.loads(path.read_text())["rows"]
    out = {(r["group"], r["type"]): {k: v for k, v in r.items() if k != "seconds"} for r in rows}
    assert len(out) == len(rows), "a row was counted twice"
    return out


def test_ray_sweep_rows_equal_the_local_sweep(model: Path, imatrix: Path, tmp_path: Path) -> None:
    """The workers measure as the driver says: each chunk fed in batches of 24 tokens (--batch; its rows differ
    from whole chunks' in the last digits) with the imatrix."""
    local, remote = tmp_path / "local.json", tmp_path / "ray.json"
    assert _sweep(model, local, "--chunks", "4", "--imatrix", str(imatrix), "--batch", "24").exit_code == 0
    res = _sweep(model, remote, "--chunks", "4", "--imatrix", str(imatrix), "--batch", "24", "--ray", "local:2")
    assert res.exit_code == 0, res.output
    assert "2 workers" in res.output
    assert _rows(remote) == _rows(local)
    assert len(_rows(local)) == 14


def test_a_pruned_sweep_on_ray_in_auto_rounds_has_the_local_rows(model: Path, tmp_path: Path) -> None:
    """--target-bpw with --ray and --chunks auto: the rows (measured and predicted) of the same pruned sweep run
    locally on the chunk count the rounds stopped at."""
    remote, local = tmp_path / "ray.json", tmp_path / "local.json"
    pruning = ("--ctx", "32", "--target-bpw", "20.6", "--tie", r"attn_[kv]\.")
    res = _sweep(model, remote, "--chunks", "auto", "--ray", "local:2", *pruning)
    assert res.exit_code == 0, res.output
    header = json.loads(remote.read_text())
    n = header["chunks"]
    assert "2 workers" in res.output and "rank agreement" in res.output and n >= 8
    assert _sweep(model, local, "--chunks", str(n), *pruning).exit_code == 0
    rows = _rows(remote)
    assert rows == _rows(local)
    assert 0 < sum(r["measured"] for r in rows.values()) < len(rows)
    assert rows[("blk.1.attn_k.weight", "Q4_0")]["measured"] == rows[("blk.1.attn_v.weight", "Q4_0")]["measured"]


def test_ray_quantization_writes_the_same_bytes(model: Path, imatrix: Path, tmp_path: Path) -> None:
    for qtype in ("IQ4_KS", "Q4_K_M"):
        a, b = tmp_path / f"{qtype}-local.gguf", tmp_path / f"{qtype}-ray.gguf"
        common = [str(model), "--type", qtype, "--imatrix", str(imatrix)]
        assert runner.invoke(ikquant_app, [common[0], str(a), *common[1:]]).exit_code == 0
        res = runner.invoke(ikquant_app, [common[0], str(b), *common[1:], "--ray", "local:2"])
        assert res.exit_code == 0, res.output
        assert a.read_bytes() == b.read_bytes()


def test_a_killed_worker_loses_no_row(model: Path, tmp_path: Path) -> None:
    from ikquant.cluster import open_cluster
    from ikquant.types import type_by_name
    from ikrun.eval.evaluate import open_base, perplexity, tokenize_chunks
    from ikrun.model import Model
    from ikrun.sweep import run_sweep
    from ikrun.sweep.measure import sweep_groups

    local = tmp_path / "local.json"
    assert _sweep(model, local, "--chunks", "3").exit_code == 0
    m = Model(model, threads=1)
    base = tmp_path / "base.kld"
    perplexity(m, tokenize_chunks(m, CORPUS.read_text(encoding="utf-8"), 64, 3), base)
    groups = sweep_groups(m, "tensor", r"blk\.1\.")
    seen: list[list[int]] = []  # the workers' pids, each time the set changes
    rows, events = [], []
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("iktools-sweep-worker-*"))

    def kill_once(row) -> None:  # type: ignore[no-untyped-def]
        rows.append(row)
        if len(rows) == 1:
            os.kill(seen[0][0], signal.SIGKILL)

    with open_cluster("local:2", 1) as cluster:
        run_sweep(m, open_base(base, m), groups, [type_by_name("Q4_0"), type_by_name("IQ4_KS")], None, [], kill_once,
                  cluster=cluster, worker_mem=1 << 30, on_event=events.append,
                  on_workers=lambda ws: seen.append(ray.get([w.pid.remote() for w in ws])))
    assert any("lost" in e for e in events), events
    assert set(temp.glob("iktools-sweep-worker-*")) <= before, "a worker (killed or stopped) left its folder behind"
    assert len(seen) == 2 and seen[0][0] not in seen[1] and len(set(seen[1])) == 2  # replaced once
    got = {(r.group, r.type): r for r in rows}
    assert len(got) == len(rows) == 14
    want = _rows(local)
    for key, r in got.items():
        assert r.kld_mean == want[key]["kld_mean"] and r.kld_p99 == want[key]["kld_p99"]


def test_a_worker_pool_serves_every_batch_of_a_round(model: Path, tmp_path: Path) -> None:
    """A pruned sweep's batches of one round run on the workers the first batch started (each loads the model and
    records its block inputs once), with the rows of one call."""
    from ikquant.cluster import open_cluster
    from ikquant.types import type_by_name
    from ikrun.eval.evaluate import open_base, perplexity, tokenize_chunks
    from ikrun.model import Model
    from ikrun.sweep import run_sweep
    from ikrun.sweep.cluster import WorkerPool
    from ikrun.sweep.measure import sweep_groups

    m = Model(model, threads=1)
    base = tmp_path / "base.kld"
    perplexity(m, tokenize_chunks(m, CORPUS.read_text(encoding="utf-8"), 64, 2), base)
    groups = sweep_groups(m, "tensor", r"blk\.1\.")
    types = [type_by_name("Q4_0"), type_by_name("IQ4_KS")]
    started: list[list[int]] = []
    # the rows of one local call (test_ray_sweep_rows_equal_the_local_sweep: a call on workers has the same)
    one = run_sweep(m, open_base(base, m), groups, types, None, [], lambda r: None)
    with open_cluster("local:2", 1) as cluster:
        pool = WorkerPool()
        try:
            batches = [run_sweep(m, open_base(base, m), groups, types, None, [], lambda r: None, cluster=cluster,
                                 worker_mem=1 << 30, only={(g, t.name) for g in groups}, pool=pool,
                                 on_workers=lambda ws: started.append(ray.get([w.pid.remote() for w in ws])))
                       for t in types]
            assert len(started) == 1 and ray.get([w.pid.remote() for w in pool.workers]) == started[0]
        finally:
            pool.close(ray)
    assert [{r.key for r in b} for b in batches] == [{(g, t.name) for g in groups} for t in types]
    assert {r.key: r.kld_mean for b in batches for r in b} == {r.key: r.kld_mean for r in one}


def test_bad_ray_addresses_and_no_ray(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "s.json"
    res = _sweep(model, out, "--chunks", "2", "--ray", "127.0.0.1:1")
    assert res.exit_code == 2 and "no Ray cluster answers" in res.output
    res = _sweep(model, out, "--chunks", "2", "--ray", "local:0")
    assert res.exit_code == 2 and "at least one worker" in res.output
    dst = tmp_path / "q.gguf"
    res = runner.invoke(ikquant_app, [str(model), str(dst), "--type", "Q4_0", "--ray", "127.0.0.1:1"])
    assert res.exit_code == 2 and "no Ray cluster answers" in res.output
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    res = _sweep(model, out, "--chunks", "2", "--ray", "local")
    assert res.exit_code == 2 and "pip install 'iktools[ray]'" in res.output
    assert not out.exists() and not dst.exists()
    assert not list(tmp_path.glob("*.partial*"))


def test_auto_chunks_extend_rounds_to_the_rows_of_a_fixed_count(model: Path, tmp_path: Path) -> None:
    auto = tmp_path / "auto.json"
    res = runner.invoke(app, ["sweep", str(model), "--text", str(CORPUS), "--ctx", "32", "--types", "Q4_0,IQ2_KS",
                              "--tensors", r"blk\.1\.", "-o", str(auto), "--chunks", "auto", "--threads", "1"])
    assert res.exit_code == 0, res.output
    header = json.loads(auto.read_text())
    n = header["chunks"]
    assert n >= 8 and "rank agreement" in res.output and f"stopping at {n} chunks" in res.output
    assert header["ranking"]["stable"] and header["ranking"]["kendall_tau"] >= 0.9
    fixed = tmp_path / "fixed.json"
    res = runner.invoke(app, ["sweep", str(model), "--text", str(CORPUS), "--ctx", "32", "--types", "Q4_0,IQ2_KS",
                              "--tensors", r"blk\.1\.", "-o", str(fixed), "--chunks", str(n), "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert _rows(auto) == _rows(fixed)  # each round scored only its new chunks: the same digits
    res = runner.invoke(app, ["sweep", str(model), "--text", str(CORPUS), "--ctx", "32", "--types", "Q4_0,IQ2_KS",
                              "--tensors", r"blk\.1\.", "-o", str(auto), "--chunks", "auto", "--threads", "1"])
    assert res.exit_code == 0 and "(0 new)" in res.output and "ranking was stable" in res.output
    res = _sweep(model, tmp_path / "x.json", "--chunks", "some")
    assert res.exit_code == 2 and "--chunks must be" in res.output


def test_kendall_tau() -> None:
    import numpy as np

    from ikrun.sweep.measure import auto_rounds, kendall_tau

    x = np.array([1.0, 2.0, 3.0, 4.0])
    assert kendall_tau(x, x * 10) == 1.0
    assert kendall_tau(x, -x) == -1.0
    assert kendall_tau(x, np.array([1.0, 3.0, 2.0, 4.0])) == pytest.approx(4 / 6)
    assert auto_rounds(20) == [4, 8, 16, 20] and auto_rounds(16) == [4, 8, 16] and auto_rounds(3) == [3]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_ray_workers_keep_the_memory_they_free() -> None:
    """Every worker process of the job (tasks and the sweep's actors) serves large arrays from its heap, as the
    command-line tools do (ikquant/heap.py): a 64 MiB array adds no mmapped block there (Ray's own start-up, before
    the hook, may have some)."""
    from ikquant.cluster import open_cluster, ordered_map

    def mapped_bytes() -> int:
        import ctypes

        import numpy as np

        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                                               "keepcost")]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        before = libc.mallinfo2().hblkhd
        a = np.ones(16 << 20, np.float32)
        return int(libc.mallinfo2().hblkhd - before) * int(a[0])

    class Probe:
        def mapped(self) -> int:
            return mapped_bytes()

    with open_cluster("local:1", 1) as cluster:
        assert list(ordered_map(cluster, mapped_bytes, [()])) == [0]
        actor = cluster.ray.remote(num_cpus=1)(Probe).remote()
        assert cluster.ray.get(actor.mapped.remote()) == 0


def test_a_ray_sweep_of_a_model_with_an_indexer_cache_has_the_local_rows(tmp_path: Path) -> None:
    """The workers are handed the cache options as given, and resolve them as the driver did: DeepSeek-V4's
    indexer key cache resolves to f32 with f32 keys, a type its -ictk refuses when named (handed the resolved
    types, every worker refused to load the model)."""
    model = Path(__file__).parent / "data" / "convert" / "deepseek-v4-flash" / "ref-f32.gguf"
    local, remote = tmp_path / "local.json", tmp_path / "ray.json"
    flags = ["--chunks", "2", "--tensors", r"blk\.1\.ffn_down_exps"]
    res = _sweep(model, local, *flags)
    assert res.exit_code == 0, res.output
    res = _sweep(model, remote, *flags, "--ray", "local:1")
    assert res.exit_code == 0, res.output
    assert _rows(remote) == _rows(local) and len(_rows(local)) == 2
