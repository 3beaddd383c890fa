"""GLM-4.5/4.6/4.7 (`glm4moe`): ik's conversion byte for byte (NextN layer included), the runtime against
transformers and ik's base logits, `--numerics ik` to ik's printed digits, q/k norm, expert groups, refused configs,
imatrix, streaming, plans, and ik itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.checkpoint import Checkpoint
from ikconvert.convert import Converter
from ikconvert.errors import ConvertError
from ikquant.gguf_io import GGUFFile
from ikquant.imatrix import read_imatrix_dat
from ikquant.kv_override import parse_override
from ikrun.errors import ModelError
from ikrun.model import Model
from ikrun.options import RuntimeOptions
from ikrun.validate.hf import HFReference
from tests import ik_engine
from tests.family_checks import assert_imatrix_equals_iks, assert_streamed_equals_chunk_by_chunk, hf_variant, kld_json
from tests.test_ik_engine import mean_kld
from tests.test_numerics import _printed

runner = CliRunner()
DATA = Path(__file__).parent / "data"
HF = DATA / "convert" / "glm4-moe" / "hf"
LOGITS = DATA / "logits" / "glm4-moe"
TOKENS = DATA / "hf-logits" / "glm4-moe" / "tokens.npy"
SCORED = slice(32, 63)  # the positions ik scores in a 64-token chunk
IK = RuntimeOptions(numerics="ik")


@pytest.fixture(scope="module")
def f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Converter(HF, "f32", "glm4").write(tmp_path_factory.mktemp("glm4moe") / "f32.gguf")


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_conversion_is_iks_byte_for_byte(tmp_path: Path, outtype: str) -> None:
    out = Converter(HF, outtype, "glm4").write(tmp_path / f"{outtype}.gguf")
    assert out.read_bytes() == (DATA / "convert" / "glm4-moe" / f"ik-{outtype}.gguf").read_bytes()


def test_the_nextn_layer_is_loaded_and_checked_not_run(f32: Path, tmp_path: Path) -> None:
    """Block 3 is the NextN/MTP layer: kept with its nextn.* tensors, shape-checked, outside the forward."""
    model = Model(f32)
    assert model.impl.n_active == 3 and GGUFFile(f32).get("glm4moe.block_count") == 4
    assert model.weights.info("blk.3.nextn.eh_proj.weight").shape == (64, 128)
    tensors = {n: ("F32", t.to_f32()) for n, t in Checkpoint(HF).iter_tensors()}
    tensors["model.layers.3.eh_proj.weight"] = ("F32", np.zeros((64, 64), dtype=np.float32))
    with pytest.raises(ConvertError, match=r"model.layers.3.eh_proj.weight.*\[64, 128\]"):
        Converter(hf_variant(HF, tmp_path, {}, tensors), "f32", "glm4").build_plan()


def test_runtime_against_transformers_and_iks_base_logits(f32: Path) -> None:
    tokens, ref = np.load(TOKENS), np.load(DATA / "hf-logits" / "glm4-moe" / "logits.npy")
    model = Model(f32)
    got = np.stack([model.logits(t) for t in tokens])
    assert mean_kld(ref[:, SCORED].reshape(-1, ref.shape[-1]), got[:, SCORED].reshape(-1, ref.shape[-1])) <= 1e-4
    # ik's -ctk f32 keeps its values in F16 (no flash attention): that rounding flips a near-tie routing in a chunk
    # transformers' logits do not cover, so the exact F32 cache is near it, and the same cache matches it
    assert kld_json(f32, LOGITS / "ik-base-ctk-f32.kld", "--kv-cache", "k-f32")["kld_mean"] <= 1e-5
    assert 1e-5 < kld_json(f32, LOGITS / "ik-base-ctk-f32.kld")["kld_mean"] <= 1e-4
    assert kld_json(f32, LOGITS / "ik-base.kld", "--kv-cache", "f16")["kld_mean"] <= 1e-5
    assert kld_json(f32, LOGITS / "ik-base.kld")["kld_mean"] <= 1e-3


@pytest.mark.parametrize("outtype", ["q8_0", "bf16"])
def test_numerics_ik_prints_iks_figures(outtype: str) -> None:
    ik = _printed(LOGITS / f"ik-{outtype}-kld.txt")
    got = kld_json(DATA / "convert" / "glm4-moe" / f"ik-{outtype}.gguf", LOGITS / "ik-base.kld", "--numerics", "ik",
                   "--flash-attn", "off")
    for key, value in ik.items():  # printed with 6 decimals (same top p: 3 decimals of a percentage)
        assert abs(got[key] - value) <= (5.01e-6 if key == "same_top_p" else 5.01e-7), (key, got[key], value)


def test_imatrix_equals_iks(f32: Path, tmp_path: Path) -> None:
    assert_imatrix_equals_iks(f32, LOGITS / "text.txt", LOGITS / "ik-imatrix.dat", tmp_path / "imatrix.dat")


def test_streamed_equals_chunk_by_chunk(f32: Path) -> None:
    assert_streamed_equals_chunk_by_chunk(f32)


def _matches_reference(hf: Path, gguf: Path) -> np.ndarray:
    tokens = np.load(TOKENS)[:2]
    ref, model = HFReference(hf), Model(gguf)
    got = []
    for t in tokens:
        got.append(model.logits(t))
        assert mean_kld(ref.logits(t), got[-1]) <= 1e-8
    return np.stack(got)


@pytest.mark.parametrize("config", [{"routed_scaling_factor": 2.5}, {"norm_topk_prob": False}],
                         ids=["scaled", "unnormalised"])
def test_routing_keys_are_carried_and_computed(tmp_path: Path, f32: Path, config: dict) -> None:  # type: ignore[type-arg]
    hf = hf_variant(HF, tmp_path, config)
    gguf = Converter(hf, "f32", "glm4").write(tmp_path / "m.gguf")
    changed = _matches_reference(hf, gguf)
    plain = np.stack([Model(f32).logits(t) for t in np.load(TOKENS)[:2]])
    assert mean_kld(plain.reshape(-1, plain.shape[-1]), changed.reshape(-1, plain.shape[-1])) > 1e-6


def test_qk_norm_where_the_config_says(tmp_path: Path) -> None:
    """use_qk_norm (GLM-4.5's 355B): per-head q_norm / k_norm, converted and run."""
    tensors = {n: ("F32", t.to_f32()) for n, t in Checkpoint(HF).iter_tensors()}
    rng = np.random.default_rng(1)
    for i in range(4):
        for which in ("q_norm", "k_norm"):
            tensors[f"model.layers.{i}.self_attn.{which}.weight"] = ("F32", rng.uniform(0.5, 1.5, 32).astype(np.float32))
    hf = hf_variant(HF, tmp_path, {"use_qk_norm": True}, tensors)
    gguf = Converter(hf, "f32", "glm4").write(tmp_path / "m.gguf")
    assert "blk.1.attn_q_norm.weight" in GGUFFile(gguf).tensors
    _matches_reference(hf, gguf)


def test_expert_groups_limit_the_top_k_as_transformers_does(tmp_path: Path, f32: Path) -> None:
    """n_group 2 / topk_group 1 (beyond ik, which drops both): written as expert_group_count / _used_count; the exact
    runtime keeps the top-k inside the best group as transformers does, --numerics ik takes ik's plain top-k."""
    hf = hf_variant(HF, tmp_path, {"n_group": 2, "topk_group": 1})
    gguf = Converter(hf, "f32", "glm4").write(tmp_path / "m.gguf")
    meta = GGUFFile(gguf)
    assert meta.get("glm4moe.expert_group_count") == 2 and meta.get("glm4moe.expert_group_used_count") == 1
    grouped = _matches_reference(hf, gguf)
    plain = np.stack([Model(f32).logits(t) for t in np.load(TOKENS)[:2]])
    assert mean_kld(plain.reshape(-1, plain.shape[-1]), grouped.reshape(-1, plain.shape[-1])) > 1e-4
    ik_grouped = Model(gguf, options=IK).logits(np.load(TOKENS)[0])
    np.testing.assert_array_equal(ik_grouped, Model(f32, options=IK).logits(np.load(TOKENS)[0]))


@pytest.mark.parametrize(("config", "said"), [
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"topk_method": "greedy"}, "topk_method 'greedy'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling {'rope_type': 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"n_group": 3}, "n_group 3"),
])
def test_configs_not_computed_are_refused_naming_key_and_value(tmp_path: Path, config: dict, said: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConvertError, match=said.replace("(", r"\(").replace("{", r"\{").replace("[", r"\[")):
        Converter(hf_variant(HF, tmp_path, config), "f32", "glm4")


