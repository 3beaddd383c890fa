"""Independent numpy reference for the Gated DeltaNet hybrids (Qwen3NextForCausalLM, Qwen3.5 MoE and dense), written
from the Hugging Face model definitions (transformers' modeling_qwen3_next.py and modeling_qwen3_5(_moe).py).

It shares nothing with the runtime: HF tensor names and layouts (Qwen3-Next's per-key-head `in_proj_qkvz` / `in_proj_ba`
split as `fix_query_key_value_ordering` does, Qwen3.5's separate projections, value heads in HF's grouped order with
q / k repeated per group), the depthwise causal conv with SiLU, transformers' chunked gated delta rule
(`torch_chunk_gated_delta_rule`, 64-token chunks, the in-chunk triangular solve row by row, L2-normalised q / k),
the gated RMSNorm `norm(x) * w * silu(z)`, zero-centred RMSNorms `norm(x) * (1 + w)`, gated attention (q_proj's per
head [q | gate] halves, sigmoid(gate) on the output) with partial rotate-half rope (Qwen3.5: interleaved M-RoPE, its
t / h / w sections taking every third frequency; for text all three positions are the token index), the MoE with
softmax routing and the sigmoid-gated shared expert. float32 throughout, like transformers on CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Observe = Callable[[str, np.ndarray], None]
#: transformers' chunk length of the gated delta rule
CHUNK = 64


def _silu(x: np.ndarray) -> np.ndarray:
    return (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (np.float32(1.0) / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def _softplus(x: np.ndarray) -> np.ndarray:
    """torch's softplus (beta 1, threshold 20)."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)


def _l2norm(x: np.ndarray) -> np.ndarray:
    return (x / np.sqrt((x * x).sum(-1, keepdims=True) + np.float32(1e-6))).astype(np.float32)


