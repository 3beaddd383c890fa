"""ik's own kernels of the IQK types, IQ4_XS, Q2_K and Q3_K (IQ4_KS, IQ5_KS, IQ3_KS, IQ2_KS, IQ2_KL, IQ4_KSS,
IQ2_K ... IQ6_K, IQ4_XS, Q2_K, Q3_K; ikrun/numerics/ik/iqk_native.py) against ik's AVX-512 build
(tests/data/iqk-native): its dense matmul (IQ4_KS, IQ5_KS: its MoE matmul and fused up-gate too) below 32 activation
rows bit for bit, and a Qwen3-MoE whose experts get fewer than 32 tokens: ik's base-logits file byte for byte and its
final line, with one chunk and (IQ4_KS) with four that share ik's micro-batch (ffn.micro_batches). The same against its
AVX2 build (tests/data/iqk-native-avx2: IQ4_KS, IQ3_KS, IQ2_KS, IQ2_K ... IQ6_K, IQ5_KS, IQ4_XS, Q2_K, Q3_K)."""

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
from ikrun.numerics.ik.formats import Q8_K, integer_rows, round_activations
from ikrun.numerics.ik.iqk_native import HAS_AVX512BW, iqk_matmul, iqk_matmuls
from ikrun.ops.moe import ExpertGlu, _swiglu

DATA = Path(__file__).parent / "data" / "iqk-native"
TEXT = Path(__file__).parent / "data" / "logits" / "qwen3-moe" / "text.txt"
SHA256 = {"f32": "7f50b66fd608f13111031427eaad8451863fce54650a56d8c18f5cfeac593e2d",
          "IQ4_KS": "8988607add836e671e81fa96cfaf020ad4da63501118ca826097b589a4712112",
          "IQ5_KS": "53f57c661416477be581d71ba2fc969b563c844d11c0fff9064a604b5e28cd68",
          "IQ3_KS": "375e860c166f690d3dfe407256fc9abf1b65ea33f8e490fae5f994517ddf5c91",
          "IQ2_KS": "60f9f61d2d43a8e903dfe5cf21420380aafb3648d4d129f7282364bbc0dbd427",
          "IQ2_K": "adfc511f54199318ad7bb08297b50ea9db116f0b10a3650b614ec44d3b45f6a1",
          "IQ3_K": "6019f8186e54748356c5dec17d7e62839bab73e8dfad4d425ef03a0179de29c1",
          "IQ4_K": "cb45d6557f2295ec395a20ae69289f824bdfc7fe7c82124c96ba0620dd7a6b5e",
          "IQ5_K": "9c14b3c211aecfb6b91d644241025a6a5f2268d1aa1a3fdbbaee41da956b6568",
          "IQ6_K": "8d48958d272915b8cb2b1433c77ce333b368cfa61825fd730c0f08b58454e4d2",
          "IQ4_KSS": "b7701083ecaa7c0dbdb4fb3a0973c0cbf86268dd64f41cbe942c785240029ede",
          "IQ2_KL": "4509ce1bc1544d491574388ee90fc2ea23417e75b44bffc928a1c838b2c74a21",
          "IQ4_XS": "4565983c31f639e80acfb8bce3278cab2a2cfeb2890d37b90aac7b4de59d5aef",
          "Q2_K": "f105037a2f4b01f2800e0c9674cf150ef304b1809d733dcfe5371766bd8008da",
          "Q3_K_S": "3ac176085881bfec7125348dcb1d428cf6777171eed3d8094bbee5dd298ede43"}
CASES = {"IQ4_KS": "cases.npz", "IQ5_KS": "cases-iq5_ks.npz"}
FORMS = [True, False] if HAS_AVX512BW else [False]  # the AVX-512BW form where the CPU has it, and the scalar loop
runner = CliRunner()


@pytest.fixture(scope="module", params=sorted(CASES))
def cases(request: pytest.FixtureRequest) -> dict[str, np.ndarray]:
    """One type's weights, activations and ik's outputs (the type under "type")."""
    with np.load(DATA / CASES[request.param]) as f:
        return {"type": np.array(request.param), **{k: f[k] for k in f.files}}


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("vector", FORMS)
@pytest.mark.parametrize("m", [1, 5, 31])
def test_a_dense_matmul_is_iks(cases: dict[str, np.ndarray], m: int, vector: bool) -> None:
    x = integer_rows(cases["x_dense"][:m], Q8_K)
    got = iqk_matmul(x, cases["raw"][0], str(cases["type"]), vector)
    np.testing.assert_array_equal(_bits(got), _bits(cases[f"dense_{m}"]))


