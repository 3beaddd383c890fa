"""The hybrid linear-attention runtime (`qwen3next`, `qwen35moe`) on the reference files ik's runtime loads: against
transformers' logits and ik's base logits, ik's printed Q8_0 figures, the delta rule's chunked form against its
recurrence, streaming, imatrix (and the sweep and mix it guides), hot swap, a sequence continued through its cache (and rolled back) against the whole,
the refusals of hyperparameters it does not implement, and files holding the fused ssm_in against the split ones."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ikquant.cli import app as ikquant_app
from ikquant.gguf_io import GGUFFile, GGUFStreamWriter
from ikquant.imatrix import read_imatrix_dat
from ikquant.types import type_by_name
from ikrun.cli import app
from ikrun.eval.speculative import TargetDecoder, greedy_continuation, speculative_generate
from ikrun.model import Model
from ikrun.numerics.ik.delta_net import ik_delta_rule
from ikrun.ops.conv import causal_conv_silu
from ikrun.ops.delta_net import delta_rule_chunked, delta_rule_recurrent
from ikrun.options import RuntimeOptions
from tests.family_checks import (
    assert_iks_forward,
    assert_imatrix_equals_iks,
    assert_streamed_equals_chunk_by_chunk,
    ik_quantized,
    kld_json,
)
from tests.test_hot_reload import _copy_with, _requantized
from tests.test_ik_engine import mean_kld
from tests.test_numerics import _printed

runner = CliRunner()
DATA = Path(__file__).parent / "data"
FAMILIES = ["qwen3-next", "qwen35-moe"]
SCORED = slice(32, 63)  # the positions ik scores in a 64-token chunk


def _f32(family: str) -> Path:
    return DATA / "convert" / family / "ref-f32.gguf"


@pytest.mark.parametrize("family", FAMILIES)
def test_runtime_against_transformers_and_iks_base_logits(family: str) -> None:
    tokens = np.load(DATA / "hf-logits" / family / "tokens.npy")
    ref = np.load(DATA / "hf-logits" / family / "logits.npy")
    model = Model(_f32(family))
    got = np.stack([model.logits(t) for t in tokens])
    assert mean_kld(ref[:, SCORED].reshape(-1, ref.shape[-1]), got[:, SCORED].reshape(-1, ref.shape[-1])) <= 1e-6
    logits = DATA / "logits" / family
    assert kld_json(_f32(family), logits / "ik-base-ctk-f32.kld")["kld_mean"] <= 1e-6
    for extra in ([], ["--kv-cache", "f16"]):
        report = kld_json(_f32(family), logits / "ik-base.kld", *extra)
        assert report["kld_mean"] <= 1e-6 and report["same_top_p"] == 1.0


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_file_gives_iks_printed_weight_error(family: str) -> None:
    """The exact arithmetic measures the stored weights alone: ik's run on the Q8_0 file dequantized to F32 (whose
    own float order moves each token's KL by ~1e-7, so the printed digits agree to about that, not to the last)."""
    ik = _printed(DATA / "logits" / family / "ik-q8_0-as-f32-kld.txt")
    got = kld_json(DATA / "convert" / family / "ref-q8_0.gguf", DATA / "logits" / family / "ik-base.kld")
    assert abs(got["kld_mean"] - ik["kld_mean"]) <= 1e-6
    assert abs(got["same_top_p"] - ik["same_top_p"]) <= 5.01e-6  # 3 decimals of a percentage
    for key in ("kld_max", "ppl_q", "ppl_base"):
        assert abs(got[key] - ik[key]) <= 1e-5 * ik[key], (key, got[key], ik[key])


