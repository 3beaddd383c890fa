"""Our byte-level BPE against the `tokenizers` package, against ik's own tokens, and ik's probe hash."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from ikconvert.tiny import CORPUS
from ikconvert.tokenizer import BPETokenizer
from ikconvert.vocab import PRE_TOKENIZER_HASHES, PROBE_TEXT, HFTokenizerFiles
from ikquant.gguf_io import GGUFFile
from ikrun.eval.metrics import BaseLogitsFile

TEXTS = [
    CORPUS.read_text(encoding="utf-8"),
    PROBE_TEXT,
    "Grüße aus Köln! Ça va? 東京タワー 1234567 and emojis 🦙🚀 'quoted' it's I'VE we'll\n\n\t  tabs   ",
    "<|im_start|>user\nHello<|im_end|>\n<think>plain text with a user-defined token</think>",
]


@pytest.mark.parametrize("text_index", range(len(TEXTS)))
def test_gguf_tokenizer_matches_tokenizers(tiny_hf: Path, tiny_f32: Path, text_index: int) -> None:
    text = TEXTS[text_index]
    hf = tokenizers.Tokenizer.from_file(str(tiny_hf / "tokenizer.json"))
    ours = BPETokenizer.from_gguf(GGUFFile(tiny_f32))
    # llama.cpp parses user-defined (non-special) added tokens always, control tokens only on request
    expected = hf.encode(text, add_special_tokens=True).ids
    got = ours.encode(text, add_special=True, parse_special=True)
    assert got == expected


def test_gguf_tokenizer_reproduces_iks_tokens(data_dir: Path) -> None:
    tok = BPETokenizer.from_gguf(GGUFFile(data_dir / "convert" / "qwen3" / "ik-f32.gguf"))
    text = (data_dir / "logits" / "qwen3" / "text.txt").read_text(encoding="utf-8")
    base = BaseLogitsFile(data_dir / "logits" / "qwen3" / "ik-base.kld")
    ids = tok.encode(text)
    np.testing.assert_array_equal(np.array(ids[: base.tokens.size]), base.tokens.reshape(-1))


def test_probe_hash_equals_the_one_transformers_gives(tiny_hf: Path) -> None:
    files = HFTokenizerFiles(tiny_hf)
    hf = tokenizers.Tokenizer.from_file(str(tiny_hf / "tokenizer.json"))
    expected = hashlib.sha256(str(hf.encode(PROBE_TEXT).ids).encode()).hexdigest()
    assert files.probe_hash() == expected
    assert expected not in PRE_TOKENIZER_HASHES


def test_hash_table_keeps_iks_last_entry_for_duplicates() -> None:
    # ik's table tests these hashes twice; the later `if` wins there
    assert PRE_TOKENIZER_HASHES["b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166"] == "olmo"
    assert PRE_TOKENIZER_HASHES["0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f"] == "jina-v2-en"
