"""--numerics ik runs the routed experts of several sequences (ik's batches) as one product per expert and kernel
choice: the same bits as each batch run alone, where an expert's choice is the batches' own (ik converts an
expert's Q8_0 weights from 32 routed tokens on, and multiplies them as stored below)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ikrun.model import Model
from ikrun.ops.moe import ExpertGlu
from ikrun.options import RuntimeOptions

MOE = Path(__file__).parent / "data" / "convert" / "qwen3-moe" / "ik-q8_0.gguf"


@pytest.mark.parametrize("sizes", [(40, 10, 33), (40, 36), (5, 7, 3)])
def test_batches_joined_equal_each_batch_alone(sizes: tuple[int, ...]) -> None:
    """Batches of `sizes` tokens, every token's first slot on expert 0: converted in a batch of 32 tokens or more,
    as stored in a smaller one; the other slots random."""
    model = Model(MOE, options=RuntimeOptions(numerics="ik"))
    ik = model.numerics
    names = [f"blk.0.ffn_{t}_exps.weight" for t in ("up", "gate", "down")]
    n_expert, n_embd = model.weights.info(names[0]).shape[0], model.weights.info(names[0]).shape[2]
    n, k = sum(sizes), 2
    rng = np.random.default_rng(len(sizes))
    x = rng.standard_normal((n, n_embd)).astype(np.float32)
    sel = np.stack([np.zeros(n, np.int64), rng.integers(1, n_expert, n)], axis=1)
    w = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    batches = np.cumsum((0,) + sizes)
    joined = ik.routed_experts(x, sel, w, n_expert, names, None, ExpertGlu(), True, batches)
    alone = [ik.routed_experts(x[a:b], sel[a:b], w[a:b], n_expert, names, None, ExpertGlu(), True)
             for a, b in zip(batches[:-1], batches[1:])]
    assert np.array_equal(joined.out.view(np.uint32), np.concatenate([r.out for r in alone]).view(np.uint32))
    assert joined.act is not None
    assert np.array_equal(joined.act.view(np.uint32),
                          np.concatenate([r.act for r in alone if r.act is not None]).view(np.uint32))
    assert np.array_equal(joined.rows(0), np.arange(0, n * k, k))
