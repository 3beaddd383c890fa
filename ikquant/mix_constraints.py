"""What a mix must respect besides its size: tie groups (tensors of one layer chosen as one type) and lower bounds
per tensor class (`--tie REGEX`, `--min-type REGEX=TYPE` on `ikquant --sweep` and `ikrun mix`).

Both act on the sweep's options before the choice: a bound removes a group's options below its type, a tie merges
the groups of one layer whose tensors a regex matches into one group whose options are the types every member was
measured at (cost and bits added up, as the mix's prediction adds them anyway).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ikquant.errors import MixError, UnknownTypeError
from ikquant.mix import Option
from ikquant.types import type_by_name

#: ties applied unless --no-default-ties: ik's fused MoE kernels run ffn_up_exps and ffn_gate_exps together when
#: they have one type (Thireus measured +20% prompt, +11% generation speed). attn_k_b/attn_v_b/attn_kv_b are not
#: tied by default: in DeepSeek-V3 their rows are 128 and 512 values long, so no tie of them holds (see --tie).
DEFAULT_TIES = (r"ffn_(up|gate)_exps",)


@dataclass(frozen=True)
class MixConstraints:
    """The user's --tie regexes, whether the default ties apply, and --min-type 'REGEX=TYPE' bounds."""

    ties: tuple[str, ...] = ()
    default_ties: bool = True
    min_types: tuple[str, ...] = ()


def _layer(name: str) -> str:
    m = re.match(r"blk\.(\d+)\.", name)
    return m.group(1) if m else ""


def apply_bounds(options: dict[str, list[Option]], groups: dict[str, list[str]], min_types: tuple[str, ...],
                 ) -> dict[str, list[Option]]:
    """Each group's options without those of fewer bits per weight than the first --min-type its tensors match."""
    bounds = []
    for value in min_types:
        pattern, sep, tname = value.rpartition("=")
        if not sep or not pattern:
            raise MixError(f"--min-type {value!r} is not of the form REGEX=TYPE (e.g. 'ffn_.*_exps=IQ2_KS')")
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise MixError(f"--min-type {value!r}: {pattern!r} is not a regular expression ({exc})") from None
        try:
            floor = type_by_name(tname)
        except UnknownTypeError:
            raise MixError(f"--min-type {value!r}: {tname!r} is not a type") from None
        if not any(rx.search(n) for names in groups.values() for n in names):
            raise MixError(f"--min-type {value!r}: {pattern!r} matches no swept tensor")
        bounds.append((value, rx, floor))
    out = dict(options)
    for g, names in groups.items():
        bound = next((b for b in bounds if any(b[1].search(n) for n in names)), None)
        if bound is None:
            continue
        value, _, floor = bound
        kept = [o for o in options[g] if type_by_name(o.type).bits_per_weight >= floor.bits_per_weight]
        if not kept:
            raise MixError(f"--min-type {value!r}: group {g!r} was measured only below {floor.name} "
                           f"({', '.join(o.type for o in options[g])})")
        out[g] = kept
    return out


def apply_ties(groups: dict[str, list[str]], options: dict[str, list[Option]], ties: tuple[str, ...],
               default_ties: bool, row_length: dict[str, int]) -> tuple[dict[str, list[str]], dict[str, list[Option]]]:
    """Groups and options with the groups of one layer that a tie regex matches (all their tensors) merged into one
    group ('a+b'), whose options are the stored types all members were measured at. A user's tie that matches no
    swept tensor, or ties tensors of different row lengths (no type is sure to fit all), is refused."""
    patterns = [(t, True) for t in ties] + [(t, False) for t in DEFAULT_TIES if default_ties and t not in ties]
    out_groups, out_options = dict(groups), dict(options)
    for pattern, given in patterns:
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise MixError(f"--tie {pattern!r} is not a regular expression ({exc})") from None
        units: dict[str, list[str]] = {}
        for g, names in out_groups.items():
            if all(rx.search(n) for n in names):
                units.setdefault(",".join(sorted({_layer(n) for n in names})), []).append(g)
        if not units:
            if given:
                raise MixError(f"--tie {pattern!r} matches no swept tensor (or only groups that also hold others)")
            continue
        for members in units.values():
            if len(members) < 2:
                continue
            names = [n for g in members for n in out_groups[g]]
            lengths = {n: row_length[n] for n in names}
            if len(set(lengths.values())) > 1:
                ordered = sorted(lengths.items(), key=lambda kv: kv[1])
                (a, la), (b, lb) = ordered[0], ordered[-1]
                raise MixError(f"--tie {pattern!r} ties {a} ({la} columns) and {b} ({lb} columns): tensors of "
                               "different shapes, no type is sure to fit both")
            common = set.intersection(*({o.type for o in out_options[g]} for g in members))
            if not common:
                raise MixError(f"--tie {pattern!r}: {', '.join(members)} were measured at no common type")
            merged = [Option(t, sum(_at(out_options[g], t).bits for g in members),
                             sum(_at(out_options[g], t).kld for g in members)) for t in sorted(common)]
            unit = "+".join(members)
            for g in members:
                del out_groups[g], out_options[g]
            out_groups[unit], out_options[unit] = names, merged
    return out_groups, out_options


def _at(opts: list[Option], tname: str) -> Option:
    """A group's option of stored type `tname` (the cheapest-cost one, if a fallback made two alike)."""
    return min((o for o in opts if o.type == tname), key=lambda o: (o.kld, o.bits))


def constrained(groups: dict[str, list[str]], options: dict[str, list[Option]], constraints: MixConstraints,
                row_length: dict[str, int]) -> tuple[dict[str, list[str]], dict[str, list[Option]]]:
    """The sweep's groups and options under `constraints`: bounds first (per measured group), then ties."""
    bounded = apply_bounds(options, groups, constraints.min_types)
    return apply_ties(groups, bounded, constraints.ties, constraints.default_ties, row_length)
