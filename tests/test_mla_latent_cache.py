"""A Q8_0 MLA latent cache (`-ctk q8_0`, what DeepSeek users run to fit context) under ik's default run (flash
attention, mla 3: the prefill form for 128-token batches) against a native AVX2 ik (tests/data/logits/
deepseek-v3-heads192-fa-ctk-avx2): the cache written in Q8_0, attn_kv_b times its latent decoded (and converted to
an F16 / BF16 weight's own rows), the materialised keys and values cast to Q8_0, ik's own flash-attention kernel over
them (keys 192, values 128); what ik cannot run or this runtime does not reproduce refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ikrun.cli import app
from ikrun.eval.evaluate import perplexity
from ikrun.eval.metrics import BaseLogitsFile
from ikrun.model import Model
from ikrun.options import RuntimeOptions
from tests.family_checks import assert_iks_forward, iks_running_ppl, running_ppl
from tests.test_ik_flash_attention import REAL, real_heads  # noqa: F401  (the fixture making the files)
from tests.test_numerics import _printed

runner = CliRunner()
FOLDER = Path(__file__).parent / "data" / "logits" / "deepseek-v3-heads192-fa-ctk-avx2"


def _model(path: Path) -> Model:
    return Model(path, options=RuntimeOptions(numerics="ik-avx2"), cache_type_k="q8_0")


@pytest.mark.parametrize("weight", ["q4_0", "f16"])
def test_q8_0_latent_cache_is_iks_default_run(real_heads: dict[str, Path], weight: str,  # noqa: F811
                                              tmp_path: Path) -> None:
    """attn_kv_b in Q4_0 (PPL 478.4010) and F16 (484.6069), -ctk q8_0: ik's base-logits file byte for byte, every
    running PPL (an F16 attn_kv_b takes the decoded latent rounded to F16 rows: unrounded, its file differs in
    102,729 of 165,364 bytes and ends at 483.7854)."""
    base = FOLDER / f"kvb-{weight}-ctk-q8_0-base.kld"
    assert_iks_forward(_model(real_heads[f"kvb-{weight}.gguf"]), base, base.with_suffix(".txt"),
                       tmp_path / "ours.kld")


@pytest.mark.parametrize(("weight", "ppl"), [("q8_0", "485.4561"), ("bf16", "484.2409")])
def test_q8_0_latent_cache_prints_iks_perplexities(real_heads: dict[str, Path], weight: str,  # noqa: F811
                                                   ppl: str) -> None:
    """attn_kv_b in Q8_0 and BF16, -ctk q8_0: every running PPL ik printed."""
    printed = FOLDER / f"kvb-{weight}-ctk-q8_0-base.txt"
    assert f"= {ppl} +/-" in printed.read_text(errors="replace")
    res = perplexity(_model(real_heads[f"kvb-{weight}.gguf"]),
                     BaseLogitsFile(FOLDER / "kvb-q4_0-ctk-q8_0-base.kld").tokens)
    assert running_ppl(res.nll, res.n_chunk) == iks_running_ppl(printed)


def _kld(model: Path, *flags: str) -> dict[str, Any]:
    res = runner.invoke(app, ["kld", str(model), "--base-logits", str(REAL / "ik-base.kld"), "--json", "-ctk", "q8_0",
                              *flags])
    assert res.exit_code == 0, res.output
    return dict(json.loads(res.stdout))


def test_q8_0_latent_cache_costs_what_ik_prints(real_heads: dict[str, Path]) -> None:  # noqa: F811
    """attn_kv_b in Q4_0 with -ctk q8_0 against ik's default (F16-cache) base of the F32 file: mean KLD 0.031737
    (0.030781 with the F16 cache), every figure ik printed to the digit. The exact arithmetic, which rounds the
    same cache and casts, measures the cache too: 0.030744 against 0.030130 with the F16 cache (its distance from
    ik's arithmetic is the F16 cache's)."""
    ours = _kld(real_heads["kvb-q4_0.gguf"], "--numerics", "ik-avx2")
    assert ours["mla_path"] == "prefill" and ours["cache_type_k"] == "q8_0"
    for key, value in _printed(FOLDER / "kvb-q4_0-ctk-q8_0-kld.txt").items():
        assert abs(ours[key] - value) <= (5.01e-6 if key == "same_top_p" else 5.01e-7), key
    exact = _kld(real_heads["kvb-q4_0.gguf"])["kld_mean"]
    exact_f16 = _kld(real_heads["kvb-q4_0.gguf"], "-ctk", "f16")["kld_mean"]
    assert exact > exact_f16 + 5e-4


TEXT = Path(__file__).parent / "data" / "logits" / "deepseek-v3" / "text.txt"


@pytest.mark.parametrize(("model", "flags", "named"), [
    ("ik-f32.gguf", ["--ctx", "128"], ("--cache-type-k q8_0", "attn_kv_b", "F32", "crashes")),
    ("kvb-q4_0.gguf", ["--ctx", "128", "--mla", "decode"], ("--cache-type-k q8_0", "absorbed MLA form", "prefill")),
    ("kvb-q4_0.gguf", ["--ctx", "64"], ("--cache-type-k q8_0", "under 128 tokens", "generic")),
    ("kvb-q4_0.gguf", ["--ctx", "128", "-khad"], ("--k-cache-hadamard", "latent")),
])
def test_what_is_not_reproduced_is_refused(real_heads: dict[str, Path], model: str, flags: list[str],  # noqa: F811
                                           named: tuple[str, ...]) -> None:
    """One line, exit 2: an F32 attn_kv_b (ik's conversion of the quantized latent for it calls a function F32 lacks:
    ik crashes), the absorbed form (asked for, or a batch under 128 tokens), -khad; nothing written."""
    res = runner.invoke(app, ["ppl", str(real_heads[model]), "--text", str(TEXT), "--chunks", "1", "-ctk", "q8_0",
                              "--numerics", "ik-avx2", *flags])
    assert res.exit_code == 2, res.output
    said = [line for line in res.output.strip().splitlines() if not line.startswith("memory budget")]
    assert len(said) == 1 and all(n in said[0] for n in named), res.output  # the budget is announced once a process


def test_a_file_without_attn_kv_b_is_refused(real_heads: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    """ik derives attn_kv_b at load for such a file; over a quantized latent cache that is not reproduced."""
    from tests.test_mla_paths import _rewrite

    no_kv_b = _rewrite(real_heads["kvb-q4_0.gguf"], tmp_path / "no-kv_b.gguf",
                       drop=tuple(f"blk.{i}.attn_kv_b.weight" for i in range(2)))
    res = runner.invoke(app, ["ppl", str(no_kv_b), "--text", str(TEXT), "--ctx", "128", "--chunks", "1", "-ctk",
                              "q8_0", "--numerics", "ik-avx2"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert "blk.0.attn_kv_b.weight" in res.output and "derives" in res.output, res.output


def test_ik_arithmetics_refuse_other_latent_types(real_heads: dict[str, Path]) -> None:  # noqa: F811
    """Both builds' arithmetics reproduce Q8_0, Q4_0, Q6_0 and IQ4_NL latents (tests/test_ik_quantized_caches.py,
    tests/test_mla_absorbed_flash.py), no other."""
    for numerics in ("ik", "ik-avx2"):
        res = runner.invoke(app, ["ppl", str(real_heads["kvb-q4_0.gguf"]), "--text", str(TEXT), "--ctx", "128",
                                  "-ctk", "q5_0", "--numerics", numerics])
        assert res.exit_code == 2 and "q8_0/q4_0/q6_0/iq4_nl as deepseek2's MLA latent" in res.output, res.output
