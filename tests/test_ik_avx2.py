"""--numerics ik-avx2 against ik's AVX2 build (tests/data/logits/qwen3-avx2: this machine's native ik, no AVX-512):
its base-logits file byte for byte, every running PPL, and the bf16 file's printed KL-divergence; --numerics ik (the
AVX-512 build's float order) does not give them; what it does not reproduce is refused before any compute."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikquant import QuantizeOptions, file_type, quantize_model
from ikrun.cli import app
from ikrun.eval.evaluate import perplexity
from ikrun.eval.metrics import BaseLogitsFile
from ikrun.model import Model
from ikrun.options import RuntimeOptions
from tests.family_checks import assert_iks_forward, fa_off, ik_quantized
from tests.test_numerics import _printed

runner = CliRunner()
DATA = Path(__file__).parent / "data"
CONVERT, LOGITS = DATA / "convert" / "qwen3", DATA / "logits" / "qwen3-avx2"
DS3_AVX2 = DATA / "logits" / "deepseek-v3-avx2"
AVX2 = RuntimeOptions(numerics="ik-avx2")
#: the -fa off graph qwen3-avx2's runs were made with
AVX2_FA_OFF = RuntimeOptions(numerics="ik-avx2", flash_attn="off")


def test_ik_avx2_gives_iks_avx2_base_logits(tmp_path: Path) -> None:
    assert_iks_forward(Model(CONVERT / "ik-f32.gguf", options=AVX2_FA_OFF), LOGITS / "ik-base.kld",
                       LOGITS / "ik-f32-ppl.txt", tmp_path / "base.kld")


def test_ik_avx512_order_is_not_iks_avx2(tmp_path: Path) -> None:
    """The AVX-512 build's float order (--numerics ik) misses the AVX2 build's file: the check above can fail."""
    base = LOGITS / "ik-base.kld"
    out = tmp_path / "base.kld"
    perplexity(Model(CONVERT / "ik-f32.gguf", options=RuntimeOptions(numerics="ik", flash_attn="off")),
               np.asarray(BaseLogitsFile(base).tokens), save_base=out)
    assert out.read_bytes() != base.read_bytes()


def _kld(gguf: Path, numerics: str) -> dict[str, float]:
    res = runner.invoke(app, ["kld", str(gguf), "--base-logits", str(LOGITS / "ik-base.kld"), "--json",
                              "--numerics", numerics, "--flash-attn", "off"])
    assert res.exit_code == 0, res.output
    return dict(json.loads(res.stdout))


def _matches(got: dict[str, float], printed: Path) -> bool:
    """Every figure ik printed, to its last digit."""
    return all(abs(got[key] - value) <= (5.01e-6 if key == "same_top_p" else 5.01e-7)
               for key, value in _printed(printed).items())


def test_ik_avx2_bf16_kld_is_iks() -> None:
    """ik's AVX2 build multiplies bf16 weights in its float kernel with unrounded activations: every figure its
    --kl-divergence run printed for the bf16 file, to the last digit."""
    assert _matches(_kld(CONVERT / "ik-bf16.gguf", "ik-avx2"), LOGITS / "ik-bf16-kld.txt")


def test_ik_avx2_q8_0_kld_is_iks() -> None:
    """ik's AVX2 Q8_0_R8 kernel (qgemm.ORDER_R8_AVX2): every figure printed for the Q8_0 file (KLD 0.000579, PPL(Q)
    542.179591), which the AVX-512 build's order (--numerics ik) misses."""
    assert _matches(_kld(CONVERT / "ik-q8_0.gguf", "ik-avx2"), LOGITS / "ik-q8_0-kld.txt")
    assert not _matches(_kld(CONVERT / "ik-q8_0.gguf", "ik"), LOGITS / "ik-q8_0-kld.txt")


PLAN, PLAN_AVX2 = DATA / "logits" / "qwen3-plan", DATA / "logits" / "qwen3-plan-avx2"
#: the qwen3-plan files ik's AVX2 build ran (tests/data/logits/qwen3-plan-avx2): the types it converts first
PLAN_FILES = {**{t: DATA / "convert" / "qwen3-plan-quants" / f"ik-{t}.gguf"
                 for t in ("q8_0", "q4_k", "iq4_ks", "iq3_k", "iq2_k")},
              **{t: DATA / "convert" / "qwen3-plan-more" / f"ik-{t}.gguf"
                 for t in ("q5_k", "iqk-mix", "iq12-mix", "iq1_kt", "iq2_kt", "iq3_kt", "iq4_kt")}}


