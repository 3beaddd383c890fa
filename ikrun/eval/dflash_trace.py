"""Where a DFlash draft's forward leaves its definition: every step's draft, layer by layer, against the
independent numpy reference of the draft's Hugging Face checkpoint (ikrun/validate/dflash.py) on the same target
features and block embeddings, and every step's acceptance against a reference run's (an oracle json of
z-lab/dflash's `dflash_generate`: `runs[p].acceptance_lengths`).

A draft whose layers agree at every step but whose acceptance differs points at the target's side (its features,
its verification); a layer that differs names the first draft layer computed differently (the last index is the
final norm)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ikrun.validate.dflash import DFlashReference

#: float32 arithmetic in another order (ggml's rope angles against float64 ones) stays well inside this: the
#: trained pairs of tests/data/dflash/shapes differ by at most 2e-5 over every step
LAYER_TOLERANCE = 1e-4


@dataclass
class LayerTrace:
    """Per step, the largest absolute difference of each draft layer's output (then the final norm's) from the
    reference's; an observer for `speculative_generate`."""

    reference: DFlashReference
    steps: list[list[float]] = field(default_factory=list)

    def __call__(self, features: np.ndarray, embeddings: np.ndarray, ours: list[np.ndarray]) -> None:
        theirs = self.reference.forward(features, embeddings)
        self.steps.append([float(np.abs(a - b).max()) for a, b in zip(ours, theirs)])

    def first_divergence(self, tolerance: float = LAYER_TOLERANCE) -> tuple[int, int, float] | None:
        """(step, layer, difference) of the first layer beyond `tolerance`, or None."""
        for k, diffs in enumerate(self.steps):
            for i, diff in enumerate(diffs):
                if diff > tolerance:
                    return k, i, diff
        return None

    def summary(self) -> dict:  # type: ignore[type-arg]
        first = self.first_divergence()
        worst = [max(d[i] for d in self.steps) for i in range(len(self.steps[0]))] if self.steps else []
        return {"max_abs_by_layer": worst,
                "first_divergence": None if first is None else {"step": first[0], "layer": first[1],
                                                                "max_abs": first[2]}}


def first_acceptance_difference(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, int] | None:
    """(prompt, step) of the first step whose acceptance length differs from the reference's (a run that stops
    early or goes on longer differs at its end), or None."""
    for p, (a, b) in enumerate(zip(ours, theirs)):
        for k in range(max(len(a), len(b))):
            if k >= len(a) or k >= len(b) or a[k] != b[k]:
                return p, k
    return None
