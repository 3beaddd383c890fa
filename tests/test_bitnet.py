"""IQ1_BN, IQ2_BN and IQ2_BN_R4: ik's golden floats explained, the interleaved form, row groups, threads, ternary rows.

ik's CPU to_float for IQ1_BN and IQ2_BN (what the golden `dequant.f32` files hold) decodes a row from its first
byte, header included, and never applies the row scale; its matrix kernels and CUDA dequantizer read the header and
scale the codes (test_quant_golden checks both against tests/quant_golden.header_blind_to_float).
"""

from __future__ import annotations

import numba
import numpy as np
import pytest

import ikquant.formats  # noqa: F401  (registers the codecs)
from ikquant.errors import QuantInputError
from ikquant.types import type_by_name
from tests.quant_golden import golden_cases

BN_TYPES = ("IQ1_BN", "IQ2_BN")
def test_iq2_bn_r4_values_equal_iq2_bn_values() -> None:
    r4, base = type_by_name("IQ2_BN_R4").require_codec(), type_by_name("IQ2_BN").require_codec()
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal((8, 512)).astype(np.float32)] + [c.x for c in golden_cases("IQ2_BN_R4")]
    for x in inputs:
        n = x.shape[1]
        got = r4.dequantize(r4.quantize(x), n)
        want = base.dequantize(base.quantize(x), n)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_iq2_bn_r4_refuses_rows_that_are_not_whole_groups() -> None:
    codec = type_by_name("IQ2_BN_R4").require_codec()
    x = np.random.default_rng(1).standard_normal((6, 256)).astype(np.float32)
    with pytest.raises(QuantInputError, match="IQ2_BN_R4: 6 rows"):
        codec.quantize(x)
    with pytest.raises(QuantInputError, match="IQ2_BN_R4: 6 rows"):
        codec.dequantize(np.zeros((6, type_by_name("IQ2_BN_R4").row_bytes(256)), dtype=np.uint8), 256)


@pytest.mark.parametrize("type_name", ["IQ1_BN", "IQ2_BN", "IQ2_BN_R4"])
def test_bytes_do_not_depend_on_the_thread_count(type_name: str) -> None:
    codec = type_by_name(type_name).require_codec()
    x = np.random.default_rng(5).standard_normal((64, 1024)).astype(np.float32)
    threads = numba.get_num_threads()
    try:
        results = []
        for n_threads in (1, 2):
            numba.set_num_threads(n_threads)
            q = codec.quantize(x)
            results.append((q, codec.dequantize(q, x.shape[1])))
    finally:
        numba.set_num_threads(threads)
    (q1, y1), (q2, y2) = results
    assert np.array_equal(q1, q2)
    assert np.array_equal(y1.view(np.uint32), y2.view(np.uint32))


@pytest.mark.parametrize("type_name", ["IQ1_BN", "IQ2_BN", "IQ2_BN_R4"])
def test_ternary_rows_round_trip_exactly(type_name: str) -> None:
    codec = type_by_name(type_name).require_codec()
    rng = np.random.default_rng(11)
    # per-row magnitudes that f16 holds exactly (IQ1_BN stores the scale as f16), one row all zeros
    a = (2.0 ** rng.integers(-12, 12, size=8) * (1 + rng.integers(0, 1024, size=8) / 1024)).astype(np.float32)
    x = a[:, None] * rng.integers(-1, 2, size=(8, 640)).astype(np.float32)
    x[3] = 0
    y = codec.dequantize(codec.quantize(x), x.shape[1])
    assert np.array_equal(y.view(np.uint32), x.view(np.uint32))
