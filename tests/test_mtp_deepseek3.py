"""DeepSeek-V3's MTP head, which ik neither converts nor runs: `ikconvert --keep-mtp` keeps the layer (ik's layout for
NextN blocks), its head's logits equal an independent float64 reference of DeepSeek's MTP module, and the target
drafts with it through its latent cache (`ikrun accept --mtp`) without changing its greedy output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.checkpoint import Checkpoint
from ikconvert.convert import Converter
from ikquant.gguf_io import GGUFFile
from ikrun.cli import app
from ikrun.eval.speculative import TargetDecoder, greedy_continuation, mtp_generate
from ikrun.model import Model
from ikrun.options import RuntimeOptions
from ikrun.validate.deepseek2 import DeepseekV3Reference
from tests.family_checks import assert_drafts_equal_the_reference_loop, assert_head_equals_reference

runner = CliRunner()
DATA = Path(__file__).parent / "data"
HF = DATA / "convert" / "deepseek-v3" / "hf"  # num_nextn_predict_layers 1: layer 3 is the MTP layer
IK_F32 = DATA / "convert" / "deepseek-v3" / "ik-f32.gguf"  # ik's converter: the MTP layer dropped
TEXT = DATA / "logits" / "deepseek-v3" / "text.txt"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Converter(HF, "f32", "deepseek-v3", arch_options={"keep_mtp": True}).write(
        tmp_path_factory.mktemp("ds-mtp") / "f32.gguf")


def test_keep_mtp_adds_the_layer_as_a_nextn_block_to_iks_conversion(gguf: Path) -> None:
    """Every tensor of ik's conversion with its bytes, plus block 3 (its decoder layer and nextn.*); block_count 4
    and nextn_predict_layers 1. Without --keep-mtp the conversion is ik's (test_convert_deepseek2)."""
    ours, ik = GGUFFile(gguf), GGUFFile(IK_F32)
    for name in ik.tensors:
        assert np.array_equal(ours.raw(name), ik.raw(name)), name
    extra = set(ours.tensors) - set(ik.tensors)
    assert all(n.startswith("blk.3.") for n in extra) and {
        "blk.3.nextn.eh_proj.weight", "blk.3.nextn.enorm.weight", "blk.3.nextn.hnorm.weight",
        "blk.3.nextn.embed_tokens.weight", "blk.3.nextn.shared_head_head.weight", "blk.3.nextn.shared_head_norm.weight",
        "blk.3.attn_kv_b.weight", "blk.3.attn_k_b.weight", "blk.3.ffn_up_exps.weight"} <= extra
    assert ours.get("deepseek2.block_count") == 4 and ours.get("deepseek2.nextn_predict_layers") == 1
    assert ik.get("deepseek2.block_count") == 3 and ik.get("deepseek2.nextn_predict_layers") is None


def test_mtp_head_equals_the_float64_reference_whole_and_continued(gguf: Path) -> None:
    """The head over 20 positions (the target's output-normed hidden rows shifted by one) against DeepSeek's MTP
    module in float64 from the checkpoint; the same positions run 8 + 1 + 1 + ... through its latent cache."""
    model = Model(gguf)
    tokens = np.random.default_rng(3).integers(0, 320, 20)
    ckpt = Checkpoint(HF)
    reference = DeepseekV3Reference(ckpt.config, dict(ckpt.iter_tensors()), np.float64)
    assert_head_equals_reference(model, tokens, lambda hidden: reference.mtp_logits(hidden, tokens), 2e-6)


@pytest.mark.parametrize("mla", ["decode", "prefill"])
def test_the_target_continues_through_its_latent_cache(gguf: Path, mla: str) -> None:
    """20 positions fed 8 + 1 + 1 + ... give the logits of one whole forward, in either MLA form."""
    model = Model(gguf, options=RuntimeOptions(mla=mla))
    tokens = np.random.default_rng(5).integers(0, 320, 20)
    whole, _ = TargetDecoder(model, []).run(tokens)
    dec = TargetDecoder(model, [])
    parts = [dec.run(tokens[:8])[0]] + [dec.run(tokens[i : i + 1])[0] for i in range(8, 20)]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=0, atol=2e-6 * np.abs(whole).max())


