"""The arithmetics a run can compute in, chosen once from --numerics: `exact` (numerics/exact.py: the model's
semantics on exactly decoded weights), `ik` (numerics/ik/: ik's CPU backend, its AVX-512 build's float orders) and
`ik-avx2` (numerics/ik/avx2.py: its AVX2 build's). Architectures call the chosen
`Numerics` and never name a mode; a third arithmetic is one more subclass and one more entry here.

The implementations are imported when one is made: the op kernels they build on import ik's activation formats
from numerics/ik/, so this package's import must not pull them in first."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ikrun.numerics.exact import Numerics
    from ikrun.options import RuntimeOptions
    from ikrun.weights import WeightStore

#: the --numerics names
NUMERICS = ("exact", "ik", "ik-avx2")


def make_numerics(weights: WeightStore, options: RuntimeOptions) -> Numerics:
    """The arithmetic options.numerics names (RuntimeOptions has checked the name)."""
    from ikrun.numerics.exact import Numerics
    from ikrun.numerics.ik.arithmetic import IkNumerics
    from ikrun.numerics.ik.avx2 import IkAvx2Numerics

    by_name: dict[str, type[Numerics]] = {cls.name: cls for cls in (Numerics, IkNumerics, IkAvx2Numerics)}
    return by_name[options.numerics](weights, options)
