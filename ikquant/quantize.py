"""The streaming whole-model quantizer: GGUF in, GGUF out, one tensor at a time.

The plan (each tensor's new type and why) is made from the input's header alone, with ik's decisions
(ikquant.recipes). Then tensors are read from the memory-mapped input, quantized in row batches (memory: one batch
of float32 rows plus the output tensor; the input's pages are released after each tensor), and streamed to a
temporary file that replaces the output only when complete. Metadata is copied as ik copies it: every input key in
place, general.quantization_version and general.file_type updated (or appended), the imatrix provenance keys
appended.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

from ikquant.cluster import Cluster, ordered_map
from ikquant.errors import MainlineError, QuantizeError, UnknownTypeError
from ikquant.ftypes import FileType
from ikquant.gguf_io import GGUFStreamWriter, KeyValue, TensorInfo
from ikquant.imatrix import Imatrix
from ikquant.recipes import (
    FLOAT_TYPES,
    HONOURED_OPTIONS,
    NEEDS_IMATRIX,
    Decision,
    ModelFacts,
    TypeChooser,
    eligible,
    family_of,
    size_class,
    with_row_fallback,
)
from ikquant.shards import GGUFModel
from ikquant.split_layout import OutputShards
from ikquant.types import GGMLType, type_by_name

#: float32 input held per quantization batch (bytes)
BATCH_BYTES = 64 << 20
#: the per-class options, as QuantizeOptions.class_types keys (their CLI spelling is --attn-q-type etc.)
CLASS_OPTIONS = ("attn_q_type", "attn_k_type", "attn_v_type", "attn_output_type", "ffn_gate_type", "ffn_up_type",
                 "ffn_down_type")


@dataclass
class QuantizeOptions:
    ftype: FileType
    pure: bool = False
    imatrix: Imatrix | None = None
    allow_requantize: bool = False
    leave_output_tensor: bool = False
    ignore_imatrix_rules: bool = False
    #: (regex, type name) in the user's order; first match wins
    custom_q: list[tuple[str, str]] = field(default_factory=list)
    #: per-class types, keys from CLASS_OPTIONS
    class_types: dict[str, str] = field(default_factory=dict)
    output_tensor_type: str | None = None
    token_embedding_type: str | None = None
    #: IQ2_KS with ik's older scalar search (llama-quantize --slow-iq2ks) instead of its default AVX2 one
    slow_iq2ks: bool = False
    #: exact per-tensor types (e.g. a mix chosen from a sweep), applied after every rule
    tensor_types: dict[str, str] = field(default_factory=dict)
    #: whose llama-quantize decides: "ik", or "mainline" (ftype from recipes_mainline, mainline-loadable types only)
    recipe: str = "ik"
    #: --override-kv entries, written as given
    kv_overrides: list[KeyValue] = field(default_factory=list)
    #: --hide-imatrix: the quantize.imatrix.* keys say "top_secret" and 0 instead of the file, dataset and counts
    hide_imatrix: bool = False


@dataclass
class TensorPlan:
    info: TensorInfo
    type: GGMLType
    quantize: bool
    reason: str
    imatrix_entry: str | None = None
    notes: list[str] = field(default_factory=list)
    #: ik's choice when it differs from what is written (a type whose blocks cannot hold the rows)
    ik_type: GGMLType | None = None

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def new_bytes(self) -> int:
        return self.type.tensor_bytes(self.info.ne) if self.quantize else self.info.nbytes


@dataclass
class Plan:
    tensors: list[TensorPlan]
    warnings: list[str]
    #: once written: the files (one, or the shards), and the shards left as they were (OutputShards.partial)
    outputs: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)

    @property
    def bits_per_weight(self) -> float:
        n = sum(p.info.n_elements for p in self.tensors)
        return 8.0 * sum(p.new_bytes for p in self.tensors) / max(n, 1)


def _type(name: str, option: str) -> str:
    try:
        return type_by_name(name).name
    except UnknownTypeError:
        raise QuantizeError(f"{option}: {name!r} is not a ggml type; e.g. q4_K, q6_K, iq4_ks, q8_0, f16") from None


def model_facts(src: GGUFModel) -> ModelFacts:
    """The hyperparameters ik's rules consult, from the GGUF header."""
    arch = src.architecture

    def first(key: str, default: int) -> int:
        v = src.get(f"{arch}.{key}")
        if isinstance(v, list):
            v = v[0] if v else default
        return int(v) if v is not None else default

    n_head = first("attention.head_count", 0)
    n_head_kv = first("attention.head_count_kv", n_head)
    n_layer = first("block_count", 0)
    tokens = src.get("tokenizer.ggml.tokens")
    n_vocab = first("vocab_size", len(tokens) if tokens else 0)
    names = list(src.tensors)
    return ModelFacts(
        arch=arch,
        n_expert=first("expert_count", 0),
        n_gqa=n_head // n_head_kv if n_head_kv else 0,
        n_layer=n_layer,
        n_vocab=n_vocab,
        size_class=size_class(arch, n_layer, n_vocab, first("embedding_length", 0), n_head, n_head_kv),
        has_output="output.weight" in src.tensors,
        n_attention_wv=sum(1 for n in names if "attn_v.weight" in n or "attn_qkv.weight" in n),
    )


