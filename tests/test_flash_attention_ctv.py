"""Quantized V caches (-ctv) under ik's flash attention: ik's default runs with -ctk/-ctv on a native AVX2 ik
(tests/data/logits/gqa-fa-ctv-avx2), its own flash-attention kernel (qwen3 heads of 64 and 128), which decodes each
value block exactly and sums the values as it sums F16 ones; at heads of 32 ggml's generic kernel, which sums them
in float32 (a native AVX-512 ik's runs, tests/data/logits/gqa-fa-ctv-h32-avx512); the combinations ik refuses or that
are not ported are refused before any compute."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikrun.cli import app
from ikrun.eval.evaluate import perplexity
from ikrun.eval.metrics import BaseLogitsFile
from ikrun.model import Model
from ikrun.options import RuntimeOptions
from tests.family_checks import iks_running_ppl, running_ppl
from tests.test_flash_attention_gqa import heads  # noqa: F401  (the fixture making the head-64/128 files)
from tests.test_numerics import _printed

runner = CliRunner()
DATA = Path(__file__).parent / "data"
FOLDER = DATA / "logits" / "gqa-fa-ctv-avx2"
DEFAULT_BASE = DATA / "logits" / "gqa-fa-avx2"
CACHES = [("f16", "q8_0"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("f16", "q6_0"), ("f16", "iq4_nl"), ("f16", "q4_1")]


def _ik_sha256() -> dict[str, str]:
    lines = (FOLDER / "ik-base.sha256").read_text().split("\n")
    return {name: digest for digest, name in (line.split() for line in lines if line)}


@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize(("k", "v"), CACHES)
def test_ik_avx2_ctv_is_iks_default_run(heads: dict[str, Path], head: int, k: str, v: str,  # noqa: F811
                                        tmp_path: Path) -> None:
    """ik's default run of the F32 files with -ctk K -ctv V: its base-logits file byte for byte (its SHA-256) with
    every running PPL (README's table)."""
    name = f"qwen3-h{head}-ctk-{k}-ctv-{v}"
    model = Model(heads[f"h{head}-f32.gguf"], options=RuntimeOptions(numerics="ik-avx2", ik_threads=2),
                  cache_type_k=k, cache_type_v=v)
    assert (model.cache.k, model.cache.v) == (k, v)
    stored = FOLDER / f"{name}-base.kld"
    tokens = np.asarray(BaseLogitsFile(stored if stored.exists() else DEFAULT_BASE / f"qwen3-h{head}-base.kld").tokens)
    res = perplexity(model, tokens, save_base=tmp_path / "ours.kld")
    ours = (tmp_path / "ours.kld").read_bytes()
    assert hashlib.sha256(ours).hexdigest() == _ik_sha256()[f"{name}-base.kld"]
    if stored.exists():
        assert ours == stored.read_bytes()
    assert running_ppl(res.nll, res.n_chunk) == iks_running_ppl(FOLDER / f"{name}-base.txt")


def test_the_value_cache_is_what_the_figures_measure(heads: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    """With the values F16 (the code before: -ctv refused, or a V cache kept in F16) the run is another one."""
    model = Model(heads["h64-f32.gguf"], options=RuntimeOptions(numerics="ik-avx2", ik_threads=2),
                  cache_type_k="q8_0")
    perplexity(model, np.asarray(BaseLogitsFile(DEFAULT_BASE / "qwen3-h64-base.kld").tokens),
               save_base=tmp_path / "f16-values.kld")
    digest = hashlib.sha256((tmp_path / "f16-values.kld").read_bytes()).hexdigest()
    assert digest != _ik_sha256()["qwen3-h64-ctk-q8_0-ctv-q8_0-base.kld"]


GENERIC = DATA / "logits" / "gqa-fa-ctv-h32-avx512"


@pytest.mark.parametrize(("k", "v"), [*(("f16", v) for v in ("q8_0", "q4_0", "iq4_nl", "q6_0", "q4_1")),
                                      ("q8_0", "q8_0"), ("bf16", "bf16")])
def test_ggml_generic_kernel_sums_a_quantized_v_cache_in_float32(k: str, v: str, tmp_path: Path) -> None:
    """At heads ik's own kernel does not take (the golden qwen3's 32) ggml's generic kernel runs: each value row
    decoded, the sums kept in float32 (over F16 values it keeps them in f16); over BF16 keys its q . k is
    ggml_vec_dot_bf16. A native AVX-512 ik's default run with -ctk K -ctv V: its base-logits file byte for byte (its
    SHA-256) with every running PPL."""
    name = f"qwen3-ctk-{k}-ctv-{v}"
    model = Model(DATA / "convert" / "qwen3" / "ik-f32.gguf", options=RuntimeOptions(numerics="ik", ik_threads=2),
                  cache_type_k=k, cache_type_v=v)
    assert model.computed_paths(64)["flash_attn"] == "on"
    tokens = np.asarray(BaseLogitsFile(GENERIC / "qwen3-ctk-f16-ctv-q8_0-base.kld").tokens)
    res = perplexity(model, tokens, save_base=tmp_path / "ours.kld")
    digests = dict(reversed(line.split()) for line in (GENERIC / "ik-base.sha256").read_text().splitlines() if line)
    assert hashlib.sha256((tmp_path / "ours.kld").read_bytes()).hexdigest() == digests[f"{name}-base.kld"]
    assert running_ppl(res.nll, res.n_chunk) == iks_running_ppl(GENERIC / f"{name}-base.txt")


@pytest.mark.parametrize("head", [64, 128])
@pytest.mark.parametrize(("k", "v"), [("q8_0", "q8_0"), ("f16", "q4_1")])
def test_ik_avx2_ctv_kld_is_what_ik_prints(heads: dict[str, Path], head: int, k: str, v: str) -> None:  # noqa: F811
    """The Q8_0 files with -ctk K -ctv V against ik's default (F16-cache) base: every figure ik printed, to the
    digit (q8_0 / q8_0: KLD 0.000139 at heads of 64, 0.000137 at 128; f16 / q4_1: 0.000639, 0.000629)."""
    res = runner.invoke(app, ["kld", str(heads[f"h{head}-q8_0.gguf"]), "--base-logits",
                              str(DEFAULT_BASE / f"qwen3-h{head}-base.kld"), "--json", "--numerics", "ik-avx2",
                              "--ik-threads", "2", "-ctk", k, "-ctv", v])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert (got["cache_type_k"], got["cache_type_v"], got["flash_attn"]) == (k, v, "on")
    for key, value in _printed(FOLDER / f"qwen3-h{head}-ctk-{k}-ctv-{v}-kld.txt").items():
        assert abs(got[key] - value) <= (5.01e-6 if key == "same_top_p" else 5.01e-7), key


def _refused(model: Path, *args: str) -> str:
    res = runner.invoke(app, ["ppl", str(model), "--text", str(DATA / "logits" / "qwen3" / "text.txt"), "--ctx", "64",
                              "--chunks", "1", *args])
    assert res.exit_code == 2, res.output
    # one line, after the budget's (announced once a process: by the first command this process runs)
    said = [line for line in res.output.strip().splitlines() if not line.startswith("memory budget")]
    assert len(said) == 1, res.output
    return res.output


def test_value_caches_ik_refuses_or_not_ported(heads: dict[str, Path]) -> None:  # noqa: F811
    h64, h32 = heads["h64-f32.gguf"], heads["h32-f32.gguf"]
    ik = ["--numerics", "ik-avx2", "--ik-threads", "2"]
    assert "only with flash attention" in _refused(h64, *ik, "--flash-attn", "off", "-ctv", "q8_0")
    assert "not a q5_0 one" in _refused(h32, *ik, "-ctv", "q5_0")  # heads of 32, ggml's generic kernel: as at 64
    assert "not a q5_0 one" in _refused(h64, *ik, "-ctv", "q5_0")
    assert "-vhad" in _refused(h64, *ik, "-ctv", "q8_0", "-vhad")
    assert "ones under flash attention, not a q5_0 one" in _refused(h64, "--numerics", "ik", "-ctv", "q5_0")
    assert "latent" in _refused(DATA / "convert" / "deepseek-v3" / "ik-f32.gguf", *ik, "-ctv", "q8_0")
    # the exact arithmetic reads any cache's exact decoding, with or without flash attention in ik's sense
    exact = Model(h32, cache_type_v="q8_0")
    assert exact.cache.v == "q8_0"
