"""Which type each tensor gets in mainline llama.cpp's llama-quantize (`ikquant --recipe mainline`): its file
types, its per-tensor rules, its row-length fallbacks and the types it can load, as facts from its
src/llama-quant.cpp (the copy vendored in llama-cpp-python 0.3.36 made the golden plans).

Mainline decides differently from ik: tensors are visited in its loader's order (names outside blocks first, then
block by block, each sorted by name), which its counters (attn_v-like tensors, ffn_down/gate/up) follow; a tensor
is put in one category by substring (attn_kv_b and attn_qkv count as attn_v); its MoE rules test for exactly 8
experts; its fallbacks for rows that 256-value blocks do not fit are its own (Q2_K/Q3_K -> Q4_0, Q5_K -> Q5_1) and
fall back to F16 when even those do not fit.
"""

from __future__ import annotations

from ikquant.errors import MainlineError
from ikquant.ftypes import FileType
from ikquant.recipes import Decision, ModelFacts, use_more_bits
from ikquant.types import type_by_name

MainlineFileType = FileType  # the same fields; the ids are mainline's general.file_type values

MAINLINE_FTYPES = {f.name: f for f in (
    MainlineFileType("F32", 0, "F32"), MainlineFileType("F16", 1, "F16"), MainlineFileType("BF16", 32, "BF16"),
    MainlineFileType("Q4_0", 2, "Q4_0"), MainlineFileType("Q4_1", 3, "Q4_1"), MainlineFileType("Q5_0", 8, "Q5_0"),
    MainlineFileType("Q5_1", 9, "Q5_1"), MainlineFileType("Q8_0", 7, "Q8_0"), MainlineFileType("Q2_K", 10, "Q2_K"),
    MainlineFileType("Q2_K_S", 21, "Q2_K"), MainlineFileType("Q3_K_S", 11, "Q3_K"),
    MainlineFileType("Q3_K_M", 12, "Q3_K"), MainlineFileType("Q3_K_L", 13, "Q3_K"),
    MainlineFileType("Q4_K_S", 14, "Q4_K"), MainlineFileType("Q4_K_M", 15, "Q4_K"),
    MainlineFileType("Q5_K_S", 16, "Q5_K"), MainlineFileType("Q5_K_M", 17, "Q5_K"),
    MainlineFileType("Q6_K", 18, "Q6_K"), MainlineFileType("IQ2_XXS", 19, "IQ2_XXS"),
    MainlineFileType("IQ2_XS", 20, "IQ2_XS"), MainlineFileType("IQ2_S", 28, "IQ2_XS"),
    MainlineFileType("IQ2_M", 29, "IQ2_S"), MainlineFileType("IQ1_S", 24, "IQ1_S"),
    MainlineFileType("IQ1_M", 31, "IQ1_M"), MainlineFileType("IQ3_XXS", 23, "IQ3_XXS"),
    MainlineFileType("IQ3_XS", 22, "IQ3_S"), MainlineFileType("IQ3_S", 26, "IQ3_S"),
    MainlineFileType("IQ3_M", 27, "IQ3_S"), MainlineFileType("IQ4_NL", 25, "IQ4_NL"),
    MainlineFileType("IQ4_XS", 30, "IQ4_XS"), MainlineFileType("MXFP4_MOE", 38, "MXFP4"),
)}
#: the tensor types mainline llama.cpp reads (of those iktools knows)
MAINLINE_TYPES = frozenset(("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                            "Q5_K", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
                            "IQ4_NL", "IQ4_XS", "MXFP4", "I8", "I16", "I32", "I64"))
FALLBACK = {**dict.fromkeys(("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS"), "IQ4_NL"),
            **dict.fromkeys(("Q2_K", "Q3_K"), "Q4_0"), "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_EXCLUDED = ("ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj", "ssm_conv1d",
             "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight", "time_mix_first.weight",
             "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight", "time_mix_v0.weight",
             "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight",
             "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight", "time_mix_decay_w1.weight",
             "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd",
             "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook",
             "mm.a.code_embd")
LOW_BIT = ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")
IQ2SM = ("IQ2_S", "IQ2_M")
ATTN_OUTPUT_Q5K_MOE = ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S",
                       "IQ3_M", "IQ4_XS")


def recipe_file_type(recipe: str, name: str) -> FileType:
    """The file type `name` as `--recipe` (ik or mainline) defines it."""
    from ikquant.ftypes import file_type

    if recipe not in ("ik", "mainline"):
        raise MainlineError(f"--recipe must be ik or mainline, not {recipe!r}")
    return mainline_file_type(name) if recipe == "mainline" else file_type(name)


