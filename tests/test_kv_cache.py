"""Quantized KV caches (--cache-type-k/-ctk, --cache-type-v/-ctv): ik's cache writes byte for byte, the cache holding
their exact decoding, what a quantized K cache costs, and the caches a model or an arithmetic cannot take."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.checkpoint import Checkpoint
from ikconvert.convert import Converter
from ikconvert.tiny import TinySpec, make_tiny_checkpoint
from ikquant.formats.cache_rows import cache_row_bytes
from ikquant.types import type_by_name
from ikrun.cli import app
from ikrun.errors import ModelError
from ikrun.eval.evaluate import open_base
from ikrun.model import Model
from ikrun.options import RuntimeOptions
from tests import ik_engine
from tests.family_checks import assert_iks_forward, fa_off_flags, hf_variant
from tests.test_ik_avx2 import _matches
from tests.test_ik_engine import mean_kld
from tests.test_numerics import _printed

runner = CliRunner()
DATA = Path(__file__).parent / "data"
GOLD = DATA / "kv-cache"
QWEN3 = DATA / "convert" / "qwen3" / "ik-f32.gguf"
QWEN3_BASE = DATA / "logits" / "qwen3" / "ik-base.kld"


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q6_0", "iq4_nl", "f16", "bf16"])
def test_cache_writes_are_the_bytes_iks_cpy_writes(name: str) -> None:
    """Rows of keys written into a cache of each type: the bytes ik's own from_float wrote (tools/ik_cache_rows.py,
    a native AVX2 build)."""
    rows = np.load(GOLD / "rows.npy")
    ik = np.fromfile(GOLD / f"ik-{name}.bin", dtype=np.uint8).reshape(len(rows), -1)
    same = cache_row_bytes(name.upper(), rows) == ik
    if name == "iq4_nl":  # the all-zero block (row 0, block 0) has scale 0 and whatever codes ik's buffer held
        assert not ik[0, :2].any()
        same[0, 2:18] = True
    assert same.all()


@pytest.mark.parametrize("name", ["q4_0", "q6_0", "iq4_nl"])
def test_cache_writes_are_not_llama_quantizes_rounding(name: str) -> None:
    """The cache quantizers of Q4_0 (ik's low-PPL variant), Q6_0 (reference codes, refitted scale) and IQ4_NL (no
    trial scales) write other bytes than the weight codecs: a cache run on the codec alone would measure another
    cache."""
    rows = np.load(GOLD / "rows.npy")
    ik = np.fromfile(GOLD / f"ik-{name}.bin", dtype=np.uint8).reshape(len(rows), -1)
    assert not np.array_equal(type_by_name(name.upper()).require_codec().quantize(rows), ik)


def test_the_cache_holds_the_decoded_cache_bytes() -> None:
    """What the attention reads back is the cache type's dequantize of ik's quantize, for K and V separately."""
    m = Model(QWEN3, cache_type_k="q4_0", cache_type_v="q8_0")
    x = np.random.default_rng(1).standard_normal((7, 2, 32)).astype(np.float32)
    for value, name in ((False, "Q4_0"), (True, "Q8_0")):
        codec = type_by_name(name).require_codec()
        want = codec.dequantize(cache_row_bytes(name, x.reshape(-1, 32)), 32).reshape(x.shape)
        got = m.ctx.kv_store(x, value=value)
        assert np.array_equal(got, want)
        assert not np.array_equal(got, x)


def _kld(*flags: str, model: Path = QWEN3, base: Path = QWEN3_BASE) -> dict:
    """The kld run's report; under ik's arithmetic ik's -fa off graph, that of the oracles here."""
    graph = fa_off_flags(model) if "--numerics" in flags else []
    res = runner.invoke(app, ["kld", str(model), "--base-logits", str(base), "--json", *flags, *graph])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_a_quantized_k_cache_costs_kld_in_the_order_of_its_bits() -> None:
    """qwen3 in F32 against ik's base run (F16 caches): an F32 K cache agrees to ~1e-6; q8_0 keys cost more, q4_0
    keys far more. The report names the caches."""
    f32, q8, q4 = (_kld("-ctk", name, "-ctv", "f16") for name in ("f32", "q8_0", "q4_0"))
    assert f32["kld_mean"] < 1e-5 < q8["kld_mean"] < q4["kld_mean"] / 10
    assert (q4["cache_type_k"], q4["cache_type_v"]) == ("q4_0", "f16")


