"""The integer matmul of --numerics ik (ikrun/numerics/ik/qgemm.py) and the integer forms it multiplies."""

from __future__ import annotations

from pathlib import Path

import numba
import numpy as np
import pytest

import ikquant.formats  # noqa: F401  (registers the codecs)
from ikquant.gguf_io import GGUFFile
from ikquant.types import type_by_name
from ikrun.numerics.ik.formats import (
    IK_KERNELS,
    KEY_CACHE_KERNELS,
    KT_MATMUL_FACTOR,
    Q8_2_X4,
    Q8_K,
    _block_f16,
    _iq6_k_table_ints,
    _kt_sub_scales,
    integer_rows,
    round_activations,
)
from ikrun.numerics.ik.qgemm import (
    _DOT_PAIRS,
    _DOT_PMADD,
    GROUPS,
    HAS_AVX2,
    HAS_VNNI,
    ORDER_PLAIN,
    ORDER_Q8_1,
    ORDER_Q8_1_AVX2,
    ORDER_QX_0_AVX2,
    ORDER_QX_0_NATIVE,
    ORDER_R8,
    ORDER_R8_AVX2,
    ORDER_R16,
    SIGNED_TILES,
    TILE,
    BlockInts,
    IntRows,
    _make_native_tile,
    _make_tile,
    pack,
    qmatmul,
)
from ikrun.ops.moe import moe_experts

DATA = Path(__file__).parent / "data"
#: (block, activation format, with Q8_1 offsets)
LAYOUTS = [(32, Q8_2_X4, False), (32, Q8_2_X4, True), (256, Q8_K, False)]


