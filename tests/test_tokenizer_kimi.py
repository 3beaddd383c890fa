"""Kimi-K2's tiktoken vocabulary: converted as ik writes it, tokenized by ikrun with the reference's ids.

The checkpoint is the tiny DeepSeek-V3 one with Kimi's vocab_size (163840, which is what sends ik's converter to
its tiktoken branch), its tokenizer.json replaced by a tiny tiktoken.model and a tokenizer_config.json of Kimi's
shape (tests/data/convert/kimi-k2/tokenizer). The expected ids were produced by the tiktoken library itself with
Kimi's pat_str (tiktoken-ids.json); a plain-Python tiktoken written here from its definition checks them again.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import regex
from typer.testing import CliRunner

from ikconvert.convert import Converter
from ikconvert.errors import VocabError
from ikconvert.tiktoken_vocab import TIKTOKEN_FILE, TiktokenFiles, read_tiktoken_ranks
from ikconvert.tokenizer import CONTROL, NORMAL, UNUSED, byte_encoder
from ikconvert.vocab import PRE_TOKENIZER_HASHES, PROBE_TEXT
from ikquant.gguf_io import GGUFFile
from ikrun.cli import app as ikrun_app
from ikrun.model import Model
from tests import ik_engine
from tests.convert_helpers import convert_fails, deepseek_v3_with_vocab

KIMI_VOCAB = 163840


@pytest.fixture(scope="module")
def kimi_dir(data_dir: Path) -> Path:
    return data_dir / "convert" / "kimi-k2"


@pytest.fixture(scope="module")
def reference(kimi_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((kimi_dir / "tiktoken-ids.json").read_text(encoding="utf-8"))
    return data


def _n_base(kimi_dir: Path) -> int:
    return sum(1 for line in (kimi_dir / "tokenizer" / TIKTOKEN_FILE).read_text().splitlines() if line)


def make_kimi_checkpoint(data_dir: Path, kimi_dir: Path, folder: Path) -> Path:
    """The tiny DeepSeek-V3 checkpoint with 163840-row embeddings and Kimi's tokenizer files."""
    tokenizer = kimi_dir / "tokenizer"
    deepseek_v3_with_vocab(data_dir, folder, KIMI_VOCAB, [tokenizer / TIKTOKEN_FILE, tokenizer / "tokenizer_config.json"])
    cfg = json.loads((folder / "config.json").read_text())
    n_base = _n_base(kimi_dir)
    cfg.update(bos_token_id=n_base, eos_token_id=n_base + 1)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