@pytest.mark.parametrize("n_max", [1, 3])
def test_mtp_speculation_gives_the_targets_greedy_continuation(gguf: Path, n_max: int) -> None:
    model = Model(gguf)
    prompt = np.random.default_rng(n_max).integers(0, 320, 12)
    run = mtp_generate(model, prompt, 24, n_max)
    assert run.output_ids == greedy_continuation(model, prompt, 24)
    assert set(run.draft_lengths) == {n_max}


def test_accept_mtp_on_deepseek_and_iks_file_without_the_layer(gguf: Path) -> None:
    res = runner.invoke(app, ["accept", str(gguf), "--mtp", "--text", str(TEXT), "--prompts", "2", "--prompt-len",
                              "8", "--max-new", "12", "--json"])
    assert res.exit_code == 0, res.output
    assert '"output_matches_target": true' in res.output
    res = runner.invoke(app, ["accept", str(IK_F32), "--mtp", "--text", str(TEXT)], env={"COLUMNS": "400"})
    assert res.exit_code == 2 and "--keep-mtp" in res.output and len(res.output.strip().splitlines()) == 1


def test_ik_arithmetic_continues_the_latent_cache_bit_for_bit() -> None:
    """`--numerics ik` (ik's attention kernel over the cache rows, earlier positions first) on ik's Q8_0 file: the
    continued logits are the whole forward's, bit for bit."""
    model = Model(DATA / "convert" / "deepseek-v3" / "ik-q8_0.gguf", options=RuntimeOptions(numerics="ik"))
    tokens = np.random.default_rng(5).integers(0, 320, 20)
    whole, _ = TargetDecoder(model, []).run(tokens)
    dec = TargetDecoder(model, [])
    parts = [dec.run(tokens[:8])[0]] + [dec.run(tokens[i : i + 1])[0] for i in range(8, 20)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_keep_mtp_refused_where_it_does_not_apply(tmp_path: Path) -> None:
    import json

    from ikconvert.cli import app as ikconvert_app

    no_mtp = tmp_path / "no-mtp"  # DeepSeek-V3 without an MTP layer
    no_mtp.mkdir()
    for f in HF.iterdir():
        (no_mtp / f.name).symlink_to(f)
    (no_mtp / "config.json").unlink()
    (no_mtp / "config.json").write_text(json.dumps({**json.loads((HF / "config.json").read_text()),
                                                    "num_nextn_predict_layers": 0}))
    for hf, said in ((DATA / "convert" / "qwen3" / "hf", "--keep-mtp does not apply"),
                     (DATA / "convert" / "glm-dsa" / "hf", "--keep-mtp does not apply"),
                     (no_mtp, "num_nextn_predict_layers is 0")):
        res = runner.invoke(ikconvert_app, ["hf2gguf", str(hf), "--keep-mtp", "--outfile", str(tmp_path / "x.gguf")],
                            env={"COLUMNS": "400"})
        assert res.exit_code == 2 and said in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "x.gguf").exists()


TRAINED = DATA / "mtp" / "deepseek-v3-trained"


def test_a_trained_heads_acceptance_equals_the_reference_loop_at_every_step(tmp_path: Path) -> None:
    """tools/make_mtp_head.py's torch loop (transformers' DeepseekV3 layers, whole-sequence forwards, no caches) on
    a head trained there: ikrun drafts, accepts and outputs the same at every step of all 6 prompts; an acceptance
    sweep of the head measures what `accept --mtp --compare` does for the whole head at a type."""
    import json

    gguf = Converter(TRAINED / "hf", "f32", "deepseek-v3", arch_options={"keep_mtp": True}).write(tmp_path / "t.gguf")
    oracle = json.loads((TRAINED / "mtp-oracle.json").read_text())
    model = Model(gguf)
    assert_drafts_equal_the_reference_loop(model, oracle)
    decoding = ["--text", str(TEXT), "--prompts", "2", "--prompt-len", "16", "--max-new", "24"]
    res = runner.invoke(app, ["sweep", str(gguf), "--metric", "acceptance", "--mtp", *decoding, "--types", "Q4_0",
                              "--group", "layer", "-o", str(tmp_path / "head.json")])
    assert res.exit_code == 0, res.output
    row = json.loads((tmp_path / "head.json").read_text())["rows"][0]
    res = runner.invoke(app, ["accept", str(gguf), "--mtp", *decoding, "--compare", "Q4_0", "--json", "--no-check"])
    assert res.exit_code == 0, res.output
    assert row["group"] == "blk.3" and row["acceptance_mean"] == json.loads(res.stdout)[1]["mean_acceptance_length"]
