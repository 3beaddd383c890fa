"""ggml-quants.c's weighted scale searches that both the legacy types (legacy.py) and the k-quants (kquants.py) run.

make_qx_quants fits a symmetric scale (Q4_0, Q5_0, Q6_0; Q3_K and Q6_K, and Q3_K's sub-block scales), and
make_qkx3_quants a scale and a min (Q4_1, Q5_1; Q2_K, Q4_K, Q5_K). The float arithmetic follows ik's GCC build
operation by operation: `fmaf`/`fma64` where GCC fused a multiply-add, separately rounded products summed in order
where it vectorised a loop.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils

from ikquant.formats.jit import intrinsic
from ikquant.formats.numeric import abs_bits_max, abs_max, f32_bits, fma64, fmaf, nearest_int_fma

NJIT = dict(cache=True, nogil=True, error_model="numpy")


@njit(**NJIT)
def _movable_bits(scale: np.float32, x: np.ndarray, w: np.ndarray, L: np.ndarray, nmax: int, movable: np.ndarray,
                  n: int) -> None:
    """make_qx_quants' greedy step: per code, |scale w (x - scale l)| as float bits where the code may move that way,
    else 0, in a branch-free pass (it vectorises)."""
    lo, hi = np.int32(-nmax), np.int32(nmax - 1)
    for j in range(n):
        l = np.int32(L[j]) - np.int32(nmax)
        g = scale * w[j] * fmaf(-scale, np.float32(l), x[j])
        ok = ((g > 0) & (l < hi)) | ((g < 0) & (l > lo))
        movable[j] = (f32_bits(g) & np.uint32(0x7FFFFFFF)) if ok else np.uint32(0)


@njit(**NJIT)
def _first_largest(movable: np.ndarray, n: int) -> int:
    """The first position of the largest of n float bit patterns (an integer maximum: it vectorises), -1 when all
    are 0: the first strict maximum that ik's scalar scan keeps."""
    top = np.uint32(0)
    for j in range(n):
        top = abs_bits_max(top, movable[j])
    if top == 0:
        return -1
    j = 0
    while movable[j] != top:
        j += 1
    return j


#: make_qx_quants' trial scales: ik's 38, padded to whole 8-float vectors (the padding is computed, never read)
QX_TRIALS = 38
QX_TRIALS_PADDED = 40


@njit(**NJIT)
def qx_scratch(n: int) -> tuple[np.ndarray, np.ndarray]:
    """make_qx_quants' working arrays for blocks of up to n values, allocated once by a caller that searches many
    blocks (an allocation per block cost a fifth of Q6_K's time)."""
    return np.zeros((3, QX_TRIALS_PADDED), np.float32), np.empty(n, np.uint32)