def _assert_prints(got: dict[str, Any], ik: dict[str, float]) -> None:
    """Every figure of ik's KLD report (`ik`) is ours to its printed digits: 6 decimals, the same top p 3 decimals of
    a percentage."""
    for key, value in ik.items():
        assert abs(got[key] - value) <= (5.01e-6 if key == "same_top_p" else 5.01e-7), (key, got[key], value)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("source", "ftype", "report"), [("ref-q8_0.gguf", "F32", "ik-q8_0-as-f32-kld.txt"),
                                                         ("ref-f32.gguf", "BF16", "ik-bf16-kld.txt")],
                         ids=["q8_0-as-f32", "bf16"])
def test_numerics_ik_prints_iks_report_of_float_files(family: str, source: str, ftype: str, report: str,
                                                      tmp_path: Path) -> None:
    """ik's runs on float files llama-quantize wrote (ikquant writes them byte for byte): its Q8_0 file dequantized to
    F32 and ref-f32 in BF16 (its bf16 kernel on bf16-rounded activations). With ik's float order every figure of its
    report to the printed digits (Q8_0 as F32: mean KLD 0.015608 / 0.016474, max 1.168498 / 1.320835, PPL(Q)
    544.119642 / 511.207656, where the exact arithmetic gives max 1.168495, PPL(Q) 544.118691; BF16: mean KLD
    0.001432 / 0.000783, PPL(Q) 541.752766 / 514.621027, same top 95.108% / 96.290%)."""
    model = ik_quantized(DATA / "convert" / family / source, tmp_path / f"{ftype}.gguf", ftype)
    got = kld_json(model, DATA / "logits" / family / "ik-base.kld", "--numerics", "ik")
    _assert_prints(got, _printed(DATA / "logits" / family / report))


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
def test_chunked_delta_rule_equals_its_recurrence(tiled: bool) -> None:
    """150 tokens (two whole chunks and a part), 2 key heads shared by 4 value heads: the chunked prompt form and
    the token-by-token recurrence agree to float32 rounding, whatever the chunk length."""
    rng = np.random.default_rng(7)
    n, hk, hv, dk, dv = 150, 2, 4, 32, 16
    q, k = rng.normal(size=(n, hk, dk)).astype(np.float32), rng.normal(size=(n, hk, dk)).astype(np.float32)
    v = rng.normal(size=(n, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 0.5, size=(n, hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(n, hv)).astype(np.float32)
    heads = np.arange(hv) % hk if tiled else np.arange(hv) // 2
    step = delta_rule_recurrent(q, k, v, g, beta, heads)
    for chunk in (64, 16, 150):
        np.testing.assert_allclose(delta_rule_chunked(q, k, v, g, beta, heads, chunk), step, rtol=0, atol=2e-6)
    # the head order matters: the other one is another function
    assert np.abs(delta_rule_recurrent(q, k, v, g, beta, heads[::-1].copy()) - step).max() > 0.1


def test_iks_delta_net_kernels_compute_the_same_functions() -> None:
    """ik's float orders (--numerics ik) of the conv + SiLU and of its fused delta rule (its own L2 norm epsilon,
    token by token) against the exact ones."""
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.5, size=(32, 4)).astype(np.float32)
    x = rng.normal(size=(40, 32)).astype(np.float32)
    np.testing.assert_allclose(causal_conv_silu(x, w, ik=True), causal_conv_silu(x, w), rtol=0, atol=1e-6)
    n, hk, hv, d = 70, 2, 4, 32
    q, k = rng.normal(size=(n, hk, d)).astype(np.float32), rng.normal(size=(n, hk, d)).astype(np.float32)
    v = rng.normal(size=(n, hv, d)).astype(np.float32)
    g = -rng.uniform(0.0, 0.5, size=(n, hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(n, hv)).astype(np.float32)
    for heads in (np.arange(hv) // 2, np.arange(hv) % hk):
        np.testing.assert_allclose(ik_delta_rule(q, k, v, g, beta, heads, 1e-6),
                                   delta_rule_recurrent(q, k, v, g, beta, heads), rtol=0, atol=2e-6)


def test_the_delta_rule_continues_from_a_state() -> None:
    """A sequence in pieces, each from the state the last one left: the exact forms give the whole sequence's output
    to float32 rounding (chunk boundaries move), ik's token-by-token kernel to the bit."""
    rng = np.random.default_rng(5)
    n, hk, hv, d = 90, 2, 4, 32
    q, k = rng.normal(size=(n, hk, d)).astype(np.float32), rng.normal(size=(n, hk, d)).astype(np.float32)
    v = rng.normal(size=(n, hv, d)).astype(np.float32)
    g = -rng.uniform(0.0, 0.5, size=(n, hv)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, size=(n, hv)).astype(np.float32)
    heads = np.arange(hv) // 2
    cuts = [(0, 30), (30, 31), (31, 40), (40, 90)]
    forms = [(delta_rule_chunked, lambda *a: delta_rule_chunked(*a[:6], state=a[6]), 2e-6),
             (delta_rule_recurrent, delta_rule_recurrent, 2e-6),
             (lambda *a: ik_delta_rule(*a, 1e-6), lambda *a: ik_delta_rule(*a[:6], 1e-6, a[6]), 0.0)]
    for whole_form, piece_form, atol in forms:
        whole = whole_form(q, k, v, g, beta, heads)
        state = np.zeros((hv, d, d), dtype=np.float32)
        pieces = np.concatenate([piece_form(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], heads, state)
                                 for a, b in cuts])
        np.testing.assert_allclose(pieces, whole, rtol=0, atol=atol)
        assert np.abs(whole_form(q[40:], k[40:], v[40:], g[40:], beta[40:], heads) - whole[40:]).max() > 0.01


def _decoded(model: Model, tokens: np.ndarray, calls: list[tuple[int, int]], keep: dict[int, int]) -> np.ndarray:
    """Logits of `tokens` fed through the cache in calls [a, b), each call i followed by keep(keep[i]) if given;
    the logits of rows a call kept."""
    dec, rows = TargetDecoder(model, []), []
    for i, (a, b) in enumerate(calls):
        logits, _ = dec.run(tokens[a:b])
        rows.append(logits[: keep.get(i, b) - a])
        if i in keep:
            dec.keep(keep[i])
    return np.concatenate(rows)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("numerics", ["exact", "ik"])
def test_a_continued_sequence_equals_the_whole(family: str, numerics: str) -> None:
    """A prompt, single tokens, a block and the rest fed through the cache (conv tails, delta-net states, keys and
    values), and a verified block of 8 of which 3 positions are kept: the whole sequence's logits, bit for bit under
    ik's token-by-token arithmetic; the exact one moves chunk boundaries and its matmuls round by row count (1e-4
    on logits). Rolling back further than the last call is a bug, refused."""
    model = Model(_f32(family), options=RuntimeOptions(numerics=numerics))
    tokens = np.load(DATA / "hf-logits" / family / "tokens.npy")[0][:64]
    whole = model.impl.forward(tokens)
    pieces = _decoded(model, tokens, [(0, 20), (20, 21), (21, 22), (22, 31), (31, 64)], {})
    rolled = _decoded(model, tokens, [(0, 20), (20, 28), (23, 40), (40, 64)], {1: 23})
    fresh = model.impl.forward(tokens[31:])  # the same tokens without their past
    atol = 0.0 if numerics == "ik" else 1e-4
    for got in (pieces, rolled):
        np.testing.assert_allclose(got, whole, rtol=0, atol=atol)
    assert np.abs(fresh - whole[31:]).max() > 0.1
    dec = TargetDecoder(model, [])
    dec.run(tokens[:20])
    dec.run(tokens[20:28])
    with pytest.raises(ValueError, match="rolls back only within its last call"):
        dec.keep(19)


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_decoding_with_a_hybrid_target_gives_its_greedy_continuation(family: str, tmp_path: Path) -> None:
    """The qwen3moe pair's DFlash draft (it fits these targets' width, vocabulary, tokenizer and layers, though it
    learned another target) drafts blocks of 8 that the hybrid target mostly rejects, so nearly every step rolls
    7 positions back out of the delta-net states: the output is still the target's own greedy continuation, through
    its cache token by token and by one forward over the whole output."""
    from ikconvert.convert import Converter

    shape = DATA / "dflash" / "shapes" / "qwen3moe"
    draft = Converter(shape / "hf", "f32", "qwen2", arch_options={"target_model_dir": str(shape / "target")}).write(
        tmp_path / "draft.gguf")
    target = Model(_f32(family))
    prompt = np.load(DATA / "hf-logits" / family / "tokens.npy")[0][:24]
    run = speculative_generate(target, Model(draft), prompt, 48)
    assert run.output_ids == greedy_continuation(target, prompt, 48)
    whole = target.impl.forward(np.array(run.output_ids[:-1]))
    assert run.output_ids[24:] == np.argmax(whole[23:], axis=-1).tolist()
    assert len(run.acceptance_lengths) > 40 and min(run.acceptance_lengths) == 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("key_cache", [None, "f32"], ids=["f16-cache", "ctk-f32"])
def test_numerics_ik_is_iks_forward_of_the_f32_file(family: str, key_cache: str | None, tmp_path: Path) -> None:
    """F32 weights leave every rounding of ik's arithmetic in its logits (no 8-bit activations round small
    differences away): our --save-base-logits file is ik's byte for byte, with its default F16 cache and with
    -ctk f32, and every running PPL ik printed is ours (541.2250 / 514.8854; -ctk f32 541.2251 / 514.8853). The
    delta-net kernel's v' = v beta - p (beta decay) as the fused multiply-add GCC makes of it decides this: computed
    as written, 71% of the positions' header floats differ from ik's and 58 / 12 of the 60 printed PPLs miss their
    last digit."""
    suffix = "" if key_cache is None else "-ctk-f32"
    logits = DATA / "logits" / family
    model = Model(_f32(family), options=RuntimeOptions(numerics="ik"), cache_type_k=key_cache)
    assert_iks_forward(model, logits / f"ik-base{suffix}.kld", logits / f"ik-f32{suffix}-ppl.txt", tmp_path / "b.kld")


@pytest.mark.parametrize("family", FAMILIES)
def test_numerics_ik_on_the_q8_0_file_prints_iks_figures(family: str) -> None:
    """ik's matmuls with its 8-bit activations, its delta-net kernels, norms and gates, its fused softmax top-k
    router (iqk_topk_moe), its residual order after the MoE ((routed + input) + shared) and its per-chunk kernel
    choice for the routed experts: every figure of ik's report to its printed digits (mean KLD 0.020644 / 0.023922;
    without the router or the residual order some chunks' PPL moves by up to 2e-4 relative, and the mean KLD misses
    by 3e-6 / 1e-6)."""
    got = kld_json(DATA / "convert" / family / "ref-q8_0.gguf", DATA / "logits" / family / "ik-base.kld",
                   "--numerics", "ik")
    _assert_prints(got, _printed(DATA / "logits" / family / "ik-q8_0-kld.txt"))


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_equals_chunk_by_chunk(family: str) -> None:
    assert_streamed_equals_chunk_by_chunk(_f32(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_imatrix_equals_iks(family: str, tmp_path: Path) -> None:
    """Every weight ik records, the delta-net's projections (attn_qkv, attn_gate, ssm_ba or ssm_beta/ssm_alpha,
    ssm_out) and the shared expert's gate included."""
    logits = DATA / "logits" / family
    assert_imatrix_equals_iks(_f32(family), logits / "text.txt", logits / "ik-imatrix.dat", tmp_path / "imatrix.dat")


@pytest.mark.parametrize("family", FAMILIES)
def test_imatrix_guided_sweep_and_mix(family: str, tmp_path: Path) -> None:
    """ikrun imatrix -> ikrun sweep --imatrix -> ikrun mix: the sweep measures every tensor ikquant quantizes (the
    delta-net's projections among them), each at a non-zero cost, and the mix within the budget is measured."""
    f32, text = _f32(family), DATA / "logits" / family / "text.txt"
    imatrix, sweep, pure, mix = (tmp_path / n for n in ("imatrix.dat", "sweep.json", "q4_0.gguf", "mix.gguf"))
    assert runner.invoke(app, ["imatrix", str(f32), "--text", str(text), "--ctx", "64", "-o", str(imatrix)]
                         ).exit_code == 0
    res = runner.invoke(ikquant_app, [str(f32), str(pure), "--pure", "--type", "Q4_0", "--imatrix", str(imatrix)])
    assert res.exit_code == 0, res.output
    quantized = {n for n, t in GGUFFile(pure).tensors.items() if t.type.name != "F32"}
    mixer = ("attn_qkv", "attn_gate", "ssm_out", "ssm_beta", "ssm_alpha") if "35" in family else \
        ("attn_qkv", "attn_gate", "ssm_out", "ssm_ba")
    assert {f"blk.0.{t}.weight" for t in mixer} <= quantized
    res = runner.invoke(app, ["sweep", str(f32), "--text", str(text), "--ctx", "64", "--chunks", "2", "--types",
                              "Q4_0,Q8_0", "--imatrix", str(imatrix), "-o", str(sweep)])
    assert res.exit_code == 0, res.output
    rows = json.loads(sweep.read_text())["rows"]
    assert {r["group"] for r in rows} == quantized and len(rows) == 2 * len(quantized)
    assert all(r["kld_mean"] > 0 for r in rows), [r["group"] for r in rows if not r["kld_mean"] > 0]
    res = runner.invoke(app, ["mix", str(f32), str(mix), "--sweep", str(sweep), "--type", "Q4_0", "--target-bpw",
                              "6.5", "--imatrix", str(imatrix), "--json"])
    assert res.exit_code == 0, res.output
    measured = json.loads(res.stdout)[0]
    g = GGUFFile(mix)
    assert 8 * sum(t.nbytes for t in g.tensors.values()) / sum(t.n_elements for t in g.tensors.values()) <= 6.5
    assert {"Q4_0", "Q8_0"} <= {t.type.name for t in g.tensors.values()} and measured["kld_mean"] > 0


@pytest.mark.parametrize("name", ["blk.0.attn_qkv.weight", "blk.1.ssm_out.weight", "blk.3.attn_q.weight"])
def test_hot_swap_of_a_mixer_weight(name: str, tmp_path: Path) -> None:
    f32, tokens = _f32("qwen3-next"), np.load(DATA / "hf-logits" / "qwen3-next" / "tokens.npy")[0]
    raw = _requantized(f32, name, "Q4_0")
    replaced = tmp_path / "replaced.gguf"
    _copy_with(f32, replaced, {name: ("Q4_0", raw)})
    m = Model(f32)
    before = m.logits(tokens)
    m.swap(name, type_by_name("Q4_0"), raw)
    swapped = m.logits(tokens)
    assert not np.array_equal(before, swapped)
    np.testing.assert_array_equal(swapped, Model(replaced).logits(tokens))
    m.restore(name)
    np.testing.assert_array_equal(m.logits(tokens), before)


def _with_keys(src: Path, dst: Path, keys: dict[str, Any]) -> Path:
    """A copy of `src` whose metadata has `keys` (int: UINT32, str: STRING, list: INT32 array) instead."""
    g = GGUFFile(src)
    with GGUFStreamWriter(dst, g.architecture) as w:
        w.copy_kvs(g.kv(), skip=keys)
        for key, value in keys.items():
            if isinstance(value, str):
                w.gw.add_string(key, value)
            elif isinstance(value, list):
                w.gw.add_array(key, value)
            else:
                w.gw.add_uint32(key, value)
        for n in g.tensors:
            w.add_tensor_info(n, g.info(n).shape, g.info(n).type)
        for n in g.tensors:
            w.write_tensor(n, g.raw(n))
        w.finish()
    return dst


@pytest.mark.parametrize(("family", "keys", "message"), [
    ("qwen3-next", {"qwen3next.full_attention_interval": 0}, "qwen3next.full_attention_interval 0 names no layer type"),
    ("qwen3-next", {"qwen3next.ssm.conv_kernel": 0}, "qwen3next.ssm.conv_kernel 0"),
    ("qwen3-next", {"qwen3next.ssm.state_size": 32}, "qwen3next.ssm.state_size 32 disagrees with the heads"),
    ("qwen3-next", {"qwen3next.ssm.time_step_rank": 3}, "qwen3next.ssm.time_step_rank 3"),
    ("qwen3-next", {"qwen3next.rope.scaling.type": "yarn"}, "qwen3next.rope.scaling.type 'yarn' is a rope scheme"),
    ("qwen35-moe", {"qwen35moe.rope.dimension_sections": [2, 1, 0, 1]},
     r"qwen35moe.rope.dimension_sections \[2, 1, 0, 1\] is a rope scheme"),
    ("qwen3-next", {"qwen3next.full_attention_interval": 2}, "tensors missing for qwen3next: blk.1.attn_q.weight"),
    # heads the exact arithmetic runs (key dim 32, value dim 96) but ik's fused kernel does not
    ("qwen3-next", {"qwen3next.ssm.state_size": 32, "qwen3next.ssm.inner_size": 384, "--numerics": "ik"},
     r"qwen3next.ssm.state_size 32 \(value head dim 96\): --numerics ik"),
    ("qwen3-next", {"qwen3next.full_attention_interval": 2, "--numerics": "ik"},
     "qwen3next.full_attention_interval 2: ik's qwen3next makes every 4th layer full attention"),
])
def test_what_the_runtime_does_not_implement_is_refused(family: str, keys: dict[str, Any], message: str,
                                                        tmp_path: Path) -> None:
    """Refused before any compute with exit 2, the message naming the key (or the tensor the key contradicts)."""
    options = [f"{k}={v}" for k, v in keys.items() if k.startswith("--")]
    bad = _with_keys(_f32(family), tmp_path / "bad.gguf", {k: v for k, v in keys.items() if not k.startswith("--")})
    res = runner.invoke(app, ["kld", str(bad), "--base-logits", str(DATA / "logits" / family / "ik-base.kld"),
                              *options])
    assert res.exit_code == 2, res.output
    assert re.search(message, " ".join(res.output.split())), res.output


def test_dense_qwen35_runs_as_transformers_defines_it(tmp_path: Path) -> None:
    """qwen35 (dense Qwen3.5, no golden file): the runtime on our conversion of the dense variant against the numpy
    reference on its checkpoint (itself checked against transformers on the MoE model)."""
    from ikconvert import Converter
    from ikrun.validate.hf import HFReference
    from tests.test_convert_qwen3next import _dense_config, _dense_tensors, _variant

    folder = _variant(tmp_path, "qwen35-moe", _dense_config, _dense_tensors)
    out = Converter(folder, "f32", "qwen35").write(tmp_path / "dense.gguf")
    tokens = [int(t) for t in np.load(DATA / "hf-logits" / "qwen35-moe" / "tokens.npy")[0]]
    model = Model(out)
    assert model.arch == "qwen35"
    assert mean_kld(HFReference(folder).logits(tokens), model.logits(tokens)) <= 1e-9


def _fused_qkvz_file(src: Path, dst: Path) -> Path:
    """`src` with each delta-net block's attn_qkv and attn_gate re-packed into one ssm_in as older
    mainline conversions wrote it: per key head [its q | its k | its value heads' v | their z] rows (ik's reading of
    ssm_in), the stored rows moved as they are (F32 and Q8_0 rows stand alone)."""
    g = GGUFFile(src)
    hk, dk = g.require(f"{g.architecture}.ssm.group_count"), g.require(f"{g.architecture}.ssm.state_size")
    vr = g.require(f"{g.architecture}.ssm.inner_size") // hk  # v (and z) rows of one key head's value heads
    tensors: dict[str, tuple[tuple[int, ...], Any, np.ndarray]] = {}
    for n in g.tensors:
        if n.endswith("attn_gate.weight"):
            continue
        info = g.info(n)
        if not n.endswith("attn_qkv.weight"):
            tensors[n] = (info.shape, info.type, g.raw(n))
            continue
        b = n.removesuffix("attn_qkv.weight")
        qkv, z = g.raw(n), g.raw(b + "attn_gate.weight")
        q, k, v = qkv[: hk * dk], qkv[hk * dk : 2 * hk * dk], qkv[2 * hk * dk :]
        rows = [np.concatenate([q[j * dk : (j + 1) * dk], k[j * dk : (j + 1) * dk], v[j * vr : (j + 1) * vr],
                                z[j * vr : (j + 1) * vr]]) for j in range(hk)]
        tensors[b + "ssm_in.weight"] = ((len(qkv) + len(z), info.shape[1]), info.type, np.concatenate(rows))
    with GGUFStreamWriter(dst, g.architecture) as w:
        w.copy_kvs(g.kv())
        for n, (shape, gtype, _) in tensors.items():
            w.add_tensor_info(n, shape, gtype)
        for n, (_, _, raw) in tensors.items():
            w.write_tensor(n, raw)
        w.finish()
    return dst


@pytest.mark.parametrize("stored", ["ref-f32", "ref-q8_0"])
def test_a_fused_ssm_in_file_runs_as_the_split_one(stored: str, tmp_path: Path) -> None:
    """A file whose delta-net blocks hold one ssm_in gives the split file's logits: one sequence, and every chunk of
    ik's base run layer-streamed (`ikrun kld`'s report). Under --numerics ik bit for bit (ik's matmul computes each
    output on its own); the exact arithmetic to float rounding (measured: 3.2e-5 on a logit, mean KLD 1.3e-12
    between the two), as OpenBLAS's sgemm sums in another order for a product of 768 weight rows than for products
    of 512 and 256 (from 8 input rows on)."""
    split = DATA / "convert" / "qwen3-next" / f"{stored}.gguf"
    fused = _fused_qkvz_file(split, tmp_path / "fused.gguf")
    assert "blk.0.ssm_in.weight" in GGUFFile(fused).tensors
    assert not any(n.endswith(("attn_qkv.weight", "attn_gate.weight")) for n in GGUFFile(fused).tensors)
    tokens = np.load(DATA / "hf-logits" / "qwen3-next" / "tokens.npy")[0]
    base = DATA / "logits" / "qwen3-next" / "ik-base.kld"
    for numerics in ("exact", "ik"):
        options = RuntimeOptions(numerics=numerics)
        got, want = Model(fused, options=options).logits(tokens), Model(split, options=options).logits(tokens)
        got_report, want_report = (kld_json(path, base, "--numerics", numerics) for path in (fused, split))
        if numerics == "ik":
            np.testing.assert_array_equal(got, want)
            assert got_report == want_report
        else:
            assert np.abs(got - want).max() <= 1e-4 and mean_kld(want, got) <= 1e-10
            assert got_report["same_top_p"] == want_report["same_top_p"]
            assert abs(got_report["ppl_q"] / want_report["ppl_q"] - 1) <= 1e-7  # measured 2e-8
            assert abs(got_report["kld_mean"] - want_report["kld_mean"]) <= 1e-8  # 6.8e-9 (F32), 1.4e-9 (Q8_0)


def test_imatrix_and_sweep_on_a_fused_ssm_in_file_see_ssm_in(tmp_path: Path) -> None:
    """imatrix records ssm_in as ik's does, with the values attn_qkv and attn_gate get in the split file (bit for
    bit under --numerics ik, where the layers before give the same rows), and a sweep measures ssm_in as stored, at
    a non-zero cost per type."""
    text = DATA / "logits" / "qwen3-next" / "text.txt"
    fused = _fused_qkvz_file(_f32("qwen3-next"), tmp_path / "fused.gguf")
    dats = {}
    for name, path in (("split", _f32("qwen3-next")), ("fused", fused)):
        dats[name] = tmp_path / f"{name}.dat"
        res = runner.invoke(app, ["imatrix", str(path), "--text", str(text), "--ctx", "64", "-o", str(dats[name]),
                                  "--numerics", "ik"])
        assert res.exit_code == 0, res.output
    split, ours = read_imatrix_dat(dats["split"]).entries, read_imatrix_dat(dats["fused"]).entries
    blocks = sorted({n.removesuffix("attn_qkv.weight") for n in split if n.endswith("attn_qkv.weight")})
    assert set(ours) == {n for n in split if not n.endswith(("attn_qkv.weight", "attn_gate.weight"))} | \
        {b + "ssm_in.weight" for b in blocks}
    for b in blocks:
        for part in ("attn_qkv.weight", "attn_gate.weight"):
            assert ours[b + "ssm_in.weight"].ncall == split[b + part].ncall
            np.testing.assert_array_equal(ours[b + "ssm_in.weight"].mean_sq(), split[b + part].mean_sq())
    sweep = tmp_path / "sweep.json"
    res = runner.invoke(app, ["sweep", str(fused), "--text", str(text), "--ctx", "64", "--chunks", "2", "--types",
                              "Q4_0,Q8_0", "--imatrix", str(dats["fused"]), "--tensors", "ssm_in", "-o", str(sweep)])
    assert res.exit_code == 0, res.output
    rows = json.loads(sweep.read_text())["rows"]
    assert {r["group"] for r in rows} == {b + "ssm_in.weight" for b in blocks} and len(rows) == 2 * len(blocks)
    assert all(r["kld_mean"] > 0 for r in rows)


def test_ik_on_a_fused_ssm_in_file_computes_what_ikrun_does(tmp_path: Path) -> None:
    """The wheel's ik loads the fused file and its logits are its split file's bit for bit, and ours (with ik's F16
    cache) to float rounding."""
    from tests import ik_engine

    fused = _fused_qkvz_file(_f32("qwen3-next"), tmp_path / "fused.gguf")
    tokens = [int(t) for t in np.load(DATA / "hf-logits" / "qwen3-next" / "tokens.npy")[0]]
    ik_fused = ik_engine.logits(fused, tokens)
    np.testing.assert_array_equal(ik_fused, ik_engine.logits(_f32("qwen3-next"), tokens))
    assert mean_kld(ik_fused, Model(fused, kv_cache="f16").logits(np.array(tokens))) <= 1e-9  # measured 3.2e-11


def test_a_fused_ssm_in_qwen35moe_file_is_refused(tmp_path: Path) -> None:
    """ik's qwen35moe loads no ssm_in: such a file is refused before compute, naming the tensor."""
    fused = _fused_qkvz_file(_f32("qwen35-moe"), tmp_path / "fused.gguf")
    res = runner.invoke(app, ["kld", str(fused), "--base-logits", str(DATA / "logits" / "qwen35-moe" / "ik-base.kld")])
    assert res.exit_code == 2, res.output
    assert "blk.0.ssm_in.weight (a fused delta-net input projection) is a layout ik's qwen35moe does not load" in \
        " ".join(res.output.split())
