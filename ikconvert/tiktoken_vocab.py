"""Kimi-K2's tiktoken vocabulary (tiktoken.model + tokenizer_config.json) -> GGUF tokenizer keys, as ik writes them.

A tiktoken file lists base64 token bytes and their ranks; it has no merge list. ik's converter (its Kimi-K2 branch
of DeepseekV2Model.set_vocab) writes the tokens GPT-2 byte-encoded, derives the merges from the ranks (a token's
merge is the pair its own bytes reach by rank-ordered merging among lower-ranked tokens; tokens that do not end in
exactly two parts contribute none), and numbers Kimi's 256 special tokens after the base vocabulary, named from
tokenizer_config.json's `added_tokens_decoder` or `<|reserved_token_<id>|>`. The runtime then tokenizes with
llama.cpp's merge-rank BPE and Kimi's regex (`kimi-k2` in ikconvert.tokenizer).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from pathlib import Path
from typing import Any

from gguf import GGUFWriter, TokenType

from ikconvert.errors import VocabError

TIKTOKEN_FILE = "tiktoken.model"
KIMI_VOCAB_SIZE = 163840  # ik's converter takes its Kimi-K2 branch on exactly this config.json vocab_size
KIMI_RESERVED_SPECIALS = 256  # tokenization_kimi.py's num_reserved_special_tokens


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Token bytes -> rank from a tiktoken file, in file order; malformed lines are errors naming file and line."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise VocabError(f"{path}:{number}: expected '<base64 token> <rank>', got {line[:60]!r}")
        try:
            token = base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError):
            raise VocabError(f"{path}:{number}: {fields[0][:40]!r} is not base64") from None
        if not fields[1].isdigit():
            raise VocabError(f"{path}:{number}: rank {fields[1][:20]!r} is not a non-negative integer")
        if token in ranks:
            raise VocabError(f"{path}:{number}: token {fields[0]!r} is listed twice")
        ranks[token] = int(fields[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise VocabError(f"{path}: ranks are not 0..{len(ranks) - 1} each once (Kimi's special ids follow them)")
    return ranks


def rank_merge(ranks: dict[bytes, int], token: bytes, below: int) -> list[bytes]:
    """Merge `token`'s bytes pairwise, lowest-ranked pair first, using only tokens ranked below `below`."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best: tuple[int, int] | None = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < below and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def _as_gpt2(token: bytes) -> str:
    from ikconvert.tokenizer import byte_encoder

    enc = byte_encoder()
    return "".join(enc[b] for b in token)


class TiktokenFiles:
    """A folder's Kimi-style tiktoken vocabulary: base ranks plus the reserved special tokens after them."""

    def __init__(self, folder: Path):
        self.dir = folder
        path = folder / TIKTOKEN_FILE
        if not path.is_file():
            raise VocabError(f"{folder}: no {TIKTOKEN_FILE} (a vocab_size of {KIMI_VOCAB_SIZE} selects ik's "
                             "Kimi-K2 tiktoken vocabulary)")
        self.ranks = read_tiktoken_ranks(path)
        cfg = folder / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(cfg.read_text(encoding="utf-8")) if cfg.is_file() else {}
        named = {int(tid): entry["content"] for tid, entry in (config.get("added_tokens_decoder") or {}).items()}
        first = len(self.ranks)
        self.specials: dict[str, int] = {named.get(tid, f"<|reserved_token_{tid}|>"): tid
                                         for tid in range(first, first + KIMI_RESERVED_SPECIALS)}

    def merges(self) -> list[str]:
        """ik's merges: one per multi-byte token whose rank-limited merging ends in two parts, in file order."""
        out: list[str] = []
        for token, rank in self.ranks.items():
            if len(token) < 2:
                continue
            parts = rank_merge(self.ranks, token, rank)
            if len(parts) == 2:
                out.append(f"{_as_gpt2(parts[0])} {_as_gpt2(parts[1])}")
        return out

    def tokens_and_types(self, vocab_size: int) -> tuple[list[str], list[int]]:
        """One entry per id below vocab_size: base tokens NORMAL, specials CONTROL, ids without a token [PAD<id>]."""
        by_id = {rank: _as_gpt2(token) for token, rank in self.ranks.items()}
        by_id.update({tid: name for name, tid in self.specials.items()})
        if max(by_id) >= vocab_size:
            raise VocabError(f"{self.dir / TIKTOKEN_FILE}: {len(self.ranks)} tokens and {KIMI_RESERVED_SPECIALS} "
                             f"special tokens do not fit vocab_size {vocab_size} (config.json)")
        special_ids = set(self.specials.values())
        tokens: list[str] = []
        types: list[int] = []
        for i in range(vocab_size):
            if i not in by_id:
                tokens.append(f"[PAD{i}]")
                types.append(int(TokenType.UNUSED))
            else:
                tokens.append(by_id[i])
                types.append(int(TokenType.CONTROL if i in special_ids else TokenType.NORMAL))
        return tokens, types

    def encode(self, text: str) -> list[int]:
        """tiktoken's encode_ordinary, which produced ik's hash: Kimi's regex pieces, a piece that is a token taken
        whole, any other merged by rank (unlimited); the runtime's merge-list BPE is a separate implementation."""
        from ikconvert.tokenizer import PRE_TOKENIZERS, BPETokenizer

        splitter = BPETokenizer(tokens=[], merges=[], regexes=PRE_TOKENIZERS["kimi-k2"].regexes)
        ids: list[int] = []
        for piece in splitter.split_words(text):
            word = piece.encode("utf-8")
            parts = [word] if word in self.ranks else rank_merge(self.ranks, word, len(self.ranks))
            ids.extend(self.ranks[p] for p in parts)
        return ids

    def probe_hash(self) -> str:
        """sha256 of str(ids) of ik's probe text as Kimi's tokenizer encodes it (no BOS)."""
        from ikconvert.vocab import PROBE_TEXT

        return hashlib.sha256(str(self.encode(PROBE_TEXT)).encode()).hexdigest()

    def detect_pre_tokenizer(self) -> str:
        """ik's get_vocab_base_pre on this vocabulary: the probe hash looked up in ik's table."""
        from ikconvert.vocab import PRE_TOKENIZER_HASHES

        digest = self.probe_hash()
        name = PRE_TOKENIZER_HASHES.get(digest)
        if name is None:
            raise VocabError(f"{self.dir / TIKTOKEN_FILE}: BPE pre-tokenizer not recognized (probe hash {digest}); "
                             "ik's converter refuses it too. Pass --pre-tokenizer NAME (kimi-k2 for Kimi's regex)")
        return name


def write_tiktoken_vocab(gw: GGUFWriter, folder: Path, vocab_size: int, pre_tokenizer: str) -> None:
    """Add ik's Kimi-K2 tokenizer keys for `folder` to `gw`: GPT-2 style tokens, types, derived merges, specials."""
    from ikconvert.vocab import _IkSpecialVocab

    files = TiktokenFiles(folder)
    tokens, types = files.tokens_and_types(vocab_size)
    gw.add_tokenizer_model("gpt2")
    gw.add_tokenizer_pre(pre_tokenizer)
    gw.add_token_list(tokens)
    gw.add_token_types(types)
    gw.add_token_merges(files.merges())
    _IkSpecialVocab(folder, load_merges=False).add_to_gguf(gw, quiet=True)
