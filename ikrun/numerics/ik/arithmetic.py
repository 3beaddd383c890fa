"""`--numerics ik`: the arithmetic of ik's CPU backend, to get the numbers llama-perplexity prints.

Activations are rounded to the format each weight type pairs with and multiplied in ik's integer kernels' float
orders (formats.py, qgemm.py) or its float kernels' (ikgemm.py); norms, rope, attention, the SwiGLU's exponential,
the experts' weighting, hyper-connections and convolutions follow ik's float order (the fused multiply-adds its
build makes); the KV cache is ik's f16 one. Which kernel ik takes is its choice per matmul: by the activation rows
and, for a plain matmul, the rows each of its threads gets (`--ik-threads`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ikquant.formats.cache_rows import cache_row_bytes
from ikquant.types import type_by_name
from ikrun.errors import ModelError
from ikrun.kvcache import FLOAT_CACHES, KvCache, blockwise_hadamard, cache_holds, ggml_name
from ikrun.numerics.exact import Numerics
from ikrun.numerics.ik.attention import ik_causal_attention, ik_latent_attention, ik_sink_latent_attention
from ikrun.numerics.ik.delta_net import (
    FUSED_HEAD_DIMS,
    ik_decay_and_beta,
    ik_delta_rule,
    ik_sigmoid_array,
)
from ikrun.numerics.ik.flash_attention import generic_flash_attention
from ikrun.numerics.ik.formats import (
    IK_FLOAT_TYPES,
    IK_KERNELS,
    IkKernel,
    ToInts,
    activation_format,
    ik_kernel,
    integer_rows,
    key_cache_kernel,
    round_activations,
)
from ikrun.numerics.ik.ikgemm import AVX2_LANES, LANES, ik_float_matmul, takes_whole
from ikrun.numerics.ik.iqk_flash_attention import (
    NO_SCORES,
    bf16_k_step_for,
    iqk_flash_attention,
    iqk_flash_attention_parts,
    k_step_for,
    kernel_row_calls,
)
from ikrun.numerics.ik.key_cache import (
    IQK_FA_KEY_BIAS,
    SINGLE_ROW_BLOCKS,
    iq4_nl_misread_key_products,
    iqk_fa_key_products,
    key_cells,
    key_products,
    q4_0_misread_key_products,
    q8_kv_key_products,
    single_row_key_products,
)
from ikrun.numerics.ik.mla_weights import HeadSource, derived_k_b_source, derived_k_b_type, derived_v_b_source
from ikrun.numerics.ik.native import NativeRows, native_matmul, native_types
from ikrun.numerics.ik.qgemm import IntRows, PackedHeads, PackedInts, pack, qmatmul, row_slice
from ikrun.numerics.ik.shared_kv_flash import NO_SCORES as NO_SHARED_SCORES
from ikrun.numerics.ik.shared_kv_flash import (
    generic_bf16_products,
    ik_gathers,
    shared_kv_flash_attention,
    sink_heads,
    visible_keys,
)
from ikrun.ops.activations import swiglu
from ikrun.ops.conv import causal_conv_residual, causal_conv_silu
from ikrun.ops.hyperconn import hc_combine, hc_post, hc_pre
from ikrun.ops.indexer import TIE_PARTIAL_SORT, scores_from_products
from ikrun.ops.moe import ExpertGlu, ExpertProduct, RoutedExperts, group_by_expert, moe_experts, route
from ikrun.ops.norm import rms_norm
from ikrun.ops.rope import apply_rope
from ikrun.options import MLA_PREFILL_MIN_TOKENS
from ikrun.weights import CONVERTED, DERIVED, FILE_ROWS, HEADS, INTEGER_TYPES, PACKED

if TYPE_CHECKING:
    from ikquant.types import GGMLType


#: architectures whose ik graph hard-codes the full attention layers of a hybrid, whatever the file says
FIXED_FULL_ATTENTION_INTERVAL = {"qwen3next": 4}
#: the (key, value) head sizes ik's own flash-attention kernels take (ggml/src/iqk/fa, iqk_flash_attention.py); others
#: run ggml's generic one (flash_attention.py)
IQK_FA_HEADS = ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256), (320, 256), (512, 512),
                (576, 512))
#: the head sizes of IQK_FA_HEADS whose kernel has no bf16 form (ik's DeepSeek and 320/256 kernels)
NO_BF16_FA_HEADS = ((320, 256), (576, 512))
#: the architectures whose quantized key caches were checked against ik (their grouped-query attention)
QUANTIZED_KEY_ARCHS = ("qwen3", "qwen3moe", "glm4moe", "minimax-m2")
#: the architectures whose MLA latent cache may be quantized -> the types (ik's names) reproduced for it: DeepSeek's
#: in the prefill form (its keys and values cast to the type, ik's own flash-attention kernel over them) and in the
#: absorbed one at the heads ik's own kernel takes (latent_cache_problem); openPangu's in its unfused chain, which
#: decodes the cache to F32 for its float kernels
MLA_QUANTIZED_LATENT = {"deepseek2": ("q8_0", "q4_0", "q6_0", "iq4_nl"), "openpangu": ("q8_0",)}
#: the quantized key caches (ik's names) whose flash attention in ik's own kernel (IQK_FA_HEADS) is reproduced, from
#: FLASH_REPACK_ROWS query rows on: it repacks a Q8_0 cache to Q8_0_R8 and multiplies it with the queries in Q8_2_X4;
#: the others (key_cache.IQK_FA_KEY_BIAS) in their type's own kernel as stored (ggml's generic kernel takes the
#: quantized key caches of GENERIC_FLASH_KEYS)
FLASH_QUANTIZED_KEYS = ("q8_0", "q4_0", "q6_0", "iq4_nl", "q4_1")
FLASH_REPACK_ROWS = 8
#: the query rows per call for which ik's own kernel takes the key types TX_KEYS in another kernel
#: (mul_mat_qX_0_q8_2_Tx, which sums a row's lanes in another order: key_cache.iqk_fa_key_products)
TX_QUERY_ROWS = (1, 2, 4)
#: Q4_0, Q6_0 and, below FLASH_REPACK_ROWS query rows, Q8_0 (on AVX2 in an unbiased kernel, where the order is the same)
TX_KEYS = ("Q4_0", "Q6_0", "Q8_0")
#: the quantized key caches (ik's names) whose flash attention in ggml's generic kernel (heads not in IQK_FA_HEADS)
#: is reproduced: Q8_0 up to key_cache.SINGLE_ROW_BLOCKS blocks a head, the others at heads of 32 only
#: (MISREAD_FLASH_KEYS)
GENERIC_FLASH_KEYS = ("q8_0", "q4_0", "q6_0", "iq4_nl")
#: key caches whose dot in ggml's generic kernel gets ik's AVX2 Q8_2 query blocks it does not read as such, each
#: -> what ik computes (at heads of 32, one block, the only size reproduced)
MISREAD_FLASH_KEYS = {"q4_0": "ik's AVX2 misread of the Q8_2 query blocks over a q4_0 key cache",
                      "iq4_nl": "ik's AVX2 misread of the Q8_2 query blocks over an iq4_nl key cache",
                      "q6_0": "ik's zero q . k over a q6_0 key cache (its dot declines the Q8_2 query blocks)"}
#: ik's Q8_KV kernel takes rows of a multiple of this (QK_K); its fallback for other rows writes nothing
Q8_KV_ROWS = 256
#: ik's KV cache length is a multiple of this with flash attention on (llama_kv_cache::get_padding)
FA_CACHE_PADDING = 256
#: the architectures whose grouped-query attention under ik's flash attention (-fa on) was checked against ik
FLASH_ATTENTION_ARCHS = QUANTIZED_KEY_ARCHS
#: the architectures whose attention over one shared key = value head ik's flash-attention graph computes in two
#: kernels (shared_kv_flash.py), reproduced over the key caches of SHARED_KV_FLASH_KEYS
SHARED_KV_FLASH_ARCHS = ("deepseek4",)
#: their key caches whose flash attention is reproduced (the -fa off graph over a quantized one is not)
SHARED_KV_FLASH_KEYS = ("f16", "q8_0", "bf16")
#: the MLA architectures whose attention ik's flash-attention graph (-fa on, mla 3) computes in both forms: the
#: prefill one over materialised keys and values, the absorbed one over the latent cache (_absorbed_flash)
MLA_FLASH_ARCHS = ("deepseek2",)
#: architectures whose NextN head ik's loader strips of its own nextn.embed_tokens / shared_head_head ("model has
#: unused tensor ... ignoring"): its graph takes token_embd / output instead
NEXTN_TABLES_IGNORED = ("glm4moe",)


def fa_cache_cells(n_keys: int) -> int:
    """The cells of ik's KV cache under flash attention for `n_keys` keys (padded to FA_CACHE_PADDING)."""
    return -(-n_keys // FA_CACHE_PADDING) * FA_CACHE_PADDING


def flash_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, lanes: int,
                    scores: np.ndarray | None = None, threads: int = 1,
                    key_step: Callable[[int, int, int], int] = k_step_for, f16_values: bool = True) -> np.ndarray:
    """ik's flash attention over its F16 caches (ggml_flash_attn_ext): q [H, n, Dk] (float32), k [H_kv, keys, Dk],
    v [H_kv, keys, Dv] (f16 values), the queries the last n positions -> [H, n, Dv]. ik's own kernel for the head sizes
    it takes (IQK_FA_HEADS, its key blocks by the cache length, padded to FA_CACHE_PADDING), ggml's generic one for
    the others, both in the float order of its build with `lanes` float lanes. `scores`: the products
    q . k [H, n, keys] ik's own kernel takes from its integer kernel over a
    quantized key cache (FLASH_QUANTIZED_KEYS; k unused). A one-token batch whose keys ik's `threads` split
    (split_parts) is computed in those parts, merged as ik merges them (iqk_flash_attention_parts). `key_step`: the
    keys per block its kernel takes (bf16_k_step_for over bf16 caches); `f16_values` False: v is a value cache of
    another type, decoded (ggml's generic kernel then sums the values in float32)."""
    n_head, n, head_k = q.shape
    n_keys, head_v = k.shape[1], v.shape[2]
    out = np.empty((n_head, n, head_v), dtype=np.float32)
    given = NO_SCORES if scores is None else scores
    if (head_k, head_v) not in IQK_FA_HEADS:
        generic_flash_attention(q, k, given, v, float(np.float32(scale)), n_keys - n, out, lanes, f16_values)
        return out
    n_kv = fa_cache_cells(n_keys)
    parts = split_parts(n_head, k.shape[0], n_kv, threads) if n == 1 else None
    if parts is not None and len(parts[0]) > 1:
        starts, lengths, _ = parts
        iqk_flash_attention_parts(q, k, given, v, scale, np.array(starts), np.array(lengths),
                                  np.array([key_step(head_k, head_v, m) for m in lengths]), out, lanes)
    else:
        iqk_flash_attention(q, k, given, v, float(np.float32(scale)), n_keys - n, key_step(head_k, head_v, n_kv),
                            out, lanes)
    return out


