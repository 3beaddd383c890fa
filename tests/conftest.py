"""Shared fixtures: golden data paths and tiny checkpoints generated once per session."""

from __future__ import annotations

import os
from pathlib import Path

# the CLIs' rich consoles take their width from COLUMNS once, when ikquant.cli_common is first imported: set before
# any test imports it, so that every test process (pytest-xdist runs several) reads tables and paths unwrapped
os.environ["COLUMNS"] = "200"

import pytest

from ikconvert.tiny import TinySpec, make_tiny_checkpoint

DATA = Path(__file__).parent / "data"
PRE = {"qwen3": "qwen2", "llama": "llama-bpe"}


@pytest.fixture(autouse=True)
def _own_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs in a folder of its own, so a command's default output (`ikrun logits` writes logits.npy,
    `ikrun imatrix` imatrix.dat) never lands in the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def tiny_hf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint per architecture (the llama one sharded, with an index)."""
    arch = request.param
    spec = TinySpec(arch=arch, shards=2 if arch == "llama" else 1, seed=1 if arch == "llama" else 0)
    return make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), spec)


@pytest.fixture(scope="session")
def tiny_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint in three shards with model.safetensors.index.json."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-sharded"), TinySpec(arch="llama", shards=3, seed=2))


@pytest.fixture(scope="session")
def tiny_f32(tiny_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint converted to an F32 GGUF."""
    from ikconvert.convert import Converter

    arch = "llama" if "llama" in tiny_hf.name else "qwen3"
    out = tmp_path_factory.mktemp("gguf") / f"tiny-{arch}-f32.gguf"
    return Converter(tiny_hf, "f32", pre_tokenizer=PRE[arch]).write(out)
