"""The `openpangu` runtime (tiny openPangu-2.0 golden model) against ik_llama.cpp and the numpy reference."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numba
import numpy as np
import pytest
from typer.testing import CliRunner

from ikquant.gguf_io import GGUFFile
from ikquant.imatrix import read_imatrix_dat
from ikrun.cli import app
from ikrun.errors import ModelError
from ikrun.eval.evaluate import chunk_logits, open_base
from ikrun.eval.metrics import BaseLogitsFile, KLDAccumulator, kld_stats
from ikrun.model import Model
from ikrun.models import openpangu
from ikrun.numerics import exact
from ikrun.ops import moe
from ikrun.ops.conv import causal_conv_residual
from ikrun.ops.hyperconn import hc_combine, hc_post, hc_pre
from ikrun.ops.indexer import TIE_LATER_INDEX
from ikrun.options import RuntimeOptions
from ikrun.validate.hf import HFReference, compare_logits
from ikrun.validate.openpangu import OpenPanguReference
from tests.test_qgemm import _fma32
from tests.test_runtime_deepseek2 import _rewrite

runner = CliRunner()
V2 = "openpangu-v2"
BOS = 1
#: ik's numbers for this 8-sink model carry its AVX-512 GEMM's over-read of the sink values (ikrun/ops/mla.py)
IK = RuntimeOptions(ik_sink_overread=True)


def _gguf(data_dir: Path, kind: str = "f32") -> Path:
    return data_dir / "convert" / V2 / f"ik-{kind}.gguf"


def _base(data_dir: Path) -> BaseLogitsFile:
    return BaseLogitsFile(data_dir / "logits" / V2 / "ik-base.kld")


def _tokens(data_dir: Path, chunk: int) -> np.ndarray:
    """A chunk of ik's base file as llama-perplexity feeds it (first token swapped for BOS)."""
    tokens = np.array(_base(data_dir).tokens[chunk], dtype=np.int64)
    tokens[0] = BOS
    return tokens


def _ik_printed(path: Path) -> dict[str, float]:
    text = path.read_bytes().decode("utf-8", errors="replace")
    grab = {"ppl_q": r"Mean PPL\(Q\)\s*:\s*([\d.]+)", "ppl_base": r"Mean PPL\(base\)\s*:\s*([\d.]+)",
            "kld_mean": r"Mean\s+KLD:\s*([\d.]+)"}
    return {k: float(re.search(p, text).group(1)) for k, p in grab.items()}  # type: ignore[union-attr]