@pytest.mark.parametrize(("override", "said"), [
    ("glm4moe.expert_gating_func=int:7", "glm4moe.expert_gating_func 7"),
    ("glm4moe.rope.scaling.type=str:yarn", "glm4moe.rope.scaling.type 'yarn'"),
    ("glm4moe.expert_group_count=int:3", "glm4moe.expert_group_count 3"),
])
def test_files_not_computed_are_refused_before_any_compute(tmp_path: Path, override: str, said: str) -> None:
    gguf = Converter(HF, "f32", "glm4").write(tmp_path / "m.gguf", overrides=[parse_override(override)])
    with pytest.raises(ModelError, match=said):
        Model(gguf)


def test_ik_runs_the_conversion_as_ikrun_does(f32: Path) -> None:
    tokens = [int(t) for t in np.load(TOKENS)[0]]
    ours = Model(f32, kv_cache="f16").logits(np.asarray(tokens))
    assert mean_kld(ik_engine.logits(f32, tokens), ours) <= 1e-5


@pytest.mark.parametrize("imat", [False, True], ids=["plain", "imat"])
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q3_K_S", "Q6_K", "Q8_0", "IQ4_KS", "IQ3_K", "IQ2_KS", "IQ4_XS",
                                   "IQ2_KT", "IQ3_XXS", "IQ1_S", "Q4_0_R8"])
def test_plans_equal_iks_llama_quantize(tmp_path: Path, ftype: str, imat: bool) -> None:
    """ik's per-tensor rules for glm4moe (shared experts, the router bias, the NextN block's tensors), against the
    llama-quantize of tests/ik_engine.py on a BF16 conversion."""
    from ikquant.errors import QuantizeError
    from ikquant.ftypes import file_type
    from ikquant.quantize import QuantizeOptions, check_writable, make_plan
    from ikquant.shards import GGUFModel
    from tests.test_ik_engine import ik_plan

    model = Converter(HF, "bf16", "glm4").write(tmp_path / "bf16.gguf")
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
