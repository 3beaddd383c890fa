"""DFlash drafts in the runtime: greedy speculative decoding against the reference implementation's oracle
(output ids, acceptance lengths, draft logits per step), layer by layer against an independent reference, and
`ikrun accept`."""

from __future__ import annotations

import json
from pathlib import Path

import numba
import numpy as np
import pytest
from typer.testing import CliRunner

from ikrun.cli import app

runner = CliRunner()
GOLD = Path(__file__).parent / "data" / "dflash" / "dflash-qwen3-trained"
TEXT = Path(__file__).parent / "data" / "logits" / "qwen3" / "text.txt"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from ikconvert.convert import Converter

    folder = tmp_path_factory.mktemp("dflash")
    target = Converter(GOLD / "target", "f32", "qwen2").write(folder / "target.gguf")
    draft = Converter(GOLD / "hf", "f32", "qwen2", arch_options={"target_model_dir": str(GOLD / "target")}).write(
        folder / "draft.gguf")
    return target, draft


@pytest.fixture(scope="module")
def oracle() -> dict:  # type: ignore[type-arg]
    return json.loads((GOLD / "dflash-oracle.json").read_text())


def test_speculative_decoding_reproduces_the_reference(pair: tuple[Path, Path], oracle: dict) -> None:  # type: ignore[type-arg]
    from ikrun.eval.speculative import greedy_continuation, speculative_generate
    from ikrun.model import Model

    target, draft = Model(pair[0]), Model(pair[1])
    logits = np.load(GOLD / "dflash-draft-logits.npz")
    for p, ref in enumerate(oracle["runs"]):
        run = speculative_generate(target, draft, np.array(ref["prompt"]), oracle["max_new_tokens"], keep_logits=True)
        assert run.output_ids == ref["output_ids"], p
        assert run.acceptance_lengths == ref["acceptance_lengths"], p
        assert len(run.draft_logits) == len(ref["acceptance_lengths"])
        assert 0 < run.decode_seconds < run.seconds  # decode only: the prompt's forward is left out
        for k, got in enumerate(run.draft_logits):
            assert np.abs(got - logits[f"p{p}_step{k}"]).max() < 1e-4, (p, k)
        if p == 0:  # speculation never changes the greedy output
            assert greedy_continuation(target, np.array(ref["prompt"]), oracle["max_new_tokens"]) == ref["output_ids"]


def test_draft_layers_match_the_independent_reference(pair: tuple[Path, Path], oracle: dict) -> None:  # type: ignore[type-arg]
    from ikrun.eval.speculative import TargetDecoder
    from ikrun.model import Model
    from ikrun.models.dflash import DraftContext
    from ikrun.validate.dflash import DFlashReference, target_embeddings

    target, draft = Model(pair[0]), Model(pair[1])
    d = draft.impl
    prompt = np.array(oracle["runs"][0]["prompt"])
    logits, features = TargetDecoder(target, d.target_layer_ids).run(prompt)
    block = np.full(d.block_size, d.mask_token_id)
    block[0] = int(np.argmax(logits[-1]))
    ctx = DraftContext()
    d.extend_context(ctx, features)
    layers: list[np.ndarray] = []
    out = d.draft(ctx, target.ctx.embed_rows("token_embd.weight", block), lambda i, x: layers.append(x.copy()))
    ref = DFlashReference(GOLD / "hf").forward(features, target_embeddings(GOLD / "target")[0][block])
    for i, (ours, theirs) in enumerate(zip([*layers, out], ref)):
        assert np.abs(ours - theirs).max() < 1e-4, f"draft layer {i} differs first"
    first = np.load(GOLD / "dflash-draft-logits.npz")["p0_step0"]
    assert np.abs(target.impl.output_projection(out) - first).max() < 1e-4


def test_a_draft_with_biases_matches_the_reference(tmp_path: Path) -> None:
    """The gpt-oss-style draft (attention biases, three target layers, 8 heads over 2): no trained target, so the
    draft runs on random target features and block embeddings."""
    from ikconvert.convert import Converter
    from ikrun.model import Model
    from ikrun.models.dflash import DraftContext
    from ikrun.validate.dflash import DFlashReference

    src = Path(__file__).parent / "data" / "convert" / "dflash-gptoss"
    path = Converter(src / "hf", "f32", "qwen2", arch_options={"target_model_dir": str(src / "target")}).write(
        tmp_path / "draft.gguf")
    d = Model(path).impl
    rng = np.random.default_rng(0)
    features = rng.standard_normal((20, d.n_target_features)).astype(np.float32)
    block = rng.standard_normal((d.block_size, d.n_embd)).astype(np.float32)
    ctx = DraftContext()
    d.extend_context(ctx, features[:13])  # the context grows over two steps, as in decoding
    d.extend_context(ctx, features[13:])
    layers: list[np.ndarray] = []
    out = d.draft(ctx, block, lambda i, x: layers.append(x.copy()))
    for i, (ours, theirs) in enumerate(zip([*layers, out], DFlashReference(src / "hf").forward(features, block))):
        assert np.abs(ours - theirs).max() < 1e-4, f"draft layer {i} differs first"


