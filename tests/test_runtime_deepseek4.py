"""The `deepseek4` runtime on the tiny DeepSeek-V4-Flash checkpoint (3 layers: sliding, CSA, HCA; hash routing on
layer 0): against transformers' logits, transformers' and ik_llama.cpp's base files, block by block against the
independent numpy reference where HCA entries and the indexer's top-k (with its exact ties) are live, threads,
budgets, imatrix, and files it must refuse before any compute."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ikquant.gguf_io import GGUFFile
from ikquant.imatrix import read_imatrix_dat
from ikrun.cli import app
from ikrun.errors import ModelError
from ikrun.model import Model
from ikrun.ops.indexer import TIE_TORCH, select_top_k
from ikrun.validate.deepseek4 import DeepseekV4Reference, torch_topk
from tests.test_reference_deepseek4 import _kl
from tests.test_runtime_deepseek2 import _rewrite, assert_thread_invariant

runner = CliRunner()
DATA = Path(__file__).parent / "data"
GGUF = DATA / "convert" / "deepseek-v4-flash" / "ref-f32.gguf"
HF = DATA / "convert" / "deepseek-v4-flash" / "hf"
LOGITS = DATA / "logits" / "deepseek-v4-flash"
HF_LOGITS = DATA / "hf-logits" / "deepseek-v4-flash"


def _kld(base: str, *extra: str) -> dict[str, Any]:
    res = runner.invoke(app, ["kld", str(GGUF), "--base-logits", str(LOGITS / base), "--json", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(GGUF)


@pytest.fixture(scope="module")
def long_tokens(model: Model) -> np.ndarray:
    """600 tokens of the evaluation text: 150 CSA entries (the indexer keeps 16 of them) and 4 HCA entries."""
    return np.array(model.tokenizer().encode((LOGITS / "text.txt").read_text()), dtype=np.int64)[:600]


# ---- against transformers -----------------------------------------------------------------------------------

def test_logits_equal_transformers(model: Model) -> None:
    tokens, logits = np.load(HF_LOGITS / "tokens.npy"), np.load(HF_LOGITS / "logits.npy")
    for c in range(len(tokens)):
        got = model.logits(tokens[c])
        assert np.abs(got - logits[c]).max() < 5e-5, c  # float32 rounding: ~8e-6 measured
        assert _kl(logits[c], got).mean() < 1e-9, c


def test_kld_against_transformers_base_file() -> None:
    stats = _kld("hf-base.kld")
    assert stats["n_tokens"] == 8 * 31 and stats["same_top_p"] == 1.0
    assert abs(stats["kld_mean"]) < 1e-6 and stats["kld_max"] < 2e-5, stats


# ---- against ik_llama.cpp on exact weights (the MXFP4 experts decode exactly) ---------------------------------

def test_kld_against_ik_on_exact_weights() -> None:
    """ik's only difference on exact weights is its f16 K cache: computed in f32 a few positions move (indexer
    and routing near-ties), with the cache emulated every position agrees to float noise."""
    exact = _kld("ik-base-dequant.kld")
    assert exact["n_tokens"] == 60 * 31 and exact["kld_mean"] <= 1e-3 and exact["same_top_p"] > 0.99, exact
    f16 = _kld("ik-base-dequant.kld", "--kv-cache", "f16")
    # one position (chunk 27, token 12) is a tie in ik's file: it stores tokens 71 and 145 at the same 16-bit
    # log-probability (ours differ by 3.6e-6), and its top is the first of the two
    assert round(f16["same_top_p"] * f16["n_tokens"]) >= f16["n_tokens"] - 1, f16
    assert abs(f16["kld_mean"]) < 1e-6 and f16["kld_max"] < 2e-5, f16
    assert f16["kld_max"] < exact["kld_max"] / 100


def test_perplexity_is_iks_final_estimate() -> None:
    printed = (LOGITS / "ik-dequant-f32-ppl.txt").read_text()
    ik_ppl = float(re.search(r"Final estimate: PPL .* = ([0-9.]+) \+/-", printed).group(1))  # type: ignore[union-attr]
    res = runner.invoke(app, ["ppl", str(GGUF), "--text", str(LOGITS / "text.txt"), "--ctx", "64", "--json",
                              "--kv-cache", "f16"])
    assert res.exit_code == 0, res.output
    assert abs(json.loads(res.stdout)["ppl"] / ik_ppl - 1) < 1e-5


# ---- against the numpy reference where the 64-token goldens cannot look -----------------------------------------

def test_every_block_equals_the_reference_with_hca_and_indexer_selection(model: Model,
                                                                         long_tokens: np.ndarray) -> None:
    ref = DeepseekV4Reference.from_folder(HF)
    want: dict[int, np.ndarray] = {}
    got: dict[int, np.ndarray] = {}
    ref_logits = ref.logits(long_tokens, on_block=lambda i, x: want.__setitem__(i, x.copy()))
    logits = model.impl.forward(long_tokens, on_block=lambda i, x: got.__setitem__(i, x.copy()))
    for i in range(3):
        assert got[i].shape == want[i].shape == (600, 4, 128)
        err = np.abs(got[i] - want[i]).max() / np.abs(want[i]).max()
        assert err < 1e-5, (i, err)  # ~1e-6 measured
    kl = _kl(ref_logits, logits)
    assert kl.mean() < 1e-9 and kl.max() < 1e-8, (kl.mean(), kl.max())


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The converter tests' generated checkpoint of other dimensions (CSA on layer 0, two hash layers, hc 2, YaRN
    with a short original context, window 8, top-k 8) with its scales set so activations stay unit-sized (the
    converter tests' random FP8 and FP4 scales make weights of hundreds)."""
    from ikconvert.convert import Converter
    from tests.test_convert_deepseek4 import GEN_CONFIG, PRE, _gen_tensors, _write_checkpoint

    tensors = _gen_tensors(GEN_CONFIG, seed=7)
    for name, (dtype, values) in list(tensors.items()):
        if name.endswith(".scale"):
            fp8 = tensors[name.removesuffix(".scale") + ".weight"][0] == "F8_E4M3"
            tensors[name] = (dtype, np.full_like(values, 117 if fp8 else 121))  # 2^-10 and 2^-6
    folder = tmp_path_factory.mktemp("ds4run")
    hf = _write_checkpoint(folder / "hf", GEN_CONFIG, tensors, HF)
    return hf, Converter(hf, "f32", PRE).write(folder / "gen.gguf")


