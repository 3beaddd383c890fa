#!/usr/bin/env python3
"""Quantize and dequantize throughput per type (M weights/s), one thread and all cores.

Input: 64 rows x 4096 gaussian floats with an importance vector, the shape ik's own per-type throughput figures use. Baseline in the
same run: PyPI gguf's numpy implementation where it has one. ik's own single-thread figures (measured with
importance weights on this machine type, from the issues) are printed beside ours.

Example: python tools/bench_quant.py --type Q4_K --type IQ4_KS
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from ikquant import implemented_types, type_by_name

# ik_llama.cpp, single thread, with importance weights, 64 x 4096 (M weights/s): (quantize, dequantize)
IK = {
    "Q4_0": (20.1, 2447), "Q4_1": (10.7, 2148), "Q5_0": (20.1, 4896), "Q5_1": (12.3, 4937), "Q6_0": (20.2, 1201),
    "Q8_0": (249, 13010), "Q2_K": (10.6, 1886), "Q3_K": (15.6, 1550), "Q4_K": (12.1, 10725), "Q5_K": (11.9, 9186),
    "Q6_K": (17.5, 1118), "IQ4_NL": (7.2, 1664), "IQ4_XS": (7.5, 1807), "MXFP4": (278, 1932),
    "IQ2_KS": (15.8, 1566), "IQ2_K": (3.4, 1794), "IQ2_KL": (4.1, 1532), "IQ3_KS": (4.6, 983), "IQ3_K": (6.4, 1082),
    "IQ4_KSS": (1.8, 1180), "IQ4_KS": (4.1, 2312), "IQ4_K": (4.3, 2077), "IQ5_KS": (3.6, 1161), "IQ5_K": (3.6, 1132),
    "IQ6_K": (2.4, 3192), "IQ1_KT": (1.8, 617), "IQ2_KT": (1.4, 838), "IQ3_KT": (0.54, 215), "IQ4_KT": (0.56, 561),
    # measured later with the same input shape (ik's ggml_quantize_chunk and to_float, one thread; interleaved types'
    # to_float called per group of rows), for the types added since
    "IQ2_XXS": (4.52, 299), "IQ2_XS": (2.61, 313), "IQ2_S": (6.2, 288), "IQ1_S": (8.12, 3594),
    "IQ1_M": (6.87, 2839), "IQ1_BN": (644, 1835), "IQ2_BN": (530, 10396), "Q5_0_R4": (25.5, 1689),
    "Q6_0_R4": (25.5, 1300), "Q2_K_R4": (13, 3115), "Q3_K_R4": (17, 1727), "Q5_K_R4": (14.2, 2100),
    "IQ2_XXS_R4": (4.56, 341), "IQ2_XS_R4": (2.6, 292), "IQ2_S_R4": (6.36, 302), "IQ3_XXS_R4": (3.13, 333),
    "IQ3_S_R4": (4.35, 246), "IQ1_S_R4": (7.4, 2287), "IQ1_M_R4": (6.6, 2239), "IQ2_BN_R4": (609, 2877),
    "Q8_K_R8": (4460, 3608), "Q8_K_R16": (3828, 2069), "Q8_KV_R8": (6850, 3076), "IQ3_K_R4": (7.24, 1606),
    "IQ5_K_R4": (3.92, 1538), "IQ5_KS_R4": (3.88, 1694), "Q6_K_R4": (19.1, 1957), "IQ4_XS_R8": (7.91, 2794),
    "IQ4_NL_R4": (8.41, 3042), "Q4_0_R8": (25.5, 2827), "Q8_KV": (7915, 23583), "Q1_0_G128": (205, 4986),
    "IQ3_XXS": (3.07, 305), "IQ3_S": (4.58, 303), "IQ4_K_R4": (4.91, 2517), "IQ2_K_R4": (3.65, 2619),
    "Q4_K_R4": (14.1, 3185), "IQ4_KS_R4": (4.64, 2913), "Q8_0_R8": (329, 3222),
}


def rate(fn, n_weights: int, min_seconds: float = 0.3) -> float:  # type: ignore[no-untyped-def]
    """Best-of-several M weights/s of fn()."""
    fn()
    best = float("inf")
    t_end = time.perf_counter() + min_seconds
    runs = 0
    while runs < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return n_weights / best / 1e6


def gguf_baseline(name: str, x: np.ndarray, q: np.ndarray) -> tuple[float | None, float | None]:
    import gguf

    qt = getattr(gguf.GGMLQuantizationType, name, None)
    if qt is None:
        return None, None
    quant = deq = None
    try:
        gguf.quants.quantize(x[:1], qt)
        quant = rate(lambda: gguf.quants.quantize(x, qt), x.size)
    except (NotImplementedError, gguf.QuantError, KeyError):
        pass
    try:
        deq = rate(lambda: gguf.quants.dequantize(q, qt), x.size)
    except (NotImplementedError, KeyError):
        pass
    return quant, deq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--type", dest="types", action="append")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4096)).astype(np.float32)
    w = (np.mean(rng.standard_normal((64, 4096)) ** 2, axis=0) * rng.lognormal(0, 1, 4096)).astype(np.float32)
    types = [type_by_name(t) for t in a.types] if a.types else [t for t in implemented_types() if t.name in IK]
    all_threads = numba.config.NUMBA_NUM_THREADS
    print(f"{'type':8s} | {'quantize M/s: 1 thr':>19s} {f'{all_threads} thr':>7s} {'ik':>6s} {'ours/ik':>7s} "
          f"{'gguf*':>6s} | {'dequantize M/s: 1 thr':>21s} {f'{all_threads} thr':>7s} {'ik':>6s} {'ours/ik':>7s} "
          f"{'gguf':>6s}")
    print("(gguf*: PyPI gguf's numpy quantizer, which takes no importance weights)")
    for t in types:
        codec = t.require_codec()
        q = codec.quantize(x, w)
        res = {}
        for n in (1, all_threads):
            numba.set_num_threads(n)
            res[n] = (rate(lambda: codec.quantize(x, w), x.size), rate(lambda: codec.dequantize(q, 4096), x.size))
        numba.set_num_threads(all_threads)
        gq, gd = gguf_baseline(t.name, x, q)
        iq, idq = IK.get(t.name, (None, None))  # no ik figure recorded for this type: no ratio

        def fmt(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}" if v < 100 else f"{v:.0f}"

        def ratio(ours: float, theirs: float | None) -> str:
            return "-" if theirs is None else f"{ours / theirs:.2f}"

        print(f"{t.name:8s} | {fmt(res[1][0]):>19s} {fmt(res[all_threads][0]):>7s} {fmt(iq):>6s} "
              f"{ratio(res[1][0], iq):>7s} {fmt(gq):>6s} | {fmt(res[1][1]):>21s} {fmt(res[all_threads][1]):>7s} "
              f"{fmt(idq):>6s} {ratio(res[1][1], idq):>7s} {fmt(gd):>6s}", flush=True)


if __name__ == "__main__":
    main()
