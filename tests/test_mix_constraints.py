"""Choosing a mix under constraints (tie groups, lower bounds per class, the exchange repair after the greedy
choice), measuring it on held-out text, and refusing bad input before anything is written."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.tiny import CORPUS
from ikquant.cli import app as ikquant_app
from ikquant.gguf_io import GGUFFile
from ikquant.mix import Option, choose_mix
from ikrun.cli import app

runner = CliRunner()


def _random_instance(rng: np.random.Generator) -> tuple[dict[str, list[Option]], float]:
    """Groups with 2-4 options each, KLD falling with bits (as a sweep's), and a budget between the extremes."""
    options = {}
    for g in range(int(rng.integers(2, 6))):
        n = int(rng.integers(2, 5))
        bits = np.sort(rng.choice(np.arange(10, 200), size=n, replace=False))
        kld = np.sort(rng.random(n) ** 2)[::-1]
        options[f"g{g}"] = [Option(f"T{k}", int(b), float(v)) for k, (b, v) in enumerate(zip(bits, kld))]
    lo = sum(min(o.bits for o in opts) for opts in options.values())
    hi = sum(max(o.bits for o in opts) for opts in options.values())
    return options, float(rng.uniform(lo, hi))


def test_exchange_repair_is_never_worse_than_the_greedy_choice_and_often_better() -> None:
    rng = np.random.default_rng(0)
    improved = 0
    for _ in range(300):
        options, budget = _random_instance(rng)
        mix = choose_mix({g: [g] for g in options}, options, budget)
        assert mix.bits <= budget and mix.bits == sum(o.bits for o in mix.choice.values())
        assert mix.predicted_kld <= mix.greedy_kld + 1e-15
        assert mix.predicted_kld == pytest.approx(sum(o.kld for o in mix.choice.values()), abs=1e-15)
        best = min(sum(o.kld for o in c) for c in itertools.product(*options.values())
                   if sum(o.bits for o in c) <= budget)
        assert mix.predicted_kld >= best - 1e-12
        improved += mix.predicted_kld < mix.greedy_kld - 1e-12
    assert improved > 0  # the greedy choice alone is not optimal on these: the repair has work to do


def test_the_best_exchange_pair_is_the_full_tables_best() -> None:
    """The sorted search finds the pair the full (upgrade x downgrade) table finds."""
    from ikquant.mix import _best_pair

    rng = np.random.default_rng(1)
    for _ in range(500):
        n = int(rng.integers(2, 40))
        group = rng.integers(0, max(2, n // 3), n)
        dbits = rng.integers(-50, 50, n).astype(np.float64)
        dkld = rng.normal(0, 1, n)
        room = float(rng.integers(-20, 40))
        up, down = np.flatnonzero(dbits > 0), np.flatnonzero(dbits < 0)
        table = [(dkld[u] + dkld[d], u, d) for u in up for d in down
                 if group[u] != group[d] and dbits[u] + dbits[d] <= room and dkld[u] + dkld[d] < 0]
        pair, gain = _best_pair(group, dbits, dkld, room)
        if not table:
            assert pair is None and gain == np.inf
            continue
        assert pair is not None and gain == pytest.approx(min(table)[0], abs=1e-12)
        u, d = pair
        assert group[u] != group[d] and dbits[u] + dbits[d] <= room and dkld[u] + dkld[d] == pytest.approx(gain)


@pytest.fixture(scope="module")
def moe_sweep(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    model = data_dir / "convert" / "qwen3-moe" / "ik-f32.gguf"
    out = tmp_path_factory.mktemp("moe") / "sweep.json"
    res = runner.invoke(app, ["sweep", str(model), "--text", str(CORPUS), "--ctx", "64", "--chunks", "3", "-o",
                              str(out), "--types", "Q4_0,Q6_0,Q8_0"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    return model, out


def _quantize(model: Path, sweep: Path, out: Path, *extra: str):  # type: ignore[no-untyped-def]
    return runner.invoke(ikquant_app, [str(model), str(out), "--type", "q8_0", "--sweep", str(sweep), *extra],
                         env={"COLUMNS": "200"})


def test_ties_and_bounds_are_honoured(moe_sweep: tuple[Path, Path], tmp_path: Path) -> None:
    model, sweep = moe_sweep
    rows = json.loads(sweep.read_text())["rows"]
    lo = min(r["bpw"] for r in rows)
    for bpw in (lo + 0.6, lo + 1.6, lo + 2.6):
        out = tmp_path / f"mix{bpw:.1f}.gguf"
        res = _quantize(model, sweep, out, "--target-bpw", f"{bpw:.3f}", "--tie", "attn_(q|k|v)",
                        "--min-type", "ffn_down_exps=Q6_0")
        assert res.exit_code == 0, res.output
        types = {t.name: t.type.name for t in GGUFFile(out).tensors.values()}
        for layer in (0, 1):
            assert types[f"blk.{layer}.ffn_up_exps.weight"] == types[f"blk.{layer}.ffn_gate_exps.weight"]  # default
            assert len({types[f"blk.{layer}.attn_{x}.weight"] for x in "qkv"}) == 1
            assert types[f"blk.{layer}.ffn_down_exps.weight"] in ("Q6_0", "Q8_0")
    # without the ties and the bound, the same budget's mix breaks them (the test above would notice)
    free = tmp_path / "free.gguf"
    assert _quantize(model, sweep, free, "--target-bpw", f"{lo + 1.6:.3f}", "--no-default-ties").exit_code == 0
    types = {t.name: t.type.name for t in GGUFFile(free).tensors.values()}
    assert any(types[f"blk.{k}.ffn_up_exps.weight"] != types[f"blk.{k}.ffn_gate_exps.weight"] for k in (0, 1)) or \
        any(len({types[f"blk.{k}.attn_{x}.weight"] for x in "qkv"}) > 1 for k in (0, 1)) or \
        any(types[f"blk.{k}.ffn_down_exps.weight"] == "Q4_0" for k in (0, 1))


@pytest.mark.parametrize(("extra", "needle"), [
    (["--tie", "attn_nothing"], "--tie 'attn_nothing' matches no swept tensor"),
    (["--tie", "attn_(q|output)"], "different shapes"),
    (["--tie", "attn_("], "not a regular expression"),
    (["--min-type", "ffn_down_exps=Q9_9"], "is not a type"),
    (["--min-type", "nothing=Q6_0"], "matches no swept tensor"),
])
def test_bad_constraints_are_refused(moe_sweep: tuple[Path, Path], tmp_path: Path, extra: list[str],
                                     needle: str) -> None:
    model, sweep = moe_sweep
    out = tmp_path / "bad.gguf"
    res = _quantize(model, sweep, out, "--target-bpw", "7", *extra)
    assert res.exit_code == 2 and needle in " ".join(res.output.split()), res.output
    assert not out.exists()


def _mix(model: Path, sweep: Path, out: Path, *extra: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["mix", str(model), str(out), "--sweep", str(sweep), "--type", "Q8_0", "--json",
                               *extra], env={"COLUMNS": "200"})


def test_mix_is_measured_on_held_out_text_and_says_so(moe_sweep: tuple[Path, Path], tmp_path: Path) -> None:
    model, sweep = moe_sweep
    held_out = tmp_path / "held-out.txt"  # real prose the sweep never saw: a standard-library module's source
    held_out.write_text(Path(json.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path / "mix.gguf"
    res = _mix(model, sweep, out, "--target-bpw", "6", "--eval-text", str(held_out))
    assert res.exit_code == 0, res.output
    first, on_eval = json.loads(res.stdout)
    assert first["sample"] == "in-sample" and first["text"] == str(CORPUS)
    assert on_eval["sample"] == "held-out" and on_eval["text"] == str(held_out)
    kld = runner.invoke(app, ["kld", str(out), "--base", str(model), "--text", str(held_out), "--ctx", "64",
                              "--chunks", "3", "--json"])
    alone = json.loads(kld.stdout)
    assert alone["kld_mean"] == pytest.approx(on_eval["kld_mean"], rel=1e-12)
    assert alone["kld_mean_err"] == pytest.approx(on_eval["kld_mean_err"], rel=1e-12)  # one ± (ik's), both places
    assert on_eval["kld_mean"] != pytest.approx(first["kld_mean"], rel=1e-3)
    res = _mix(model, sweep, tmp_path / "again.gguf", "--target-bpw", "6", "--eval-text", str(CORPUS))
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)[1]["sample"] == "in-sample"


def test_bad_mix_input_is_one_line_exit_2_and_writes_nothing(moe_sweep: tuple[Path, Path], data_dir: Path,
                                                             tmp_path: Path) -> None:
    model, sweep = moe_sweep
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    cases = [
        (model, ["--target-bpw", "2"], "--target-bpw 2 is below the cheapest mix the sweep allows"),
        (model, ["--target-bpw", "30"], "--target-bpw 30 is above the most expensive mix the sweep allows"),
        (model, ["--target-size", "1KiB"], "--target-size 1KiB is below the cheapest"),
        (model, ["--target-bpw", "6", "--eval-text", str(short)], f"--eval-text {short}: the text gives"),
        (model, ["--target-bpw", "6", "--tie", "attn_(q|output)"], "different shapes"),
        (data_dir / "convert" / "qwen3-moe" / "ik-bf16.gguf", ["--target-bpw", "6"],
         "was measured on another model file"),
    ]
    for base, extra, needle in cases:
        out = tmp_path / "bad.gguf"
        res = _mix(base, sweep, out, *extra)
        assert res.exit_code == 2 and needle in " ".join(res.output.split()), (extra, res.output)
        assert res.output.count("error:") == 1 and not out.exists() and not list(tmp_path.glob("*.gguf*"))


def test_ikquant_refuses_a_sweep_of_another_model_shape(moe_sweep: tuple[Path, Path], tmp_path: Path) -> None:
    model, sweep = moe_sweep
    data = json.loads(sweep.read_text())
    data["rows"][0]["n_weights"] *= 2  # what a wider model of the same tensor names measures
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    out = tmp_path / "mix.gguf"
    res = _quantize(model, other, out, "--target-bpw", "7")
    assert res.exit_code == 2 and "a sweep of another model" in res.output and not out.exists()
    assert data["rows"][0]["group"] in res.output