@njit(**NJIT)
def make_qx_quants(n: int, nmax: int, x: np.ndarray, L: np.ndarray, w: np.ndarray,
                   scratch: tuple[np.ndarray, np.ndarray]) -> np.float32:
    """ik's importance-weighted symmetric scale search (rmse_type 1 with explicit weights).

    Returns the scale; L receives codes in [0, 2*nmax). The multiply-adds are fused where ik's GCC build fuses them.
    `scratch`: qx_scratch(n) or larger.
    """
    amax, fmax = abs_max(x[:n])
    if amax < np.float32(1e-15):
        for i in range(n):
            L[i] = 0
        return np.float32(0.0)
    fn = np.float32(nmax)
    # the code range as int32: Numba would clamp against int64 bounds in 64-bit lanes, half the vector width
    lo, hi = np.int32(-nmax), np.int32(nmax - 1)
    iscale = -fn / fmax
    sumlx = np.float32(0.0)
    suml2 = np.float32(0.0)
    for i in range(n):
        l = min(hi, max(lo, nearest_int_fma(iscale, x[i])))
        L[i] = l + nmax
        fl = np.float32(l)
        sumlx = fmaf(w[i] * x[i], fl, sumlx)
        suml2 = fmaf(w[i] * fl, fl, suml2)
    scale = sumlx / suml2 if suml2 != 0 else np.float32(0.0)
    best = scale * sumlx
    best_sumlx = sumlx
    best_suml2 = suml2
    # The 38 trial scales, in ik's order. ik's build vectorises each trial's loop: products are rounded, then
    # summed in order without fusing. The trials are independent, so their sums are accumulated side by side
    # (same roundings, vectorised across trials) and ik's sequential acceptance test runs afterwards.
    trials, movable = scratch
    iscales, t_sumlx, t_suml2 = trials[0], trials[1], trials[2]
    for k in range(QX_TRIALS // 2):
        step = np.float32(0.1) * np.float32(k - 9)
        iscales[2 * k] = -(step + fn) / fmax
        iscales[2 * k + 1] = (step + (fn - np.float32(1.0))) / fmax
    for c in range(QX_TRIALS_PADDED):
        t_sumlx[c] = 0.0
        t_suml2[c] = 0.0
    for i in range(n):
        xi = x[i]
        wi = w[i]
        wxi = wi * xi
        for c in range(QX_TRIALS_PADDED):
            fl = np.float32(min(hi, max(lo, nearest_int_fma(iscales[c], xi))))
            t_sumlx[c] += wxi * fl
            t_suml2[c] += (wi * fl) * fl
    winner = -1
    for c in range(QX_TRIALS):
        sumlx = t_sumlx[c]
        suml2 = t_suml2[c]
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            scale = sumlx / suml2
            best = scale * sumlx
            best_sumlx = sumlx
            best_suml2 = suml2
            winner = c
    if winner >= 0:
        for i in range(n):
            L[i] = nmax + min(hi, max(lo, nearest_int_fma(iscales[winner], x[i])))
    sumlx = best_sumlx
    suml2 = best_suml2
    for _ in range(n * (2 * nmax - 1)):
        _movable_bits(scale, x, w, L, nmax, movable, n)
        best_j = _first_largest(movable, n)
        if best_j < 0:
            break
        wj = w[best_j]
        l = np.int32(L[best_j]) - nmax
        gmax = scale * wj * fmaf(-scale, np.float32(l), x[best_j])
        # ik's build rounds w*x before adding it, but fuses w*(2l +- 1) into the add
        wx = wj * x[best_j]
        if gmax > 0:
            new_sumlx = sumlx + wx
            new_suml2 = fmaf(wj, np.float32(2 * l + 1), suml2)
            l += 1
        else:
            new_sumlx = sumlx - wx
            new_suml2 = fmaf(-wj, np.float32(2 * l - 1), suml2)
            l -= 1
        if new_suml2 > 0 and new_sumlx * new_sumlx > best * new_suml2:
            sumlx = new_sumlx
            suml2 = new_suml2
            scale = sumlx / suml2
            best = scale * sumlx
            L[best_j] = l + nmax
        else:
            break
    return scale



@njit(**NJIT)
def _qkx3_error(
    scale: float, mn: float, sum_w: float, sum_x: float, sum_x2: float, sum_l: float, sum_l2: float, sum_xl: float
) -> float:
    """Weighted squared error of (scale, min) from the moments, in the fused order of ik's build."""
    t = fma64(-(2.0 * scale), sum_xl, sum_x2)
    t = fma64(-sum_x, 2.0 * mn, t)
    t = fma64(sum_l, (2.0 * scale) * mn, t)
    t = fma64(sum_l2, scale * scale, t)
    return fma64(sum_w, mn * mn, t)


@njit(**NJIT)
def _qkx3_gain(
    scale: float, mn: float, sum_w: float, sum_x: float, sum_l: float, sum_l2: float, sum_xl: float
) -> float:
    """sum_x2 minus the weighted squared error of (scale, min), in the fused order of ik's build."""
    t = (2.0 * mn) * sum_x
    t = fma64(2.0 * scale, sum_xl, t)
    t = fma64(-((2.0 * scale) * mn), sum_l, t)
    t = fma64(-(scale * scale), sum_l2, t)
    return fma64(-(mn * mn), sum_w, t)


@njit(**NJIT)
def _qkx3_fit(sum_w: float, sum_x: float, sum_l: float, sum_l2: float, sum_xl: float) -> tuple[float, float, float]:
    """Least-squares (scale, min) for fixed codes, min clamped to <= 0; returns (D, scale, min), D <= 0: no fit."""
    D = fma64(sum_w, sum_l2, -(sum_l * sum_l))
    if D <= 0:
        return D, 0.0, 0.0
    this_min = fma64(sum_l2, sum_x, -(sum_l * sum_xl)) / D
    if this_min > 0:
        return D, sum_xl / sum_l2, 0.0
    return D, fma64(-sum_l, sum_x, sum_xl * sum_w) / D, this_min


@njit(**NJIT)
def _qkx3_moments(x: np.ndarray, w: np.ndarray, fused_sum_x2: bool
                  ) -> tuple[np.float32, np.float32, float, float, float]:
    """(min clamped to <= 0, max, sum w, sum w x, sum w x^2) of a block, the sums in float64 in ik's order."""
    mn = x[0]
    mx = x[0]
    sum_w = np.float64(w[0])
    sum_x = sum_w * np.float64(x[0])
    sum_x2 = sum_x * np.float64(x[0])
    for i in range(1, x.size):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        wi = np.float64(w[i])
        xi = np.float64(x[i])
        sum_w += wi
        wx = xi * wi
        sum_x += wx
        sum_x2 = fma64(wx, xi, sum_x2) if fused_sum_x2 else sum_x2 + wx * xi
    if mn > 0:
        mn = np.float32(0.0)
    return mn, mx, sum_w, sum_x, sum_x2


@njit(**NJIT)
def _qkx3_start(nmax: int, x: np.ndarray, w: np.ndarray, L: np.ndarray, mn: np.float32, mx: np.float32
                ) -> tuple[np.float32, float]:
    """The codes of the plain grid over [min, max] into L; returns (its scale, its weighted squared error)."""
    iscale = np.float32(nmax) / (mx - mn)
    scale = np.float32(1.0) / iscale
    best_mad = 0.0
    for i in range(x.size):
        l = min(nmax, max(0, nearest_int_fma(x[i] - mn, iscale)))
        L[i] = l
        diff = fma64(np.float64(l), np.float64(scale), np.float64(mn)) - np.float64(x[i])
        best_mad = fma64(np.float64(w[i]), diff * diff, best_mad)
    return scale, best_mad


@njit(**NJIT)
def _trial_iscale(step: int, nmax: int, mn: np.float32, mx: np.float32) -> np.float32:
    """The inverse scale of trial `step` (rmin -0.9, rdelta 0.05) over [min, max]."""
    return (fmaf(np.float32(step), np.float32(0.05), np.float32(-0.9)) + np.float32(nmax)) / (mx - mn)


@njit(**NJIT)
def _qkx3_refine(nmax: int, x: np.ndarray, w: np.ndarray, L: np.ndarray, scale: np.float32, mn: np.float32,
                 sum_w: float, sum_x: float, movable: np.ndarray) -> tuple[np.float32, np.float32]:
    """ik's greedy pass after the trials: moves one code at a time by the largest residual while the fit
    improves; returns the final (scale, min). `movable`: room for x.size values."""
    n = x.size
    sum_l = 0.0
    sum_l2 = 0.0
    sum_xl = 0.0
    for i in range(n):
        fl = np.float64(L[i])
        wl = np.float64(w[i]) * fl
        sum_l2 = fma64(fl, wl, sum_l2)
        sum_l += wl
        sum_xl = fma64(np.float64(x[i]), wl, sum_xl)
    best = _qkx3_gain(np.float64(scale), np.float64(mn), sum_w, sum_x, sum_l, sum_l2, sum_xl)
    last_j = -1
    last_dir = 0
    top = np.int32(nmax)
    # per code, |residual| as float bits where the code may move that way (else 0): the largest, first found, is
    # ik's choice, found with a branch-free pass and an integer maximum (both vectorise)
    for _ in range(nmax * n):
        for j in range(n):
            lj = np.int32(L[j])
            g = fmaf(-scale, np.float32(lj), x[j]) - mn
            ok = ((g > 0) & (lj < top)) | ((g < 0) & (lj > 0))
            movable[j] = (f32_bits(g) & np.uint32(0x7FFFFFFF)) if ok else np.uint32(0)
        best_j = _first_largest(movable, n)
        if best_j < 0:
            break
        direction = 1 if fmaf(-scale, np.float32(L[best_j]), x[best_j]) - mn > 0 else -1
        if best_j == last_j and direction == -last_dir:
            break
        wj = np.float64(w[best_j])
        fd = np.float64(direction)
        lj = np.int32(L[best_j])
        sum_l = fma64(wj, fd, sum_l)
        sum_l2 = fma64(wj, np.float64(2 * lj * direction + 1), sum_l2)
        sum_xl = fma64(np.float64(x[best_j]) * wj, fd, sum_xl)
        D, this_scale, this_min = _qkx3_fit(sum_w, sum_x, sum_l, sum_l2, sum_xl)
        if D <= 0 or this_scale < 0:
            break
        score = _qkx3_gain(this_scale, this_min, sum_w, sum_x, sum_l, sum_l2, sum_xl)
        if score <= best:
            break
        best = score
        scale = np.float32(this_scale)
        mn = np.float32(this_min)
        L[best_j] = lj + direction
        last_j = best_j
        last_dir = direction
    return scale, mn


@njit(**NJIT)
def make_qkx3_quants(nmax: int, x: np.ndarray, w: np.ndarray, L: np.ndarray, fused_sum_x2: bool
                     ) -> tuple[np.float32, np.float32]:
    """ik's weighted scale-and-min search (rmin -0.9, rdelta 0.05, nstep 36, squared error: the settings of every
    caller in ik) over len(x) values.

    Returns (scale, min) with min <= 0, so y = scale*L + min; L receives codes in [0, nmax]. The moments are in
    float64 as in ik; fused and unfused steps follow ik's GCC build, which fuses the x^2 sum in the 16-value copy
    (Q2_K) but not in the 32-value ones (Q4_K, Q5_K, Q4_1, Q5_1): `fused_sum_x2` selects which.
    """
    n = x.size
    mn, mx, sum_w, sum_x, sum_x2 = _qkx3_moments(x, w, fused_sum_x2)
    if mx - mn < np.float32(1e-10):
        for i in range(n):
            L[i] = 0
        return np.float32(0.0), mn
    scale, best_mad = _qkx3_start(nmax, x, w, L, mn, mx)
    # a trial's codes in a vectorised pass (32-bit clamp), then its float64 sums in ik's order
    Laux = np.empty(n, dtype=np.int32)
    top = np.int32(nmax)
    for step in range(37):
        iscale = _trial_iscale(step, nmax, mn, mx)
        sum_l = 0.0
        sum_l2 = 0.0
        sum_xl = 0.0
        for i in range(n):
            Laux[i] = min(top, max(np.int32(0), nearest_int_fma(x[i] - mn, iscale)))
        for i in range(n):
            fl = np.float64(Laux[i])
            wl = np.float64(w[i]) * fl
            sum_l2 = fma64(fl, wl, sum_l2)
            sum_xl = fma64(np.float64(x[i]), wl, sum_xl)
            sum_l += wl
        D, this_scale, this_min = _qkx3_fit(sum_w, sum_x, sum_l, sum_l2, sum_xl)
        if D > 0:
            mad = _qkx3_error(this_scale, this_min, sum_w, sum_x, sum_x2, sum_l, sum_l2, sum_xl)
            if mad < best_mad:
                # an accepted trial moves min, which the following trials use
                for i in range(n):
                    L[i] = Laux[i]
                best_mad = mad
                scale = np.float32(this_scale)
                mn = np.float32(this_min)
    return _qkx3_refine(nmax, x, w, L, scale, mn, sum_w, sum_x, np.empty(n, np.uint32))


#: blocks whose trial scales make_qkx3_blocks computes side by side (four float64 lanes of an AVX2 register)
LANES = 4
_F32, _F64, _I32, _I64 = ir.FloatType(), ir.DoubleType(), ir.IntType(32), ir.IntType(64)
_V4F, _V4D, _V4I = ir.VectorType(_F32, LANES), ir.VectorType(_F64, LANES), ir.VectorType(_I32, LANES)


def _splat(builder: ir.IRBuilder, value: ir.Value, vty: ir.VectorType) -> ir.Value:
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(_I32, vty.count),
                                                                                   [0] * vty.count))


