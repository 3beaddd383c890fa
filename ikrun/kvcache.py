"""The KV cache's types: what `--kv-cache`, `--cache-type-k/-ctk` and `--cache-type-v/-ctv` ask for, checked against
the model before any compute, and how a cache of each type holds the keys and values written into it.

ik writes a cache with `ggml_cpy` from float32: its type's row quantizer (ikquant/formats/cache_rows.py) over every
32-value block of a head's keys or values (of the MLA latent row [roped key | latent] for DeepSeek's caches,
[latent | roped key] for openPangu's). The
exact arithmetic reads back what that wrote (decoded exactly), so a cache type's cost is measured alone.

With `--k-cache-hadamard/-khad` (`--v-cache-hadamard/-vhad`) ik rotates the keys (values) by a Walsh-Hadamard
transform over blocks of each head (of 64 values of DeepSeek's latent row) before the write and rotates the queries
(the attention output) to match; exactly, the cache then holds H(dequantize(quantize(H x))). As ik does, the
transform is dropped for an unquantized cache and for heads no block size divides.

The DSA indexer's key cache (`--indexer-cache-type-k/-ictk`, glm-dsa, openPangu and DeepSeek-V4) holds each layer's
indexer keys (glm-dsa's and DeepSeek-V4's Walsh-Hadamard-rotated first, as ik rotates them and the queries whatever
the type); unset, it is ik's default F16 where the K cache is not F32 (ik's -ictk default does not follow -ctk) and
F32 otherwise.

DeepSeek-V4 keeps keys alone (its attention reads the values from the same rows): its raw window, CSA and HCA
caches take -ctk's type, which ik takes as f16, bf16 or q8_0 without a Hadamard transform; ik ignores -ctv there.

`--kv-cache` stays the shorthand it was: f32 (both caches F32, the default: the weights alone), f16 (both F16, ik's
default), k-f32 (F32 keys, F16 values: ik's -ctk f32 without flash attention); -ctk / -ctv override one side each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ikquant.formats.cache_rows import CACHE_WRITE_TYPES, cache_round_trip
from ikquant.types import type_by_name
from ikrun.errors import ModelError
from ikrun.ops.f16 import f16_rounded
from ikrun.ops.indexer import hadamard

if TYPE_CHECKING:
    from ikrun.context import Context
    from ikrun.numerics.exact import Numerics

#: the --kv-cache shorthands: (K type, V type)
KV_SHORTHANDS = {"f32": ("f32", "f32"), "f16": ("f16", "f16"), "k-f32": ("f32", "f16")}
#: the names ik's -ctk / -ctv accept (common.cpp kv_cache_type_from_str), as ik spells them
IK_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1", "q6_0", "q8_KV")
#: the cache types (ik's names) that hold floats; ik writes the others blockwise quantized
FLOAT_CACHES = ("f32", "f16", "bf16")
#: the architectures whose caches a type other than f32/f16 is reproduced for: grouped-query K/V caches, the MLA
#: latent caches of DeepSeek, GLM-5 DSA (DeepSeek's graph in ik) and openPangu, and DeepSeek-V4's key caches
QUANTIZED_CACHE_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "glm4moe", "minimax-m2", "gpt-oss", "deepseek2",
                         "glm-dsa", "deepseek4", "openpangu")
#: the architectures whose MLA latent cache ik takes in a few types only -> those (-ctk; llama.cpp refuses others)
LATENT_CACHE_TYPES = {"openpangu": ("f32", "f16", "q8_0")}
#: the architectures with a DSA indexer key cache reproduced here -> the -ictk types ik takes for it (None: all)
INDEXER_CACHE_TYPES: dict[str, tuple[str, ...] | None] = {"glm-dsa": None,
                                                           "openpangu": ("f32", "f16", "bf16", "q8_0"),
                                                           "deepseek4": ("f16", "bf16", "q8_0")}
#: the architectures whose caches hold keys alone (the attention reads its values from them) -> the -ctk types ik
#: takes for them (f32 besides: iktools' default, the weights alone)
KEY_ONLY_CACHES = {"deepseek4": ("f16", "bf16", "q8_0")}


def ggml_name(ik_name: str) -> str:
    """The GGML type name of a cache type as ik spells it (q8_0 -> Q8_0, q8_KV -> Q8_KV)."""
    return ik_name.upper()


@dataclass(frozen=True)
class KvCache:
    """The K and V caches' types, as ik spells them."""

    k: str = "f32"
    v: str = "f32"
    #: the block of ik's Hadamard transform of the keys (values) around the cache, 0: none
    k_hadamard: int = 0
    v_hadamard: int = 0
    #: the DSA indexer's key cache type (-ictk); None until resolved against the model (check_cache)
    indexer: str | None = None

    @property
    def label(self) -> str:
        """The --kv-cache shorthand these types are, or `k-<type>,v-<type>`; `,khad` / `,vhad` for the transforms."""
        label = next((name for name, pair in KV_SHORTHANDS.items() if pair == (self.k, self.v)),
                     f"k-{self.k},v-{self.v}")
        return label + ",khad" * bool(self.k_hadamard) + ",vhad" * bool(self.v_hadamard)

    def report(self) -> dict[str, str | int]:
        """The cache types as a run's report names them."""
        report: dict[str, str | int] = {"cache_type_k": self.k, "cache_type_v": self.v,
                                        "k_cache_hadamard": self.k_hadamard, "v_cache_hadamard": self.v_hadamard}
        if self.indexer is not None:
            report["indexer_cache_type_k"] = self.indexer
        return report


