#!/usr/bin/env python3
"""Train a small Qwen3-architecture language model (dense, or Qwen3-MoE with `--experts`) on real text that every
machine has (the sources of this Python's standard library), save it as a Hugging Face checkpoint, and write
disjoint calibration and evaluation texts beside it, so that mixes and recipes are judged on a model that has
learned something, on text it was not tuned on.

Needs torch and transformers (`pip install -e '.[train]'`); nothing in the product imports them.

The standard library's files are split by a hash of their relative path: 1 in 10 to the calibration text
(imatrix, sweeps), 1 in 10 to the evaluation text (what of that split does not fit there goes to a second one,
eval2.txt: other files, as unseen), the rest to training. The tokenizer is a byte-level BPE with Qwen2's
pre-tokenizer (ik's `qwen2`), its merges learned on the training text. Widths are multiples of 256 so
that every quantization type fits every weight row. The training is short (a few hundred steps of AdamW on random
windows): the model is weak, but its predictions are far from uniform and depend on its weights the way a real
model's do.

With `--experts N` every layer's FFN is N routed experts of width `--expert-ffn`, `--experts-used` of them per
token (top-k weights renormalised, as every released Qwen3-MoE), trained with transformers' load-balancing loss so
that the router uses them all: a MoE whose sweeps have per-expert tensors to measure.

Example: python tools/train_lm.py --out /tmp/lm   (then ikconvert hf2gguf /tmp/lm/hf --outtype f32 ...)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from ikconvert.tiny import pretokenizer_regex, tokenizer_files

SPLITS = {0: "calib", 1: "eval"}  # path hash mod 10 -> split; the rest trains


def stdlib_texts(limit: int, train_limit: int) -> dict[str, str]:
    """{train, calib, eval, eval2} texts from the standard library's .py files: calib, eval and eval2 at most `limit`
    characters, train at most `train_limit` (whole files, in path order); eval2 is a second held-out text, the eval
    split's files that did not fit in eval."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: dict[str, list[str]] = {"train": [], "calib": [], "eval": [], "eval2": []}
    sizes = dict.fromkeys(parts, 0)
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if "site-packages" in rel:
            continue
        split = SPLITS.get(int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 10, "train")
        text = path.read_text(encoding="utf-8", errors="replace")
        if split == "eval" and sizes[split] + len(text) > limit:
            split = "eval2"
        if sizes[split] + len(text) > (train_limit if split == "train" else limit):
            continue
        parts[split].append(text)
        sizes[split] += len(text)
    return {k: "\n".join(v) for k, v in parts.items()}


def learn_bpe_merges(text: str, vocab_size: int) -> list[tuple[str, str]]:
    """The merges of a byte-level BPE with Qwen2's pre-tokenizer learned on `text` (tokenizers' trainer)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pretokenizer_regex(llama=False)), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return [(m.split(" ")[0], m.split(" ")[1]) if isinstance(m, str) else (m[0], m[1])
            for m in json.loads(bpe.to_str())["model"]["merges"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True,
                    help="folder: hf/ (the checkpoint), calib.txt, eval.txt, eval2.txt")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=0, help="routed experts per layer (0: a dense Qwen3)")
    ap.add_argument("--experts-used", type=int, default=2, help="experts per token (with --experts)")
    ap.add_argument("--expert-ffn", type=int, default=256, help="each expert's FFN width (with --experts)")
    ap.add_argument("--aux-loss", type=float, default=0.01, help="load-balancing loss weight (with --experts)")
    ap.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary before the special tokens")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--text-limit", type=int, default=400_000, help="characters of calibration / evaluation text")
    ap.add_argument("--train-limit", type=int, default=4_000_000, help="characters of training text")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    hf = a.out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    texts = stdlib_texts(a.text_limit, a.train_limit)
    for split in ("calib", "eval", "eval2"):
        (a.out / f"{split}.txt").write_text(texts[split], encoding="utf-8")
    tokenizer, tok_config, ids = tokenizer_files(learn_bpe_merges(texts["train"], a.vocab), llama=False)
    (hf / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=1), encoding="utf-8")
    (hf / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    tokens = torch.tensor(Tokenizer.from_str(json.dumps(tokenizer)).encode(texts["train"]).ids, dtype=torch.long)
    vocab_size = -(-ids["n_vocab"] // 64) * 64
    shape = dict(vocab_size=vocab_size, hidden_size=a.hidden, intermediate_size=a.ffn,
                 num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                 head_dim=a.hidden // a.heads, max_position_embeddings=4096, rope_theta=1e6,
                 tie_word_embeddings=False, bos_token_id=ids["bos"], eos_token_id=ids["eos"])
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **shape, num_experts=a.experts, num_experts_per_tok=a.experts_used, moe_intermediate_size=a.expert_ffn,
        norm_topk_prob=True, router_aux_loss_coef=a.aux_loss)) if a.experts else Qwen3ForCausalLM(Qwen3Config(**shape))
    router = {"output_router_logits": True} if a.experts else {}
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.1f}M parameters, {len(tokens) / 1e6:.2f}M training tokens, vocab {vocab_size}",
          flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, a.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, a.steps) / a.steps)))
    gen = torch.Generator().manual_seed(a.seed)
    t0 = time.perf_counter()
    for step in range(a.steps):
        starts = torch.randint(0, len(tokens) - a.ctx - 1, (a.batch,), generator=gen)
        batch = torch.stack([tokens[s : s + a.ctx + 1] for s in starts.tolist()])
        out = model(input_ids=batch[:, :-1], **router)
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, vocab_size), batch[:, 1:].reshape(-1))
        total = loss + a.aux_loss * out.aux_loss if a.experts else loss
        opt.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 20 == 0 or step == a.steps - 1 or step < 10:
            print(f"step {step:4d}  loss {loss.item():.3f}  {time.perf_counter() - t0:.0f} s", flush=True)
    model.to(torch.bfloat16).save_pretrained(hf, safe_serialization=True)
    print(f"saved {hf} ({n_params / 1e6:.1f}M parameters); texts: {a.out / 'calib.txt'}, {a.out / 'eval.txt'}, "
          f"{a.out / 'eval2.txt'}")


if __name__ == "__main__":
    main()
