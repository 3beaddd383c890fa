"""The flash-attention inputs tools/iqk_fa_oracle.py ran through ik's ggml_flash_attn_ext (native AVX2 build) for
tests/data/flash-attention/iqk-avx2: random queries (float32) and f16 keys and values, made again from their seeds.
Every head size ik's own (iqk) kernels take, and a few its generic ggml kernel takes (GENERIC_CASES)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Case(NamedTuple):
    """One call: head sizes, queries, ik's cache length (keys beyond first + query masked), heads, ik's threads,
    the first query's position, the queries' scale (large: wide scores, so new maxima and underflowing weights)."""

    dk: int
    dv: int
    n_q: int
    n_kv: int
    n_head: int
    threads: int
    first: int
    q_scale: float

    @property
    def name(self) -> str:
        return "_".join(str(x) for x in self)


CASES = (
    Case(192, 128, 128, 256, 2, 1, 0, 1.0),  # a llama-perplexity chunk of 128 tokens on DeepSeek-V3's heads
    Case(192, 128, 37, 256, 2, 4, 100, 8.0),  # a continuation, rows split among threads, wide scores
    Case(192, 128, 64, 512, 2, 2, 300, 30.0),
    Case(64, 64, 20, 256, 1, 1, 5, 4.0),
    Case(96, 96, 20, 256, 1, 1, 5, 4.0),
    Case(128, 128, 20, 256, 1, 1, 5, 4.0),
    Case(192, 192, 20, 256, 1, 1, 5, 4.0),
    Case(256, 256, 20, 256, 1, 1, 5, 4.0),
    Case(320, 256, 20, 256, 1, 1, 5, 4.0),  # 32-key blocks
    Case(512, 512, 8, 256, 1, 1, 5, 4.0),
    Case(576, 512, 8, 256, 1, 1, 5, 4.0),  # 32-key blocks
)
#: head sizes ik's iqk kernels do not take: ggml's generic kernel (the tiny DeepSeek-V3's 48/32; values not a whole
#: number of 32-wide steps)
GENERIC_CASES = (
    Case(48, 32, 128, 256, 2, 1, 0, 1.0),
    Case(48, 40, 64, 256, 2, 2, 0, 3.0),
    Case(80, 72, 37, 256, 2, 1, 30, 3.0),
)


def case_inputs(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.float32]:
    """q [H, n_q, Dk] float32, k [H, n_kv, Dk] and v [H, n_kv, Dv] float16, and the scale 1/sqrt(Dk)."""
    rng = np.random.default_rng(list(case[:7]))
    q = (rng.standard_normal((case.n_head, case.n_q, case.dk)) * case.q_scale).astype(np.float32)
    k = rng.standard_normal((case.n_head, case.n_kv, case.dk)).astype(np.float16)
    v = rng.standard_normal((case.n_head, case.n_kv, case.dv)).astype(np.float16)
    return q, k, v, np.float32(1.0 / np.sqrt(np.float32(case.dk)))