@pytest.mark.parametrize(("model", "flags", "words"), [
    (QWEN3, ["-ctk", "q3_K"], ["--cache-type-k q3_K", "not a cache type ik takes"]),
    (DATA / "convert" / "qwen3-next" / "ref-f32.gguf", ["-ctk", "q8_0", "--numerics", "ik"],
     ["--cache-type-k q8_0", "--numerics ik ", "not a q8_0 key cache on qwen3next"]),
    (DATA / "convert" / "deepseek-v3" / "ik-f32.gguf", ["-ctk", "bf16", "--numerics", "ik-avx2"],
     ["--cache-type-k bf16", "not a bf16 key cache on deepseek2"]),
    (QWEN3, ["-ctk", "q4_1", "--numerics", "ik-avx2", "--flash-attn", "on"],
     ["--flash-attn on", "generic flash-attention kernel (heads of 32)", "not a q4_1 one", "--flash-attn off"]),
    (QWEN3, ["-ctv", "q5_0", "--numerics", "ik-avx2"], ["--cache-type-v q5_0", "under flash attention",
                                                       "not a q5_0 one"]),
    (QWEN3, ["-ctv", "q8_0", "--numerics", "ik-avx2", "--flash-attn", "off"],
     ["--cache-type-v q8_0", "only with flash attention"]),
    (DATA / "convert" / "deepseek-v3" / "ik-f32.gguf", ["-ctk", "q5_0", "--numerics", "ik-avx2"],
     ["--cache-type-k q5_0", "q8_0/q4_0/q6_0/iq4_nl as deepseek2's MLA latent", "not a q5_0 key cache on deepseek2"]),
    (DATA / "convert" / "gpt-oss" / "ref-f32.gguf", ["-ctk", "q8_0"], ["--cache-type-k q8_0", "key head size",
                                                                       "is 16"]),
    (DATA / "convert" / "deepseek-v3" / "ik-f32.gguf", ["-ctk", "q4_0"], ["--cache-type-k q4_0", "key head size",
                                                                          "is 48", "ik aborts"]),
    (DATA / "convert" / "deepseek-v3" / "ik-f32.gguf", ["-ctv", "q8_0"], ["--cache-type-v q8_0", "latent alone"]),
    (DATA / "convert" / "glm-dsa" / "ref-f32.gguf", ["-ctk", "q8_0"], ["--cache-type-k q8_0", "key head size",
                                                                        "is 48", "ik aborts"]),
    (DATA / "convert" / "deepseek-v3" / "ik-f32.gguf", ["-ctk", "f32", "--numerics", "ik"],
     ["--cache-type-k f32", "latent cache"]),
])
def test_caches_a_model_or_arithmetic_cannot_take_are_refused(model: Path, flags: list[str],
                                                              words: list[str]) -> None:
    res = runner.invoke(app, ["ppl", str(model), "--text", str(DATA / "logits" / "qwen3" / "text.txt"), *flags])
    assert res.exit_code == 2, res.output
    line = " ".join(res.output.split())
    assert all(w in line for w in words), res.output


