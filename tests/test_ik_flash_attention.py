"""`--numerics ik --mla prefill`: ik's flash-attention kernels on the keys and values ik materialises through
attn_kv_b, against a native AVX2 ik: its own iqk kernel (ikrun/numerics/ik/iqk_flash_attention.py) bit for bit
against ggml_flash_attn_ext (tests/data/flash-attention/iqk-avx2), ggml's generic one (flash_attention.py) on the
tiny DeepSeek-V3's 48/32 heads against ik's default run (flash attention on, mla 3; tests/data/logits/
deepseek-v3-fa-avx2)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ikrun.cli import app
from ikrun.errors import ModelError
from ikrun.eval.evaluate import perplexity
from ikrun.eval.metrics import BaseLogitsFile
from ikrun.model import Model
from ikrun.numerics.ik.arithmetic import IQK_FA_HEADS
from ikrun.numerics.ik.flash_attention import generic_flash_attention
from ikrun.numerics.ik.iqk_flash_attention import (
    AVX2_LANES,
    AVX512_LANES,
    NO_SCORES,
    iqk_flash_attention,
    k_step_for,
)
from ikrun.ops.activations import ik_expf, ik_expf_avx2
from ikrun.options import RuntimeOptions
from tests.family_checks import assert_iks_forward, iks_running_ppl, running_ppl
from tests.iqk_fa_cases import CASES, GENERIC_CASES, case_inputs
from tests.test_mla_paths import _quantized_kv_b

runner = CliRunner()
DATA = Path(__file__).parent / "data"
V3 = DATA / "convert" / "deepseek-v3" / "ik-f32.gguf"
FOLDER = DATA / "logits" / "deepseek-v3-fa-avx2"
FOLDER_AVX512 = DATA / "logits" / "deepseek-v3-fa-avx512"
IQK_OUTPUTS = DATA / "flash-attention" / "iqk-avx2" / "outputs.npz"
IQK_AVX512_OUTPUTS = DATA / "flash-attention" / "iqk-avx512" / "outputs.npz"


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _kld(model: Path, *flags: str) -> dict[str, Any]:
    res = runner.invoke(app, ["kld", str(model), "--base-logits", str(FOLDER / "ik-base.kld"), "--mla", "prefill",
                              "--json", *flags])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_one_visible_key_gives_its_value_and_the_rest_is_a_softmax_in_f16() -> None:
    """The first query sees one key: its (f16) value exactly. Every row is the float64 softmax's to f16 precision,
    and not bit for bit (the value sums are rounded to f16 at each key)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 40, 48)).astype(np.float32)
    k, v = _f16(rng.standard_normal((2, 40, 48)).astype(np.float32)), _f16(rng.standard_normal((2, 40, 32)))
    out = np.empty((2, 40, 32), dtype=np.float32)
    generic_flash_attention(q, k, NO_SCORES, v, 0.2, 0, out, AVX512_LANES, True)
    np.testing.assert_array_equal(out[:, 0], v[:, 0])
    s = np.einsum("htd,hsd->hts", _f16(q).astype(np.float64), k.astype(np.float64)) * 0.2
    s[:, np.triu_indices(40, 1)[0], np.triu_indices(40, 1)[1]] = -np.inf
    p = np.exp(s - s.max(axis=2, keepdims=True))
    ref = (p / p.sum(axis=2, keepdims=True)) @ v.astype(np.float64)
    np.testing.assert_allclose(out, ref, atol=4e-3)
    assert not np.array_equal(out, ref.astype(np.float32))


def test_f32_prefill_is_iks_default_run() -> None:
    """ik's default run of the F32 file on its AVX2 build: --numerics ik (the AVX-512 build's orders, PPL 490.9733
    where the AVX2 build prints 490.9511) lands at KLD 4e-7 of its base, the exact arithmetic at 2e-4."""
    ours = _kld(V3, "--numerics", "ik")
    assert ours["mla_path"] == "prefill" and ours["kld_mean"] < 1e-6, ours["kld_mean"]
    assert _kld(V3)["kld_mean"] > 100 * ours["kld_mean"]


