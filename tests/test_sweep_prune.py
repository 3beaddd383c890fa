"""`ikrun sweep --target-bpw`: fewer measurements, predicted rows that say so, and mixes as good as the
exhaustive sweep's at those budgets (in-sample: the mixes are measured on the sweep's own text)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ikconvert.tiny import CORPUS
from ikrun.cli import app

runner = CliRunner()
TYPES = "Q4_0,Q5_0,Q6_0,Q8_0"
BUDGETS = (5.5, 6.5)
#: the pruned sweep's mix may measure at most this much above the exhaustive sweep's mix at the same budget
MARGIN = 1.05


def _sweep(model: Path, out: Path, *extra: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["sweep", str(model), "--text", str(CORPUS), "--ctx", "64", "--chunks", "4", "-o",
                               str(out), "--types", TYPES, *extra], env={"COLUMNS": "250"})


def _mix_kld(model: Path, sweep: Path, out: Path, bpw: float) -> float:
    res = runner.invoke(app, ["mix", str(model), str(out), "--sweep", str(sweep), "--type", "Q8_0", "--target-bpw",
                              str(bpw), "--json"])
    assert res.exit_code == 0, res.output
    return float(json.loads(res.stdout)[0]["kld_mean"])


@pytest.fixture(scope="module")
def model(data_dir: Path) -> Path:
    return data_dir / "convert" / "qwen3-moe" / "ik-f32.gguf"


@pytest.fixture(scope="module")
def full(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The exhaustive sweep."""
    path = tmp_path_factory.mktemp("exhaustive") / "full.json"
    assert _sweep(model, path).exit_code == 0
    return path


def test_pruned_sweep_measures_fewer_rows_for_mixes_as_good(model: Path, full: Path, tmp_path: Path) -> None:
    pruned = tmp_path / "pruned.csv"
    res = _sweep(model, pruned, "--target-bpw", ",".join(map(str, BUDGETS)))
    assert res.exit_code == 0, res.output
    from ikquant.sweepfile import read_sweep_file

    every = {(r["group"], r["type"]): r for r in json.loads(full.read_text())["rows"]}
    header, rows = read_sweep_file(pruned)
    assert header["target_bpw"] == list(BUDGETS) and len(rows) == len(every)
    measured = [r for r in rows if r["measured"]]
    predicted = [r for r in rows if not r["measured"]]
    assert 0 < len(measured) < 0.75 * len(rows)
    summary = " ".join(res.output.split())
    assert f"measured {len(measured)} of {len(rows)} (group, type) candidates, predicted {len(predicted)}" in summary
    assert "measured/predicted median" in summary
    for r in measured:  # a measured row is the exhaustive sweep's row, digit for digit
        assert r["kld_mean"] == every[(r["group"], r["type"])]["kld_mean"]
    for r in predicted:
        assert r["kld_mean"] == r["prediction"] and "weighted quantization error" in r["basis"]
        assert r["bytes_new"] == every[(r["group"], r["type"])]["bytes_new"]
    assert any(r["prediction"] is not None for r in measured)  # measured besides the anchors, with what was predicted
    for bpw in BUDGETS:
        exhaustive = _mix_kld(model, full, tmp_path / f"full{bpw}.gguf", bpw)
        assert _mix_kld(model, pruned, tmp_path / f"pruned{bpw}.gguf", bpw) <= MARGIN * exhaustive
    # resumed without a target, the sweep measures exactly the rows that were predicted
    res = _sweep(model, pruned)
    assert res.exit_code == 0 and f"({len(predicted)} new)" in res.output, res.output
    completed = {(r["group"], r["type"]): r for r in read_sweep_file(pruned)[1]}
    assert {k: r["kld_mean"] for k, r in completed.items()} == {k: r["kld_mean"] for k, r in every.items()}
    assert all(r["measured"] for r in completed.values())


def _mix_types(model: Path, sweep: Path, out: Path, bpw: float, *extra: str) -> dict[str, str]:
    res = runner.invoke(app, ["mix", str(model), str(out), "--sweep", str(sweep), "--type", "Q8_0", "--target-bpw",
                              str(bpw), *extra])
    assert res.exit_code == 0, res.output
    from ikquant.shards import GGUFModel

    return {name: t.type.name for name, t in GGUFModel(out).tensors.items()}


