"""`--numerics ik` over quantized KV caches, against ik's AVX-512 build (tests/data/logits/ctk-avx512): its -fa off
K x Q matmul over every 32-value block key cache, its default flash attention over Q8_0 / Q4_0 / Q6_0 / IQ4_NL keys
and quantized values, and DeepSeek's Q8_0 MLA latent: every figure ik printed, to the digit, and its base-logits
files byte for byte."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.convert import Converter
from ikconvert.tiny import make_tiny_checkpoint
from ikrun.cli import app
from ikrun.eval.evaluate import perplexity
from ikrun.eval.metrics import BaseLogitsFile
from ikrun.model import Model
from ikrun.options import RuntimeOptions
from tests.family_checks import assert_iks_forward, iks_running_ppl, running_ppl
from tests.test_flash_attention_gqa import heads  # noqa: F401  (the fixture making the head-64/128 files)
from tests.test_ik_avx2 import _matches
from tests.test_ik_flash_attention import REAL_AVX512, real_heads  # noqa: F401  (the heads-192 DeepSeek-V3 files)
from tests.test_kv_cache import H128, H256, H256_SPEC, qwen3_h128  # noqa: F401  (the heads-128 qwen3 of the oracles)

runner = CliRunner()
DATA = Path(__file__).parent / "data"
LOGITS = DATA / "logits"
FOLDER = LOGITS / "ctk-avx512"
QWEN3 = DATA / "convert" / "qwen3" / "ik-f32.gguf"


def _flags(case: str) -> list[str]:
    """The cache flags of an oracle case: <k>, <k>-khad or <k>-ctv-<v>."""
    k, _, v = case.partition("-ctv-")
    name, _, khad = k.partition("-")
    return ["-ctk", name, *(["-khad"] if khad else []), *(["-ctv", v] if v else [])]


def _kld(model: Path, base: Path, case: str, *flags: str) -> dict[str, Any]:
    res = runner.invoke(app, ["kld", str(model), "--base-logits", str(base), "--json", "--numerics", "ik",
                              *_flags(case), *flags])
    assert res.exit_code == 0, res.output
    return dict(json.loads(res.stdout))


@pytest.mark.parametrize("case", ["q8_0", "q4_0", "q4_0-khad", "q6_0", "q6_0-khad", "iq4_nl", "q5_0", "q4_1",
                                  "q5_1"])
def test_ik_prints_iks_figures_with_a_quantized_k_cache(case: str) -> None:
    """ik's -fa off runs on qwen3 (heads of 32): the cache rows converted to Q8_0_R8 (Q4_1, Q5_1: Q8_1_R8) and
    multiplied in the AVX-512 build's integer gemms with the queries in Q8_2_X4. Every figure ik printed (mean KLD
    0.000048 for q8_0, 0.005078 for q4_0); its Q8_1_R8 gemm takes whole groups of four blocks only, so over q4_1 /
    q5_1 every q . k of a head of 32 is 0 (0.543938), which the report says."""
    got = _kld(QWEN3, LOGITS / "qwen3" / "ik-base.kld", case, "--flash-attn", "off", "--ik-threads", "2")
    assert _matches(got, FOLDER / f"qwen3-h32-off-ctk-{case}-kld.txt")
    assert ("ik_defect" in got) == (case in ("q4_1", "q5_1"))


@pytest.mark.parametrize("case", ["q4_1", "q5_1", "q5_1-khad", "q6_0"])
def test_ik_prints_iks_figures_with_heads_of_128(case: str, qwen3_h128: Path) -> None:  # noqa: F811
    """Heads of 128, where ik's AVX-512 Q8_1_R8 gemm takes every block (each group's four offsets first, then each
    block's whole sum): every figure ik printed (q4_1: mean KLD 0.000382, PPL(Q) 561.379987)."""
    got = _kld(qwen3_h128, H128 / "ik-base.kld", case, "--flash-attn", "off", "--ik-threads", "2")
    assert _matches(got, FOLDER / f"qwen3-h128-off-ctk-{case}-kld.txt")


def test_ik_writes_iks_base_logits_with_a_q4_1_k_cache(qwen3_h128: Path, tmp_path: Path) -> None:  # noqa: F811
    """ik's -fa off run with a Q4_1 key cache at heads of 128: its base-logits file byte for byte, every running
    PPL (561.3800 after 8 chunks)."""
    model = Model(qwen3_h128, options=RuntimeOptions(numerics="ik", ik_threads=2, flash_attn="off"),
                  cache_type_k="q4_1")
    assert_iks_forward(model, FOLDER / "qwen3-h128-off-ctk-q4_1-base.kld",
                       FOLDER / "qwen3-h128-off-ctk-q4_1-base.txt", tmp_path / "base.kld")


@pytest.mark.parametrize("head", [32, 128])
def test_ik_prints_iks_figures_with_a_bf16_k_cache(head: int, qwen3_h128: Path) -> None:  # noqa: F811
    """A BF16 key cache, -fa off: ik's AVX-512 bf16 kernel with the queries rounded to bf16 (the AVX2 build's float
    kernel takes them unrounded): every figure ik printed (mean KLD 0.000005 at heads of 32, 0.000001 at 128)."""
    model, base = (QWEN3, LOGITS / "qwen3" / "ik-base.kld") if head == 32 else (qwen3_h128, H128 / "ik-base.kld")
    got = _kld(model, base, "bf16", "--flash-attn", "off", "--ik-threads", "2")
    assert _matches(got, FOLDER / f"qwen3-h{head}-off-ctk-bf16-kld.txt")


