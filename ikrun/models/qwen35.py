"""Qwen3.5 dense (`qwen35`): Qwen3.5's hybrid (ikrun/models/qwen35moe.py: tiled value heads, separate b / a
projections, IMROPE) with a SwiGLU FFN in every layer instead of the MoE; the file has no expert keys."""

from __future__ import annotations

from typing import ClassVar

from ikrun.models.qwen35moe import Qwen35Moe


class Qwen35(Qwen35Moe):
    archs: ClassVar[tuple[str, ...]] = ("qwen35",)
