"""Qwen3-MoE (`qwen3moe`): ik's conversion byte for byte, the runtime against transformers and ik's base logits,
`--numerics ik` to ik's printed digits, dense layers, `norm_topk_prob: false`, imatrix, streaming, and ik itself."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.checkpoint import Checkpoint
from ikconvert.convert import Converter
from ikconvert.errors import ConvertError
from ikquant.gguf_io import GGUFFile
from ikquant.imatrix import read_imatrix_dat
from ikrun.model import Model
from ikrun.validate.hf import HFReference
from tests import ik_engine
from tests.family_checks import assert_imatrix_equals_iks, assert_streamed_equals_chunk_by_chunk, hf_variant, kld_json
from tests.test_ik_engine import mean_kld
from tests.test_numerics import _printed

runner = CliRunner()
DATA = Path(__file__).parent / "data"
HF = DATA / "convert" / "qwen3-moe" / "hf"
LOGITS = DATA / "logits" / "qwen3-moe"
SCORED = slice(32, 63)  # the positions ik scores in a 64-token chunk


@pytest.fixture(scope="module")
def f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Converter(HF, "f32", "qwen2").write(tmp_path_factory.mktemp("q3m") / "f32.gguf")


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_conversion_is_iks_byte_for_byte(tmp_path: Path, outtype: str) -> None:
    out = Converter(HF, outtype, "qwen2").write(tmp_path / f"{outtype}.gguf")
    assert out.read_bytes() == (DATA / "convert" / "qwen3-moe" / f"ik-{outtype}.gguf").read_bytes()


def test_runtime_against_transformers_and_iks_base_logits(f32: Path) -> None:
    tokens = np.load(DATA / "hf-logits" / "qwen3-moe" / "tokens.npy")
    ref = np.load(DATA / "hf-logits" / "qwen3-moe" / "logits.npy")
    model = Model(f32)
    got = np.stack([model.logits(t) for t in tokens])
    assert mean_kld(ref[:, SCORED].reshape(-1, ref.shape[-1]), got[:, SCORED].reshape(-1, ref.shape[-1])) <= 1e-4
    # ik with an F32 key cache computes the model; its default F16 cache flips a near-tie routing (chunk 5, layer 0)
    assert kld_json(f32, LOGITS / "ik-base-ctk-f32.kld")["kld_mean"] <= 1e-5
    assert kld_json(f32, LOGITS / "ik-base.kld", "--kv-cache", "f16")["kld_mean"] <= 1e-5
    assert 1e-5 < kld_json(f32, LOGITS / "ik-base.kld")["kld_mean"] <= 1e-3


def test_numerics_ik_prints_iks_figures() -> None:
    ik = _printed(LOGITS / "ik-q8_0-kld.txt")
    got = kld_json(DATA / "convert" / "qwen3-moe" / "ik-q8_0.gguf", LOGITS / "ik-base.kld", "--numerics", "ik",
                   "--flash-attn", "off")
    for key, value in ik.items():  # printed with 6 decimals (same top p: 3 decimals of a percentage)
        assert abs(got[key] - value) <= (5.01e-6 if key == "same_top_p" else 5.01e-7), (key, got[key], value)


def test_imatrix_equals_iks(f32: Path, tmp_path: Path) -> None:
    assert_imatrix_equals_iks(f32, LOGITS / "text.txt", LOGITS / "ik-imatrix.dat", tmp_path / "imatrix.dat")


def test_streamed_equals_chunk_by_chunk(f32: Path) -> None:
    assert_streamed_equals_chunk_by_chunk(f32)


def _matches_reference(hf: Path, gguf: Path) -> None:
    tokens = np.load(DATA / "hf-logits" / "qwen3-moe" / "tokens.npy")[:2]
    ref, model = HFReference(hf), Model(gguf)
    for t in tokens:
        assert mean_kld(ref.logits(t), model.logits(t)) <= 1e-8


def test_norm_topk_prob_false_is_carried(tmp_path: Path) -> None:
    hf = hf_variant(HF, tmp_path, {"norm_topk_prob": False})
    gguf = Converter(hf, "f32", "qwen2").write(tmp_path / "m.gguf")
    assert GGUFFile(gguf).get("qwen3moe.expert_weights_norm") is False
    _matches_reference(hf, gguf)


def test_a_config_saved_by_transformers_5_converts_alike(tmp_path: Path) -> None:
    """transformers 5 writes Qwen3-MoE's expert count as num_local_experts: the same file as from num_experts."""
    hf = hf_variant(HF, tmp_path, {})
    cfg = json.loads((hf / "config.json").read_text())
    cfg["num_local_experts"] = cfg.pop("num_experts")
    (hf / "config.json").write_text(json.dumps(cfg))
    out = Converter(hf, "f32", "qwen2").write(tmp_path / "m.gguf")
    assert out.read_bytes() == (DATA / "convert" / "qwen3-moe" / "ik-f32.gguf").read_bytes()