def _weights(rng: np.random.Generator, rows: int, n: int, block: int, offsets: bool) -> BlockInts:
    """Values in -127 .. 127, what ik's quantizers and conversions write (a -128 takes the scalar kernel)."""
    q = rng.integers(-127, 128, (rows, n)).astype(np.int8)
    scale = rng.random((rows, n // block)).astype(np.float32)
    offset = rng.standard_normal((rows, n // block)).astype(np.float32) if offsets else None
    return BlockInts(q, scale, block, offset, ORDER_Q8_1 if offsets else ORDER_PLAIN)


@pytest.mark.parametrize(("block", "fmt", "offsets"), LAYOUTS)
def test_qmatmul_is_the_rounded_product(block: int, fmt: str, offsets: bool) -> None:
    """Rows that are no whole 16-row group and activation rows that are no whole tile: every output equals the
    float64 product of the rounded activations and the weights to float32 accuracy (the float part sums blocks
    one at a time)."""
    rng = np.random.default_rng(block + offsets)
    w = _weights(rng, 37, 4 * block, block, offsets)
    x = rng.standard_normal((TILE + 3, 4 * block)).astype(np.float32)
    got = qmatmul(integer_rows(x, fmt), pack(w))
    want = round_activations(x, fmt).astype(np.float64) @ w.to_float().T.astype(np.float64)
    assert got.shape == (TILE + 3, 37)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_block_sums_are_exact_integers() -> None:
    """Unit scales and one block: the output is the integer dot product itself, to the last unit."""
    rng = np.random.default_rng(5)
    q = rng.integers(-128, 128, (16, 32)).astype(np.int8)
    x = rng.integers(-127, 128, (4, 32)).astype(np.float32)
    x[:, 0] = 127  # every activation block's scale is then bf16(127 / 127) = 1
    got = qmatmul(integer_rows(x, Q8_2_X4), pack(BlockInts(q, np.ones((16, 1), np.float32), 32)))
    np.testing.assert_array_equal(got, x.astype(np.int64) @ q.T.astype(np.int64))


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a b + c of float32 arrays with one rounding: the float64 product is exact, the float64 sum's own error
    (two-sum) settles the rare sums that land on a float32 midpoint."""
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in np.broadcast_arrays(a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    r = s.astype(np.float32)
    up, down = np.nextafter(r, np.float32(np.inf)), np.nextafter(r, np.float32(-np.inf))
    r = np.where((err > 0) & ((r.astype(np.float64) + up) / 2 == s), up, r)
    return np.where((err < 0) & ((r.astype(np.float64) + down) / 2 == s), down, r)


def _ik_reference(x: IntRows, w: BlockInts) -> np.ndarray:
    """The float order of ik's kernel for `w.order`, written out with numpy from the integers (tests/_fma32)."""
    m, nb = x.rows, w.scale.shape[1]
    qa = x.u[:m].astype(np.int64).reshape(m, nb, w.block) - 128
    qw = w.q.astype(np.int64).reshape(-1, nb, w.block)
    isum = np.einsum("mbk,rbk->mrb", qa, qw)
    asum = qa.sum(axis=2)
    d = (w.scale[None, :, :] * x.scale[:m, None, :]).astype(np.float32)  # [m, r, b]
    zero = np.zeros(d.shape[:2], np.float32)
    if w.order in (ORDER_QX_0_NATIVE, ORDER_QX_0_AVX2):  # AVX-512: the weights + bias as bytes (wrapping, as ik
        own = w.order == ORDER_QX_0_NATIVE  # adds them) and their correction; AVX2: the weights as they are
        prods = np.einsum("mbk,rbk->mrbk", qa, (qw + w.bias) % 256 if own else qw)
        acc, accm = np.zeros((*d.shape[:2], 8), np.float32), np.zeros((*d.shape[:2], 4), np.float32)
        corr = (w.scale * np.float32(-w.bias)).astype(np.float32)[None] * x.sums[:m, None, :] if own else \
            np.zeros(d.shape, np.float32)
        for b in range(nb):
            if b < nb // 4 * 4:  # a whole group of four: halves to accumulators j and 4 + j
                j = b % 4
                accm[..., j] += corr[..., b]
                acc[..., j] = _fma32(d[..., b], prods[..., b, :16].sum(-1).astype(np.float32), acc[..., j])
                acc[..., 4 + j] = _fma32(d[..., b], prods[..., b, 16:].sum(-1).astype(np.float32), acc[..., 4 + j])
            else:  # after them: eight 4-value sums, a quarter of the correction to each accm
                accm += (corr[..., b] * np.float32(0.25))[..., None]
                fours = prods[..., b, :].reshape(*prods.shape[:2], 8, 4).sum(-1).astype(np.float32)
                acc = _fma32(d[..., b, None], fours, acc)
        t = (acc[..., :4] + acc[..., 4:]) + accm if own else acc[..., :4] + acc[..., 4:]
        return (t[..., 0] + t[..., 2]) + (t[..., 1] + t[..., 3])
    if w.order == ORDER_R8:
        acc, acc1 = zero, zero
        for b in range(nb):
            acc = _fma32(d[..., b], (isum[..., b] + 127 * asum[:, None, b]).astype(np.float32), acc)
            acc1 = _fma32(w.scale[None, :, b], x.sums[:m, None, b], acc1)
        return _fma32(np.float32(-127), acc1, acc)
    acc = zero
    if w.order == ORDER_R8_AVX2:
        for b in range(nb):
            acc = _fma32(d[..., b], isum[..., b].astype(np.float32), acc)
        return acc
    if w.order == ORDER_R16:
        for b in range(nb):
            acc = _fma32(d[..., b], (isum[..., b] + 128 * asum[:, None, b]).astype(np.float32), acc)
            acc = _fma32((w.scale[:, b] * np.float32(-128)).astype(np.float32)[None, :], x.sums[:m, None, b], acc)
        return acc
    assert w.order in (ORDER_Q8_1, ORDER_Q8_1_AVX2) and w.offset is not None
    if w.order == ORDER_Q8_1_AVX2:  # each half block's sum scaled on its own; the blocks past the last group: nothing
        half = np.einsum("mbhk,rbhk->mrbh", qa.reshape(m, nb, 2, 16), qw.reshape(-1, nb, 2, 16))
        for b0 in range(0, nb // 4 * 4, 4):
            for b in range(b0, b0 + 4):
                acc = _fma32(w.offset[None, :, b], x.sums[:m, None, b], acc)
            for b in range(b0, b0 + 4):
                for h in range(2):
                    acc = _fma32(d[..., b], half[..., b, h].astype(np.float32), acc)
        return acc
    for b0 in range(0, nb, 4):
        for b in range(b0, b0 + 4):
            acc = _fma32(w.offset[None, :, b], x.sums[:m, None, b], acc)
        for b in range(b0, b0 + 4):
            acc = _fma32(d[..., b], isum[..., b].astype(np.float32), acc)
    return acc


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize(("block", "fmt", "order"), [(32, Q8_2_X4, ORDER_R8), (32, Q8_2_X4, ORDER_Q8_1),
                                                     (256, Q8_K, ORDER_R16), (32, Q8_2_X4, ORDER_QX_0_NATIVE),
                                                     (32, Q8_2_X4, ORDER_R8_AVX2), (32, Q8_2_X4, ORDER_Q8_1_AVX2),
                                                     (32, Q8_2_X4, ORDER_QX_0_AVX2), (256, Q8_K, ORDER_R8_AVX2)])
def test_each_order_is_iks_float_arithmetic(block: int, fmt: str, order: int, tiled: bool) -> None:
    """ik's Q8_0_R8, Q8_1 and Q8_K_R16 gemms (AVX2: Q8_K_R8) and its own Q8_0 kernel (AVX-512 and AVX2; ikrun/numerics/ik/qgemm.py
    ORDER_*), written out block by block with exact fused multiply-adds: the kernels give their bits, over rows long
    enough to take several passes of K_BYTES (Q8_0's kernels and the AVX2 Q8_1 one: blocks past the last whole
    group of four too) and row counts that are no whole tiles or groups; the plain order gives other bits."""
    rng = np.random.default_rng(order)
    n = {ORDER_QX_0_NATIVE: 26 * block, ORDER_QX_0_AVX2: 26 * block, ORDER_Q8_1_AVX2: 26 * block,
         ORDER_R16: 4 * block}.get(order, 24 * block if block == 32 else 5 * block)
    w = _weights(rng, 40, n, block, order in (ORDER_Q8_1, ORDER_Q8_1_AVX2))
    w = BlockInts(w.q, w.scale, block, w.offset, order, bias=127 if order == ORDER_QX_0_NATIVE else 0)
    x = (rng.standard_normal((TILE + 3, w.q.shape[1])) * rng.uniform(0.1, 10, (TILE + 3, 1))).astype(np.float32)
    rows = integer_rows(x, fmt)
    got = qmatmul(rows, pack(w), tiled=tiled)
    np.testing.assert_array_equal(got, _ik_reference(rows, w))
    plain = qmatmul(rows, pack(BlockInts(w.q, w.scale, block)), tiled=tiled)
    if w.offset is not None:  # the plain order has no offsets: add them block by block after the scaled sums
        for b in range(w.scale.shape[1]):
            plain = plain + w.offset[None, :, b] * rows.sums[: rows.rows, None, b]
    assert np.any(plain != got)


NATIVE = np.load(DATA / "logits" / "ik-bits" / "ik-native-matmuls.npz")


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("case", sorted({k.rsplit("-", 1)[0] for k in NATIVE.files}))
def test_32_value_types_below_conversion_multiply_as_iks_own_kernel(case: str, tiled: bool) -> None:
    """ik's own matmuls of Q8_0, Q4_0, Q5_0, Q6_0, IQ4_NL and MXFP4 weights (its file's bytes) with fewer
    activation rows than it converts them from (tests/data/logits/ik-bits): every output bit, whole groups of four
    blocks and blocks after them."""
    type_name, shape, _ = case.split("-")
    rows, k = (int(v) for v in shape.split("x"))
    raw, x, want = NATIVE[case + "-w"].reshape(rows, -1), NATIVE[case + "-x"], NATIVE[case + "-y"]
    decoded = type_by_name(type_name.upper()).require_codec().dequantize(raw, k).reshape(rows, k)
    kernel = IK_KERNELS[type_name.upper()]
    assert not kernel.converts(len(x), rows)
    ints = kernel.integers(len(x), rows)
    assert ints is not None
    got = qmatmul(integer_rows(x, kernel.activation), pack(ints(raw, decoded)), tiled=tiled)
    np.testing.assert_array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32))


def test_offsets_belong_to_the_q8_1_order_alone() -> None:
    rng = np.random.default_rng(4)
    x = integer_rows(rng.standard_normal((TILE, 128)).astype(np.float32), Q8_2_X4)
    w = _weights(rng, 16, 128, 32, True)
    with pytest.raises(ValueError, match="offsets belong"):
        qmatmul(x, pack(BlockInts(w.q, w.scale, 32, w.offset, ORDER_R8)))
    with pytest.raises(ValueError, match="offsets belong"):
        qmatmul(x, pack(BlockInts(w.q, w.scale, 32, None, ORDER_Q8_1)))


@pytest.mark.parametrize(("block", "fmt", "offsets"), LAYOUTS)
def test_tile_and_scalar_kernels_give_the_same_bits(block: int, fmt: str, offsets: bool) -> None:
    """vpdpbusd on AVX-512 VNNI, its vector-code equivalent elsewhere: the scalar reference's bits either way."""
    rng = np.random.default_rng(11)
    w, x = _weights(rng, 64, 4 * block, block, offsets), rng.standard_normal((9, 4 * block)).astype(np.float32)
    rows, packed = integer_rows(x, fmt), pack(w)
    np.testing.assert_array_equal(qmatmul(rows, packed, tiled=True), qmatmul(rows, packed, tiled=False))


@pytest.mark.parametrize("order", [ORDER_PLAIN, ORDER_R8, ORDER_R8_AVX2])
def test_weights_holding_minus_128_multiply_exactly(order: int) -> None:
    """AVX2's signed byte products cannot negate -128: a weight holding one is multiplied in the scalar kernel (on
    such a host the tile gives other sums for it, shown on the tile itself), every other weight in the tiles."""
    rng = np.random.default_rng(order)
    w = _weights(rng, 32, 256, 32, False)
    q = w.q.copy()
    q[5, 7] = -128
    w = BlockInts(q, w.scale, 32, None, order)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x[0, 7] = -2.0  # negative: vpsignb would negate the weight's -128, which stays -128
    rows, packed = integer_rows(x, Q8_2_X4), pack(w)
    assert packed.full_range and not pack(BlockInts(q.clip(-127), w.scale, 32, None, order)).full_range
    exact = qmatmul(rows, packed, tiled=False)
    np.testing.assert_array_equal(qmatmul(rows, packed, tiled=True), exact)
    if SIGNED_TILES:
        tile = _make_tile(32, order)

        @numba.njit
        def call(wq, ws, wc, wo, au, asc, asum, aisum, out, nb, n):  # type: ignore[no-untyped-def]
            tile(wq, ws, wc, wo, au, asc, asum, aisum, out, 0, 0, 0, nb, nb, n)

        out = np.zeros((TILE, 32), np.float32)
        call(packed.q, packed.scale, packed.corr, packed.offset, rows.u.reshape(-1), rows.scale.reshape(-1),
             rows.sums.reshape(-1), rows.isums.reshape(-1), out.reshape(-1), 8, 32)
        assert out[0, 5] != exact[0, 5]


@pytest.mark.parametrize("tiled", [False, True])
def test_any_thread_count_gives_the_same_bits(tiled: bool) -> None:
    """Large enough for the parallel kernel: a task (a weight group against a panel of rows) computes its outputs
    whole whichever thread claims it, so one or two change nothing."""
    rng = np.random.default_rng(3)
    w, x = _weights(rng, 512, 1024, 32, False), rng.standard_normal((64, 1024)).astype(np.float32)
    rows, packed = integer_rows(x, Q8_2_X4), pack(w)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = qmatmul(rows, packed, tiled=tiled)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = qmatmul(rows, packed, tiled=tiled)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(one, two)


def test_work_claimed_in_small_tasks_is_computed_once() -> None:
    """Few weight groups and many rows: the threads claim row panels of each group from a shared counter; every
    output is computed exactly once (the kernels add to the output, so a task run twice or never shows)."""
    rng = np.random.default_rng(5)
    w, x = _weights(rng, 64, 2048, 32, False), rng.standard_normal((203, 2048)).astype(np.float32)
    rows, packed = integer_rows(x, Q8_2_X4), pack(w)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        for _ in range(5):
            np.testing.assert_array_equal(qmatmul(rows, packed, tiled=True), qmatmul(rows, packed, tiled=False))
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("fmt", [Q8_2_X4, Q8_K])
def test_integer_rows_are_the_rounded_activations(fmt: str) -> None:
    """The integers and scales qmatmul takes are the values the float emulation rounds to, and the block sums are
    scale x the integers' sum."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((5, 512)) * rng.random((5, 1)) * 40).astype(np.float32)
    x[2, :256] = 0  # an all-zero block: scale 0
    r = integer_rows(x, fmt)
    q = r.u[: r.rows].astype(np.int32) - 128
    np.testing.assert_array_equal(  # the emulation rounds q x d to float32
        (q.reshape(5, -1, r.block).astype(np.float32) * r.scale[: r.rows, :, None]).reshape(5, -1),
        round_activations(x, fmt))
    np.testing.assert_array_equal(r.sums[: r.rows], r.scale[: r.rows] * q.reshape(5, -1, r.block).sum(-1).astype(np.float32))
    assert r.u.shape[0] % TILE == 0 and (r.u[r.rows :] == 128).all() and (r.scale[r.rows :] == 0).all()


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q5_0", "Q6_0", "IQ4_NL", "MXFP4"])
def test_stored_integers_of_block_types_are_their_decoding(type_name: str) -> None:
    """The 32-value types ik multiplies as stored: scale x integers is every decoded float, bit for bit."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((24, 256)) * np.exp(rng.standard_normal((24, 1)))).astype(np.float32)
    codec = type_by_name(type_name).require_codec()
    raw = codec.quantize(x)
    decoded = codec.dequantize(raw, 256)
    ints = IK_KERNELS[type_name].ints
    assert ints is not None
    np.testing.assert_array_equal(ints(raw, decoded).to_float(), decoded)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_1"])
def test_types_with_a_min_convert_to_their_codes_scale_and_min(type_name: str) -> None:
    """Q4_1 and Q5_1 as ik converts them to Q8_1_R8 (a K cache's kernel): scale x code + offset is every decoded
    float, bit for bit, the codes in 0 .. 15 / 0 .. 31."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((24, 256)) * np.exp(rng.standard_normal((24, 1)))).astype(np.float32)
    codec = type_by_name(type_name).require_codec()
    raw = codec.quantize(x)
    decoded = codec.dequantize(raw, 256)
    held = KEY_CACHE_KERNELS[type_name].integers(32, 32)
    assert held is not None
    w = held(raw, decoded)
    np.testing.assert_array_equal(w.to_float(), decoded)
    assert w.q.min() == 0 and w.q.max() == (15 if type_name == "Q4_1" else 31)


def test_routed_experts_in_integers_match_their_float_emulation() -> None:
    """moe_experts with each expert's integers (qmatmul per expert) against the float kernel on the same rounded
    values; with half of the experts sent to each path, every expert's rows are those of its own path, bit for bit."""
    rng = np.random.default_rng(4)
    n, n_expert, k, n_ff, n_embd = 70, 6, 2, 64, 96
    x = rng.standard_normal((n, n_embd)).astype(np.float32)
    sel = np.stack([rng.choice(n_expert, k, replace=False) for _ in range(n)]).astype(np.int64)
    w = rng.random((n, k)).astype(np.float32)
    mats = [[_weights(rng, rows, cols, 32, False) for rows, cols in ((n_ff, n_embd), (n_ff, n_embd), (n_embd, n_ff))]
            for _ in range(n_expert)]
    packs = [tuple(pack(m) for m in expert) for expert in mats]

    def fetch(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        up, gate, down = (np.stack([mats[e][j].to_float() for e in ids.tolist()]) for j in range(3))
        return up, gate, down

    formats = (Q8_2_X4, Q8_2_X4, Q8_2_X4)
    floats = moe_experts(x, sel, w, n_expert, fetch, formats=formats)
    ints = moe_experts(x, sel, w, n_expert, fetch, formats=formats, ints=lambda e: packs[e])
    mixed = moe_experts(x, sel, w, n_expert, fetch, formats=formats, ints=lambda e: packs[e] if e % 2 else None)
    # the SwiGLU inputs are the same rounded products, summed in another order
    np.testing.assert_allclose(ints.act, floats.act, rtol=0, atol=1e-5 * np.abs(floats.act).max())
    # the outputs from the integer path's own activations (rounded again, a value near a rounding boundary may
    # round the other way from the float path's)
    want = np.zeros((n, n_embd))
    for e in range(n_expert):
        rows = ints.rows(e)
        y = round_activations(ints.act[rows], Q8_2_X4).astype(np.float64) @ mats[e][2].to_float().T.astype(np.float64)
        np.add.at(want, rows // k, w.reshape(-1)[rows, None] * y)
    np.testing.assert_allclose(ints.out, want, rtol=0, atol=1e-5 * np.abs(want).max())
    for e in range(n_expert):
        rows = floats.rows(e)
        np.testing.assert_array_equal(mixed.act[rows], (ints if e % 2 else floats).act[rows])


@pytest.mark.parametrize("type_name", ["IQ1_KT", "IQ2_KT", "IQ3_KT", "IQ4_KT"])
def test_trellis_integers_are_the_generators_values(type_name: str) -> None:
    """A trellis row decodes to (d x sub-block scale) x the generator's integer (-126..126); ik's matmul multiplies
    those integers by (d x its factor) x the sub-block scale, in float32 natively and rounded to f16 converted."""
    gguf = GGUFFile(DATA / "convert" / "qwen3-plan-more" / f"ik-{type_name.lower()}.gguf")
    name = "blk.0.ffn_down.weight"
    raw, n = np.ascontiguousarray(gguf.raw(name)), gguf.info(name).n_per_row
    raw = raw.reshape(gguf.info(name).n_rows, -1)
    decoded = type_by_name(type_name).require_codec().dequantize(raw, n)
    kernel = IK_KERNELS[type_name]
    assert kernel.ints is not None and kernel.convert is not None
    native, converted = kernel.ints(raw, decoded), kernel.convert(raw, decoded)
    d = raw[:, :4].copy().view(np.float32)
    dl = (d * _kt_sub_scales(raw, n, type_name)).astype(np.float32)
    assert np.abs(native.q).max() <= 126
    np.testing.assert_array_equal((native.q.reshape(*dl.shape, 32) * dl[..., None]).reshape(decoded.shape), decoded)
    factor = KT_MATMUL_FACTOR[type_name]
    dm = d if factor is None else (d * factor).astype(np.float32)
    np.testing.assert_array_equal(native.scale, (dm * _kt_sub_scales(raw, n, type_name)).astype(np.float32))
    np.testing.assert_array_equal(converted.scale, native.scale.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(converted.q, native.q)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_k_quants_convert_to_their_values_with_f16_scales(type_name: str) -> None:
    """ik's Q8_1 conversion keeps the 4- or 5-bit values and rounds the scale d x sc and the offset -dmin x m to f16:
    every converted value is within that rounding of the decoding (a wrong value would be a whole scale off)."""
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((32, 512)) * np.exp(rng.standard_normal((32, 1))) + 0.3).astype(np.float32)
    codec = type_by_name(type_name).require_codec()
    raw = codec.quantize(x)
    decoded = codec.dequantize(raw, 512)
    convert = IK_KERNELS[type_name].convert
    assert convert is not None
    ints = convert(raw, decoded)
    assert ints.q.min() >= 0 and ints.q.max() == (31 if type_name == "Q5_K" else 15)
    assert ints.offset is not None
    scale, offset = np.repeat(ints.scale, 32, axis=1), np.repeat(ints.offset, 32, axis=1)
    bound = 2.0**-11 * (np.abs(scale * ints.q) + np.abs(offset)) * 1.001 + 1e-30
    assert (np.abs(ints.to_float() - decoded) <= bound).all()


def _tile32_asm() -> str:
    """What LLVM emits for the 32-value micro-kernel (compiled afresh: cached code cannot be inspected)."""
    from numba import njit

    from ikrun.numerics.ik.qgemm import _tile32

    @njit
    def call(wq, ws, wc, wo, au, asc, asum, aisum, out):  # type: ignore[no-untyped-def]
        _tile32(wq, ws, wc, wo, au, asc, asum, aisum, out, 0, 0, 0, 1, 1, 32)

    f32, i8 = np.zeros(64, np.float32), np.zeros(32 * 32, np.int8)
    call(i8, f32, np.zeros(64, np.int32), f32, np.zeros(4 * 32, np.uint8), f32, f32, np.zeros(4, np.int32),
         np.zeros(4 * 32, np.float32))
    return "\n".join(call.inspect_asm().values())


@pytest.mark.skipif(not HAS_VNNI, reason="this CPU has no AVX-512 VNNI")
def test_the_vnni_kernel_is_built_from_vpdpbusd() -> None:
    """512-bit vpdpbusd, 8 per 32-value block of each of the 4 x 2 accumulators."""
    asm = _tile32_asm()
    assert asm.count("vpdpbusd") >= 64 and "vpdpbusd\t%zmm" in asm  # LLVM may unroll the block loop further


@pytest.mark.skipif(HAS_VNNI, reason="this CPU has AVX-512 VNNI: the kernel is built from vpdpbusd")
def test_the_kernel_without_vnni_is_vector_code() -> None:
    """Without VNNI the byte products are summed on vector registers, not one value at a time: on AVX2 by
    vpmaddubsw (signed bytes, pairs) then vpmaddwd (pairs to 32 bits)."""
    asm = _tile32_asm()
    assert "vpdpbusd" not in asm
    if SIGNED_TILES:  # a step of the loop: 2 groups x 4 rows x 2 halves
        assert asm.count("vpmaddubsw") >= 16 and asm.count("vpmaddwd") >= 16 and asm.count("vpsignb") >= 16
    else:
        assert asm.count("vpmaddwd") >= 64


#: the byte dot products this host can run besides its own: (name, the tile's dot)
OTHER_DOTS = [("portable vector code", lambda builder: _DOT_PAIRS)] + (
    [("vpmaddwd", lambda builder: _DOT_PMADD)] if HAS_AVX2 else [])


@pytest.mark.parametrize(("name", "dot"), OTHER_DOTS, ids=[name for name, _ in OTHER_DOTS])
@pytest.mark.parametrize(("block", "fmt", "order"), [(32, Q8_2_X4, ORDER_PLAIN), (256, Q8_K, ORDER_PLAIN),
                                                     (32, Q8_2_X4, ORDER_R8), (32, Q8_2_X4, ORDER_Q8_1),
                                                     (256, Q8_K, ORDER_R16), (32, Q8_2_X4, ORDER_QX_0_NATIVE),
                                                     (32, Q8_2_X4, ORDER_R8_AVX2), (256, Q8_K, ORDER_R8_AVX2)])
def test_each_dot_product_kernel_gives_the_scalar_bits(name: str, dot, block: int, fmt: str,  # type: ignore[no-untyped-def]
                                                       order: int) -> None:
    """The tile kernels built on the byte dot products the host does not pick (the portable vector code a CPU
    without AVX2 runs; vpmaddwd on a VNNI host): one call, a whole row, the scalar kernel's bits in every order."""
    tile = _make_native_tile(dot) if order == ORDER_QX_0_NATIVE else _make_tile(block, order, dot)

    @numba.njit
    def call(wq, ws, wc, wo, au, asc, asum, aisum, out, nb, n):  # type: ignore[no-untyped-def]
        tile(wq, ws, wc, wo, au, asc, asum, aisum, out, 0, 0, 0, nb, nb, n)

    rng = np.random.default_rng(order)
    n, rows = 8 * block, GROUPS * 16
    w = _weights(rng, rows, n, block, order == ORDER_Q8_1)
    w = BlockInts(w.q, w.scale, block, w.offset, order, bias=127 if order == ORDER_QX_0_NATIVE else 0)
    x = integer_rows(rng.standard_normal((TILE, n)).astype(np.float32), fmt)
    packed = pack(w)
    out = np.zeros((TILE, rows), np.float32)
    call(packed.q, packed.scale, packed.corr, packed.offset, x.u.reshape(-1), x.scale.reshape(-1),
         x.sums.reshape(-1), x.isums.reshape(-1), out.reshape(-1), n // block, rows)
    np.testing.assert_array_equal(out, qmatmul(x, packed, tiled=False))


def _q8_k_reference(decoded: np.ndarray, dsup: np.ndarray, c: float) -> tuple[np.ndarray, np.ndarray]:
    """ik's convert_to_q8_k_r8 written with numpy, array at a time."""
    shape = dsup.shape + (256,)
    p = np.rint(np.divide(decoded.reshape(shape), dsup[..., None], out=np.zeros(shape, np.float32),
                          where=dsup[..., None] != 0))
    dnew = np.abs(p).max(axis=-1) * np.float32(np.float32(1.0) / np.float32(c))
    small = dnew < 1
    dnew = np.where(small, np.float32(1), dnew).astype(np.float32)
    inv = np.where(np.abs(dnew) > np.float32(1e-9), np.float32(1) / dnew, np.float32(0)).astype(np.float32)
    q = np.where(small[..., None], p, np.clip(np.rint(p * inv[..., None]), -128, 127))
    return q.reshape(decoded.shape).astype(np.int8), (dsup * dnew).astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("type_name", ["IQ2_K", "IQ3_K", "IQ4_KS", "IQ5_K", "IQ6_K", "IQ2_KS"])
def test_iqk_conversion_is_its_array_definition(type_name: str) -> None:
    """The Numba conversion to Q8_K_R16 gives the integers and scales of the array-at-a-time definition, bit for bit
    (blocks whose integers fit and blocks re-quantized against max / c, an all-zero row included)."""
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((16, 512)) * np.exp(rng.standard_normal((16, 1)) * 2)).astype(np.float32)
    x[3] = 0
    codec = type_by_name(type_name).require_codec()
    raw = codec.quantize(x)
    decoded = codec.dequantize(raw, 512)
    convert = IK_KERNELS[type_name].convert
    assert convert is not None
    got = convert(raw, decoded)
    if type_name in ("IQ4_KS", "IQ2_KS"):  # one scale per row, before the blocks
        row = raw[:, :4].copy().view(np.float32) if type_name == "IQ4_KS" else \
            raw[:, :2].copy().view(np.float16).astype(np.float32)
        d = np.repeat(row, 2, axis=1)
    else:
        d = _block_f16(raw, type_by_name(type_name).type_size)
    if type_name == "IQ6_K":  # ik's kernels multiply iq6nl_values, which its cubic decoding rounds to
        ints = _iq6_k_table_ints(raw)
        scaled = np.repeat(d, 256, axis=1)
        ls = np.repeat(raw.reshape(16, -1, 212)[..., 4:20].view(np.int8).astype(np.float32), 16, axis=2)
        cubic = np.divide(decoded, scaled, out=np.zeros_like(decoded), where=scaled != 0)
        assert np.all(np.abs(ints - cubic) <= 0.5 * np.abs(ls.reshape(16, -1)) + 1e-3)
        assert np.any(ints != np.rint(cubic))
        decoded = (ints * scaled).astype(np.float32)
    q, scale = _q8_k_reference(decoded, d, {"IQ2_K": 120, "IQ2_KS": 125}.get(type_name, 127))
    np.testing.assert_array_equal(got.q, q)
    np.testing.assert_array_equal(got.scale, scale)
