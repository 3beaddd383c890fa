"""`ikquant`: quantize a GGUF (one file or a split one) with ik_llama.cpp's formats and per-tensor decisions
(`ikquant IN.gguf OUT.gguf --type T ...` runs `quantize`), and write a model card for the result."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table
from typer.core import TyperGroup

from ikquant.cli_common import (
    MAX_ACCEPTANCE_LOSS,
    MIN_TYPE,
    MTP_SWEEP,
    NO_DEFAULT_TIES,
    NO_TENSOR_FIRST_SPLIT,
    OVERRIDE_KV,
    SPLIT_MAX_SIZE,
    SPLIT_MAX_TENSORS,
    TIE,
    App,
    err,
    fail,
    out,
    print_shard_plan,
    report_outputs,
)
from ikquant.errors import IkError

if TYPE_CHECKING:
    from ikquant.split_layout import OutputShards

class _QuantizeByDefault(TyperGroup):
    """`ikquant IN OUT --type T` runs `quantize`; `ikquant card ...` the named command."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["quantize", *args]
        return super().parse_args(ctx, args)


app = App(cls=_QuantizeByDefault, add_completion=False, no_args_is_help=True, help=__doc__)


def _custom_q(values: list[str]) -> list[tuple[str, str]]:
    """ik's --custom-q syntax: comma-separated regex=type pairs (split at the first '=')."""
    rules = []
    for value in values:
        for item in value.split(","):
            if not item.strip():
                continue
            regex, sep, tname = item.partition("=")
            if not sep or not regex or not tname:
                fail(f"--custom-q: {item!r} is not of the form regex=type")
            rules.append((regex, tname))
    return rules


