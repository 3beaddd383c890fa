#!/usr/bin/env python3
"""Memory and speed of `ikrun ppl` on ~1B-parameter models: unconstrained, default, and under a small --mem.

Generates (once, cached in --workdir) a Qwen3-shaped model, a DeepSeek-V3-shaped MoE (MLA, 1 dense + 3 MoE
layers of 64 experts) and a Qwen3-MoE-shaped one (10 layers of 1024, 64 experts of 512, 8 used), each as F16,
IQ4_KS and Q8_0 (those --only names), and, as F16 with their MXFP4 experts, a DeepSeek-V4-shaped one (6 layers of
1024: sliding, CSA and HCA attention, mHC, 32 MXFP4 experts; ~350M parameters) and a gpt-oss-shaped one (12 layers
of 1024, sinks, alternating 128-token windows, 32 MXFP4 experts of 1024, 4 used; ~1.2B parameters), and a
Qwen3-Next-shaped one as F16, IQ4_KS and Q8_0 (10 layers of 1024: gated delta-net with 8 key / 16 value heads of
128, gated full attention every 4th layer, 64 experts of 512, 8 used, and a gated shared expert; ~1.1B
parameters). Each file runs in a fresh process (tools/peak_rss.py, so the peak RSS is the command's own):

- `unconstrained`: --no-stream with no budget worth the name (every decoded weight cached, the pre-budget runtime);
- `default`: no flags (75% of the available memory; one-pass runs are layer-streamed);
- `--mem M`: the given budget (default 1GiB), layer-streamed;
- `--numerics ik`: the default mode with ik's arithmetic (integer matmuls; `--ik-batch B`, the micro-batches of
  the ik runs' `-b B`: ik's default 2048 unless --ik-batch says otherwise), shown as "refused" for a file with a
  weight type it does not reproduce; `--numerics ik-avx2` instead (ik's AVX2 build's arithmetic, what a native ik
  computes there) on a host without AVX-512 VNNI, or as --numerics says;
- `ik`: ik_llama.cpp's llama-perplexity on the same file, chunks and threads, when --ik-bin is given, with its
  defaults (flash attention on; --ik-flash-attn off for -fa off).

Each file is read once before its first mode, so every mode finds it in the page cache, and each ikrun mode runs
once on one chunk before it is timed: a kernel whose source file changed since Numba cached it compiles in the first
process that calls it, inside its timed evaluation (after an edit of ikrun/ops/moe.py the Qwen3-MoE IQ4_KS file's
`--numerics ik` row measured 153 tok/s where a warm run measures ~640). With --rounds N every mode of a file is
timed N times, one round of all modes after another, and the median is reported with the range. Reported: tokens/s
of the evaluation (ikrun's own report, without start-up; ik's prompt-eval figure), its ratio to
the first mode run for that file ("x first": the unconstrained run unless --modes leaves it out), peak RSS, and peak
RSS over the file size.

Example: python tools/bench_scale.py --workdir /tmp/bench-scale --ik-bin ~/ik/build/bin/llama-perplexity
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# isort: off
import ikquant  # noqa: F401  (first: its import sets OpenBLAS's thread timeout before numpy loads)
# isort: on

import numba
import numpy as np

from ikconvert import CORPUS, Converter, TinySpec, make_tiny_checkpoint
from ikquant import QuantizeOptions, file_type, quantize_model
from ikquant.cpu import host_has

TOOLS = Path(__file__).parent
sys.path.insert(0, str(TOOLS))
from bench_convert import (  # noqa: E402
    make_deepseek4_checkpoint,
    make_deepseek_fp8_checkpoint,
    make_gpt_oss_checkpoint,
    make_qwen3moe_checkpoint,
    make_qwen3next_checkpoint,
)

GiB = 1 << 30
PRE_TOKENIZERS = {"qwen3": "qwen2", "deepseek": "deepseek-v3", "deepseek4": "joyai-llm", "qwen3moe": "qwen2",
                  "gpt-oss": "gpt-4o", "qwen3next": "qwen2"}
QUANTIZED = ("IQ4_KS", "Q8_0")  # what each model's F16 file is also quantized to (ik's recipe for the type)
#: ik's graph for these asserts on a batch of several sequences (DeepSeek-V4's mask, at 8337e4cd3): their ik runs and
#: --numerics ik runs take one chunk a batch (-b / --ik-batch of the context)
ONE_SEQUENCE = ("deepseek4",)
MXFP4_EXPERTS = ("deepseek4", "gpt-oss")  # routed experts MXFP4 in every file (requantizing them is not the point)


def build_models(workdir: Path, only: str | None) -> dict[str, Path]:
    """The benchmark files, generated and converted once; with `only`, just the models a label it matches needs."""
    files = {}
    for name in ("qwen3", "deepseek", "deepseek4", "qwen3moe", "gpt-oss", "qwen3next"):
        if only and not any(re.search(only, f"{name} {kind}") for kind in ("F16", *QUANTIZED, "F16+MXFP4")):
            continue
        hf = workdir / f"hf-{name}"
        if not (hf / "config.json").exists():
            if name == "qwen3":  # 22 layers x 50 M parameters
                make_tiny_checkpoint(hf, TinySpec(arch="qwen3", hidden=2048, layers=22, heads=16, kv_heads=8,
                                                  head_dim=128, ffn=6144))
            elif name == "deepseek":
                make_deepseek_fp8_checkpoint(hf, 4)
            elif name == "qwen3moe":
                make_qwen3moe_checkpoint(hf)
            elif name == "gpt-oss":
                make_gpt_oss_checkpoint(hf)
            elif name == "qwen3next":
                make_qwen3next_checkpoint(hf)
            else:
                make_deepseek4_checkpoint(hf)
        f16 = workdir / f"{name}-f16.gguf"
        if not f16.exists():
            Converter(hf, "f16", PRE_TOKENIZERS[name]).write(f16)
        if name in MXFP4_EXPERTS:
            files[f"{name} F16+MXFP4"] = f16
            continue
        files[f"{name} F16"] = f16
        for kind in QUANTIZED:
            if only and not re.search(only, f"{name} {kind}"):
                continue
            quantized = workdir / f"{name}-{kind.lower()}.gguf"
            if not quantized.exists():
                quantize_model(f16, quantized, QuantizeOptions(file_type(kind)))
            files[f"{name} {kind}"] = quantized
    return files


class Refused(Exception):
    """ikrun refused the file under the options given (--numerics ik on a type it does not reproduce)."""


def run(cmd: list[str]) -> tuple[str, float]:
    """(the command's stderr+stdout, its peak RSS in bytes)."""
    res = subprocess.run([sys.executable, str(TOOLS / "peak_rss.py"), *cmd], capture_output=True, text=True,
                         errors="replace", cwd=tempfile.gettempdir())
    text = res.stdout + res.stderr
    refused = r"does not reproduce ik's (arithmetic|AVX2 kernels)|reproduces ik's AVX2 .* not (the|its own) kernel|--numerics ik is not"
    if res.returncode != 0 and re.search(refused, text):
        raise Refused(text.strip().splitlines()[-1])
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{text[-3000:]}")
    rss = float(re.findall(r"peak_rss ([\d.]+)", text)[-1]) * (1 << 20)
    return text, rss


def ikrun_ppl(path: Path, text: Path, ctx: int, chunks: int, threads: int, extra: list[str]) -> tuple[float, float]:
    ikrun = str(Path(sys.executable).with_name("ikrun"))
    out, rss = run([ikrun, "ppl", str(path), "--text", str(text), "--ctx", str(ctx), "--chunks", str(chunks),
                    "-t", str(threads), *extra])
    m = re.search(r"peak RSS [\d.]+ \w+, ([\d.]+) s", re.sub(r"\s+", " ", out))
    if m is None:
        raise SystemExit(f"no run report in ikrun's output:\n{out[-2000:]}")
    seconds = float(m.group(1))
    return chunks * ctx / seconds, rss


def ik_ppl(ik_bin: Path, path: Path, text: Path, ctx: int, chunks: int, threads: int,
           flash_attn: str, batch: int) -> tuple[float, float]:
    out, rss = run([str(ik_bin), "-m", str(path), "-f", str(text), "-c", str(ctx), "-b", str(batch), "--chunks",
                    str(chunks), "-t", str(threads), "-fa", flash_attn])
    m = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", out)
    if m is None:
        raise SystemExit(f"no prompt eval time in ik's output:\n{out[-2000:]}")
    return int(m.group(2)) / (float(m.group(1)) / 1000), rss


def read_through(path: Path) -> None:
    """Read the file once so that every mode starts with it in the page cache: a command timed after other work
    had pushed it out read it from the disk inside its timed evaluation, and the modes after it did not (the ~1B
    Qwen3-MoE IQ4_KS file, --numerics ik, after dropping the page cache: 2.18 s, then 1.65 s)."""
    with path.open("rb") as f:
        while f.read(1 << 24):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("bench-scale"))
    ap.add_argument("--ik-bin", type=Path, help="ik_llama.cpp's llama-perplexity (optional)")
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--mem", default="1GiB")
    ap.add_argument("--only", help="regex: only the files whose label matches (e.g. 'qwen3 F16')")
    ap.add_argument("--modes", help="regex: only the modes whose name matches (e.g. 'default|numerics|ik')")
    ap.add_argument("--ik-flash-attn", choices=("on", "off"), default="on",
                    help="ik's -fa: on is its default (what users run; its DeepSeek-V4 graph asserts with off); off "
                         "was these figures' setting before")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every mode of a file this many times, the modes alternated round by round, and print "
                         "the median with the range (this machine's speed moves by 10-40%% within minutes: a mode "
                         "timed once against ik timed once compares two moments as much as two programs)")
    ap.add_argument("--numerics", choices=("ik", "ik-avx2"), default="ik" if host_has("avx512vnni") else "ik-avx2",
                    help="the arithmetic of the numerics mode: ik's AVX-512 build's or its AVX2 build's (default: the "
                         "one a native ik build runs on this host)")
    ap.add_argument("--ik-batch", type=int, default=2048,
                    help="ik's -b and the --numerics ik runs' --ik-batch (which expert kernels ik picks depends on "
                         "the tokens a micro-batch routes to each expert): 2048 is ik's default; the figures before "
                         "2026-12 ran ik with -b of the context (ikrun with 2048); the DeepSeek-V4-shaped file "
                         "takes the context (ONE_SEQUENCE)")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    files = build_models(a.workdir, a.only)
    text = a.workdir / "text.txt"
    text.write_text(CORPUS.read_text(encoding="utf-8") * 40, encoding="utf-8")
    modes = {"unconstrained": ["--no-stream", "--mem", "1000GiB"], "default": [], f"--mem {a.mem}": ["--mem", a.mem],
             f"--numerics {a.numerics}": ["--numerics", a.numerics]}
    print(f"ctx {a.ctx}, {a.chunks} chunks, {a.threads} threads")
    print(f"{'file':16s} {'GiB':>6s} {'mode':>19s} {'tok/s':>7s} {'x first':>8s} {'peak RSS GiB':>12s} "
          f"{'RSS/file':>8s}{' (tok/s range)' if a.rounds > 1 else ''}")
    for label, path in files.items():
        if a.only and not re.search(a.only, label):
            continue
        size = path.stat().st_size
        read_through(path)
        batch = a.ctx if label.split()[0] in ONE_SEQUENCE else a.ik_batch
        timed_modes: dict[str, list[str]] = {}
        for mode, extra in [*modes.items(), *([("ik", [])] if a.ik_bin else [])]:
            if a.modes and not re.search(a.modes, mode):
                continue
            if mode.startswith("--numerics"):  # ik's micro-batches, this file's
                extra = [*extra, "--ik-batch", str(batch)]
            try:
                if mode != "ik":  # untimed: compiles what Numba's cache lacks (a kernel's source changed since)
                    ikrun_ppl(path, text, a.ctx, 1, a.threads, extra)
            except Refused:
                print(f"{label:16s} {size / GiB:6.2f} {mode:>19s} {'refused':>7s}", flush=True)
                continue
            timed_modes[mode] = extra
        runs: dict[str, list[tuple[float, float]]] = {mode: [] for mode in timed_modes}
        for _ in range(a.rounds):
            for mode, extra in timed_modes.items():
                runs[mode].append(ik_ppl(a.ik_bin, path, text, a.ctx, a.chunks, a.threads, a.ik_flash_attn, batch)
                                  if mode == "ik" else ikrun_ppl(path, text, a.ctx, a.chunks, a.threads, extra))
        base = None
        for mode, timed in runs.items():
            rates = sorted(tps for tps, _ in timed)
            tps, rss = float(np.median(rates)), max(r for _, r in timed)
            spread = f" ({rates[0]:.1f}-{rates[-1]:.1f})" if len(rates) > 1 else ""
            base = base or tps
            print(f"{label:16s} {size / GiB:6.2f} {mode:>19s} {tps:7.1f} {base / tps:8.2f} {rss / GiB:12.2f} "
                  f"{rss / size:8.2f}{spread}", flush=True)


if __name__ == "__main__":
    main()
