"""Greedy speculative decoding with a DFlash draft, step for step as the reference (z-lab/dflash's
`dflash_generate` at temperature 0) does it, and the acceptance statistics users judge drafts by.

Each step drafts a whole block `[last token, mask x (block - 1)]` from the target's features of every token verified so
far, the target verifies the whole block in one forward that continues its key/value cache, the longest prefix of
proposals the target agrees with is accepted, and the target's own next token is added (the acceptance length of a
step counts both). The verified tokens' features become the draft's next context. Greedy speculation never
changes the output: it is the target's own greedy continuation (`greedy_continuation` checks it).

The loop is the one the oracle's acceptance lengths were measured with: whole blocks until max_new tokens exist,
the last block's tokens past them cut afterwards (its acceptance length counts them; the reference's current
`dflash_generate` shortens the last block instead, which changes only the last step's figure).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ikrun.errors import AcceptError
from ikrun.model import Model
from ikrun.models.base import Sequence
from ikrun.models.dflash import DFlashDraft, DraftContext


class TargetDecoder:
    """The target continuing one sequence through its key/value cache, with the hidden states of chosen blocks
    from the same forward: transformers' `hidden_states[i + 1]`, which for the last block is the output norm's."""

    def __init__(self, model: Model, feature_layers: list[int], nextn: bool = False):
        self.model, self.impl = model, model.impl
        self.layers = feature_layers
        self.nextn = nextn  # the last block's feature is the state a NextN/MTP head takes (impl.nextn_state)
        self.kv: dict[str, Any] = {}
        self.length = 0

    def run(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Logits [n, vocab] and the features [n, layers x n_embd] of the next len(tokens) positions."""
        seq = Sequence(np.asarray(tokens, dtype=np.int64), start=self.length, state={"kv": self.kv})
        impl = self.impl
        with self.model.blas_limit():
            impl.begin(seq)
            x = impl.embed(seq)
            features = {}
            last = impl.n_active - 1
            for i in range(impl.n_active):
                x = impl.block(i, [x], [seq])[0]
                if i in self.layers:
                    features[i] = x if i != last else impl.nextn_state(x) if self.nextn else impl.final_norm(x)
            logits = impl.head(x, seq)
        self.length += len(tokens)
        return logits, np.concatenate([features[i] for i in self.layers], axis=1) if self.layers else x[:, :0]

    def keep(self, length: int) -> None:
        """Forget every position from `length` on (the rejected part of a verified block)."""
        self.kv = self.impl.keep_cache(self.kv, length)
        self.length = length


@dataclass(frozen=True)
class IkSpecBench:
    """Where ik's `llama-spec-bench` departs from the reference loop; each switch on reproduces one departure, all
    off (the default) is the reference's behaviour."""

    #: the draft attends to the newest `cross_ctx` rows of target features only (ik's `cross_ctx`)
    cross_ctx: int | None = None
    #: the rows a step verifies are committed at their positions + 1 and the next block starts one position late
    #: (ik's `common_speculative_run_round` passes `n_past + 1` as the commit's first position)
    late_feature_positions: bool = False
    #: each step drafts min(block - 1, tokens left - 2) tokens in a block that long, none once fewer than 3 tokens
    #: are left (those come from the target alone), instead of whole blocks cut afterwards
    budget_drafts: bool = False


@dataclass
class SpecRun:
    """One prompt's speculative decoding."""

    prompt: list[int]
    output_ids: list[int]  # prompt + new tokens
    acceptance_lengths: list[int]
    #: per step, the target's output head on every row of the draft's block (row 0: the known token's position)
    draft_logits: list[np.ndarray] = field(default_factory=list)
    #: per step, how many tokens were drafted (block - 1 but where the draft budget shortened the block)
    draft_lengths: list[int] = field(default_factory=list)
    seconds: float = 0.0
    #: the time after the prompt's forward and the draft's context from it (ik's `decode_s`: prefill excluded)
    decode_seconds: float = 0.0


#: sees, at every step, the target's features of every position before the block, the block's embeddings and the
#: draft's output per layer, then its final norm's
DraftObserver = Callable[[np.ndarray, np.ndarray, list[np.ndarray]], None]


