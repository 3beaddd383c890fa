"""Predicting what a (group, type) costs from a few blocks' measurements: `ikrun sweep --target-bpw ...
--prediction-spread F` measures only a sample of the blocks, so the other blocks' costs must come from somewhere.

Two observations carry the prediction. Across types, a tensor's KLD follows a power of its importance-weighted
quantization error (the prior, ikrun/sweep/prune.py): log KLD = b + alpha log error, alpha about 1 (a small change
of the weights changes the logits in proportion), the same for every tensor of a class. Across blocks, the
intercept b (the tensor's sensitivity) drifts smoothly with depth within a class. So every class is measured at
every SAMPLE_STRIDE-th block and its last, the class's first block and its sampled blocks of the later half at
two types (which gives the class its alpha: `exponent_groups`), the others at one; a measured group's other types
are interpolated between its measured types on the log-log line (or extended along the class's alpha), and an
unsampled group's b is interpolated linearly between the nearest sampled blocks of its class. The class's first
block is sampled but never interpolated from: in a trained model it is tens to hundreds of times more sensitive
than the blocks after it (on README's trained 24-layer Qwen3-MoE, 20-1000x its second block at IQ2_KS), and a line
drawn from it predicted the next blocks up to 80x high; the blocks before the next sampled one take that block's
b.

A third observation: the FFN tensors of one block depart from their classes' trends together. A block whose router
sends its tokens to sensitive experts, or whose FFN input carries more of the output, is more sensitive in all of
its ffn_* tensors (on that model the departures of ffn_gate_exps, ffn_up_exps and ffn_down_exps from a running
median over their neighbouring blocks correlate 0.92-0.93 at IQ2_KS; the attention classes' 0.3 at most, attn_v's
negatively). So the groups measured outside the sample (near the frontier) do not join their class's trend, where
a single block's spike would bend the line for its neighbours; their mean departure from the trend is their
block's effect, added to the unmeasured ffn_* groups of that block. Before it, a block whose gate and up measured
3-10x above their trends left its ffn_down_exps predicted 10x low (blk.19 at IQ2_KS: 3.6e-07 against 3.44e-06
measured; with the effect 1.1e-06), and the mix took IQ2_KS there.
"""

from __future__ import annotations

import math

import numpy as np

from ikrun.sweep.measure import layer_of, tensor_class

#: every this-many-th block of a class is sampled (and its last block)
SAMPLE_STRIDE = 4
#: measured KLDs at or below this (noise) are taken as this, so that their logarithm exists
KLD_FLOOR = 1e-9
#: the class exponent is kept within these bounds (two noisy measurements can give any slope)
ALPHA_BOUNDS = (0.25, 4.0)


def group_class(names: list[str]) -> str:
    """The class a group's tensors make (`ffn_down_exps`; `attn_k+attn_v` for a group of both)."""
    return "+".join(sorted({tensor_class(n) for n in names}))


def sampled_groups(groups: dict[str, list[str]]) -> set[str]:
    """Per class, the groups of every SAMPLE_STRIDE-th block it occurs in and of its last; every group outside
    the blocks (output, token_embd)."""
    out: set[str] = set()
    by_class: dict[str, dict[int, list[str]]] = {}
    for g, names in groups.items():
        layer = layer_of(names[0])
        if layer is None:
            out.add(g)
        else:
            by_class.setdefault(group_class(names), {}).setdefault(layer, []).append(g)
    for layers in by_class.values():
        ordered = sorted(layers)
        for layer in set(ordered[::SAMPLE_STRIDE]) | {ordered[-1]}:
            out.update(layers[layer])
    return out


