"""`--numerics ik`: the KL-divergence and perplexity ik's llama-perplexity prints, from ik's own quantized files and
base-logits files; the activation formats themselves; types it cannot reproduce refused before any compute."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ikquant.formats.numeric import f32_to_bf16_bits
from ikquant.types import type_by_name
from ikrun.cli import app
from ikrun.model import Model, ModelError, RuntimeOptions
from ikrun.ops.numerics import BF16, IK_KERNELS, Q8_2_X4, Q8_K, round_activations
from ikrun.ops.qgemm import BlockInts
from tests.test_qgemm import _q8_k_reference
from tests.test_runtime_deepseek2 import assert_thread_invariant

runner = CliRunner()
DATA = Path(__file__).parent / "data"
IK = RuntimeOptions(numerics="ik")


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """bf16 bits -> float32 (exact: bf16 is the top half of a float32), the tests' own reference."""
    return (np.ascontiguousarray(b).view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def _printed(path: Path) -> dict[str, float]:
    """What ik's --kl-divergence run printed: mean KLD, max KLD, PPL(Q), same top p (as a fraction)."""
    text = path.read_text(errors="replace")  # ik prints the token pieces it loads as raw bytes

    def num(pattern: str) -> float:
        return float(re.search(pattern, text).group(1))  # type: ignore[union-attr]

    return {"kld_mean": num(r"Mean    KLD:\s+([-0-9.]+)"), "kld_max": num(r"Maximum KLD:\s+([-0-9.]+)"),
            "ppl_q": num(r"Mean PPL\(Q\)\s+:\s+([0-9.]+)"), "same_top_p": num(r"Same top p:\s+([0-9.]+)") / 100}


def _kld(gguf: Path, base: Path, *extra: str) -> dict[str, Any]:
    res = runner.invoke(app, ["kld", str(gguf), "--base-logits", str(base), "--json", "--numerics", "ik", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _close(got: float, printed: float, rel: float) -> bool:
    """Within `rel` of a figure ik printed with 6 decimals (its own rounding allowed for)."""
    return abs(got - printed) <= rel * abs(printed) + 5e-7


# ---- ik's printed figures ---------------------------------------------------------------------------------------

def test_q8_0_reproduces_iks_kld_on_the_plan_model() -> None:
    """The issue's bar: mean KLD within 0.3% and PPL(Q) within 0.05% (the weights alone give 0.000401)."""
    logits = DATA / "logits" / "qwen3-plan"
    ik = _printed(logits / "ik-q8_0-kld.txt")
    got = _kld(DATA / "convert" / "qwen3-plan-quants" / "ik-q8_0.gguf", logits / "ik-base.kld")
    assert _close(got["kld_mean"], ik["kld_mean"], 0.003), (got["kld_mean"], ik)
    assert abs(got["ppl_q"] / ik["ppl_q"] - 1) < 5e-4, (got["ppl_q"], ik)
    assert got["kld_mean"] > 1.5 * _printed(logits / "ik-q8_0-as-f32-kld.txt")["kld_mean"]


@pytest.mark.parametrize("weights", ["q4_k", "iq4_ks", "iq3_k", "iq2_k"])
def test_types_whose_kernels_convert_the_weights_reproduce_iks_kld(weights: str) -> None:
    """K-quant and IQK files, whose weights ik converts before multiplying (Q8_1, Q8_K_R16) against Q8_2_X4 or Q8_K
    activations: the mean KLD within 0.3% of ik's (measured -0.05% .. 0.00%). Their PPL(Q) is 0.06-0.15% below
    ik's, a gap not explained yet, so it is not asserted here."""
    logits = DATA / "logits" / "qwen3-plan"
    ik = _printed(logits / f"ik-{weights}-kld.txt")
    got = _kld(DATA / "convert" / "qwen3-plan-quants" / f"ik-{weights}.gguf", logits / "ik-base.kld")
    assert _close(got["kld_mean"], ik["kld_mean"], 0.003), (got["kld_mean"], ik)
    weights_alone = _printed(logits / f"ik-{weights}-as-f32-kld.txt")["kld_mean"]
    assert abs(got["kld_mean"] - ik["kld_mean"]) < abs(weights_alone - ik["kld_mean"]) / 4


@pytest.mark.parametrize(("weights", "ppl_rel"), [("q5_k", 5e-4), ("iqk-mix", 5e-4), ("iq1_kt", None),
                                                  ("iq2_kt", None), ("iq3_kt", 5e-4), ("iq4_kt", 5e-4)])
def test_more_types_reproduce_iks_kld(weights: str, ppl_rel: float | None) -> None:
    """Q5_K converted to Q8_1; the IQK types of the mix (IQ2_KS, IQ2_KL, IQ3_KS, IQ4_K, IQ4_KSS, IQ5_K, IQ5_KS,
    IQ6_K) to Q8_K_R16; ik's CPU matmul multiplies IQ2_KT / IQ3_KT rows by 1.05 / 1.01 times the scale its
    dequantization uses (ikrun/ops/numerics.py): the mean KLD within 0.3% of ik's (measured -0.03% .. +0.067%), far
    from the weights-alone figure for IQ2_KT. PPL(Q) within 0.05% (measured -0.022% .. +0.018%) but for IQ1_KT and
    IQ2_KT, 0.05% above and 0.10% below ik's, the gap of the other low-bit types, so not asserted."""
    ik = _printed(DATA / "logits" / "qwen3-plan-more" / f"ik-{weights}-kld.txt")
    gguf = DATA / "convert" / "qwen3-plan-more" / f"ik-{weights}.gguf"
    base = DATA / "logits" / "qwen3-plan" / "ik-base.kld"
    got = _kld(gguf, base)
    assert _close(got["kld_mean"], ik["kld_mean"], 0.003), (got["kld_mean"], ik)
    if ppl_rel is not None:
        assert abs(got["ppl_q"] / ik["ppl_q"] - 1) < ppl_rel, (got["ppl_q"], ik)
    if weights == "iq2_kt":
        exact = json.loads(runner.invoke(app, ["kld", str(gguf), "--base-logits", str(base), "--json"]).stdout)
        assert ik["kld_mean"] - exact["kld_mean"] > 50 * abs(got["kld_mean"] - ik["kld_mean"])


IQUANTS = DATA / "logits" / "qwen3-plan-iquants"


@pytest.mark.parametrize(("weights", "ppl_rel"), [("iq2_xxs", 5e-4), ("iq2_xs", 5e-4), ("iq2_s", None),
                                                  ("iq1_s", None), ("iq1_m", None), ("iq12-mix", 5e-4)])
def test_the_1_and_2_bit_i_quants_reproduce_iks_kld(weights: str, ppl_rel: float | None) -> None:
    """Pure IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M files and the five in one file, converted to Q8_K_R16 against
    Q8_K activations: the mean KLD within 0.3% of ik's (measured -0.022% .. +0.007%) and at most half as far from it
    as the weights alone (the 0.3% bar alone would not tell the two apart). PPL(Q) within 0.05% (measured -0.035% ..
    +0.030%) but for IQ2_S, IQ1_S and IQ1_M, -0.11%, +0.11% and -0.06% from ik's: as far as two float orders of the
    emulation itself lie apart on these files (the same rounded products summed in integers or as floats move
    PPL(Q) by up to 0.11%), so not asserted."""
    mix = weights == "iq12-mix"
    ik = _printed(IQUANTS / f"ik-{weights}-kld.txt")
    alone = _printed(DATA / "logits" / "qwen3-plan-more" / "ik-iq12-mix-as-f32-kld.txt" if mix
                     else IQUANTS / f"ik-{weights}-as-f32-kld.txt")
    gguf = DATA / "convert" / "qwen3-plan-more" / "ik-iq12-mix.gguf" if mix else IQUANTS / f"ik-{weights}.gguf"
    got = _kld(gguf, DATA / "logits" / "qwen3-plan" / "ik-base.kld")
    assert _close(got["kld_mean"], ik["kld_mean"], 0.003), (got["kld_mean"], ik)
    assert abs(got["kld_mean"] - ik["kld_mean"]) < abs(alone["kld_mean"] - ik["kld_mean"]) / 2, (got, ik, alone)
    if ppl_rel is not None:
        assert abs(got["ppl_q"] / ik["ppl_q"] - 1) < ppl_rel, (got["ppl_q"], ik)


@pytest.mark.parametrize(("weights", "kld_rel"), [("q8_0", 0.003), ("bf16", 0.03)])
def test_qwen3_q8_0_and_bf16(weights: str, kld_rel: float) -> None:
    """bf16's KLD (2.0e-5) is printed with two digits; its PPL(Q) carries the check."""
    ik = _printed(DATA / "logits" / "qwen3" / f"ik-{weights}-kld.txt")
    got = _kld(DATA / "convert" / "qwen3" / f"ik-{weights}.gguf", DATA / "logits" / "qwen3" / "ik-base.kld")
    assert _close(got["kld_mean"], ik["kld_mean"], kld_rel), (got["kld_mean"], ik)
    assert abs(got["ppl_q"] / ik["ppl_q"] - 1) < 5e-4, (got["ppl_q"], ik)


def test_deepseek_v4_mxfp4_experts_reproduce_iks_kld_against_transformers() -> None:
    """ik's run of the reference file against transformers' logits (KLD 0.000667, all of it from rounding the
    activations of the MXFP4 experts): the exact forward gives ~0, --numerics ik ik's figures."""
    logits = DATA / "logits" / "deepseek-v4-flash"
    ik = _printed(logits / "ik-ref-f32-vs-hf-kld.txt")
    got = _kld(DATA / "convert" / "deepseek-v4-flash" / "ref-f32.gguf", logits / "hf-base.kld")
    assert _close(got["kld_mean"], ik["kld_mean"], 0.003) and abs(got["kld_max"] / ik["kld_max"] - 1) < 0.01, got
    assert abs(got["same_top_p"] - ik["same_top_p"]) < 1e-3
    against_ik = _kld(DATA / "convert" / "deepseek-v4-flash" / "ref-f32.gguf", logits / "ik-base.kld")
    assert against_ik["kld_mean"] < 2e-4 and against_ik["same_top_p"] > 0.99, against_ik


# ---- the formats --------------------------------------------------------------------------------------------

def test_q8_2_x4_blocks() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 96)) * rng.uniform(0.01, 10, (5, 1))).astype(np.float32)
    x[2, 32:64] = 0.0  # an all-zero block stays zero
    got = round_activations(x, Q8_2_X4)
    blocks = x.reshape(-1, 32)
    d = bf16_bits_to_f32(f32_to_bf16_bits(np.abs(blocks).max(axis=1) / np.float32(127)))
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
    q = np.clip(np.rint(blocks * inv[:, None]), -128, 127)
    np.testing.assert_array_equal(got, (q * d[:, None]).reshape(x.shape).astype(np.float32))
    assert np.all(got[2, 32:64] == 0) and len(np.unique(np.abs(got[0, :32]))) <= 128
    with pytest.raises(ValueError, match="whole 32-value"):
        round_activations(x[:, :40], Q8_2_X4)