#: files ikquant makes again from ik-q8_0.gguf (--allow-requantize) for that run: file type, --pure, sha256 prefix
REQUANTIZED = {"q6_k": ("Q6_K", True, "8489cb6f96fefb36"), "iq4_ks-recipe": ("IQ4_KS", False, "470ff8ff33cc8dfc"),
               "q5_0": ("Q5_0", True, "22108b6ea2326744"), "q6_0": ("Q6_0", True, "3614b4c5ac980332"),
               "iq4_nl": ("IQ4_NL", True, "d8bdc8deb77e6396"), "mxfp4": ("MXFP4", True, "7b49ac0a5755cab1"),
               "iq4_xs": ("IQ4_XS", True, "c5eff3e529dacc8f"), "q2_k": ("Q2_K", True, "560f824896e12abd"),
               "q3_k_s": ("Q3_K_S", True, "eee79dbf4e7d4ded"), "iq3_xxs": ("IQ3_XXS", True, "8e5281071b1cee31"),
               "iq3_s": ("IQ3_S", True, "a127039d41e52d88")}


def _plan_kld(gguf: Path, numerics: str) -> dict[str, float]:
    res = runner.invoke(app, ["kld", str(gguf), "--base-logits", str(PLAN / "ik-base.kld"), "--json",
                              "--numerics", numerics, "--flash-attn", "off", "--ik-threads", "2"])
    assert res.exit_code == 0, res.output
    return dict(json.loads(res.stdout))


@pytest.mark.parametrize("name", sorted(set(PLAN_FILES) - {"q8_0"}))
def test_ik_avx2_converted_types_print_iks_figures(name: str) -> None:
    """Q4_K and Q5_K (to Q8_1), the IQK types and the 1- and 2-bit i-quants (to Q8_K_R8, the AVX-512 build's Q8_K_R16
    in 8-row groups multiplied in signed bytes: qgemm.ORDER_R8_AVX2 over 256-value blocks) and the trellis types
    (to Q8_0_R8) at 128 activation rows: every figure ik's AVX2 build printed for each file."""
    assert _matches(_plan_kld(PLAN_FILES[name], "ik-avx2"), PLAN_AVX2 / f"ik-{name}-kld.txt")


@pytest.mark.parametrize("name", sorted(REQUANTIZED))
def test_ik_avx2_requantized_files_print_iks_figures(name: str, tmp_path: Path) -> None:
    """Q6_K (to Q8_0_R8 from 64 activation rows), Q5_0, Q6_0, IQ4_NL, MXFP4 (to Q8_0_R8), IQ4_XS, Q2_K, Q3_K,
    IQ3_XXS and IQ3_S (to Q8_K_R8) on every matrix, and ik's IQ4_KS recipe (IQ4_KS, IQ5_K attn_v, Q6_K output: what users' IQ4_KS files hold): every
    figure ik's AVX2 build printed; --numerics ik misses them."""
    file_type_name, pure, digest = REQUANTIZED[name]
    gguf = tmp_path / f"{name}.gguf"
    quantize_model(PLAN_FILES["q8_0"], gguf, QuantizeOptions(file_type(file_type_name), pure=pure,
                                                             allow_requantize=True))
    assert hashlib.sha256(gguf.read_bytes()).hexdigest().startswith(digest)
    assert _matches(_plan_kld(gguf, "ik-avx2"), PLAN_AVX2 / f"ik-{name}-kld.txt")
    assert not _matches(_plan_kld(gguf, "ik"), PLAN_AVX2 / f"ik-{name}-kld.txt")


