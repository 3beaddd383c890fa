"""Float32 matmuls of routed experts' tokens with a fixed summation order: the exact mode's expert kernel.

The exact runtime must give the same bits whatever the batching (chunk by chunk, layer-streamed, any grouping of
experts) and thread count, which BLAS does not promise. Here every output y[t, r] = sum_k w[r, k] x[t, k] is one
fused multiply-add chain over k in order, whoever computes it: 16 tokens share a vector (their lanes), each weight
value is broadcast to them, and a call keeps a register tile of accumulators (ROWS weight rows x GROUPS token
groups, sized to the host's vector registers), so the FMA units stay busy without summing across lanes. The
weights are read from the matrix itself: float32 as decoded, or the file's own f16 / bf16 bits, widened to float32
(exactly) a small panel at a time (ROWS rows x K_STEP values), so half-precision experts are never
decoded into a float32 copy; the quantized types of PANEL_TYPES are decoded the same way, a panel at a time from the
file's rows by their codec's own block decoder (the same floats as decoding the whole matrix, which would write and
read back four bytes a value and fault in fresh pages for them). The tokens are transposed, 16 to a group (an
expert's odd last group takes a tile of one group: padding each expert to GROUPS groups multiplied 12.5% zero
rows in a 1,024-token batch of 64 experts, 8 used; to one, 5.5%). One call
takes all experts of a layer that receive tokens (a few dozen tokens each in a MoE's batch): the threads share
their (expert, row tiles) tasks, where a call per expert would pay Python's and the thread pool's start for each.
A task multiplies its row tiles by a block of 256 tokens at a time, every tile against the block's panel of the
tokens in turn, so that panel is read from the second-level cache; a task of one tile over all of an expert's
tokens read them all again for every tile, from memory once they outgrew the last-level cache (a dense
2,048 x 6,144 F16 matrix times 1,024 tokens, 2 threads of a Zen 3: 48-54 -> 111-119 GFLOP/s).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic, overload

from ikquant.cpu import host_has
from ikquant.formats.iqk_ks import iq4_ks_block, iq5_ks_block
from ikquant.formats.jit import read_only
from ikquant.formats.kquants import q4_k_block, q5_k_block, q6_k_block
from ikquant.formats.mxfp4 import mxfp4_values
from ikquant.formats.numeric import widen_16
from ikrun.ops.parallel import TASKS_PER_THREAD, claim_items, run_claimed, task_items
from ikrun.ops.simd import splat

LANES = 16  # tokens per vector
#: weight rows and token groups per call. AVX2 has 16 vector registers of 8 floats: 6 x 1 keeps 12 accumulators,
#: the group's two token vectors and the broadcast weight in registers (4 x 2 spilled accumulators to the stack
#: every step: f16 experts 38 -> 60 GFLOP/s per core of an EPYC); 12 x 2 elsewhere (AVX-512's 32 registers: 24
#: accumulators; 8 experts of 768 x 2048 f16, 200 tokens each, 2 threads: 4 x 2 121.5 GFLOP/s, 8 x 2 146.9, 12 x 2
#: 152.7-160.0, 14 x 2 166-168 with 31 registers taken)
AVX2_TILE = host_has("avx2") and host_has("fma") and not host_has("avx512f")
ROWS, GROUPS = (6, 1) if AVX2_TILE else (12, 2)
K_STEP = 256  # values of a row per pass over the tokens (their panel stays in the first-level cache)
#: token groups multiplied together, and row tiles a task takes: BLOCK_GROUPS x K_STEP values of the tokens
#: (256 KiB) stay in the second-level cache for CHUNK_TILES row tiles in turn
BLOCK_GROUPS, CHUNK_TILES = 16, 16
#: quantized weight types the kernel decodes a panel at a time (blocks of K_STEP values), by their codes here
PANEL_TYPES = {"IQ4_KS": 1, "IQ5_KS": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5, "MXFP4": 6}
_I64, _F32 = ir.IntType(64), ir.FloatType()
_V16F = ir.VectorType(_F32, LANES)
_V16I = ir.VectorType(ir.IntType(32), LANES)


def _tile_of(n_groups: int):  # type: ignore[no-untyped-def]
    """The register tile over `n_groups` token groups (an intrinsic, below)."""

    def tile(typingctx, panel, xt, g0, k0, k1, n, out, r0, n_tok):  # type: ignore[no-untyped-def]
        sig = types.void(panel, xt, *[types.int64] * 4, out, types.int64, types.int64)
        return sig, lambda context, builder, signature, args: _tile_code(context, builder, signature, args, n_groups)

    return intrinsic(tile)


def _tile_code(context, builder, signature, args, n_groups):  # type: ignore[no-untyped-def]
    """out[r, 16 g : 16 g + 16] += sum_{k0 <= k < k1} w[r, k] xt[g, k, :] for rows r0 .. r0 + ROWS - 1 and token
    groups g0 .. g0 + n_groups - 1, k in order, one fused multiply-add at a time per lane; the weights come from
    `panel` (_panel: rows K_STEP apart, a constant, so each step's ROWS broadcasts are offsets of one pointer)."""
    w_p = context.make_array(signature.args[0])(context, builder, value=args[0]).data
    x_p = context.make_array(signature.args[1])(context, builder, value=args[1]).data
    o_p = context.make_array(signature.args[6])(context, builder, value=args[6]).data
    g0, k0, k1, n = args[2], args[3], args[4], args[5]
    r0, n_tok = args[7], args[8]
    const = lambda v: ir.Constant(_I64, v)  # noqa: E731
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
    rows = [builder.add(r0, const(i)) for i in range(ROWS)]
    groups = [builder.add(g0, const(h)) for h in range(n_groups)]
    outs = {(i, h): builder.bitcast(builder.gep(o_p, [builder.add(builder.mul(rows[i], n_tok), builder.mul(
        groups[h], const(LANES)))]), _V16F.as_pointer()) for i in range(ROWS) for h in range(n_groups)}
    accs = {key: cgutils.alloca_once_value(builder, builder.load(o, align=4)) for key, o in outs.items()}
    x_at = [builder.gep(x_p, [builder.mul(builder.add(builder.mul(g, n), k0), const(LANES))]) for g in groups]
    with cgutils.for_range(builder, builder.sub(k1, k0)) as loop:
        step = builder.mul(loop.index, const(LANES))
        xs = [builder.load(builder.bitcast(builder.gep(x, [step]), _V16F.as_pointer()), align=4) for x in x_at]
        for i in range(ROWS):
            wv = builder.load(builder.gep(w_p, [builder.add(loop.index, const(i * K_STEP))]))
            broadcast = splat(builder, wv)
            for h in range(n_groups):
                builder.store(builder.call(fma, [broadcast, xs[h], builder.load(accs[(i, h)])]), accs[(i, h)])
    for key, o in outs.items():
        builder.store(builder.load(accs[key]), o, align=4)
    return context.get_dummy_value()


#: ROWS x GROUPS token groups, and ROWS x 1 for an expert's odd last group
_tile = _tile_of(GROUPS)
_tile_one = _tile_of(1)


@njit(cache=True, nogil=True, inline="always")
def tile_groups(panel, xt, count, k0, k1, n, out, n_tok):  # type: ignore[no-untyped-def]
    """out[r, :16 count] += the panel's ROWS rows (values k0 .. k1 of a row) times token groups 0 .. count - 1 of xt
    ([groups, n, 16], flat), each output's FMA chain continued in k order: GROUPS groups a register tile, an odd last
    group a tile of its own."""
    whole = count // GROUPS * GROUPS
    for g in range(0, whole, GROUPS):
        _tile(panel, xt, g, k0, k1, n, out, 0, n_tok)
    for g in range(whole, count):
        _tile_one(panel, xt, g, k0, k1, n, out, 0, n_tok)


def _value(w, at):  # type: ignore[no-untyped-def]
    """w[at] as float32: float32 as it is, f16 / bf16 bits widened (exactly)."""


@overload(_value, inline="always")
def _value_impl(w, at):  # type: ignore[no-untyped-def]
    if w.dtype == types.float32:
        return lambda w, at: w[at]
    return lambda w, at: widen_16(w[at])


#: the 16-bit expert types the kernel widens itself, as the dtype of their bits (bf16's int16: widen_16)
HALF_BITS = {"F16": np.uint16, "BF16": np.int16}


@dataclass(frozen=True)
class FileExperts:
    """Expert matrices as the file's rows of a PANEL_TYPES or HALF_BITS type: matrices `which` of raw [E, rows, row
    bytes] (uint8; None: all of them, in order), n values a row. Naming the matrices instead of taking them out of
    the file (raw[which], a copy of every matrix not in one consecutive run) leaves the kernels to read the mapped
    file's rows where they lie."""

    raw: np.ndarray
    type_name: str
    n: int
    which: np.ndarray | None = None

    @property
    def ids(self) -> np.ndarray:
        """The matrices of raw, in order (int64)."""
        return np.arange(self.raw.shape[0], dtype=np.int64) if self.which is None else \
            np.ascontiguousarray(self.which, dtype=np.int64)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.raw.shape[0] if self.which is None else len(self.which)), self.raw.shape[1], self.n

    @property
    def nbytes(self) -> int:
        return int(self.raw[0].nbytes) * self.shape[0] if self.raw.shape[0] else 0


