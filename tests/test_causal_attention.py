"""The exact mode's causal attention (ikrun/ops/attention.py causal_attention): every score one FMA chain over the
head's values in order, the masked softmax (its exponentials in float64, its sum in a fixed order), every output
one FMA chain over the keys the query sees, in order; so the same bits whichever tile, thread or continuation
computes a query."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit

from ikquant.formats.numeric import fmaf
from ikrun.ops.attention import _extra_softmax_row, _softmax_row, causal_attention, shared_kv_attention
from ikrun.ops.parallel import PARALLEL_MIN_ELEMENTS


@njit(cache=True)
def _reference(q, k, v, scale, window, sinks, ek, ev, keep):  # type: ignore[no-untyped-def]
    """One query at a time, every product a scalar fused multiply-add loop; the extra entries (ek, ev, keep: T of
    them, T >= 0) after the positions, in every score row and value chain."""
    n, n_head, d = q.shape
    n_keys, n_kv_head, dv = v.shape
    past, group, n_extra = n_keys - n, n_head // n_kv_head, keep.shape[1]
    out = np.zeros((n, n_head, dv), np.float32)
    for i in range(n):
        pos = past + i
        first = max(0, pos - window + 1) if window > 0 else 0
        raw = -(-(pos + 1) // 16) * 16
        for h in range(n_head):
            hk = h // group
            p = np.zeros(raw + -(-n_extra // 16) * 16, np.float32)
            for j in range(pos + 1):
                acc = np.float32(0.0)
                for c in range(d):
                    acc = fmaf(q[i, h, c], k[j, hk, c], acc)
                p[j] = acc
            for t in range(n_extra):
                acc = np.float32(0.0)
                for c in range(d):
                    acc = fmaf(q[i, h, c], ek[t, hk, c], acc)
                p[raw + t] = acc
            sink = sinks[h] if sinks.shape[0] else np.float32(-np.inf)
            if n_extra:
                _extra_softmax_row(p, np.float32(scale), first, pos, raw, keep[i], sink, np.empty(16, np.float64))
            else:
                _softmax_row(p, np.float32(scale), first, pos, sink, np.empty(16, np.float64))
            for c in range(dv):
                acc = np.float32(0.0)
                for j in range(first, pos + 1):
                    acc = fmaf(p[j], v[j, hk, c], acc)
                for t in range(n_extra):
                    if keep[i, t]:
                        acc = fmaf(p[raw + t], ev[t, hk, c], acc)
                out[i, h, c] = acc
    return out


def _no_extra(n: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return k[:0], v[:0], np.zeros((n, 0), np.bool_)


def _case(n: int, past: int, heads: int, kv_heads: int, d: int, dv: int,
          seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, heads, d), dtype=np.float32),
            rng.standard_normal((past + n, kv_heads, d), dtype=np.float32),
            rng.standard_normal((past + n, kv_heads, dv), dtype=np.float32))


CASES = [  # n, past, heads, kv heads, d, dv, window, sinks
    (37, 0, 4, 2, 40, 24, 0, False),  # no whole tiles, value channels not a multiple of 16
    (50, 13, 2, 1, 64, 64, 0, False),  # a continuation
    (70, 0, 3, 3, 32, 48, 20, True),  # a window and sinks (gpt-oss)
    (29, 4, 2, 2, 300, 16, 0, False),  # a head longer than one K step of the tiles
]


@pytest.mark.parametrize("case", CASES)
def test_every_output_is_the_scalar_fma_chains(case: tuple[int, ...]) -> None:
    n, past, heads, kv_heads, d, dv, window, with_sinks = case
    q, k, v = _case(n, past, heads, kv_heads, d, dv)
    sinks = np.linspace(-1, 1, heads).astype(np.float32) if with_sinks else np.empty(0, np.float32)
    got = causal_attention(q, k, v, 0.15, window=window, sinks=sinks if with_sinks else None)
    np.testing.assert_array_equal(got, _reference(q, k, v, np.float32(0.15), window, sinks, *_no_extra(n, k, v)))


def _extra_case(n: int, past: int, n_extra: int, d: int, seed: int) -> tuple[np.ndarray, ...]:
    """One shared key = value head (DeepSeek-V4) with n_extra compressed entries, each query keeping a random
    subset of those before its position's share (the last queries keep the last entries)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, 4, d), dtype=np.float32)
    kv = rng.standard_normal((past + n, d), dtype=np.float32)
    comp = rng.standard_normal((n_extra, d), dtype=np.float32)
    seen = (past + np.arange(n) + 1) * n_extra // (past + n)
    keep = (rng.random((n, n_extra)) < 0.4) & (np.arange(n_extra)[None, :] < seen[:, None])
    keep[-1, -1] = True
    return q, kv, comp, keep


