"""DFlash drafts of every shape against the reference implementation: pairs trained on the shared tiny Qwen3
target, each differing from the shared pair in one way (target layer 0 among the features, a one-layer draft,
blocks of 8, 3 query heads per key/value head, rope theta 5e5), one with all of them at once (the target under
rope theta 5e5 too), gpt-oss and Qwen3-MoE targets whose last layer is a feature, and a draft with MiMo-V2.5-Pro's
attention (sinks, value scale, backbone rope base, partial rotary); every step's acceptance length and every token
equal z-lab/dflash's `dflash_generate` (tools/make_dflash_pair.py made them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikrun.cli import app

DATA = Path(__file__).parent / "data" / "dflash"
SHAPES = DATA / "shapes"
QWEN3_TARGET = DATA / "dflash-qwen3-trained" / "target"
TEXT = Path(__file__).parent / "data" / "logits" / "qwen3" / "text.txt"
runner = CliRunner()


def _target_dir(shape: Path, tmp: Path) -> Path:
    """The shape's target folder: its own, else the shared Qwen3 target, under the shape's own config where it has
    one."""
    if (shape / "target").is_dir():
        return shape / "target"
    if not (shape / "target-config.json").is_file():
        return QWEN3_TARGET
    folder = tmp / "target"
    shutil.copytree(QWEN3_TARGET, folder)
    shutil.copy(shape / "target-config.json", folder / "config.json")
    return folder


def _pair(shape: Path, tmp: Path) -> tuple[Path, Path]:
    from ikconvert.convert import Converter

    target_dir = _target_dir(shape, tmp)
    target = Converter(target_dir, "f32", "qwen2").write(tmp / "target.gguf")
    draft = Converter(shape / "hf", "f32", "qwen2", arch_options={"target_model_dir": str(target_dir)}).write(
        tmp / "draft.gguf")
    return target, draft


@pytest.mark.parametrize("name", ["layer0", "onelayer", "block8", "gqa3", "rope5e5", "issue", "gptoss",
                                  "qwen3moe", "mimo"])
def test_every_step_equals_the_reference(name: str, tmp_path: Path) -> None:
    from ikrun.eval.speculative import speculative_generate
    from ikrun.model import Model

    shape = SHAPES / name
    oracle = json.loads((shape / "dflash-oracle.json").read_text())
    target, draft = (Model(p) for p in _pair(shape, tmp_path))
    assert draft.impl.block_size == oracle["block_size"]
    assert draft.impl.target_layer_ids == oracle["target_layer_ids"]
    assert oracle["mean_acceptance_length"] > 1.2  # the draft drafts: the steps below test more than the target
    for p, ref in enumerate(oracle["runs"]):
        run = speculative_generate(target, draft, np.array(ref["prompt"]), oracle["max_new_tokens"])
        assert run.acceptance_lengths == ref["acceptance_lengths"], p
        assert run.output_ids == ref["output_ids"], p


def test_accept_names_the_first_step_and_layer_that_differ(tmp_path: Path) -> None:
    """--oracle finds where acceptance leaves a reference run, --trace which draft layer leaves the draft's
    definition: a reference run whose draft rope went through bf16 differs at prompt 1 step 20 while every layer
    agrees with the file's definition; the definition under another rope theta differs from step 0, layer 0."""
    shape = SHAPES / "layer0"
    target, draft = _pair(shape, tmp_path)
    base = ["accept", str(target), str(draft), "--text", str(TEXT), "--json"]
    res = runner.invoke(app, [*base, "--oracle", str(shape / "dflash-oracle.json"), "--trace", str(shape / "hf")])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["oracle_first_difference"] is None
    assert [t["first_divergence"] for t in got["trace"]] == [None] * 6
    other = tmp_path / "hf"
    shutil.copytree(shape / "hf", other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "rope_theta": 5e5}))
    res = runner.invoke(app, [*base, "--prompts", "6", "--oracle", str(shape / "dflash-oracle-bf16-rope.json"),
                              "--trace", str(other)])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["oracle_first_difference"] == {"prompt": 1, "step": 20}
    assert all(t["first_divergence"]["step"] == 0 and t["first_divergence"]["layer"] == 0 for t in got["trace"])
    res = runner.invoke(app, [*base, "--prompts", "2", "--oracle", str(shape / "dflash-oracle.json")])
    assert res.exit_code == 2 and "its prompt 1 is not prompt 1 cut from --text" in res.output
    res = runner.invoke(app, [*base, "--trace", str(tmp_path)])
    assert res.exit_code == 2 and "not a Hugging Face draft folder" in res.output


