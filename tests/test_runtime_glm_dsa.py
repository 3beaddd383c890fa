"""The `glm-dsa` runtime (GLM-5.2-style tiny model, lightning indexer with IndexShare) against ik_llama.cpp's three
base files (dense, --dsa, --dsa without the sink), transformers' logits and the numpy reference; a generated
GLM-5-style checkpoint (an indexer on every layer); the --dsa / --dsa-sink switches; bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.convert import Converter
from ikquant.gguf_io import GGUFFile
from ikquant.imatrix import read_imatrix_dat
from ikrun.cli import app
from ikrun.errors import ModelError
from ikrun.model import Model
from ikrun.ops.indexer import hadamard
from ikrun.options import RuntimeOptions
from ikrun.validate.hf import HFReference, compare_logits
from tests.blas import needs_avx512_gemm
from tests.family_checks import assert_iks_forward
from tests.test_convert_glm_dsa import GlmSpec, make_glm_checkpoint
from tests.test_runtime_deepseek2 import _rewrite, assert_thread_invariant

runner = CliRunner()
DATA = Path(__file__).parent / "data"
GGUF = DATA / "convert" / "glm-dsa" / "ref-f32.gguf"
LOGITS = DATA / "logits" / "glm-dsa"
HF_LOGITS = DATA / "hf-logits" / "glm-dsa"
DENSE, SINK = RuntimeOptions(dsa=False), RuntimeOptions(dsa_sink=True)


def _tokens() -> np.ndarray:
    return np.load(HF_LOGITS / "tokens.npy")


def _kld(base: str, *extra: str) -> dict[str, Any]:
    res = runner.invoke(app, ["kld", str(GGUF), "--base-logits", str(LOGITS / base), "--json", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


# ---- against ik_llama.cpp: each of its three runs reproduced on purpose ----------------------------------------

@needs_avx512_gemm
def test_default_is_sparse_without_sink_like_iks_dsa_sink_0_run() -> None:
    stats = _kld("ik-base-dsa-nosink.kld")
    assert stats["n_tokens"] == 8 * 31
    assert stats["kld_mean"] <= 1e-3 and stats["same_top_p"] >= 0.97, stats
    assert stats["kld_median"] < 3e-6  # the rest is near-ties flipped by ik's f16 caches (next test)


def test_dsa_off_is_iks_dense_run() -> None:
    stats = _kld("ik-base.kld", "--dsa", "off")
    assert stats["kld_mean"] <= 1e-3 and stats["same_top_p"] >= 0.97, stats
    assert stats["kld_mean"] < 1e-5 and stats["same_top_p"] == 1.0  # no selection: only the f16 latent cache differs


@needs_avx512_gemm
@pytest.mark.parametrize(("base", "flags", "kld_max"), [
    ("ik-base.kld", ["--dsa", "off"], 1e-5),
    ("ik-base-dsa.kld", ["--dsa-sink"], 1e-5),
    # two positions keep a small difference: indexer near-ties (relative score gap 1.3e-5 and 6e-5, chunk 0 query 48
    # and chunk 3 query 42, layer 6) that ik's f16 arithmetic resolves the other way
    ("ik-base-dsa-nosink.kld", [], 2e-3),
])
def test_with_iks_f16_caches_every_run_agrees(base: str, flags: list[str], kld_max: float) -> None:
    """ik's default caches: the f16 MLA latent and the Hadamard-rotated f16 indexer keys. Emulated, the selections
    ik's f16 rounding flips flip here too."""
    stats = _kld(base, "--kv-cache", "f16", *flags)
    assert stats["same_top_p"] == 1.0 and stats["kld_max"] < kld_max, stats
    assert abs(stats["kld_mean"]) < 2e-5 and stats["kld_median"] < 2e-7, stats


@pytest.mark.parametrize(("base", "printed", "options"), [
    ("ik-base-dsa.kld", "ik-f32-dsa-ppl.txt", RuntimeOptions(numerics="ik", dsa_sink=True)),
    ("ik-base-dsa-nosink.kld", "ik-f32-dsa-nosink-ppl.txt", RuntimeOptions(numerics="ik")),
    ("ik-base.kld", "ik-f32-ppl.txt", RuntimeOptions(numerics="ik", dsa=False)),
])
def test_numerics_ik_is_iks_forward(base: str, printed: str, options: RuntimeOptions, tmp_path: Path) -> None:
    """Under --numerics ik each of ik's three runs comes out byte for byte (its base-logits file, every running
    PPL): the indexer's selection and ik's -fa off attention under its sparse mask in its float order (before the
    mask went through ik's kernel, the --dsa run was 515.5757 where ik prints 515.6401). Its kernels are emulated,
    so this needs no particular BLAS."""
    assert_iks_forward(Model(GGUF, options=options), LOGITS / base, LOGITS / printed, tmp_path / "base.kld")


