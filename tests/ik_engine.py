"""ik_llama.cpp itself, as PyPI's `ik-llama-cpp-python` wheel ships it (the `test` extra installs it): its
`llama-quantize` binary, and its libllama loaded through ctypes (the wheel's own bindings) to read a file's logits.
The wheel's ik is a build from before openPangu and DeepSeek-V4, with generic x86-64 kernels. Another build:
IK_LLAMA_CPP_LIB_PATH names its libllama.so (its C structs must match the wheel's bindings), IK_LLAMA_QUANTIZE its
llama-quantize."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest


def _package() -> Path:
    try:
        import ik_llama_cpp
    except (ImportError, OSError) as exc:  # another platform: the wheel is manylinux x86-64 only
        pytest.skip(f"ik-llama-cpp-python does not load here ({exc})")
    return Path(ik_llama_cpp.__file__).parent


def llama_quantize(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ik's llama-quantize (the wheel's, or IK_LLAMA_QUANTIZE's) with `args`."""
    pkg = _package()
    exe = os.environ.get("IK_LLAMA_QUANTIZE", str(pkg / "bin" / "llama-quantize"))
    return subprocess.run([exe, *args], capture_output=True, text=True, errors="replace",
                          env={"LD_LIBRARY_PATH": str(pkg / "lib")})


def logits(path: Path, tokens: list[int], threads: int = 2, type_k: int = 1, flash_attn: bool = False) -> np.ndarray:
    """ik's logits [len(tokens), n_vocab] of one sequence decoded as one batch (an f16 V cache and a K cache of ggml
    type id `type_k`, f16 by default; flash attention off unless `flash_attn`, ik's default), computed in a child
    process: ik aborts the process on what it cannot compute."""
    _package()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        res = subprocess.run([sys.executable, __file__, str(path), str(out), str(threads), str(type_k),
                              str(int(flash_attn)),
                              *map(str, tokens)],
                             capture_output=True, text=True, errors="replace")
        if res.returncode != 0:
            said = [line for line in res.stderr.splitlines() if "GGML_ASSERT" in line or "error" in line.lower()]
            raise IkFailed(f"ik could not run {path} (exit {res.returncode}): {' | '.join(said[:2])}")
        return np.load(out)


def tokenize(path: Path, texts: list[str], parse_special: bool = False) -> list[list[int]]:
    """ik's llama_tokenize of each text with the file's vocabulary (no BOS added), in a child process."""
    _package()
    script = ("import json, sys\nfrom ik_llama_cpp._internals import IkModel\nm = IkModel(sys.argv[1])\n"
              "texts, special = json.loads(sys.stdin.read()), sys.argv[2] == '1'\n"
              "print(json.dumps([m.tokenize(t, add_bos=False, special=special) for t in texts]))")
    res = subprocess.run([sys.executable, "-c", script, str(path), "1" if parse_special else "0"],
                         input=json.dumps(texts), capture_output=True, text=True, errors="replace")
    if res.returncode != 0:
        raise IkFailed(f"ik could not tokenize with {path} (exit {res.returncode}): {res.stderr[-300:]}")
    ids: list[list[int]] = json.loads(res.stdout.strip().splitlines()[-1])
    return ids


class IkFailed(AssertionError):
    """ik refused or aborted on a file."""


def _child(path: str, out: str, threads: int, type_k: int, flash_attn: bool, tokens: list[int]) -> None:
    from ik_llama_cpp import _ctypes_api as api
    from ik_llama_cpp._internals import IkContext, IkModel

    model = IkModel(path, use_mmap=True)
    default_params = api.llama_context_default_params

    def with_k_cache():  # type: ignore[no-untyped-def]
        params = default_params()
        params.type_k = type_k
        return params

    api.llama_context_default_params = with_k_cache  # IkContext takes the wheel's defaults; the K cache type is ours
    ctx = IkContext(model, n_ctx=len(tokens), n_threads=threads, flash_attn=flash_attn)
    batch = api.llama_batch_init(len(tokens), 0, 1)
    batch.n_tokens = len(tokens)
    for i, token in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
        batch.seq_id[i][0] = 0
    if ctx.decode(batch) != 0:
        raise SystemExit(f"llama_decode failed on {path}")
    n_vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(model.model))
    np.save(out, np.array([np.ctypeslib.as_array(ctx.get_logits(i), shape=(n_vocab,)) for i in range(len(tokens))]))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1",
           [int(t) for t in sys.argv[6:]])
