"""`--numerics ik --mla prefill`: ik's flash-attention kernels on the keys and values ik materialises through
attn_kv_b, against a native AVX2 ik: its own iqk kernel (ikrun/numerics/ik/iqk_flash_attention.py) bit for bit
against ggml_flash_attn_ext (tests/data/flash-attention/iqk-avx2), ggml's generic one (flash_attention.py) on the
tiny DeepSeek-V3's 48/32 heads against ik's default run (flash attention on, mla 3; tests/data/logits/
deepseek-v3-fa-avx2)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ikrun.cli import app
from ikrun.numerics.ik.arithmetic import IQK_FA_HEADS
from ikrun.numerics.ik.flash_attention import flash_attention_f16
from ikrun.numerics.ik.iqk_flash_attention import avx2_expf, iqk_flash_attention_f16, k_step_for
from tests.iqk_fa_cases import CASES, case_inputs
from tests.test_mla_paths import _quantized_kv_b

runner = CliRunner()
DATA = Path(__file__).parent / "data"
V3 = DATA / "convert" / "deepseek-v3" / "ik-f32.gguf"
FOLDER = DATA / "logits" / "deepseek-v3-fa-avx2"
IQK_OUTPUTS = DATA / "flash-attention" / "iqk-avx2" / "outputs.npz"


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
    flash_attention_f16(q, k, v, 0.2, 0, out)
    np.testing.assert_array_equal(out[:, 0], v[:, 0])
    s = np.einsum("htd,hsd->hts", _f16(q).astype(np.float64), k.astype(np.float64)) * 0.2
    s[:, np.triu_indices(40, 1)[0], np.triu_indices(40, 1)[1]] = -np.inf
    p = np.exp(s - s.max(axis=2, keepdims=True))
    ref = (p / p.sum(axis=2, keepdims=True)) @ v.astype(np.float64)
    np.testing.assert_allclose(out, ref, atol=4e-3)
    assert not np.array_equal(out, ref.astype(np.float32))


def test_f32_prefill_is_iks_default_run() -> None:
    """ik's default run of the F32 file: --numerics ik lands at KLD 4e-7 of ik's base (PPL 490.9671 where ik prints
    490.9511), the exact arithmetic at 2e-4."""
    ours = _kld(V3, "--numerics", "ik")
    assert ours["mla_path"] == "prefill" and ours["kld_mean"] < 1e-6, ours["kld_mean"]
    assert _kld(V3)["kld_mean"] > 100 * ours["kld_mean"]


def test_a_q4_0_attn_kv_b_costs_what_ik_prints(tmp_path: Path) -> None:
    """attn_kv_b alone in Q4_0 (the latent rounded to 8 bits for its product): ik prints 0.086238; --numerics ik
    0.086241, the exact arithmetic 0.0881."""
    q4 = _quantized_kv_b(V3, tmp_path / "kvb-q4_0.gguf", "Q4_0")
    text = (FOLDER / "ik-kvb-q4_0-kld.txt").read_bytes().decode(errors="replace")
    m = re.search(r"Mean\s+KLD:\s*([\d.]+)", text)
    assert m is not None
    theirs = float(m.group(1))
    assert _kld(q4, "--numerics", "ik")["kld_mean"] == pytest.approx(theirs, rel=1e-4)
    assert _kld(q4)["kld_mean"] != pytest.approx(theirs, rel=1e-2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_iqk_kernel_is_iks_bit_for_bit(case: Any) -> None:
    """ik's ggml_flash_attn_ext (native AVX2 build, its iqk kernel) on the same inputs gave these very bits, whatever
    its thread count and the rows it tiles together; keys past the last visible one are skipped (ik weighs them 0)."""
    q, k, v, scale = case_inputs(case)
    n_keys = case.first + case.n_q
    out = np.empty((case.n_head, case.n_q, case.dv), dtype=np.float32)
    iqk_flash_attention_f16(q, np.ascontiguousarray(k[:, :n_keys], dtype=np.float32),
                            np.ascontiguousarray(v[:, :n_keys], dtype=np.float32), float(scale), case.first,
                            k_step_for(case.dk, case.dv, case.n_kv), out)
    with np.load(IQK_OUTPUTS) as theirs:
        np.testing.assert_array_equal(out, theirs[case.name])


def test_every_head_size_of_iks_kernels_is_checked() -> None:
    assert {(c.dk, c.dv) for c in CASES} == set(IQK_FA_HEADS)


def test_the_avx2_exponential_is_not_expf_and_ends_at_0_and_inf() -> None:
    x = np.linspace(-120, 0, 100001, dtype=np.float32)
    ours = np.array([avx2_expf(np.float32(t)) for t in x[::97]])
    np.testing.assert_allclose(ours, np.exp(x[::97].astype(np.float64)), rtol=3e-7, atol=1e-45)
    assert (ours != np.exp(x[::97])).any()
    assert avx2_expf(np.float32(-np.inf)) == 0 and avx2_expf(np.float32(-200.0)) == 0
    assert avx2_expf(np.float32(0.0)) == 1 and avx2_expf(np.float32(200.0)) == np.inf
