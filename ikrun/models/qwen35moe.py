"""Qwen3.5 MoE (`qwen35moe`): Qwen3-Next's hybrid (ikrun/models/qwen3next.py) in Qwen3.5's file layout.

Two differences in the file: the delta-net's value heads are in tiled order (value head h reads key head h % Hk; the
converter reorders transformers' grouped heads) and b / a come from two projections, ssm_beta and ssm_alpha; and the
full-attention layers rope with IMROPE, the interleaved multi-section rope whose pairs take their position from the
section (time, height, width) `rope.dimension_sections` assigns them. A text token has the same position in every
section, so over text IMROPE is the NEOX rope of the first `rope.dimension_count` dims, provided the sections cover
every rotated pair: a fourth section, or sections that leave pairs out (transformers then rotates those by the time
position, ik by none), is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ikrun.models.qwen3next import Qwen3Next

if TYPE_CHECKING:
    from ikrun.context import Context


class Qwen35Moe(Qwen3Next):
    archs: ClassVar[tuple[str, ...]] = ("qwen35moe",)
    qwen35_layout: ClassVar[bool] = True

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        key = "rope.dimension_sections"
        sections = [int(s) for s in self.ctx.hparam(key)]
        if len(sections) != 4 or sections[3] or min(sections) < 0 or sum(sections[:3]) != self.n_rot // 2:
            self.fail_hparam(key, f"{sections} is a rope scheme ikrun does not implement: IMROPE over text needs "
                                  f"[t, h, w, 0] sections covering the {self.n_rot // 2} rotated pairs "
                                  f"(rope.dimension_count {self.n_rot})")
