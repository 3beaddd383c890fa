#!/usr/bin/env python3
"""Pruned against exhaustive sweeps: rows measured, CPU time, and the mixes' KLD in-sample and held-out.

Runs `ikrun sweep` twice on MODEL (every row; then `--target-bpw` with the budgets), builds `ikrun mix` at every
budget from each sweep with `--eval-text`, and prints one table: for each budget and sweep, the rows it measured,
its CPU seconds (the child processes' user+system time: fair on a shared machine, where wall time is not), the
mix's bits per weight, predicted KLD, and measured KLD on the sweep's text (in-sample) and on --eval-text
(held-out). --pure adds whole-file types at their own size for reference (held-out KLD from `ikrun kld`).

--spread F1,F2 adds a `--target-bpw ... --prediction-spread F` sweep per factor. --moe-layers N generates the model
instead: an N-layer DeepSeek-shaped MoE with random weights (hidden 64, 8 experts of 32, 2 used, the first layer
dense), in WORKDIR/moe-N.gguf (without --workdir a temporary folder, deleted at the end).

Example: python tools/bench_prune.py model-f32.gguf --text calibration.txt --eval-text held-out.txt \
             --types Q4_0,Q5_0,Q6_0,Q8_0 --budgets 5.565,6.563 --pure q5_0,q6_0 --ctx 64 --chunks 16
         python tools/bench_prune.py --moe-layers 24 --text calib.txt --eval-text eval.txt --budgets 5.5,6.5 \
             --spread 1.25,2
"""

from __future__ import annotations

import argparse
import atexit
import json
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ikquant.gguf_io import GGUFFile

BIN = Path(sys.executable).parent


def run(cmd: list[str]) -> tuple[str, float]:
    """(stdout, CPU seconds) of one command; its stderr is shown only when it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run(cmd, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    return res.stdout, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def moe_model(work: Path, layers: int) -> Path:
    """WORKDIR/moe-N.gguf: an N-layer DeepSeek-shaped MoE with random weights, F32 (made once)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_convert import DeepSeekShape, make_deepseek_fp8_checkpoint

    from ikconvert import Converter

    out = work / f"moe-{layers}.gguf"
    if not out.exists():
        shape = DeepSeekShape(hidden=64, heads=2, q_lora=64, kv_lora=64, nope=32, rope=32, v=32, ffn=128, moe_ffn=32,
                              experts=8, used=2, first_dense=1, vocab=320)
        make_deepseek_fp8_checkpoint(work / f"moe-{layers}-hf", layers, shape, fp8=False)
        Converter(work / f"moe-{layers}-hf", "f32", "deepseek-v3").write(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, nargs="?", help="An F32/BF16 GGUF (or --moe-layers).")
    ap.add_argument("--moe-layers", type=int, help="Generate an N-layer DeepSeek-shaped MoE as the model.")
    ap.add_argument("--spread", default="", help="Comma-separated --prediction-spread factors to bench too.")
    ap.add_argument("--text", type=Path, required=True, help="The sweep's text.")
    ap.add_argument("--eval-text", type=Path, required=True, help="Held-out text the mixes are also measured on.")
    ap.add_argument("--types", default="Q4_0,Q5_0,Q6_0,Q8_0")
    ap.add_argument("--budgets", required=True, help="Comma-separated whole-file bits per weight.")
    ap.add_argument("--pure", default="", help="Comma-separated file types to measure as references.")
    ap.add_argument("--ctx", default="64")
    ap.add_argument("--chunks", default="16")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--reuse", action="store_true", help="Keep the sweeps (KIND.json and its CPU seconds, KIND.cpu) "
                    "that --workdir already holds.")
    a = ap.parse_args()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="bench-prune-"))
    if a.workdir is None:  # the generated model, sweeps and mixes: 34 MB a run at --moe-layers 24
        atexit.register(shutil.rmtree, work, True)
    work.mkdir(parents=True, exist_ok=True)
    if (a.model is None) == (a.moe_layers is None):
        sys.exit("give a model or --moe-layers")
    model = a.model or moe_model(work, a.moe_layers)
    common = ["--ctx", a.ctx, "--chunks", a.chunks, "--threads", a.threads]
    sweeps = {}
    kinds = [("exhaustive", []), ("pruned", ["--target-bpw", a.budgets])]
    kinds += [(f"spread {f}", ["--target-bpw", a.budgets, "--prediction-spread", f]) for f in filter(None, a.spread.split(","))]
    for kind, extra in kinds:
        out, seconds = work / f"{kind.replace(' ', '-')}.json", work / f"{kind.replace(' ', '-')}.cpu"
        if a.reuse and out.exists() and seconds.exists():
            rows = json.loads(out.read_text())["rows"]
            sweeps[kind] = (out, sum(1 for r in rows if r.get("measured", True)), len(rows), float(seconds.read_text()))
            continue
        out.unlink(missing_ok=True)
        _, cpu = run([str(BIN / "ikrun"), "sweep", str(model), "--text", str(a.text), "--types", a.types, "-o",
                      str(out), *common, *extra])
        seconds.write_text(f"{cpu:.1f}")
        rows = json.loads(out.read_text())["rows"]
        sweeps[kind] = (out, sum(1 for r in rows if r.get("measured", True)), len(rows), cpu)
    exhaustive_cpu = sweeps["exhaustive"][3]
    print("| budget | sweep | rows measured | CPU s (x exhaustive) | bpw | predicted | in-sample KLD | held-out KLD |")
    print("|---|---|---|---|---|---|---|---|")
    for bpw in a.budgets.split(","):
        for kind, (path, measured, total, cpu) in sweeps.items():
            stdout, _ = run([str(BIN / "ikrun"), "mix", str(model), str(work / f"{kind.replace(' ', '-')}-{bpw}.gguf"), "--sweep",
                             str(path), "--type", "Q8_0", "--target-bpw", bpw, "--eval-text", str(a.eval_text),
                             "--json", "--threads", a.threads])
            first, held = json.loads(stdout)
            print(f"| {bpw} | {kind} | {measured} of {total} | {cpu:.1f} ({cpu / exhaustive_cpu:.2f}x) | "
                  f"{first['bpw']:.4f} | "
                  f"{first['predicted_kld']:.4g} | {first['kld_mean']:.4g} ± {first['kld_mean_err']:.2g} | "
                  f"{held['kld_mean']:.4g} ± {held['kld_mean_err']:.2g} |")
    for ftype in filter(None, a.pure.split(",")):
        pure = work / f"pure-{ftype}.gguf"
        run([str(BIN / "ikquant"), str(model), str(pure), "--type", ftype, "--pure"])
        stdout, _ = run([str(BIN / "ikrun"), "kld", str(pure), "--base", str(model), "--text", str(a.eval_text),
                         "--json", *common])
        kld = json.loads(stdout)
        g = GGUFFile(pure)
        bits = 8 * sum(t.nbytes for t in g.tensors.values()) / sum(t.n_elements for t in g.tensors.values())
        print(f"| pure {ftype} | - | - | - | {bits:.4f} | - | - | {kld['kld_mean']:.4g} ± {kld['kld_mean_err']:.2g} |")


if __name__ == "__main__":
    main()
