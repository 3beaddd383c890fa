"""ik's own kernels of IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M (ikrun/numerics/ik/iquant_native.py)
against ik's AVX-512 and AVX2 builds (tests/data/iquant-native): their dense matmul below the rows they convert them
from, bit for bit (the i-quants on AVX-512, one activation row: its _1 kernel; more, and every count on AVX2: the N
kernel with its minima; IQ1_S and IQ1_M: one kernel each), and a Qwen3-MoE whose experts get fewer than 32 tokens:
each build's base-logits file byte for byte and its final line. And the rows from which the AVX2 build converts IQ2_S
and the trellis types: the AVX-512 build's."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.convert import Converter
from ikquant import QuantizeOptions, file_type, quantize_model
from ikquant.imatrix import read_imatrix_dat
from ikquant.types import type_by_name
from ikrun.cli import app
from ikrun.numerics.ik.formats import Q8_K, ik_kernel, integer_rows, round_activations
from ikrun.numerics.ik.native import native_matmul, native_types
from ikrun.numerics.ik.qgemm import ORDER_R8_AVX2, pack, qmatmul

DATA = Path(__file__).parent / "data" / "iquant-native"
TEXT = Path(__file__).parent / "data" / "logits" / "qwen3-moe" / "text.txt"
#: the pure files of the Qwen3-MoE ik ran (IQ2_XXS and IQ2_XS with the imatrix, read as "imatrix.dat" in the
#: working folder since the file records that path, and Q8_0 embedding and output)
SHA256 = {"IQ2_XXS": "913b108424319004aadc7149a43d0ca79cbccc7f6fbe52307d90c69e2112026e",
          "IQ2_XS": "f488d2deed47624d55f1a0405eb9d3fbe818d68e2c1c0467d61bcae922c4d663",
          "IQ3_XXS": "8bfc0e5f32861834876c39ea4d99ab5c74e4b8154cb0134fdcc4ddf4f86f6153",
          "IQ3_S": "e9bf8e1b45530a94029cacdf7df07e3c98c98b0146c7ac5f065ee18004089a51",
          "IQ1_M": "34a511dc60d8e59e23a242a1b7213cc284124ce4875c020a2be130f6f2a1fa23",
          "IQ1_S": "31780482b374ad1e39450fc86a3e1fb10f3bf93b1694c9a0e06afa74c662b82e"}
#: the runs compared: IQ1_S's float path already writes the AVX-512 build's file on this model (its kernel is checked
#: on the matmuls alone there), where --numerics ik-avx2 refused it
RUNS = [(t, n) for t in SHA256 for n in ("ik", "ik-avx2") if (t, n) != ("IQ1_S", "ik")]
runner = CliRunner()


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize(("type_name", "m"), [(t, m) for t in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ3_S", "IQ1_S",
                                                        "IQ1_M") for m in (1, 5, 15, 31)]
                         + [("IQ2_S", m) for m in (1, 5, 15)])
def test_own_kernel_matmul_is_iks(type_name: str, m: int) -> None:
    """ik's ggml_mul_mat of 48 rows of 512 on m activation rows (IQ2_S: below the 16 it converts from), bit for bit;
    the float path is not."""
    with np.load(DATA / "cases.npz") as f, np.load(DATA / "cases-iq1.npz") as g:
        cases = g if type_name.startswith("IQ1") else f
        raw, x, ik = cases[f"raw_{type_name}"], f["x"][:m], cases[f"{type_name}_{m}"]
    got = native_matmul(integer_rows(x, Q8_K), raw, type_name)
    np.testing.assert_array_equal(_bits(got), _bits(ik))
    floats = round_activations(x, Q8_K) @ type_by_name(type_name).require_codec().dequantize(raw, 512).T
    assert not np.array_equal(_bits(floats), _bits(ik))


@pytest.mark.parametrize(("type_name", "m"), [(t, m) for t in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ3_S")
                                              for m in (1, 5, 15, 31)] + [("IQ2_S", m) for m in (1, 5, 15)])
def test_avx2_own_kernel_matmul_is_iks(type_name: str, m: int) -> None:
    """ik's AVX2 build multiplies one activation row in the N-row kernel too: its ggml_mul_mat of the same weights,
    bit for bit (at one row not the AVX-512 build's numbers)."""
    with np.load(DATA / "cases.npz") as f, np.load(DATA / "outputs-avx2.npz") as g:
        raw, x, ik, avx512 = f[f"raw_{type_name}"], f["x"][:m], g[f"{type_name}_{m}"], f[f"{type_name}_{m}"]
    assert type_name in native_types()
    got = native_matmul(integer_rows(x, Q8_K), raw, type_name, avx2=True)
    np.testing.assert_array_equal(_bits(got), _bits(ik))
    assert (m == 1) != np.array_equal(_bits(ik), _bits(avx512))


@pytest.mark.parametrize("m", [1, 5, 15, 31])
@pytest.mark.parametrize("type_name", ["IQ1_S", "IQ1_M"])
def test_avx2_iq1_kernels_are_iks(type_name: str, m: int) -> None:
    """IQ1_M's kernel is the same code in both builds; IQ1_S's AVX2 one sums other values into a lane (two runs of 4):
    the AVX2 build's ggml_mul_mat, bit for bit (IQ1_S: not the AVX-512 build's numbers)."""
    with np.load(DATA / "cases.npz") as f, np.load(DATA / "cases-iq1.npz") as g, \
            np.load(DATA / "outputs-avx2-iq1.npz") as h:
        raw, x, ik, avx512 = g[f"raw_{type_name}"], f["x"][:m], h[f"{type_name}_{m}"], g[f"{type_name}_{m}"]
    got = native_matmul(integer_rows(x, Q8_K), raw, type_name, avx2=True)
    np.testing.assert_array_equal(_bits(got), _bits(ik))
    assert np.array_equal(_bits(ik), _bits(avx512)) == (type_name == "IQ1_M")


@pytest.mark.parametrize("type_name", ["IQ2_S", "IQ2_KT", "IQ4_KT"])
def test_avx2_converts_from_the_avx512_builds_rows(type_name: str) -> None:
    """ik's AVX2 build converts IQ2_S from 16 activation rows and the trellis types from 16 (IQ4_KT 24), as its
    AVX-512 build: its ggml_mul_mat equals the converted weights' product in its order exactly from there."""
    kernel = ik_kernel(type_name)
    with np.load(DATA / "thresholds-avx2.npz") as f:
        raw, x = f[f"raw_{type_name}"], f["x"]
        outputs = {m: f[f"{type_name}_{m}"] for m in (15, 16, 23, 24)}
    converted = pack(replace(kernel.convert(raw, type_by_name(type_name).require_codec().dequantize(raw, 512)),  # type: ignore[misc]
                             order=ORDER_R8_AVX2))
    for m, ik in outputs.items():
        got = qmatmul(integer_rows(x[:m], kernel.activation), converted)
        assert np.array_equal(_bits(got), _bits(ik)) == kernel.converts(m, raw.shape[0], None, 8), m


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """The Qwen3-MoE of tests/moe_native.py quantized as ik ran it, checked to be the same bytes."""
    from tests.moe_native import make_checkpoint

    tmp = tmp_path_factory.mktemp("iquant-native")
    f32 = Converter(make_checkpoint(tmp / "hf"), "f32", pre_tokenizer="qwen2").write(tmp / "f32.gguf")
    shutil.copy(DATA / "moe-imatrix.dat", tmp / "imatrix.dat")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)
        imatrix = read_imatrix_dat(Path("imatrix.dat"))
    files = {}
    for name in SHA256:
        files[name] = tmp / f"{name.lower()}.gguf"
        extra = dict(imatrix=imatrix, token_embedding_type="q8_0", output_tensor_type="q8_0") \
            if name.startswith(("IQ2", "IQ1")) else {}
        quantize_model(f32, files[name], QuantizeOptions(file_type(name), pure=True, **extra))  # type: ignore[arg-type]
        assert hashlib.sha256(files[name].read_bytes()).hexdigest() == SHA256[name], name
    yield files


