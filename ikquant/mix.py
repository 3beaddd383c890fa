"""Choosing a per-tensor type mix from a sensitivity sweep, to meet a bits-per-weight budget.

Model of the cost: the KL-divergence of a mix is predicted as the sum of the per-group KLDs measured one group at a
time (`ikrun sweep`). Interactions between tensors are ignored, so the prediction is a first-order estimate; measure
the result with `ikrun kld`. The choice is a multiple-choice knapsack: minimise the sum of KLDs subject to the
total bits, solved by Lagrangian relaxation (each group picks argmin KLD + lambda*bits; lambda bisected to the
budget), then leftover bits spent on the upgrades with the best KLD saved per bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ikquant.errors import IkError
from ikquant.sweepfile import SweepFileError, read_sweep_file


class MixError(IkError, ValueError):
    """A sweep that cannot serve this model or budget."""


@dataclass(frozen=True)
class Option:
    type: str  # the type actually stored (after ik's row-length fallback)
    bits: int
    kld: float


@dataclass
class Mix:
    choice: dict[str, Option]  # group -> chosen option
    groups: dict[str, list[str]]  # group -> tensor names
    predicted_kld: float
    bits: int

    def tensor_types(self) -> dict[str, str]:
        return {name: opt.type for g, opt in self.choice.items() for name in self.groups[g]}


def read_sweep(path: Path) -> tuple[dict[str, list[str]], dict[str, list[Option]]]:
    """Groups and their measured options from an `ikrun sweep` file (.json or .csv)."""
    try:
        _, rows = read_sweep_file(Path(path))
    except SweepFileError as exc:
        raise MixError(f"--sweep {exc}") from None
    groups: dict[str, list[str]] = {}
    options: dict[str, list[Option]] = {}
    for r in rows:
        if "+" in r["type_used"]:
            raise MixError(f"--sweep {path}: group {r['group']!r} mixes types ({r['type_used']}); sweep with --group "
                           "tensor to choose per tensor")
        groups[r["group"]] = r["tensors"]
        options.setdefault(r["group"], []).append(Option(r["type_used"], 8 * r["bytes_new"], r["kld_mean"]))
    if not options:
        raise MixError(f"--sweep {path}: no measurements")
    return groups, options


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
    return Mix(choice, groups, sum(o.kld for o in choice.values()), used)
