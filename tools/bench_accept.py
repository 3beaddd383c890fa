#!/usr/bin/env python3
"""DFlash drafts measured two ways: what quantizing the draft costs in acceptance (`table`), and `ikrun accept`'s
decoding speed against ik's `llama-spec-bench` on the same target/draft GGUFs, prompts and threads (`speed`).

`table` quantizes the draft to each type in memory (`ikrun accept --compare ... --json`, one process) and reports
the mean acceptance length (tokens per target step, every step of every prompt) with its standard error over
prompts, and the difference from the draft as stored with the standard error of that paired difference (every
type decodes the same prompts, so the pairing removes the prompts' own spread). Beside each row: the types
`ikquant --pure --dry-run` gives the draft's weights for that type, so a row that falls back (rows too short for
the type's blocks) says so.

`speed` is decode only on both sides (ik's `decode_s`; ikrun's time after the prompt's forward and the draft's
context from it), with ik's loop on both (`--cross-ctx`, `--late-feature-positions`, `--budget-drafts`, checked:
the drafts and accepted tokens of every prompt must be ik's) so that both decode at the same acceptance. The two
run interleaved, --rounds times per thread count, and each round's ratio is reported (a loaded machine moves both
alike within a round). Prompts are cut from the text as characters; ik tokenizes them, ikrun encodes the same
characters (no BOS), so both see the same tokens.

Examples:
    python tools/bench_accept.py table --target t.gguf --draft d.gguf --text heldout.txt --prompts 32 \\
        --types Q8_0,Q6_K,Q5_K,Q4_K,IQ4_KS,IQ3_K,IQ2_KS
    python tools/bench_accept.py speed --target t.gguf --draft d.gguf --text heldout.txt \\
        --ik-bin /work/ik-src/build/bin/llama-spec-bench --threads 1,2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

# isort: off
import ikquant  # noqa: F401  (first: its import sets OpenBLAS's thread timeout before numpy loads)
# isort: on

import numba
import numpy as np

from ikrun import Model
from ikrun.eval.speculative import IkSpecBench, speculative_generate
from ikrun.options import RuntimeOptions

BIN = Path(sys.executable).parent
#: ikquant takes ik's file types: with --pure these give every weight the K-quant of the table's row
PURE_FTYPE = {"Q3_K": "Q3_K_S", "Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S"}


def ratio_and_se(tokens: np.ndarray, steps: np.ndarray) -> tuple[float, np.ndarray]:
    """The pooled mean acceptance (all tokens / all steps) and each prompt's influence on it (its linearisation:
    the standard error over prompts is sqrt(n/(n-1) * sum(influence^2)))."""
    mean = float(tokens.sum() / steps.sum())
    return mean, (tokens - mean * steps) / steps.sum()


def standard_error(influence: np.ndarray) -> float:
    n = len(influence)
    return math.sqrt(n / (n - 1) * float(np.sum(influence**2))) if n > 1 else float("nan")


def plan_types(draft: Path, qtype: str) -> dict[str, int]:
    """How many of the draft's tensors `ikquant --pure --dry-run` writes in each type, 1-D tensors (F32) left out."""
    res = subprocess.run([str(BIN / "ikquant"), "quantize", str(draft), os.devnull, "--type",
                          PURE_FTYPE.get(qtype.upper(), qtype), "--pure",
                          "--dry-run", "--json"], capture_output=True, text=True, check=True)
    counts: dict[str, int] = {}
    for row in json.loads(res.stdout):
        if row["written_type"].lower() != "f32":
            counts[row["written_type"]] = counts.get(row["written_type"], 0) + 1
    return counts


def table(a: argparse.Namespace) -> None:
    cmd = [str(BIN / "ikrun"), "accept", str(a.target), str(a.draft), "--text", str(a.text), "--prompts",
           str(a.prompts), "--prompt-len", str(a.prompt_len), "--max-new", str(a.max_new), "--compare", a.types,
           "--json", "--threads", str(a.threads), "--no-check"]  # acceptance only: the output check is the tests' job
    results = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    per_type = []
    for r in results:
        tokens = np.array([sum(run["acceptance_lengths"]) for run in r["runs"]], dtype=np.float64)
        steps = np.array([len(run["acceptance_lengths"]) for run in r["runs"]], dtype=np.float64)
        per_type.append((r, *ratio_and_se(tokens, steps)))
    base_mean, base_infl = per_type[0][1], per_type[0][2]
    print(f"{len(per_type[0][0]['runs'])} prompts of {a.prompt_len} tokens from {a.text.name}, {a.max_new} new each")
    print("| draft | ikquant --pure --dry-run types | draft bytes | mean acceptance ± s.e. | vs stored ± s.e. (paired) |")
    print("|---|---|---:|---:|---:|")
    for r, mean, infl in per_type:
        planned = ("as stored" if r["draft"] == "as stored" else
                   ", ".join(f"{n} {t}" for t, n in sorted(plan_types(a.draft, r["draft"]).items())))
        diff = "" if r is per_type[0][0] else f"{mean - base_mean:+.3f} ± {standard_error(infl - base_infl):.3f}"
        print(f"| {r['draft']} ({', '.join(r['types_used'])}) | {planned} | {r['draft_bytes']:,} | "
              f"{mean:.3f} ± {standard_error(infl):.3f} | {diff} |")