def test_the_float_path_it_replaces_was_not(cases: dict[str, np.ndarray]) -> None:
    """The decoded weights against the rounded activations (the sums unsaturated): not ik's numbers on these
    cases, so the tests above can fail."""
    raw = cases["raw"][0]
    decoded = type_by_name(str(cases["type"])).require_codec().dequantize(raw, 512)
    floats = round_activations(cases["x_dense"], Q8_K) @ decoded.T
    assert np.abs(floats - cases["dense_31"]).max() > 1e-3 * np.abs(cases["dense_31"]).max()


@pytest.mark.parametrize("vector", FORMS)
def test_the_moe_matmul_and_fused_up_gate_are_iks(cases: dict[str, np.ndarray], vector: bool) -> None:
    """Every expert's tokens (5 to 17 of 40) in one call, each output ik's mul_mat_id's; silu(g) x g of them its
    moe_up_gate's."""
    ids, x = cases["ids"], integer_rows(cases["x_moe"], Q8_K)
    order = np.argsort(ids.reshape(-1), kind="stable")
    counts = np.bincount(ids.reshape(-1), minlength=len(cases["raw"]))
    row_at = np.concatenate([[0], np.cumsum(counts)])
    out = np.empty((ids.size, cases["raw"].shape[1]), np.float32)
    out[order] = iqk_matmuls(x, cases["raw"], order // ids.shape[1], row_at, str(cases["type"]),
                                vector)
    np.testing.assert_array_equal(_bits(out), _bits(cases["mul_mat_id"].reshape(ids.size, -1)))
    fused = _swiglu(out, out, ExpertGlu(), 0, True, False)
    np.testing.assert_array_equal(_bits(fused), _bits(cases["moe_up_gate"].reshape(ids.size, -1)))