@app.command(context_settings={"help_option_names": ["--help", "-h"]})
def quantize(
    src: Path = typer.Argument(..., help="Input GGUF (f32/f16/bf16, or quantized with --allow-requantize)."),
    dst: Path = typer.Argument(..., help="Output GGUF (written to a temporary name, renamed when complete)."),
    type_name: Optional[str] = typer.Option(None, "--type", help="Target file type, as ik names it "
                                            "(case-insensitive): Q4_0, Q8_0, Q4_K_M, Q6_K, IQ4_KS, IQ2_KT, MXFP4, "
                                            "F16, BF16, ... (required unless --repack or --unpack)."),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", help="Importance matrix: ik's .dat, or mainline "
                                           "llama.cpp's GGUF imatrix (which ik itself cannot read)."),
    include_weights: list[str] = typer.Option([], "--include-weights", help="Use only imatrix entries whose name "
                                              "contains this text (repeatable)."),
    exclude_weights: list[str] = typer.Option([], "--exclude-weights", help="Drop imatrix entries whose name "
                                              "contains this text (repeatable)."),
    custom_q: list[str] = typer.Option([], "--custom-q", help="'regex=type,regex=type': tensors matching a regex "
                                       "(first match wins) get that type instead of the ftype's choice."),
    attn_q_type: Optional[str] = typer.Option(None, "--attn-q-type", help="Type for attn_q tensors."),
    attn_k_type: Optional[str] = typer.Option(None, "--attn-k-type", help="Type for attn_k tensors."),
    attn_v_type: Optional[str] = typer.Option(None, "--attn-v-type", help="Type for attn_v tensors."),
    attn_output_type: Optional[str] = typer.Option(None, "--attn-output-type", help="Type for attn_output."),
    ffn_gate_type: Optional[str] = typer.Option(None, "--ffn-gate-type", help="Type for ffn_gate tensors."),
    ffn_up_type: Optional[str] = typer.Option(None, "--ffn-up-type", help="Type for ffn_up tensors."),
    ffn_down_type: Optional[str] = typer.Option(None, "--ffn-down-type", help="Type for ffn_down tensors."),
    output_tensor_type: Optional[str] = typer.Option(None, "--output-tensor-type", help="Type for output.weight."),
    token_embedding_type: Optional[str] = typer.Option(None, "--token-embedding-type", help="Type for "
                                                       "token_embd.weight."),
    pure: bool = typer.Option(False, "--pure", help="Give every eligible 2-D/3-D weight the target type (norms "
                              "and 1-D tensors stay F32; only ik's row-length fallback still applies)."),
    allow_requantize: bool = typer.Option(False, "--allow-requantize", help="Accept already-quantized input "
                                          "tensors (dequantized exactly, then requantized)."),
    leave_output_tensor: bool = typer.Option(False, "--leave-output-tensor", help="Copy output.weight as it is."),
    ignore_imatrix_rules: bool = typer.Option(False, "--ignore-imatrix-rules", help="Quantize to the very-low-bit "
                                              "types (IQ1_KT, IQ2_KT, ...) even without importance data."),
    slow_iq2ks: bool = typer.Option(False, "--slow-iq2ks", help="IQ2_KS with ik's older scalar search: 8x slower; "
                                    "on real weights with an imatrix 2-3% lower weighted error, without one 2% "
                                    "higher (ik's --slow-iq2ks)."),
    sweep: Optional[Path] = typer.Option(None, "--sweep", help="An `ikrun sweep` result (.json or .csv): with "
                                         "--target-bpw, --target-size or --budget, choose each swept tensor's type "
                                         "from it."),
    target_bpw: Optional[float] = typer.Option(None, "--target-bpw", help="With --sweep: the whole file's bits per "
                                               "weight. The swept tensors get the types of least predicted KLD "
                                               "(predicted as the sum of the per-tensor KLDs measured one at a "
                                               "time) that fit; the others follow --type."),
    target_size: Optional[str] = typer.Option(None, "--target-size", help="With --sweep: the whole file's tensor "
                                              "bytes, e.g. 200GiB (instead of --target-bpw)."),
    budget: list[str] = typer.Option([], "--budget", help="With --sweep, repeatable: REGEX=SIZE caps the tensors whose "
                                     "names match (the first matching budget owns a tensor), rest=SIZE the others; "
                                     "e.g. --budget 'ffn_.*_exps=180GiB' --budget 'rest=22GiB' for a CPU/GPU split."),
    mtp_sweep: Optional[Path] = MTP_SWEEP,
    max_acceptance_loss: Optional[float] = MAX_ACCEPTANCE_LOSS,
    tie: list[str] = TIE,
    no_default_ties: bool = NO_DEFAULT_TIES,
    min_type: list[str] = MIN_TYPE,
    recipe: str = typer.Option("ik", "--recipe", help="Whose per-tensor rules: ik (ik_llama.cpp's llama-quantize, "
                               "every ik type) or mainline (mainline llama.cpp's, its file types, only types mainline "
                               "llama.cpp and llama-cpp-python/Ollama/LM Studio load)."),
    threads: Optional[int] = typer.Option(None, "--threads", "-t", help="Worker threads (default: all cores)."),
    ray: Optional[str] = typer.Option(None, "--ray", help="Quantize the tensors on Ray workers: local or local:N "
                                      "starts N local workers, else a cluster address (auto, HOST:PORT, "
                                      "ray://HOST:10001) whose nodes read IN.gguf at the same path. The same bytes as "
                                      "a local run. Needs pip install 'iktools[ray]'."),
    repack: bool = typer.Option(False, "--repack", help="Instead of quantizing: convert every tensor that has a "
                                "row-interleaved form (Q8_0 -> Q8_0_R8, IQ4_K -> IQ4_K_R4, ...) to it, moving bytes "
                                "only (the values stay the same); token embeddings and tensors whose rows are not "
                                "whole groups keep their type."),
    repack_pattern: Optional[str] = typer.Option(None, "--repack-pattern", help="With --repack (implied): only "
                                                 "the tensors whose names match this regex."),
    unpack: bool = typer.Option(False, "--unpack", help="Instead of quantizing: convert every interleaved tensor "
                                "back to its base type (bytes moved, values unchanged)."),
    split_max_size: Optional[str] = SPLIT_MAX_SIZE,
    split_max_tensors: int = SPLIT_MAX_TENSORS,
    no_tensor_first_split: bool = NO_TENSOR_FIRST_SPLIT,
    keep_split: bool = typer.Option(False, "--keep-split", help="A split input gives a split output with the same "
                                    "tensors in each shard (ik's --keep-split)."),
    partial_requant: bool = typer.Option(False, "--partial-requant", help="Leave every existing output shard this run "
                                         "would write identically (same metadata, same tensor types) as it is and "
                                         "rewrite the others; says which. Trusts that the input and imatrix are "
                                         "those the shards were made from."),
    override_kv: list[str] = OVERRIDE_KV,
    hide_imatrix: bool = typer.Option(False, "--hide-imatrix", help="Write the quantize.imatrix.* keys as "
                                      "'top_secret' and 0 instead of the imatrix's file, dataset and counts (ik's "
                                      "--hide-imatrix)."),
    recipe_out: Optional[Path] = typer.Option(None, "--recipe-out", help="Also write the chosen per-tensor types as "
                                              "ik --custom-q rules (one anchored regex=type a line; # comments with "
                                              "sizes, predicted KLD and -ot offload lines)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (tensor, type, reason, sizes, bpw) and "
                                 "write nothing."),
    json_out: bool = typer.Option(False, "--json", help="With --dry-run: print the plan as a JSON list of "
                                  "{name, type, ...} (types spelled as ik prints them, e.g. q4_K, iq4_ks, f32)."),
) -> None:
    """Quantize IN.gguf into OUT.gguf, choosing every tensor's type as ik_llama.cpp's llama-quantize does.

    Example: ikquant model-f32.gguf model-q4_k_m.gguf --type Q4_K_M --imatrix imatrix.dat
    Example: ikquant model-bf16.gguf model-iq4_ks.gguf --type iq4_ks --custom-q "ffn_down=iq5_ks" --dry-run
    """
    from ikquant.cluster import open_cluster
    from ikquant.gguf_io import exit_cleanly_on_sigterm
    from ikquant.imatrix import filter_entries, read_imatrix
    from ikquant.kv_override import parse_override
    from ikquant.quantize import QuantizeOptions, check_writable, make_plan, quantize_model
    from ikquant.recipe_out import recipe_text, write_recipe
    from ikquant.recipes_mainline import recipe_file_type
    from ikquant.shards import GGUFModel
    from ikquant.split_layout import output_shards

    exit_cleanly_on_sigterm()
    try:
        shards = output_shards(split_max_size, split_max_tensors, no_tensor_first_split, keep_split, partial_requant)
        overrides = [parse_override(text) for text in override_kv]
    except IkError as exc:
        fail(str(exc))
    if repack or repack_pattern is not None or unpack:
        if overrides or hide_imatrix or recipe_out:
            fail("--repack / --unpack copy the metadata as it is: --override-kv, --hide-imatrix and --recipe-out "
                 "go with quantizing")
        _repack(src, dst, repack_pattern, unpack, repack or repack_pattern is not None, type_name, dry_run, shards)
        return
    if type_name is None:
        fail("--type is required (or --repack / --unpack to convert a file's tensors as they are)")
    if threads:
        import numba

        numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    class_types = {k: v for k, v in (("attn_q_type", attn_q_type), ("attn_k_type", attn_k_type),
                                     ("attn_v_type", attn_v_type), ("attn_output_type", attn_output_type),
                                     ("ffn_gate_type", ffn_gate_type), ("ffn_up_type", ffn_up_type),
                                     ("ffn_down_type", ffn_down_type)) if v}
    try:
        ftype = recipe_file_type(recipe, type_name)
        imat = None
        if imatrix is not None:
            imat = filter_entries(read_imatrix(imatrix), include_weights, exclude_weights)
        elif include_weights or exclude_weights:
            fail("--include-weights/--exclude-weights need --imatrix")
        if hide_imatrix and imat is None:
            fail("--hide-imatrix hides the provenance of an --imatrix: give one")
        opts = QuantizeOptions(ftype, pure, imat, allow_requantize, leave_output_tensor, ignore_imatrix_rules,
                               _custom_q(custom_q), class_types, output_tensor_type, token_embedding_type, slow_iq2ks,
                               recipe=recipe, kv_overrides=overrides, hide_imatrix=hide_imatrix)
        source = GGUFModel(src)
        if keep_split and not source.is_split:
            err.print(f"[yellow]warning:[/] --keep-split: {src} is not split, so neither is the output",
                      highlight=False)
        targets = [t for t in (target_bpw is not None, target_size is not None, bool(budget)) if t]
        if (sweep is None) != (not targets) or len(targets) > 1:
            fail("--sweep goes with exactly one of --target-bpw, --target-size or --budget")
        if (mtp_sweep is None) != (max_acceptance_loss is None):
            fail("--mtp-sweep and --max-acceptance-loss go together (the head's types within a bound on its loss)")
        from ikquant.mix_constraints import MixConstraints

        constraints = MixConstraints(tuple(tie), not no_default_ties, tuple(min_type))
        head: dict[str, str] = {}
        if mtp_sweep is not None and max_acceptance_loss is not None:
            head = head_from_sweep(source, mtp_sweep, max_acceptance_loss, constraints).tensor_types
            opts.tensor_types = dict(head)
        mix = None
        if sweep is not None:
            from ikquant.mix import MixTarget

            mix = _mix_from_sweep(source, opts, sweep, MixTarget(target_bpw, target_size, budget), constraints)
            both = sorted(set(mix.tensor_types) & set(head))
            if both:
                fail(f"tensor {both[0]} is typed by both --sweep {sweep} and --mtp-sweep {mtp_sweep}: sweep the "
                     "model by KLD and its head by acceptance")
            opts.tensor_types = {**mix.tensor_types, **head}
        elif (tie or min_type or no_default_ties) and mtp_sweep is None:
            fail("--tie, --min-type and --no-default-ties constrain a mix: they go with --sweep or --mtp-sweep")
        plan = make_plan(source, opts)
    except IkError as exc:
        fail(str(exc))
    try:
        check_writable(plan)
    except IkError as exc:
        if not dry_run:
            fail(str(exc))
        plan.warnings.append(f"this plan cannot be written: {exc}")
    for w in plan.warnings:
        err.print(f"[yellow]warning:[/] {w}", soft_wrap=True)
    for p in plan.tensors:
        for note in p.notes:
            err.print(f"[yellow]warning:[/] {p.name}: {note}", soft_wrap=True)
    if dry_run:
        if json_out:
            out.print_json(json.dumps([{"name": p.name, "type": (p.ik_type or p.type).ggml_name,
                                        "written_type": p.type.ggml_name, "quantize": p.quantize,
                                        "reason": p.reason, "bytes_in": p.info.nbytes, "bytes_out": p.new_bytes,
                                        "imatrix": p.imatrix_entry} for p in plan.tensors]))
        else:
            _print_plan(plan)
            if not shards.keep_input:
                print_shard_plan(dst, [p.new_bytes for p in plan.tensors], shards.limits)
        return
    if recipe_out is not None:
        try:
            write_recipe(recipe_out, recipe_text(plan, type_name, mix))
        except IkError as exc:
            fail(str(exc))
        err.print(f"wrote {recipe_out}: the per-tensor types as --custom-q rules", highlight=False)
    total = sum(p.info.nbytes for p in plan.tensors)
    with ExitStack() as stack:
        try:
            cluster = stack.enter_context(open_cluster(ray, threads or 1)) if ray is not None else None
        except IkError as exc:
            fail(str(exc))
        if cluster is not None:
            err.print(f"Ray {ray}: {cluster.workers} workers of {cluster.threads} thread(s)", highlight=False)
        bar = stack.enter_context(Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                                           TransferSpeedColumn(), TimeRemainingColumn(), console=err))
        task = bar.add_task("quantizing", total=total)
        try:
            done = quantize_model(src, dst, opts, lambda p: bar.update(task, advance=p.info.nbytes,
                                                                       description=p.name), cluster, shards)
        except IkError as exc:
            bar.stop()
            fail(str(exc))
    size_in = sum(p.info.nbytes for p in plan.tensors)
    size_out = sum(p.new_bytes for p in plan.tensors)
    report_outputs(done.outputs, done.kept)
    where = done.outputs[0] if len(done.outputs) == 1 else f"{done.outputs[0]} and {len(done.outputs) - 1} more shards"
    err.print(f"wrote [bold]{where}[/]: {size_in / 2**20:.2f} MiB -> {size_out / 2**20:.2f} MiB, "
              f"{plan.bits_per_weight:.3f} bits per weight")


