"""ik's two MLA computations (--mla prefill: keys and values through attn_kv_b; decode: absorbed through attn_k_b /
attn_v_b), files that carry attn_kv_b alone, --dsa-top-k, and the bad-input errors of both options, on the tiny
DeepSeek-V3 and GLM-5.2 (glm-dsa) golden models."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikquant.formats.cache_rows import cache_round_trip, cache_row_bytes
from ikquant.gguf_io import GGUFFile
from ikquant.types import type_by_name
from ikrun.cli import app
from ikrun.model import Model
from ikrun.numerics.exact import derived_k_b, derived_v_b
from ikrun.options import RuntimeOptions
from ikrun.validate.hf import compare_logits
from tests import ik_engine
from tests.test_ik_engine import mean_kld
from tests.test_runtime_deepseek2 import _rewrite

runner = CliRunner()
DATA = Path(__file__).parent / "data"
V3 = DATA / "convert" / "deepseek-v3" / "ik-f32.gguf"
GLM = DATA / "convert" / "glm-dsa" / "ref-f32.gguf"
QWEN3 = DATA / "convert" / "qwen3" / "ik-f32.gguf"
#: the tiny model's three main layers; 4 heads of nope 32 and value 32 over a latent of 32
LAYERS, N_HEAD, N_NOPE = range(3), 4, 32
PREFILL, DECODE = RuntimeOptions(mla="prefill"), RuntimeOptions(mla="decode")


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 320, n)


def _kv_b_alone(tmp_path: Path) -> Path:
    """The DeepSeek model without attn_k_b / attn_v_b (as mainline's converter or ik's own older files have it)."""
    drop = tuple(f"blk.{i}.attn_{k}_b.weight" for i in LAYERS for k in ("k", "v"))
    return _rewrite(V3, tmp_path / "kv_b-only.gguf", drop=drop)


def _quantized_kv_b(src: Path, dst: Path, gtype: str, cache_writer: bool = False) -> Path:
    """A copy of `src` whose attn_kv_b alone is stored as `gtype` (the rest as it is), by llama-quantize's codec or,
    `cache_writer`, by ik's ggml_cpy row quantizer (what ik's load-time derivations store)."""
    from ikquant.gguf_io import GGUFStreamWriter

    f = GGUFFile(src)
    codec = type_by_name(gtype).require_codec()
    quantize = (lambda rows: cache_row_bytes(gtype, rows)) if cache_writer else codec.quantize
    with GGUFStreamWriter(dst, f.architecture) as w:
        w.copy_kvs(f.kv())
        kv_b = {n for n in f.tensors if n.endswith("attn_kv_b.weight")}
        for t in f.tensors.values():
            w.add_tensor_info(t.name, t.shape, type_by_name(gtype) if t.name in kv_b else t.type)
        for t in f.tensors.values():
            w.write_tensor(t.name, quantize(f.dequantize(t.name)) if t.name in kv_b else f.raw(t.name))
        return w.finish()


# ---- the two paths ------------------------------------------------------------------------------------------------

def test_prefill_and_decode_compute_the_same_function_of_one_set_of_weights() -> None:
    """attn_kv_b holds what attn_k_b / attn_v_b hold in the converted file: both forms agree to float order."""
    tokens = _tokens(130)
    res = compare_logits(Model(V3, options=DECODE).logits(tokens), Model(V3, options=PREFILL).logits(tokens))
    assert res["max_rel_logit_err"] < 1e-5 and res["same_top"] == 1.0, res


@pytest.mark.parametrize("masked", [False, True])
def test_both_kernels_agree_on_one_set_of_weights(masked: bool) -> None:
    """ops/mla: the prefill form with attn_kv_b built from attn_k_b / attn_v_b is the absorbed form, with a DSA keep
    mask too (300 queries: more than one query block)."""
    from ikrun.ops.mla import latent_attention, materialized_attention

    rng = np.random.default_rng(5)
    n, h, r, c, d, v = 300, 3, 8, 32, 16, 24
    q_rope, q_nope = (rng.standard_normal((n, h, k)).astype(np.float32) for k in (r, d))
    cache = rng.standard_normal((n, r + c)).astype(np.float32)
    w_kb, w_vb = rng.standard_normal((h, c, d)).astype(np.float32), rng.standard_normal((h, v, c)).astype(np.float32)
    w_kvb = np.concatenate([w_kb.transpose(0, 2, 1), w_vb], axis=1).reshape(h * (d + v), c)
    keep = (rng.random((n, n)) < 0.3) | np.eye(n, dtype=bool) if masked else None
    absorbed = latent_attention(q_rope, q_nope, w_kb, cache, w_vb, 0.1, keep=keep)
    prefill = materialized_attention(q_rope, q_nope, cache, w_kvb, 0.1, keep=keep)
    np.testing.assert_allclose(prefill, absorbed, rtol=1e-4, atol=1e-4)
    if masked:  # the mask is honoured: without it the result differs
        assert not np.allclose(materialized_attention(q_rope, q_nope, cache, w_kvb, 0.1), prefill, atol=1e-3)


def test_auto_follows_iks_batch_rule_and_numerics() -> None:
    assert Model(V3).computed_paths(128) == {"mla_path": "prefill"}
    assert Model(V3).computed_paths(127) == {"mla_path": "decode"}
    ik = {"flash_attn": "on"}
    assert Model(V3, options=RuntimeOptions(numerics="ik")).computed_paths(128) == {"mla_path": "prefill", **ik}
    assert Model(V3, options=RuntimeOptions(numerics="ik")).computed_paths(127) == {"mla_path": "decode", **ik}
    fa_off = RuntimeOptions(numerics="ik", flash_attn="off")  # ik's -fa off graph takes the absorbed form always
    assert Model(V3, options=fa_off).computed_paths(512) == {"mla_path": "decode", "flash_attn": "off"}
    assert Model(V3, options=DECODE).computed_paths(512) == {"mla_path": "decode"}
    assert Model(QWEN3).computed_paths(512) == {}


def test_prefill_reads_attn_kv_b_and_decode_does_not(tmp_path: Path) -> None:
    """attn_kv_b alone quantized to Q4_0: the prefill form pays for it, the decode form is the f32 model's."""
    q4 = _quantized_kv_b(V3, tmp_path / "kv_b-q4_0.gguf", "Q4_0")
    tokens = _tokens(64, 1)
    np.testing.assert_array_equal(Model(q4, options=DECODE).logits(tokens), Model(V3, options=DECODE).logits(tokens))
    res = compare_logits(Model(V3, options=PREFILL).logits(tokens), Model(q4, options=PREFILL).logits(tokens))
    assert res["kld_mean"] > 1e-6, res
    assert Model(q4).unread_tensors(512) == {f"blk.{i}.attn_{k}_b.weight": "the MLA prefill path (--mla) does not "
                                             "read it" for i in LAYERS for k in ("k", "v")}
    assert set(Model(q4).unread_tensors(64)) == {f"blk.{i}.attn_kv_b.weight" for i in LAYERS}