def test_ik_avx2_is_iks_default_run(tmp_path: Path) -> None:
    """--numerics ik-avx2 (ik's AVX2 build around ggml's generic flash-attention kernel, heads 48/32): ik's base-logits
    file byte for byte with every running PPL (490.9511; --numerics ik 490.9675, 80300 bytes differ), and with
    attn_kv_b in Q4_0 every figure ik printed (PPL(Q) 521.403029, KLD 0.086238, maximum 0.463238, same top p
    52.381%)."""
    assert_iks_forward(Model(V3, options=RuntimeOptions(numerics="ik-avx2", mla="prefill")), FOLDER / "ik-base.kld",
                       FOLDER / "ik-base.txt", tmp_path / "base.kld")
    ours = _kld(_quantized_kv_b(V3, tmp_path / "kvb-q4_0.gguf", "Q4_0"), "--numerics", "ik-avx2")
    text = (FOLDER / "ik-kvb-q4_0-kld.txt").read_bytes().decode(errors="replace")
    for key, pattern in (("ppl_q", r"Mean PPL\(Q\)\s*:\s*([\d.]+)"), ("kld_mean", r"Mean\s+KLD:\s*([\d.]+)"),
                         ("kld_max", r"Maximum KLD:\s*([\d.]+)")):
        m = re.search(pattern, text)
        assert m is not None and f"{ours[key]:.6f}" == m.group(1), (key, ours[key])


def test_ik_is_iks_avx512_default_run(tmp_path: Path) -> None:
    """--numerics ik (ik's AVX-512 build around ggml's generic flash-attention kernel, heads 48/32): that build's
    base-logits file byte for byte with every running PPL (490.9733; the AVX2 build prints 490.9511)."""
    assert_iks_forward(Model(V3, options=RuntimeOptions(numerics="ik", mla="prefill")), FOLDER_AVX512 / "ik-base.kld",
                       FOLDER_AVX512 / "ik-base.txt", tmp_path / "base.kld")


def test_a_q4_0_attn_kv_b_costs_what_ik_prints(tmp_path: Path) -> None:
    """attn_kv_b alone in Q4_0 (the latent rounded to 8 bits for its product): ik's AVX2 build prints 0.086238;
    --numerics ik (AVX-512 orders) 0.086237, the exact arithmetic 0.0881."""
    q4 = _quantized_kv_b(V3, tmp_path / "kvb-q4_0.gguf", "Q4_0")
    text = (FOLDER / "ik-kvb-q4_0-kld.txt").read_bytes().decode(errors="replace")
    m = re.search(r"Mean\s+KLD:\s*([\d.]+)", text)
    assert m is not None
    theirs = float(m.group(1))
    assert _kld(q4, "--numerics", "ik")["kld_mean"] == pytest.approx(theirs, rel=1e-4)
    assert _kld(q4)["kld_mean"] != pytest.approx(theirs, rel=1e-2)