@pytest.mark.parametrize("n, past, n_extra, d, window", [(45, 0, 20, 64, 16), (30, 7, 3, 32, 0), (40, 0, 37, 300, 8)])
def test_extra_entries_are_the_scalar_fma_chains(n: int, past: int, n_extra: int, d: int, window: int) -> None:
    """DeepSeek-V4's compressed entries beside the window's keys (shared_kv_attention): each kept one scored and
    weighed in the query's chains after its positions, the others not at all; sinks in every row."""
    q, kv, comp, keep = _extra_case(n, past, n_extra, d, 3)
    sinks = np.linspace(-1, 1, 4).astype(np.float32)
    got = shared_kv_attention(q, kv, 0.15, window=window, sinks=sinks, comp=comp, comp_keep=keep, start=past)
    rows, extra = kv[:, None, :], comp[:, None, :]
    np.testing.assert_array_equal(got, _reference(q, rows, rows, np.float32(0.15), window, sinks, extra, extra, keep))


def test_extra_entries_give_a_query_its_bits_alone_and_in_a_continuation() -> None:
    """A tile scores the extra entries up to the last one any of its queries keeps: a query's bits do not depend on
    which queries share its tile."""
    q, kv, comp, keep = _extra_case(200, 0, 50, 64, 4)
    whole = shared_kv_attention(q, kv, 0.125, window=32, comp=comp, comp_keep=keep)
    for split in (1, 77, 199):
        first = shared_kv_attention(q[:split], kv[:split], 0.125, window=32, comp=comp, comp_keep=keep[:split])
        rest = shared_kv_attention(q[split:], kv, 0.125, window=32, comp=comp, comp_keep=keep[split:], start=split)
        np.testing.assert_array_equal(np.concatenate([first, rest]), whole)


@pytest.mark.parametrize("window", [0, 40])
def test_a_query_has_the_same_bits_alone_in_a_continuation_and_on_any_thread_count(window: int) -> None:
    """256 queries (parallel, claimed tiles) against every split into a first part and its continuation."""
    q, k, v = _case(256, 0, 4, 2, 64, 64, 1)
    assert q.size * 256 >= PARALLEL_MIN_ELEMENTS
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = causal_attention(q, k, v, 0.125, window=window)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        whole = causal_attention(q, k, v, 0.125, window=window)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(one, whole)
    for split in (1, 13, 100, 255):
        first = causal_attention(q[:split], k[:split], v[:split], 0.125, window=window)
        rest = causal_attention(q[split:], k, v, 0.125, window=window)
        np.testing.assert_array_equal(np.concatenate([first, rest]), whole)


@pytest.mark.parametrize("first, last, sink", [(0, 0, -np.inf), (0, 40, -np.inf), (17, 63, -np.inf), (5, 30, 2.5)])
def test_the_softmax_row_is_float64s_rounded(first: int, last: int, sink: float) -> None:
    """Within an ulp of float32 of the float64 softmax of the scaled scores (each product rounded to float32, as the
    row keeps them); zeros outside the keys seen."""
    r = np.random.default_rng(2).normal(0, 30, 64).astype(np.float32)
    x = (r[first : last + 1] * np.float32(0.3)).astype(np.float64)
    m = max(x.max(), sink)
    e = np.exp(x - m)
    want = e / (e.sum() + np.exp(sink - m))
    row = r.copy()
    _softmax_row(row, np.float32(0.3), first, last, np.float32(sink), np.empty(16, np.float64))
    np.testing.assert_allclose(row[first : last + 1], want, rtol=2 ** -22, atol=0)
    assert not row[:first].any() and not row[last + 1 :].any()