def test_sink_changes_the_selection() -> None:
    """ik's default --dsa keeps the first token; against ik's no-sink run that costs KL, as against transformers."""
    stats = _kld("ik-base-dsa-nosink.kld", "--dsa-sink")
    assert stats["kld_mean"] > 0.1


@needs_avx512_gemm
@pytest.mark.parametrize(("flags", "printed"), [([], "ik-f32-dsa-nosink-ppl.txt"), (["--dsa", "off"], "ik-f32-ppl.txt"),
                                                (["--dsa-sink"], "ik-f32-dsa-ppl.txt")])
def test_ppl_matches_iks_printed_estimate(flags: list[str], printed: str) -> None:
    text = (LOGITS / printed).read_bytes().decode(errors="replace")
    ik = re.search(r"Final estimate: PPL over 8 chunks for n_ctx=64 = ([\d.]+) \+/- ([\d.]+)", text)
    assert ik is not None
    res = runner.invoke(app, ["ppl", str(GGUF), "--text", str(LOGITS / "text.txt"), "--ctx", "64", "--chunks", "8",
                              "--json", "--kv-cache", "f16", *flags])
    assert res.exit_code == 0, res.output
    ours = json.loads(res.stdout)
    assert ours["n_tokens"] == 248
    rel = 2e-4 if not flags else 1e-5  # the no-sink run keeps the two near-ties above
    assert ours["ppl"] == pytest.approx(float(ik.group(1)), rel=rel)
    assert ours["ppl_err"] == pytest.approx(float(ik.group(2)), rel=rel * 5)


# ---- against Hugging Face transformers and the numpy reference --------------------------------------------------

@needs_avx512_gemm
def test_matches_transformers_logits() -> None:
    hf = np.load(HF_LOGITS / "logits.npy")
    tokens = _tokens()
    assert Model(GGUF).tokenizer_flags()[0] is False  # no BOS swap, as transformers was fed
    ours = np.stack([Model(GGUF).logits(t) for t in tokens])
    res = compare_logits(hf.reshape(-1, hf.shape[-1]), ours.reshape(-1, hf.shape[-1]))
    assert res["kld_mean"] <= 1e-4 and res["same_top"] == 1.0, res
    assert res["kld_mean"] < 1e-8 and res["max_rel_logit_err"] < 2e-4, res  # every selection is transformers'


def test_dense_and_sink_are_not_transformers() -> None:
    """The two ik compatibility modes are what they claim: not the model (KL about 0.7 and 0.3 from transformers)."""
    hf = np.load(HF_LOGITS / "logits.npy")[:2]
    for options, at_least in ((DENSE, 0.2), (SINK, 0.1)):
        ours = np.stack([Model(GGUF, options=options).logits(t) for t in _tokens()[:2]])
        assert compare_logits(hf[:, 32:63].reshape(-1, 336), ours[:, 32:63].reshape(-1, 336))["kld_mean"] > at_least


def test_numpy_reference_matches_transformers() -> None:
    ref = HFReference(DATA / "convert" / "glm-dsa" / "hf")
    hf = np.load(HF_LOGITS / "logits.npy")
    ours = np.stack([ref.logits(t) for t in _tokens()])
    res = compare_logits(hf.reshape(-1, 336), ours.reshape(-1, 336))
    assert res["max_rel_logit_err"] < 2e-5 and res["kld_max"] < 1e-10, res


def _reference_like_ik(hf: Path) -> HFReference:
    """The numpy reference with ik's eps (rms_norm_eps) in the q_a / kv_a RMSNorms and the indexer LayerNorm, where
    transformers has 1e-6: then the runtime and the reference compute the same function."""
    ref = HFReference(hf)
    ref.other.latent_norm_eps = ref.other.indexer_norm_eps = ref.cfg["rms_norm_eps"]
    return ref


