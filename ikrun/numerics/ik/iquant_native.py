"""ik's own kernels of IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M in its AVX-512 and AVX2 builds
(`--numerics ik`, `ik-avx2`): what ik multiplies those weights with below the activation rows
from which it converts them to Q8_K_R16 (32, IQ2_S 16: a routed expert's few tokens, a short batch), Q8_K activations
against the stored values (mul_mat_qX_K_q8_K_IQ).

Per 256 values ik takes the block's f16 d times a factor (1/8 for the IQ2 types, 1/4 for IQ3_XXS, 1 for IQ3_S), a
scale 2 s + 1 per sub-block (of 32 values; IQ2_XS and IQ2_S: of 16) and the signed grid values. It has two kernels:

- one activation row (mul_mat_qX_K_q8_K_IQ_1): the values' magnitudes against the activations with the values'
  signs, in 8 int32 lanes: per half block j and pair of 32-value groups h, lane 4 L + u sums the sub-block scale
  times values 16 L + 8 (u % 2) .. + 7 of group 4 j + 2 h + u // 2 (vpdpbusd's 4-value sums packed to 16 bits, then
  vpdpwssd), exact; per block fma(d x the token's scale, float(lane), acc); no minima.
- more rows (mul_mat_qX_K_q8_K_IQ_N, ik's AVX2 arithmetic): the values plus minv (43 for the IQ2 types, 64 for
  IQ3_XXS, 16 for IQ3_S) as unsigned bytes, so each block first adds its minima lanes, lane j the scales of
  16-value sub-blocks 2 j and 2 j + 1 times their activation sums, as fma(-d x minv x the token's scale, float, acc);
  then lane l the scale of sub-block 2 g + l // 4 times values 32 g + 4 l .. + 3 over the 8 groups g (vpmaddubsw's
  pair sums, which stay below 32767 here), as fma(d x the token's scale, float, acc).
Both end in hsum_float_8 of the 8 accumulators. ik splits a matmul's activation rows into calls of up to 8 rows
(balanced: 9 rows are 4 + 5), so only a matrix with exactly one activation row takes the first kernel; its AVX2
build has only the second (its pair sums summed by vpmaddwd and added, the same integers).

IQ1_S and IQ1_M have one kernel each for any row count (iqk_gemm_1bit.cpp), over 8 x level +- 1 with the block's
f16 d and 1/8 of the row's hsum_float_8 as the result: IQ1_M's lanes are the N-row form's without minima (the same
code in both builds); IQ1_S's take the unsigned levels (level + 1) x 8 x scale in the one-row form's lanes (its AVX2
build's lane takes two runs of 4 values of the same 16, _row_one), and lane t adds group t's scale x (its shift's
sign - 8) times the group's activation sum.

The values and scales come from the decoding: every value is d x factor x scale x grid value exactly, so the signed
grid value is the decoding over d x factor x scale; the scales are read from the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import get_num_threads, njit, prange

from ikquant.formats.numeric import fmaf, hsum_float_8
from ikquant.types import type_by_name
from ikrun.numerics.ik.formats import iq1_m_d
from ikrun.numerics.ik.iqk_native import sub_block_sums
from ikrun.numerics.ik.qgemm import IntRows
from ikrun.ops.parallel import claim_items, task_items

SUPER = 256


@dataclass(frozen=True)
class IquantLayout:
    """Where a type's block keeps its scales, and the constants of ik's kernel: bytes per 256 values, the factor of
    the f16 d, minv, and whether its sub-blocks are 16 values (else 32)."""

    block_bytes: int
    factor: float
    minv: int
    sixteen: bool


IQUANT_TYPES = {"IQ2_XXS": IquantLayout(66, 0.125, 43, False), "IQ2_XS": IquantLayout(74, 0.125, 43, True),
                "IQ2_S": IquantLayout(82, 0.125, 43, True), "IQ3_XXS": IquantLayout(98, 0.25, 64, False),
                "IQ3_S": IquantLayout(110, 1.0, 16, False)}
#: IQ1_S and IQ1_M (iqk_gemm_1bit.cpp: their own kernels, one for any row count; factor: the result's, 1/8)
IQ1_TYPES = {"IQ1_S": IquantLayout(50, 0.125, 0, False), "IQ1_M": IquantLayout(56, 0.125, 0, True)}
#: the kernel of a type: the i-quants' two forms, IQ1_S's, IQ1_M's
KERNEL_IQ, KERNEL_IQ1_S, KERNEL_IQ1_M = 0, 1, 2


def _scale_codes(type_name: str, blocks: np.ndarray) -> np.ndarray:
    """Each 16-value sub-block's scale code s (the scale is 2 s + 1) [..., nb, 16] from blocks [..., nb, bytes]:
    IQ2_XXS the top nibble of each 32-value group's second u32 (bytes 2 + 8 g .. ), IQ3_XXS of its u32 after the 64
    grid bytes; IQ2_XS's and IQ2_S's 8 bytes of nibbles (low: the even sub-block); IQ3_S's 4 (low: the even group)."""
    if type_name == "IQ1_S":
        per_group = (blocks[..., 34:50].copy().view(np.uint16) >> 12) & 7
    elif type_name == "IQ1_M":
        words = blocks[..., 48:56].copy().view(np.uint16).astype(np.int32)
        return np.stack([(words[..., ib // 4] >> (6 * ((ib // 2) % 2) + 3 * (ib % 2))) & 7 for ib in range(16)],
                        axis=-1)
    elif type_name == "IQ2_XXS":
        per_group = blocks[..., 2 + 7 : 2 + 64 : 8] >> 4
    elif type_name == "IQ3_XXS":
        per_group = blocks[..., 66 + 3 : 98 : 4] >> 4
    elif type_name == "IQ3_S":
        nib = blocks[..., 106:110]
        per_group = np.stack([nib & 15, nib >> 4], axis=-1).reshape(*nib.shape[:-1], 8)
    else:
        nib = blocks[..., 66:74] if type_name == "IQ2_XS" else blocks[..., 74:82]
        return np.stack([nib & 15, nib >> 4], axis=-1).reshape(*nib.shape[:-1], 16)
    return np.repeat(per_group, 2, axis=-1)


def _held(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Matrices raw [E, rows, row bytes] as ik's kernel holds them: the values [E, rows, n] (int16: the signed grid
    values; IQ1_M 8 x level +- 1; IQ1_S the unsigned level + 1), the 16-value sub-blocks' scales [E, rows, nb x 16]
    (IQ1_S: 8 x 2 s + 1), the kernel's d (the i-quants: d x factor; IQ1_S, IQ1_M: d), -d x factor x minv [E, rows,
    nb], and IQ1_S's shift term per 32-value group, scale x (the shift's sign - 8) [E, rows, nb x 8] (else empty)."""
    iq1 = type_name in IQ1_TYPES
    layout = (IQ1_TYPES if iq1 else IQUANT_TYPES)[type_name]
    e, rows, row_bytes = raw.shape
    nb = row_bytes // layout.block_bytes
    blocks = raw.reshape(e, rows, nb, layout.block_bytes)
    if type_name == "IQ1_M":
        d16 = iq1_m_d(raw.reshape(e * rows, row_bytes)).reshape(e, rows, nb)
    else:
        d16 = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    step_d = d16 * np.float32(layout.factor)
    scales = 2 * _scale_codes(type_name, blocks).astype(np.int32) + 1
    decoded = type_by_name(type_name).require_codec().dequantize(raw.reshape(e * rows, row_bytes), nb * SUPER)
    step = (step_d[..., None] * scales.astype(np.float32)).reshape(e, rows, nb, 16, 1)
    sub = decoded.reshape(e, rows, nb, 16, 16)
    values = np.rint(np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)).astype(np.int32)
    shift = np.zeros((e, rows, 0), np.int32)
    if type_name == "IQ1_S":  # 8 x level + sign: ik's kernel takes level + 1, and the sign - 8 per group apart
        levels = (values + 9) // 8 - 1
        signs = (values - 8 * levels)[..., ::2, 0]  # one per 32 values
        shift = (scales[..., ::2] * (signs - 8)).reshape(e, rows, nb * 8)
        values, scales = levels + 1, 8 * scales
    dmin = (-step_d) * np.float32(layout.minv)
    return (values.reshape(e, rows, nb * SUPER).astype(np.int16), scales.reshape(e, rows, nb * 16).astype(np.int16),
            d16 if iq1 else step_d, dmin, shift.astype(np.int32))


def iquant_matmuls(x: IntRows, raw: np.ndarray, tokens: np.ndarray, row_at: np.ndarray, type_name: str,
                   which: np.ndarray | None = None, avx2: bool = False) -> np.ndarray:
    """Rows `tokens` of the Q8_K activations x times matrices of `type_name` (IQUANT_TYPES) as ik's own kernels
    compute them: matrix j (raw [E, rows, row bytes]; with `which`, raw's matrix which[j]) takes
    tokens[row_at[j] : row_at[j + 1]]; float32 [len(tokens), rows]. `avx2`: ik's AVX2 build, whose one-row calls
    take the N-row form too."""
    iq1 = type_name in IQ1_TYPES
    if x.block != SUPER:
        raise ValueError(f"ik's {type_name} kernel takes Q8_K activations (blocks of {SUPER}), not blocks of "
                         f"{x.block}")
    which = np.arange(raw.shape[0], dtype=np.int64) if which is None else np.ascontiguousarray(which, np.int64)
    used = np.nonzero(np.diff(row_at) > 0)[0]
    values, scales, d, dmin, shift = _held(np.ascontiguousarray(raw[which[used]]), type_name)
    slot = np.full(len(which), -1, np.int64)
    slot[used] = np.arange(len(used))
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    sums16 = np.empty((len(tokens), x.u.shape[1] // 16), np.int32)
    sub_block_sums(x.u, tokens, sums16)
    out = np.empty((len(tokens), raw.shape[1]), np.float32)
    kernel = KERNEL_IQ1_S if type_name == "IQ1_S" else KERNEL_IQ1_M if type_name == "IQ1_M" else KERNEL_IQ
    minv = 0 if iq1 else IQUANT_TYPES[type_name].minv
    _matmuls(values, scales, d, dmin, shift, np.int32(minv), x.u, x.scale, sums16, tokens,
             np.ascontiguousarray(row_at, np.int64), slot, out, get_num_threads(), avx2, kernel)
    return out


@njit(cache=True, nogil=True, inline="always")
def _row_one(v: np.ndarray, sc: np.ndarray, d: np.ndarray, shift: np.ndarray, xu: np.ndarray, xd: np.ndarray,
             sums16: np.ndarray, split: bool, a: np.ndarray) -> np.float32:
    """One weight row against one activation row (mul_mat_qX_K_q8_K_IQ_1, the module docstring; IQ1_S's lanes too,
    each lane t adding group t's shift term times its 32 activations' sum). `split`: IQ1_S's AVX2 lanes, whose 8
    values of a group are 16 L + 4 (u % 2) .. + 3 and 8 more (its vpmaddubsw pair sums of two 8-value runs added
    as 16-bit, then vpmaddwd), where the AVX-512 ones are 8 in a row."""
    a[:] = 0
    for i in range(d.shape[0]):
        dd = d[i] * xd[i]
        for t in range(8):
            big, u = t // 4, t % 4
            total = np.int32(0)
            for j in range(2):
                for h in range(2):
                    g = 4 * j + 2 * h + u // 2
                    at = SUPER * i + 32 * g + 16 * big
                    part = np.int32(0)
                    for k in range(8):
                        o = at + (4 * (u % 2) + k % 4 + 8 * (k // 4) if split else 8 * (u % 2) + k)
                        part += np.int32(v[o]) * (np.int32(xu[o]) - 128)
                    total += np.int32(sc[16 * i + 2 * g + big]) * part
            if shift.shape[0]:
                total += shift[8 * i + t] * (sums16[16 * i + 2 * t] + sums16[16 * i + 2 * t + 1])
            a[t] = fmaf(dd, np.float32(total), a[t])
    return hsum_float_8(a)


@njit(cache=True, nogil=True, inline="always")
def _row_many(v: np.ndarray, sc: np.ndarray, d: np.ndarray, dmin: np.ndarray, minv: np.int32, xu: np.ndarray,
              xd: np.ndarray, sums16: np.ndarray, minima: bool, a: np.ndarray) -> np.float32:
    """One weight row against one of several activation rows (mul_mat_qX_K_q8_K_IQ_N, the module docstring; IQ1_M's
    lanes too, without minima)."""
    a[:] = 0
    for i in range(d.shape[0]):
        if minima:
            dm = dmin[i] * xd[i]
            for j in range(8):
                total = (np.int32(sc[16 * i + 2 * j]) * sums16[16 * i + 2 * j]
                         + np.int32(sc[16 * i + 2 * j + 1]) * sums16[16 * i + 2 * j + 1])
                a[j] = fmaf(dm, np.float32(total), a[j])
        dd = d[i] * xd[i]
        for lane in range(8):
            total = np.int32(0)
            for g in range(8):
                at = SUPER * i + 32 * g + 4 * lane
                part = np.int32(0)
                for k in range(4):
                    part += (np.int32(v[at + k]) + minv) * (np.int32(xu[at + k]) - 128)
                total += np.int32(sc[16 * i + 2 * g + lane // 4]) * part
            a[lane] = fmaf(dd, np.float32(total), a[lane])
    return hsum_float_8(a)


@njit(cache=True, nogil=True, parallel=True)
def _matmuls(values, scales, d, dmin, shift, minv, xu, xd, sums16, tokens, row_at, slot, out,  # type: ignore[no-untyped-def]
             threads, avx2, kernel):
    """Every (matrix, row) pair with tokens, claimed by the threads (ikrun/ops/parallel.py)."""
    n_rows = values.shape[1]
    tasks = (len(row_at) - 1) * n_rows
    per, counter = task_items(tasks, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        a = np.empty(8, np.float32)
        t0, t1 = claim_items(counter, per, tasks)
        while t0 < t1:
            for task in range(t0, t1):
                j, r = task // n_rows, task % n_rows
                m0, m1 = row_at[j], row_at[j + 1]
                if m0 == m1:
                    continue
                e = slot[j]
                for m in range(m0, m1):
                    x = tokens[m]
                    if kernel == KERNEL_IQ1_S or (kernel == KERNEL_IQ and m1 - m0 == 1 and not avx2):
                        res = _row_one(values[e, r], scales[e, r], d[e, r], shift[e, r], xu[x], xd[x], sums16[m],
                                       avx2, a)
                    else:
                        res = _row_many(values[e, r], scales[e, r], d[e, r], dmin[e, r], minv, xu[x], xd[x],
                                        sums16[m], kernel == KERNEL_IQ, a)
                    out[m, r] = res if kernel == KERNEL_IQ else np.float32(0.125) * res
            t0, t1 = claim_items(counter, per, tasks)
