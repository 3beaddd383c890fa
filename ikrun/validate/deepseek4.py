"""Independent numpy reference for DeepseekV4ForCausalLM, written from the transformers 5.23 model definition.

Why: ik's graph (and a runtime port of it) computes hyper-connections, compressed attention and the lightning indexer
fused and cache-oriented; this computes the same model the way transformers lays it out, one explicit array per step,
so a disagreement points at one side rather than at both. It shares no code with ikrun's forward and reads the
checkpoint's own tensor names (`layers.N.attn.wq_a.weight`, ... as stored in the Hugging Face repository; the
transformers module each one loads into is named where it is used). Weights are widened exactly, as transformers'
FineGrainedFP8Config(dequantize=True, expert_dtype='fp4') loads them: BF16/F32 as stored, FP8 E4M3 times
2^(e8m0-127) per `weight_block_size` tile, routed experts E2M1 (even element in the low nibble) times 2^(e8m0-127)
per 32 values. Activations are float32 like transformers on CPU; softmaxes and the Sinkhorn loop run in float64.

It is the stateless forward transformers runs with `use_cache=False`: positions 0..n-1, the compressors pool only
complete windows of this sequence (no carried buffer or overlap state), and the MTP block is not run by `logits`.
`mtp_logits` runs it alone, in float64 (a check of a float32 runtime that rounds nothing of its own), as DeepSeek's
MTPBlock defines it: per hyper-connection stream e_proj(enorm(embedding)) + h_proj(hnorm(stream)), the block (its
compress ratio 0: a sliding-window layer with the main rope), its own hc_head mix, norm and the shared head.

Where the definition leaves a choice, or transformers' behaviour is easy to miss, and what is done here:

- Top-k ties (lightning indexer; router): torch.topk leaves the order of equal values to its CPU kernel, and with few
  indexer heads ReLU makes exact zero scores common once more than index_topk entries are visible. The index set is
  the one torch's kernel returns (libstdc++ nth_element / partial_sort over (value, index) pairs, replayed by
  `torch_topk`), so the reference follows transformers past 64 tokens too; ik breaks these ties differently.
- Indexer picks the query may not see yet (w >= (t+1)//ratio, possible when fewer than index_topk are visible) are
  dropped, as transformers drops them through its -1 sentinel.
- Hash routing may name one expert twice for a token (tid2eid rows repeat ids); that expert then counts twice, as the
  eager experts loop's index_add counts it.
- Routed experts are summed in expert order, each scaled by its weight; the shared expert (clamped like the routed
  ones) is added after. Router weights are always renormalised (+1e-20), whatever norm_topk_prob says.
- Sliding-only layers use the plain "main" rope (rope_theta); CSA/HCA layers use the "compress" rope
  (compress_rope_theta, YaRN from rope_scaling) for queries, keys, inverse rope, compressed entries and the indexer,
  with cos/sin unscaled: transformers pins YaRN's attention_factor to 1 unless the config sets one.
- FP8 tiles: the checkpoint's 128x128 tiles with partial edge tiles. transformers instead derives the tile from the
  scale grid (rows // grid rows); the two agree when every dimension is at most the tile or a multiple of it, as in
  the DeepSeek-V4 checkpoints, and differ otherwise (a 192-row weight would get 96-row tiles there).
- softplus switches to the identity above 20, as torch's default threshold does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ikconvert.archs.deepseek4 import dequantize_fp8_e8m0, e8m0_bytes
from ikconvert.checkpoint import Checkpoint
from ikconvert.safetensors_io import E8M0_TABLE, SafeTensor
from ikrun.errors import HFReferenceError

BlockHook = Callable[[int, np.ndarray], None]
Observe = Callable[[str, np.ndarray], None]

#: E2M1 code -> value (sign bit 3, then two exponent bits and one mantissa bit)
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
FP4_GROUP = 32  # E2M1 values per E8M0 scale
#: compress ratio -> transformers layer type
LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus default


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)


def _silu(x: np.ndarray) -> np.ndarray:
    return (x * _sigmoid(x)).astype(np.float32)


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax in float64; rows that are all -inf give NaN as in torch (callers never produce them)."""
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


def _unit_rms(x: np.ndarray, eps: float) -> np.ndarray:
    """RMS normalisation without a weight over the last axis (DeepseekV4UnweightedRMSNorm)."""
    x = x.astype(np.float32)
    var = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(var + np.float32(eps))).astype(np.float32)