def make_plan(src: GGUFModel, opts: QuantizeOptions) -> Plan:
    """Each tensor's type and the reason, as ik's (or with recipe "mainline", mainline's) llama-quantize decides
    them (no tensor data is read)."""
    if opts.recipe == "mainline":
        return _mainline_plan(src, opts)
    warnings: list[str] = []
    class_types = {k: _type(v, f"--{k.replace('_', '-')}") for k, v in opts.class_types.items()}
    custom = _custom_rules(opts)
    out_type = _type(opts.output_tensor_type, "--output-tensor-type") if opts.output_tensor_type else None
    embd_type = _type(opts.token_embedding_type, "--token-embedding-type") if opts.token_embedding_type else None
    base = opts.ftype.base
    rules_apply = not opts.pure and base.name not in FLOAT_TYPES
    if not rules_apply and (custom or class_types):
        why = "--pure" if opts.pure else f"a float type ({base.name})"
        warnings.append(f"with {why}, ik ignores --custom-q and the per-class options: they are ignored here too")
    if rules_apply:
        honoured = HONOURED_OPTIONS[family_of(opts.ftype.name)]
        for key in class_types:
            if key not in honoured:
                warnings.append(f"--{key.replace('_', '-')} is ignored by ik's rules for {opts.ftype.name} "
                                f"(that type reads only: {', '.join('--' + h.replace('_', '-') for h in honoured)})")
    facts = model_facts(src)
    chooser = TypeChooser(opts.ftype, facts, opts.imatrix is not None, class_types,
                          custom if rules_apply else [])
    unknown = sorted(set(opts.tensor_types) - set(src.tensors))
    if unknown:
        raise QuantizeError(f"the type mix names tensor {unknown[0]!r}, which {src.path} does not have: "
                            "was the sweep made on another model?")
    plans = []
    for info in src.tensors.values():
        plans.append(_plan_tensor(info, opts, chooser, rules_apply, out_type, embd_type))
    for regex, _ in (opts.custom_q if rules_apply else []):
        if not any(re.search(regex, p.name) for p in plans if p.quantize or eligible(p.name, p.info.n_dims,
                                                                                     p.info.type)):
            warnings.append(f"--custom-q {regex!r} matches no tensor")
    _check_imatrix(plans, opts, warnings)
    _check_ik_matmul_rows(plans, warnings)
    return Plan(plans, warnings)


def _plan_tensor(info: TensorInfo, opts: QuantizeOptions, chooser: TypeChooser, rules_apply: bool,
                 out_type: str | None, embd_type: str | None) -> TensorPlan:
    name = info.name
    keep = TensorPlan(info, info.type, False, "")
    if not eligible(name, info.n_dims, info.type):
        keep.reason = "never quantized (1-D, norm, integer, bias or excluded tensor)"
        return keep
    if opts.leave_output_tensor and name == "output.weight":
        keep.reason = "--leave-output-tensor"
        return keep
    notes: list[str] = []
    if rules_apply:
        decision = chooser.choose(name, info.n_per_row)
    else:
        decision = Decision(opts.ftype.base, "--pure" if opts.pure else f"{opts.ftype.name} default")
    fallback = with_row_fallback(decision.type, info.n_per_row, name)
    if fallback is not None:
        decision = fallback
        notes.append(fallback.reason)
    if embd_type and name == "token_embd.weight":
        decision = Decision(type_by_name(embd_type), "--token-embedding-type")
    if out_type and name == "output.weight":
        decision = Decision(type_by_name(out_type), "--output-tensor-type")
    if name in opts.tensor_types:
        decision = Decision(type_by_name(opts.tensor_types[name]), "chosen from the sweep")
    # as ik, after every override: token embeddings and rows that are no whole group are never interleaved
    if decision.type.base is not None and (name == "token_embd.weight" or info.ne[1] % decision.type.row_group):
        why = ("token embeddings are not interleaved" if name == "token_embd.weight" else
               f"{info.ne[1]} rows are not a multiple of {decision.type.row_group}")
        decision = Decision(type_by_name(decision.type.base), f"{why}: {decision.type.name} becomes its base type")
        notes.append(decision.reason)
    if decision.type is info.type:
        keep.reason = f"already {info.type.name}"
        return keep
    if info.n_per_row % decision.type.block_size:
        keep.reason = decision.reason
        keep.ik_type = decision.type
        keep.notes = notes + [
            f"ik chooses {decision.type.ggml_name}, but {info.n_per_row} columns cannot hold its "
            f"{decision.type.block_size}-value blocks (ik's llama-quantize writes a broken, zero-byte tensor here); "
            f"kept as {info.type.ggml_name}"]
        return keep
    return _quantized(info, decision, opts, notes)