def _array_data(context, builder, signature, args):  # type: ignore[no-untyped-def]
    """The data pointers of an intrinsic's array arguments, in order."""
    return [context.make_array(t)(context, builder, value=v).data
            for t, v in zip(signature.args, args) if isinstance(t, types.Array)]


def _vec_at(builder: ir.IRBuilder, ptr: ir.Value, index: ir.Value, vty: ir.VectorType) -> ir.Value:
    return builder.bitcast(builder.gep(ptr, [index]), vty.as_pointer())


def _rounded_codes(builder: ir.IRBuilder, product: ir.Value, top: ir.Value) -> ir.Value:
    """min(top, max(0, nearest_int)) of lanes already holding a*b + 1.5*2^23 (ik's fused rounding add)."""
    vty = ir.VectorType(_I32, product.type.count)
    q = builder.sub(builder.and_(builder.bitcast(product, vty), ir.Constant(vty, [0x7FFFFF] * vty.count)),
                    ir.Constant(vty, [0x400000] * vty.count))
    zero = ir.Constant(vty, [0] * vty.count)
    q = builder.select(builder.icmp_signed(">", q, zero), q, zero)
    return builder.select(builder.icmp_signed("<", q, top), q, top)


@intrinsic
def _lane_trial(typingctx, xt, wt, mn, iscale, top, codes, sums):  # type: ignore[no-untyped-def]
    """One trial scale for LANES blocks side by side (xt, wt, codes: [n, LANES]; mn, iscale: [LANES]): each lane's
    codes min(top, max(0, nearest_int(iscale (x - mn)))) into `codes` and its float64 sums w l, w l^2, w x l into
    sums [3, LANES], every lane in ik's order (the rounding add fused as ik's build fuses it).

    Written as vector IR because LLVM does not vectorise four independent reduction chains: one <4 x double>
    multiply-add advances all four lanes' sums."""
    sig = types.void(xt, wt, mn, iscale, types.int32, codes, sums)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        x_p, w_p, mn_p, isc_p, c_p, s_p = _array_data(context, builder, signature, args)
        n = builder.extract_value(context.make_array(signature.args[0])(context, builder, value=args[0]).shape, 0)

        def vec_at(ptr: ir.Value, index: ir.Value, vty: ir.VectorType) -> ir.Value:
            return _vec_at(builder, ptr, index, vty)

        vmn = builder.load(vec_at(mn_p, ir.Constant(_I64, 0), _V4F), align=4)
        visc = builder.load(vec_at(isc_p, ir.Constant(_I64, 0), _V4F), align=4)
        vtop = _splat(builder, args[4], _V4I)
        magic = ir.Constant(_V4F, [12582912.0] * LANES)
        fma4f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V4F, [_V4F] * 3), "llvm.fma.v4f32")
        fma4d = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V4D, [_V4D] * 3), "llvm.fma.v4f64")
        acc = [cgutils.alloca_once_value(builder, ir.Constant(_V4D, [0.0] * LANES)) for _ in range(3)]
        with cgutils.for_range(builder, n) as loop:
            off = builder.mul(loop.index, ir.Constant(_I64, LANES))
            x = builder.load(vec_at(x_p, off, _V4F), align=4)
            q = _rounded_codes(builder, builder.call(fma4f, [builder.fsub(x, vmn), visc, magic]), vtop)
            builder.store(q, vec_at(c_p, off, _V4I), align=4)
            fl = builder.sitofp(q, _V4D)
            wl = builder.fmul(builder.load(vec_at(w_p, off, _V4D), align=8), fl)
            builder.store(builder.fadd(builder.load(acc[0]), wl), acc[0])
            builder.store(builder.call(fma4d, [fl, wl, builder.load(acc[1])]), acc[1])
            builder.store(builder.call(fma4d, [builder.fpext(x, _V4D), wl, builder.load(acc[2])]), acc[2])
        for k in range(3):
            builder.store(builder.load(acc[k]), vec_at(s_p, ir.Constant(_I64, LANES * k), _V4D), align=8)
        return context.get_dummy_value()

    return sig, codegen


