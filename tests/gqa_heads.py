"""Tiny qwen3 checkpoints with the head sizes ik's own flash-attention kernel takes (64 and 128; 4 query heads on 2
key/value heads, a vocabulary of 480: whole 16-row tiles of ik's Q8_0 kernels): the models behind tests/data/logits/qwen3-fa-avx2, made again from their specs by the tests."""

from __future__ import annotations

from pathlib import Path

from ikconvert.tiny import TinySpec, make_tiny_checkpoint

#: head size -> the checkpoint's spec
SPECS = {head: TinySpec(arch="qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=head, vocab_pad=19,
                         seed=head)
         for head in (64, 128)}


def make_checkpoint(folder: Path, head_dim: int) -> Path:
    """The tiny qwen3 checkpoint with `head_dim`-wide heads (SPECS)."""
    return make_tiny_checkpoint(folder, SPECS[head_dim])
