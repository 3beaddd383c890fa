"""Choosing a per-tensor type mix from a sensitivity sweep, to meet a bits-per-weight budget.

Model of the cost: the KL-divergence of a mix is predicted as the sum of the per-group KLDs measured one group at a
time (`ikrun sweep`). Interactions between tensors are ignored, so the prediction is a first-order estimate; measure
the result with `ikrun kld`. The choice is a multiple-choice knapsack: minimise the sum of KLDs subject to the
total bits, solved by Lagrangian relaxation (each group picks argmin KLD + lambda*bits; lambda bisected to the
budget), then leftover bits spent on the upgrades with the best KLD saved per bit, then an exchange repair: the
single change or the pair of changes (one group up, another down) that lowers the predicted KLD most within the
budget, repeated until none does (the greedy steps stop at the first upgrade that does not fit; a pair frees the
bits for it). Constraints (tie groups, lower bounds per class) are applied to the options first
(mix_constraints.py).

A group with no real cost is not chosen for: the tensors a sweep lists as `unmeasured` (the measured forward never
reads them) and, in a KLD sweep, groups whose every measured cost is exactly zero (a swap that changed no logit: an
older sweep of an unread tensor; in a file older than `kld_added`, zero or below; an acceptance sweep's drafter reads
every tensor it swaps, and a zero loss there is a measured one). They keep the recipe's type, as unswept tensors do; `read_sweep` names them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ikquant.errors import MixError, SweepFileError
from ikquant.sweepfile import DEFAULTS, METRICS, read_sweep_file

if TYPE_CHECKING:
    from ikquant.mix_constraints import MixConstraints
    from ikquant.quantize import QuantizeOptions
    from ikquant.shards import GGUFModel


@dataclass(frozen=True)
class Option:
    type: str  # the type actually stored (after ik's row-length fallback)
    bits: int
    kld: float
    #: the weights the sweep measured the group's tensors with (None: not from a sweep file)
    n_weights: int | None = None


@dataclass
class Mix:
    choice: dict[str, Option]  # group -> chosen option
    groups: dict[str, list[str]]  # group -> tensor names
    predicted_kld: float
    bits: int
    #: the predicted KLD of the greedy choice before the exchange repair, and the repair's number of exchanges
    greedy_kld: float = 0.0
    exchanges: int = 0
    #: the Lagrange multiplier at the budget (predicted KLD per bit): an upgrade saving less than this per bit
    #: it costs was not worth its bits
    lam: float = 0.0

    def tensor_types(self) -> dict[str, str]:
        return {name: opt.type for g, opt in self.choice.items() for name in self.groups[g]}


def read_sweep(path: Path) -> tuple[dict[str, list[str]], dict[str, list[Option]], dict[str, str]]:
    """Groups and their measured options from an `ikrun sweep` file (.json or .csv); an option's `kld` is the
    metric's cost (mean KLD, or a draft's acceptance-length loss for `--metric acceptance` sweeps); and the tensors
    left to the recipe's type, with why (the module docstring)."""
    try:
        header, rows = read_sweep_file(Path(path))
    except SweepFileError as exc:
        raise MixError(f"--sweep {exc}") from None
    metric = header.get("metric", DEFAULTS["metric"])
    cost = header.get("cost") or METRICS[metric]
    groups: dict[str, list[str]] = {}
    options: dict[str, list[Option]] = {}
    for r in rows:
        if "+" in r["type_used"]:
            raise MixError(f"--sweep {path}: group {r['group']!r} mixes types ({r['type_used']}); sweep with --group "
                           "tensor to choose per tensor")
        groups[r["group"]] = r["tensors"]
        options.setdefault(r["group"], []).append(Option(r["type_used"], 8 * r["bytes_new"], max(r[cost], 0.0),
                                                         r["n_weights"]))
    if not options:
        raise MixError(f"--sweep {path}: no measurements")
    unmeasured = {str(n): str(why) for n, why in header.get("unmeasured", {}).items()}
    # a drafter reads every tensor it is swept by; a KLD measured against the model's own KLD is exactly 0 where
    # the swap changed nothing, and may be a little below 0 where it changed too little to measure
    zero_is_unread = metric == "kld"
    changed = {r["group"] for r in rows if r[cost] != 0.0} if cost == "kld_added" else \
        {r["group"] for r in rows if r[cost] > 0.0}
    for g in [g for g in options if zero_is_unread and g not in changed]:
        unmeasured.update({n: "every measured type cost nothing: the forward may not read it" for n in groups[g]})
    for g in [g for g, names in groups.items() if any(n in unmeasured for n in names)]:
        del groups[g], options[g]
    if not options:
        raise MixError(f"--sweep {path}: no group has a measured cost")
    return groups, options, unmeasured