@app.command()
def card(
    model: Path = typer.Argument(..., help="The quantized GGUF (the first shard of a split one)."),
    output: Path = typer.Option(..., "--output", "-o", help="The model card to write (README.md)."),
    kld: list[Path] = typer.Option([], "--kld", help="An `ikrun kld --json` result measured on this file (or on "
                                   "another quant of the same model, for comparison); repeatable, one row each, "
                                   "labelled by its file name (IQ4_KS.json: IQ4_KS)."),
    recipe_file: Optional[Path] = typer.Option(None, "--recipe", help="The --recipe-out file the quant was made "
                                               "with: shown, with its -ot offload lines in the run command."),
) -> None:
    """Write a Hugging Face model card for a quantized GGUF: front matter, file type and size, tensor types per
    class, imatrix provenance, the measured PPL/KLD, the recipe, the offload line and the shard list.

    Example: ikrun kld model-iq4_ks.gguf --base-logits base.kld --json > iq4_ks.json;
    ikquant card model-iq4_ks.gguf --kld iq4_ks.json --recipe recipe.txt -o README.md
    """
    from ikquant.card import model_card, read_kld
    from ikquant.errors import InputNotFoundError
    from ikquant.outputs import output_file
    from ikquant.shards import GGUFModel

    try:
        klds = [(p.stem, read_kld(p)) for p in kld]
        if recipe_file is not None and not recipe_file.is_file():
            raise InputNotFoundError(f"--recipe {recipe_file}: no such file")
        recipe = recipe_file.read_text(encoding="utf-8") if recipe_file is not None else None
        text = model_card(GGUFModel(model), klds, recipe)
        with output_file(output) as tmp:
            tmp.write_text(text, encoding="utf-8")
    except IkError as exc:
        fail(str(exc))
    err.print(f"wrote {output}", highlight=False)