def hadamard_size(head_size: int) -> int:
    """ik's Hadamard block for a head: the head when a power of two, else the largest of 512 .. 64 dividing it, else
    0 (no transform)."""
    if head_size & (head_size - 1) == 0:
        return head_size
    return next((b for b in (512, 256, 128, 64) if head_size % b == 0), 0)


@dataclass(frozen=True)
class CacheRequest:
    """The cache options a run was given (Model's arguments, before check_cache resolves them against the model):
    what a worker loading the same model is handed, so that it resolves them as the driver did (a resolved type
    named as an option may be refused: DeepSeek-V4's indexer cache resolves to f32 with f32 keys, which -ictk does
    not take)."""

    kv_cache: str = "f32"
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    k_cache_hadamard: bool = False
    v_cache_hadamard: bool = False
    indexer_cache_type_k: str | None = None


def requested_cache(r: CacheRequest) -> KvCache:
    """The caches --kv-cache, -ctk / -ctv, -khad / -vhad and -ictk ask for (a Hadamard block of 1: asked for, its
    size still to be found from the model); a name ik does not take is refused."""
    if r.kv_cache not in KV_SHORTHANDS:
        raise ModelError(f"--kv-cache {r.kv_cache}: not one of {', '.join(KV_SHORTHANDS)}")
    k, v = KV_SHORTHANDS[r.kv_cache]
    for flag, name in (("--cache-type-k", r.cache_type_k), ("--cache-type-v", r.cache_type_v),
                       ("--indexer-cache-type-k", r.indexer_cache_type_k)):
        if name is not None and name not in IK_CACHE_TYPES:
            raise ModelError(f"{flag} {name}: not a cache type ik takes ({', '.join(IK_CACHE_TYPES)})")
    return KvCache(r.cache_type_k or k, r.cache_type_v or v, int(r.k_cache_hadamard), int(r.v_cache_hadamard),
                   r.indexer_cache_type_k)