def test_ik_writes_iks_base_logits_with_a_q8_kv_k_cache(tmp_path: Path) -> None:
    """A q8_KV key cache at heads of 256 (tests/data/logits/qwen3-h256-ctk): ik's AVX-512 base-logits file byte for
    byte, every running PPL (543.7236; the AVX2 build prints 543.7259)."""
    hf = make_tiny_checkpoint(tmp_path / "hf256", H256_SPEC)
    gguf = Converter(hf, "f32", pre_tokenizer="qwen2").write(tmp_path / "qwen3-h256-f32.gguf")
    assert hashlib.sha256(gguf.read_bytes()).hexdigest()[:16] == (H256 / "gguf.sha256").read_text().split()[0]
    model = Model(gguf, options=RuntimeOptions(numerics="ik", ik_threads=2, flash_attn="off"), cache_type_k="q8_KV")
    assert_iks_forward(model, FOLDER / "qwen3-h256-off-ctk-q8_KV-base.kld", FOLDER / "qwen3-h256-off-ctk-q8_KV-base.txt",
                       tmp_path / "base.kld")


@pytest.mark.parametrize(("folder", "gguf", "case"), [
    ("qwen3-moe", "ik-f32", "q4_0-khad"),
    ("glm4-moe", "ik-f32", "q8_0"),
    ("minimax-m2", "ref-f32", "q4_0"),
    ("minimax-m2", "ref-f32", "iq4_nl"),
])
def test_ik_quantized_k_cache_on_other_gqa_models(folder: str, gguf: str, case: str) -> None:
    """The MoE grouped-query models, -fa off, against their AVX-512 base runs: every figure ik printed."""
    got = _kld(DATA / "convert" / folder / f"{gguf}.gguf", LOGITS / folder / "ik-base.kld", case, "--flash-attn",
               "off")
    assert _matches(got, FOLDER / f"{folder}-ctk-{case}-kld.txt")


FLASH_CASES = [(head, case) for head in (32, 64, 128) for case in ("q8_0", "q4_0", "q4_0-khad", "q6_0", "iq4_nl")] \
    + [(head, case) for head in (64, 128) for case in ("q8_0-ctv-q8_0", "f16-ctv-q4_1")]


@pytest.mark.parametrize(("head", "case"), FLASH_CASES)
def test_ik_prints_iks_default_figures_with_quantized_caches(heads: dict[str, Path], head: int,  # noqa: F811
                                                             case: str) -> None:
    """ik's default runs (flash attention): at heads of 64 and 128 its own kernel (a Q8_0 cache repacked to
    Q8_0_R8; Q4_0, Q6_0 and IQ4_NL, the last unsigned on AVX-512, in their own kernel; quantized values decoded),
    at heads of 32 ggml's generic one (ik's AVX-512 Q8_0 kernel one key at a time; the misread Q4_0 / IQ4_NL query
    blocks and Q6_0's zeros of ik's): every figure ik printed, with the graph and ik's defect in the report."""
    got = _kld(heads[f"h{head}-f32.gguf"], LOGITS / "gqa-fa-avx2" / f"qwen3-h{head}-base.kld", case,
               "--ik-threads", "2")
    assert got["flash_attn"] == "on"
    assert _matches(got, FOLDER / f"qwen3-h{head}-fa-ctk-{case}-kld.txt")
    assert ("ik_defect" in got) == (head == 32 and case != "q8_0")


def test_ik_writes_iks_default_run_over_a_q8_0_mla_latent(real_heads: dict[str, Path],  # noqa: F811
                                                          tmp_path: Path) -> None:
    """DeepSeek-V3 (heads 192/128) with ik's defaults and -ctk q8_0 (the prefill form over the Q8_0 latent): with
    attn_kv_b in Q4_0 its base-logits file byte for byte, in Q8_0, F16 and BF16 every running PPL (485.4428,
    484.6011, 484.2438 where the AVX2 build prints 485.4561, 484.6069, 484.2409), and the Q4_0 file's KLD against
    the F32 file's default run to the digit (0.031743)."""
    options = RuntimeOptions(numerics="ik", ik_threads=1)
    assert_iks_forward(Model(real_heads["kvb-q4_0.gguf"], options=options, cache_type_k="q8_0"),
                       FOLDER / "kvb-q4_0-ctk-q8_0-base.kld", FOLDER / "kvb-q4_0-ctk-q8_0-base.txt",
                       tmp_path / "base.kld")
    tokens = np.asarray(BaseLogitsFile(FOLDER / "kvb-q4_0-ctk-q8_0-base.kld").tokens)
    for kv_b in ("q8_0", "f16", "bf16"):
        res = perplexity(Model(real_heads[f"kvb-{kv_b}.gguf"], options=options, cache_type_k="q8_0"), tokens)
        assert running_ppl(res.nll, res.n_chunk) == iks_running_ppl(FOLDER / f"kvb-{kv_b}-ctk-q8_0-base.txt")
    got = _kld(real_heads["kvb-q4_0.gguf"], REAL_AVX512 / "ik-base.kld", "q8_0", "--ik-threads", "1")
    assert _matches(got, FOLDER / "kvb-q4_0-ctk-q8_0-kld.txt")
