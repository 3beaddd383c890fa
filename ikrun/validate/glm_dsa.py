"""Independent numpy reference for GlmMoeDsaForCausalLM, written from the Hugging Face model definition.

GLM-5's layers are DeepSeek-V3's (ikrun/validate/deepseek2.py: expanded per-head keys and values, HF's rope and
router) with DeepSeek Sparse Attention: each attention block's mask keeps, per query, only the `index_topk` keys its
lightning indexer scores highest. As transformers computes it: the indexer query from the q LoRA latent through
wq_b, the one key head through wk and a LayerNorm (eps 1e-6, as HF builds it), rope on the first qk_rope_head_dim
dims of both, score = sum over heads of weights_proj * n_heads^-0.5 * relu(q . k * index_head_dim^-0.5), causal,
top-k. "shared" layers (indexer_types, derived from config.json as transformers does) reuse the last full layer's
top-k. No attention-sink forcing, float32 throughout (`dtype` float64 for a check of the runtime's float32).
"""

from __future__ import annotations

import numpy as np

from ikrun.validate.deepseek2 import BlockHook, DeepseekV3Reference, Observe, Proj


def layer_types(config: dict, n_layer: int) -> list[str]:  # type: ignore[type-arg]
    """GlmMoeDsaConfig's indexer_types: given, or from index_topk_pattern ("F"/"S" or names), or from
    index_topk_freq / index_skip_topk_offset (written here from transformers, not shared with the converter)."""
    if config.get("indexer_types") is not None:
        return list(config["indexer_types"])
    pattern = config.get("index_topk_pattern")
    if pattern is not None:
        names = {"F": "full", "S": "shared"}
        return [names.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(config.get("index_topk_freq", 1)), 1), int(config.get("index_skip_topk_offset", 2))
    return ["shared" if i >= offset and (i - offset + 1) % freq else "full" for i in range(n_layer)]


class GlmDsaReference(DeepseekV3Reference):
    architectures = ("GlmMoeDsaForCausalLM",)
    #: HF builds the indexer's k_norm as nn.LayerNorm(index_head_dim, eps=1e-6)
    indexer_norm_eps = 1e-6

    def __init__(self, config: dict, tensors: dict, dtype: type = np.float32):  # type: ignore[type-arg]
        config = {**config, "rope_theta": config.get("rope_theta", (config.get("rope_parameters") or {}).get(
            "rope_theta", 10000.0))}
        super().__init__(config, tensors, dtype)
        self.types = layer_types(config, config["num_hidden_layers"])
        #: during a forward: the last full layer's top-k [n, k] (key indices per query)
        self._topk: np.ndarray | None = None
        #: every layer's top-k of the last forward, for tests that localise a disagreement
        self.selections: dict[int, np.ndarray] = {}

    def logits(self, tokens: np.ndarray, observe: Observe | None = None,
               on_block: BlockHook | None = None) -> np.ndarray:
        self._topk, self.selections = None, {}
        return super().logits(tokens, observe, on_block)

    def mtp_logits(self, hidden: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The NextN/MTP layer's logits (DeepseekV3Reference.mtp_logits): its attention is a full DSA layer with its
        own indexer, as vLLM's and SGLang's GLM-5 MTP run it."""
        self._topk = None
        return super().mtp_logits(hidden, tokens)

    def _mask(self, h: np.ndarray, q_resid: np.ndarray | None, p: str, positions: np.ndarray,
              proj: Proj) -> np.ndarray:
        causal = super()._mask(h, q_resid, p, positions, proj)
        layer = int(p.split(".")[2])
        if layer >= len(self.types) or self.types[layer] == "full" or self._topk is None:  # the MTP layer: full
            self._topk = self._indexer(h, q_resid, p + "indexer.", positions, causal, proj)  # type: ignore[arg-type]
        self.selections[layer] = self._topk
        index_mask = np.full_like(causal, -np.inf)
        np.put_along_axis(index_mask, self._topk, 0.0, axis=-1)
        return index_mask + causal

    def _indexer(self, h: np.ndarray, q_resid: np.ndarray, p: str, positions: np.ndarray, causal: np.ndarray,
                 proj: Proj) -> np.ndarray:
        cfg = self.cfg
        n, heads, dim, rope = h.shape[0], cfg["index_n_heads"], cfg["index_head_dim"], cfg["qk_rope_head_dim"]
        interleave = cfg.get("indexer_rope_interleave")
        q = proj(q_resid, p + "wq_b").reshape(n, heads, dim)
        q = np.concatenate([self._rope(q[..., :rope], positions, interleave), q[..., rope:]], axis=-1)
        k = proj(h, p + "wk")
        mean = k.mean(-1, keepdims=True)
        var = ((k - mean) ** 2).mean(-1, keepdims=True)
        k = (k - mean) / np.sqrt(var + self.dtype(self.indexer_norm_eps)) * self.w(p + "k_norm.weight") \
            + self.w(p + "k_norm.bias")
        k = np.concatenate([self._rope(k[:, None, :rope], positions, interleave)[:, 0], k[:, rope:]], axis=-1)
        weights = proj(h, p + "weights_proj") * self.dtype(heads ** -0.5)
        scores = np.maximum(np.einsum("shd,td->sht", q, k) * self.dtype(dim ** -0.5), 0)
        index = np.einsum("sht,sh->st", scores, weights) + causal
        return np.argsort(-index, axis=-1, kind="stable")[:, : min(cfg["index_topk"], n)]
