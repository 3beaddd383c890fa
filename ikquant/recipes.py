"""Which type each tensor gets: ik's llama-quantize decisions as data, plus the few functions they need.

ik decides in layers, applied here in ik's order:
1. eligibility: what is never quantized (1-D, norms, integer tensors, gate_inp, ...);
2. the ftype's rules for the tensor's class (output, token_embd, attn_v, attn_k, attn_q, ffn_down, attn_output,
   ffn_gate, ffn_up) -- tables of (condition, type) tried in order, first match wins, per rule family: the
   IQ1_S_R4/IQ1_M_R4 block, the IQ2_KT block, the low-bit block (IQ2_KS and friends), and the generic chain for
   everything else;
3. the user's --custom-q rules (they replace the ftype's choice), then the fallback for rows that 256-value blocks
   do not fit (or the refusal, for the BitNet types, which have none), then the driver's own overrides
   (--token-embedding-type, --output-tensor-type, --ffn-gate-inp-type).

The interleaved ftypes (Q4_K_R4, IQ3_K_R4, ...) have rules of their own in each chain, and several of them put plain
(not interleaved) types on some tensors: Q4_K_R4 gives the first attn_v tensors Q5_K, the IQ1_S_R4 family picks _R4
types, the low-bit family (IQ2_XXS_R4 included) plain ones. Whatever the rules choose, an interleaved type is replaced
by its base type where the tensor's rows are no whole number of row groups, and on token_embd (quantize.py).

Tensor classes are found by substring, as ik does: "attn_k" also matches attn_kv_a_mqa, attn_kv_b and attn_k_b;
"attn_q" matches attn_q_a, attn_q_b and attn_qkv; "ffn_down" matches ffn_down_exps and ffn_down_shexp.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ikquant.errors import QuantizeError
from ikquant.ftypes import FileType
from ikquant.types import GGMLType, type_by_name

# Types with 256-value super-blocks and what ik uses instead when a row is not a multiple of 256
# (llama-quantize.cpp change_type_if_necessary).
ROW_FALLBACK: dict[str, str] = {
    **dict.fromkeys(["IQ2_KS", "Q2_K", "Q3_K", "IQ2_K", "IQ2_KL", "IQ3_KS", "IQ3_K", "IQ4_KSS", "IQ4_KS", "IQ1_KT",
                     "IQ2_KT", "IQ3_KT", "IQ4_KT", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                     "IQ1_S", "IQ1_M", "IQ2_XXS_R4", "IQ2_XS_R4", "IQ2_S_R4", "IQ3_XXS_R4", "IQ3_S_R4", "Q2_K_R4",
                     "Q3_K_R4", "IQ2_K_R4", "IQ3_K_R4", "IQ4_KS_R4", "IQ4_XS_R8"], "IQ4_NL"),
    **dict.fromkeys(["IQ4_K", "IQ5_KS", "Q4_K", "IQ4_K_R4", "Q4_K_R4", "IQ5_KS_R4"], "Q5_0"),
    **dict.fromkeys(["IQ5_K", "Q5_K", "IQ5_K_R4", "Q5_K_R4"], "Q6_0"),
    **dict.fromkeys(["IQ6_K", "Q6_K", "Q6_K_R4", "Q8_K_R8"], "Q8_0"),
}
# Types with no such substitute, and the row multiple they need: ik refuses to quantize a tensor whose rows their
# 64-value blocks do not divide (its "Unsupported tensor size encountered").
NO_ROW_FALLBACK: dict[str, int] = dict.fromkeys(["IQ1_BN", "IQ2_BN", "IQ2_BN_R4"], 64)
# Names ik never quantizes (besides norms, 1-D and integer tensors): substrings, then exact names.
NEVER_QUANTIZED = ("ffn_gate_inp.weight", "ssm_conv1d", "ssm_x.weight", "ssm_dt.weight", "attn_rel_b.weight")
NEVER_QUANTIZED_EXACT = ("position_embd.weight", "token_types.weight")
INT_TYPES = ("I8", "I16", "I32", "I64")
FLOAT_TYPES = ("F32", "F16", "BF16", "BF16_R16")
# Types ik refuses to produce without importance data (outside token_embd/output), unless --ignore-imatrix-rules.
NEEDS_IMATRIX = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "IQ1_KT", "IQ2_KT", "IQ2_XXS_R4", "IQ2_XS_R4",
                 "IQ2_S_R4", "IQ1_S_R4", "IQ1_M_R4")


@dataclass(frozen=True)
class ModelFacts:
    """What ik's rules know about the model: expert count, GQA factor of layer 0, layers, vocab, size class."""

    arch: str
    n_expert: int
    n_gqa: int
    n_layer: int
    n_vocab: int
    size_class: str  # "8B", "70B" or "" (only these two change decisions)
    has_output: bool
    n_attention_wv: int

    @property
    def l3(self) -> bool:
        """ik's 'Llama-3-like' test: a large vocabulary on an 8B or 70B model."""
        return self.n_vocab >= 127999 and self.size_class in ("8B", "70B")


