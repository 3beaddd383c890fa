"""LLVM IR building blocks for the quantizers' kernels written as Numba intrinsics (listed_search, grid_sums,
iq4kss_lanes, the trellis scan; ikrun's simd splat too): the searches whose speed must not depend on whether LLVM
vectorises a loop: it vectorised the IQK scale search in one compile and left it scalar in another (IQ4_KS at 7.9
and 1.7 M weights/s, IQ5_KS at 0.7). Eight lanes unless a helper says otherwise."""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils
from numba.extending import register_jitable

LANES = 8
#: C's FLT_MAX, the bound ik's searches compare their best sums with
FLT_MAX = 3.4028234663852886e38
F32 = ir.FloatType()
I1 = ir.IntType(1)
I8 = ir.IntType(8)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
V8F = ir.VectorType(F32, LANES)
V8I = ir.VectorType(I32, LANES)
V8L = ir.VectorType(I64, LANES)
V8B = ir.VectorType(I8, LANES)


@register_jitable
def whole_vectors(n: int) -> int:
    """n lanes (trials, list entries) rounded up to whole vectors of LANES; callable from Python and kernels."""
    return (n + LANES - 1) // LANES * LANES


def splat(builder: ir.IRBuilder, value: ir.Value, vector: ir.VectorType) -> ir.Value:
    """`value` in every lane of `vector` (of any width)."""
    v = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(I32, 0))
    mask = ir.Constant(ir.VectorType(I32, vector.count), [0] * vector.count)
    return builder.shuffle_vector(v, ir.Constant(vector, ir.Undefined), mask)


def fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a * b + c rounded once, lane by lane (fmaf)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8F, [V8F] * 3), "llvm.fma.v8f32")
    return builder.call(fn, [a, b, c])


def fold(builder: ir.IRBuilder, v: ir.Value, pick: str, floats: bool) -> ir.Value:
    """The lanes' least (pick "<") or greatest (">") in every lane: three halving steps of shuffle and select."""
    for width in (4, 2, 1):
        mask = [(lane + width) % LANES for lane in range(LANES)]
        other = builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), ir.Constant(V8I, mask))
        better = builder.fcmp_ordered(pick, other, v) if floats else builder.icmp_signed(pick, other, v)
        v = builder.select(better, other, v)
    return v


def hsum8(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """The 8 float lanes of v summed in ik's hsum_float_8 order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))."""
    def pick(value: ir.Value, lanes: list[int]) -> ir.Value:
        return builder.shuffle_vector(value, ir.Constant(value.type, ir.Undefined),
                                      ir.Constant(ir.VectorType(I32, len(lanes)), lanes))

    b = builder.fadd(pick(v, [0, 1, 2, 3]), pick(v, [4, 5, 6, 7]))
    c = builder.fadd(pick(b, [0, 1]), pick(b, [2, 3]))
    return builder.fadd(builder.extract_element(c, ir.Constant(I32, 0)), builder.extract_element(c, ir.Constant(I32, 1)))


def gather(builder: ir.IRBuilder, base: ir.Value, index: ir.Value) -> ir.Value:
    """base[index[lane]] for eight int32 indices into an array of 32-bit floats or integers (one vgatherdps or
    vpgatherdd where the target has them)."""
    element = base.type.pointee
    vector = ir.VectorType(element, LANES)
    offsets = builder.mul(builder.sext(index, V8L), ir.Constant(V8L, [4] * LANES))
    pointers_t = ir.VectorType(element.as_pointer(), LANES)
    pointers = builder.inttoptr(builder.add(splat(builder, builder.ptrtoint(base, I64), V8L), offsets), pointers_t)
    mask_t = ir.VectorType(I1, LANES)
    name = "llvm.masked.gather.v8f32.v8p0" if element == F32 else "llvm.masked.gather.v8i32.v8p0"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [pointers_t, I32, mask_t, vector]),
                                        name)
    return builder.call(fn, [pointers, ir.Constant(I32, 4), ir.Constant(mask_t, [1] * LANES),
                             ir.Constant(vector, ir.Undefined)])


def load_vector(builder: ir.IRBuilder, data: ir.Value, at: ir.Value, vector: ir.VectorType) -> ir.Value:
    """The vector at element `at` of an array's data (no alignment assumed beyond the element's)."""
    return builder.load(builder.bitcast(builder.gep(data, [at]), vector.as_pointer()), align=4)


def store_vector(builder: ir.IRBuilder, value: ir.Value, data: ir.Value, at: ir.Value) -> None:
    """Store a vector at element `at` of an array's data."""
    builder.store(value, builder.bitcast(builder.gep(data, [at]), value.type.as_pointer()), align=4)
