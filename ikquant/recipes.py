"""Which type each tensor gets: ik's llama-quantize decisions, as data plus the few functions they need.

Three layers, applied in ik's order: eligibility (what is never quantized), the ftype's per-tensor rule (the
output tensor's promotion and friends), and the row-length fallback for types whose 256-value blocks do not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from ikquant.ftypes import FileType
from ikquant.types import GGMLType, type_by_name

# Types with 256-value super-blocks and what ik uses instead when a row is not a multiple of 256
# (llama-quantize.cpp change_type_if_necessary).
ROW_FALLBACK: dict[str, str] = {
    **dict.fromkeys(["IQ2_KS", "Q2_K", "Q3_K", "IQ2_K", "IQ2_KL", "IQ3_KS", "IQ3_K", "IQ4_KSS", "IQ4_KS", "IQ1_KT",
                     "IQ2_KT", "IQ3_KT", "IQ4_KT", "IQ4_XS"], "IQ4_NL"),
    **dict.fromkeys(["IQ4_K", "IQ5_KS", "Q4_K"], "Q5_0"),
    **dict.fromkeys(["IQ5_K", "Q5_K"], "Q6_0"),
    **dict.fromkeys(["IQ6_K", "Q6_K"], "Q8_0"),
}
# Substrings of names ik never quantizes (besides norms and 1-D tensors).
NEVER_QUANTIZED = ("ffn_gate_inp.weight", "ssm_conv1d", "ssm_x.weight", "ssm_dt.weight", "attn_rel_b.weight")
NEVER_QUANTIZED_EXACT = ("position_embd.weight", "token_types.weight")
INT_TYPES = ("I8", "I16", "I32", "I64")
# ftypes whose output tensor becomes IQ4_K (tied embeddings) / Q5_K instead of Q6_K.
LOW_BIT_OUTPUT = ("IQ2_K", "IQ3_K", "IQ2_KS", "IQ3_KS", "IQ2_KL", "IQ2_KT", "IQ3_KT", "IQ1_KT")
# ftypes whose tied token embeddings get IQ5_K.
IQ4_TIED_OUTPUT = ("IQ4_XS", "IQ4_KS", "IQ4_KSS")
# ftypes for which the per-tensor rules below are complete (checked against ik's plans); the others are --pure only.
RULES_COMPLETE = ("F32", "F16", "BF16", "Q8_0", "Q4_0")


@dataclass(frozen=True)
class Decision:
    type: GGMLType
    reason: str


def eligible(name: str, n_dims: int, src: GGMLType) -> bool:
    """ik's test of whether llama-quantize touches a tensor at all."""
    return (src.name not in INT_TYPES and name.endswith("weight") and n_dims >= 2 and "_norm.weight" not in name
            and not any(s in name for s in NEVER_QUANTIZED) and name not in NEVER_QUANTIZED_EXACT)


def with_row_fallback(gtype: GGMLType, n_per_row: int) -> Decision | None:
    """The type ik actually uses when `gtype`'s super-blocks do not divide the rows (None: no change needed)."""
    if gtype.name in ROW_FALLBACK and n_per_row % 256:
        fb = type_by_name(ROW_FALLBACK[gtype.name])
        return Decision(fb, f"{n_per_row} columns are not a multiple of 256: {gtype.name} falls back to {fb.name}")
    return None


def ftype_rule(name: str, n_per_row: int, ftype: FileType, has_output: bool) -> Decision:
    """The ftype's choice for one tensor before any user override (ik's llama_tensor_get_type)."""
    base = ftype.base
    is_output = name == "output.weight" or (not has_output and name == "token_embd.weight")
    if is_output and base.name not in ("F32", "F16", "BF16"):
        if n_per_row % 256:
            return Decision(type_by_name("Q8_0"), f"output tensor with {n_per_row} columns (not a multiple of 256)")
        if ftype.name in LOW_BIT_OUTPUT:
            t = "IQ4_K" if not has_output else "Q5_K"
            return Decision(type_by_name(t), f"output tensor of a low-bit {ftype.name} model")
        if ftype.name in IQ4_TIED_OUTPUT and not has_output:
            return Decision(type_by_name("IQ5_K"), f"tied token embeddings of an {ftype.name} model")
        if base.name not in ("Q8_0", "IQ6_K"):
            return Decision(type_by_name("Q6_K"), "output tensor gets Q6_K")
    return Decision(base, f"{ftype.name} default")
