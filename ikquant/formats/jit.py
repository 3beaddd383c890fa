"""How kernels are called: Numba's `intrinsic` decorator as callers see it (for mypy), and `read_only`.

Why a parallel kernel's task (a row, a query, a head, a job) is a function of its own and not inlined: Numba types
and lowers a parallel loop's body twice (in the function, then in the outlined loop), and once more in a serial
twin; an inlined body of helpers is large, a called one is typed and lowered once. It pays where the inlined body
is large and not where it is small (the linked callee is still optimised again in each caller): measure before
moving one, and time the kernel after. A task handed its thread's buffers as arguments ran slower, probably as
the compiler no longer knew that nothing else writes them (ik's flash attention: 9.7-11.6 -> 11.6-14.0 ms on 2
threads); there the function is the thread's whole share, its buffers its own (_attention_thread). A decoder
called per block instead of inlined cost the expert matmul 1.7x on IQ4_KS (_decode_block stays inlined). First
calls from an empty cache on a 2-core Zen 3, before -> after: ik's flash attention 64 -> 32-40 s (and its split
one-token form 26 -> 20), the SwiGLU's two kernels 21 -> 8, the indexer's top-k 34 -> 13, the delta rule
39 -> 32, openPangu's sink attention 20 -> 14, DeepSeek-V4's generic flash attention 14 -> 10,
IQ4_KSS's quantizer 27 -> 20; the expert matmul's task and IQ4_KS's rows gained nothing and stayed inlined.

Numba ships a stub for `numba.core.extending` in which an intrinsic is called with its definition's own parameters,
typing context first, and returns Never; kernels call it without the typing context and use what it returns. Here
the decorated definition `(typingctx, *args)` becomes a function of `*args` returning Any (what the intrinsic returns
is whatever its signature says, which mypy cannot read). At run time it is numba's decorator unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, cast

import numpy as np
from numba import types
from numba.core.errors import TypingError
from numba.core.extending import intrinsic as _numba_intrinsic

P = ParamSpec("P")


def intrinsic(definition: Callable[Concatenate[Any, P], Any]) -> Callable[P, Any]:
    """numba.core.extending.intrinsic, typed as kernels call the result."""
    return cast("Callable[P, Any]", _numba_intrinsic(definition))


def read_only(a: np.ndarray) -> np.ndarray:
    """`a` as a read-only view (itself when it is one). Numba compiles a kernel once for each mutability of each
    array it takes, and stored bytes arrive both ways: read-only from a memory-mapped file, writable from an array
    made in memory. Kernels that only read them are handed them read-only, so that one compile serves both."""
    if not a.flags.writeable:
        return a
    view = a.view()
    view.flags.writeable = False
    return view


def require_array(owner: str, name: str, arg: object, ndim: int, dtype: object, contiguous: bool = True) -> None:
    """An intrinsic's check of its argument's Numba type at compile time: an array of `ndim` dimensions of `dtype`
    (C-contiguous unless told otherwise), else a TypingError naming the intrinsic and the argument."""
    if not (isinstance(arg, types.Array) and arg.ndim == ndim and arg.dtype == dtype
            and (arg.layout == "C" or not contiguous)):
        kind = f"{'C-contiguous ' if contiguous else ''}{ndim}-d {dtype} array"
        raise TypingError(f"{owner}: {name} must be a {kind}, not {arg}")