@pytest.fixture(scope="module")
def kimi_gguf(data_dir: Path, kimi_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("kimi")
    hf = make_kimi_checkpoint(data_dir, kimi_dir, tmp / "hf")
    return Converter(hf, "bf16", pre_tokenizer="kimi-k2").write(tmp / "kimi-bf16.gguf")


# ---- an independent tiktoken, from its definition ----------------------------------------------------------------
def tiktoken_encode(ranks: dict[bytes, int], pat_str: str, text: str) -> list[int]:
    """tiktoken's encode_ordinary: a piece that is a token is that token; otherwise its bytes are merged, always
    at the adjacent pair whose concatenation has the lowest rank. `(?V1)` gives the pattern's `&&` its meaning."""
    ids: list[int] = []
    for piece in regex.findall("(?V1)" + pat_str, text):
        word = piece.encode("utf-8")
        if word in ranks:
            ids.append(ranks[word])
            continue
        parts = [bytes([b]) for b in word]
        while True:
            pairs = [(ranks[a + b], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if a + b in ranks]
            if not pairs:
                break
            _, i = min(pairs)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(ranks[p] for p in parts)
    return ids


def test_fixture_ids_are_tiktokens(kimi_dir: Path, reference: dict[str, Any]) -> None:
    ranks = {base64.b64decode(t): int(r) for t, r in
             (line.split() for line in (kimi_dir / "tokenizer" / TIKTOKEN_FILE).read_text().splitlines())}
    files = TiktokenFiles(kimi_dir / "tokenizer")
    for case in reference["cases"]:
        assert tiktoken_encode(ranks, reference["pat_str"], case["text"]) == case["ordinary"]
        assert files.encode(case["text"]) == case["ordinary"]  # the converter's, for the probe hash


# ---- the converter -------------------------------------------------------------------------------------------------
def test_conversion_writes_iks_kimi_vocabulary(kimi_gguf: Path, kimi_dir: Path, data_dir: Path) -> None:
    g = GGUFFile(kimi_gguf)
    n_base = _n_base(kimi_dir)
    assert g.get("tokenizer.ggml.model") == "gpt2"
    assert g.get("tokenizer.ggml.pre") == "kimi-k2"
    tokens, types = list(g.get("tokenizer.ggml.tokens")), list(g.get("tokenizer.ggml.token_type"))
    assert len(tokens) == len(types) == KIMI_VOCAB
    enc = byte_encoder()
    assert tokens[:256] == [enc[b] for b in range(256)]
    assert types == [NORMAL] * n_base + [CONTROL] * 256 + [UNUSED] * (KIMI_VOCAB - n_base - 256)
    assert tokens[n_base : n_base + 3] == ["[BOS]", "[EOS]", "<|im_end|>"]
    assert tokens[n_base + 5] == f"<|reserved_token_{n_base + 5}|>"
    assert tokens[n_base + 255] == "[PAD]" and tokens[-1] == f"[PAD{KIMI_VOCAB - 1}]"
    assert g.get("tokenizer.ggml.bos_token_id") == n_base and g.get("tokenizer.ggml.eos_token_id") == n_base + 1
    # every merge joins two lower-ranked tokens into a token, in rank order; single bytes never merge
    ids = {t: i for i, t in enumerate(tokens[:n_base])}
    merges = list(g.get("tokenizer.ggml.merges"))
    made = [ids[m.replace(" ", "")] for m in merges]
    assert made == sorted(made) and len(merges) == n_base - 256
    assert all(ids[m.split(" ")[0]] < r and ids[m.split(" ")[1]] < r for m, r in zip(merges, made))
    # ik's keys for the checkpoint this one is built from, less what gguf-py's SpecialVocab only finds through a
    # tokenizer.json (the pad id, the post-processor's add_* flags) and the chat template this config lacks
    ik = GGUFFile(data_dir / "convert" / "deepseek-v3" / "ik-bf16.gguf")
    absent = {"tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_sep_token",
              "tokenizer.ggml.add_eos_token", "tokenizer.chat_template"}
    assert [kv.key for kv in g.kv()] == [kv.key for kv in ik.kv() if kv.key not in absent]


def test_tokenizer_keys_equal_what_iks_own_set_vocab_wrote(kimi_gguf: Path, kimi_dir: Path) -> None:
    """ik-tokenizer-keys.json: ik's Kimi-K2 set_vocab itself, run on this checkpoint (see tests/data/README.md)."""
    ik = json.loads((kimi_dir / "ik-tokenizer-keys.json").read_text(encoding="utf-8"))
    g = GGUFFile(kimi_gguf)
    ours = [kv for kv in g.kv() if kv.key.startswith("tokenizer.")]
    assert [[kv.key, int(kv.type)] for kv in ours] == ik["keys"]
    named = ik["tokens_before_padding"]
    assert list(g.get("tokenizer.ggml.tokens")) == named + [f"[PAD{i}]" for i in range(len(named), ik["n_tokens"])]
    assert list(g.get("tokenizer.ggml.token_type")) == [t for t, n in ik["token_type_runs"] for _ in range(n)]
    assert list(g.get("tokenizer.ggml.merges")) == ik["merges"]
    assert g.get("tokenizer.ggml.pre") == ik["pre"]
    assert (g.get("tokenizer.ggml.bos_token_id"), g.get("tokenizer.ggml.eos_token_id")) == (ik["bos_token_id"],
                                                                                          ik["eos_token_id"])


def test_probe_hash_is_the_one_tiktoken_gives(kimi_dir: Path, reference: dict[str, Any]) -> None:
    """ik hashes the probe text's ids from Kimi's tokenizer: ours are tiktoken's, so the real vocabulary's hash is
    ik's kimi-k2 entry; this tiny one is in no table, and the converter refuses it like ik does."""
    probe = next(c for c in reference["cases"] if c["text"] == PROBE_TEXT)
    files = TiktokenFiles(kimi_dir / "tokenizer")
    expected = hashlib.sha256(str(probe["ordinary"]).encode()).hexdigest()
    assert files.probe_hash() == expected
    assert expected not in PRE_TOKENIZER_HASHES
    assert PRE_TOKENIZER_HASHES["81212dc7cdb7e0c1074ca62c5aeab0d43c9f52b8a737be7b12a777c953027890"] == "kimi-k2"
    with pytest.raises(VocabError, match=f"not recognized \\(probe hash {expected}\\).*--pre-tokenizer"):
        files.detect_pre_tokenizer()


def test_unrecognized_tiktoken_vocabulary_is_refused(data_dir: Path, kimi_dir: Path, tmp_path: Path) -> None:
    hf = make_kimi_checkpoint(data_dir, kimi_dir, tmp_path / "hf")
    convert_fails([str(hf), "--outtype", "bf16"], tmp_path / "out.gguf", TIKTOKEN_FILE, "not recognized",
                  "--pre-tokenizer")


@pytest.mark.parametrize("line, needle", [
    ("QUJD", "expected '<base64 token> <rank>'"),
    ("QUJD 7 8", "expected '<base64 token> <rank>'"),
    ("@@@@ {n}", "is not base64"),
    ("QUJD x1", "rank 'x1' is not a non-negative integer"),
    ("AA== {n}", "listed twice"),
])
def test_malformed_tiktoken_model_names_file_and_line(kimi_dir: Path, tmp_path: Path, line: str,
                                                      needle: str) -> None:
    text = (kimi_dir / "tokenizer" / TIKTOKEN_FILE).read_text()
    bad = tmp_path / TIKTOKEN_FILE
    bad.write_text(text + line.format(n=_n_base(kimi_dir)) + "\n")
    with pytest.raises(VocabError) as err:
        read_tiktoken_ranks(bad)
    assert str(err.value).startswith(f"{bad}:{text.count(chr(10)) + 1}: ") and needle in str(err.value)


def test_ranks_with_a_gap_are_refused(kimi_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / TIKTOKEN_FILE
    n = _n_base(kimi_dir)
    bad.write_text((kimi_dir / "tokenizer" / TIKTOKEN_FILE).read_text() + f"QUJDRA== {n + 1}\n")
    with pytest.raises(VocabError, match=f"^{bad}: ranks are not 0..{n} each once"):
        read_tiktoken_ranks(bad)


def test_kimi_vocab_size_without_tiktoken_model(data_dir: Path, kimi_dir: Path, tmp_path: Path) -> None:
    hf = make_kimi_checkpoint(data_dir, kimi_dir, tmp_path / "hf")
    (hf / TIKTOKEN_FILE).unlink()
    convert_fails([str(hf), "--outtype", "bf16", "--pre-tokenizer", "kimi-k2"], tmp_path / "out.gguf",
                  str(hf), f"no {TIKTOKEN_FILE}", "vocab_size of 163840")


# ---- the runtime --------------------------------------------------------------------------------------------------
def test_runtime_tokenizes_like_tiktoken(kimi_gguf: Path, reference: dict[str, Any]) -> None:
    tok = Model(kimi_gguf).tokenizer()
    for case in reference["cases"]:
        assert tok.encode(case["text"]) == case["ordinary"]  # Kimi adds no BOS
        assert tok.encode(case["text"], add_special=False, parse_special=True) == case["all_specials"]


def test_ikrun_ppl_runs_on_the_kimi_file(kimi_gguf: Path, reference: dict[str, Any], tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text(reference["cases"][0]["text"], encoding="utf-8")
    res = CliRunner().invoke(ikrun_app, ["ppl", str(kimi_gguf), "--text", str(text), "--ctx", "64", "--chunks", "2",
                                         "--json"])
    assert res.exit_code == 0, res.output
    stats = json.loads(res.stdout)
    assert stats["n_tokens"] == 2 * (64 // 2 - 1) and np.isfinite(stats["ppl"])  # ik scores ctx/2 - 1 a chunk


def test_the_wheels_ik_differs_only_on_script_han_outside_its_ranges_and_uppercase_contractions(
        kimi_gguf: Path, reference: dict[str, Any]) -> None:
    """ik (the wheel) tokenizes the converted file with its own Kimi splitter: tiktoken's ids except where a
    character is Script=Han outside the CJK blocks ik lists (々 U+3005, 〇 U+3007) or a contraction is uppercase
    ('VE: the wheel compares case-sensitively; ik's current source lowercases). Without those, ik gives ours."""
    texts = [c["text"] for c in reference["cases"]]
    ik = ik_engine.tokenize(kimi_gguf, texts)
    tok = Model(kimi_gguf).tokenizer()
    differs = [i for i, (text, ids) in enumerate(zip(texts, ik)) if ids != tok.encode(text)]
    assert differs == [i for i, t in enumerate(texts) if regex.search(r"[々〇]|'(?:VE|S|T)\b", t)] and differs

    def plain(text: str) -> str:
        return regex.sub(r"'(VE|S|T)\b", lambda m: "'" + m.group(1).lower(), text.replace("々", "").replace("〇", ""))

    cleaned = [plain(t) for t in texts]
    assert ik_engine.tokenize(kimi_gguf, cleaned) == [tok.encode(t) for t in cleaned]
    assert ik_engine.tokenize(kimi_gguf, cleaned, parse_special=True) == [
        tok.encode(t, add_special=False, parse_special=True) for t in cleaned]
