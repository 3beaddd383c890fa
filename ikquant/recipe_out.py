"""`--recipe-out`: a quantization's per-tensor types as ik's `--custom-q` rules, so that `ikquant` (and ik's
`llama-quantize`, whose bytes ours are) reproduce the file from the same input, type and imatrix.

One anchored `^NAME$=type` rule per tensor ik's quantizer would touch, the types spelled as ik parses them (case
and all: q4_K, iq4_ks, f32); every other line is a `#` comment (sizes, predicted and measured KLD, the command
that reads the file back, and with --budget groups the `-ot` offload lines for llama-server / llama-cli).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from ikquant.outputs import output_file
from ikquant.recipes import eligible

if TYPE_CHECKING:
    from ikquant.mix import MixPlan
    from ikquant.quantize import Plan


def recipe_text(plan: Plan, type_name: str, mix: MixPlan | None = None, measured_kld: float | None = None) -> str:
    """The rules file for `plan` (quantized as --type `type_name`), with `mix`'s predictions where it chose."""
    n_weights = sum(p.info.n_elements for p in plan.tensors)
    size = sum(p.new_bytes for p in plan.tensors)
    lines = [f"# iktools recipe: --type {type_name}, {size} bytes of tensors ({size / 2**20:.3f} MiB), "
             f"{8 * size / max(n_weights, 1):.4f} bits per weight"]
    if mix is not None:
        lines.append(f"# type mix from a sweep ({mix.title}): predicted mean KLD {mix.predicted_kld:.6f} (the sum of "
                     "the swept tensors' KLDs, each measured alone)")
    if measured_kld is not None:
        lines.append(f"# measured mean KLD of the assembled file: {measured_kld:.6f}")
    lines += ["# reproduce: ikquant IN.gguf OUT.gguf --type " + type_name
              + " [--imatrix FILE] --custom-q \"$(grep -v '^#' THIS_FILE | paste -sd, -)\"",
              "# (ik_llama.cpp's llama-quantize takes the same --custom-q and writes the same bytes)"]
    predicted: dict[str, tuple[str, float]] = {}
    if mix is not None:
        for group, option in mix.choice.items():
            for name in mix.groups[group]:
                predicted[name] = (group, option.kld)
    for p in plan.tensors:
        if not (p.quantize or eligible(p.name, p.info.n_dims, p.info.type)):
            continue
        note = f"# {p.name}: {p.new_bytes} bytes"
        if p.name in predicted:
            group, kld = predicted[p.name]
            note += f", predicted KLD {kld:.6g} (swept group {group})"
        lines += [note, f"^{re.escape(p.name)}$={p.type.ggml_name}"]
    if mix is not None and any(b.pattern is not None for b, _, _ in mix.results):
        lines.append("# offload for llama-server / llama-cli (the tensors of every named --budget in system RAM, "
                     "the rest on the GPU with -ngl 999):")
        lines += [f"# -ot \"{b.pattern}=CPU\"" for b, _, _ in mix.results if b.pattern is not None]
    return "\n".join(lines) + "\n"


def write_recipe(path: Path, text: str) -> None:
    """Write a recipe file (temporary name, renamed when complete)."""
    with output_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
