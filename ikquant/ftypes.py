"""ik_llama.cpp's file types (llama_ftype): the names `--type` accepts, their general.file_type ids, and the
ggml type each one starts from before the per-tensor rules adjust it (facts from include/llama.h and
src/llama-quantize.cpp)."""

from __future__ import annotations

from dataclasses import dataclass

from ikquant.errors import UnknownFileTypeError
from ikquant.types import GGMLType, type_by_name


@dataclass(frozen=True)
class FileType:
    name: str
    id: int
    default_type: str

    @property
    def base(self) -> GGMLType:
        return type_by_name(self.default_type)


_FTYPES = (
    FileType("F32", 0, "F32"),
    FileType("F16", 1, "F16"),
    FileType("Q4_0", 2, "Q4_0"),
    FileType("Q4_1", 3, "Q4_1"),
    FileType("Q8_0", 7, "Q8_0"),
    FileType("Q5_0", 8, "Q5_0"),
    FileType("Q5_1", 9, "Q5_1"),
    FileType("Q2_K", 10, "Q2_K"),
    FileType("Q2_K_S", 21, "Q2_K"),
    FileType("Q3_K_S", 11, "Q3_K"),
    FileType("Q3_K_M", 12, "Q3_K"),
    FileType("Q3_K_L", 13, "Q3_K"),
    FileType("Q4_K_S", 14, "Q4_K"),
    FileType("Q4_K_M", 15, "Q4_K"),
    FileType("Q5_K_S", 16, "Q5_K"),
    FileType("Q5_K_M", 17, "Q5_K"),
    FileType("Q6_K", 18, "Q6_K"),
    FileType("IQ3_XS", 22, "IQ3_S"),
    FileType("IQ3_XXS", 23, "IQ3_XXS"),
    FileType("IQ4_NL", 25, "IQ4_NL"),
    FileType("IQ3_S", 26, "IQ3_S"),
    FileType("IQ3_M", 27, "IQ3_S"),
    FileType("IQ4_XS", 30, "IQ4_XS"),
    FileType("BF16", 32, "BF16"),
    FileType("MXFP4", 38, "MXFP4"),
    FileType("Q1_0_G128", 41, "Q1_0_G128"),
    FileType("Q6_0", 135, "Q6_0"),
    FileType("IQ2_K", 138, "IQ2_K"),
    FileType("IQ3_K", 139, "IQ3_K"),
    FileType("IQ4_K", 140, "IQ4_K"),
    FileType("IQ5_K", 141, "IQ5_K"),
    FileType("IQ6_K", 142, "IQ6_K"),
    FileType("IQ4_KS", 145, "IQ4_KS"),
    FileType("IQ2_KS", 147, "IQ2_KS"),
    FileType("IQ4_KSS", 148, "IQ4_KSS"),
    FileType("IQ3_KL", 146, "IQ3_K"),
    FileType("Q8_KV", 149, "Q8_KV"),
    FileType("Q4_0_R8", 202, "Q4_0_R8"),
    FileType("Q8_0_R8", 207, "Q8_0_R8"),
    FileType("IQ4_NL_R4", 225, "IQ4_NL_R4"),
    FileType("MXFP4_R8", 351, "MXFP4_R8"),
    FileType("IQ5_KS", 150, "IQ5_KS"),
    FileType("IQ2_KT", 151, "IQ2_KT"),
    FileType("IQ3_KT", 152, "IQ3_KT"),
    FileType("IQ4_KT", 153, "IQ4_KT"),
    FileType("IQ3_KS", 154, "IQ3_KS"),
    FileType("IQ2_KL", 155, "IQ2_KL"),
    FileType("IQ1_KT", 156, "IQ1_KT"),
    FileType("IQ2_XXS", 19, "IQ2_XXS"),
    FileType("IQ2_XS", 20, "IQ2_XS"),
    FileType("IQ1_S", 24, "IQ1_S"),
    FileType("IQ2_S", 28, "IQ2_XS"),
    FileType("IQ2_M", 29, "IQ2_S"),
    FileType("IQ1_M", 31, "IQ1_M"),
    FileType("IQ1_BN", 136, "IQ1_BN"),
    FileType("IQ2_BN", 137, "IQ2_BN"),
    FileType("Q5_0_R4", 208, "Q5_0_R4"),
    FileType("Q2_K_R4", 210, "Q2_K_R4"),
    FileType("Q3_K_R4", 211, "Q3_K_R4"),
    FileType("Q4_K_R4", 214, "Q4_K_R4"),
    FileType("Q5_K_R4", 216, "Q5_K_R4"),
    FileType("Q6_K_R4", 218, "Q6_K_R4"),
    FileType("IQ2_XXS_R4", 219, "IQ2_XXS_R4"),
    FileType("IQ2_XS_R4", 220, "IQ2_XS_R4"),
    FileType("IQ3_XXS_R4", 223, "IQ3_XXS_R4"),
    FileType("IQ1_S_R4", 224, "IQ1_S_R4"),
    FileType("IQ3_S_R4", 226, "IQ3_S_R4"),
    FileType("IQ2_M_R4", 229, "IQ2_S_R4"),
    FileType("IQ4_XS_R8", 230, "IQ4_XS_R8"),
    FileType("IQ1_M_R4", 231, "IQ1_M_R4"),
    FileType("Q6_0_R4", 335, "Q6_0_R4"),
    FileType("IQ2_BN_R4", 337, "IQ2_BN_R4"),
    FileType("IQ2_K_R4", 338, "IQ2_K_R4"),
    FileType("IQ3_K_R4", 339, "IQ3_K_R4"),
    FileType("IQ4_K_R4", 340, "IQ4_K_R4"),
    FileType("IQ5_K_R4", 341, "IQ5_K_R4"),
    FileType("IQ4_KS_R4", 345, "IQ4_KS_R4"),
    FileType("IQ5_KS_R4", 350, "IQ5_KS_R4"),
    FileType("Q8_KV_R8", 398, "Q8_KV_R8"),
    FileType("Q8_K_R8", 399, "Q8_K_R8"),
    FileType("BF16_R16", 232, "BF16_R16"),
)
_BY_NAME = {f.name: f for f in _FTYPES}


def all_file_types() -> list[FileType]:
    return list(_FTYPES)


def file_type(name: str) -> FileType:
    """The ftype called `name`, case-insensitively (q4_k_m, Q4_K_M, iq4_ks ...)."""
    ft = _BY_NAME.get(name.strip().upper())
    if ft is None:
        raise UnknownFileTypeError(f"unknown type {name!r}; valid types: {', '.join(f.name for f in _FTYPES)}")
    return ft
