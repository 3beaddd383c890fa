"""ik_llama.cpp itself, as PyPI's `ik-llama-cpp-python` wheel ships it (the `test` extra installs it): its
`llama-quantize` binary, and its libllama loaded through ctypes to read a file's logits. A build from before
openPangu and DeepSeek-V4, with generic x86-64 (AVX2) kernels; IK_LLAMA_CPP_LIB_PATH points the library at another
build."""

from __future__ import annotations

import subprocess
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
    """Run ik's llama-quantize from the wheel with `args`."""
    pkg = _package()
    return subprocess.run([str(pkg / "bin" / "llama-quantize"), *args], capture_output=True, text=True,
                          env={"LD_LIBRARY_PATH": str(pkg / "lib")})


def logits(path: Path, tokens: list[int]) -> np.ndarray:
    """ik's logits [len(tokens), n_vocab] of one sequence decoded as one batch (flash attention off)."""
    _package()
    from ik_llama_cpp import _ctypes_api as api
    from ik_llama_cpp._internals import IkContext, IkModel

    model = IkModel(str(path), use_mmap=True)
    ctx = IkContext(model, n_ctx=len(tokens), n_threads=2, flash_attn=False)
    batch = api.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
            batch.seq_id[i][0] = 0
        assert ctx.decode(batch) == 0, f"ik could not decode {path}"
        n_vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(model.model))
        return np.array([np.ctypeslib.as_array(ctx.get_logits(i), shape=(n_vocab,)) for i in range(len(tokens))])
    finally:
        api.llama_batch_free(batch)
        ctx.close()
        model.close()
