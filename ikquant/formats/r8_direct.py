"""Q8_0_R8 and Q4_0_R8 decoded straight from their layout (ik's block_q8_0_r8 and block_iq4_nl_r8).

A group of 8 rows stores, per 32-value block, the 8 rows' f16 scales, then the rows' bytes four at a time, the rows
side by side: byte 32 j + 4 k + i of the block's data is row k's byte 4 j + i (Q8_0: code 4 j + i; Q4_0: the packed
byte whose low nibble is value 4 j + i and high nibble value 4 j + i + 16). Decoding through the regrouping map
moved every byte a second time and ran at a third of ik's speed; here each value is decoded where it lies, with the
plain rows' arithmetic (code x d, (nibble - 8) x d). tests/test_interleaved.py checks both against
regroup-then-decode bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import load_f16

KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")
U = np.uint64
ROWS = 8
QK = 32


@njit(**KERNEL)
def _decode(q: np.ndarray, out: np.ndarray, nibbles: bool) -> None:
    """Groups [rows / 8, 8 row bytes] -> rows: Q4_0_R8's packed nibbles (`nibbles`) or Q8_0_R8's codes."""
    codes = q.view(np.int8)
    block_bytes = ROWS * (2 + (QK // 2 if nibbles else QK))
    for g in prange(q.shape[0]):
        gg = U(g)
        for ib in range(out.shape[1] // QK):
            o = ib * block_bytes
            for k in range(ROWS):
                d = load_f16(q[g], o + 2 * k)
                row = U(ROWS * g + k)
                for j in range(QK // 8 if nibbles else QK // 4):
                    at = U(o + 2 * ROWS + 32 * j + 4 * k)
                    to = U(QK * ib + 4 * j)
                    for i in range(4):
                        if nibbles:
                            b = np.int32(q[gg, at + U(i)])
                            out[row, to + U(i)] = np.float32(np.int32((b & np.int32(15)) - np.int32(8))) * d
                            out[row, to + U(i + 16)] = np.float32(np.int32((b >> np.int32(4)) - np.int32(8))) * d
                        else:
                            out[row, to + U(i)] = np.float32(codes[gg, at + U(i)]) * d


def dequantize_q8_0_r8(q: np.ndarray, out: np.ndarray) -> None:
    """Q8_0_R8 groups [rows / 8, 8 row bytes] -> rows."""
    _decode(q, out, False)


def dequantize_q4_0_r8(q: np.ndarray, out: np.ndarray) -> None:
    """Q4_0_R8 groups [rows / 8, 8 row bytes] -> rows."""
    _decode(q, out, True)
