"""Qwen3.5's pre-tokenizer (`qwen35`: combining marks `\\p{M}` belong to letter runs) against the `tokenizers`
library on the golden Qwen3.5 tokenizer, from the GGUF our converter writes.

ik (like all of llama.cpp) applies no normalizer, while the tokenizer.json asks for NFC: on text that is not already
NFC the two differ (ik keeps `e` + U+0301 as two characters). The texts here are NFC, as almost all text is.
"""

from __future__ import annotations

import hashlib
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from ikconvert.convert import Converter
from ikconvert.tiny import CORPUS
from ikconvert.tokenizer import BPETokenizer
from ikconvert.vocab import PRE_TOKENIZER_HASHES, PROBE_TEXT, HFTokenizerFiles
from ikquant.gguf_io import GGUFFile

TEXTS = [
    CORPUS.read_text(encoding="utf-8"),
    PROBE_TEXT,
    "हिन्दी भाषा नमस्ते दुनिया",
    "ภาษาไทย สวัสดีครับ ไม่ได้",
    "কাজ করছে; தமிழ் மொழி; ქართული",
    "😶\u200d🌫️ ❤️ 👍🏽 ✌️ 1️⃣ \u1ea1\u0308 ṩ́",
    "<|im_start|>user\nनमस्ते<|im_end|>\n<think>x</think> I'VE it's",
]


@pytest.fixture(scope="module")
def converted(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = data_dir / "convert" / "qwen35-moe" / "hf"
    return Converter(folder, "f32", "qwen35").write(tmp_path_factory.mktemp("qwen35") / "f32.gguf")


@pytest.mark.parametrize("index", range(len(TEXTS)))
def test_gguf_tokenizer_matches_tokenizers(data_dir: Path, converted: Path, index: int) -> None:
    text = TEXTS[index]
    assert unicodedata.normalize("NFC", text) == text
    hf = tokenizers.Tokenizer.from_file(str(data_dir / "convert" / "qwen35-moe" / "hf" / "tokenizer.json"))
    ours = BPETokenizer.from_gguf(GGUFFile(converted))
    assert ours.encode(text, add_special=True, parse_special=True) == hf.encode(text, add_special_tokens=True).ids


def test_text_gives_the_tokens_transformers_was_fed(data_dir: Path, converted: Path) -> None:
    tokens = np.load(data_dir / "hf-logits" / "qwen35-moe" / "tokens.npy")
    ids = BPETokenizer.from_gguf(GGUFFile(converted)).encode((data_dir / "logits" / "qwen3" / "text.txt").read_text())
    np.testing.assert_array_equal(np.array(ids[: tokens.size]), tokens.reshape(-1))


def test_marks_stay_in_letter_runs(converted: Path) -> None:
    """The same vocabulary under qwen2's rule splits a Devanagari word at its virama and vowel sign (pieces BPE
    never merges across); qwen35 keeps it whole."""
    gguf = GGUFFile(converted)
    keys = {kv.key: kv.value for kv in gguf.kv() if kv.key.startswith("tokenizer.")}
    qwen35 = BPETokenizer.from_gguf(keys)
    qwen2 = BPETokenizer.from_gguf({**keys, "tokenizer.ggml.pre": "qwen2"})
    word = " नमस्ते"
    assert qwen35.split_words(word) == [word]
    assert qwen2.split_words(word) == [" नमस", "्त", "े"]


def test_probe_of_the_golden_tokenizer(data_dir: Path) -> None:
    """The tiny tokenizer's probe hash is its own (ik's converter does not know it either: the reference was written
    with `qwen35` forced); ik's table names the released Qwen3.5 / 3.6 tokenizers `qwen35`."""
    files = HFTokenizerFiles(data_dir / "convert" / "qwen35-moe" / "hf")
    hf = tokenizers.Tokenizer.from_file(str(files.dir / "tokenizer.json"))
    assert files.probe_hash() == hashlib.sha256(str(hf.encode(PROBE_TEXT).ids).encode()).hexdigest()
    assert sum(name == "qwen35" for name in PRE_TOKENIZER_HASHES.values()) == 4