def test_bf16_rounding_is_nearest_even() -> None:
    x = np.array([[1.0 + 2**-8, 1.0 + 3 * 2**-8, -3.14159, 1e-30]], dtype=np.float32)
    np.testing.assert_array_equal(round_activations(x, BF16), bf16_bits_to_f32(f32_to_bf16_bits(x)).reshape(x.shape))


def test_threads_do_not_change_a_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Model(DATA / "convert" / "deepseek-v3" / "ik-q8_0.gguf", options=IK)
    assert_thread_invariant(model, np.arange(1, 65) % model.n_vocab, monkeypatch)


def test_the_exact_mode_is_untouched() -> None:
    path = DATA / "convert" / "qwen3" / "ik-q8_0.gguf"
    tokens = np.arange(1, 40)
    exact, ik = Model(path).logits(tokens), Model(path, options=IK)
    assert ik.kv_cache == "f16"  # ik's default cache comes with its arithmetic
    assert not np.array_equal(exact, ik.logits(tokens))
    np.testing.assert_array_equal(exact, Model(path, options=RuntimeOptions(numerics="exact")).logits(tokens))


#: i-quant -> (activation rows from which ik converts it to Q8_K_R16, the c of its conversion, max |integer|)
IQUANT_CONVERSION = {"IQ2_XXS": (32, 124, 31 * 43), "IQ2_XS": (32, 124, 31 * 43), "IQ2_S": (16, 124, 31 * 43),
                     "IQ1_S": (32, 126, 15 * 9), "IQ1_M": (32, 126, 15 * 9)}