def loadable_by_mainline(options: dict[str, list[Option]], sweep_name: str) -> dict[str, list[Option]]:
    """Each group's measured options of types mainline llama.cpp loads (a group with none is an error)."""
    from ikquant.recipes_mainline import MAINLINE_TYPES

    kept = {g: [o for o in opts if o.type in MAINLINE_TYPES] for g, opts in options.items()}
    empty = [g for g, opts in kept.items() if not opts]
    if empty:
        raise MixError(f"--sweep {sweep_name}: group {empty[0]!r} was measured only at ik-only types "
                       f"({', '.join(o.type for o in options[empty[0]])}); sweep mainline types (Q4_K, IQ4_XS, ...) "
                       "for --recipe mainline")
    return kept


def _pick(options: dict[str, list[Option]], lam: float) -> dict[str, Option]:
    return {g: min(opts, key=lambda o: (o.kld + lam * o.bits, o.bits)) for g, opts in options.items()}


def choose_mix(groups: dict[str, list[str]], options: dict[str, list[Option]], budget_bits: float) -> Mix:
    """The mix of least predicted KLD whose swept groups take at most `budget_bits`."""
    cheapest = sum(min(o.bits for o in opts) for opts in options.values())
    if cheapest > budget_bits:
        raise MixError(f"the budget leaves {budget_bits / 8e6:.3f} MB for the swept tensors, but even their cheapest "
                       f"measured types take {cheapest / 8e6:.3f} MB")
    lo, hi = 0.0, 1.0
    while sum(o.bits for o in _pick(options, hi).values()) > budget_bits:
        hi *= 4
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(o.bits for o in _pick(options, mid).values()) > budget_bits:
            lo = mid
        else:
            hi = mid
    choice = _pick(options, hi)
    used = sum(o.bits for o in choice.values())
    while True:
        best = None
        for g, opts in options.items():
            cur = choice[g]
            for o in opts:
                extra = o.bits - cur.bits
                if o.kld < cur.kld and extra > 0 and used + extra <= budget_bits:
                    gain = (cur.kld - o.kld) / extra
                    if best is None or gain > best[0]:
                        best = (gain, g, o)
        if best is None:
            break
        _, g, o = best
        used += o.bits - choice[g].bits
        choice[g] = o
    greedy = sum(o.kld for o in choice.values())
    exchanges = exchange_repair(options, choice, budget_bits)
    return Mix(choice, groups, sum(o.kld for o in choice.values()), sum(o.bits for o in choice.values()), greedy,
               exchanges, hi)


#: at most this many exchanges per group (each lowers the predicted KLD, so the repair ends anyway; this bounds it)
MAX_EXCHANGES_PER_GROUP = 8


def exchange_repair(options: dict[str, list[Option]], choice: dict[str, Option], budget_bits: float) -> int:
    """Improve `choice` in place: apply the single change, or the pair of changes in two groups (one up, one down),
    that lowers the predicted KLD most and keeps the bits within the budget, until none does. Returns the number of
    changes applied; the result is never worse than `choice` was."""
    names = list(options)
    applied = 0
    for _ in range(MAX_EXCHANGES_PER_GROUP * len(names)):
        used = sum(o.bits for o in choice.values())
        moves = [(k, o, o.bits - choice[g].bits, o.kld - choice[g].kld)
                 for k, g in enumerate(names) for o in options[g] if o != choice[g]]
        if not moves:
            break
        group = np.array([m[0] for m in moves])
        dbits = np.array([m[2] for m in moves], dtype=np.float64)
        dkld = np.array([m[3] for m in moves], dtype=np.float64)
        room = budget_bits - used
        single = np.where((dbits <= room) & (dkld < 0), dkld, np.inf)
        best_single = int(np.argmin(single))
        best_pair, pair_gain = _best_pair(group, dbits, dkld, room)
        if single[best_single] == np.inf and pair_gain == np.inf:
            break
        chosen = [best_single] if single[best_single] <= pair_gain else list(best_pair or ())
        for i in chosen:
            k, o, _, _ = moves[i]
            choice[names[k]] = o
            applied += 1
    return applied


