"""libstdc++'s heap algorithms on an index array ordered by a score (comparator score[a] > score[b]): ik picks its
top-k experts and DSA keys with std::partial_sort / std::nth_element, and the order they leave the indices in is the
order ik sums in, so the selection is reproduced step for step."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, inline="always")
def adjust_heap(idx: np.ndarray, score: np.ndarray, hole: int, length: int, value: int) -> None:
    """libstdc++'s __adjust_heap then __push_heap for the comparator score[a] > score[b] (a min-heap on score)."""
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if score[idx[child]] > score[idx[child - 1]]:
            child -= 1
        idx[hole] = idx[child]
        hole = child
    if (length & 1) == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        idx[hole] = idx[child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and score[idx[parent]] > score[value]:
        idx[hole] = idx[parent]
        hole = parent
        parent = (hole - 1) // 2
    idx[hole] = value


@njit(cache=True, nogil=True, inline="always")
def heap_select(idx: np.ndarray, score: np.ndarray, first: int, middle: int, last: int) -> None:
    """libstdc++'s __heap_select on idx[first:last] (the heap in idx[first:middle]) for score[a] > score[b]."""
    length = middle - first
    if length > 1:
        parent = (length - 2) // 2
        while True:
            adjust_heap(idx[first:], score, parent, length, idx[first + parent])
            if parent == 0:
                break
            parent -= 1
    for i in range(middle, last):
        if score[idx[i]] > score[idx[first]]:
            value = idx[i]
            idx[i] = idx[first]
            adjust_heap(idx[first:], score, 0, length, value)


@njit(cache=True, nogil=True, inline="always")
def partial_sort(score: np.ndarray, k: int, idx: np.ndarray) -> None:
    """idx = 0..n-1 as std::partial_sort(idx, idx + k, idx + n, score[a] > score[b]) leaves them: the top k in
    descending order, then the others in the order the heap selection left them."""
    n = idx.shape[0]
    for j in range(n):
        idx[j] = j
    heap_select(idx, score, 0, k, n)
    last = k
    while last > 1:
        last -= 1
        value = idx[last]
        idx[last] = idx[0]
        adjust_heap(idx, score, 0, last, value)
