"""Independent numpy reference for OpenPanguV2ForCausalLM, written from the model's definition.

There is no transformers implementation to run, so this follows the checkpoint's own layout and config.json
(ikconvert/archs/openpangu.py maps the tensors) and the semantics of ik's build_openpangu graph, written the way the
Hugging Face model is laid out rather than the way the runtime computes it: HF tensor names; kv_b_proj expanded into
per-head keys and values (no latent absorption), for the cache and for the param sinks alike; rotate-half rope
from inverse frequencies; the layer schedule from config.json (dsa_layers, swa_layers with sliding_window_list,
block_post_layernorm_idx); mHC streams as explicit matrices with a plain Sinkhorn loop; the MoME convolutions by
zero padding; the router and experts in expert order. float32 throughout, softmaxes in float64.

Where the definition leaves a choice, ik's is taken: every RMS norm uses rms_norm_eps; the indexer's k_norm is an RMS
norm; its weights are not scaled; ties of the indexer's top-k are resolved as ik's std::partial_sort resolves them
(transformers' torch.topk leaves ties to its implementation, and relu makes exact ties common). With
`ik_avx512_sinks` (off by default, as in the runtime) the sinks' values carry ik's AVX-512 GEMM over-read for fewer
than 16 sinks (ikrun/ops/mla.py explains it); it is replayed here on flat memory, register by register.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ikrun.errors import HFReferenceError

Observe = Callable[[str, np.ndarray], None]
BlockHook = Callable[[int, np.ndarray], None]
#: config switches whose other setting ik's graph does not implement
_FIXED = {"use_mhc": True, "use_mome": True, "sandwich_norm": True, "param_sink_with_value": True,
          "mhc_use_gamma": True, "rope_interleave": False}


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def _heap_select(score: np.ndarray, k: int) -> set[int]:
    """The first k indices std::partial_sort(0..n-1, score[a] > score[b]) leaves (libstdc++'s heap select)."""
    heap = list(range(k))

    def sift(hole: int, value: int) -> None:  # __adjust_heap + __push_heap with `a before b` = score[a] > score[b]
        top, child = hole, hole
        while child < (k - 1) // 2:
            child = 2 * child + 2
            if score[heap[child]] > score[heap[child - 1]]:
                child -= 1
            heap[hole], hole = heap[child], child
        if k % 2 == 0 and child == (k - 2) // 2:
            child = 2 * child + 2
            heap[hole], hole = heap[child - 1], child - 1
        parent = (hole - 1) // 2
        while hole > top and score[heap[parent]] > score[value]:
            heap[hole], hole = heap[parent], parent
            parent = (hole - 1) // 2
        heap[hole] = value

    for parent in range((k - 2) // 2, -1, -1):
        sift(parent, heap[parent])
    for i in range(k, len(score)):
        if score[i] > score[heap[0]]:
            sift(0, i)
    return set(heap)


class OpenPanguReference:
    architectures = ("OpenPanguV2ForCausalLM",)

    def __init__(self, config: dict, tensors: dict, ik_avx512_sinks: bool = False):  # type: ignore[type-arg]


        for key, value in _FIXED.items():
            if config.get(key, value) != value:
                raise HFReferenceError(f"config {key}={config[key]!r} is not implemented in the openPangu reference")
        self.cfg = config
        self.tensors = tensors
        self.eps = np.float32(config.get("rms_norm_eps", 1e-6))
        self.n_stream = config["mhc_num_stream"]
        rot = config["qk_rope_head_dim"]
        base = float(config.get("rope_theta", 10000.0))
        self.inv_freq = (1.0 / base ** (np.arange(0, rot, 2, dtype=np.float32) / np.float32(rot))).astype(np.float32)
        windows = dict(zip(config.get("swa_layers") or [], config.get("sliding_window_list") or []))
        self.window = {int(i): int(w) for i, w in windows.items()}
        self.dsa = set(config.get("dsa_layers") or [])
        #: add ik's AVX-512 over-read to the sinks' values (it only exists for 4, 8 or 12 sinks)
        self.ik_avx512_sinks = ik_avx512_sinks

    def w(self, name: str) -> np.ndarray:
        return self.tensors[name].to_f32()

    def _rmsnorm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        var = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
        return (x / np.sqrt(var + self.eps)).astype(np.float32) * weight

    def _rope(self, x: np.ndarray) -> np.ndarray:
        """Rotate-half rope over the whole last axis of x [n, heads, d] at positions 0..n-1."""
        d = x.shape[-1]
        freqs = np.arange(len(x), dtype=np.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = np.cos(freqs)[:, None, :], np.sin(freqs)[:, None, :]
        lo, hi = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1).astype(np.float32)

    @staticmethod
    def _mome(x: np.ndarray, conv: np.ndarray) -> np.ndarray:
        """x + depthwise causal conv: HF's Conv1d(groups=C) weight [C, 1, K] over x zero-padded by K-1 in front."""
        k = conv.shape[-1]
        padded = np.concatenate([np.zeros((k - 1, x.shape[1]), np.float32), x])
        taps = conv.reshape(x.shape[1], k)
        return x + sum(padded[j : j + len(x)] * taps[:, j] for j in range(k))

    # ---- forward --------------------------------------------------------------------------------------------
    def logits(self, tokens: np.ndarray, observe: Observe | None = None,
               on_block: BlockHook | None = None) -> np.ndarray:
        """float32 logits of one sequence; `observe(hf_weight_name, x)` sees every projection's input rows,
        `on_block(i, streams)` the residual streams [n, S, H] after each decoder layer."""
        def proj(h: np.ndarray, name: str) -> np.ndarray:
            if observe is not None:
                observe(name + ".weight", h)
            return h @ self.w(name + ".weight").T

        x = self.w("model.embed_tokens.weight")[tokens]
        streams = np.stack([x] * self.n_stream, axis=1)
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            streams = self._hyper(streams, p + "attn_mhc_module.", p + "input_layernorm.weight",
                                  p + "post_attention_layernorm.weight", lambda h: self._attention(h, i, proj))
            dense = i < self.cfg.get("first_k_dense_replace", 0)
            streams = self._hyper(streams, p + "mlp_mhc_module.", p + "pre_mlp_layernorm.weight",
                                  p + "post_mlp_layernorm.weight",
                                  lambda h: self._mlp(h, p + "mlp.", proj) if dense else self._moe(h, p + "mlp.", proj))
            if i in (self.cfg.get("block_post_layernorm_idx") or []):
                n, s, d = streams.shape
                streams = self._rmsnorm(streams.reshape(n, s * d), self.w(p + "block_post_layernorm.weight"))
                streams = streams.reshape(n, s, d)
            if on_block is not None:
                on_block(i, streams)
        x = self._merge(streams, proj)
        x = self._rmsnorm(x, self.w("model.norm.weight"))
        return (x @ self.w("lm_head.weight").T).astype(np.float32)

    def _hyper(self, streams: np.ndarray, m: str, norm: str, post_norm: str,
               body: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """One hyper-connected sub-layer: h_pre mixes the streams in, h_post scatters the normed output back,
        h_res (Sinkhorn-normalised) mixes the old streams."""
        n, s, d = streams.shape
        mixes = self._rmsnorm(streams.reshape(n, s * d), self.w(m + "norm_gamma")) @ self.w(m + "phi.weight").T
        alpha, beta = self.w(m + "branch_alpha"), self.w(m + "branch_beta")
        h_pre = _sigmoid(mixes[:, :s] * alpha[0] + beta[:s])
        h_post = 2 * _sigmoid(mixes[:, s : 2 * s] * alpha[1] + beta[s : 2 * s])
        h_res = self._sinkhorn((mixes[:, 2 * s :] * alpha[2] + beta[2 * s :]).reshape(n, s, s))
        y = body(self._rmsnorm(np.einsum("ns,nsd->nd", h_pre, streams), self.w(norm)))
        y = self._rmsnorm(y, self.w(post_norm))
        return (h_post[:, :, None] * y[:, None, :] + np.einsum("nji,njd->nid", h_res, streams)).astype(np.float32)

    def _sinkhorn(self, logits: np.ndarray) -> np.ndarray:
        """Row softmax, then alternate column and row normalisation for mhc_recur_norm rounds (columns first)."""
        m = _softmax(logits).astype(np.float64)
        for it in range(self.cfg["mhc_recur_norm"]):
            if it:
                m /= m.sum(-1, keepdims=True)
            m /= m.sum(-2, keepdims=True)
        return m.astype(np.float32)

    def _merge(self, streams: np.ndarray, proj: Callable[[np.ndarray, str], np.ndarray]) -> np.ndarray:
        n, s, d = streams.shape
        p = "model.merge_mhc_module."
        gate = proj(self._rmsnorm(streams.reshape(n, s * d), self.w(p + "norm_gamma")), p + "phi")
        gate = _sigmoid(gate * self.w(p + "branch_alpha_pre").reshape(-1)[0] + self.w(p + "branch_beta_pre"))
        return np.einsum("ns,nsd->nd", gate, streams).astype(np.float32)

    # ---- attention ------------------------------------------------------------------------------------------
    def _attention(self, h: np.ndarray, i: int, proj: Callable[[np.ndarray, str], np.ndarray]) -> np.ndarray:
        cfg = self.cfg
        p = f"model.layers.{i}.self_attn."
        n, n_head = len(h), cfg["num_attention_heads"]
        nope, rope, v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        lora = cfg["kv_lora_rank"]
        q_lat = self._rmsnorm(self._mome(proj(h, p + "q_a_proj"), self.w(p + "qa_conv.weight")),
                              self.w(p + "q_a_layernorm.weight"))
        q = proj(q_lat, p + "q_b_proj").reshape(n, n_head, nope + rope)
        compressed = proj(h, p + "kv_a_proj_with_mqa")
        latent = self._rmsnorm(self._mome(compressed[:, :lora], self.w(p + "compresskv_conv.weight")),
                               self.w(p + "kv_a_layernorm.weight"))
        sink_latent = self._rmsnorm(self.w(p + "param_sink_compressed_kv"), self.w(p + "kv_a_layernorm.weight"))
        n_sink = len(sink_latent)
        kv_b = self.w(p + "kv_b_proj.weight").reshape(n_head, nope + v_dim, lora)
        kv = np.einsum("jc,hec->jhe", np.concatenate([sink_latent, latent]), kv_b)  # sinks first, then the tokens
        k_rot = np.concatenate([np.repeat(self.w(p + "param_sink_k_pe")[:, None], n_head, 1),
                                np.repeat(self._rope(compressed[:, None, lora:]), n_head, 1)])
        query = np.concatenate([q[..., :nope], self._rope(q[..., nope:])], axis=-1)
        key = np.concatenate([kv[..., :nope], k_rot], axis=-1)
        visible = self._visible(h, q_lat, i, p)
        logits = np.einsum("ihd,jhd->hij", query, key) / np.float32(np.sqrt(nope + rope))
        logits[:, :, n_sink:] = np.where(visible[None], logits[:, :, n_sink:], -np.inf)
        probs = _softmax(logits)
        out = np.einsum("hij,jhd->ihd", probs, kv[..., nope:])
        if self.ik_avx512_sinks and n_sink in (4, 8, 12):
            out += self._avx512_overread(probs, sink_latent, kv_b[:, nope:])
        out = self._mome(out.reshape(n, n_head * v_dim).astype(np.float32), self.w(p + "o_conv.weight"))
        return proj(out, p + "o_proj")

    def _visible(self, h: np.ndarray, q_lat: np.ndarray, i: int, p: str) -> np.ndarray:
        """[n, n] keys each query attends to: causal, within the layer's window, among the indexer's top-k."""
        n = len(h)
        pos = np.arange(n)
        visible = pos[:, None] >= pos[None, :]
        if i in self.window and self.window[i] > 0:
            visible &= pos[:, None] - pos[None, :] < self.window[i]
        if i in self.dsa and n > self.cfg["index_topk"]:
            visible &= self._indexer_keep(h, q_lat, p + "indexer.")
        return visible

    def _indexer_keep(self, h: np.ndarray, q_lat: np.ndarray, p: str) -> np.ndarray:
        cfg = self.cfg
        n, heads, dim, rope = len(h), cfg["index_n_heads"], cfg["index_head_dim"], cfg["qk_rope_head_dim"]
        q = (q_lat @ self.w(p + "wq_b.weight").T).reshape(n, heads, dim)
        k = self._rmsnorm(h @ self.w(p + "wk.weight").T, self.w(p + "k_norm.weight"))[:, None, :]
        q = np.concatenate([self._rope(q[..., :rope]), q[..., rope:]], axis=-1)
        k = np.concatenate([self._rope(k[..., :rope]), k[..., rope:]], axis=-1)[:, 0]
        weights = h @ self.w(p + "weights_proj.weight").T
        scores = np.einsum("th,tsh->ts", weights, np.maximum(np.einsum("thd,sd->tsh", q, k), 0))
        keep = np.zeros((n, n), bool)
        for t in range(n):
            chosen = _heap_select(scores[t, : t + 1], cfg["index_topk"]) if t + 1 > cfg["index_topk"] \
                else range(t + 1)
            keep[t, list(chosen)] = True
        return keep

    def _avx512_overread(self, probs: np.ndarray, sink_latent: np.ndarray, v_b: np.ndarray) -> np.ndarray:
        """What ik adds to each head's sink value [n, H, v]. Its GEMM over the transposed sink latents [C, S] (flat,
        zeros past the end) and each softmax row [sinks | cache ...] reads 16 floats of both, then goes over the S
        sink entries once more in its tail loop: beyond the true sum (already in the output) that is the 16-float
        product."""
        n_sink, lora = sink_latent.shape
        flat = np.concatenate([sink_latent.T.reshape(-1), np.zeros(16, np.float32)])
        read = np.stack([flat[c * n_sink : c * n_sink + 16] for c in range(lora)])  # [C, 16]
        rows = probs[:, :, :16]
        if rows.shape[2] < 16:  # ik's rows run on over masked (zero) cache keys
            rows = np.concatenate([rows, np.zeros(rows.shape[:2] + (16 - rows.shape[2],), np.float32)], axis=2)
        return np.einsum("ihc,hvc->ihv", np.einsum("hik,ck->ihc", rows, read), v_b)

    # ---- feed-forward ---------------------------------------------------------------------------------------
    @staticmethod
    def _mlp(h: np.ndarray, p: str, proj: Callable[[np.ndarray, str], np.ndarray]) -> np.ndarray:
        g = proj(h, p + "gate_proj")
        return proj((g / (1 + np.exp(-g))) * proj(h, p + "up_proj"), p + "down_proj")

    def _moe(self, h: np.ndarray, p: str, proj: Callable[[np.ndarray, str], np.ndarray]) -> np.ndarray:
        cfg = self.cfg
        scores = _sigmoid(proj(h, p + "gate"))
        choice = scores + self.w(p + "e_score_correction_bias")
        chosen = np.argsort(-choice, axis=-1, kind="stable")[:, : cfg["num_experts_per_tok"]]
        weights = np.take_along_axis(scores, chosen, -1)
        if cfg.get("norm_topk_prob", True):
            weights = weights / weights.sum(-1, keepdims=True)
        weights = weights * np.float32(cfg["routed_scaling_factor"])
        out = np.zeros_like(h)
        for e in range(cfg["n_routed_experts"]):
            tok, slot = np.nonzero(chosen == e)
            if tok.size:
                out[tok] += self._mlp(h[tok], f"{p}experts.{e}.", proj) * weights[tok, slot][:, None]
        return out + self._mlp(h, p + "shared_experts.", proj) if cfg.get("n_shared_experts") else out
