"""The one registry of ggml tensor types, as ik_llama.cpp numbers and sizes them.

PyPI `gguf` only knows mainline's type ids; ik_llama.cpp adds its own (Q6_0 = 133, the IQK family 137-157,
the trellis types 153-158) and row-scaled types whose rows start with a per-row header. Every size or offset
computation in the project goes through `GGMLType.row_bytes` / `tensor_bytes` so those headers are never forgotten.
Format modules attach their codec with `register_codec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ikquant.errors import CodecMissingError, UnknownTypeError

if TYPE_CHECKING:
    from ikquant.formats.base import Codec


@dataclass(eq=False)
class GGMLType:
    """One ggml type: enum id, the name ik prints, and its storage geometry."""

    name: str
    ggml_name: str
    id: int
    block_size: int
    type_size: int
    row_meta_size: int = 0
    codec: Codec | None = field(default=None, repr=False)
    #: interleaved types: rows are stored in groups of `row_group`, each group the regrouped bytes of `base`
    row_group: int = 1
    base: str | None = None

    @property
    def bits_per_weight(self) -> float:
        """Bits per weight of the blocks alone (row headers excluded), as ik reports bpw."""
        return 8.0 * self.type_size / self.block_size

    def row_bytes(self, n_per_row: int) -> int:
        """Bytes of one row of `n_per_row` values, including the per-row header."""
        if n_per_row % self.block_size:
            raise ValueError(
                f"row length {n_per_row} is not a multiple of {self.name}'s block size {self.block_size}"
            )
        return self.row_meta_size + self.type_size * (n_per_row // self.block_size)

    def tensor_bytes(self, ne: tuple[int, ...] | list[int]) -> int:
        """Bytes of a tensor with ggml dims `ne` (fastest first)."""
        ne = tuple(int(n) for n in ne)
        n_per_row = ne[0] if ne else 1
        n_rows = 1
        for n in ne[1:]:
            n_rows *= n
        return self.row_bytes(n_per_row) * n_rows

    def require_codec(self) -> Codec:
        """The codec of this type, or a clear error when none is implemented yet."""
        import ikquant.formats  # noqa: F401  (importing the formats registers their codecs)

        if self.codec is None:
            raise CodecMissingError(f"type {self.name} (ggml id {self.id}) has no quantize/dequantize implementation")
        return self.codec

    def __repr__(self) -> str:
        return f"GGMLType({self.name}, id={self.id})"


# Facts from ik_llama.cpp (ggml/include/ggml.h enum ggml_type, ggml/src/ggml.c type_traits, ggml-common.h block
# structs): name, the type_name ik prints, id, block size, bytes per block, bytes of per-row header.
_TYPE_TABLE: tuple[tuple[str, str, int, int, int, int], ...] = (
    ("F32", "f32", 0, 1, 4, 0),
    ("F16", "f16", 1, 1, 2, 0),
    ("Q4_0", "q4_0", 2, 32, 18, 0),
    ("Q4_1", "q4_1", 3, 32, 20, 0),
    ("Q5_0", "q5_0", 6, 32, 22, 0),
    ("Q5_1", "q5_1", 7, 32, 24, 0),
    ("Q8_0", "q8_0", 8, 32, 34, 0),
    ("Q8_1", "q8_1", 9, 32, 36, 0),
    ("Q2_K", "q2_K", 10, 256, 84, 0),
    ("Q3_K", "q3_K", 11, 256, 110, 0),
    ("Q4_K", "q4_K", 12, 256, 144, 0),
    ("Q5_K", "q5_K", 13, 256, 176, 0),
    ("Q6_K", "q6_K", 14, 256, 210, 0),
    ("Q8_K", "q8_K", 15, 256, 292, 0),
    ("IQ2_XXS", "iq2_xxs", 16, 256, 66, 0),
    ("IQ2_XS", "iq2_xs", 17, 256, 74, 0),
    ("IQ3_XXS", "iq3_xxs", 18, 256, 98, 0),
    ("IQ1_S", "iq1_s", 19, 256, 50, 0),
    ("IQ4_NL", "iq4_nl", 20, 32, 18, 0),
    ("IQ3_S", "iq3_s", 21, 256, 110, 0),
    ("IQ2_S", "iq2_s", 22, 256, 82, 0),
    ("IQ4_XS", "iq4_xs", 23, 256, 136, 0),
    ("I8", "i8", 24, 1, 1, 0),
    ("I16", "i16", 25, 1, 2, 0),
    ("I32", "i32", 26, 1, 4, 0),
    ("I64", "i64", 27, 1, 8, 0),
    ("F64", "f64", 28, 1, 8, 0),
    ("IQ1_M", "iq1_m", 29, 256, 56, 0),
    ("BF16", "bf16", 30, 1, 2, 0),
    ("MXFP4", "mxfp4", 39, 32, 17, 0),
    ("Q1_0_G128", "q1_0_g128", 41, 128, 18, 0),
    ("Q4_0_R8", "q4_0_r8", 202, 32, 18, 0),
    ("Q8_0_R8", "q8_0_r8", 208, 32, 34, 0),
    ("IQ4_NL_R4", "iq4_nl_r4", 220, 32, 18, 0),
    ("MXFP4_R8", "mxfp4_r8", 353, 32, 17, 0),
    ("Q6_0", "q6_0", 133, 32, 26, 0),
    ("IQ2_K", "iq2_k", 137, 256, 76, 0),
    ("IQ3_K", "iq3_k", 138, 256, 110, 0),
    ("IQ4_K", "iq4_k", 139, 256, 144, 0),
    ("IQ5_K", "iq5_k", 140, 256, 176, 0),
    ("IQ6_K", "iq6_k", 141, 256, 212, 0),
    ("IQ4_KS", "iq4_ks", 144, 256, 136, 4),
    ("IQ2_KS", "iq2_ks", 145, 256, 70, 2),
    ("IQ4_KSS", "iq4_kss", 146, 256, 128, 4),
    ("Q8_KV", "q8_KV", 151, 32, 32, 8),
    ("IQ5_KS", "iq5_ks", 152, 256, 168, 4),
    ("IQ2_KT", "iq2_kt", 153, 256, 68, 4),
    ("IQ3_KT", "iq3_kt", 154, 256, 100, 4),
    ("IQ4_KT", "iq4_kt", 155, 256, 128, 4),
    ("IQ3_KS", "iq3_ks", 156, 256, 102, 2),
    ("IQ2_KL", "iq2_kl", 157, 256, 86, 2),
    ("IQ1_KT", "iq1_kt", 158, 256, 56, 4),
    ("Q4_K_R4", "q4_k_r4", 212, 256, 144, 0),
    ("IQ4_XS_R8", "iq4_xs_r8", 223, 256, 136, 0),
    ("Q6_K_R4", "q6_k_r4", 214, 256, 210, 0),
    ("IQ2_K_R4", "iq2_k_r4", 337, 256, 76, 0),
    ("IQ3_K_R4", "iq3_k_r4", 338, 256, 110, 0),
    ("IQ4_K_R4", "iq4_k_r4", 339, 256, 144, 0),
    ("IQ5_K_R4", "iq5_k_r4", 340, 256, 176, 0),
    ("IQ4_KS_R4", "iq4_ks_r4", 344, 256, 136, 4),
    ("IQ5_KS_R4", "iq5_ks_r4", 352, 256, 168, 4),
    ("IQ1_BN", "iq1_bn", 134, 64, 13, 2),
    ("IQ2_BN", "iq2_bn", 135, 64, 16, 4),
    ("IQ2_BN_R4", "iq2_bn_r4", 335, 64, 16, 4),
    ("Q5_0_R4", "q5_0_r4", 206, 32, 22, 0),
    ("Q6_0_R4", "q6_0_r4", 233, 32, 26, 0),
    ("Q2_K_R4", "q2_k_r4", 210, 256, 84, 0),
    ("Q3_K_R4", "q3_k_r4", 211, 256, 110, 0),
    ("Q5_K_R4", "q5_k_r4", 213, 256, 176, 0),
    ("IQ2_XXS_R4", "iq2_xxs_r4", 216, 256, 66, 0),
    ("IQ2_XS_R4", "iq2_xs_r4", 217, 256, 74, 0),
    ("IQ3_XXS_R4", "iq3_xxs_r4", 218, 256, 98, 0),
    ("IQ1_S_R4", "iq1_s_r4", 219, 32, 6, 2),
    ("IQ3_S_R4", "iq3_s_r4", 221, 256, 110, 0),
    ("IQ2_S_R4", "iq2_s_r4", 222, 256, 82, 0),
    ("IQ1_M_R4", "iq1_m_r4", 229, 32, 7, 2),
    ("Q8_K_R16", "q8_k_r16", 397, 256, 258, 0),
    ("Q8_KV_R8", "q8_KV_r8", 398, 32, 32, 4),
    ("Q8_K_R8", "q8_k_r8", 399, 256, 258, 0),
)

# Ids that mainline llama.cpp assigns to types ik_llama.cpp does not have (so a file using them came from mainline).
_MAINLINE_ONLY_IDS = {34: "TQ1_0", 35: "TQ2_0", 40: "NVFP4"}

# Interleaved types (ik's interleaved_properties): the base type and how many rows a group holds.
_INTERLEAVED = {"Q8_0_R8": ("Q8_0", 8), "Q4_0_R8": ("Q4_0", 8), "IQ4_NL_R4": ("IQ4_NL", 4), "IQ4_K_R4": ("IQ4_K", 4),
                "IQ2_K_R4": ("IQ2_K", 4), "IQ3_K_R4": ("IQ3_K", 4),
                "IQ4_KS_R4": ("IQ4_KS", 4), "IQ5_K_R4": ("IQ5_K", 4), "IQ5_KS_R4": ("IQ5_KS", 4),
                "Q4_K_R4": ("Q4_K", 4), "Q6_K_R4": ("Q6_K", 4), "IQ4_XS_R8": ("IQ4_XS", 8),
                "MXFP4_R8": ("MXFP4", 8), "Q5_0_R4": ("Q5_0", 4), "Q6_0_R4": ("Q6_0", 4), "Q2_K_R4": ("Q2_K", 4),
                "Q3_K_R4": ("Q3_K", 4), "Q5_K_R4": ("Q5_K", 4), "IQ2_XXS_R4": ("IQ2_XXS", 4), "IQ2_XS_R4": ("IQ2_XS", 4),
                "IQ2_S_R4": ("IQ2_S", 4), "IQ3_XXS_R4": ("IQ3_XXS", 4), "IQ3_S_R4": ("IQ3_S", 4), "IQ1_S_R4": ("IQ1_S", 4),
                "IQ1_M_R4": ("IQ1_M", 4), "IQ2_BN_R4": ("IQ2_BN", 4), "Q8_KV_R8": ("Q8_KV", 8), "Q8_K_R8": ("Q8_0", 8),
                "Q8_K_R16": ("Q8_0", 16)}

_BY_NAME: dict[str, GGMLType] = {}
_BY_ID: dict[int, GGMLType] = {}
for _row in _TYPE_TABLE:
    _t = GGMLType(*_row)
    if _t.name in _INTERLEAVED:
        _t.base, _t.row_group = _INTERLEAVED[_t.name]
    _BY_NAME[_t.name] = _t
    _BY_ID[_t.id] = _t


def all_types() -> list[GGMLType]:
    """Every type in the registry, in id order."""
    return sorted(_BY_ID.values(), key=lambda t: t.id)


def type_by_id(type_id: int) -> GGMLType:
    """The registered type with ggml id `type_id`."""
    try:
        return _BY_ID[int(type_id)]
    except KeyError:
        if type_id in _MAINLINE_ONLY_IDS:
            raise UnknownTypeError(
                f"ggml type id {type_id} is mainline llama.cpp's {_MAINLINE_ONLY_IDS[type_id]}, "
                "which ik_llama.cpp does not support"
            ) from None
        raise UnknownTypeError(f"unknown ggml type id {type_id}") from None


def type_by_name(name: str) -> GGMLType:
    """The registered type called `name` (case-insensitive: 'q4_k', 'Q4_K' and 'iq4_ks' all work)."""
    key = name.strip().upper()
    if key in _BY_NAME:
        return _BY_NAME[key]
    raise UnknownTypeError(f"unknown ggml type {name!r}; known types: {', '.join(t.name for t in all_types())}")


def register_codec(type_name: str, codec: Codec) -> None:
    """Attach the quantize/dequantize implementation of a type (called by the format modules)."""
    type_by_name(type_name).codec = codec


def decodable_types() -> list[GGMLType]:
    """Types that have a codec: the tools can read them (dequantize)."""
    import ikquant.formats  # noqa: F401  (importing the formats registers their codecs)

    return [t for t in all_types() if t.codec is not None]


def implemented_types() -> list[GGMLType]:
    """Types the tools can quantize to and dequantize from."""
    return [t for t in decodable_types() if t.codec is not None and t.codec.can_quantize]
