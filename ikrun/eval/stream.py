"""Evaluation of many chunks within a memory budget: chunk by chunk, or layer-streamed.

Chunk by chunk (the model's decoded weights fit the budget): every chunk runs the whole forward in turn, the
decoded weights stay cached. Layer-streamed (`--stream`, or automatically when they do not fit, and for one-pass
commands over several chunks, where it is never slower): all chunks go through block 0, then all through block 1,
..., so each block's weights are decoded once per pass and released before the next block's are read. The hidden
states between blocks live in memory when they fit, else in a spill file (positioned reads and writes, so its pages
sit in the page cache, not in the process) that is removed at the end, on Ctrl-C and on SIGTERM alike.

Both orders compute every chunk with the same operations on the same rows, so their logits are bit-identical.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ikquant.errors import OutputError
from ikquant.outputs import scratch_folder, write_errors
from ikquant.sizes import format_size
from ikrun.errors import BudgetError, EvalError
from ikrun.memory import free_disk
from ikrun.model import Model, fed_batch
from ikrun.models.base import Sequence
from ikrun.numerics.exact import TILE_BYTES

#: reports (done, total, bytes of weights decoded so far) after each streamed block
BlockProgress = Callable[[int, int, int], None]
#: share of the budget that streamed hidden states may take before they are spilled to disk
HIDDEN_SHARE = 0.25
#: transient memory of a block, in activations of its widest matrix per token (q/k/v/ffn intermediates)
TRANSIENT_ROWS = 8


@dataclass
class StreamPlan:
    """How a run over `n_chunk` chunks of `n_ctx` tokens is evaluated within the model's budget."""

    streamed: bool
    n_chunk: int
    n_ctx: int
    #: chunks that go through a block together (MoE experts are decoded once per group)
    group: int
    spill_dir: Path | None
    hidden_bytes: int
    cache_capacity: int | None
    #: tokens fed at a time through a chunk's key/value cache (ik's micro-batches); None: each chunk whole
    batch: int | None = None

    def describe(self) -> str:
        if not self.streamed:
            return f"chunk by chunk{f' in batches of {self.batch} tokens' if self.batch else ''}, weights cached"
        where = f"spilled to {self.spill_dir}" if self.spill_dir else "in memory"
        return (f"layer-streamed, {self.group} of {self.n_chunk} chunks per pass, hidden states "
                f"{format_size(self.hidden_bytes)} {where}")


def model_decoded_bytes(model: Model) -> int:
    return sum(model.weights.decoded_bytes(n) for n in model.weights.names())


def _block_bytes(model: Model, i: int) -> tuple[int, int]:
    """(decoded bytes of block i's non-expert tensors, of one expert's matrices)."""
    dense = expert = 0
    for name in model.impl.block_tensors(i):
        info = model.weights.info(name)
        if len(info.shape) == 3:
            expert += 4 * info.shape[1] * info.shape[2]
        else:
            dense += model.weights.decoded_bytes(name)
    return dense, expert


def _widest(model: Model) -> int:
    return max((max(model.weights.info(n).shape) for n in model.impl.block_tensors(0)
                if len(model.weights.info(n).shape) >= 2), default=1)


@dataclass(frozen=True)
class _Needs:
    """What evaluating chunks of n_ctx tokens needs, in bytes."""

    block: int  # the largest block's decoded weights (experts: one expert's matrices)
    head: int  # the globals (embedding rows, output head tiles)
    transient: int  # one chunk's working memory inside a block and its logits
    per_chunk: int  # one chunk's hidden state and per-sequence state between blocks

    @property
    def minimum(self) -> int:
        return self.block + self.head + self.transient + self.per_chunk