def test_a_pruned_sweep_decides_under_the_mix_ties_and_bounds(model: Path, full: Path, tmp_path: Path) -> None:
    """A tie is one choice: its tensors are measured at the same types, and the mix from the pruned sweep is the
    exhaustive sweep's mix under the same tie; a bound keeps the sweep from measuring below it."""
    from ikquant.sweepfile import read_sweep_file

    tie = ["--tie", r"attn_[kv]\."]
    pruned = tmp_path / "tied.json"
    res = _sweep(model, pruned, "--target-bpw", ",".join(map(str, BUDGETS)), *tie)
    assert res.exit_code == 0, res.output
    header, rows = read_sweep_file(pruned)
    assert header["constraints"] == {"ties": [r"attn_[kv]\."], "default_ties": True, "min_types": []}
    measured: dict[str, set[str]] = {}
    for r in rows:
        if r["measured"]:
            measured.setdefault(r["group"], set()).add(r["type"])
    for layer in (0, 1):
        for a, b in (("attn_k", "attn_v"), ("ffn_up_exps", "ffn_gate_exps")):
            ta, tb = measured[f"blk.{layer}.{a}.weight"], measured[f"blk.{layer}.{b}.weight"]
            assert ta == tb, (layer, a, ta, tb)
    assert any(len(types) > 1 for types in measured.values())
    for bpw in BUDGETS:
        exhaustive = _mix_types(model, full, tmp_path / f"full{bpw}.gguf", bpw, *tie)
        assert _mix_types(model, pruned, tmp_path / f"tied{bpw}.gguf", bpw, *tie) == exhaustive
        assert exhaustive["blk.0.attn_k.weight"] == exhaustive["blk.0.attn_v.weight"]
    bounded = tmp_path / "bounded.json"
    res = _sweep(model, bounded, "--target-bpw", "6.5", "--min-type", "ffn_.*_exps=Q6_0")
    assert res.exit_code == 0, res.output
    for r in read_sweep_file(bounded)[1]:
        if "_exps" in r["group"] and r["measured"]:
            assert r["type"] in ("Q6_0", "Q8_0"), r
    res = _sweep(model, tmp_path / "x.json", "--target-bpw", "5.5", "--min-type", "ffn_.*_exps=Q8_0")
    assert res.exit_code == 2 and "--target-bpw 5.5 is below the cheapest mix of the swept types under --min-type" \
        in " ".join(res.output.split()), res.output


def test_unreachable_budgets_are_refused_before_measuring(model: Path, tmp_path: Path) -> None:
    for extra, needle in ((["--target-bpw", "30"], "--target-bpw 30 is above the most expensive"),
                          (["--target-bpw", "1,6"], "--target-bpw 1 is below the cheapest"),
                          (["--target-bpw", "6,x"], "is not a comma-separated list"),
                          (["--tie", "attn_q"], "decide what a --target-bpw sweep measures")):
        out = tmp_path / "s.json"
        res = _sweep(model, out, *extra)
        assert res.exit_code == 2 and needle in " ".join(res.output.split()), (extra, res.output)
        assert not out.exists()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_the_prior_is_the_weighted_squared_error(data_dir: Path, qtype: str) -> None:
    import numpy as np

    from ikquant.imatrix import Imatrix, ImatrixEntry
    from ikquant.types import type_by_name
    from ikrun.model import Model
    from ikrun.sweep.prune import weighted_error

    model = Model(data_dir / "convert" / "qwen3-moe" / "ik-f32.gguf")
    name = "blk.0.ffn_up_exps.weight"  # 3-D: one importance vector per expert
    info = model.weights.info(name)
    t = type_by_name(qtype)
    x = model.weights.source_encoding(name).raw.view(np.float32).reshape(info.n_rows, info.n_per_row)
    from ikrun.sweep.measure import quantized_copy

    q = t.require_codec().dequantize(quantized_copy(model, name, t, None)[1], info.n_per_row)
    plain = float(((q.reshape(x.shape).astype(np.float64) - x) ** 2).sum())
    assert weighted_error(model, name, t, None) == pytest.approx(plain, rel=1e-12)
    n_exp = info.ne[2]
    sums = np.arange(1, n_exp * info.n_per_row + 1, dtype=np.float32)
    imat = Imatrix({name: ImatrixEntry(sums, 1)})
    w = imat.lookup(name, info.n_per_row, n_exp, info.n_rows)[0]
    assert w is not None
    qw = t.require_codec().dequantize(quantized_copy(model, name, t, imat)[1], info.n_per_row).reshape(x.shape)
    d2 = (qw.astype(np.float64) - x) ** 2
    per_expert = info.n_rows // n_exp
    expected = sum(float((d2[e * per_expert:(e + 1) * per_expert] * w[e]).sum()) for e in range(n_exp))
    assert weighted_error(model, name, t, imat) == pytest.approx(expected, rel=1e-12)
