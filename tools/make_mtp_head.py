"""Train the NextN/MTP head of a tiny GLM-4.x, DeepSeek-V3 or GLM-5 target and record a reference greedy MTP speculative
decoding with it.

Needs torch and transformers, OUTSIDE the product: run it with a separate environment (e.g. /work/torchenv); nothing
in ikconvert/ikquant/ikrun imports it.

    /work/torchenv/bin/python tools/make_mtp_head.py --target tests/data/convert/glm4-moe/hf \
        --text tests/data/logits/glm4-moe/text.txt --out OUT --train-target 500 --steps 500

The target (transformers' Glm4MoeForCausalLM or DeepseekV3ForCausalLM, both of which ignore the NextN/MTP layer, or
GLM-5 from tools/glm_dsa_torch.py: DeepseekV3 layers under sparse attention) first learns the text
(make_dflash_pair.train_target, glm_dsa_torch.train_glm_target); then only the NextN layer (model.layers.{num_hidden_layers}.*:
embed_tokens, enorm, hnorm, eh_proj, the decoder layer of the model's own kind, shared_head) learns to predict, at
position p from the target's output-normed hidden state of p - 1 and token p, the target's own greedy token p + 1
(GLM-4.5's NextN layer and DeepSeek-V3's MTP module are this one computation; DeepSeek-V3 report, section 2.2;
GLM-5's layer attends sparsely through its own indexer, which gets no gradient through its top-k and stays as stored,
and it reads the target's embedding and lm_head, having none of its own). OUT/hf is the checkpoint with both (the
stored dtype), OUT/mtp-oracle.json the reference loop's greedy decoding of 6 prompts of 24 tokens, 64 new each,
drafting 3 tokens a step (each from the previous draft's state), computed in float32 from exactly the stored weights.
The reference loop recomputes every forward over the whole sequence (no caches): what ik's MTP path computes with
its caches (ikrun/eval/speculative.py mtp_generate).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from glm_dsa_torch import GlmDsa, Indexer, attention_keep, load_glm_target, train_glm_target  # noqa: E402
from make_dflash_pair import load_target, train_target  # noqa: E402

N_PROMPTS, PROMPT_LEN, MAX_NEW, N_MAX = 6, 24, 64, 3
LAYER = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")
#: config model_type -> transformers' module, its decoder layer and RMSNorm classes
FAMILIES = {"glm4_moe": ("glm4_moe", "Glm4Moe"), "deepseek_v3": ("deepseek_v3", "DeepseekV3")}


def family_classes(config):  # type: ignore[no-untyped-def]
    """The decoder layer and RMSNorm classes of the target's family."""
    if config.model_type not in FAMILIES:
        raise SystemExit(f"model_type {config.model_type!r}: this tool trains heads of {', '.join(FAMILIES)}")
    module, prefix = FAMILIES[config.model_type]
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(mod, prefix + "DecoderLayer"), getattr(mod, prefix + "RMSNorm")


class NextnHead(torch.nn.Module):
    """The MTP layer: [enorm(embedding of token p) | hnorm(hidden of p - 1)] through eh_proj, one decoder layer of
    the target's kind (causal attention, MoE), shared_head.norm (the next step's hidden state) and shared_head.head.
    GLM-5's (`glm`: the target) adds its indexer's mask and reads the target's embedding and lm_head."""

    def __init__(self, config, glm: GlmDsa | None = None) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        layer, norm = family_classes(config)
        e, v, eps = config.hidden_size, config.vocab_size, config.rms_norm_eps
        self.index = config.num_hidden_layers
        self.enorm, self.hnorm = norm(e, eps), norm(e, eps)
        self.eh_proj = torch.nn.Linear(2 * e, e, bias=False)
        self.layer = layer(config, layer_idx=self.index)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = norm(e, eps)
        self.indexer = None if glm is None else Indexer(glm.cfg)
        if glm is None:
            self.embed_tokens = torch.nn.Embedding(v, e)
            self.shared_head.head = torch.nn.Linear(e, v, bias=False)
            self.tables = (self.embed_tokens, self.shared_head.head)
        else:
            self.tables = (glm.inner.model.embed_tokens, glm.inner.lm_head)  # a tuple: not the head's parameters

    def checkpoint_name(self, name: str) -> str:
        if name.startswith("indexer."):
            return f"model.layers.{self.index}.self_attn.{name}"
        return f"model.layers.{self.index}." + (name[len("layer."):] if name.startswith("layer.") else name)

    def load(self, stored: dict[str, torch.Tensor]) -> None:
        own = {n: stored[self.checkpoint_name(n)].float() for n in self.state_dict()}
        self.load_state_dict(own)

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
        """Normed states and logits [batch, n, .] of positions 0..n-1 (hidden row p: the state of position p - 1)."""
        embed, head = self.tables
        x = self.eh_proj(torch.cat([self.enorm(embed(ids)), self.hnorm(hidden)], dim=-1))
        n = ids.shape[1]
        pos = torch.arange(n).unsqueeze(0)
        causal = torch.full((n, n), float("-inf")).triu(1)[None]
        cos, sin = rotary(x, pos)
        mask = causal if self.indexer is None else attention_keep(self.indexer, self.layer, x, cos, sin, causal) + causal
        x = self.layer(x, attention_mask=mask[:, None], position_ids=pos, position_embeddings=(cos, sin))
        x = x[0] if isinstance(x, tuple) else x
        s = self.shared_head.norm(x)
        return s, head(s)