def _needs(model: Model, n_ctx: int) -> _Needs:
    impl = model.impl
    blocks = [_block_bytes(model, i) for i in range(impl.n_active)]
    globals_ = sum(model.weights.decoded_bytes(n) for n in model.weights.names() if not n.startswith("blk."))
    return _Needs(max((d + e for d, e in blocks), default=0), min(globals_, 2 * TILE_BYTES),
                  4 * n_ctx * (TRANSIENT_ROWS * _widest(model) + model.n_vocab),
                  4 * n_ctx * impl.hidden_width() + impl.sequence_state_bytes(n_ctx))


def minimum_budget(model: Model, n_ctx: int) -> int:
    """The smallest --mem a streamed run over chunks of n_ctx tokens accepts."""
    return _needs(model, n_ctx).minimum


def plan_run(model: Model, n_chunk: int, n_ctx: int, one_pass: bool, spill_dir: Path | None = None,
             batch: int | None = None) -> StreamPlan:
    """Decide the evaluation order and check the budget can hold it (a BudgetError says the minimum if not);
    `batch` < n_ctx: each chunk fed that many tokens at a time through its cache, chunk by chunk."""
    needs = _needs(model, n_ctx)
    budget = model.mem
    fits = budget is None or model_decoded_bytes(model) + needs.transient + needs.per_chunk <= budget
    streamed = model.stream if model.stream is not None else (one_pass and n_chunk > 1) or not fits
    batch = fed_batch(n_ctx, batch)
    if batch is not None:
        if not model.impl.continues:
            raise EvalError(f"--batch {batch}: {model.arch} runs each chunk whole here (its forward keeps no cache "
                            f"a batch could continue through); give --batch {n_ctx} or leave it out")
        if model.stream:
            raise EvalError(f"--batch {batch} feeds each chunk through its cache in turn, chunk by chunk: not with "
                            "--stream")
        streamed = False
    if budget is not None and budget < needs.minimum:
        raise BudgetError(f"--mem {format_size(budget)} is below what one block needs: its weights decoded "
                          f"({format_size(needs.block)}), one chunk's hidden state and working memory "
                          f"({format_size(needs.transient + needs.per_chunk)}) and the head "
                          f"({format_size(needs.head)}); give at least {format_size(needs.minimum)}")
    if not streamed:
        capacity = None if budget is None else budget - needs.transient - needs.per_chunk
        return StreamPlan(False, n_chunk, n_ctx, 1, None, needs.per_chunk, capacity, batch)
    total = needs.per_chunk * n_chunk
    if budget is None:
        return StreamPlan(True, n_chunk, n_ctx, n_chunk, None, total, None)
    room = budget - needs.minimum
    in_memory = total - needs.per_chunk <= room * HIDDEN_SHARE
    spare = room - (total - needs.per_chunk if in_memory else 0)
    batched = model.impl.batched_bytes(n_ctx)
    cost = batched + (0 if in_memory else needs.per_chunk)  # of one more chunk in a block's batch
    group = n_chunk if cost == 0 else max(1, min(n_chunk, 1 + int(spare * HIDDEN_SHARE // cost)))
    spill = None
    if not in_memory:
        spill = Path(spill_dir or tempfile.gettempdir())
        need_disk = 4 * n_ctx * model.impl.hidden_width() * n_chunk
        if free_disk(spill) < need_disk:
            raise BudgetError(f"--spill-dir {spill}: the hidden states of {n_chunk} chunks need "
                              f"{format_size(need_disk)} on disk, {format_size(free_disk(spill))} are free")
    held = total if in_memory else needs.per_chunk * group
    capacity = budget - held - batched * group - needs.transient - needs.head
    return StreamPlan(True, n_chunk, n_ctx, group, spill, held, capacity)


class _Hidden:
    """The hidden states of every chunk between blocks: arrays in memory, or records of a spill file, each of
    `shape` or fewer rows (the last block's output rows)."""

    def __init__(self, n_chunk: int, shape: tuple[int, ...], spill_dir: Path | None):
        self.shape = shape
        self.record = 4 * int(np.prod(shape))
        self.arrays: list[np.ndarray | None] = [None] * n_chunk
        self.rows = [shape[0]] * n_chunk
        self.fd: int | None = None
        self.path: Path | None = None
        self._scratch = ExitStack()
        if spill_dir is not None:
            # in a scratch folder of its own: a run killed by SIGKILL leaves it for the next run to remove
            folder = self._scratch.enter_context(scratch_folder("spill", spill_dir))
            self.path = folder / "hidden.f32"
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)

    def put(self, c: int, x: np.ndarray) -> None:
        if self.fd is None:
            self.arrays[c] = x
            return
        assert self.path is not None and x.shape[1:] == self.shape[1:] and len(x) <= self.shape[0]
        data = np.ascontiguousarray(x, dtype=np.float32).data.cast("B")
        with write_errors(self.path):
            written = os.pwrite(self.fd, data, c * self.record)
        if written != len(data):
            raise OutputError(f"{self.path}: no space left on the device for the spilled hidden states (wrote "
                              f"{written} of {len(data)} bytes)")
        self.rows[c] = len(x)

    def get(self, c: int) -> np.ndarray:
        if self.fd is None:
            x = self.arrays[c]
            assert x is not None
            return x
        out = np.empty((self.rows[c], *self.shape[1:]), dtype=np.float32)
        got = os.preadv(self.fd, [out.data.cast("B")], c * self.record)
        if got != out.nbytes:
            raise OSError(f"{self.path}: short read of a hidden state ({got} of {out.nbytes} bytes)")
        return out

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._scratch.close()


def fed_tokens(model: Model, chunk: np.ndarray) -> np.ndarray:
    """The tokens a chunk is evaluated on: its first swapped for BOS when the vocabulary adds one (as
    llama-perplexity does)."""
    add_bos, bos = model.tokenizer_flags()
    fed = np.array(chunk, dtype=np.int64)
    if add_bos and bos is not None:
        fed[0] = bos
    return fed


class BlockInputs:
    """What enters every main block for every chunk of a base run: the hidden state and the sequence's state.

    A sweep candidate that changes a tensor of block L resumes every chunk at block L from here instead of
    recomputing blocks 0..L-1, which the change cannot affect (bit-identical rows, far less compute). The hidden
    states stay in memory within a quarter of the budget, else go to a spill file removed by `close`.

    A run fed in batches (`batch` < the chunk's length, ik's micro-batches) records each batch's inputs, its state
    without the key/value cache: a resumed chunk runs its batches in turn from block L through a cache of its own,
    which so holds the candidate's keys and values of blocks L.. (those of the earlier blocks it never reads).
    """

    def __init__(self, model: Model, chunks: np.ndarray, spill_dir: Path | None = None, batch: int | None = None):
        impl = model.impl
        n_chunk, n_ctx = chunks.shape
        self.impl, self.ctx = impl, model.ctx
        self.n_block = impl.n_active
        step = fed_batch(n_ctx, batch) or n_ctx
        #: the first position and length of each batch a chunk is fed in (one: the chunk whole)
        self.batches = [(s, min(n_ctx, s + step) - s) for s in range(0, n_ctx, step)]
        self.batched = len(self.batches) > 1
        per = 4 * n_ctx * impl.hidden_width() * (self.n_block + 1) * n_chunk
        spill = model.mem is not None and per > model.mem * HIDDEN_SHARE
        spill_path = Path(spill_dir or tempfile.gettempdir()) if spill else None
        if spill_path is not None and free_disk(spill_path) < per:
            raise BudgetError(f"--spill-dir {spill_path}: the block inputs of {n_chunk} chunks need "
                              f"{format_size(per)} on disk, {format_size(free_disk(spill_path))} are free")
        self.tokens = [fed_tokens(model, chunks[c]) for c in range(n_chunk)]
        #: what the recorded inputs hold in memory (the rest of the budget is the evaluations')
        self.resident_bytes = 0 if spill else per
        #: per chunk, per batch, per block: the state it enters with
        self.states: list[list[list[dict]]] = []
        # one store per batch length (a chunk's last batch may be shorter), each record at slot (chunk, its batch
        # among those of that length, block)
        lengths = [n for _, n in self.batches]
        self._slot = [(n, lengths[:k].count(n), lengths.count(n)) for k, n in enumerate(lengths)]
        self._hidden: dict[int, _Hidden] = {}
        try:
            with model.blas_limit():
                for c in range(n_chunk):
                    kv: dict = {}
                    self.states.append([self._record(c, k, kv, n_chunk, spill_path) for k in range(len(self.batches))])
        except BaseException:
            self.close()
            raise
        finally:
            model.ctx.batch_start = 0

    def _sequence(self, c: int, k: int, state: dict) -> Sequence:
        start, n = self.batches[k]
        return Sequence(self.tokens[c][start : start + n], c, state, start, -start)

    def _record(self, c: int, k: int, kv: dict, n_chunk: int, spill_path: Path | None) -> list[dict]:
        """Batch k of chunk c through every block, its input to each recorded; the states it entered with."""
        impl = self.impl
        seq = self._sequence(c, k, {"kv": kv} if self.batched else {})
        self.ctx.chunk, self.ctx.batch_start = c, seq.start
        impl.begin(seq)
        x = impl.embed(seq)
        length, _, count = self._slot[k]
        if length not in self._hidden:
            self._hidden[length] = _Hidden(n_chunk * count * (self.n_block + 1), x.shape, spill_path)
        states = []
        for i in range(self.n_block + 1):
            self._hidden[length].put(self._record_index(c, k, i), x)
            # values are replaced by later blocks, never changed; the cache is the resumed run's own
            states.append({key: v for key, v in seq.state.items() if key != "kv"})
            if i < self.n_block:
                x = impl.block(i, [x], [seq])[0]
        return states

    def _record_index(self, c: int, k: int, block: int) -> int:
        _, j, count = self._slot[k]
        return (c * count + j) * (self.n_block + 1) + block

    def at(self, c: int, block: int) -> tuple[Sequence, np.ndarray]:
        """Chunk c as it enters `block` (n_block: the head); a chunk fed whole."""
        assert not self.batched, "a run fed in batches resumes through logits_from"
        return self._entering(c, 0, block, {})

    def _entering(self, c: int, k: int, block: int, kv: dict) -> tuple[Sequence, np.ndarray]:
        state = dict(self.states[c][k][block]) | ({"kv": kv} if self.batched else {})
        return self._sequence(c, k, state), self._hidden[self._slot[k][0]].get(self._record_index(c, k, block))

    def logits_from(self, c: int, block: int) -> np.ndarray:
        """Chunk c's logits, every batch run from `block` on in turn (n_block: only the head)."""
        kv: dict = {}
        out = []
        try:
            for k in range(len(self.batches)):
                seq, x = self._entering(c, k, block, kv)
                self.ctx.batch_start = seq.start
                out.append(self.impl.run_from(block, x, seq))
        finally:
            self.ctx.batch_start = 0
        return out[0] if len(out) == 1 else np.concatenate(out)

    def close(self) -> None:
        for hidden in self._hidden.values():
            hidden.close()


def evaluate_chunks(model: Model, chunks: np.ndarray, plan: StreamPlan, on_block: BlockProgress | None = None,
                    as_perplexity: bool = True, resume: tuple[BlockInputs, int] | None = None,
                    start: int = 0, every_row: bool = False) -> Iterator[tuple[int, np.ndarray]]:
    """(chunk index, logits) for every chunk from `start` on, in order, evaluated as `plan` says: as
    llama-perplexity (BOS swapped in, the scored positions' logits), or with `as_perplexity=False` each chunk as
    given, all its logits. ik's perplexity run asks for the logits of the second half of a chunk, its KL-divergence
    and imatrix runs for every row (`every_row`), which its last block's kernel choices see (Sequence.outputs).

    `resume=(inputs, L)` starts every chunk at block L from the base run's recorded inputs (chunks as perplexity).
    """
    n_ctx = chunks.shape[1]
    first, last = (n_ctx // 2, n_ctx - 1) if as_perplexity else (0, n_ctx)
    outputs = 0 if every_row else first
    feed = (lambda c: fed_tokens(model, chunks[c])) if as_perplexity else (lambda c: np.asarray(chunks[c], np.int64))
    saved_capacity = model.weights.capacity
    model.weights.capacity = plan.cache_capacity
    try:
        with model.blas_limit():
            ids = range(start, len(chunks))
            if not plan.streamed:
                for c in ids:
                    if resume is None:
                        logits = model.logits(feed(c), index=c, outputs=outputs, batch=plan.batch)
                        yield c, logits[first - outputs : last - outputs]
                    else:
                        yield c, resume[0].logits_from(c, resume[1])[first:last]
                return
            yield from _streamed(model, {c: feed(c) for c in ids}, plan, (first, last), outputs, on_block, resume)
    finally:
        model.weights.capacity = saved_capacity


def _streamed(model: Model, fed: dict[int, np.ndarray], plan: StreamPlan, window: tuple[int, int], outputs: int,
              on_block: BlockProgress | None, resume: tuple[BlockInputs, int] | None) -> Iterator[tuple[int, np.ndarray]]:
    """`fed`: the tokens of each chunk to evaluate, by chunk index (hidden states are held by position);
    `outputs`: the first row whose logits ik is asked for (Sequence.outputs)."""
    impl, weights = model.impl, model.weights
    n_chunk = len(fed)
    seqs: list[Sequence] = []
    hidden: _Hidden | None = None
    read0 = sum(weights.reads.values())
    model.weights.streaming = True
    model.weights.regrouped = plan.group < n_chunk
    try:
        for k, (c, tokens) in enumerate(fed.items()):
            model.ctx.chunk = c
            if resume is None:
                seq = Sequence(tokens, c, outputs=outputs)
                model.check_tokens(seq.tokens)
                impl.begin(seq)
                x = impl.embed(seq)
            else:
                seq, x = resume[0].at(c, resume[1])
            seqs.append(seq)
            if hidden is None:
                hidden = _Hidden(n_chunk, x.shape, plan.spill_dir)
            hidden.put(k, x)
        assert hidden is not None
        weights.evict([n for n in weights.names() if n.startswith("token_embd.")])
        for i in range(resume[1] if resume is not None else 0, impl.n_active):
            for g0 in range(0, n_chunk, plan.group):
                group = range(g0, min(n_chunk, g0 + plan.group))
                outs = impl.block(i, [hidden.get(c) for c in group], [seqs[c] for c in group])
                for c, x in zip(group, outs):
                    hidden.put(c, x)
            weights.evict(impl.block_tensors(i))
            if on_block is not None:
                on_block(i + 1, impl.n_active, sum(weights.reads.values()) - read0)
        for k, seq in enumerate(seqs):
            model.ctx.chunk = seq.index
            logits = impl.head(hidden.get(k), seq)  # of the rows from seq.first_output on
            seq.state.clear()
            yield seq.index, logits[window[0] - seq.first_output : window[1] - seq.first_output]
    finally:
        model.weights.streaming = model.weights.regrouped = False
        if hidden is not None:
            hidden.close()


@dataclass
class RunReport:
    """What a command prints at its end: how the run went through memory."""

    plan: StreamPlan
    seconds: float
    peak_rss: int
    bytes_read: int

    def line(self) -> str:
        return (f"{self.plan.describe()}; {format_size(self.bytes_read)} of weights decoded, peak RSS "
                f"{format_size(self.peak_rss)}, {self.seconds:.2f} s")