def size_class(arch: str, n_layer: int, n_vocab: int, n_embd: int, n_head: int, n_head_kv: int) -> str:
    """ik's model type, reduced to the two classes its quantization rules test (llama-hparams.cpp)."""
    if arch == "llama":
        if n_layer == 32 and n_vocab != 49152 and n_vocab >= 40000 or n_layer == 36:
            return "8B"
        if n_layer == 80 and n_head != n_head_kv:
            return "70B"
    if arch == "qwen2" and n_layer == 80:
        return "70B"
    if arch == "qwen3" and n_layer == 36 and n_embd != 2560:
        return "8B"
    return ""


@dataclass
class Context:
    """One tensor's situation when its rule is evaluated."""

    ftype: str
    facts: ModelFacts
    default: str
    has_imatrix: bool
    i_layer: int = 0
    n_layer: int = 1
    i_attention_wv: int = 0
    n_per_row: int = 0
    options: dict[str, str] = field(default_factory=dict)

    @property
    def more_bits(self) -> bool:
        return use_more_bits(self.i_layer, self.n_layer)


def use_more_bits(i: int, n: int) -> bool:
    """ik's use_more_bits: the first and last eighth of the layers, and every third layer in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


Cond = Callable[[Context], bool]
Choice = str | Callable[[Context], str]


@dataclass(frozen=True)
class Rule:
    """`ftypes` (empty: any) and `when` hold -> the tensor gets `to` (a type name, or computed from the context)."""

    ftypes: tuple[str, ...]
    to: Choice
    when: Cond = lambda c: True  # noqa: E731
    note: str = ""

    def applies(self, c: Context) -> bool:
        return (not self.ftypes or c.ftype in self.ftypes) and self.when(c)

    def result(self, c: Context) -> str:
        return self.to(c) if callable(self.to) else self.to


def R(ftypes: str | tuple[str, ...], to: Choice, when: Cond = lambda c: True, note: str = "") -> Rule:  # noqa: E731,N802
    return Rule((ftypes,) if isinstance(ftypes, str) else ftypes, to, when, note)


def opt(name: str) -> Rule:
    """A per-class user option (e.g. --attn-v-type) wins when set."""
    return Rule((), lambda c: c.options[name], lambda c: name in c.options, f"--{name.replace('_', '-')}")


E = lambda n: (lambda c: c.facts.n_expert >= n)  # noqa: E731
G = lambda n: (lambda c: c.facts.n_gqa >= n)  # noqa: E731
FIRST_EIGHTH: Cond = lambda c: c.i_layer < c.n_layer // 8  # noqa: E731
NO_IMATRIX: Cond = lambda c: not c.has_imatrix  # noqa: E731
ANY: Cond = lambda c: True  # noqa: E731

LOW_BIT_OUTPUT = ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M", "IQ2_K", "IQ3_K", "IQ2_KS",
                  "IQ3_K_R4", "IQ3_KS", "IQ2_K_R4", "IQ3_XXS_R4", "IQ2_KL", "IQ2_M_R4", "IQ1_S_R4", "IQ1_M_R4",
                  "IQ2_KT", "IQ3_KT", "IQ1_KT")
IQ4_TIED_IQ5 = ("IQ3_S", "IQ3_M", "IQ3_KL", "IQ4_XS", "IQ3_S_R4", "IQ4_KS", "IQ4_KSS", "IQ4_KS_R4")
# default types that already have 6 bits or more: output.weight keeps them instead of becoming Q6_K
OUTPUT_KEEPS = ("Q8_0", "Q8_0_R8", "IQ6_K", "Q6_K_R4", "Q8_K_R8", "Q8_KV", "Q8_KV_R8")
BITNET = ("IQ1_BN", "IQ2_BN", "IQ2_BN_R4")
ATTN_OUTPUT_Q5K_MOE = ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S",
                       "IQ3_M", "IQ4_XS", "IQ4_K", "IQ4_KSS", "IQ4_KS", "IQ4_KS_R4", "IQ5_KS", "IQ5_KS_R4", "IQ2_K",
                       "IQ3_K", "IQ3_KL", "Q4_K_R4", "IQ4_NL_R4", "IQ4_XS_R8", "Q3_K_R4", "IQ3_KT", "IQ3_KS",
                       "Q2_K_R4", "IQ4_K_R4", "IQ3_K_R4", "IQ2_K_R4", "IQ3_XXS_R4", "IQ3_S_R4")
LOW_BIT_BLOCK = ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M", "IQ2_KS", "IQ2_XXS_R4", "IQ2_XS_R4",
                 "IQ2_M_R4")
IQ1_R4_BLOCK = ("IQ1_S_R4", "IQ1_M_R4")
IQ2SM = ("IQ2_S", "IQ2_M", "IQ2_M_R4")

# G >= 4 bump of attn_v in the generic chain: the current type -> one step up.
GQA_BUMP = {"Q2_K": "IQ3_S", "IQ3_XXS": "IQ3_S", "Q2_K_R4": "IQ3_K_R4", "IQ3_XXS_R4": "IQ3_K_R4", "Q3_K": "Q4_K",
            "IQ3_S": "Q4_K", "IQ3_K": "IQ4_K", "IQ3_KS": "IQ4_KS", "IQ2_KL": "IQ4_KS", "IQ3_S_R4": "Q4_K_R4",
            "Q3_K_R4": "Q4_K_R4", "Q4_K": "Q5_K", "IQ4_XS": "Q5_K", "IQ4_NL": "Q5_K", "IQ4_K": "IQ5_K",
            "IQ4_KS": "IQ5_K", "IQ4_NL_R4": "Q5_K", "IQ4_XS_R8": "Q5_K", "Q5_K": "Q6_K", "IQ5_K": "IQ6_K",
            "IQ5_KS": "IQ6_K"}
SEVENTY_B_BUMP = {"Q3_K": "Q5_K", "Q4_K": "Q5_K", "IQ3_K": "IQ5_K"}

# --- the rules, per family and tensor class (order matters: first applicable rule wins) ---------------------------

OUTPUT_RULES = [
    opt("output_tensor_type"),
    R((), "Q8_0", lambda c: c.facts.arch == "falcon" or c.n_per_row % 256 != 0),
    R(LOW_BIT_OUTPUT, lambda c: "IQ4_K" if not c.facts.has_output else "Q5_K"),
    R(("IQ2_XXS_R4", "IQ2_XS_R4"), lambda c: "IQ4_K_R4" if not c.facts.has_output else "Q5_K_R4"),
    R(IQ4_TIED_IQ5, "IQ5_K", lambda c: not c.facts.has_output),
    R((), "Q6_K", lambda c: c.default not in OUTPUT_KEEPS),
]
TOKEN_EMBD_RULES = [
    opt("token_embedding_type"),
    R(("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M", "IQ2_XXS_R4", "IQ2_XS_R4", "IQ1_S_R4", "IQ1_M_R4"), "Q2_K"),
    R(("IQ2_S", "IQ2_M", "IQ2_M_R4", "IQ3_XXS", "IQ3_KT"), "IQ3_S"),
    R("IQ3_XXS_R4", "IQ3_K"),
    R(BITNET, "IQ4_NL"),
]

# IQ1_S_R4 and IQ1_M_R4: the IQ2_KT family's shape with interleaved types (and lower ones on attn_qkv, ffn_down and
# attn_output).
IQ1_R4_RULES: dict[str, list[Rule]] = {
    "attn_v": [R((), "IQ4_K_R4", lambda c: c.facts.n_expert >= 4 or c.facts.n_gqa >= 4), R((), "IQ3_K_R4", G(2)),
               R((), "Q2_K_R4")],
    "attn_k": [R((), "Q4_K_R4", E(8))],
    "blk0_ffn": [R((), "IQ3_K_R4", E(8))],
    "attn_q": [R((), "Q4_K_R4", E(8))],
    "attn_qkv": [R((), "IQ2_K_R4")],
    "shexp": [R((), "IQ4_K_R4")],
    "ffn_down": [opt("ffn_down_type"), R((), "Q2_K_R4", FIRST_EIGHTH)],
    "attn_output": [R((), lambda c: "Q5_K_R4" if c.facts.n_expert >= 4 else "IQ2_K_R4")],
}

IQ2_KT_RULES: dict[str, list[Rule]] = {
    "attn_v": [R((), "IQ4_K", lambda c: c.facts.n_expert >= 4 or c.facts.n_gqa >= 4), R((), "IQ3_K", G(2)),
               R((), "Q2_K")],
    "attn_k": [R((), "Q4_K", E(8))],
    "blk0_ffn": [R((), "IQ3_K", E(8))],
    "attn_q": [R((), "Q4_K", E(8))],
    "attn_qkv": [R((), "IQ3_K")],
    "shexp": [R((), "IQ4_K")],
    "ffn_down": [opt("ffn_down_type"), R((), "IQ3_K", FIRST_EIGHTH)],
    "attn_output": [R((), lambda c: "Q5_K" if c.facts.n_expert >= 4 else "IQ3_K")],
}

LOW_BIT_RULES: dict[str, list[Rule]] = {
    "attn_v": [R((), "IQ4_K", lambda c: c.facts.n_gqa >= 4 or c.facts.n_expert >= 4),
               R((), "IQ3_K", lambda c: c.facts.n_gqa >= 2 or c.facts.n_expert >= 2),
               R(IQ2SM, "IQ3_S"), R((), "Q2_K")],
    "attn_k": [R((), "Q4_K", E(8))],
    "attn_q": [R((), "Q4_K", E(8))],
    "attn_qkv": [R(IQ2SM, "IQ3_XXS"), R((), "IQ2_K")],
    # this family counts ffn_down tensors in file order, even in MoE models (i_layer is that counter here)
    "ffn_down": [R(IQ2SM, "IQ3_S", FIRST_EIGHTH), R((), "Q2_K", FIRST_EIGHTH)],
    "attn_output": [opt("attn_output_type"), R((), "Q5_K", E(4)), R(("IQ1_S", "IQ1_M"), "IQ2_K"),
                    R(IQ2SM, "IQ3_S")],
}

GENERIC_RULES: dict[str, list[Rule]] = {
    "attn_v": [
        opt("attn_v_type"),
        R((), "Q8_0", E(4)),
        R((), lambda c: SEVENTY_B_BUMP.get(c.default, c.default), lambda c: c.facts.size_class == "70B"),
        R("Q2_K", lambda c: "Q4_K" if c.facts.n_gqa >= 4 else "Q3_K"),
        R("IQ2_K", lambda c: "IQ4_K" if c.facts.n_gqa >= 2 else "IQ3_K"),
        R("IQ2_K_R4", lambda c: "IQ4_K_R4" if c.facts.n_gqa >= 2 else "IQ3_K_R4"),
        R("Q2_K_S", "Q4_K", G(4)),
        R("Q2_K_R4", "Q4_K_R4", G(4)),
        R("IQ3_XXS", lambda c: "Q4_K" if c.facts.n_gqa >= 4 else "IQ3_K" if c.facts.n_gqa >= 2
          else "IQ3_S" if not c.has_imatrix else "IQ3_XXS"),
        R("IQ3_KT", lambda c: "IQ4_K" if c.facts.n_gqa >= 4 else "IQ3_K"),
        R("IQ4_KT", lambda c: "IQ5_K" if c.facts.n_gqa >= 4 else "IQ4_K"),
        R("IQ3_XXS_R4", lambda c: "Q4_K_R4" if c.facts.n_gqa >= 4 else "IQ3_K_R4" if c.facts.n_gqa >= 2
          else "IQ3_K_R4" if not c.has_imatrix else "IQ3_XXS_R4"),
        R(("IQ3_XS", "IQ3_S", "IQ3_K"), "IQ4_K", G(2)),
        R(("IQ3_S_R4", "IQ3_K_R4"), "IQ4_K_R4", G(2)),
        R(("IQ3_KS", "IQ2_KL"), "IQ4_KS", G(2)),
        R(("IQ3_KL", "IQ3_M"), lambda c: "IQ5_K" if c.facts.n_gqa >= 2 else "IQ4_K"),
        R("Q3_K_M", lambda c: "Q5_K" if c.i_attention_wv < 2 else "Q4_K"),
        R("Q3_K_L", "Q5_K"),
        # IQ4_K_R4 steps up to plain IQ5_K, IQ4_KS_R4 to IQ5_K_R4
        R(("IQ4_NL", "IQ4_XS", "IQ4_NL_R4", "IQ4_XS_R8", "IQ4_KS", "IQ4_KSS", "IQ4_K", "IQ4_K_R4"), "IQ5_K", G(2)),
        R("IQ4_KS_R4", "IQ5_K_R4", G(2)),
        R(("Q4_K_M", "Q5_K_M"), "Q6_K", lambda c: use_more_bits(c.i_attention_wv, c.facts.n_attention_wv)),
        R(("Q4_K_S", "Q4_K_R4"), "Q5_K", lambda c: c.i_attention_wv < 4),
        # these two ftypes stop the chain even when the model is not Llama-3-like
        R("Q5_K_S", lambda c: "Q6_K" if c.facts.l3 else c.default),
        R(("IQ5_K", "IQ5_KS"), lambda c: "IQ6_K" if c.facts.l3 else c.default),
        R((), lambda c: GQA_BUMP.get(c.default, c.default),
          lambda c: c.facts.n_gqa >= 4 and not (c.facts.arch == "dflash-draft" and c.ftype in ("Q4_K_M", "Q5_K_M"))),
    ],
    "attn_k": [opt("attn_k_type"), R((), "Q8_0", E(4)), R("IQ3_XS", "IQ3_XXS"), R(("IQ3_XXS", "IQ3_XXS_R4"), "IQ2_S")],
    "attn_q": [
        opt("attn_q_type"), R("IQ3_XS", "IQ3_XXS"), R(("IQ3_XXS", "IQ3_XXS_R4"), "IQ2_S"),
        R("Q5_K_S", "Q4_K", lambda c: c.facts.l3), R("IQ5_K", "IQ4_K", lambda c: c.facts.l3),
        R("IQ5_KS", "IQ4_KS", lambda c: c.facts.l3),
    ],
    "ffn_down": [
        opt("ffn_down_type"),
        R("Q2_K", "Q3_K"),
        R("Q2_K_S", lambda c: "Q4_K" if c.i_layer < c.n_layer // 8 else c.default),
        R("Q2_K_R4", lambda c: "Q4_K_R4" if c.i_layer < c.n_layer // 8 else c.default),
        R("IQ3_XXS", lambda c: "Q4_K" if c.i_layer < c.n_layer // 8 else "Q3_K", NO_IMATRIX),
        R("IQ3_KT", lambda c: "IQ4_K" if c.i_layer < c.n_layer // 8 else "IQ3_K", NO_IMATRIX),
        R("IQ3_XXS_R4", lambda c: "Q4_K_R4" if c.i_layer < c.n_layer // 8 else "IQ3_K_R4", NO_IMATRIX),
        R("Q3_K_M", lambda c: "Q5_K" if c.i_layer < c.n_layer // 16
          else "Q4_K" if c.facts.arch != "falcon" or c.more_bits else "Q3_K"),
        R("IQ3_M", "IQ4_K", lambda c: c.i_layer < c.n_layer // 8 or (c.facts.n_expert >= 4 and c.more_bits)),
        R("Q3_K_L", lambda c: "Q4_K" if c.facts.arch == "falcon" else "Q5_K"),
        R("IQ3_KL", lambda c: "IQ4_KS" if c.more_bits else "IQ3_K"),
        R("Q4_K_M", lambda c: ("Q6_K" if c.i_layer < c.n_layer // 16 else "Q5_K" if c.more_bits else "Q4_K")
          if c.facts.arch == "falcon" else ("Q6_K" if c.more_bits else c.default)),
        R(("IQ4_NL", "IQ4_XS", "IQ4_KS", "IQ4_KSS", "IQ4_NL_R4", "IQ4_XS_R8"), "Q5_K",
          lambda c: FIRST_EIGHTH(c) and not c.has_imatrix),
        R("IQ4_KS_R4", "Q5_K_R4", lambda c: FIRST_EIGHTH(c) and not c.has_imatrix),
        R("Q5_K_M", "Q6_K", lambda c: c.more_bits),
        R(("Q4_K_S", "Q4_K_R4"), "Q5_K", lambda c: c.facts.arch != "falcon" and FIRST_EIGHTH(c)),
        R(("Q4_0", "Q5_0"), lambda c: "Q4_1" if c.ftype == "Q4_0" else "Q5_1",
          lambda c: c.has_imatrix and FIRST_EIGHTH(c)),
        R("Q4_0_R8", "IQ4_NL_R4", lambda c: c.has_imatrix and FIRST_EIGHTH(c)),
    ],
    "attn_output": [
        opt("attn_output_type"),
        R(ATTN_OUTPUT_Q5K_MOE, "Q5_K", lambda c: c.facts.arch != "falcon" and c.facts.n_expert >= 4),
        R("IQ2_KL", "IQ4_KS", lambda c: c.facts.arch != "falcon" and c.facts.n_expert >= 4),
        R((), lambda c: c.default, lambda c: c.facts.arch != "falcon" and c.facts.n_expert >= 4),
        R("Q2_K", "Q3_K", lambda c: c.facts.arch != "falcon"),
        R("IQ3_XXS", "IQ3_S", lambda c: c.facts.arch != "falcon"),
        R("IQ3_KT", "IQ3_K", lambda c: c.facts.arch != "falcon" and c.facts.n_gqa >= 4),
        R("IQ3_XXS_R4", "IQ3_K_R4", lambda c: c.facts.arch != "falcon"),
        R("Q3_K_M", "Q4_K", lambda c: c.facts.arch != "falcon"),
        R("Q3_K_L", lambda c: "Q5_K" if c.facts.arch != "falcon" else "Q4_K"),
        R("IQ3_M", "IQ4_K", lambda c: c.facts.arch != "falcon"),
        R("IQ2_K", "IQ3_K", lambda c: c.facts.arch != "falcon"),
        R("IQ2_K_R4", "IQ3_K_R4", lambda c: c.facts.arch != "falcon"),
        R("IQ3_KL", "IQ4_KS", lambda c: c.facts.arch != "falcon"),
    ],
    "ffn_gate": [opt("ffn_gate_type"), R("IQ3_XS", "IQ3_XXS", lambda c: c.n_layer // 8 <= c.i_layer < 7 * c.n_layer // 8),
                 R("IQ3_KL", "IQ4_KS", lambda c: c.more_bits)],
    "ffn_up": [opt("ffn_up_type"), R("IQ3_XS", "IQ3_XXS", lambda c: c.n_layer // 8 <= c.i_layer < 7 * c.n_layer // 8),
               R("IQ3_KL", "IQ4_KS", lambda c: c.more_bits)],
}

# Per-class user options each family reads (the others are ignored there, as in ik).
HONOURED_OPTIONS = {
    "generic": ("attn_v_type", "attn_k_type", "attn_q_type", "attn_output_type", "ffn_down_type", "ffn_gate_type",
                "ffn_up_type"),
    "iq2_kt": ("ffn_down_type",),
    "iq1_r4": ("ffn_down_type",),
    "low_bit": ("attn_output_type",),
}


def tensor_class(name: str, family: str, n_expert: int) -> str | None:
    """The rule class of a tensor in a family, by ik's substring tests in ik's order."""
    if "attn_v.weight" in name:
        return "attn_v"
    if family in ("iq1_r4", "iq2_kt"):
        if n_expert >= 8 and "attn_k" in name:
            return "attn_k"
        if n_expert >= 8 and any(s in name for s in ("blk.0.ffn_down", "blk.0.ffn_gate", "blk.0.ffn_up")):
            return "blk0_ffn"
        if n_expert >= 8 and "attn_q" in name:
            return "attn_q"
        if "attn_qkv.weight" in name:
            return "attn_qkv"
        if "_shexp.weight" in name:
            return "shexp"
        if "ffn_down" in name:
            return "ffn_down"
        if "attn_output.weight" in name:
            return "attn_output"
        return None
    if family == "low_bit":
        if n_expert >= 8 and "attn_k" in name:
            return "attn_k"
        if n_expert >= 8 and "attn_q" in name:
            return "attn_q"
        if "attn_qkv.weight" in name:
            return "attn_qkv"
        if "ffn_down" in name:
            return "ffn_down"
        if "attn_output.weight" in name:
            return "attn_output"
        return None
    for key, cls in (("attn_k", "attn_k"), ("attn_q", "attn_q"), ("ffn_down", "ffn_down"),
                     ("attn_output.weight", "attn_output"), ("attn_qkv.weight", "attn_qkv"),
                     ("ffn_gate", "ffn_gate"), ("ffn_up", "ffn_up")):
        if key in name:
            return cls
    return None


def family_of(ftype: str) -> str:
    if ftype in IQ1_R4_BLOCK:
        return "iq1_r4"
    if ftype == "IQ2_KT":
        return "iq2_kt"
    if ftype in LOW_BIT_BLOCK:
        return "low_bit"
    return "generic"


@dataclass(frozen=True)
class Decision:
    type: GGMLType
    reason: str


class TypeChooser:
    """Walks a model's tensors in file order, keeping ik's counters, and decides each tensor's type."""

    def __init__(self, ftype: FileType, facts: ModelFacts, has_imatrix: bool, options: dict[str, str],
                 custom: list[tuple[re.Pattern[str], str]]):
        self.ftype = ftype
        self.facts = facts
        self.has_imatrix = has_imatrix
        self.options = options
        self.custom = custom
        self.family = family_of(ftype.name)
        self.i_attention_wv = 0
        self.counters = {"ffn_down": 0, "ffn_gate": 0, "ffn_up": 0}

    def _layer(self, name: str, counter: str) -> tuple[int, int]:
        """ik's layer_info: the block index from the name in MoE models, else a running counter."""
        if self.facts.n_expert > 1:
            m = re.match(r"blk\.(\d+)\.", name)
            if m is None:
                raise ValueError(f"cannot tell the layer of tensor {name!r}")
            return int(m.group(1)), self.facts.n_layer
        return self.counters[counter], self.facts.n_layer

    def choose(self, name: str, n_per_row: int) -> Decision:
        """ik's llama_tensor_get_type for one tensor (to be called in file order, once per quantized tensor)."""
        default = self.ftype.default_type
        ctx = Context(self.ftype.name, self.facts, default, self.has_imatrix, n_per_row=n_per_row,
                      options=self.options)
        chosen, why = default, f"{self.ftype.name} default"
        is_output = name == "output.weight" or (not self.facts.has_output and name == "token_embd.weight")
        if is_output:
            chosen, why = self._first(OUTPUT_RULES, ctx, default, "output tensor")
        elif name == "token_embd.weight":
            chosen, why = self._first(TOKEN_EMBD_RULES, ctx, default, "token embeddings")
        else:
            cls = tensor_class(name, self.family, self.facts.n_expert)
            rules = {"generic": GENERIC_RULES, "iq1_r4": IQ1_R4_RULES, "iq2_kt": IQ2_KT_RULES,
                     "low_bit": LOW_BIT_RULES}[self.family]
            if cls == "attn_v":
                ctx.i_attention_wv = self.i_attention_wv
            if cls in ("ffn_down", "ffn_gate", "ffn_up"):
                if self.family == "low_bit":
                    ctx.i_layer, ctx.n_layer = self.counters["ffn_down"], self.facts.n_layer
                else:
                    ctx.i_layer, ctx.n_layer = self._layer(name, cls)
            if cls is not None and cls in rules:
                chosen, why = self._first(rules[cls], ctx, default, cls)
            if cls == "attn_v":
                self.i_attention_wv += 1
            if cls in self.counters:
                self.counters[cls] += 1
        for pattern, type_name in self.custom:
            if pattern.search(name):
                chosen, why = type_name, f"--custom-q {pattern.pattern}={type_name}"
                break
        return Decision(type_by_name(chosen), why)

    @staticmethod
    def _first(rules: list[Rule], ctx: Context, default: str, what: str) -> tuple[str, str]:
        for rule in rules:
            if rule.applies(ctx):
                result = rule.result(ctx)
                return result, (rule.note or f"{what} rule for {ctx.ftype}") if result != default else \
                    f"{ctx.ftype} default"
        return default, f"{ctx.ftype} default"


