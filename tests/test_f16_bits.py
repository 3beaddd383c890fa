"""The kernels' fp16 conversions (one F16C instruction each) against numpy's IEEE conversions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from numba import njit

from ikquant import type_by_name
from ikquant.formats.numeric import f16_bits_to_f32, f32_bits, f32_to_f16_bits


@njit(cache=True)
def _narrow(x: np.ndarray, out: np.ndarray) -> None:
    for i in range(x.size):
        out[i] = f32_to_f16_bits(x[i])


@njit(cache=True)
def _widen(h: np.ndarray, out: np.ndarray) -> None:
    for i in range(h.size):
        out[i] = f32_bits(f16_bits_to_f32(h[i]))


def _narrowed(x: np.ndarray) -> np.ndarray:
    out = np.empty(x.size, np.uint16)
    _narrow(x, out)
    return out


def _numpy_f16(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # beyond the largest f16 is infinity, as intended
        return x.astype(np.float16).view(np.uint16)


def test_every_float_near_an_f16_rounds_to_nearest_even() -> None:
    # every f16 value, the float32 neighbours of every midpoint between two f16 values (the ties themselves
    # included), both signs, from the subnormals to beyond the largest f16 (which round to infinity)
    h = np.arange(0x7C00, dtype=np.uint16)
    lo = h.view(np.float16).astype(np.float64)
    hi = np.append(lo[1:], 65520.0)
    mid = ((lo + hi) / 2).astype(np.float32)
    ties = np.concatenate([mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf)),
                           lo.astype(np.float32), np.float32([65504, 65519.99, 65520, 1e5, 3e38, np.inf, 2.0**-25,
                                                               2.0**-26, 1e-30])])
    x = np.concatenate([ties, -ties]).astype(np.float32)
    np.testing.assert_array_equal(_narrowed(x), _numpy_f16(x))


def test_random_floats_and_nans() -> None:
    bits = np.random.default_rng(0).integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    got = _narrowed(x)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(got[finite], _numpy_f16(x[finite]))
    # a NaN stays a NaN of its sign, made quiet, with the top of its payload
    nan = bits[~finite]
    expect = ((nan >> 16) & 0x8000) | 0x7E00 | ((nan & 0x7FFFFF) >> 13)
    np.testing.assert_array_equal(got[~finite], expect.astype(np.uint16))


def test_every_f16_widens_exactly() -> None:
    h = np.arange(2**16, dtype=np.uint16)
    got = np.empty(h.size, np.uint32)
    _widen(h, got)
    nan = np.isnan(h.view(np.float16))
    np.testing.assert_array_equal(got[~nan], h[~nan].view(np.float16).astype(np.float32).view(np.uint32))
    hn = h[nan].astype(np.uint32)
    expect = ((hn & 0x8000) << 16) | 0x7FC00000 | ((hn & 0x3FF) << 13)
    np.testing.assert_array_equal(got[nan], expect)


def test_a_cpu_without_f16c_converts_alike(tmp_path: Path) -> None:
    """NUMBA_CPU_NAME=generic (no F16C: LLVM calls the runtime's conversion functions, which the JIT must be given):
    the conversions pass the tests above and Q4_K's blocks (f16 scales) come out as on this host."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((8, 512)) * rng.lognormal(0, 2, (8, 1))).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    host = type_by_name("Q4_K").require_codec().quantize(x, None)
    program = ("import numpy as np, sys\n"
               "from ikquant import type_by_name\n"
               "from tests import test_f16_bits as t\n"
               "t.test_every_float_near_an_f16_rounds_to_nearest_even()\n"
               "t.test_random_floats_and_nans()\n"
               "t.test_every_f16_widens_exactly()\n"
               f"x = np.load({str(tmp_path / 'x.npy')!r})\n"
               f"np.save({str(tmp_path / 'q.npy')!r}, type_by_name('Q4_K').require_codec().quantize(x, None))\n")
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    subprocess.run([sys.executable, "-c", program], env=env, check=True, cwd=Path(__file__).resolve().parent.parent)
    np.testing.assert_array_equal(np.load(tmp_path / "q.npy"), host)
