"""`--flash-attn` over a Hadamard-rotated quantized key cache (-khad): ik's graph rotates the keys before the cache
write and the queries before attention, whichever attention graph follows, so its default (flash-attention) runs with
-ctk q8_0 -khad (heads of 32, 64, 128), -ctk q4_0 -khad (heads of 32, 64), q6_0 (128) and iq4_nl (32, 64) are the -ctk runs' kernels over rotated rows
(tests/data/logits/gqa-fa-khad-avx2); the -fa off graph (what auto computed before) misses them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ikrun.eval.evaluate import perplexity
from ikrun.eval.metrics import BaseLogitsFile
from ikrun.model import Model
from ikrun.options import RuntimeOptions
from tests.family_checks import assert_iks_forward, iks_running_ppl, running_ppl
from tests.test_flash_attention_gqa import heads  # noqa: F401  (the fixture making the head-64/128 files)

DATA = Path(__file__).parent / "data"
FOLDER = DATA / "logits" / "gqa-fa-khad-avx2"
CONVERT = DATA / "convert"


def _model(path: Path, cache: str, flash_attn: str = "auto") -> Model:
    return Model(path, options=RuntimeOptions(numerics="ik-avx2", ik_threads=2, flash_attn=flash_attn),
                 cache_type_k=cache, k_cache_hadamard=True)


def _files(name: str, cache: str) -> tuple[Path, Path]:
    return FOLDER / f"{name}-ctk-{cache}-khad-base.kld", FOLDER / f"{name}-ctk-{cache}-khad-base.txt"


@pytest.mark.parametrize(("head", "cache", "ppl"), [(32, "q8_0", "542.7844"), (64, "q8_0", "802.7502"),
                                                    (128, "q8_0", "826.5943"), (32, "q4_0", "548.3071")])
def test_ik_avx2_khad_is_iks_default_run_on_qwen3(heads: dict[str, Path], head: int, cache: str,  # noqa: F811
                                                  ppl: str, tmp_path: Path) -> None:
    """ik's default run of the F32 files with -ctk <cache> -khad: its base-logits file byte for byte with every running
    PPL (as named; the -fa off graph: 542.7177, 802.7503, 826.5938, 537.5751)."""
    base, printed = _files(f"qwen3-h{head}", cache)
    assert f"= {ppl} +/-" in printed.read_text(errors="replace")
    assert_iks_forward(_model(heads[f"h{head}-f32.gguf"], cache), base, printed, tmp_path / "fa.kld")


@pytest.mark.parametrize(("head", "cache", "ppl"), [(64, "q4_0", "802.9627"), (128, "q6_0", "826.9240"),
                                                   (64, "iq4_nl", "802.3103"), (32, "iq4_nl", "538.3672")])
def test_ik_avx2_khad_over_the_other_key_types_is_iks_default_run(heads: dict[str, Path], head: int, cache: str,  # noqa: F811
                                                                  ppl: str) -> None:
    """-ctk q4_0 / q6_0 / iq4_nl -khad (ik's own kernel over the types' caches of rotated rows; at heads of 32 its
    IQ4_NL misread): every running PPL ik printed (as named; base files not stored: the -ctk runs' cover the
    kernels)."""
    _, printed = _files(f"qwen3-h{head}", cache)
    assert f"= {ppl} +/-" in printed.read_text(errors="replace")
    tokens = BaseLogitsFile(DATA / "logits" / "gqa-fa-avx2" / f"qwen3-h{head}-base.kld").tokens
    res = perplexity(_model(heads[f"h{head}-f32.gguf"], cache), np.asarray(tokens))
    assert running_ppl(res.nll, res.n_chunk) == iks_running_ppl(printed)


@pytest.mark.parametrize("cache", ["q8_0", "q4_0"])
@pytest.mark.parametrize(("folder", "gguf"), [("qwen3-moe", "ik-f32"), ("glm4-moe", "ik-f32"),
                                              ("minimax-m2", "ref-f32")])
def test_ik_avx2_khad_is_iks_default_run_on_the_other_gqa_models(folder: str, gguf: str, cache: str,
                                                                 tmp_path: Path) -> None:
    """qwen3moe, glm4moe and minimax-m2 (heads of 32) with -ctk q8_0 / q4_0 -khad: ik's default run byte for byte
    (PPL 525.4999 / 525.3322, 591.0397 / 552.4645, 509.4809 / 552.3523)."""
    base, printed = _files(folder, cache)
    assert_iks_forward(_model(CONVERT / folder / f"{gguf}.gguf", cache), base, printed, tmp_path / "fa.kld")


def test_the_fa_off_graph_misses_iks_default_khad_run(tmp_path: Path) -> None:
    """The -fa off graph over the same rotated cache (what auto computed before) writes other bytes: the flash
    attention's float order is what the base file holds."""
    base, _ = _files("qwen3-h32", "q8_0")
    model = _model(CONVERT / "qwen3" / "ik-f32.gguf", "q8_0", "off")
    perplexity(model, np.asarray(BaseLogitsFile(base).tokens), save_base=tmp_path / "off.kld")
    assert (tmp_path / "off.kld").read_bytes() != base.read_bytes()