def _repack(src: Path, dst: Path, pattern: Optional[str], unpack: bool, repack: bool, type_name: Optional[str],
            dry_run: bool, shards: OutputShards) -> None:
    """--repack / --unpack: the file's tensors regrouped, nothing requantized."""
    from ikquant.repack import plan_repack, repack_model
    from ikquant.shards import GGUFModel

    if repack and unpack:
        fail("--repack and --unpack go in opposite directions: give one")
    if type_name is not None:
        fail("--repack / --unpack convert the tensors as they are: --type does not go with them")
    try:
        steps = plan_repack(GGUFModel(src), pattern, unpack)
        if dry_run:
            table = Table(title="repack plan (nothing written: --dry-run)")
            for col in ("tensor", "type", "reason"):
                table.add_column(col)
            for step in steps:
                table.add_row(step.info.name, step.type.name, step.reason)
            err.print(table)
            return
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=err) as bar:
            task = bar.add_task("unpacking" if unpack else "repacking", total=sum(s.info.nbytes for s in steps))
            _, outputs, kept = repack_model(src, dst, pattern, unpack, lambda s: bar.update(
                task, advance=s.info.nbytes, description=s.info.name), shards)
    except IkError as exc:
        fail(str(exc))
    report_outputs(outputs, kept)
    changed = sum(1 for s in steps if s.changed)
    err.print(f"wrote [bold]{outputs[0]}[/]: {changed} of {len(steps)} tensors {'unpacked' if unpack else 'repacked'}, "
              "no value changed")


