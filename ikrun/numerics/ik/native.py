"""ik's own integer kernels of the types it converts, where it does not convert them (below the activation rows it
converts from, or weight rows no multiple of the converted form's row group): which are reproduced for which
build, and one entry to them for dense and routed-expert matmuls. The other types' own kernels multiply floats
(IkKernel.float_values)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ikrun.numerics.ik.iqk_native import NATIVE_TYPES, iqk_matmuls
from ikrun.numerics.ik.iquant_native import IQ1_TYPES, IQUANT_TYPES, iquant_matmuls
from ikrun.numerics.ik.kquant_native import KQUANT_TYPES, kquant_matmuls
from ikrun.numerics.ik.qgemm import IntRows


def native_types() -> tuple[str, ...]:
    """The weight types whose own kernel is reproduced, for ik's AVX2 build and its AVX-512 one alike: the IQK types,
    IQ4_XS, Q2_K and Q3_K (iqk_native.py), Q4_K, Q5_K and Q6_K (kquant_native.py), IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
    IQ3_S, IQ1_S and IQ1_M (iquant_native.py)."""
    return (*NATIVE_TYPES, *IQUANT_TYPES, *IQ1_TYPES, *KQUANT_TYPES)


def native_matmuls(x: IntRows, raw: np.ndarray, tokens: np.ndarray, row_at: np.ndarray, type_name: str,
                   which: np.ndarray | None = None, avx2: bool = False) -> np.ndarray:
    """Rows `tokens` of the integer activation rows x (the type's activation format) times matrices of
    `type_name` as ik's own kernel computes them: matrix j (raw [E, rows, row bytes], the file's rows; with
    `which`, raw's matrix which[j]) takes tokens[row_at[j] : row_at[j + 1]]; float32 [len(tokens), rows]."""
    if type_name in KQUANT_TYPES:
        return kquant_matmuls(x, raw, tokens, row_at, type_name, which)
    if type_name in IQUANT_TYPES or type_name in IQ1_TYPES:
        return iquant_matmuls(x, raw, tokens, row_at, type_name, which, avx2)
    return iqk_matmuls(x, raw, tokens, row_at, type_name, which=which, avx2=avx2)


def native_matmul(x: IntRows, raw: np.ndarray, type_name: str, avx2: bool = False) -> np.ndarray:
    """x @ a matrix's rows `raw` [rows, row bytes]^T of `type_name` in ik's own kernel (`avx2`: its AVX2 build's):
    float32 [x.rows, rows]."""
    return native_matmuls(x, raw[None], np.arange(x.rows, dtype=np.int64), np.array([0, x.rows], np.int64),
                          type_name, avx2=avx2)


@dataclass(frozen=True)
class NativeRows:
    """One matrix's rows in the file [rows, row bytes], which ik multiplies in its own kernel of `type_name`: a
    routed expert's matrix beside others of the same expert that ik converts (ops/moe.moe_experts)."""

    raw: np.ndarray
    type_name: str
    avx2: bool

    @property
    def rows(self) -> int:
        return int(self.raw.shape[0])

    def times(self, x: IntRows) -> np.ndarray:
        """x @ these rows^T in ik's own kernel."""
        return native_matmul(x, self.raw, self.type_name, self.avx2)
