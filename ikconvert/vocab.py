"""Tokenizer files (tokenizer.json, tokenizer_config.json, config.json) -> GGUF tokenizer keys, as ik writes them.

The vocabulary list, token types, merges and special ids follow ik's converter (`get_vocab_base`, gguf-py's
SpecialVocab). The pre-tokenizer name is identified the way ik's converter does it: encode a fixed probe string with
the model's own tokenizer and look the sha256 of the id list up in a table of known models. The encoding is done
by our byte-level BPE implementation configured from tokenizer.json (the components real BPE checkpoints use);
anything it cannot reproduce exactly is reported instead of guessed, and `--pre-tokenizer` overrides.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from gguf import GGUFWriter, SpecialVocab, TokenType

from ikconvert.errors import VocabError

log = logging.getLogger(__name__)

# The probe text of ik's convert_hf_to_gguf.py get_vocab_base_pre.
PROBE_TEXT = '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, \'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL'

# sha256(str(ids of PROBE_TEXT)) -> tokenizer.ggml.pre, as in ik's table (where a hash appears twice, the later
# entry wins there, so it does here).
PRE_TOKENIZER_HASHES: dict[str, str] = {
    "66b8d4e19ab16c3bfd89bce5d785fb7e0155e8648708a1f42077cb9fe002c273": "grok-2",
    "65df2fe396b537a53433301848c0a739f56d56f67ad3d35eba27961ac33c12bb": "openpangu",
    "972da7b59cec44d1f0a490a86c96df53859e486e481563e5dddac155013d87ac": "laguna",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "049ecf7629871e3041641907f3de7c733e4dbfdc736f57d882ba0b0845599754": "deepseek-llm",
    "347715f544604f9118bb75ed199f68779f423cabb20db6de6f31b908d04d7821": "deepseek-coder",
    "8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed": "falcon",
    "0876d13b50744004aa9aeae05e7b0647eac9d801b5ba4668afc01e709c15e19f": "jina-v2-en",
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "olmo",
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3": "stablelm2",
    "6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff": "refact",
    "9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8": "command-r",
    "52df12b4c8d4176e7481aab4b6e8454d1fd0a210a04a574f6d4e067d10e23c3e": "cohere2_moe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4": "qwen35",
    "99cc61242f7106804ce24fdf3a6451e4a55251078dffd5453c806e11b2310db3": "qwen35",
    "1444df51289cfa8063b96f0e62b1125440111bc79a52003ea14b6eac7016fd5f": "qwen35",
    "4f53cda18c2baa0c0354bb5f9a3ecbe5ed12ab4d8e11ba873c2f11161202b945": "qwen35",
    "a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e": "dbrx",
    "171aeeedd6fb548d418a7461d053f11b6f1f1fc9b387bd66640d28a4b9f5c643": "jina-v2-es",
    "27949a2493fc4a9f53f5b9b029c82689cfbe5d3a1929bb25e043089e28466de6": "jina-v2-de",
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",
    "c7ea5862a53e4272c035c8238367063e2b270d51faa48c0f09e9d5b54746c360": "poro-chat",
    "7967bfa498ade6b757b064f31e964dddbb80f8f9a4d68d4ba7998fcf281c531a": "jina-v2-code",
    "b6e8e1518dc4305be2fe39c313ed643381c4da5db34a98f6a04c093f8afbe99b": "chatglm-bpe",
    "81d72c7348a9f0ebe86f23298d37debe0a5e71149e29bd283904c02262b27516": "chatglm-bpe",
    "a1336059768a55c99a734006ffb02203cd450fed003e9a71886c88acf24fdbc2": "glm4",
    "7fc505bd3104ca1083b150b17d088b59534ede9bde81f0dd2090967d7fe52cee": "viking",
    "b53802fb28e26d645c3a310b34bfe07da813026ec7c7716883404d5e0f8b1901": "jais",
    "7b3e7548e4308f52a76e8229e4e6cc831195d0d1df43aed21ac6c93da05fec5f": "codeshell",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "877081d19cf6996e2c4ff0e1236341e9b7bde288f5311a56a937f0afbbb3aeb5": "deepseek-v3",
    "b4b8ca1f9769494fbd956ebc4c249de6131fb277a4a3345a7a92c7dd7a55808d": "joyai-llm",
    "d5f1dd6f980fec569fb218a81a7658ac45fc56b38c5a0adeb1c232fbe04ef5ec": "seed-coder",
    "81212dc7cdb7e0c1074ca62c5aeab0d43c9f52b8a737be7b12a777c953027890": "kimi-k2",
    "9b1be57e70d20d9501b2b3186e792d81181ae36ada3903c26f9fea418cf87206": "bailingmoe2",
    "f4f37b6c8eb9ea29b3eac6bb8c8487c5ab7885f8d8022e67edc1c68ce8403e95": "minimax-m2",
    "9dcf830ee9990cdbf78cc523a5f7bd9ad8f3f9890c2d3581d2785ad10f07049d": "mellum2",
    "ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e": "gpt-4o",
}


# HF ByteLevel pre-tokenizer's own split pattern (GPT-2).
_BYTELEVEL_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"


def _looks_special(token: str) -> bool:
    """ik's does_token_look_special: added tokens that ought to be control tokens even if not marked special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


