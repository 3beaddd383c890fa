"""ik's attention arithmetic (ikrun/numerics/ik/attention.py ik_causal_attention, ik_latent_attention): queries are
computed a group at a time, and what a query gets must not depend on its group, on how many queries share the
call, or on keys it may not see."""

from __future__ import annotations

import numpy as np
import pytest

from ikrun.numerics.ik.attention import ik_causal_attention, ik_latent_attention
from ikrun.ops.attention import causal_attention


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


@pytest.mark.parametrize(("n", "past"), [(37, 0), (29, 11), (64, 3)])
def test_each_query_gets_what_it_gets_alone(n: int, past: int) -> None:
    """Every output bit of a batch of queries equals the query evaluated alone against the keys it sees (ik's
    attention keeps no state between queries); and the result is the attention, to float32 rounding."""
    rng = np.random.default_rng(n + past)
    q = rng.standard_normal((n, 8, 32)).astype(np.float32)
    k, v = _f16(rng.standard_normal((past + n, 4, 32))), _f16(rng.standard_normal((past + n, 4, 48)))
    got = ik_causal_attention(q, k, v, 0.17)
    for i in range(n):
        alone = ik_causal_attention(q[i : i + 1], k[: past + i + 1], v[: past + i + 1], 0.17)
        np.testing.assert_array_equal(got[i], alone[0], err_msg=f"query {i}")
    np.testing.assert_allclose(got, causal_attention(q, k, v, 0.17), rtol=1e-5, atol=1e-6)


def test_latent_queries_get_what_they_get_alone() -> None:
    rng = np.random.default_rng(5)
    n, rope = 21, 16
    q = rng.standard_normal((3, n, 80)).astype(np.float32)
    cache = _f16(rng.standard_normal((n, 80)))
    got = ik_latent_attention(q, cache, rope, 0.1)
    for i in (0, 3, 4, 20):
        scores = np.einsum("hd,nd->hn", q[:, i].astype(np.float64), cache[: i + 1]) * 0.1
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        want = (p / p.sum(axis=1, keepdims=True)) @ cache[: i + 1, rope:]
        np.testing.assert_allclose(got[:, i], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ik_latent_attention(q[:, :8], cache[:8], rope, 0.1), got[:, :8])


def test_head_dims_ik_does_not_take_whole_are_refused() -> None:
    with pytest.raises(ValueError, match="multiples of 16"):
        ik_causal_attention(np.zeros((2, 2, 40), np.float32), np.zeros((2, 1, 40), np.float32),
                            np.zeros((2, 1, 40), np.float32), 0.1)