def target_states(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The target's output-normed hidden states and logits."""
    if isinstance(target, GlmDsa):
        return target(ids)  # type: ignore[no-any-return]
    h = target.model(ids).last_hidden_state
    return h, target.lm_head(h)


def shifted(h: torch.Tensor) -> torch.Tensor:
    """Row p: the state of position p - 1 (zeros before the first, as ik's fresh warmup)."""
    return torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)


def train_head(target, head: NextnHead, ids: torch.Tensor, steps: int, lr: float, seed: int) -> float:  # type: ignore[no-untyped-def]
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    loss = torch.tensor(0.0)
    for step in range(steps):
        starts = torch.randint(0, len(ids) - 97, (16,), generator=gen).tolist()
        win = torch.stack([ids[s : s + 96] for s in starts])
        with torch.no_grad():
            h, logits = target_states(target, win)
        _, out = head(shifted(h), win, rotary_of(target))
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), logits.argmax(-1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f"head step {step}: loss {loss.item():.3f}", flush=True)
    return float(loss.item())


@torch.no_grad()
def generate(target, head: NextnHead, prompt: list[int]) -> dict:  # type: ignore[no-untyped-def, type-arg]
    """Greedy MTP speculative decoding, every forward over the whole sequence."""
    rotary = rotary_of(target)
    n = len(prompt)
    h, logits = target_states(target, torch.tensor([prompt]))
    out = [*prompt, int(logits[0, -1].argmax())]
    rows = [torch.zeros_like(h[0, 0])] + [h[0, i] for i in range(n - 1)]
    hidden, start, lengths = h[0, -1], n, []
    while start < n + MAX_NEW:
        blk, state, draft_rows = [out[start]], hidden, list(rows[:start])
        for _ in range(N_MAX):
            draft_rows.append(state)
            s, p = head(torch.stack(draft_rows)[None], torch.tensor([out[:start] + blk]), rotary)
            blk.append(int(p[0, -1].argmax()))
            state = s[0, -1]
        h, logits = target_states(target, torch.tensor([out[:start] + blk]))
        post = logits[0, start : start + len(blk)].argmax(-1).tolist()
        a = 0
        while a < N_MAX and blk[a + 1] == post[a]:
            a += 1
        out = out[:start] + blk[: a + 1] + [post[a]]
        rows = rows[:start] + [hidden] + [h[0, start + i] for i in range(a)]
        hidden, start = h[0, start + a], start + a + 1
        lengths.append(a + 1)
    return {"prompt": prompt, "output_ids": out[: n + MAX_NEW], "acceptance_lengths": lengths}


def rotary_of(target):  # type: ignore[no-untyped-def]
    return (target.inner.model if isinstance(target, GlmDsa) else target.model).rotary_emb


def new_head(target) -> NextnHead:  # type: ignore[no-untyped-def]
    return NextnHead(target.config, target if isinstance(target, GlmDsa) else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--train-target", type=int, default=600)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    ids = torch.tensor(Tokenizer.from_file(str(args.target / "tokenizer.json")).encode(
        args.text.read_text(), add_special_tokens=False).ids, dtype=torch.long)
    hf = args.out / "hf"
    glm = json.loads((args.target / "config.json").read_text())["model_type"] == "glm_moe_dsa"
    train, load = (train_glm_target, load_glm_target) if glm else (train_target, load_target)
    target = train(args.target, hf, ids, args.train_target, args.seed)
    for p in target.parameters():
        p.requires_grad_(False)
    stored = load_file(hf / "model.safetensors")
    head = new_head(target)
    head.load(stored)
    if not glm:
        with torch.no_grad():  # start from the target's own embeddings and output, as released GLM heads do
            head.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            head.shared_head.head.weight.copy_(target.lm_head.weight)
    loss = train_head(target, head, ids, args.steps, args.lr, args.seed)
    for n, t in head.state_dict().items():
        name = head.checkpoint_name(n)
        stored[name] = t.detach().to(stored[name].dtype).contiguous()
    save_file(stored, hf / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(args.target / "config.json", hf / "config.json")
    # decode with exactly the stored weights, in float32, loaded afresh
    target = load(hf)
    head = new_head(target)
    head.load(load_file(hf / "model.safetensors"))
    head.eval()
    step = (len(ids) - PROMPT_LEN - MAX_NEW) // N_PROMPTS
    runs = [generate(target, head, ids[i * step : i * step + PROMPT_LEN].tolist()) for i in range(N_PROMPTS)]
    steps = [a for r in runs for a in r["acceptance_lengths"]]
    oracle = {"reference": "tools/make_mtp_head.py generate: greedy MTP speculative decoding, whole-sequence forwards",
              "n_max": N_MAX, "n_prompts": N_PROMPTS, "prompt_len": PROMPT_LEN, "max_new_tokens": MAX_NEW,
              "prompts_from": f"text tokenized without special tokens, prompt i = tokens [i*{step}, i*{step}+"
              f"{PROMPT_LEN})", "mean_acceptance_length": sum(steps) / len(steps), "train_loss_head": loss,
              "weights": "as stored, computed in float32, eager attention", "torch": torch.__version__, "runs": runs}
    (args.out / "mtp-oracle.json").write_text(json.dumps(oracle, indent=1) + "\n")
    print(f"mean acceptance {oracle['mean_acceptance_length']:.3f}")


if __name__ == "__main__":
    main()
