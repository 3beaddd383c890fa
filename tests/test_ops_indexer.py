"""The DSA lightning indexer op (ikrun/ops/indexer.py) and the restricted latent attention (ikrun/ops/mla.py)
against plain numpy, libstdc++'s own std::partial_sort and a step-by-step replay of ik's AVX-512 GEMM."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numba
import numpy as np
import pytest

from ikrun.ops import mla
from ikrun.ops.indexer import TIE_LATER_INDEX, TIE_PARTIAL_SORT, indexer_scores, select_top_k
from ikrun.ops.mla import latent_attention

# ---- scores ----------------------------------------------------------------------------------------------------


def _numpy_scores(q: np.ndarray, k: np.ndarray, w: np.ndarray, q0: int) -> np.ndarray:
    qk = np.einsum("thd,sd->ths", q.astype(np.float64), k.astype(np.float64))
    s = (w[:, :, None].astype(np.float64) * np.maximum(qk, 0.0)).sum(1)
    s[np.arange(len(q))[:, None] + q0 < np.arange(len(k))[None, :]] = -np.inf
    return s


@pytest.mark.parametrize(("n", "n_keys", "q0"), [(40, 40, 0), (7, 30, 23), (300, 300, 0)])
def test_scores_are_the_weighted_relu_sum_over_heads(n: int, n_keys: int, q0: int) -> None:
    rng = np.random.default_rng(n)
    q = rng.standard_normal((n, 3, 16), dtype=np.float32)
    k = rng.standard_normal((n_keys, 16), dtype=np.float32)
    w = rng.standard_normal((n, 3), dtype=np.float32)  # negative weights too: scores below 0 exist
    got = indexer_scores(q, k, w, q0)
    want = _numpy_scores(q, k, w, q0)
    assert (np.isinf(got) == np.isinf(want)).all() and (got[np.isinf(got)] < 0).all()
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-4)
    assert (got[finite] < 0).any() and (got[finite] == 0).any()


def test_scores_reject_shapes_that_disagree() -> None:
    with pytest.raises(ValueError, match="shapes disagree"):
        indexer_scores(np.zeros((4, 2, 8), np.float32), np.zeros((4, 7), np.float32), np.zeros((4, 2), np.float32))


# ---- selection -------------------------------------------------------------------------------------------------


def _causal_random(n: int, seed: int, levels: int = 0) -> np.ndarray:
    """Causal scores; with `levels`, drawn from that many values (plenty of exact ties)."""
    rng = np.random.default_rng(seed)
    s = rng.integers(-levels, levels + 1, (n, n)).astype(np.float32) if levels else \
        rng.standard_normal((n, n), dtype=np.float32)
    s[np.triu_indices(n, 1)] = -np.inf
    return s


@pytest.mark.parametrize("tie", [TIE_PARTIAL_SORT, TIE_LATER_INDEX])
def test_every_candidate_is_kept_while_there_are_at_most_top_k(tie: int) -> None:
    s = _causal_random(40, 1, levels=2)
    keep = select_top_k(s, 16, tie)
    assert (keep[:16] == np.tril(np.ones((16, 40), bool))).all()  # t + 1 <= 16: the layer is dense there
    assert (keep[16:].sum(1) == 16).all()
    assert not keep[np.triu_indices(40, 1)].any()


@pytest.mark.parametrize("tie", [TIE_PARTIAL_SORT, TIE_LATER_INDEX])
def test_the_kept_keys_are_the_largest_scores(tie: int) -> None:
    s = _causal_random(120, 2, levels=3)
    keep = select_top_k(s, 10, tie)
    for t in range(10, 120):
        row, kept = s[t, : t + 1], keep[t, : t + 1]
        assert row[kept].min() >= row[~kept].max()


def test_distinct_scores_select_as_argsort_does() -> None:
    s = _causal_random(80, 3)
    want = np.zeros_like(s, dtype=bool)
    for t in range(80):
        want[t, np.argsort(-s[t, : t + 1])[:12]] = True
    for tie in (TIE_PARTIAL_SORT, TIE_LATER_INDEX):
        np.testing.assert_array_equal(select_top_k(s, 12, tie), want)


def test_later_index_wins_ties_like_iks_argsort() -> None:
    s = _causal_random(64, 4, levels=2)
    keep = select_top_k(s, 8, TIE_LATER_INDEX)
    for t in range(8, 64):
        idx = np.arange(t + 1)
        order = np.lexsort((-idx, -s[t, : t + 1]))  # score descending, then index descending
        np.testing.assert_array_equal(np.nonzero(keep[t])[0], np.sort(order[:8]))


def test_partial_sort_tie_break_on_equal_scores() -> None:
    """All-equal scores: the heap never replaces its first top_k indices; ggml_top_k's order keeps the last ones."""
    s = np.zeros((1, 6), np.float32)
    assert np.nonzero(select_top_k(s, 2, TIE_PARTIAL_SORT)[0])[0].tolist() == [0, 1]
    assert np.nonzero(select_top_k(s, 2, TIE_LATER_INDEX)[0])[0].tolist() == [4, 5]