def test_dense_layers_where_the_config_says(tmp_path: Path) -> None:
    """mlp_only_layers [1]: layer 1 is Qwen3's dense MLP (intermediate_size), converted and run as such."""
    tensors = {n: ("F32", t.to_f32()) for n, t in Checkpoint(HF).iter_tensors()
               if not n.startswith("model.layers.1.mlp.")}
    rng = np.random.default_rng(0)
    for proj, shape in (("gate_proj", (128, 64)), ("up_proj", (128, 64)), ("down_proj", (64, 128))):
        tensors[f"model.layers.1.mlp.{proj}.weight"] = ("F32", rng.normal(0, 0.05, shape).astype(np.float32))
    hf = hf_variant(HF, tmp_path, {"mlp_only_layers": [1]}, tensors)
    gguf = Converter(hf, "f32", "qwen2").write(tmp_path / "m.gguf")
    names = set(GGUFFile(gguf).tensors)
    assert "blk.1.ffn_gate.weight" in names and "blk.1.ffn_gate_inp.weight" not in names
    _matches_reference(hf, gguf)
    # the experts of a layer the config makes dense are refused, naming the tensor
    wrong = hf_variant(HF, tmp_path / "wrong", {"mlp_only_layers": [0]})
    with pytest.raises(ConvertError, match="does not belong in layer 0"):
        Converter(wrong, "f32", "qwen2").build_plan()


def test_ik_runs_the_conversion_as_ikrun_does(f32: Path) -> None:
    tokens = [int(t) for t in np.load(DATA / "hf-logits" / "qwen3-moe" / "tokens.npy")[0]]
    ours = Model(f32, kv_cache="f16").logits(np.asarray(tokens))
    assert mean_kld(ik_engine.logits(f32, tokens), ours) <= 1e-5


@pytest.mark.parametrize("imat", [False, True], ids=["plain", "imat"])
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q3_K_S", "Q6_K", "Q8_0", "IQ4_KS", "IQ3_K", "IQ2_KS", "IQ4_XS",
                                   "IQ2_KT", "IQ3_XXS", "IQ1_S", "Q4_0_R8"])
def test_plans_equal_iks_llama_quantize(tmp_path: Path, ftype: str, imat: bool) -> None:
    """ik's per-tensor rules for qwen3moe (its MoE rules: attn_v with 8+ experts, ffn_down_exps, ...), against the
    llama-quantize of tests/ik_engine.py on a BF16 conversion."""
    from ikquant.errors import QuantizeError
    from ikquant.ftypes import file_type
    from ikquant.quantize import QuantizeOptions, check_writable, make_plan
    from ikquant.shards import GGUFModel
    from tests.test_ik_engine import ik_plan

    model = Converter(HF, "bf16", "qwen2").write(tmp_path / "bf16.gguf")
    imatrix = LOGITS / "ik-imatrix.dat"
    res = ik_engine.llama_quantize("--dry-run", *["--imatrix", str(imatrix)] * imat, str(model),
                                   str(tmp_path / "out.gguf"), ftype, "1")
    opts = QuantizeOptions(file_type(ftype), imatrix=read_imatrix_dat(imatrix) if imat else None)
    if res.returncode != 0:  # ik refuses very-low-bit output without importance data: so do we
        assert not imat and "importance matrix" in res.stderr, res.stderr[-2000:]
        with pytest.raises(QuantizeError):
            check_writable(make_plan(GGUFModel(model), opts))
        return
    plan = make_plan(GGUFModel(model), QuantizeOptions(file_type(ftype), imatrix=opts.imatrix,
                                                       ignore_imatrix_rules=True))
    assert {p.name: (p.ik_type or p.type).ggml_name for p in plan.tensors} == ik_plan(res.stdout + res.stderr)