def mainline_file_type(name: str) -> MainlineFileType:
    ft = MAINLINE_FTYPES.get(name.strip().upper())
    if ft is None:
        raise MainlineError(f"--recipe mainline: {name!r} is not one of mainline llama.cpp's file types "
                            f"({', '.join(MAINLINE_FTYPES)}); ik-only types such as IQ4_KS load in ik_llama.cpp only")
    return ft


def require_mainline_type(type_name: str, what: str) -> None:
    if type_name.upper() not in MAINLINE_TYPES:
        raise MainlineError(f"{what}: {type_name} is an ik_llama.cpp type; mainline llama.cpp and the runtimes built on "
                            "it (llama-cpp-python, Ollama, LM Studio) cannot load it (use --recipe ik for ik_llama.cpp)")


def eligible(name: str, n_dims: int) -> bool:
    """Mainline's tensor_allows_quantization (its output tensor is quantized unless told otherwise)."""
    return (n_dims >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and not any(s in name for s in _EXCLUDED) and name not in ("position_embd.weight", "token_types.weight"))


def category(name: str) -> str:
    """Mainline's tensor_get_category, by its substring tests in its order."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
                     ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                     ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def loader_order(names: list[str]) -> list[str]:
    """Mainline's loader visits tensors by block number (names outside blocks first), then by name."""
    def key(name: str) -> tuple[int, str]:
        if name.startswith("blk."):
            head = name[4:].split(".", 1)[0]
            if head.isdigit():
                return int(head), name
        return -1, name

    return sorted(names, key=key)


