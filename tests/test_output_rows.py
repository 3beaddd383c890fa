"""The last block's FFN and the head run on the rows whose logits are asked for (Sequence.outputs), as ik's graph
does: the same logits as a run of every row, in every family's own place for the cut, whole or in micro-batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ikrun.model import Model
from ikrun.options import RuntimeOptions
from tests.family_checks import assert_iks_forward

CONVERT = Path(__file__).parent / "data" / "convert"
FILES = ["qwen3/ik-f32.gguf", "deepseek-v3/ik-f32.gguf", "deepseek-v4-flash/ref-f32.gguf", "openpangu-v2/ik-f32.gguf",
         "qwen3-moe/ik-f32.gguf", "qwen3-next/ref-f32.gguf", "gpt-oss/ref-f32.gguf"]
N = 40


def _rows_match(model: Model, exact: bool) -> None:
    tokens = np.random.default_rng(0).integers(1, model.n_vocab, N)
    every = model.logits(tokens)
    assert every.shape == (N, model.n_vocab)
    for outputs in (1, N // 2, N - 1):
        got = model.logits(tokens, outputs=outputs)
        assert got.shape == (N - outputs, model.n_vocab)
        if exact:
            np.testing.assert_array_equal(got, every[outputs:])
        else:  # BLAS rounds a row of a product of fewer rows otherwise
            np.testing.assert_allclose(got, every[outputs:], rtol=0, atol=1e-5 * np.abs(every).max())


@pytest.mark.parametrize("name", FILES)
def test_output_rows_are_those_of_every_row(name: str) -> None:
    _rows_match(Model(CONVERT / name), exact=False)


@pytest.mark.parametrize("name", ["qwen3/ik-f32.gguf", "deepseek-v3/ik-f32.gguf", "qwen3-moe/ik-f32.gguf"])
def test_output_rows_are_those_of_every_row_bit_for_bit_in_iks_kernels(name: str) -> None:
    """ik's float kernel computes every output row alike whatever the rows beside it."""
    _rows_match(Model(CONVERT / name, options=RuntimeOptions(numerics="ik-avx2")), exact=True)


def test_micro_batches_before_the_output_rows_give_none() -> None:
    """Fed 8 tokens at a time, the batches before row 20 pass no row to the head; the cache still holds them."""
    model = Model(CONVERT / "qwen3" / "ik-f32.gguf")
    tokens = np.random.default_rng(1).integers(1, model.n_vocab, N)
    batched = model.logits(tokens, outputs=20, batch=8)
    assert batched.shape == (N - 20, model.n_vocab)
    every = model.logits(tokens)
    np.testing.assert_allclose(batched, every[20:], rtol=0, atol=1e-5 * np.abs(every).max())


ROWS_AVX2 = Path(__file__).parent / "data" / "logits" / "output-rows-avx2"


@pytest.mark.parametrize(("family", "threads"), [("qwen3", 1), ("qwen3", 2), ("deepseek-v3", 2), ("qwen3-moe", 2)])
def test_iks_kernels_see_the_output_rows(family: str, threads: int, tmp_path: Path) -> None:
    """48-token chunks: ik multiplies the last block's FFN and the output matrix on 24 rows, in Q8_0's own kernel
    (tests/data/logits/output-rows-avx2): its base-logits file byte for byte and every running PPL."""
    model = Model(CONVERT / family / "ik-q8_0.gguf",
                  options=RuntimeOptions(numerics="ik-avx2", flash_attn="off", ik_threads=threads))
    assert_iks_forward(model, ROWS_AVX2 / f"{family}-q8_0-base.kld", ROWS_AVX2 / f"{family}-q8_0-ppl-t{threads}.txt",
                       tmp_path / "base.kld")