def _mix_from_sweep(source, opts, sweep: Path, target, constraints):  # type: ignore[no-untyped-def]
    """The mix of per-tensor types from a sweep within the target(s); prints it and its predicted KLD."""
    from ikquant.mix import plan_mix, read_sweep

    groups, options, unmeasured = read_sweep(sweep)
    plan = plan_mix(source, opts, groups, options, target, str(sweep), constraints)
    print_mix(plan)
    print_unmeasured(unmeasured)
    return plan


def head_from_sweep(source, mtp_sweep: Path, max_loss: float, constraints):  # type: ignore[no-untyped-def]
    """The NextN head's types from an `--mtp-sweep` within `--max-acceptance-loss` (under the mix's constraints);
    prints them."""
    from ikquant.mix_constraints import constrained
    from ikquant.mix_head import choose_head, read_head_sweep

    groups, options, decoding = read_head_sweep(mtp_sweep, set(source.tensors))
    groups, options = constrained(groups, options, constraints,
                                  {n: source.tensors[n].n_per_row for names in groups.values() for n in names})
    head = choose_head(groups, options, max_loss, str(mtp_sweep))
    head.decoding = decoding
    types = head.tensor_types
    err.print(f"NextN head from {mtp_sweep}: {len(types)} tensors as "
              + ", ".join(f"{t} x{sum(1 for v in types.values() if v == t)}" for t in sorted(set(types.values())))
              + f", {head.bits / 8 / 2**20:.3f} MiB; predicted acceptance loss {head.predicted_loss:.4f} of at most "
              f"{max_loss:g} tokens per step", soft_wrap=True, highlight=False)
    return head


