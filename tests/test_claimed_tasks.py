"""Kernels whose threads claim their work in small tasks (ikrun/ops/parallel.py claim_items): every item is done
once, and the bits do not depend on how many threads share it."""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
import pytest
from numba import njit, prange

from ikrun.numerics.ik.attention import ik_causal_attention
from ikrun.numerics.ik.formats import Q8_2_X4, Q8_K, integer_rows, round_activations
from ikrun.numerics.ik.ikgemm import ik_float_matmul
from ikrun.ops.attention import shared_kv_attention
from ikrun.ops.hyperconn import hc_post
from ikrun.ops.parallel import PARALLEL_MIN_ELEMENTS, claim_items, task_items


@njit(cache=True, parallel=True)
def _count_claims(items: int, threads: int) -> np.ndarray:
    hits = np.zeros(items, np.int64)
    per, counter = task_items(items, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        i0, i1 = claim_items(counter, per, items)
        while i0 < i1:
            for i in range(i0, i1):
                hits[i] += 1
            i0, i1 = claim_items(counter, per, items)
    return hits


@pytest.mark.parametrize(("items", "threads"), [(1, 2), (7, 2), (16, 2), (17, 2), (1000, 2), (5, 8), (333, 3)])
def test_every_item_is_claimed_once(items: int, threads: int) -> None:
    np.testing.assert_array_equal(_count_claims(items, threads), np.ones(items, np.int64))


def _at_thread_counts(compute: Callable[[], tuple[np.ndarray, ...]]) -> list[tuple[np.ndarray, ...]]:
    before = numba.get_num_threads()
    try:
        results = []
        for threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            numba.set_num_threads(threads)
            results.append(compute())
        return results
    finally:
        numba.set_num_threads(before)


def _rows(m: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, n)).astype(np.float32)


@pytest.mark.parametrize("fmt", [Q8_2_X4, Q8_K])
def test_activation_rounding_is_the_same_at_any_thread_count(fmt: str) -> None:
    x = _rows(PARALLEL_MIN_ELEMENTS // 1024 + 37, 1024, 1)  # above the parallel threshold, rows no whole tasks

    def compute() -> tuple[np.ndarray, ...]:
        ints = integer_rows(x, fmt)
        return ints.u, ints.scale, ints.sums, ints.isums, round_activations(x, fmt)

    one, *more = _at_thread_counts(compute)
    serial = integer_rows(x[:100], fmt)  # below the threshold: the serial kernel
    np.testing.assert_array_equal(one[0][:100], serial.u[:100])
    for other in more:
        for a, b in zip(one, other, strict=True):
            np.testing.assert_array_equal(a, b)


def test_ik_attention_and_float_matmul_are_the_same_at_any_thread_count() -> None:
    rng = np.random.default_rng(2)
    q = rng.standard_normal((45, 8, 32)).astype(np.float32)
    k, v = rng.standard_normal((50, 4, 32)).astype(np.float32), rng.standard_normal((50, 4, 48)).astype(np.float32)
    x, w = _rows(37, 256, 3), _rows(333, 256, 4)
    one, *more = _at_thread_counts(lambda: (ik_causal_attention(q, k, v, 0.2), ik_float_matmul(x, w)))
    for other in more:
        for a, b in zip(one, other, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fused", [False, True])
def test_hyperconnection_post_is_the_same_at_any_thread_count_and_as_the_serial_kernel(fused: bool) -> None:
    """DeepSeek-V4's hc_post above the parallel threshold (claimed token tasks), and a few tokens (serial)."""
    rng = np.random.default_rng(5)
    t, s, h = PARALLEL_MIN_ELEMENTS // (4 * 256) + 7, 4, 256
    y, post = rng.standard_normal((t, h)).astype(np.float32), rng.random((t, s)).astype(np.float32)
    streams, m = rng.standard_normal((t, s, h)).astype(np.float32), rng.random((t, s, s)).astype(np.float32)
    one, *more = _at_thread_counts(lambda: (hc_post(y, post, streams, m, fused),))
    np.testing.assert_array_equal(one[0][:5], hc_post(y[:5], post[:5], streams[:5], m[:5], fused))
    for other in more:
        np.testing.assert_array_equal(one[0], other[0])


def test_shared_kv_attention_is_the_same_at_any_thread_count() -> None:
    """DeepSeek-V4's window, sinks and compressed entries: the causal kernel's claimed (head, query tile) tasks."""
    rng = np.random.default_rng(6)
    q, kv = rng.standard_normal((200, 64, 64)).astype(np.float32), rng.standard_normal((200, 64)).astype(np.float32)
    comp, keep = rng.standard_normal((12, 64)).astype(np.float32), rng.random((200, 12)) < 0.5
    sinks = np.linspace(-1, 1, 64).astype(np.float32)
    assert q.size * (len(kv) + len(comp)) >= PARALLEL_MIN_ELEMENTS  # the parallel kernel
    one, *more = _at_thread_counts(lambda: (shared_kv_attention(q, kv, 0.125, window=128, sinks=sinks, comp=comp,
                                                                comp_keep=keep),))
    for other in more:
        np.testing.assert_array_equal(one[0], other[0])
