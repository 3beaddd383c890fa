"""ik's flash attention over Q4_0, Q6_0, Q8_0 and IQ4_NL key caches in batches of fewer than 8 tokens (chunks of 4
and 6: tests/data/logits/gqa-fa-small-batches), where its own kernel hands the K x Q product calls of 1, 2 or 4
rows (the Tx kernels) and a Q8_0 cache is multiplied as stored or repacked block by block: every base-logits file
byte for byte in both builds' arithmetics; before, these batches were refused."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.convert import Converter
from ikconvert.tiny import TinySpec, make_tiny_checkpoint
from ikrun.cli import app
from ikrun.model import Model
from ikrun.numerics.ik.arithmetic import split_parts
from ikrun.numerics.ik.iqk_flash_attention import kernel_row_calls
from ikrun.options import RuntimeOptions
from tests.family_checks import assert_decoded_records, assert_iks_forward
from tests.test_flash_attention_gqa import heads  # noqa: F401  (the fixture making the head-64/128 files)

FOLDER = Path(__file__).parent / "data" / "logits" / "gqa-fa-small-batches"
#: 4 query heads on one key/value head of 64: a one-token batch hands ik's kernel calls of 4 rows
G4_SPEC = TinySpec(arch="qwen3", hidden=64, layers=2, heads=4, kv_heads=1, head_dim=64, vocab_pad=19, seed=41)
G4_SHA256 = "c83516012046654583c67ecfbd24039607a186b86df1409f620fc96afef2bebb"
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


@pytest.fixture(scope="module")
def group4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The G4_SPEC file ik ran, made again and checked to be its bytes."""
    tmp = tmp_path_factory.mktemp("g4")
    gguf = Converter(make_tiny_checkpoint(tmp / "hfg4", G4_SPEC), "f32", pre_tokenizer="qwen2").write(tmp / "g4.gguf")
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == G4_SHA256
    return gguf


@pytest.mark.parametrize("cache", ["q4_0", "q6_0", "q8_0"])
@pytest.mark.parametrize("model", ["qwen3-h64", "qwen3-h128", "qwen3-g4-h64"])
@pytest.mark.parametrize(("numerics", "build"), [("ik", "avx512"), ("ik-avx2", "avx2")])
def test_one_token_batches_are_iks(heads: dict[str, Path], group4: Path, model: str, cache: str,  # noqa: F811
                                   numerics: str, build: str) -> None:
    """ik's default run one token a batch (-c 8 -b 1): each chunk fed one token at a time through the cache gives
    every scored position's record of ik's base-logits file bit for bit. ik takes a key head's 2 or 4 query heads as
    the rows of one call (the Tx kernel; with 4 rows a Q8_0 cache repacked block by block)."""
    path = group4 if model == "qwen3-g4-h64" else heads[f"h{model.split('-h')[1]}-f32.gguf"]
    assert_decoded_records(path, FOLDER / f"{model}-b1-ctk-{cache}-{build}.kld", numerics, 1, cache)


@pytest.mark.parametrize(("threads", "cache", "numerics", "build"), [
    (4, "f16", "ik", "avx512"), (8, "f16", "ik", "avx512"), (8, "q4_0", "ik", "avx512"), (8, "q8_0", "ik", "avx512"),
    (8, "f16", "ik-avx2", "avx2"), (4, "q4_0", "ik-avx2", "avx2")])
def test_one_token_batches_whose_keys_ik_splits(heads: dict[str, Path], threads: int, cache: str,  # noqa: F811
                                                numerics: str, build: str) -> None:
    """A 256-token chunk one token a batch with 4 or 8 ik threads over 2 key/value heads: ik splits the cache into
    parts of 128 or 64 cells and merges them; every record of its base-logits file bit for bit."""
    assert_decoded_records(heads["h64-f32.gguf"], FOLDER / f"qwen3-h64-b1-c256-t{threads}-ctk-{cache}-{build}.kld",
                            numerics, threads, cache)


@pytest.mark.parametrize(("threads", "cache"), [(2, "q4_0"), (4, "f16")])
def test_one_token_batches_whose_keys_ik_splits_over_one_key_head(group4: Path, threads: int, cache: str) -> None:
    """4 query heads on one key/value head (ik's MQA path): with 2 threads a part of the 256 cells each over all
    heads, with 4 threads 4 parts of 64 each over the heads its threads share; every record bit for bit."""
    assert_decoded_records(group4, FOLDER / f"qwen3-g4-h64-b1-c256-t{threads}-ctk-{cache}-avx512.kld", "ik",
                            threads, cache)


def test_split_parts_follow_iks_partition() -> None:
    """ik's ways of sharing a one-token batch's 256 cells (8 steps of 32) among its threads: one key head and 2
    threads, a part a thread over all 4 heads; one key head and 3 threads, one part, its heads 2 + 1 + 1 a thread;
    one key head and 4 threads, gcd(8, 4) parts of 64; 2 key heads and 8 threads, parts of 64 over each key head's
    group of 2; one part where a key head stays whole; none without a group."""
    assert split_parts(4, 1, 256, 2) == ([0, 128], [128, 128], [4] * 4)
    assert split_parts(4, 1, 256, 3) == ([0], [256], [2, 2, 1, 1])
    assert split_parts(4, 1, 256, 4) == ([0, 64, 128, 192], [64] * 4, [4] * 4)
    assert split_parts(4, 2, 256, 8) == ([0, 64, 128, 192], [64] * 4, [2] * 4)
    assert split_parts(4, 2, 256, 2) == ([0], [256], [2] * 4) and split_parts(4, 4, 256, 2) is None


UNEVEN = FOLDER.parent / "uneven-shares"


@pytest.mark.parametrize(("name", "build"), [
    ("qwen3-g4-h64-b1-t3-ctk-q4_0", "avx512"), ("qwen3-g4-h64-b1-t3-ctk-q4_0", "avx2"),
    ("qwen3-g4-h64-b1-t3-ctk-q6_0", "avx512"), ("qwen3-g4-h64-b1-t3-ctk-q8_0", "avx512"),
    ("qwen3-g4-h64-b1-c256-t3-ctk-q8_0", "avx512")])
def test_calls_of_unequal_rows_are_iks(group4: Path, name: str, build: str, tmp_path: Path) -> None:
    """3 ik threads share the 4 query heads of one key head 2 + 1 + 1: one call of 2 rows, two of 1, each head
    folded as its own call's rows say (refused before); ik's base-logits file byte for byte (tests/data/logits/
    uneven-shares), from the command line one token a batch."""
    ctx, chunks = ("256", "1") if "-c256-" in name else ("8", "4")
    out = tmp_path / "base.kld"
    res = CliRunner().invoke(app, ["ppl", str(group4), "--text", str(FOLDER.parent / "qwen3" / "text.txt"), "-c", ctx,
                                   "--chunks", chunks, "--batch", "1", "-ctk", name.rsplit("-", 1)[1], "--numerics",
                                   "ik" if build == "avx512" else "ik-avx2", "--ik-threads", "3",
                                   "--save-base-logits", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes() == (UNEVEN / f"{name}-{build}.kld").read_bytes()