def test_the_vector_form_saturates_as_the_scalar_loop() -> None:
    """Pairs of large codes against +-127 activations (every pair sum past 32767 and -32768) and random rows: the
    two forms' bits."""
    if not HAS_AVX512BW:
        pytest.skip("the vector form needs AVX-512BW")
    rng = np.random.default_rng(3)
    codec = type_by_name("IQ4_KS").require_codec()
    w = rng.standard_normal((48, 768)).astype(np.float32)
    w[:16] = np.abs(w[:16]) + 3  # the grid's top codes
    raw = codec.quantize(w)
    x = rng.standard_normal((9, 768)).astype(np.float32)
    x[:4] = np.where(np.arange(4)[:, None] % 2, 1.0, -1.0)  # +-127 everywhere
    rows = integer_rows(x, Q8_K)
    vector = iqk_matmul(rows, raw, "IQ4_KS", True)
    np.testing.assert_array_equal(_bits(vector), _bits(iqk_matmul(rows, raw, "IQ4_KS", False)))
    unsaturated = round_activations(x[:4], Q8_K) @ codec.dequantize(raw[:16], 768).T
    assert np.mean(np.abs(vector[:4, :16] - unsaturated) > 0.02 * np.abs(unsaturated)) > 0.8  # saturated


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The Qwen3-MoE ik ran, made again, converted and quantized to IQ4_KS and IQ5_KS, and checked to be its
    bytes."""
    from tests.moe_native import make_checkpoint

    tmp = tmp_path_factory.mktemp("iqk-native")
    f32 = Converter(make_checkpoint(tmp / "hf"), "f32", pre_tokenizer="qwen2").write(tmp / "f32.gguf")
    files = {"f32": f32}
    for name in ("IQ4_KS", "IQ5_KS", "IQ3_KS", "IQ2_KS", "IQ2_K", "IQ3_K", "IQ4_K", "IQ5_K",
                 "IQ6_K", "IQ4_KSS", "IQ2_KL", "IQ4_XS", "Q2_K", "Q3_K_S"):
        files[name] = tmp / f"{name.lower()}.gguf"
        quantize_model(f32, files[name], QuantizeOptions(file_type(name), pure=True))
    for name, path in files.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA256[name], name
    return files


@pytest.mark.parametrize(("type_name", "ctx", "chunks", "kld"), [
    ("IQ4_KS", 128, 1, "ik-c128.kld"), ("IQ4_KS", 256, 1, "ik-c256.kld"), ("IQ4_KS", 128, 4, "ik-c128x4.kld"),
    ("IQ5_KS", 128, 1, "ik-iq5_ks-c128.kld"), ("IQ3_KS", 128, 1, "ik-iq3_ks-c128.kld"),
    ("IQ2_KS", 128, 1, "ik-iq2_ks-c128.kld"), ("IQ2_K", 128, 1, "ik-iq2_k-c128.kld"),
    ("IQ3_K", 128, 1, "ik-iq3_k-c128.kld"),
    ("IQ4_K", 128, 1, "ik-iq4_k-c128.kld"), ("IQ5_K", 128, 1, "ik-iq5_k-c128.kld"),
    ("IQ6_K", 128, 1, "ik-iq6_k-c128.kld"), ("IQ4_KSS", 128, 1, "ik-iq4_kss-c128.kld"),
    ("IQ2_KL", 128, 1, "ik-iq2_kl-c128.kld"), ("IQ4_XS", 128, 1, "ik-iq4_xs-c128.kld"),
    ("Q2_K", 128, 1, "ik-q2_k-c128.kld"), ("Q3_K_S", 128, 1, "ik-q3_k_s-c128.kld")])
def test_experts_below_32_tokens_give_iks_logits(models: dict[str, Path], type_name: str, ctx: int, chunks: int,
                                                  kld: str, tmp_path: Path) -> None:
    """ik's base-logits file byte for byte and its final line to the digit (most experts get 5-30 tokens of a chunk;
    four chunks of 128 share ik's 512-token micro-batch, where most get 32 or more: --ik-batch 2048, ik's default -b).
    The experts in the float path printed IQ3_KS 522.9366 (ik: 523.5129), IQ2_KS 580.4391 (580.4589), IQ4_XS 531.5912
    (533.0735), IQ2_KL 657.9729 (657.8923), IQ4_KSS 582.1464 (583.4199), IQ2_K 592.7253 (592.7312), IQ3_K 515.4000
    (515.3999), IQ4_K 481.1680 (478.6976), IQ5_K 525.6906 (519.6313), IQ6_K 514.3496 (510.3074; its experts reach its
    own kernel as the file's rows, ops/moe._experts_product, though its float path multiplies other values than its
    decoding), Q2_K 509.0484 (509.3891), Q3_K 567.9698 (567.2664)."""
    out = tmp_path / "base.kld"
    res = runner.invoke(app, ["ppl", str(models[type_name]), "--text", str(TEXT), "-c", str(ctx), "--chunks",
                              str(chunks), "-t", "2", "--numerics", "ik", "--ik-batch", "2048", "--save-base-logits",
                              str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes() == (DATA / kld).read_bytes()
    prefix = "" if type_name == "IQ4_KS" else f"{type_name}: "
    final = [line for line in (DATA / "ik-final-lines.txt").read_text().splitlines()
             if line.startswith(prefix + "Final") and f"over {chunks} chunks for n_ctx={ctx} " in line][0]
    assert final.split("=")[-1].split("+/-")[0].strip() in " ".join(res.output.split())


AVX2 = DATA.parent / "iqk-native-avx2"


@pytest.mark.parametrize(("type_name", "kld"), [("IQ4_KS", "ik-c128.kld"), ("IQ3_KS", "ik-iq3_ks-c128.kld"),
                                               ("IQ2_KS", "ik-iq2_ks-c128.kld"), ("IQ2_K", "ik-iq2_k-c128.kld"),
                                               ("IQ3_K", "ik-iq3_k-c128.kld"), ("IQ4_K", "ik-iq4_k-c128.kld"),
                                               ("IQ5_K", "ik-iq5_k-c128.kld"), ("IQ6_K", "ik-iq6_k-c128.kld"),
                                               ("IQ5_KS", "ik-iq5_ks-c128.kld"), ("IQ4_XS", "ik-iq4_xs-c128.kld"),
                                               ("Q2_K", "ik-q2_k-c128.kld"), ("Q3_K_S", "ik-q3_k_s-c128.kld"),
                                               ("IQ4_KSS", "ik-iq4_kss-c128.kld"), ("IQ2_KL", "ik-iq2_kl-c128.kld")])
def test_experts_below_32_tokens_give_iks_avx2_logits(models: dict[str, Path], type_name: str, kld: str,
                                                      tmp_path: Path) -> None:
    """ik's own IQ4_KS, IQ3_KS, IQ2_KS, IQ2_K ... IQ6_K, IQ5_KS, IQ4_XS, Q2_K, Q3_K, IQ4_KSS and IQ2_KL kernels of its
    AVX2 build
    (tests/data/iqk-native-avx2; most experts get 5-30 tokens of the chunk): --numerics ik-avx2 writes ik's
    base-logits file byte for byte and prints its final line (the experts in the float path printed IQ3_KS 523.0499,
    not ik's 523.2203; IQ2_KS 579.8098, not 580.5024; the others were refused)."""
    out = tmp_path / "base.kld"
    res = runner.invoke(app, ["ppl", str(models[type_name]), "--text", str(TEXT), "-c", "128", "--chunks", "1", "-t",
                              "2", "--numerics", "ik-avx2", "--ik-batch", "2048", "--save-base-logits", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes() == (AVX2 / kld).read_bytes()
    prefix = "" if type_name == "IQ4_KS" else f"{type_name}: "
    line = [ln for ln in (AVX2 / "ik-final-lines.txt").read_text().splitlines() if ln.startswith(prefix + "Final")][0]
    assert line.split("=")[-1].split("+/-")[0].strip() in " ".join(res.output.split())


@pytest.mark.parametrize("avx2", [True, False])
@pytest.mark.parametrize("m", [1, 5, 31])
@pytest.mark.parametrize("type_name", ["IQ3_KS", "IQ2_KS"])
def test_ks_own_kernel_matmul_is_iks(type_name: str, m: int, avx2: bool) -> None:
    """IQ3_KS's and IQ2_KS's own kernels of ik's AVX2 build (IQ3_KS: multiply_add_avx2 over its signed grid values
    and 16-bit sub-block scales; IQ2_KS: multiply_add over its grid plus 32, each sub-block's minimum in a fused
    multiply-add of its own) and of its AVX-512 build (IQ4_KS's 16 lanes over the unshifted grid plus 64 or 32, the
    minima in lanes 0 .. 7): each build's ggml_mul_mat of the same 48 rows of 512 on m activation rows, bit for
    bit; the float path is not."""
    with np.load((AVX2 if avx2 else DATA) / f"cases-{type_name.lower()}.npz") as f:
        raw, x, ik = f[f"raw_{type_name}"], f["x"][:m], f[f"{type_name}_{m}"]
    got = iqk_matmul(integer_rows(x, Q8_K), raw, type_name, avx2=avx2)
    np.testing.assert_array_equal(_bits(got), _bits(ik))
    decoded = type_by_name(type_name).require_codec().dequantize(raw, x.shape[1])
    assert not np.array_equal(round_activations(x, Q8_K) @ decoded.T, ik)



@pytest.mark.parametrize("m", [1, 5, 31])
@pytest.mark.parametrize("type_name", ["IQ2_K", "IQ3_K", "IQ4_K", "IQ5_K", "IQ6_K", "IQ4_KSS", "IQ2_KL", "IQ4_XS",
                                       "Q2_K", "Q3_K"])
def test_own_kernel_matmul_is_iks(type_name: str, m: int) -> None:
    """IQ3_K's, IQ4_K's, IQ5_K's, IQ6_K's, IQ4_KSS's and IQ4_XS's own kernels of ik's AVX-512 build
    (mul_mat_iqX_k_q8_K_AVX512: 16 lanes of saturated pair sums times their sub-block's scale, 8 lanes of minima, a
    fused multiply-add a block and lane), IQ2_K's, Q2_K's and Q3_K's (mul_mat_qX_K_q8_K_AVX512: other lanes, exact;
    Q2_K's minima scaled by -dmin, Q3_K's by -4 d) and IQ2_KL's
    (IQ2_KS's kernel over its value pairs): its ggml_mul_mat of 48 rows of 512 (8 rows of large values, whose pair
    sums saturate against the 2 activation rows of +127) on m activation rows, bit for bit. The float path is off
    by saturation (the 4-6 bit types: more than a twentieth of the largest output) or by float order (the 2-3 bit ones,
    whose sums cannot saturate)."""
    with np.load(DATA / f"cases-{type_name.lower()}.npz") as f:
        raw, x, ik = f[f"raw_{type_name}"], f["x"][:m], f[f"{type_name}_{m}"]
    got = iqk_matmul(integer_rows(x, Q8_K), raw, type_name)
    np.testing.assert_array_equal(_bits(got), _bits(ik))
    floats = round_activations(x, Q8_K) @ type_by_name(type_name).require_codec().dequantize(raw, 512).T
    off = np.abs(floats - ik).max() / np.abs(ik).max()
    assert off > 0.05 if type_name in ("IQ4_K", "IQ5_K", "IQ6_K", "IQ4_KSS", "IQ4_XS") else 0 < off < 1e-5


@pytest.mark.parametrize("m", [1, 5, 31])
@pytest.mark.parametrize("type_name", ["IQ2_K", "IQ3_K", "IQ4_K", "IQ5_K", "IQ6_K", "IQ4_XS", "Q2_K", "Q3_K", "IQ4_KSS",
                                       "IQ2_KL"])
def test_avx2_own_kernels_are_iks(type_name: str, m: int) -> None:
    """IQ2_K ... IQ6_K's own kernels of ik's AVX2 build (mul_mat_qY_K_q8_K_T: the minima's lanes first, IQ4_K
    none, then 8 exact lanes; _scalar_row_xk_avx2; Q2_K's and Q3_K's the same) and IQ4_XS's, IQ4_KSS's and IQ2_KL's
    (mul_mat_qX_K_q8_K_T: saturating pair sums, the minima lanes first): its
    ggml_mul_mat of the AVX-512 cases' weights and activations, bit for bit, and not the AVX-512 build's numbers."""
    outputs = AVX2 / {"IQ4_XS": "outputs-iq4_xs.npz", "Q2_K": "outputs-q2_k-q3_k.npz", "Q3_K": "outputs-q2_k-q3_k.npz",
                      "IQ4_KSS": "outputs-iq4_kss-iq2_kl.npz", "IQ2_KL": "outputs-iq4_kss-iq2_kl.npz"}.get(
        type_name, "outputs-k.npz")
    with np.load(DATA / f"cases-{type_name.lower()}.npz") as f, np.load(outputs) as g:
        raw, x, ik, avx512 = f[f"raw_{type_name}"], f["x"][:m], g[f"{type_name}_{m}"], f[f"{type_name}_{m}"]
    got = iqk_matmul(integer_rows(x, Q8_K), raw, type_name, avx2=True)
    np.testing.assert_array_equal(_bits(got), _bits(ik))
    assert not np.array_equal(_bits(got), _bits(avx512))


@pytest.mark.parametrize("m", [1, 5, 31])
def test_avx2_iq5_ks_kernel_saturates_as_iks(m: int) -> None:
    """IQ5_KS's own kernel of ik's AVX2 build (unsigned values whose pair sums saturate at 16 bits, the minima's
    lanes first): its ggml_mul_mat on rows built to saturate, bit for bit, where the float path is off by more than
    a tenth of the largest output."""
    with np.load(AVX2 / "cases-iq5_ks.npz") as f:
        raw, x, ik = f["raw_IQ5_KS"], f["x"][:m], f[f"IQ5_KS_{m}"]
    got = iqk_matmul(integer_rows(x, Q8_K), raw, "IQ5_KS", avx2=True)
    np.testing.assert_array_equal(_bits(got), _bits(ik))
    floats = round_activations(x, Q8_K) @ type_by_name("IQ5_KS").require_codec().dequantize(raw, 512).T
    assert np.abs(floats - ik).max() > 0.1 * np.abs(ik).max()