def _custom_rules(opts: QuantizeOptions) -> list[tuple[re.Pattern[str], str]]:
    """--custom-q as (compiled regex, type name), in the user's order."""
    custom = []
    for regex, tname in opts.custom_q:
        try:
            custom.append((re.compile(regex), _type(tname, f"--custom-q {regex}")))
        except re.error as exc:
            raise QuantizeError(f"--custom-q: {regex!r} is not a valid regular expression ({exc})") from None
    return custom


def _quantized(info: TensorInfo, decision: Decision, opts: QuantizeOptions, notes: list[str]) -> TensorPlan:
    """The plan of a tensor that is re-encoded (refused for quantized input unless --allow-requantize), with the
    imatrix entry it will use."""
    if info.type.name not in FLOAT_TYPES and not opts.allow_requantize:
        raise QuantizeError(f"tensor {info.name!r} is already quantized ({info.type.name}); requantizing loses "
                            "accuracy twice, pass --allow-requantize to do it anyway")
    plan = TensorPlan(info, decision.type, True, decision.reason, notes=notes)
    if opts.imatrix is not None:
        n_mat = info.ne[2] if len(info.ne) > 2 else 1
        _, plan.imatrix_entry = opts.imatrix.lookup(info.name, info.n_per_row, n_mat, info.n_rows)
    return plan


def _mainline_plan(src: GGUFModel, opts: QuantizeOptions) -> Plan:
    """make_plan for mainline llama.cpp: its rules, in its loader's order, and only types it loads."""
    from ikquant.recipes_mainline import MainlineChooser, loader_order, require_mainline_type, with_fallback
    from ikquant.recipes_mainline import eligible as mainline_eligible

    if opts.class_types:
        raise MainlineError("mainline's llama-quantize has no per-class type options (--attn-v-type, ...); give "
                            "--custom-q 'attn_v=TYPE' instead")
    custom = _custom_rules(opts)
    for pattern, tname in custom:
        require_mainline_type(tname, f"--custom-q {pattern.pattern}={tname}")
    overrides = {"token_embd.weight": opts.token_embedding_type, "output.weight": opts.output_tensor_type}
    for name, override in overrides.items():
        if override:
            require_mainline_type(_type(override, name), f"type for {name}")
    rules_apply = not opts.pure and opts.ftype.default_type not in FLOAT_TYPES
    chooser = MainlineChooser(opts.ftype, model_facts(src), opts.imatrix is not None, list(src.tensors))
    decided: dict[str, Decision] = {}
    for name in loader_order(list(src.tensors)):
        info = src.tensors[name]
        if not mainline_eligible(name, info.n_dims) or (opts.leave_output_tensor and name == "output.weight"):
            continue
        if overrides.get(name):
            decided[name] = Decision(type_by_name(_type(overrides[name] or "", name)), "type option")
            continue
        chosen = next(((t, f"--custom-q {p.pattern}={t}") for p, t in custom if p.search(name)), None)
        if chosen is None:
            t = chooser.choose(name, info.n_per_row, info.ne[2] if len(info.ne) > 2 else 1) if rules_apply \
                else opts.ftype.default_type
            chosen = (t, f"mainline's {opts.ftype.name} rule" if t != opts.ftype.default_type else
                      f"{opts.ftype.name} default")
        decision = Decision(type_by_name(chosen[0]), chosen[1])
        fallback = with_fallback(decision.type.name, info.n_per_row)
        decided[name] = fallback or decision
    plans = []
    for name, info in src.tensors.items():
        if name in opts.tensor_types:
            require_mainline_type(opts.tensor_types[name], f"the type mix's {name}")
            decided[name] = Decision(type_by_name(opts.tensor_types[name]), "chosen from the sweep")
        d = decided.get(name)
        if d is None or d.type is info.type:
            plans.append(TensorPlan(info, info.type, False, "never quantized by mainline" if d is None else
                                    f"already {info.type.name}"))
            continue
        require_mainline_type(d.type.name, name)
        plans.append(_quantized(info, d, opts, []))
    warnings: list[str] = []
    _check_imatrix(plans, opts, warnings)
    _check_ik_matmul_rows(plans, warnings)
    return Plan(plans, warnings)


