#!/usr/bin/env python3
"""Run tests/iqk_fa_cases.py's inputs through ik's flash attention (ggml_flash_attn_ext of a native ik build, which
takes its own iqk kernel or ggml's generic one by head size; tools/iqk_fa_oracle.c) and store the results for
tests/test_ik_flash_attention.py.

Example: python tools/iqk_fa_oracle.py /work/ik-src tests/data/flash-attention/iqk-avx2/outputs.npz
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from tests.iqk_fa_cases import CASES, GENERIC_CASES, case_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ik_src", type=Path, help="ik_llama.cpp source tree with its build in build/")
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    lib = a.ik_src / "build" / "ggml" / "src"
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        exe, data, result = Path(tmp) / "fa", Path(tmp) / "in.bin", Path(tmp) / "out.bin"
        subprocess.run(["gcc", "-O2", "-o", str(exe), str(Path(__file__).with_suffix(".c")),
                        f"-I{a.ik_src / 'ggml' / 'include'}", f"-L{lib}", "-lggml", "-lm", f"-Wl,-rpath,{lib}"],
                       check=True)
        for case in CASES + GENERIC_CASES:
            q, k, v, scale = case_inputs(case)
            with data.open("wb") as f:
                np.array(case[:7], np.int32).tofile(f)
                np.array([scale], np.float32).tofile(f)
                for x in (q, k, v):
                    x.tofile(f)
            subprocess.run([str(exe), str(data), str(result)], check=True)
            out = np.fromfile(result, np.float32).reshape(case.n_q, case.n_head, case.dv)
            outputs[case.name] = out.transpose(1, 0, 2)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(a.out, **outputs)


if __name__ == "__main__":
    main()
