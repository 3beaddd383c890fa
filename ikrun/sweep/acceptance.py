"""Per-tensor sensitivity of a drafter by acceptance length: a DFlash draft (`ikrun sweep DRAFT --target T --metric
acceptance`) or a target's own NextN/MTP head (`ikrun sweep T --metric acceptance --mtp`). Each drafter tensor (or
layer, or class) is quantized to each type, swapped in, and the same greedy speculative decoding of the same prompts
is run again; a row's cost is the mean acceptance length it loses against the drafter as stored (what a quantized
drafter costs its users in target steps). The rows feed `ikquant --sweep` like KLD rows do (a head's, `ikquant
--mtp-sweep` with a bound on the loss).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ikquant.imatrix import Imatrix
from ikquant.types import GGMLType
from ikrun.eval.speculative import SpecRun, acceptance_by_position, mean_acceptance_length
from ikrun.model import Model
from ikrun.sweep.measure import Measured, model_fingerprint, pending_jobs, prepare_candidate


@dataclass
class AcceptanceRow(Measured):
    acceptance_mean: float
    #: the stored draft's mean acceptance length minus this one's (the cost a mix minimises)
    acceptance_loss: float
    #: accepted share at the first draft position
    acceptance_first: float
    seconds: float
    #: why a tensor of the group is stored as another type than asked (ik's fallback), None when none is
    fallback: str | None = None


#: one prompt's greedy speculative decoding with the drafter as it is swapped in now
Decode = Callable[[np.ndarray], SpecRun]


def decoding_identity(target: Model, prompts: list[np.ndarray], max_new: int, block: int,
                      mtp: dict | None = None) -> dict:  # type: ignore[type-arg]
    """What an acceptance sweep's rows depend on besides the drafter: the target and the decoding (for a NextN head,
    its n_max and p_min under "mtp")."""
    return {"target_fingerprint": model_fingerprint(target), "prompts": [p.tolist() for p in prompts],
            "max_new": max_new, "block": block, **({"mtp": mtp} if mtp is not None else {})}


def acceptance(decode: Decode, prompts: list[np.ndarray], block: int) -> tuple[float, float]:
    """(mean acceptance length, accepted share at the first draft position) over the prompts."""
    runs = [decode(p) for p in prompts]
    return mean_acceptance_length(runs), acceptance_by_position(runs, block)[0]


def run_acceptance_sweep(draft: Model, decode: Decode, prompts: list[np.ndarray], block: int,
                         groups: dict[str, list[str]], types: list[GGMLType], imatrix: Imatrix | None,
                         done: list[AcceptanceRow], on_row: Callable[[AcceptanceRow], None]) -> list[AcceptanceRow]:
    """Measure every (group, type) not in `done` against the stored drafter's acceptance; `draft` is the model
    whose tensors are swapped (the DFlash draft, or the target holding the NextN head), `decode` drafts with it."""
    jobs = pending_jobs(groups, types, done)
    rows = list(done)
    if not jobs:
        return rows
    base, _ = acceptance(decode, prompts, block)
    for group, names, gtype in jobs:
        t0 = time.perf_counter()
        job = prepare_candidate(draft, group, names, gtype, imatrix)
        try:
            for name, (used, raw) in zip(job.names, job.encodings):
                draft.swap(name, used, raw)
            mean, first = acceptance(decode, prompts, block)
        finally:
            for name in job.names:
                draft.restore(name)
        bytes_new = sum(raw.nbytes for _, raw in job.encodings)
        n_weights = sum(draft.weights.info(n).n_elements for n in names)
        row = AcceptanceRow(group, names, gtype.name, "+".join(sorted({u.name for u, _ in job.encodings})), n_weights,
                            sum(draft.weights.source_encoding(n).raw.nbytes for n in names), bytes_new,
                            8.0 * bytes_new / n_weights, mean, base - mean, first, time.perf_counter() - t0,
                            job.fallback)
        rows.append(row)
        on_row(row)
    return rows