def test_the_k_hadamard_transform_spreads_outliers_before_the_write() -> None:
    """-khad on qwen3 (heads of 32): a block of 32 around a quantized K cache, which holds the outlier-laden rows
    closer than the plain cache does (mean square error 0.0086 vs 0.0239); ik drops it around an F16 cache."""
    rows = np.load(GOLD / "rows.npy").reshape(-1, 4, 32)
    plain, rotated = Model(QWEN3, cache_type_k="q4_0"), Model(QWEN3, cache_type_k="q4_0", k_cache_hadamard=True)
    assert (plain.cache.k_hadamard, rotated.cache.k_hadamard) == (0, 32)
    err_plain = np.square(plain.ctx.kv_store(rows) - rows).mean()
    err_rotated = np.square(rotated.ctx.kv_store(rows) - rows).mean()
    assert err_rotated < 0.8 * err_plain
    assert Model(QWEN3, cache_type_k="f16", k_cache_hadamard=True).cache.k_hadamard == 0


def _mla_variant(folder: str, pre: str, width: int, nope: int, tmp_path: Path) -> Path:
    """The test checkpoint convert/`folder`/hf with kv_lora_rank `width` and `nope` key dims a head before the rope's
    (random q_b / kv_a / kv_b weights of those shapes, seeded), converted to F32 (pre-tokenizer `pre`): its latent
    cache rows are width + its rope dims, its key heads nope + them (a multiple of the cache type's block, or ik
    aborts)."""
    hf_src = DATA / "convert" / folder / "hf"
    cfg = json.loads((hf_src / "config.json").read_text())
    heads, rope, v = cfg["num_attention_heads"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    rng = np.random.default_rng(2)
    tensors = {}
    for name, t in Checkpoint(hf_src).iter_tensors():
        a = t.to_f32()
        if name.endswith("kv_a_proj_with_mqa.weight"):
            a = rng.normal(0, 0.1, (width + rope, a.shape[1])).astype(np.float32)
        elif name.endswith("kv_a_layernorm.weight"):
            a = rng.uniform(0.5, 1.5, width).astype(np.float32)
        elif name.endswith("kv_b_proj.weight"):
            a = rng.normal(0, 0.1, (heads * (nope + v), width)).astype(np.float32)
        elif name.endswith("q_b_proj.weight"):
            a = rng.normal(0, 0.1, (heads * (nope + rope), a.shape[1])).astype(np.float32)
        tensors[name] = ("F32", a)
    hf = hf_variant(hf_src, tmp_path, {"kv_lora_rank": width, "qk_nope_head_dim": nope}, tensors)
    return Converter(hf, "f32", pre).write(tmp_path / "m.gguf")


def test_the_glm_dsa_latent_cache_takes_the_k_cache_type(tmp_path: Path) -> None:
    """GLM-5 DSA runs DeepSeek's MLA graph in ik: its latent cache ([rope | latent] rows) takes -ctk as DeepSeek's
    does, in the exact arithmetic (ik's arithmetic over it is not reproduced: refused). Key heads of 64, latent rows
    of 96: q4_0 moves the logits more than q8_0."""
    gguf = _mla_variant("glm-dsa", "glm4", 80, 48, tmp_path)
    tokens = np.arange(1, 41)
    exact = Model(gguf).logits(tokens)
    moved = {name: np.abs(Model(gguf, cache_type_k=name).logits(tokens) - exact).max() for name in ("q8_0", "q4_0")}
    assert 0 < moved["q8_0"] < moved["q4_0"]
    with pytest.raises(ModelError, match="not a q8_0 key cache on glm-dsa"):
        Model(gguf, options=RuntimeOptions(numerics="ik"), cache_type_k="q8_0")


def test_the_mla_latent_cache_takes_the_k_cache_type(tmp_path: Path) -> None:
    """A DeepSeek model whose latent rows are 64 wide: -ctk sets the latent cache (ik's only cache with MLA), whose
    rounding moves the logits, q4_0 more than q8_0; -khad rotates its rows in blocks of 64."""
    gguf = _mla_variant("deepseek-v3", "deepseek-v3", 48, 48, tmp_path)
    tokens = np.arange(1, 41)
    exact = Model(gguf).logits(tokens)
    moved = {name: np.abs(Model(gguf, cache_type_k=name).logits(tokens) - exact).max() for name in ("q8_0", "q4_0")}
    assert 0 < moved["q8_0"] < moved["q4_0"]
    assert Model(gguf, cache_type_k="q4_0", k_cache_hadamard=True).cache.k_hadamard == 64


def test_iks_own_quantized_k_cache_is_the_one_modelled() -> None:
    """ik (the wheel) on the qwen3 F32 file with a q4_0 K cache, fa off, V f16: ikrun's exact arithmetic with the same
    caches is 9e-5 mean KL away from it, against 8.5e-3 for the F32 K cache that ignores it. What remains is ik's
    arithmetic (its K x Q kernel rounds the queries to 8 bits), measured here for q8_0 as 3.7e-5."""
    base = open_base(QWEN3_BASE, Model(QWEN3))
    tokens = np.asarray(base.tokens).reshape(-1)[:64]
    ik = ik_engine.logits(QWEN3, tokens.tolist(), type_k=type_by_name("Q4_0").id)
    same = mean_kld(ik, Model(QWEN3, cache_type_k="q4_0", cache_type_v="f16").logits(tokens))
    unmodelled = mean_kld(ik, Model(QWEN3, kv_cache="k-f32").logits(tokens))
    assert same < 0.02 * unmodelled


@pytest.mark.parametrize(("case", "flags"), [("q8_0", ["-ctk", "q8_0"]), ("q4_0", ["-ctk", "q4_0"]),
                                             ("q4_0-khad", ["-ctk", "q4_0", "-khad"])])
def test_iks_printed_figures_with_a_quantized_k_cache(case: str, flags: list[str]) -> None:
    """ik's llama-perplexity (native AVX2 build, fa off, V f16) on the qwen3 F32 file against its own base run:
    ikrun's exact arithmetic with the same caches lands within 1e-4 of its mean KLD and 1e-3 of its PPL(Q) (measured:
    2.9e-5 / 2.0e-4 for q8_0, 2.0e-5 / 3.3e-4 for q4_0, 4.4e-5 / 6.2e-4 for q4_0 with -khad); the rest is ik's
    arithmetic, which rounds the queries to 8 bits in its K x Q kernel."""
    ik = _printed(DATA / "logits" / "qwen3-ctk" / f"ik-ctk-{case}-kld.txt")
    ours = _kld(*flags, "-ctv", "f16")
    assert abs(ours["kld_mean"] - ik["kld_mean"]) < 1e-4
    assert abs(ours["ppl_q"] / ik["ppl_q"] - 1) < 1e-3


# ---- --numerics ik-avx2: ik's own K x Q over a quantized K cache (-fa off), against the native AVX2 build ----------
CTK, CTK_AVX2 = DATA / "logits" / "qwen3-ctk", DATA / "logits" / "ctk-avx2"


@pytest.mark.parametrize(("case", "flags"), [("q8_0", ["-ctk", "q8_0"]), ("q4_0", ["-ctk", "q4_0"]),
                                             ("q4_0-khad", ["-ctk", "q4_0", "-khad"])])
def test_ik_avx2_prints_iks_figures_with_a_quantized_k_cache(case: str, flags: list[str]) -> None:
    """The same runs of ik as above under --numerics ik-avx2 (the cache rows as the weight of ik's integer kernel,
    the queries rounded to Q8_2_X4, Hadamard-rotated first with -khad): every figure ik printed, to the digit (mean
    KLD 0.000048 / 0.005078 / 0.003913, where the exact arithmetic gives 1.9e-5 / 5.058e-3 / 3.869e-3)."""
    assert _matches(_kld(*flags, "--numerics", "ik-avx2", "--ik-threads", "2"), CTK / f"ik-ctk-{case}-kld.txt")


def test_ik_avx2_writes_iks_base_logits_with_a_hadamard_q4_0_k_cache(tmp_path: Path) -> None:
    """ik's base-logits file of a -ctk q4_0 -khad -fa off run (8 chunks, -t 2) byte for byte, with every running
    PPL."""
    model = Model(QWEN3, options=RuntimeOptions(numerics="ik-avx2", ik_threads=2, flash_attn="off"),
                  cache_type_k="q4_0", k_cache_hadamard=True)
    assert_iks_forward(model, CTK / "ik-ctk-q4_0-khad-base.kld", CTK / "ik-ctk-q4_0-khad-ppl.txt",
                       tmp_path / "base.kld")


@pytest.mark.parametrize(("folder", "gguf", "case", "flags"), [
    ("qwen3-moe", "ik-f32", "q4_0-khad", ["-ctk", "q4_0", "-khad"]),
    ("glm4-moe", "ik-f32", "q8_0", ["-ctk", "q8_0"]),
    ("minimax-m2", "ref-f32", "q4_0", ["-ctk", "q4_0"]),
    ("minimax-m2", "ref-f32", "iq4_nl", ["-ctk", "iq4_nl", "--flash-attn", "off"]),
])
def test_ik_avx2_quantized_k_cache_on_other_gqa_models(folder: str, gguf: str, case: str, flags: list[str]) -> None:
    """The other grouped-query models ik-avx2 reproduces, against their AVX2 base runs: every figure ik printed
    with the quantized K cache, to the digit."""
    got = _kld(*flags, "--numerics", "ik-avx2", model=DATA / "convert" / folder / f"{gguf}.gguf",
               base=DATA / "logits" / f"{folder}-avx2" / "ik-base.kld")
    assert _matches(got, CTK_AVX2 / f"{folder}-ctk-{case}-kld.txt")


# ---- the other K cache types ik's -fa off graph multiplies in its AVX2 build's integer gemms ------------------------
#: the types ik converts to Q8_0_R8 (their integers kept) and to Q8_1_R8 (Q4_1, Q5_1: their codes and min), and
#: BF16, which its F16 cache's float kernel multiplies with the queries unrounded (AVX2 has no bf16 kernel)
MORE_KEYS = ["q6_0", "iq4_nl", "q5_0", "q4_1", "q5_1", "bf16"]


def _ctk(case: str) -> list[str]:
    """The cache flags of an oracle case: <type> or <type>-khad."""
    name, _, khad = case.partition("-")
    return ["-ctk", name, *(["-khad"] if khad else [])]


@pytest.mark.parametrize("case", [*MORE_KEYS, "q6_0-khad"])
def test_ik_avx2_prints_iks_figures_with_more_k_cache_types(case: str) -> None:
    """ik's -fa off runs with these K caches on qwen3 (heads of 32) under --numerics ik-avx2: every figure ik
    printed, to the digit (bf16: mean KLD 0.000002; q6_0 -khad 0.000275). Its AVX2 Q8_1_R8 kernel multiplies whole
    groups of 4 blocks only, so over a q4_1 / q5_1 cache every q . k of a head of 32 is 0 (uniform attention): the
    report says so."""
    got = _kld(*_ctk(case), "--numerics", "ik-avx2", "--ik-threads", "2")
    assert _matches(got, CTK / f"ik-ctk-{case}-kld.txt")
    assert ("ik_defect" in got) == (case in ("q4_1", "q5_1"))
    assert got["k_cache_hadamard"] == (32 if case.endswith("khad") else 0)


@pytest.mark.parametrize("case", ["q6_0", "q5_1"])
def test_ik_avx2_refuses_the_types_own_k_cache_kernels(case: str) -> None:
    """With fewer than 32 cache cells a thread (--ik-threads 36: 9 threads a head over 256 cells) ik multiplies the
    cache in the type's own kernel, whose AVX2 order is not reproduced: refused in one line."""
    res = runner.invoke(app, ["kld", str(QWEN3), "--base-logits", str(QWEN3_BASE), "-ctk", case, "--numerics",
                              "ik-avx2", "--flash-attn", "off", "--ik-threads", "36"])
    assert res.exit_code == 2 and "9 ik threads a head, in the type's own kernel" in " ".join(res.output.split()), \
        res.output


H128 = DATA / "logits" / "qwen3-h128-ctk"
#: ikconvert's qwen3 checkpoint with heads of 128 values (4 blocks: ik's Q8_1_R8 kernel multiplies them all)
H128_SPEC = TinySpec(head_dim=128, n_merges=40, seed=7)


@pytest.fixture(scope="module")
def qwen3_h128(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The F32 file ik's oracle runs took (tests/data/logits/qwen3-h128-ctk/README.md), rebuilt: the same bytes."""
    folder = tmp_path_factory.mktemp("h128")
    hf = make_tiny_checkpoint(folder / "hf128", H128_SPEC)
    gguf = Converter(hf, "f32", pre_tokenizer="qwen2").write(folder / "qwen3-h128-f32.gguf")
    assert hashlib.sha256(gguf.read_bytes()).hexdigest()[:16] == (H128 / "gguf.sha256").read_text().split()[0]
    return gguf


@pytest.mark.parametrize("case", ["q4_1", "q5_1", "q6_0", "q5_1-khad"])
def test_ik_avx2_prints_iks_figures_with_heads_of_128(case: str, qwen3_h128: Path) -> None:
    """Heads of 128, where ik's AVX2 Q8_1_R8 kernel takes every block (its offsets of 4 blocks first, then each
    block's two 16-value sums scaled one at a time) against ik's own -fa off base run: every figure ik printed."""
    got = _kld(*_ctk(case), "--numerics", "ik-avx2", "--ik-threads", "2", model=qwen3_h128,
               base=H128 / "ik-base.kld")
    assert _matches(got, H128 / f"ik-ctk-{case}-kld.txt")
    assert "ik_defect" not in got


def test_ik_avx2_writes_iks_base_logits_with_a_q5_1_k_cache(qwen3_h128: Path, tmp_path: Path) -> None:
    """ik's base-logits file of a -ctk q5_1 -fa off run on heads of 128 (8 chunks, -t 2) byte for byte, with every
    running PPL."""
    model = Model(qwen3_h128, options=RuntimeOptions(numerics="ik-avx2", ik_threads=2, flash_attn="off"),
                  cache_type_k="q5_1")
    assert_iks_forward(model, H128 / "ik-ctk-q5_1-base.kld", H128 / "ik-ctk-q5_1-ppl.txt", tmp_path / "base.kld")


H256 = DATA / "logits" / "qwen3-h256-ctk"
#: the checkpoint behind its oracles (its README)
H256_SPEC = TinySpec(head_dim=256, heads=2, kv_heads=1, n_merges=40, seed=8)


def test_ik_avx2_writes_iks_base_logits_with_a_q8_kv_k_cache(tmp_path: Path) -> None:
    """A q8_KV key cache on heads of 256 (ik's Q8_KV kernel takes rows of 256 values and more: the keys and the
    queries each with one f32 scale a head's row, a score (scale x scale) x their integer dot product): ik's
    base-logits file of its -fa off run byte for byte, with every running PPL; heads of 32 are refused (ik leaves
    those scores unwritten)."""
    hf = make_tiny_checkpoint(tmp_path / "hf256", H256_SPEC)
    gguf = Converter(hf, "f32", pre_tokenizer="qwen2").write(tmp_path / "qwen3-h256-f32.gguf")
    assert hashlib.sha256(gguf.read_bytes()).hexdigest()[:16] == (H256 / "gguf.sha256").read_text().split()[0]
    options = RuntimeOptions(numerics="ik-avx2", ik_threads=2, flash_attn="off")
    assert_iks_forward(Model(gguf, options=options, cache_type_k="q8_KV"), H256 / "ik-ctk-q8_KV-base.kld",
                       H256 / "ik-ctk-q8_KV-ppl.txt", tmp_path / "base.kld")
    res = runner.invoke(app, ["kld", str(QWEN3), "--base-logits", str(QWEN3_BASE), "-ctk", "q8_KV", "--numerics",
                              "ik-avx2", "--flash-attn", "off"])
    assert res.exit_code == 2 and "heads of 32" in res.output and "never written" in res.output, res.output