def _best_pair(group: np.ndarray, dbits: np.ndarray, dkld: np.ndarray, room: float,
               ) -> tuple[tuple[int, int] | None, float]:
    """The pair of moves (an upgrade, a downgrade of another group) of least summed KLD change below 0 whose bits
    fit `room`, and that change (inf: none). The upgrades are sorted by bits with a running best and a running best
    of another group than the best's, so each downgrade finds its partner by one binary search: O(M log M) for M
    moves, where the full pair table of a DeepSeek-sized sweep would not fit in memory."""
    up, down = np.flatnonzero(dbits > 0), np.flatnonzero(dbits < 0)
    if not len(up) or not len(down):
        return None, np.inf
    up = up[np.argsort(dbits[up], kind="stable")]
    best = np.empty(len(up), dtype=np.int64)  # index into `up` of the least dkld so far
    second = np.full(len(up), -1, dtype=np.int64)  # the least dkld so far among other groups than best's
    b, c = 0, -1
    for i in range(len(up)):
        if dkld[up[i]] < dkld[up[b]]:
            if group[up[i]] != group[up[b]]:
                c = b
            b = i
        elif group[up[i]] != group[up[b]] and (c < 0 or dkld[up[i]] < dkld[up[c]]):
            c = i
        best[i], second[i] = b, c
    last = np.searchsorted(dbits[up], room - dbits[down], side="right") - 1
    ok = last >= 0
    last = np.maximum(last, 0)
    partner = np.where(group[up[best[last]]] != group[down], best[last], second[last])
    ok &= partner >= 0
    gain = np.where(ok, dkld[up[np.maximum(partner, 0)]] + dkld[down], np.inf)
    gain[gain >= 0] = np.inf
    k = int(np.argmin(gain))
    if gain[k] == np.inf:
        return None, np.inf
    return (int(up[partner[k]]), int(down[k])), float(gain[k])


@dataclass(frozen=True)
class Budget:
    """At most `bits` for the tensors whose names match `pattern` (None: every tensor no other budget matches)."""

    pattern: str | None
    bits: float

    @property
    def label(self) -> str:
        return self.pattern if self.pattern is not None else "rest"


def parse_budgets(values: list[str]) -> list[Budget]:
    """`--budget 'REGEX=SIZE'` values (`rest=SIZE` for the tensors no other budget matches)."""
    from ikquant.sizes import parse_size

    budgets = []
    for value in values:
        pattern, sep, size = value.rpartition("=")
        if not sep or not pattern:
            raise MixError(f"--budget {value!r} is not of the form REGEX=SIZE (e.g. 'ffn_.*_exps=180GiB', 'rest=22GiB')")
        if pattern != "rest":
            try:
                re.compile(pattern)
            except re.error as exc:
                raise MixError(f"--budget {value!r}: {pattern!r} is not a regular expression ({exc})") from None
        budgets.append(Budget(None if pattern == "rest" else pattern, 8 * parse_size(size, "--budget")))
    return budgets


def choose_mixes(tensor_bits: dict[str, int], groups: dict[str, list[str]], options: dict[str, list[Option]],
                 budgets: list[Budget]) -> list[tuple[Budget, Mix, int]]:
    """One mix per budget: each tensor belongs to the first budget whose regex finds it (else `rest`), the tensors
    no sweep group holds take their planned size (`tensor_bits`) from their budget's share, and each budget's
    swept groups are chosen for it alone. Returns (budget, its mix, its fixed bits)."""
    def owner(name: str) -> Budget:
        for b in budgets:
            if b.pattern is not None and re.search(b.pattern, name):
                return b
        rest = next((b for b in budgets if b.pattern is None), None)
        if rest is None:
            raise MixError(f"tensor {name!r} matches no --budget; add one for it or 'rest=SIZE'")
        return rest

    owners = {name: owner(name) for name in tensor_bits}
    for b in budgets:
        if b.pattern is not None and not any(o is b for o in owners.values()):
            raise MixError(f"--budget {b.pattern!r} matches no tensor of the model")
    results = []
    for b in budgets:
        mine = {g: names for g, names in groups.items() if owners[names[0]] is b}
        for g, names in mine.items():
            split = sorted({owners[n].label for n in names})
            if len(split) > 1:
                raise MixError(f"sweep group {g!r} spans budgets {', '.join(split)}; sweep with --group tensor")
        swept = {n for names in mine.values() for n in names}
        fixed = sum(bits for name, bits in tensor_bits.items() if owners[name] is b and name not in swept)
        if not mine:
            if fixed > b.bits:
                raise MixError(f"--budget {b.label}: its unswept tensors alone take {fixed / 8 / 2**30:.3f} GiB")
            results.append((b, Mix({}, {}, 0.0, 0), fixed))
            continue
        try:
            mix = choose_mix(mine, {g: options[g] for g in mine}, b.bits - fixed)
        except MixError as exc:
            if len(budgets) == 1:
                raise
            raise MixError(f"--budget {b.label}: {exc}") from None
        results.append((b, mix, fixed))
    return results


