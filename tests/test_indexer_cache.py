"""The DSA indexer's key cache (--indexer-cache-type-k/-ictk, ik's option): what it holds on glm-dsa (Hadamard-
rotated keys) and openPangu, its default, ik's printed figures with -ictk q8_0, and the types a model cannot take."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikquant.formats.cache_rows import cache_round_trip
from ikrun.cli import app
from ikrun.model import Model
from ikrun.ops.indexer import hadamard
from ikrun.options import RuntimeOptions

runner = CliRunner()
DATA = Path(__file__).parent / "data"
GLM = DATA / "convert" / "glm-dsa" / "ref-f32.gguf"
PANGU = DATA / "convert" / "openpangu-v2" / "ik-f32.gguf"
QWEN3 = DATA / "convert" / "qwen3" / "ik-f32.gguf"
TEXT = DATA / "logits" / "glm-dsa" / "text.txt"


@pytest.mark.parametrize(("kv_cache", "ctk", "ictk", "held"), [
    ("f32", None, None, "f32"),  # the weights alone
    ("f16", None, None, "f16"),  # ik's default caches
    ("f32", "f16", None, "f16"),  # ik's -ictk default does not follow -ctk: f16 once ik's caches are asked for
    ("f32", None, "q8_0", "q8_0"),
])
def test_the_indexer_cache_type_and_its_default(kv_cache: str, ctk: str | None, ictk: str | None, held: str) -> None:
    assert Model(GLM, kv_cache=kv_cache, cache_type_k=ctk, indexer_cache_type_k=ictk).cache.indexer == held


def test_glm_dsa_stores_hadamard_rotated_keys_in_the_indexer_cache() -> None:
    """The keys the indexer scores are H(k) written into the cache type and read back exactly (q8_0 here: ik's
    AVX2 cache writer), the queries rotated to match; the other caches stay as asked (f32)."""
    m = Model(GLM, indexer_cache_type_k="q8_0")
    assert (m.cache.k, m.cache.indexer) == ("f32", "q8_0")
    k = np.random.default_rng(0).standard_normal((9, 1, 32)).astype(np.float32)
    np.testing.assert_array_equal(m.ctx.indexer_store(hadamard(k)),
                                  cache_round_trip("Q8_0", hadamard(k).reshape(9, 32)).reshape(k.shape))
    tokens = np.load(DATA / "hf-logits" / "glm-dsa" / "tokens.npy")[0]
    assert not np.array_equal(m.logits(tokens), Model(GLM).logits(tokens))


def test_openpangu_indexer_cache_is_its_own() -> None:
    """openPangu's indexer keys go into the indexer cache alone (not rotated): -ictk q8_0 moves the logits, the
    latent cache stays f32."""
    m = Model(PANGU, indexer_cache_type_k="q8_0", options=RuntimeOptions(ik_sink_overread=True))
    assert (m.cache.k, m.cache.indexer) == ("f32", "q8_0")
    tokens = np.arange(1, 65)
    base = Model(PANGU, options=RuntimeOptions(ik_sink_overread=True)).logits(tokens)
    assert not np.array_equal(m.logits(tokens), base)


def _refused(args: list[str], *named: str) -> None:
    res = runner.invoke(app, args, env={"COLUMNS": "250"})
    assert res.exit_code == 2, res.output
    line = " ".join(res.output.split())
    for text in named:
        assert text in line, res.output


@pytest.mark.parametrize(("model", "flags", "named"), [
    (PANGU, ["-ictk", "q4_0"], ("--indexer-cache-type-k q4_0", "openpangu", "f32, f16, bf16, q8_0 only")),
    (QWEN3, ["-ictk", "q8_0"], ("--indexer-cache-type-k q8_0", "qwen3", "no DSA indexer")),
    (GLM, ["-ictk", "q8_0", "--dsa", "off"], ("--indexer-cache-type-k q8_0", "--dsa off runs no indexer")),
    (GLM, ["-ictk", "q9"], ("--indexer-cache-type-k q9", "not a cache type ik takes")),
    (GLM, ["-ictk", "q8_KV"], ("--indexer-cache-type-k q8_KV", "not reproduced")),
])
def test_an_indexer_cache_the_model_cannot_take_is_refused(model: Path, flags: list[str],
                                                           named: tuple[str, ...]) -> None:
    _refused(["ppl", str(model), "--text", str(TEXT), "--ctx", "64", "--chunks", "1", *flags], *named)