def speculative_generate(target: Model, draft: Model, prompt: np.ndarray, max_new: int, block: int | None = None,
                         keep_logits: bool = False, observe: DraftObserver | None = None,
                         ik: IkSpecBench = IkSpecBench()) -> SpecRun:
    """Greedy DFlash speculative decoding of `max_new` tokens after `prompt`."""
    d = draft.impl
    assert isinstance(d, DFlashDraft)
    d.check_target(target.impl)
    bs = block or d.block_size
    n = len(prompt)
    max_length = n + max_new
    t0 = time.perf_counter()
    out = np.full(max_length + bs, d.mask_token_id, dtype=np.int64)
    out[:n] = prompt
    dec = TargetDecoder(target, d.target_layer_ids)
    logits, pending = dec.run(out[:n])
    out[n] = int(np.argmax(logits[-1]))
    ctx = DraftContext(limit=ik.cross_ctx)
    d.extend_context(ctx, pending, np.arange(n))
    t_decode = time.perf_counter()
    run = SpecRun([int(t) for t in prompt], [], [])
    start = n
    seen = pending  # every position's features, kept only for an observer
    with draft.blas_limit():
        while start < max_length:  # whole blocks, the last one cut at max_length afterwards
            size = bs
            if ik.budget_drafts:  # ik's budget counts the first step's known token as still to come, later ones not
                left = max_length - start - (1 if run.acceptance_lengths else 0)
                if left < 3:
                    break
                size = min(bs, left - 1)
            blk = out[start : start + size].copy()
            embeddings = target.ctx.embed_rows("token_embd.weight", blk)
            layers: list[np.ndarray] = []
            hidden = d.draft(ctx, embeddings, None if observe is None else lambda i, x: layers.append(x.copy()))
            if observe is not None:
                observe(seen, embeddings, [*layers, hidden])
            proposals = target.impl.output_projection(hidden)
            if keep_logits:
                run.draft_logits.append(proposals)
            blk[1:] = np.argmax(proposals[1:], axis=-1)
            accepted, features = verify(dec, out, start, blk)
            late = int(ik.late_feature_positions)
            d.extend_context(ctx, features[: accepted + 1], np.arange(start + late, start + late + accepted + 1))
            if observe is not None:
                seen = np.concatenate([seen, features[: accepted + 1]])
            start += accepted + 1
            run.acceptance_lengths.append(accepted + 1)
            run.draft_lengths.append(size - 1)
        while start < max_length - 1:  # what the draft budget left to the target alone
            logits, _ = dec.run(out[start : start + 1])
            start += 1
            out[start] = int(np.argmax(logits[-1]))
    run.output_ids = [int(t) for t in out[:max_length]]
    t_end = time.perf_counter()
    run.seconds, run.decode_seconds = t_end - t0, t_end - t_decode
    return run


def verify(dec: TargetDecoder, out: np.ndarray, start: int, blk: np.ndarray) -> tuple[int, np.ndarray]:
    """The target's verification of `blk` = [known token, proposals ...] at position `start`: the proposals it agrees
    with (the longest such prefix) and its own next token written into `out`, its cache cut after them; returns how
    many proposals were accepted and the block's features."""
    logits, features = dec.run(blk)
    posterior = np.argmax(logits, axis=-1)
    accepted = int(np.cumprod(blk[1:] == posterior[:-1]).sum())
    out[start : start + accepted + 1] = blk[: accepted + 1]
    out[start + accepted + 1] = posterior[accepted]
    dec.keep(start + accepted + 1)
    return accepted, features


