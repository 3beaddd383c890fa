#!/usr/bin/env python3
"""Rebuild the tokenizer test data of tests/data/convert/kimi-k2 and tests/data/convert/deepseek-llm.

Three steps, each run where its libraries are (the references are never project dependencies):

  vocab         project venv: the tiny Kimi tiktoken.model + tokenizer_config.json and the tiny DeepSeek-LLM
                tokenizer.json (its five Split regexes read from ik's llama-vocab.cpp in the mirror)
  tiktoken-ids  a separate venv with `tiktoken` (e.g. /tmp/tokref): tiktoken-ids.json, the reference's ids
  ik-keys       the same venv plus numpy, KIMI_GGUF_FOLDER = a Kimi checkpoint folder the tests build
                (tests.test_tokenizer_kimi.make_kimi_checkpoint): ik-tokenizer-keys.json from ik's own set_vocab

Example: python tools/make_tokenizer_fixtures.py vocab
         TIKTOKEN_CACHE_DIR= /tmp/tokref/bin/python tools/make_tokenizer_fixtures.py tiktoken-ids
(TIKTOKEN_CACHE_DIR empty: tiktoken otherwise caches a local file by its path and later reads the stale copy.)
"""

from __future__ import annotations

import ast
import base64
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KIMI = ROOT / "tests" / "data" / "convert" / "kimi-k2"
DS_LLM = ROOT / "tests" / "data" / "convert" / "deepseek-llm"
IK = Path("/work/.mirror/ikawrakow+ik_llama.cpp/repo")

KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# tokenization_kimi.py's named specials, by offset after the base vocabulary (Kimi-K2's own ids minus 163584)
KIMI_NAMED = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
              6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
              11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
              14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>", 254: "[UNK]",
              255: "[PAD]"}
KIMI_EXTRA = ("🦙  \n在apple工作 東京タワーabc、漢字〆〇 a/b/c x//y HELLOworld dont'T\r\n\r\n "
              "我想在apple工作1314151天～ 東京タワーは高いです。ひらがなとカタカナ、漢字々。 한국어 텍스트입니다. "
              "Привет, как дела? Grüße aus Köln! Ça va? I'VE we'll they'd HE'S 12345 3.14159 don't\n\n\t  tabs  \n")
DS_LLM_EXTRA = ("Привет, как дела? Ελληνικά κείμενα. 我想在apple工作1314151天～ 한국어 텍스트입니다. ＡＢＣ！？（）「」 "
                "Grüße aus Köln 12345 3.14 don't\r\n\n  🦙  \n😀 \t\nend.  \r\n\r\nabc123def ひらがなabc 😀!! 🦙?? "
                "ひらがな。。 🦙  ")


def kimi_texts(n_base: int) -> list[str]:
    from ikconvert.tiny import CORPUS
    from ikconvert.vocab import PROBE_TEXT

    return [
        CORPUS.read_text(encoding="utf-8"),
        PROBE_TEXT,
        "我想在apple工作1314151天～ 東京タワーは高いです。ひらがなとカタカナ、漢字々〆〇。 한국어 텍스트입니다. ㄅㄆㄇ",
        "Привет, как дела? Grüße aus Köln! Ça va? ΑΒΓ αβγ e\u0301te\u0301 I'VE we'll they'd HE'S Don'T ſs ǅungla\n",
        "1234567890 3.14159 ١٢٣ ½ 12a34 a1b2c3  \t\t\n\n\r\n  \u00a0\u3000x  end   ",
        "emoji 🦙🚀✅ mixed漢字and英文text 「引用」（括弧）…—",
        KIMI_EXTRA[:KIMI_EXTRA.index(" 我想")] + " カタカナ、漢字々。 123456789",
        "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>Hi [EOS] [BOS]"
        f"<|reserved_token_{n_base + 5}|> <|im_end|>",
    ]


