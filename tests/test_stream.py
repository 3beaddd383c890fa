"""Evaluation within a memory budget: layer-streamed runs give the exact logits of chunk-by-chunk runs, read each
block once, spill hidden states to disk when asked to, and refuse budgets they cannot meet before any compute."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikquant.sizes import parse_size
from ikrun.cli import app
from ikrun.errors import BudgetError
from ikrun.eval.evaluate import collect_imatrix, perplexity
from ikrun.eval.imatrix import ImatrixCollector
from ikrun.eval.stream import evaluate_chunks, minimum_budget, model_decoded_bytes, plan_run
from ikrun.model import Model
from ikrun.options import RuntimeOptions

runner = CliRunner()
CTX = 48
MODELS = {"qwen3": "qwen3/ik-f32.gguf", "deepseek2": "deepseek-v3/ik-q8_0.gguf",
          "openpangu": "openpangu-v2/ik-q8_0.gguf", "glm-dsa": "glm-dsa/ref-f32.gguf",
          "deepseek4": "deepseek-v4-flash/ref-f32.gguf", "qwen3next": "qwen3-next/ref-f32.gguf"}


def _path(data_dir: Path, arch: str) -> Path:
    return data_dir / "convert" / MODELS[arch]


def _chunks(model: Model, n_chunk: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.n_vocab, size=(n_chunk, CTX))


def _logits(model: Model, chunks: np.ndarray, plan) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    return [x.copy() for _, x in evaluate_chunks(model, chunks, plan)]


@pytest.mark.parametrize(("arch", "numerics"), [(arch, "exact") for arch in sorted(MODELS)] + [
    (arch, "ik") for arch in ("deepseek2", "openpangu", "deepseek4")])  # Q8_0 / MXFP4 weights: integer kernels
def test_streamed_under_a_small_budget_equals_chunk_by_chunk(data_dir: Path, arch: str, numerics: str) -> None:
    """Streamed, every expert's tokens come from all five chunks at once; under --numerics ik they are multiplied
    in integers (qmatmul) and must give the bits of the chunk-by-chunk run too."""
    options = RuntimeOptions(numerics=numerics)
    free = Model(_path(data_dir, arch), options=options)
    chunks = _chunks(free, 5)
    expected = _logits(free, chunks, plan_run(free, 5, CTX, one_pass=False))
    tight = Model(_path(data_dir, arch), options=options)
    tight.mem = minimum_budget(tight, CTX)  # one block at a time: experts decoded a few at a time
    plan = plan_run(tight, 5, CTX, one_pass=True)
    assert plan.streamed and plan.cache_capacity is not None and plan.cache_capacity < model_decoded_bytes(tight)
    got = _logits(tight, chunks, plan)
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("arch", ["qwen3", "deepseek2", "deepseek4"])
def test_each_block_is_read_once_per_pass_whatever_the_chunk_count(data_dir: Path, arch: str) -> None:
    reads = {}
    for n_chunk in (2, 6):
        m = Model(_path(data_dir, arch))
        m.mem = minimum_budget(m, CTX) + (4 << 20)
        plan = plan_run(m, n_chunk, CTX, one_pass=True)
        assert plan.streamed and plan.group == n_chunk
        _logits(m, _chunks(m, n_chunk), plan)
        reads[n_chunk] = {n: r for n, r in m.weights.reads.items() if n.startswith("blk.")}
        for name, r in reads[n_chunk].items():
            enc = m.weights.encoded_bytes(name)
            if "_exps" in name:  # only routed experts are decoded, each once
                assert 0 < r <= enc and r % (enc // m.weights.info(name).shape[0]) == 0, name
            else:
                assert r == enc, name
    assert reads[2].keys() == reads[6].keys()
    assert all(reads[6][n] >= reads[2][n] for n in reads[2])  # more chunks route to more experts, never re-read
    assert {n: r for n, r in reads[6].items() if "_exps" not in n} == \
        {n: r for n, r in reads[2].items() if "_exps" not in n}


@pytest.mark.parametrize("numerics", ["exact", "ik"])
def test_a_pass_in_several_groups_converts_each_expert_once_where_it_fits(data_dir: Path, numerics: str) -> None:
    """Chunks taken through each block one at a time: the experts decoded (exact) or converted to ik's integers
    for the first chunk serve the next ones while the cache has room (read once per pass), and are read again per
    chunk without it; the logits are the chunk-by-chunk run's either way. Under --numerics ik an expert has two
    forms (its stored integers below ik's conversion threshold of routed tokens, the converted ones from it on),
    each read once."""
    options = RuntimeOptions(numerics=numerics)
    free = Model(_path(data_dir, "deepseek2"), options=options)
    chunks = _chunks(free, 4)
    expected = _logits(free, chunks, plan_run(free, 4, CTX, one_pass=False))
    expert_reads = {}
    for room in (True, False):
        m = Model(_path(data_dir, "deepseek2"), options=options)
        m.mem = minimum_budget(m, CTX)
        plan = replace(plan_run(m, 4, CTX, one_pass=True), group=1, cache_capacity=None if room else 0)
        for a, b in zip(expected, _logits(m, chunks, plan)):
            np.testing.assert_array_equal(a, b)
        reads = {n: r for n, r in m.weights.reads.items() if "_exps" in n}
        if room:
            forms = 2 if numerics == "ik" else 1
            assert all(r <= forms * m.weights.encoded_bytes(n) for n, r in reads.items())
        expert_reads[room] = sum(reads.values())
    assert expert_reads[False] > expert_reads[True] > 0


def test_hidden_states_spill_to_disk_and_the_file_is_removed(data_dir: Path, tmp_path: Path) -> None:
    free = Model(_path(data_dir, "qwen3"))
    chunks = _chunks(free, 40)
    expected = _logits(free, chunks, plan_run(free, 40, CTX, one_pass=False))
    m = Model(_path(data_dir, "qwen3"))
    m.mem = minimum_budget(m, CTX) + 64 * 1024
    plan = plan_run(m, 40, CTX, one_pass=True, spill_dir=tmp_path)
    assert plan.spill_dir == tmp_path and plan.group < 40
    seen = []
    for i, x in evaluate_chunks(m, chunks, plan):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        np.testing.assert_array_equal(x, expected[i])
    assert all(len(s) == 1 and s[0].startswith(f"iktools-spill-{os.getpid()}-") for s in seen)
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_streamed_run_removes_its_spill_file(data_dir: Path, tmp_path: Path) -> None:
    m = Model(_path(data_dir, "qwen3"))
    m.mem = minimum_budget(m, CTX) + 64 * 1024
    plan = plan_run(m, 40, CTX, one_pass=True, spill_dir=tmp_path)
    run = evaluate_chunks(m, _chunks(m, 40), plan)
    next(run)
    assert len(list(tmp_path.iterdir())) == 1
    run.close()  # what Ctrl-C or SIGTERM (SystemExit) does to the generator
    assert list(tmp_path.iterdir()) == []


def test_a_spill_disk_without_room_is_refused_before_the_run(data_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import ikrun.eval.stream

    monkeypatch.setattr(ikrun.eval.stream, "free_disk", lambda path: 1000)
    m = Model(_path(data_dir, "qwen3"))
    m.mem = minimum_budget(m, CTX) + 64 * 1024
    with pytest.raises(BudgetError, match="on disk"):
        plan_run(m, 40, CTX, one_pass=True, spill_dir=tmp_path)


def test_imatrix_streamed_equals_chunk_by_chunk(data_dir: Path) -> None:
    collected = {}
    for stream in (False, True):
        m = Model(_path(data_dir, "deepseek2"), stream=stream)
        chunks = _chunks(m, 4)
        collector = ImatrixCollector()
        nll = collect_imatrix(m, chunks, collector, plan=plan_run(m, 4, CTX, one_pass=True))
        collected[stream] = (collector, nll)
    (a, nll_a), (b, nll_b) = collected[False], collected[True]
    np.testing.assert_array_equal(nll_a, nll_b)
    assert a.sums.keys() == b.sums.keys() and a.ncall == b.ncall
    for name in a.sums:
        np.testing.assert_array_equal(a.sums[name], b.sums[name], err_msg=name)
        np.testing.assert_array_equal(a.counts[name], b.counts[name], err_msg=name)


def test_ppl_and_kld_digits_do_not_depend_on_the_budget(data_dir: Path, tmp_path: Path) -> None:
    model = str(_path(data_dir, "qwen3"))
    text = str(data_dir / "logits" / "qwen3" / "text.txt")
    small = str(minimum_budget(Model(model), 64) + 256 * 1024)
    runs = []
    for extra in ([], ["--no-stream"], ["--mem", small], ["--mem", small, "--stream", "--spill-dir", str(tmp_path)]):
        res = runner.invoke(app, ["ppl", model, "--text", text, "--ctx", "64", "--json", *extra])
        assert res.exit_code == 0, res.output
        runs.append(json.loads(res.stdout))
    assert all(r == runs[0] for r in runs), runs
    q8 = str(data_dir / "convert" / "qwen3" / "ik-q8_0.gguf")
    saved = []
    for i, extra in enumerate(([], ["--mem", small])):
        path = tmp_path / f"base{i}.kld"
        res = runner.invoke(app, ["kld", q8, "--base", model, "--text", text, "--ctx", "64", "--json",
                                  "--save-base-logits", str(path), *extra])
        assert res.exit_code == 0, res.output
        saved.append((json.loads(res.stdout), path.read_bytes()))
    assert saved[0] == saved[1]


def test_a_budget_below_one_block_stops_before_compute(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "imatrix.dat"
    res = runner.invoke(app, ["imatrix", str(_path(data_dir, "qwen3")), "--text",
                              str(data_dir / "logits" / "qwen3" / "text.txt"), "--ctx", "64", "--mem", "100KiB",
                              "-o", str(out)])
    assert res.exit_code == 2, res.output
    assert "--mem 100.00 KiB is below what one block needs" in res.output and "give at least" in res.output
    assert not out.exists() and list(tmp_path.iterdir()) == []
    res = runner.invoke(app, ["ppl", str(_path(data_dir, "qwen3")), "--text", "x", "--mem", "lots"])
    assert res.exit_code == 2 and "--mem 'lots' is not a size" in res.output


def test_the_output_head_runs_in_tiles_when_it_does_not_fit(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ikrun.numerics.exact

    free = Model(_path(data_dir, "qwen3"))
    chunks = _chunks(free, 2)
    expected = _logits(free, chunks, plan_run(free, 2, CTX, one_pass=False))
    monkeypatch.setattr(ikrun.numerics.exact, "TILE_BYTES", 64 * 4 * 32)  # 32 rows at a time
    m = Model(_path(data_dir, "qwen3"))
    m.mem = minimum_budget(m, CTX)
    plan = plan_run(m, 2, CTX, one_pass=True)
    plan.cache_capacity = m.weights.decoded_bytes(m.impl.output) - 1  # type: ignore[attr-defined]
    got = _logits(m, chunks, plan)
    assert m.tiled == {m.impl.output}  # type: ignore[attr-defined]
    for a, b in zip(expected, got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # BLAS rounds a tile's rows differently


@pytest.mark.parametrize("text,size", [("8GiB", 8 << 30), ("512MiB", 512 << 20), ("1.5TB", 1_500_000_000_000),
                                       ("300000", 300000), (" 2 kib ", 2048)])
def test_sizes_parse(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_perplexity_matches_through_every_plan(data_dir: Path) -> None:
    m = Model(_path(data_dir, "openpangu"))
    chunks = _chunks(m, 3)
    a = perplexity(m, chunks, plan=plan_run(m, 3, CTX, one_pass=False)).nll
    m.stream = True
    b = perplexity(m, chunks).nll
    np.testing.assert_array_equal(a, b)
