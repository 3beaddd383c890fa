"""Multi-head latent attention in the absorbed form ik computes it (mla=3 without flash attention).

The KV cache holds one row per token: [k_rope | c_kv] (the roped key part shared by all heads, then the normalised
KV latent). Each head's no-rope query is absorbed into the latent space through attn_k_b
(q_lat = q_nope @ W_kb[h]^T); scores are [q_rope | q_lat] . cache row for every head against the same cache; the
softmax-weighted sum of latents is projected to the head's value through attn_v_b. No per-head keys or values are
ever expanded. The products run through BLAS (batched over heads), the masked softmax in Numba (ops/attention),
which measured 1.8x faster than a fused Numba loop from the tiny test model up to DeepSeek-V2-Lite sizes.
"""

from __future__ import annotations

import numpy as np

from ikrun.ops.attention import QUERY_BLOCK, causal_softmax


def latent_attention(q_rope: np.ndarray, q_nope: np.ndarray, w_kb: np.ndarray, cache: np.ndarray,
                     w_vb: np.ndarray, scale: float) -> np.ndarray:
    """Causal MLA over one fresh sequence (positions 0..n-1).

    q_rope [n, H, R] (roped), q_nope [n, H, D], w_kb [H, C, D], cache [n, R + C] rows [k_rope | c_kv],
    w_vb [H, V, C]; returns the heads' values [n, H, V].
    """
    n, n_head, n_rope = q_rope.shape
    n_lat = w_kb.shape[1]
    q = np.empty((n_head, n, n_rope + n_lat), dtype=np.float32)
    q[:, :, :n_rope] = q_rope.transpose(1, 0, 2)
    np.matmul(q_nope.transpose(1, 0, 2), w_kb.transpose(0, 2, 1), out=q[:, :, n_rope:])
    latent = np.empty((n_head, n, n_lat), dtype=np.float32)
    for q0 in range(0, n, QUERY_BLOCK):
        q1 = min(n, q0 + QUERY_BLOCK)
        scores = np.matmul(q[:, q0:q1], cache[:q1].T)  # [H, nq, q1]: keys past the block's last query never count
        causal_softmax(scores, scale, q0)
        np.matmul(scores, cache[:q1, n_rope:], out=latent[:, q0:q1])
    return np.matmul(latent, w_vb.transpose(0, 2, 1)).transpose(1, 0, 2)
