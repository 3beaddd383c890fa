"""ik's flash attention over Q4_0, Q6_0, Q8_0 and IQ4_NL key caches in batches of fewer than 8 tokens (chunks of 4
and 6: tests/data/logits/gqa-fa-small-batches), where its own kernel hands the K x Q product calls of 1, 2 or 4
rows (the Tx kernels) and a Q8_0 cache is multiplied as stored or repacked block by block: every base-logits file
byte for byte in both builds' arithmetics; before, these batches were refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ikrun.model import Model
from ikrun.numerics.ik.iqk_flash_attention import kernel_row_calls
from ikrun.options import RuntimeOptions
from tests.family_checks import assert_iks_forward
from tests.test_flash_attention_gqa import heads  # noqa: F401  (the fixture making the head-64/128 files)

FOLDER = Path(__file__).parent / "data" / "logits" / "gqa-fa-small-batches"
CASES = [(head, chunk, cache) for head in (64, 128) for chunk in (4, 6) for cache in ("q4_0", "q6_0", "q8_0")] + \
    [(64, 6, "iq4_nl")]


@pytest.mark.parametrize(("head", "chunk", "cache"), CASES)
@pytest.mark.parametrize(("numerics", "build"), [("ik", "avx512"), ("ik-avx2", "avx2")])
def test_small_batches_are_iks_default_run(heads: dict[str, Path], head: int, chunk: int, cache: str,  # noqa: F811
                                           numerics: str, build: str, tmp_path: Path) -> None:
    """ik's default run in chunks of `chunk` tokens with -ctk `cache`: its base-logits file byte for byte, every
    running PPL (heads of 64, chunks of 6, q4_0: 881.5289 on AVX-512)."""
    name = f"qwen3-h{head}-c{chunk}-ctk-{cache}-{build}"
    model = Model(heads[f"h{head}-f32.gguf"], options=RuntimeOptions(numerics=numerics, ik_threads=2),
                  cache_type_k=cache)
    assert_iks_forward(model, FOLDER / f"{name}.kld", FOLDER / f"{name}.txt", tmp_path / "base.kld")


def test_row_calls_follow_iks_steps() -> None:
    """6 rows on 4 heads, 2 threads: a step of 4 rows (one call, repacking a Q8_0 block by block), then single
    rows; DeepSeek's 576 / 512 helper takes 7 rows as a step of 4 and one of 3."""
    calls, single = kernel_row_calls(6, 4, 2, 256)
    assert calls.tolist() == [4, 4, 4, 4, 1, 1] and single.tolist() == [True] * 4 + [False] * 2
    calls, single = kernel_row_calls(7, 2, 1, 256, (576, 512))
    assert calls.tolist() == [4] * 4 + [3] * 3 and single.tolist() == [True] * 4 + [False] * 3
    assert not kernel_row_calls(16, 4, 2, 256)[1].any()  # two steps of 8: the cache is repacked beforehand
    assert np.array_equal(kernel_row_calls(20, 2, 4, 256)[0], [8] * 8 + [1, 1] + [8] * 8 + [1, 1])