def test_iks_default_run_reads_attn_kv_b_as_the_prefill_path_does(tmp_path: Path) -> None:
    """ik with its defaults (flash attention, mla 3; the PyPI wheel's build) on one batch of 160 tokens takes its
    attn_kv_b path: attn_kv_b alone in Q4_0 costs it 0.1135 (nothing with flash attention off), and ikrun's exact
    prefill form 0.1131 against ik's own f32 logits. The 0.4% between them is ik's arithmetic (activations rounded to
    8 bits for the Q4_0 product, its f16 flash-attention kernel), which --numerics ik does not reproduce on this
    path; the decode form does not see the tensor at all."""
    q4 = _quantized_kv_b(V3, tmp_path / "kv_b-q4_0.gguf", "Q4_0")
    tokens = [int(t) for t in np.load(DATA / "hf-logits" / "deepseek-v3" / "tokens.npy")[:3].reshape(-1)[:160]]
    ik_f32, ik_q4 = (ik_engine.logits(p, tokens, flash_attn=True) for p in (V3, q4))
    assert mean_kld(ik_f32, Model(V3, options=PREFILL).logits(np.array(tokens))) <= 1e-5
    theirs = mean_kld(ik_f32, ik_q4)
    assert theirs > 0.05  # ik pays for attn_kv_b
    assert mean_kld(ik_f32, Model(q4, options=PREFILL).logits(np.array(tokens))) == pytest.approx(theirs, rel=5e-3)
    assert mean_kld(ik_f32, Model(q4, options=DECODE).logits(np.array(tokens))) < 1e-5
    assert mean_kld(ik_engine.logits(V3, tokens), ik_engine.logits(q4, tokens)) == 0.0  # -fa off: absorbed form


