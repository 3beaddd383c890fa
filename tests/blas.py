"""Which OpenBLAS kernel numpy's matmuls run on: some golden figures depend on its float32 summation order."""

from __future__ import annotations

import pytest
from threadpoolctl import threadpool_info


def blas_kernel() -> str | None:
    return next((i.get("architecture") for i in threadpool_info() if i["internal_api"] == "openblas"), None)


#: ik's golden runs used AVX-512 GEMMs; OpenBLAS's AVX-512 kernels sum dot products in the same order as far as the
#: tiny models' near-ties can tell, its AVX2 ones (Haswell, Zen; OPENBLAS_CORETYPE may force them) do not
AVX512_GEMM = blas_kernel() in ("SkylakeX", "Cooperlake", "SapphireRapids")

needs_avx512_gemm = pytest.mark.skipif(
    not AVX512_GEMM,
    reason=f"OpenBLAS runs its {blas_kernel()} kernel: the tiny GLM model's indexer has top-k near-ties (scores a "
    "float32 ulp apart) that flip with any other summation order than the AVX-512 one of the golden runs")