_PARTIAL_SORT_CPP = r"""
#include <algorithm>
#include <cstdio>
#include <vector>
int main() {
    int n, k;
    while (std::scanf("%d %d", &n, &k) == 2) {
        std::vector<float> s(n);
        for (auto & v : s) std::scanf("%f", &v);
        std::vector<int> idx(n);
        for (int j = 0; j < n; ++j) idx[j] = j;
        std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int l, int r) { return s[l] > s[r]; });
        std::sort(idx.begin(), idx.begin() + k);
        for (int j = 0; j < k; ++j) std::printf("%d ", idx[j]);
        std::printf("\n");
    }
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler for the libstdc++ oracle")
def test_partial_sort_tie_break_matches_libstdcxx(tmp_path: Path) -> None:
    """The replayed heap selection against the real std::partial_sort, on rows full of exact ties."""
    src, exe = tmp_path / "ps.cpp", tmp_path / "ps"
    src.write_text(_PARTIAL_SORT_CPP)
    subprocess.run(["g++", "-O2", "-o", str(exe), str(src)], check=True)
    rng = np.random.default_rng(5)
    rows = []
    for i in range(600):
        n = int(rng.integers(2, 90))
        vals = rng.integers(-2, 3, n).astype(np.float32) * np.float32(0.5 if i % 2 else 1.0)
        rows.append((n, int(rng.integers(1, n)), vals))
    text = "".join(f"{n} {k} " + " ".join(f"{v:.1f}" for v in vals) + "\n" for n, k, vals in rows)
    out = subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout.splitlines()
    for (_, k, vals), line in zip(rows, out, strict=True):
        got = np.nonzero(select_top_k(vals[None], k, TIE_PARTIAL_SORT)[0])[0].tolist()
        assert got == [int(v) for v in line.split()], (vals.tolist(), k)


def test_selection_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="top_k"):
        select_top_k(np.zeros((2, 2), np.float32), 0)
    with pytest.raises(ValueError, match="tie-break"):
        select_top_k(np.zeros((2, 2), np.float32), 1, tie=7)


def test_parallel_kernels_give_identical_results(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(6)
    q = rng.standard_normal((70, 2, 8), dtype=np.float32)
    k = rng.standard_normal((70, 8), dtype=np.float32)
    w = rng.standard_normal((70, 2), dtype=np.float32)
    scores = indexer_scores(q, k, w)
    keep = select_top_k(scores, 9)
    monkeypatch.setattr("ikrun.ops.parallel.PARALLEL_MIN_ELEMENTS", 0)
    for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
        numba.set_num_threads(threads)
        try:
            np.testing.assert_array_equal(indexer_scores(q, k, w), scores)
            np.testing.assert_array_equal(select_top_k(scores, 9), keep)
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


# ---- restricted latent attention -------------------------------------------------------------------------------


def _mla_case(n: int, seed: int, n_sink: int = 0) -> dict:  # type: ignore[type-arg]
    rng = np.random.default_rng(seed)
    h, r, d, c, v = 3, 4, 6, 8, 5
    return {"q_rope": rng.standard_normal((n, h, r), dtype=np.float32),
            "q_nope": rng.standard_normal((n, h, d), dtype=np.float32),
            "w_kb": rng.standard_normal((h, c, d), dtype=np.float32) * 0.5,
            "cache": rng.standard_normal((n, r + c), dtype=np.float32),
            "w_vb": rng.standard_normal((h, v, c), dtype=np.float32) * 0.5,
            "sinks": rng.standard_normal((n_sink, r + c), dtype=np.float32) if n_sink else None}


def _numpy_mla(case: dict, scale: float, visible: np.ndarray) -> np.ndarray:  # type: ignore[type-arg]
    """Per-head expanded keys and values (no absorption), a float64 softmax over the sinks and the visible keys."""
    q_rope, q_nope, w_kb, cache, w_vb = (case[k].astype(np.float64) for k in ("q_rope", "q_nope", "w_kb", "cache",
                                                                              "w_vb"))
    r = q_rope.shape[2]
    sinks = case["sinks"].astype(np.float64) if case["sinks"] is not None else np.zeros((0, cache.shape[1]))
    rows = np.concatenate([sinks, cache])
    k_nope = np.einsum("jc,hcd->jhd", rows[:, r:], w_kb)  # each head's no-rope key for every row
    logits = (np.einsum("thd,jhd->htj", q_nope, k_nope) + np.einsum("thr,jr->htj", q_rope, rows[:, :r])) * scale
    mask = np.concatenate([np.ones((len(visible), len(sinks)), bool), visible], axis=1)
    logits = np.where(mask[None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    values = np.einsum("jc,hvc->jhv", rows[:, r:], w_vb)
    return np.einsum("htj,jhv->thv", p, values)


def test_plain_latent_attention_is_causal_mla() -> None:
    case = _mla_case(20, 7)
    args = [case[k] for k in ("q_rope", "q_nope", "w_kb", "cache", "w_vb")]
    np.testing.assert_allclose(latent_attention(*args, 0.3), _numpy_mla(case, 0.3, np.tril(np.ones((20, 20), bool))),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("n_sink", "window", "use_keep"), [(4, 0, False), (0, 5, False), (0, 0, True),
                                                             (3, 6, True)])
def test_sinks_window_and_keep_mask(n_sink: int, window: int, use_keep: bool) -> None:
    n = 300  # more than one query block of the op
    case = _mla_case(n, 8, n_sink)
    visible = np.tril(np.ones((n, n), bool))
    if window:
        visible &= np.subtract.outer(np.arange(n), np.arange(n)) < window
    keep = None
    if use_keep:
        keep = np.random.default_rng(9).random((n, n)) < 0.5
        keep[np.arange(n), np.arange(n)] = True
        visible &= keep
    args = [case[k] for k in ("q_rope", "q_nope", "w_kb", "cache", "w_vb")]
    got = latent_attention(*args, 0.25, sinks=case["sinks"], window=window, keep=keep)
    np.testing.assert_allclose(got, _numpy_mla(case, 0.25, visible), rtol=1e-4, atol=1e-5)


def _avx512_gemm_row(x: np.ndarray, y: np.ndarray, n: int) -> np.float32:
    """ik's iqk mul_mat_Qx_Qy_MxN for one output with 16-float registers, replayed on flat memory: the first
    16-float block (always read), the full blocks after it, then the 4-float tail loop from 16*(n//16) to n."""
    acc = np.float64(np.dot(x[:16].astype(np.float64), y[:16]))
    for i in range(1, n // 16):
        acc += np.dot(x[16 * i : 16 * i + 16].astype(np.float64), y[16 * i : 16 * i + 16])
    for i in range(4 * (n // 16), n // 4):
        acc += np.dot(x[4 * i : 4 * i + 4].astype(np.float64), y[4 * i : 4 * i + 4])
    return np.float32(acc)


@pytest.mark.parametrize(("n_sink", "n", "window"), [(4, 30, 0), (8, 30, 0), (12, 30, 0), (8, 300, 7),
                                                     (8, 300, 260)])
def test_ik_avx512_sink_values_follow_iks_gemm(n_sink: int, n: int, window: int) -> None:
    """With fewer than 16 sinks, each latent channel of the sinks' values is what ik's GEMM computes over the
    transposed sink latents [C, S] (zeros past their end) and the softmax rows [sinks | cache keys ...]; with a
    window and several query blocks too (the first keys' probabilities are then 0 for most queries)."""
    scale = 0.3
    case = _mla_case(n, 10, n_sink)
    args = [case[k] for k in ("q_rope", "q_nope", "w_kb", "cache", "w_vb")]
    exact = latent_attention(*args, scale, sinks=case["sinks"], window=window)
    ik = latent_attention(*args, scale, sinks=case["sinks"], window=window, ik_avx512_sinks=True)
    r, c = case["q_rope"].shape[2], case["w_kb"].shape[1]
    sink_lat = case["sinks"][:, r:]
    flat_x = np.concatenate([sink_lat.T.reshape(-1), np.zeros(16, np.float32)])
    rows = np.concatenate([case["sinks"], case["cache"]])
    q = np.concatenate([case["q_rope"], np.einsum("thd,hcd->thc", case["q_nope"], case["w_kb"])], -1)
    logits = np.einsum("thk,jk->thj", q, rows).astype(np.float64) * scale
    pos = np.arange(n)
    future = (pos[None, :] > pos[:, None]) | ((pos[:, None] - pos[None, :] >= window) if window else False)
    future = future[:, None, :]
    logits[:, :, n_sink:] = np.where(future, -np.inf, logits[:, :, n_sink:])
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
    expected = np.empty((n, 3, c), np.float32)
    for t in range(n):
        for h in range(3):
            sink_part = [_avx512_gemm_row(flat_x[ch * n_sink :], p[t, h], n_sink) for ch in range(c)]
            expected[t, h] = np.asarray(sink_part) + p[t, h, n_sink:] @ case["cache"][:, r:]
    want = np.einsum("thc,hvc->thv", expected, case["w_vb"])
    np.testing.assert_allclose(ik, want, rtol=1e-4, atol=1e-5)
    assert np.abs(ik - exact).max() > 0.1  # the over-read is not a rounding matter
    assert mla.overread_applies(n_sink) and not mla.overread_applies(16) and not mla.overread_applies(6)


def test_ik_avx512_sinks_leave_16_or_more_sinks_exact() -> None:
    case = _mla_case(12, 11, 16)
    args = [case[k] for k in ("q_rope", "q_nope", "w_kb", "cache", "w_vb")]
    np.testing.assert_array_equal(latent_attention(*args, 0.3, sinks=case["sinks"], ik_avx512_sinks=True),
                                  latent_attention(*args, 0.3, sinks=case["sinks"]))


def test_restricted_attention_is_thread_count_independent(monkeypatch: pytest.MonkeyPatch) -> None:
    case = _mla_case(50, 12, 8)
    args = [case[k] for k in ("q_rope", "q_nope", "w_kb", "cache", "w_vb")]
    first = latent_attention(*args, 0.3, sinks=case["sinks"], window=9)
    monkeypatch.setattr("ikrun.ops.parallel.PARALLEL_MIN_ELEMENTS", 0)
    for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
        numba.set_num_threads(threads)
        try:
            np.testing.assert_array_equal(latent_attention(*args, 0.3, sinks=case["sinks"], window=9), first)
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
