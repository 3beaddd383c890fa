"""A Qwen3-MoE checkpoint whose routed experts get fewer than 32 tokens of a 128-token chunk (16 experts of 256, 2
used: 16 each on average), where ik multiplies IQ4_KS experts in the type's own kernel; 256 wide, so every
matrix quantizes to IQ4_KS. The model behind tests/data/iqk-native, made again from this spec by the tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

TOKENIZER = Path(__file__).parent / "data" / "convert" / "qwen3-moe" / "hf"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, USED, EXPERT_FFN, LAYERS, VOCAB = 256, 2, 1, 128, 16, 2, 256, 2, 320


def make_checkpoint(folder: Path) -> Path:
    """The checkpoint (float32 weights, normal with 1/sqrt(fan-in) deviation, seed 0; unit norms)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)
    config = json.loads((TOKENIZER / "config.json").read_text())
    config.update({"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
                   "head_dim": HEAD_DIM, "num_experts": EXPERTS, "num_experts_per_tok": USED,
                   "moe_intermediate_size": EXPERT_FFN, "intermediate_size": 3 * EXPERT_FFN,
                   "num_hidden_layers": LAYERS, "max_window_layers": LAYERS, "vocab_size": VOCAB,
                   "torch_dtype": "float32"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": matrix(VOCAB, HIDDEN), "lm_head.weight": matrix(VOCAB, HIDDEN),
               "model.norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name, size in (("input_layernorm", HIDDEN), ("post_attention_layernorm", HIDDEN),
                           ("self_attn.q_norm", HEAD_DIM), ("self_attn.k_norm", HEAD_DIM)):
            tensors[p + name + ".weight"] = np.ones(size, np.float32)
        for name, (rows, cols) in (("q_proj", (HEADS * HEAD_DIM, HIDDEN)), ("k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
                                   ("v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)), ("o_proj", (HIDDEN, HEADS * HEAD_DIM))):
            tensors[f"{p}self_attn.{name}.weight"] = matrix(rows, cols)
        tensors[p + "mlp.gate.weight"] = matrix(EXPERTS, HIDDEN)
        for e in range(EXPERTS):
            for name, (rows, cols) in (("gate_proj", (EXPERT_FFN, HIDDEN)), ("up_proj", (EXPERT_FFN, HIDDEN)),
                                       ("down_proj", (HIDDEN, EXPERT_FFN))):
                tensors[f"{p}mlp.experts.{e}.{name}.weight"] = matrix(rows, cols)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