def test_ik_avx512_order_misses_iks_avx2_iq4_ks() -> None:
    """The check above can fail: the AVX-512 build's order (--numerics ik) prints other figures for IQ4_KS."""
    assert not _matches(_plan_kld(PLAN_FILES["iq4_ks"], "ik"), PLAN_AVX2 / "ik-iq4_ks-kld.txt")


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q5_0", "q6_0", "iq4_nl", "mxfp4"])
def test_ik_avx2_own_kernels_of_32_value_types_are_iks(name: str) -> None:
    """Below 32 activation rows ik's AVX2 build multiplies Q8_0 and IQ4_NL on their signed values and Q4_0, Q5_0, Q6_0
    and MXFP4 as its AVX-512 build does: own_kernel_order's integers give its ggml_mul_mat bit for bit
    (tests/data/logits/ik-bits), at 5 rows against 16 weight rows of 160 values and 7 against 32 of 256."""
    from ikquant.types import type_by_name
    from ikrun.numerics.ik.avx2 import own_kernel_order
    from ikrun.numerics.ik.formats import ik_kernel, integer_rows
    from ikrun.numerics.ik.qgemm import pack, qmatmul

    kernel = ik_kernel(name.upper())
    with np.load(DATA / "logits" / "ik-bits" / "ik-native-matmuls.npz") as f, \
            np.load(DATA / "logits" / "ik-bits" / "ik-avx2-native-matmuls.npz") as g:
        for case in (f"{name}-16x160-5", f"{name}-32x256-7"):
            rows, n = map(int, case.split("-")[1].split("x"))
            w, x, ik, avx512 = f[case + "-w"].reshape(rows, -1), f[case + "-x"], g[case], f[case + "-y"]
            assert kernel.ints is not None
            held = own_kernel_order(kernel, kernel.ints(w, type_by_name(name.upper()).require_codec().dequantize(w, n)))
            assert held is not None
            got = qmatmul(integer_rows(x, kernel.activation), pack(held))
            np.testing.assert_array_equal(got.view(np.uint32), ik.view(np.uint32))
            assert np.array_equal(ik.view(np.uint32), avx512.view(np.uint32)) == (name not in ("q8_0", "iq4_nl"))


def test_ik_avx2_refuses_the_own_kernels_of_converted_types() -> None:
    """Below 16 activation rows ik multiplies IQ2_KT weights in their own AVX2 kernel, which is not reproduced (the
    IQK types', IQ4_XS's, Q2_K's, Q3_K's and the i-quants' are, tests/test_iqk_native.py, test_iquant_native.py):
    refused, not replaced by another arithmetic."""
    res = runner.invoke(app, ["logits", str(PLAN_FILES["iq2_kt"]), "--tokens", "1,2", "--numerics", "ik-avx2"])
    assert res.exit_code == 2 and "not the kernel ik takes for 2 rows" in res.output, res.output


def test_ik_avx2_refuses_other_quant_types(tmp_path: Path) -> None:
    q4_1 = ik_quantized(CONVERT / "ik-f32.gguf", tmp_path / "q4_1.gguf", "Q4_1")
    res = runner.invoke(app, ["logits", str(q4_1), "--tokens", "1,2", "--numerics", "ik-avx2"])
    assert res.exit_code == 2 and "--numerics ik-avx2 does not reproduce ik's AVX2 kernels for Q4_1" in res.output, \
        res.output


@pytest.mark.parametrize("threads", [1, 2])
def test_ik_avx2_q8_0s_own_kernel_prints_iks_figures(threads: int) -> None:
    """ik's own AVX2 Q8_0 kernel (qgemm.ORDER_QX_0_AVX2): with two threads the tiny deepseek-v3's 32-row q_a and
    48-row KV projections give a thread fewer than 32 rows, so ik multiplies them in it rather than converting them
    (tests/data/logits/deepseek-v3-avx2); every printed figure of ik's AVX2 build with 1 and with 2 threads, which
    differ, so the kernel is what is tested."""
    printed = DS3_AVX2 / f"ik-q8_0-t{threads}-kld.txt"
    assert _printed(printed) != _printed(DS3_AVX2 / f"ik-q8_0-t{3 - threads}-kld.txt")
    res = runner.invoke(app, ["kld", str(DATA / "convert" / "deepseek-v3" / "ik-q8_0.gguf"), "--base-logits",
                              str(DATA / "logits" / "deepseek-v3" / "ik-base.kld"), "--json", "--numerics", "ik-avx2",
                              "--flash-attn", "off", "--ik-threads", str(threads)])
    assert res.exit_code == 0, res.output
    assert _matches(dict(json.loads(res.stdout)), printed)


GLM, GLM_ICTK = DATA / "convert" / "glm-dsa" / "ref-f32.gguf", DATA / "logits" / "glm-dsa-ictk"


