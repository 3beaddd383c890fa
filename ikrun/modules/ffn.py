"""The feed-forward blocks the architectures share: the SwiGLU FFN and the routed MoE FFN with shared experts.

Both take the Context (ikrun/context.py) for its weights, arithmetic and observers. The MoE FFN routes every sequence
of a batch separately (the router and shared experts are matmuls whose rounding depends on the batch's row count),
then runs the routed experts once for the whole batch: each routed expert is decoded once per batch (cached per
expert while the budget allows, except in a layer-streamed pass, which uses each once), and only the experts that
receive a token at all, a group at a time sized to what the cache holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ikrun.ops.moe import GATING_NAMES, ExpertGlu, RoutedExperts

if TYPE_CHECKING:
    from ikrun.context import Context
    from ikrun.models.base import Sequence

EXPERT_TENSORS = ("ffn_up_exps", "ffn_gate_exps", "ffn_down_exps")


def dense_ffn(cx: Context, h: np.ndarray, b: str, kind: str = "", limit: float = np.inf) -> np.ndarray:
    """SwiGLU FFN through ffn_gate/up/down{kind} of block prefix `b` ("" dense layers, "_shexp" shared experts),
    clamped at a finite `limit` (swiglu)."""
    gate, up = cx.linears(h, [b + "ffn_gate" + kind, b + "ffn_up" + kind], fused=True)
    return cx.linear(cx.numerics.swiglu(gate, up, limit), b + "ffn_down" + kind)


@dataclass(frozen=True)
class MoeConfig:
    """The routing hyperparameters of a MoE architecture."""

    n_expert: int
    n_used: int
    n_ff: int
    n_shared: int
    w_scale: float
    w_norm: bool
    gating: int
    #: expert groups (n_group, topk_group): the top-k limited to the best groups (transformers' GLM-4.x with
    #: n_group > 1); (1, 1) is a plain top-k
    groups: tuple[int, int] = (1, 1)
    #: the shared expert's width when it is not n_ff x n_shared (Qwen3-Next's expert_shared_feed_forward_length)
    n_ff_shared: int = 0
    #: the shared expert's output times sigmoid(ffn_gate_inp_shexp . x) (Qwen3-Next, Qwen3.5)
    shared_gate: bool = False

    @classmethod
    def read(cls, hp: Callable[..., Any], default_gating: int, fail: Callable[[str], Exception]) -> MoeConfig:
        """From `{arch}.expert_*` keys; `default_gating` for files without expert_gating_func."""
        cfg = cls(int(hp("expert_count")), int(hp("expert_used_count")), int(hp("expert_feed_forward_length")),
                  int(hp("expert_shared_count")), float(hp("expert_weights_scale")),
                  bool(hp("expert_weights_norm", False)), int(hp("expert_gating_func", 0)) or default_gating)
        if cfg.gating not in GATING_NAMES:
            raise fail(f"expert_gating_func {cfg.gating} is not one of {sorted(GATING_NAMES)}")
        if not 0 < cfg.n_used <= cfg.n_expert:
            raise fail(f"expert_used_count {cfg.n_used} must be in 1..expert_count {cfg.n_expert}")
        return cfg

    def expected(self, b: str, n_embd: int) -> dict[str, tuple[int, ...]]:
        x, fe, fs = self.n_expert, self.n_ff, self.n_ff_shared or self.n_ff * self.n_shared
        want = {b + "ffn_gate_inp.weight": (x, n_embd), b + "ffn_up_exps.weight": (x, fe, n_embd),
                b + "ffn_gate_exps.weight": (x, fe, n_embd), b + "ffn_down_exps.weight": (x, n_embd, fe)}
        if self.n_shared:
            want.update({b + "ffn_gate_shexp.weight": (fs, n_embd), b + "ffn_up_shexp.weight": (fs, n_embd),
                         b + "ffn_down_shexp.weight": (n_embd, fs)})
        return want


#: ik's micro-batch (llama-perplexity's -ub default): its graph runs that many tokens at once
MICRO_BATCH = 512


def micro_batches(seqs: list[Sequence], ik_batch: int) -> np.ndarray:
    """Each sequence's micro-batch in ik's run with -b `ik_batch` (RuntimeOptions.ik_batch; 0: each sequence its
    own): llama-perplexity decodes ik_batch / n_ctx chunks at once, min(ik_batch, MICRO_BATCH) tokens at a time, so
    whole chunks shorter than that which divide it share one with the chunks beside them (by their index in the
    run); any other sequence is a micro-batch of its own. ik's kernel choices by row count (a routed expert's
    tokens) see the rows of one micro-batch."""
    lengths = {len(s) for s in seqs}
    n, micro = (lengths.pop() if len(lengths) == 1 else 0), min(ik_batch, MICRO_BATCH)
    if 0 < n < micro and micro % n == 0 and all(s.start == 0 for s in seqs):
        return np.array([s.index // (micro // n) for s in seqs], np.int64)
    return np.arange(len(seqs), dtype=np.int64)


def moe_ffn(cx: Context, hs: list[np.ndarray], seqs: list[Sequence], b: str, cfg: MoeConfig, *,
            limit: float = np.inf, shared_limit: float = np.inf, alpha: float = 0.0,
            hash_table: np.ndarray | None = None,
            residual: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """The MoE FFN of block prefix `b` on a batch of sequences' normed hidden states (one [n, n_embd] each).

    `limit` / `shared_limit` clamp the routed / shared experts' SwiGLU; a positive `alpha` makes the routed experts'
    SwiGLU gpt-oss's (ops/moe.ExpertGlu); `hash_table` [vocab, n_used] routes each token to the experts of its row
    instead of the top-k (DeepSeek-V4's hash layers). The router's bias (`ffn_gate_inp.bias`) and the experts'
    (`ffn_{up,gate,down}_exps.bias`) are added where the file has them. A sequence's states may be fewer rows than
    its tokens (the last block's output rows, ArchModel.output_rows). With `residual` (each
    sequence's block input) the result is the residual stream after the FFN, summed in the arithmetic's order
    (Numerics.moe_residual); without it, the FFN's output alone."""
    if not any(len(h) for h in hs):  # a micro-batch before the output rows: ik's last block runs none of it
        return hs if residual is None else residual
    bias = cx.weight(b + "exp_probs_b.bias") if cx.has(b + "exp_probs_b.bias") else None
    routes = []
    for h, seq in zip(hs, seqs):
        cx.chunk = seq.index
        chosen = None if hash_table is None else hash_table[seq.tokens]
        routes.append(cx.numerics.route(cx.linear(h, b + "ffn_gate_inp"), bias, cfg.n_used, cfg.gating, cfg.w_norm,
                                        cfg.w_scale, chosen, cfg.groups))
    x = hs[0] if len(hs) == 1 else np.concatenate(hs)
    sel = routes[0][0] if len(hs) == 1 else np.concatenate([r[0] for r in routes])
    w = routes[0][1] if len(hs) == 1 else np.concatenate([r[1] for r in routes])
    names = [b + t + ".weight" for t in EXPERT_TENSORS]
    biases = [b + t + ".bias" for t in EXPERT_TENSORS]
    glu = ExpertGlu(limit, alpha, (cx.weight(biases[0]), cx.weight(biases[1]), cx.weight(biases[2]))
                    if all(cx.has(n) for n in biases) else None)
    starts = np.cumsum([0] + [len(h) for h in hs])
    batches = np.repeat(micro_batches(seqs, cx.options.ik_batch), [len(h) for h in hs])
    res = cx.numerics.routed_experts(x, sel, w, cfg.n_expert, names, _group(cx, names, cfg.n_expert), glu,
                                     keep_act=bool(cx.observers), batches=batches)
    if cx.observers:
        _observe_experts(cx, names, x, res, cfg, starts, seqs)
    outs = []
    for c, (h, seq) in enumerate(zip(hs, seqs)):
        routed, shared = res.out[starts[c] : starts[c + 1]], None
        if cfg.n_shared:
            cx.chunk = seq.index
            shared = dense_ffn(cx, h, b, "_shexp", shared_limit)
            if cfg.shared_gate:
                shared = shared * cx.numerics.sigmoid(cx.linear(h, b + "ffn_gate_inp_shexp").reshape(len(h), 1))
        if residual is not None:
            outs.append(cx.numerics.moe_residual(residual[c], routed, shared))
        else:
            outs.append(routed if shared is None else routed + shared)
    return outs


#: decoded expert matrices a layer-streamed pass holds at a time: it uses each expert once, so a larger group only
#: raises the peak (64 experts of a DeepSeek-shaped IQ4_KS layer decoded together are 1.2 GB)
STREAM_DECODE_BYTES = 64 << 20


def _group(cx: Context, names: list[str], n_expert: int) -> int | None:
    """How many routed experts to decode at a time: all of them when their decoded matrices fit the cache, else
    what it holds (one at least); streamed, what STREAM_DECODE_BYTES holds."""
    per_expert = sum(cx.weights.decoded_bytes(n) for n in names) // n_expert
    capacity = cx.weights.capacity
    if cx.weights.streaming:
        capacity = STREAM_DECODE_BYTES if capacity is None else min(capacity, STREAM_DECODE_BYTES)
    return None if capacity is None else max(1, int(capacity // per_expert))


def _observe_experts(cx: Context, names: list[str], x: np.ndarray, res: RoutedExperts, cfg: MoeConfig,
                     starts: np.ndarray, seqs: list[Sequence]) -> None:
    """Each expert's rows per sequence, in sequence order (the order a chunk-by-chunk run shows them): as ik's fused
    up/gate op, the shared input is recorded under the up tensor only."""
    up, _, down = names
    assert res.act is not None, "moe_experts was not asked to keep the activations"
    for e in range(cfg.n_expert):
        rows = res.rows(e)
        if not rows.size:
            continue
        tokens = rows // cfg.n_used
        cuts = np.searchsorted(tokens, starts)
        for c, seq in enumerate(seqs):
            part = rows[cuts[c] : cuts[c + 1]]
            if part.size:
                cx.chunk = seq.index
                cx.observe(up, x[part // cfg.n_used], e, cfg.n_expert)
                cx.observe(down, res.act[part], e, cfg.n_expert)
