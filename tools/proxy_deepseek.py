#!/usr/bin/env python3
"""What a sweep of DeepSeek-V3 costs: measured on a 61-layer DeepSeek-V3-shaped proxy, extrapolated per op.

The proxy (tools/bench_convert.py's DeepSeek generator) has DeepSeek-V3's layer count (61, the first 3 dense), its
experts (256 routed, 8 used, 1 shared) and its tensor set (MLA: q_a, q_b, kv_a, kv_b, k_b, v_b; no indexer), at
narrow widths (hidden 64, expert FFN 32, vocab 320: 183 MiB in BF16). On it, this script measures:

- a one-type sweep (`ikrun sweep --types Q4_0`, every group): seconds per candidate by tensor class, and the
  layer-local forward's cost per block and chunk (the slope of a candidate's seconds against the blocks after it);
- a pruned sweep (`--target-bpw` at two budgets over four types): rows measured of the exhaustive count, rounds;
  with --exhaustive also the exhaustive sweep over the four types, for its time;
- per-op rates on this machine at DeepSeek-V3's real shapes: the f32 GEMM the exact numerics runs (numpy), the
  base's Q8_0 decode per weight, the KLD's log-softmax per logit, and the quantization and prior (quantize,
  dequantize, weighted squared error) per weight and type, on one routed expert's 2048 x 7168 matrix;
- one Ray actor's start and one task's round trip on a local Ray cluster (127.0.0.1).

The extrapolation (printed with its assumptions) prices each candidate of DeepSeek-V3 as: its quantization
(weights x rate, linear: a quantizer's work is per block) + for every block from its first to the last, per chunk
the block's FLOPs / the GEMM rate (matmuls and MLA attention are compute-bound at 512-token chunks) + the proxy's
measured per-block overhead (the interpreter's work per block, independent of width), and once per candidate per
block the decode of the block's base weights (bytes-bound: all chunks run in one pass, so every weight is decoded
once per pass; every expert receives tokens at these chunk counts) + per chunk the output head (FLOPs) and the KLD
(per logit). Core counts scale the GEMM and decode rates linearly (optimistic: no memory-bandwidth ceiling).

Example: python tools/proxy_deepseek.py --workdir /tmp/proxy --chunks 2 --user-chunks 32,250
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# isort: off
import ikquant  # noqa: F401  (first: its import sets OpenBLAS's thread timeout before numpy loads)
# isort: on

import numpy as np

TOOLS = Path(__file__).parent
sys.path.insert(0, str(TOOLS))
from bench_convert import DeepSeekShape, make_deepseek_fp8_checkpoint  # noqa: E402

from ikconvert import CORPUS, Converter  # noqa: E402

LAYERS = 61
PROXY = DeepSeekShape(hidden=64, heads=2, q_lora=64, kv_lora=64, nope=32, rope=32, v=32, ffn=128, moe_ffn=32,
                      experts=256, used=8, first_dense=3, vocab=320)
DEEPSEEK_V3 = DeepSeekShape(hidden=7168, heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128, ffn=18432,
                            moe_ffn=2048, experts=256, used=8, first_dense=3, vocab=129280)
TYPES = ("Q4_0", "Q5_0", "Q6_0", "Q8_0")
#: the parts of a candidate's extrapolated time
PARTS = ("GEMM", "base decode", "overhead", "KLD", "quantize")
CLASSES = ("attention", "dense FFN", "routed experts", "shared expert", "output/embd")
BIN = Path(sys.executable).parent


def class_of(tensor: str) -> str:
    """The tensor class a sweep group belongs to, for the per-class costs."""
    if "_exps" in tensor:
        return "routed experts"
    if "_shexp" in tensor:
        return "shared expert"
    if ".attn_" in tensor:
        return "attention"
    if re.search(r"\.ffn_(up|gate|down)\.", tensor):
        return "dense FFN"
    return "output/embd"


def tensor_weights(s: DeepSeekShape, tensor: str) -> int:
    """The weights of one tensor of a DeepSeek-V3-layout model of shape `s` (by its GGUF name)."""
    h, qk = s.hidden, s.nope + s.rope
    sizes = {"attn_q_a": h * s.q_lora, "attn_q_b": s.q_lora * s.heads * qk, "attn_kv_a_mqa": h * (s.kv_lora + s.rope),
             "attn_kv_b": s.kv_lora * s.heads * (s.nope + s.v), "attn_k_b": s.heads * s.nope * s.kv_lora,
             "attn_v_b": s.heads * s.kv_lora * s.v, "attn_output": s.heads * s.v * h, "ffn_gate": h * s.ffn,
             "ffn_up": h * s.ffn, "ffn_down": h * s.ffn, "ffn_gate_exps": s.experts * h * s.moe_ffn,
             "ffn_up_exps": s.experts * h * s.moe_ffn, "ffn_down_exps": s.experts * h * s.moe_ffn,
             "ffn_gate_shexp": h * s.moe_ffn, "ffn_up_shexp": h * s.moe_ffn, "ffn_down_shexp": h * s.moe_ffn,
             "token_embd": s.vocab * h, "output": s.vocab * h}
    return sizes[re.sub(r"^blk\.\d+\.|\.weight$", "", tensor)]


def block_flops(s: DeepSeekShape, layer: int, n_ctx: int) -> float:
    """FLOPs per token of block `layer` in a chunk of n_ctx tokens: the projections, MLA attention with the
    absorbed k_b/v_b (the path ikrun's MLA runs) over the causal average of (n_ctx + 1) / 2 keys, and the dense FFN
    or the router, the 8 used experts and the shared one."""
    h, keys = s.hidden, (n_ctx + 1) / 2
    proj = sum(tensor_weights(s, t) for t in ("attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_output"))
    mla = s.heads * (s.nope * s.kv_lora + (s.kv_lora + s.rope) * keys + s.kv_lora * keys + s.kv_lora * s.v)
    ffn = 3 * h * s.ffn if layer < s.first_dense else h * s.experts + (s.used + 1) * 3 * h * s.moe_ffn
    return 2.0 * (proj + mla + ffn)


def block_weights(s: DeepSeekShape, layer: int) -> int:
    """The weights a forward through block `layer` decodes (k_b/v_b, not kv_b, on the MLA path)."""
    names = ["attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_k_b", "attn_v_b", "attn_output"]
    names += ["ffn_gate", "ffn_up", "ffn_down"] if layer < s.first_dense else [
        "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
    return sum(tensor_weights(s, n) for n in names) + (s.hidden * s.experts if layer >= s.first_dense else 0)


def first_block(tensor: str) -> int:
    """The block a change of `tensor` is first seen in (the output head: after the last; the embedding: 0)."""
    m = re.match(r"blk\.(\d+)\.", tensor)
    return int(m.group(1)) if m else (LAYERS if tensor.startswith("output") else 0)


def timed(fn, repeat: int = 3, clock=time.perf_counter) -> float:  # type: ignore[no-untyped-def]
    """The least seconds of `repeat` calls (the least loaded one, on a shared machine) by `clock` (wall, or this
    process's CPU time)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


@dataclass
class Rates:
    """Per-op rates measured on this machine."""

    gemm_flops: float  # f32 GEMM FLOP/s at a DeepSeek-V3 expert's shape, per CPU second x threads (own cores)
    gemm_flops_wall: float  # the same per wall second (on this machine as loaded)
    decode_weight_s: float  # seconds to decode one Q8_0 weight to f32
    kld_logit_s: float  # seconds per logit of two log-softmaxes and their KL sum
    quantize_weight_s: dict[str, float]  # seconds to quantize one weight, per type
    prior_weight_s: dict[str, float]  # seconds of the pruned sweep's prior per weight, per type


def measure_rates(threads: int) -> Rates:
    """The per-op rates, each at DeepSeek-V3's own shapes: a 256-token f32 GEMM by an expert's 2048 x 7168 matrix;
    the quantization of that matrix (from F32) to each type, its decode, and the prior's weighted squared error."""
    import numba

    from ikquant.gguf_io import TensorInfo
    from ikquant.quantize import quantize_rows
    from ikquant.types import type_by_name

    numba.set_num_threads(threads)
    rng = np.random.default_rng(0)
    s = DEEPSEEK_V3
    x = rng.standard_normal((256, s.hidden), dtype=np.float32)
    w = rng.standard_normal((s.moe_ffn, s.hidden), dtype=np.float32) / np.float32(np.sqrt(s.hidden))
    flops = 2 * x.shape[0] * w.size
    gemm_wall = flops / timed(lambda: x @ w.T)
    gemm = flops / (timed(lambda: x @ w.T, clock=time.process_time) / threads)
    logits = rng.standard_normal((64, s.vocab), dtype=np.float32)
    base = rng.standard_normal((64, s.vocab), dtype=np.float32)

    def kld() -> float:
        lp = logits - logits.max(1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(1, keepdims=True))
        lb = base - base.max(1, keepdims=True)
        lb -= np.log(np.exp(lb).sum(1, keepdims=True))
        return float((np.exp(lb) * (lb - lp)).sum())

    kld_s = timed(kld) / logits.size
    info = TensorInfo("w", (s.hidden, s.moe_ffn), type_by_name("F32"), 0, w.nbytes)
    raw = w.view(np.uint8).reshape(s.moe_ffn, -1)
    importance = rng.uniform(0.5, 2.0, s.hidden)
    quant, prior, decode = {}, {}, 0.0
    for t in TYPES:
        gt = type_by_name(t)
        codec = gt.require_codec()
        quant[t] = timed(lambda gt=gt, codec=codec: quantize_rows(raw, info, gt, codec, None, threads), 2) / w.size
        q = quantize_rows(raw, info, gt, codec, None, threads)

        def error(codec=codec, q=q) -> float:  # type: ignore[no-untyped-def]
            d = codec.dequantize(q, s.hidden).reshape(w.shape).astype(np.float64) - w
            return float((d * d * importance).sum())

        prior[t] = quant[t] + timed(error, 2) / w.size
        if t == "Q8_0":
            decode = timed(lambda codec=codec, q=q: codec.dequantize(q, s.hidden), 2) / w.size
    return Rates(gemm, gemm_wall, decode, kld_s, quant, prior)


def ray_dispatch_s(n: int = 200) -> tuple[float, float]:
    """(seconds to start one actor, seconds per task round trip) on a local Ray cluster (127.0.0.1)."""
    from ikquant.cluster import open_cluster

    class Echo:
        def ping(self) -> int:
            return 0

    with open_cluster("local:1", 1) as cluster:
        ray = cluster.ray
        t0 = time.perf_counter()
        actor = ray.remote(num_cpus=1)(Echo).remote()
        ray.get(actor.ping.remote())
        start = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n):
            ray.get(actor.ping.remote())
        return start, (time.perf_counter() - t0) / n


def ikrun(*args: str) -> tuple[str, float, float]:
    """(stderr, wall seconds, CPU seconds) of one `ikrun` command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(["nice", "-n", "10", str(BIN / "ikrun"), *args], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "250"})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode:
        sys.exit(f"ikrun {' '.join(args)} failed:\n{res.stderr[-2000:]}")
    return res.stderr, wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def proxy_budgets(model_path: Path) -> list[float]:
    """Two whole-file bits per weight a third and two thirds of the way between the cheapest and the dearest mix
    of TYPES (the other tensors as stored)."""
    from ikquant.mix_constraints import MixConstraints
    from ikquant.types import type_by_name
    from ikrun.model import Model
    from ikrun.sweep.measure import sweep_groups
    from ikrun.sweep.prune import Decision, budget_bits

    model = Model(model_path)
    groups = sweep_groups(model, "tensor", None, 64)
    _, options = Decision(model, groups, [type_by_name(t) for t in TYPES], MixConstraints()).options(lambda g, t: 0)
    least = sum(min(o.bits for o in opts) for opts in options.values())
    most = sum(max(o.bits for o in opts) for opts in options.values())
    n = sum(model.weights.info(x).n_elements for x in model.weights.names())
    zero = budget_bits(model, groups, 0.0)
    return [round((least + f * (most - least) - zero) / n, 3) for f in (1 / 3, 2 / 3)]


def measure(work: Path, ctx: int, chunks: int, threads: int, exhaustive: bool) -> dict:
    """Everything measured on this machine (written to WORK/proxy.json)."""
    hf, gguf = work / "hf", work / "proxy-bf16.gguf"
    if not gguf.exists():
        make_deepseek_fp8_checkpoint(hf, LAYERS, PROXY, fp8=False)
        Converter(hf, "bf16", "deepseek-v3").write(gguf)
    from ikquant.gguf_io import GGUFFile

    for name, t in GGUFFile(gguf).tensors.items():  # the weight formula the extrapolation uses, checked
        if name.endswith(".weight") and len(t.ne) > 1 and "gate_inp" not in name:
            if tensor_weights(PROXY, name) != t.n_elements:
                sys.exit(f"{name}: {t.n_elements} weights, the extrapolation's formula says "
                         f"{tensor_weights(PROXY, name)}")
    common = ["--text", str(CORPUS), "--ctx", str(ctx), "--chunks", str(chunks), "--threads", str(threads)]
    load = os.getloadavg()[0]
    one = work / "one-type.json"
    one.unlink(missing_ok=True)
    _, one_wall, one_cpu = ikrun("sweep", str(gguf), *common, "--types", TYPES[0], "-o", str(one))
    budgets = proxy_budgets(gguf)
    pruned = work / "pruned.json"
    pruned.unlink(missing_ok=True)
    log, pruned_wall, pruned_cpu = ikrun("sweep", str(gguf), *common, "--types", ",".join(TYPES), "--target-bpw",
                                         ",".join(map(str, budgets)), "-o", str(pruned))
    rounds = int(re.search(r"in (\d+) rounds", " ".join(log.split())).group(1))  # type: ignore[union-attr]
    every = None
    if exhaustive:
        out = work / "exhaustive.json"
        out.unlink(missing_ok=True)
        _, wall, cpu = ikrun("sweep", str(gguf), *common, "--types", ",".join(TYPES), "-o", str(out))
        every = {"wall": wall, "cpu": cpu}
    rows = json.loads(one.read_text())["rows"]
    prows = json.loads(pruned.read_text())["rows"]
    rates = measure_rates(threads)
    start, dispatch = ray_dispatch_s()
    return {"ctx": ctx, "chunks": chunks, "threads": threads, "load_before": load, "load_after": os.getloadavg()[0],
            "proxy_mib": gguf.stat().st_size / 2**20,
            "one_type": {"wall": one_wall, "cpu": one_cpu,
                         "rows": [(r["group"], r["seconds"]) for r in rows]},
            "pruned": {"wall": pruned_wall, "cpu": pruned_cpu, "budgets": budgets, "rounds": rounds,
                       "rows": [(r["group"], r["type"], r["measured"], r["seconds"]) for r in prows]},
            "exhaustive": every,
            "rates": rates.__dict__, "ray": {"actor_start": start, "dispatch": dispatch}}


@dataclass(frozen=True)
class Node:
    name: str
    cores: int
    nodes: int = 1


#: assumptions of the extrapolation (printed with it)
DISK_BYTES_S = 2e9  # a node reads the base from local NVMe at 2 GB/s (page-in of the memory map)
NET_BYTES_S = 1.25e9  # 10 GbE between the driver and a node (the base logits sent once)
BASE_BITS = 8.5  # the sweep's base is Q8_0 (713 GB: resident in a node of >= 768 GB RAM)


def extrapolate(m: dict, node: Node, n_ctx: int, n_chunks: int) -> dict:
    """Seconds of DeepSeek-V3's one-type sweep, exhaustive sweep (all TYPES) and the pruned sweep (the proxy's
    measured rows, and its prior over every tensor and type) on `node` at n_chunks chunks of n_ctx tokens."""
    s, r = DEEPSEEK_V3, m["rates"]
    speed = node.cores / m["threads"]
    gemm, decode = r["gemm_flops"] * speed, r["decode_weight_s"] / speed
    fit = fit_proxy(m)
    o_blk, o_cand = fit["block_chunk_s"], fit["candidate_chunk_s"]

    def block_s(layer: int) -> np.ndarray:
        return np.array([n_chunks * block_flops(s, layer, n_ctx) * n_ctx / gemm, block_weights(s, layer) * decode,
                         n_chunks * o_blk, 0.0, 0.0])

    head = np.array([n_chunks * 2 * s.hidden * s.vocab * n_ctx / gemm, s.vocab * s.hidden * decode,
                     n_chunks * o_cand, n_chunks * n_ctx * s.vocab * r["kld_logit_s"] / speed, 0.0])
    after = [np.zeros(len(PARTS)) for _ in range(LAYERS + 1)]  # after[L]: the blocks L..60
    for layer in range(LAYERS - 1, -1, -1):
        after[layer] = after[layer + 1] + block_s(layer)

    def candidate_parts(tensor: str, qtype: str) -> np.ndarray:
        quant = tensor_weights(s, tensor) * r["quantize_weight_s"][qtype] / speed
        return after[first_block(tensor)] + head + np.array([0.0, 0.0, 0.0, 0.0, quant])

    def candidate(tensor: str, qtype: str) -> float:
        return float(candidate_parts(tensor, qtype).sum())

    groups = [g for g, _ in m["one_type"]["rows"]]
    one = sum(candidate(g, TYPES[0]) for g in groups)
    every = sum(candidate(g, t) for g in groups for t in TYPES)
    measured = [(g, t) for g, t, ok, _ in m["pruned"]["rows"] if ok]
    # the prior quantizes, decodes the base (Q8_0) and the quantized copy, and sums the weighted squared error
    prior = sum(tensor_weights(s, g) * (r["prior_weight_s"][t] + r["decode_weight_s"]) / speed
                for g in groups for t in TYPES)
    pruned = sum(candidate(g, t) for g, t in measured)
    forward = float((after[0] + head).sum())  # one full forward: the base logits, and again to record block inputs
    setup = 2 * forward
    total_bytes = sum(tensor_weights(s, g) for g in groups) * BASE_BITS / 8
    if node.nodes > 1:  # each node loads the model and records its block inputs once (a round's workers stay up
        # for all its batches); the driver computes the base logits and the prior, and dispatches the tasks one at a
        # time
        per_node = total_bytes / DISK_BYTES_S + forward + n_chunks * n_ctx * s.vocab * 2 / NET_BYTES_S \
            + m["ray"]["actor_start"]
        dispatch = m["ray"]["dispatch"]
        return {"one": forward + per_node + one / node.nodes + len(groups) * dispatch,
                "exhaustive": forward + per_node + every / node.nodes + len(groups) * len(TYPES) * dispatch,
                "pruned": forward + per_node + prior + pruned / node.nodes + len(measured) * dispatch,
                "setup": forward + per_node}
    parts = sum(candidate_parts(g, TYPES[0]) for g in groups)
    return {"one": setup + one, "exhaustive": setup + every, "pruned": setup + prior + pruned, "setup": setup,
            "parts": dict(zip(PARTS, parts / parts.sum()))}


def fit_proxy(m: dict) -> dict:
    """What a candidate costs besides its blocks, per chunk: the output head's candidate (no block after it:
    quantize, swap, head, KLD); and the layer-local forward's cost per block and chunk: the least-squares slope of
    the other candidates' seconds, less that, against the blocks they run."""
    rows = m["one_type"]["rows"]
    head = next(sec for g, sec in rows if g.startswith("output."))
    x = np.array([LAYERS - first_block(g) for g, _ in rows], dtype=np.float64)
    y = np.array([sec for _, sec in rows]) - head
    return {"block_chunk_s": float((x * y).sum() / (x * x).sum()) / m["chunks"],
            "candidate_chunk_s": head / m["chunks"]}


