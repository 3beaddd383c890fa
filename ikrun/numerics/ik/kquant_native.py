"""ik's own Q4_K, Q5_K and Q6_K kernels (mul_mat_qX_K_q8_2_X4_T, mul_mat_qY_K_q8_2_X4_T), for `--numerics ik`
and `ik-avx2`: what ik multiplies those weights with below the activation rows from which it converts them (32 for
Q4_K and Q5_K, 64 for Q6_K: a routed expert's few tokens, a one-token decode) and where a weight's rows are no
multiple of the converted form's row group (an odd vocabulary's output). Its AVX2 and AVX-512 builds share them:
the AVX-512 build sums the byte products in 32 bits (vpdpbusd), the AVX2 build pairs them in 16 bits (vpmaddubsw,
then 16-bit adds of four such pairs) where they cannot overflow (8 products of at most 32 x 127), so both hold the
same exact integers.

Per 256 values of a row and an activation row (Q8_2_X4: 32-value blocks, bf16 scales, integer sums) the kernel
holds 8 float32 lanes. Per 128 values (half j) lane l takes the 16 values 128 j + 32 (l % 4) + 16 (l // 4): its
integer sum of products (the unsigned codes of Q4_K / Q5_K; Q6_K's q - 32) is added as fma(lane scale x the
activation block's scale, float(sum), acc[l]), the lane scale being d x the 6-bit scale of sub-block 4 j + l % 4
(Q4_K, Q5_K) or d x the int8 scale of the 16 values (Q6_K). Q4_K and Q5_K first add each block's minima: acc[k] =
fma(activation block 8 i + k's scale x its integer sum, -(dmin x min_k), acc[k]). The 8 lanes are summed as
hsum_float_8. Checked byte for byte against ik's AVX2 build (tests/test_kquant_native.py).
"""

from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange

from ikquant.formats.jit import read_only
from ikquant.formats.kquants import scale_min_k4
from ikquant.formats.numeric import fmaf, hsum_float_8, load_f16
from ikrun.numerics.ik.qgemm import IntRows
from ikrun.ops.parallel import claim_items, task_items

#: the weight types whose own kernel is reproduced here, by their code here
KQUANT_TYPES = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}
BLOCK_BYTES = np.array([144, 176, 210], np.int64)
SUPER = 256
BLOCK = 32  # values per activation block
ROW_TILE = 16  # weight rows a task multiplies (row by row) against all its matrix's tokens