def _per_layer(model: Model, ref: HFReference, tokens: np.ndarray) -> list[tuple[int, float, int]]:
    """Per main layer: relative error of the hidden state after it, and how many queries keep other keys than
    the reference's top-k."""
    theirs: dict[int, np.ndarray] = {}
    ours: dict[int, np.ndarray] = {}
    kept: list[np.ndarray | None] = []
    run = model.impl._latent_attention

    def spy(b: str, h: np.ndarray, q: np.ndarray, cos: np.ndarray, sin: np.ndarray,
            keep: np.ndarray | None = None, kv: dict[str, Any] | None = None) -> np.ndarray:
        kept.append(keep)
        return run(b, h, q, cos, sin, keep, kv)

    model.impl._latent_attention = spy
    try:
        ref.other.logits(tokens, on_block=lambda i, x: theirs.__setitem__(i, x.copy()))
        model.impl.forward(tokens, on_block=lambda i, x: ours.__setitem__(i, x.copy()))
    finally:
        del model.impl._latent_attention
    n = len(tokens)
    rows = []
    for i in sorted(ours):
        selected = np.zeros((n, n), dtype=bool)
        np.put_along_axis(selected, ref.other.selections[i], True, axis=-1)
        selected &= np.tril(np.ones((n, n), dtype=bool))
        assert kept[i] is not None
        err = float(np.abs(ours[i] - theirs[i]).max() / np.abs(theirs[i]).max())
        rows.append((i, err, int((kept[i] != selected).any(axis=1).sum())))
    return rows


@needs_avx512_gemm
def test_every_layer_matches_the_numpy_reference() -> None:
    """Hidden state after each block and each layer's selection; shared layers (3, 4, 5) reuse layer 2's."""
    ref = _reference_like_ik(DATA / "convert" / "glm-dsa" / "hf")
    assert ref.other.types == ["full"] * 3 + ["shared"] * 3 + ["full"]
    for tokens in _tokens()[:3]:
        for layer, err, flipped in _per_layer(Model(GGUF), ref, tokens):
            assert flipped == 0 and err < 1e-5, f"layer {layer}: {flipped} queries select other keys, error {err:.2e}"
        for shared in (3, 4, 5):
            assert ref.other.selections[shared] is ref.other.selections[2]