def exponent_groups(groups: dict[str, list[str]]) -> set[str]:
    """Of the sampled groups, those measured at a second type (for their class's alpha): per class, its first
    block's and those of its sampled blocks from the middle of its blocks on; every group outside the blocks.

    A candidate's forward runs from its block to the output, so a measurement costs least in the last blocks (on
    README's trained 24-layer MoE 0.08 s a row at the last block, 0.70 s at the first), and alpha is a median over
    noisy slopes anyway (one class's IQ2_KS-IQ4_KS slopes there scatter 0.3-1.9 from block to block): the later
    half's second types cost 44% of every sampled block's after the first. The first block, the most sensitive,
    keeps both types: its choices weigh most in a mix. There, with the second type at blocks 4 and 8 too, the
    pruned sweep took 26% of the exhaustive sweep's row time, without them 20%, its mixes as good held out."""
    blocks: dict[str, list[int]] = {}
    for names in groups.values():
        if (layer := layer_of(names[0])) is not None:
            blocks.setdefault(group_class(names), []).append(layer)
    first = {c: min(v) for c, v in blocks.items()}
    middle = {c: sorted(v)[len(v) // 2] for c, v in blocks.items()}
    out: set[str] = set()
    for g in sampled_groups(groups):
        layer, cls = layer_of(groups[g][0]), group_class(groups[g])
        if layer is None or layer == first[cls] or layer >= middle[cls]:
            out.add(g)
    return out


Prediction = tuple[float, str]

#: the sublayers whose tensors share a block's departure from their classes' trends (the module's docstring)
SHARED_SUBLAYERS = ("ffn_",)


def sublayer(cls: str) -> str | None:
    """The sublayer (`ffn_`) whose tensors share their block's effect, for a class of one; None for the others."""
    return next((p for p in SHARED_SUBLAYERS if cls.startswith(p)), None)


class Predictor:
    """The predicted KLD of every (group, type) from `measured` {(group, type): KLD} and the priors `error`
    {(group, type): importance-weighted squared error}, with the basis of each prediction in words."""

    def __init__(self, groups: dict[str, list[str]], type_names: list[str], error: dict[tuple[str, str], float],
                 measured: dict[tuple[str, str], float]):
        self.error = error
        self.cls = {g: group_class(names) for g, names in groups.items()}
        self.layer = {g: layer_of(names[0]) for g, names in groups.items()}
        self.first_block: dict[str, int] = {}
        for g, layer in self.layer.items():
            if layer is not None:
                self.first_block[self.cls[g]] = min(layer, self.first_block.get(self.cls[g], layer))
        # each group's measured points (log error, log KLD, type), by error
        self.points = {g: sorted((math.log(error[(g, t)]), math.log(max(measured[(g, t)], KLD_FLOOR)), t)
                                 for t in type_names if (g, t) in measured and error[(g, t)] > 0)
                       for g in groups}
        slopes: dict[str, list[float]] = {}
        for g, pts in self.points.items():
            if len(pts) >= 2 and pts[-1][0] - pts[0][0] > 1e-6:
                slopes.setdefault(self.cls[g], []).append((pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]))
        every = [s for v in slopes.values() for s in v]
        default = float(np.median(every)) if every else 1.0
        self.alpha = {c: float(np.clip(np.median(slopes[c]) if c in slopes else default, *ALPHA_BOUNDS))
                      for c in set(self.cls.values())}
        # each measured group's block and intercept b (log KLD - alpha log error, averaged over its points)
        own = {g: (layer, float(np.mean([lk - self.alpha[self.cls[g]] * le for le, lk, _ in pts])))
               for g, pts in self.points.items() if pts and (layer := self.layer[g]) is not None}
        # the sampled groups make each class's trend over its blocks (a class with none measured: all its measured
        # groups); the other measured groups' departures from their trend make their block's effect
        sample = sampled_groups(groups)
        trended = {self.cls[g] for g in own if g in sample}
        knots = {g for g in own if g in sample or self.cls[g] not in trended}
        self.intercepts: dict[str, list[tuple[int, float]]] = {}
        for g in knots:
            self.intercepts.setdefault(self.cls[g], []).append(own[g])
        for v in self.intercepts.values():
            v.sort()
        departures: dict[tuple[int, str], list[float]] = {}
        for g, (layer, b) in own.items():
            part = sublayer(self.cls[g])
            if g not in knots and part is not None:
                departures.setdefault((layer, part), []).append(b - self._intercept(g)[0])
        self.block_effect = {k: float(np.mean(v)) for k, v in departures.items()}

    def __call__(self, g: str, t: str) -> Prediction:
        err = self.error[(g, t)]
        if err <= 0:
            return 0.0, "no weighted quantization error (the tensor's own encoding)"
        le, pts, a = math.log(err), self.points[g], self.alpha[self.cls[g]]
        if pts:
            below = [p for p in pts if p[0] <= le]
            above = [p for p in pts if p[0] >= le]
            if below and above and above[0][0] > below[-1][0]:
                (e0, k0, t0), (e1, k1, t1) = below[-1], above[0]
                return (math.exp(k0 + (k1 - k0) * (le - e0) / (e1 - e0)),
                        f"interpolated between the {t0} and {t1} measurements on log KLD vs log weighted "
                        f"quantization error ({err:.4g})")
            e0, k0, t0 = min(pts, key=lambda p: abs(p[0] - le))
            return (math.exp(k0 + a * (le - e0)),
                    f"the {t0} measurement x (weighted quantization error {err:.4g} / {math.exp(e0):.4g})^{a:.2f} "
                    f"(alpha of {self.cls[g]})")
        b, where = self._intercept(g)
        part, layer = sublayer(self.cls[g]), self.layer[g]
        effect = self.block_effect.get((layer, part), 0.0) if part is not None and layer is not None else 0.0
        if effect:
            b += effect
            where += f", {effect:+.3f} for the departure of blk.{layer}'s measured {part}* tensors from their trends"
        return math.exp(b + a * le), (f"{where}: log KLD = {b:.3f} + {a:.2f} log weighted quantization error "
                                      f"({err:.4g})")

    def _intercept(self, g: str) -> tuple[float, str]:
        """The group's b interpolated over the measured blocks of its class, and whence."""
        known = self.intercepts.get(self.cls[g], [])
        layer = self.layer[g]
        if not known or layer is None:
            every = [b for v in self.intercepts.values() for _, b in v]
            return float(np.median(every)) if every else math.log(KLD_FLOOR), "the median of every measured class"
        # the first block is no guide to its neighbours (the module's docstring)
        first = self.first_block[self.cls[g]]
        if layer != first:
            known = [k for k in known if k[0] != first] or known
        lower = [k for k in known if k[0] <= layer]
        upper = [k for k in known if k[0] >= layer]
        if lower and upper and upper[0][0] > lower[-1][0]:
            (l0, b0), (l1, b1) = lower[-1], upper[0]
            return (b0 + (b1 - b0) * (layer - l0) / (l1 - l0),
                    f"interpolated between blk.{l0} and blk.{l1} of {self.cls[g]}")
        l0, b0 = (lower or upper)[-1 if lower else 0]
        return b0, f"blk.{l0} of {self.cls[g]}"


def near_frontier(current: tuple[int, float], other: tuple[int, float], lam: float, spread: float) -> bool:
    """Whether a prediction off by a factor `spread` could make a group choose `other` (bits, KLD) instead of
    `current` at the multiplier `lam` (KLD per bit): an upgrade that saves at least lam/spread per added bit, a
    downgrade that loses at most lam x spread per bit saved."""
    (b0, k0), (b1, k1) = current, other
    if b1 == b0:
        return k1 <= k0 * spread
    rate = (k0 - k1) / (b1 - b0) if b1 > b0 else (k1 - k0) / (b0 - b1)
    return rate * spread >= lam if b1 > b0 else rate <= lam * spread

