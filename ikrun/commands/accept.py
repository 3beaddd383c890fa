"""`ikrun accept`: speculative decoding with a DFlash draft or the target's own NextN/MTP head (--mtp), and its
acceptance lengths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import typer
from rich.table import Table

from ikquant.cli_common import fail, out
from ikquant.errors import IkError
from ikrun.commands.common import load_model, progress_bar, read_text
from ikrun.commands.options import Evaluation, evaluation_options

if TYPE_CHECKING:
    from ikrun.model import Model


@evaluation_options
def accept(
    target: Path = typer.Argument(..., help="The target model's GGUF."),
    draft: Optional[Path] = typer.Argument(None, help="The DFlash draft's GGUF (ikconvert hf2gguf ... "
                                           "--target-model-dir); with --mtp only DeepSeek-V4's MTP export "
                                           "(ikconvert hf2gguf --mtp), which ik loads beside its target."),
    text: Path = typer.Option(..., "--text", help="Text the prompts are cut from (tokenized without BOS)."),
    prompts: int = typer.Option(6, "--prompts", help="Number of prompts; prompt i starts at token i*floor((n-L-M)/N)."),
    prompt_len: int = typer.Option(24, "--prompt-len", help="Tokens per prompt (L)."),
    max_new: int = typer.Option(96, "--max-new", help="New tokens per prompt (M)."),
    block: Optional[int] = typer.Option(None, "--block", help="Block size (default: the draft's)."),
    compare: Optional[str] = typer.Option(None, "--compare", help="Comma-separated types: quantize the draft to each "
                                          "in memory (from its own weights) and measure it too, e.g. Q8_0,Q4_K,IQ4_KS."),
    check: bool = typer.Option(True, "--check/--no-check", help="Check every output against the target's own greedy "
                               "continuation (speculation must not change it)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="The draft's Hugging Face folder: compare every "
                                         "step's draft layer by layer with the independent reference of it and "
                                         "name the first layer that differs."),
    oracle: Optional[Path] = typer.Option(None, "--oracle", help="A reference run's JSON (z-lab/dflash's "
                                          "dflash_generate: runs[].prompt, runs[].acceptance_lengths): name the "
                                          "first step whose acceptance differs."),
    cross_ctx: Optional[int] = typer.Option(None, "--cross-ctx", help="The draft attends to the newest N target "
                                            "positions only (ik's cross_ctx, e.g. 128; at least the block size). "
                                            "Default: every position, as the reference."),
    late_features: bool = typer.Option(False, "--late-feature-positions", help="Commit the positions a step "
                                       "verified one position late and start the next block one late, as ik's "
                                       "speculative loop does (with --budget-drafts: ik's llama-spec-bench)."),
    budget_drafts: bool = typer.Option(False, "--budget-drafts", help="Draft at most (tokens left - 2) tokens a "
                                       "step in a block that long, none with fewer than 3 left, as ik's loop does "
                                       "(default: whole blocks, cut afterwards, as the reference)."),
    mtp: bool = typer.Option(False, "--mtp", help="Draft with the target's own NextN/MTP head (GLM-4.x, DeepSeek-V3; "
                             "DeepSeek-V4: its MTP export after the target) instead of a DFlash draft, as ik's "
                             "--spec-type mtp; --compare then quantizes the head's block."),
    n_max: Optional[int] = typer.Option(None, "--n-max", help="With --mtp: tokens drafted per step, each from the "
                                        "previous draft's state (ik's --draft-max; default 3)."),
    p_min: Optional[float] = typer.Option(None, "--p-min", help="With --mtp: stop drafting after a token whose probability is "
                                "below this, and drop such tokens but the first (ik's --draft-p-min)."),
    ev: Evaluation = None,  # type: ignore[assignment]
) -> None:
    """Greedy speculative decoding with a DFlash draft (or, --mtp, the target's NextN head): acceptance length (tokens per target step) per prompt and
    per draft position, tokens/s, and the check that the output is the target's own.

    Example: ikrun accept qwen3-8b.gguf dflash-draft.gguf --text wiki.test.raw --prompts 8 --max-new 256
    --compare Q8_0,Q4_K; ikrun accept GLM-4.5-Air.gguf --mtp --n-max 3 --text wiki.test.raw --compare Q4_0;
    ikrun accept DeepSeek-V4-Flash.gguf DeepSeek-V4-Flash-mtp.gguf --mtp --text wiki.test.raw
    """
    from ikquant.types import type_by_name
    from ikrun.eval.dflash_trace import LayerTrace, first_acceptance_difference
    from ikrun.eval.speculative import (
        IkSpecBench,
        acceptance_by_position,
        greedy_continuation,
        mean_acceptance_length,
        mtp_generate,
        speculative_generate,
    )

    if mtp:
        if trace or oracle or cross_ctx is not None or late_features or budget_drafts or block:
            fail("--mtp drafts with the target's NextN/MTP head: it takes no --block, --trace, --oracle, "
                 "--cross-ctx, --late-feature-positions or --budget-drafts")
        n_max, p_min = mtp_settings(n_max, p_min)
        t, head_model, head_block, chunks = mtp_target(target, ev, text, prompts, prompt_len, max_new, draft)
        d, bs = head_model or t, n_max + 1
        drafted = [n for n in d.weights.names() if n.startswith(f"blk.{head_block}.")]
    else:
        if draft is None:
            fail("give a DFlash draft's GGUF after the target, or --mtp to draft with the target's NextN head")
        if n_max is not None or p_min is not None:
            fail("--n-max and --p-min go with --mtp (a DFlash draft drafts a block: --block)")
        t, d, bs, chunks = draft_pair(target, draft, ev, text, prompts, prompt_len, max_new, block)
        drafted = d.weights.names()
    if cross_ctx is not None and cross_ctx < bs:
        fail(f"--cross-ctx {cross_ctx}: below the block size {bs} (the draft must see at least a block of positions)")
    if trace and (cross_ctx is not None or late_features):
        fail("--trace compares each step with the reference's draft over every position at its own place: it does "
             "not go with --cross-ctx or --late-feature-positions")
    ik = IkSpecBench(cross_ctx, late_features, budget_drafts)
    reference_runs = _oracle_runs(oracle, chunks) if oracle else None
    reference = _trace_reference(trace) if trace else None
    try:
        types = [type_by_name(x) for x in compare.split(",") if x.strip()] if compare else []
        for qt in types:
            qt.require_codec()
    except IkError as exc:
        fail(str(exc))

    def measure(label: str, used: list[str], traced: bool = False) -> dict:  # type: ignore[type-arg]
        with progress_bar() as bar:
            task = bar.add_task(f"{label}: speculative decoding", total=len(chunks))
            runs, traces = [], []
            for p in chunks:
                observer = LayerTrace(reference) if traced and reference is not None else None
                runs.append(mtp_generate(t, p, max_new, bs - 1, p_min or 0.0, head_model) if mtp else
                            speculative_generate(t, d, p, max_new, bs, observe=observer, ik=ik))
                if observer is not None:
                    traces.append(observer.summary())
                bar.update(task, advance=1)
        mismatched = []
        if check:
            for i, (p, r) in enumerate(zip(chunks, runs)):
                if greedy_continuation(t, p, max_new) != r.output_ids:
                    mismatched.append(i)
        seconds = sum(r.seconds for r in runs)
        extra: dict = {}  # type: ignore[type-arg]
        if traces:
            extra["trace"] = traces
        if reference_runs is not None:
            first = first_acceptance_difference([r.acceptance_lengths for r in runs], reference_runs)
            extra["oracle_first_difference"] = None if first is None else {"prompt": first[0], "step": first[1]}
        return {**extra, "draft": label, "types_used": used, "draft_bytes": sum(d.weights.encoding(n).raw.nbytes for n in drafted),
                "mean_acceptance_length": mean_acceptance_length(runs),
                "tokens_per_second": len(chunks) * max_new / seconds if seconds > 0 else 0.0,
                "output_matches_target": not mismatched if check else None, "mismatched_prompts": mismatched,
                "acceptance_by_position": acceptance_by_position(runs, bs),
                "runs": [{"prompt": r.prompt, "output_ids": r.output_ids, "acceptance_lengths": r.acceptance_lengths,
                          "draft_lengths": r.draft_lengths}
                         for r in runs]}

    results = [measure("as stored", sorted({d.weights.encoding(n).type.name for n in drafted}), True)]
    for qt in types:
        try:
            results.append(measure(qt.name, _quantize_draft_in_memory(d, qt, drafted)))
        except IkError as exc:
            fail(str(exc))
        finally:
            d.restore()
    if json_out:
        out.print_json(json.dumps(results[0] if not types else results))
    else:
        _print_acceptance(results, bs, len(chunks), prompt_len, max_new)
        _print_checks(results[0])
    if check and any(r["mismatched_prompts"] for r in results):
        bad = next(r for r in results if r["mismatched_prompts"])
        fail(f"draft {bad['draft']}: the speculative output of prompt {bad['mismatched_prompts'][0]} differs from the "
             "target's own greedy continuation (a runtime bug: please report it)")


def draft_pair(target: Path, draft: Path, ev: Evaluation, text: Path, prompts: int, prompt_len: int, max_new: int,
                block: Optional[int]) -> tuple[Model, Model, int, list[np.ndarray]]:
    """Target and DFlash draft loaded and checked against each other, the block size, and the prompts cut from
    the text (tokenized without BOS), before any compute."""
    from ikrun.eval.speculative import prompt_starts
    from ikrun.models.dflash import DFlashDraft

    t, d = load_model(target, ev), load_model(draft, ev, beside=True)
    try:
        if not isinstance(d.impl, DFlashDraft):
            fail(f"{draft} is a {d.arch} model, not a DFlash draft (dflash-draft)")
        d.impl.check_target(t.impl)
        bs = block or d.impl.block_size
        if bs < 2:
            fail(f"--block {bs}: a block holds the known token and at least one proposal")
        ids = np.asarray(t.tokenizer().encode(read_text(text), add_special=False), dtype=np.int64)
        starts = prompt_starts(len(ids), prompts, prompt_len, max_new)
    except IkError as exc:
        fail(str(exc))
    return t, d, bs, [ids[s : s + prompt_len] for s in starts]


def mtp_settings(n_max: Optional[int], p_min: Optional[float]) -> tuple[int, float]:
    """--n-max and --p-min of a NextN head's drafting, with ik's defaults (3, 0)."""
    n_max = 3 if n_max is None else n_max
    if n_max < 1:
        fail(f"--n-max {n_max}: at least one token is drafted a step")
    return n_max, p_min or 0.0


def mtp_target(target: Path, ev: Evaluation, text: Path, prompts: int, prompt_len: int, max_new: int,
               head_file: Optional[Path] = None) -> tuple[Model, Optional[Model], int, list[np.ndarray]]:
    """A target with a NextN/MTP head (its own, or `head_file`'s: an MTP export ik loads beside it) loaded and the
    head checked, and the prompts cut from the text, before any compute."""
    from ikrun.eval.speculative import prompt_starts

    t = load_model(target, ev)
    h = None if head_file is None else load_model(head_file, ev, beside=True)
    try:
        t.check_context(prompt_len + max_new)  # the target runs (an MTP export alone cannot)
        if h is not None:
            t.impl.check_head(h.impl)
        head = (h or t).impl.nextn_head()
        ids = np.asarray(t.tokenizer().encode(read_text(text), add_special=False), dtype=np.int64)
        starts = prompt_starts(len(ids), prompts, prompt_len, max_new)
    except IkError as exc:
        fail(str(exc))
    return t, h, head.block, [ids[s : s + prompt_len] for s in starts]


def _oracle_runs(path: Path, chunks: list[np.ndarray]) -> list[list[int]]:
    """The reference run's acceptance lengths per prompt, its prompts checked to be the ones cut from --text."""
    try:
        runs = json.loads(path.read_text(encoding="utf-8"))["runs"]
        prompts = [r["prompt"] for r in runs]
        lengths = [[int(a) for a in r["acceptance_lengths"]] for r in runs]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        fail(f"--oracle {path}: not a reference run's JSON with runs[].prompt and runs[].acceptance_lengths ({exc})")
    for p, chunk in enumerate(chunks):
        if p >= len(prompts) or prompts[p] != [int(x) for x in chunk]:
            fail(f"--oracle {path}: its prompt {p} is not prompt {p} cut from --text (same --text, --prompts, "
                 "--prompt-len and --max-new as the reference run?)")
    return lengths


def _trace_reference(folder: Path):  # type: ignore[no-untyped-def]
    """The independent reference of the draft's Hugging Face checkpoint."""
    from ikrun.validate.dflash import DFlashReference

    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        fail(f"--trace {folder}: not a Hugging Face draft folder (config.json and *.safetensors)")
    return DFlashReference(folder)


def _print_checks(result: dict) -> None:  # type: ignore[type-arg]
    """What --trace and --oracle found."""
    for p, tr in enumerate(result.get("trace", [])):
        first = tr["first_divergence"]
        if first is None:
            out.print(f"prompt {p}: every step's draft layers agree with the reference (largest difference "
                      f"{max(tr['max_abs_by_layer'], default=0.0):.2e})")
        else:
            out.print(f"prompt {p}: step {first['step']}, draft layer {first['layer']} differs first from the "
                      f"reference (by {first['max_abs']:.2e}; the last layer index is the final norm)")
    if "oracle_first_difference" in result:
        first = result["oracle_first_difference"]
        out.print("acceptance equal to the reference run at every step" if first is None else
                  f"acceptance differs from the reference run first at prompt {first['prompt']}, step "
                  f"{first['step']}")


def _quantize_draft_in_memory(d: Model, qtype, names: list[str]) -> list[str]:  # type: ignore[no-untyped-def]
    """Every quantizable draft weight among `names` re-encoded as `qtype` from its stored encoding and swapped in;
    the types written (ik's fallback where a row does not hold `qtype`'s blocks)."""
    from ikquant.recipes import eligible
    from ikrun.sweep.measure import quantized_copy

    used_types = set()
    for name in names:
        info = d.weights.info(name)
        if eligible(name, info.n_dims, info.type):
            used, raw = quantized_copy(d, name, qtype, None)
            d.swap(name, used, raw)
            used_types.add(used.name)
    return sorted(used_types)


def _print_acceptance(results: list, bs: int, n_prompts: int, prompt_len: int, max_new: int) -> None:  # type: ignore[type-arg]
    table = Table(title=f"acceptance length: {n_prompts} prompts of {prompt_len} tokens, {max_new} new, blocks of {bs}")
    for col in ("draft", "weights", "MiB", "mean acceptance", "per prompt", "tok/s", "= target"):
        table.add_column(col, justify="right")
    for r in results:
        per = [sum(x["acceptance_lengths"]) / len(x["acceptance_lengths"]) for x in r["runs"]]
        table.add_row(r["draft"], "+".join(r["types_used"]), f"{r['draft_bytes'] / 2**20:.3f}", f"{r['mean_acceptance_length']:.2f}",
                      " ".join(f"{v:.1f}" for v in per), f"{r['tokens_per_second']:.1f}",
                      "-" if r["output_matches_target"] is None else "yes" if r["output_matches_target"] else "NO")
    out.print(table)
    pos = Table(title="accepted share by draft position")
    pos.add_column("draft")
    for j in range(1, bs):
        pos.add_column(str(j), justify="right")
    for r in results:
        pos.add_row(r["draft"], *(f"{100 * v:.0f}%" for v in r["acceptance_by_position"]))
    out.print(pos)
