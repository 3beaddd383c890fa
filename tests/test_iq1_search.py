"""The IQ1 quantizers' contract beyond the golden bytes: what ik refuses, thread-independent bytes, whole row groups
for the _R4 types, and ik's carried-over IQ1_M shift bits."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from ikquant.errors import QuantInputError
from ikquant.types import type_by_name

IQ1_TYPES = ["IQ1_S", "IQ1_M", "IQ1_S_R4", "IQ1_M_R4"]


def _rows(n_rows: int, n: int, seed: int = 0) -> np.ndarray:
    """Gaussian rows with a few 16-value blocks of zeros (the blocks that carry a shift over)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows, n)).astype(np.float32)
    zero = rng.random((n_rows, n // 16)) < 0.1
    zero[0] = False
    x[np.repeat(zero, 16, axis=1)] = 0
    return x


def _imatrix(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.1, 10.0, n).astype(np.float32)


def test_iq1_s_needs_an_importance_matrix() -> None:
    codec = type_by_name("IQ1_S").require_codec()
    with pytest.raises(QuantInputError, match="IQ1_S needs an importance matrix"):
        codec.quantize(_rows(2, 256))
    assert codec.quantize(_rows(2, 256), _imatrix(256)).shape == (2, 50)


@pytest.mark.parametrize("type_name", IQ1_TYPES)
def test_bytes_do_not_depend_on_the_thread_count(type_name: str) -> None:
    codec = type_by_name(type_name).require_codec()
    x, w = _rows(32, 512), _imatrix(512)
    weights = [w] if type_name == "IQ1_S" else [w, None]
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = [codec.quantize(x, v) for v in weights]
        try:
            numba.set_num_threads(2)
        except ValueError:
            pytest.skip("needs 2 Numba threads")
        two = [codec.quantize(x, v) for v in weights]
    finally:
        numba.set_num_threads(before)
    for a, b in zip(one, two):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("type_name", ["IQ1_S_R4", "IQ1_M_R4"])
def test_r4_types_take_whole_groups_of_4_rows(type_name: str) -> None:
    codec = type_by_name(type_name).require_codec()
    with pytest.raises(QuantInputError, match=f"{type_name}: 6 rows are not a whole number of 4-row groups"):
        codec.quantize(_rows(6, 256))
    q = codec.quantize(_rows(8, 256))
    with pytest.raises(QuantInputError, match="6 rows are not a whole number of 4-row groups"):
        codec.dequantize(q[:6], 256)


def test_an_iq1_m_block_below_the_threshold_keeps_the_last_shift_bits() -> None:
    """ik's IQ1_M stores no shift for a block of 16 values below 1e-7: the qh byte keeps the shift bits that block
    position got in the call's previous super-block (here: the row before)."""
    codec = type_by_name("IQ1_M").require_codec()
    rng = np.random.default_rng(1)
    first = rng.standard_normal((1, 256)).astype(np.float32)
    second = rng.standard_normal((1, 256)).astype(np.float32)
    second[0, 48:64] = 0  # block 3
    shift_bits = 0x88
    carried = codec.quantize(first)[0, 32 + 3] & shift_bits
    assert carried != 0
    assert codec.quantize(np.concatenate([first, second]))[1, 32 + 3] & shift_bits == carried
    assert codec.quantize(second)[0, 32 + 3] & shift_bits == 0