def test_validate_command() -> None:
    res = runner.invoke(app, ["validate", "--hf", str(DATA / "convert" / "glm-dsa" / "hf"), "--gguf", str(GGUF),
                              "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["ok"] is True


# ---- a generated GLM-5-style checkpoint: the schedule comes from the file ----------------------------------------

@pytest.fixture(scope="module")
def glm5(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """GLM-5 style (no IndexShare keys: every layer runs its indexer), a non-power-of-two indexer key length."""
    root = tmp_path_factory.mktemp("glm5")
    hf = make_glm_checkpoint(root / "hf", GlmSpec(index_dim=24, seed=5))
    return hf, Converter(hf, "f32", "glm4").write(root / "glm5-f32.gguf")


def test_glm5_style_checkpoint_end_to_end(glm5: tuple[Path, Path]) -> None:
    hf, gguf = glm5
    assert GGUFFile(gguf).get("glm-dsa.attention.indexer.types") == [True] * 4
    ref = _reference_like_ik(hf)
    for tokens in _tokens()[:2]:
        for layer, err, flipped in _per_layer(Model(gguf), ref, tokens):
            assert flipped == 0 and err < 1e-5, f"layer {layer}: {flipped} queries select other keys, error {err:.2e}"
    tokens = _tokens()[2]
    res = compare_logits(HFReference(hf).logits(tokens), Model(gguf).logits(tokens))  # transformers' own eps
    assert res["same_top"] == 1.0 and res["kld_max"] < 1e-6, res


def test_shared_layers_follow_the_files_schedule(glm5: tuple[Path, Path], tmp_path: Path) -> None:
    """ik's hard-coded IndexShare rule (layers 0, 1, 2, 6, ... full) written as the file's schedule: layer 3 then
    reuses layer 2's selection, as the reference does with that schedule, and the logits change."""
    hf, gguf = glm5
    ik_rule = [i <= 1 or i % 4 == 2 for i in range(4)]
    assert ik_rule == [True, True, True, False]
    shared = _rewrite(gguf, tmp_path / "shared.gguf", kv={"glm-dsa.attention.indexer.types": ik_rule})
    ref = _reference_like_ik(hf)
    ref.other.types = ["full" if f else "shared" for f in ik_rule]
    tokens = _tokens()[0]
    for layer, err, flipped in _per_layer(Model(shared), ref, tokens):
        assert flipped == 0 and err < 1e-5, f"layer {layer}: {flipped} queries select other keys, error {err:.2e}"
    assert compare_logits(Model(gguf).logits(tokens), Model(shared).logits(tokens))["kld_mean"] > 1e-4


def test_without_a_schedule_every_layer_runs_its_indexer(tmp_path: Path) -> None:
    """No attention.indexer.types (a file from a GLM-5 config): every layer is full, so the golden file's shared
    layers, which carry no indexer, are an error naming the first of them."""
    path = _rewrite(GGUF, tmp_path / "notypes.gguf", unset=("glm-dsa.attention.indexer.types",))
    with pytest.raises(ModelError, match=r"layer 3 runs its lightning indexer .* lacks blk\.3\.indexer\.attn_q_b"):
        Model(path)


# ---- the switches -----------------------------------------------------------------------------------------------

def test_switches_reach_the_forward(tmp_path: Path) -> None:
    tokens = ",".join(str(t) for t in _tokens()[1])
    runs = {}
    for name, flags in (("default", []), ("on", ["--dsa", "on"]), ("off", ["--dsa", "off"]), ("sink", ["--dsa-sink"])):
        res = runner.invoke(app, ["logits", str(GGUF), "--tokens", tokens, "-o", str(tmp_path / f"{name}.npy"),
                                  *flags])
        assert res.exit_code == 0, res.output
        runs[name] = np.load(tmp_path / f"{name}.npy")
    ids = _tokens()[1]
    np.testing.assert_array_equal(runs["default"], runs["on"])
    np.testing.assert_array_equal(runs["default"], Model(GGUF).logits(ids))
    np.testing.assert_array_equal(runs["off"], Model(GGUF, options=DENSE).logits(ids))
    np.testing.assert_array_equal(runs["sink"], Model(GGUF, options=SINK).logits(ids))
    first = slice(0, 16)  # while a query has at most top_k keys the three agree
    np.testing.assert_array_equal(runs["default"][first], runs["off"][first])
    assert not np.array_equal(runs["default"], runs["off"]) and not np.array_equal(runs["default"], runs["sink"])


def test_imatrix_sees_the_indexer_only_when_it_runs(tmp_path: Path) -> None:
    entries = {}
    for name, flags in (("sparse", []), ("dense", ["--dsa", "off"])):
        out = tmp_path / f"{name}.dat"
        res = runner.invoke(app, ["imatrix", str(GGUF), "--text", str(LOGITS / "text.txt"), "--ctx", "64",
                                  "--chunks", "2", "-o", str(out), *flags])
        assert res.exit_code == 0, res.output
        entries[name] = set(read_imatrix_dat(out).entries)
    indexer = {f"blk.{i}.indexer.{t}.weight" for i in (0, 1, 2, 6) for t in ("attn_q_b", "attn_k", "proj")}
    assert entries["sparse"] - entries["dense"] == indexer


_QWEN3 = DATA / "convert" / "qwen3" / "ik-f32.gguf"


@pytest.mark.parametrize("command", [
    ["logits", str(_QWEN3), "--tokens", "1,2"],
    ["ppl", str(_QWEN3), "--text", str(LOGITS / "text.txt"), "--ctx", "64", "--chunks", "1"],
    ["kld", str(_QWEN3), "--base-logits", str(DATA / "logits" / "qwen3" / "ik-base.kld")],
    ["imatrix", str(_QWEN3), "--text", str(LOGITS / "text.txt"), "--ctx", "64", "--chunks", "1"],
    ["sweep", str(_QWEN3), "--text", str(LOGITS / "text.txt"), "--types", "Q8_0", "--ctx", "64", "--chunks", "1"],
    ["validate", "--hf", str(DATA / "convert" / "qwen3" / "hf"), "--gguf", str(_QWEN3)],
])
@pytest.mark.parametrize("flags", [["--dsa", "off"], ["--dsa", "on"], ["--dsa-sink"]])
def test_switches_are_an_error_without_an_indexer(command: list[str], flags: list[str], tmp_path: Path) -> None:
    res = runner.invoke(app, [*command, *flags, *(["-o", str(tmp_path / "out")] if command[0] in (
        "logits", "imatrix", "sweep") else [])], env={"COLUMNS": "250"})
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert f"{flags[0]} applies only to glm-dsa;" in text
    assert "ik-f32.gguf is qwen3" in text
    assert not (tmp_path / "out").exists()


def test_sink_without_sparse_attention_is_an_error() -> None:
    res = runner.invoke(app, ["logits", str(GGUF), "--tokens", "1,2", "--dsa", "off", "--dsa-sink"])
    assert res.exit_code == 2 and "--dsa-sink" in res.output and "--dsa off" in res.output


# ---- determinism and kernels ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_cache", ["f32", "f16"])
def test_identical_logits_at_any_thread_count(kv_cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_thread_invariant(Model(GGUF, kv_cache=kv_cache), _tokens()[0], monkeypatch)


def test_hadamard_is_sylvesters_orthonormal_matrix() -> None:
    h = np.ones((1, 1))
    while h.shape[0] < 32:
        h = np.block([[h, h], [h, -h]])
    x = np.random.default_rng(2).standard_normal((3, 5, 32)).astype(np.float32)
    np.testing.assert_allclose(hadamard(x), x @ (h / np.sqrt(32)).T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hadamard(hadamard(x)), x, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(np.ones((2, 24), dtype=np.float32))


# ---- bad input and other layouts ---------------------------------------------------------------------------------

def test_full_layer_without_indexer_is_named(tmp_path: Path) -> None:
    """ik warns "DSA will run dense on it" and then segfaults with --dsa (ik's behaviour on such files)."""
    broken = _rewrite(GGUF, tmp_path / "noidx.gguf", drop=tuple(f"blk.6.{n}" for n in (
        "indexer.attn_q_b.weight", "indexer.attn_k.weight", "indexer.k_norm.weight", "indexer.k_norm.bias",
        "indexer.proj.weight")))
    with pytest.raises(ModelError, match=r"layer 6 runs its lightning indexer .* lacks blk\.6\.indexer\.attn_q_b"):
        Model(broken)
    res = runner.invoke(app, ["logits", str(broken), "--tokens", "1,2"], env={"COLUMNS": "250"})
    assert res.exit_code == 2 and "layer 6" in res.output and "--dsa off" in " ".join(res.output.split())
    tokens = _tokens()[0]
    np.testing.assert_array_equal(Model(broken, options=DENSE).logits(tokens), Model(GGUF, options=DENSE).logits(tokens))


@pytest.mark.parametrize(("kv", "drop", "reshape", "named"), [
    ({}, ("blk.7.indexer.attn_k.weight",), {}, r"layer 7 has part of an indexer but lacks blk\.7\.indexer\.attn_k"),
    ({"glm-dsa.attention.indexer.types": [True] * 6}, (), {}, r"indexer\.types must have one entry per main layer \(7\)"),
    ({"glm-dsa.attention.indexer.types": [False] + [True] * 6}, (), {}, r"the first true"),
    ({"glm-dsa.attention.indexer.head_count": 8}, (), {}, r"blk\.0\.indexer\.attn_q_b\.weight has shape \[512, 96\]"),
    ({"glm-dsa.attention.indexer.key_length": 16}, (), {}, r"key_length 16 must exceed rope\.dimension_count 16"),
    ({}, (), {"blk.7.nextn.eh_proj.weight": (32, 256)}, r"blk\.7\.nextn\.eh_proj\.weight has shape \[32, 256\]"),
])
def test_inconsistent_files_are_named(tmp_path: Path, kv: dict, drop: tuple[str, ...],
                                      reshape: dict[str, tuple[int, ...]], named: str) -> None:
    with pytest.raises(ModelError, match=named):
        Model(_rewrite(GGUF, tmp_path / "bad.gguf", kv=kv, drop=drop, reshape=reshape))


def test_f16_indexer_cache_needs_a_power_of_two_key_length(glm5: tuple[Path, Path]) -> None:
    with pytest.raises(ModelError, match=r"power-of-two glm-dsa\.attention\.indexer\.key_length \(got 24\)"):
        Model(glm5[1], kv_cache="f16")
    Model(glm5[1], kv_cache="f16", options=DENSE)  # dense attention needs no indexer cache ...
    Model(glm5[1])  # ... nor does the exact float32 one


def test_missing_gating_function_routes_by_sigmoid(tmp_path: Path) -> None:
    """GLM-5 scores experts by sigmoid; ik falls back to softmax without the key , ikrun does not."""
    tokens = _tokens()[4]
    unset = _rewrite(GGUF, tmp_path / "nogating.gguf", unset=("glm-dsa.expert_gating_func",))
    np.testing.assert_array_equal(Model(unset).logits(tokens), Model(GGUF).logits(tokens))
    softmax = _rewrite(GGUF, tmp_path / "softmax.gguf", kv={"glm-dsa.expert_gating_func": 1})
    assert compare_logits(Model(GGUF).logits(tokens), Model(softmax).logits(tokens))["kld_mean"] > 1e-3


def test_the_golden_file_is_what_the_converter_writes(tmp_path: Path) -> None:
    """The runtime tests run ik's reference layout; our conversion holds the same tensors (test_convert_glm_dsa)."""
    ours = Converter(DATA / "convert" / "glm-dsa" / "hf", "f32", "glm4").write(tmp_path / "ours.gguf")
    tokens = _tokens()[6]
    np.testing.assert_array_equal(Model(ours).logits(tokens), Model(GGUF).logits(tokens))