def vocab() -> None:
    """Merges learned on whitespace-delimited words, so they cross the pre-tokenizers' splits."""
    from ikconvert.tiny import CORPUS, learn_merges
    from ikconvert.tokenizer import byte_encoder

    enc = byte_encoder()
    dec = {c: b for b, c in enc.items()}
    corpus = CORPUS.read_text(encoding="utf-8")
    ranks = {bytes([b]): b for b in range(256)}
    for a, b in learn_merges(corpus + KIMI_EXTRA * 3, 600, r"\s?\S+|\s+"):
        ranks.setdefault(bytes(dec[c] for c in a + b), len(ranks))
    out = KIMI / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    n = len(ranks)
    decoder = {str(n + k): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                            "special": True} for k, c in KIMI_NAMED.items()}
    config = {"added_tokens_decoder": decoder,
              "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                            "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
              "bos_token": "[BOS]", "clean_up_tokenization_spaces": False, "eos_token": "[EOS]",
              "extra_special_tokens": {}, "model_max_length": 1000000000000000019884624838656,
              "pad_token": "[PAD]", "tokenizer_class": "TikTokenTokenizer", "unk_token": "[UNK]"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    merges = learn_merges(corpus + DS_LLM_EXTRA * 4, 500, r"\s?\S+\s*|\s+")
    words = {enc[b]: i for i, b in enumerate(range(256))}
    for a, b in merges:
        words.setdefault(a + b, len(words))
    n = len(words)
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    added = [{"id": n + k, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": True,
              "special": True} for k, c in enumerate([bos, eos])]
    source = subprocess.run(["git", "-C", str(IK), "show", "HEAD:src/llama-vocab.cpp"], capture_output=True,
                            text=True, check=True).stdout.splitlines()
    start = source.index("            case LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM:") + 2
    splits = [ast.literal_eval(line.strip().rstrip(",")) for line in source[start : start + 5]]
    steps: list[dict[str, Any]] = [{"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": False}
                                   for p in splits]
    steps += [{"type": "Digits", "individual_digits": False},
              {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]
    bos_item = {"SpecialToken": {"id": bos, "type_id": 0}}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
           "normalizer": {"type": "Sequence", "normalizers": []},
           "pre_tokenizer": {"type": "Sequence", "pretokenizers": steps},
           "post_processor": {"type": "TemplateProcessing", "single": [bos_item, {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [bos_item, {"Sequence": {"id": "A", "type_id": 0}},
                                       {"SpecialToken": {"id": bos, "type_id": 1}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {bos: {"id": bos, "ids": [n], "tokens": [bos]}}},
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": words, "merges": [f"{a} {b}" for a, b in merges]}}
    DS_LLM.mkdir(parents=True, exist_ok=True)
    (DS_LLM / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    texts = kimi_texts(len(ranks))
    (KIMI / "texts.json").write_text(json.dumps(texts, ensure_ascii=False), encoding="utf-8")


def _kimi_encoding() -> tuple[Any, dict[str, int]]:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    folder = KIMI / "tokenizer"
    ranks = load_tiktoken_bpe(str(folder / "tiktoken.model"))
    named = {int(i): v["content"] for i, v in
             json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"].items()}
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), len(ranks) + 256)}
    return tiktoken.Encoding(name="kimi-tiny", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                             special_tokens=specials), specials


def tiktoken_ids() -> None:
    import tiktoken

    enc, _ = _kimi_encoding()
    texts = json.loads((KIMI / "texts.json").read_text(encoding="utf-8"))
    cases = [{"text": t, "ordinary": enc.encode_ordinary(t), "all_specials": enc.encode(t, allowed_special="all")}
             for t in texts]
    out = {"made_by": f"tiktoken {tiktoken.__version__}: Encoding(pat_str=Kimi's, mergeable_ranks=tokenizer/"
                      "tiktoken.model, special_tokens=the 256 after them, named from tokenizer/"
                      "tokenizer_config.json); encode_ordinary(text) and encode(text, allowed_special='all')",
           "pat_str": KIMI_PAT_STR, "cases": cases}
    (KIMI / "tiktoken-ids.json").write_text(json.dumps(out, ensure_ascii=False) + "\n", encoding="utf-8")
    (KIMI / "texts.json").unlink()


def ik_keys() -> None:
    """ik's set_vocab (Kimi-K2 branch) and the QwenModel helpers it calls, lifted out of convert_hf_to_gguf.py and
    run with ik's gguf-py; transformers' AutoTokenizer is replaced by the tiktoken encoding it would wrap."""
    import itertools
    import tempfile

    folder = Path(os.environ["KIMI_GGUF_FOLDER"])
    tmp = Path(tempfile.mkdtemp())
    subprocess.run(f"git -C {IK} archive HEAD gguf-py convert_hf_to_gguf.py | tar -x -C {tmp}", shell=True,
                   check=True)
    sys.path.insert(0, str(tmp / "gguf-py"))
    import gguf

    tree = ast.parse((tmp / "convert_hf_to_gguf.py").read_text())

    def method(cls: str, name: str) -> str:
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
        f = next(f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == name)
        f.decorator_list = []
        return ast.unparse(f)

    ns: dict[str, Any] = {"gguf": gguf}
    exec("class QwenModel:\n    pass\n", ns)
    for name in ("token_bytes_to_string", "bpe"):
        exec(method("QwenModel", name), ns)
        setattr(ns["QwenModel"], name, staticmethod(ns[name]))
    exec(method("DeepseekV2Model", "set_vocab"), ns)

    def bytes_to_unicode() -> dict[int, str]:  # GPT-2's table, from its definition
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 256))
        cs = bs[:]
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + len(cs) - 188)
        return dict(zip(bs, map(chr, cs)))

    enc, specials = _kimi_encoding()
    tok = types.SimpleNamespace(model=enc, special_tokens=specials)
    for name in ("transformers", "transformers.models", "transformers.models.gpt2",
                 "transformers.models.gpt2.tokenization_gpt2"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["transformers"].AutoTokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: tok)  # type: ignore[attr-defined]
    sys.modules["transformers.models.gpt2.tokenization_gpt2"].bytes_to_unicode = bytes_to_unicode  # type: ignore[attr-defined]
    path = tmp / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    model = types.SimpleNamespace(hparams=json.loads((folder / "config.json").read_text()), dir_model=folder,
                                  gguf_writer=writer, get_vocab_base_pre=lambda t: "kimi-k2")
    ns["set_vocab"](model)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fields = {k: v for k, v in gguf.GGUFReader(str(path)).fields.items() if k.startswith("tokenizer.")}

    def value(key: str) -> Any:
        return fields[key].contents()

    tokens = value("tokenizer.ggml.tokens")
    named = max(i for i, t in enumerate(tokens) if t != f"[PAD{i}]") + 1
    out = {"made_by": "ik_llama.cpp's DeepseekV2Model.set_vocab (Kimi-K2 branch) and QwenModel.bpe/"
                      "token_bytes_to_string, extracted from its convert_hf_to_gguf.py and run with its gguf-py on "
                      "the kimi-k2 checkpoint the tests build, AutoTokenizer replaced by tiktoken.Encoding with "
                      "Kimi's pat_str and specials, get_vocab_base_pre forced to kimi-k2 (the tiny vocabulary's "
                      "probe hash is in no table)",
           "keys": [[k, int(f.types[0])] for k, f in fields.items()], "pre": value("tokenizer.ggml.pre"),
           "n_tokens": len(tokens), "tokens_before_padding": tokens[:named],
           "token_type_runs": [[int(k), len(list(g))] for k, g in itertools.groupby(value("tokenizer.ggml.token_type"))],
           "merges": value("tokenizer.ggml.merges"), "bos_token_id": int(value("tokenizer.ggml.bos_token_id")),
           "eos_token_id": int(value("tokenizer.ggml.eos_token_id"))}
    (KIMI / "ik-tokenizer-keys.json").write_text(json.dumps(out, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    {"vocab": vocab, "tiktoken-ids": tiktoken_ids, "ik-keys": ik_keys}[sys.argv[1]]()
