"""Byte-level BPE tokenization with ik_llama.cpp's semantics, built from a GGUF's vocabulary.

llama.cpp tokenizes in four steps: split the text on special tokens (user-defined ones always, control ones only
when parsing specials), split each plain fragment with the pre-tokenizer's list of regexes (each regex splits every
current piece; matches and the gaps between them both become pieces), byte-encode each piece GPT-2 style, and
merge its characters by BPE rank (lowest rank first, leftmost on ties). The regex lists and per-pre-tokenizer flags
below are facts taken from ik's llama-vocab.cpp, written in the original (Unicode-class) form the `regex` module runs.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from functools import lru_cache

import regex

from ikconvert.errors import TokenizerError

# token types (gguf TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_DEEPSEEK3 = [
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
]
# DeepSeek-LLM (V1, V2, V2-Lite): newlines alone, then runs of letters of the cased scripts, of ASCII/full-width
# punctuation, trailing whitespace, CJK/Hangul runs, digit runs (tokenizer.json's Split/Digits sequence).
_DEEPSEEK_LLM = [
    "[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
]
# Kimi-K2 (tokenization_kimi.py's pat_str): GPT-4o's word rules with Han runs taken out of letters and made pieces
# of their own. The original's class intersections `[...&&[^\p{Han}]]` are written as a negative lookahead per
# character, which means the same and needs no VERSION1 flag (whose full case folding would change `(?i:...)`).
_NOT_HAN_UPPER = r"(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])"
_NOT_HAN_LOWER = r"(?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])"
_KIMI_K2 = (r"\p{Han}+"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_STARCODER = [r"\p{N}", _GPT2]
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]


@dataclass(frozen=True)
class PreTokenizer:
    """One of llama.cpp's pre-tokenizer types: its regex list and the vocabulary defaults it implies."""

    regexes: tuple[str, ...]
    add_bos: bool = False
    ignore_merges: bool = False
    clean_spaces: bool = True
    no_bos_token: bool = False


def _pre(regexes: list[str] | str, **flags: bool) -> PreTokenizer:
    return PreTokenizer(tuple([regexes] if isinstance(regexes, str) else regexes), **flags)


_LLAMA3_PRE = _pre(_LLAMA3, add_bos=True, ignore_merges=True)
_QWEN2_PRE = _pre(_QWEN2, clean_spaces=False)
_DEEPSEEK3_PRE = _pre(_DEEPSEEK3, clean_spaces=False)
_GPT4O_PRE = _pre(_GPT4O, clean_spaces=False)
_GPT2_PRE = _pre(_GPT2)
_STARCODER_PRE = _pre(_STARCODER)

# tokenizer.ggml.pre value -> pre-tokenizer, per ik's llama-vocab.cpp (load() and llm_tokenizer_bpe).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _pre(_DEFAULT),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "laguna", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano"], _LLAMA3_PRE),
    "dbrx": _pre(_LLAMA3),
    "smaug-bpe": _pre(_LLAMA3),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "openpangu", "f2llmv2"], _QWEN2_PRE),
    "megrez": _pre(_QWEN2),
    "stablelm2": _pre(_QWEN2),
    "hunyuan": _QWEN2_PRE,
    "solar-open": _QWEN2_PRE,
    "grok-2": _QWEN2_PRE,
    "qwen35": _pre(_QWEN35, clean_spaces=False),
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "joyai-llm"], _DEEPSEEK3_PRE),
    "deepseek-llm": _pre(_DEEPSEEK_LLM, clean_spaces=False),
    "kimi-k2": _pre(_KIMI_K2, clean_spaces=False),
    **dict.fromkeys(["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling"],
                    _GPT2_PRE),
    **dict.fromkeys(["starcoder", "refact", "codeshell", "exaone", "minerva-7b"], _STARCODER_PRE),
    **dict.fromkeys(["command-r", "cohere2_moe", "smollm"], _pre(_STARCODER, clean_spaces=False)),
    **dict.fromkeys(["glm4", "chatglm-bpe"], _pre(_LLAMA3, no_bos_token=True)),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "minimax-m2"], _GPT4O_PRE),
    "seed-coder": _pre(_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
                       r"|\s+(?!\S)|\s+", clean_spaces=False),
}


@lru_cache(maxsize=1)
def byte_encoder() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