def _kld(path: Path, base: Path, *extra: str) -> dict[str, Any]:
    """`ikrun kld` against one of ik's base files, computing what ik computes (--ik-sink-overread)."""
    res = runner.invoke(app, ["kld", str(path), "--base-logits", str(base), "--json", "--ik-sink-overread", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _reference(data_dir: Path, **config: Any) -> OpenPanguReference:
    hf = HFReference(data_dir / "convert" / V2 / "hf")
    return OpenPanguReference({**hf.cfg, **config}, hf.tensors)


# ---- against ik_llama.cpp --------------------------------------------------------------------------------------

def test_f32_forward_reproduces_iks_base_logits(data_dir: Path) -> None:
    stats = _kld(_gguf(data_dir), data_dir / "logits" / V2 / "ik-base.kld")
    assert stats["n_tokens"] == 60 * 31
    assert stats["kld_mean"] <= 1e-3 and stats["same_top_p"] >= 0.97, stats
    assert stats["kld_median"] < 1e-6  # most positions agree to float precision; near-ties flip the rest
    ik = _ik_printed(data_dir / "logits" / V2 / "ik-q8_0-as-f32-kld.txt")
    assert stats["ppl_base"] == pytest.approx(ik["ppl_base"], rel=1e-6)


def test_with_iks_f16_kv_cache_nearly_every_position_agrees(data_dir: Path) -> None:
    """ik's base run kept the latent and indexer-key caches in f16; rounding ours the same way leaves one MoE
    near-tie (chunk 30, position 49: the 2nd and 3rd expert 4e-6 apart in layer 2) flipped."""
    stats = _kld(_gguf(data_dir), data_dir / "logits" / V2 / "ik-base.kld", "--kv-cache", "f16")
    assert stats["kld_mean"] < 1e-4 and stats["kld_median"] < 1e-7, stats
    assert stats["kld_p99"] < 1e-4 and stats["same_top_p"] >= 0.999


def test_ppl_matches_iks_printed_estimate(data_dir: Path) -> None:
    """From the text, through our tokenizer: ik's 60 chunks and its PPL, up to the flipped near-tie above."""
    printed = (data_dir / "logits" / V2 / "ik-f32-ppl.txt").read_bytes().decode(errors="replace")
    ik = re.search(r"Final estimate: PPL over 60 chunks for n_ctx=64 = ([\d.]+) \+/- ([\d.]+)", printed)
    assert ik is not None
    res = runner.invoke(app, ["ppl", str(_gguf(data_dir)), "--text", str(data_dir / "logits" / V2 / "text.txt"),
                              "--ctx", "64", "--json", "--kv-cache", "f16", "--ik-sink-overread"])
    assert res.exit_code == 0, res.output
    ours = json.loads(res.stdout)
    assert ours["n_tokens"] == 1860
    assert ours["ppl"] == pytest.approx(float(ik.group(1)), rel=5e-4)
    assert ours["ppl_err"] == pytest.approx(float(ik.group(2)), rel=5e-4)


def test_q8_0_weight_error_matches_iks_weight_only_run(data_dir: Path) -> None:
    stats = _kld(_gguf(data_dir, "q8_0"), data_dir / "logits" / V2 / "ik-base.kld")
    ik = _ik_printed(data_dir / "logits" / V2 / "ik-q8_0-as-f32-kld.txt")
    assert stats["kld_mean"] == pytest.approx(ik["kld_mean"], rel=0.10)
    assert stats["ppl_q"] == pytest.approx(ik["ppl_q"], rel=0.01)


def _kld_in_process(model: Model, data_dir: Path, chunks: int = 20) -> float:
    """Mean KLD against ik's base file over its first chunks."""
    base = open_base(data_dir / "logits" / V2 / "ik-base.kld", model)
    acc = KLDAccumulator()
    for i in range(chunks):
        chunk = np.asarray(base.tokens[i])
        acc.add(chunk_logits(model, chunk), np.asarray(base.records(i)), chunk[33:])
    return kld_stats(acc)["kld_mean"]


def test_what_ik_computes_for_8_sinks_and_tied_indexer_scores(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ik behaviours the golden numbers depend on: the AVX-512 GEMM's over-read of the 8 sinks' values, and
    the indexer's top-k ties resolved as std::partial_sort resolves them. Either one changed and ik's logits are
    far away."""
    model = Model(_gguf(data_dir), options=IK)
    assert _kld_in_process(model, data_dir) < 1e-3
    assert _kld_in_process(Model(_gguf(data_dir)), data_dir) > 0.1
    monkeypatch.setattr(openpangu, "TIE_PARTIAL_SORT", TIE_LATER_INDEX)
    assert _kld_in_process(model, data_dir) > 0.01


# ---- against the numpy reference -------------------------------------------------------------------------------

@pytest.mark.parametrize("ik_sinks", [True, False], ids=["ik-avx512-sinks", "exact"])
def test_every_block_matches_the_numpy_reference(data_dir: Path, ik_sinks: bool) -> None:
    """The S hidden streams after each decoder block, runtime on the GGUF vs reference on the safetensors."""
    ref = _reference(data_dir)
    ref.ik_avx512_sinks = ik_sinks
    model = Model(_gguf(data_dir), options=RuntimeOptions(ik_sink_overread=ik_sinks))
    for chunk in (3, 11):
        tokens = _tokens(data_dir, chunk)
        theirs: dict[int, np.ndarray] = {}
        ours: dict[int, np.ndarray] = {}
        ref_logits = ref.logits(tokens, on_block=lambda i, x: theirs.__setitem__(i, x.copy()))
        logits = model.impl.forward(tokens, on_block=lambda i, x: ours.__setitem__(i, x.copy()))
        assert sorted(ours) == sorted(theirs) == [0, 1, 2]
        for i in sorted(ours):
            assert ours[i].shape == (64, 4, 64)
            err = np.abs(ours[i] - theirs[i]).max() / np.abs(theirs[i]).max()
            assert err < 1e-5, f"chunk {chunk} block {i}: relative error {err:.2e}"
        assert compare_logits(ref_logits, logits)["max_rel_logit_err"] < 1e-5


def test_every_attention_path_runs_at_this_context(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 0 runs the indexer and it prunes (64 tokens, top_k 16); layers 1-2 see a 16-token window; layer 2 has
    the block post-norm; layer 0 is dense, 1-2 MoE; the NextN block 3 is not run."""
    model = Model(_gguf(data_dir))
    impl = model.impl
    assert [(k.window, k.indexer) for k in impl.kinds] == [(0, True), (16, False), (16, False)]
    assert (impl.n_active, impl.n_dense, impl.n_sink, impl.top_k) == (3, 1, 8, 16)
    seen: list[tuple[int, np.ndarray | None]] = []
    real = exact.latent_attention

    def spy(*args: Any, **kwargs: Any) -> np.ndarray:
        seen.append((kwargs["window"], kwargs["keep"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(exact, "latent_attention", spy)
    model.logits(_tokens(data_dir, 0))
    assert [w for w, _ in seen] == [0, 16, 16]
    keep = seen[0][1]
    assert keep is not None and (keep.sum(1) == np.minimum(np.arange(64) + 1, 16)).all()  # 48 queries pruned
    assert model.weights.has("blk.2.block_post_norm.weight") and not model.weights.has("blk.1.block_post_norm.weight")


def test_validate_command(data_dir: Path) -> None:
    res = runner.invoke(app, ["validate", "--hf", str(data_dir / "convert" / V2 / "hf"), "--gguf",
                              str(_gguf(data_dir)), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["ok"] is True


def test_per_layer_windows_beyond_ik(data_dir: Path, tmp_path: Path) -> None:
    """Different windows per base layer (ik refuses such a file): each layer keeps its own."""
    path = _rewrite(_gguf(data_dir), tmp_path / "windows.gguf",
                    kv={"openpangu.sliding_window_list": [16, 5, 32]})
    model = Model(path)
    assert [k.window for k in model.impl.kinds] == [0, 16, 5]
    ref = _reference(data_dir, sliding_window_list=[16, 5, 32])
    tokens = _tokens(data_dir, 4)
    res = compare_logits(ref.logits(tokens), model.logits(tokens))
    assert res["max_rel_logit_err"] < 1e-5, res
    assert compare_logits(Model(_gguf(data_dir)).logits(tokens), model.logits(tokens))["kld_mean"] > 1e-4


def test_file_without_schedule_runs_every_layer_dense(data_dir: Path, tmp_path: Path) -> None:
    """Without openpangu.swa_layers / sliding_window_list ik runs every layer dense, the indexer unused."""
    path = _rewrite(_gguf(data_dir), tmp_path / "dense.gguf",
                    unset=("openpangu.swa_layers", "openpangu.sliding_window_list"))
    model = Model(path)
    assert all(k.window == 0 and not k.indexer for k in model.impl.kinds)
    ref = _reference(data_dir, dsa_layers=[], swa_layers=[], sliding_window_list=[])
    tokens = _tokens(data_dir, 6)
    assert compare_logits(ref.logits(tokens), model.logits(tokens))["max_rel_logit_err"] < 1e-5


def test_imatrix_covers_iks_weight_entries(data_dir: Path, tmp_path: Path) -> None:
    """Every weight ik's imatrix records, per head for attn_k_b / attn_v_b and per expert; ik also records its
    load-time sink tensors, which are not weights of the file."""
    out = tmp_path / "ours.dat"
    res = runner.invoke(app, ["imatrix", str(_gguf(data_dir)), "--text", str(data_dir / "logits" / V2 / "text.txt"),
                              "--ctx", "64", "-o", str(out), "--ik-sink-overread"])
    assert res.exit_code == 0, res.output
    ik, ours = read_imatrix_dat(data_dir / "logits" / V2 / "ik-imatrix.dat"), read_imatrix_dat(out)
    real = {name.removesuffix(" (reshaped)"): name for name in ik.entries if "param_sink" not in name}
    assert set(ours.entries) == set(real)
    assert ours.chunks == ik.chunks == 60
    for name, ik_name in real.items():
        a, b = ik.entries[ik_name].mean_sq(), ours.entries[name].mean_sq()
        assert a.size == b.size, name
        assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.01, name


# ---- building blocks against plain numpy -----------------------------------------------------------------------

def test_hyper_connection_ops_against_numpy() -> None:
    rng = np.random.default_rng(1)
    t, s, d, iters, eps = 9, 4, 10, 20, 1e-3
    mixes = rng.standard_normal((t, 2 * s + s * s), dtype=np.float32)
    alpha, beta = rng.standard_normal(3, dtype=np.float32), rng.standard_normal(2 * s + s * s, dtype=np.float32)
    pre, post, m = hc_pre(mixes, alpha, beta, s, iters, eps)
    sig = lambda x: 1 / (1 + np.exp(-x.astype(np.float64)))  # noqa: E731
    np.testing.assert_allclose(pre, sig(mixes[:, :s] * alpha[0] + beta[:s]) + eps, rtol=1e-6)
    np.testing.assert_allclose(post, 2 * sig(mixes[:, s : 2 * s] * alpha[1] + beta[s : 2 * s]), rtol=1e-6)
    logits = (mixes[:, 2 * s :] * alpha[2] + beta[2 * s :]).reshape(t, s, s).astype(np.float64)
    want = np.exp(logits - logits.max(-1, keepdims=True))
    want = want / want.sum(-1, keepdims=True) + eps
    want /= eps + want.sum(1, keepdims=True)
    for _ in range(iters - 1):
        want /= eps + want.sum(2, keepdims=True)
        want /= eps + want.sum(1, keepdims=True)
    np.testing.assert_allclose(m, want, rtol=1e-5)
    assert np.allclose(m.sum(1), 1, atol=1e-2)  # close to doubly stochastic
    streams = rng.standard_normal((t, s, d), dtype=np.float32)
    y = rng.standard_normal((t, d), dtype=np.float32)
    np.testing.assert_allclose(hc_combine(streams, pre), np.einsum("ts,tsd->td", pre, streams), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hc_post(y, post, streams, m),
                               post[:, :, None] * y[:, None] + np.einsum("tji,tjd->tid", m, streams), rtol=1e-5,
                               atol=1e-6)


def test_fused_hyper_connection_and_conv_ops_are_iks_fused_multiply_adds() -> None:
    """Under --numerics ik (fused) each product-plus-sum is one fused multiply-add, as ik's compiled hc_pre,
    hc_post, mul_multi_add and ssm_conv compute them: the stream sums and the convolution written out with exact
    fused multiply-adds give every bit (the unfused forms other bits); hc_pre's gates are checked as formulas."""
    rng = np.random.default_rng(3)
    t, s, d = 7, 4, 40
    mixes = rng.standard_normal((t, 2 * s + s * s), dtype=np.float32)
    alpha, beta = rng.standard_normal(3, dtype=np.float32), rng.standard_normal(2 * s + s * s, dtype=np.float32)
    pre, post, m = hc_pre(mixes, alpha, beta, s, 2, 0.0, fused=True)
    sig = lambda v: 1 / (1 + np.exp(-v.astype(np.float64)))  # noqa: E731
    np.testing.assert_allclose(pre, sig(_fma32(mixes[:, :s], alpha[0], beta[:s])), rtol=1e-6)
    np.testing.assert_allclose(post, 2 * sig(_fma32(mixes[:, s : 2 * s], alpha[1], beta[s : 2 * s])), rtol=1e-6)
    streams = rng.standard_normal((t, s, d), dtype=np.float32)
    y = rng.standard_normal((t, d), dtype=np.float32)
    want = streams[:, 0] * pre[:, :1]
    for j in range(1, s):
        want = _fma32(streams[:, j], pre[:, j : j + 1], want)
    np.testing.assert_array_equal(hc_combine(streams, pre, fused=True), want)
    assert not np.array_equal(hc_combine(streams, pre), want)
    want = _fma32(post[:, :, None], y[:, None], m[:, 0, :, None] * streams[:, 0, None])
    for j in range(1, s):
        want = _fma32(m[:, j, :, None], streams[:, j, None], want)
    np.testing.assert_array_equal(hc_post(y, post, streams, m, fused=True), want)
    assert not np.array_equal(hc_post(y, post, streams, m), want)
    x, w = rng.standard_normal((12, d), dtype=np.float32), rng.standard_normal((d, 3), dtype=np.float32)
    padded = np.concatenate([np.zeros((2, d), np.float32), x])
    acc = padded[:-2] * w[:, 0]
    for k in (1, 2):
        acc = _fma32(w[:, k], padded[k : len(padded) - 2 + k], acc)
    np.testing.assert_array_equal(causal_conv_residual(x, w, fused=True), x + acc)
    assert not np.array_equal(causal_conv_residual(x, w), x + acc)


def test_causal_conv_against_numpy() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((12, 5), dtype=np.float32)
    w = rng.standard_normal((5, 3), dtype=np.float32)
    padded = np.vstack([np.zeros((2, 5), np.float32), x])
    want = x + sum(padded[k : k + 12] * w[:, k] for k in range(3))
    np.testing.assert_allclose(causal_conv_residual(x, w), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="channels"):
        causal_conv_residual(x, w[:4])


# ---- determinism -----------------------------------------------------------------------------------------------

def _run_with_threads(model: Model, tokens: np.ndarray, n: int) -> np.ndarray:
    numba.set_num_threads(n)
    try:
        return model.logits(tokens)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_identical_logits_at_any_thread_count(data_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    model = Model(_gguf(data_dir, kind))
    tokens = _tokens(data_dir, 7)
    two = min(2, numba.config.NUMBA_NUM_THREADS)
    serial = _run_with_threads(model, tokens, 1)
    np.testing.assert_array_equal(serial, _run_with_threads(model, tokens, two))
    # the tiny model's ops run serially; force every parallel kernel on and the logits must not move either
    monkeypatch.setattr("ikrun.ops.parallel.PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(moe, "PARALLEL_MIN_FLOPS", 0)
    np.testing.assert_array_equal(serial, _run_with_threads(model, tokens, 1))
    np.testing.assert_array_equal(serial, _run_with_threads(model, tokens, two))


def test_same_command_twice_gives_identical_output(data_dir: Path) -> None:
    base = data_dir / "logits" / V2 / "ik-base.kld"
    first = _kld(_gguf(data_dir), base, "--threads", "1")
    assert _kld(_gguf(data_dir), base, "--threads", "1") == first
    assert _kld(_gguf(data_dir), base, "--threads", "2") == first


# ---- bad input -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["blk.1.attn_o_conv.weight", "merge_mhc_phi.weight", "blk.0.attn_indexer_k.weight",
                                  "blk.2.exp_probs_b.bias", "blk.0.attn_param_sink_k_pe", "merge_mhc_alpha"])
def test_missing_tensor_is_named_before_compute(data_dir: Path, tmp_path: Path, name: str) -> None:
    broken = _rewrite(_gguf(data_dir), tmp_path / "broken.gguf", drop=(name,))
    with pytest.raises(ModelError, match=re.escape(name)):
        Model(broken)
    res = runner.invoke(app, ["logits", str(broken), "--tokens", "1,2"], env={"COLUMNS": "250"})
    assert res.exit_code == 2 and name in res.output


@pytest.mark.parametrize(("key", "value", "named"), [
    ("openpangu.mhc_num_stream", 2, "merge_mhc_phi.weight"),
    ("openpangu.param_sink_number", 4, "blk.0.attn_param_sink_kv"),
    ("openpangu.attention.kv_lora_rank", 16, "blk.0.attn_kv_a_norm.weight"),
    ("openpangu.attention.indexer.key_length", 16, "blk.0.attn_indexer_q_b.weight"),
    ("openpangu.attention.indexer.head_count", 3, "blk.0.attn_indexer_q_b.weight"),
    ("openpangu.expert_count", 8, "blk.1.ffn_gate_inp.weight"),
    ("openpangu.attention.value_length", 16, "blk.0.attn_v_b.weight"),
    ("openpangu.leading_dense_block_count", 2, "blk.1.ffn_gate.weight"),
])
def test_hyperparameters_that_disagree_with_tensors(data_dir: Path, tmp_path: Path, key: str, value: int,
                                                    named: str) -> None:
    broken = _rewrite(_gguf(data_dir), tmp_path / "broken.gguf", kv={key: value})
    with pytest.raises(ModelError, match=re.escape(named)):
        Model(broken)


@pytest.mark.parametrize(("kv", "named"), [
    ({"openpangu.swa_layers": [1, 2, 9]}, r"openpangu\.swa_layers names layer 9"),
    ({"openpangu.sliding_window_list": [16, 16]}, r"openpangu\.sliding_window_list has 2 entries"),
    ({"openpangu.mhc_recur_norm": 0}, r"openpangu\.mhc_recur_norm"),
    ({"openpangu.mhc_num_stream": 9}, r"openpangu\.mhc_num_stream 9"),
    ({"openpangu.attention.indexer.top_k": 0}, r"openpangu\.attention\.indexer\.top_k"),
    ({"openpangu.nextn_predict_layers": 4}, r"openpangu\.nextn_predict_layers 4"),
])
def test_inconsistent_hyperparameters_are_named(data_dir: Path, tmp_path: Path, kv: dict[str, Any],
                                                named: str) -> None:
    broken = _rewrite(_gguf(data_dir), tmp_path / "broken.gguf", kv=kv)
    with pytest.raises(ModelError, match=named):
        Model(broken)


def test_missing_required_key_is_named(data_dir: Path, tmp_path: Path) -> None:
    broken = _rewrite(_gguf(data_dir), tmp_path / "nokey.gguf", unset=("openpangu.mhc_recur_norm",))
    with pytest.raises(ModelError, match=r"openpangu\.mhc_recur_norm"):
        Model(broken)


# ---- the NextN block ------------------------------------------------------------------------------------------

def test_nextn_layer_is_loaded_but_not_run(data_dir: Path, tmp_path: Path) -> None:
    """The file's NextN block (blk.3) is shape-checked and left out of the main forward."""
    src = GGUFFile(_gguf(data_dir))
    rng = np.random.default_rng(3)
    noisy = {name: src.dequantize(name) + rng.standard_normal(src.info(name).shape).astype(np.float32)
             for name in src.tensors if name.startswith("blk.3.")}
    path = _rewrite(_gguf(data_dir), tmp_path / "mtp.gguf", drop=tuple(noisy), add=noisy)
    tokens = _tokens(data_dir, 2)
    np.testing.assert_array_equal(Model(path).logits(tokens), Model(_gguf(data_dir)).logits(tokens))
    noisy["blk.3.ffn_up_exps.weight"] = noisy["blk.3.ffn_up_exps.weight"][:, :16]
    bad = _rewrite(_gguf(data_dir), tmp_path / "mtp-bad.gguf", drop=tuple(noisy), add=noisy)
    with pytest.raises(ModelError, match=r"blk\.3\.ffn_up_exps\.weight"):
        Model(bad)


def test_sink_overread_is_openpangus_switch_alone(data_dir: Path) -> None:
    res = runner.invoke(app, ["logits", str(data_dir / "convert" / "qwen3" / "ik-f32.gguf"), "--tokens", "1,2",
                              "--ik-sink-overread"], env={"COLUMNS": "250"})
    assert res.exit_code == 2 and "--ik-sink-overread applies only to openpangu;" in " ".join(res.output.split())
    tokens = _tokens(data_dir, 3)
    exact, ik = Model(_gguf(data_dir)).logits(tokens), Model(_gguf(data_dir), options=IK).logits(tokens)
    assert compare_logits(ik, exact)["kld_mean"] > 1e-3