def check_writable(plan: Plan) -> None:
    """Refuse, before any file is created, a plan naming a type iktools cannot encode (or a source it cannot read), or
    one that gives a type needing importance data to a tensor without it."""
    import ikquant.formats  # noqa: F401  (importing the formats registers their codecs)

    missing: dict[str, list[str]] = {}
    for p in plan.tensors:
        if p.quantize and (p.type.codec is None or not p.type.codec.can_quantize or p.info.type.codec is None):
            missing.setdefault(p.type.name if p.info.type.codec is not None else p.info.type.name, []).append(p.name)
    if missing:
        first, names = next(iter(missing.items()))
        raise QuantizeError(f"the plan needs {', '.join(missing)}, which iktools cannot encode or decode yet "
                            f"({first}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}); nothing was "
                            "written (--dry-run shows the plan; --custom-q, --token-embedding-type or "
                            "--output-tensor-type can give those tensors another type)")
    # ik's quantizer itself asserts importance data for these (ggml_quantize_requires_imatrix): no option lifts it
    bare = [p for p in plan.tensors if p.quantize and p.type.codec is not None and p.type.codec.requires_imatrix
            and p.imatrix_entry is None]
    if bare:
        raise QuantizeError(
            f"{bare[0].type.name} cannot be quantized without importance data, and {len(bare)} tensors would be "
            f"without it ({', '.join(p.name for p in bare[:6])}{' ...' if len(bare) > 6 else ''}); nothing was "
            "written: pass --imatrix with entries for them, or give them another type (--custom-q)")


#: file types ik's llama-quantize refuses outright without an imatrix (examples/quantize), before any tensor's rule
FTYPES_NEED_IMATRIX = ("IQ2_XS", "IQ2_XXS", "IQ2_S", "IQ2_XXS_R4", "Q2_K_S", "IQ2_XS_R4", "IQ1_S", "IQ1_S_R4",
                       "IQ1_M_R4", "IQ1_M")


def _check_imatrix(plans: list[TensorPlan], opts: QuantizeOptions, warnings: list[str]) -> None:
    quantized = [p for p in plans if p.quantize]
    if opts.imatrix is not None and quantized and opts.imatrix.entries:
        if not any(p.imatrix_entry for p in quantized):
            sample = ", ".join(list(opts.imatrix.entries)[:3])
            raise QuantizeError(f"{opts.imatrix.path}: none of its {len(opts.imatrix.entries)} entries ({sample}, ...) "
                                "names a tensor of this model: is this imatrix for another model?")
        missing = [p.name for p in quantized if p.imatrix_entry is None]
        if missing:
            warnings.append(f"no imatrix entry for {len(missing)} tensors: {', '.join(missing[:6])}"
                            + (" ..." if len(missing) > 6 else ""))
    if opts.ignore_imatrix_rules:
        return
    if opts.imatrix is None and opts.ftype.name in FTYPES_NEED_IMATRIX:
        raise QuantizeError(f"--type {opts.ftype.name} without an importance matrix: ik refuses it as garbage (whatever "
                            "the tensors' rows allow); pass --imatrix (or --ignore-imatrix-rules to quantize anyway)")
    needy = [p for p in quantized if p.type.name in NEEDS_IMATRIX and p.imatrix_entry is None
             and p.name not in ("token_embd.weight", "output.weight")]
    if needy:
        raise QuantizeError(
            f"{len(needy)} tensors would become {needy[0].type.name} without importance data ({', '.join(p.name for p in needy[:6])}"
            + (" ..." if len(needy) > 6 else "") + "); ik refuses such low-bit output as garbage: pass --imatrix "
            "(or --ignore-imatrix-rules to quantize anyway)"
        )


