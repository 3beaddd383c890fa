"""Mixture-of-experts FFN as ggml's llm_build_moe_ffn computes it: routing, then the routed tokens per expert.

Routing per token: gating probabilities from the router logits (softmax, sigmoid, raw logits re-softmaxed over the
chosen experts, or sqrt(softplus)), the top-k experts by probability plus the optional selection bias
(exp_probs_b; the bias only chooses, the unbiased probabilities weigh), optional normalisation of the chosen
weights to sum 1 (sum in float64 like ggml_sum_rows) and a final scale. Under --numerics ik a softmax router without
a selection bias runs as ik's CPU graph runs it, fused with the top-k (iqk_topk_moe: libstdc++'s partial sort of the
logits, a float32 sum of the exponentials in that order) and the normalisation (iqk_sumrows_div).

Experts: every (token, slot) assignment is processed by its expert only (no dense pass over all experts): in the
exact mode all fetched experts' products in one parallel call per projection (ikrun/ops/fgemm.py: one FMA chain per
output), under --numerics ik each expert's matmuls in parallel over its weight rows (ikrun/numerics/ik/qgemm.py:
ik's integer sums); the weighted expert outputs are summed in slot order (ggml's mul_multi_add), so results depend
neither on the thread count nor on how tokens are batched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numba import get_num_threads, njit, prange

from ikquant.formats.numeric import fmaf
from ikrun.numerics.ik.formats import IK_FLOAT_TYPES, UNROUNDED, integer_rows, round_activations
from ikrun.numerics.ik.ikgemm import AVX2_LANES, LANES, ik_float_matmul, takes_whole
from ikrun.numerics.ik.native import NativeRows, native_matmuls, native_types
from ikrun.numerics.ik.qgemm import IntRows, PackedInts, qmatmul
from ikrun.ops.activations import swiglu_value
from ikrun.ops.fgemm import HALF_BITS, FileExperts, experts_matmul
from ikrun.ops.parallel import claim_items, run_claimed, task_items
from ikrun.ops.stl_heap import partial_sort

GATING_SOFTMAX = 1
GATING_SIGMOID = 2
GATING_SOFTMAX_WEIGHT = 3
GATING_SQRT_SOFTPLUS = 4
GATING_NAMES = {GATING_SOFTMAX: "softmax", GATING_SIGMOID: "sigmoid", GATING_SOFTMAX_WEIGHT: "softmax_weight",
                GATING_SQRT_SOFTPLUS: "sqrt_softplus"}

#: multiply-adds below which combining the experts' outputs runs on one thread (start-up costs more than it saves)
PARALLEL_MIN_FLOPS = 1 << 22


@njit(cache=True, nogil=True, inline="always")
def _softmax(x: np.ndarray, out: np.ndarray) -> None:
    m = x[0]
    for j in range(1, x.shape[0]):
        if x[j] > m:
            m = x[j]
    s = 0.0
    for j in range(x.shape[0]):
        e = np.exp(x[j] - m)
        out[j] = e
        s += np.float64(e)
    inv = np.float32(1.0 / s)
    for j in range(x.shape[0]):
        out[j] *= inv


@njit(cache=True, nogil=True, inline="always")
def _ik_softmax_top_k(logits: np.ndarray, ids: np.ndarray, sel: np.ndarray, w: np.ndarray) -> None:
    """ik's fused softmax + top-k of a router row (iqk_topk_moe, which its CPU graph runs for softmax gating
    without a selection bias): the experts by partial sort of the logits, then expf(l - max) of the chosen in
    order, a float32 sum over the chosen and then the rest, and the chosen times its reciprocal."""
    k = sel.shape[0]
    partial_sort(logits, k, ids)
    top = logits[ids[0]]
    total = np.float32(0.0)
    for s in range(k):
        p = np.exp(logits[ids[s]] - top)
        sel[s] = ids[s]
        w[s] = p
        total += p
    for j in range(k, ids.shape[0]):
        total += np.exp(logits[ids[j]] - top)
    inv = np.float32(1.0) / total
    for s in range(k):
        w[s] *= inv


@njit(cache=True, nogil=True, inline="always")
def _choose(logits: np.ndarray, bias: np.ndarray, gating: int, preset: bool, probs: np.ndarray, taken: np.ndarray,
            sel: np.ndarray, w: np.ndarray) -> None:
    """The gating probabilities, the top-k of them plus the selection bias (or the preset experts) and their
    unbiased probabilities as the weights."""
    n_expert = logits.shape[0]
    one = np.float32(1.0)
    if gating == GATING_SOFTMAX:
        _softmax(logits, probs)
    elif gating == GATING_SIGMOID:
        for e in range(n_expert):
            probs[e] = one / (one + np.exp(-logits[e]))
    elif gating == GATING_SQRT_SOFTPLUS:
        for e in range(n_expert):
            x = logits[e]
            # log1p as torch's softplus: a hash-routed expert's score may be far below 1 (log(1 + e^x) rounds to 0
            # below x = -17, which drops it from the renormalised weights)
            probs[e] = np.sqrt(x if x > np.float32(20.0) else np.log1p(np.exp(x)))
    else:
        for e in range(n_expert):
            probs[e] = logits[e]
    if preset:
        for s in range(sel.shape[0]):
            w[s] = probs[sel[s]]
    else:
        taken[:] = False
        for s in range(sel.shape[0]):
            best = -1
            best_v = np.float32(0.0)
            for e in range(n_expert):
                if taken[e]:
                    continue
                v = probs[e] + bias[e] if bias.shape[0] else probs[e]
                if best < 0 or v > best_v:
                    best = e
                    best_v = v
            taken[best] = True
            sel[s] = best
            w[s] = probs[best]


@njit(cache=True, nogil=True, inline="always")
def _route_row(logits: np.ndarray, bias: np.ndarray, gating: int, norm: bool, scale: np.float32, preset: bool,
               ik: bool, probs: np.ndarray, taken: np.ndarray, ids: np.ndarray, sel: np.ndarray,
               w: np.ndarray) -> None:
    one = np.float32(1.0)
    if ik and gating == GATING_SOFTMAX and not preset and bias.shape[0] == 0:
        _ik_softmax_top_k(logits, ids, sel, w)
    else:
        _choose(logits, bias, gating, preset, probs, taken, sel, w)
    if gating == GATING_SOFTMAX_WEIGHT:
        _softmax(w.copy(), w)
    if norm and ik:  # ik's fused sum_rows + div: a float32 sum, its reciprocal, a product
        t = np.float32(0.0)
        for s in range(w.shape[0]):
            t += w[s]
        inv = one / t if t > 0 else np.float32(0.0)
        for s in range(w.shape[0]):
            w[s] = w[s] * inv
    elif norm:
        total = 1e-20  # transformers' guard: DeepSeek-V4's sqrt(softplus) scores of a hash row can all be 0
        for s in range(w.shape[0]):
            total += np.float64(w[s])
        t32 = np.float32(total)
        for s in range(w.shape[0]):
            w[s] = w[s] / t32
    if abs(scale - one) > np.float32(1e-5):
        for s in range(w.shape[0]):
            w[s] = w[s] * scale


@njit(cache=True, nogil=True)
def _route(logits: np.ndarray, bias: np.ndarray, gating: int, norm: bool, scale: float, preset: bool, ik: bool,
           sel: np.ndarray, w: np.ndarray) -> None:
    n, n_expert = logits.shape
    probs = np.empty(n_expert, dtype=np.float32)
    taken = np.empty(n_expert, dtype=np.bool_)
    ids = np.empty(n_expert, dtype=np.int64)
    for t in range(n):
        _route_row(logits[t], bias, gating, norm, np.float32(scale), preset, ik, probs, taken, ids, sel[t], w[t])


def route(logits: np.ndarray, bias: np.ndarray | None, n_used: int, gating: int, norm: bool,
          scale: float, chosen: np.ndarray | None = None, ik: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(chosen experts [n, n_used] int64, their weights [n, n_used] float32) from router logits [n, n_expert].

    `chosen` [n, n_used] fixes the experts instead of the top-k (hash routing: DeepSeek-V4's tid2eid rows, which
    may name an expert twice); they are weighed, normalised and scaled as a top-k choice would be; `ik`:
    normalised as ik's graph computes it (--numerics ik)."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    n = logits.shape[0]
    if chosen is None:
        sel = np.empty((n, n_used), dtype=np.int64)
    else:
        sel = np.array(chosen, dtype=np.int64).reshape(n, n_used)
        if sel.size and (sel.min() < 0 or sel.max() >= logits.shape[1]):
            raise ValueError(f"expert id {int(sel.max() if sel.max() >= logits.shape[1] else sel.min())} is outside "
                             f"0..{logits.shape[1] - 1}")
    w = np.empty((n, n_used), dtype=np.float32)
    b = np.empty(0, dtype=np.float32) if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
    _route(logits, b, gating, norm, float(scale), chosen is not None, ik, sel, w)
    return sel, w


def group_limited_top_k(logits: np.ndarray, bias: np.ndarray | None, n_used: int, n_group: int,
                        topk_group: int) -> np.ndarray:
    """The experts [n, n_used] transformers' DeepSeek-V3 / GLM-4.x routers choose with expert groups: sigmoid scores
    plus the correction bias, each group scored by its two best, the `topk_group` best groups kept, the other
    experts' scores set to 0 (not -inf: a kept expert scoring below 0 loses to them, as in transformers), then the
    top-k. Ties go to the lower index."""
    scores = (np.float32(1.0) / (np.float32(1.0) + np.exp(-np.asarray(logits, dtype=np.float32)))).astype(np.float32)
    if bias is not None:
        scores = scores + np.asarray(bias, dtype=np.float32)
    n, n_expert = scores.shape
    grouped = scores.reshape(n, n_group, n_expert // n_group)
    best_two = -np.sort(-grouped, axis=-1)[:, :, :2].sum(axis=-1)
    kept = np.argsort(-best_two, axis=-1, kind="stable")[:, :topk_group]
    mask = np.zeros((n, n_group), dtype=bool)
    np.put_along_axis(mask, kept, True, axis=-1)
    masked = np.where(np.repeat(mask, n_expert // n_group, axis=-1), scores, np.float32(0.0))
    return np.argsort(-masked, axis=-1, kind="stable")[:, :n_used]


def group_by_expert(sel: np.ndarray, n_expert: int) -> tuple[np.ndarray, np.ndarray]:
    """Assignments (flat index token*k + slot) ordered by expert, then token; and each expert's start offset."""
    flat = sel.reshape(-1)
    order = np.argsort(flat, kind="stable")
    offsets = np.zeros(n_expert + 1, dtype=np.int64)
    np.cumsum(np.bincount(flat, minlength=n_expert), out=offsets[1:])
    return order.astype(np.int64), offsets