def _indexer_cache(cache: KvCache, cx: Context) -> str | None:
    """The indexer key cache's type for this model (None: it has none), refusing an -ictk it cannot take."""
    name = cache.indexer
    if cx.arch not in INDEXER_CACHE_TYPES:
        if name is not None:
            raise ModelError(f"--indexer-cache-type-k {name}: {cx.path} is {cx.arch}, which has no DSA indexer key "
                             f"cache reproduced here (those of: {', '.join(INDEXER_CACHE_TYPES)})")
        return None
    if name is None:
        return None if cx.options.dsa is False else "f32" if cache.k == "f32" else "f16"
    if cx.options.dsa is False:
        raise ModelError(f"--indexer-cache-type-k {name}: --dsa off runs no indexer, so {cx.path} has no indexer "
                         "cache to set")
    taken = INDEXER_CACHE_TYPES[cx.arch]
    if taken is not None and name not in taken:
        raise ModelError(f"--indexer-cache-type-k {name}: {cx.path} is {cx.arch}, whose indexer key cache ik takes as "
                         f"{', '.join(taken)} only")
    if name == "q8_KV":
        raise ModelError(f"--indexer-cache-type-k {name}: ik takes it, but its indexer scores over q8_KV rows are not "
                         "reproduced here")
    if ggml_name(name) not in CACHE_WRITE_TYPES:
        raise ModelError(f"--indexer-cache-type-k {name}: ik takes it, but its cache writes are not reproduced here; "
                         "reproduced: " + ", ".join(t.lower() for t in CACHE_WRITE_TYPES))
    width = cx.hparam("attention.indexer.key_length", 0)
    block = type_by_name(ggml_name(name)).block_size
    if width % block:
        raise ModelError(f"--indexer-cache-type-k {name}: the indexer key length of {cx.path} is {width}, not a "
                         f"multiple of {name}'s block of {block} values")
    return name


