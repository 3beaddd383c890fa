"""Numba's `intrinsic` decorator as callers see it, for mypy.

Numba ships a stub for `numba.core.extending` in which an intrinsic is called with its definition's own parameters,
typing context first, and returns Never; kernels call it without the typing context and use what it returns. Here
the decorated definition `(typingctx, *args)` becomes a function of `*args` returning Any (what the intrinsic returns
is whatever its signature says, which mypy cannot read). At run time it is numba's decorator unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, cast

from numba.core.extending import intrinsic as _numba_intrinsic

P = ParamSpec("P")


def intrinsic(definition: Callable[Concatenate[Any, P], Any]) -> Callable[P, Any]:
    """numba.core.extending.intrinsic, typed as kernels call the result."""
    return cast("Callable[P, Any]", _numba_intrinsic(definition))
