"""Chunked evaluation as llama-perplexity does it: tokenize once, cut into n_ctx chunks, evaluate each chunk
from an empty context (first token swapped for BOS when the vocabulary adds one), score the second half.

Each function takes a StreamPlan (ikrun/eval/stream.py: chunk by chunk or layer-streamed within the memory budget);
without one it plans a one-pass run itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ikquant.errors import InputNotFoundError
from ikrun.errors import BaseLogitsError, EvalError
from ikrun.eval.metrics import BaseLogitsFile, BaseLogitsWriter, KLDAccumulator, encode_records, kld_stats
from ikrun.eval.stream import BlockInputs, BlockProgress, StreamPlan, evaluate_chunks, fed_tokens, plan_run
from ikrun.model import Model

Progress = Callable[[int, int], None]


def read_text(path: Path) -> str:
    """A text to evaluate on, as UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputNotFoundError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise EvalError(f"{path}: not UTF-8 ({exc})") from None


def tokenize_chunks(model: Model, text: str, n_ctx: int, max_chunks: int | None = None) -> np.ndarray:
    """Token chunks [n_chunk, n_ctx] of `text`, tokenized once with the model's own vocabulary (BOS added as
    llama_tokenize adds it), as llama-perplexity cuts them."""
    if n_ctx < 4:
        raise EvalError(f"--ctx must be at least 4 (got {n_ctx})")
    ids = np.asarray(model.tokenizer().encode(text, add_special=True), dtype=np.int32)
    if len(ids) < 2 * n_ctx:
        raise EvalError(f"the text gives {len(ids)} tokens; at least 2*ctx = {2 * n_ctx} are needed "
                        "(use a longer text or a smaller --ctx)")
    n_chunk = len(ids) // n_ctx
    if max_chunks is not None and max_chunks > 0:
        n_chunk = min(n_chunk, max_chunks)
    return ids[: n_chunk * n_ctx].reshape(n_chunk, n_ctx)


def chunk_logits(model: Model, chunk: np.ndarray) -> np.ndarray:
    """Logits of the scored positions of one chunk (BOS swapped in first when the model adds BOS)."""
    n_ctx = len(chunk)
    return model.logits(fed_tokens(model, chunk), outputs=n_ctx // 2)[: n_ctx - 1 - n_ctx // 2]


@dataclass
class PPLResult:
    nll: np.ndarray
    n_ctx: int
    n_chunk: int


def perplexity(model: Model, chunks: np.ndarray, save_base: Path | None = None,
               progress: Progress | None = None, plan: StreamPlan | None = None,
               on_block: BlockProgress | None = None) -> PPLResult:
    """NLL of every scored token; with `save_base`, also ik's base-logits file for these chunks."""
    n_chunk, n_ctx = chunks.shape
    plan = plan or plan_run(model, n_chunk, n_ctx, one_pass=True)
    writer = BaseLogitsWriter(save_base, n_ctx, model.n_vocab, chunks) if save_base else None
    nlls = []
    try:
        for i, logits in evaluate_chunks(model, chunks, plan, on_block):
            records, nll = encode_records(logits, chunks[i][n_ctx // 2 + 1 :])
            nlls.append(nll)
            if writer is not None:
                writer.write_chunk(records)
            if progress:
                progress(i + 1, n_chunk)
        if writer is not None:
            writer.finish()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return PPLResult(np.concatenate(nlls), n_ctx, n_chunk)


def open_base(path: Path, model: Model) -> BaseLogitsFile:
    """A base-logits file checked against the model (ik only warns on a vocabulary mismatch; we refuse)."""
    base = BaseLogitsFile(path)
    if base.n_vocab != model.n_vocab:
        raise BaseLogitsError(f"{path}: made with a vocabulary of {base.n_vocab} tokens, the model has "
                              f"{model.n_vocab}")
    return base


def kl_divergence(model: Model, base: BaseLogitsFile, progress: Progress | None = None,
                  per_chunk: Callable[[int, dict], None] | None = None, plan: StreamPlan | None = None,
                  on_block: BlockProgress | None = None,
                  resume: tuple[BlockInputs, int] | None = None, start: int = 0) -> KLDAccumulator:
    """Score every chunk of the base file's tokens (from chunk `start` on) with `model` against the stored base
    log-probabilities (`resume`: from a block's recorded inputs, see stream.BlockInputs)."""
    acc = KLDAccumulator()
    n_ctx = base.n_ctx
    tokens = np.asarray(base.tokens[: base.n_chunk])
    plan = plan or plan_run(model, base.n_chunk - start, n_ctx, one_pass=True)
    for i, logits in evaluate_chunks(model, tokens, plan, on_block, resume=resume, start=start, every_row=True):
        acc.add(logits, np.asarray(base.records(i)), tokens[i][n_ctx // 2 + 1 :])
        if per_chunk is not None:
            per_chunk(i + 1, kld_stats(acc))
        if progress:
            progress(i + 1, base.n_chunk)
    return acc


def collect_imatrix(model: Model, chunks: np.ndarray, collector, progress: Progress | None = None,  # type: ignore[no-untyped-def]
                    plan: StreamPlan | None = None, on_block: BlockProgress | None = None) -> np.ndarray:
    """Run every chunk with `collector` observing the matmuls; returns the scored NLLs."""
    n_chunk, n_ctx = chunks.shape
    plan = plan or plan_run(model, n_chunk, n_ctx, one_pass=True)
    nlls = []
    model.observers.append(collector)
    try:
        for i, logits in evaluate_chunks(model, chunks, plan, on_block, every_row=True):
            nlls.append(encode_records(logits, chunks[i][n_ctx // 2 + 1 :])[1])
            if progress:
                progress(i + 1, n_chunk)
    finally:
        model.observers.remove(collector)
    return np.concatenate(nlls)
