"""The runtime over memory-mapped GGUF: logits, perplexity, KL-divergence, imatrix, sweeps, speculative decoding.

The public names below are what a library user (and tools/) needs; each is imported when first used, so importing
ikrun stays cheap and the kernels compile only for what runs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import ikquant  # noqa: F401  (its import sets the BLAS thread timeout and the Numba cache folder before they load)

if TYPE_CHECKING:
    from ikrun.cli import app
    from ikrun.errors import ModelError
    from ikrun.eval.evaluate import kl_divergence, open_base, perplexity, tokenize_chunks
    from ikrun.eval.metrics import KLDAccumulator, kld_stats
    from ikrun.eval.speculative import mean_acceptance_length, speculative_generate
    from ikrun.model import Model
    from ikrun.options import RuntimeOptions
    from ikrun.sweep import run_sweep
    from ikrun.sweep.measure import sweep_groups
    from ikrun.validate.hf import HFReference, compare_logits

#: public name -> the module that defines it
_EXPORTS = {
    "Model": "ikrun.model",
    "RuntimeOptions": "ikrun.options",
    "ModelError": "ikrun.errors",
    "tokenize_chunks": "ikrun.eval.evaluate",
    "perplexity": "ikrun.eval.evaluate",
    "kl_divergence": "ikrun.eval.evaluate",
    "open_base": "ikrun.eval.evaluate",
    "KLDAccumulator": "ikrun.eval.metrics",
    "kld_stats": "ikrun.eval.metrics",
    "speculative_generate": "ikrun.eval.speculative",
    "mean_acceptance_length": "ikrun.eval.speculative",
    "run_sweep": "ikrun.sweep",
    "sweep_groups": "ikrun.sweep.measure",
    "HFReference": "ikrun.validate.hf",
    "compare_logits": "ikrun.validate.hf",
    "app": "ikrun.cli",
}

__all__ = [
    "HFReference",
    "KLDAccumulator",
    "Model",
    "ModelError",
    "RuntimeOptions",
    "app",
    "compare_logits",
    "kl_divergence",
    "kld_stats",
    "mean_acceptance_length",
    "open_base",
    "perplexity",
    "run_sweep",
    "speculative_generate",
    "sweep_groups",
    "tokenize_chunks",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ikrun' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
