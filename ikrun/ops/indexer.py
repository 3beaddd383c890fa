"""DeepSeek Sparse Attention's lightning indexer: which earlier keys each query may attend to.

The semantics, shared by every architecture with a DSA indexer (how q, k and w are produced, any sink boost or
window is the model module's business):

- **Scores** (`indexer_scores`). For query t (absolute position q0 + t) and key s of the cache:

      score[t, s] = sum over indexer heads h of  w[t, h] * relu(q[t, h] . k[s])     for s <= q0 + t
      score[t, s] = -inf                                                             for s >  q0 + t

  No scale is applied here. ik folds every scale into w before the scores (GLM-DSA: w / sqrt(heads * head_dim);
  openPangu: none), so callers pass w already scaled. The heads are accumulated in order h = 0, 1, ... into a float32
  sum starting at 0, one (possibly fused) multiply-add per head, as ik's fused kernel does.
- **Selection** (`select_top_k`). Only finite scores are candidates. A query with at most top_k candidates keeps
  them all, so under a causal mask the layer is dense while t + 1 <= top_k. Otherwise exactly top_k keys are kept,
  those with the largest scores; ties at the boundary are broken in one of ik's two ways, both deterministic:

  - `TIE_LATER_INDEX`: among equal scores the later key wins. ik's `ggml_top_k` (its argsort orders
    (score, index) pairs with std::greater).
  - `TIE_PARTIAL_SORT`: the keys libstdc++'s `std::partial_sort` leaves in front when it orders the key indices
    0..n-1 by `score[a] > score[b]`. ik's fused `iqk_indexer_topk`, which llama-perplexity uses by default
    (`-fidx`). The heap selection is replayed step by step (make_heap over the first top_k indices, then each
    later index replaces the heap top when strictly greater), so equal scores resolve exactly as there.

  Exact ties are not rare: relu makes the score of every key that all heads score negatively exactly 0.
- **Attention**. The result is a boolean mask [n, n_keys] (True = attend) for
  `ikrun.ops.mla.latent_attention(keep=...)`. A key outside it has no weight in the softmax (ik adds -1e30 to its
  logit, which underflows to exactly zero weight).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikrun.ops.parallel import pick
from ikrun.ops.stl_heap import heap_select

TIE_LATER_INDEX = 0
TIE_PARTIAL_SORT = 1
TIE_TORCH = 2
TIE_NAMES = {TIE_LATER_INDEX: "later index", TIE_PARTIAL_SORT: "std::partial_sort", TIE_TORCH: "torch.topk"}

#: queries per block: bounds the q.k buffer to block x heads x keys floats
QUERY_BLOCK = 128
# a*b+c may be fused into one multiply-add, as ik's kernel does; the order over heads is fixed
_FMA = {"contract"}


@njit(cache=True, nogil=True, fastmath=_FMA, inline="always")
def _score_row(qk: np.ndarray, w: np.ndarray, last: int, out: np.ndarray) -> None:
    zero = np.float32(0.0)
    for s in range(last + 1):
        acc = zero
        for h in range(qk.shape[0]):
            v = qk[h, s]
            acc = w[h] * (v if v > zero else zero) + acc
        out[s] = acc
    for s in range(last + 1, out.shape[0]):
        out[s] = -np.inf


@njit(cache=True, nogil=True, fastmath=_FMA)
def _scores_serial(qk: np.ndarray, w: np.ndarray, first: int, out: np.ndarray) -> None:
    for t in range(qk.shape[0]):
        _score_row(qk[t], w[t], min(first + t, out.shape[1] - 1), out[t])


@njit(cache=True, nogil=True, fastmath=_FMA, parallel=True)
def _scores_parallel(qk: np.ndarray, w: np.ndarray, first: int, out: np.ndarray) -> None:
    for t in prange(qk.shape[0]):
        _score_row(qk[t], w[t], min(first + t, out.shape[1] - 1), out[t])


def indexer_scores(q: np.ndarray, k: np.ndarray, w: np.ndarray, q0: int = 0) -> np.ndarray:
    """Causal indexer scores [n, n_keys] (float32, -inf after each query's position).

    q [n, heads, d] (query t at absolute position q0 + t), k [n_keys, d] (key s at position s), w [n, heads].
    """
    n, n_head, d = q.shape
    if k.ndim != 2 or k.shape[1] != d or w.shape != (n, n_head):
        raise ValueError(f"indexer shapes disagree: q {list(q.shape)}, k {list(k.shape)}, w {list(w.shape)}")
    q = np.ascontiguousarray(q, dtype=np.float32)
    kt = np.ascontiguousarray(k, dtype=np.float32).T
    w = np.ascontiguousarray(w, dtype=np.float32)
    out = np.empty((n, k.shape[0]), dtype=np.float32)
    for b0 in range(0, n, QUERY_BLOCK):
        b1 = min(n, b0 + QUERY_BLOCK)
        qk = np.matmul(q[b0:b1], kt)  # [block, heads, n_keys]
        pick(_scores_serial, _scores_parallel, qk.size)(qk, w[b0:b1], q0 + b0, out[b0:b1])
    return out


@njit(cache=True, nogil=True, error_model="numpy")
def _scores_unfused(qk: np.ndarray, w: np.ndarray, first: int, out: np.ndarray) -> None:
    """Scores summed as ik's graph sums them with flash attention off: per head a product, then an add."""
    zero = np.float32(0.0)
    for t in range(qk.shape[0]):
        last = min(first + t, out.shape[1] - 1)
        for s in range(out.shape[1]):
            out[t, s] = zero if s <= last else -np.inf
        for h in range(qk.shape[1]):
            for s in range(last + 1):
                v = qk[t, h, s]
                term = (v if v > zero else zero) * w[t, h]
                out[t, s] = out[t, s] + term


def scores_from_products(qk: np.ndarray, w: np.ndarray, q0: int = 0) -> np.ndarray:
    """indexer_scores from the heads' products qk [n, heads, n_keys] (an engine's own q . k), each head's weighted
    term rounded before it is added, in head order (ik's per-head ggml_mul and ggml_add)."""
    qk = np.ascontiguousarray(qk, dtype=np.float32)
    out = np.empty((qk.shape[0], qk.shape[2]), dtype=np.float32)
    _scores_unfused(qk, np.ascontiguousarray(w, dtype=np.float32), q0, out)
    return out


@njit(cache=True, nogil=True, inline="always")
def _partial_sort_front(score: np.ndarray, top_k: int, idx: np.ndarray) -> None:
    """The first top_k entries of std::partial_sort(indices, +top_k, end, score[a] > score[b]), as a set."""
    for j in range(score.shape[0]):
        idx[j] = j
    heap_select(idx, score, 0, top_k, score.shape[0])


@njit(cache=True, nogil=True, inline="always")
def _nth_element_front(score: np.ndarray, top_k: int, idx: np.ndarray) -> None:
    """The first top_k entries of std::nth_element(indices, +top_k-1, end, score[a] > score[b]), as a set."""
    n = score.shape[0]
    for j in range(n):
        idx[j] = j
    first, nth, last = 0, top_k - 1, n
    depth = 0
    m = n
    while m > 1:  # 2 * floor(log2(n))
        m >>= 1
        depth += 2
    while last - first > 3:
        if depth == 0:
            heap_select(idx, score, first, nth + 1, last)
            idx[first], idx[nth] = idx[nth], idx[first]
            return
        depth -= 1
        # median of (first + 1, middle, last - 1) moved to first, then the unguarded partition
        a, b, c = first + 1, first + (last - first) // 2, last - 1
        va, vb, vc = score[idx[a]], score[idx[b]], score[idx[c]]
        if va > vb:
            pick = b if vb > vc else (c if va > vc else a)
        else:
            pick = a if va > vc else (c if vb > vc else b)
        idx[first], idx[pick] = idx[pick], idx[first]
        pivot = score[idx[first]]
        lo, hi = first + 1, last
        while True:
            while score[idx[lo]] > pivot:
                lo += 1
            hi -= 1
            while pivot > score[idx[hi]]:
                hi -= 1
            if lo >= hi:
                break
            idx[lo], idx[hi] = idx[hi], idx[lo]
            lo += 1
        if lo <= nth:
            first = lo
        else:
            last = lo
    for i in range(first + 1, last):  # insertion sort of the last few
        value = idx[i]
        if score[value] > score[idx[first]]:
            for j in range(i, first, -1):
                idx[j] = idx[j - 1]
            idx[first] = value
        else:
            j = i
            while score[value] > score[idx[j - 1]]:
                idx[j] = idx[j - 1]
                j -= 1
            idx[j] = value


@njit(cache=True, nogil=True, inline="always")
def _later_index_front(score: np.ndarray, top_k: int, idx: np.ndarray) -> None:
    """The top_k keys by (score, index) descending: stable sort of the reversed row, mapped back."""
    n = score.shape[0]
    order = np.argsort(-score[::-1], kind="mergesort")
    for j in range(top_k):
        idx[j] = n - 1 - order[j]


@njit(cache=True, nogil=True)
def _select_row(score: np.ndarray, top_k: int, tie: int, idx: np.ndarray, keep: np.ndarray) -> None:
    """One query's kept keys (select_top_k). Called, not inlined (ikquant/formats/jit.py: why a task is a function
    of its own)."""
    n_finite = 0
    for s in range(score.shape[0]):
        finite = score[s] > -np.inf
        keep[s] = finite
        if finite:
            n_finite += 1
    if n_finite <= top_k:
        return
    if tie == TIE_PARTIAL_SORT or (tie == TIE_TORCH and top_k * 64 <= score.shape[0]):
        _partial_sort_front(score, top_k, idx)
    elif tie == TIE_TORCH:
        _nth_element_front(score, top_k, idx)
    else:
        _later_index_front(score, top_k, idx)
    keep[:] = False
    for j in range(top_k):
        keep[idx[j]] = True


@njit(cache=True, nogil=True)
def _select_serial(scores: np.ndarray, top_k: int, tie: int, keep: np.ndarray) -> None:
    idx = np.empty(scores.shape[1], dtype=np.int64)
    for t in range(scores.shape[0]):
        _select_row(scores[t], top_k, tie, idx, keep[t])


@njit(cache=True, nogil=True, parallel=True)
def _select_parallel(scores: np.ndarray, top_k: int, tie: int, keep: np.ndarray) -> None:
    for t in prange(scores.shape[0]):
        idx = np.empty(scores.shape[1], dtype=np.int64)
        _select_row(scores[t], top_k, tie, idx, keep[t])


def select_top_k(scores: np.ndarray, top_k: int, tie: int = TIE_PARTIAL_SORT) -> np.ndarray:
    """Keys kept per query [n, n_keys] (bool): every finite score while there are at most top_k of them, else the
    top_k largest with ties broken by `tie` (TIE_PARTIAL_SORT, TIE_LATER_INDEX or TIE_TORCH, see the module
    docstring)."""
    if top_k <= 0:
        raise ValueError(f"top_k must be positive (got {top_k})")
    if tie not in TIE_NAMES:
        raise ValueError(f"tie-break {tie} is not one of {sorted(TIE_NAMES)}")
    scores = np.ascontiguousarray(scores, dtype=np.float32)
    keep = np.empty(scores.shape, dtype=np.bool_)
    pick(_select_serial, _select_parallel, scores.size)(scores, int(top_k), int(tie), keep)
    return keep


#: 1/sqrt(2) as ik's fast Walsh-Hadamard transform rounds it
_INV_SQRT2 = np.float32(0.707106781)


def hadamard(x: np.ndarray) -> np.ndarray:
    """ggml_hadamard over the last axis (a power of two): the orthonormal Walsh-Hadamard rotation ik applies to
    GLM-DSA's indexer queries and keys before the keys enter its f16 indexer cache. Dot products are unchanged up to
    rounding; what it changes is which values the f16 cache rounds. ik's butterfly order, the scale applied last."""
    n = x.shape[-1]
    if n < 2 or n & (n - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two length, got {n}")
    y = np.array(x, dtype=np.float32)
    h, scale = 1, np.float32(1.0)
    while h < n:
        pairs = y.reshape(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0].copy(), pairs[:, :, 1].copy()
        pairs[:, :, 0] = a + b
        pairs[:, :, 1] = a - b
        scale = np.float32(scale * _INV_SQRT2)
        h *= 2
    return y * scale