#: ik's printed perplexity of the 12 chunks of 128 tokens its default-settings base files hold
FINAL_PPL = r"Final estimate: PPL over 12 chunks for n_ctx=128 = ([\d.]+)"


def _ik_printed(path: Path, pattern: str) -> float:
    m = re.search(pattern, path.read_bytes().decode(errors="replace"))
    assert m is not None, pattern
    return float(m.group(1))


def _kld(model: Path, base: Path, *flags: str) -> dict:
    res = runner.invoke(app, ["kld", str(model), "--base-logits", str(base), "--json", *flags])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_exact_prefill_reproduces_iks_default_llama_perplexity(tmp_path: Path) -> None:
    """ik's llama-perplexity with its defaults (-c 128 -b 128: its prefill path). The f32 file lands within
    1e-3 (a few MoE near-ties flipped by ik's f16 flash attention); attn_kv_b alone in Q4_0 costs what ik prints to
    0.3% (ik also rounds the latent to 8 bits for the Q4_0 product), and nothing on the decode path."""
    folder = DATA / "logits" / "deepseek-v3"
    base = folder / "ik-base-fa-c128.kld"
    f32 = _kld(V3, base)
    assert f32["mla_path"] == "prefill" and f32["kld_mean"] <= 1e-3 and f32["kld_median"] < 1e-5, f32
    ppl = _ik_printed(folder / "ik-f32-fa-c128-ppl.txt", FINAL_PPL)
    assert f32["ppl_base"] == pytest.approx(ppl, rel=1e-6)
    q4 = _quantized_kv_b(V3, tmp_path / "kv_b-q4_0.gguf", "Q4_0")
    theirs = _ik_printed(folder / "ik-kvb-q4_0-fa-c128-kld.txt", r"Mean\s+KLD:\s*([\d.]+)")
    assert _kld(q4, base)["kld_mean"] == pytest.approx(theirs, rel=3e-3)
    assert _kld(q4, base, "--mla", "decode")["kld_mean"] == pytest.approx(_kld(V3, base, "--mla", "decode")["kld_mean"])


def test_glm_dsa_default_run_is_closer_on_the_prefill_path() -> None:
    """GLM-5.2's file has no attn_kv_b; ik's default dense run uses the Q8_0 one it derives: ikrun's prefill form
    (with the same derivation) is nearer ik's digits than the decode form. Both stay above 1e-3 here (ik's 8-bit
    activations for the Q8_0 product and its flash attention; the file's reference run was made on AVX-512)."""
    folder = DATA / "logits" / "glm-dsa"
    prefill = _kld(GLM, folder / "ik-base-fa-c128.kld", "--dsa", "off")
    decode = _kld(GLM, folder / "ik-base-fa-c128.kld", "--dsa", "off", "--mla", "decode")
    assert prefill["mla_path"] == "prefill" and prefill["kld_mean"] < 0.8 * decode["kld_mean"], (prefill, decode)
    ppl = _ik_printed(folder / "ik-f32-fa-c128-ppl.txt", FINAL_PPL)
    assert prefill["ppl_base"] == pytest.approx(ppl, rel=1e-6)