def hours(sec: float) -> str:
    return f"{sec / 3600:,.1f} h" if sec < 72 * 3600 else f"{sec / 86400:,.1f} d"


def report(m: dict, user_ctx: int, user_chunks: list[int]) -> None:
    rows, fit = m["one_type"]["rows"], fit_proxy(m)
    print(f"## Measured on the proxy ({m['proxy_mib']:.0f} MiB BF16, {m['chunks']} chunks of {m['ctx']}, "
          f"{m['threads']} threads, load {m['load_before']:.1f} -> {m['load_after']:.1f})\n")
    print("| tensor class | groups | s per candidate at Q4_0 (mean) | sum |\n|---|---|---|---|")
    for c in CLASSES:
        secs = [sec for g, sec in rows if class_of(g) == c]
        if secs:
            print(f"| {c} | {len(secs)} | {np.mean(secs):.3f} | {sum(secs):.1f} |")
    p = m["pruned"]
    n_meas = sum(1 for row in p["rows"] if row[2])
    print(f"\none-type sweep: {len(rows)} candidates, {m['one_type']['wall']:.0f} s wall, "
          f"{m['one_type']['cpu']:.0f} s CPU; layer-local forward {1e3 * fit['block_chunk_s']:.2f} ms per block per "
          f"chunk, {1e3 * fit['candidate_chunk_s']:.1f} ms per candidate per chunk besides\n"
          f"pruned sweep ({','.join(TYPES)}, --target-bpw {','.join(map(str, p['budgets']))}): measured "
          f"{n_meas} of {len(p['rows'])} rows in {p['rounds']} rounds, {p['wall']:.0f} s wall, {p['cpu']:.0f} s CPU"
          + (f"; exhaustive sweep: {len(p['rows'])} rows, {m['exhaustive']['wall']:.0f} s wall, "
             f"{m['exhaustive']['cpu']:.0f} s CPU" if m.get("exhaustive") else ""))
    r = m["rates"]
    print(f"rates here (at DeepSeek-V3's shapes): f32 GEMM {r['gemm_flops'] / 1e9:.1f} GFLOP/s per "
          f"{m['threads']} CPU-seconds (256 x 7168 by 7168 x 2048; {r['gemm_flops_wall'] / 1e9:.1f} per wall second "
          "here, loaded), Q8_0 decode "
          f"{1e9 * r['decode_weight_s']:.2f} ns/weight, KLD {1e9 * r['kld_logit_s']:.2f} ns/logit, quantize "
          + ", ".join(f"{t} {1e9 * v:.0f}" for t, v in r["quantize_weight_s"].items()) + " ns/weight, prior "
          + ", ".join(f"{t} {1e9 * v:.0f}" for t, v in r["prior_weight_s"].items()) + " ns/weight; Ray: actor "
          f"start {m['ray']['actor_start']:.2f} s, task round trip {1e3 * m['ray']['dispatch']:.2f} ms\n")
    weights = sum(tensor_weights(DEEPSEEK_V3, g) for g, _ in rows)
    print(f"## Extrapolated to DeepSeek-V3 ({weights / 1e9:.0f}B swept weights, {len(rows)} groups, "
          f"{len(TYPES)} types, chunks of {user_ctx})\n")
    print("| chunks | node | setup | one type | exhaustive | pruned |\n|---|---|---|---|---|---|")
    nodes = [Node(f"this machine ({m['threads']} cores)", m["threads"]), Node("64-core node", 64),
             Node("8 x 64-core Ray nodes", 64, 8)]
    for n in user_chunks:
        for node in nodes:
            e = extrapolate(m, node, user_ctx, n)
            print(f"| {n} | {node.name} | {hours(e['setup'])} | {hours(e['one'])} | {hours(e['exhaustive'])} | "
                  f"{hours(e['pruned'])} |")
    for node in nodes[:2]:
        e = extrapolate(m, node, user_ctx, user_chunks[0])
        print(f"\none-type sweep on {node.name} at {user_chunks[0]} chunks, by part: "
              + ", ".join(f"{k} {100 * v:.0f}%" for k, v in e["parts"].items()))
    print("\n".join([
        "", "Assumptions: the sweep's base is Q8_0 (713 GB, resident: a node of >= 768 GB RAM) and is decoded once per "
        "candidate per block (all chunks in one pass, every expert receives tokens); the FLOPs of a block per token "
        "are its projections, MLA with absorbed k_b/v_b over (ctx+1)/2 keys, the router and 8+1 experts (or the "
        "dense FFN), the head's 2 x 7168 x 129280; the GEMM rate is numpy's f32 BLAS per CPU second (the cores as if "
        "unshared); GEMM, decode, quantization, prior and KLD rates scale linearly with "
        "cores (no memory-bandwidth ceiling: optimistic for 64 cores); the proxy's per-block and per-candidate "
        "overheads (the interpreter's, width-independent) are added unscaled; setup is the base logits and the "
        "recorded block inputs (two full forwards). Ray: one worker of 64 threads per node; each node pages the base "
        f"in from local disk at {DISK_BYTES_S / 1e9:g} GB/s, receives the base logits (2 bytes a logit) at "
        f"{NET_BYTES_S / 1e9:g} GB/s, starts its actor (measured here) and records its block inputs, in parallel; "
        "the driver computes the base logits and the pruned sweep's prior (not distributed) and dispatches each task "
        "(measured round trip here); the candidates are spread evenly (the last round's tail and stragglers "
        "ignored).", ""]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=64, help="The proxy sweep's chunk length.")
    ap.add_argument("--chunks", type=int, default=2, help="The proxy sweep's chunks.")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--user-ctx", type=int, default=512, help="DeepSeek-V3's sweep: chunk length.")
    ap.add_argument("--user-chunks", default="32,250", help="DeepSeek-V3's sweep: chunk counts (comma-separated).")
    ap.add_argument("--exhaustive", action="store_true", help="Also time the exhaustive sweep of the four types.")
    ap.add_argument("--reuse", action="store_true", help="Print from WORKDIR/proxy.json without measuring again.")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    saved = a.workdir / "proxy.json"
    if not a.reuse:
        saved.write_text(json.dumps(measure(a.workdir, a.ctx, a.chunks, a.threads, a.exhaustive), indent=1))
    report(json.loads(saved.read_text()), a.user_ctx, [int(n) for n in a.user_chunks.split(",")])


if __name__ == "__main__":
    main()
