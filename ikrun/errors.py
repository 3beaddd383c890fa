"""Every error the runtime raises for a user's mistake or an input it cannot evaluate: one line for the user, no
traceback (the CLI catches IkError alone; anything else is a bug and shows its traceback)."""

from ikquant.errors import IkError


class ModelError(IkError, ValueError):
    """A GGUF the runtime cannot evaluate: unsupported architecture, missing tensors, inconsistent shapes."""


class SwapError(IkError, ValueError):
    """A swap or reload that cannot be correct; nothing was changed."""


class BudgetError(IkError, ValueError):
    """A memory budget that cannot be met (too small for one block, no room for the spill file)."""


class EvalError(IkError, ValueError):
    """Options or inputs that make an evaluation impossible (too little text, context mismatch, ...)."""


class BaseLogitsError(IkError, ValueError):
    """A base-logits file that is not in ik's layout, or does not fit the model or options it is used with."""


class AcceptError(IkError, ValueError):
    """Prompts or options that cannot be decoded (a prompt longer than the text, a block larger than the draft's)."""


class SweepError(IkError, ValueError):
    """Sweep options that cannot be measured: an unknown grouping, a regex that matches nothing, a type that does
    not fit a tensor's rows."""


class HFReferenceError(IkError, ValueError):
    """A checkpoint the numpy reference does not implement."""


class NumericsError(IkError, ValueError):
    """A weight type or row size whose ik arithmetic the runtime does not reproduce."""


class MissingExtraError(IkError, ImportError):
    """An optional dependency a requested feature needs is not installed (matplotlib for --plot)."""
