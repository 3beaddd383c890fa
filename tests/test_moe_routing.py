"""ik's fused softmax top-k router (ops/moe.py, --numerics ik): the order its partial sort leaves the experts in
decides the order of its float32 sum of their exponentials, so the port must leave them as libstdc++ does, ties
included (the printed figures of the hybrids' Q8_0 runs: tests/test_runtime_qwen3next.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ikrun.ops.stl_heap import partial_sort

CASES = Path(__file__).parent / "data" / "moe" / "libstdcxx-partial-sort.txt"


def test_the_partial_sort_leaves_the_experts_as_libstdcxx_does() -> None:
    """400 rows of 2..16 experts with integer logits (many ties), every k: g++ 12.2's std::partial_sort output."""
    rows = CASES.read_text().splitlines()
    assert len(rows) == 400
    for row in rows:
        head, want = row.split("|")
        n, k, *values = head.split()
        logits = np.array(values, dtype=np.float32)
        assert len(logits) == int(n)
        ids = np.empty(int(n), dtype=np.int64)
        partial_sort(logits, int(k), ids)
        assert ids.tolist() == [int(v) for v in want.split()], row