def test_a_mimo_style_draft_matches_the_reference(tmp_path: Path) -> None:
    """The shared draft with MiMo's additions (sink logits per head, values scaled by 0.5, the context's keys roped
    at a backbone base of 2.5e5, rope over half of each head): the runtime's layers equal the independent reference's
    on random target features and block embeddings; without the additions the draft computes something else. An
    attention gate (ik's graph gates Laguna drafts only) is refused."""
    from ikconvert.convert import Converter
    from ikconvert.safetensors_io import SafetensorsFile, write_safetensors
    from ikrun.model import Model
    from ikrun.models.dflash import DraftContext
    from ikrun.validate.dflash import DFlashReference

    folder = tmp_path / "mimo"
    folder.mkdir()
    tensors = {n: ("F32", t.to_f32()) for n, t in SafetensorsFile(GOLD / "hf" / "model.safetensors").tensors.items()}
    rng = np.random.default_rng(5)
    for i in range(2):
        tensors[f"layers.{i}.self_attn.attention_sink_bias"] = ("F32", rng.normal(0, 2, 4).astype(np.float32))
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    cfg = json.loads((GOLD / "hf" / "config.json").read_text())
    cfg["partial_rotary_factor"] = 0.5
    cfg["dflash_config"] = {**cfg["dflash_config"], "backbone_rotary_base": 250000.0, "attention_value_scale": 0.5}
    (folder / "config.json").write_text(json.dumps(cfg))
    path = Converter(folder, "f32", "qwen2", arch_options={"target_model_dir": str(GOLD / "target")}).write(
        tmp_path / "mimo.gguf")
    d = Model(path).impl
    assert (d.n_rot, d.value_scale, d.context_rope_base) == (16, 0.5, 250000.0)
    features = rng.standard_normal((20, d.n_target_features)).astype(np.float32)
    block = rng.standard_normal((d.block_size, d.n_embd)).astype(np.float32)
    ctx = DraftContext()
    d.extend_context(ctx, features[:13])
    d.extend_context(ctx, features[13:])
    layers: list[np.ndarray] = []
    out = d.draft(ctx, block, lambda i, x: layers.append(x.copy()))
    for i, (ours, theirs) in enumerate(zip([*layers, out], DFlashReference(folder).forward(features, block))):
        assert np.abs(ours - theirs).max() < 1e-4, f"draft layer {i} differs first"
    plain = DFlashReference(GOLD / "hf").forward(features, block)[-1]
    assert np.abs(out - plain).max() > 0.1
    tensors["layers.0.self_attn.g_proj.weight"] = ("F32", rng.standard_normal((4, 64)).astype(np.float32))
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    gated = Converter(folder, "f32", "qwen2", arch_options={"target_model_dir": str(GOLD / "target")}).write(
        tmp_path / "gated.gguf")
    target = Converter(GOLD / "target", "f32", "qwen2").write(tmp_path / "target.gguf")
    res = runner.invoke(app, ["accept", str(target), str(gated), "--text", str(TEXT)])
    assert res.exit_code == 2 and "attn_gate tensors are not supported" in res.output, res.output


