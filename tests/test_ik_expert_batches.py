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
    starts = np.cumsum((0,) + sizes)
    joined = ik.routed_experts(x, sel, w, n_expert, names, None, ExpertGlu(), True,
                               np.repeat(np.arange(len(sizes)), sizes))
    alone = [ik.routed_experts(x[a:b], sel[a:b], w[a:b], n_expert, names, None, ExpertGlu(), True)
             for a, b in zip(starts[:-1], starts[1:])]
    assert np.array_equal(joined.out.view(np.uint32), np.concatenate([r.out for r in alone]).view(np.uint32))
    assert joined.act is not None
    assert np.array_equal(joined.act.view(np.uint32),
                          np.concatenate([r.act for r in alone if r.act is not None]).view(np.uint32))
    assert np.array_equal(joined.rows(0), np.arange(0, n * k, k))


def test_micro_batches_that_interleave_equal_each_alone() -> None:
    """Rows labelled by micro-batch in any order (ik's last block: a micro-batch's output rows together, the rows
    before them apart): each label's rows computed alone give the same bits."""
    model = Model(MOE, options=RuntimeOptions(numerics="ik"))
    ik = model.numerics
    names = [f"blk.0.ffn_{t}_exps.weight" for t in ("up", "gate", "down")]
    n_expert, n_embd = model.weights.info(names[0]).shape[0], model.weights.info(names[0]).shape[2]
    labels = np.repeat([0, 1, 0, 1, 2], [20, 10, 20, 30, 5])
    n, k = len(labels), 2
    rng = np.random.default_rng(9)
    x = rng.standard_normal((n, n_embd)).astype(np.float32)
    sel = np.stack([np.zeros(n, np.int64), rng.integers(1, n_expert, n)], axis=1)
    w = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    joined = ik.routed_experts(x, sel, w, n_expert, names, None, ExpertGlu(), False, labels)
    for b in range(3):
        rows = labels == b  # expert 0 gets 40, 40 and 5 tokens: converted, converted, as stored
        alone = ik.routed_experts(x[rows], sel[rows], w[rows], n_expert, names, None, ExpertGlu(), False)
        assert np.array_equal(joined.out[rows].view(np.uint32), alone.out.view(np.uint32))


@pytest.mark.parametrize(("lengths", "indices", "ik_batch", "expected"), [
    ((128,) * 6, (0, 1, 2, 3, 4, 5), 2048, (0, 0, 0, 0, 1, 1)),  # four chunks of 128 a micro-batch of 512
    ((256,) * 3, (5, 6, 7), 2048, (2, 3, 3)),  # by their index in the run: chunks 6 and 7 share one
    ((128,) * 4, (0, 1, 2, 3), 256, (0, 0, 1, 1)),  # -b 256: two chunks a decode
    ((128,) * 2, (0, 1), 0, (0, 1)),  # the default: each chunk its own
    ((512,) * 2, (0, 1), 2048, (0, 1)),
    ((384,) * 2, (0, 1), 2048, (0, 1)),  # 384 does not divide 512: ik's micro-batch cuts through a chunk (not modelled)
    ((128, 64), (0, 1), 2048, (0, 1))])
def test_micro_batches_group_the_chunks_llama_perplexity_decodes_together(
        lengths: tuple[int, ...], indices: tuple[int, ...], ik_batch: int, expected: tuple[int, ...]) -> None:
    from ikrun.models.base import Sequence
    from ikrun.modules.ffn import micro_batches

    seqs = [Sequence(np.zeros(n, np.int64), index=i) for n, i in zip(lengths, indices)]
    assert micro_batches(seqs, ik_batch).tolist() == list(expected)
