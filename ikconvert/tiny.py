"""Deterministic tiny checkpoints in the real Hugging Face layout, so tests and the demo never download anything.

A checkpoint is config.json, bf16 safetensors (optionally sharded with model.safetensors.index.json), and a
byte-level BPE tokenizer (tokenizer.json with merges learned from a bundled corpus, tokenizer_config.json with a
chat template). Weights are seeded normal draws scaled by 1/sqrt(fan_in), so activations keep their scale and the
tiny model's predictions are not uniform.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ikconvert.safetensors_io import write_safetensors

CORPUS = Path(__file__).parent / "data" / "tiny_corpus.txt"

_QWEN2_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_LLAMA3_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
                 "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
_CHAT_TEMPLATE = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                  "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny checkpoint. `arch` is 'qwen3' or 'llama'."""

    arch: str = "qwen3"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    ffn: int = 128
    n_merges: int = 200
    vocab_pad: int = 16
    tie_embeddings: bool = False
    shards: int = 1
    seed: int = 0
    rope_theta: float = 1000000.0


def learn_merges(text: str, n_merges: int, regex_pattern: str) -> list[tuple[str, str]]:
    """Greedy BPE training on byte-encoded pre-tokenized words (most frequent pair, ties by pair text)."""
    import regex

    from ikconvert.tokenizer import byte_encoder

    enc = byte_encoder()
    words = Counter("".join(enc[b] for b in w.encode("utf-8")) for w in regex.findall(regex_pattern, text))
    splits = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for w, count in words.items():
            syms = splits[w]
            for a, b in zip(syms, syms[1:]):
                pairs[(a, b)] += count
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        for syms in splits.values():
            i = 0
            while i < len(syms) - 1:
                if syms[i] == best[0] and syms[i + 1] == best[1]:
                    syms[i : i + 2] = [best[0] + best[1]]
                i += 1
    return merges


def _tokenizer_files(spec: TinySpec) -> tuple[dict, dict, dict[str, int]]:
    llama = spec.arch == "llama"
    merges = learn_merges(CORPUS.read_text(encoding="utf-8"), spec.n_merges, pretokenizer_regex(llama))
    return tokenizer_files(merges, llama)


def pretokenizer_regex(llama: bool) -> str:
    """The Split regex of the tokenizers these checkpoints carry: Llama 3's, or Qwen2's (ik's `qwen2` pre)."""
    return _LLAMA3_REGEX if llama else _QWEN2_REGEX


def tokenizer_files(merges: list[tuple[str, str]], llama: bool) -> tuple[dict, dict, dict[str, int]]:
    """tokenizer.json, tokenizer_config.json and {n_vocab, bos, eos} of a byte-level BPE with these merges: the 256
    byte symbols first, then one token per merge, then the special tokens."""
    from ikconvert.tokenizer import byte_encoder

    pattern = pretokenizer_regex(llama)
    vocab: dict[str, int] = {}
    for ch in byte_encoder().values():
        vocab.setdefault(ch, len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    specials = (["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"] if llama
                else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    added: list[dict[str, Any]] = []
    for text in specials + ["<think>", "</think>"]:
        added.append({"id": len(vocab), "content": text, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": text.startswith("<|")})
        vocab[text] = len(vocab)
    ids = {t["content"]: t["id"] for t in added}
    bos = ids["<|begin_of_text|>"] if llama else None
    eos = ids["<|end_of_text|>"] if llama else ids["<|im_end|>"]
    post = ({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                                                      {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                      {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos],
                                                      "tokens": ["<|begin_of_text|>"]}}}
            if llama else {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False})
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None if llama else {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": llama,
                  "vocab": {t: i for t, i in vocab.items() if i < len(vocab) - len(added)},
                  "merges": [[a, b] for a, b in merges]},
    }
    config = {
        "added_tokens_decoder": {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added},
        "bos_token": "<|begin_of_text|>" if llama else None,
        "eos_token": "<|end_of_text|>" if llama else "<|im_end|>",
        "pad_token": None if llama else "<|endoftext|>",
        "chat_template": _CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast" if llama else "Qwen2Tokenizer",
    }
    return tokenizer, config, {"n_vocab": len(vocab), "bos": bos if bos is not None else ids.get("<|endoftext|>"),
                               "eos": eos}


def _weights(spec: TinySpec, vocab_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    q_dim, kv_dim = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((vocab_size, spec.hidden))
                                .astype(np.float32)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(spec.hidden)
        w[p + "self_attn.q_proj.weight"] = mat(q_dim, spec.hidden)
        w[p + "self_attn.k_proj.weight"] = mat(kv_dim, spec.hidden)
        w[p + "self_attn.v_proj.weight"] = mat(kv_dim, spec.hidden)
        w[p + "self_attn.o_proj.weight"] = mat(spec.hidden, q_dim)
        if spec.arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(spec.head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(spec.head_dim)
        w[p + "post_attention_layernorm.weight"] = norm(spec.hidden)
        w[p + "mlp.gate_proj.weight"] = mat(spec.ffn, spec.hidden)
        w[p + "mlp.up_proj.weight"] = mat(spec.ffn, spec.hidden)
        w[p + "mlp.down_proj.weight"] = mat(spec.hidden, spec.ffn)
    w["model.norm.weight"] = norm(spec.hidden)
    if not spec.tie_embeddings:
        w["lm_head.weight"] = mat(vocab_size, spec.hidden)
    return w


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    from ikquant.formats.numeric import f32_to_bf16_bits

    return f32_to_bf16_bits(x)


def make_tiny_checkpoint(folder: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Write a tiny random checkpoint for `spec` into `folder` (created) and return the folder."""
    if spec.arch not in ("qwen3", "llama"):
        raise ValueError(f"tiny checkpoints exist for 'qwen3' and 'llama', not {spec.arch!r}")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, tok_config, ids = _tokenizer_files(spec)
    vocab_size = ids["n_vocab"] + spec.vocab_pad
    weights = _weights(spec, vocab_size)
    llama = spec.arch == "llama"
    config = {
        "architectures": ["LlamaForCausalLM" if llama else "Qwen3ForCausalLM"],
        "model_type": spec.arch,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "initializer_range": 0.02,
        "intermediate_size": spec.ffn,
        "max_position_embeddings": 4096,
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_embeddings,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=1), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    names = sorted(weights)
    n_shards = max(1, spec.shards)
    if n_shards == 1:
        write_safetensors(out / "model.safetensors", {n: ("BF16", _bf16_bits(weights[n])) for n in names},
                          {"format": "pt"})
        return out
    weight_map = {}
    chunks = np.array_split(np.arange(len(names)), n_shards)
    for k, idx in enumerate(chunks, start=1):
        fname = f"model-{k:05d}-of-{n_shards:05d}.safetensors"
        part = {names[i]: ("BF16", _bf16_bits(weights[names[i]])) for i in idx}
        write_safetensors(out / fname, part, {"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(w.size * 2 for w in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return out