#: interleaved types whose CPU matmul in ik needs rows of a multiple of this many values; on other rows ik's kernel
#: refuses and its fallback writes no output (iqk_set_kernels_1bit / the Q8_KV_R8 kernels), so the file holds the
#: tensor as ik's recipe chose it but ik computes garbage with it
IK_MATMUL_ROW_MULTIPLE = {"IQ1_S_R4": 128, "IQ1_M_R4": 128, "Q8_KV_R8": 256}


def _check_ik_matmul_rows(plans: list[TensorPlan], warnings: list[str]) -> None:
    """Warn (the plan stays ik's) about tensors ik writes in a type its own CPU matmul cannot multiply."""
    for tname, multiple in IK_MATMUL_ROW_MULTIPLE.items():
        bad = [p.name for p in plans if p.quantize and p.type.name == tname and p.info.n_per_row % multiple]
        if bad:
            warnings.append(f"{len(bad)} tensors become {tname} with rows that are no multiple of {multiple} values "
                            f"({', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}): ik's CPU matmul leaves their "
                            "products unwritten (garbage results); --custom-q can give them another type")


def output_metadata(src: GGUFModel, opts: QuantizeOptions) -> list[KeyValue]:
    """The output's key/values in ik's order: input keys (updated in place), then new ones."""
    kvs = list(src.kv())
    by_key = {kv.key: kv for kv in kvs}

    def put(kv: KeyValue) -> None:
        if kv.key in by_key:
            old = by_key[kv.key]
            old.value, old.type, old.sub_type = kv.value, kv.type, kv.sub_type
        else:
            kvs.append(kv)
            by_key[kv.key] = kv

    put(KeyValue("general.quantization_version", 2, GGUFValueType.UINT32))
    for kv in opts.kv_overrides:  # ik applies the user's overrides, then its own imatrix entries
        put(kv)
    if opts.imatrix is not None and opts.imatrix.entries:
        imat, hide = opts.imatrix, opts.hide_imatrix
        put(KeyValue("quantize.imatrix.file", "top_secret" if hide else str(imat.path), GGUFValueType.STRING))
        if imat.dataset:
            put(KeyValue("quantize.imatrix.dataset", "top_secret" if hide else imat.dataset, GGUFValueType.STRING))
        put(KeyValue("quantize.imatrix.entries_count", 0 if hide else len(imat.entries), GGUFValueType.INT32))
        if imat.chunks > 0:
            put(KeyValue("quantize.imatrix.chunks_count", 0 if hide else imat.chunks, GGUFValueType.INT32))
    put(KeyValue("general.file_type", opts.ftype.id, GGUFValueType.UINT32))
    return kvs


