"""The one registry of ggml tensor types, as ik_llama.cpp numbers and sizes them.

PyPI `gguf` only knows mainline's type ids; ik_llama.cpp adds its own (Q6_0 = 133, the IQK family 137-157,
the trellis types 153-158) and row-scaled types whose rows start with a per-row header. Every size or offset
computation in the project goes through `GGMLType.row_bytes` / `tensor_bytes` so those headers are never forgotten.
A codec class attaches itself to its type when it is defined (`class Q4_0Codec(Codec, type_name="Q4_0")`,
see `ikquant.formats.base.Codec`); importing `ikquant.formats` defines them all.
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
# structs, and ik's interleaved_properties for the _R4/_R8/_R16 types): name, the type_name ik prints, id, block size,
# bytes per block, bytes of per-row header, and for an interleaved type the rows in a group and its base type.
_TYPES: tuple[GGMLType, ...] = (
    GGMLType("F32", "f32", 0, 1, 4),
    GGMLType("F16", "f16", 1, 1, 2),
    GGMLType("Q4_0", "q4_0", 2, 32, 18),
    GGMLType("Q4_1", "q4_1", 3, 32, 20),
    GGMLType("Q5_0", "q5_0", 6, 32, 22),
    GGMLType("Q5_1", "q5_1", 7, 32, 24),
    GGMLType("Q8_0", "q8_0", 8, 32, 34),
    GGMLType("Q8_1", "q8_1", 9, 32, 36),
    GGMLType("Q2_K", "q2_K", 10, 256, 84),
    GGMLType("Q3_K", "q3_K", 11, 256, 110),
    GGMLType("Q4_K", "q4_K", 12, 256, 144),
    GGMLType("Q5_K", "q5_K", 13, 256, 176),
    GGMLType("Q6_K", "q6_K", 14, 256, 210),
    GGMLType("Q8_K", "q8_K", 15, 256, 292),
    GGMLType("IQ2_XXS", "iq2_xxs", 16, 256, 66),
    GGMLType("IQ2_XS", "iq2_xs", 17, 256, 74),
    GGMLType("IQ3_XXS", "iq3_xxs", 18, 256, 98),
    GGMLType("IQ1_S", "iq1_s", 19, 256, 50),
    GGMLType("IQ4_NL", "iq4_nl", 20, 32, 18),
    GGMLType("IQ3_S", "iq3_s", 21, 256, 110),
    GGMLType("IQ2_S", "iq2_s", 22, 256, 82),
    GGMLType("IQ4_XS", "iq4_xs", 23, 256, 136),
    GGMLType("I8", "i8", 24, 1, 1),
    GGMLType("I16", "i16", 25, 1, 2),
    GGMLType("I32", "i32", 26, 1, 4),
    GGMLType("I64", "i64", 27, 1, 8),
    GGMLType("F64", "f64", 28, 1, 8),
    GGMLType("IQ1_M", "iq1_m", 29, 256, 56),
    GGMLType("BF16", "bf16", 30, 1, 2),
    GGMLType("MXFP4", "mxfp4", 39, 32, 17),
    GGMLType("Q1_0_G128", "q1_0_g128", 41, 128, 18),
    GGMLType("Q4_0_R8", "q4_0_r8", 202, 32, 18, row_group=8, base="Q4_0"),
    GGMLType("Q8_0_R8", "q8_0_r8", 208, 32, 34, row_group=8, base="Q8_0"),
    GGMLType("IQ4_NL_R4", "iq4_nl_r4", 220, 32, 18, row_group=4, base="IQ4_NL"),
    GGMLType("MXFP4_R8", "mxfp4_r8", 353, 32, 17, row_group=8, base="MXFP4"),
    GGMLType("Q6_0", "q6_0", 133, 32, 26),
    GGMLType("IQ2_K", "iq2_k", 137, 256, 76),
    GGMLType("IQ3_K", "iq3_k", 138, 256, 110),
    GGMLType("IQ4_K", "iq4_k", 139, 256, 144),
    GGMLType("IQ5_K", "iq5_k", 140, 256, 176),
    GGMLType("IQ6_K", "iq6_k", 141, 256, 212),
    GGMLType("IQ4_KS", "iq4_ks", 144, 256, 136, row_meta_size=4),
    GGMLType("IQ2_KS", "iq2_ks", 145, 256, 70, row_meta_size=2),
    GGMLType("IQ4_KSS", "iq4_kss", 146, 256, 128, row_meta_size=4),
    GGMLType("Q8_KV", "q8_KV", 151, 32, 32, row_meta_size=8),
    GGMLType("IQ5_KS", "iq5_ks", 152, 256, 168, row_meta_size=4),
    GGMLType("IQ2_KT", "iq2_kt", 153, 256, 68, row_meta_size=4),
    GGMLType("IQ3_KT", "iq3_kt", 154, 256, 100, row_meta_size=4),
    GGMLType("IQ4_KT", "iq4_kt", 155, 256, 128, row_meta_size=4),
    GGMLType("IQ3_KS", "iq3_ks", 156, 256, 102, row_meta_size=2),
    GGMLType("IQ2_KL", "iq2_kl", 157, 256, 86, row_meta_size=2),
    GGMLType("IQ1_KT", "iq1_kt", 158, 256, 56, row_meta_size=4),
    GGMLType("Q4_K_R4", "q4_k_r4", 212, 256, 144, row_group=4, base="Q4_K"),
    GGMLType("IQ4_XS_R8", "iq4_xs_r8", 223, 256, 136, row_group=8, base="IQ4_XS"),
    GGMLType("Q6_K_R4", "q6_k_r4", 214, 256, 210, row_group=4, base="Q6_K"),
    GGMLType("IQ2_K_R4", "iq2_k_r4", 337, 256, 76, row_group=4, base="IQ2_K"),
    GGMLType("IQ3_K_R4", "iq3_k_r4", 338, 256, 110, row_group=4, base="IQ3_K"),
    GGMLType("IQ4_K_R4", "iq4_k_r4", 339, 256, 144, row_group=4, base="IQ4_K"),
    GGMLType("IQ5_K_R4", "iq5_k_r4", 340, 256, 176, row_group=4, base="IQ5_K"),
    GGMLType("IQ4_KS_R4", "iq4_ks_r4", 344, 256, 136, row_meta_size=4, row_group=4, base="IQ4_KS"),
    GGMLType("IQ5_KS_R4", "iq5_ks_r4", 352, 256, 168, row_meta_size=4, row_group=4, base="IQ5_KS"),
    GGMLType("IQ1_BN", "iq1_bn", 134, 64, 13, row_meta_size=2),
    GGMLType("IQ2_BN", "iq2_bn", 135, 64, 16, row_meta_size=4),
    GGMLType("IQ2_BN_R4", "iq2_bn_r4", 335, 64, 16, row_meta_size=4, row_group=4, base="IQ2_BN"),
    GGMLType("Q5_0_R4", "q5_0_r4", 206, 32, 22, row_group=4, base="Q5_0"),
    GGMLType("Q6_0_R4", "q6_0_r4", 233, 32, 26, row_group=4, base="Q6_0"),
    GGMLType("Q2_K_R4", "q2_k_r4", 210, 256, 84, row_group=4, base="Q2_K"),
    GGMLType("Q3_K_R4", "q3_k_r4", 211, 256, 110, row_group=4, base="Q3_K"),
    GGMLType("Q5_K_R4", "q5_k_r4", 213, 256, 176, row_group=4, base="Q5_K"),
    GGMLType("IQ2_XXS_R4", "iq2_xxs_r4", 216, 256, 66, row_group=4, base="IQ2_XXS"),
    GGMLType("IQ2_XS_R4", "iq2_xs_r4", 217, 256, 74, row_group=4, base="IQ2_XS"),
    GGMLType("IQ3_XXS_R4", "iq3_xxs_r4", 218, 256, 98, row_group=4, base="IQ3_XXS"),
    GGMLType("IQ1_S_R4", "iq1_s_r4", 219, 32, 6, row_meta_size=2, row_group=4, base="IQ1_S"),
    GGMLType("IQ3_S_R4", "iq3_s_r4", 221, 256, 110, row_group=4, base="IQ3_S"),
    GGMLType("IQ2_S_R4", "iq2_s_r4", 222, 256, 82, row_group=4, base="IQ2_S"),
    GGMLType("IQ1_M_R4", "iq1_m_r4", 229, 32, 7, row_meta_size=2, row_group=4, base="IQ1_M"),
    GGMLType("Q8_K_R16", "q8_k_r16", 397, 256, 258, row_group=16, base="Q8_0"),
    # ik declares blocks of one value; its regrouping moves pairs of values (rows of an even length), so here a
    # block is a pair: the same bytes per row
    GGMLType("BF16_R16", "bf16_r16", 230, 2, 4, row_group=16, base="BF16"),
    GGMLType("Q8_KV_R8", "q8_KV_r8", 398, 32, 32, row_meta_size=4, row_group=8, base="Q8_KV"),
    GGMLType("Q8_K_R8", "q8_k_r8", 399, 256, 258, row_group=8, base="Q8_0"),
)

# Ids that mainline llama.cpp assigns to types ik_llama.cpp does not have (so a file using them came from mainline).
_MAINLINE_ONLY_IDS = {34: "TQ1_0", 35: "TQ2_0", 40: "NVFP4"}

_BY_NAME: dict[str, GGMLType] = {t.name: t for t in _TYPES}
_BY_ID: dict[int, GGMLType] = {t.id: t for t in _TYPES}


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


def register_codec(codec: Codec) -> None:
    """Attach `codec` to the type it names (Codec subclasses given a type_name call this when they are defined). A
    second codec for one type is a mistake in the format modules, so it is refused rather than replacing the first."""
    gtype = type_by_name(codec.type_name)
    if gtype.codec is not None:
        raise RuntimeError(f"{gtype.name} has two codecs: {type(gtype.codec).__name__} and {type(codec).__name__}")
    gtype.codec = codec


def decodable_types() -> list[GGMLType]:
    """Types that have a codec: the tools can read them (dequantize)."""
    import ikquant.formats  # noqa: F401  (importing the formats registers their codecs)

    return [t for t in all_types() if t.codec is not None]


def implemented_types() -> list[GGMLType]:
    """Types the tools can quantize to and dequantize from."""
    return [t for t in decodable_types() if t.codec is not None and t.codec.can_quantize]