def split_part_keys(n_head_kv: int, n_cells: int, threads: int) -> int | None:
    """The keys of each part ik's kernel splits a one-token batch's cache of `n_cells` cells into, for grouped heads
    on `n_head_kv` > 1 key/value heads among its `threads` (iqk_flash_attn_noalibi), or None where it does not take
    that path (fewer than 32 cells a thread)."""
    if n_head_kv * n_cells < 32 * threads:
        return None
    per_thread = threads // math.gcd(n_head_kv, threads)
    chunks = n_head_kv // math.gcd(n_head_kv, threads) * n_cells // 32
    chunks_per_thread = -(-chunks // per_thread)
    if chunks_per_thread * per_thread == chunks:
        return 32 * (n_head_kv * n_cells // (32 * threads))
    blocks = 1
    while blocks * 4 < chunks_per_thread:
        blocks *= 2
    return 32 * blocks


def split_parts(n_head: int, n_head_kv: int, n_cells: int,
                threads: int) -> tuple[list[int], list[int], list[int]] | None:
    """How ik's own flash-attention kernel shares a one-token batch over grouped heads among its `threads`
    (iqk_flash_attn_noalibi): the key parts of the `n_cells` cells (starts, lengths, in the order it merges them)
    and per query head the heads its part's calls take as rows; None where it takes its general path (one call per
    query head: no group, or fewer than 32 cells a thread). Over one key/value head (its MLA path), with 4 steps of
    32 cells a thread or more: one part a thread, the first ones a step longer where they do not divide evenly, each
    over all heads; else, where that leaves a thread more than one head, gcd(steps, threads) equal parts, the heads
    shared among the threads left, the first ones a head more where they do not divide evenly. Otherwise parts of
    split_part_keys cells, each over its key head's group."""
    if n_head == n_head_kv:
        return None
    steps = n_cells // 32
    if n_head_kv == 1 and steps > 1:
        if steps >= 4 * threads:
            per = -(-steps // threads)
            mid = threads if per * threads == steps else steps - threads * (per - 1)
            lengths = [32 * (per if i < mid else per - 1) for i in range(threads)]
            return [sum(lengths[:i]) for i in range(threads)], lengths, [n_head] * n_head
        gcd = math.gcd(steps, threads)
        share = threads // gcd
        heads_per = -(-n_head // share)
        if heads_per > 1:
            mid = share if heads_per * share == n_head else n_head - share * (heads_per - 1)
            rows = [heads_per if j < mid * heads_per else heads_per - 1 for j in range(n_head)]
            return [i * (n_cells // gcd) for i in range(gcd)], [n_cells // gcd] * gcd, rows
    keys = split_part_keys(n_head_kv, n_cells, threads)
    if keys is None:
        return None
    starts = list(range(0, n_cells, keys))
    return starts, [min(keys, n_cells - a) for a in starts], [n_head // n_head_kv] * n_head


class IkNumerics(Numerics):
    """ik's CPU arithmetic (the module docstring)."""

    name = "ik"
    #: F16 / BF16 weights go through ik's float kernels (or, past the cache, the exact mode's decoded tiles)
    multiplies_halves = False
    #: the quantized key caches (ik's names) whose K x Q kernel of ik's -fa off graph this arithmetic reproduces
    #: (key_cache.py)
    quantized_keys: tuple[str, ...] = ("q8_0", "q4_0", "q6_0", "iq4_nl", "q5_0", "q4_1", "q5_1", "q8_KV")
    #: those of them whose K x Q products in ik's flash attention it reproduces too
    flash_keys: tuple[str, ...] = ("q8_0", "q4_0", "q6_0", "iq4_nl", "q4_1")
    #: the float key caches (ik's names) besides F16 and F32 it reproduces on QUANTIZED_KEY_ARCHS (ik's -fa off
    #: graph: its bf16 kernel on the cache's values and the queries rounded to bf16, where it has one, _bf16_kernel;
    #: else the float kernel)
    float_keys: tuple[str, ...] = ("bf16",)
    #: the quantized value caches (ik's names) whose flash attention in ik's own kernel (IQK_FA_HEADS) it
    #: reproduces (ik quantizes a V cache only with flash attention on; GGML_IQK_FA_ALL_QUANTS, its build's default)
    flash_values: tuple[str, ...] = ("q8_0", "q6_0", "q4_0", "q4_1", "iq4_nl")
    #: whether the float orders are ik's AVX2 build's (8-lane float kernels, its AVX2 exponential, numerics/ik/
    #: avx2.py) rather than its AVX-512 build's
    avx2 = False

    @property
    def lanes(self) -> int:
        """The lanes of ik's float kernels in the build this arithmetic reproduces."""
        return AVX2_LANES if self.avx2 else LANES

    @property
    def row_group(self) -> int:
        """The weight rows each form ik converts to interleaves (Q8_0_R8, Q8_1, Q8_K_R16 / Q8_K_R8): a matmul
        converts only weights of a multiple of it (16 in ik's AVX-512 build, 8 in its AVX2 one)."""
        return 8 if self.avx2 else 16

    # ---- what a file may hold ---------------------------------------------------------------------------------
    def kv_cache(self, requested: KvCache) -> KvCache:
        """ik's F16 caches, its F32 key cache (-ctk f32: the same float kernel on unrounded keys) or a quantized key
        cache (-ctk, checked by check_key_cache) with its Hadamard transform; the values F16 or a quantized value
        cache of flash_values (-ctv, checked by check_value_cache)."""
        quantized_v = requested.v in self.flash_values or (requested.v == "bf16" and not self.avx2)
        v, v_hadamard = (requested.v, requested.v_hadamard) if quantized_v else ("f16", 0)
        if requested.k not in FLOAT_CACHES:
            return KvCache(requested.k, v, k_hadamard=requested.k_hadamard, v_hadamard=v_hadamard,
                           indexer=requested.indexer)
        return KvCache("f32" if (requested.k, requested.v) == ("f32", "f16") else "f16", v, v_hadamard=v_hadamard,
                       indexer=requested.indexer)

    def _bf16_flash(self, kv: KvCache) -> bool:
        """Whether these are bf16 K and V caches, which ik's AVX-512 build runs in flash attention (FlashAttnBF16,
        built with AVX512BF16; it refuses bf16 keys beside other values, and its AVX2 build any bf16 key cache)."""
        return kv.k == kv.v == "bf16" and not self.avx2

    def yarn_truncates(self, requested: bool) -> bool:
        """ggml always rounds YaRN's correction range to whole dims (GGUF has no key for anything else)."""
        return True

    def check_weights(self) -> list[str]:
        odd: dict[str, list[str]] = {}
        for name in self.weights.names():
            info = self.weights.info(name)
            if len(info.ne) >= 2 and name != "token_embd.weight" and info.type.name not in INTEGER_TYPES \
                    and info.type.name not in IK_KERNELS:
                odd.setdefault(info.type.name, []).append(name)
        if not odd:
            return []
        kinds = "; ".join(f"{t} ({len(n)} tensors, e.g. {n[0]})" for t, n in odd.items())
        return [f"--numerics ik does not reproduce ik's arithmetic for {kinds}: ik's kernels re-quantize such weights "
                "in ways not emulated; reproduced: " + ", ".join(sorted(IK_KERNELS))]

    def check_type(self, gtype: GGMLType) -> str | None:
        if gtype.name in IK_KERNELS:
            return None
        return (f"--numerics ik does not reproduce ik's arithmetic for {gtype.name} weights; reproduced: "
                + ", ".join(sorted(IK_KERNELS)))

    # ---- what ik computes otherwise, or wrongly --------------------------------------------------------------
    def check_full_attention_interval(self, arch: str, interval: int) -> str | None:
        fixed = FIXED_FULL_ATTENTION_INTERVAL.get(arch)
        if fixed is None or interval == fixed:
            return None
        return (f"ik's {arch} makes every {fixed}th layer full attention whatever the file says (it cannot load this "
                "file); --numerics ik has no ik arithmetic to reproduce, use the exact one")

    def check_delta_net(self, head_k: int, head_v: int) -> str | None:
        if head_k == head_v and head_k in FUSED_HEAD_DIMS:
            return None
        return ("--numerics ik computes ik's fused delta-net kernel, which keeps one head dim for keys and values and "
                "which ik runs right only for 64 and 128 (its fallback is wrong); use the exact arithmetic")

    def check_key_cache(self, arch: str, cache_type: str) -> str | None:
        if cache_type in ("f16", "f32"):
            return None
        others = (*self.float_keys, *self.quantized_keys)
        if arch in QUANTIZED_KEY_ARCHS and cache_type in others:
            return None
        if cache_type in MLA_QUANTIZED_LATENT.get(arch, ()) and cache_type in self.quantized_keys:
            return None
        if arch in SHARED_KV_FLASH_ARCHS and self.options.flash_attn != "off" and cache_type in SHARED_KV_FLASH_KEYS:
            return self.check_flash_attention(arch, KvCache(k=cache_type), 0)
        if cache_type == "bf16" and arch in MLA_FLASH_ARCHS and not self.avx2:  # the prefill form's: latent_cache_problem
            return None
        latent = "".join(f"; {'/'.join(types)} as {name}'s MLA latent" for name, types in MLA_QUANTIZED_LATENT.items())
        return (f"--numerics {self.name} reproduces ik's F16 and F32 key caches, and on {', '.join(QUANTIZED_KEY_ARCHS)} "
                f"its {', '.join(others)} ones{latent}; not a {cache_type} key cache on {arch}")

    def latent_cache_problem(self, kv: KvCache, path: str, kv_b: tuple[str, str] | None,
                             heads: tuple[int, int] | None = None) -> str | None:
        """Why ik's run over the MLA latent cache `kv.k` in the form `path` is not reproduced, or None: a quantized
        cache (MLA_QUANTIZED_LATENT) in the prefill form over the file's own attn_kv_b, not F32 (`kv_b`: a block's
        attn_kv_b and its type, "absent" where the file has none: ik converts the decoded cache for an F32 matmul
        with a conversion F32 lacks, and crashes; the attn_kv_b ik derives at load is not reproduced under it), or in
        the absorbed form in flash attention at `heads` ik's own kernel takes (IQK_FA_HEADS, DeepSeek-V3's 576 /
        512: its K x Q over the quantized rows, their values decoded), and a Q8_0 one in ggml's generic kernel at the
        others (its q . k one query row at a time, the values decoded and summed in float32; on AVX2 at keys of at
        most SINGLE_ROW_BLOCKS blocks). Over the other types ggml's generic kernel misreads the query blocks (ik's
        figures are NaN) or writes q . k 0 (Q6_0). A BF16 latent in the prefill form, its keys and values cast to
        BF16 for ik's bf16 kernel at `heads` (there the prefill form's) that kernel takes; in the absorbed form in
        ggml's generic kernel (its bf16 dot, shared_kv_flash.generic_bf16_products) at heads ik's own kernel does not
        take, on AVX-512 (ik's AVX2 build aborts). In ik's -fa off graph the latent takes -ctv's type, f16 or bf16
        (kvcache.check_cache), a BF16 one multiplied in ik's bf16 kernel (its AVX2 build: its float kernel on the
        unrounded activations, as for F16)."""
        if path != "prefill" and not self._absorbed_flash():
            if kv.k in FLOAT_CACHES:
                return None
            return f"a {kv.k} MLA latent cache in ik's -fa off graph is not reproduced (ik takes f16 or bf16 there)"
        if kv.k == "bf16":
            if path != "prefill" and self._absorbed_flash() and heads is not None and heads not in IQK_FA_HEADS \
                    and not self.avx2:
                return None
            if path != "prefill":
                return (f"--cache-type-k bf16: ik's absorbed MLA form (batches under {MLA_PREFILL_MIN_TOKENS} tokens, "
                        "--mla decode or --flash-attn off) over a bf16 latent cache is reproduced in ggml's generic "
                        "flash-attention kernel (its bf16 dot, heads ik's own kernel does not take, AVX-512), not "
                        + ("in ik's AVX2 build" if self.avx2 else f"at heads {heads}") + "; the prefill form is")
            if heads is not None and (heads not in IQK_FA_HEADS or heads in NO_BF16_FA_HEADS):
                return (f"--cache-type-k bf16: the prefill form's heads {heads[0]}/{heads[1]} are not ones ik's bf16 "
                        "flash-attention kernel takes")
        elif kv.k in FLOAT_CACHES:
            return None
        if path != "prefill":
            if self._absorbed_flash() and heads in IQK_FA_HEADS:
                return None
            if self._absorbed_flash() and heads is not None and kv.k == "q8_0" and \
                    not (self.avx2 and heads[0] // 32 > SINGLE_ROW_BLOCKS):
                return None
            where = "ggml's generic flash-attention kernel" + ("" if heads is None else f" (heads {heads[0]}/{heads[1]})")
            return (f"--cache-type-k {kv.k}: ik's absorbed MLA form (batches under {MLA_PREFILL_MIN_TOKENS} tokens, or "
                    f"--mla decode) over a {kv.k} latent cache is reproduced in ik's own flash-attention kernel (heads "
                    f"576/512, DeepSeek-V3's) and, q8_0, in ggml's generic one, not in {where}; the prefill form "
                    "is")
        if kv_b is not None and kv_b[1] == "F32":
            return (f"--cache-type-k {kv.k}: {kv_b[0]} is F32, and ik's prefill form converts a {kv.k} latent "
                    "cache for an F32 matmul with a conversion F32 lacks (ik crashes there); quantize attn_kv_b or "
                    "run the exact arithmetic")
        if kv_b is not None and kv_b[1] == "absent":
            return (f"--cache-type-k {kv.k}: the file has no {kv_b[0]}; the one ik derives at load is not "
                    f"reproduced over a {kv.k} latent cache")
        return None

    def check_value_cache(self, arch: str, kv: KvCache, head_dim: int) -> str | None:
        """Why this arithmetic cannot reproduce ik's run with the value cache `kv.v` (not F16), or None: ik's flash
        attention must be on and reproduced over these caches (check_flash_attention), without -vhad."""
        if self.options.flash_attn == "off" and kv.v != "bf16":
            return "ik quantizes a V cache only with flash attention (it refuses to run with -fa off)"
        if kv.v_hadamard:
            return "ik's Hadamard transform of a quantized V cache (-vhad) is not reproduced"
        if self.options.flash_attn == "off":  # a bf16 V cache: ik's bf16 matmul of the softmax by the values
            return "ik's AVX2 build's -fa off graph over a bf16 V cache is not reproduced" if self.avx2 else None
        return self.check_flash_attention(arch, kv, head_dim)

    def nextn_own_tables(self, arch: str) -> bool:
        return arch not in NEXTN_TABLES_IGNORED

    def nextn_sparse_attention(self) -> bool:
        """ik's MTP graph runs a DSA head's attention dense (dsa_should_use is off for MTP passes)."""
        return False

    def fused_top_k_tie(self, semantic: int) -> int:
        """ik's fused indexer top-k (iqk_indexer_topk) orders each query's key indices by std::partial_sort on the
        scores. That is its path where a batch has a query per thread or more, every prompt batch of a perplexity
        run; below that (a token at a time on several threads) it takes a bucket selection whose order among equal
        scores is not reproduced here."""
        return TIE_PARTIAL_SORT

    # ---- element-wise: ik's float orders ----------------------------------------------------------------------
    def norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        return rms_norm(x, weight, eps, ik=True)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, neox: bool) -> None:
        apply_rope(x, cos, sin, n_rot, neox, fused=True)

    def swiglu(self, gate: np.ndarray, up: np.ndarray, limit: float = np.inf) -> np.ndarray:
        return swiglu(gate, up, limit, ik=True, avx2=self.avx2)

    def route(self, logits: np.ndarray, bias: np.ndarray | None, n_used: int, gating: int, norm: bool,
              scale: float, chosen: np.ndarray | None = None,
              groups: tuple[int, int] = (1, 1)) -> tuple[np.ndarray, np.ndarray]:
        """ik's graphs route deepseek2 and glm4moe by a plain top-k: expert groups are ignored."""
        return route(logits, bias, n_used, gating, norm, scale, chosen, ik=True)

    def hc_pre(self, mixes: np.ndarray, alpha: np.ndarray, beta: np.ndarray, n_stream: int, iters: int,
               eps: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return hc_pre(mixes, alpha, beta, n_stream, iters, eps, fused=True)

    def hc_combine(self, streams: np.ndarray, weights: np.ndarray) -> np.ndarray:
        return hc_combine(streams, weights, fused=True)

    def hc_post(self, y: np.ndarray, post: np.ndarray, streams: np.ndarray, mix: np.ndarray) -> np.ndarray:
        return hc_post(y, post, streams, mix, fused=True)

    def conv(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return causal_conv_residual(x, w, fused=True)

    def moe_residual(self, x: np.ndarray, routed: np.ndarray, shared: np.ndarray | None) -> np.ndarray:
        """ik's llm_build_std_moe_ffn with add_input: the routed experts plus the input, then the shared experts."""
        return routed + x if shared is None else (routed + x) + shared

    def sigmoid(self, x: np.ndarray) -> np.ndarray:
        return ik_sigmoid_array(x)

    # ---- the gated delta-net: ik's conv, its fused kernel, its norms (numerics/ik/delta_net.py) ----------------
    def conv_silu(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return causal_conv_silu(x, w, ik=True, avx2=self.avx2)

    def decay_and_beta(self, a: np.ndarray, b: np.ndarray, ssm_a: np.ndarray,
                       dt_bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return ik_decay_and_beta(a, b, ssm_a, dt_bias)

    def delta_rule(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                   k_head: np.ndarray, eps: float, state: np.ndarray | None = None) -> np.ndarray:
        return ik_delta_rule(q, k, v, g, beta, k_head, eps, state, self.avx2)

    def gated_norm(self, x: np.ndarray, z: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """ik's RMS norm, then its fused SiLU(z) times the normed value."""
        return swiglu(z, self.norm(x, weight, eps), ik=True, avx2=self.avx2)

    def indexer_scores(self, q: np.ndarray, k: np.ndarray, w: np.ndarray, cache_type: str,
                       q0: int = 0) -> np.ndarray:
        """A quantized indexer cache's q . k as ik's matmul of the cache with each head's queries computes it (the
        queries rounded to the type's activation blocks, integer dot products); other caches as the exact
        arithmetic."""
        type_name = ggml_name(cache_type)
        kernel = IK_KERNELS.get(type_name)
        n, n_head, d = q.shape
        ints = None if kernel is None else self._integers(kernel, n, len(k), self.options.ik_threads)
        if ints is None:
            return super().indexer_scores(q, k, w, cache_type, q0)
        raw = cache_row_bytes(type_name, np.ascontiguousarray(k, dtype=np.float32))
        packed = pack(ints(raw, type_by_name(type_name).require_codec().dequantize(raw, d)))
        fmt = activation_format(type_name)
        qk = np.stack([qmatmul(integer_rows(q[:, h], fmt), packed)[:n] for h in range(n_head)], axis=1)
        return scores_from_products(qk, w, q0)

    def kv_store(self, x: np.ndarray, cache_type: str, hadamard_block: int = 0, value: bool = False) -> np.ndarray:
        """A quantized key cache (quantized_keys) keeps the rows ik's ggml_cpy quantizes into it (rotated by its
        Hadamard transform where asked): causal_attention writes and multiplies them as ik's K x Q kernel does. A
        quantized value cache (flash_values) holds its decoded rows: ik's flash-attention kernel decodes each
        block as scale x integer (exact in float32) before the same fused sums as F16 values."""
        if cache_type in self.quantized_keys and not value:
            return blockwise_hadamard(x, hadamard_block) if hadamard_block else x
        return super().kv_store(x, cache_type, hadamard_block, value)

    # ---- attention: ik's kernels where its float kernels take the head dims whole -----------------------------
    def attention_graph(self, arch: str, kv: KvCache, head_dim: int) -> str | None:
        """ik's flash-attention graph ("on", its default) where --flash-attn asks for it or leaves it to ik's default
        and this arithmetic reproduces it (check_flash_attention); else its -fa off graph."""
        if self.options.flash_attn == "off" or self.check_flash_attention(arch, kv, head_dim) is not None:
            return "off"
        return "on"

    def reproduced_defect(self, arch: str, kv: KvCache, head_dim: int) -> str | None:
        """ggml's generic flash-attention kernel over a Q4_0 or IQ4_NL key cache reads each query block as a Q8_0 one
        (q4_0_misread_key_products, iq4_nl_misread_key_products), over a Q6_0 one writes every q . k 0; ik's
        Q8_1_R8 gemm (both builds), which multiplies a Q4_1 or Q5_1 key cache, has no loop for the blocks past a key
        head's last whole 128 values (qgemm.ORDER_Q8_1, ORDER_Q8_1_AVX2)."""
        if kv.k in MISREAD_FLASH_KEYS and (head_dim, head_dim) not in IQK_FA_HEADS and \
                self.attention_graph(arch, kv, head_dim) == "on":
            return f"{MISREAD_FLASH_KEYS[kv.k]} (its figures are wrong)"
        if kv.k in ("q4_1", "q5_1") and kv.k in self.quantized_keys and head_dim % 128 and \
                self.attention_graph(arch, kv, head_dim) == "off":
            return (f"ik's Q8_1_R8 kernel leaves the last {head_dim % 128} of {head_dim} values of each key head "
                    f"out of q . k over a {kv.k} key cache (its figures are wrong)")
        return None

    def check_flash_attention(self, arch: str, kv: KvCache, head_dim: int) -> str | None:
        if arch in MLA_FLASH_ARCHS:  # the latent cache's forms: latent_cache_problem
            return None
        if arch in SHARED_KV_FLASH_ARCHS:
            if kv.k == "bf16" and self.avx2:
                return "ik's AVX2 build has no flash attention over bf16 caches (its kernel needs AVX512BF16: it aborts)"
            return None if kv.k in SHARED_KV_FLASH_KEYS else (
                f"--numerics {self.name} reproduces ik's flash attention on {arch} over its "
                f"{' / '.join(SHARED_KV_FLASH_KEYS)} key caches, not a {kv.k} one")
        if arch not in FLASH_ATTENTION_ARCHS:
            return (f"--numerics {self.name} reproduces ik's flash attention on {', '.join(FLASH_ATTENTION_ARCHS)}, "
                    f"not {arch}")
        if kv.k == kv.v == "bf16" and self.avx2:
            return "ik's AVX2 build has no flash attention over bf16 caches (its kernel needs AVX512BF16: it aborts)"
        if self._bf16_flash(kv):  # ik's own kernel at the heads it takes, ggml's generic one at the others
            return None if (head_dim, head_dim) not in NO_BF16_FA_HEADS \
                else f"ik's flash attention over bf16 caches at heads of {head_dim}/{head_dim} is not reproduced"
        if kv.v not in ("f16", *self.flash_values):
            return (f"--numerics {self.name} reproduces ik's F16 value caches, and {' / '.join(self.flash_values)} "
                    f"ones under flash attention, not a {kv.v} one")
        if kv.k not in ("f16", *self.flash_keys):
            return (f"--numerics {self.name} reproduces ik's flash attention over F16 caches and "
                    f"{' / '.join(self.flash_keys)} key caches, not a {kv.k} key cache (give --flash-attn off: ik's "
                    "-fa off graph)")
        if kv.k == "f16":
            return None
        if (head_dim, head_dim) in IQK_FA_HEADS and kv.k not in FLASH_QUANTIZED_KEYS:
            return (f"--numerics {self.name} reproduces ik's own flash-attention kernel (heads of {head_dim}) over "
                    f"{', '.join(FLASH_QUANTIZED_KEYS)} key caches, not a {kv.k} one (give --flash-attn off: ik's -fa "
                    "off graph)")
        if (head_dim, head_dim) not in IQK_FA_HEADS and kv.k not in GENERIC_FLASH_KEYS:
            return (f"--numerics {self.name} reproduces ggml's generic flash-attention kernel (heads of {head_dim}) over "
                    f"{', '.join(GENERIC_FLASH_KEYS)} key caches, not a {kv.k} one (give --flash-attn off: ik's -fa "
                    "off graph)")
        if kv.k in MISREAD_FLASH_KEYS and head_dim != 32 and (head_dim, head_dim) not in IQK_FA_HEADS:
            return (f"--numerics {self.name} reproduces ggml's generic flash-attention kernel over a {kv.k} key cache "
                    f"at heads of 32, not {head_dim} (give --flash-attn off: ik's -fa off graph)")
        if (head_dim, head_dim) not in IQK_FA_HEADS and head_dim // 32 > SINGLE_ROW_BLOCKS:
            return (f"--numerics {self.name} reproduces ggml's generic flash-attention kernel over a {kv.k} key cache "
                    f"up to heads of {32 * SINGLE_ROW_BLOCKS}, not heads of {head_dim} (give --flash-attn off: ik's "
                    "-fa off graph)")
        return None

    def causal_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, head_dim: int, *, window: int = 0,
                         sinks: np.ndarray | None = None, kv: KvCache | None = None,
                         flash: bool = False) -> np.ndarray:
        """ik's kernels for causal attention, a sliding window and sinks (gpt-oss) included; over a quantized key
        cache its integer K x Q product (key_cache.py) feeds the same softmax and values. `flash`: ik's flash
        attention over its caches instead (flash_attention), for attention_graph "on"."""
        scale = float(np.float32(1.0) / np.sqrt(np.float32(head_dim)))  # 1.0f / sqrtf
        if kv is not None and kv.k_hadamard:  # ik's graph rotates the queries before either attention graph
            q = blockwise_hadamard(q, kv.k_hadamard)
        if flash:
            bf16 = kv is not None and kv.k == "bf16"  # FlashAttnBF16: its bf16 K x Q, its own key blocks
            if bf16 and (head_dim, v.shape[2]) not in IQK_FA_HEADS:  # ggml's generic kernel: ggml_vec_dot_bf16
                scores: np.ndarray | None = self._generic_bf16_products(q, k)
            else:
                scores = None if kv is None or kv.k == "f16" else \
                    self._bf16_key_products(q, k) if bf16 else self._flash_key_products(q, k, v.shape[2], kv.k)
            return flash_attention(np.ascontiguousarray(q.transpose(1, 0, 2), dtype=np.float32),
                                   np.ascontiguousarray(k.transpose(1, 0, 2), dtype=np.float32),
                                   np.ascontiguousarray(v.transpose(1, 0, 2), dtype=np.float32), scale, self.lanes,
                                   scores, self.options.ik_threads, bf16_k_step_for if bf16 else k_step_for,
                                   kv is None or kv.v == "f16").transpose(1, 0, 2)
        values = kv is not None and kv.v == "bf16"  # ik's bf16 kernel multiplies the probabilities by them
        if kv is not None and kv.k in self.quantized_keys:
            return ik_causal_attention(q, k, v, scale, window, sinks, self.avx2, self._key_products(q, k, kv.k),
                                       values)
        if kv is not None and kv.k == "bf16" and self._bf16_kernel("BF16"):
            return ik_causal_attention(q, k, v, scale, window, sinks, self.avx2, self._bf16_key_products(q, k),
                                       values)
        if values:
            return ik_causal_attention(q, k, v, scale, window, sinks, self.avx2, bf16_values=True)
        if head_dim % self.lanes:
            return super().causal_attention(q, k, v, head_dim, window=window, sinks=sinks)
        return ik_causal_attention(q, k, v, scale, window, sinks, self.avx2)

    def shared_kv_attention(self, q: np.ndarray, kv: np.ndarray, scale: float, *, window: int = 0,
                            sinks: np.ndarray | None = None, comp: np.ndarray | None = None,
                            comp_keep: np.ndarray | None = None, start: int = 0, ratio: int = 0, top_k: int = 0,
                            flash: bool = False, cache: KvCache | None = None) -> np.ndarray:
        """`flash`: ik's flash-attention graph, in the kernel it picks for the layer and batch (shared_kv_flash.py:
        ggml's generic one, or its own over the gathered visible keys); else its -fa off graph, computed here as the
        exact arithmetic's (float32 products and softmax: a KLD near 1e-7 from ik's). Over a q8_0 or bf16 key `cache`
        (the rows as kv_store kept them) the kernel takes the products q . k of ik's kernels for it
        (_shared_key_products) and the decoded rows as values."""
        if not flash:
            return super().shared_kv_attention(q, kv, scale, window=window, sinks=sinks, comp=comp,
                                               comp_keep=comp_keep, start=start)
        n, n_head, d = q.shape
        extra = np.zeros((0, d), np.float32) if comp is None else comp
        keep = np.zeros((n, len(extra)), np.bool_) if comp_keep is None else comp_keep
        rows, counts = visible_keys(n, start, window, len(kv), keep)
        gathered = ik_gathers(ratio, window, top_k, start, n)
        sink_of = sink_heads(n_head, self.options.ik_threads) if gathered and n == 1 else np.arange(n_head)
        q = np.ascontiguousarray(q, dtype=np.float32)
        keys = np.ascontiguousarray(np.concatenate([kv, extra]), dtype=np.float32)
        scores, bf16 = NO_SHARED_SCORES, cache is not None and cache.k == "bf16"
        if cache is not None and cache.k not in ("f32", "f16"):
            scores = self._shared_key_products(q, keys, cache.k, gathered)
            keys = np.ascontiguousarray(cache_holds(keys, cache.k))
        return shared_kv_flash_attention(q, keys, rows, counts, np.empty(0, np.float32) if sinks is None else
                                         np.ascontiguousarray(sinks, dtype=np.float32), float(np.float32(scale)),
                                         gathered, self.lanes, sink_of, scores, bf16)

    def _shared_key_products(self, q: np.ndarray, keys: np.ndarray, cache_type: str, gathered: bool) -> np.ndarray:
        """q . k [n, H, K] of queries q [n, H, d] and every key row [K, d] over a key cache of `cache_type`, as ik's
        flash-attention kernels multiply them for DeepSeek-V4: ggml's generic one ik's Q8_0 kernel one row and one
        key at a time (over BF16 ggml_vec_dot_bf16); ik's own one a token's heads as the rows of one call (each
        thread takes whole tokens), which is _flash_key_products of the heads as the tokens of one head, in one
        thread (over BF16 its bf16 kernel, whose products do not depend on the rows a call takes)."""
        if cache_type == "bf16":  # ggml_vec_dot_bf16, or ik's bf16 kernel (FlashAttnBF16)
            return generic_bf16_products(q, keys) if not gathered else \
                np.ascontiguousarray(self._bf16_key_products(q, keys[:, None]).transpose(1, 0, 2))
        if not gathered:
            kernel = key_cache_kernel(ggml_name(cache_type))
            assert kernel.ints is not None, f"{cache_type} is held as integers (formats.IK_KERNELS)"
            heads = single_row_key_products(q, keys[:, None], ggml_name(cache_type), kernel.ints, self.avx2)
            return np.ascontiguousarray(heads.transpose(1, 0, 2))
        return self._flash_key_products(np.ascontiguousarray(q.transpose(1, 0, 2)), keys[:, None], q.shape[2],
                                        cache_type, threads=1)

    def _one_token_calls(self, n_head: int, n_head_kv: int, n_cells: int,
                         heads: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """Per query head of a one-token batch, the rows of the K x Q call ik's kernel takes it in and whether that
        call's step was a single one of 4 rows or more (kernel_row_calls): a thread's share of a key head's query
        heads are the rows of its calls, consecutive heads (split_parts; on its general path each head alone).
        Where the threads' shares differ (4 heads among 3 threads: 2, 1 and 1) each head takes its own share's."""
        parts = split_parts(n_head, n_head_kv, n_cells, self.options.ik_threads)
        rows = [1] * n_head if parts is None else parts[2]
        calls = np.empty(n_head, dtype=np.int64)
        single = np.zeros(n_head, dtype=np.bool_)
        h = 0
        while h < n_head:
            share = rows[h]
            calls[h : h + share], single[h : h + share] = kernel_row_calls(share, 1, 1, n_cells, heads)
            h += share
        return calls, single

    def _key_products(self, q: np.ndarray, k: np.ndarray, cache_type: str) -> np.ndarray:
        """q . k [H, n, keys] over a key cache of `cache_type` as ik multiplies them: each query head a matmul of
        its own, its rows the activation rows (a single query: its group's heads, ik's Ny = 1 path), the head's
        share of ik's threads splitting the cache cells."""
        type_name = ggml_name(cache_type)
        if type_name == "Q8_KV":
            if q.shape[2] % Q8_KV_ROWS:
                raise ModelError(f"ik multiplies a q8_KV key cache in rows of {Q8_KV_ROWS} values: with heads of "
                                 f"{q.shape[2]} its q . k is never written (its figures are whatever memory held, not "
                                 "reproducible)")
            return q8_kv_key_products(q, k)
        n, n_head, _ = q.shape
        n_kv = k.shape[1]
        rows, threads = (n, self._kernel_threads(n_head)) if n > 1 else (n_head // n_kv, self._kernel_threads(n_kv))
        kernel = key_cache_kernel(type_name)
        if not kernel.converts(rows, key_cells(len(k)), threads, self.row_group):
            raise ModelError(f"ik multiplies a {cache_type} key cache with {rows} query rows, {threads} ik threads a "
                             "head, in the type's own kernel (it converts the cache rows from 32 query rows and 32 "
                             "cache cells a thread on), which is not reproduced")
        ints = self._integers(kernel, rows, key_cells(len(k)), threads)
        assert ints is not None, f"{type_name} converts (formats.IK_KERNELS, KEY_CACHE_KERNELS)"
        return key_products(q, k, type_name, ints, kernel.activation)

    @staticmethod
    def _generic_bf16_products(q: np.ndarray, k: np.ndarray) -> np.ndarray:
        """q . k [H, n, keys] of q [n, H, d] and a BF16 key cache k [keys, H_kv, d] as ggml's generic flash-attention
        kernel takes them (generic_bf16_products), each query head against its group's keys."""
        group = q.shape[1] // k.shape[1]
        return np.concatenate([generic_bf16_products(np.ascontiguousarray(q[:, g * group:(g + 1) * group]),
                                                     np.ascontiguousarray(k[:, g])).transpose(1, 0, 2)
                               for g in range(k.shape[1])])

    def _bf16_key_products(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        """q . k [H, n, keys] over a BF16 key cache (k: its values) as ik's bf16 kernel multiplies them, each query
        head's rows rounded to bf16 against its group's keys."""
        n, n_head, d = q.shape
        if not takes_whole(d, True, self.lanes):
            raise ModelError(f"ik's bf16 kernel takes rows in multiples of {2 * self.lanes} values: its K x Q over a "
                             f"bf16 key cache with heads of {d} is not reproduced")
        group = n_head // k.shape[1]
        xr = round_activations(np.ascontiguousarray(q.transpose(1, 0, 2)), self._activation_format("BF16"))
        return np.stack([ik_float_matmul(xr[h], np.ascontiguousarray(k[:, h // group]), True, self.lanes)
                         for h in range(n_head)])

    def _flash_key_products(self, q: np.ndarray, k: np.ndarray, head_v: int, cache_type: str,
                            threads: int | None = None) -> np.ndarray:
        """q . k [H, n, keys] over a key cache of `cache_type` as ik's flash attention multiplies them. Its own kernel
        (IQK_FA_HEADS), for a batch of FLASH_REPACK_ROWS tokens and more: it repacks the Q8_0 cache rows to Q8_0_R8
        (iqk_repack_k), whatever its threads, the queries rounded as for the matmul of such weights; the other types
        (key_cache.IQK_FA_KEY_BIAS), and Q8_0 below those rows, it multiplies as stored in their own kernel, 8 query
        rows a call (kernel_row_calls; TX_KEYS in calls of TX_QUERY_ROWS rows in their Tx kernel); ggml's generic
        kernel: ik's Q8_0 kernel one query row and one key at a time. `threads`: ik's (--ik-threads unless given)."""
        type_name = ggml_name(cache_type)
        kernel = key_cache_kernel(type_name)
        if (q.shape[2], head_v) not in IQK_FA_HEADS:
            assert kernel.ints is not None, f"{type_name} is held as integers (formats.IK_KERNELS)"
            if type_name == "Q4_0":
                return q4_0_misread_key_products(q, k, kernel.ints)
            if type_name == "IQ4_NL":
                return iq4_nl_misread_key_products(q, k, kernel.ints)
            if type_name == "Q6_0":  # ik declines its dot's Q8_1 query: ggml's fallback writes 0
                return np.zeros((q.shape[1], len(q), len(k)), np.float32)
            return single_row_key_products(q, k, type_name, kernel.ints, self.avx2)
        n = len(q)
        if type_name in IQK_FA_KEY_BIAS or n < FLASH_REPACK_ROWS:
            held = kernel.ints or kernel.convert  # Q4_1: its codes, scales and offsets as stored
            assert held is not None, f"{type_name} is held as integers (formats.IK_KERNELS, KEY_CACHE_KERNELS)"
            cells, heads = fa_cache_cells(len(k)), (q.shape[2], head_v)
            # the rows of the call each score's query row (one token: each head) is in, as [H, n]
            if n == 1:
                calls, single = (c[:, None] for c in self._one_token_calls(q.shape[1], k.shape[1], cells, heads))
            else:
                calls, single = (np.broadcast_to(c, (q.shape[1], n))
                                 for c in kernel_row_calls(n, q.shape[1], threads or self.options.ik_threads,
                                                           cells, heads))
            tx = np.isin(calls, TX_QUERY_ROWS) & (type_name in TX_KEYS)
            scores = iqk_fa_key_products(q, k, type_name, held, self.avx2, tx)
            if type_name == "Q8_0" and single.any():  # a single step of 4+ rows: each key block repacked to R8
                scores[single] = self._repacked_q8_0(q, k, kernel)[single]
            return scores
        ints = self._integers(kernel, max(n, kernel.convert_rows), key_cells(len(k)))
        assert ints is not None, f"{type_name} is held as integers (formats.IK_KERNELS)"
        return key_products(q, k, type_name, ints, self._activation_format(type_name))

    def _repacked_q8_0(self, q: np.ndarray, k: np.ndarray, kernel: IkKernel) -> np.ndarray:
        """q . k [H, n, keys] over a Q8_0 key cache repacked to Q8_0_R8 block by block (compute_helper_q)."""
        ints = self._integers(kernel, kernel.convert_rows, key_cells(len(k)))
        assert ints is not None, "Q8_0 converts (formats.IK_KERNELS)"
        return key_products(q, k, "Q8_0", ints, self._activation_format("Q8_0"))

    def latent_attention(self, b: str, q_rope: np.ndarray, q_nope: np.ndarray, cache: np.ndarray, scale: float,
                         kv: KvCache, *, sinks: np.ndarray | None = None, window: int = 0,
                         keep: np.ndarray | None = None,
                         on_latent: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """ik's attention kernels with attn_k_b / attn_v_b per head as ik's kernels multiply them: DeepSeek's plain
        causal form (with GLM's DSA keep mask, ik's sparse mask; DeepSeek's in flash attention under ik's defaults,
        _absorbed_flash), and openPangu's with sinks (its unfused chain, in ik's [latent | rope] layout). A quantized
        latent cache is reproduced in flash attention at the heads ik's own kernel takes (latent_cache_problem)."""
        n, n_head, n_rot = q_rope.shape
        n_lat = cache.shape[1] - n_rot
        problem = None if sinks is not None else self.latent_cache_problem(kv, "decode", None, (n_rot + n_lat, n_lat))
        if problem is not None:
            raise ModelError(problem)
        plain = sinks is None and window == 0
        if len(cache) != n and (sinks is not None or window > 0):
            raise ValueError("a continued sequence's MLA takes no sinks or window")
        if (n_rot + n_lat) % self.lanes or not (plain or sinks is not None):
            return super().latent_attention(b, q_rope, q_nope, cache, scale, kv, sinks=sinks, window=window,
                                            keep=keep, on_latent=on_latent)
        k_b, v_b = self._mla_heads(b, n_head, q_nope.shape[2])
        q_lat = self.head_product(np.ascontiguousarray(q_nope.transpose(1, 0, 2)), b + "attn_k_b.weight", k_b)
        if plain and keep is None and self._absorbed_flash():
            q = np.ascontiguousarray(np.concatenate([q_rope.transpose(1, 0, 2), q_lat], axis=2), dtype=np.float32)
            keys = np.ascontiguousarray(cache[None], dtype=np.float32)
            scores = None
            if kv.k not in FLOAT_CACHES:  # `cache` holds the rows before ik's write: its K x Q, then the values
                scores = self._flash_key_products(q.transpose(1, 0, 2), keys.transpose(1, 0, 2), n_lat, kv.k)
                keys = np.ascontiguousarray(cache_holds(keys, kv.k))
            elif kv.k == "bf16":  # ggml's generic kernel (latent_cache_problem): ggml_vec_dot_bf16
                scores = self._generic_bf16_products(q.transpose(1, 0, 2), cache[:, None])
            latent = flash_attention(q, keys, np.ascontiguousarray(keys[:, :, n_rot:]), scale, self.lanes, scores,
                                     self.options.ik_threads, f16_values=kv.k == "f16")
        elif sinks is None:
            q = np.concatenate([q_rope.transpose(1, 0, 2), q_lat], axis=2)
            bf16 = kv.k == "bf16" and not self.avx2  # ik's bf16 kernel (its AVX2 build: its float kernel, as for F16)
            scores = self._bf16_key_products(q.transpose(1, 0, 2), cache[:, None]) if bf16 else None
            latent = ik_latent_attention(q, cache, n_rot, scale, keep, self.avx2, scores, bf16_values=bf16)
        else:
            q = np.concatenate([q_lat, q_rope.transpose(1, 0, 2)], axis=2)
            lat_first = np.r_[n_rot : n_rot + n_lat, :n_rot]
            t, s = np.arange(n)[:, None], np.arange(n)[None, :]
            visible = (s <= t) & ((t - s < window) if window > 0 else True)
            if keep is not None:
                visible &= keep
            rows = cache[:, lat_first]  # ik's layout, whose blocks a quantized cache rounds (kv_store kept the rows)
            if kv.k not in FLOAT_CACHES:
                rows = cache_holds(rows, kv.k)
            latent = ik_sink_latent_attention(q, rows, sinks[:, lat_first], visible, n_lat, scale,
                                              self.options.ik_sink_overread, self.avx2)
        if on_latent is not None:
            on_latent(latent)
        return self.head_product(latent, b + "attn_v_b.weight", v_b).transpose(1, 0, 2)

    def _absorbed_flash(self) -> bool:
        """Whether ik runs the absorbed form in flash attention (-fa on, mla 3: its defaults) for this file's
        architecture (MLA_FLASH_ARCHS), the queries [q_rope | q_nope x attn_k_b] against the whole latent cache
        rows as keys (one key head) and their latent part as values; else its -fa off graph."""
        return self.weights.metadata.architecture in MLA_FLASH_ARCHS and self.options.flash_attn != "off"

    def _mla_heads(self, b: str, n_head: int, n_nope: int) -> tuple[HeadSource | None, HeadSource | None]:
        """Block `b`'s attn_k_b / attn_v_b: the file's (None), or as ik derives them from its attn_kv_b alone."""
        if self.weights.has(b + "attn_k_b.weight"):
            return None, None
        kvb = b + "attn_kv_b.weight"
        type_name, (rows, n_lat) = self.weights.encoding(kvb).type.name, self.weights.info(kvb).shape
        return (derived_k_b_source(kvb, type_name, n_head, n_nope, n_lat),
                derived_v_b_source(kvb, type_name, n_head, n_nope, rows // n_head - n_nope))

    def materialized_attention(self, b: str, q_rope: np.ndarray, q_nope: np.ndarray, cache: np.ndarray,
                               scale: float, kv: KvCache, *, keep: np.ndarray | None = None) -> np.ndarray:
        """ik's prefill form: attn_kv_b times the latent cache in ik's matmul, keys and values cast to the cache's
        type, then ik's own flash-attention kernel for the head sizes it takes (iqk_flash_attention.py), ggml's
        generic one for the others (flash_attention.py); a keep mask or a derived attn_kv_b keeps this runtime's
        float order around ik's matmuls. Over a quantized latent cache (MLA_QUANTIZED_LATENT; `cache` then holds the
        rows before ik's write) the matmul takes the cache's latent decoded, the keys [roped key | nope] are the
        cache's rope blocks beside the nope keys written in the type (blockwise, so the rows before the write stand
        for both) and multiplied by ik's integer kernel, the values decoded after their write."""
        kvb = b + "attn_kv_b.weight"
        weight_type = self.weights.encoding(kvb).type.name if self.weights.has(kvb) else "absent"
        problem = self.latent_cache_problem(kv, "prefill", (kvb, weight_type))
        if problem is not None:
            raise ModelError(problem)
        if keep is not None or weight_type == "absent":
            return super().materialized_attention(b, q_rope, q_nope, cache, scale, kv, keep=keep)
        _, n_head, n_rope = q_rope.shape
        n_nope, n_keys = q_nope.shape[2], len(cache)
        quantized = kv.k not in FLOAT_CACHES
        bf16 = kv.k == "bf16"
        latent = cache[:, n_rope:]
        if quantized or bf16:
            # ik decodes the cache rows, then converts them to the weight's vec_dot_type: F16 / BF16 rows for those
            # weights (a float input would take its own float kernel), the activation blocks otherwise (as a float)
            latent = cache_holds(cache, kv.k)[:, n_rope:]
            if weight_type in ("F16", "BF16"):
                latent = cache_holds(latent, weight_type.lower())
        kv_rows = self.project(np.ascontiguousarray(latent), kvb).reshape(n_keys, n_head, -1)
        nope = kv_rows[:, :, :n_nope]
        k = np.empty((n_head, n_keys, n_rope + n_nope), dtype=np.float32)
        k[:, :, :n_rope] = cache[None, :, :n_rope]
        k[:, :, n_rope:] = (nope if quantized else cache_holds(nope, kv.k)).transpose(1, 0, 2)
        v = np.ascontiguousarray(cache_holds(kv_rows[:, :, n_nope:], kv.k).transpose(1, 0, 2))
        q = np.ascontiguousarray(np.concatenate([q_rope, q_nope], axis=2).transpose(1, 0, 2), dtype=np.float32)
        scores = self._flash_key_products(q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.shape[2], kv.k) \
            if quantized else self._bf16_key_products(q.transpose(1, 0, 2), k.transpose(1, 0, 2)) if bf16 else None
        return flash_attention(q, k, v, scale, self.lanes, scores, key_step=bf16_k_step_for if bf16 else k_step_for,
                               f16_values=kv.k == "f16").transpose(1, 0, 2)

    # ---- matmuls: ik's kernels ------------------------------------------------------------------------------
    def _format(self, weight_name: str) -> str:
        """The activation format of a matmul with `weight_name` (attn_k_b / attn_v_b: ik's derived ones where the
        file has attn_kv_b alone)."""
        if self.weights.has(weight_name):
            return self._activation_format(self.weights.encoding(weight_name).type.name)
        kv_b_type = self.weights.encoding(weight_name.replace("attn_k_b", "attn_kv_b").replace(
            "attn_v_b", "attn_kv_b")).type.name
        return self._activation_format(derived_k_b_type(kv_b_type) if "attn_k_b" in weight_name else kv_b_type)

    def _activation_format(self, type_name: str) -> str:
        """The format ik rounds a matmul's activations to for `type_name` weights."""
        return activation_format(type_name)

    def activations(self, x: np.ndarray, weight_name: str) -> np.ndarray:
        """x rounded as ik rounds the activations of a matmul with `weight_name`."""
        return round_activations(x, self._format(weight_name))

    def _kernel_threads(self, n_matrices: int) -> int:
        """The threads ik gives each of `n_matrices` equal matrices it multiplies at once (one per head): its
        --ik-threads divided by their greatest common divisor with the count (ik's split of a batched matmul)."""
        return self.options.ik_threads // math.gcd(n_matrices, self.options.ik_threads)

    def _converted(self, name: str, n_act_rows: int, weight_rows: int, threads: int | None) -> np.ndarray | None:
        """The weights ik's kernel multiplies `name` as in a matmul with `n_act_rows` activation rows (of matrices
        of `weight_rows` rows, `threads` ik threads each), in float32, where they are not its exact decoding
        (formats.py); else None."""
        kernel = ik_kernel(self.weights.encoding(name).type.name)
        values = kernel.float_values(n_act_rows, weight_rows, threads, self.row_group)
        if values is None:
            return None
        kind = DERIVED + CONVERTED * kernel.converts(n_act_rows, weight_rows, threads, self.row_group)
        shape = self.weights.info(name).shape
        return self.weights.derived(name, lambda raw, decoded: values(raw, decoded).to_float().reshape(shape), kind)

    def _integers(self, kernel: IkKernel, n_act_rows: int, n_weight_rows: int,
                  threads: int | None = None) -> ToInts | None:
        """The integers (and float order) `kernel` multiplies its weights as in a matmul of `n_act_rows` activation
        rows (IkKernel.integers)."""
        return kernel.integers(n_act_rows, n_weight_rows, threads, self.row_group)

    def _packed(self, name: str, n_act_rows: int, threads: int | None) -> PackedInts | None:
        """The integers ik's kernel multiplies the 2-D weight `name` as (its rows shared by `threads` ik threads),
        packed for qmatmul; None where it multiplies floats."""
        kernel = ik_kernel(self.weights.encoding(name).type.name)
        rows = self.weights.info(name).shape[0]
        ints = self._integers(kernel, n_act_rows, rows, threads)
        if ints is None:
            return None
        kind = PACKED + CONVERTED * kernel.converts(n_act_rows, rows, threads, self.row_group)
        return self.weights.derived(name, lambda raw, decoded: pack(ints(raw, decoded)), kind,
                                    direct=self._direct(kernel, n_act_rows, rows, threads))

    def _direct(self, kernel: IkKernel, n_act_rows: int, n_weight_rows: int,
                threads: int | None = None) -> Callable[[np.ndarray], PackedInts | None] | None:
        """What makes `_integers`' result packed straight from the raw rows, where something does
        (IkKernel.packed)."""
        return kernel.packed(n_act_rows, n_weight_rows, threads, self.row_group)

    def _float_kind(self, name: str) -> str | None:
        """F32, F16 or BF16 where ik multiplies weight `name` in its float kernels on rows they take whole."""
        type_name = self.weights.encoding(name).type.name
        return type_name if type_name in IK_FLOAT_TYPES and self._takes_whole(self.weights.info(name).n_per_row,
                                                                               type_name) else None

    def _bf16_kernel(self, type_name: str) -> bool:
        """Whether ik multiplies `type_name` weights in its bf16 kernel."""
        return type_name == "BF16"

    def _takes_whole(self, n_per_row: int, type_name: str) -> bool:
        return takes_whole(n_per_row, self._bf16_kernel(type_name), self.lanes)

    def _float_matmul(self, x: np.ndarray, w: np.ndarray, type_name: str) -> np.ndarray:
        """x (rounded as ik rounds it for `type_name`) @ w^T in ik's float kernel for that type."""
        return ik_float_matmul(x, w, self._bf16_kernel(type_name), self.lanes)

    def project(self, x: np.ndarray, weight_name: str, shared: dict[str, Any] | None = None,
                fused: bool = False) -> np.ndarray:
        """ik's matmul: `shared` keeps x's integer rows per activation format for the next weight on the same
        input; `fused`: ik multiplies it in its fused up-gate op, whose kernel choice does not depend on its thread
        count (--ik-threads)."""
        threads = None if fused else self.options.ik_threads
        packed = self._packed(weight_name, len(x), threads)
        if packed is not None:
            return qmatmul(self._integer_rows(x, weight_name, shared), packed)
        if self._native(weight_name):
            file_rows = self.weights.derived(weight_name, lambda raw, decoded: raw.copy(), FILE_ROWS,
                                             direct=lambda raw: raw.copy())
            return native_matmul(self._integer_rows(x, weight_name, shared),
                                 file_rows.reshape(self.weights.info(weight_name).shape[0], -1),
                                 self.weights.encoding(weight_name).type.name, avx2=self.avx2)
        x = self.activations(x, weight_name)
        converted = self._converted(weight_name, len(x), self.weights.info(weight_name).shape[0], threads)
        if converted is not None:
            return x @ converted.T
        kind = self._float_kind(weight_name)
        if kind is not None and self.weights.is_half(weight_name):  # a streamed pass: the file's bits, widened
            return self._on_halves(weight_name, lambda w: self._float_matmul(x, w, kind))  # as the kernel loads them
        if kind is not None and self.weights.fits(self.weights.decoded_bytes(weight_name)):
            # a 1-D weight is one row, as ggml multiplies it (ik's quantizer writes ffn_gate_inp_shexp as a vector)
            w = self.weights.decode(weight_name)
            return self._float_matmul(x, w.reshape(-1, w.shape[-1]), kind)
        return super().project(x, weight_name)

    def _integer_rows(self, x: np.ndarray, weight_name: str, shared: dict[str, Any] | None) -> IntRows:
        """x as the integer rows of the weight's activation format, taken from / kept in `shared` (project)."""
        fmt = self._format(weight_name)
        rows = shared.get(fmt) if shared is not None else None
        if rows is None:
            rows = integer_rows(x, fmt)
            if shared is not None:
                shared[fmt] = rows
        return rows

    def matmul_weight(self, name: str, n_act_rows: int, weight_rows: int | None = None) -> np.ndarray:
        """Weight `name` as ik's kernel converts it when it does, else its exact decoding."""
        rows = self.weights.info(name).n_rows if weight_rows is None else weight_rows
        converted = self._converted(name, n_act_rows, rows,
                                    self._kernel_threads(self.weights.info(name).n_rows // rows))
        return self.weights.decode(name) if converted is None else converted

    def head_product(self, x: np.ndarray, name: str, source: HeadSource | None = None) -> np.ndarray:
        """Each head's slice as ik's kernel multiplies it (the slice is the matrix it sees): in its float kernels,
        in integers where it holds them, else the converted floats against the rounded activations. `source`: the
        rows ik derives for `name` at load (mla_weights.py), where the file does not carry it."""
        n_head, n, n_in = x.shape
        src = source if source is not None else HeadSource(name, self.weights.encoding(name).type.name)
        rows = src.head_rows or self.weights.info(name).n_elements // (n_head * n_in)  # a 3-D [H, rows, in] too
        fmt = self._activation_format(src.type_name)
        if src.type_name in IK_FLOAT_TYPES and self._takes_whole(n_in, src.type_name):
            w = (self.weights.decode(name) if source is None else
                 self.weights.derived(src.name, lambda raw, dec: src.rows(raw, dec)[1], DERIVED + src.kind))
            xr = round_activations(x, fmt)
            w = w.reshape(n_head, rows, -1)
            return np.stack([self._float_matmul(xr[h], w[h], src.type_name) for h in range(n_head)])
        kernel = ik_kernel(src.type_name)
        threads = self._kernel_threads(n_head)
        converts = CONVERTED * kernel.converts(n, rows, threads, self.row_group)
        ints = self._integers(kernel, n, rows, threads)
        if ints is None:
            if source is None and self._native(name):  # each head's rows in the type's own kernel
                raw = self.weights.encoding(name).raw.reshape(n_head, rows, -1)
                return np.stack([native_matmul(integer_rows(x[h], fmt), raw[h], src.type_name, self.avx2)
                                 for h in range(n_head)])
            if source is None:
                return self.sliced_product(x, name)
            values = kernel.float_values(n, rows, threads, self.row_group)

            def floats(raw: np.ndarray, decoded: np.ndarray) -> np.ndarray:
                taken = src.rows(raw, decoded)
                return taken[1] if values is None else values(*taken).to_float()

            w = self.weights.derived(src.name, floats, DERIVED + converts + src.kind).reshape(n_head, rows, -1)
            return np.matmul(round_activations(x, fmt), w.transpose(0, 2, 1))

        def make(raw: np.ndarray, decoded: np.ndarray) -> PackedHeads:
            whole = ints(*src.rows(raw, decoded))
            return PackedHeads(tuple(pack(row_slice(whole, h * rows, (h + 1) * rows)) for h in range(n_head)))

        heads = self.weights.derived(src.name, make, HEADS + converts + src.kind)
        return np.stack([qmatmul(integer_rows(x[h], fmt), heads.heads[h]) for h in range(n_head)])

    # ---- routed experts ---------------------------------------------------------------------------------------
    def _expert_ints(self, name: str, count: int) -> ToInts | None:
        kernel = ik_kernel(self.weights.encoding(name).type.name)
        return self._integers(kernel, count, self.weights.info(name).shape[1])

    def expert_ints(self, name: str, expert: int, count: int) -> PackedInts | None:
        """The packed integers ik's kernel multiplies expert `expert` of the 3-D tensor `name` as when `count`
        tokens are routed to it; None where it multiplies floats."""
        ints = self._expert_ints(name, count)
        if ints is None:
            return None
        kernel = ik_kernel(self.weights.encoding(name).type.name)
        rows = self.weights.info(name).shape[1]
        return self.weights.derived_expert(name, expert, lambda raw, decoded: pack(ints(raw, decoded)),
                                           keep=self.weights.keeps_experts,
                                           kind=PACKED + CONVERTED * kernel.converts(count, rows, row_group=self.row_group),
                                           direct=self._direct(kernel, count, rows))

    def _native_rows(self, name: str, expert: int) -> NativeRows:
        """Expert `expert` of the 3-D tensor `name` as the file's rows, for its type's own kernel."""
        n_expert, rows, _ = self.weights.info(name).shape
        raw = self.weights.encoding(name).raw.reshape(n_expert, rows, -1)[expert]
        return NativeRows(raw, self.weights.encoding(name).type.name, self.avx2)

    def reads_file_rows(self, name: str, counts: np.ndarray) -> bool:
        """ik's own kernels reproduced in native.py read the experts' rows, where it converts none of them (below
        the type's conversion threshold; IQ6_K's own kernel multiplies other values than its decoding, so
        multiplies_decoding alone would not say so)."""
        kernel, rows = ik_kernel(self.weights.encoding(name).type.name), self.weights.info(name).shape[1]
        return self._native(name) and not any(kernel.converts(c, rows, row_group=self.row_group)
                                              for c in np.unique(counts).tolist())

    def _native(self, name: str) -> bool:
        """Whether weight `name` is multiplied in ik's own kernel of its type where ik does not convert it
        (native.native_types: which are reproduced)."""
        return self.weights.encoding(name).type.name in native_types()

    def multiplies_decoding(self, name: str, counts: np.ndarray) -> bool:
        """Whether ik's kernels multiply experts of `name` with `counts` routed tokens each as the exact decoding
        (no conversion, no rescaled or native values: IkKernel.float_values)."""
        kernel, rows = ik_kernel(self.weights.encoding(name).type.name), self.weights.info(name).shape[1]
        return all(kernel.float_values(c, rows, row_group=self.row_group) is None for c in np.unique(counts).tolist())

    def convert_experts(self, name: str, ids: np.ndarray, counts: np.ndarray, mats: np.ndarray) -> np.ndarray:
        """Each expert as ik multiplies it for its token count (ik decides per expert: is_dequant_better on the rows
        routed to it): in place, or in a copy where `mats` is a view of the cached decoding (select_experts)."""
        kernel = ik_kernel(self.weights.encoding(name).type.name)
        n_expert, rows, _ = self.weights.info(name).shape
        raw = self.weights.encoding(name).raw.reshape(n_expert, rows, -1)
        for j, (e, count) in enumerate(zip(ids.tolist(), counts.tolist())):
            values = kernel.float_values(int(count), rows, row_group=self.row_group)
            if values is not None:
                if not mats.flags.owndata:
                    mats = mats.copy()
                mats[j] = values(np.ascontiguousarray(raw[e]), mats[j]).to_float()
        return mats

    def routed_experts(self, x: np.ndarray, sel: np.ndarray, w: np.ndarray, n_expert: int, names: list[str],
                       group: int | None, glu: ExpertGlu, keep_act: bool,
                       batches: np.ndarray | None = None) -> RoutedExperts:
        """ik chooses each expert's kernel by the tokens routed to it in a micro-batch (`batches`: each row's
        micro-batch, ffn.micro_batches). The rows of all micro-batches for which an expert's choice is the same run
        as one product, its weights converted once (each row's result is its own, so the bits are the batches'):
        expert e under choice c is the virtual expert e + c n_expert."""
        labels = np.unique(batches, return_inverse=True)[1] if batches is not None else None
        if labels is None or labels.max(initial=0) == 0:
            return self._routed_batch(x, sel, w, n_expert, names, group, glu, keep_act,
                                      np.bincount(sel.reshape(-1), minlength=n_expert))
        n_batches = int(labels.max()) + 1
        per_batch = np.zeros((n_batches, n_expert), np.int64)
        np.add.at(per_batch, (np.repeat(labels, sel.shape[1]), sel.reshape(-1)), 1)
        choice = self._kernel_choices(names, per_batch)
        counts = np.zeros((1 << len(names)) * n_expert, np.int64)  # a count making each virtual expert's choice
        for b in range(n_batches):
            ids = np.arange(n_expert) + choice[b] * n_expert
            counts[ids] = np.maximum(counts[ids], per_batch[b])
        virtual = (sel + (choice[labels] * n_expert)[np.arange(len(sel))[:, None], sel]).astype(sel.dtype)
        res = self._routed_batch(x, virtual, w, len(counts), names, group, glu, keep_act, counts, n_expert)
        order, offsets = group_by_expert(sel, n_expert)
        return RoutedExperts(res.out, res.act, order, offsets)

    def _kernel_choices(self, names: list[str], counts: np.ndarray) -> np.ndarray:
        """What ik's kernels choose for experts with `counts` routed tokens (any shape): bit i set where it converts
        matrix names[i] (the only choice a token count makes: IkKernel.converts)."""
        choice = np.zeros(counts.shape, np.int64)
        values, inverse = np.unique(counts, return_inverse=True)
        for i, name in enumerate(names):
            kernel, rows = ik_kernel(self.weights.encoding(name).type.name), self.weights.info(name).shape[1]
            converts = np.array([kernel.converts(int(c), rows, row_group=self.row_group) for c in values.tolist()], np.int64)
            choice |= converts[inverse.reshape(counts.shape)] << i
        return choice

    def _routed_batch(self, x: np.ndarray, sel: np.ndarray, w: np.ndarray, n_expert: int, names: list[str],
                      group: int | None, glu: ExpertGlu, keep_act: bool, counts: np.ndarray,
                      n_real: int | None = None) -> RoutedExperts:
        """The routed experts as ik computes them, per expert ik's choice at its token count `counts[e]`: integers
        where ik multiplies all three matrices in integers, else its float kernels or the converted floats against
        the rounded activations. With `n_real`, the ids in sel are virtual: expert e is the tensors' e % n_real."""
        up, gate, down = names
        formats = (self._format(up), self._format(gate), self._format(down))
        types = (self.weights.encoding(up).type.name, self.weights.encoding(gate).type.name,
                 self.weights.encoding(down).type.name)
        real = n_real or n_expert
        if glu.biases is not None and real != n_expert:  # each virtual expert's biases are its tensor expert's
            up_b, gate_b, down_b = (np.tile(b, (n_expert // real, 1)) for b in glu.biases)
            glu = replace(glu, biases=(up_b, gate_b, down_b))

        def ints(e: int) -> tuple[ExpertProduct, ExpertProduct, ExpertProduct] | None:
            count = int(counts[e])
            held = [self._expert_ints(name, count) is not None for name in names]
            if not all(held) and not (any(held) and all(h or self._native(n) for h, n in zip(held, names))):
                return None  # its floats, or (all three in their own kernels) the experts' batched product
            products = [self.expert_ints(name, e % real, count) if h else self._native_rows(name, e % real)
                        for h, name in zip(held, names)]
            assert products[0] is not None and products[1] is not None and products[2] is not None
            return products[0], products[1], products[2]

        return moe_experts(x, sel, w, n_expert, self.expert_fetch(names, counts, n_real), group, glu, formats, ints,
                           keep_act=keep_act, ik=types, avx2=self.avx2, done=lambda: self.weights.release(names))