class NextnDecoder:
    """A target's NextN/MTP head continuing one sequence through its own key/value cache (ikrun/modules/nextn.py):
    position p takes token p and the target's hidden state of position p - 1."""

    def __init__(self, model: Model, index: int = 0):
        self.model, self.impl = model, model.impl
        self.head = model.impl.nextn_head()
        self.kv: dict[str, Any] = {}
        self.length = 0
        self.index = index  # the chunk observers are told they see

    def run(self, hidden: np.ndarray, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The head's normed states and logits at the next len(tokens) positions."""
        seq = Sequence(np.asarray(tokens, dtype=np.int64), self.index, start=self.length, state={"kv": self.kv})
        with self.model.blas_limit():
            self.impl.begin(seq)
            states, logits = self.head(self.model.ctx, hidden, seq)
        self.length += len(tokens)
        return states, logits

    def keep(self, length: int) -> None:
        """Forget every position from `length` on (the drafts past the verified token)."""
        self.kv = self.impl.keep_cache(self.kv, length)
        self.length = length


def previous_states(features: np.ndarray) -> np.ndarray:
    """Row p: the target's state of position p - 1, what the head takes at p (zeros before the first, as ik's fresh
    warmup)."""
    return np.concatenate([np.zeros_like(features[:1]), features[:-1]])


def top_probability(logits: np.ndarray) -> float:
    """The softmax probability of the greedy token (what ik's --draft-p-min compares)."""
    z = np.exp(logits.astype(np.float64) - logits.max())
    return float(z.max() / z.sum())


def mtp_generate(target: Model, prompt: np.ndarray, max_new: int, n_max: int, p_min: float = 0.0,
                 head: Model | None = None) -> SpecRun:
    """Greedy speculative decoding of `max_new` tokens after `prompt`, the target's NextN head (or `head`'s, an MTP
    export ik loads beside the target) drafting up to `n_max` tokens a step, each from the previous one's state (ik's
    mtp_speculative_gen_draft: the first draft always, then none whose probability is below `p_min`, and none after
    one below it); the last step's tokens past max_new are cut afterwards, as speculative_generate does."""
    n = len(prompt)
    max_length = n + max_new
    t0 = time.perf_counter()
    out = np.zeros(max_length + n_max + 1, dtype=np.int64)
    out[:n] = prompt
    dec = TargetDecoder(target, [target.impl.n_active - 1], nextn=True)
    logits, features = dec.run(out[:n])
    out[n] = int(np.argmax(logits[-1]))
    drafter = NextnDecoder(head or target)
    drafter.run(previous_states(features), out[:n])
    hidden, start = features[-1:], n
    run = SpecRun([int(t) for t in prompt], [], [])
    while start < max_length:
        blk, state = [int(out[start])], hidden
        for k in range(n_max):
            state, proposal = drafter.run(state, np.asarray(blk[-1:]))
            token, p = int(np.argmax(proposal[-1])), top_probability(proposal[-1])
            if k > 0 and p < p_min:
                break
            blk.append(token)
            if p < p_min:
                break
        accepted, features = verify(dec, out, start, np.asarray(blk, dtype=np.int64))
        drafter.keep(start + 1)  # the known token's position holds the target's own hidden state; drafts after it not
        if accepted:
            drafter.run(features[:accepted], out[start + 1 : start + accepted + 1])
        hidden = features[accepted : accepted + 1]
        start += accepted + 1
        run.acceptance_lengths.append(accepted + 1)
        run.draft_lengths.append(len(blk) - 1)
    run.output_ids = [int(t) for t in out[:max_length]]
    run.seconds = time.perf_counter() - t0
    return run


def greedy_continuation(target: Model, prompt: np.ndarray, max_new: int) -> list[int]:
    """The target's own greedy continuation, one token at a time through its cache (what speculation must give)."""
    dec = TargetDecoder(target, [])
    out = [int(t) for t in prompt]
    logits, _ = dec.run(np.asarray(prompt))
    for _ in range(max_new):
        out.append(int(np.argmax(logits[-1])))
        if len(out) == len(prompt) + max_new:
            break
        logits, _ = dec.run(np.asarray(out[-1:]))
    return out


def prompt_starts(n_tokens: int, n_prompts: int, prompt_len: int, max_new: int) -> list[int]:
    """Prompt i starts at token i * floor((n - L - M) / N)."""
    room = n_tokens - prompt_len - max_new
    if room < 0 or n_prompts < 1:
        raise AcceptError(f"the text gives {n_tokens} tokens; {n_prompts} prompts of {prompt_len} tokens with "
                          f"{max_new} new tokens each need at least {prompt_len + max_new}")
    step = room // n_prompts
    return [i * step for i in range(n_prompts)]


def acceptance_by_position(runs: list[SpecRun], block: int) -> list[float]:
    """For each draft position 1..block-1: the share of all steps in which the proposal there was accepted."""
    steps = [length for r in runs for length in r.acceptance_lengths]
    return [sum(1 for length in steps if length - 1 >= j) / len(steps) if steps else 0.0 for j in range(1, block)]


def mean_acceptance_length(runs: list[SpecRun]) -> float:
    """Tokens per target step over every step of every prompt (the reference's figure)."""
    steps = [length for r in runs for length in r.acceptance_lengths]
    return sum(steps) / len(steps) if steps else 0.0
