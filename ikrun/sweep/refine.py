"""Refining a sweep's mix by measuring its most sensitive groups in place (`ikrun mix --refine N`).

A sweep measures each group alone, on top of the unquantized model; a mix predicts its KLD as the sum. In the
assembled mix the groups interact, so a group's cost at each type is re-measured on top of the mix itself: the
assembled model with that one group re-quantized (from the base's weights) to each swept type, against the base
logits. The difference to the mix's measured KLD replaces the group's sweep-alone figures relative to its chosen
type, and the optimizer chooses again. Layer-local propagation (stream.BlockInputs of the assembled model) keeps
each re-measurement to the blocks from the group on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ikquant.imatrix import Imatrix
from ikquant.mix import Option
from ikquant.types import type_by_name
from ikrun.eval.metrics import BaseLogitsFile
from ikrun.model import Model
from ikrun.sweep.measure import Measurer, prepare_candidate


def most_sensitive(choice: dict[str, Option], n: int) -> list[str]:
    """The `n` groups whose chosen types cost the most predicted KLD."""
    return sorted(choice, key=lambda g: (-choice[g].kld, g))[:n]


def refined_options(base_model: Model, mixed: Model, base: BaseLogitsFile, groups: dict[str, list[str]],
                    options: dict[str, list[Option]], choice: dict[str, Option], refine: list[str],
                    mix_kld: float, imatrix: Imatrix | None, spill_dir: Path | None = None,
                    on_measure: Callable[[str, str, float], None] | None = None, batch: int | None = None,
                    ) -> dict[str, list[Option]]:
    """`options` with the groups of `refine` re-costed on top of the assembled mix `mixed` (whose measured mean
    KLD is `mix_kld`): option t of group g costs choice[g].kld + KLD(mix with g at t) - mix_kld (at least 0);
    `batch`: each chunk fed that many tokens at a time, as the base was."""
    measurer = Measurer(mixed, base, spill_dir, batch=batch)
    out = dict(options)
    try:
        for g in refine:
            chosen, names = choice[g], groups[g]
            costs = []
            for o in options[g]:
                if o.type == chosen.type:
                    costs.append(o)
                    continue
                job = prepare_candidate(base_model, g, names, type_by_name(o.type), imatrix)
                row, _ = measurer.measure(job)
                delta = row.kld_mean - mix_kld
                if on_measure is not None:
                    on_measure(g, o.type, delta)
                costs.append(Option(o.type, o.bits, max(chosen.kld + delta, 0.0)))
            out[g] = costs
    finally:
        measurer.close()
    return out
