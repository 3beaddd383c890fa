"""PyPI gguf's numpy formats as a second, independent oracle beside ik's golden vectors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from ikquant.types import type_by_name
from tests.quant_golden import golden_cases

DEQUANT = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
           "MXFP4", "BF16", "F16"]
QUANT = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "BF16", "F16"]


@pytest.mark.parametrize("type_name", DEQUANT)
def test_dequantize_agrees_with_gguf(type_name: str) -> None:
    qt = getattr(gguf.GGMLQuantizationType, type_name)
    codec = type_by_name(type_name).require_codec()
    for case in golden_cases(type_name):
        ours = codec.dequantize(case.quant, case.n_per_row)
        theirs = gguf.quants.dequantize(case.quant, qt).reshape(ours.shape).astype(np.float32)
        np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32), err_msg=case.name)


@pytest.mark.parametrize("type_name", QUANT)
def test_quantize_without_weights_agrees_with_gguf(type_name: str) -> None:
    qt = getattr(gguf.GGMLQuantizationType, type_name)
    codec = type_by_name(type_name).require_codec()
    rng = np.random.default_rng(7)
    rows = [c.x for c in golden_cases(type_name) if c.imatrix is None]
    rows.append((rng.standard_normal((64, 512)) * rng.lognormal(0, 2, (64, 1))).astype(np.float32))
    for x in rows:
        assert codec.quantize(x).tobytes() == gguf.quants.quantize(x, qt).tobytes()