@njit(cache=True, nogil=True, inline="always")
def _combine_row(y: np.ndarray, w: np.ndarray, t: int, out: np.ndarray, ik: bool) -> None:
    """Token t's slots weighted and summed in slot order (`ik`: each after the first fused into the sum, as ik's
    compiled mul_multi_add)."""
    k = w.shape[1]
    for j in range(out.shape[1]):
        out[t, j] = y[t * k, j] * w[t, 0]
    for s in range(1, k):
        ws = w[t, s]
        for j in range(out.shape[1]):
            out[t, j] = fmaf(y[t * k + s, j], ws, out[t, j]) if ik else out[t, j] + y[t * k + s, j] * ws


@njit(cache=True, nogil=True)
def _combine_serial(y, w, out, ik):  # type: ignore[no-untyped-def]
    for t in range(out.shape[0]):
        _combine_row(y, w, t, out, ik)


@njit(cache=True, nogil=True, parallel=True)
def _combine_parallel(y, w, out, ik, threads):  # type: ignore[no-untyped-def]
    """The tokens in tasks the threads claim (ikrun/ops/parallel.py)."""
    per, counter = task_items(out.shape[0], threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        t0, t1 = claim_items(counter, per, out.shape[0])
        while t0 < t1:
            for t in range(t0, t1):
                _combine_row(y, w, t, out, ik)
            t0, t1 = claim_items(counter, per, out.shape[0])


#: a stack of expert matrices as experts_matmul takes them
ExpertMats = np.ndarray | FileExperts
#: expert ids -> their (up, gate, down) matrices, [len(ids), ...] each, in the order of ids
ExpertFetch = Callable[[np.ndarray], tuple[ExpertMats, ExpertMats, ExpertMats]]
#: one matrix of an expert as ik's integer kernels multiply it: converted (or stored) integers, or the file's rows
#: in the type's own kernel
ExpertProduct = PackedInts | NativeRows
#: expert id -> its (up, gate, down) as ik's integer kernels multiply them, None where ik multiplies floats
ExpertInts = Callable[[int], tuple[ExpertProduct, ExpertProduct, ExpertProduct] | None]


def _times(x: IntRows, m: ExpertProduct) -> np.ndarray:
    return m.times(x) if isinstance(m, NativeRows) else qmatmul(x, m)


@njit(cache=True, nogil=True, error_model="numpy")
def _swiglu_row(g, u, gb, ub, experts, i, limit, alpha, ik, avx2, out):  # type: ignore[no-untyped-def]
    """Row i's SwiGLU values, its expert's biases (gb / ub [E, n_ff]; none when gb has no rows) added first (the
    same float32 sums as adding them beforehand). Called, not inlined (ikquant/formats/jit.py: why a task is a
    function of its own)."""
    lim, a = np.float32(limit), np.float32(alpha)
    if gb.shape[0]:
        e = experts[i]
        for j in range(g.shape[1]):
            out[i, j] = swiglu_value(g[i, j] + gb[e, j], u[i, j] + ub[e, j], lim, a, ik, avx2)
    else:
        for j in range(g.shape[1]):
            out[i, j] = swiglu_value(g[i, j], u[i, j], lim, a, ik, avx2)


@njit(cache=True, nogil=True, error_model="numpy")
def _swiglu_serial(g, u, gb, ub, experts, limit, alpha, ik, avx2, out):  # type: ignore[no-untyped-def]
    for i in range(g.shape[0]):
        _swiglu_row(g, u, gb, ub, experts, i, limit, alpha, ik, avx2, out)


@njit(cache=True, nogil=True, error_model="numpy", parallel=True)
def _swiglu_claimed(g, u, gb, ub, experts, limit, alpha, ik, avx2, out, threads):  # type: ignore[no-untyped-def]
    """The rows in tasks the threads claim (ikrun/ops/parallel.py)."""
    per, counter = task_items(g.shape[0], threads), np.zeros(1, np.int64)
    for _ in prange(threads):
        i0, i1 = claim_items(counter, per, g.shape[0])
        while i0 < i1:
            for i in range(i0, i1):
                _swiglu_row(g, u, gb, ub, experts, i, limit, alpha, ik, avx2, out)
            i0, i1 = claim_items(counter, per, g.shape[0])


#: an exponential costs the SwiGLU's threads as much as this many of the elementwise work PARALLEL_MIN_ELEMENTS
#: counts: an expert's hundred rows are worth two threads (set when libm's expf took ~3.7 ns a value here; exp64
#: takes ~1 ns a value a thread, gpt-oss's form under --numerics ik still libm's; not measured again since)
EXP_WEIGHT = 8
_NO_BIAS = np.zeros((0, 0), np.float32)


@dataclass(frozen=True)
class ExpertGlu:
    """What an expert does between its projections: the SwiGLU's clamp `limit`, gpt-oss's `alpha` (0: plain
    silu(gate) * up), and per-expert biases (up [E, n_ff], gate [E, n_ff], down [E, n_embd]) added to each
    projection's output."""

    limit: float = np.inf
    alpha: float = 0.0
    biases: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def bias(self, which: int, e: int | np.ndarray) -> np.ndarray | None:
        """Expert e's bias of projection `which` (0 up, 1 gate, 2 down; e an array: each row's expert's), None
        without biases."""
        return None if self.biases is None else self.biases[which][e]


def _swiglu(g: np.ndarray, u: np.ndarray, glu: ExpertGlu, e: int | np.ndarray, ik: bool, avx2: bool) -> np.ndarray:
    """The clamped SwiGLU of expert e's gate and up projections [tokens, n_ff] (e an array: each row's expert),
    its biases added first."""
    g, u = np.ascontiguousarray(g, dtype=np.float32), np.ascontiguousarray(u, dtype=np.float32)
    if glu.biases is None:
        gb = ub = _NO_BIAS
        experts = np.zeros(0, np.int64)
    else:
        gb, ub = np.ascontiguousarray(glu.biases[1], np.float32), np.ascontiguousarray(glu.biases[0], np.float32)
        experts = np.full(g.shape[0], e, np.int64) if np.ndim(e) == 0 else np.ascontiguousarray(e, np.int64)
    out = np.empty(g.shape, np.float32)
    run_claimed(_swiglu_serial, _swiglu_claimed, EXP_WEIGHT * g.size, g, u, gb, ub, experts, float(glu.limit),
                float(glu.alpha), ik, avx2, out)
    return out


def _down(y: np.ndarray, glu: ExpertGlu, e: int | np.ndarray) -> np.ndarray:
    """Expert e's down projection (e an array: each row's expert's) with its bias, if any."""
    b = glu.bias(2, e)
    return y if b is None else y + b


@dataclass
class RoutedExperts:
    """The result of the routed experts on a batch: output [n, n_embd] plus what observers need (the activations
    entering ffn_down per assignment [n*k, n_ff], kept only when asked for; the assignments ordered by expert, each
    expert's offset)."""

    out: np.ndarray
    act: np.ndarray | None
    order: np.ndarray
    offsets: np.ndarray

    def rows(self, e: int) -> np.ndarray:
        """Expert e's assignments (flat token*k + slot), by token."""
        return self.order[self.offsets[e] : self.offsets[e + 1]]


def moe_experts(x: np.ndarray, sel: np.ndarray, w: np.ndarray, n_expert: int, fetch: ExpertFetch,
                group: int | None = None, glu: ExpertGlu = ExpertGlu(),
                formats: tuple[str, str, str] = (UNROUNDED, UNROUNDED, UNROUNDED),
                ints: ExpertInts | None = None, keep_act: bool = True,
                ik: tuple[str, str, str] | None = None, avx2: bool = False,
                done: Callable[[], None] | None = None) -> RoutedExperts:
    """Routed SwiGLU experts: x [n, n_embd], sel/w [n, k]; `fetch(ids)` gives the up/gate [len(ids), n_ff, n_embd] and
    down [len(ids), n_embd, n_ff] matrices of experts `ids` (float32, f16/bf16 bits or a type's rows, as
    experts_matmul reads them);
    `glu` the SwiGLU's form (a finite limit clamps it as swiglu does) and the experts' biases;
    `formats` are the activation formats (ikrun/numerics/ik/formats.py) of up, gate and down under --numerics ik, and
    `ints(e)` gives the integers ik's kernels multiply expert e as (qmatmul: integer rows per expert) where they do
    (a matrix ik multiplies in its type's own kernel beside converted ones: its file rows, NativeRows);
    `keep_act` keeps the ffn_down inputs of every assignment for observers ([n k, n_ff] floats: a streamed pass over
    many chunks would hold them for nothing); `ik` (--numerics ik: the up, gate and down weight types) computes the
    SwiGLU and the weighted sum in ik's float order and F32/F16/BF16 experts in ik's float kernels (`avx2`: its AVX2
    build's, numerics/ik/avx2.py); `done()` runs after each fetched group's products (the fetched matrices may be
    views of the mapped file, whose pages it releases).

    Only experts with at least one assignment are fetched, `group` of them at a time (None: all at once), so a
    layer's expert tensor never has to be decoded whole. Every assignment's result is computed by its expert alone
    and combined in slot order, so grouping and thread count do not change a bit.
    """
    n, k = sel.shape
    order, offsets = group_by_expert(sel, n_expert)
    used = np.nonzero(offsets[1:] > offsets[:-1])[0].astype(np.int64)
    x = np.ascontiguousarray(x, dtype=np.float32)
    act: np.ndarray | None = None
    y: np.ndarray | None = None

    def outputs(n_ff: int, n_embd: int) -> tuple[np.ndarray | None, np.ndarray]:
        return (np.empty((n * k, n_ff), np.float32) if keep_act else None), np.empty((n * k, n_embd), np.float32)

    x_up = _Activations(x, formats[0])
    x_gate = x_up if formats[1] == formats[0] else _Activations(x, formats[1])
    as_floats = []
    for e in used.tolist():
        packed = None if ints is None else ints(e)
        if packed is None:
            as_floats.append(e)
            continue
        up, gate, down = packed
        if y is None:
            act, y = outputs(up.rows, down.rows)
        rows = order[offsets[e] : offsets[e + 1]]
        e_up = x_up.ints().take(rows // k)
        e_gate = e_up if x_gate is x_up else x_gate.ints().take(rows // k)
        a = _swiglu(_times(e_gate, gate), _times(e_up, up), glu, e, ik is not None, avx2)
        if act is not None:
            act[rows] = a
        y[rows] = _down(_times(integer_rows(a, formats[2]), down), glu, e)
    floats = np.array(as_floats, dtype=np.int64)
    step = max(1, len(floats) if group is None else group)
    for g0 in range(0, len(floats), step):
        ids = floats[g0 : g0 + step]
        ups, gates, downs = fetch(ids)
        if y is None:
            act, y = outputs(ups.shape[1], downs.shape[1])
        rows = np.concatenate([order[offsets[e] : offsets[e + 1]] for e in ids.tolist()])
        row_at = np.zeros(len(ids) + 1, np.int64)
        np.cumsum(offsets[ids + 1] - offsets[ids], out=row_at[1:])
        per_row = np.repeat(ids, np.diff(row_at))
        tokens = rows // k
        types = (None, None, None) if ik is None else ik
        a = _swiglu(_experts_product(x_gate, gates, tokens, row_at, types[1], avx2),
                    _experts_product(x_up, ups, tokens, row_at, types[0], avx2), glu, per_row, ik is not None, avx2)
        if act is not None:
            act[rows] = a
        _experts_product(_Activations(a, formats[2]), downs, np.arange(len(rows), dtype=np.int64), row_at,
                         types[2], avx2, into=(y, rows))
        bias = glu.bias(2, per_row)
        if bias is not None:
            y[rows] += bias
        if done is not None:
            done()
    assert y is not None, "a routing without assignments"
    out = np.empty((n, y.shape[1]), dtype=np.float32)
    if n * k * y.shape[1] >= PARALLEL_MIN_FLOPS:
        _combine_parallel(y, np.ascontiguousarray(w), out, ik is not None, get_num_threads())
    else:
        _combine_serial(y, np.ascontiguousarray(w), out, ik is not None)
    return RoutedExperts(out, act, order, offsets)


class _Activations:
    """A projection's input rows as the products take them, each form made once, on first use: rounded to the
    activation format and widened back (the float products), or as its integer rows (ik's integer kernels)."""

    def __init__(self, x: np.ndarray, fmt: str) -> None:
        self.x, self.fmt = x, fmt
        self._rounded: np.ndarray | None = None
        self._ints: IntRows | None = None

    def rounded(self) -> np.ndarray:
        if self._rounded is None:
            self._rounded = round_activations(self.x, self.fmt)
        return self._rounded

    def ints(self) -> IntRows:
        if self._ints is None:
            self._ints = integer_rows(self.x, self.fmt)
        return self._ints


def _experts_product(x: _Activations, mats: ExpertMats, tokens: np.ndarray, row_at: np.ndarray, ik: str | None,
                     avx2: bool = False, into: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Rows `tokens` of x times their experts' matrices (expert j's rows tokens[row_at[j] : row_at[j + 1]]): under
    --numerics ik (`ik` the weights' type) in ik's own kernel where it is reproduced (numerics/ik/native.py: the
    file's rows against the integer rows; `avx2`: its AVX2 build's), in its float kernel per expert for an F32/F16/BF16
    weight (`avx2`: its AVX2 build's 8-lane kernel, bf16 weights included); else all experts in one experts_matmul
    call on the rounded rows (its bits are each output's own FMA chain, so the same as a call per expert). With
    `into` (out, dest), result i goes to out[dest[i]] (returned: out)."""
    if ik is not None and ik in native_types() and isinstance(mats, FileExperts):
        res = native_matmuls(x.ints(), mats.raw, tokens, row_at, ik, which=mats.ids, avx2=avx2)
    else:
        rounded = x.rounded()
        bf16, lanes = ik == "BF16" and not avx2, AVX2_LANES if avx2 else LANES
        if not (ik in IK_FLOAT_TYPES and takes_whole(rounded.shape[1], bf16, lanes)):
            return experts_matmul(rounded, mats, tokens, row_at, *(into or (None, None)))
        if isinstance(mats, FileExperts):  # F16/BF16 experts: their bits, each where it lies in the file
            stack, ids = mats.raw.view(HALF_BITS[mats.type_name]), mats.ids.tolist()
        else:
            stack, ids = mats, list(range(len(mats)))
        res = np.concatenate([ik_float_matmul(rounded[tokens[a:b]], stack[e], bf16, lanes)
                              for e, a, b in zip(ids, row_at[:-1].tolist(), row_at[1:].tolist())])
    if into is None:
        return res
    into[0][into[1]] = res
    return into[0]
