"""IQK weights straight from their bytes to qgemm's packed Q8_K_R16 integers, for `--numerics ik`.

ik converts an IQK weight to Q8_K_R16 from its integers: per 256 values p = sub-block scale x grid value, kept
when max|p| / c < 1, else re-quantized to int8 against max|p| / c (formats.py, `_to_q8_k`). The general path
recovers p from the float decoding (p = rint(decoding / d)) and packs the int8 rows afterwards (qgemm.pack): three
passes over the weight, the first two in float32. Here one pass reads the bytes and writes the packed layout,
the scales and the block sums, with the same integers, so the same PackedInts to the bit (test_q8k_direct.py).

The decoding's p is exactly the integer product wherever the row scale d is a normal float well inside float32's
range (d x ls x v then rounds by a few ulps of at most 127 x 127, far from a half); a file with another row scale
takes the general path.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from ikquant.formats.iqk_grids import IQ4K_VALUES
from ikquant.formats.numeric import f16_bits_to_f32, f32_from_bits, f32_to_f16_bits, load_f32
from ikrun.numerics.ik.qgemm import GROUPS, LANES, ORDER_R16, PackedInts
from ikrun.ops.cpu import host_has
from ikrun.ops.parallel import claim_items, task_items

SUPER = 256  # values per Q8_K block
IQ4_KS_BLOCK_BYTES = 136  # per 256 values: 8 sub-block scale bytes, 128 bytes of 4-bit codes
#: the row scales whose decoding gives the exact integers (module docstring)
SAFE_SCALES = (2.0**-100, 2.0**100)
#: the grid values as float32: sub-block scale x value is exact in float32 (|ls x v| < 2^24)
_IQ4K_FLOATS = IQ4K_VALUES.astype(np.float32)
_I64, _V16B = ir.IntType(64), ir.VectorType(ir.IntType(8), 16)
_V16I, _V16F = ir.VectorType(ir.IntType(32), 16), ir.VectorType(ir.FloatType(), 16)


def iq4_ks_packed(raw: np.ndarray, c: float) -> PackedInts | None:
    """IQ4_KS rows `raw` [rows, row bytes] as ik converts them to Q8_K_R16, packed for qmatmul; None where a row
    scale is outside SAFE_SCALES (the general path then decodes them)."""
    rows = raw.shape[0]
    d = np.ascontiguousarray(raw[:, :4]).view(np.float32)[:, 0]
    if not np.all((np.abs(d) >= SAFE_SCALES[0]) & (np.abs(d) <= SAFE_SCALES[1])):
        return None
    nb = (raw.shape[1] - 4) // IQ4_KS_BLOCK_BYTES
    n = nb * SUPER
    groups = -(-rows // (GROUPS * LANES)) * GROUPS
    q = np.empty(groups * LANES * n, np.int8)
    scale = np.empty(groups * nb * LANES, np.float32)
    corr = np.empty(groups * nb * LANES, np.int32)
    low = np.zeros(groups, np.uint8)
    _iq4_ks_groups(np.ascontiguousarray(raw), np.float32(np.float32(1) / np.float32(c)), q.view(np.int32), scale,
                   corr, low, get_num_threads())
    return PackedInts(q=q, scale=scale, corr=corr, offset=np.empty(0, np.float32), rows=rows, n=n, block=SUPER,
                      order=ORDER_R16, full_range=bool(low.any()))


@intrinsic
def _sub_block_permuted(typingctx, row, codes, grid, off, scale, p, at):  # type: ignore[no-untyped-def]
    """p[at .. at + 31] = scale x grid[off + low nibbles], then of the high nibbles, of row[codes .. codes + 15]:
    the 16 values scaled in one register, then two AVX-512 permutes of it (the values built in memory and loaded
    as a vector cost a failed store forwarding each sub-block)."""
    sig = types.void(row, types.int64, grid, types.int64, types.float32, p, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        row_p, grid_p, p_p = (context.make_array(signature.args[i])(context, builder, value=args[i]).data
                              for i in (0, 2, 5))
        permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F, _V16I]),
                                                 "llvm.x86.avx512.permvar.sf.512")
        codes = builder.load(builder.bitcast(builder.gep(row_p, [args[1]]), _V16B.as_pointer()), align=1)
        wide = builder.zext(codes, _V16I)
        grid_v = builder.load(builder.bitcast(builder.gep(grid_p, [args[3]]), _V16F.as_pointer()), align=4)
        splat = builder.insert_element(ir.Constant(_V16F, ir.Undefined), args[4], ir.Constant(ir.IntType(32), 0))
        splat = builder.shuffle_vector(splat, ir.Constant(_V16F, ir.Undefined), ir.Constant(_V16I, [0] * 16))
        values = builder.fmul(grid_v, splat)
        out = builder.bitcast(builder.gep(p_p, [args[6]]), _V16F.as_pointer())
        low = builder.and_(wide, ir.Constant(_V16I, [15] * 16))
        high = builder.lshr(wide, ir.Constant(_V16I, [4] * 16))
        builder.store(builder.call(permute, [values, low]), out, align=4)
        builder.store(builder.call(permute, [values, high]), builder.gep(out, [ir.Constant(_I64, 1)]), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def _sub_block_looked_up(row: np.ndarray, codes: int, grid: np.ndarray, off: int, scale: np.float32, p: np.ndarray,
                         at: int) -> None:
    """_sub_block_permuted in scalar code (CPUs without AVX-512)."""
    for j in range(16):
        code = np.int32(row[codes + j])
        p[at + j] = scale * grid[off + (code & 15)]
        p[at + j + 16] = scale * grid[off + (code >> 4)]


_sub_block: Callable[..., None] = _sub_block_permuted if host_has("avx512f") else _sub_block_looked_up


@njit(cache=True, nogil=True, inline="always")
def _iq4_ks_ints(row: np.ndarray, b: int, p: np.ndarray) -> None:
    """Block b's integers sub-block scale x grid value, as float32 p[256]."""
    o = 4 + b * IQ4_KS_BLOCK_BYTES
    for ib in range(8):
        s = np.int32(row[o + ib])
        _sub_block(row, o + 8 + 16 * ib, _IQ4K_FLOATS, 16 * (s & 1), np.float32((s & 254) - 127), p, 32 * ib)


