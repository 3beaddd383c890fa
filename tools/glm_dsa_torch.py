"""GLM-5 (GlmMoeDsaForCausalLM) in torch, for tools that train with it: transformers 4.57 has no glm_moe_dsa, so its
DeepseekV3 decoder layers run here under DeepSeek Sparse Attention's mask, from a lightning indexer written after
the Hugging Face definition (as ikrun/validate/glm_dsa.py's numpy reference): the indexer query from the q LoRA
latent through wq_b, one key head through wk and a LayerNorm (eps 1e-6), rope on the first qk_rope_head_dim dims,
score = sum over heads of weights_proj * heads^-0.5 * relu(q . k * dim^-0.5), causal, torch.topk; "shared" layers
reuse the last full layer's selection.

Needs torch and transformers, OUTSIDE the product (tools/make_mtp_head.py imports it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds3
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

#: GLM-5 config keys DeepseekV3Config does not take (head_dim would override its rope head dim)
GLM_ONLY = ("head_dim", "architectures", "model_type", "rope_parameters", "mlp_layer_types", "transformers_version",
            "dtype", "indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")


def layer_types(cfg: dict, n_layer: int) -> list[str]:  # type: ignore[type-arg]
    """indexer_types as the checkpoint gives it, or every layer full (GLM-5 without IndexShare)."""
    return list(cfg.get("indexer_types") or ["full"] * n_layer)


def deepseek_config(cfg: dict) -> DeepseekV3Config:  # type: ignore[type-arg]
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    config = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in GLM_ONLY}, rope_theta=theta)
    config._attn_implementation = "eager"
    return config


class Indexer(torch.nn.Module):
    """One layer's lightning indexer: the additive keep mask [b, n, n] (0 kept, -inf not) of its top-k keys."""

    def __init__(self, cfg: dict) -> None:  # type: ignore[type-arg]
        super().__init__()
        self.heads, self.dim, self.rope = cfg["index_n_heads"], cfg["index_head_dim"], cfg["qk_rope_head_dim"]
        self.top_k, self.interleave = cfg["index_topk"], bool(cfg.get("indexer_rope_interleave"))
        self.wq_b = torch.nn.Linear(cfg["q_lora_rank"], self.heads * self.dim, bias=False)
        self.wk = torch.nn.Linear(cfg["hidden_size"], self.dim, bias=False)
        self.k_norm = torch.nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = torch.nn.Linear(cfg["hidden_size"], self.heads, bias=False)

    def forward(self, h: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                causal: torch.Tensor) -> torch.Tensor:
        b, n, _ = h.shape
        q = self.wq_b(q_resid).view(b, n, self.heads, self.dim).transpose(1, 2)
        k = self.k_norm(self.wk(h))[:, None]
        rope = ds3.apply_rotary_pos_emb_interleave if self.interleave else ds3.apply_rotary_pos_emb
        q_rot, k_rot = rope(q[..., : self.rope], k[..., : self.rope], cos, sin)
        q, k = torch.cat([q_rot, q[..., self.rope :]], -1), torch.cat([k_rot, k[..., self.rope :]], -1)
        w = self.weights_proj(h) * self.heads ** -0.5
        scores = torch.relu(q @ k.transpose(-1, -2) * self.dim ** -0.5)  # [b, heads, n, n]
        index = torch.einsum("bhst,bsh->bst", scores, w) + causal
        top = index.topk(min(self.top_k, n), dim=-1).indices
        return torch.full_like(index, float("-inf")).scatter(-1, top, 0.0)


class GlmDsa(torch.nn.Module):
    """The main model: transformers' DeepseekV3ForCausalLM (`inner`) with one indexer per full layer."""

    def __init__(self, cfg: dict) -> None:  # type: ignore[type-arg]
        super().__init__()
        self.cfg, self.config = cfg, deepseek_config(cfg)
        self.inner = ds3.DeepseekV3ForCausalLM(self.config)
        self.types = layer_types(cfg, cfg["num_hidden_layers"])
        self.indexers = torch.nn.ModuleDict({str(i): Indexer(cfg) for i, t in enumerate(self.types) if t == "full"})

    def checkpoint_name(self, name: str) -> str:
        if name.startswith("inner."):
            return name[len("inner."):]
        _, i, rest = name.split(".", 2)
        return f"model.layers.{i}.self_attn.indexer.{rest}"

    def load(self, stored: dict[str, torch.Tensor]) -> None:
        self.load_state_dict({n: stored[self.checkpoint_name(n)].float() for n in self.state_dict()})

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The output-normed hidden states and logits [b, n, .]."""
        m = self.inner.model
        x = m.embed_tokens(ids)
        n = ids.shape[1]
        pos = torch.arange(n).unsqueeze(0)
        cos, sin = m.rotary_emb(x, pos)
        causal = torch.full((n, n), float("-inf")).triu(1)[None]
        keep = None
        for i, layer in enumerate(m.layers):
            if str(i) in self.indexers:
                keep = attention_keep(self.indexers[str(i)], layer, x, cos, sin, causal)
            x = layer(x, attention_mask=(keep + causal)[:, None], position_ids=pos, position_embeddings=(cos, sin))
            x = x[0] if isinstance(x, tuple) else x
        h = m.norm(x)
        return h, self.inner.lm_head(h)


def attention_keep(indexer: Indexer, layer: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   causal: torch.Tensor) -> torch.Tensor:
    """The indexer's mask for decoder `layer` on its input x (its attention's normed input and q LoRA latent)."""
    h = layer.input_layernorm(x)
    attn = layer.self_attn
    return indexer(h, attn.q_a_layernorm(attn.q_a_proj(h)), cos, sin, causal)


def load_glm_target(folder: Path) -> GlmDsa:
    model = GlmDsa(json.loads((folder / "config.json").read_text()))
    model.load(load_file(folder / "model.safetensors"))
    return model.float().eval()


def train_glm_target(folder: Path, out: Path, ids: torch.Tensor, steps: int, seed: int) -> GlmDsa:
    """make_dflash_pair.train_target for GLM-5: every stored tensor of the main model learns the text (next token,
    windows of 96; the indexers get no gradient through their top-k and stay as stored); saved to `out` in the
    stored dtypes."""
    model = load_glm_target(folder)
    stored = load_file(folder / "model.safetensors")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - 97, (16,), generator=gen).tolist()
        win = torch.stack([ids[s : s + 97] for s in starts])
        _, logits = model(win[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), win[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f"target step {step}: loss {loss.item():.3f}", flush=True)
    shutil.copytree(folder, out, dirs_exist_ok=True)
    trained = {model.checkpoint_name(n): p for n, p in model.state_dict().items()}
    save_file({n: (trained[n].detach().to(t.dtype) if n in trained else t).contiguous() for n, t in stored.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    return load_glm_target(out)
