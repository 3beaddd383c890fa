"""The IQ1 quantizers' contract beyond the golden bytes: what ik refuses, thread-independent bytes, whole row groups
for the _R4 types, and ik's carried-over IQ1_M shift bits."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from ikquant.errors import QuantInputError
from ikquant.formats.iq1_lanes import iq1m_contenders, iq1s_contenders
from ikquant.formats.iq1_search import iq1m_best_split, iq1s_best_split
from ikquant.formats.vector_ir import LANES
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


def _prefix_sums(x: np.ndarray, w: np.ndarray, groups: int) -> np.ndarray:
    """Prefix sums of w x and w over a block sorted by value, of all its values (groups 1: IQ1_S) or of its first and
    second half apart (groups 2: IQ1_M), with the padding the contender marking reads."""
    order = np.argsort(x, kind="stable")
    sums = np.zeros((4, 32 + 1 + LANES), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # the blocks of huge magnitudes
        for j, i in enumerate(order):
            sums[:, j + 1] = sums[:, j]
            g = 2 * (i * groups // x.size)
            sums[g, j + 1] += w[i] * x[i]
            sums[g + 1, j + 1] += w[i]
    return sums


def _adversarial_blocks(rng: np.random.Generator, n: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Blocks of n values with importances: ordinary ones, ties everywhere (equal scores), zero importances, and
    magnitudes at which the contender scan must give way to the full one."""
    blocks = []
    for _ in range(200):
        x = rng.standard_normal(n).astype(np.float32)
        blocks.append(("gaussian", x, (rng.lognormal(0, 2, n) * np.sqrt(x * x + 1)).astype(np.float32)))
        blocks.append(("ties", rng.integers(-2, 3, n).astype(np.float32), np.ones(n, np.float32)))
        blocks.append(("few levels", rng.choice([-0.5, 0.125, 1.0], n).astype(np.float32),
                       rng.choice([1.0, 2.0], n).astype(np.float32)))
        w = rng.lognormal(0, 1, n).astype(np.float32)
        w[rng.random(n) < 0.5] = 0
        blocks.append(("zero importances", rng.standard_normal(n).astype(np.float32), w))
        scale = np.float32(10.0 ** rng.uniform(-25, 20))
        blocks.append(("magnitudes", (rng.standard_normal(n) * scale).astype(np.float32),
                       (10.0 ** rng.uniform(-25, 25, n)).astype(np.float32)))
    return blocks


@numba.njit(cache=True)
def _iq1s_contenders(sums: np.ndarray, marks: np.ndarray) -> bool:
    return iq1s_contenders(sums, 32, marks)


@numba.njit(cache=True)
def _iq1m_contenders(sums: np.ndarray, marks: np.ndarray) -> bool:
    return iq1m_contenders(sums, 16, marks)


@pytest.mark.parametrize("type_name", ["IQ1_S", "IQ1_M"])
def test_the_contender_scan_takes_the_split_of_the_full_scan(type_name: str) -> None:
    """The searches score only the splits iq1_lanes marks: the same split, scale and shift as ik's scan over every
    split, on blocks of ties and zero importances too; where magnitudes could round below normal floats the marking
    says so and the caller scans everything."""
    rng = np.random.default_rng(7)
    marks = np.zeros(33, np.int64)
    narrowed: dict[str, int] = {}
    marked: dict[str, int] = {}
    n, groups = (32, 1) if type_name == "IQ1_S" else (16, 2)
    for kind, x, w in _adversarial_blocks(rng, n):
        sums = _prefix_sums(x, w, groups)
        if type_name == "IQ1_S":
            full = iq1s_best_split(sums, n, marks, True, np.float32(1.0))
            if not _iq1s_contenders(sums, marks):
                continue
            narrow = iq1s_best_split(sums, n, marks, False, np.float32(1.0))
        else:
            full = iq1m_best_split(sums, n, marks, True)
            if not _iq1m_contenders(sums, marks):
                continue
            narrow = iq1m_best_split(sums, n, marks, False)
        assert narrow == full, kind
        narrowed[kind] = narrowed.get(kind, 0) + 1
        marked[kind] = marked.get(kind, 0) + sum(bin(int(m)).count("1") for m in marks)
    assert narrowed["gaussian"] == narrowed["ties"] == narrowed["few levels"] == narrowed["zero importances"] == 200
    assert 20 < narrowed.get("magnitudes", 0) < 200
    assert marked["gaussian"] < 20 * 200  # of the 561 (IQ1_S) or 153 (IQ1_M) splits of a block