class HFTokenizerFiles:
    """The byte-level BPE tokenizer described by a folder's tokenizer.json (+ tokenizer_config.json)."""

    def __init__(self, folder: Path):
        self.dir = folder
        path = folder / "tokenizer.json"
        if (folder / "tokenizer.model").is_file():
            raise VocabError(f"{folder / 'tokenizer.model'}: SentencePiece vocabularies are not supported yet")
        if not path.is_file():
            raise VocabError(f"{folder}: no tokenizer.json")
        self.json: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        cfg = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg.read_text(encoding="utf-8")) if cfg.is_file() else {}
        model = self.json.get("model") or {}
        if model.get("type") != "BPE":
            raise VocabError(f"{path}: tokenizer model {model.get('type')!r} is not supported (byte-level BPE only)")
        self.vocab: dict[str, int] = dict(model.get("vocab") or {})
        self.added: dict[int, dict[str, Any]] = {}
        for entry in self.config.get("added_tokens_decoder", {}).items():
            self.added[int(entry[0])] = dict(entry[1])
        for tok in self.json.get("added_tokens") or []:
            self.added[int(tok["id"])] = tok
        for tid, tok in self.added.items():
            self.vocab.setdefault(tok["content"], tid)

    def merges(self) -> list[str]:
        merges = (self.json.get("model") or {}).get("merges") or []
        out = []
        for m in merges:
            if isinstance(m, str):
                out.append(m)
            else:
                out.append(" ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part) for part in m))
        return out

    def tokens_and_types(self, vocab_size: int) -> tuple[list[str], list[int]]:
        """ik's get_vocab_base: one entry per id below vocab_size; ids the tokenizer lacks become [PAD<id>]."""
        reverse = {i: t for t, i in self.vocab.items()}
        if reverse and max(reverse) >= vocab_size:
            raise VocabError(
                f"{self.dir / 'tokenizer.json'}: token id {max(reverse)} is not below vocab_size {vocab_size} "
                "(config.json)"
            )
        tokens: list[str] = []
        types: list[int] = []
        added_ids = {tid for tid in self.added}
        for i in range(vocab_size):
            if i not in reverse:
                tokens.append(f"[PAD{i}]")
                types.append(int(TokenType.UNUSED))
                continue
            token = reverse[i]
            if i in added_ids:
                if self.added[i].get("special") or _looks_special(token):
                    types.append(int(TokenType.CONTROL))
                else:
                    token = token.replace("\u2581", " ")
                    types.append(int(TokenType.USER_DEFINED))
            else:
                types.append(int(TokenType.NORMAL))
            tokens.append(token)
        return tokens, types

    def probe_tokenizer(self) -> Any:
        """Our BPE tokenizer configured like tokenizer.json, or a VocabError saying which part we cannot mirror."""
        from ikconvert.tokenizer import USER_DEFINED, BPETokenizer

        where = self.dir / "tokenizer.json"
        nfc = False
        norm = self.json.get("normalizer")
        for n in (norm.get("normalizers", [norm]) if isinstance(norm, dict) else []):
            if n.get("type") == "NFC":
                nfc = True
            else:
                raise VocabError(f"{where}: normalizer {n.get('type')!r} is not supported")
        regexes: list[str] = []
        pre = self.json.get("pre_tokenizer")
        steps = (pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]) if pre else []
        for step in steps:
            kind = step.get("type")
            if kind == "Split" and step.get("behavior") == "Isolated" and not step.get("invert"):
                pattern = step.get("pattern") or {}
                if "Regex" not in pattern:
                    raise VocabError(f"{where}: Split on a plain string is not supported")
                regexes.append(pattern["Regex"])
            elif kind == "ByteLevel":
                if step.get("add_prefix_space") and len(steps) > 1:
                    raise VocabError(f"{where}: ByteLevel add_prefix_space inside a Sequence is not supported")
                if step.get("use_regex", True):
                    regexes.append(_BYTELEVEL_REGEX)
            elif kind == "Digits":
                regexes.append(r"\p{N}" if step.get("individual_digits") else r"\p{N}+")
            else:
                raise VocabError(f"{where}: pre-tokenizer step {kind!r} is not supported")
        model = self.json["model"]
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            raise VocabError(f"{where}: BPE with subword prefixes/suffixes is not supported")
        size = max(self.vocab.values()) + 1 if self.vocab else 0
        tokens, types = self.tokens_and_types(size)
        types = [USER_DEFINED if i in self.added else t for i, t in enumerate(types)]
        return BPETokenizer(tokens=tokens, merges=self.merges(), regexes=tuple(regexes), token_types=types,
                            ignore_merges=bool(model.get("ignore_merges")), normalize_nfc=nfc)

    def _template(self) -> tuple[list[int], list[int]]:
        """Ids the post-processor puts around a single sequence (TemplateProcessing), like HF's encode()."""
        post = self.json.get("post_processor")
        prefix: list[int] = []
        suffix: list[int] = []
        for proc in (post.get("processors", [post]) if post else []):
            kind = proc.get("type")
            if kind == "TemplateProcessing":
                specials = proc.get("special_tokens") or {}
                seen_a = False
                for item in proc.get("single") or []:
                    if "Sequence" in item:
                        seen_a = True
                    elif "SpecialToken" in item:
                        ids = specials.get(item["SpecialToken"]["id"], {}).get("ids", [])
                        (suffix if seen_a else prefix).extend(int(i) for i in ids)
            elif kind != "ByteLevel":
                raise VocabError(f"{self.dir / 'tokenizer.json'}: post-processor {kind!r} is not supported")
        return prefix, suffix

    def probe_hash(self) -> str:
        """sha256 of str(ids) of the probe text, exactly as ik's converter computes it with transformers."""
        tok = self.probe_tokenizer()
        prefix, suffix = self._template()
        ids = prefix + tok.encode(PROBE_TEXT, add_special=False, parse_special=False) + suffix
        return hashlib.sha256(str(ids).encode()).hexdigest()

    def detect_pre_tokenizer(self) -> str:
        try:
            digest = self.probe_hash()
        except VocabError as exc:
            raise VocabError(f"cannot identify the BPE pre-tokenizer: {exc}; pass --pre-tokenizer NAME") from None
        name = PRE_TOKENIZER_HASHES.get(digest)
        if name is None:
            raise VocabError(
                f"{self.dir / 'tokenizer.json'}: BPE pre-tokenizer not recognized (probe hash {digest}); "
                "ik's converter refuses it too. Pass --pre-tokenizer NAME (e.g. qwen2, llama-bpe, deepseek-v3) "
                "naming the model family whose tokenizer this one copies"
            )
        return name