def test_glm_dsa_ik_avx2_is_iks_avx2_build(tmp_path: Path) -> None:
    """GLM-5.x with ik's --dsa sink against this machine's ik: the default caches' base-logits file byte for byte
    (PPL 515.6411) and every figure of the q8_0 indexer cache's KL-divergence run (KLD 0.093825, PPL(Q) 536.412028;
    --numerics ik: 0.093823)."""
    options = RuntimeOptions(numerics="ik-avx2", dsa_sink=True)
    assert_iks_forward(Model(GLM, options=options), GLM_ICTK / "ik-base.kld", GLM_ICTK / "ik-base.txt",
                       tmp_path / "base.kld")
    res = runner.invoke(app, ["kld", str(GLM), "--base-logits", str(GLM_ICTK / "ik-base.kld"), "--json",
                              "--numerics", "ik-avx2", "--dsa-sink", "-ictk", "q8_0"])
    assert res.exit_code == 0, res.output
    assert _matches(json.loads(res.stdout), GLM_ICTK / "ik-ictk-q8_0-kld.txt")


PANGU, PANGU_ICTK = DATA / "convert" / "openpangu-v2" / "ik-f32.gguf", DATA / "logits" / "openpangu-v2-ictk"


def test_openpangu_ik_avx2_is_iks_avx2_build(tmp_path: Path) -> None:
    """openPangu (8 param sinks: ik's AVX2 GEMM reads them whole) against this machine's ik: the default caches'
    base-logits file byte for byte (PPL 569.5097) and every figure of the q8_0 indexer cache's run (KLD 0.011595,
    PPL(Q) 565.797767)."""
    assert_iks_forward(Model(PANGU, options=AVX2), PANGU_ICTK / "ik-base.kld", PANGU_ICTK / "ik-base.txt",
                       tmp_path / "base.kld")
    res = runner.invoke(app, ["kld", str(PANGU), "--base-logits", str(PANGU_ICTK / "ik-base.kld"), "--json",
                              "--numerics", "ik-avx2", "-ictk", "q8_0"])
    assert res.exit_code == 0, res.output
    assert _matches(json.loads(res.stdout), PANGU_ICTK / "ik-ictk-q8_0-kld.txt")


@pytest.mark.parametrize(("variant", "gguf"), [("qwen3-moe", "ik-f32.gguf"), ("glm4-moe", "ik-f32.gguf"),
                                             ("minimax-m2", "ref-f32.gguf"), ("qwen3-next", "ref-f32.gguf"),
                                             ("qwen35-moe", "ref-f32.gguf")])
def test_moe_families_are_iks_avx2_build(variant: str, gguf: str, tmp_path: Path) -> None:
    """qwen3moe, glm4moe, minimax-m2, qwen3next and qwen35moe (tests/data/logits/<variant>-avx2, 8 chunks): ik's
    base-logits file byte for byte with every running PPL (525.1843, 590.5826, 508.5050, 534.7389, 554.3415;
    --numerics ik: 525.1851, 590.5827, 508.5055, 534.7391, 554.3412)."""
    folder = DATA / "logits" / f"{variant}-avx2"
    base = folder / "ik-base.kld"
    model = DATA / "convert" / variant / gguf
    assert_iks_forward(Model(model, options=RuntimeOptions(numerics="ik-avx2", **fa_off(model))), base,
                       folder / "ik-base.txt", tmp_path / "avx2.kld")
    perplexity(Model(model, options=RuntimeOptions(numerics="ik", **fa_off(model))), np.asarray(BaseLogitsFile(base).tokens),
               save_base=tmp_path / "avx512.kld")
    assert (tmp_path / "avx512.kld").read_bytes() != base.read_bytes()


@pytest.mark.parametrize(("gguf", "extra", "message"), [
    (DATA / "convert" / "gpt-oss" / "ref-f32.gguf", [], "--numerics ik-avx2 does not reproduce ik's AVX2 "
     "arithmetic for gpt-oss"),
    (DATA / "convert" / "openpangu-v2" / "ik-f32.gguf", ["--ik-sink-overread"], "--ik-sink-overread reproduces "
     "ik's AVX-512 build"),
])
def test_ik_avx2_refuses_what_it_does_not_reproduce(gguf: Path, extra: list[str], message: str) -> None:
    res = runner.invoke(app, ["logits", str(gguf), "--tokens", "1,2", "--numerics", "ik-avx2", *extra])
    assert res.exit_code == 2 and message in res.output, res.output
