#!/usr/bin/env python3
"""Prompt-eval speed of the runtime (tokens/s) on a generated Qwen3-shaped model, against a numpy-only baseline
and, given --ik-bin, ik_llama.cpp's own llama-perplexity on the same files and threads. With --tiny, the same on the
tiny golden models of every architecture the runtime has (tests/data: qwen3, deepseek-v3, openpangu-v2, glm-dsa),
64-token chunks as their golden logits were made.

The model (default ~0.4B parameters) is written as bf16 safetensors, converted to F16, then quantized to Q8_0, Q4_K,
IQ4_KS and IQ2_KT; each file runs with the exact arithmetic and with --numerics ik. Each measurement evaluates the same chunks; the runtime's figure excludes the first chunk (decode caches,
JIT warm-up) as ik's excludes its load.

Example: python tools/bench_runtime.py --ik-bin ~/ik/build/bin/llama-perplexity --threads 2
         python tools/bench_runtime.py --tiny --ik-bin ~/ik/build/bin/llama-perplexity --threads 1
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import time
from pathlib import Path

# isort: off
import ikquant  # noqa: F401  (first: its import sets OpenBLAS's thread timeout before numpy loads)
# isort: on

import numba

from ikconvert import CORPUS, Converter, TinySpec, make_tiny_checkpoint
from ikquant import QuantizeOptions, file_type, quantize_model
from ikrun import HFReference, Model, RuntimeOptions, tokenize_chunks

DATA = Path(__file__).parents[1] / "tests" / "data"
#: golden tiny models: (file, text, our runtime options, ik's extra flags) computing the same function in both
TINY = {
    "qwen3": (DATA / "convert" / "qwen3" / "ik-f32.gguf", DATA / "logits" / "qwen3" / "text.txt", RuntimeOptions(), []),
    "deepseek-v3": (DATA / "convert" / "deepseek-v3" / "ik-f32.gguf", DATA / "logits" / "deepseek-v3" / "text.txt",
                    RuntimeOptions(), []),
    "openpangu-v2": (DATA / "convert" / "openpangu-v2" / "ik-f32.gguf", DATA / "logits" / "openpangu-v2" / "text.txt",
                     RuntimeOptions(ik_sink_overread=True), []),
    "glm-dsa": (DATA / "convert" / "glm-dsa" / "ref-f32.gguf", DATA / "logits" / "glm-dsa" / "text.txt",
                RuntimeOptions(dsa_sink=True), ["--dsa"]),
}


def runtime_speed(path: Path, ctx: int, n_chunks: int, threads: int, text: str | None = None,
                  options: RuntimeOptions | None = None) -> float:
    numba.set_num_threads(threads)
    m = Model(path, threads, options=options)
    chunks = tokenize_chunks(m, text or CORPUS.read_text(encoding="utf-8") * 4, ctx, n_chunks + 1)
    m.logits(chunks[0])
    t0 = time.perf_counter()
    for c in chunks[1:]:
        m.logits(c)
    return (len(chunks) - 1) * ctx / (time.perf_counter() - t0)


def numpy_speed(hf: Path, path: Path, ctx: int) -> float:
    ref = HFReference(hf)
    m = Model(path)
    chunk = tokenize_chunks(m, CORPUS.read_text(encoding="utf-8") * 4, ctx, 1)[0]
    t0 = time.perf_counter()
    ref.logits(chunk)
    return ctx / (time.perf_counter() - t0)


def ik_speed(ik_bin: Path, path: Path, text: Path, ctx: int, n_chunks: int, threads: int,
             extra: list[str] | None = None) -> float | None:
    res = subprocess.run([str(ik_bin), "-m", str(path), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "--chunks",
                          str(n_chunks + 1), "-t", str(threads), "-fa", "off", *(extra or [])],
                         capture_output=True, text=True, errors="replace", cwd=tempfile.gettempdir())  # its llama.log
    m = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", res.stdout + res.stderr)
    return int(m.group(2)) / (float(m.group(1)) / 1000) if m else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("bench-runtime"))
    ap.add_argument("--ik-bin", type=Path, help="ik_llama.cpp's llama-perplexity (optional)")
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="the tiny golden models instead (ctx 64, 8 chunks)")
    a = ap.parse_args()
    if a.tiny:
        tiny(a.ik_bin, a.threads)
        return
    a.workdir.mkdir(parents=True, exist_ok=True)
    hf = a.workdir / "hf"
    if not (hf / "config.json").exists():
        make_tiny_checkpoint(hf, TinySpec(arch="qwen3", hidden=1024, layers=24, heads=16, kv_heads=8, head_dim=64,
                                          ffn=4096))
    f16 = a.workdir / "model-f16.gguf"
    if not f16.exists():
        Converter(hf, "f16", "qwen2").write(f16)
    files = {"F16": f16}
    for t, ftype in (("Q8_0", "Q8_0"), ("Q4_K", "Q4_K_S"), ("IQ4_KS", "IQ4_KS"), ("IQ2_KT", "IQ2_KT")):
        files[t] = a.workdir / f"model-{t.lower()}.gguf"  # --pure: every tensor type t (IQ2_KT without an imatrix)
        if not files[t].exists():
            quantize_model(f16, files[t], QuantizeOptions(file_type(ftype), pure=True, ignore_imatrix_rules=True))
    text = a.workdir / "text.txt"
    text.write_text(CORPUS.read_text(encoding="utf-8") * 4, encoding="utf-8")
    n_params = sum(t.n_elements for t in Model(f16).gguf.tensors.values())
    print(f"model: {n_params / 1e6:.0f} M parameters, ctx {a.ctx}, {a.threads} threads")
    print(f"{'file':8s} {'exact tok/s':>12s} {'--numerics ik':>14s} {'ik tok/s':>9s} {'exact/ik':>9s} "
          f"{'numerics ik/ik':>15s}")
    for name, path in files.items():
        ours = runtime_speed(path, a.ctx, a.chunks, a.threads)
        ours_ik = runtime_speed(path, a.ctx, a.chunks, a.threads, options=RuntimeOptions(numerics="ik"))
        ik = ik_speed(a.ik_bin, path, text, a.ctx, a.chunks, a.threads) if a.ik_bin else None
        ratios = f"{ours / ik:9.2f} {ours_ik / ik:15.2f}" if ik else f"{'-':>9s} {'-':>15s}"
        print(f"{name:8s} {ours:12.1f} {ours_ik:14.1f} {ik if ik else float('nan'):9.1f} {ratios}", flush=True)
    print(f"numpy-only reference forward (F32 math from the safetensors): {numpy_speed(hf, f16, a.ctx):.1f} tok/s")


def tiny(ik_bin: Path | None, threads: int) -> None:
    print(f"tiny golden models, ctx 64, 7 chunks timed, {threads} threads")
    print(f"{'model':13s} {'ikrun tok/s':>12s} {'ik tok/s':>9s} {'ikrun/ik':>9s}")
    for name, (path, text, options, ik_flags) in TINY.items():
        ours = runtime_speed(path, 64, 7, threads, text.read_text(encoding="utf-8"), options)
        ik = ik_speed(ik_bin, path, text, 64, 7, threads, ik_flags) if ik_bin else None
        ratio = f"{ours / ik:9.2f}" if ik else f"{'-':>9s}"
        print(f"{name:13s} {ours:12.0f} {ik if ik else float('nan'):9.0f} {ratio}", flush=True)


if __name__ == "__main__":
    main()