def _hc_weights(mix: np.ndarray, base: np.ndarray, scale: np.ndarray, hc: int, eps: float,
                iters: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A hyper-connection's (pre [n, hc], post [n, hc], comb [n, hc, hc]) from its projection `mix`
    [n, hc * (2 + hc)] (DeepseekV4HyperConnection: sigmoid gates, a Sinkhorn-normalised mixing matrix)."""
    n = mix.shape[0]
    pre = 1.0 / (1.0 + np.exp(-(mix[:, :hc] * scale[0] + base[:hc]))) + eps
    post = 2.0 / (1.0 + np.exp(-(mix[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])))
    logits = mix[:, 2 * hc:].reshape(n, hc, hc) * scale[2] + base[2 * hc:].reshape(hc, hc)
    comb = np.exp(logits - logits.max(-1, keepdims=True))
    comb = comb / comb.sum(-1, keepdims=True) + eps
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
    return pre, post, comb


def dequantize_fp4(codes: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """[out, in/2] packed E2M1 (even element in the low nibble) with [out, in/32] E8M0 scale bytes -> float32
    [out, in], each value times 2^(byte-127)."""
    raw = codes.view(np.uint8)
    rows, half = raw.shape
    vals = np.empty((rows, 2 * half), dtype=np.float32)
    vals[:, 0::2] = E2M1_VALUES[raw & 0x0F]
    vals[:, 1::2] = E2M1_VALUES[raw >> 4]
    mult = E8M0_TABLE[scale_bytes]
    return (vals.reshape(rows, -1, FP4_GROUP) * mult[:, :, None]).reshape(rows, 2 * half).astype(np.float32)


def _lg(n: int) -> int:
    return n.bit_length() - 1


def torch_topk(values: np.ndarray, k: int) -> list[int]:
    """The index set torch.topk(values, k) returns on CPU (largest=True), ties included.

    torch's CPU kernel fills (value, index) pairs and runs libstdc++'s std::partial_sort when k * 64 <= n, else
    std::nth_element, both with `a before b` = a.value > b.value (NaN first); which of several equal values lands in
    the top k is whatever those algorithms leave there, so they are replayed here step by step (introselect with
    median-of-three pivots, heap select, insertion sort)."""
    v = [float(x) for x in values]
    n = len(v)
    if k >= n:
        return list(range(n))
    if k <= 0:
        return []
    q = list(range(n))

    def comp(a: int, b: int) -> bool:
        return (math.isnan(v[a]) and not math.isnan(v[b])) or v[a] > v[b]

    def adjust_heap(first: int, hole: int, length: int, value: int) -> None:
        top, child = hole, hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if comp(q[first + child], q[first + child - 1]):
                child -= 1
            q[first + hole] = q[first + child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            q[first + hole] = q[first + child - 1]
            hole = child - 1
        parent = (hole - 1) // 2
        while hole > top and comp(q[first + parent], value):
            q[first + hole] = q[first + parent]
            hole = parent
            parent = (hole - 1) // 2
        q[first + hole] = value

    def heap_select(first: int, middle: int, last: int) -> None:
        length = middle - first
        if length > 1:
            for parent in range((length - 2) // 2, -1, -1):
                adjust_heap(first, parent, length, q[first + parent])
        for i in range(middle, last):
            if comp(q[i], q[first]):
                value, q[i] = q[i], q[first]
                adjust_heap(first, 0, length, value)

    def insertion_sort(first: int, last: int) -> None:
        for i in range(first + 1, last):
            value = q[i]
            if comp(value, q[first]):
                q[first + 1:i + 1] = q[first:i]
                q[first] = value
            else:
                j = i
                while comp(value, q[j - 1]):
                    q[j] = q[j - 1]
                    j -= 1
                q[j] = value

    def median_to_first(result: int, a: int, b: int, c: int) -> None:
        if comp(q[a], q[b]):
            pick = b if comp(q[b], q[c]) else c if comp(q[a], q[c]) else a
        else:
            pick = a if comp(q[a], q[c]) else c if comp(q[b], q[c]) else b
        q[result], q[pick] = q[pick], q[result]

    def partition_pivot(first: int, last: int) -> int:
        median_to_first(first, first + 1, first + (last - first) // 2, last - 1)
        pivot, lo, hi = q[first], first + 1, last
        while True:
            while comp(q[lo], pivot):
                lo += 1
            hi -= 1
            while comp(pivot, q[hi]):
                hi -= 1
            if lo >= hi:
                return lo
            q[lo], q[hi] = q[hi], q[lo]
            lo += 1

    if k * 64 <= n:  # std::partial_sort: the set is the heap select's
        heap_select(0, k, n)
        return q[:k]
    first, nth, last = 0, k - 1, n  # std::nth_element
    depth = 2 * _lg(n)
    while last - first > 3:
        if depth == 0:
            heap_select(first, nth + 1, last)
            q[first], q[nth] = q[nth], q[first]
            return q[:k]
        depth -= 1
        cut = partition_pivot(first, last)
        if cut <= nth:
            first = cut
        else:
            last = cut
    insertion_sort(first, last)
    return q[:k]


class DeepseekV4Reference:
    architectures = ("DeepseekV4ForCausalLM", "DeepseekV4FlashForCausalLM", "DeepseekV4ProForCausalLM")

    def __init__(self, config: dict[str, Any], tensors: dict[str, SafeTensor]):
        self.cfg = config
        self.tensors = tensors
        self._cache: dict[str, np.ndarray] = {}
        self._observe: Observe | None = None
        c = config
        self.n_layer: int = c["num_hidden_layers"]
        self.ratios: list[int] = list(c.get("compress_ratios") or [0] * self.n_layer)[: self.n_layer]
        for r in self.ratios:
            if r not in LAYER_TYPES:


                raise HFReferenceError(f"compress ratio {r} is not one transformers implements ({sorted(LAYER_TYPES)})")
        self.n_hash: int = min(c.get("num_hash_layers", 3), self.n_layer)
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        self.hc_eps = float(c.get("hc_eps", 1e-6))
        self.hd: int = c["head_dim"]
        self.rope_dim: int = c.get("qk_rope_head_dim") or self.hd // 8  # transformers' default 64 / 512
        self.limit = float(c.get("swiglu_limit", 10.0))
        q = c.get("quantization_config") or {}
        self.block = tuple(q.get("weight_block_size") or (128, 128))
        compress, self.compress_scale = self._compress_inv_freq()
        self.inv_freq = {"main": self._default_inv_freq(float(c.get("rope_theta", 10000.0))), "compress": compress}

    @classmethod
    def from_folder(cls, folder: str | Path) -> DeepseekV4Reference:
        """The reference over a checkpoint folder (config.json and its safetensors shards)."""
        ckpt = Checkpoint(folder)
        return cls(ckpt.config, dict(ckpt.iter_tensors()))

    # ---- weights --------------------------------------------------------------------------------------------
    def w(self, name: str) -> np.ndarray:
        """float32 values of a checkpoint tensor, dequantized with its `.scale` companion when there is one."""
        got = self._cache.get(name)
        if got is not None:
            return got
        t = self.tensors[name]
        scale = self.tensors.get(name.removesuffix(".weight") + ".scale") if name.endswith(".weight") else None
        if t.dtype in ("F8_E4M3", "F8_E5M2"):
            assert scale is not None, f"{name} is FP8 without a scale"
            out = dequantize_fp8_e8m0(t, scale, self.block)  # type: ignore[arg-type]
        elif t.dtype in ("I8", "U8"):
            assert scale is not None, f"{name} is packed FP4 without a scale"
            out = dequantize_fp4(t.raw(), e8m0_bytes(scale))
        else:
            out = t.to_f32()
        self._cache[name] = out
        return out

    # ---- rope -----------------------------------------------------------------------------------------------
    def _default_inv_freq(self, base: float) -> np.ndarray:
        d = self.rope_dim
        return (1.0 / (base ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)))).astype(
            np.float32)

    def _compress_inv_freq(self) -> tuple[np.ndarray, float]:
        """Inverse frequencies and cos/sin factor of the "compress" rope (CSA/HCA layers): compress_rope_theta with
        YaRN when rope_scaling (or a nested rope_parameters["compress"]) says so; the factor is 1 unless set."""
        c = self.cfg
        base = float(c.get("compress_rope_theta", 160000.0))
        scaling = c.get("rope_scaling") or c.get("rope_parameters") or {}
        if isinstance(scaling.get("compress"), dict):
            scaling = scaling["compress"]
            base = float(scaling.get("rope_theta", base))
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "yarn":
            return self._default_inv_freq(base), 1.0
        d = self.rope_dim
        longest = c.get("max_position_embeddings", 1048576)
        original = scaling.get("original_max_position_embeddings") or longest
        factor = scaling.get("factor") or longest / original
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        pos_freqs = (base ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d))).astype(np.float32)
        ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        extrapolation = (np.float32(1.0) - ramp.astype(np.float32)).astype(np.float32)
        inv_extra = (np.float32(1.0) / pos_freqs).astype(np.float32)
        inv_inter = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
        inv = (inv_inter * (np.float32(1.0) - extrapolation) + inv_extra * extrapolation).astype(np.float32)
        return inv, float(scaling.get("attention_factor") or 1.0)

    def _cos_sin(self, kind: str, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[n, rope_dim/2] cos and sin, one angle per interleaved pair."""
        freqs = (positions.astype(np.float32)[:, None] * self.inv_freq[kind][None, :]).astype(np.float32)
        scale = np.float32(self.compress_scale if kind == "compress" else 1.0)
        return (np.cos(freqs) * scale).astype(np.float32), (np.sin(freqs) * scale).astype(np.float32)

    @staticmethod
    def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate consecutive pairs (2i, 2i+1) of the trailing 2*len(cos) channels of x [n, ..., d]; cos/sin [n, r/2]
        broadcast over the middle axes. The leading (nope) channels are untouched."""
        r = 2 * cos.shape[-1]
        shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[-1],)
        cos, sin = cos.reshape(shape), sin.reshape(shape)
        out = x.astype(np.float32, copy=True)
        even, odd = x[..., -r::2], x[..., -r + 1::2]
        out[..., -r::2] = even * cos - odd * sin
        out[..., -r + 1::2] = odd * cos + even * sin
        return out

    def _proj(self, h: np.ndarray, name: str) -> np.ndarray:
        """h @ W.T for the checkpoint weight `name` (nn.Linear without bias), shown to the observer first."""
        if self._observe is not None:
            self._observe(name, h)
        return (h.astype(np.float32) @ self.w(name).T).astype(np.float32)

    def _rmsnorm(self, x: np.ndarray, weight: str) -> np.ndarray:
        return (self.w(weight) * _unit_rms(x, self.eps)).astype(np.float32)

    # ---- forward --------------------------------------------------------------------------------------------
    def logits(self, tokens: np.ndarray, observe: Observe | None = None,
               on_block: BlockHook | None = None) -> np.ndarray:
        """float32 logits [n, vocab] of one sequence at positions 0..n-1. `observe(name, x)` sees the input rows of
        every linear (checkpoint weight name; a routed expert only its own tokens); `on_block(i, streams)` the
        hyper-connection streams [n, hc_mult, hidden] after decoder layer i."""
        tokens = np.asarray(tokens, dtype=np.int64)
        c = self.cfg
        n = len(tokens)
        hc = c["hc_mult"]
        positions = np.arange(n)
        rope = {kind: self._cos_sin(kind, positions) for kind in self.inv_freq}

        self._observe = observe
        x = np.repeat(self.w("embed.weight")[tokens][:, None, :], hc, axis=1)  # [n, hc, H]
        for i in range(self.n_layer):
            p = f"layers.{i}."
            post, comb, collapsed = self._hyper_connection(x, p + "hc_attn_")
            attn = self._attention(self._rmsnorm(collapsed, p + "attn_norm.weight"), p + "attn.", i, rope)
            x = self._hc_merge(x, post, comb, attn)
            post, comb, collapsed = self._hyper_connection(x, p + "hc_ffn_")
            ffn = self._moe(self._rmsnorm(collapsed, p + "ffn_norm.weight"), p + "ffn.", i, tokens)
            x = self._hc_merge(x, post, comb, ffn)
            if on_block is not None:
                on_block(i, x)
        h = self._rmsnorm(self._hyper_head(x), "norm.weight")
        return self._proj(h, "head.weight")

    def mtp_logits(self, hidden: np.ndarray, tokens: np.ndarray,
                   on_streams: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """float64 logits [n, vocab] of the MTP block at positions 0..n-1 (module docstring) from `hidden` [n, hc_mult
        x hidden], the target's last-layer streams of each position's predecessor; `on_streams` sees the block's
        output streams [n, hc_mult, hidden] (what a next draft step takes)."""
        if not any(name.startswith("mtp.0.") for name in self.tensors):
            raise HFReferenceError("the checkpoint has no MTP block (mtp.0.*)")
        return _Mtp64(self).logits(np.asarray(hidden, dtype=np.float64), np.asarray(tokens, dtype=np.int64),
                                   on_streams)

    # ---- hyper-connections (DeepseekV4HyperConnection / DeepseekV4HyperHead) -----------------------------------
    def _hyper_connection(self, x: np.ndarray, p: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(post [n, hc], comb [n, hc, hc], collapsed [n, H]) of the streams x [n, hc, H]."""
        n, hc, _ = x.shape
        mix = (_unit_rms(x.reshape(n, -1), self.eps) @ self.w(p + "fn").T).astype(np.float64)
        pre, post, comb = _hc_weights(mix, self.w(p + "base").astype(np.float64),
                                      self.w(p + "scale").astype(np.float64), hc, self.hc_eps,
                                      self.cfg.get("hc_sinkhorn_iters", 20))
        collapsed = (pre.astype(np.float32)[:, :, None] * x).sum(axis=1, dtype=np.float32)
        return post.astype(np.float32), comb.astype(np.float32), collapsed.astype(np.float32)

    @staticmethod
    def _hc_merge(x: np.ndarray, post: np.ndarray, comb: np.ndarray, out: np.ndarray) -> np.ndarray:
        """post * block output + comb^T @ streams: stream k receives sum_j comb[j, k] * stream j."""
        return (post[:, :, None] * out[:, None, :] + np.einsum("njk,njd->nkd", comb, x)).astype(np.float32)

    def _hyper_head(self, x: np.ndarray) -> np.ndarray:
        n = x.shape[0]
        mix = (_unit_rms(x.reshape(n, -1), self.eps) @ self.w("hc_head_fn").T).astype(np.float64)
        pre = 1.0 / (1.0 + np.exp(-(mix * float(self.w("hc_head_scale")[0]) + self.w("hc_head_base")))) + self.hc_eps
        return (pre.astype(np.float32)[:, :, None] * x).sum(axis=1, dtype=np.float32)

    # ---- attention (DeepseekV4Attention) --------------------------------------------------------------------
    def _attention(self, h: np.ndarray, p: str, layer: int,
                   rope: dict[str, tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        c = self.cfg
        n = h.shape[0]
        nh, hd, ratio = c["num_attention_heads"], self.hd, self.ratios[layer]
        cos, sin = rope["main" if ratio == 0 else "compress"]
        # q_a_proj -> q_a_norm (the q residual the indexer reuses) -> q_b_proj -> per-head RMS without weight
        q_res = self._rmsnorm(self._proj(h, p + "wq_a.weight"), p + "q_norm.weight")
        q = _unit_rms(self._proj(q_res, p + "wq_b.weight").reshape(n, nh, hd), self.eps)
        q = self._rope(q, cos, sin)
        # one shared head read as both key and value (kv_proj -> kv_norm -> rope)
        kv = self._rmsnorm(self._proj(h, p + "wkv.weight"), p + "kv_norm.weight")
        kv = self._rope(kv[:, None, :], cos, sin)[:, 0]
        rows = np.arange(n)
        window = c["sliding_window"]
        visible = (rows[None, :] <= rows[:, None]) & (rows[:, None] - rows[None, :] < window)
        bias = np.where(visible, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
        keys = kv
        if ratio:
            comp, comp_bias = self._compressed(h, q_res, p, ratio, rope)
            keys = np.concatenate([kv, comp], axis=0)
            bias = np.concatenate([bias, comp_bias], axis=1)
        scores = np.einsum("nhd,md->hnm", q, keys).astype(np.float32) * np.float32(hd ** -0.5) + bias[None]
        sinks = np.broadcast_to(self.w(p + "attn_sink")[:, None, None], (nh, n, 1))
        probs = _softmax(np.concatenate([scores, sinks], axis=-1))[..., :-1]
        out = np.einsum("hnm,md->nhd", probs, keys).astype(np.float32)
        out = self._rope(out, cos, -sin)  # undo the rotation the values carried
        # grouped low-rank output: each group's heads -> o_lora_rank, then one mix to hidden
        g, ol = c["o_groups"], c["o_lora_rank"]
        grouped = out.reshape(n, g, nh * hd // g)
        name = p + "wo_a.weight"
        if self._observe is not None:
            self._observe(name, grouped.reshape(n, -1))
        wa = self.w(name).reshape(g, ol, nh * hd // g)
        mid = np.einsum("ngd,god->ngo", grouped, wa).astype(np.float32).reshape(n, -1)
        return self._proj(mid, p + "wo_b.weight")

    def _pool(self, h: np.ndarray, p: str, ratio: int, width: int, overlap: bool) -> np.ndarray:
        """Compressed entries [n // ratio, width] of one compressor (`p` = its tensor prefix): per channel, a softmax
        over the window of gate + ape weights the window's kv rows; RMS norm; rope at position w * ratio.

        overlap (CSA): the projections are 2*width wide; entry w pools window w's second half together with window
        w-1's first half (2*ratio rows), window -1 being empty (zero kv, -inf gate)."""
        n = h.shape[0]
        windows = n // ratio
        if windows == 0:
            return np.zeros((0, width), dtype=np.float32)
        used = windows * ratio
        kv = self._proj(h, p + "wkv.weight")[:used].reshape(windows, ratio, -1)
        gate = self._proj(h, p + "wgate.weight")[:used].reshape(windows, ratio, -1)
        gate = (gate + self.w(p + "ape")).astype(np.float32)  # ape: the per-slot position_bias
        if overlap:
            rows_kv = np.zeros((windows, 2 * ratio, width), dtype=np.float32)
            rows_gate = np.full((windows, 2 * ratio, width), -np.inf, dtype=np.float32)
            rows_kv[:, ratio:], rows_gate[:, ratio:] = kv[..., width:], gate[..., width:]
            rows_kv[1:, :ratio], rows_gate[1:, :ratio] = kv[:-1, :, :width], gate[:-1, :, :width]
            kv, gate = rows_kv, rows_gate
        pooled = (kv * _softmax(gate, axis=1)).sum(axis=1, dtype=np.float32)
        pooled = self._rmsnorm(pooled, p + "norm.weight")
        cos, sin = self._cos_sin("compress", np.arange(windows) * ratio)
        return self._rope(pooled[:, None, :], cos, sin)[:, 0]

    def _compressed(self, h: np.ndarray, q_res: np.ndarray, p: str, ratio: int,
                    rope: dict[str, tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """Compressed keys [T, hd] and their additive bias [n, T] (causality, and for CSA the indexer's choice)."""
        n = h.shape[0]
        csa = ratio == 4
        comp = self._pool(h, p + "compressor.", ratio, self.hd, csa)
        T = comp.shape[0]
        threshold = (np.arange(n) + 1) // ratio  # query t sees entry w iff w < (t + 1) // ratio
        causal = np.arange(T)[None, :] < threshold[:, None]
        if csa and T:
            causal &= self._indexer_selection(h, q_res, p + "indexer.", ratio, rope, causal)
        return comp, np.where(causal, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)

    def _indexer_selection(self, h: np.ndarray, q_res: np.ndarray, p: str, ratio: int,
                           rope: dict[str, tuple[np.ndarray, np.ndarray]], causal: np.ndarray) -> np.ndarray:
        """Lightning indexer (DeepseekV4Indexer): [n, T] mask of the top index_topk visible entries per query by
        sum_h (w_h / sqrt(n_heads)) * ReLU(q_h . k) / sqrt(index_head_dim)."""
        c = self.cfg
        n = h.shape[0]
        ih, idim = c["index_n_heads"], c["index_head_dim"]
        keys = self._pool(h, p + "compressor.", ratio, idim, True)  # [T, idim]
        cos, sin = rope["compress"]
        q = self._rope(self._proj(q_res, p + "wq_b.weight").reshape(n, ih, idim), cos, sin)
        dots = np.maximum(np.einsum("nhd,td->nht", q, keys).astype(np.float32), 0) * np.float32(idim ** -0.5)
        weights = self._proj(h, p + "weights_proj.weight") * np.float32(ih ** -0.5)
        score = (dots * weights[:, :, None]).sum(axis=1, dtype=np.float32)
        score = np.where(causal, score, -np.inf)
        k = min(c["index_topk"], keys.shape[0])
        chosen = np.zeros_like(causal)
        for t in range(n):
            chosen[t, torch_topk(score[t], k)] = True
        return chosen & causal

    # ---- MoE (DeepseekV4SparseMoeBlock) ---------------------------------------------------------------------
    def _swiglu(self, h: np.ndarray, p: str) -> np.ndarray:
        gate = np.minimum(self._proj(h, p + "w1.weight"), np.float32(self.limit))
        up = np.clip(self._proj(h, p + "w3.weight"), np.float32(-self.limit), np.float32(self.limit))
        return self._proj((_silu(gate) * up).astype(np.float32), p + "w2.weight")

    def _moe(self, h: np.ndarray, p: str, layer: int, tokens: np.ndarray) -> np.ndarray:
        c = self.cfg
        logits = self._proj(h, p + "gate.weight").astype(np.float64)
        soft = np.where(logits > SOFTPLUS_THRESHOLD, logits,
                        np.log1p(np.exp(np.minimum(logits, SOFTPLUS_THRESHOLD))))
        scores = np.sqrt(soft).astype(np.float32)
        k = c["num_experts_per_tok"]
        if layer < self.n_hash:
            chosen = self.tensors[p + "gate.tid2eid"].raw().astype(np.int64)[tokens]
        else:
            choice = scores + self.w(p + "gate.bias")[None, :]
            chosen = np.array([torch_topk(row, k) for row in choice], dtype=np.int64).reshape(len(h), k)
        weights = np.take_along_axis(scores, chosen, axis=-1)
        weights = weights / (weights.sum(-1, keepdims=True) + np.float32(1e-20))
        weights = (weights * np.float32(c["routed_scaling_factor"])).astype(np.float32)
        out = np.zeros_like(h)
        for e in range(c["n_routed_experts"]):
            tok, slot = np.nonzero(chosen == e)
            if tok.size:
                # np.add.at, not out[tok] +=: a token may pick the same expert twice (tid2eid rows can repeat
                # an id) and transformers' index_add then counts it twice
                np.add.at(out, tok, self._swiglu(h[tok], f"{p}experts.{e}.") * weights[tok, slot][:, None])
        return (out + self._swiglu(h, p + "shared_experts.")).astype(np.float32)


class _Mtp64:
    """DeepSeek-V4's MTP block in float64 over a reference's checkpoint tensors (DeepseekV4Reference.mtp_logits)."""

    def __init__(self, ref: DeepseekV4Reference, prefix: str = "mtp.0."):
        self.ref, self.p, self.c = ref, prefix, ref.cfg

    def w(self, name: str) -> np.ndarray:
        return self.ref.w(name).astype(np.float64)

    def lin(self, x: np.ndarray, name: str) -> np.ndarray:
        return x @ self.w(name).T

    def rms(self, x: np.ndarray, weight: str | None = None) -> np.ndarray:
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.ref.eps)
        return y if weight is None else y * self.w(weight)

    @staticmethod
    def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Interleaved pairs of the trailing 2 x len(cos) channels of x [n, heads, d]."""
        r = 2 * cos.shape[-1]
        cos, sin = cos[:, None, :], sin[:, None, :]
        out = x.copy()
        even, odd = x[..., -r::2], x[..., -r + 1 :: 2]
        out[..., -r::2] = even * cos - odd * sin
        out[..., -r + 1 :: 2] = odd * cos + even * sin
        return out

    def logits(self, hidden: np.ndarray, tokens: np.ndarray,
               on_streams: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        p, c = self.p, self.c
        n, hc = len(tokens), c["hc_mult"]
        e = self.lin(self.rms(self.w("embed.weight")[tokens], p + "enorm.weight"), p + "e_proj.weight")
        h = self.lin(self.rms(hidden.reshape(n, hc, -1), p + "hnorm.weight"), p + "h_proj.weight")
        x = e[:, None, :] + h
        pre, post, comb = self.hyper(x, p + "hc_attn_")
        x = post[:, :, None] * self.attention(self.rms((pre[:, :, None] * x).sum(1), p + "attn_norm.weight")) \
            [:, None, :] + np.einsum("njk,njd->nkd", comb, x)
        pre, post, comb = self.hyper(x, p + "hc_ffn_")
        x = post[:, :, None] * self.moe(self.rms((pre[:, :, None] * x).sum(1), p + "ffn_norm.weight"))[:, None, :] \
            + np.einsum("njk,njd->nkd", comb, x)
        if on_streams is not None:
            on_streams(x)
        mix = self.lin(self.rms(x.reshape(n, -1)), p + "hc_head_fn")
        pre = 1.0 / (1.0 + np.exp(-(mix * self.w(p + "hc_head_scale")[0] + self.w(p + "hc_head_base")))) \
            + self.ref.hc_eps
        return self.lin(self.rms((pre[:, :, None] * x).sum(1), p + "norm.weight"), "head.weight")

    def hyper(self, x: np.ndarray, p: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pre [n, hc], post [n, hc], comb [n, hc, hc]) of the streams x [n, hc, H] (DeepseekV4HyperConnection)."""
        n, hc, _ = x.shape
        mix = self.lin(self.rms(x.reshape(n, -1)), p + "fn")
        return _hc_weights(mix, self.w(p + "base"), self.w(p + "scale"), hc, self.ref.hc_eps,
                           self.c.get("hc_sinkhorn_iters", 20))

    def attention(self, h: np.ndarray) -> np.ndarray:
        """The block's sliding-window attention (compress ratio 0) over positions 0..n-1, one shared key = value
        head, per-head sinks, the grouped low-rank output."""
        p, c = self.p + "attn.", self.c
        n, nh, hd = len(h), c["num_attention_heads"], self.ref.hd
        cos, sin = (t.astype(np.float64) for t in self.ref._cos_sin("main", np.arange(n)))
        q_res = self.rms(self.lin(h, p + "wq_a.weight"), p + "q_norm.weight")
        q = self.rope(self.rms(self.lin(q_res, p + "wq_b.weight").reshape(n, nh, hd)), cos, sin)
        kv = self.rope(self.rms(self.lin(h, p + "wkv.weight"), p + "kv_norm.weight")[:, None, :], cos, sin)[:, 0]
        rows = np.arange(n)
        visible = (rows[None, :] <= rows[:, None]) & (rows[:, None] - rows[None, :] < c["sliding_window"])
        scores = np.einsum("nhd,md->hnm", q, kv) * hd ** -0.5 + np.where(visible, 0.0, -np.inf)[None]
        sinks = np.broadcast_to(self.w(p + "attn_sink")[:, None, None], (nh, n, 1))
        z = np.concatenate([scores, sinks], axis=-1)
        z = np.exp(z - z.max(-1, keepdims=True))
        probs = (z / z.sum(-1, keepdims=True))[..., :-1]
        out = self.rope(np.einsum("hnm,md->nhd", probs, kv), cos, -sin)
        g, ol = c["o_groups"], c["o_lora_rank"]
        wa = self.w(p + "wo_a.weight").reshape(g, ol, nh * hd // g)
        mid = np.einsum("ngd,god->ngo", out.reshape(n, g, -1), wa).reshape(n, -1)
        return self.lin(mid, p + "wo_b.weight")

    def swiglu(self, h: np.ndarray, p: str) -> np.ndarray:
        limit = self.ref.limit
        gate = np.minimum(self.lin(h, p + "w1.weight"), limit)
        up = np.clip(self.lin(h, p + "w3.weight"), -limit, limit)
        return self.lin(gate / (1.0 + np.exp(-gate)) * up, p + "w2.weight")

    def moe(self, h: np.ndarray) -> np.ndarray:
        """sqrt(softplus) scores, top-k of score + bias, renormalised times routed_scaling_factor; the shared
        expert added."""
        p, c = self.p + "ffn.", self.c
        logits = self.lin(h, p + "gate.weight")
        scores = np.sqrt(np.where(logits > SOFTPLUS_THRESHOLD, logits,
                                  np.log1p(np.exp(np.minimum(logits, SOFTPLUS_THRESHOLD)))))
        choice = scores + self.w(p + "gate.bias")[None, :]
        chosen = np.array([torch_topk(row, c["num_experts_per_tok"]) for row in choice], dtype=np.int64)
        weights = np.take_along_axis(scores, chosen, axis=-1)
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20) * c["routed_scaling_factor"]
        out = np.zeros_like(h)
        for t in range(len(h)):
            for e, wt in zip(chosen[t], weights[t]):
                out[t] += wt * self.swiglu(h[t : t + 1], f"{p}experts.{e}.")[0]
        return out + self.swiglu(h, p + "shared_experts.")