def eligible(name: str, n_dims: int, src: GGMLType) -> bool:
    """ik's test of whether llama-quantize touches a tensor at all (gate_inp handled by the caller)."""
    return (src.name not in INT_TYPES and name.endswith("weight") and n_dims >= 2 and "_norm.weight" not in name
            and not any(s in name for s in NEVER_QUANTIZED) and name not in NEVER_QUANTIZED_EXACT)


def with_row_fallback(gtype: GGMLType, n_per_row: int, name: str = "") -> Decision | None:
    """The type ik actually uses when `gtype`'s super-blocks do not divide the rows (None: no change needed).

    Refuses, as ik does, a type that has no substitute (the BitNet types) on rows its blocks do not divide."""
    need = NO_ROW_FALLBACK.get(gtype.name)
    if need is not None and n_per_row % need:
        raise QuantizeError(f"tensor {name or '(unnamed)'!r} has rows of {n_per_row} values, which {gtype.name}'s "
                            f"{need}-value blocks cannot hold, and {gtype.name} has no fallback type (ik's "
                            "llama-quantize refuses it too); --custom-q 'REGEX=f16' keeps such tensors as they are")
    if gtype.name in ROW_FALLBACK and n_per_row % 256:
        fb = type_by_name(ROW_FALLBACK[gtype.name])
        return Decision(fb, f"{n_per_row} columns are not a multiple of 256: {gtype.name} falls back to {fb.name}")
    return None