def test_ikrun_accept_prints_the_reference_acceptance(pair: tuple[Path, Path], oracle: dict) -> None:  # type: ignore[type-arg]
    res = runner.invoke(app, ["accept", str(pair[0]), str(pair[1]), "--text", str(TEXT), "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["mean_acceptance_length"] == pytest.approx(oracle["mean_acceptance_length"], rel=1e-12)
    assert [r["prompt"] for r in got["runs"]] == [r["prompt"] for r in oracle["runs"]]
    assert [r["acceptance_lengths"] for r in got["runs"]] == [r["acceptance_lengths"] for r in oracle["runs"]]
    assert got["output_matches_target"] is True
    assert len(got["acceptance_by_position"]) == 15 and got["acceptance_by_position"][0] > 0.9


def _spec_bench_figures(run: dict) -> dict:  # type: ignore[type-arg]
    """One `ikrun accept --json` run in the terms of ik's llama-spec-bench dflash stage."""
    accepted = [a - 1 for a in run["acceptance_lengths"]]
    drafted = run["draft_lengths"]
    return {"drafts": len(accepted), "draft_tokens": sum(drafted), "accepted": sum(accepted),
            "drafted_by_position": [sum(1 for n in drafted if n > j) for j in range(15)],
            "accepted_by_position": [sum(1 for n in accepted if n > j) for j in range(15)]}


def test_ik_spec_bench_acceptance_reproduced_with_the_switches(pair: tuple[Path, Path], oracle: dict) -> None:  # type: ignore[type-arg]
    """ik's llama-spec-bench (cross_ctx 128) on the same prompts: with ik's late feature positions and its draft
    budget every prompt's drafts, accepted tokens and both by-position counts are ik's; either switch alone is not."""
    from ikrun.model import Model

    rows = [json.loads(line) for line in (GOLD / "ik-spec-bench.jsonl").read_text().splitlines()]
    tok = Model(pair[0]).tokenizer()
    assert [tok.encode(r["prompt_text"], add_special=True) for r in rows] == [r["prompt"] for r in oracle["runs"]]
    want = [{k: r["stages"][0][k] for k in ("drafts", "draft_tokens", "accepted", "drafted_by_position",
                                            "accepted_by_position")} for r in rows]
    base = ["accept", str(pair[0]), str(pair[1]), "--text", str(TEXT), "--json", "--cross-ctx", "128"]
    res = runner.invoke(app, [*base, "--late-feature-positions", "--budget-drafts"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert [_spec_bench_figures(r) for r in got["runs"]] == want
    assert [r["output_ids"] for r in got["runs"]] == [r["output_ids"] for r in oracle["runs"]]
    for switch in ("--late-feature-positions", "--budget-drafts"):
        alone = json.loads(runner.invoke(app, [*base, switch]).stdout)
        assert [_spec_bench_figures(r) for r in alone["runs"]] != want, switch


def test_cross_ctx_attends_to_the_newest_positions_only(pair: tuple[Path, Path]) -> None:
    """A draft context limited to N rows holds the newest N rows of the whole context (keys roped at their own
    positions) and drafts what they draft, a different block than the whole context does."""
    from ikrun.model import Model
    from ikrun.models.dflash import DraftContext

    d = Model(pair[1]).impl
    rng = np.random.default_rng(3)
    features = rng.standard_normal((40, d.n_target_features)).astype(np.float32)
    block = rng.standard_normal((d.block_size, d.n_embd)).astype(np.float32)
    limited, whole = DraftContext(limit=16), DraftContext()
    for part in (features[:30], features[30:]):
        d.extend_context(limited, part)
        d.extend_context(whole, part)
    newest = DraftContext([k[-16:] for k in whole.k], [v[-16:] for v in whole.v], whole.positions[-16:])
    assert limited.positions.tolist() == list(range(24, 40))
    assert np.array_equal(d.draft(limited, block), d.draft(newest, block))
    assert not np.allclose(d.draft(limited, block), d.draft(whole, block))
    res = runner.invoke(app, ["accept", str(pair[0]), str(pair[1]), "--text", str(TEXT), "--cross-ctx", "8"])
    assert res.exit_code == 2 and "--cross-ctx 8: below the block size 16" in res.output
    assert sum(line.startswith("error:") for line in res.output.splitlines()) == 1
    res = runner.invoke(app, ["accept", str(pair[0]), str(pair[1]), "--text", str(TEXT), "--late-feature-positions",
                              "--trace", str(GOLD / "hf")])
    assert res.exit_code == 2 and "--trace compares" in res.output


def test_quantized_drafts_are_compared(pair: tuple[Path, Path]) -> None:
    res = runner.invoke(app, ["accept", str(pair[0]), str(pair[1]), "--text", str(TEXT), "--prompts", "2",
                              "--max-new", "32", "--compare", "Q8_0,Q4_0", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert [r["draft"] for r in rows] == ["as stored", "Q8_0", "Q4_0"]
    assert rows[0]["draft_bytes"] > rows[1]["draft_bytes"] > rows[2]["draft_bytes"]
    assert all(r["output_matches_target"] for r in rows)
    assert rows[1]["mean_acceptance_length"] > 4  # a working draft still drafts once quantized


def test_deterministic_at_any_thread_count(pair: tuple[Path, Path], oracle: dict) -> None:  # type: ignore[type-arg]
    from ikrun.eval.speculative import speculative_generate
    from ikrun.model import Model

    runs = []
    for threads in (1, 2):
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        target, draft = Model(pair[0], threads=threads), Model(pair[1], threads=threads)
        runs.append(speculative_generate(target, draft, np.array(oracle["runs"][1]["prompt"]), 48, keep_logits=True))
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert runs[0].output_ids == runs[1].output_ids
    assert all(np.array_equal(a, b) for a, b in zip(runs[0].draft_logits, runs[1].draft_logits))


def test_bad_pairs_and_prompts_are_refused_before_compute(pair: tuple[Path, Path], tmp_path: Path) -> None:
    from ikconvert.convert import Converter
    from ikconvert.tiny import TinySpec, make_tiny_checkpoint

    other = Converter(make_tiny_checkpoint(tmp_path / "hf", TinySpec(arch="qwen3", hidden=96, layers=3, heads=2,
                                                                     kv_heads=1, head_dim=48, ffn=128)),
                      "f32", "qwen2").write(tmp_path / "other.gguf")
    res = runner.invoke(app, ["accept", str(other), str(pair[1]), "--text", str(TEXT)])
    assert res.exit_code == 2 and "128 target features" in res.output and "2 layers x 96 = 192" in res.output
    same_width = Converter(make_tiny_checkpoint(tmp_path / "hf2", TinySpec(arch="qwen3", hidden=64, layers=4,
                                                                        n_merges=150)),
                           "f32", "qwen2").write(tmp_path / "other-vocab.gguf")
    res = runner.invoke(app, ["accept", str(same_width), str(pair[1]), "--text", str(TEXT)])
    assert res.exit_code == 2 and "the draft's vocabulary has 320 tokens" in res.output, res.output
    res = runner.invoke(app, ["accept", str(pair[0]), str(pair[1]), "--text", str(TEXT), "--prompt-len", "5000"])
    assert res.exit_code == 2 and "3892 tokens" in res.output
    res = runner.invoke(app, ["accept", str(pair[0]), str(pair[0]), "--text", str(TEXT)])
    assert res.exit_code == 2 and "not a DFlash draft" in res.output
    res = runner.invoke(app, ["ppl", str(pair[1]), "--text", str(TEXT), "--ctx", "64", "--chunks", "2"])
    assert res.exit_code == 2 and "it runs with its target (ikrun accept" in res.output


def test_acceptance_sweep_rows_are_the_acceptance_of_that_tensor_alone(pair: tuple[Path, Path], tmp_path: Path) -> None:
    from ikquant.ftypes import file_type
    from ikquant.quantize import QuantizeOptions, quantize_model

    out = tmp_path / "acc.json"
    args = ["sweep", str(pair[1]), "--target", str(pair[0]), "--metric", "acceptance", "--text", str(TEXT),
            "--types", "Q4_0", "--tensors", r"blk\.1\.", "--prompts", "2", "--max-new", "32", "-o", str(out)]
    res = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["metric"] == "acceptance" and len(data["rows"]) == 7
    row = next(r for r in data["rows"] if r["group"] == "blk.1.attn_k.weight")
    single = tmp_path / "one.gguf"  # the draft with that one tensor quantized, measured by ikrun accept
    quantize_model(pair[1], single, QuantizeOptions(file_type("F32"), pure=True, tensor_types={row["group"]: "Q4_0"}))
    acc = runner.invoke(app, ["accept", str(pair[0]), str(single), "--text", str(TEXT), "--prompts", "2",
                              "--max-new", "32", "--json"])
    assert json.loads(acc.stdout)["mean_acceptance_length"] == row["acceptance_mean"]
    base = runner.invoke(app, ["accept", str(pair[0]), str(pair[1]), "--text", str(TEXT), "--prompts", "2",
                               "--max-new", "32", "--json"])
    assert row["acceptance_loss"] == pytest.approx(json.loads(base.stdout)["mean_acceptance_length"] - row[
        "acceptance_mean"], abs=1e-12)
    res = runner.invoke(app, args)
    assert res.exit_code == 0 and "(0 new)" in res.output
    res = runner.invoke(app, [*args[:-4], "--max-new", "40", "-o", str(out)])
    assert res.exit_code == 2 and "decoding" in res.output
    res = runner.invoke(app, ["sweep", str(pair[1]), "--metric", "acceptance", "--text", str(TEXT), "--types",
                              "Q4_0"])
    assert res.exit_code == 2 and "--target go together" in res.output
