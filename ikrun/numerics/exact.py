"""The exact arithmetic, and the interface every arithmetic implements.

`Numerics` is what an architecture and its modules compute with: projections (dense, per-head, routed experts),
norms, rope, attention, activations, routing, the hyper-connection and convolution sums, and how the KV cache
holds keys and values. This class computes them exactly: float32 on exactly decoded weights, in transformers'
float order where an engine's differs, so a KL-divergence measures the stored weights alone. Another arithmetic
(ikrun/numerics/ik: ik's CPU backend) is a subclass that overrides what it computes differently; an architecture
never asks which one it runs on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ikquant.formats.cache_rows import cache_round_trip
from ikrun.kvcache import KvCache, cache_holds
from ikrun.ops.activations import swiglu
from ikrun.ops.attention import causal_attention, shared_kv_attention
from ikrun.ops.conv import causal_conv_residual, causal_conv_silu
from ikrun.ops.delta_net import decay_and_beta, delta_rule_chunked, gated_rms_norm
from ikrun.ops.fgemm import GatheredRows, expert_matmul, experts_matmul
from ikrun.ops.hyperconn import hc_combine, hc_post, hc_pre
from ikrun.ops.indexer import indexer_scores
from ikrun.ops.mla import latent_attention, materialized_attention
from ikrun.ops.moe import (
    GATING_SIGMOID,
    ExpertFetch,
    ExpertGlu,
    ExpertMats,
    RoutedExperts,
    group_limited_top_k,
    moe_experts,
    route,
)
from ikrun.ops.norm import rms_norm
from ikrun.ops.rope import apply_rope

if TYPE_CHECKING:
    from ikquant.types import GGMLType
    from ikrun.options import RuntimeOptions
    from ikrun.weights import WeightStore

#: rows of a weight decoded at a time by a matmul whose weight does not fit the cache (the output head of a big
#: vocabulary under a small budget); such a matmul may differ from the untiled one in the last bits
TILE_BYTES = 64 << 20
#: the weight-cache kinds of the attn_k_b / attn_v_b derived from a file's attn_kv_b (ikrun/weights.py)
DERIVED_K_B, DERIVED_V_B, DERIVED_KV_B = -20, -21, -22
#: weight types ik keeps when it derives attn_k_b from attn_kv_b (any other, quantized, becomes Q8_0)
UNQUANTIZED = ("F32", "F16", "BF16")


def derived_k_b(kv_b: np.ndarray, type_name: str, n_head: int, n_nope: int) -> np.ndarray:
    """attn_k_b [H, C, D] as ik derives it at load from a file's attn_kv_b [H * (D + V), C] (of type `type_name`)
    alone (llm_prepare_mla): each head's nope rows transposed, stored as Q8_0 when attn_kv_b is quantized, else in
    its own type (which a transposition does not round). ik's load makes the Q8_0 with ggml_cast, its cache
    writer's row quantizer (ikquant/formats/cache_rows.py), not llama-quantize's."""
    w_kb = np.ascontiguousarray(kv_b.reshape(n_head, -1, kv_b.shape[1])[:, :n_nope].transpose(0, 2, 1))
    if type_name in UNQUANTIZED:
        return w_kb
    return cache_round_trip("Q8_0", w_kb.reshape(-1, n_nope)).reshape(w_kb.shape)


def derived_kv_b(k_b: np.ndarray, v_b: np.ndarray, types: tuple[str, str], n_head: int) -> np.ndarray:
    """attn_kv_b [H * (D + V), C] as ik derives it at load from a file's attn_k_b [H, C, D] and attn_v_b [H, V, C]
    (of types `types`) for its prefill form (llm_compute_wkv_b): per head the transposed k_b rows, then the v_b
    rows, stored as F16 or BF16 when both are, else as Q8_0 (an F32 pair too), with ggml_cast (ik's cache writer's
    rounding, as derived_k_b)."""
    n_lat = v_b.shape[-1]
    heads = np.concatenate([k_b.reshape(n_head, n_lat, -1).transpose(0, 2, 1), v_b.reshape(n_head, -1, n_lat)], axis=1)
    kv_b = np.ascontiguousarray(heads.reshape(-1, n_lat))
    kept = types[0] if types[0] == types[1] and types[0] in ("F16", "BF16") else "Q8_0"
    return cache_round_trip(kept, kv_b)


def derived_v_b(kv_b: np.ndarray, n_head: int, n_nope: int) -> np.ndarray:
    """attn_v_b [H, V, C] as ik derives it from attn_kv_b alone: each head's value rows, as they are."""
    return np.ascontiguousarray(kv_b.reshape(n_head, -1, kv_b.shape[1])[:, n_nope:])