@njit(cache=True, nogil=True, inline="always")
def _decode_block(kind, row, k0, k1, panel, at):  # type: ignore[no-untyped-def]
    """Values k0 .. k1 - 1 of a quantized row, its type's PANEL_TYPES code `kind`, into panel[at:]: a K_STEP
    block (k0 a multiple of it) of the 256-value types, whose rows are whole blocks; MXFP4's 32-value blocks in
    between (its rows' last panel may be shorter)."""
    if kind == 1:
        iq4_ks_block(row, k0 // K_STEP, panel, at)
    elif kind == 2:
        iq5_ks_block(row, k0 // K_STEP, panel, at)
    elif kind == 3:
        q4_k_block(row, k0 // K_STEP, panel, at)
    elif kind == 4:
        q5_k_block(row, k0 // K_STEP, panel, at)
    elif kind == 5:
        q6_k_block(row, k0 // K_STEP, panel, at)
    else:
        mxfp4_values(row, k0, k1, panel, at)


def _panel(w, kind, row_len, r0, n_rows, k0, k1, panel):  # type: ignore[no-untyped-def]
    """Rows r0 .. r0 + ROWS - 1 (zeros past the matrix's n_rows), values k0 .. k1 of w (rows of `row_len`
    elements) as float32 in `panel` [ROWS, K_STEP]: a vector copy, vcvtph2ps / shifts for 16-bit weights, or the
    quantized rows' values k0 .. k1 - 1 decoded (uint8 rows of the PANEL_TYPES type `kind`)."""


@overload(_panel, inline="always")
def _panel_impl(w, kind, row_len, r0, n_rows, k0, k1, panel):  # type: ignore[no-untyped-def]
    if w.dtype == types.uint8:
        def decoded(w, kind, row_len, r0, n_rows, k0, k1, panel):  # type: ignore[no-untyped-def]
            for i in range(ROWS):
                if r0 + i < n_rows:
                    _decode_block(kind, w[(r0 + i) * row_len : (r0 + i + 1) * row_len], k0, k1, panel, i * K_STEP)
                else:
                    panel[i * K_STEP : i * K_STEP + k1 - k0] = 0
        return decoded

    def values(w, kind, row_len, r0, n_rows, k0, k1, panel):  # type: ignore[no-untyped-def]
        for i in range(ROWS):
            if r0 + i < n_rows:
                # slices indexed by the bare loop counter: an index like `at + j` keeps Numba's negative-index
                # test in the loop, which kept LLVM from vectorising it (a value at a time)
                src = w[(r0 + i) * row_len + k0 : (r0 + i) * row_len + k1]
                dst = panel[i * K_STEP : i * K_STEP + k1 - k0]
                for j in range(k1 - k0):
                    dst[j] = _value(src, j)
            else:
                panel[i * K_STEP : i * K_STEP + k1 - k0] = 0
    return values


@njit(cache=True, nogil=True, inline="always")
def _chunk_tiles(n_experts, n_rows, threads):  # type: ignore[no-untyped-def]
    """Row tiles a task takes: CHUNK_TILES, fewer where that would leave a thread under TASKS_PER_THREAD tasks
    (a 1,024-row matrix makes 11 tasks of 16 AVX2 tiles: one thread would wait for the other's last)."""
    tiles = -(-n_rows // ROWS)
    return max(1, min(CHUNK_TILES, n_experts * tiles // (threads * TASKS_PER_THREAD)))


@njit(cache=True, nogil=True, inline="always")
def _tasks(n_experts, n_rows, chunk):  # type: ignore[no-untyped-def]
    """The tasks of a call: each expert's row tiles, `chunk` to a task."""
    tiles = -(-n_rows // ROWS)
    return n_experts * -(-tiles // chunk)


@njit(cache=True, nogil=True, inline="always")
def _task(w, which, kind, row_len, xt, group_at, row_at, out, dest, task, n_rows, n,  # type: ignore[no-untyped-def]
          chunk):
    """One task of a call: weight rows of `chunk` row tiles of expert j (task = j x chunks + c; w's matrix
    which[j]) against that expert's tokens, a block of token groups at a time: for each K_STEP panel in order,
    every row tile's panel against the block's groups (the block's panel of tokens stays in the second-level cache
    across the tiles), into a zeroed accumulator block, then copied to the block's tokens' output rows (result i to
    out[dest[i]])."""
    tiles = -(-n_rows // ROWS)
    chunks = -(-tiles // chunk)
    j, c = task // chunks, task % chunks
    t0 = c * chunk
    t1 = min(tiles, t0 + chunk)
    wj = w[which[j] * n_rows * row_len : (which[j] + 1) * n_rows * row_len]
    acc = np.empty((t1 - t0) * ROWS * BLOCK_GROUPS * LANES, np.float32)
    panel = np.empty(ROWS * K_STEP, np.float32)
    for b0 in range(group_at[j], group_at[j + 1], BLOCK_GROUPS):
        count = min(BLOCK_GROUPS, group_at[j + 1] - b0)
        n_tok = count * LANES
        xb = xt[b0 * n * LANES : (b0 + count) * n * LANES]
        block = acc[: (t1 - t0) * ROWS * n_tok]
        block[:] = 0
        for k0 in range(0, n, K_STEP):
            k1 = min(n, k0 + K_STEP)
            for t in range(t0, t1):
                _panel(wj, kind, row_len, t * ROWS, n_rows, k0, k1, panel)
                tile_groups(panel, xb, count, k0, k1, n, block[(t - t0) * ROWS * n_tok :], n_tok)
        first = row_at[j] + (b0 - group_at[j]) * LANES
        width = min(t1 * ROWS, n_rows) - t0 * ROWS
        for m in range(min(n_tok, row_at[j + 1] - first)):
            dst = out[dest[first + m]][t0 * ROWS : t0 * ROWS + width]
            for r in range(width):
                dst[r] = block[r * n_tok + m]


@njit(cache=True, nogil=True, parallel=True)
def _experts_parallel(w, which, kind, row_len, xt, group_at, row_at, out, dest, n_rows,  # type: ignore[no-untyped-def]
                      n, threads):
    """Every (expert, row tiles) task, claimed by the threads (ikrun/ops/parallel.py)."""
    chunk = _chunk_tiles(len(group_at) - 1, n_rows, threads)
    tasks = _tasks(len(group_at) - 1, n_rows, chunk)
    per, counter = task_items(tasks, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        t0, t1 = claim_items(counter, per, tasks)
        while t0 < t1:
            for task in range(t0, t1):
                _task(w, which, kind, row_len, xt, group_at, row_at, out, dest, task, n_rows, n, chunk)
            t0, t1 = claim_items(counter, per, tasks)


@njit(cache=True, nogil=True)
def _experts_serial(w, which, kind, row_len, xt, group_at, row_at, out, dest, n_rows,  # type: ignore[no-untyped-def]
                    n):
    for task in range(_tasks(len(group_at) - 1, n_rows, CHUNK_TILES)):
        _task(w, which, kind, row_len, xt, group_at, row_at, out, dest, task, n_rows, n, CHUNK_TILES)


@intrinsic
def _transpose_block(typingctx, x, lanes, k0, xt, g):  # type: ignore[no-untyped-def]
    """xt[g, k0 + i, l] = x[lanes[l], k0 + i] for i, l < 16 (x C-contiguous [m, n], xt [groups, n, 16]): 16 row
    vectors loaded, transposed in registers (four rounds of two-vector shuffles, each swapping the off-diagonal
    blocks of 8, 4, 2, then 1), stored as 16 vectors. A copy: the same values as moving them one at a time, which
    took a scalar load and store a value (8-9 GB/s on 1,024 x 2,048 rows, where a copy runs at 26-59)."""
    sig = types.void(x, lanes, types.int64, xt, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        x_arr = context.make_array(signature.args[0])(context, builder, value=args[0])
        l_arr = context.make_array(signature.args[1])(context, builder, value=args[1])
        t_arr = context.make_array(signature.args[3])(context, builder, value=args[3])
        k0, g = args[2], args[4]
        n = cgutils.unpack_tuple(builder, x_arr.shape, 2)[1]
        const = lambda v: ir.Constant(_I64, v)  # noqa: E731
        rows = []
        for lane in range(LANES):
            token = builder.load(builder.gep(l_arr.data, [const(lane)]))
            at = builder.gep(x_arr.data, [builder.add(builder.mul(token, n), k0)])
            rows.append(builder.load(builder.bitcast(at, _V16F.as_pointer()), align=4))
        half = LANES // 2
        while half:
            low = ir.Constant(_V16I, [c if not c & half else LANES + c - half for c in range(LANES)])
            high = ir.Constant(_V16I, [c + half if not c & half else LANES + c for c in range(LANES)])
            for r in range(LANES):
                if not r & half:
                    pair = rows[r], rows[r + half]
                    rows[r], rows[r + half] = builder.shuffle_vector(*pair, low), builder.shuffle_vector(*pair, high)
            half //= 2
        base = builder.mul(builder.add(builder.mul(g, n), k0), const(LANES))
        for i in range(LANES):
            at = builder.gep(t_arr.data, [builder.add(base, const(i * LANES))])
            builder.store(rows[i], builder.bitcast(at, _V16F.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def _gather_group(x, tokens, row_at, group_at, j, g, xt, lanes):  # type: ignore[no-untyped-def]
    """xt[g, :, l] = x[tokens[row_at[j] + 16 (g - group_at[j]) + l]], zeros beyond expert j's last token: the
    group's 16 rows read side by side, so its transposed block is written in order (token by token, each of its
    cache lines was written 16 times, from the second-level cache once a row outgrew the first); a whole group
    16 values of its rows at a time, transposed in registers (_transpose_block), up to its rows' last n % 16."""
    count = row_at[j + 1] - row_at[j]
    first = (g - group_at[j]) * LANES
    for lane in range(LANES):
        lanes[lane] = tokens[row_at[j] + first + lane] if first + lane < count else -1
    done = x.shape[1] // LANES * LANES if first + LANES <= count else 0
    for k0 in range(0, done, LANES):
        _transpose_block(x, lanes, k0, xt, g)
    for k in range(done, x.shape[1]):
        for lane in range(LANES):
            xt[g, k, lane] = x[lanes[lane], k] if lanes[lane] >= 0 else np.float32(0.0)


@njit(cache=True, nogil=True)
def _gather_serial(x, tokens, row_at, group_at, owner, xt):  # type: ignore[no-untyped-def]
    lanes = np.empty(LANES, np.int64)
    for g in range(len(owner)):
        _gather_group(x, tokens, row_at, group_at, owner[g], g, xt, lanes)


@njit(cache=True, nogil=True, parallel=True)
def _gather_parallel(x, tokens, row_at, group_at, owner, xt, threads):  # type: ignore[no-untyped-def]
    """The groups (owner[g]: group g's expert) in tasks the threads claim (ikrun/ops/parallel.py)."""
    groups = len(owner)
    per, counter = task_items(groups, threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        lanes = np.empty(LANES, np.int64)
        g0, g1 = claim_items(counter, per, groups)
        while g0 < g1:
            for g in range(g0, g1):
                _gather_group(x, tokens, row_at, group_at, owner[g], g, xt, lanes)
            g0, g1 = claim_items(counter, per, groups)


#: the largest gathered token block (bytes) a thread keeps for its next call (_scratch)
SCRATCH_BYTES = 64 << 20
_scratch = threading.local()


def _gather_buffer(shape: tuple[int, int, int]) -> np.ndarray:
    """An uninitialised float32 array of `shape` for token_groups, valid until this thread's next call: up to
    SCRATCH_BYTES the thread's kept buffer (a fresh array is zeroed page by page by the kernel as it is first
    written: 6.5 of the 10 ms of gathering 8192 rows of 1024 floats), larger ones fresh."""
    size = shape[0] * shape[1] * shape[2]
    if 4 * size > SCRATCH_BYTES:
        return np.empty(shape, np.float32)
    kept = getattr(_scratch, "buffer", None)
    if kept is None or kept.size < size:
        kept = _scratch.buffer = np.empty(max(size, 1 << 16), np.float32)
    return kept[:size].reshape(shape)


def token_groups(x: np.ndarray, tokens: np.ndarray, row_at: np.ndarray,
                 owned: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The rows `tokens` of x [m, n] as the kernel takes them, expert j's being tokens[row_at[j] : row_at[j + 1]]:
    [groups, n, 16], each expert's padded with zero rows to whole groups of 16, gathered and transposed in one pass
    (in this thread's kept buffer up to SCRATCH_BYTES: valid until its next call; `owned`: in an array of their
    own); and each expert's first group."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    per = -(-np.diff(row_at) // LANES)
    group_at = np.zeros(len(row_at), np.int64)
    np.cumsum(per, out=group_at[1:])
    shape = (int(group_at[-1]), x.shape[1], LANES)
    xt = np.empty(shape, np.float32) if owned else _gather_buffer(shape)
    owner = np.repeat(np.arange(len(row_at) - 1, dtype=np.int64), per)
    run_claimed(_gather_serial, _gather_parallel, xt.size, x, tokens, row_at, group_at, owner, xt)
    return xt, group_at


@dataclass(frozen=True)
class GatheredRows:
    """Every row of an input, in order, as the kernel takes them (token_groups, in an array of their own): one
    gather serves each weight multiplied by the same input (q/k/v, gate/up), where each product gathered it again."""

    xt: np.ndarray
    group_at: np.ndarray
    n_rows: int

    @classmethod
    def of(cls, x: np.ndarray) -> GatheredRows:
        xt, group_at = token_groups(x, np.arange(len(x), dtype=np.int64), np.array([0, len(x)], np.int64), True)
        return cls(xt, group_at, len(x))


#: weight dtypes the kernel reads: float32, f16 bits (uint16) and bf16 bits (int16), the latter widened exactly
WEIGHT_DTYPES = (np.float32, np.uint16, np.int16)


def experts_matmul(x: np.ndarray | GatheredRows, w: np.ndarray | FileExperts, tokens: np.ndarray, row_at: np.ndarray,
                   out: np.ndarray | None = None, dest: np.ndarray | None = None) -> np.ndarray:
    """Each expert's tokens times its matrix in one call: out[i] = x[tokens[i]] @ w[j]^T for row_at[j] <= i <
    row_at[j + 1], in float32, each output one FMA chain over n in order ([len(tokens), rows], C-contiguous). w [E,
    rows, n] is float32 (any other float dtype is converted), 16-bit patterns (uint16 for f16, int16 for bf16), or
    the file's rows of a PANEL_TYPES or HALF_BITS type (FileExperts), the latter widened / decoded exactly.
    The threads share the (expert, row tile) tasks of all experts, so a layer's small experts make one call.
    With `out` (C-contiguous float32 [m, rows]) and `dest` [len(tokens)], result i is written to out[dest[i]]
    instead (a MoE's outputs straight into their assignments' rows: no copy of the result scattered there). x may
    come gathered already (GatheredRows: all its rows, one matrix)."""
    n_rows, n = w.shape[1], w.shape[2]
    tokens, row_at = np.ascontiguousarray(tokens, dtype=np.int64), np.ascontiguousarray(row_at, dtype=np.int64)
    if isinstance(x, GatheredRows):
        if len(row_at) != 2 or not np.array_equal(tokens, np.arange(x.n_rows)):
            raise ValueError("gathered rows are every row of one input, in order, for one matrix")
        xt, group_at = x.xt, x.group_at
    else:
        xt, group_at = token_groups(x, tokens, row_at)
    if isinstance(w, FileExperts):
        raw, which = np.ascontiguousarray(w.raw), w.ids
        if w.type_name in HALF_BITS:
            flat, kind, row_len = raw.view(HALF_BITS[w.type_name]).reshape(-1), 0, n
        else:
            flat, kind, row_len = raw.reshape(-1), PANEL_TYPES[w.type_name], raw.shape[2]
    else:
        dtype = w.dtype.type if w.dtype.type in WEIGHT_DTYPES else np.float32
        flat, kind, row_len = np.ascontiguousarray(w, dtype=dtype).reshape(-1), 0, n
        which = np.arange(w.shape[0], dtype=np.int64)
    if out is None:
        out, dest = np.empty((len(tokens), n_rows), np.float32), np.arange(len(tokens), dtype=np.int64)
    elif dest is None or len(dest) != len(tokens) or out.shape[1] != n_rows or not out.flags.c_contiguous:
        raise ValueError("out must be a C-contiguous [m, rows] array and dest name a row of it for every token")
    run_claimed(_experts_serial, _experts_parallel, n_rows * n * xt.shape[0], read_only(flat), which, kind, row_len,
                xt.reshape(-1), group_at, row_at, out, np.ascontiguousarray(dest, dtype=np.int64), n_rows, n)
    return out


def expert_matmul(x: np.ndarray | GatheredRows, w: np.ndarray, tokens: np.ndarray | None = None) -> np.ndarray:
    """x [m, n] (or its rows `tokens`; or all of them gathered) @ w[rows, n]^T: experts_matmul of one expert."""
    m = x.n_rows if isinstance(x, GatheredRows) else x.shape[0]
    idx = np.arange(m, dtype=np.int64) if tokens is None else tokens
    return experts_matmul(x, w[None], idx, np.array([0, len(idx)], np.int64))