def chunk_gated_delta_rule(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """transformers' torch_chunk_gated_delta_rule with L2-normalised q / k and no initial state.
    q, k [heads, n, dk], v [heads, n, dv], g and beta [heads, n]; returns [heads, n, dv]."""
    h, n, dk = k.shape
    dv = v.shape[-1]
    pad = (CHUNK - n % CHUNK) % CHUNK
    q, k = _l2norm(q), _l2norm(k)
    q, k, v = (np.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (q, k, v))
    g, beta = (np.pad(x, ((0, 0), (0, pad))) for x in (g, beta))
    q = q * np.float32(1.0 / np.sqrt(dk))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    n_chunks = (n + pad) // CHUNK
    q, k, v_beta, k_beta = (x.reshape(h, n_chunks, CHUNK, x.shape[-1]) for x in (q, k, v_beta, k_beta))
    g = np.cumsum(g.reshape(h, n_chunks, CHUNK), axis=-1, dtype=np.float32)
    decay = np.tril(np.exp(np.tril(g[..., :, None] - g[..., None, :]))).astype(np.float32)
    upper_or_diag = np.triu(np.ones((CHUNK, CHUNK), dtype=bool))
    attn = np.where(upper_or_diag, np.float32(0), -((k_beta @ k.swapaxes(-1, -2)) * decay)).astype(np.float32)
    for i in range(1, CHUNK):
        row, sub = attn[..., i, :i].copy(), attn[..., :i, :i].copy()
        attn[..., i, :i] = row + (row[..., None] * sub).sum(-2)
    attn = attn + np.eye(CHUNK, dtype=np.float32)
    value = attn @ v_beta
    k_cumdecay = attn @ (k_beta * np.exp(g)[..., None])
    state = np.zeros((h, dk, dv), dtype=np.float32)
    out = np.zeros((h, n_chunks, CHUNK, dv), dtype=np.float32)
    strictly_upper = np.triu(np.ones((CHUNK, CHUNK), dtype=bool), 1)
    for c in range(n_chunks):
        q_c, k_c, g_c = q[:, c], k[:, c], g[:, c]
        local = np.where(strictly_upper, np.float32(0), (q_c @ k_c.swapaxes(-1, -2)) * decay[:, c])
        v_new = value[:, c] - k_cumdecay[:, c] @ state
        out[:, c] = (q_c * np.exp(g_c)[..., None]) @ state + local @ v_new
        state = (state * np.exp(g_c[:, -1])[:, None, None]
                 + (k_c * np.exp(g_c[:, -1:] - g_c)[..., None]).swapaxes(-1, -2) @ v_new)
    return out.reshape(h, n_chunks * CHUNK, dv)[:, :n].astype(np.float32)


class GatedDeltaNetReference:
    architectures = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                     "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")

    def __init__(self, config: dict, tensors: dict):  # type: ignore[type-arg]
        text = config.get("text_config")
        self.cfg = {**config, **text} if isinstance(text, dict) else config
        self.tensors = {name.replace("model.language_model.", "model.", 1): t for name, t in tensors.items()}
        cfg = self.cfg
        self.eps = np.float32(cfg["rms_norm_eps"])
        self.n_k, self.n_v = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
        self.d_k, self.d_v = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
        params = cfg.get("rope_parameters")
        rope: dict = params if isinstance(params, dict) else cfg  # type: ignore[type-arg]
        self.head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        self.rotary_dim = int(self.head_dim * float(rope.get("partial_rotary_factor", 0.25)))
        base = float(rope.get("rope_theta", 10000.0))
        exponents = np.arange(0, self.rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(self.rotary_dim)
        self.inv_freq = (np.float32(1.0) / np.float32(base) ** exponents).astype(np.float32)
        self.mrope_section = rope.get("mrope_section")
        interval = int(cfg.get("full_attention_interval") or 4)
        self.layer_types = cfg.get("layer_types") or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(int(cfg["num_hidden_layers"]))]
        self._observe: Observe | None = None

    def w(self, name: str) -> np.ndarray:
        return self.tensors[name].to_f32()

    def _norm(self, x: np.ndarray) -> np.ndarray:
        var = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
        return (x / np.sqrt(var + self.eps)).astype(np.float32)

    def _zc_norm(self, x: np.ndarray, name: str) -> np.ndarray:
        """Zero-centred RMSNorm: the stored gain is w, the applied one 1 + w."""
        return (self._norm(x) * (np.float32(1.0) + self.w(name))).astype(np.float32)

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate-half rope on the first rotary_dim dims of x [n, heads, head_dim]; with M-RoPE sections the
        frequencies of dims 1, 4, .. (h) and 2, 5, .. (w) follow the h / w positions (the token index for text)."""
        d = self.rotary_dim
        pos3 = np.stack([positions] * 3).astype(np.float32)
        freqs = pos3[:, :, None] * self.inv_freq[None, None, :]
        picked = freqs[0].copy()
        if self.mrope_section is not None:
            for axis, offset in ((1, 1), (2, 2)):
                idx = slice(offset, int(self.mrope_section[axis]) * 3, 3)
                picked[:, idx] = freqs[axis][:, idx]
        emb = np.concatenate([picked, picked], axis=-1)
        cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
        rot = x[..., :d]
        rotated = np.concatenate([-rot[..., d // 2:], rot[..., : d // 2]], axis=-1)
        return np.concatenate([rot * cos + rotated * sin, x[..., d:]], axis=-1).astype(np.float32)

    def logits(self, tokens: np.ndarray, observe: Observe | None = None) -> np.ndarray:
        """float32 logits of one sequence; `observe(hf_weight_name, x)` sees every projection's input rows."""
        n = len(tokens)
        self._observe = observe
        x = self.w("model.embed_tokens.weight")[tokens]

        def proj(h: np.ndarray, name: str) -> np.ndarray:
            if observe is not None:
                observe(name + ".weight", h)
            return (h @ self.w(name + ".weight").T).astype(np.float32)

        for i, kind in enumerate(self.layer_types):
            p = f"model.layers.{i}."
            h = self._zc_norm(x, p + "input_layernorm.weight")
            if kind == "linear_attention":
                x = x + self._delta_net(h, p + "linear_attn.", proj)
            else:
                x = x + self._attention(h, p + "self_attn.", np.arange(n), proj)
            h = self._zc_norm(x, p + "post_attention_layernorm.weight")
            x = x + (self._moe(h, p + "mlp.", proj) if p + "mlp.gate.weight" in self.tensors
                     else self._mlp(h, p + "mlp.", proj))
        x = self._zc_norm(x, "model.norm.weight")
        head = "lm_head.weight" if "lm_head.weight" in self.tensors else "model.embed_tokens.weight"
        return (x @ self.w(head).T).astype(np.float32)

    def _delta_net(self, h: np.ndarray, p: str, proj: Callable[[np.ndarray, str], np.ndarray]) -> np.ndarray:
        n = h.shape[0]
        n_k, n_v, d_k, d_v = self.n_k, self.n_v, self.d_k, self.d_v
        r = n_v // n_k
        if p + "in_proj_qkvz.weight" in self.tensors:  # Qwen3-Next: per key head [q, k, v x r, z x r], [b x r, a x r]
            qkvz = proj(h, p + "in_proj_qkvz").reshape(n, n_k, 2 * d_k + 2 * r * d_v)
            ba = proj(h, p + "in_proj_ba").reshape(n, n_k, 2 * r)
            q, k = qkvz[..., :d_k], qkvz[..., d_k:2 * d_k]
            v, z = qkvz[..., 2 * d_k:2 * d_k + r * d_v], qkvz[..., 2 * d_k + r * d_v:]
            mixed = np.concatenate([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], axis=-1)
            z = z.reshape(n, n_v, d_v)
            b, a = ba[..., :r].reshape(n, n_v), ba[..., r:].reshape(n, n_v)
        else:  # Qwen3.5: separate projections
            mixed = proj(h, p + "in_proj_qkv")
            z = proj(h, p + "in_proj_z").reshape(n, n_v, d_v)
            b, a = proj(h, p + "in_proj_b"), proj(h, p + "in_proj_a")
        kernel = self.w(p + "conv1d.weight")[:, 0, :]  # [channels, K]: depthwise, causal (left zero padding)
        width = kernel.shape[1]
        padded = np.concatenate([np.zeros((width - 1, mixed.shape[1]), np.float32), mixed])
        conv = sum(padded[j:j + n] * kernel[:, j] for j in range(width))
        mixed = _silu(np.asarray(conv, dtype=np.float32))
        kd = n_k * d_k
        q = mixed[:, :kd].reshape(n, n_k, d_k)
        k = mixed[:, kd:2 * kd].reshape(n, n_k, d_k)
        v = mixed[:, 2 * kd:].reshape(n, n_v, d_v)
        beta = _sigmoid(b)
        g = (-np.exp(self.w(p + "A_log")) * _softplus(a + self.w(p + "dt_bias"))).astype(np.float32)
        q, k = np.repeat(q, r, axis=1), np.repeat(k, r, axis=1)
        core = chunk_gated_delta_rule(q.swapaxes(0, 1), k.swapaxes(0, 1), v.swapaxes(0, 1), g.T, beta.T)
        core = core.swapaxes(0, 1)  # [n, heads, d_v]
        gated = self._norm(core) * self.w(p + "norm.weight") * _silu(z)
        return proj(gated.reshape(n, n_v * d_v).astype(np.float32), p + "out_proj")

    def _attention(self, h: np.ndarray, p: str, positions: np.ndarray,
                   proj: Callable[[np.ndarray, str], np.ndarray]) -> np.ndarray:
        n, hd = h.shape[0], self.head_dim
        n_head = int(self.cfg["num_attention_heads"])
        n_kv = int(self.cfg.get("num_key_value_heads") or n_head)
        qg = proj(h, p + "q_proj").reshape(n, n_head, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(n, n_head * hd)
        q = self._rope(self._zc_norm(q, p + "q_norm.weight"), positions)
        k = self._rope(self._zc_norm(proj(h, p + "k_proj").reshape(n, n_kv, hd), p + "k_norm.weight"), positions)
        v = proj(h, p + "v_proj").reshape(n, n_kv, hd)
        k, v = np.repeat(k, n_head // n_kv, axis=1), np.repeat(v, n_head // n_kv, axis=1)
        mask = np.triu(np.full((n, n), -np.inf, dtype=np.float32), 1)
        att = np.einsum("ihd,jhd->hij", q, k) * np.float32(hd ** -0.5) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att = att / att.sum(-1, keepdims=True)
        o = np.einsum("hij,jhd->ihd", att, v).reshape(n, n_head * hd)
        return proj((o * _sigmoid(gate)).astype(np.float32), p + "o_proj")

    @staticmethod
    def _mlp(h: np.ndarray, p: str, proj: Callable[[np.ndarray, str], np.ndarray]) -> np.ndarray:
        return proj(_silu(proj(h, p + "gate_proj")) * proj(h, p + "up_proj"), p + "down_proj")

    def _expert(self, h: np.ndarray, p: str, e: int, proj: Callable[[np.ndarray, str], np.ndarray]) -> np.ndarray:
        """One routed expert's SwiGLU on its rows: per-expert tensors, or transformers 5's fused [E, 2F, H] /
        [E, H, F] stacks (gate the first half)."""
        if f"{p}experts.{e}.gate_proj.weight" in self.tensors:
            return self._mlp(h, f"{p}experts.{e}.", proj)
        if self._observe is not None:
            self._observe(p + "experts.gate_up_proj", h)
        gate_up = h @ self.tensors[p + "experts.gate_up_proj"].to_f32()[e].T
        ff = gate_up.shape[1] // 2
        act = (_silu(gate_up[:, :ff]) * gate_up[:, ff:]).astype(np.float32)
        if self._observe is not None:
            self._observe(p + "experts.down_proj", act)
        return (act @ self.tensors[p + "experts.down_proj"].to_f32()[e].T).astype(np.float32)

    def _moe(self, h: np.ndarray, p: str, proj: Callable[[np.ndarray, str], np.ndarray]) -> np.ndarray:
        """Softmax routing over the top-k (renormalised unless norm_topk_prob is false), each expert on the tokens
        routed to it, plus the shared expert scaled by sigmoid(shared_expert_gate)."""
        logits = proj(h, p + "gate")
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs = probs / probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :int(self.cfg["num_experts_per_tok"])]
        weights = np.take_along_axis(probs, top, axis=-1)
        if self.cfg.get("norm_topk_prob", True):
            weights = weights / weights.sum(-1, keepdims=True)

        out = np.zeros_like(h)
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)
            out[rows] += weights[rows, slot, None] * self._expert(h[rows], p, int(e), proj)
        if p + "shared_expert.gate_proj.weight" in self.tensors:
            shared = self._mlp(h, p + "shared_expert.", proj)
            out = out + _sigmoid(proj(h, p + "shared_expert_gate")) * shared
        return out.astype(np.float32)
