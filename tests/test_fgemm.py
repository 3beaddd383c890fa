"""The exact mode's expert matmul (ikrun/ops/fgemm.py): one fused multiply-add chain per output, in k order."""

from __future__ import annotations

import re

import numba
import numpy as np
import pytest
from numba import njit

from ikquant.cpu import host_has
from ikquant.formats.numeric import fmaf
from ikquant.types import type_by_name
from ikrun.ops.fgemm import (
    AVX2_TILE,
    BLOCK_GROUPS,
    CHUNK_TILES,
    GROUPS,
    K_STEP,
    LANES,
    PANEL_TYPES,
    ROWS,
    FileExperts,
    GatheredRows,
    _tile,
    expert_matmul,
    experts_matmul,
    token_groups,
)


@njit(cache=True)
def _fma_chains(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], w.shape[0]), np.float32)
    for t in range(x.shape[0]):
        for r in range(w.shape[0]):
            acc = np.float32(0.0)
            for k in range(x.shape[1]):
                acc = fmaf(w[r, k], x[t, k], acc)
            out[t, r] = acc
    return out


def _case(m: int, n: int, rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, n)).astype(np.float32), rng.standard_normal((rows, n)).astype(np.float32)


def test_every_output_is_one_fma_chain_in_order() -> None:
    """Shapes that are no whole tiles (tokens, rows, and a row longer than one K step), and tokens of several
    blocks and rows of several tasks, the last of each partial: the bits of a scalar fused multiply-add loop."""
    blocks, chunks = 2 * BLOCK_GROUPS * LANES + 21, CHUNK_TILES * ROWS + 7
    for m, n, rows in ((1, 32, 1), (5, 64, 7), (37, 600, 13), (blocks, 300, chunks)):
        x, w = _case(m, n, rows)
        np.testing.assert_array_equal(expert_matmul(x, w), _fma_chains(x, w))


def test_the_tokens_batched_with_it_change_nothing() -> None:
    x, w = _case(70, 256, 24, 1)
    whole = expert_matmul(x, w)
    for a, b in ((0, 1), (3, 19), (40, 70)):
        np.testing.assert_array_equal(expert_matmul(x[a:b], w), whole[a:b])


def test_any_thread_count_gives_the_same_bits() -> None:
    x, w = _case(64, 512, 256, 2)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = expert_matmul(x, w)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = expert_matmul(x, w)
    finally:
        numba.set_num_threads(before)
    np.testing.assert_array_equal(one, two)


