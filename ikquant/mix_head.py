"""The types of a model's NextN/MTP head chosen within a bound on the acceptance length its drafts may lose.

A head is measured by what its users get from it, tokens per target step, not by the model's KLD (which never reads
it): `ikrun sweep T --metric acceptance --mtp` records each head tensor's loss at each type, and the head's types are
the fewest bits whose predicted loss (the sum of the tensors' losses, each measured alone; noise below zero counts as
no loss) stays within `--max-acceptance-loss`. The choice is greedy: every tensor starts at its least-loss type, then
the downgrade that saves the most bits per loss added and still fits is taken, until none fits. The rest of the file
is typed as without the head sweep (a KLD sweep's mix, or the recipe), with the head's bits counted as fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ikquant.errors import MixError
from ikquant.mix import Option, read_sweep
from ikquant.sweepfile import read_sweep_file

#: losses within this of the bound fit it (sums of a few float losses)
LOSS_SLACK = 1e-12


@dataclass
class HeadMix:
    """The head's chosen option per group, and what the choice predicts."""

    choice: dict[str, Option]
    groups: dict[str, list[str]]
    max_loss: float
    #: the head sweep's decoding (prompts, max_new, n_max, p_min, the target's fingerprint): what to measure it on
    decoding: dict = field(default_factory=dict)  # type: ignore[type-arg]

    @property
    def predicted_loss(self) -> float:
        return sum(o.kld for o in self.choice.values())

    @property
    def bits(self) -> int:
        return sum(o.bits for o in self.choice.values())

    @property
    def tensor_types(self) -> dict[str, str]:
        return {name: o.type for g, o in self.choice.items() for name in self.groups[g]}


def read_head_sweep(path: Path, tensors: set[str]) -> tuple[dict[str, list[str]], dict[str, list[Option]], dict]:  # type: ignore[type-arg]
    """The groups and options of an `ikrun sweep --metric acceptance --mtp` file, and its decoding (prompts,
    max_new, n_max, p_min) to measure the result with; any other sweep, or one of a head `tensors` (the model's)
    lack, is refused."""
    header = read_sweep_file(Path(path))[0]
    decoding = header.get("decoding") or {}
    if header.get("metric") != "acceptance" or "mtp" not in decoding:
        raise MixError(f"--mtp-sweep {path}: not an `ikrun sweep --metric acceptance --mtp` result (metric "
                       f"{header.get('metric', 'kld')!r}{'' if 'mtp' in decoding else ', no NextN head decoding'})")
    groups, options, _ = read_sweep(Path(path))
    missing = sorted(n for names in groups.values() for n in names if n not in tensors)
    if missing:
        raise MixError(f"--mtp-sweep {path}: tensor {missing[0]!r} is not in the model: a sweep of another model's "
                       "head?")
    return groups, options, decoding


def choose_head(groups: dict[str, list[str]], options: dict[str, list[Option]], max_loss: float,
                sweep_name: str) -> HeadMix:
    """The head's types of fewest bits whose predicted acceptance loss is at most `max_loss`."""
    if not max_loss >= 0:
        raise MixError(f"--max-acceptance-loss {max_loss:g}: a loss of tokens per step is 0 or more")
    choice = {g: min(opts, key=lambda o: (o.kld, o.bits)) for g, opts in options.items()}
    head = HeadMix(choice, groups, max_loss)
    if head.predicted_loss > max_loss + LOSS_SLACK:
        raise MixError(f"--max-acceptance-loss {max_loss:g}: the head's least-loss types already lose "
                       f"{head.predicted_loss:.4f} tokens per step in {sweep_name} (sweep higher types)")
    while True:
        room = max_loss + LOSS_SLACK - head.predicted_loss
        steps = [(o.kld - choice[g].kld, choice[g].bits - o.bits, g, o) for g, opts in options.items() for o in opts
                 if o.bits < choice[g].bits and o.kld - choice[g].kld <= room]
        if not steps:
            return head
        _, _, g, o = max(steps, key=lambda s: (s[1] / s[0] if s[0] > 0 else float("inf"), s[1]))
        choice[g] = o