@pytest.mark.parametrize(("lanes", "outputs"), [(AVX2_LANES, IQK_OUTPUTS), (AVX512_LANES, IQK_AVX512_OUTPUTS)],
                         ids=["avx2", "avx512"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_iqk_kernel_is_iks_bit_for_bit(case: Any, lanes: int, outputs: Path) -> None:
    """ik's ggml_flash_attn_ext (native AVX2 and AVX-512 builds, its iqk kernel) on the same inputs gave these very
    bits, whatever its thread count and the rows it tiles together; keys past the last visible one are skipped (ik
    weighs them 0). The two builds' results differ in most values (tests/data/flash-attention/iqk-avx512)."""
    q, k, v, scale = case_inputs(case)
    n_keys = case.first + case.n_q
    out = np.empty((case.n_head, case.n_q, case.dv), dtype=np.float32)
    iqk_flash_attention(q, np.ascontiguousarray(k[:, :n_keys], dtype=np.float32), NO_SCORES,
                        np.ascontiguousarray(v[:, :n_keys], dtype=np.float32), float(scale), case.first,
                        k_step_for(case.dk, case.dv, case.n_kv), out, lanes)
    with np.load(outputs) as theirs:
        np.testing.assert_array_equal(out, theirs[case.name])


@pytest.mark.parametrize(("lanes", "outputs"), [(AVX2_LANES, IQK_OUTPUTS), (AVX512_LANES, IQK_AVX512_OUTPUTS)],
                         ids=["avx2", "avx512"])
@pytest.mark.parametrize("case", GENERIC_CASES, ids=lambda c: c.name)
def test_generic_kernel_is_iks_bit_for_bit(case: Any, lanes: int, outputs: Path) -> None:
    """Other head sizes: ggml's generic kernel of ik's native AVX2 and AVX-512 builds gave these very bits (its weight
    total is not fused: S * ms + vs, two roundings; the builds' f16 dot products differ)."""
    q, k, v, scale = case_inputs(case)
    n_keys = case.first + case.n_q
    out = np.empty((case.n_head, case.n_q, case.dv), dtype=np.float32)
    generic_flash_attention(q, np.ascontiguousarray(k[:, :n_keys], dtype=np.float32), NO_SCORES,
                            np.ascontiguousarray(v[:, :n_keys], dtype=np.float32), float(scale), case.first, out,
                            lanes, True)
    with np.load(outputs) as theirs:
        np.testing.assert_array_equal(out, theirs[case.name])


def test_every_head_size_of_iks_kernels_is_checked() -> None:
    assert not {(c.dk, c.dv) for c in GENERIC_CASES} & set(IQK_FA_HEADS)
    assert {(c.dk, c.dv) for c in CASES} == set(IQK_FA_HEADS)


def test_the_avx2_exponential_is_not_expf_and_ends_at_0_and_inf() -> None:
    x = np.linspace(-120, 0, 100001, dtype=np.float32)
    ours = np.array([ik_expf_avx2(np.float32(t)) for t in x[::97]])
    np.testing.assert_allclose(ours, np.exp(x[::97].astype(np.float64)), rtol=3e-7, atol=1e-45)
    assert (ours != np.exp(x[::97])).any()
    assert ik_expf_avx2(np.float32(-np.inf)) == 0 and ik_expf_avx2(np.float32(-200.0)) == 0
    assert ik_expf_avx2(np.float32(0.0)) == 1 and ik_expf_avx2(np.float32(200.0)) == np.inf


def test_the_avx512_exponential_is_neither_expf_nor_the_avx2_one_and_ends_at_0_and_inf() -> None:
    """Subnormal results included (x down to -103: vscalefps rounds them once)."""
    x = np.linspace(-103, 0, 100001, dtype=np.float32)[::97]
    ours = np.array([ik_expf(np.float32(t)) for t in x])
    np.testing.assert_allclose(ours, np.exp(x.astype(np.float64)), rtol=3e-7, atol=1e-45)
    assert (ours != np.exp(x)).any() and (ours != np.array([ik_expf_avx2(np.float32(t)) for t in x])).any()
    assert ik_expf(np.float32(-np.inf)) == 0 and ik_expf(np.float32(-200.0)) == 0
    assert ik_expf(np.float32(0.0)) == 1 and ik_expf(np.float32(200.0)) == np.inf


# ---- the tiny DeepSeek-V3 with real head sizes (192/128) against ik's default run ------------------------------

REAL = DATA / "logits" / "deepseek-v3-heads192-fa-avx2"
REAL_AVX512 = DATA / "logits" / "deepseek-v3-heads192-fa-avx512"
REAL_SHA256 = {"ik-f32.gguf": "16675deab855ab3ec35c9606d382238a6f87ac6c3175a5cccbae14314669e2be",
               "kvb-q4_0.gguf": "19ed60f164290874518d91e8e56493cb267349d0f82dfc4ba204add487d66cbf",
               "kvb-q8_0.gguf": "e27e8ca6ea50dea0c8e5f808e4baa7d6595972fba45adf07b03f69c3b439ee28",
               "kvb-f16.gguf": "0e84cd3cad396929994fc2b40fe20aa85c7e80da49050844b366a7dad3d76071",
               "kvb-bf16.gguf": "fc58a2201a9c709b8999ab21a44139dd1b8e71dfd0737658f13b9cd9e2360d8f"}


@pytest.fixture(scope="module")
def real_heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The files behind REAL (and tests/data/logits/deepseek-v3-heads192-fa-ctk-avx2), made again from their seed
    (the READMEs), checked to be the very bytes ik ran: the F32 file and copies with attn_kv_b alone in Q4_0, Q8_0,
    F16 and BF16."""
    from ikconvert.cli import app as ikconvert_app
    from tests.mla_real_heads import make_checkpoint

    tmp = tmp_path_factory.mktemp("heads192")
    hf = make_checkpoint(tmp / "hf")
    f32 = tmp / "ik-f32.gguf"
    res = runner.invoke(ikconvert_app, ["hf2gguf", str(hf), "--outtype", "f32", "--pre-tokenizer", "deepseek-v3",
                                        "--outfile", str(f32)])
    assert res.exit_code == 0, res.output
    files = {"ik-f32.gguf": f32, **{f"kvb-{t.lower()}.gguf": _quantized_kv_b(f32, tmp / f"kvb-{t.lower()}.gguf", t)
                                    for t in ("Q4_0", "Q8_0", "F16", "BF16")}}
    for name, path in files.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == REAL_SHA256[name], name
    return files


def _assert_absorbed_generic_run(real_heads: dict[str, Path], cache: str, out: Path) -> None:
    """ik's default run of the F32 file with -ctk `cache` (tests/data/logits/deepseek-v3-heads192-absorbed-ctk-avx512,
    the absorbed form at 64-token batches): its base-logits file byte for byte with every running PPL."""
    folder = DATA / "logits" / "deepseek-v3-heads192-absorbed-ctk-avx512"
    model = Model(real_heads["ik-f32.gguf"], options=RuntimeOptions(numerics="ik", ik_threads=2), cache_type_k=cache)
    assert model.computed_paths(64) == {"mla_path": "decode", "flash_attn": "on"}
    base = folder / f"ctk-{cache}-base.kld"
    res = perplexity(model, np.asarray(BaseLogitsFile(base).tokens), save_base=out)
    assert out.read_bytes() == base.read_bytes()
    assert running_ppl(res.nll, res.n_chunk) == iks_running_ppl(folder / f"ctk-{cache}-base.txt")


def test_a_q8_0_latent_in_the_absorbed_form_at_ggml_generic_heads(real_heads: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    """The absorbed form's heads here (keys 128, values 64) are not a pair ik's own kernel takes: ggml's generic one
    multiplies the Q8_0 latent rows by each query row and sums their decoded values in float32 (ik's run: 519.7588).
    Over Q4_0 / IQ4_NL / Q6_0 latents ik's figures are NaN or its q . k 0: those stay refused."""
    _assert_absorbed_generic_run(real_heads, "q8_0", tmp_path / "ours.kld")
    for cache in ("q4_0", "q6_0"):
        refused = Model(real_heads["ik-f32.gguf"], options=RuntimeOptions(numerics="ik"), cache_type_k=cache)
        with pytest.raises(ModelError, match=f"--cache-type-k {cache}: ik's absorbed MLA form"):
            refused.check_context(64)


def test_a_bf16_latent_in_the_absorbed_form_at_ggml_generic_heads(real_heads: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    """Over a BF16 latent cache ggml's generic kernel takes q . k from ggml_vec_dot_bf16 (the query rounded to bf16,
    AVX512-BF16 lanes) and sums the values in float32 (ik's run: 515.4576); ik-avx2 (whose build aborts there) and
    -ctk bf16 with ik's -fa off graph (which never reads -ctk) stay refused."""
    _assert_absorbed_generic_run(real_heads, "bf16", tmp_path / "ours.kld")
    for options in (RuntimeOptions(numerics="ik-avx2"), RuntimeOptions(numerics="ik", flash_attn="off")):
        with pytest.raises(ModelError, match="--cache-type-k bf16"):
            Model(real_heads["ik-f32.gguf"], options=options, cache_type_k="bf16").check_context(64)


@pytest.mark.parametrize("kv_b", ["q8_0", "f16"])
def test_a_bf16_latent_in_the_prefill_form_is_iks_bf16_flash_attention(real_heads: dict[str, Path], kv_b: str,
                                                                       tmp_path: Path) -> None:
    """-ctk bf16 on DeepSeek: the prefill form takes the latent decoded from BF16, attn_kv_b times it, the keys and
    values cast to BF16, then ik's bf16 flash-attention kernel (its K x Q on queries rounded to bf16). ik's default
    run (tests/data/logits/deepseek-v3-heads192-bf16-latent-avx512): its base-logits file byte for byte (Q8_0
    attn_kv_b: stored; F16: its SHA-256) with every running PPL (484.8329, 484.6364)."""
    folder = DATA / "logits" / "deepseek-v3-heads192-bf16-latent-avx512"
    model = Model(real_heads[f"kvb-{kv_b}.gguf"], options=RuntimeOptions(numerics="ik", ik_threads=2),
                  cache_type_k="bf16")
    assert model.computed_paths(128) == {"mla_path": "prefill", "flash_attn": "on"}
    name = f"kvb-{kv_b}-ctk-bf16-base"
    res = perplexity(model, np.asarray(BaseLogitsFile(folder / "kvb-q8_0-ctk-bf16-base.kld").tokens),
                     save_base=tmp_path / "ours.kld")
    ours = (tmp_path / "ours.kld").read_bytes()
    if kv_b == "q8_0":
        assert ours == (folder / f"{name}.kld").read_bytes()
    else:
        assert hashlib.sha256(ours).hexdigest() == (folder / "ik-base.sha256").read_text().split()[0]
    assert running_ppl(res.nll, res.n_chunk) == iks_running_ppl(folder / f"{name}.txt")


@pytest.mark.parametrize(("file", "flags", "says"), [
    # ik's -fa off graph keeps the latent in -ctv's type (-ctv bf16 runs: tests/test_mla_absorbed_flash.py)
    ("kvb-q8_0.gguf", ["--ctx", "64", "--flash-attn", "off"], "in -ctv's type and never reads -ctk"),
    ("ik-f32.gguf", ["--ctx", "128"], "is F32"),  # ik crashes (the README's ik-f32-ctk-bf16-crash.txt)
    ("kvb-q8_0.gguf", ["--ctx", "128", "--numerics", "ik-avx2"], "not a bf16 key cache on deepseek2"),
])
def test_a_bf16_latent_ik_does_not_run_as_reproduced_is_refused(real_heads: dict[str, Path], file: str,
                                                                flags: list[str], says: str) -> None:
    res = runner.invoke(app, ["ppl", str(real_heads[file]), "--text", str(DATA / "logits" / "deepseek-v3" / "text.txt"),
                              "--chunks", "1", "--numerics", "ik", "-ctk", "bf16", *flags])
    assert res.exit_code == 2 and says in " ".join(res.output.split()), res.output


def _real_kld(model: Path, *flags: str) -> dict[str, Any]:
    res = runner.invoke(app, ["kld", str(model), "--base-logits", str(REAL / "ik-base.kld"), "--json", *flags])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _printed(name: str) -> dict[str, float]:
    text = (REAL / name).read_bytes().decode(errors="replace")
    grab = {"ppl_q": r"Mean PPL\(Q\)\s*:\s*([\d.]+)", "kld_mean": r"Mean\s+KLD:\s*([\d.]+)",
            "kld_max": r"Maximum KLD:\s*([\d.]+)", "same_top_p": r"Same top p:\s*([\d.]+)"}
    found = {key: re.search(pattern, text) for key, pattern in grab.items()}
    return {key: float(m.group(1)) for key, m in found.items() if m is not None}


def test_iks_figures_do_not_depend_on_its_threads() -> None:
    assert _printed("ik-kvb-q4_0-kld.txt") == _printed("ik-kvb-q4_0-kld-t2.txt")


def test_real_heads_f32_prefill_is_iks_default_run(real_heads: dict[str, Path]) -> None:
    """--numerics ik is ik's AVX-512 build (its base-logits file byte for byte: test_real_heads_ik_is_iks_avx512_build)
    on the prefill path, which --mla auto takes for ik's 128-token chunks; against the AVX2 build's base it lands at
    mean KLD 1.4e-8 (what the two builds' orders differ by), maximum 5.3e-6 (that build's own F32 run against its
    base prints 0.000006: the base file's 16-bit log-probabilities), PPL(Q) 484.7288, the AVX-512 build's PPL. The
    exact arithmetic: 2.3e-7."""
    ours = _real_kld(real_heads["ik-f32.gguf"], "--numerics", "ik")
    assert ours["mla_path"] == "prefill"
    assert ours["kld_mean"] < 3e-8 and ours["kld_max"] < _printed("ik-f32-kld.txt")["kld_max"]
    m = re.search(r"Final estimate: PPL over 4 chunks for n_ctx=128 = ([\d.]+)",
                  (REAL_AVX512 / "ik-base.txt").read_bytes().decode(errors="replace"))
    assert m is not None and f"{ours['ppl_q']:.4f}" == m.group(1)
    assert _real_kld(real_heads["ik-f32.gguf"], "--mla", "prefill")["kld_mean"] > 10 * ours["kld_mean"]


def test_real_heads_q4_0_attn_kv_b_costs_what_ik_prints(real_heads: dict[str, Path]) -> None:
    """attn_kv_b alone in Q4_0: ik prints mean KLD 0.030781, maximum 0.419790, same top p 68.254%; --numerics ik
    0.030778, 0.419758 and 68.254%; the exact arithmetic 0.030130."""
    ik = _printed("ik-kvb-q4_0-kld.txt")
    ours = _real_kld(real_heads["kvb-q4_0.gguf"], "--numerics", "ik")
    assert ours["mla_path"] == "prefill"
    assert ours["kld_mean"] == pytest.approx(ik["kld_mean"], rel=2e-4)
    assert ours["kld_max"] == pytest.approx(ik["kld_max"], rel=2e-4)
    assert f"{100 * ours['same_top_p']:.3f}" == f"{ik['same_top_p']:.3f}"
    assert _real_kld(real_heads["kvb-q4_0.gguf"], "--mla", "prefill")["kld_mean"] != pytest.approx(ik["kld_mean"],
                                                                                                   rel=1e-2)


REAL_FA_OFF = DATA / "logits" / "deepseek-v3-heads192-avx2-fa-off"


@pytest.mark.parametrize(("folder", "flash_attn"), [(REAL, "auto"), (REAL_FA_OFF, "off")])
def test_real_heads_ik_avx2_is_iks_avx2_build(real_heads: dict[str, Path], folder: Path, flash_attn: str,
                                              tmp_path: Path) -> None:
    """--numerics ik-avx2 (ik's AVX2 build's float orders around its flash-attention kernels): ik's default run's
    base-logits file (prefill, PPL 484.7333) and its -fa off run's (decode, 484.7470) byte for byte, every running
    PPL; --numerics ik's files differ (PPL(Q) 484.7288, the AVX-512 build's, and 484.7474)."""
    base, printed = folder / "ik-base.kld", folder / "ik-base.txt"
    assert_iks_forward(Model(real_heads["ik-f32.gguf"], options=RuntimeOptions(numerics="ik-avx2",
                                                                               flash_attn=flash_attn)),
                       base, printed, tmp_path / "avx2.kld")
    perplexity(Model(real_heads["ik-f32.gguf"], options=RuntimeOptions(numerics="ik", flash_attn=flash_attn)),
               np.asarray(BaseLogitsFile(base).tokens), save_base=tmp_path / "avx512.kld")
    assert (tmp_path / "avx512.kld").read_bytes() != base.read_bytes()


def test_real_heads_ik_is_iks_avx512_build(real_heads: dict[str, Path], tmp_path: Path) -> None:
    """--numerics ik (ik's AVX-512 build's float orders, its flash-attention kernel's included): that build's default
    run's base-logits file byte for byte (prefill, PPL 484.7288), every running PPL; and with attn_kv_b alone in Q4_0
    every figure it printed (PPL(Q) 480.178712, mean KLD 0.030779, maximum 0.419763, same top p 68.254%)."""
    assert_iks_forward(Model(real_heads["ik-f32.gguf"], options=RuntimeOptions(numerics="ik", mla="auto")),
                       REAL_AVX512 / "ik-base.kld", REAL_AVX512 / "ik-base.txt", tmp_path / "avx512.kld")
    res = runner.invoke(app, ["kld", str(real_heads["kvb-q4_0.gguf"]), "--base-logits",
                              str(REAL_AVX512 / "ik-base.kld"), "--json", "--numerics", "ik"])
    assert res.exit_code == 0, res.output
    ours = json.loads(res.stdout)
    text = (REAL_AVX512 / "ik-kvb-q4_0-kld.txt").read_bytes().decode(errors="replace")
    for key, pattern in (("ppl_q", r"Mean PPL\(Q\)\s*:\s*([\d.]+)"), ("kld_mean", r"Mean\s+KLD:\s*([\d.]+)"),
                         ("kld_max", r"Maximum KLD:\s*([\d.]+)")):
        m = re.search(pattern, text)
        assert m is not None and f"{ours[key]:.6f}" == m.group(1), (key, ours[key])
    m = re.search(r"Same top p:\s*([\d.]+)", text)
    assert m is not None and f"{100 * ours['same_top_p']:.3f}" == m.group(1)


def test_real_heads_ik_avx2_q4_0_attn_kv_b_is_what_ik_prints(real_heads: dict[str, Path]) -> None:
    """attn_kv_b alone in Q4_0 (ik converts it to Q8_0_R8 for the prefill's 128 latent rows; its AVX2 gemm order):
    under --numerics ik-avx2 PPL(Q) 480.164173, mean KLD 0.030781, maximum 0.419790, same top p 68.254%, as ik
    prints them (--numerics ik: 0.030778, 0.419758)."""
    ik = _printed("ik-kvb-q4_0-kld.txt")
    ours = _real_kld(real_heads["kvb-q4_0.gguf"], "--numerics", "ik-avx2")
    assert ours["mla_path"] == "prefill"
    assert {key: f"{ours[key]:.6f}" for key in ("ppl_q", "kld_mean", "kld_max")} == \
        {key: f"{ik[key]:.6f}" for key in ("ppl_q", "kld_mean", "kld_max")}
    assert f"{100 * ours['same_top_p']:.3f}" == f"{ik['same_top_p']:.3f}"


def test_the_console_report_names_the_mla_path(real_heads: dict[str, Path]) -> None:
    for flags, path in (((), "prefill"), (("--mla", "decode"), "decode")):
        res = runner.invoke(app, ["kld", str(real_heads["ik-f32.gguf"]), "--base-logits", str(REAL / "ik-base.kld"),
                                  "--numerics", "ik", *flags], env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output
        assert f"MLA {path} path" in res.stdout
