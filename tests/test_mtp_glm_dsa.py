"""GLM-5's NextN/MTP head (`glm-dsa`): a full sparse-attention layer with its own lightning indexer. Its logits equal
a float64 reference of the checkpoint's MTP layer whole and continued; the target continues through its latent and
indexer key caches; `--numerics ik` runs the head's attention dense, as ik's MTP graph does; greedy speculation
with it gives the target's own continuation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.checkpoint import Checkpoint
from ikconvert.convert import Converter
from ikrun.cli import app
from ikrun.eval.speculative import NextnDecoder, TargetDecoder, greedy_continuation, mtp_generate, previous_states
from ikrun.model import Model
from ikrun.options import RuntimeOptions
from ikrun.validate.glm_dsa import GlmDsaReference
from tests.family_checks import assert_drafts_equal_the_reference_loop, assert_head_equals_reference
from tests.test_runtime_deepseek2 import _rewrite

runner = CliRunner()
DATA = Path(__file__).parent / "data"
HF = DATA / "convert" / "glm-dsa" / "hf"  # 7 layers and the NextN layer 7, each with an indexer (top-k 16)
GGUF = DATA / "convert" / "glm-dsa" / "ref-f32.gguf"  # attn_k_b / attn_v_b 3-D, as ik's converter writes them
TEXT = DATA / "logits" / "glm-dsa" / "text.txt"
#: 40 positions: past the indexer's top-k of 16, so that most queries of every layer and the head select
N_TOKENS = 40


def _tokens(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 320, N_TOKENS)


def test_head_equals_the_float64_reference_whole_and_continued() -> None:
    """The head (sparse through blk.7's own indexer) against the checkpoint's MTP layer in float64, with GLM-5's
    own embedding and lm_head (the layer has none); measured 6.1e-6 of the largest logit."""
    ckpt = Checkpoint(HF)
    reference = GlmDsaReference(ckpt.config, dict(ckpt.iter_tensors()), np.float64)
    tokens = _tokens(3)
    assert_head_equals_reference(Model(GGUF), tokens, lambda hidden: reference.mtp_logits(hidden, tokens), 1e-5)


@pytest.mark.parametrize("mla", ["decode", "prefill"])
def test_the_target_continues_through_its_latent_and_indexer_caches(mla: str) -> None:
    """40 positions fed 8 + 1 + 1 + ...: each query selects among every cached indexer key and attends to the kept
    latent rows, giving the logits of one whole forward (measured within 3.1e-6 of the largest logit)."""
    model = Model(GGUF, options=RuntimeOptions(mla=mla))
    tokens = _tokens(5)
    whole, _ = TargetDecoder(model, []).run(tokens)
    dec = TargetDecoder(model, [])
    parts = [dec.run(tokens[:8])[0]] + [dec.run(tokens[i : i + 1])[0] for i in range(8, N_TOKENS)]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=0, atol=5e-6 * np.abs(whole).max())


def test_numerics_ik_runs_the_heads_attention_dense() -> None:
    """ik's MTP graph turns DSA off for the head: under `--numerics ik` the head's logits are the dense head's
    (the exact arithmetic with --dsa off, within ik's float order), far from the sparse one's, and continue through its cache bit for bit."""
    target = Model(GGUF)
    tokens = _tokens(3)
    _, features = TargetDecoder(target, [target.impl.n_active - 1]).run(tokens)
    hidden = previous_states(features)
    sparse = NextnDecoder(target).run(hidden, tokens)[1]
    dense = NextnDecoder(Model(GGUF, options=RuntimeOptions(dsa=False))).run(hidden, tokens)[1]
    ik_model = Model(GGUF, options=RuntimeOptions(numerics="ik"))
    ik = NextnDecoder(ik_model).run(hidden, tokens)[1]
    scale = np.abs(dense).max()
    assert np.abs(ik - dense).max() < 1e-3 * scale  # ik's arithmetic: measured 1.5e-4
    assert np.abs(sparse - dense).max() > 0.1 * scale  # measured 0.6
    dec = NextnDecoder(ik_model)
    parts = [dec.run(hidden[:8], tokens[:8])[1]] + [dec.run(hidden[i : i + 1], tokens[i : i + 1])[1]
                                                     for i in range(8, N_TOKENS)]
    np.testing.assert_array_equal(np.concatenate(parts), ik)


@pytest.mark.parametrize("numerics", ["exact", "ik"])
def test_mtp_speculation_gives_the_targets_greedy_continuation(numerics: str) -> None:
    model = Model(GGUF, options=RuntimeOptions(numerics=numerics))
    prompt = _tokens(7)[:20]
    run = mtp_generate(model, prompt, 24, 3)
    assert run.output_ids == greedy_continuation(model, prompt, 24)
    assert set(run.draft_lengths) == {3}


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    """--mtp on a glm-dsa file without the NextN block, and a sparse head without its indexer (which --dsa off runs
    dense): one line naming the fact, exit 2."""
    head = tuple(f"blk.7.{n}" for n in ("indexer.attn_q_b.weight", "indexer.attn_k.weight", "indexer.k_norm.weight",
                                         "indexer.k_norm.bias", "indexer.proj.weight"))
    no_indexer = _rewrite(GGUF, tmp_path / "noidx.gguf", drop=head)
    no_head = _rewrite(GGUF, tmp_path / "nohead.gguf", kv={"glm-dsa.block_count": 7, "glm-dsa.nextn_predict_layers": 0},
                       drop=tuple(n for n in Model(GGUF).weights.names() if n.startswith("blk.7.")))
    decoding = ["--text", str(TEXT), "--prompts", "1", "--prompt-len", "8", "--max-new", "8", "--mem", "4GiB"]
    for gguf, said in ((no_head, "nextn_predict_layers is 0"), (no_indexer, "blk.7.indexer.attn_q_b.weight")):
        res = runner.invoke(app, ["accept", str(gguf), "--mtp", *decoding], env={"COLUMNS": "400"})
        assert res.exit_code == 2 and said in res.output and len(res.output.strip().splitlines()) == 1, res.output
        assert "--keep-mtp" not in res.output  # DeepSeek-V3's converter option: GLM-5's keeps the layer anyway
    res = runner.invoke(app, ["accept", str(no_indexer), "--mtp", "--dsa", "off", *decoding, "--json"])
    assert res.exit_code == 0 and '"output_matches_target": true' in res.output, res.output


TRAINED = DATA / "mtp" / "glm-dsa-trained"  # tools/make_mtp_head.py on the target above (README there)
#: `accept --mtp --compare` by the head block's type: mean acceptance on the oracle's 6 prompts (F32 as stored: 2.617)
BY_TYPE = {"Q8_0": 2.628, "Q4_0": 2.553, "IQ4_NL": 2.462}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:  # type: ignore[type-arg]
    gguf = Converter(TRAINED / "hf", "f32", "glm4").write(tmp_path_factory.mktemp("glm-dsa-mtp") / "f32.gguf")
    return gguf, json.loads((TRAINED / "mtp-oracle.json").read_text())


def test_a_trained_heads_acceptance_equals_the_reference_loop_at_every_step(trained: tuple[Path, dict]) -> None:  # type: ignore[type-arg]
    """tools/make_mtp_head.py's torch loop (transformers' DeepseekV3 layers under the indexers' masks, whole-sequence
    forwards, no caches): ikrun drafts, accepts and outputs the same at every step of all 6 prompts, the head
    sparse through its own indexer and the target through its latent and indexer caches."""
    gguf, oracle = trained
    assert_drafts_equal_the_reference_loop(Model(gguf), oracle)


def test_acceptance_by_the_heads_type(trained: tuple[Path, dict]) -> None:  # type: ignore[type-arg]
    """`accept --mtp --compare` on the oracle's prompts: the stored head's figure is the torch loop's, and each type's
    is the table's in the README (tests/data/mtp/glm-dsa-trained/README.md)."""
    gguf, oracle = trained
    res = runner.invoke(app, ["accept", str(gguf), "--mtp", "--text", str(TEXT), "--prompts", "6", "--prompt-len",
                              "24", "--max-new", "64", "--compare", ",".join(BY_TYPE), "--json", "--no-check"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert rows[0]["mean_acceptance_length"] == oracle["mean_acceptance_length"]
    assert {t: round(r["mean_acceptance_length"], 3) for t, r in zip(BY_TYPE, rows[1:])} == BY_TYPE


def test_imatrix_mtp_collects_the_heads_tensors_its_indexer_included(tmp_path: Path) -> None:
    """`imatrix --mtp` runs the head at every position of each chunk: its entries are added (the indexer's among
    them, as the head runs it sparse), the main model's stay as without --mtp."""
    from ikquant.imatrix import read_imatrix_dat

    outs = {}
    for name, extra in (("main", []), ("mtp", ["--mtp"])):
        res = runner.invoke(app, ["imatrix", str(GGUF), "--text", str(TEXT), "--ctx", "64", "--chunks", "4", "-o",
                                  str(tmp_path / f"{name}.dat"), *extra])
        assert res.exit_code == 0, res.output
        outs[name] = read_imatrix_dat(tmp_path / f"{name}.dat").entries
    added = set(outs["mtp"]) - set(outs["main"])
    assert set(outs["main"]) <= set(outs["mtp"]) and all(n.startswith("blk.7.") for n in added)
    assert {"blk.7.nextn.eh_proj.weight", "blk.7.indexer.attn_q_b.weight", "blk.7.indexer.attn_k.weight",
            "blk.7.indexer.proj.weight", "blk.7.attn_k_b.weight", "blk.7.ffn_up_exps.weight"} <= added
    for name, entry in outs["main"].items():
        np.testing.assert_array_equal(outs["mtp"][name].mean_sq(), entry.mean_sq())