@dataclass
class BPETokenizer:
    """A byte-level BPE vocabulary with llama.cpp's splitting rules."""

    tokens: list[str]
    merges: list[str]
    regexes: tuple[str, ...]
    token_types: list[int] = field(default_factory=list)
    ignore_merges: bool = False
    add_bos: bool = False
    add_eos: bool = False
    bos_id: int | None = None
    eos_id: int | None = None
    normalize_nfc: bool = False

    def __post_init__(self) -> None:
        self._ids = {t: i for i, t in enumerate(self.tokens)}
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(self.merges):
            left, sep, right = merge.partition(" ")
            if sep:
                self._ranks.setdefault((left, right), rank)
        self._compiled = [regex.compile(r) for r in self.regexes]
        types = self.token_types or [NORMAL] * len(self.tokens)
        self._user_defined = sorted((t for t, ty in zip(self.tokens, types) if ty == USER_DEFINED), key=len,
                                    reverse=True)
        self._specials = sorted((t for t, ty in zip(self.tokens, types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)),
                                key=len, reverse=True)
        self._cache: dict[str, list[int]] = {}

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`; `add_special` adds BOS/EOS as the vocabulary asks, like llama_tokenize."""
        ids: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            ids.append(self.bos_id)
        specials = self._specials if parse_special else self._user_defined
        for fragment, is_special in self._partition(text, specials):
            if is_special:
                ids.append(self._ids[fragment])
            else:
                ids.extend(self._encode_plain(fragment))
        if add_special and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    @staticmethod
    def _partition(text: str, specials: list[str]) -> list[tuple[str, bool]]:
        parts: list[tuple[str, bool]] = [(text, False)]
        for special in specials:
            if not any(not s and special in f for f, s in parts):
                continue
            out: list[tuple[str, bool]] = []
            for frag, is_special in parts:
                if is_special or special not in frag:
                    out.append((frag, is_special))
                    continue
                pieces = frag.split(special)
                for i, piece in enumerate(pieces):
                    if piece:
                        out.append((piece, False))
                    if i + 1 < len(pieces):
                        out.append((special, True))
            parts = out
        return parts

    def split_words(self, text: str) -> list[str]:
        """The pre-tokenizer pieces of plain text (before byte encoding)."""
        if self.normalize_nfc:
            text = unicodedata.normalize("NFC", text)
        pieces = [text] if text else []
        for rx in self._compiled:
            out: list[str] = []
            for piece in pieces:
                pos = 0
                for m in rx.finditer(piece):
                    if m.start() == m.end():
                        continue
                    if m.start() > pos:
                        out.append(piece[pos : m.start()])
                    out.append(m.group())
                    pos = m.end()
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        return pieces

    def _encode_plain(self, text: str) -> list[int]:
        enc = byte_encoder()
        ids: list[int] = []
        for word in self.split_words(text):
            encoded = "".join(enc[b] for b in word.encode("utf-8"))
            cached = self._cache.get(encoded)
            if cached is None:
                cached = self._bpe(encoded)
                if len(self._cache) < 200_000:
                    self._cache[encoded] = cached
            ids.extend(cached)
        return ids

    def _bpe(self, word: str) -> list[int]:
        if self.ignore_merges and word in self._ids:
            return [self._ids[word]]
        symbols = list(word)
        ranks = self._ranks
        while len(symbols) > 1:
            best_rank = None
            best_i = -1
            for i in range(len(symbols) - 1):
                r = ranks.get((symbols[i], symbols[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best_rank, best_i = r, i
            if best_rank is None:
                break
            symbols[best_i : best_i + 2] = [symbols[best_i] + symbols[best_i + 1]]
        out: list[int] = []
        for sym in symbols:
            tid = self._ids.get(sym)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._ids[c] for c in sym if c in self._ids)
        return out

    @classmethod
    def from_gguf(cls, gguf: object) -> BPETokenizer:
        """Build from a GGUF's tokenizer.ggml.* keys (model 'gpt2' only)."""
        get = gguf.get  # type: ignore[attr-defined]
        model = get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(f"tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2'); "
                                 "pass token ids instead of text")
        pre_name = get("tokenizer.ggml.pre") or "default"
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise TokenizerError(f"pre-tokenizer {pre_name!r} is not supported; known: {', '.join(sorted(PRE_TOKENIZERS))}")
        add_bos = get("tokenizer.ggml.add_bos_token")
        add_eos = get("tokenizer.ggml.add_eos_token")
        bos = None if pre.no_bos_token else get("tokenizer.ggml.bos_token_id")
        return cls(
            tokens=list(get("tokenizer.ggml.tokens")),
            merges=list(get("tokenizer.ggml.merges") or []),
            regexes=pre.regexes,
            token_types=list(get("tokenizer.ggml.token_type") or []),
            ignore_merges=pre.ignore_merges,
            add_bos=pre.add_bos if add_bos is None else bool(add_bos),
            add_eos=False if add_eos is None else bool(add_eos),
            bos_id=None if bos is None else int(bos),
            eos_id=get("tokenizer.ggml.eos_token_id"),
        )
