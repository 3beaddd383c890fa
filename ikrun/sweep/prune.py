"""Fewer measurements for the same mix: `ikrun sweep --target-bpw B1,B2` measures only what can change the mixes at
those budgets and predicts the rest.

A measurement costs a partial forward; a quantization costs far less, and a quantization of a few hundred rows
less still. So every (group, type) gets a prior, its importance-weighted squared quantization error estimated on
a sample of its rows (a quantize and a dequantize: sum over columns of the imatrix's mean squared activation times
the squared weight error, or the plain squared error without an imatrix). Each group
is then measured at one anchor type (the cheapest swept type: the largest, least noisy effect), which gives its
sensitivity (measured KLD per unit of weighted error); another type's KLD is predicted as sensitivity x its error,
the sensitivity taken from the group's measured type nearest in error (the anchor at first). The mixes at the
budgets are chosen from these costs by the mix's own function under the mix's constraints (ties, bounds and the
exchange repair: ikquant/mix_constraints.py, ikquant/mix.py), and each chosen (group, type) not measured yet is
measured and the mixes chosen again, until every type the mixes choose was measured. The rest are written
as predicted rows ("measured": false, with the prediction and its basis).

With `--resolution K` (after `--prediction-spread`) an option near the frontier is measured only when its predicted
KLD differs from the chosen option's by more than K standard errors of a measurement (the group's measured rows'
median `kld_added_sem`, the paired error of what a swap adds): measuring options closer than that would only pick
between figures the measurement cannot tell apart.

Under the constraints a tie is one choice: its groups are anchored at the cheapest type all of them may take and
measured together at every type the mix chooses for the tie; a bounded group is anchored at its cheapest allowed
type and never measured below its bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from ikquant.errors import IkError
from ikquant.imatrix import Imatrix
from ikquant.mix import Mix, Option, choose_mix
from ikquant.mix_constraints import MixConstraints, constrained
from ikquant.types import GGMLType
from ikrun.errors import SweepError
from ikrun.model import Model
from ikrun.sweep.measure import SweepRow, quantized_copy, stored_type
from ikrun.sweep.predict import Predictor, exponent_groups, near_frontier, sampled_groups

#: rows of a tensor its prior quantizes (spread evenly over its importance slices): the prior serves ratios between
#: types and between groups, which a sample of rows gives; quantizing every row at every type costs as much as all
#: the quantizations of an exhaustive sweep
PRIOR_SAMPLE_ROWS = 256


@dataclass(frozen=True)
class Prior:
    """What a quantization alone says of a (group, type): the types stored, their bytes, the weighted error."""

    type_used: str
    bytes_new: int
    error: float
    fallback: str | None


def stored_bytes(model: Model, name: str, gtype: GGMLType) -> int:
    """The bytes tensor `name` takes when a sweep asks for `gtype` (no quantization needed)."""
    info = model.weights.info(name)
    used, _ = stored_type(model, name, gtype)
    source = model.weights.source_encoding(name)
    return int(source.raw.nbytes) if used is source.type else used.row_bytes(info.n_per_row) * info.n_rows


def sampled_rows(n_rows: int, slices: int, row_group: int, sample: int) -> np.ndarray:
    """About `sample` row indices (all when there are no more), the same share of every importance slice, in
    whole groups of `row_group` rows (an interleaved type quantizes no fewer), evenly spaced within each slice."""
    per_slice = n_rows // slices
    groups_per_slice = per_slice // row_group
    take = min(groups_per_slice, max(1, -(-sample // (slices * row_group))))
    starts = np.linspace(0, groups_per_slice, take, endpoint=False).astype(np.int64) * row_group
    rows = (np.arange(slices)[:, None] * per_slice + starts[None, :])[..., None] + np.arange(row_group)
    return rows.reshape(-1)


def weighted_error(model: Model, name: str, gtype: GGMLType, imatrix: Imatrix | None,
                   sample: int = PRIOR_SAMPLE_ROWS) -> float:
    """Sum over the tensor's weights of (importance of the column) x (quantized - base)^2, estimated from about
    `sample` of its rows (sampled_rows; each slice's sum scaled to all its rows; exact when it has no more)."""
    info = model.weights.info(name)
    n = info.n_per_row
    used, _ = stored_type(model, name, gtype)
    source = model.weights.source_encoding(name)
    if used is source.type:
        return 0.0
    n_mat = info.ne[2] if len(info.ne) > 2 else 1
    weights = imatrix.lookup(name, n, n_mat, info.n_rows)[0] if imatrix is not None else None
    slices = weights.shape[0] if weights is not None else n_mat
    rows = sampled_rows(info.n_rows, slices, used.row_group, sample)
    codec = used.require_codec()
    if len(rows) == info.n_rows:
        x = source.type.require_codec().dequantize(source.raw, n)
        q = codec.dequantize(quantized_copy(model, name, gtype, imatrix)[1], n)
    else:
        x = source.type.require_codec().dequantize(source.raw[rows], n)
        per_slice = len(rows) // slices
        q = np.concatenate([codec.dequantize(codec.quantize(x[k * per_slice:(k + 1) * per_slice],
                                                            None if weights is None else weights[k]), n)
                            for k in range(slices)])
    d2 = (q.astype(np.float64) - x.astype(np.float64)) ** 2
    if weights is not None:
        d2 *= weights[rows // (info.n_rows // slices)]
    return float(d2.sum()) * info.n_rows / len(rows)


def priors(model: Model, groups: dict[str, list[str]], types: list[GGMLType], imatrix: Imatrix | None,
           ) -> dict[tuple[str, str], Prior]:
    """Every (group, type)'s prior."""
    out = {}
    for g, names in groups.items():
        for t in types:
            used = [stored_type(model, n, t) for n in names]
            why = "; ".join(w for _, w in used if w) or None
            out[(g, t.name)] = Prior("+".join(sorted({u.name for u, _ in used})),
                                     sum(stored_bytes(model, n, t) for n in names),
                                     sum(weighted_error(model, n, t, imatrix) for n in names), why)
    return out


def budget_bits(model: Model, groups: dict[str, list[str]], bpw: float) -> float:
    """The bits the swept groups may take for a whole file of `bpw` bits per weight (the other tensors as stored)."""
    swept = {n for names in groups.values() for n in names}
    names = model.weights.names()
    n_weights = sum(model.weights.info(n).n_elements for n in names)
    fixed = sum(8 * model.weights.source_encoding(n).raw.nbytes for n in names if n not in swept)
    return bpw * n_weights - fixed


class Decision:
    """The pruned sweep's choices made as the mix makes them: the groups' options (priced per stored type, as the
    sweep file gives them to `ikrun mix`) under the mix's constraints, and the way back from a tie's chosen option
    to each of its groups' asked type."""

    def __init__(self, model: Model, groups: dict[str, list[str]], types: list[GGMLType],
                 constraints: MixConstraints):
        self.model, self.groups, self.types, self.constraints = model, groups, types, constraints
        self.stored = {(g, t.name): _stored_name(model, names, t) for g, names in groups.items() for t in types}
        self.bits = {(g, t.name): 8 * sum(stored_bytes(model, n, t) for n in names)
                     for g, names in groups.items() for t in types}
        self.row_length = {n: model.weights.info(n).n_per_row for names in groups.values() for n in names}
        self.group_of = {n: g for g, names in groups.items() for n in names}

    def options(self, cost: Callable[[str, str], float]) -> tuple[dict[str, list[str]], dict[str, list[Option]]]:
        """The constrained units (a tie's groups merged) and their options, each (group, type) at `cost`."""
        options = {g: [Option(self.stored[(g, t.name)], self.bits[(g, t.name)], cost(g, t.name)) for t in self.types]
                   for g in self.groups}
        return constrained(self.groups, options, self.constraints, self.row_length)

    def members(self, unit: list[str], option: Option) -> set[tuple[str, str]]:
        """The (group, asked type) pairs a unit's option stands for: each of its groups at the first swept type
        stored as the option's type."""
        out = set()
        for g in dict.fromkeys(self.group_of[n] for n in unit):
            out.add((g, next(t.name for t in self.types if self.stored[(g, t.name)] == option.type)))
        return out

    def anchors(self) -> set[tuple[str, str]]:
        """Each unit's cheapest allowed option, for all its groups."""
        units, options = self.options(lambda g, t: 0.0)
        return {key for u, names in units.items() for key in self.members(names, min(options[u], key=lambda o: o.bits))}

    def seconds(self) -> set[tuple[str, str]]:
        """Each unit's middle option by bits (a second type for the class's exponent), for all its groups."""
        units, options = self.options(lambda g, t: 0.0)
        out = set()
        for u, names in units.items():
            ordered = sorted(options[u], key=lambda o: o.bits)
            if len(ordered) > 1:
                out |= self.members(names, ordered[len(ordered) // 2])
        return out

    def near(self, cost: Callable[[str, str], float], bpws: list[float], spread: float,
             floor: Callable[[list[str]], float] = lambda unit: 0.0) -> tuple[set[tuple[str, str]], int]:
        """The (group, type) pairs of the units whose choice a prediction off by `spread` could change at a budget:
        the chosen option and every option near it at the budget's multiplier (predict.near_frontier) whose KLD
        differs from the chosen one's by more than `floor(unit)`; and how many options near the frontier were left
        out by that floor."""
        units, options = self.options(cost)
        out: set[tuple[str, str]] = set()
        unresolved: set[tuple[str, str]] = set()
        for bpw in bpws:
            mix = self._mix(units, options, bpw)
            for u, o in mix.choice.items():
                near = [x for x in options[u]
                        if x != o and near_frontier((o.bits, o.kld), (x.bits, x.kld), mix.lam, spread)]
                least = floor(units[u]) if near else 0.0
                close = [x for x in near if abs(x.kld - o.kld) > least]
                unresolved |= {(u, x.type) for x in near if x not in close}
                for x in close + ([o] if close else []):
                    out |= self.members(units[u], x)
        return out, len(unresolved)

    def _mix(self, units: dict[str, list[str]], options: dict[str, list[Option]], bpw: float) -> Mix:
        try:
            return choose_mix(units, options, budget_bits(self.model, self.groups, bpw))
        except IkError as exc:
            raise SweepError(f"--target-bpw {bpw:g}: {exc}") from None

    def chosen(self, cost: Callable[[str, str], float], bpws: list[float]) -> set[tuple[str, str]]:
        """The (group, type) pairs the mixes at `bpws` choose with these costs."""
        units, options = self.options(cost)
        out = set()
        for bpw in bpws:
            mix = self._mix(units, options, bpw)
            out |= {key for u, o in mix.choice.items() for key in self.members(units[u], o)}
        return out

    def check_budgets(self, bpws: list[float]) -> None:
        """Refuse a --target-bpw the swept types cannot reach under the constraints, before anything is measured."""
        _, options = self.options(lambda g, t: 0.0)
        least = sum(min(o.bits for o in opts) for opts in options.values())
        most = sum(max(o.bits for o in opts) for opts in options.values())
        for bpw in bpws:
            bits = budget_bits(self.model, self.groups, bpw)
            if not least <= bits <= most:
                side = "below the cheapest" if bits < least else "above the most expensive"
                raise SweepError(f"--target-bpw {bpw:g} is {side} mix of the swept types"
                                 + (" under --min-type" if self.constraints.min_types else ""))


def _stored_name(model: Model, names: list[str], gtype: GGMLType) -> str:
    return "+".join(sorted({stored_type(model, n, gtype)[0].name for n in names}))


def check_budgets(model: Model, groups: dict[str, list[str]], types: list[GGMLType], bpws: list[float],
                  constraints: MixConstraints) -> None:
    """Refuse a --target-bpw the swept types cannot reach (under the constraints), or constraints the mix would
    refuse, before anything is measured."""
    Decision(model, groups, types, constraints).check_budgets(bpws)


@dataclass(frozen=True)
class Pruning:
    """What a pruned sweep is asked for (`ikrun sweep --target-bpw ... [--prediction-spread F] [--resolution K]`)."""

    bpws: list[float]
    constraints: MixConstraints
    spread: float | None = None
    resolution: float = 0.0

    def header(self) -> dict:  # type: ignore[type-arg]
        """The sweep file's header entries that say how it was pruned."""
        return {"target_bpw": self.bpws, "constraints": asdict(self.constraints),
                **({"prediction_spread": self.spread} if self.spread is not None else {}),
                **({"resolution": self.resolution} if self.resolution > 0 else {})}


@dataclass
class PrunedSweep:
    """The rows (measured and predicted), and what the pruning saved and how good its predictions were."""

    rows: list[SweepRow]
    n_measured: int
    n_predicted: int
    #: (predicted, measured) mean KLD of the rows measured besides the anchors
    checks: list[tuple[float, float]]
    #: the batches of measurements asked for (the anchors, then one per choice that met unmeasured types)
    rounds: int = 0
    #: with --prediction-spread: the spread, and the groups sampled of all
    spread: float | None = None
    sampled: tuple[int, int] | None = None
    #: with --resolution: the standard errors asked for, and the options near the frontier (at the last choice)
    #: left unmeasured because their predicted KLD was within that many of the chosen option's
    resolution: float = 0.0
    unresolved: int = 0

    def summary(self) -> str:
        total = self.n_measured + self.n_predicted
        text = (f"--target-bpw: measured {self.n_measured} of {total} (group, type) candidates, predicted "
                f"{self.n_predicted} ({100 * self.n_predicted / max(total, 1):.0f}% skipped) in {self.rounds} "
                "rounds of measurements")
        if self.spread is not None and self.sampled is not None:
            text += (f"; spread {self.spread:g}: {self.sampled[0]} of {self.sampled[1]} groups sampled, the rest "
                     "measured only near the frontier")
        if self.resolution > 0:
            text += (f"; resolution {self.resolution:g}: {self.unresolved} options near the frontier not measured, "
                     f"their predicted KLD within {self.resolution:g} standard errors of a measurement of the "
                     "chosen one's")
        ratios = [m / p for p, m in self.checks if p > 0 and m > 0]
        if ratios:
            logs = np.abs(np.log(ratios))
            text += (f"; on the {len(ratios)} measured besides the anchors, measured/predicted median "
                     f"{float(np.median(ratios)):.3f}, median |log ratio| {float(np.median(logs)):.3f}, within "
                     f"2x: {100 * float(np.mean(logs <= math.log(2))):.0f}%")
        return text


def run_pruned_sweep(model: Model, groups: dict[str, list[str]], types: list[GGMLType], imatrix: Imatrix | None,
                     bpws: list[float], done: list[SweepRow],
                     measure: Callable[[set[tuple[str, str]]], list[SweepRow]],
                     constraints: MixConstraints | None = None, spread: float | None = None,
                     resolution: float = 0.0) -> PrunedSweep:
    """The pruned sweep: `measure(jobs)` measures those (group, type) pairs (and records the rows); `done` holds
    rows an earlier run measured; the budgets must be reachable (check_budgets); the mixes are chosen under
    `constraints` (default: the mix's default ties). With `spread` only the sampled blocks are measured first (at
    one type, a second for the class's exponent: predict.exponent_groups) and then only the options near the
    mixes' frontier (ikrun/sweep/predict.py), and of those (`resolution` > 0) only the ones whose predicted KLD
    differs from the chosen option's by more than `resolution` standard errors of a measurement: a difference
    the measurement cannot resolve is one the mix cannot choose by."""
    decision = Decision(model, groups, types, constraints or MixConstraints())
    prior = priors(model, groups, types, imatrix)
    measured = {r.key: r for r in done if r.measured}
    rounds = 0

    def run(jobs: set[tuple[str, str]]) -> None:
        nonlocal rounds
        if jobs:
            rounds += 1
            for r in measure(jobs):
                measured[r.key] = r

    def nearest(g: str, tname: str) -> tuple[float, str]:
        """The KLD of (g, tname) from the group's measured type of the nearest weighted error (log scale), and its
        basis."""
        err = prior[(g, tname)].error
        known = [(t.name, prior[(g, t.name)].error) for t in types if (g, t.name) in measured]
        ref, ref_err = min(known, key=lambda k: abs(math.log((k[1] + 1e-300) / (err + 1e-300))))
        kld = max(measured[(g, ref)].cost, 0.0)
        basis = f"the {ref} measurement x weighted quantization error {err:.4g} / {ref_err:.4g} at {ref}"
        return (kld * err / ref_err, basis) if ref_err > 0 else (kld, f"the {ref} measurement (no error there)")

    def sampled() -> Predictor:
        return Predictor(groups, [t.name for t in types], {k: p.error for k, p in prior.items()},
                         {k: r.cost for k, r in measured.items()})

    predicted: Callable[[str, str], tuple[float, str]] = nearest
    sample: set[str] = set()
    if spread is None:
        run(decision.anchors() - measured.keys())
    else:
        sample, second = sampled_groups(groups), exponent_groups(groups)
        run(({key for key in decision.anchors() if key[0] in sample}
             | {key for key in decision.seconds() if key[0] in second}) - measured.keys())
        predicted = sampled()

    def cost(g: str, tname: str) -> float:
        return max(measured[(g, tname)].cost, 0.0) if (g, tname) in measured else predicted(g, tname)[0]

    def noise_floor() -> Callable[[list[str]], float]:
        """`resolution` standard errors of a measurement of a unit's KLD, from the rows measured so far: each
        group's median over its measured rows (all groups' median for a group not measured yet), added in
        quadrature over the unit's groups."""
        by_group: dict[str, list[float]] = {}
        for (g, _), r in measured.items():
            by_group.setdefault(g, []).append(r.kld_added_sem)
        fallback = float(np.median([r.kld_added_sem for r in measured.values()])) if measured else 0.0
        sem = {g: float(np.median(v)) for g, v in by_group.items()}

        def floor(unit: list[str]) -> float:
            groups_of = dict.fromkeys(decision.group_of[n] for n in unit)
            return resolution * math.sqrt(sum(sem.get(g, fallback) ** 2 for g in groups_of))

        return floor

    forecast: dict[tuple[str, str], tuple[float, str]] = {}  # what was predicted of a row before it was measured
    unresolved = 0
    while True:
        if spread is None:
            wanted = decision.chosen(cost, bpws)
        else:
            wanted, unresolved = decision.near(cost, bpws, spread, noise_floor())
        missing = wanted - measured.keys()
        if not missing:
            break
        forecast.update({key: predicted(*key) for key in missing})
        run(missing)
        if spread is not None:
            predicted = sampled()
    rows, checks = [], []
    for g, names in groups.items():
        for t in types:
            key = (g, t.name)
            if key in measured:
                row = measured[key]
                if key in forecast:
                    row.prediction, row.basis = forecast[key]
                    checks.append((row.prediction, row.cost))
                rows.append(row)
                continue
            p = prior[key]
            kld, basis = predicted(g, t.name)
            n_weights = sum(model.weights.info(n).n_elements for n in names)
            nan = float("nan")
            rows.append(SweepRow(g, names, t.name, p.type_used, n_weights,
                                 sum(model.weights.source_encoding(n).raw.nbytes for n in names), p.bytes_new,
                                 8.0 * p.bytes_new / n_weights, kld, nan, nan, nan, nan, nan, nan, 0.0, p.fallback,
                                 measured=False, prediction=kld, basis=basis, kld_added=kld))
    n_measured = sum(1 for r in rows if r.measured)
    return PrunedSweep(rows, n_measured, len(rows) - n_measured, checks, rounds, spread,
                       None if spread is None else (len(sample), len(groups)), resolution, unresolved)