def check_cache(cache: KvCache, cx: Context, numerics: Numerics, given: tuple[str | None, str | None]) -> KvCache:
    """The caches a run keeps (Hadamard blocks and the indexer cache resolved as ik resolves them); refuses what
    this model (or the arithmetic) cannot hold, naming the option and the model's fact. `given`: the -ctk and -ctv
    values given (under ik's arithmetic, which reproduces ik's F16 caches, only f16 is accepted, an F32 key cache
    for models without a latent cache and the quantized key caches `numerics.check_key_cache` takes; the indexer
    cache is written as in the exact arithmetic)."""
    asked_indexer = cache.indexer
    cache = replace(cache, indexer=_indexer_cache(cache, cx))
    if cx.arch in KEY_ONLY_CACHES:
        _check_key_only(cache, cx, given[1], asked_indexer, numerics.name)
    if cx.arch in LATENT_CACHE_TYPES:
        _check_latent_types(cache, cx, given[0] or "f16")
    if numerics.name != "exact" and numerics.options.flash_attn == "off" and cx.hparam("attention.kv_lora_rank", 0):
        return _latent_without_flash(cache, cx, given)
    if numerics.name != "exact":
        problem = numerics.check_key_cache(cx.arch, given[0] or "f16")
        if problem is not None:
            raise ModelError(f"--cache-type-k {given[0]}: {problem}")
        keys = given[0] if given[0] in ("f32", "bf16") else cache.k
        if given[1] not in (None, "f16"):
            n_head = cx.hparam("attention.head_count")
            head_dim = cx.hparam("attention.key_length", cx.hparam("embedding_length") // n_head)
            problem = (f"{cx.path} ({cx.arch}) caches MLA's latent alone, in -ctk's type under flash attention (ik's "
                       "default, which ignores -ctv)" if cx.hparam("attention.kv_lora_rank", 0)
                       else numerics.check_value_cache(cx.arch, replace(cache, k=keys, v=given[1]), head_dim))
            if problem is not None:
                raise ModelError(f"--cache-type-v {given[1]}: {problem}")
        if keys not in FLOAT_CACHES and cache.k_hadamard and cx.hparam("attention.kv_lora_rank", 0):
            raise ModelError(f"--k-cache-hadamard: --numerics {numerics.name} does not reproduce ik's transform of "
                             f"{cx.path}'s quantized MLA latent cache")
        if keys == "f32" and cx.hparam("attention.kv_lora_rank", 0):
            raise ModelError(f"--cache-type-k f32: --numerics {numerics.name} reproduces an F32 key cache for "
                             f"grouped-query attention, not {cx.path}'s latent cache")
        if keys in FLOAT_CACHES:  # ik drops the transform around a cache it does not quantize
            cache = replace(cache, k=keys, k_hadamard=0)
        if cache.v == "f16":
            cache = replace(cache, v_hadamard=0)
            if keys in FLOAT_CACHES:
                return cache
    for flag, name in (("--cache-type-k", cache.k), ("--cache-type-v", cache.v)):
        if ggml_name(name) not in CACHE_WRITE_TYPES:
            raise ModelError(f"{flag} {name}: ik takes it, but its cache writes are not reproduced here; reproduced: "
                             + ", ".join(t.lower() for t in CACHE_WRITE_TYPES))
        if name not in ("f32", "f16") and cx.arch not in QUANTIZED_CACHE_ARCHS:
            raise ModelError(f"{flag} {name}: {cx.path} is {cx.arch}, whose caches are reproduced as f32 or f16 only "
                             f"(other types: {', '.join(QUANTIZED_CACHE_ARCHS)})")
    latent = cx.hparam("attention.kv_lora_rank", 0)
    if latent:
        if cache.v not in ("f32", "f16"):
            raise ModelError(f"--cache-type-v {cache.v}: {cx.path} ({cx.arch}) caches MLA's latent alone, whose type "
                             "--cache-type-k sets")
        head_k, block = cx.hparam("attention.key_length"), type_by_name(ggml_name(cache.k)).block_size
        if head_k % block:  # ik asserts it of every model's key cache type
            raise ModelError(f"--cache-type-k {cache.k}: the key head size of {cx.path} is {head_k}, not a multiple "
                             f"of {cache.k}'s block of {block} values (ik aborts)")
        rows = {"--cache-type-k": ("the MLA latent cache row (latent + rope dims)",
                                   latent + cx.hparam("rope.dimension_count"))}
        blocks = {"--cache-type-k": 64}
    else:
        n_head = cx.hparam("attention.head_count")
        head_k = cx.hparam("attention.key_length", cx.hparam("embedding_length") // n_head)
        rows = {"--cache-type-k": ("the key head size", head_k),
                "--cache-type-v": ("the value head size", cx.hparam("attention.value_length", head_k))}
        blocks = {flag: hadamard_size(width) for flag, (_, width) in rows.items()}
    for flag, (what, width) in rows.items():
        name = cache.k if flag == "--cache-type-k" else cache.v
        block = type_by_name(ggml_name(name)).block_size
        if width % block:
            raise ModelError(f"{flag} {name}: {what} of {cx.path} is {width}, not a multiple of {name}'s block of "
                             f"{block} values")
    k_block, v_block = (blocks.get(flag, 0) if type_by_name(ggml_name(name)).block_size > 1 else 0
                        for flag, name in (("--cache-type-k", cache.k), ("--cache-type-v", cache.v)))
    if cache.k_hadamard and k_block and rows["--cache-type-k"][1] % k_block:
        raise ModelError(f"--k-cache-hadamard: {rows['--cache-type-k'][0]} of {cx.path} is "
                         f"{rows['--cache-type-k'][1]}, not a multiple of ik's Hadamard block of {k_block}")
    return replace(cache, k_hadamard=k_block * cache.k_hadamard, v_hadamard=v_block * cache.v_hadamard)


def _latent_without_flash(cache: KvCache, cx: Context, given: tuple[str | None, str | None]) -> KvCache:
    """The caches of ik's -fa off graph for a model whose cache holds MLA's latent alone (--flash-attn off, which ik's
    arithmetics take for DeepSeek's graph): llama.cpp keeps the latent in -ctv's type there (under -mla 3) and never
    reads -ctk, and ik refuses a V cache other than f16 or bf16 without flash attention. A bf16 latent's products
    are ik's bf16 kernel's (its AVX2 build's float kernel's); a -ctk other than f16 is refused as changing nothing."""
    keys, values = given
    if keys not in (None, "f16"):
        raise ModelError(f"--cache-type-k {keys}: with --flash-attn off ik keeps the MLA latent cache of {cx.path} in "
                         f"-ctv's type and never reads -ctk (its figures for -ctk {keys} there are its f16 cache's); "
                         "-ctk sets the latent's type under flash attention, ik's default")
    if values in (None, "f16"):
        return replace(cache, k="f16", v="f16", k_hadamard=0, v_hadamard=0)
    if values != "bf16":
        raise ModelError(f"--cache-type-v {values}: ik refuses a V cache other than f16 or bf16 without flash "
                         "attention (--flash-attn off)")
    return replace(cache, k="bf16", v="bf16", k_hadamard=0, v_hadamard=0)


def _check_key_only(cache: KvCache, cx: Context, values: str | None, indexer: str | None, arithmetic: str) -> None:
    """Refuse for a model whose caches hold keys alone (KEY_ONLY_CACHES) what ik refuses or ignores there: a value
    cache type (`values`: the -ctv given), a Hadamard transform, a key cache type its graph does not take; under
    ik's `arithmetic` (not "exact"), an indexer key cache asked for (`indexer`: the -ictk given) other than its
    default f16 (ik's scores over quantized keys, with the queries rounded to 8 bits, are not reproduced)."""
    taken = KEY_ONLY_CACHES[cx.arch]
    if arithmetic != "exact" and indexer not in (None, "f16"):
        raise ModelError(f"--indexer-cache-type-k {indexer}: --numerics {arithmetic} reproduces ik's f16 "
                         f"indexer key cache of {cx.path} ({cx.arch}) only; the exact arithmetic takes "
                         f"{', '.join(taken)}")
    if values not in (None, "f32", "f16"):
        raise ModelError(f"--cache-type-v {values}: {cx.path} ({cx.arch}) reads its values from its key cache "
                         "(ik ignores -ctv for it): --cache-type-k sets both")
    if cache.k_hadamard or cache.v_hadamard:
        flag = "--k-cache-hadamard" if cache.k_hadamard else "--v-cache-hadamard"
        raise ModelError(f"{flag}: ik writes the caches of {cx.path} ({cx.arch}) untransformed (it refuses -khad)")
    if cache.k not in ("f32", *taken):
        raise ModelError(f"--cache-type-k {cache.k}: ik takes the key caches of {cx.path} ({cx.arch}) as "
                         f"{', '.join(taken)} only")


def _check_latent_types(cache: KvCache, cx: Context, keys: str) -> None:
    """Refuse what ik refuses for a model whose latent cache it takes in a few types (LATENT_CACHE_TYPES): another
    -ctk (`keys`: the one given, or ik's default), a Hadamard transform (its graph writes the rows as they are)."""
    taken = LATENT_CACHE_TYPES[cx.arch]
    if keys not in taken:
        raise ModelError(f"--cache-type-k {keys}: ik takes the MLA latent cache of {cx.path} ({cx.arch}) as "
                         f"{', '.join(taken)} only")
    if cache.k_hadamard:
        raise ModelError(f"--k-cache-hadamard: ik writes the latent cache of {cx.path} ({cx.arch}) untransformed")


def indexer_cache_holds(k: np.ndarray, cache_type: str, hadamard_block: int) -> np.ndarray:
    """Indexer keys k [keys, d] as an indexer key cache of `cache_type` holds them when ik rotates them by its
    Hadamard transform over blocks of `hadamard_block` values before the write whatever the type (and the queries
    to match, which leaves the scores the product with the keys rotated back); an F32 cache holds them as they
    are (the weights alone: ik takes none)."""
    if cache_type == "f32":
        return k
    rotated = cache_holds(blockwise_hadamard(k, hadamard_block), cache_type)
    return blockwise_hadamard(rotated.astype(np.float32, copy=False), hadamard_block)


def cache_holds(x: np.ndarray, cache_type: str, hadamard_block: int = 0) -> np.ndarray:
    """Rows x [..., width] as a cache of `cache_type` holds them: each row written with ik's cache quantizer and
    decoded exactly; with a `hadamard_block`, rotated by ik's Hadamard transform over blocks of that many values
    before the write and rotated back after the read."""
    if cache_type == "f32":
        return x
    if cache_type == "f16":
        return f16_rounded(x)
    rows = x.reshape(-1, x.shape[-1])
    if hadamard_block:
        rows = blockwise_hadamard(rows, hadamard_block)
    held = cache_round_trip(ggml_name(cache_type), rows)
    if hadamard_block:
        held = blockwise_hadamard(held, hadamard_block)
    return held.reshape(x.shape)


def blockwise_hadamard(x: np.ndarray, block: int) -> np.ndarray:
    """ik's Hadamard transform (ggml_hadamard) over consecutive blocks of `block` values of each row x [..., width]
    (its own inverse)."""
    return hadamard(x.reshape(*x.shape[:-1], -1, block)).reshape(x.shape)