def test_half_precision_bits_are_widened_exactly() -> None:
    """f16 bits (uint16) and bf16 bits (int16) give the bits of their float32 values, subnormals, infinities and
    signed zeros included, on rows longer than one K step."""
    x, w = _case(37, 600, 13, 3)
    specials = np.array([0.0, -0.0, 6e-8, -6e-5, 65504.0, np.inf], dtype=np.float32)
    w[0, : specials.size] = specials
    x[:, : specials.size] = 0.5  # an inf weight gives inf, not NaN
    f16 = w.astype(np.float16)
    np.testing.assert_array_equal(expert_matmul(x, f16.view(np.uint16)), _fma_chains(x, f16.astype(np.float32)))
    bf16 = (w.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
    widened = (bf16.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(expert_matmul(x, bf16), _fma_chains(x, widened))


def test_experts_in_one_call_give_each_expert_alone_its_bits() -> None:
    """Several experts' tokens in one call (one with none, one with a single token, counts that are no whole
    groups, one of several token blocks, a token routed to two experts, rows that are no whole tiles, more than one
    task's): each expert's outputs are its own FMA chains, in f32 and f16, on one thread and two."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((40, 600)).astype(np.float32)
    w = rng.standard_normal((5, CHUNK_TILES * ROWS + 5, 600)).astype(np.float32)
    counts = np.array([0, 1, 17, BLOCK_GROUPS * LANES + 33, 5])
    row_at = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    tokens = rng.integers(0, len(x), int(row_at[-1])).astype(np.int64)
    tokens[row_at[2]] = tokens[row_at[3]]
    before = numba.get_num_threads()
    try:
        for threads in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(threads)
            for weights, values in ((w, w), (w.astype(np.float16).view(np.uint16), w.astype(np.float16))):
                out = experts_matmul(x, weights, tokens, row_at)
                for j in range(len(counts)):
                    mine = tokens[row_at[j] : row_at[j + 1]]
                    np.testing.assert_array_equal(out[row_at[j] : row_at[j + 1]],
                                                  _fma_chains(x[mine], values[j].astype(np.float32)))
    finally:
        numba.set_num_threads(before)


def test_results_written_into_given_rows() -> None:
    """With out and dest each result lands in its row of out (a MoE's assignment rows), the rows no result names
    untouched, the bits of the plain call's; a dest that does not cover every token is refused."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((30, 300)).astype(np.float32)
    w = rng.standard_normal((3, 2 * ROWS + 1, 300)).astype(np.float32)
    row_at = np.array([0, 7, 7, 25], np.int64)
    tokens = rng.integers(0, len(x), 25).astype(np.int64)
    dest = rng.permutation(40)[:25].astype(np.int64)
    out = np.full((40, w.shape[1]), np.float32(-7.0))
    assert experts_matmul(x, w, tokens, row_at, out, dest) is out
    np.testing.assert_array_equal(out[dest], experts_matmul(x, w, tokens, row_at))
    untouched = np.setdiff1d(np.arange(40), dest)
    assert untouched.size == 15 and (out[untouched] == np.float32(-7.0)).all()
    with pytest.raises(ValueError, match="dest name a row"):
        experts_matmul(x, w, tokens, row_at, out, dest[:-1])


@pytest.mark.parametrize("type_name", sorted(PANEL_TYPES))
def test_quantized_experts_decoded_a_panel_at_a_time_give_the_bits_of_their_decoding(type_name: str) -> None:
    """Experts handed over as the file's rows (decoded by the kernel, a panel at a time) multiply as their whole
    decoding does: rows that are no whole tiles, several K steps, counts that are no whole groups, an expert with no
    tokens, every sub-block scale and both grids (random rows), a non-consecutive selection (a copy), two threads;
    a last K step shorter than the others where the type's blocks allow it (MXFP4's 32 values)."""
    rng = np.random.default_rng(5)
    qtype = type_by_name(type_name)
    n_expert, rows, n = 4, 2 * ROWS + 5, 3 * K_STEP + 2 * qtype.block_size % K_STEP
    codec = qtype.require_codec()
    w = rng.standard_normal((n_expert * rows, n)).astype(np.float32) * rng.uniform(0.01, 3, (n_expert * rows, 1))
    raw = codec.quantize(w.astype(np.float32)).reshape(n_expert, rows, -1)
    decoded = codec.dequantize(raw.reshape(n_expert * rows, -1), n).reshape(n_expert, rows, n)
    x = rng.standard_normal((50, n)).astype(np.float32)
    counts = np.array([3, 0, 21, 40])
    row_at = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    tokens = rng.integers(0, len(x), int(row_at[-1])).astype(np.int64)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        for pick in (np.arange(n_expert), np.array([3, 0, 2, 1])):
            out = experts_matmul(x, FileExperts(raw[pick], type_name, n), tokens, row_at)
            np.testing.assert_array_equal(out, experts_matmul(x, decoded[pick], tokens, row_at))
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("n", [16, 37, 2 * K_STEP + 21])
def test_token_groups_are_each_experts_rows_side_by_side(n: int) -> None:
    """The gathered layout is each expert's token rows, 16 to a group, transposed ([group, k, lane]) and padded with
    zeros to whole groups: whole groups go through the in-register 16 x 16 transpose (a row's last n % 16 values
    and partial groups one value at a time), on one thread and on two, for small and large calls."""
    rng = np.random.default_rng(3)
    before = numba.get_num_threads()
    try:
        for threads in {1, min(2, numba.config.NUMBA_NUM_THREADS)}:
            numba.set_num_threads(threads)
            for counts in ([5, 0, 16, 33], [600, 17, 1024]):
                x = rng.standard_normal((300, n)).astype(np.float32)
                row_at = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
                tokens = rng.integers(0, len(x), int(row_at[-1])).astype(np.int64)
                xt, group_at = token_groups(x, tokens, row_at)
                want = []
                for j, count in enumerate(counts):
                    rows = np.zeros((-(-count // 16) * 16, n), np.float32)
                    rows[:count] = x[tokens[row_at[j] : row_at[j + 1]]]
                    want.append(rows.reshape(-1, 16, n).transpose(0, 2, 1))
                assert group_at.tolist() == np.concatenate([[0], np.cumsum([len(w) for w in want])]).tolist()
                np.testing.assert_array_equal(xt, np.concatenate(want))
    finally:
        numba.set_num_threads(before)


def test_rows_gathered_once_serve_every_weight_of_the_same_input() -> None:
    """GatheredRows (q/k/v, gate/up gathering their input once) gives each weight the bits of its own product, f16
    bits and float32 alike, after other products have reused the thread's kept gather buffer; a gathering used for
    other rows is refused."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((45, 2 * K_STEP + 3)).astype(np.float32)
    weights = [rng.standard_normal((ROWS + 7, x.shape[1])).astype(np.float16).view(np.uint16),
               rng.standard_normal((2 * ROWS, x.shape[1])).astype(np.float32)]
    rows = GatheredRows.of(x)
    for w in weights:
        want = expert_matmul(x, w)
        expert_matmul(rng.standard_normal((30, x.shape[1])).astype(np.float32), w)
        np.testing.assert_array_equal(expert_matmul(rows, w), want)
    with pytest.raises(ValueError, match="every row of one input"):
        experts_matmul(rows, weights[1][None], np.arange(44, dtype=np.int64), np.array([0, 44], np.int64))


def _tile_asm() -> str:
    """What LLVM emits for the register tile (compiled afresh: cached code cannot be inspected)."""

    @njit
    def call(panel, xt, out):  # type: ignore[no-untyped-def]
        _tile(panel, xt, 0, 0, 64, 64, out, 0, 16 * GROUPS)

    call(np.zeros(ROWS * K_STEP, np.float32), np.zeros(4 * 64 * 16, np.float32),
         np.zeros(ROWS * GROUPS * 16, np.float32))
    return "\n".join(call.inspect_asm().values())


@pytest.mark.skipif(not AVX2_TILE, reason="the 6 x 16 tile is AVX2's (16 vector registers of 8 floats)")
def test_the_avx2_tile_keeps_its_accumulators_in_registers() -> None:
    """12 ymm accumulators, 12 vfmadd a step (LLVM may unroll the step loop), none reloaded from the stack."""
    asm = _tile_asm()
    fmas = re.findall(r"vfmadd\w+\s+(.*)", asm)
    assert len(fmas) >= 12 and all(ops.count("%ymm") == 3 for ops in fmas)
    assert len({ops.split(", ")[-1] for ops in fmas}) == 12
    assert not any("rsp" in ops for ops in fmas)


@pytest.mark.skipif(AVX2_TILE or not host_has("avx512f"), reason="the 12 x 2 tile is AVX-512's (32 vector registers)")
def test_the_avx512_tile_keeps_its_accumulators_in_registers() -> None:
    """24 zmm accumulators, 24 vfmadd a step, none reloaded from the stack."""
    asm = _tile_asm()
    fmas = re.findall(r"vfmadd\w+\s+(.*)", asm)
    assert len(fmas) >= ROWS * GROUPS and all(ops.count("%zmm") == 3 for ops in fmas)
    assert len({ops.split(", ")[-1] for ops in fmas}) == ROWS * GROUPS == 24
    assert not any("rsp" in ops for ops in fmas)
