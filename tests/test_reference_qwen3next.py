"""The numpy reference of the Gated DeltaNet hybrids (ikrun.validate.qwen3next, what `ikrun validate` compares the
runtime with) against transformers' logits, and its chunked delta rule against the token-by-token recurrence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ikrun.validate.hf import HFReference
from ikrun.validate.qwen3next import CHUNK, chunk_gated_delta_rule
from tests.test_ik_engine import mean_kld

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("family", ["qwen3-next", "qwen35-moe"])
def test_reference_is_transformers(family: str) -> None:
    """All 8 chunks of transformers' float32 logits (transformers 5.24, torch_chunk_gated_delta_rule, eager)."""
    ref = HFReference(DATA / "convert" / family / "hf")
    tokens = np.load(DATA / "hf-logits" / family / "tokens.npy")
    hf = np.load(DATA / "hf-logits" / family / "logits.npy")
    for t, logits in zip(tokens, hf):
        ours = ref.logits(t)
        assert mean_kld(logits, ours) <= 1e-10
        assert (ours.argmax(-1) == logits.argmax(-1)).all()


def _recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """The gated delta rule token by token, in float64: S <- exp(g) S + beta k (v - exp(g) S^T k)^T, o = S^T q."""
    def l2(x: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    q, k = l2(q.astype(np.float64)) / np.sqrt(q.shape[-1]), l2(k.astype(np.float64))
    h, n, dk = q.shape
    state = np.zeros((h, dk, v.shape[-1]))
    out = np.zeros((h, n, v.shape[-1]))
    for t in range(n):
        state = state * np.exp(g[:, t])[:, None, None]
        delta = v[:, t] - np.einsum("hkv,hk->hv", state, k[:, t])
        state = state + np.einsum("hk,hv->hkv", k[:, t], delta * beta[:, t, None])
        out[:, t] = np.einsum("hkv,hk->hv", state, q[:, t])
    return out


def test_chunked_delta_rule_is_the_recurrence() -> None:
    """Across chunk boundaries and a padded last chunk (150 tokens = 2 full chunks + 22)."""
    rng = np.random.default_rng(5)
    h, n, dk, dv = 3, 2 * CHUNK + 22, 16, 8
    q, k = (rng.standard_normal((h, n, dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((h, n, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 0.5, (h, n)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (h, n)).astype(np.float32)
    chunked = chunk_gated_delta_rule(q, k, v, g, beta)
    np.testing.assert_allclose(chunked, _recurrent(q, k, v, g, beta), rtol=0, atol=2e-5)


def test_observer_sees_every_projection() -> None:
    """`observe` (what imatrix-style hooks get) is called with every linear weight of the checkpoint."""
    ref = HFReference(DATA / "convert" / "qwen3-next" / "hf")
    seen: set[str] = set()
    ref.logits(np.load(DATA / "hf-logits" / "qwen3-next" / "tokens.npy")[0], lambda name, rows: seen.add(name))
    linear = {n for n, t in ref.tensors.items() if len(t.shape) == 2 and "embed_tokens" not in n
              and n != "lm_head.weight"}
    assert seen == linear
