"""The contract every runtime architecture implements, and the checks they share.

An architecture is a class that declares what it reads (`archs`: the GGUF architecture names it evaluates;
`runtime_options`: the RuntimeOptions fields it honours; `expected_tensors`: every tensor's numpy shape, checked
before any compute) and computes a forward in three steps over a `Sequence`:

- `embed(seq)`: the hidden state entering block 0 (any array shape: openPangu carries several streams);
- `block(i, xs, seqs)`: main block i for a batch of sequences, one hidden state each; the attention runs per
  sequence, token-wise parts may be shared across the batch (MoE experts decode each routed expert once per
  batch) as long as every sequence's result is bit-identical to running it alone; the last one passes on the
  sequence's output rows alone (`output_rows`, where ik's graph cuts them);
- `head(x, seq)`: logits from the hidden state after the last main block (the output rows).

Per-sequence state that a later block needs (rope tables, the indexer's last selection) lives in `seq.state`, so the
same sequence can go through block 0 now and block 1 later: that is how layer-streamed evaluation
(ikrun/eval/stream.py) runs all chunks through one block before reading the next block's weights. Tensors named
`blk.{i}.*` belong to block i; all others to embed/head.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, TypeVar

import numpy as np

from ikrun.errors import ModelError

if TYPE_CHECKING:
    from ikrun.context import Context
    from ikrun.modules.nextn import NextnHead

#: the hidden state after each main block, for tests that localise a mismatch
BlockHook = Callable[[int, np.ndarray], None]
Hparam = Callable[..., Any]
T = TypeVar("T")
_BLOCK = re.compile(r"blk\.(\d+)\.")


def block_of(name: str) -> int | None:
    """The block a tensor belongs to (`blk.7.attn_q.weight` -> 7), None for embeddings, output and the like."""
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


@dataclass
class Sequence:
    """One sequence under evaluation: its tokens at positions start..start+n-1, its index among the chunks of a
    run, and the state an architecture carries from one block to the next. `start` > 0 continues an earlier
    sequence whose keys and values the state holds (`state["kv"]`, for architectures with `continues`)."""

    tokens: np.ndarray
    index: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    start: int = 0
    #: the first row whose logits the caller reads (negative: every row is read): ik's graph runs what follows its
    #: last block's attention on those rows only (its llama-perplexity asks for the second half of a chunk), and so
    #: does ArchModel.output_rows
    outputs: int = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def first_output(self) -> int:
        """The first row the last block passes on: `outputs` within 0..len."""
        return min(max(self.outputs, 0), len(self.tokens))


class ArchModel(ABC):
    """One GGUF architecture's forward on a loaded model's Context (see the module docstring for the contract)."""

    archs: ClassVar[tuple[str, ...]]
    runtime_options: ClassVar[tuple[str, ...]] = ()
    #: vocabulary size and the number of main blocks the forward runs (NextN/MTP blocks excluded)
    n_vocab: int
    n_active: int
    n_embd: int

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._tables: dict[Any, Any] = {}

    def table(self, key: Any, make: Callable[[], Any]) -> Any:
        """A table every sequence of the same length shares (rope cos/sin): made once, not once per chunk."""
        if key not in self._tables:
            self._tables[key] = make()
        return self._tables[key]

    # ---- declarations ---------------------------------------------------------------------------------------
    def block_tensors(self, i: int) -> list[str]:
        """The tensors block i reads (those of the file named blk.i.*)."""
        prefix = f"blk.{i}."
        return [n for n in self.ctx.weights.names() if n.startswith(prefix)]

    def hidden_width(self) -> int:
        """Numbers per token of the hidden state between blocks."""
        return self.n_embd

    def batched_bytes(self, n_ctx: int) -> int:
        """Working memory one more sequence of n_ctx tokens adds to a block's batch (the parts run for the whole
        batch at once, like MoE experts); 0 when everything runs a sequence at a time."""
        moe = getattr(self, "moe", None)
        if moe is None:
            return 0
        return 4 * n_ctx * (2 * self.n_embd + moe.n_used * (moe.n_ff + self.n_embd + 2))

    def computed_paths(self, n_ctx: int) -> dict[str, str]:
        """Which of an engine's alternative computations a run of n_ctx-token chunks takes (named for its report,
        e.g. {"mla_path": "prefill"}); none by default."""
        return {}

    def unread_tensors(self, n_ctx: int, batches: tuple[int, ...] = ()) -> dict[str, str]:
        """The file's tensors a run of n_ctx-token chunks (fed in micro-batches of `batches` tokens; none: each chunk
        whole) never reads, each with why: a sweep cannot measure them (ikrun/sweep/measure.py); none by default."""
        return {}

    def check_context(self, n_ctx: int, batches: tuple[int, ...] = ()) -> None:  # noqa: B027 (a hook, optional)
        """Refuse, before any compute, a chunk length the run's options cannot take (a DSA top-k above it);
        `batches`: the sizes of the micro-batches a chunk is fed in (none: the chunk whole)."""

    def sequence_state_bytes(self, n_ctx: int) -> int:
        """Bytes of `seq.state` a sequence of n_ctx tokens carries between blocks (beyond shared tables)."""
        return 0

    def read_gqa_hparams(self) -> None:
        """The hyperparameters of a plain grouped-query attention stack (the llama family, DFlash drafts)."""
        hp = self.ctx.hparam
        self.n_layer = int(hp("block_count"))
        self.n_embd = int(hp("embedding_length"))
        self.n_head = int(hp("attention.head_count"))
        self.n_head_kv = int(hp("attention.head_count_kv", self.n_head))
        self.head_dim = int(hp("attention.key_length", self.n_embd // self.n_head))
        self.n_rot = int(hp("rope.dimension_count", self.head_dim))
        self.eps = float(hp("attention.layer_norm_rms_epsilon"))
        self.rope_base = float(hp("rope.freq_base", 10000.0))
        if self.n_head % self.n_head_kv:
            raise self.fail(f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")

    def norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """RMSNorm with the architecture's epsilon (`self.eps`)."""
        return self.ctx.numerics.norm(x, weight, self.eps)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> None:
        """Rope over the architecture's n_rot dims, in place."""
        self.ctx.numerics.rope(x, cos, sin, self.n_rot, neox)

    def fail(self, message: str) -> ModelError:
        """A ModelError about this file (raise it)."""
        return ModelError(f"{self.ctx.path}: {message}")

    def fail_hparam(self, key: str, why: str) -> NoReturn:
        """Raise a ModelError about the file's hyperparameter `{arch}.{key}`."""
        raise self.fail(f"{self.ctx.arch}.{key} {why}")

    def check_tensors(self, want: dict[str, tuple[int, ...]], optional: dict[str, tuple[int, ...]] | None = None,
                      hint: str = "") -> None:
        """Every tensor of `want` present with its shape; those of `optional` shape-checked where present."""
        cx = self.ctx
        missing = [n for n in want if not cx.has(n)]
        if missing:
            raise self.fail(f"{len(missing)} tensors missing for {cx.arch}: {', '.join(missing[:8])}"
                            + (" ..." if len(missing) > 8 else "") + hint)
        present = {n: s for n, s in (optional or {}).items() if cx.has(n)}
        for name, shape in {**want, **present}.items():
            if cx.shape(name) != shape:
                raise self.fail(f"tensor {name} has shape {list(cx.shape(name))}, the hyperparameters imply "
                                f"{list(shape)}")

    #: False for models that run only beside another (a DFlash draft beside its target)
    standalone: ClassVar[bool] = True
    #: whether a Sequence may continue an earlier one through a key/value cache (`Sequence.start`,
    #: `state["kv"]`): what speculative decoding's verification needs of a target
    continues: ClassVar[bool] = False
    #: whether the blocks pass one hidden state [n, n_embd] (transformers' hidden_states), the features a DFlash
    #: draft is trained on; False where they pass several streams (DeepSeek-V4's hyper-connections)
    one_hidden_stream: ClassVar[bool] = True

    def keep_cache(self, cache: dict[str, Any], length: int) -> dict[str, Any]:
        """A continued sequence's cache (`state["kv"]`) with every position from `length` on forgotten (the rejected
        part of a verified block): keys and values cut there, per block prefix."""
        return {b: (k[:length], v[:length]) for b, (k, v) in cache.items()}

    def output_projection(self, x: np.ndarray) -> np.ndarray:
        """The output head alone (no final norm) on hidden rows: what a DFlash draft's proposals go through."""
        raise self.fail(f"{self.ctx.arch} models have no hidden-state output for a DFlash draft")

    def nextn_head(self) -> NextnHead:
        """The NextN/MTP head that drafts for this model (ikrun/modules/nextn.py); refused for models without one."""
        raise self.fail(f"{self.ctx.arch} models have no NextN/MTP head that ikrun runs")

    def nextn_state(self, x: np.ndarray) -> np.ndarray:
        """The hidden state after the last main block as the model's NextN/MTP head takes it (the output norm's)."""
        return self.final_norm(x)

    def check_head(self, head: ArchModel) -> None:
        """Refuse a NextN/MTP head from another file: only architectures whose heads ik loads separately take one."""
        raise head.fail(f"is given as an MTP file, but {self.ctx.arch} models draft with their own NextN/MTP head "
                        "(give the target alone)")

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        """The output norm alone on hidden rows: transformers' last hidden state, a DFlash feature when a draft
        takes the target's last layer."""
        raise self.fail(f"{self.ctx.arch} models have no hidden-state output for a DFlash draft")

    # ---- the forward ----------------------------------------------------------------------------------------
    def begin(self, seq: Sequence) -> None:  # noqa: B027 (a hook most architectures use, none must)
        """Set up `seq.state` before its embedding (rope tables, ...); nothing by default."""

    @abstractmethod
    def embed(self, seq: Sequence) -> np.ndarray: ...

    @abstractmethod
    def block(self, i: int, xs: list[np.ndarray], seqs: list[Sequence]) -> list[np.ndarray]: ...

    @abstractmethod
    def head(self, x: np.ndarray, seq: Sequence) -> np.ndarray: ...

    def output_rows(self, i: int, xs: list[np.ndarray], seqs: list[Sequence]) -> list[np.ndarray]:
        """In the last main block, each sequence's rows from its first output row on (Sequence.outputs): where ik's
        graph cuts them (its inp_out_ids), the rest of the block and the head run on those rows only, which its
        kernel choices by row count see. Other blocks' states pass as they are."""
        if i != self.n_active - 1:
            return xs
        return [x[seq.first_output :] for x, seq in zip(xs, seqs)]

    def each(self, xs: list[np.ndarray], seqs: list[Sequence], step: Callable[[np.ndarray, Sequence], T]) -> list[T]:
        """`step` on every sequence of a batch in turn (observers are told which chunk they see)."""
        out = []
        for x, seq in zip(xs, seqs):
            self.ctx.chunk = seq.index
            out.append(step(x, seq))
        return out

    def forward(self, tokens: np.ndarray, on_block: BlockHook | None = None, index: int = 0,
                outputs: int = 0) -> np.ndarray:
        """float32 logits of one fresh sequence, of its rows from `outputs` on (Sequence.outputs: the last block and
        the head compute no other rows); `on_block(i, hidden)` sees the hidden state after each block."""
        seq = Sequence(np.asarray(tokens), index, outputs=outputs)
        self.ctx.chunk = seq.index
        self.begin(seq)
        return self.run_from(0, self.embed(seq), seq, on_block)

    def forward_in_batches(self, tokens: np.ndarray, batch: int, index: int = 0, outputs: int = 0) -> np.ndarray:
        """float32 logits of one fresh sequence fed `batch` tokens at a time through its key/value cache, as ik
        runs a chunk in micro-batches (llama-perplexity -b / -ub): each batch a Sequence continuing the last, its
        output rows those from `outputs` on (`continues` architectures; the logits of those rows are returned, as
        `forward` returns them); each batch an evaluation of its own to the
        observers (Context.batch_start), as each is a graph evaluation of ik's."""
        kv: dict[str, Any] = {}
        out = []
        try:
            for start in range(0, len(tokens), batch):
                seq = Sequence(np.asarray(tokens[start : start + batch]), index, {"kv": kv}, start, outputs - start)
                self.ctx.chunk, self.ctx.batch_start = index, start
                self.begin(seq)
                out.append(self.run_from(0, self.embed(seq), seq))
        finally:
            self.ctx.batch_start = 0
        return np.concatenate(out)

    def run_from(self, first: int, x: np.ndarray, seq: Sequence, on_block: BlockHook | None = None) -> np.ndarray:
        """Logits of one sequence whose hidden state `x` enters block `first` (n_active: only the head)."""
        self.ctx.chunk = seq.index
        for i in range(first, self.n_active):
            x = self.block(i, [x], [seq])[0]
            if on_block is not None:
                on_block(i, x)
        if not len(x):  # a micro-batch before the output rows
            return np.empty((0, self.n_vocab), np.float32)
        return self.head(x, seq)