def acceptance(drafts_accepted: list[tuple[int, int]]) -> float:
    """Tokens per drafting step as ik counts them: 1 + accepted / drafts."""
    return 1.0 + sum(n for _, n in drafts_accepted) / sum(d for d, _ in drafts_accepted)


def ik_run(ik_bin: Path, target: Path, draft: Path, prompt: str, max_new: int, threads: int,
           cross_ctx: int) -> tuple[float, int, int]:
    """(decode seconds, drafts, accepted tokens) of one prompt in ik's llama-spec-bench."""
    res = subprocess.run([str(ik_bin), "-m", str(target), "-md", str(draft), "--spec-type",
                          f"dflash:n_max=15,cross_ctx={cross_ctx}", "--temp", "0", "--in-suffix", "", "-p", prompt,
                          "-n", str(max_new), "-t", str(threads), "--output-format", "jsonl"],
                         capture_output=True, text=True, errors="replace", check=True)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    attempt = next(r for r in rows if r["row_type"] == "attempt")
    if attempt["generated"] != max_new:
        raise RuntimeError(f"ik generated {attempt['generated']} tokens, not {max_new} (an end-of-text token?)")
    stage = attempt["stages"][0]
    return float(attempt["decode_s"]), int(stage["drafts"]), int(stage["accepted"])


def speed(a: argparse.Namespace) -> None:
    text = a.text.read_text(encoding="utf-8")
    stride = (len(text) - a.prompt_chars) // a.prompts
    prompts = [text[i * stride : i * stride + a.prompt_chars] for i in range(a.prompts)]
    tokenizer = Model(a.target, threads=1).tokenizer()
    ids = [np.asarray(tokenizer.encode(p, add_special=False), dtype=np.int64) for p in prompts]
    ik = IkSpecBench(a.cross_ctx, True, True)
    tokens = a.prompts * a.max_new
    print(f"{a.prompts} prompts of {a.prompt_chars} characters ({min(map(len, ids))}-{max(map(len, ids))} tokens) "
          f"from {a.text.name}, {a.max_new} new tokens each; decode-only tokens/s, ik's loop on both sides")
    for threads in (int(t) for t in a.threads.split(",")):
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        options = RuntimeOptions(numerics=a.numerics)
        target, draft = (Model(m, threads=threads, options=options) for m in (a.target, a.draft))
        for p in ids[:1]:  # JIT and page cache warm before the first timed round
            speculative_generate(target, draft, p, a.max_new, ik=ik)
        ratios = []
        for rnd in range(a.rounds):
            runs = [speculative_generate(target, draft, p, a.max_new, ik=ik) for p in ids]
            ours = tokens / sum(r.decode_seconds for r in runs)
            theirs = [ik_run(a.ik_bin, a.target, a.draft, p, a.max_new, threads, a.cross_ctx) for p in prompts]
            ik_tps = tokens / sum(s for s, _, _ in theirs)
            mine = [(len(r.acceptance_lengths), sum(r.acceptance_lengths) - len(r.acceptance_lengths)) for r in runs]
            iks = [(d, n) for _, d, n in theirs]
            differ = [i for i, (x, y) in enumerate(zip(mine, iks)) if x != y]
            ratios.append(ours / ik_tps)
            print(f"{threads} thread(s), round {rnd + 1}: ikrun {ours:,.0f} tok/s, ik {ik_tps:,.0f} tok/s, ratio "
                  f"{ours / ik_tps:.2f}; acceptance ikrun {acceptance(mine):.3f}, ik {acceptance(iks):.3f} tokens/step"
                  f" (drafts and accepted tokens differ in prompts {differ or 'none'})", flush=True)
        print(f"{threads} thread(s): ratio ikrun/ik median {float(np.median(ratios)):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    for name in ("table", "speed"):
        p = sub.add_parser(name)
        p.add_argument("--target", type=Path, required=True, help="the target's GGUF")
        p.add_argument("--draft", type=Path, required=True, help="the DFlash draft's GGUF")
        p.add_argument("--text", type=Path, required=True, help="text the prompts are cut from")
        p.add_argument("--prompts", type=int, default=32 if name == "table" else 8)
        p.add_argument("--max-new", type=int, default=96 if name == "table" else 128)
    t = sub.choices["table"]
    t.add_argument("--prompt-len", type=int, default=24)
    t.add_argument("--types", default="Q8_0,Q6_K,Q5_K,Q4_K,IQ4_KS,IQ3_K,IQ2_KS")
    t.add_argument("--threads", type=int, default=2)
    s = sub.choices["speed"]
    s.add_argument("--ik-bin", type=Path, required=True, help="ik's llama-spec-bench")
    s.add_argument("--prompt-chars", type=int, default=60)
    s.add_argument("--threads", default="1,2")
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--cross-ctx", type=int, default=128)
    s.add_argument("--numerics", default="exact", help="ikrun's arithmetic: exact (default) or ik (ik's float order)")
    a = ap.parse_args()
    if a.mode == "table":
        table(a)
    else:
        speed(a)


if __name__ == "__main__":
    main()
