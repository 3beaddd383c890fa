"""`ikrun sweep --target-bpw`: fewer measurements, predicted rows that say so, and mixes as good as the
exhaustive sweep's at those budgets (in-sample: the mixes are measured on the sweep's own text)."""

from __future__ import annotations

import json
import re
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


def test_pruned_sweep_measures_fewer_rows_for_mixes_as_good(model: Path, full: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from ikrun.sweep import measure

    recordings = []

    class Counted(measure.BlockInputs):  # type: ignore[misc]
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            recordings.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(measure, "BlockInputs", Counted)
    pruned = tmp_path / "pruned.csv"
    res = _sweep(model, pruned, "--target-bpw", ",".join(map(str, BUDGETS)))
    assert res.exit_code == 0, res.output
    rounds = re.search(r"in (\d+) rounds of measurements", " ".join(res.output.split()))
    assert rounds is not None and int(rounds.group(1)) > 1 and len(recordings) == 1  # the rounds share one recording
    monkeypatch.undo()
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


def test_the_prior_of_a_large_tensor_is_estimated_from_a_sample_of_its_rows(data_dir: Path) -> None:
    """A tensor of more rows than the sample: the prior quantizes only the sampled rows (the same share of every
    expert, evenly spaced) and scales their weighted error to all rows; those rows encode as in the whole tensor
    (Q8_0's rows do not interact), so the estimate is the whole tensor's error on exactly those rows."""
    import numpy as np

    from ikquant.imatrix import Imatrix, ImatrixEntry
    from ikquant.types import type_by_name
    from ikrun.model import Model
    from ikrun.sweep.measure import quantized_copy
    from ikrun.sweep.prune import sampled_rows, weighted_error

    assert sampled_rows(2048, 8, 1, 256).tolist() == [e * 256 + 8 * k for e in range(8) for k in range(32)]
    assert sampled_rows(16, 1, 4, 8).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert sampled_rows(100, 1, 1, 256).tolist() == list(range(100))
    model = Model(data_dir / "convert" / "qwen3-moe" / "ik-f32.gguf")
    name = "blk.0.ffn_up_exps.weight"  # 4 experts of 32 rows
    info = model.weights.info(name)
    t = type_by_name("Q8_0")
    n_exp = info.ne[2]
    imat = Imatrix({name: ImatrixEntry(np.arange(1, n_exp * info.n_per_row + 1, dtype=np.float32), 1)})
    w = imat.lookup(name, info.n_per_row, n_exp, info.n_rows)[0]
    assert w is not None
    x = model.weights.source_encoding(name).raw.view(np.float32).reshape(info.n_rows, info.n_per_row)
    q = t.require_codec().dequantize(quantized_copy(model, name, t, imat)[1], info.n_per_row).reshape(x.shape)
    d2 = (q.astype(np.float64) - x) ** 2 * w[np.arange(info.n_rows) // (info.n_rows // n_exp)]
    rows = sampled_rows(info.n_rows, n_exp, 1, 16)
    assert len(rows) == 16 and sorted(set(rows // 32)) == [0, 1, 2, 3]
    expected = float(d2[rows].sum()) * info.n_rows / 16
    assert weighted_error(model, name, t, imat, sample=16) == pytest.approx(expected, rel=1e-12)
    assert weighted_error(model, name, t, imat, sample=16) != pytest.approx(float(d2.sum()), rel=1e-6)


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 6-layer tiny Qwen3 (blocks 0, 4 and 5 sampled, 1-3 predicted) and its exhaustive sweep."""
    from ikconvert.convert import Converter
    from ikconvert.tiny import TinySpec, make_tiny_checkpoint

    folder = tmp_path_factory.mktemp("six")
    hf = make_tiny_checkpoint(folder / "hf", TinySpec(arch="qwen3", hidden=64, layers=6, heads=4, kv_heads=2,
                                                      head_dim=32, ffn=128, seed=5))
    model = Converter(hf, "f32", "qwen2").write(folder / "m6-f32.gguf")
    full = folder / "full.json"
    assert _sweep(model, full).exit_code == 0
    return model, full


def test_a_spread_sweep_samples_blocks_and_measures_near_the_frontier(six_layers: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    """With --prediction-spread the unsampled blocks' rows are predicted from the sampled blocks of their class
    (the basis says which), far fewer rows are measured, every measured row is the exhaustive sweep's, and the
    mixes measure as the exhaustive sweep's do."""
    from ikquant.sweepfile import read_sweep_file

    model, full = six_layers
    every = {(r["group"], r["type"]): r for r in json.loads(full.read_text())["rows"]}
    pruned = tmp_path / "spread.json"
    res = _sweep(model, pruned, "--target-bpw", ",".join(map(str, BUDGETS)), "--prediction-spread", "1.25")
    assert res.exit_code == 0, res.output
    assert "spread 1.25: 23 of 44 groups sampled" in " ".join(res.output.split())
    header, rows = read_sweep_file(pruned)
    assert header["prediction_spread"] == 1.25 and len(rows) == len(every)
    measured = [r for r in rows if r["measured"]]
    # blocks 0, 4 and 5 of 6 are sampled, at two types each: 83 rows before the blocks' ffn effects moved the
    # predictions, 88 since (on random weights the effects are noise, and move more options near the frontier)
    assert len(measured) <= 0.5 * len(rows), len(measured)
    for r in measured:
        assert r["kld_mean"] == every[(r["group"], r["type"])]["kld_mean"]
    predicted = [r for r in rows if not r["measured"]]
    assert all(r["kld_mean"] == r["prediction"] for r in predicted)
    touched = {r["group"] for r in measured}
    for r in predicted:  # a group never measured is predicted from its class's sampled blocks, else from its own
        layer = int(r["group"].split(".")[1]) if r["group"].startswith("blk.") else None
        if r["group"] not in touched:
            assert layer in (1, 2, 3) and r["basis"].startswith("blk.4 of "), r  # not from the first block
        else:
            assert "measurement" in r["basis"], r
    assert len({r["group"] for r in predicted} - touched) >= 6
    for bpw in BUDGETS:
        exhaustive = _mix_kld(model, full, tmp_path / f"full{bpw}.gguf", bpw)
        assert _mix_kld(model, pruned, tmp_path / f"spread{bpw}.gguf", bpw) <= MARGIN * exhaustive
    res = _sweep(model, tmp_path / "x.json", "--prediction-spread", "2")
    assert res.exit_code == 2 and "--prediction-spread 2: give a factor of 1 or more, with --target-bpw" in \
        " ".join(res.output.split()), res.output


def test_resolution_leaves_unresolvable_options_unmeasured(six_layers: tuple[Path, Path], tmp_path: Path) -> None:
    """--resolution K skips the options near the frontier whose predicted KLD is within K standard errors of the
    chosen one's: fewer rows measured the larger K, every measured row the exhaustive sweep's, the count of what
    was skipped in the summary and K in the header; the mixes stay as good."""
    from ikquant.sweepfile import read_sweep_file

    model, full = six_layers
    every = {(r["group"], r["type"]): r for r in json.loads(full.read_text())["rows"]}
    budgets = ",".join(map(str, BUDGETS))
    counts = []
    for k in ("0", "2", "1e9"):
        out = tmp_path / f"res{k}.json"
        res = _sweep(model, out, "--target-bpw", budgets, "--prediction-spread", "1.25", "--resolution", k)
        assert res.exit_code == 0, res.output
        text = " ".join(res.output.split())
        header, rows = read_sweep_file(out)
        measured = [r for r in rows if r["measured"]]
        for r in measured:
            assert r["kld_mean"] == every[(r["group"], r["type"])]["kld_mean"]
        skipped = re.search(r"resolution \S+: (\d+) options near the frontier not measured", text)
        if k == "0":
            assert skipped is None and "resolution" not in header
        else:
            assert skipped is not None and header["resolution"] == float(k), text
        counts.append((len(measured), int(skipped.group(1)) if skipped else 0))
        if k == "2":
            for bpw in BUDGETS:
                exhaustive = _mix_kld(model, full, tmp_path / f"full{bpw}.gguf", bpw)
                assert _mix_kld(model, out, tmp_path / f"res{bpw}.gguf", bpw) <= MARGIN * exhaustive
    assert counts[0][0] > counts[1][0] > counts[2][0] and counts[2][1] > counts[1][1] > 0, counts
    for bad, why in ((["--target-bpw", budgets, "--resolution", "1"], "with --prediction-spread"),
                     (["--target-bpw", budgets, "--prediction-spread", "2", "--resolution", "-1"], "0 or more")):
        res = _sweep(model, tmp_path / "x.json", *bad)
        assert res.exit_code == 2 and why in " ".join(res.output.split()), res.output
        assert not (tmp_path / "x.json").exists()


def test_the_sampled_blocks_and_the_predictions_from_them() -> None:
    """Every 4th block of a class and its last are sampled, the first block and those from the middle on at a
    second type; on costs that follow log KLD = b(block) + alpha log error exactly, with b linear in the block
    except an outlying first block, the predictions of unmeasured types (from a group's two measured types, or its
    one along the class's alpha) and of the unsampled blocks after the second sampled one are exact; the blocks
    between the first and the second sampled block take the second's b (the first is no guide to them)."""
    import math

    from ikrun.sweep.predict import Predictor, exponent_groups, sampled_groups

    groups = {f"blk.{i}.{c}.weight": [f"blk.{i}.{c}.weight"] for i in range(24) for c in ("attn_q", "ffn_down")}
    groups["output.weight"] = ["output.weight"]
    sample, second = sampled_groups(groups), exponent_groups(groups)
    assert sample == {"output.weight"} | {f"blk.{i}.{c}.weight" for i in (0, 4, 8, 12, 16, 20, 23)
                                          for c in ("attn_q", "ffn_down")}
    assert second == {"output.weight"} | {f"blk.{i}.{c}.weight" for i in (0, 12, 16, 20, 23)
                                          for c in ("attn_q", "ffn_down")}
    types = ["A", "B", "C", "D"]
    alpha = {"attn_q": 0.8, "ffn_down": 1.3, "output": 1.0}
    error = {(g, t): (k + 1) * 0.01 * (1 + len(g) % 3) for g in groups for k, t in enumerate(types)}

    def b(layer: int) -> float:
        return -9 + 0.1 * layer + (5.0 if layer == 0 else 0.0)

    def truth(g: str, t: str, layer: int | None = None) -> float:
        own = int(g.split(".")[1]) if g.startswith("blk.") else 0
        cls = g.split(".")[2] if g.startswith("blk.") else "output"
        return math.exp(b(own if layer is None else layer) + alpha[cls] * math.log(error[(g, t)]))

    measured = {(g, t): truth(g, t) for g in sample for t in (("A", "C") if g in second else ("A",))}
    predict = Predictor(groups, types, error, measured)
    for g in groups:
        early = g.startswith(("blk.1.", "blk.2.", "blk.3."))
        for t in types:
            want = truth(g, t, 4) if early else truth(g, t)
            assert predict(g, t)[0] == pytest.approx(want, rel=1e-9), (g, t, predict(g, t))
    assert predict("blk.2.attn_q.weight", "B")[1].startswith("blk.4 of attn_q:")
    assert "interpolated between blk.4 and blk.8 of attn_q" in predict("blk.5.attn_q.weight", "B")[1]
    assert "interpolated between blk.20 and blk.23 of ffn_down" in predict("blk.21.ffn_down.weight", "B")[1]
    assert "interpolated between the A and C measurements" in predict("blk.12.attn_q.weight", "B")[1]
    assert "the A measurement" in predict("blk.4.attn_q.weight", "B")[1]
    assert "^1.30 (alpha of ffn_down)" in predict("blk.4.ffn_down.weight", "D")[1]
    assert "^1.30 (alpha of ffn_down)" in predict("blk.12.ffn_down.weight", "D")[1]


def test_near_the_frontier_is_within_the_spread_of_the_multiplier() -> None:
    from ikrun.sweep.predict import near_frontier

    chosen, lam = (400, 0.010), 1e-5  # (bits, KLD); lam: KLD per bit
    assert near_frontier(chosen, (500, 0.0095), lam, 2.0)  # saves 5e-6 a bit: half the multiplier
    assert not near_frontier(chosen, (500, 0.0096), lam, 2.0)  # saves 4e-6 a bit
    assert near_frontier(chosen, (300, 0.0115), lam, 2.0)  # loses 1.5e-5 a bit saved
    assert not near_frontier(chosen, (300, 0.0125), lam, 2.0)  # loses 2.5e-5 a bit saved
    assert not near_frontier(chosen, (500, 0.0095), lam, 1.0)  # a spread of 1 trusts the predictions


def test_a_block_departing_from_the_trend_in_its_measured_ffn_tensors_moves_its_other_ffn_tensors() -> None:
    """A group measured outside the sample (near the frontier) does not join its class's trend; its departure from
    the trend is its block's effect, added to the block's unmeasured ffn_* groups only: blk.9's ffn_gate measured
    e^2 above the line predicts blk.9's ffn_down e^2 above its own line (exactly, on costs that follow the model),
    leaves blk.9's attn_q and blk.10's ffn_gate on their lines, and blk.10 is still interpolated between blk.8 and
    blk.12 (not from blk.9)."""
    import math

    from ikrun.sweep.predict import Predictor, sampled_groups

    classes = ("attn_q", "ffn_gate_exps", "ffn_down_exps")
    groups = {f"blk.{i}.{c}.weight": [f"blk.{i}.{c}.weight"] for i in range(24) for c in classes}
    sample = sampled_groups(groups)
    types = ["A", "B", "C"]
    alpha = {"attn_q": 0.8, "ffn_gate_exps": 1.1, "ffn_down_exps": 1.3}
    error = {(g, t): (k + 1) * 0.01 * (1 + len(g) % 3) for g in groups for k, t in enumerate(types)}

    def truth(g: str, t: str, bump: float = 0.0) -> float:
        layer, cls = int(g.split(".")[1]), g.split(".")[2]
        return math.exp(-9 + 0.1 * layer + bump + alpha[cls] * math.log(error[(g, t)]))

    measured = {(g, t): truth(g, t) for g in sample for t in ("A", "C")}
    measured[("blk.9.ffn_gate_exps.weight", "A")] = truth("blk.9.ffn_gate_exps.weight", "A", 2.0)
    predict = Predictor(groups, types, error, measured)
    kld, basis = predict("blk.9.ffn_down_exps.weight", "B")
    assert kld == pytest.approx(truth("blk.9.ffn_down_exps.weight", "B", 2.0), rel=1e-9)
    assert "+2.000 for the departure of blk.9's measured ffn_* tensors" in basis
    for g in ("blk.9.attn_q.weight", "blk.10.ffn_gate_exps.weight", "blk.10.ffn_down_exps.weight"):
        kld, basis = predict(g, "B")
        assert kld == pytest.approx(truth(g, "B"), rel=1e-9), (g, basis)
        assert "departure" not in basis
    assert "interpolated between blk.8 and blk.12 of ffn_gate_exps" in predict("blk.10.ffn_gate_exps.weight", "B")[1]
