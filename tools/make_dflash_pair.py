"""Train a tiny DFlash draft for a tiny target and record what the reference implementation decodes with it.

Needs torch and transformers, OUTSIDE the product: run it with a separate environment (e.g. /work/torchenv,
`pip install torch==2.13.0 transformers safetensors numpy`); nothing in ikconvert/ikquant/ikrun imports it.
The reference is z-lab/dflash's `dflash/model.py` (DFlashDraftModel, dflash_generate), passed as a file.

    /work/torchenv/bin/python tools/make_dflash_pair.py --reference dflash_model.py --target TARGET_DIR \
        --text text.txt --out OUT --target-layers 0,2 --draft-layers 1 --block 8 --heads 6 --kv-heads 2 \
        --rope-theta 5e5

`--mimo VALUE_SCALE BACKBONE_BASE PARTIAL` gives the draft MiMo-V2.5-Pro's attention (add_mimo_attention: sink
logits, value scale, the context keys' rope base, partial rotary), which z-lab's model does not have.

OUT/hf is the draft (bf16), OUT/target-config.json the target's config when --target-rope-theta changes it (the
target's weights are TARGET_DIR's), OUT/dflash-oracle.json the reference's greedy speculative decoding of 6
prompts of 24 tokens, 96 new tokens each (output ids and acceptance lengths per step, as the shared oracle has).
The draft learns, block by block, the target's own greedy tokens from the target's hidden states.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Mxfp4Config, Qwen3Config

N_PROMPTS, PROMPT_LEN, MAX_NEW = 6, 24, 96


def load_reference(path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("dflash_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_target(folder: Path):  # type: ignore[no-untyped-def]
    """The target in float32, eager attention; MXFP4 experts (gpt-oss as released) dequantized exactly first."""
    quant = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    extra = {"quantization_config": Mxfp4Config(dequantize=True)} if quant.get("quant_method") == "mxfp4" else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager", **extra)
    return model.float().eval()


def train_target(folder: Path, out: Path, ids: torch.Tensor, steps: int, seed: int):  # type: ignore[no-untyped-def]
    """A random target's greedy tokens are hard to draft: teach it the text first. Every tensor the checkpoint stores
    unquantized learns (next token, windows of 96); MXFP4 experts stay as stored. Saved to `out`, the stored tensors
    replaced in their own dtype, the others (MXFP4 blocks and scales) copied byte for byte."""
    from safetensors.torch import load_file, save_file

    model = load_target(folder)
    stored = {}
    for path in sorted(folder.glob("*.safetensors")):
        stored.update(load_file(path))
    learn = [(n, p) for n, p in model.named_parameters() if n in stored]
    for n, p in model.named_parameters():
        p.requires_grad_(n in stored)
    opt = torch.optim.AdamW([p for _, p in learn], lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - 97, (16,), generator=gen).tolist()
        win = torch.stack([ids[s : s + 97] for s in starts])
        loss = model(win[:, :-1], labels=win[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f"target step {step}: loss {loss.item():.3f}", flush=True)
    shutil.copytree(folder, out, dirs_exist_ok=True)
    for path in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:  # one file replaces the shards
        path.unlink()
    trained = dict(learn)
    save_file({n: (trained[n].detach().to(t.dtype) if n in trained else t).contiguous() for n, t in stored.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    return load_target(out)


def resize_target(folder: Path, out: Path, hidden: int, layers: int, ffn: int, seed: int) -> Path:
    """A fresh, randomly initialised target shaped hidden x layers x ffn (heads of the folder's head size) with the
    folder's tokenizer and every other config key, for drafts whose rows are wide enough for the real quantized
    types (multiples of 256); --train-target then teaches it the text."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=ffn,
               num_attention_heads=hidden // cfg["head_dim"], torch_dtype="bfloat16")
    cfg["num_key_value_heads"] = max(1, cfg["num_attention_heads"] // 2)
    out.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.name.startswith("tokenizer"):
            shutil.copy(path, out / path.name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3Config.from_pretrained(out))
    model.to(torch.bfloat16).save_pretrained(out)
    return out


def add_mimo_attention(ref) -> None:  # type: ignore[no-untyped-def]
    """MiMo-V2.5-Pro drafts' attention as ik's draft graph computes it, patched into the reference's attention where
    the config asks for it: a learned sink logit per head in the softmax (`attention_sink_bias`), values times
    dflash_config.attention_value_scale, the context's keys roped at dflash_config.backbone_rotary_base (the
    block's at rope_theta), rope over head_dim x partial_rotary_factor dims (the rest unrotated)."""
    import copy

    attention = ref.Qwen3DFlashAttention
    plain_init, plain_forward = attention.__init__, attention.forward

    def init(self, config, layer_idx: int) -> None:  # type: ignore[no-untyped-def]
        plain_init(self, config, layer_idx)
        extra = config.dflash_config
        self.mimo = bool(extra.get("mimo_attention"))
        if self.mimo:
            self.attention_sink_bias = torch.nn.Parameter(torch.zeros(config.num_attention_heads))
            self.value_scale = float(extra.get("attention_value_scale", 1.0))
            backbone = copy.deepcopy(config)
            backbone.rope_theta = float(extra.get("backbone_rotary_base") or config.rope_theta)
            self.backbone_rotary = ref.Qwen3RotaryEmbedding(backbone)

    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask,  # type: ignore[no-untyped-def]
                past_key_values=None, cache_position=None, **kwargs):
        if not self.mimo:
            return plain_forward(self, hidden_states, target_hidden, position_embeddings, attention_mask,
                                 past_key_values, cache_position, **kwargs)
        assert attention_mask is None and self.sliding_window is None
        bsz, q_len = hidden_states.shape[:-1]
        ctx_len = target_hidden.shape[1]
        q = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        both = torch.cat([target_hidden, hidden_states], dim=1)
        k = self.k_norm(self.k_proj(both).view(bsz, ctx_len + q_len, -1, self.head_dim)).transpose(1, 2)
        v = (self.v_proj(both) * self.value_scale).view(bsz, ctx_len + q_len, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        bcos, bsin = self.backbone_rotary(hidden_states, kwargs["position_ids"])
        rot = cos.shape[-1]

        def rope(x, c, s):  # type: ignore[no-untyped-def]
            r = x[..., :rot]
            return torch.cat([r * c.unsqueeze(1) + ref.rotate_half(r) * s.unsqueeze(1), x[..., rot:]], dim=-1)

        q = rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = torch.cat([rope(k[:, :, :ctx_len], bcos[:, :ctx_len], bsin[:, :ctx_len]),
                       rope(k[:, :, ctx_len:], cos[:, -q_len:], sin[:, -q_len:])], dim=2)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx, {"cache_position": cache_position})
        k = k.repeat_interleave(self.num_key_value_groups, dim=1)
        v = v.repeat_interleave(self.num_key_value_groups, dim=1)
        scores = (q @ k.transpose(2, 3)) * self.scaling
        sinks = self.attention_sink_bias.view(1, -1, 1, 1).expand(bsz, -1, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        out = (probs @ v).transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out), probs

    attention.__init__, attention.forward = init, forward


def draft_config(target_cfg, args: argparse.Namespace) -> Qwen3Config:  # type: ignore[no-untyped-def]
    layers = [int(i) for i in args.target_layers.split(",")]
    cfg = Qwen3Config(
        vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size, intermediate_size=args.intermediate,
        num_hidden_layers=args.draft_layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, rms_norm_eps=target_cfg.rms_norm_eps, max_position_embeddings=40960,
        rope_theta=args.rope_theta, tie_word_embeddings=False)
    cfg.architectures = ["DFlashDraftModel"]
    cfg.auto_map = {"AutoModel": "dflash.DFlashDraftModel"}
    cfg.block_size = args.block
    cfg.num_target_layers = target_cfg.num_hidden_layers
    cfg.dflash_config = {"mask_token_id": args.mask_token, "target_layer_ids": layers}
    if args.mimo:
        cfg.partial_rotary_factor = args.mimo[2]
        cfg.dflash_config.update({"mimo_attention": True, "attention_value_scale": args.mimo[0],
                                  "backbone_rotary_base": args.mimo[1]})
    cfg._attn_implementation = "eager"
    return cfg


def features(ref, target, ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    out = target(ids, output_hidden_states=True)
    return ref.extract_context_feature(out.hidden_states, layer_ids), out.logits.argmax(-1)


def train(ref, target, draft, ids: torch.Tensor, args: argparse.Namespace) -> float:  # type: ignore[no-untyped-def]
    """Blocks anchored at random positions of random windows: rows 1.. learn the target's greedy tokens."""
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0)
    window, bs, batch = 96, args.block, 16
    loss = torch.tensor(0.0)
    for step in range(args.steps):
        starts = torch.randint(0, len(ids) - window - 1, (batch,), generator=gen)
        win = torch.stack([ids[s : s + window] for s in starts.tolist()])
        with torch.no_grad():
            feats, greedy = features(ref, target, win, draft.target_layer_ids)
        anchor = int(torch.randint(8, window - bs, (1,), generator=gen))
        block = torch.full((batch, bs), args.mask_token, dtype=torch.long)
        block[:, 0] = win[:, anchor]
        # the target's greedy token after each block row's predecessor: what verification accepts
        labels = greedy[:, anchor : anchor + bs - 1]
        with torch.no_grad():
            noise = target.model.embed_tokens(block)
        pos = torch.arange(anchor + bs).unsqueeze(0).expand(batch, -1)
        hidden = draft(target_hidden=feats[:, :anchor], noise_embedding=noise, position_ids=pos, is_causal=False)
        logits = target.lm_head(hidden[:, 1:])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    return float(loss.item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reference", type=Path, required=True)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target-layers", default="1,2")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=128, help="the draft's FFN width")
    ap.add_argument("--new-target", type=int, nargs=3, metavar=("HIDDEN", "LAYERS", "FFN"), help="start from a "
                    "fresh random target of this shape (--target's tokenizer and config otherwise; OUT/target-init), "
                    "to be trained with --train-target")
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--target-rope-theta", type=float, default=None)
    ap.add_argument("--mask-token", type=int, default=304)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-target", type=int, default=0, help="first train the target's unquantized tensors on "
                    "the text for this many steps (OUT/target)")
    ap.add_argument("--decode-only", action="store_true", help="OUT/hf exists: only decode with it")
    ap.add_argument("--mimo", type=float, nargs=3, metavar=("VALUE_SCALE", "BACKBONE_BASE", "PARTIAL"),
                    help="MiMo-V2.5-Pro attention (add_mimo_attention, with sink logits): the value scale, the "
                    "context keys' rope base, the partial rotary factor")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    ref = load_reference(args.reference)
    add_mimo_attention(ref)
    args.out.mkdir(parents=True, exist_ok=True)
    target_dir = args.target
    if args.new_target:
        args.target = target_dir = resize_target(args.target, args.out / "target-init", *args.new_target, args.seed)
    if args.target_rope_theta is not None:  # the same weights under another rope theta
        target_dir = args.out / "target"
        shutil.copytree(args.target, target_dir, dirs_exist_ok=True)
        cfg = json.loads((target_dir / "config.json").read_text())
        cfg["rope_theta"] = args.target_rope_theta
        (target_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        shutil.copy(target_dir / "config.json", args.out / "target-config.json")
    tok = AutoTokenizer.from_pretrained(target_dir)
    ids = torch.tensor(tok.encode(args.text.read_text(), add_special_tokens=False), dtype=torch.long)
    if args.train_target:
        target_dir = args.out / "target"
        if not (args.decode_only and target_dir.is_dir()):
            train_target(args.target, target_dir, ids, args.train_target, args.seed)
    target = load_target(target_dir)
    for p in target.parameters():
        p.requires_grad_(False)
    loss = None  # none when only decoding
    if not (args.decode_only and (args.out / "hf").is_dir()):
        draft = ref.DFlashDraftModel(draft_config(target.config, args)).float()
        draft.config._attn_implementation = "eager"
        loss = train(ref, target, draft, ids, args)
        draft.to(torch.bfloat16).save_pretrained(args.out / "hf")
    # decode with exactly the stored weights, in float32, loaded afresh: the trained model's buffers (the rope's
    # inverse frequencies) went through bf16 with its weights and would not be the file's
    draft = ref.DFlashDraftModel.from_pretrained(args.out / "hf", dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    step = (len(ids) - PROMPT_LEN - MAX_NEW) // N_PROMPTS
    runs = []
    for i in range(N_PROMPTS):
        prompt = ids[i * step : i * step + PROMPT_LEN].unsqueeze(0)
        r = _generate(ref, draft, target, prompt)
        runs.append({"prompt": prompt[0].tolist(), **r})
    steps = [a for r in runs for a in r["acceptance_lengths"]]
    oracle = {"reference": "z-lab/dflash dflash/model.py dflash_generate, greedy (temperature 0)",
              "block_size": draft.block_size, "mask_token_id": args.mask_token, "target_layer_ids": draft.target_layer_ids,
              "draft_layers": draft.config.num_hidden_layers, "heads": [draft.config.num_attention_heads,
              draft.config.num_key_value_heads], "rope_theta": draft.config.rope_theta,
              "target_rope_theta": args.target_rope_theta, "n_prompts": N_PROMPTS, "prompt_len": PROMPT_LEN,
              "max_new_tokens": MAX_NEW, "prompts_from": f"text tokenized without special tokens, prompt i = tokens "
              f"[i*{step}, i*{step}+{PROMPT_LEN})", "mean_acceptance_length": sum(steps) / len(steps),
              "train_loss_draft": loss, "weights": "bf16 as stored, computed in float32, eager attention",
              "torch": torch.__version__, "runs": runs}
    (args.out / "dflash-oracle.json").write_text(json.dumps(oracle, indent=1) + "\n")
    print(f"mean acceptance {oracle['mean_acceptance_length']:.3f}")


def _generate(ref, draft, target, prompt: torch.Tensor) -> dict:  # type: ignore[no-untyped-def, type-arg]
    """dflash_generate's greedy loop with whole blocks (the shared oracle's loop: the last block is not shortened)."""
    stats = _patched_cuda_time(ref)
    with stats:
        r = ref.dflash_generate(draft, target, prompt, MAX_NEW, None, 0.0, return_stats=True)
    return {"output_ids": r.output_ids[0].tolist(), "acceptance_lengths": [int(a) for a in r.acceptance_lengths]}


class _patched_cuda_time:
    """return_stats times with torch.cuda.synchronize; on a CPU machine perf_counter alone."""

    def __init__(self, ref) -> None:  # type: ignore[no-untyped-def]
        self.ref, self.saved = ref, ref._cuda_time

    def __enter__(self) -> None:
        import time

        self.ref._cuda_time = time.perf_counter

    def __exit__(self, *exc: object) -> None:
        self.ref._cuda_time = self.saved


if __name__ == "__main__":
    main()
