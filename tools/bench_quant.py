#!/usr/bin/env python3
"""Quantize and dequantize throughput per type (M weights/s), one thread and all cores, against ik's own quantizer.

Input: 64 rows x 4096 gaussian floats with an importance vector (none with --plain), the shape ik's own per-type
throughput figures use.
ik's quantize is timed in the same run: its libggml.so (a native build's, `--ik-lib`, or by default the one in the
`ik_llama_cpp` wheel) is loaded through ctypes and ggml_quantize_chunk called on the same rows and importance vector.
Both sides are timed in thread CPU time, one thread, so that other processes on a loaded machine do not count; the
ratio and whether the bytes agree are printed per type. ik's dequantize figures are the ones recorded below. Baseline
for dequantize: PyPI gguf's numpy implementation where it has one.

Example: python tools/bench_quant.py --type Q4_K --type IQ4_KS --ik-lib ~/ik/build/ggml/src/libggml.so
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np

from ikquant import implemented_types, type_by_name
from ikquant.types import GGMLType

# ik_llama.cpp, single thread, 64 x 4096 (M weights/s), dequantize (to_float; interleaved types' called per group of rows)
IK_DEQUANTIZE = {
    "Q4_0": 2447, "Q4_1": 2148, "Q5_0": 4896, "Q5_1": 4937, "Q6_0": 1201, "Q8_0": 13010, "Q2_K": 1886, "Q3_K": 1550,
    "Q4_K": 10725, "Q5_K": 9186, "Q6_K": 1118, "IQ4_NL": 1664, "IQ4_XS": 1807, "MXFP4": 1932, "IQ2_KS": 1566,
    "IQ2_K": 1794, "IQ2_KL": 1532, "IQ3_KS": 983, "IQ3_K": 1082, "IQ4_KSS": 1180, "IQ4_KS": 2312, "IQ4_K": 2077,
    "IQ5_KS": 1161, "IQ5_K": 1132, "IQ6_K": 3192, "IQ1_KT": 617, "IQ2_KT": 838, "IQ3_KT": 215, "IQ4_KT": 561,
    "IQ2_XXS": 299, "IQ2_XS": 313, "IQ2_S": 288, "IQ1_S": 3594, "IQ1_M": 2839, "IQ1_BN": 1835, "IQ2_BN": 10396,
    "Q5_0_R4": 1689, "Q6_0_R4": 1300, "Q2_K_R4": 3115, "Q3_K_R4": 1727, "Q5_K_R4": 2100, "IQ2_XXS_R4": 341,
    "IQ2_XS_R4": 292, "IQ2_S_R4": 302, "IQ3_XXS_R4": 333, "IQ3_S_R4": 246, "IQ1_S_R4": 2287, "IQ1_M_R4": 2239,
    "IQ2_BN_R4": 2877, "Q8_K_R8": 3608, "Q8_K_R16": 2069, "Q8_KV_R8": 3076, "IQ3_K_R4": 1606, "IQ5_K_R4": 1538,
    "IQ5_KS_R4": 1694, "Q6_K_R4": 1957, "IQ4_XS_R8": 2794, "IQ4_NL_R4": 3042, "Q4_0_R8": 2827, "Q8_KV": 23583,
    "Q1_0_G128": 4986, "IQ3_XXS": 305, "IQ3_S": 303, "IQ4_K_R4": 2517, "IQ2_K_R4": 2619, "Q4_K_R4": 3185,
    "IQ4_KS_R4": 2913, "Q8_0_R8": 3222,
}


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _UserData(ctypes.Structure):
    """ik's quantize_user_data: llama-quantize's defaults (without it ik's IQ2_KS takes its older, slower search on
    AVX2 builds, where ikquant takes llama-quantize's default)."""

    _fields_ = [("symmetric_q4_0", ctypes.c_bool), ("slow_iq2_ks", ctypes.c_bool)]


class IkQuantizer:
    """ik's ggml_quantize_chunk from its libggml.so, called on whole arrays of rows with llama-quantize's options."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        # ggml_init's first call fills the fp16 -> fp32 table the k-quants read their stored scales back through;
        # unfilled, every stored scale reads as 0 and ik's last code pass skips its sub-blocks
        self.lib.ggml_init.restype = ctypes.c_void_p
        self.lib.ggml_init.argtypes = [_InitParams]
        self.lib.ggml_free.argtypes = [ctypes.c_void_p]
        self.lib.ggml_free(self.lib.ggml_init(_InitParams(1 << 16, None, True)))
        self.lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        self.user_data = _UserData(False, False)

    def quantize(self, t: GGMLType, x: np.ndarray, w: np.ndarray | None, out: np.ndarray) -> None:
        """Rows x into out (ik's bytes of type t), importance-weighted by w (None: without an importance vector)."""
        self.lib.ggml_quantize_chunk(t.id, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1],
                                     None if w is None else w.ctypes.data, ctypes.byref(self.user_data))


def default_ik_lib() -> Path | None:
    """The libggml.so of the ik_llama_cpp wheel, when it is installed."""
    spec = importlib.util.find_spec("ik_llama_cpp")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "lib" / "libggml.so"


def rate(fn: Callable[[], object], n_weights: int, clock: Callable[[], float] = time.thread_time,
         min_seconds: float = 0.3) -> float:
    """Best-of-several M weights/s of fn(), by default in this thread's CPU time (other processes' load does not
    count); several threads are timed by the wall clock."""
    fn()
    best = float("inf")
    t_end = time.perf_counter() + min_seconds
    runs = 0
    while runs < 3 or time.perf_counter() < t_end:
        t0 = clock()
        fn()
        best = min(best, max(clock() - t0, 1e-9))
        runs += 1
    return n_weights / best / 1e6


def gguf_dequantize(name: str, q: np.ndarray, n_weights: int) -> float | None:
    """PyPI gguf's numpy dequantize throughput, where it has one."""
    import gguf

    qt = getattr(gguf.GGMLQuantizationType, name, None)
    if qt is None:
        return None
    try:
        return rate(lambda: gguf.quants.dequantize(q, qt), n_weights)
    except (NotImplementedError, KeyError):
        return None


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def ratio(ours: float, theirs: float | None) -> str:
    return "-" if theirs is None else f"{ours / theirs:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--type", dest="types", action="append")
    ap.add_argument("--ik-lib", type=Path, default=default_ik_lib(),
                    help="ik's libggml.so (default: the ik_llama_cpp wheel's)")
    ap.add_argument("--plain", action="store_true",
                    help="quantize without the importance vector (the reference paths of files made without an "
                         "imatrix: Q4_K_M, Q5_K_M ...); types that require one are skipped")
    a = ap.parse_args()
    if a.ik_lib is None or not a.ik_lib.is_file():
        print(f"bench_quant: ik's libggml.so not found ({a.ik_lib or 'no ik_llama_cpp wheel'}); name it with --ik-lib",
              file=sys.stderr)
        sys.exit(2)
    ik = IkQuantizer(a.ik_lib)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4096)).astype(np.float32)
    w: np.ndarray | None = (np.mean(rng.standard_normal((64, 4096)) ** 2, axis=0)
                            * rng.lognormal(0, 1, 4096)).astype(np.float32)
    types = [type_by_name(t) for t in a.types] if a.types else [t for t in implemented_types()
                                                                 if t.name in IK_DEQUANTIZE]
    if a.plain:
        skipped = [t.name for t in types if t.require_codec().requires_imatrix]
        types = [t for t in types if t.name not in skipped]
        if skipped:
            print(f"--plain: skipped {', '.join(skipped)} (ik refuses them without an imatrix)")
        w = None
    all_threads = numba.config.NUMBA_NUM_THREADS
    print(f"ik: {a.ik_lib}; thread CPU time, one thread unless said; "
          f"{'no importance vector' if w is None else 'importance-weighted'}")
    print(f"{'type':10s} | {'quantize M/s: ours':>18s} {f'{all_threads} thr':>7s} {'ik':>6s} {'ours/ik':>7s} "
          f"{'bytes':>5s} | {'dequantize M/s: ours':>20s} {f'{all_threads} thr':>7s} {'ik':>6s} {'ours/ik':>7s} "
          f"{'gguf':>6s}")
    for t in types:
        codec = t.require_codec()
        q = codec.quantize(x, w)
        q_ik = np.zeros_like(q)
        ik.lib.ggml_quantize_init(t.id)
        ik_quant = rate(lambda: ik.quantize(t, x, w, q_ik), x.size)
        numba.set_num_threads(1)
        ours = (rate(lambda: codec.quantize(x, w), x.size), rate(lambda: codec.dequantize(q, 4096), x.size))
        numba.set_num_threads(all_threads)
        ours_all = (rate(lambda: codec.quantize(x, w), x.size, time.perf_counter),
                    rate(lambda: codec.dequantize(q, 4096), x.size, time.perf_counter))
        same = "same" if np.array_equal(q, q_ik) else "DIFF"
        ik_deq = IK_DEQUANTIZE.get(t.name)
        print(f"{t.name:10s} | {fmt(ours[0]):>18s} {fmt(ours_all[0]):>7s} {fmt(ik_quant):>6s} "
              f"{ratio(ours[0], ik_quant):>7s} {same:>5s} | {fmt(ours[1]):>20s} {fmt(ours_all[1]):>7s} "
              f"{fmt(ik_deq):>6s} {ratio(ours[1], ik_deq):>7s} {fmt(gguf_dequantize(t.name, q, x.size)):>6s}",
              flush=True)


if __name__ == "__main__":
    main()
