#!/usr/bin/env python3
"""Write a deterministic tiny random checkpoint in the real Hugging Face layout (no downloads).

Example: python tools/make_tiny_checkpoint.py out/tiny-qwen3 --arch qwen3 --shards 2
"""

from __future__ import annotations

import argparse

from ikconvert import TinySpec, make_tiny_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--arch", choices=["qwen3", "llama"], default="qwen3")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--shards", type=int, default=1, help="more than 1 writes model.safetensors.index.json")
    ap.add_argument("--tie-embeddings", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    spec = TinySpec(arch=a.arch, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                    head_dim=a.head_dim, ffn=a.ffn, shards=a.shards, tie_embeddings=a.tie_embeddings, seed=a.seed)
    print(make_tiny_checkpoint(a.folder, spec))


if __name__ == "__main__":
    main()