def _iquant_d(raw: np.ndarray, type_name: str) -> np.ndarray:
    """An i-quant's f16 block scale [rows, blocks], read on its own: the first two bytes of a block; for IQ1_M the
    top nibbles of the high bytes of its four scale words (bytes 49, 51, 53, 55), the first the lowest."""
    blocks = raw.reshape(raw.shape[0], -1, type_by_name(type_name).type_size)
    if type_name != "IQ1_M":
        return blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 49::2].astype(np.uint16) >> 4
    bits = nibbles[..., 0] | (nibbles[..., 1] << 4) | (nibbles[..., 2] << 8) | (nibbles[..., 3] << 12)
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)


@pytest.mark.parametrize("type_name", list(IQUANT_CONVERSION))
def test_i_quants_convert_to_the_integers_of_their_decoding(type_name: str) -> None:
    """Every decoded value of an i-quant block is an integer multiple of d / 8 ((2 s + 1) x level, or x (8 level +-
    1) for IQ1); ik's Q8_K_R16 conversion keeps those integers while max |p| < c and re-rounds them against max / c
    from there, bit for bit the array definition of convert_to_q8_k_r8 with c = 124 (IQ2) or 126 (IQ1). Where the
    integers are kept (IQ1 blocks whose scales stay low; an IQ2 block always has a sub-block at 31 x level >= 248)
    the converted weights are the decoding itself."""
    threshold, c, bound = IQUANT_CONVERSION[type_name]
    model = Model(IQUANTS / f"ik-{type_name.lower()}.gguf", options=IK)
    name = "blk.0.ffn_down.weight"
    raw = model.weights.encoding(name).raw.reshape(model.weights.info(name).n_rows, -1)
    decoded = model.weight(name)
    dsup = _iquant_d(raw, type_name) * np.float32(0.125)
    p = decoded.reshape(*dsup.shape, 256) / dsup[..., None]
    np.testing.assert_array_equal(p, np.rint(p))
    assert np.abs(p).max() <= bound and np.abs(p).max() >= c  # the blocks at the top are re-rounded
    kernel = IK_KERNELS[type_name]
    assert kernel.activation == Q8_K and kernel.convert_rows == threshold and kernel.convert is not None
    got = kernel.convert(np.ascontiguousarray(raw), decoded)
    q, scale = _q8_k_reference(decoded, dsup, c)
    np.testing.assert_array_equal(got.q, q)
    np.testing.assert_array_equal(got.scale, scale)
    kept = np.abs(p).max(axis=-1) < c
    assert kept.any() == type_name.startswith("IQ1")
    np.testing.assert_array_equal(got.to_float().reshape(p.shape)[kept], decoded.reshape(p.shape)[kept])