def test_a_rope_parameters_config_keeps_its_rope_theta(tmp_path: Path) -> None:
    """The rope5e5 draft with rope_theta only inside `rope_parameters` (transformers 5's layout): its file is the
    transformers-4 config's byte for byte (rope.freq_base 5e5, where ik's converter writes none and ik's runtime
    would rope at 10000), every step's acceptance is the reference's, and the independent reference reads the same
    theta (--trace: no layer differs)."""
    from ikconvert.convert import Converter

    shape = SHAPES / "rope5e5"
    target, draft = _pair(shape, tmp_path)
    v5 = tmp_path / "v5" / "hf"
    shutil.copytree(shape / "hf", v5)
    cfg = json.loads((v5 / "config.json").read_text())
    theta = cfg.pop("rope_theta")
    del cfg["rope_scaling"]
    (v5 / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_theta": theta,
                                                                           "rope_type": "default"}}))
    draft5 = Converter(v5, "f32", "qwen2", arch_options={"target_model_dir": str(QWEN3_TARGET)}).write(
        tmp_path / "draft5.gguf")
    assert draft5.read_bytes() == draft.read_bytes()
    res = runner.invoke(app, ["accept", str(target), str(draft5), "--text", str(TEXT), "--json", "--oracle",
                              str(shape / "dflash-oracle.json"), "--trace", str(v5)])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    oracle = json.loads((shape / "dflash-oracle.json").read_text())
    assert got["oracle_first_difference"] is None
    assert [r["acceptance_lengths"] for r in got["runs"]] == [r["acceptance_lengths"] for r in oracle["runs"]]
    assert [t["first_divergence"] for t in got["trace"]] == [None] * 6


def _draft_variant(tmp: Path, name: str, **dflash_config: object) -> Path:
    """The layer0 draft converted with its dflash_config changed."""
    from ikconvert.convert import Converter

    folder = tmp / name
    shutil.copytree(SHAPES / "layer0" / "hf", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dflash_config"] = {**cfg["dflash_config"], **dflash_config}
    (folder / "config.json").write_text(json.dumps(cfg))
    return Converter(folder, "f32", "qwen2", arch_options={"target_model_dir": str(QWEN3_TARGET)}).write(
        tmp / f"{name}.gguf")


def test_drafts_that_do_not_fit_the_target_are_refused_before_compute(tmp_path: Path) -> None:
    from ikconvert.convert import Converter
    from ikconvert.tiny import TinySpec, make_tiny_checkpoint

    target, draft = _pair(SHAPES / "layer0", tmp_path)
    gpt_oss = Converter(SHAPES / "gptoss" / "target", "f32", "qwen2").write(tmp_path / "gpt-oss.gguf")

    def refused(t: Path, d: Path) -> str:
        res = runner.invoke(app, ["accept", str(t), str(d), "--text", str(TEXT)])
        assert res.exit_code == 2, res.output
        assert sum(line.startswith("error:") for line in res.output.splitlines()) == 1, res.output
        return res.output

    assert "dflash-draft.dflash.target_layer_ids: target layer 2 is not a block of" in refused(gpt_oss, draft)
    narrow = Converter(make_tiny_checkpoint(tmp_path / "narrow", TinySpec(arch="qwen3", hidden=32, layers=4, heads=2,
                                                                          kv_heads=1, head_dim=16, ffn=64)),
                       "f32", "qwen2").write(tmp_path / "narrow.gguf")
    four = _draft_variant(tmp_path, "four", target_layer_ids=[0, 1, 2, 3], n_target_features=128)
    assert "dflash-draft.embedding_length: the draft's hidden size 64 is not the target's 32" in refused(narrow, four)
    masked = _draft_variant(tmp_path, "mask", mask_token_id=999)
    assert "dflash-draft.dflash.mask_token_id: mask token 999 is not in" in refused(target, masked)
    flash = Path(__file__).parent / "data" / "convert" / "deepseek-v4-flash" / "ref-f32.gguf"
    assert "gives no hidden-state output to serve as a DFlash target" in refused(flash, draft)