@dataclass(frozen=True)
class MixTarget:
    """What the mix must fit: exactly one of a whole-file bpw, a whole-file size, or per-group budgets."""

    bpw: float | None = None
    size: str | None = None
    budgets: tuple[str, ...] | list[str] = ()


@dataclass
class MixPlan:
    """The chosen mix: per budget (budget, mix, fixed bits), and every swept tensor's type."""

    results: list[tuple[Budget, Mix, int]]
    title: str
    n_weights: int
    total_bits: int
    #: every swept group's tensors, and its options, after the constraints (tied groups merged)
    groups: dict[str, list[str]] = field(default_factory=dict)
    options: dict[str, list[Option]] = field(default_factory=dict)

    @property
    def greedy_kld(self) -> float:
        return sum(m.greedy_kld for _, m, _ in self.results)

    @property
    def exchanges(self) -> int:
        return sum(m.exchanges for _, m, _ in self.results)

    @property
    def tensor_types(self) -> dict[str, str]:
        return {name: t for _, mix, _ in self.results for name, t in mix.tensor_types().items()}

    @property
    def predicted_kld(self) -> float:
        return sum(m.predicted_kld for _, m, _ in self.results)

    @property
    def choice(self) -> dict[str, Option]:
        return {g: o for _, mix, _ in self.results for g, o in mix.choice.items()}


def _check_reachable(target: MixTarget, bits: float, tensor_bits: dict[str, int], groups: dict[str, list[str]],
                     options: dict[str, list[Option]], n_weights: int) -> None:
    """Refuse a whole-file target below the cheapest mix the sweep allows or above its most expensive one (the
    unswept tensors at their planned types): one is impossible, the other would only take the largest types."""
    swept = {n for names in groups.values() for n in names}
    fixed = sum(b for name, b in tensor_bits.items() if name not in swept)
    least = fixed + sum(min(o.bits for o in opts) for opts in options.values())
    most = fixed + sum(max(o.bits for o in opts) for opts in options.values())
    if least <= bits <= most:
        return
    option, value = ("--target-bpw", f"{target.bpw:g}") if target.bpw is not None else ("--target-size", target.size)
    side, edge = ("below the cheapest", least) if bits < least else ("above the most expensive", most)
    raise MixError(f"{option} {value} is {side} mix the sweep allows ({edge / n_weights:.4f} bits per weight, "
                   f"{edge / 8 / 2**20:.3f} MiB of tensors)")


def plan_mix(source: GGUFModel, opts: QuantizeOptions, groups: dict[str, list[str]], options: dict[str, list[Option]],
             target: MixTarget, sweep_name: str, constraints: MixConstraints | None = None) -> MixPlan:
    """The mix for `source` quantized per `opts` (the unswept tensors' types) within `target`, under `constraints`
    (default: the default ties); for a mainline recipe only among the measured types mainline loads."""
    from ikquant.mix_constraints import MixConstraints, constrained
    from ikquant.quantize import make_plan
    from ikquant.sizes import parse_size

    if opts.recipe == "mainline":
        options = loadable_by_mainline(options, sweep_name)
    swept = {n for names in groups.values() for n in names}
    missing = sorted(swept - set(source.tensors))
    if missing:
        raise MixError(f"--sweep {sweep_name}: tensor {missing[0]!r} is not in {source.path}: a sweep of another "
                       "model?")
    for g, measured in options.items():
        n_weights = sum(source.tensors[n].n_elements for n in groups[g])
        if any(o.n_weights not in (None, n_weights) for o in measured):
            raise MixError(f"--sweep {sweep_name}: group {g!r} was measured with other shapes than {source.path}'s "
                           f"({n_weights} weights here): a sweep of another model")
    groups, options = constrained(groups, options, constraints or MixConstraints(),
                                  {n: source.tensors[n].n_per_row for n in swept})
    plan = make_plan(source, opts)
    n_weights = sum(p.info.n_elements for p in plan.tensors)
    tensor_bits = {p.name: 8 * p.new_bytes for p in plan.tensors}
    if target.bpw is not None:
        budgets, title = [Budget(None, target.bpw * n_weights)], f"type mix for {target.bpw:g} bits per weight"
    elif target.size is not None:
        budgets, title = [Budget(None, 8 * parse_size(target.size, "--target-size"))], f"type mix for {target.size}"
    else:
        budgets, title = parse_budgets(list(target.budgets)), "type mix per budget"
    if target.bpw is not None or target.size is not None:
        _check_reachable(target, budgets[0].bits, tensor_bits, groups, options, n_weights)
    results = choose_mixes(tensor_bits, groups, options, budgets)
    return MixPlan(results, title, n_weights, sum(fixed + mix.bits for _, mix, fixed in results), groups, options)
