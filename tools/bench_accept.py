#!/usr/bin/env python3
"""Speculative decoding speed with a DFlash draft: `ikrun accept`'s loop against ik's `llama-spec-bench` on the
same target/draft GGUFs and prompts (the trained tiny pair of tests/data/dflash, converted here).

Reported per thread count: ikrun's tokens/s over all prompts (warm: the best of --repeat passes in one process, so
JIT and page-cache warm-up are excluded) with its mean acceptance length, and ik's decode tokens/s (its own decode
time, prefill excluded) with its acceptance length, when --ik-bin points at llama-spec-bench.

Example: python tools/bench_accept.py --ik-bin ~/ik/build/bin/llama-spec-bench --threads 1,2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

# isort: off
import ikquant  # noqa: F401  (first: its import sets OpenBLAS's thread timeout before numpy loads)
# isort: on

import numba
import numpy as np

from ikconvert import Converter
from ikrun import Model, mean_acceptance_length, speculative_generate

PAIR = Path(__file__).parents[1] / "tests" / "data" / "dflash" / "dflash-qwen3-trained"


def ik_run(ik_bin: Path, target: Path, draft: Path, prompt: str, max_new: int, threads: int) -> tuple[float, float]:
    """(decode seconds, tokens per target step) of one prompt in ik's llama-spec-bench."""
    res = subprocess.run([str(ik_bin), "-m", str(target), "-md", str(draft), "--spec-type", "dflash:n_max=15",
                          "--temp", "0", "--in-suffix", "", "-p", prompt, "-n", str(max_new), "-t", str(threads),
                          "--output-format", "jsonl"], capture_output=True, text=True, errors="replace", check=True)
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    return float(summary["decode_s"]), 1.0 + float(summary["speculative"]["acceptance_length"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ik-bin", type=Path, help="ik's llama-spec-bench")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    oracle = json.loads((PAIR / "dflash-oracle.json").read_text())
    max_new = int(oracle["max_new_tokens"])
    prompts = [np.array(r["prompt"]) for r in oracle["runs"]]
    with tempfile.TemporaryDirectory() as tmp:
        target = Converter(PAIR / "target", "f32", "qwen2").write(Path(tmp) / "target.gguf")
        draft = Converter(PAIR / "hf", "f32", "qwen2", arch_options={"target_model_dir": str(PAIR / "target")}).write(
            Path(tmp) / "draft.gguf")
        # the same prompts as text, as ik was given them when the golden run was made
        texts = [json.loads(line)["prompt_text"] for line in (PAIR / "ik-spec-bench.jsonl").read_text().splitlines()
                 if line.strip()]
        for threads in (int(t) for t in a.threads.split(",")):
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            t, d = Model(target, threads=threads), Model(draft, threads=threads)
            best, accept = float("inf"), 0.0
            for _ in range(a.repeat):
                runs = [speculative_generate(t, d, p, max_new) for p in prompts]
                best = min(best, sum(r.seconds for r in runs))
                accept = mean_acceptance_length(runs)
            line = (f"{threads} thread(s): ikrun {len(prompts) * max_new / best:,.0f} tok/s (acceptance {accept:.2f} "
                    "tokens/step, prefill included)")
            if a.ik_bin is not None:
                ik = [ik_run(a.ik_bin, target, draft, text, max_new, threads) for text in texts]
                seconds = sum(s for s, _ in ik)
                line += (f"; ik {len(prompts) * max_new / seconds:,.0f} tok/s (acceptance "
                         f"{np.mean([x for _, x in ik]):.2f} tokens/step, decode only)")
            print(line)


if __name__ == "__main__":
    main()