def ik_call_rows(codec_rows_interact: bool, weighted: bool, n_per_row: int, rows_per_mat: int, n_mat: int,
                 threads: int) -> int:
    """Rows per quantize call that reproduce llama-quantize's batching, where a codec's output depends on it.

    ik quantizes a whole matrix per call when single-threaded (or, with threads, a whole expert matrix per thread);
    otherwise in chunks of at least 16384 values. Codecs whose rows do not interact are batched by memory only.
    """
    if not codec_rows_interact or weighted:
        return max(1, min(rows_per_mat, BATCH_BYTES // (4 * n_per_row)))
    if threads < 2 or (n_mat > 1 and (n_mat % threads == 0 or n_mat >= 2 * threads)):
        return rows_per_mat
    min_chunk = 32 * 512
    return max(1, -(-min_chunk // n_per_row)) if n_per_row < min_chunk else 1


def quantize_tensor(src: GGUFModel, plan: TensorPlan, imatrix: Imatrix | None, slow_iq2ks: bool = False,
                    threads: int | None = None) -> np.ndarray:
    """The new bytes of one tensor, quantized in row batches (bounded memory). `threads` sets the batching (which
    some codecs' results depend on, as ik's do); default: this process's thread count."""
    import numba

    info = plan.info
    codec = plan.type.require_codec()
    if slow_iq2ks and plan.type.name == "IQ2_KS":
        codec = codec.with_user_data({"slow_iq2_ks": True})  # type: ignore[attr-defined]
    return quantize_rows(src.raw(info.name), info, plan.type, codec, imatrix, threads or numba.get_num_threads(),
                         lambda r0, r1: src.release(info.name, r0, r1))


def _quantize_on_worker(src_path: str, name: str, type_name: str, imatrix: Imatrix | None, slow_iq2ks: bool,
                        threads: int) -> np.ndarray:
    """One tensor quantized in a cluster worker, from the input file at the same path."""
    from ikquant.types import type_by_name

    src = GGUFModel(Path(src_path))
    info = src.tensors[name]
    return quantize_tensor(src, TensorPlan(info, type_by_name(type_name), True, ""), imatrix, slow_iq2ks, threads)


def quantize_rows(raw: np.ndarray, info: TensorInfo, gtype: GGMLType, codec, imatrix: Imatrix | None,  # type: ignore[no-untyped-def]
                  threads: int, done: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Re-encode a tensor's rows (`raw`, stored as info.type) as `gtype`: each importance slice (per expert,
    or per head for MLA) applied to its block of rows, batched as ik batches its calls."""
    n = info.n_per_row
    n_mat = info.ne[2] if len(info.ne) > 2 else 1
    weights = imatrix.lookup(info.name, n, n_mat, info.n_rows)[0] if imatrix is not None else None
    groups = weights.shape[0] if weights is not None else n_mat
    rows_per_group = info.n_rows // groups
    src_codec = info.type.require_codec()
    out = np.empty((info.n_rows, gtype.row_bytes(n)), dtype=np.uint8)
    batch = ik_call_rows(codec.rows_interact, weights is not None, n, rows_per_group, groups, threads)
    batch = -(-batch // gtype.row_group) * gtype.row_group  # interleaved types quantize whole row groups, as ik
    for g in range(groups):
        w = None if weights is None else weights[g]
        for r0 in range(g * rows_per_group, (g + 1) * rows_per_group, batch):
            r1 = min(r0 + batch, (g + 1) * rows_per_group)
            out[r0:r1] = codec.quantize(src_codec.dequantize(raw[r0:r1], n), w)
            if done is not None:
                done(r0, r1)
    return out


def quantize_model(src_path: Path, dst_path: Path, opts: QuantizeOptions,
                   progress: Callable[[TensorPlan], None] | None = None, cluster: Cluster | None = None,
                   shards: OutputShards | None = None) -> Plan:
    """Quantize `src_path` (one file, or the first shard of a split model) into `dst_path` per `opts`, laid out in
    files per `shards`; returns the executed plan. With a `cluster`, the tensors are quantized on its workers
    (batched as this process would batch them) and written here in order: the same bytes as a local run."""
    if Path(src_path).resolve() == Path(dst_path).resolve():
        raise QuantizeError(f"output {dst_path} is the input file; choose another output path")
    src = GGUFModel(src_path)
    plan = make_plan(src, opts)
    check_writable(plan)
    # ik always writes 32-byte alignment even when it copies a different general.alignment (an inconsistent
    # file); we write the alignment the copied key announces.
    shards = shards or OutputShards()
    keep = shards.keep_input and src.is_split
    with GGUFStreamWriter(dst_path, src.architecture, src.alignment, shards.limits, shards.partial) as writer:
        writer.copy_kvs(output_metadata(src, opts))
        for p in plan.tensors:
            writer.add_tensor_info(p.name, p.info.written_shape, p.type, src.shard_of(p.name) if keep else None)
        todo = Plan([p for p in plan.tensors if not writer.is_kept(p.name)], plan.warnings)
        for p, data in zip(todo.tensors, _tensor_bytes(src, todo, opts, cluster)):
            writer.write_tensor(p.name, data)
            del data
            src.release(p.name)
            if progress is not None:
                progress(p)
        writer.finish()
    plan.outputs, plan.kept = writer.outputs, writer.kept
    return plan


def _tensor_bytes(src: GGUFModel, plan: Plan, opts: QuantizeOptions, cluster: Cluster | None) -> Iterator[np.ndarray]:
    """Every planned tensor's output bytes, in plan order."""
    if cluster is None:
        for p in plan.tensors:
            yield quantize_tensor(src, p, opts.imatrix, opts.slow_iq2ks) if p.quantize else src.raw(p.name)
        return
    import numba

    imatrix = cluster.ray.put(opts.imatrix)
    calls = [(str(src.path), p.name, p.type.name, imatrix, opts.slow_iq2ks, numba.get_num_threads())
             for p in plan.tensors if p.quantize]
    remote = ordered_map(cluster, _quantize_on_worker, calls)
    for p in plan.tensors:
        yield next(remote) if p.quantize else src.raw(p.name)