@pytest.mark.parametrize("type_name", list(IQUANT_CONVERSION))
def test_i_quants_multiply_in_integers_as_their_float_emulation(type_name: str) -> None:
    """From ik's threshold on (16 activation rows for IQ2_S, 32 for the others) a matmul multiplies the converted
    integers (qmatmul): the float product of the Q8_K-rounded activations and the converted weights, to float32
    accuracy; one row fewer, the rounded activations times the exact decoding."""
    threshold = IQUANT_CONVERSION[type_name][0]
    model = Model(IQUANTS / f"ik-{type_name.lower()}.gguf", options=IK)
    name = "blk.1.ffn_up.weight"
    x = np.random.default_rng(3).standard_normal((threshold, model.shape(name)[1])).astype(np.float32)
    converted = model.matmul_weight(name, threshold)
    assert not np.array_equal(converted, model.weight(name))
    want = round_activations(x, Q8_K).astype(np.float64) @ converted.T.astype(np.float64)
    np.testing.assert_allclose(model.project(x, name), want, rtol=0, atol=2e-6 * np.abs(want).max())
    np.testing.assert_array_equal(model.matmul_weight(name, threshold - 1), model.weight(name))
    native = round_activations(x[1:], Q8_K).astype(np.float64) @ model.weight(name).T.astype(np.float64)
    np.testing.assert_allclose(model.project(x[1:], name), native, rtol=0, atol=2e-6 * np.abs(native).max())


# ---- what it cannot reproduce ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q3_k_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ikquant.ftypes import file_type
    from ikquant.quantize import QuantizeOptions, quantize_model

    out = tmp_path_factory.mktemp("numerics") / "q3_k_s.gguf"  # 256 wide: whole K-quant blocks
    quantize_model(DATA / "convert" / "qwen3-plan-quants" / "ik-q8_0.gguf", out,
                   QuantizeOptions(file_type("Q3_K_S"), pure=True, allow_requantize=True))
    return out


def test_a_type_whose_ik_kernels_are_not_emulated_is_refused_before_compute(q3_k_file: Path) -> None:
    with pytest.raises(ModelError, match=r"--numerics ik does not reproduce ik's arithmetic for Q3_K \(\d+ "
                                         r"tensors, e\.g\. "):
        Model(q3_k_file, options=IK)
    res = runner.invoke(app, ["ppl", str(q3_k_file), "--text", str(DATA / "logits" / "qwen3" / "text.txt"),
                              "--numerics", "ik"])
    assert res.exit_code == 2 and "re-quantize" in res.output and "Traceback" not in res.output