class Numerics:
    """The exact arithmetic (the module docstring); the base of every other."""

    #: the --numerics name
    name = "exact"
    #: F16 / BF16 dense weights multiplied by the expert kernel (ops/fgemm.py: one FMA chain per output, the bits
    #: independent of batching and tiling), from the file's bits in a streamed pass (_half_product): on the 1.1B
    #: Qwen3 F16 file (4 x 256, 2 threads) 13.1-13.4 s in 336 MiB against 15.4-16.1 s in 491 MiB decoded for
    #: OpenBLAS, whose sgemm ran the 256-row products at 179-183 GFLOP/s where the kernel reads the bits at 193-203
    multiplies_halves = True

    def __init__(self, weights: WeightStore, options: RuntimeOptions):
        self.weights = weights
        self.options = options
        #: matmuls that had to decode their weight in tiles (it did not fit the cache)
        self.tiled: set[str] = set()

    # ---- what a file may hold ---------------------------------------------------------------------------------
    def kv_cache(self, requested: KvCache) -> KvCache:
        """The KV caches a run keeps when `requested` was asked for (ikrun/kvcache.py)."""
        return requested

    def yarn_truncates(self, requested: bool) -> bool:
        """Whether YaRN's correction range is rounded out to whole dims: as the file asks (transformers' model;
        `requested` False keeps it fractional)."""
        return requested

    def check_weights(self) -> list[str]:
        """Why this arithmetic cannot run the loaded weights (empty: it can); checked before any compute."""
        return []

    def check_type(self, gtype: GGMLType) -> str | None:
        """Why a weight of `gtype` (a hot swap brings it in) cannot be multiplied here, None when it can."""
        return None

    # ---- what a model may ask of it (a refusal's why, None where this arithmetic computes it) -----------------
    def check_full_attention_interval(self, arch: str, interval: int) -> str | None:
        """Why a hybrid `arch` model with full attention every `interval`-th layer cannot run here."""
        return None

    def check_delta_net(self, head_k: int, head_v: int) -> str | None:
        """Why a gated delta-net with these key and value head dims cannot run here."""
        return None

    def check_key_cache(self, arch: str, cache_type: str) -> str | None:
        """Why an `arch` model's attention cannot read a K cache of `cache_type` (ik's name, given with -ctk) here;
        the exact arithmetic reads every type's exact decoding (ikrun/kvcache.check_cache checks the model's shapes)."""
        return None

    def check_value_cache(self, arch: str, kv: KvCache, head_dim: int) -> str | None:
        """Why an `arch` model's attention with heads of `head_dim` cannot read the V cache `kv.v` (given with -ctv,
        not F16) here; the exact arithmetic reads every type's exact decoding."""
        return None

    def check_flash_attention(self, arch: str, kv: KvCache, head_dim: int) -> str | None:
        """Why ik's flash-attention graph (--flash-attn on) of an `arch` model with heads of `head_dim` over the caches
        `kv` is not reproduced here (RuntimeOptions.check refuses the option in the exact arithmetic, where both graphs
        are one softmax)."""
        return None

    def attention_graph(self, arch: str, kv: KvCache, head_dim: int) -> str | None:
        """Which of ik's attention graphs (flash attention "on" or "off", --flash-attn) a grouped-query attention of
        an `arch` model with heads of `head_dim` over the caches `kv` computes; None here: the exact arithmetic computes the one softmax both
        graphs compute."""
        return None

    def reproduced_defect(self, arch: str, kv: KvCache, head_dim: int) -> str | None:
        """An error of ik's that the attention of an `arch` model with heads of `head_dim` over the caches `kv`
        reproduces here, for the run's report to name (its figures are ik's, not the model's); None here."""
        return None

    def fused_top_k_tie(self, semantic: int) -> int:
        """The order among equal scores (ops/indexer.py TIE_*) of a DSA indexer's top-k that ik computes in its
        fused op (DeepSeek-V4's); here the model's own, `semantic` (its reference's)."""
        return semantic

    def nextn_own_tables(self, arch: str) -> bool:
        """Whether an `arch` NextN head reads its own embedding and output tables where it carries them
        (transformers' model does; an engine's loader may ignore them)."""
        return True

    def nextn_sparse_attention(self) -> bool:
        """Whether a DSA model's NextN head runs its attention sparse through its own indexer, as the model defines
        it (an engine may run the head dense)."""
        return True

    # ---- element-wise -----------------------------------------------------------------------------------------
    def norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """RMSNorm over the last axis, times `weight`."""
        return rms_norm(x, weight, eps)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, neox: bool) -> None:
        """Rotate the first n_rot dims of every head of x [n, heads, d] in place (NEOX or NORM pairing)."""
        apply_rope(x, cos, sin, n_rot, neox)

    def swiglu(self, gate: np.ndarray, up: np.ndarray, limit: float = np.inf) -> np.ndarray:
        """silu(gate) * up, both clamped at a finite `limit`."""
        return swiglu(gate, up, limit)

    def route(self, logits: np.ndarray, bias: np.ndarray | None, n_used: int, gating: int, norm: bool,
              scale: float, chosen: np.ndarray | None = None,
              groups: tuple[int, int] = (1, 1)) -> tuple[np.ndarray, np.ndarray]:
        """(chosen experts, their weights) from router logits (ops/moe.route); `groups` (n_group, topk_group)
        limits a sigmoid top-k to the best groups as transformers does (ops/moe.group_limited_top_k)."""
        if chosen is None and groups[0] > 1 and gating == GATING_SIGMOID:
            chosen = group_limited_top_k(logits, bias, n_used, *groups)
        return route(logits, bias, n_used, gating, norm, scale, chosen)

    def hc_pre(self, mixes: np.ndarray, alpha: np.ndarray, beta: np.ndarray, n_stream: int, iters: int,
               eps: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A hyper-connection's (pre, post, mix) weights from its mixes (ops/hyperconn.hc_pre)."""
        return hc_pre(mixes, alpha, beta, n_stream, iters, eps)

    def hc_combine(self, streams: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """The streams weighted and summed into a sub-layer's input."""
        return hc_combine(streams, weights)

    def hc_post(self, y: np.ndarray, post: np.ndarray, streams: np.ndarray, mix: np.ndarray) -> np.ndarray:
        """A sub-layer's output scattered back over the mixed streams."""
        return hc_post(y, post, streams, mix)

    def conv(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x plus its causal short convolution by taps w (openPangu's MoME convolutions)."""
        return causal_conv_residual(x, w)

    def moe_residual(self, x: np.ndarray, routed: np.ndarray, shared: np.ndarray | None) -> np.ndarray:
        """The residual stream after a MoE FFN: x + (routed experts + shared experts), transformers' order."""
        return x + (routed if shared is None else routed + shared)

    def sigmoid(self, x: np.ndarray) -> np.ndarray:
        """1 / (1 + exp(-x)) in float32 (the output gates of gated attention and of a shared expert)."""
        return (np.float32(1.0) / (np.float32(1.0) + np.exp(-np.asarray(x, dtype=np.float32)))).astype(np.float32)

    # ---- the gated delta-net (ops/delta_net.py) -------------------------------------------------------------
    def conv_silu(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """SiLU of the causal short convolution of x [T, C] by taps w [C, K] (the delta-net's q/k/v)."""
        return causal_conv_silu(x, w)

    def decay_and_beta(self, a: np.ndarray, b: np.ndarray, ssm_a: np.ndarray,
                       dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The delta rule's log-decay g and write strength beta [T, H] from the a / b projections."""
        return decay_and_beta(a, b, ssm_a, dt_bias)

    def delta_rule(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                   k_head: np.ndarray, eps: float, state: np.ndarray | None = None) -> np.ndarray:
        """The gated delta rule [T, Hv, dv] (transformers' chunked prompt form, whose q/k L2 norm has its own fixed
        epsilon; an engine's may use the model's rms `eps`) from zero, or from a continued sequence's `state`
        [Hv, dk, dv], which it advances in place."""
        return delta_rule_chunked(q, k, v, g, beta, k_head, state=state)

    def gated_norm(self, x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """RMSNorm of x times weight, times SiLU(z) (the delta-net's output norm)."""
        return gated_rms_norm(x, z, weight, eps)

    def kv_store(self, x: np.ndarray, cache_type: str, hadamard_block: int = 0, value: bool = False) -> np.ndarray:
        """Rows x [..., width] of keys or (`value`) values as a cache of `cache_type` (ik's name) holds them, written
        through ik's Hadamard transform over blocks of `hadamard_block` values where given (ikrun/kvcache.py)."""
        return cache_holds(x, cache_type, hadamard_block)

    def latent_cache_problem(self, kv: KvCache, path: str, kv_b: tuple[str, str] | None,
                             heads: tuple[int, int] | None = None) -> str | None:
        """Why a run over the MLA latent cache `kv.k` in the form `path` ("prefill" / "decode"; `kv_b`: a block's
        attn_kv_b and its type, "absent" where the file has none; `heads`: the absorbed form's key and value widths,
        the whole latent cache row and its latent part) is not computed as asked, or None: here every cache type is
        its exact round trip."""
        return None

    def indexer_scores(self, q: np.ndarray, k: np.ndarray, w: np.ndarray, cache_type: str,
                       q0: int = 0) -> np.ndarray:
        """The DSA indexer's causal scores [n, keys] (ops/indexer.indexer_scores) of queries q [n, heads, d], the
        first at position q0, against keys k [keys, d] as an indexer cache of `cache_type` holds them, head weights
        w [n, heads]."""
        return indexer_scores(q, cache_holds(k, cache_type), w, q0)

    # ---- attention --------------------------------------------------------------------------------------------
    def causal_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, head_dim: int, *, window: int = 0,
                         sinks: np.ndarray | None = None, kv: KvCache | None = None,
                         flash: bool = False) -> np.ndarray:
        """Causal grouped-query attention scaled by 1 / sqrt(head_dim): q [n, H, d], k/v [keys, H_kv, d] (the last
        n keys are the queries' own positions, as kv_store returned them for the caches `kv`) -> [n, H, d_v]; a
        sliding `window` (keys seen, the own included) and per-head `sinks` logits (ops/attention.causal_attention).
        Here k and v are what the caches hold, decoded, so `kv` changes nothing, and `flash` (ik's flash-attention
        graph, attention_graph "on") is the same softmax."""
        return causal_attention(q, k, v, 1.0 / np.sqrt(head_dim), window=window, sinks=sinks)

    def shared_kv_attention(self, q: np.ndarray, kv: np.ndarray, scale: float, *, window: int = 0,
                            sinks: np.ndarray | None = None, comp: np.ndarray | None = None,
                            comp_keep: np.ndarray | None = None, start: int = 0, ratio: int = 0, top_k: int = 0,
                            flash: bool = False, cache: KvCache | None = None) -> np.ndarray:
        """Attention over one shared key = value head (DeepSeek-V4: ops/attention.shared_kv_attention): the raw rows
        `kv` of a `window`, the compressed entries `comp` seen where `comp_keep` says, `sinks`. The layer's compress
        `ratio` (0 none, 4 CSA choosing `top_k`, 128 HCA) and `flash` (ik's flash-attention graph) say which of ik's
        kernels would run, and the rows are what the key `cache` holds (kv_store): here they change nothing."""
        return shared_kv_attention(q, kv, scale, window=window, sinks=sinks, comp=comp, comp_keep=comp_keep,
                                   start=start)

    def latent_attention(self, b: str, q_rope: np.ndarray, q_nope: np.ndarray, cache: np.ndarray, scale: float,
                         kv: KvCache, *, sinks: np.ndarray | None = None, window: int = 0,
                         keep: np.ndarray | None = None,
                         on_latent: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """Multi-head latent attention in the absorbed form through block `b`'s attn_k_b / attn_v_b (ops/mla.py):
        q_rope [n, H, R] (roped), q_nope [n, H, D], cache rows [n, R + C] ([k_rope | latent]) as kv_store returned
        them for the caches `kv` (here decoded, so `kv` changes nothing); `sinks` [S, R + C] seen by every query, a
        `window`, a `keep` mask [n, cache rows]; `on_latent` sees the heads' latents [H, n, C] as they enter
        attn_v_b. Returns [n, H, V]."""
        n, n_head, _ = q_rope.shape
        n_lat = cache.shape[1] - q_rope.shape[2]
        kb, vb = b + "attn_k_b.weight", b + "attn_v_b.weight"
        if self.weights.has(kb):
            head_v = self.weights.info(vb).n_elements // (n_head * n_lat)
            w_kb = self.matmul_weight(kb, n, n_lat).reshape(n_head, n_lat, q_nope.shape[2])
            w_vb = self.matmul_weight(vb, n, head_v).reshape(n_head, head_v, n_lat)
        else:
            kvb, d = b + "attn_kv_b.weight", q_nope.shape[2]
            type_name = self.weights.encoding(kvb).type.name
            w_kb = self.weights.derived(kvb, lambda _raw, w: derived_k_b(w, type_name, n_head, d), DERIVED_K_B)
            w_vb = self.weights.derived(kvb, lambda _raw, w: derived_v_b(w, n_head, d), DERIVED_V_B)
        return latent_attention(q_rope, self.activations(q_nope, kb), w_kb, cache, w_vb, scale, sinks=sinks,
                                window=window, keep=keep, ik_avx512_sinks=self.options.ik_sink_overread,
                                on_latent=on_latent, vb_input=lambda lat: self.activations(lat, vb))

    def materialized_attention(self, b: str, q_rope: np.ndarray, q_nope: np.ndarray, cache: np.ndarray,
                               scale: float, kv: KvCache, *, keep: np.ndarray | None = None) -> np.ndarray:
        """Multi-head latent attention in ik's prefill form through block `b`'s attn_kv_b (ops/mla.py): shapes as
        latent_attention's; the materialised keys and values are rounded as ik casts them to the latent cache's
        type `kv.k` (kv_store)."""
        kvb, kb, vb = b + "attn_kv_b.weight", b + "attn_k_b.weight", b + "attn_v_b.weight"
        if self.weights.has(kvb):
            w_kvb = self.matmul_weight(kvb, cache.shape[0])
        else:
            types = (self.weights.encoding(kb).type.name, self.weights.encoding(vb).type.name)
            w_kvb = self.weights.derived(kb, lambda _raw, w: derived_kv_b(w, self.weights.decode(vb), types,
                                                                          q_rope.shape[1]), DERIVED_KV_B, (vb,))
        return materialized_attention(q_rope, q_nope, cache, w_kvb, scale, keep=keep,
                                      store=lambda x: self.kv_store(x, kv.k, kv.k_hadamard))

    # ---- matmuls ----------------------------------------------------------------------------------------------
    def activations(self, x: np.ndarray, weight_name: str) -> np.ndarray:
        """x as the matmul with `weight_name` consumes it."""
        return x

    def project(self, x: np.ndarray, weight_name: str, shared: dict[str, object] | None = None,
                fused: bool = False) -> np.ndarray:
        """x @ W^T for the 2-D weight `weight_name`: an F16 / BF16 weight in the expert kernel (`multiplies_halves`,
        _half_product); else decoded whole when it fits the cache, else a tile of rows at a time (the output head of
        a large vocabulary under a small budget). `shared` carries what projections of the same input may
        reuse (Context.linears); `fused`: the gate/up pair of a SwiGLU FFN."""
        w = self.weights
        if self.multiplies_halves and x.ndim == 2 and w.is_half(weight_name):
            return self._half_product(x if shared is None else self._gathered(x, shared), weight_name)
        hit = w.cached_array(weight_name)
        if hit is not None:
            return x @ hit.T
        if w.fits(w.decoded_bytes(weight_name)):
            return x @ w.decode(weight_name).T
        self.tiled.add(weight_name)
        n_rows, n_cols = w.info(weight_name).shape
        step = max(1, TILE_BYTES // (4 * n_cols))
        y = np.empty((x.shape[0], n_rows), dtype=np.float32)
        for r0 in range(0, n_rows, step):
            rows = np.arange(r0, min(n_rows, r0 + step))
            y[:, r0 : r0 + len(rows)] = x @ w.decode_rows(weight_name, rows).T
        return y

    @staticmethod
    def _gathered(x: np.ndarray, shared: dict[str, object]) -> GatheredRows:
        """x's rows as the expert kernel takes them, gathered once for the projections sharing x."""
        rows = shared.get("gathered rows")
        if not isinstance(rows, GatheredRows):
            rows = shared["gathered rows"] = GatheredRows.of(x)
        return rows

    def _half_product(self, x: np.ndarray | GatheredRows, name: str) -> np.ndarray:
        """x @ W^T for an F16 / BF16 weight in the expert kernel."""
        return self._on_halves(name, lambda w: expert_matmul(x, w))

    def _on_halves(self, name: str, product: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """product(W) for an F16 / BF16 weight the expert kernel multiplies: a layer-streamed pass (or a weight past
        the cache) hands it the file's bits, nothing decoded (the pass releases a block's pages after the block; the
        weight past the cache, its pages after the product); otherwise its cached float32 decoding (what a reload
        compares against the file, and what keeps a model running while its file is being rewritten). Both give
        the same bits: the kernel widens the bits exactly."""
        w = self.weights
        decoded = w.cached_array(name)
        if decoded is None and not w.streaming and w.fits(w.decoded_bytes(name)):
            decoded = w.decode(name)
        if decoded is not None:
            return product(decoded)
        y = product(w.half_rows(name))
        if not w.streaming:
            w.release([name])
        return y

    def matmul_weight(self, name: str, n_act_rows: int, weight_rows: int | None = None) -> np.ndarray:
        """Weight `name` (float32, numpy order) as a matmul with `n_act_rows` activation rows multiplies it, each
        matrix of `weight_rows` rows (a per-head slice; default all rows)."""
        return self.weights.decode(name)

    def head_product(self, x: np.ndarray, name: str) -> np.ndarray:
        """x [H, n, in] times each head's equal slice of the 2-D weight `name`'s rows: [H, n, rows / H]."""
        return self.sliced_product(x, name)

    def sliced_product(self, x: np.ndarray, name: str) -> np.ndarray:
        """head_product as float32 products of the slices matmul_weight gives against x as activations gives it
        (in any arithmetic: IkNumerics.head_product's fallback)."""
        n_head, n = x.shape[0], x.shape[1]
        rows = self.weights.info(name).shape[0] // n_head
        w = self.matmul_weight(name, n, rows).reshape(n_head, rows, -1)
        return np.matmul(self.activations(x, name), w.transpose(0, 2, 1))

    def grouped_product(self, x: np.ndarray, name: str, groups: int) -> np.ndarray:
        """x [n, groups * k]: each group of k columns times its equal slice of the 2-D weight `name`'s rows, the
        products side by side [n, rows] (DeepSeek-V4's grouped output), in the expert kernel in one call: each group
        an expert whose tokens are x's rows read at its columns (as the arithmetic rounds them) and whose results
        land in its columns of the output, so no transposed copies, and tasks the threads claim where numpy's
        batched BLAS split the work in fixed parts. The weight is its F16 / BF16 bits where the arithmetic
        multiplies halves, else as matmul_weight gives it. Under --numerics ik the bench's DeepSeek-V4-shaped file
        printed 321.0506 this way, 321.0499 through BLAS, against ik's 321.0552 (ik's float kernel per group had
        moved the test file's figures away from ik's)."""
        n = len(x)
        rows = self.weights.info(name).shape[0] // groups
        y = np.empty((n, groups * rows), np.float32)
        # group j's token t is row t groups + j of x as [n groups, k] rows, and its result that row of y's view
        at = (np.arange(groups)[:, None] + groups * np.arange(n)).reshape(-1)
        row_at = n * np.arange(groups + 1, dtype=np.int64)
        x_rows = np.ascontiguousarray(self.activations(x, name), dtype=np.float32).reshape(n * groups, -1)

        def product(w: np.ndarray) -> np.ndarray:
            return experts_matmul(x_rows, w.reshape(groups, rows, -1), at, row_at, y.reshape(n * groups, rows), at)

        if self.multiplies_halves and self.weights.is_half(name):
            self._on_halves(name, product)
        else:
            product(self.matmul_weight(name, n, rows))
        return y

    def routed_experts(self, x: np.ndarray, sel: np.ndarray, w: np.ndarray, n_expert: int, names: list[str],
                       group: int | None, glu: ExpertGlu, keep_act: bool,
                       batches: np.ndarray | None = None) -> RoutedExperts:
        """The routed SwiGLU experts of the 3-D tensors `names` (up, gate, down) on x [n, n_embd] routed by sel/w
        [n, k], `group` experts decoded at a time, `glu` their SwiGLU's form and biases (ops/moe.moe_experts);
        `batches`: each row's micro-batch in ik's run (every token's result is its own here)."""
        counts = np.bincount(sel.reshape(-1), minlength=n_expert)
        return moe_experts(x, sel, w, n_expert, self.expert_fetch(names, counts), group, glu, keep_act=keep_act,
                           done=lambda: self.weights.release(names))

    def expert_fetch(self, names: list[str], counts: np.ndarray, n_real: int | None = None) -> ExpertFetch:
        """The routed experts' matrices, decoded (and cached) one expert at a time: a whole expert tensor is never
        decoded for a batch, only the experts that receive tokens; F16/BF16 experts are handed over as their bits
        (the expert kernel widens them), never decoded; `counts`: the tokens routed to each expert id; with
        `n_real`, id e is the tensors' expert e % n_real (IkNumerics.routed_experts' virtual ids)."""

        def matrices(name: str, ids: np.ndarray) -> ExpertMats:
            real = ids if n_real is None else ids % n_real
            half = self.weights.half_experts(name, real)
            if half is not None:
                return half
            own = self.reads_file_rows(name, counts[ids])
            if own or self.multiplies_decoding(name, counts[ids]):
                panels = self.weights.panel_experts(name, real, own)
                if panels is not None:
                    return panels
            return self.convert_experts(name, real, counts[ids],
                                        self.weights.decode_experts(name, real, self.weights.keeps_experts))

        def fetch(ids: np.ndarray) -> tuple[ExpertMats, ExpertMats, ExpertMats]:
            up, gate, down = (matrices(name, ids) for name in names)
            return up, gate, down

        return fetch

    def reads_file_rows(self, name: str, counts: np.ndarray) -> bool:
        """Whether the experts of `name` with `counts` routed tokens each are multiplied from the file's rows by a
        kernel of their type's own (not from a decoding, even a cached one)."""
        return False

    def multiplies_decoding(self, name: str, counts: np.ndarray) -> bool:
        """Whether experts of `name` with `counts` routed tokens each multiply as their exact decoding (which the
        expert kernel can decode itself from the file's rows: Weights.panel_experts)."""
        return True

    def convert_experts(self, name: str, ids: np.ndarray, counts: np.ndarray, mats: np.ndarray) -> np.ndarray:
        """The decoded matrices `mats` of experts `ids` as the arithmetic multiplies them with `counts` routed
        tokens each."""
        return mats