class MainlineChooser:
    """Mainline's llama_tensor_get_type_impl over a model's tensors, with its counters."""

    def __init__(self, ftype: MainlineFileType, facts: ModelFacts, has_imatrix: bool, names: list[str]):
        self.ftype, self.facts, self.has_imatrix = ftype.name, facts, has_imatrix
        self.default = ftype.default_type
        self.n_attention_wv = sum(1 for n in names if category(n) in ("attn_v", "attn_qkv", "attn_kv_b"))
        self.tied = "output.weight" not in names
        self.i = {"attn_wv": 0, "ffn_down": 0, "ffn_gate": 0, "ffn_up": 0}

    def _layer(self, name: str, counter: str) -> tuple[int, int]:
        if max(1, self.facts.n_expert) > 1:
            head = name[4:].split(".", 1)[0] if name.startswith("blk.") else ""
            if not head.isdigit():
                raise MainlineError(f"cannot tell the layer of tensor {name!r}")
            return int(head), self.facts.n_layer
        return self.i[counter], self.facts.n_layer

    def choose(self, name: str, n_per_row: int, n_mat: int) -> str:
        """The type for one tensor (call in loader_order, for eligible tensors only)."""
        ft, f, t = self.ftype, self.facts, self.default
        cat = category(name)
        attn_v_like = cat in ("attn_v", "attn_qkv", "attn_kv_b")
        if cat == "output" or (self.tied and cat == "token_embd"):
            block = type_by_name(t).block_size
            if ft == "MXFP4_MOE" or f.arch == "falcon" or n_per_row % block:
                return "Q8_0"
            if ft in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"):
                return "Q5_K"
            return "Q6_K" if t != "Q8_0" else t
        if ft == "MXFP4_MOE":
            return "MXFP4" if n_mat > 1 else "Q8_0"
        if cat == "token_embd":
            if ft in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
                return "Q2_K"
            if ft in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
                return "IQ3_S"
            return t
        if ft in LOW_BIT:
            if attn_v_like:
                self.i["attn_wv"] += 1
                if f.n_gqa >= 4 or f.n_expert >= 4:
                    return "Q4_K"
                return "IQ3_S" if ft in IQ2SM else "Q2_K"
            if f.n_expert == 8 and cat == "attn_k":
                return "Q4_K"
            if cat == "ffn_down":
                low = self.i["ffn_down"] < f.n_layer // 8
                self.i["ffn_down"] += 1
                return ("IQ3_S" if ft in IQ2SM else "Q2_K") if low else t
            if cat == "attn_output":
                if f.n_expert == 8:
                    return "Q5_K"
                return "IQ2_XXS" if ft in ("IQ1_S", "IQ1_M") else "IQ3_S" if ft in IQ2SM else t
            return t
        if attn_v_like:
            i = self.i["attn_wv"]
            if ft == "Q2_K":
                t = "Q4_K" if f.n_gqa >= 4 else "Q3_K"
            elif ft == "Q2_K_S" and f.n_gqa >= 4:
                t = "Q4_K"
            elif ft == "IQ3_XXS":
                t = "Q4_K" if f.n_gqa >= 4 else "IQ3_S" if not self.has_imatrix else "IQ3_XXS"
            elif ft in ("IQ3_XS", "IQ3_S") and f.n_gqa >= 4:
                t = "Q4_K"
            elif ft == "IQ3_M":
                t = "Q4_K"
            elif ft == "Q3_K_M":
                t = "Q5_K" if i < 2 else "Q4_K"
            elif ft == "Q3_K_L":
                t = "Q5_K"
            elif ft in ("IQ4_NL", "IQ4_XS") and f.n_gqa >= 4:
                t = "Q5_K"
            elif ft in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, self.n_attention_wv):
                t = "Q6_K"
            elif ft == "Q4_K_S" and i < 4:
                t = "Q5_K"
            if f.size_class == "70B" and t in ("Q3_K", "Q4_K"):
                t = "Q5_K"
            if f.n_expert == 8:
                t = "Q8_0"
            self.i["attn_wv"] += 1
            return t
        if cat == "attn_k":
            if f.n_expert == 8:
                return "Q8_0"
            return {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(ft, t)
        if cat == "attn_q":
            return {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(ft, t)
        if cat == "ffn_down":
            il, nl = self._layer(name, "ffn_down")
            self.i["ffn_down"] += 1
            more = use_more_bits(il, nl)
            if ft == "Q2_K":
                return "Q3_K"
            if ft == "Q2_K_S":
                return "Q4_K" if il < nl // 8 else t
            if ft == "IQ3_XXS" and not self.has_imatrix:
                return "Q4_K" if il < nl // 8 else "Q3_K"
            if ft == "Q3_K_M":
                return "Q5_K" if il < nl // 16 else "Q4_K" if f.arch != "falcon" or more else "Q3_K"
            if ft == "IQ3_M" and (il < nl // 8 or (f.n_expert == 8 and more)):
                return "Q4_K"
            if ft == "Q3_K_L":
                return "Q4_K" if f.arch == "falcon" else "Q5_K"
            if ft == "Q4_K_M":
                if f.arch == "falcon":
                    return "Q6_K" if il < nl // 16 else "Q5_K" if more else "Q4_K"
                return "Q6_K" if more else t
            if il < nl // 8 and ft in ("IQ4_NL", "IQ4_XS") and not self.has_imatrix:
                return "Q5_K"
            if ft == "Q5_K_M" and more:
                return "Q6_K"
            if ft == "Q4_K_S" and f.arch != "falcon" and il < nl // 8:
                return "Q5_K"
            if ft in ("Q4_0", "Q5_0") and self.has_imatrix and il < nl // 8:
                return "Q4_1" if ft == "Q4_0" else "Q5_1"
            return t
        if cat == "attn_output":
            if f.arch != "falcon":
                if f.n_expert == 8:
                    return "Q5_K" if ft in ATTN_OUTPUT_Q5K_MOE else t
                return {"Q2_K": "Q3_K", "IQ3_XXS": "IQ3_S", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K", "IQ3_M": "Q4_K"}.get(ft, t)
            return "Q4_K" if ft == "Q3_K_L" else t
        if cat in ("ffn_gate", "ffn_up"):
            il, nl = self._layer(name, cat)
            self.i[cat] += 1
            return "IQ3_XXS" if ft == "IQ3_XS" and nl // 8 <= il < 7 * nl // 8 else t
        return t


def with_fallback(type_name: str, n_per_row: int) -> Decision | None:
    """Mainline's tensor_type_fallback: its replacement when the rows do not hold the type's blocks."""
    gtype = type_by_name(type_name)
    if n_per_row % gtype.block_size == 0:
        return None
    if type_name not in FALLBACK:
        raise MainlineError(f"mainline has no fallback for {type_name} on rows of {n_per_row}")
    fb = type_by_name(FALLBACK[type_name])
    if n_per_row % fb.block_size:
        fb = type_by_name("F16")
    return Decision(fb, f"{n_per_row} columns are not a multiple of {gtype.block_size}: mainline falls back from "
                        f"{type_name} to {fb.name}")