@njit(cache=True, nogil=True, inline="always")
def _prepare_row(row: np.ndarray, kind: int, nb: int, wv: np.ndarray, lane_scale: np.ndarray,
                 mins: np.ndarray) -> None:
    """A row as the kernel holds it: every value's integer (wv), each block's 16 lane scales in the kernel's lane
    order (per half j, lanes 0 .. 7: lane_scale[16 i + 8 j + l]) and Q4_K / Q5_K's negated minima per sub-block."""
    for i in range(nb):
        o = BLOCK_BYTES[kind] * i
        blk = row[o : o + BLOCK_BYTES[kind]]
        at = SUPER * i
        if kind == 2:
            d = load_f16(blk, 208)
            for j in range(2):
                for t in range(BLOCK):
                    lo, hi = np.int32(blk[64 * j + t]), np.int32(blk[64 * j + t + 32])
                    h = np.int32(blk[128 + 32 * j + t])
                    v = at + 128 * j + t
                    wv[v] = ((lo & 15) | ((h & 3) << 4)) - 32
                    wv[v + 32] = ((hi & 15) | (((h >> 2) & 3) << 4)) - 32
                    wv[v + 64] = ((lo >> 4) | (((h >> 4) & 3) << 4)) - 32
                    wv[v + 96] = ((hi >> 4) | (((h >> 6) & 3) << 4)) - 32
                for lane in range(8):
                    s = np.int8(blk[192 + 8 * j + 2 * (lane % 4) + lane // 4])
                    lane_scale[16 * i + 8 * j + lane] = d * np.float32(s)
            continue
        d, dmin = load_f16(blk, 0), load_f16(blk, 2)
        codes = 48 if kind == 1 else 16
        for k in range(8):
            sc, mn = scale_min_k4(blk, k)
            mins[8 * i + k] = np.float32(-1.0) * (dmin * np.float32(mn))
            lane_scale[16 * i + 8 * (k // 4) + k % 4] = d * np.float32(sc)
            lane_scale[16 * i + 8 * (k // 4) + k % 4 + 4] = d * np.float32(sc)
            for t in range(BLOCK):
                c = np.int32(blk[codes + BLOCK * (k // 2) + t])
                q = (c >> 4) if k % 2 else (c & 15)
                if kind == 1:
                    q |= ((np.int32(blk[16 + t]) >> k) & 1) << 4
                wv[at + BLOCK * k + t] = q


@njit(cache=True, nogil=True, inline="always")
def _row(kind, wv, lane_scale, mins, xu, xd, isums, tokens, m0, m1, out, r, sums, wsum, acc):  # type: ignore[no-untyped-def]
    """One prepared row against tokens[m0:m1] (out[m, r]); `wsum` holds each 16 values' sum (sum w (u - 128) = sum
    w u - 128 sum w), `sums` and `acc` a block's lanes."""
    nb = xd.shape[1] // 8
    for g in range(16 * nb):
        total = np.int32(0)
        for t in range(16):
            total += np.int32(wv[16 * g + t])
        wsum[g] = total
    for m in range(m0, m1):
        x = tokens[m]
        xr = xu[x]
        acc[:] = 0
        for i in range(nb):
            if kind != 2:
                for k in range(8):
                    my = xd[x, 8 * i + k] * np.float32(isums[x, 8 * i + k])
                    acc[k] = fmaf(my, mins[8 * i + k], acc[k])
            for g in range(16):
                at = SUPER * i + 16 * g
                total = np.int32(0)
                for t in range(16):
                    total += np.int32(wv[at + t]) * np.int32(xr[at + t])
                sums[g] = total - 128 * wsum[16 * i + g]
            for j in range(2):
                for lane in range(8):
                    g = 8 * j + 2 * (lane % 4) + lane // 4
                    dd = lane_scale[16 * i + 8 * j + lane] * xd[x, 8 * i + 4 * j + lane % 4]
                    acc[lane] = fmaf(dd, np.float32(sums[g]), acc[lane])
        out[m, r] = hsum_float_8(acc)


@njit(cache=True, nogil=True, parallel=True)
def _matmuls(raw, which, kind, xu, xd, isums, tokens, row_at, out, threads):  # type: ignore[no-untyped-def]
    """Every (matrix, row tile) task, claimed by the threads (ikrun/ops/parallel.py): weight rows ROW_TILE x t ..
    of matrix j (raw's matrix which[j]) against tokens[row_at[j] : row_at[j + 1]], row by row."""
    n_rows, nb = raw.shape[1], xd.shape[1] // 8
    tiles = -(-n_rows // ROW_TILE)
    tasks = (len(row_at) - 1) * tiles
    per, counter = task_items(tasks, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        wv = np.empty(nb * SUPER, np.int8)
        lane_scale = np.empty(nb * 16, np.float32)
        mins = np.zeros(nb * 8, np.float32)
        sums, wsum, acc = np.empty(16, np.int32), np.empty(16 * nb, np.int32), np.empty(8, np.float32)
        t0, t1 = claim_items(counter, per, tasks)
        while t0 < t1:
            for task in range(t0, t1):
                j, t = task // tiles, task % tiles
                m0, m1 = row_at[j], row_at[j + 1]
                if m0 == m1:
                    continue
                for r in range(t * ROW_TILE, min(n_rows, (t + 1) * ROW_TILE)):
                    _prepare_row(raw[which[j], r], kind, nb, wv, lane_scale, mins)
                    _row(kind, wv, lane_scale, mins, xu, xd, isums, tokens, m0, m1, out, r, sums, wsum, acc)
            t0, t1 = claim_items(counter, per, tasks)


def kquant_matmuls(x: IntRows, raw: np.ndarray, tokens: np.ndarray, row_at: np.ndarray, type_name: str,
                   which: np.ndarray | None = None) -> np.ndarray:
    """Rows `tokens` of the Q8_2_X4 activations x times matrices of `type_name` (KQUANT_TYPES) as ik's own kernel
    computes them: matrix j (raw [E, rows, row bytes], the file's rows; with `which`, raw's matrix which[j]) takes
    tokens[row_at[j] : row_at[j + 1]]; float32 [len(tokens), rows]."""
    if x.block != BLOCK:
        raise ValueError(f"ik's {type_name} kernel takes Q8_2_X4 activations (blocks of {BLOCK}), not blocks of "
                         f"{x.block}")
    raw = read_only(np.ascontiguousarray(raw))
    out = np.empty((len(tokens), raw.shape[1]), np.float32)
    which = np.arange(raw.shape[0], dtype=np.int64) if which is None else np.ascontiguousarray(which, np.int64)
    _matmuls(raw, which, KQUANT_TYPES[type_name], x.u, x.scale, x.isums, np.ascontiguousarray(tokens, np.int64),
             np.ascontiguousarray(row_at, np.int64), out, get_num_threads())
    return out
