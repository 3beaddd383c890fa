"""`--flash-attn` over a Q8_0, Q4_0, Q6_0 or IQ4_NL key cache: ik's default attention graph against ik's default runs
with -ctk <type> on a native AVX2 ik (tests/data/logits/gqa-fa-ctk-avx2): its own flash-attention kernel for qwen3
heads of 64 and 128 (a Q8_0 cache repacked to Q8_0_R8 and multiplied in integers with the queries in Q8_2_X4, the
others in their type's kernel as stored), ggml's generic one (ik's Q8_0 kernel one query row and one key at a time; over Q4_0 ik's misread
query blocks) for the test models' heads of 32; the -fa off graph (what auto computed before) misses them; the
combinations not ported refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ikrun.cli import app
from ikrun.eval.evaluate import perplexity
from ikrun.eval.metrics import BaseLogitsFile
from ikrun.kvcache import KvCache
from ikrun.model import Model
from ikrun.numerics.ik.iqk_flash_attention import kernel_row_calls
from ikrun.options import RuntimeOptions
from tests.family_checks import assert_iks_forward, iks_running_ppl, running_ppl
from tests.test_flash_attention_gqa import heads  # noqa: F401  (the fixture making the head-64/128 files)
from tests.test_numerics import _printed

runner = CliRunner()
DATA = Path(__file__).parent / "data"
FOLDER = DATA / "logits" / "gqa-fa-ctk-avx2"
DEFAULT_BASE = DATA / "logits" / "gqa-fa-avx2"
CONVERT = DATA / "convert"


def _model(path: Path, flash_attn: str = "auto", cache: str = "q8_0") -> Model:
    return Model(path, options=RuntimeOptions(numerics="ik-avx2", ik_threads=2, flash_attn=flash_attn),
                 cache_type_k=cache)


@pytest.mark.parametrize("head", [32, 64, 128])
def test_ik_avx2_ctk_q8_0_is_iks_default_run(heads: dict[str, Path], head: int, tmp_path: Path) -> None:  # noqa: F811
    """ik's default run of the F32 files with -ctk q8_0: its base-logits file byte for byte with every running PPL
    (heads of 32: PPL 542.8500; 64: 802.6416; 128: 826.4552); the -fa off graph (what auto computed before: PPL
    543.0119 / 802.6414 / 826.4548) misses it."""
    base, printed = FOLDER / f"qwen3-h{head}-ctk-q8_0-base.kld", FOLDER / f"qwen3-h{head}-ctk-q8_0-base.txt"
    model = heads[f"h{head}-f32.gguf"]
    assert_iks_forward(_model(model), base, printed, tmp_path / "fa.kld")
    perplexity(_model(model, "off"), np.asarray(BaseLogitsFile(base).tokens), save_base=tmp_path / "off.kld")
    assert (tmp_path / "off.kld").read_bytes() != base.read_bytes()


def _kld(model: Path, base: Path, cache: str = "q8_0") -> dict[str, Any]:
    res = runner.invoke(app, ["kld", str(model), "--base-logits", str(base), "--json", "--numerics", "ik-avx2",
                              "--ik-threads", "2", "-ctk", cache])
    assert res.exit_code == 0, res.output
    return dict(json.loads(res.stdout))


@pytest.mark.parametrize("head", [32, 64, 128])
def test_ik_avx2_ctk_q8_0_kld_is_what_ik_prints_by_default(heads: dict[str, Path], head: int) -> None:  # noqa: F811
    """The Q8_0 files with -ctk q8_0 against ik's default (F16-cache) base: every figure ik printed, to the digit
    (heads of 32: KLD 0.000632, PPL(Q) 543.223725; 64: 0.000134, 802.531361; 128: 0.000132, 825.598201); the
    report names the graph. The -fa off graph prints KLD 0.000623, PPL(Q) 542.047431 at 32, PPL(Q) 802.451363 at 64 and the same figures at 128 (the Q8_0 matmul after attention rounds
    its activations to int8, which absorbs the two graphs' difference there)."""
    got = _kld(heads[f"h{head}-q8_0.gguf"], DEFAULT_BASE / f"qwen3-h{head}-base.kld")
    assert got["flash_attn"] == "on" and "ik_defect" not in got
    for key, value in _printed(FOLDER / f"qwen3-h{head}-ctk-q8_0-kld.txt").items():
        assert abs(got[key] - value) <= (5.01e-6 if key == "same_top_p" else 5.01e-7), key


@pytest.mark.parametrize(("folder", "gguf"), [("qwen3-moe", "ik-f32"), ("glm4-moe", "ik-f32"),
                                              ("minimax-m2", "ref-f32")])
def test_ik_avx2_ctk_q8_0_is_iks_default_run_on_the_other_gqa_models(folder: str, gguf: str, tmp_path: Path) -> None:
    """qwen3moe (PPL 523.3148), glm4moe (590.7626) and minimax-m2 (509.2873), heads of 32, -ctk q8_0: ik's default
    run byte for byte."""
    assert_iks_forward(_model(CONVERT / folder / f"{gguf}.gguf"), FOLDER / f"{folder}-ctk-q8_0-base.kld",
                       FOLDER / f"{folder}-ctk-q8_0-base.txt", tmp_path / "fa.kld")


@pytest.mark.parametrize(("folder", "gguf", "ppl"), [("qwen3", "ik-f32", "476.7251"), ("qwen3-moe", "ik-f32", "562.5884"),
                                                     ("glm4-moe", "ik-f32", "516.4841"),
                                                     ("minimax-m2", "ref-f32", "512.5022")])
def test_ik_avx2_ctk_q4_0_is_iks_default_run_at_heads_of_32(folder: str, gguf: str, ppl: str, tmp_path: Path) -> None:
    """ggml's generic kernel over a Q4_0 key cache, which on ik's AVX2 build reads each Q8_2 query block as a Q8_0
    one (key_cache.q4_0_misread_key_products): ik's default run byte for byte (PPL as named; the -fa off graph,
    what auto computed before: 539.7396, 522.6608, 589.2986, 523.2597)."""
    name = "qwen3-h32" if folder == "qwen3" else folder
    printed = FOLDER / f"{name}-ctk-q4_0-base.txt"
    assert f"= {ppl} +/-" in printed.read_text(errors="replace")
    assert_iks_forward(_model(CONVERT / folder / f"{gguf}.gguf", cache="q4_0"), FOLDER / f"{name}-ctk-q4_0-base.kld",
                       printed, tmp_path / "fa.kld")


def test_ik_avx2_ctk_q4_0_kld_is_what_ik_prints_by_default() -> None:
    """The qwen3 Q8_0 file with -ctk q4_0 against ik's default base: every figure ik printed, to the digit (KLD
    0.921939, PPL(Q) 514.086648, same top 0.806%: ik's misread query blocks; the -fa off graph gives 0.005102,
    540.197088)."""
    got = _kld(CONVERT / "qwen3" / "ik-q8_0.gguf", DEFAULT_BASE / "qwen3-h32-base.kld", "q4_0")
    assert got["flash_attn"] == "on" and "misread" in got["ik_defect"]  # the report says the figures are ik's error
    for key, value in _printed(FOLDER / "qwen3-h32-ctk-q4_0-kld.txt").items():
        assert abs(got[key] - value) <= (5.01e-6 if key == "same_top_p" else 5.01e-7), key


@pytest.mark.parametrize("head", [64, 128])
def test_ik_avx2_ctk_q4_0_is_iks_default_run_in_its_own_kernel(heads: dict[str, Path], head: int,  # noqa: F811
                                                                tmp_path: Path) -> None:
    """ik's own flash-attention kernel over a Q4_0 key cache (Q4_0's kernel as stored, key_cache.iqk_fa_key_products:
    heads of 64 its per-block lanes, 128 its 4-block groups): every running PPL ik printed (64: 801.5170; 128:
    824.9939) and at 64 its base-logits file byte for byte. The -fa off graph, what auto computed before, writes
    1605 other bytes at 64 and ends at 824.9940 at 128."""
    base, printed = FOLDER / f"qwen3-h{head}-ctk-q4_0-base.kld", FOLDER / f"qwen3-h{head}-ctk-q4_0-base.txt"
    model = _model(heads[f"h{head}-f32.gguf"], cache="q4_0")
    if base.exists():
        assert_iks_forward(model, base, printed, tmp_path / "fa.kld")
        return
    res = perplexity(model, np.asarray(BaseLogitsFile(DEFAULT_BASE / f"qwen3-h{head}-base.kld").tokens))
    assert running_ppl(res.nll, res.n_chunk) == iks_running_ppl(printed)


@pytest.mark.parametrize("head", [64, 128])
def test_ik_avx2_ctk_q4_0_kld_in_its_own_kernel_is_what_ik_prints(heads: dict[str, Path], head: int) -> None:  # noqa: F811
    """The Q8_0 files with -ctk q4_0 against ik's default base: every figure ik printed, to the digit (heads of 64:
    KLD 0.000551, PPL(Q) 802.094367; 128: 0.000508, 824.598188)."""
    got = _kld(heads[f"h{head}-q8_0.gguf"], DEFAULT_BASE / f"qwen3-h{head}-base.kld", "q4_0")
    assert got["flash_attn"] == "on" and "ik_defect" not in got
    for key, value in _printed(FOLDER / f"qwen3-h{head}-ctk-q4_0-kld.txt").items():
        assert abs(got[key] - value) <= (5.01e-6 if key == "same_top_p" else 5.01e-7), key


def _call_sizes(n: int, n_head: int, threads: int, n_cells: int) -> set[int]:
    return set(kernel_row_calls(n, n_head, threads, n_cells)[0].tolist())


def test_kernel_query_rows_follow_iks_steps() -> None:
    """ik's own kernel hands its K x Q kernel 8 rows a call in steps of 8; 12 rows (GLM's special step) as 8 + 4; 7
    rows as 4, then one at a time; over 512 cells and more 64-row steps; its threads split rows when they outnumber
    the heads."""
    assert _call_sizes(64, 4, 2, 256) == {8}
    assert _call_sizes(12, 4, 2, 256) == {8, 4}
    assert _call_sizes(15, 4, 2, 256) == {8, 1}
    assert _call_sizes(7, 4, 2, 256) == {4, 1}
    assert _call_sizes(200, 4, 2, 512) == {8}
    assert _call_sizes(20, 2, 4, 256) == {8, 1}  # 2 threads a head: 10 rows each, 8 + 1 + 1


@pytest.mark.parametrize(("cache", "head", "ppl"), [("q6_0", 64, "802.7677"), ("q6_0", 128, "826.4400"),
                                                   ("iq4_nl", 64, "802.8922"), ("iq4_nl", 128, "826.9479")])
def test_ik_avx2_ctk_q6_0_and_iq4_nl_are_iks_default_run_in_its_own_kernel(heads: dict[str, Path], cache: str,  # noqa: F811
                                                                            head: int, ppl: str,
                                                                            tmp_path: Path) -> None:
    """ik's own flash-attention kernel over a Q6_0 (biased by 32, as Q4_0 by 8) or IQ4_NL (its signed kernel,
    mul_mat_qX_0_q8_0_T) key cache: every running PPL ik printed (as named) and at 128 its base-logits file byte for
    byte; the -fa off graph (what auto computed before) misses them: it ends at 802.7685, 826.4399, 802.8919 and
    826.9478."""
    base, printed = FOLDER / f"qwen3-h{head}-ctk-{cache}-base.kld", FOLDER / f"qwen3-h{head}-ctk-{cache}-base.txt"
    assert f"= {ppl} +/-" in printed.read_text(errors="replace")
    model = _model(heads[f"h{head}-f32.gguf"], cache=cache)
    if base.exists():
        assert_iks_forward(model, base, printed, tmp_path / "fa.kld")
        return
    res = perplexity(model, np.asarray(BaseLogitsFile(DEFAULT_BASE / f"qwen3-h{head}-base.kld").tokens))
    assert running_ppl(res.nll, res.n_chunk) == iks_running_ppl(printed)


@pytest.mark.parametrize(("cache", "head"), [("q6_0", 64), ("q6_0", 128), ("iq4_nl", 64), ("iq4_nl", 128)])
def test_ik_avx2_ctk_q6_0_and_iq4_nl_kld_is_what_ik_prints(heads: dict[str, Path], cache: str,  # noqa: F811
                                                           head: int) -> None:
    """The Q8_0 files with -ctk q6_0 / iq4_nl against ik's default base: every figure ik printed, to the digit
    (q6_0: KLD 0.000157, PPL(Q) 801.945504 at 64; 0.000158, 825.876850 at 128; iq4_nl: 0.000474, 802.824998;
    0.000453, 826.307986)."""
    got = _kld(heads[f"h{head}-q8_0.gguf"], DEFAULT_BASE / f"qwen3-h{head}-base.kld", cache)
    assert got["flash_attn"] == "on" and "ik_defect" not in got
    for key, value in _printed(FOLDER / f"qwen3-h{head}-ctk-{cache}-kld.txt").items():
        assert abs(got[key] - value) <= (5.01e-6 if key == "same_top_p" else 5.01e-7), key


@pytest.mark.parametrize(("cache", "ppl", "says"), [("q6_0", "521.7585", "zero q . k"),
                                                   ("iq4_nl", "515.3061", "misread")])
def test_ik_avx2_ctk_q6_0_and_iq4_nl_are_iks_default_run_at_heads_of_32(cache: str, ppl: str, says: str,
                                                                        tmp_path: Path) -> None:
    """At heads of 32 ggml's generic kernel rounds the queries to Q8_2_X4 and hands them to dots that ask ik for a
    Q8_1 (Q6_0) or Q8_0 (IQ4_NL) query; ik declines both: Q6_0's dot writes 0 (every key weighs the same), IQ4_NL's
    reads the block as a Q8_0 one (key_cache.iq4_nl_misread_key_products). ik's default run byte for byte (PPL as
    named); the Q8_0 file against ik's F16-cache base: every figure ik printed (KLD 0.505458, PPL(Q) 523.801955;
    0.921300, 528.229305), the report naming ik's defect."""
    printed = FOLDER / f"qwen3-h32-ctk-{cache}-base.txt"
    assert f"= {ppl} +/-" in printed.read_text(errors="replace")
    assert_iks_forward(_model(CONVERT / "qwen3" / "ik-f32.gguf", cache=cache),
                       FOLDER / f"qwen3-h32-ctk-{cache}-base.kld", printed, tmp_path / "fa.kld")
    got = _kld(CONVERT / "qwen3" / "ik-q8_0.gguf", DEFAULT_BASE / "qwen3-h32-base.kld", cache)
    assert got["flash_attn"] == "on" and says in got["ik_defect"]
    for key, value in _printed(FOLDER / f"qwen3-h32-ctk-{cache}-kld.txt").items():
        assert abs(got[key] - value) <= (5.01e-6 if key == "same_top_p" else 5.01e-7), key


@pytest.mark.parametrize("cache", ["q6_0", "iq4_nl"])
@pytest.mark.parametrize(("folder", "gguf"), [("qwen3-moe", "ik-f32"), ("glm4-moe", "ik-f32"),
                                              ("minimax-m2", "ref-f32")])
def test_ik_avx2_ctk_q6_0_and_iq4_nl_at_heads_of_32_on_the_other_gqa_models(folder: str, gguf: str,
                                                                            cache: str) -> None:
    """qwen3moe (PPL 578.7076 / 545.3116), glm4moe (561.1640 / 516.9782) and minimax-m2 (430.0506 / 524.3603) with
    -ctk q6_0 / iq4_nl: every running PPL of ik's default run (base files not stored: qwen3's cover the kernel)."""
    tokens = BaseLogitsFile(FOLDER / f"{folder}-ctk-q8_0-base.kld").tokens
    res = perplexity(_model(CONVERT / folder / f"{gguf}.gguf", cache=cache), np.asarray(tokens))
    assert running_ppl(res.nll, res.n_chunk) == iks_running_ppl(FOLDER / f"{folder}-ctk-{cache}-base.txt")


@pytest.mark.parametrize(("head", "flags", "says"), [
    (64, ["-ctk", "q5_0"], "not a q5_0 key cache"),
    (64, ["-ctk", "q5_1", "-khad"], "not a q5_1 key cache"),
])
def test_unported_quantized_key_caches_under_flash_attention_are_refused(heads: dict[str, Path], head: int,  # noqa: F811
                                                                         flags: list[str], says: str) -> None:
    """ik's own kernel over a cache type not ported (q5_0 and q5_1: ik itself aborts there), Hadamard-rotated or
    not: --flash-attn on is refused in one line, exit 2 (q4_1 is ported: tests/test_q4_1_flash_attention.py)."""
    res = runner.invoke(app, ["logits", str(heads[f"h{head}-f32.gguf"]), "--tokens", "1,2", "--numerics", "ik-avx2",
                              "--flash-attn", "on", *flags])
    assert res.exit_code == 2 and says in " ".join(res.output.split()), res.output


def test_heads_taking_iks_four_block_groups_are_not_reproduced() -> None:
    """ggml's generic kernel over a Q8_0 cache at heads of 4 blocks and more (160: ik's Q8_0 kernel sums 4-block
    groups in another float order), over a Q4_0, Q6_0 or IQ4_NL cache at heads other than 32 (other bytes misread,
    not checked): refused, so auto keeps -fa off."""
    numerics = Model(CONVERT / "qwen3" / "ik-f32.gguf", options=RuntimeOptions(numerics="ik-avx2"),
                     cache_type_k="q8_0").numerics
    assert numerics.check_flash_attention("qwen3", KvCache("q8_0", "f16"), 32) is None
    assert "not heads of 160" in str(numerics.check_flash_attention("qwen3", KvCache("q8_0", "f16"), 160))
    for cache in ("q4_0", "q6_0", "iq4_nl"):
        assert "at heads of 32, not 160" in str(numerics.check_flash_attention("qwen3", KvCache(cache, "f16"), 160))
    assert numerics.attention_graph("qwen3", KvCache("q8_0", "f16"), 160) == "off"
