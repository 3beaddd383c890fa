"""DeepSeek-LLM's pre-tokenizer (`deepseek-llm`: DeepSeek-LLM, V2, V2-Lite) in ikrun, against the `tokenizers` library.

tests/data/convert/deepseek-llm/tokenizer.json is a tiny byte-level BPE with DeepSeek-LLM's pre-tokenizer sequence
(five isolating Splits, Digits, ByteLevel without its regex); the runtime tokenizes from GGUF keys naming
`deepseek-llm`, with ik's regex list, and must give the library's ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers

from ikconvert.convert import Converter
from ikconvert.tiny import CORPUS
from ikconvert.tokenizer import BPETokenizer
from ikconvert.vocab import PROBE_TEXT, HFTokenizerFiles
from ikquant.gguf_io import GGUFFile
from tests import ik_engine
from tests.convert_helpers import deepseek_v3_with_vocab

TEXTS = [
    CORPUS.read_text(encoding="utf-8"),
    PROBE_TEXT,
    "Привет, как дела? Ελληνικά κείμενα. ＡＢＣ！？（）「」 ﬁne ℂℍ ǅ Ꭰ µ",
    "我想在apple工作1314151天～ 한국어 텍스트입니다. ひらがな カタカナ 漢字々",
    "trailing spaces   \r\n\r\nline\n  \n\t\tend  \t ",
    "12345678 3.14159 1,000,000 a1b2 ½ ²³  don't I'VE 'tis",
    "\u3000「引用」‘quote’ “double” — …  ",
    "emoji 🦙  \n😀 \t\nend.  \r\n\r\nabc123def ひらがなabc 🦙  ",
    "😀!! 🦙?? ひらがな。。 x 🦙  ",
]


@pytest.fixture(scope="module")
def folder(data_dir: Path) -> Path:
    return data_dir / "convert" / "deepseek-llm"


def _runtime(folder: Path) -> BPETokenizer:
    """The runtime's tokenizer built from the GGUF keys ik's converter writes for this tokenizer.json."""
    files = HFTokenizerFiles(folder)
    tokens, types = files.tokens_and_types(len(files.vocab))
    keys = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "deepseek-llm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": files.merges()}
    return BPETokenizer.from_gguf(keys)


@pytest.mark.parametrize("index", range(len(TEXTS)))
def test_runtime_matches_tokenizers(folder: Path, index: int) -> None:
    hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = TEXTS[index]
    assert _runtime(folder).encode(text, add_special=False) == hf.encode(text, add_special_tokens=False).ids


def test_converter_probe_reads_the_same_sequence(folder: Path) -> None:
    """The converter's mirror of tokenizer.json (used for the probe hash) splits as the runtime's `deepseek-llm`."""
    probe, runtime = HFTokenizerFiles(folder).probe_tokenizer(), _runtime(folder)
    for text in TEXTS:
        assert probe.split_words(text) == runtime.split_words(text)


def test_converted_file_tokenizes_the_same_in_ik_and_ikrun(data_dir: Path, folder: Path, tmp_path: Path) -> None:
    """The tiny DeepSeek-V3 model with this vocabulary, converted naming `deepseek-llm`: ik (the wheel) and the
    runtime read the same keys and give the `tokenizers` library's ids."""
    n_vocab = len(HFTokenizerFiles(folder).vocab)
    hf_dir = deepseek_v3_with_vocab(data_dir, tmp_path / "hf", n_vocab, [folder / "tokenizer.json"])
    gguf = Converter(hf_dir, "bf16", pre_tokenizer="deepseek-llm").write(tmp_path / "ds-llm.gguf")
    ours = BPETokenizer.from_gguf(GGUFFile(gguf))
    hf = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    expected = [hf.encode(t, add_special_tokens=False).ids for t in TEXTS]
    assert [ours.encode(t, add_special=False) for t in TEXTS] == expected
    assert ik_engine.tokenize(gguf, TEXTS) == expected