class _IkSpecialVocab(SpecialVocab):
    """gguf-py's SpecialVocab as ik's copy behaves: special ids are not looked up in config.json's text_config."""

    def _try_load_from_config_json(self, path: Path) -> bool:
        config_file = path / "config.json"
        if not config_file.is_file():
            return False
        config = json.loads(config_file.read_text(encoding="utf-8"))
        for typ in self.special_token_types:
            self._set_special_token(typ, config.get(f"{typ}_token_id"))
        return True


def write_bpe_vocab(gw: GGUFWriter, folder: Path, vocab_size: int, pre_tokenizer: str,
                    special_ids: dict[str, int] | None = None) -> None:
    """Add ik's GPT-2 BPE tokenizer keys for `folder` to `gw` (tokenizer.ggml.pre = `pre_tokenizer`).

    `special_ids` (type -> id) are the special tokens an architecture's set_vocab adds after gguf-py has read the
    tokenizer files (ik's GLM vocabularies set bos/eot/unk/eom this way); a type already set keeps its id.
    """
    tokens, types = HFTokenizerFiles(folder).tokens_and_types(vocab_size)
    gw.add_tokenizer_model("gpt2")
    gw.add_tokenizer_pre(pre_tokenizer)
    gw.add_token_list(tokens)
    gw.add_token_types(types)
    special = _IkSpecialVocab(folder, load_merges=True)
    for typ, tid in (special_ids or {}).items():
        special._set_special_token(typ, tid)
    special.add_to_gguf(gw, quiet=True)
