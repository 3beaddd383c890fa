"""IQ4_KSS's scale search as 8-lane vector IR: eight trial scales at once, each code group of a sub-block looked
up on one half of the IQ4 grid, parity-repaired as ik's prune_iq4ks repairs it, and summed into
(sum w q x, sum w q^2), each lane one chain over the values in ik's order.

A group is four codes whose bit count must be even; an odd group moves one code by at most two steps to a code of
the other parity, the move of least weighted change in squared error (the current error taken on the plain grid,
as ik does), the first least in ik's order (codes in group order, moves ascending). In lanes every move is scored
with selects; a group in which no lane is odd skips the scoring. The repair reads its values from two 16-entry
tables (the plain half and the coded half): one two-source permute each where the CPU has AVX-512 VL, a gather
otherwise (five gathers a code, the search's largest cost before).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils

from ikquant.cpu import host_has
from ikquant.formats.grid_sums import table_slot
from ikquant.formats.jit import intrinsic, require_array
from ikquant.formats.vector_ir import (
    FLT_MAX,
    I32,
    I64,
    LANES,
    V8F,
    V8I,
    fma,
    gather,
    load_vector,
    splat,
    store_vector,
)

GROUP_POSITIONS = (0, 16, 1, 17)  # where group k's four codes sit in a 32-value sub-block, from 2k
#: 16-entry tables looked up by vpermi2ps (the two 8-lane halves as its two sources) rather than gathered
PERMUTE16 = host_has("avx512vl")


def _table16(builder: ir.IRBuilder, data: ir.Value) -> ir.Value | tuple[ir.Value, ir.Value]:
    """The 16 floats at data as _lookup16 reads them: its two halves (loaded once) or the pointer."""
    if not PERMUTE16:
        return data
    return (load_vector(builder, data, ir.Constant(I64, 0), V8F), load_vector(builder, data, ir.Constant(I64, 8), V8F))


def _lookup16(builder: ir.IRBuilder, table: ir.Value | tuple[ir.Value, ir.Value], index: ir.Value) -> ir.Value:
    """table[index[lane]] for eight indices in 0..15."""
    if not isinstance(table, tuple):
        return gather(builder, table, index)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8F, [V8F, V8I, V8F]),
                                        "llvm.x86.avx512.vpermi2var.ps.256")
    return builder.call(fn, [table[0], index, table[1]])


def _const_i(value: int) -> ir.Constant:
    return ir.Constant(V8I, [value] * LANES)


def _const_f(value: float) -> ir.Constant:
    return ir.Constant(V8F, [value] * LANES)


@intrinsic
def iq4kss_lane_sums(typingctx, xb, wb, inv, dls, low, high, low_code, high_code, plain, half, offset,  # type: ignore[no-untyped-def]
                     limit, sumqx, sumq2):
    """For every lane l of inv (a multiple of LANES; trial inverse scale inv[l], repair scale dls[l]) the fit's
    sums over the 32 values of xb with weights wb: each value's code the entry of the grid half `half` (its 16
    values) nearest a = inv[l] x (slot = clamp(trunc(a) - offset, -1, limit) + 1; candidates low/high values and
    low_code/high_code codes; low kept when a - low < high - a), each odd group repaired at scale dls[l] with the
    current error on `plain` (the plain half), then wq = w q and fmaf into sumqx[l], sumq2[l] group by group."""
    arrays = {"xb": (xb, types.float32), "wb": (wb, types.float32), "inv": (inv, types.float32),
              "dls": (dls, types.float32), "low": (low, types.float32), "high": (high, types.float32),
              "low_code": (low_code, types.int32), "high_code": (high_code, types.int32),
              "plain": (plain, types.float32), "half": (half, types.float32), "sumqx": (sumqx, types.float32),
              "sumq2": (sumq2, types.float32)}
    for name, (arg, dtype) in arrays.items():
        require_array("iq4kss_lane_sums", name, arg, 1, dtype)
    sig = types.void(xb, wb, inv, dls, low, high, low_code, high_code, plain, half, types.int64, types.int64, sumqx,
                     sumq2)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        offset_v, limit_v = args[10], args[11]
        arrays = [context.make_array(t)(context, builder, value=v) if isinstance(t, types.Array) else None
                  for t, v in zip(signature.args, args)]
        xs, ws, invs, dl_s, lows, highs, lowc, highc, plains, halfs = (a.data for a in arrays[:10])
        qx_out, q2_out = arrays[12].data, arrays[13].data
        vectors = builder.sdiv(builder.extract_value(arrays[2].shape, 0), ir.Constant(I64, LANES))
        voffset = splat(builder, builder.trunc(offset_v, I32), V8I)
        vlimit = splat(builder, builder.trunc(limit_v, I32), V8I)
        ctpop = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8I, [V8I]), "llvm.ctpop.v8i32")
        first_value = builder.load(halfs)
        plain_table, half_table = _table16(builder, plains), _table16(builder, halfs)
        qx_p = cgutils.alloca_once_value(builder, _const_f(0.0))
        q2_p = cgutils.alloca_once_value(builder, _const_f(0.0))
        codes_p = [cgutils.alloca_once_value(builder, _const_i(0)) for _ in range(4)]
        values_p = [cgutils.alloca_once_value(builder, _const_f(0.0)) for _ in range(4)]

        def scalar(ptr: ir.Value, at: ir.Value) -> ir.Value:
            return splat(builder, builder.load(builder.gep(ptr, [at])), V8F)

        with cgutils.for_range(builder, vectors) as outer:
            at = builder.mul(outer.index, ir.Constant(I64, LANES))
            vinv = load_vector(builder, invs, at, V8F)
            vdl = load_vector(builder, dl_s, at, V8F)
            builder.store(_const_f(0.0), qx_p)
            builder.store(_const_f(0.0), q2_p)
            with cgutils.for_range(builder, ir.Constant(I64, 8)) as groups:
                first = builder.mul(groups.index, ir.Constant(I64, 2))
                pos = [builder.add(first, ir.Constant(I64, p)) for p in GROUP_POSITIONS]
                x = [scalar(xs, p) for p in pos]
                w = [scalar(ws, p) for p in pos]
                parity = _const_i(0)
                for j in range(4):
                    a = builder.fmul(vinv, x[j])
                    slot = table_slot(builder, a, voffset, vlimit)
                    lo, hi = gather(builder, lows, slot), gather(builder, highs, slot)
                    take_lo = builder.fcmp_ordered("<", builder.fsub(a, lo), builder.fsub(hi, a))
                    code = builder.select(take_lo, gather(builder, lowc, slot), gather(builder, highc, slot))
                    builder.store(code, codes_p[j])
                    builder.store(builder.select(take_lo, lo, hi), values_p[j])
                    parity = builder.xor(parity, code)
                odd = builder.icmp_signed("!=", builder.and_(builder.call(ctpop, [parity]), _const_i(1)),
                                          _const_i(0))
                any_odd = builder.icmp_unsigned("!=", builder.bitcast(odd, ir.IntType(LANES)),
                                                ir.Constant(ir.IntType(LANES), 0))
                with builder.if_then(any_odd):
                    best = _const_f(FLT_MAX)
                    best_j = _const_i(0)
                    best_value = splat(builder, first_value, V8F)
                    for j in range(4):
                        code = builder.load(codes_p[j])
                        own_parity = builder.and_(builder.call(ctpop, [code]), _const_i(1))
                        diff0 = fma(builder, vdl, _lookup16(builder, plain_table, code), builder.fsub(_const_f(-0.0), x[j]))
                        e0 = builder.fmul(diff0, diff0)
                        neg_e0 = builder.fsub(_const_f(-0.0), e0)
                        neg_x = builder.fsub(_const_f(-0.0), x[j])
                        for step in (-2, -1, 1, 2):
                            moved = builder.add(code, _const_i(step))
                            inside = builder.and_(builder.icmp_signed(">=", moved, _const_i(0)),
                                                  builder.icmp_signed("<=", moved, _const_i(15)))
                            flips = builder.icmp_signed(
                                "!=", builder.and_(builder.call(ctpop, [moved]), _const_i(1)), own_parity)
                            safe = builder.select(inside, moved, _const_i(0))
                            value = _lookup16(builder, half_table, safe)
                            diff1 = fma(builder, vdl, value, neg_x)
                            score = builder.fmul(w[j], fma(builder, diff1, diff1, neg_e0))
                            better = builder.and_(builder.and_(inside, flips),
                                                  builder.fcmp_ordered("<", score, best))
                            best = builder.select(better, score, best)
                            best_j = builder.select(better, _const_i(j), best_j)
                            best_value = builder.select(better, value, best_value)
                    for j in range(4):
                        take = builder.and_(odd, builder.icmp_signed("==", best_j, _const_i(j)))
                        builder.store(builder.select(take, best_value, builder.load(values_p[j])), values_p[j])
                for j in range(4):
                    q = builder.load(values_p[j])
                    wq = builder.fmul(w[j], q)
                    builder.store(fma(builder, wq, x[j], builder.load(qx_p)), qx_p)
                    builder.store(fma(builder, wq, q, builder.load(q2_p)), q2_p)
            store_vector(builder, builder.load(qx_p), qx_out, at)
            store_vector(builder, builder.load(q2_p), q2_out, at)
        return context.get_dummy_value()

    return sig, codegen