@pytest.mark.parametrize(("type_name", "numerics"), RUNS)
def test_experts_below_32_tokens_give_iks_logits(models: dict[str, Path], type_name: str, numerics: str,
                                                 tmp_path: Path) -> None:
    """Each build's base-logits file byte for byte and its final line (most experts get 5-30 tokens of the chunk).
    The experts in the float path printed IQ2_XXS 615.7411 (ik: 615.8687), IQ2_XS 576.9777 (576.8886), IQ3_XXS
    536.9944 (536.9152), IQ3_S 549.4308 (550.1680), IQ1_M 616.2668 (612.0605); --numerics ik-avx2 refused them."""
    out = tmp_path / "base.kld"
    res = runner.invoke(app, ["ppl", str(models[type_name]), "--text", str(TEXT), "-c", "128", "--chunks", "1", "-t",
                              "2", "--numerics", numerics, "--ik-batch", "2048", "--save-base-logits", str(out)])
    assert res.exit_code == 0, res.output
    prefix = "ik-avx2-" if numerics == "ik-avx2" else "ik-"
    assert out.read_bytes() == (DATA / f"{prefix}{type_name.lower()}-c128.kld").read_bytes()
    line = [ln for ln in (DATA / f"{prefix}final-lines.txt").read_text().splitlines()
            if ln.startswith(f"{type_name}: ")][0]
    assert line.split("=")[-1].split("+/-")[0].strip() in " ".join(res.output.split())
