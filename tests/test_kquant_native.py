"""ik's own Q4_K, Q5_K and Q6_K kernels (ikrun/numerics/ik/kquant_native.py) against ik's AVX2 build
(tests/data/kquant-native-avx2) and its AVX-512 build (tests/data/kquant-native; one kernel, which both builds'
ggml_mul_mat show): bit for bit below the rows ik converts from (where the float path they replace is not), and
runs that take them under --numerics ik-avx2 and --numerics ik: a Qwen3-MoE whose experts get fewer tokens than ik
converts those types from, pure and as ik's Q4_K_M recipe (Q4_K up/gate beside Q6_K down: from 32 routed tokens to
63 ik converts the one and not the other), and a dense model whose every matrix takes Q6_K's own kernel (32-token
micro-batches): ik's base-logits files byte for byte and its final lines. Those files hold 16-bit
log-probabilities, coarser than the kernels' differences from the float path on these models (the float path
writes them too), so the matmul cases are what tells the kernel from another arithmetic; the runs check that every
kernel ik takes is one each mode runs, end to end."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.convert import Converter
from ikquant import QuantizeOptions, file_type, quantize_model
from ikquant.types import type_by_name
from ikrun.cli import app
from ikrun.numerics.ik.formats import Q8_2_X4, integer_rows, round_activations
from ikrun.numerics.ik.native import native_matmul

DATA = Path(__file__).parent / "data"
#: each build's oracles, by the --numerics mode that models it
ORACLES = {"ik-avx2": DATA / "kquant-native-avx2", "ik": DATA / "kquant-native"}
TEXT = DATA / "logits" / "qwen3-moe" / "text.txt"
#: the MoE files ik ran: file type, --pure, sha256 prefix
MOE_FILES = {"q4_k": ("Q4_K_S", True, "a797537ddc175d0a"), "q5_k": ("Q5_K_S", True, "863847565fd809c2"),
             "q6_k": ("Q6_K", True, "a63b18bdf94ff943"), "q4_k_m": ("Q4_K_M", False, "c7648f8dc0e41348")}
runner = CliRunner()


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tests/moe_native.py's Qwen3-MoE, converted and quantized as ik ran them, checked to be those bytes."""
    from tests.moe_native import make_checkpoint

    tmp = tmp_path_factory.mktemp("kquant-native")
    f32 = Converter(make_checkpoint(tmp / "hf"), "f32", pre_tokenizer="qwen2").write(tmp / "f32.gguf")
    files = {}
    for name, (ftype, pure, digest) in MOE_FILES.items():
        files[name] = tmp / f"{name}.gguf"
        quantize_model(f32, files[name], QuantizeOptions(file_type(ftype), pure=pure))
        assert hashlib.sha256(files[name].read_bytes()).hexdigest().startswith(digest), name
    return files


def _base_logits(gguf: Path, text: Path, ctx: int, chunks: int, batch: int, out: Path, numerics: str) -> str:
    res = runner.invoke(app, ["ppl", str(gguf), "--text", str(text), "-c", str(ctx), "--chunks", str(chunks), "-t",
                              "2", "--numerics", numerics, "--ik-batch", str(batch), "--save-base-logits", str(out)])
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


def _final(numerics: str, key: str) -> str:
    lines = dict(line.split(" ", 1) for line in (ORACLES[numerics] / "ik-final-lines.txt").read_text().splitlines())
    return lines[key].split("=")[-1].split("+/-")[0].strip()


@pytest.mark.parametrize("numerics", sorted(ORACLES))
@pytest.mark.parametrize(("name", "ctx", "chunks"), [("q4_k", 128, 1), ("q5_k", 128, 1), ("q6_k", 128, 1),
                                                     ("q4_k_m", 256, 1), ("q4_k_m", 128, 4)])
def test_experts_in_their_own_kernels_give_iks_logits(moe_files: dict[str, Path], name: str, ctx: int, chunks: int,
                                                       numerics: str, tmp_path: Path) -> None:
    """Most experts get 5-30 tokens of a 128-token chunk (each type's own kernel); at 256 tokens, and with four
    chunks in ik's 512-token micro-batch, the Q4_K_M file's experts of 32-63 tokens take converted Q4_K up/gate and
    Q6_K's own kernel for down (ops/moe.moe_experts, NativeRows)."""
    key = f"{name}-c{ctx}" + (f"x{chunks}" if chunks > 1 else "")
    out = tmp_path / "base.kld"
    printed = _base_logits(moe_files[name], TEXT, ctx, chunks, 2048, out, numerics)
    assert out.read_bytes() == (ORACLES[numerics] / f"ik-{key}.kld").read_bytes()
    assert _final(numerics, key) in printed


@pytest.mark.parametrize("numerics", sorted(ORACLES))
def test_every_dense_matrix_in_q6_ks_own_kernel_gives_iks_logits(numerics: str, tmp_path: Path) -> None:
    """The 4-layer qwen3-plan model as pure Q6_K (made again from ik's Q8_0 file) in 32-token micro-batches: every
    projection and the output take Q6_K's own kernel (ik converts it from 64 rows). Both builds wrote the same
    file (kept once, in the AVX2 build's folder)."""
    gguf = tmp_path / "q6_k.gguf"
    quantize_model(DATA / "convert" / "qwen3-plan-quants" / "ik-q8_0.gguf", gguf,
                   QuantizeOptions(file_type("Q6_K"), pure=True, allow_requantize=True))
    assert hashlib.sha256(gguf.read_bytes()).hexdigest().startswith("8489cb6f96fefb36")
    out = tmp_path / "base.kld"
    printed = _base_logits(gguf, DATA / "logits" / "qwen3-plan" / "text.txt", 32, 8, 32, out, numerics)
    assert out.read_bytes() == (ORACLES["ik-avx2"] / "ik-plan-q6_k-c32.kld").read_bytes()
    assert _final("ik-avx2", "plan-q6_k-c32") in printed


@pytest.fixture(scope="module")
def cases() -> dict[str, np.ndarray]:
    """The AVX2 build's cases (weights, activations, outputs) and the AVX-512 build's outputs of the same, under
    "avx512/"."""
    with np.load(ORACLES["ik-avx2"] / "cases.npz") as f, np.load(ORACLES["ik"] / "outputs.npz") as g:
        return {**{k: f[k] for k in f.files}, **{f"avx512/{k}": g[k] for k in g.files}}


@pytest.mark.parametrize("avx2", [True, False])
@pytest.mark.parametrize(("type_name", "m"), [(t, m) for t in ("Q4_K", "Q5_K") for m in (1, 5, 31)]
                         + [("Q6_K", m) for m in (1, 5, 31, 63)])
def test_a_matmul_below_the_conversion_rows_is_iks(cases: dict[str, np.ndarray], type_name: str, m: int,
                                                   avx2: bool) -> None:
    """ik's ggml_mul_mat of 48 rows of 512 (one thread) on m activation rows, its AVX2 build's and its AVX-512
    build's, bit for bit; the float path (the decoded weights against the rounded activations) is not, so the
    check can fail."""
    raw, x = cases[f"raw_{type_name}"], cases["x"][:m]
    ik = cases[("" if avx2 else "avx512/") + f"{type_name}_{m}"]
    got = native_matmul(integer_rows(x, Q8_2_X4), raw, type_name, avx2)
    np.testing.assert_array_equal(got.view(np.uint32), ik.view(np.uint32))
    decoded = type_by_name(type_name).require_codec().dequantize(raw, x.shape[1])
    assert not np.array_equal(round_activations(x, Q8_2_X4) @ decoded.T, ik)
