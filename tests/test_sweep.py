"""ikrun sweep and ikquant --sweep/--target-bpw: per-tensor sensitivities and the mix chosen from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ikconvert.tiny import CORPUS, TinySpec, make_tiny_checkpoint
from ikquant.cli import app as ikquant_app
from ikquant.gguf_io import GGUFFile
from ikrun.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def model256(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 with 256-wide rows, so every type applies without fallbacks."""
    from ikconvert.convert import Converter

    folder = tmp_path_factory.mktemp("m256")
    hf = make_tiny_checkpoint(folder / "hf", TinySpec(arch="qwen3", hidden=256, layers=2, heads=4, kv_heads=2,
                                                      head_dim=64, ffn=512, seed=3))
    return Converter(hf, "f32", "qwen2").write(folder / "m256-f32.gguf")


def _sweep(model: Path, out: Path, *extra: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["sweep", str(model), "--text", str(CORPUS), "--ctx", "64", "--chunks", "6", "-o",
                               str(out), *extra], env={"COLUMNS": "200"})


def test_each_row_is_the_kld_of_that_tensor_alone(model256: Path, tmp_path: Path) -> None:
    from ikquant.ftypes import file_type
    from ikquant.quantize import QuantizeOptions, quantize_model

    out = tmp_path / "sweep.json"
    res = _sweep(model256, out, "--types", "IQ4_KS,Q4_0", "--tensors", r"blk\.1\.")
    assert res.exit_code == 0, res.output
    rows = {(r["group"], r["type"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 2 * 7  # q, k, v, output, gate, up, down of layer 1; two types
    base = tmp_path / "base.kld"
    for name, qtype in (("blk.1.ffn_down.weight", "IQ4_KS"), ("blk.1.attn_k.weight", "Q4_0")):
        single = tmp_path / f"{qtype}.gguf"  # the base model with this one tensor quantized
        quantize_model(model256, single, QuantizeOptions(file_type("F32"), pure=True, tensor_types={name: qtype}))
        src = ["--base-logits", str(base)] if base.exists() else [
            "--base", str(model256), "--text", str(CORPUS), "--ctx", "64", "--chunks", "6",
            "--save-base-logits", str(base)]
        r = runner.invoke(app, ["kld", str(single), *src, "--json"])
        assert r.exit_code == 0, r.output
        assert rows[(name, qtype)]["kld_mean"] == pytest.approx(json.loads(r.stdout)["kld_mean"], rel=1e-12)
        # what the row adds: this file against the unmodified model, token by token, on the same base
        r = runner.invoke(app, ["kld", str(single), "--base-logits", str(base), "--versus", str(model256), "--json"])
        assert r.exit_code == 0, r.output
        paired = json.loads(r.stdout)["versus"]
        assert paired["versus_kld_mean"] != 0.0  # the base file's rounding: the unmodified model's own KLD
        assert rows[(name, qtype)]["kld_added"] == pytest.approx(paired["kld_diff"], rel=1e-12)
        assert rows[(name, qtype)]["kld_added_sem"] == pytest.approx(paired["kld_diff_err"], rel=1e-12)
    assert rows[("blk.1.ffn_down.weight", "IQ4_KS")]["bpw"] == pytest.approx(4.25 + 32 / 512)


def test_resumes_and_groups(model256: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    assert _sweep(model256, out, "--types", "Q4_0", "--group", "layer").exit_code == 0
    first = out.read_text()
    res = _sweep(model256, out, "--types", "Q4_0", "--group", "layer")
    assert res.exit_code == 0 and "(0 new)" in res.output
    assert out.read_text() == first
    groups = {r["group"] for r in json.loads(first)["rows"]}
    assert groups == {"blk.0", "blk.1", "token_embd.weight", "output.weight"}
    res = _sweep(model256, tmp_path / "c.json", "--types", "Q4_0", "--group", "class", "--tensors", "attn_")
    assert res.exit_code == 0, res.output
    classes = {r["group"]: len(r["tensors"]) for r in json.loads((tmp_path / "c.json").read_text())["rows"]}
    assert classes == {"attn_q": 2, "attn_k": 2, "attn_v": 2, "attn_output": 2}


def test_plot(model256: Path, tmp_path: Path) -> None:
    res = _sweep(model256, tmp_path / "s.json", "--types", "Q4_0", "--tensors", "ffn", "--plot", str(tmp_path / "s.png"))
    assert res.exit_code == 0, res.output
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mix_meets_the_budget(model256: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep.json"
    assert _sweep(model256, sweep, "--types", "IQ2_KS,IQ4_KS,Q8_0").exit_code == 0
    results = {}
    for bpw in (3.0, 5.0):
        out = tmp_path / f"mix{bpw}.gguf"
        res = runner.invoke(ikquant_app, [str(model256), str(out), "--type", "q8_0", "--sweep", str(sweep),
                                          "--target-bpw", str(bpw)], env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output
        g = GGUFFile(out)
        n = sum(t.n_elements for t in g.tensors.values())
        file_bpw = 8 * sum(t.nbytes for t in g.tensors.values()) / n
        assert file_bpw <= bpw
        predicted = float(res.output.split("predicted mean KLD")[1].split()[0])
        results[bpw] = (file_bpw, predicted, {t.type.name for t in g.tensors.values()})
    assert results[3.0][0] < results[5.0][0] and results[3.0][1] > results[5.0][1]
    assert "IQ2_KS" in results[3.0][2]
    res = runner.invoke(ikquant_app, [str(model256), str(tmp_path / "x.gguf"), "--type", "q8_0", "--sweep",
                                      str(sweep), "--target-bpw", "1.0"])
    assert res.exit_code == 2 and "cheapest" in res.output
    assert not (tmp_path / "x.gguf").exists()


def test_ikrun_mix_measures_the_assembled_file_and_refines_it(model256: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep.json"
    assert _sweep(model256, sweep, "--types", "IQ2_KS,IQ3_K,IQ4_KS,Q8_0").exit_code == 0
    out = tmp_path / "mix.gguf"
    res = runner.invoke(app, ["mix", str(model256), str(out), "--sweep", str(sweep), "--type", "IQ4_KS",
                              "--target-bpw", "3.2", "--refine", "16", "--json"])
    assert res.exit_code == 0, res.output
    first, refined = json.loads(res.stdout)
    plain = runner.invoke(ikquant_app, [str(model256), str(tmp_path / "plain.gguf"), "--type", "IQ4_KS", "--sweep",
                                        str(sweep), "--target-bpw", "3.2"], env={"COLUMNS": "200"})
    assert float(plain.output.split("predicted mean KLD")[1].split()[0]) == pytest.approx(first["predicted_kld"],
                                                                                         abs=1e-6)
    # the sweep's mix, measured: what `ikrun kld` says of the file ikquant writes from the same sweep
    kld = runner.invoke(app, ["kld", str(tmp_path / "plain.gguf"), "--base", str(model256), "--text", str(CORPUS),
                              "--ctx", "64", "--chunks", "6", "--json"])
    assert json.loads(kld.stdout)["kld_mean"] == pytest.approx(first["kld_mean"], rel=1e-12)
    # interactions: the sum of one-at-a-time KLDs is not the mix's KLD; refining re-costs groups inside the mix
    assert first["kld_mean"] != pytest.approx(first["predicted_kld"], rel=1e-3)
    assert refined["kept"] and not first["kept"] and refined["kld_mean"] < first["kld_mean"]
    assert abs(refined["predicted_kld"] - refined["kld_mean"]) < abs(first["predicted_kld"] - first["kld_mean"])
    kld = runner.invoke(app, ["kld", str(out), "--base", str(model256), "--text", str(CORPUS), "--ctx", "64",
                              "--chunks", "6", "--json"])
    assert json.loads(kld.stdout)["kld_mean"] == pytest.approx(refined["kld_mean"], rel=1e-12)
    g = GGUFFile(out)
    assert 8 * sum(t.nbytes for t in g.tensors.values()) / sum(t.n_elements for t in g.tensors.values()) <= 3.2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mix.gguf", "plain.gguf", "sweep.json"]
    res = runner.invoke(app, ["mix", str(model256), str(tmp_path / "x.gguf"), "--sweep", str(sweep), "--type",
                              "IQ4_KS", "--target-bpw", "3.2", "--target-size", "1MiB"])
    assert res.exit_code == 2 and "exactly one of" in res.output and not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("arch", ["qwen3", "deepseek2", "openpangu", "glm-dsa", "deepseek4", "qwen3next"])
def test_layer_local_rows_equal_full_forward_rows(data_dir: Path, tmp_path: Path, arch: str) -> None:
    """Starting each candidate at the first block it changes gives the full forward's digits, on every architecture
    (openPangu's streams and GLM's shared indexer selections are carried in the recorded block inputs)."""
    import numpy as np

    from ikquant.types import type_by_name
    from ikrun.eval.evaluate import open_base, perplexity
    from ikrun.model import Model
    from ikrun.sweep import run_sweep
    from ikrun.sweep.measure import start_block, sweep_groups
    from tests.test_stream import MODELS

    model = Model(data_dir / "convert" / MODELS[arch])
    chunks = np.random.default_rng(1).integers(0, model.n_vocab, size=(3, 32))
    perplexity(model, chunks, tmp_path / "base.kld")
    base = open_base(tmp_path / "base.kld", model)
    groups = sweep_groups(model, "tensor")
    last = model.impl.n_active - 1
    picked = {g: n for g, n in groups.items() if start_block(model, n) in (None, 0, last, model.impl.n_active)
              and all(model.weights.info(t).n_per_row % 32 == 0 for t in n)}
    rows = {}
    for full in (False, True):
        got = run_sweep(model, base, picked, [type_by_name("Q4_0")], None, [], lambda r: None, full_forward=full)
        rows[full] = {r.group: (r.kld_mean, r.kld_p99, r.same_top_p, r.ppl_ratio) for r in got}
    assert rows[False] == rows[True]
    assert {start_block(model, n) for n in picked.values()} >= {0, last, model.impl.n_active}


@pytest.mark.parametrize("arch", ["qwen3", "deepseek2", "glm-dsa", "deepseek4", "qwen3next"])
def test_layer_local_rows_equal_full_forward_rows_fed_in_batches(data_dir: Path, tmp_path: Path, arch: str) -> None:
    """Fed in micro-batches (ikrun sweep --batch), a resumed chunk runs its batches in turn from the changed block
    through a cache of its own: the full forward's digits again, a shorter last batch included (12 + 12 + 8)."""
    import numpy as np

    from ikquant.types import type_by_name
    from ikrun.eval.evaluate import open_base, perplexity
    from ikrun.eval.stream import plan_run
    from ikrun.model import Model
    from ikrun.sweep import run_sweep
    from ikrun.sweep.measure import start_block, sweep_groups
    from tests.test_stream import MODELS

    model = Model(data_dir / "convert" / MODELS[arch])
    chunks = np.random.default_rng(1).integers(0, model.n_vocab, size=(3, 32))
    perplexity(model, chunks, tmp_path / "base.kld", plan=plan_run(model, 3, 32, one_pass=True, batch=12))
    base = open_base(tmp_path / "base.kld", model)
    last = model.impl.n_active - 1
    picked = {g: n for g, n in sweep_groups(model, "tensor", None, 32, 12).items()
              if start_block(model, n) in (0, last) and all(model.weights.info(t).n_per_row % 32 == 0 for t in n)}
    rows = {}
    for full in (False, True):
        got = run_sweep(model, base, picked, [type_by_name("Q4_0")], None, [], lambda r: None, full_forward=full,
                        batch=12)
        rows[full] = {r.group: (r.kld_mean, r.kld_p99, r.same_top_p, r.ppl_ratio) for r in got}
    assert rows[False] == rows[True]
    assert {start_block(model, n) for n in picked.values()} == {0, last}
    assert all(kld > 0 for kld, *_ in rows[False].values())


def test_a_batched_sweep_is_the_kld_of_each_file_fed_in_batches(model256: Path, tmp_path: Path) -> None:
    """`ikrun sweep --batch` measures what `ikrun kld --batch` prints of the file with that one tensor quantized;
    its rows resume only at the same batch, and bad --batch values are refused before any compute."""
    from ikquant.ftypes import file_type
    from ikquant.quantize import QuantizeOptions, quantize_model

    out = tmp_path / "sweep.json"
    res = _sweep(model256, out, "--types", "IQ4_KS", "--tensors", r"blk\.1\.ffn_down", "--batch", "24")
    assert res.exit_code == 0, res.output
    sweep = json.loads(out.read_text())
    assert sweep["batch"] == 24 and len(sweep["rows"]) == 1
    single = tmp_path / "single.gguf"
    quantize_model(model256, single, QuantizeOptions(file_type("F32"), pure=True,
                                                     tensor_types={"blk.1.ffn_down.weight": "IQ4_KS"}))
    r = runner.invoke(app, ["kld", str(single), "--base", str(model256), "--text", str(CORPUS), "--ctx", "64",
                            "--chunks", "6", "--batch", "24", "--json"])
    assert r.exit_code == 0, r.output
    assert sweep["rows"][0]["kld_mean"] == pytest.approx(json.loads(r.stdout)["kld_mean"], rel=1e-12)
    for flags, said in ((["--batch", "32"], "batch = 24, this run has 32"), ([], "batch = 24, this run has None")):
        res = _sweep(model256, out, "--types", "IQ4_KS", "--tensors", r"blk\.1\.ffn_down", *flags)
        assert res.exit_code == 2 and said in " ".join(res.output.split())
    res = _sweep(model256, tmp_path / "zero.json", "--types", "IQ4_KS", "--batch", "0")
    assert res.exit_code == 2 and "--batch 0: give 1 token or more" in res.output
    assert not (tmp_path / "zero.json").exists()


def test_resuming_with_other_settings_is_refused(model256: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    assert _sweep(model256, out, "--types", "Q4_0", "--group", "class", "--tensors", "ffn_up").exit_code == 0
    first = out.read_text()
    header = json.loads(first)
    assert header["format"] == "iktools-sweep" and header["version"] == 2 and header["ctx"] == 64
    assert all(r["kld_sem"] > 0 and r["ln_ppl_ratio_err"] > 0 for r in header["rows"])
    res = runner.invoke(app, ["sweep", str(model256), "--text", str(CORPUS), "--ctx", "32", "--chunks", "6", "-o",
                              str(out), "--types", "Q4_0", "--group", "class", "--tensors", "ffn_up"])
    assert res.exit_code == 2, res.output
    assert "ctx = 64, this run has 32" in " ".join(res.output.split())
    assert out.read_text() == first
    before = tmp_path / "before.json"  # a sweep from before kld_added: its rows cost kld_mean, not comparable
    before.write_text(json.dumps({k: v for k, v in header.items() if k != "cost"}))
    res = _sweep(model256, before, "--types", "Q4_0", "--group", "class", "--tensors", "ffn_up")
    assert res.exit_code == 2 and "cost = None, this run has 'kld_added'" in " ".join(res.output.split())
    legacy = tmp_path / "old.json"  # what earlier versions wrote: no format header
    legacy.write_text(json.dumps({"ctx": 64, "rows": header["rows"]}))
    res = _sweep(model256, legacy, "--types", "Q4_0", "--group", "class", "--tensors", "ffn_up")
    assert res.exit_code == 2 and "older ikrun" in " ".join(res.output.split())


def test_csv_sweeps_resume_and_feed_the_mix(model256: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep.csv"
    assert _sweep(model256, out, "--types", "IQ2_KS,Q8_0").exit_code == 0
    first = out.read_text()
    assert first.startswith('# {"format": "iktools-sweep"')
    res = _sweep(model256, out, "--types", "IQ2_KS,Q8_0")
    assert res.exit_code == 0 and "(0 new)" in res.output
    res = runner.invoke(ikquant_app, [str(model256), str(tmp_path / "mix.gguf"), "--type", "q8_0", "--sweep", str(out),
                                      "--target-bpw", "5.0"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert (tmp_path / "mix.gguf").exists()


def test_rows_within_noise_are_marked() -> None:
    from ikrun.commands.sweep import sweep_table
    from ikrun.sweep.measure import SweepRow

    def row(group: str, ratio: float, err: float) -> SweepRow:
        return SweepRow(group, [group], "Q4_0", "Q4_0", 100, 400, 56, 4.5, 0.01, 0.001, 0.02, 0.9, 1.0, ratio, err, 1.0)

    noisy, clear = row("blk.0.attn_q.weight", 0.001, 0.002), row("blk.0.ffn_up.weight", 0.01, 0.002)
    assert noisy.within_noise and not clear.within_noise
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(sweep_table([noisy, clear]))
    text = console.export_text()
    assert "~ blk.0.attn_q.weight" in text and "~ blk.0.ffn_up.weight" not in text


def test_size_and_per_group_budgets(model256: Path, tmp_path: Path) -> None:
    import re

    sweep = tmp_path / "sweep.json"
    assert _sweep(model256, sweep, "--types", "IQ2_KS,IQ4_KS,Q8_0").exit_code == 0

    def quantize(out: Path, *target: str):  # type: ignore[no-untyped-def]
        return runner.invoke(ikquant_app, [str(model256), str(out), "--type", "q8_0", "--sweep", str(sweep), *target],
                             env={"COLUMNS": "200"})

    sized = tmp_path / "sized.gguf"
    res = quantize(sized, "--target-size", "800KiB")
    assert res.exit_code == 0, res.output
    assert sum(t.nbytes for t in GGUFFile(sized).tensors.values()) <= 800 * 1024
    split = tmp_path / "split.gguf"
    res = quantize(split, "--budget", "ffn_=400KiB", "--budget", "rest=400KiB")
    assert res.exit_code == 0, res.output
    g = GGUFFile(split)
    ffn = sum(t.nbytes for t in g.tensors.values() if re.search("ffn_", t.name))
    rest = sum(t.nbytes for t in g.tensors.values() if not re.search("ffn_", t.name))
    assert ffn <= 400 * 1024 and rest <= 400 * 1024 and {t.type.name for t in g.tensors.values()} >= {"IQ2_KS"}
    assert "budget ffn_:" in res.output and "budget rest:" in res.output
    for target, needle in ((["--budget", "nothing_here=1MiB", "--budget", "rest=1MiB"], "matches no tensor"),
                           (["--budget", "ffn_=1MiB"], "matches no --budget"),
                           (["--budget", "ffn_=1KiB", "--budget", "rest=1MiB"], "--budget ffn_:"),
                           (["--budget", "ffn_"], "REGEX=SIZE"),
                           (["--target-size", "300KiB", "--target-bpw", "4"], "exactly one of")):
        bad = tmp_path / "bad.gguf"
        res = quantize(bad, *target)
        assert res.exit_code == 2 and needle in " ".join(res.output.split()), (target, res.output)
        assert not bad.exists()


@pytest.mark.parametrize("arch", ["qwen3", "deepseek2", "deepseek4", "qwen3next"])
def test_a_sweep_of_a_model_larger_than_its_budget_streams_with_the_same_rows(data_dir: Path, tmp_path: Path,
                                                                             arch: str) -> None:
    """Under a budget the decoded model does not fit, every candidate is layer-streamed from its first block."""
    import numpy as np

    from ikquant.types import type_by_name
    from ikrun.eval.evaluate import open_base, perplexity
    from ikrun.eval.stream import minimum_budget, plan_run
    from ikrun.model import Model
    from ikrun.sweep import run_sweep
    from ikrun.sweep.measure import sweep_groups
    from tests.test_stream import MODELS

    rows = {}
    for tight in (False, True):
        model = Model(data_dir / "convert" / MODELS[arch])
        chunks = np.random.default_rng(2).integers(0, model.n_vocab, size=(3, 32))
        perplexity(model, chunks, tmp_path / f"base{tight}.kld")
        base = open_base(tmp_path / f"base{tight}.kld", model)
        if tight:
            model.mem = minimum_budget(model, 32) + 64 * 1024
            assert plan_run(model, 3, 32, one_pass=False).streamed  # the decoded model does not fit
        groups = {g: n for g, n in sweep_groups(model, "tensor").items()
                  if all(model.weights.info(t).n_per_row % 32 == 0 for t in n)}
        got = run_sweep(model, base, groups, [type_by_name("Q4_0")], None, [], lambda r: None, spill_dir=tmp_path,
                        full_forward=not tight)
        rows[tight] = {r.group: (r.kld_mean, r.kld_p99, r.same_top_p) for r in got}
    assert rows[True] == rows[False]


@pytest.fixture(scope="module")
def narrow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 whose attn_output rows are 16 values wide: no 32-value block (Q4_0, IQ4_NL) holds them."""
    from ikconvert.convert import Converter

    folder = tmp_path_factory.mktemp("narrow")
    hf = make_tiny_checkpoint(folder / "hf", TinySpec(arch="qwen3", hidden=64, layers=2, heads=2, kv_heads=1,
                                                      head_dim=8, ffn=128, seed=5))
    return Converter(hf, "f32", "qwen2").write(folder / "narrow-f32.gguf")


def test_a_type_a_tensor_cannot_hold_takes_ik_fallback_and_the_sweep_goes_on(narrow_model: Path,
                                                                              tmp_path: Path) -> None:
    out = tmp_path / "sweep.csv"
    res = _sweep(narrow_model, out, "--types", "Q4_0,IQ4_KS,Q8_0", "--tensors", r"blk\.0\.(attn_output|ffn_down)")
    assert res.exit_code == 0, res.output
    from ikquant.sweepfile import read_sweep_file

    rows = {(r["group"], r["type"]): r for r in read_sweep_file(out)[1]}
    assert len(rows) == 6
    for qtype in ("Q4_0", "IQ4_KS"):  # 16 columns: no block fits, the tensor keeps its own encoding
        row = rows[("blk.0.attn_output.weight", qtype)]
        assert row["type_used"] == "F32" and row["bytes_new"] == row["bytes_base"]
        assert "16 columns cannot hold" in row["fallback"] and "kept as F32" in row["fallback"]
    down = rows[("blk.0.ffn_down.weight", "IQ4_KS")]  # 128 columns: ik's IQ4_KS -> IQ4_NL
    assert down["type_used"] == "IQ4_NL" and "falls back to IQ4_NL" in down["fallback"]
    assert rows[("blk.0.ffn_down.weight", "Q4_0")]["fallback"] is None
    mixed = tmp_path / "mix.gguf"
    res = runner.invoke(ikquant_app, [str(narrow_model), str(mixed), "--type", "q8_0", "--sweep", str(out),
                                      "--target-bpw", "8.75"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert GGUFFile(mixed).tensors["blk.0.attn_output.weight"].type.name == "F32"


def test_the_header_keeps_resolved_paths_for_a_mix_run_elsewhere(model256: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep given relative --text and --imatrix paths records them resolved: `ikrun mix` run from another
    directory finds both (a relative path there names another file, or none)."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir(), elsewhere.mkdir()
    (here / "text.txt").write_text(CORPUS.read_text(encoding="utf-8"), encoding="utf-8")
    monkeypatch.chdir(here)
    res = runner.invoke(app, ["imatrix", str(model256), "--text", "text.txt", "--ctx", "64", "--chunks", "2", "-o",
                              "imatrix.dat"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["sweep", str(model256), "--text", "text.txt", "--ctx", "64", "--chunks", "2", "-o",
                              str(tmp_path / "sweep.json"), "--types", "Q4_0,Q8_0", "--imatrix", "imatrix.dat",
                              "--tensors", "ffn_down"])
    assert res.exit_code == 0, res.output
    header = json.loads((tmp_path / "sweep.json").read_text())
    assert header["imatrix"] == str(here / "imatrix.dat") and header["text"] == str(here / "text.txt")
    monkeypatch.chdir(elsewhere)
    res = runner.invoke(app, ["mix", str(model256), "mix.gguf", "--sweep", str(tmp_path / "sweep.json"), "--type",
                              "Q8_0", "--target-bpw", "8", "--json"])
    assert res.exit_code == 0, res.output


def test_rows_are_written_as_they_come_while_rewriting_is_quick(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """RowSaver writes the file after a row unless the last rewrite was less than SAVE_EVERY of its own durations
    ago; flush writes what is pending, once; the file always holds whole rows."""
    from dataclasses import dataclass

    from ikrun.sweep import measure

    @dataclass
    class Row:
        group: str
        type: str

    out = tmp_path / "s.json"

    def written() -> list[str]:
        return [r["group"] for r in json.loads(out.read_text())["rows"]]

    monkeypatch.setattr(measure, "SAVE_EVERY", 0.0)
    saver = measure.RowSaver(out, {"metric": "kld"}, [Row("a", "Q4_0")])
    saver.add(Row("b", "Q4_0"))
    saver.add(Row("c", "Q4_0"))
    assert written() == ["a", "b", "c"]
    monkeypatch.setattr(measure, "SAVE_EVERY", 1e9)
    saver.add(Row("d", "Q4_0"))  # due at once: the last rewrite was under SAVE_EVERY = 0
    saver.add(Row("e", "Q4_0"))  # now due only after 1e9 rewrites' time
    assert written() == ["a", "b", "c", "d"]
    saver.flush()
    assert written() == ["a", "b", "c", "d", "e"] and [r.group for r in saver.rows] == written()
    out.write_text(json.dumps({"rows": []}))
    saver.flush()  # nothing pending: not written again
    assert written() == []