def test_routed_experts_are_converted_per_expert_by_their_token_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """ik decides per expert (is_dequant_better on the rows routed to it): an expert with enough tokens is multiplied
    as converted, the others as stored. The tiny MoE models cannot hold a K-quant, so MXFP4 is given a marking
    conversion (x 2, its scales doubled) at 3 tokens here: the forward then multiplies those experts in integers
    and the others as floats."""
    import ikrun.ops.numerics as numerics

    path = DATA / "convert" / "deepseek-v4-flash" / "ref-f32.gguf"
    tokens = np.load(DATA / "hf-logits" / "deepseek-v4-flash" / "tokens.npy")[0]
    as_stored = Model(path, options=IK).logits(tokens)
    model = Model(path, options=IK)
    name = "blk.1.ffn_up_exps.weight"
    exact = model.weights.decode_experts(name, np.arange(4))
    stored = numerics.IK_KERNELS["MXFP4"].ints
    assert stored is not None

    def doubled(raw: np.ndarray, w: np.ndarray) -> BlockInts:
        ints = stored(raw, w)
        return BlockInts(ints.q, ints.scale * 2, ints.block)

    monkeypatch.setitem(numerics.IK_KERNELS, "MXFP4", numerics.IkKernel(numerics.Q8_2_X4, 3, doubled))
    mats = exact.copy()
    model.ik_convert_experts(name, np.arange(4), np.array([0, 2, 3, 40]), mats)
    np.testing.assert_array_equal(mats[:2], exact[:2])
    np.testing.assert_array_equal(mats[2:], exact[2:] * 2)
    assert not np.array_equal(model.logits(tokens), as_stored)  # the forward multiplies the converted experts


def test_a_swap_to_a_type_not_emulated_is_refused(tmp_path: Path) -> None:
    model = Model(DATA / "convert" / "qwen3" / "ik-q8_0.gguf", options=IK)
    with pytest.raises(ModelError, match="Q2_K weights"):
        model.swap("blk.0.attn_q.weight", type_by_name("Q2_K"), np.zeros(1, np.uint8))
    res = runner.invoke(app, ["sweep", str(DATA / "convert" / "qwen3" / "ik-q8_0.gguf"), "--text",
                              str(DATA / "logits" / "qwen3" / "text.txt"), "--types", "Q4_0,Q3_K", "--numerics", "ik",
                              "--ctx", "64", "--chunks", "1", "-o", str(tmp_path / "unused.json")])
    assert res.exit_code == 2 and "Q3_K weights" in res.output and not (tmp_path / "unused.json").exists()


def test_an_unknown_numerics_is_a_usage_error() -> None:
    res = runner.invoke(app, ["ppl", str(DATA / "convert" / "qwen3" / "ik-q8_0.gguf"), "--numerics", "fast"])
    assert res.exit_code == 2 and "fast" in res.output


def test_sweep_and_imatrix_run_with_iks_numerics(tmp_path: Path) -> None:
    """A sweep measured with ik's arithmetic records it, and a resume with the exact one is refused."""
    gguf, text = DATA / "convert" / "qwen3" / "ik-q8_0.gguf", DATA / "logits" / "qwen3" / "text.txt"
    out = tmp_path / "sweep.json"
    common = ["sweep", str(gguf), "--text", str(text), "--types", "Q4_0", "--ctx", "64", "--chunks", "1", "-o",
              str(out), "--tensors", "blk.0.attn_q.weight"]
    res = runner.invoke(app, [*common, "--numerics", "ik"])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["runtime"] == {"kv_cache": "f16", "numerics": "ik"}
    res = runner.invoke(app, common)
    assert res.exit_code == 2 and "numerics" in res.output
    imatrix = tmp_path / "ik.dat"
    res = runner.invoke(app, ["imatrix", str(gguf), "--text", str(text), "--ctx", "64", "--chunks", "1", "-o",
                              str(imatrix), "--numerics", "ik"])
    assert res.exit_code == 0 and imatrix.exists(), res.output


def test_weights_sharing_an_input_reuse_its_rounding_per_format() -> None:
    """Model.linears rounds its input once per activation format: the same bits as one linear per weight, with
    weights of two formats (Q8_0 against Q8_2_X4 rows, an IQ4_KS swapped in against Q8_K rows) on the input."""
    model = Model(DATA / "convert" / "qwen3-plan-quants" / "ik-q8_0.gguf", options=IK)
    name = "blk.0.attn_k.weight"
    codec = type_by_name("IQ4_KS").require_codec()
    model.swap(name, type_by_name("IQ4_KS"), codec.quantize(model.weight(name)))
    x = np.random.default_rng(0).standard_normal((40, model.shape(name)[1])).astype(np.float32)
    names = ["blk.0.attn_q", "blk.0.attn_k", "blk.0.attn_v"]
    for got, name in zip(model.linears(x, names), names):
        np.testing.assert_array_equal(got, model.linear(x, name))