@njit(cache=True, nogil=True, parallel=True)
def _iq4_ks_groups(raw: np.ndarray, inv_c: np.float32, out4: np.ndarray, scale: np.ndarray, corr: np.ndarray,
                   low: np.ndarray, threads: int) -> None:
    """Each 16-row group's rows converted block by block into out4 [group, step, 16 rows] (4 values each),
    scale and corr [group, block, 16] (corr = 128 x the block's int8 sum; padding rows all zero) and low[group]
    (a value is -128); the groups in tasks the threads claim (ikrun/ops/parallel.py)."""
    rows = raw.shape[0]
    nb = (raw.shape[1] - 4) // IQ4_KS_BLOCK_BYTES
    steps = nb * SUPER // 4
    groups = low.size
    per, counter = task_items(groups, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        p = np.empty(SUPER, np.float32)
        p_bits = p.view(np.int32)
        q = np.empty(SUPER, np.int8)
        q4 = q.view(np.int32)
        i0, i1 = claim_items(counter, per, groups)
        while i0 < i1:
            for g in range(i0, i1):
                least = np.int32(0)
                for r in range(LANES):
                    row_index = g * LANES + r
                    for b in range(nb):
                        at = (g * nb + b) * LANES + r
                        words = (g * steps + b * (SUPER // 4)) * LANES + r
                        if row_index >= rows:
                            scale[at], corr[at] = 0, 0
                            for k in range(SUPER // 4):
                                out4[words + k * LANES] = 0
                            continue
                        row = raw[row_index]
                        d = load_f32(row, 0)
                        _iq4_ks_ints(row, b, p)
                        most = np.int32(0)
                        for j in range(SUPER):
                            most = max(most, p_bits[j] & np.int32(0x7FFFFFFF))
                        dnew = f32_from_bits(np.uint32(most)) * inv_c
                        if dnew < 1:
                            dnew = np.float32(1.0)
                            for j in range(SUPER):
                                q[j] = np.int8(np.int32(p[j]))
                        else:
                            inv = np.float32(1.0) / dnew
                            for j in range(SUPER):
                                q[j] = np.int8(np.int32(min(np.float32(127.0), max(np.float32(-128.0),
                                                                                 np.rint(p[j] * inv)))))
                        total = np.int32(0)
                        for j in range(SUPER):
                            total += np.int32(q[j])
                            least = min(least, np.int32(q[j]))
                        corr[at] = 128 * total
                        scale[at] = f16_bits_to_f32(f32_to_f16_bits(d * dnew))
                        for k in range(SUPER // 4):
                            out4[words + k * LANES] = q4[k]
                low[g] = least == -128
            i0, i1 = claim_items(counter, per, groups)