def print_unmeasured(unmeasured: dict[str, str]) -> None:
    """Say which tensors a mix left at the recipe's type because the sweep gave them no cost."""
    if unmeasured:
        first = next(iter(unmeasured))
        err.print(f"{len(unmeasured)} tensors unmeasured by the sweep keep the recipe's type, e.g. {first} "
                  f"({unmeasured[first]})", soft_wrap=True)


def print_mix(plan) -> None:  # type: ignore[no-untyped-def]
    """The chosen types per budget, and the predicted KLD of the whole mix."""
    table = Table(title=plan.title)
    for col in ("budget", "type", "tensors", "MiB"):
        table.add_column(col, justify="right")
    for b, mix, _ in plan.results:
        mine = mix.tensor_types()
        for t in sorted(set(mine.values())):
            bits = sum(o.bits for o in mix.choice.values() if o.type == t)
            table.add_row(b.label, t, str(sum(1 for v in mine.values() if v == t)), f"{bits / 8 / 2**20:.3f}")
    err.print(table)
    for b, mix, fixed in plan.results:
        if len(plan.results) > 1:
            err.print(f"budget {b.label}: {(fixed + mix.bits) / 8 / 2**30:.3f} of {b.bits / 8 / 2**30:.3f} GiB, "
                      f"predicted KLD {mix.predicted_kld:.6f}", soft_wrap=True)
    err.print(f"whole file: {plan.total_bits / plan.n_weights:.4f} bits per weight, {plan.total_bits / 8 / 2**30:.3f} "
              f"GiB of tensors; predicted mean KLD {plan.predicted_kld:.6f} (the sum of the swept tensors' KLDs, each "
              "measured alone)", soft_wrap=True)
    if plan.exchanges:
        err.print(f"exchange repair: {plan.exchanges} type changes after the greedy choice lowered the predicted KLD "
                  f"from {plan.greedy_kld:.6f}", soft_wrap=True)


def _print_plan(plan) -> None:  # type: ignore[no-untyped-def]
    table = Table(title="quantization plan (nothing written: --dry-run)")
    for col in ("tensor", "from", "to", "MiB in", "MiB out", "why"):
        table.add_column(col, overflow="fold")
    for p in plan.tensors:
        table.add_row(p.name, p.info.type.ggml_name, p.type.ggml_name, f"{p.info.nbytes / 2**20:.3f}",
                      f"{p.new_bytes / 2**20:.3f}", p.reason + ("; " + "; ".join(p.notes) if p.notes else ""))
    out.print(table)
    out.print(f"{len(plan.tensors)} tensors, {sum(p.info.nbytes for p in plan.tensors) / 2**20:.2f} MiB -> "
              f"{sum(p.new_bytes for p in plan.tensors) / 2**20:.2f} MiB, {plan.bits_per_weight:.3f} bits per weight")