def test_a_generated_model_equals_the_reference(generated: tuple[Path, Path]) -> None:
    """Hash rows that name an expert twice, and a hash-routed expert whose router logit is below -17: its
    sqrt(softplus) score is tiny but not zero (log1p, as torch), and renormalised it still weighs ~3%."""
    hf, gguf = generated
    ref, model = DeepseekV4Reference.from_folder(hf), Model(gguf)
    tokens = np.random.default_rng(0).integers(0, model.n_vocab, 200)
    want: dict[int, np.ndarray] = {}
    got: dict[int, np.ndarray] = {}
    ref_logits = ref.logits(tokens, on_block=lambda i, x: want.__setitem__(i, x.copy()))
    logits = model.impl.forward(tokens, on_block=lambda i, x: got.__setitem__(i, x.copy()))
    for i in range(4):
        assert np.abs(got[i] - want[i]).max() / np.abs(want[i]).max() < 1e-5, i  # ~5e-7 measured
    assert _kl(ref_logits, logits).max() < 1e-9


def test_indexer_top_k_breaks_ties_as_torch() -> None:
    """Both of torch's CPU paths (partial_sort when k * 64 <= n, else nth_element) on rows full of exact ties, as
    relu makes them."""
    rng = np.random.default_rng(3)
    for n, k in ((150, 16), (40, 7), (1100, 16), (9, 4), (300, 4)):
        scores = np.maximum(rng.integers(-6, 4, size=(64, n)), 0).astype(np.float32)
        scores[:, n // 2:][rng.random((64, n - n // 2)) < 0.3] = -np.inf
        keep = select_top_k(scores, k, TIE_TORCH)
        for row, kept in zip(scores, keep):
            if np.isfinite(row).sum() <= k:
                assert kept.tolist() == np.isfinite(row).tolist()
            else:
                assert sorted(np.nonzero(kept)[0].tolist()) == sorted(torch_topk(row, k)), (n, k)


def test_threads_do_not_change_a_bit(model: Model, long_tokens: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    assert_thread_invariant(model, long_tokens[:300], monkeypatch)


def test_grouped_output_of_f16_weights_in_the_expert_kernel(tmp_path: Path) -> None:
    """An F16 attn_output_a is multiplied in the expert kernel, each output group an expert reading its columns of
    the heads' outputs and writing its columns of the product: each group within float32 rounding of float64's
    product with its slice; a token alone, and the file's bits in a layer-streamed model, give the same bits."""
    from ikquant import QuantizeOptions, file_type, quantize_model

    f16 = tmp_path / "f16.gguf"
    quantize_model(GGUF, f16, QuantizeOptions(file_type("F16"), allow_requantize=True))
    name, groups = "blk.1.attn_output_a.weight", int(GGUFFile(f16).require("deepseek4.attention.output_group_count"))
    decoded, streamed = Model(f16), Model(f16)
    streamed.weights.streaming = True  # as a layer-streamed pass sets it: the file's bits, nothing decoded
    assert decoded.weights.is_half(name) and groups > 1
    w = decoded.weights.decode(name).astype(np.float64)
    rows, per = w.shape[0] // groups, w.shape[1]
    x = np.random.default_rng(0).standard_normal((37, groups * per)).astype(np.float32)
    y = decoded.numerics.grouped_product(x, name, groups)
    assert y.shape == (37, groups * rows)
    for j in range(groups):
        want = x[:, j * per : (j + 1) * per].astype(np.float64) @ w[j * rows : (j + 1) * rows].T
        np.testing.assert_allclose(y[:, j * rows : (j + 1) * rows], want, rtol=0, atol=2e-6 * np.abs(want).max())
    np.testing.assert_array_equal(decoded.numerics.grouped_product(x[20:21], name, groups), y[20:21])
    np.testing.assert_array_equal(streamed.numerics.grouped_product(x, name, groups), y)
    assert streamed.weights.reads[name] > 0 and decoded.weights.cached_array(name) is not None


def test_validate_command() -> None:
    res = runner.invoke(app, ["validate", "--hf", str(HF), "--gguf", str(GGUF), "--ctx", "200"])
    assert res.exit_code == 0, res.output
    assert "OK" in res.output


def test_a_compressor_no_window_completes_is_unread(model: Model, long_tokens: np.ndarray) -> None:
    """The HCA layer (ratio 128) pools no entry from a chunk of fewer than 128 tokens: its compressor is listed as
    unread there (a sweep leaves it unmeasured instead of scoring it at the base's own KLD), and a swap of it
    changes no logit there while it changes them at 128 tokens."""
    hca = {f"blk.2.attn_compressor_{t}" for t in ("kv.weight", "gate.weight", "ape.weight", "norm.weight")}
    assert set(model.unread_tensors(127)) == hca == set(model.unread_tensors(127, 32))
    assert model.unread_tensors(128) == {} == model.unread_tensors(128, 32)
    name = "blk.2.attn_compressor_kv.weight"
    raw = model.weights.source_encoding(name)
    before = {n: model.logits(long_tokens[:n]) for n in (127, 128)}
    model.swap(name, raw.type, np.ascontiguousarray(raw.raw[::-1]))
    try:
        after = {n: model.logits(long_tokens[:n]) for n in (127, 128)}
    finally:
        model.restore(name)
    assert np.array_equal(before[127], after[127]) and not np.array_equal(before[128], after[128])


# ---- imatrix --------------------------------------------------------------------------------------------------

def test_imatrix_names_per_expert_and_per_output_group(tmp_path: Path) -> None:
    out = tmp_path / "dsv4.dat"
    res = runner.invoke(app, ["imatrix", str(GGUF), "--text", str(LOGITS / "text.txt"), "--ctx", "64",
                              "--chunks", "2", "-o", str(out)])
    assert res.exit_code == 0, res.output
    entries = read_imatrix_dat(out).entries
    assert {f"blk.1.{t}.weight" for t in ("indexer.attn_q_b", "indexer.proj", "indexer_compressor_kv",
                                          "indexer_compressor_gate", "attn_compressor_kv")} <= set(entries)
    assert "blk.2.attn_compressor_gate.weight" in entries and "blk.0.attn_compressor_kv.weight" not in entries
    assert "blk.2.indexer.proj.weight" not in entries  # HCA layers have no indexer
    assert not any("tid2eid" in name or "ape" in name for name in entries)
    # attn_output_a: one column set per group of heads (2 x 128), experts one per expert (4 x 128)
    assert np.asarray(entries["blk.0.attn_output_a.weight"].values).size == 2 * 128
    assert np.asarray(entries["blk.0.ffn_up_exps.weight"].values).size == 4 * 128
    assert np.asarray(entries["blk.0.hc_attn_fn.weight"].values).size == 4 * 128


# ---- bad files ------------------------------------------------------------------------------------------------

def _refused(tmp_path: Path, match: str, **rewrite: Any) -> None:
    bad = _rewrite(GGUF, tmp_path / "bad.gguf", **rewrite)
    with pytest.raises(ModelError, match=match):
        Model(bad)


def test_compress_ratios_of_the_wrong_length(tmp_path: Path) -> None:
    _refused(tmp_path, r"compress_ratios has 2 entries; it needs one per main layer \(3\)",
             kv={"deepseek4.attention.compress_ratios": [0, 4]})


def test_a_ratio_the_model_does_not_define(tmp_path: Path) -> None:
    _refused(tmp_path, r"gives layer 1 ratio 8", kv={"deepseek4.attention.compress_ratios": [0, 8, 128, 0]})


def test_a_compressed_layer_without_its_compressor(tmp_path: Path) -> None:
    _refused(tmp_path, r"layer 2 has compress ratio 128 \(HCA.*lacks blk\.2\.attn_compressor_kv\.weight",
             drop=("blk.2.attn_compressor_kv.weight",))


def test_a_csa_layer_without_its_indexer(tmp_path: Path) -> None:
    _refused(tmp_path, r"layer 1 has compress ratio 4 \(CSA.*lacks blk\.1\.indexer\.proj\.weight",
             drop=("blk.1.indexer.proj.weight",))


def test_an_indexer_top_k_beyond_the_compressed_length(tmp_path: Path) -> None:
    _refused(tmp_path, r"top_k 16 \(layer 1, the first CSA layer\) must be in 1\.\.8",
             kv={"deepseek4.context_length": 32})


def test_a_hash_layer_without_its_table(tmp_path: Path) -> None:
    _refused(tmp_path, r"layer 0 is hash-routed .* lacks blk\.0\.ffn_gate_tid2eid\.weight",
             drop=("blk.0.ffn_gate_tid2eid.weight",))


def test_gating_other_than_sqrt_softplus(tmp_path: Path) -> None:
    _refused(tmp_path, r"expert_gating_func is 2", kv={"deepseek4.expert_gating_func": 2})


def test_the_reference_file_has_what_the_tests_assume() -> None:
    f = GGUFFile(GGUF)
    assert list(f.get("deepseek4.attention.compress_ratios")) == [0, 4, 128, 0]
    assert f.get("deepseek4.hash_layer_count") == 1 and f.get("deepseek4.attention.indexer.top_k") == 16
    assert f.tensors["blk.0.ffn_up_exps.weight"].type.name == "MXFP4"


def test_hot_swap_of_an_indexer_and_an_expert_tensor(model: Model, long_tokens: np.ndarray) -> None:
    from ikquant.types import type_by_name
    from tests.test_hot_reload import _requantized

    tokens = long_tokens[:300]
    before = model.logits(tokens)
    for name, gtype in (("blk.1.indexer.attn_q_b.weight", "Q8_0"), ("blk.2.ffn_down_exps.weight", "Q4_0")):
        model.swap(name, type_by_name(gtype), _requantized(GGUF, name, gtype))
        assert not np.array_equal(before, model.logits(tokens)), name
        model.restore(name)
        np.testing.assert_array_equal(before, model.logits(tokens))


def test_streamed_under_a_small_budget_with_hca_and_selection_live(long_tokens: np.ndarray) -> None:
    """Chunks long enough for HCA entries and indexer choices: layer-streamed under the smallest budget gives the
    chunk-by-chunk logits bit for bit (no compressor or indexer state leaks between chunks or blocks)."""
    from ikrun.eval.stream import evaluate_chunks, minimum_budget, model_decoded_bytes, plan_run

    chunks = np.stack([long_tokens[:300], long_tokens[300:600], long_tokens[150:450]])
    free = Model(GGUF)
    expected = [x.copy() for _, x in evaluate_chunks(free, chunks, plan_run(free, 3, 300, one_pass=False))]
    tight = Model(GGUF)
    tight.mem = minimum_budget(tight, 300)
    plan = plan_run(tight, 3, 300, one_pass=True)
    assert plan.streamed and plan.cache_capacity is not None and plan.cache_capacity < model_decoded_bytes(tight)
    for want, (_, got) in zip(expected, evaluate_chunks(tight, chunks, plan)):
        np.testing.assert_array_equal(want, got)