#: blocks whose float32 trials make_qkx2_blocks computes side by side (eight float32 lanes of an AVX2 register)
LANES32 = 8
_V8F, _V8I = ir.VectorType(_F32, LANES32), ir.VectorType(_I32, LANES32)


def _lanes_f32(context, builder, signature, args, *lane_args):  # type: ignore[no-untyped-def]
    """What both float32 lane kernels start from: their arrays' data pointers, the rows n of the first ([n,
    LANES32]), the [LANES32] arrays at positions `lane_args` loaded as vectors, and the vector multiply-add."""
    data = _array_data(context, builder, signature, args)
    n = builder.extract_value(context.make_array(signature.args[0])(context, builder, value=args[0]).shape, 0)
    lanes = tuple(builder.load(_vec_at(builder, data[i], ir.Constant(_I64, 0), _V8F), align=4) for i in lane_args)
    fma8 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F, [_V8F] * 3), "llvm.fma.v8f32")
    return data, n, lanes, fma8


@intrinsic
def lane_trial_f32(typingctx, xt, wt, fmin, iscale, top, codes, sums):  # type: ignore[no-untyped-def]
    """make_qkx2_quants' trial for LANES32 blocks side by side (xt, wt, codes: [n, LANES32]; fmin, iscale:
    [LANES32]): each lane's codes min(top, max(0, nearest_int(iscale (x - fmin)))) into `codes`, and its float32
    sums w l, w l^2, w l x into sums [3, LANES32], each lane in ik's order (vector IR: see _lane_trial)."""
    sig = types.void(xt, wt, fmin, iscale, types.int32, codes, sums)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        (x_p, w_p, mn_p, isc_p, c_p, s_p), n, (vmn, visc), fma8 = _lanes_f32(context, builder, signature, args, 2, 3)
        vtop = _splat(builder, args[4], _V8I)
        magic = ir.Constant(_V8F, [12582912.0] * LANES32)
        acc = [cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * LANES32)) for _ in range(3)]
        with cgutils.for_range(builder, n) as loop:
            off = builder.mul(loop.index, ir.Constant(_I64, LANES32))
            x = builder.load(_vec_at(builder, x_p, off, _V8F), align=4)
            q = _rounded_codes(builder, builder.call(fma8, [visc, builder.fsub(x, vmn), magic]), vtop)
            builder.store(q, _vec_at(builder, c_p, off, _V8I), align=4)
            fl = builder.sitofp(q, _V8F)
            wl = builder.fmul(builder.load(_vec_at(builder, w_p, off, _V8F), align=4), fl)
            builder.store(builder.fadd(builder.load(acc[0]), wl), acc[0])
            builder.store(builder.call(fma8, [wl, fl, builder.load(acc[1])]), acc[1])
            builder.store(builder.call(fma8, [wl, x, builder.load(acc[2])]), acc[2])
        for k in range(3):
            builder.store(builder.load(acc[k]), _vec_at(builder, s_p, ir.Constant(_I64, LANES32 * k), _V8F), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def lane_error_f32(typingctx, xt, wt, codes, scale, mn, use_mad, out):  # type: ignore[no-untyped-def]
    """make_qkx2_quants' weighted error of each lane's codes at its (scale, min), LANES32 lanes side by side:
    sum w |l scale + min - x| (use_mad) or sum w (l scale + min - x)^2, in ik's order, into out [LANES32]."""
    sig = types.void(xt, wt, codes, scale, mn, types.boolean, out)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        (x_p, w_p, c_p, sc_p, mn_p, o_p), n, (vsc, vmn), fma8 = _lanes_f32(context, builder, signature, args, 3, 4)
        zero = ir.Constant(_I64, 0)
        fabs8 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F, [_V8F]), "llvm.fabs.v8f32")
        acc = cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * LANES32))
        with cgutils.for_range(builder, n) as loop:
            off = builder.mul(loop.index, ir.Constant(_I64, LANES32))
            fl = builder.sitofp(builder.load(_vec_at(builder, c_p, off, _V8I), align=4), _V8F)
            diff = builder.fsub(builder.call(fma8, [fl, vsc, vmn]), builder.load(_vec_at(builder, x_p, off, _V8F),
                                                                                   align=4))
            diff = builder.select(args[5], builder.call(fabs8, [diff]), builder.fmul(diff, diff))
            w = builder.load(_vec_at(builder, w_p, off, _V8F), align=4)
            builder.store(builder.call(fma8, [w, diff, builder.load(acc)]), acc)
        builder.store(builder.load(acc), _vec_at(builder, o_p, zero, _V8F), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(**NJIT)
def qkx3_scratch(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                   np.ndarray]:
    """make_qkx3_blocks' working arrays for blocks of n values, allocated once by a caller that searches many
    blocks: the lanes' values, weights and codes [n, LANES], their float32 and float64 state, which lanes are
    live, and the greedy pass's room."""
    return (np.empty((n, LANES), np.float32), np.empty((n, LANES), np.float64), np.empty((n, LANES), np.int32),
            np.zeros((4, LANES), np.float32), np.zeros((7, LANES), np.float64), np.zeros(LANES, np.bool_),
            np.empty(n, np.uint32))


@njit(**NJIT)
def make_qkx3_blocks(nmax: int, x: np.ndarray, w: np.ndarray, L: np.ndarray, fused_sum_x2: bool,
                     scales: np.ndarray, mins: np.ndarray, scratch: tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                          np.ndarray, np.ndarray, np.ndarray,
                                                                          np.ndarray]) -> None:
    """make_qkx3_quants over every block (row) of x [blocks, n] (w, L alike), into scales and mins: the same bits.
    `scratch`: qkx3_scratch(n).

    Each trial's float64 sums are a chain of dependent multiply-adds that ik's order forbids reassociating, so one
    block's search waits on latency. The blocks are independent: LANES of them run their trials side by side, each
    lane its own chain in its own order (a vector multiply-add advances all four)."""
    nb, n = x.shape
    top = np.int32(nmax)
    xt, wt, Laux, f32_state, f64_state, live, movable = scratch
    mn, mx, scale, iscale = f32_state[0], f32_state[1], f32_state[2], f32_state[3]
    best_mad, sum_w, sum_x, sum_x2 = f64_state[0], f64_state[1], f64_state[2], f64_state[3]
    sums = f64_state[4:7]
    for b0 in range(0, nb - nb % LANES, LANES):
        for k in range(LANES):
            b = b0 + k
            mn[k], mx[k], sum_w[k], sum_x[k], sum_x2[k] = _qkx3_moments(x[b], w[b], fused_sum_x2)
            live[k] = not (mx[k] - mn[k] < np.float32(1e-10))
            if live[k]:
                scale[k], best_mad[k] = _qkx3_start(nmax, x[b], w[b], L[b], mn[k], mx[k])
            else:
                L[b] = 0
                scales[b], mins[b] = np.float32(0.0), mn[k]
                mn[k], mx[k] = 0.0, 1.0  # a dead lane computes on a harmless range and is never read
            for i in range(n):
                xt[i, k] = x[b, i]
                wt[i, k] = w[b, i]
        for step in range(37):
            for k in range(LANES):
                iscale[k] = _trial_iscale(step, nmax, mn[k], mx[k])
            _lane_trial(xt, wt, mn, iscale, top, Laux, sums)
            for k in range(LANES):
                if not live[k]:
                    continue
                D, this_scale, this_min = _qkx3_fit(sum_w[k], sum_x[k], sums[0, k], sums[1, k], sums[2, k])
                if D > 0:
                    mad = _qkx3_error(this_scale, this_min, sum_w[k], sum_x[k], sum_x2[k], sums[0, k], sums[1, k],
                                      sums[2, k])
                    if mad < best_mad[k]:
                        for i in range(n):
                            L[b0 + k, i] = Laux[i, k]
                        best_mad[k] = mad
                        scale[k] = np.float32(this_scale)
                        mn[k] = np.float32(this_min)
        for k in range(LANES):
            b = b0 + k
            if live[k]:
                scales[b], mins[b] = _qkx3_refine(nmax, x[b], w[b], L[b], scale[k], mn[k], sum_w[k], sum_x[k],
                                                  movable)
    for b in range(nb - nb % LANES, nb):
        scales[b], mins[b] = make_qkx3_quants(nmax, x[b], w[b], L[b], fused_sum_x2)