def test_imatrix_collects_the_per_head_entries_unless_told_prefill(tmp_path: Path) -> None:
    from ikquant.imatrix import read_imatrix_dat

    names = {}
    for flags in ([], ["--mla", "prefill"]):
        out = tmp_path / f"imatrix{len(flags)}.dat"
        res = runner.invoke(app, ["imatrix", str(V3), "--text", str(DATA / "logits" / "deepseek-v3" / "text.txt"),
                                  "--ctx", "128", "--chunks", "2", "-o", str(out), *flags])
        assert res.exit_code == 0, res.output
        names[len(flags)] = set(read_imatrix_dat(out).entries)
    assert "blk.0.attn_k_b.weight" in names[0] and "blk.0.attn_kv_b.weight" not in names[0]
    assert "blk.0.attn_kv_b.weight" in names[2] and "blk.0.attn_k_b.weight" not in names[2]


def test_kld_report_names_the_path(tmp_path: Path) -> None:
    res = runner.invoke(app, ["ppl", str(V3), "--text", str(DATA / "logits" / "deepseek-v3" / "text.txt"),
                              "--ctx", "128", "--chunks", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["mla_path"] == "prefill"


# ---- files with attn_kv_b alone ----------------------------------------------------------------------------------

def test_a_file_with_attn_kv_b_alone_runs_both_paths(tmp_path: Path) -> None:
    path = _kv_b_alone(tmp_path)
    tokens = _tokens(64, 2)
    np.testing.assert_array_equal(Model(path, options=DECODE).logits(tokens),
                                  Model(V3, options=DECODE).logits(tokens))
    np.testing.assert_array_equal(Model(path, options=PREFILL).logits(tokens),
                                  Model(V3, options=PREFILL).logits(tokens))


def test_derived_k_b_is_iks_q8_0_for_a_quantized_attn_kv_b() -> None:
    """ik derives attn_k_b as Q8_0 of the transposed nope rows of a quantized attn_kv_b (written by ggml_cast, its
    cache writer's rounding, not llama-quantize's), attn_v_b as its rows."""
    kv_b = GGUFFile(V3).dequantize("blk.0.attn_kv_b.weight")
    q8 = type_by_name("Q8_0").require_codec()
    k_b = derived_k_b(kv_b, "Q4_0", N_HEAD, N_NOPE)
    exact = derived_k_b(kv_b, "F32", N_HEAD, N_NOPE)
    rows = exact.reshape(-1, N_NOPE)
    np.testing.assert_array_equal(k_b.reshape(-1, N_NOPE), cache_round_trip("Q8_0", rows))
    assert not np.array_equal(k_b.reshape(-1, N_NOPE), q8.dequantize(q8.quantize(rows), N_NOPE))
    np.testing.assert_array_equal(exact, GGUFFile(V3).dequantize("blk.0.attn_k_b.weight").reshape(exact.shape))
    assert 0 < np.abs(k_b - exact).max() < 0.01 * np.abs(exact).max()
    np.testing.assert_array_equal(derived_v_b(kv_b, N_HEAD, N_NOPE).reshape(-1, kv_b.shape[1]),
                                  GGUFFile(V3).dequantize("blk.0.attn_v_b.weight").reshape(-1, kv_b.shape[1]))


def test_a_swap_of_attn_kv_b_reaches_the_derived_tensors(tmp_path: Path) -> None:
    path = _kv_b_alone(tmp_path)
    q4 = _quantized_kv_b(path, tmp_path / "kv_b-only-q4_0.gguf", "Q4_0")
    tokens = _tokens(64, 3)
    m = Model(path, options=DECODE)
    before = m.logits(tokens)
    m.swap_from_file("blk.1.attn_kv_b.weight", q4)
    assert compare_logits(before, m.logits(tokens))["kld_mean"] > 0
    m.restore()
    np.testing.assert_array_equal(m.logits(tokens), before)


# ---- --dsa-top-k --------------------------------------------------------------------------------------------------

def test_dsa_top_k_replaces_the_files() -> None:
    tokens = np.load(DATA / "hf-logits" / "glm-dsa" / "tokens.npy")[0]
    n = len(tokens)
    default = Model(GLM).logits(tokens)
    same = Model(GLM, options=RuntimeOptions(dsa_top_k=int(GGUFFile(GLM).get("glm-dsa.attention.indexer.top_k")))
                 ).logits(tokens)
    np.testing.assert_array_equal(same, default)
    fewer = Model(GLM, options=RuntimeOptions(dsa_top_k=4)).logits(tokens)
    assert compare_logits(default, fewer)["kld_mean"] > 1e-4
    every = Model(GLM, options=RuntimeOptions(dsa_top_k=n)).logits(tokens)  # every key kept: dense attention
    res = compare_logits(Model(GLM, options=RuntimeOptions(dsa=False)).logits(tokens), every)
    assert res["max_rel_logit_err"] < 1e-5 and res["same_top"] == 1.0, res


# ---- bad input ----------------------------------------------------------------------------------------------------

def _refused(args: list[str], *named: str) -> None:
    res = runner.invoke(app, args, env={"COLUMNS": "250"})
    assert res.exit_code == 2, res.output
    for text in named:
        assert text in res.output, res.output


@pytest.mark.parametrize(("model", "flags", "named"), [
    (QWEN3, ["--mla", "prefill"], ("--mla", "qwen3")),
    (V3, ["--dsa-top-k", "8"], ("--dsa-top-k", "deepseek2")),
    (GLM, ["--dsa-top-k", "65"], ("--dsa-top-k 65", "context of 64 tokens")),
    (GLM, ["--dsa-top-k", "8", "--dsa", "off"], ("--dsa-top-k", "--dsa off")),
])
def test_bad_options_are_refused_before_compute(model: Path, flags: list[str], named: tuple[str, ...]) -> None:
    _refused(["ppl", str(model), "--text", str(DATA / "logits" / "deepseek-v3" / "text.txt"), "--ctx", "64",
              *flags], *named)


def test_a_file_without_attn_kv_b_runs_prefill_on_iks_q8_0_derivation(tmp_path: Path) -> None:
    """ik derives attn_kv_b from attn_k_b / attn_v_b as Q8_0 (an F32 pair too) with ggml_cast: the same as a file
    whose attn_kv_b is stored as Q8_0 by ik's cache writer; the sweep then measures attn_k_b / attn_v_b under both
    forms."""
    no_kv_b = _rewrite(V3, tmp_path / "no-kv_b.gguf", drop=tuple(f"blk.{i}.attn_kv_b.weight" for i in LAYERS))
    q8 = _quantized_kv_b(V3, tmp_path / "kv_b-q8_0.gguf", "Q8_0", cache_writer=True)
    tokens = _tokens(64, 4)
    np.testing.assert_array_equal(Model(no_kv_b, options=PREFILL).logits(tokens),
                                  Model(q8, options=PREFILL).logits(tokens))
    assert Model(no_kv_b).unread_tensors(512) == {} == Model(no_kv_b).unread_tensors(64)
    m = Model(no_kv_b, options=PREFILL)
    before = m.logits(tokens)
    src = GGUFFile(V3)
    for name in ("blk.1.attn_v_b.weight", "blk.1.attn_k_b.weight"):  # a swap of either reaches the derived tensor
        m.swap(name, type_by_name("Q4_0"), type_by_name("Q4_0").require_codec().quantize(src.dequantize(name)))
        assert compare_logits(before, m.logits(tokens))["kld_mean"] > 0
        m.restore()
        np.testing.assert_array_equal(m.logits(tokens), before)


def _with_iks_derived_heads(src: Path, dst: Path) -> Path:
    """A copy of `src` (attn_kv_b in Q4_0) that also stores attn_k_b / attn_v_b as ik derives them at load: the
    transposed nope rows as Q8_0 by its cache writer, the value rows' Q4_0 bytes as they are."""
    from ikquant.gguf_io import GGUFStreamWriter

    f = GGUFFile(src)
    q8, q4 = type_by_name("Q8_0"), type_by_name("Q4_0")
    with GGUFStreamWriter(dst, f.architecture) as w:
        w.copy_kvs(f.kv())
        for t in f.tensors.values():
            w.add_tensor_info(t.name, t.shape, t.type)
        for i in LAYERS:
            w.add_tensor_info(f"blk.{i}.attn_k_b.weight", (N_HEAD * 32, N_NOPE), q8)
            w.add_tensor_info(f"blk.{i}.attn_v_b.weight", (N_HEAD * 32, 32), q4)
        for t in f.tensors.values():
            w.write_tensor(t.name, f.raw(t.name))
        for i in LAYERS:
            kv_b = f.dequantize(f"blk.{i}.attn_kv_b.weight").reshape(N_HEAD, -1, 32)
            k_rows = kv_b[:, :N_NOPE].transpose(0, 2, 1).reshape(-1, N_NOPE)
            w.write_tensor(f"blk.{i}.attn_k_b.weight", cache_row_bytes("Q8_0", np.ascontiguousarray(k_rows)))
            raw = f.raw(f"blk.{i}.attn_kv_b.weight").reshape(N_HEAD, -1, q4.row_bytes(32))
            w.write_tensor(f"blk.{i}.attn_v_b.weight", np.ascontiguousarray(raw[:, N_NOPE:]).reshape(-1, q4.row_bytes(32)))
        return w.finish()


def test_numerics_ik_derives_attn_k_b_and_attn_v_b_as_iks_load(tmp_path: Path) -> None:
    """Under --numerics ik a file with attn_kv_b alone runs on the heads ik derives (Q8_0 by its cache writer from
    a quantized attn_kv_b, the value rows in attn_kv_b's type): the logits of a file storing exactly those, bit for
    bit; an F32 attn_kv_b gives the original file's."""
    ik = RuntimeOptions(numerics="ik")
    tokens = _tokens(64, 5)
    np.testing.assert_array_equal(Model(_kv_b_alone(tmp_path), options=ik).logits(tokens),
                                  Model(V3, options=ik).logits(tokens))
    q4_alone = _quantized_kv_b(_kv_b_alone(tmp_path), tmp_path / "kv_b-only-q4_0.gguf", "Q4_0")
    stored = _with_iks_derived_heads(q4_alone, tmp_path / "heads.gguf")
    derived = Model(q4_alone, options=ik).logits(tokens)
    np.testing.assert_array_equal(derived, Model(stored, options=ik).logits(tokens))
    assert compare_logits(Model(V3, options=ik).logits(tokens), derived)["kld_mean"] > 0


def test_numerics_ik_runs_a_3d_attn_k_b() -> None:
    """GLM-5.2's file stores attn_k_b as [heads, latent, nope] (3-D): ik's dense run (-fa off) to within its f16
    cache's near-ties (it crashed here, taking one row per head)."""
    res = _kld(GLM, DATA / "logits" / "glm-dsa" / "ik-base.kld", "--dsa", "off", "--numerics", "ik")
    assert res["kld_mean"] < 1e-6 and res["same_top_p"] == 1.0, res


# ---- sweeps and mixes ---------------------------------------------------------------------------------------------

MLA_TENSORS = r"attn_k?v?_b"


def _mla_sweep(out: Path, *flags: str) -> dict:
    res = runner.invoke(app, ["sweep", str(V3), "--text", str(DATA / "logits" / "deepseek-v3" / "text.txt"), "--ctx",
                              "128", "--chunks", "2", "--types", "Q4_0,Q8_0", "--tensors", MLA_TENSORS, "-o",
                              str(out), *flags], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "left unmeasured" in res.output
    return json.loads(out.read_text())


def _mix(sweep: Path, out: Path) -> tuple[dict[str, str], str]:
    """The types ikquant's mix gives the MLA tensors at the most generous budget a mix may have (the tensor bytes of
    the plain Q8_0 file: nothing has to be starved), and its output."""
    from ikquant.cli import app as ikquant_app

    plain = out.with_name("plain-q8_0.gguf")
    assert runner.invoke(ikquant_app, [str(V3), str(plain), "--type", "q8_0"]).exit_code == 0
    size = sum(t.nbytes for t in GGUFFile(plain).tensors.values())
    res = runner.invoke(ikquant_app, [str(V3), str(out), "--type", "q8_0", "--sweep", str(sweep), "--target-size",
                                      str(size)], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    return {n: t.type.name for n, t in GGUFFile(out).tensors.items() if "_b.weight" in n}, res.output


def test_prefill_sweep_measures_attn_kv_b_and_its_mix_keeps_it(tmp_path: Path) -> None:
    sweep = _mla_sweep(tmp_path / "prefill.json")
    assert sweep["runtime"]["mla_path"] == "prefill"
    assert set(sweep["unmeasured"]) == {f"blk.{i}.attn_{k}_b.weight" for i in LAYERS for k in ("k", "v")}
    rows = {(r["group"], r["type"]): r["kld_mean"] for r in sweep["rows"]}
    assert {g for g, _ in rows} == {f"blk.{i}.attn_kv_b.weight" for i in LAYERS}
    assert all(rows[(f"blk.{i}.attn_kv_b.weight", "Q4_0")] > 10 * max(rows[(f"blk.{i}.attn_kv_b.weight", "Q8_0")],
                                                                      1e-9) for i in LAYERS)
    types, output = _mix(tmp_path / "prefill.json", tmp_path / "prefill-mix.gguf")
    assert all(types[f"blk.{i}.attn_kv_b.weight"] == "Q8_0" for i in LAYERS)  # measured, worth its bits
    assert "6 tensors unmeasured by the sweep keep the recipe's type" in output


def test_decode_sweep_leaves_attn_kv_b_unmeasured_and_its_mix_at_the_recipes_type(tmp_path: Path) -> None:
    sweep = _mla_sweep(tmp_path / "decode.json", "--mla", "decode")
    assert sweep["runtime"]["mla_path"] == "decode"
    assert set(sweep["unmeasured"]) == {f"blk.{i}.attn_kv_b.weight" for i in LAYERS}
    assert all("attn_kv_b" not in r["group"] for r in sweep["rows"])
    types, output = _mix(tmp_path / "decode.json", tmp_path / "decode-mix.gguf")
    assert all(types[f"blk.{i}.attn_kv_b.weight"] == "Q8_0" for i in LAYERS)
    assert "3 tensors unmeasured by the sweep keep the recipe's type" in output


def test_batches_under_128_tokens_sweep_the_decode_path_and_the_mix_is_measured_there(tmp_path: Path) -> None:
    """ik feeds a chunk in micro-batches of -ub tokens and takes the absorbed form below 128: a sweep --batch 64
    at --ctx 128 measures attn_k_b / attn_v_b and leaves attn_kv_b unmeasured, and `ikrun mix` measures its file
    at the sweep's batches, as `ikrun kld --batch 64` does (whole chunks take the prefill path: another figure)."""
    from ikquant.cli import app as ikquant_app

    assert Model(V3).computed_paths(256, 192) == {"mla_path": "prefill (192-token batches) + decode (64-token batches)"}
    assert {n for n in Model(V3).unread_tensors(256, 192) if "_b." in n} == set()
    assert set(Model(V3).unread_tensors(256, 64)) == {f"blk.{i}.attn_kv_b.weight" for i in LAYERS}
    sweep = _mla_sweep(tmp_path / "batched.json", "--batch", "64")
    assert sweep["batch"] == 64 and sweep["runtime"]["mla_path"] == "decode"
    assert set(sweep["unmeasured"]) == {f"blk.{i}.attn_kv_b.weight" for i in LAYERS}
    plain = tmp_path / "plain-q8_0.gguf"
    assert runner.invoke(ikquant_app, [str(V3), str(plain), "--type", "q8_0"]).exit_code == 0
    size = sum(t.nbytes for t in GGUFFile(plain).tensors.values())
    out = tmp_path / "mix.gguf"
    res = runner.invoke(app, ["mix", str(V3), str(out), "--sweep", str(tmp_path / "batched.json"), "--type", "q8_0",
                              "--target-size", str(size), "--json"])
    assert res.exit_code == 0, res.output
    measured = json.loads(res.stdout)[0]["kld_mean"]
    text = DATA / "logits" / "deepseek-v3" / "text.txt"
    kld = {}
    for flags in (["--batch", "64"], []):
        r = runner.invoke(app, ["kld", str(out), "--base", str(V3), "--text", str(text), "--ctx", "128", "--chunks",
                                "2", "--json", *flags])
        assert r.exit_code == 0, r.output
        kld[bool(flags)] = json.loads(r.stdout)["kld_mean"]
    assert measured == pytest.approx(kld[True], rel=1e-12)
    assert abs(kld[False] - kld[True]) > 1e-3 * kld[True]


def test_the_nextn_block_is_unmeasured() -> None:
    """GLM-5.2's NextN block (blk.7) takes no part in the main forward: a sweep cannot measure it."""
    from ikrun.sweep.measure import sweep_groups, unmeasured_tensors

    model = Model(GLM)
    nextn = unmeasured_tensors(model, 64, r"^blk\.7\.")
    assert "blk.7.nextn.eh_proj.weight" in nextn and "blk.7.attn_output.weight" in nextn
    assert not any(n.startswith("blk.7.") for names in sweep_groups(model, "tensor", None, 64).values() for n in names)
    assert any(n.startswith("blk.7.") for n in sweep_groups(model, "tensor"))


def test_a_mix_never_chooses_on_a_cost_of_zero(tmp_path: Path) -> None:
    """A sweep that scored an unread tensor at zero at every type: the mix leaves it to the recipe. In an older
    sweep (no `kld_added`: the cost is kld_mean) zero or below; in a new one exactly zero (a swap that changed no
    logit), where a cost a little below zero is a read tensor's, measured within its paired error."""
    from ikquant.mix import read_sweep

    sweep = _mla_sweep(tmp_path / "prefill.json")
    del sweep["unmeasured"]
    assert sweep["cost"] == "kld_added"
    old = {k: v for k, v in sweep.items() if k != "cost"}
    old["rows"] = [{**{k: v for k, v in r.items() if not k.startswith("kld_added")},
                    **({"kld_mean": 0.0} if r["group"] == "blk.2.attn_kv_b.weight" else {})} for r in sweep["rows"]]
    (tmp_path / "old.json").write_text(json.dumps(old))
    groups, options, unmeasured = read_sweep(tmp_path / "old.json")
    assert set(groups) == {"blk.0.attn_kv_b.weight", "blk.1.attn_kv_b.weight"} == set(options)
    assert list(unmeasured) == ["blk.2.attn_kv_b.weight"]

    def costs(r: dict) -> dict:
        return {"kld_added": {"blk.1.attn_kv_b.weight": -1e-9, "blk.2.attn_kv_b.weight": 0.0}.get(r["group"],
                                                                                                 r["kld_added"])}

    sweep["rows"] = [{**r, **costs(r)} for r in sweep["rows"]]
    (tmp_path / "new.json").write_text(json.dumps(sweep))
    groups, options, unmeasured = read_sweep(tmp_path / "new.json")
    assert set(groups) == {"blk.0.attn_kv_b.weight", "blk.1.attn_kv_b.weight"} == set(options)
    assert list(unmeasured) == ["blk.2.attn_kv_b.weight"]
    assert all(o.kld == 0.0 for o in options["blk.1.attn_kv_b.weight"])  # below zero: no cost, but chosen for
