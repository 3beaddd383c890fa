"""MiniMax-M2 (`minimax-m2`): the layout ik's runtime loads byte for byte (ik's own converter cannot map the merged
experts), the runtime against transformers and ik's base logits, `--numerics ik` to ik's printed digits, imatrix,
streaming, refusals, plans and ik itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert import write_safetensors
from ikconvert.checkpoint import Checkpoint
from ikconvert.cli import app as convert_app
from ikconvert.convert import Converter
from ikconvert.errors import CheckpointError, ConvertError
from ikquant.imatrix import read_imatrix_dat
from ikrun.model import Model
from ikrun.validate.hf import HFReference
from tests import ik_engine
from tests.family_checks import assert_imatrix_equals_iks, assert_streamed_equals_chunk_by_chunk, kld_json
from tests.test_ik_engine import mean_kld

runner = CliRunner()
DATA = Path(__file__).parent / "data"
HF = DATA / "convert" / "minimax-m2" / "hf"
LOGITS = DATA / "logits" / "minimax-m2"
TOKENS = DATA / "hf-logits" / "minimax-m2" / "tokens.npy"
SCORED = slice(32, 63)  # the positions ik scores in a 64-token chunk


@pytest.fixture(scope="module")
def f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Converter(HF, "f32", "minimax-m2").write(tmp_path_factory.mktemp("mm2") / "f32.gguf")


def test_conversion_is_the_file_ik_loads_byte_for_byte(f32: Path) -> None:
    assert f32.read_bytes() == (DATA / "convert" / "minimax-m2" / "ref-f32.gguf").read_bytes()


def test_runtime_against_transformers_and_iks_base_logits(f32: Path) -> None:
    ref = np.load(DATA / "hf-logits" / "minimax-m2" / "logits.npy")
    model = Model(f32)
    got = np.stack([model.logits(t) for t in np.load(TOKENS)])
    assert mean_kld(ref[:, SCORED].reshape(-1, ref.shape[-1]), got[:, SCORED].reshape(-1, ref.shape[-1])) <= 1e-4
    assert kld_json(f32, LOGITS / "ik-base.kld", "--kv-cache", "f16")["kld_mean"] <= 1e-5
    # ik's -ctk f32 keeps V in F16 (ik refuses -ctv f32 without flash attention), which flips near-tie routings in
    # chunks 12 and 20 (see test_iks_f32_key_cache_base_is_f16_values): our F32 cache does not take them
    assert 1e-5 < kld_json(f32, LOGITS / "ik-base-ctk-f32.kld")["kld_mean"] <= 1e-3
    assert 1e-5 < kld_json(f32, LOGITS / "ik-base.kld")["kld_mean"] <= 1e-3


def test_iks_f32_key_cache_base_is_f16_values(f32: Path) -> None:
    """With the keys kept in float32 and only the values rounded to f16 (`--kv-cache k-f32`), as ik's -ctk f32 run
    held them, the runtime takes ik's routings too: the 1.5e-4 above is that cache, not the model."""
    assert kld_json(f32, LOGITS / "ik-base-ctk-f32.kld", "--kv-cache", "k-f32")["kld_mean"] <= 1e-6


def test_numerics_ik_prints_iks_perplexity(f32: Path) -> None:
    """ik printed `PPL over 60 chunks for n_ctx=64 = 522.8352 +/- 13.06699` for this file (ik-f32-ppl.txt)."""
    final = next(line for line in (LOGITS / "ik-f32-ppl.txt").read_text(errors="replace").splitlines() if "Final estimate" in line)
    ppl, err = (float(v) for v in final.split("=")[-1].split("+/-"))
    got = kld_json(f32, LOGITS / "ik-base.kld", "--numerics", "ik", "--flash-attn", "off")
    assert round(got["ppl_q"], 4) == ppl and round(got["ppl_q_err"], 5) == err
    assert abs(got["kld_mean"]) <= 1e-7 and got["same_top_p"] == 1.0


def test_reference_is_transformers_and_the_runtime(f32: Path) -> None:
    ref, hf, model = HFReference(HF), np.load(DATA / "hf-logits" / "minimax-m2" / "logits.npy"), Model(f32)
    for t, logits in zip(np.load(TOKENS)[:2], hf):
        ours = ref.logits(t)
        assert mean_kld(logits, ours) <= 1e-10
        assert mean_kld(ours, model.logits(t)) <= 1e-10


def test_imatrix_equals_iks(f32: Path, tmp_path: Path) -> None:
    assert_imatrix_equals_iks(f32, LOGITS / "text.txt", LOGITS / "ik-imatrix.dat", tmp_path / "imatrix.dat")


def test_streamed_equals_chunk_by_chunk(f32: Path) -> None:
    assert_streamed_equals_chunk_by_chunk(f32)


def _variant(tmp_path: Path, config: dict, drop: str | None = None) -> Path:  # type: ignore[type-arg]
    hf = tmp_path / "hf"
    shutil.copytree(HF, hf)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, **config}))
    if drop is not None:
        tensors = {n: ("F32", t.to_f32()) for n, t in Checkpoint(HF).iter_tensors() if n != drop}
        (hf / "model.safetensors").unlink()
        write_safetensors(hf / "model.safetensors", tensors)
    return hf


def test_a_missing_expert_is_named(tmp_path: Path) -> None:
    hf = _variant(tmp_path, {}, drop="model.layers.1.block_sparse_moe.experts.2.w3.weight")
    with pytest.raises(ConvertError, match=r"layer 1 has 11 of 12 routed-expert tensors .*missing 1: "
                                           r"model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight"):
        Converter(hf, "f32", "minimax-m2").build_plan()


def test_a_missing_expert_shard_is_named(tmp_path: Path) -> None:
    """A two-shard checkpoint whose second shard (layer 1's experts) is absent: the index names the shard and a
    tensor it holds."""
    hf = tmp_path / "hf"
    hf.mkdir()
    for cfg in HF.glob("*.json"):
        shutil.copy(cfg, hf)
    tensors = {n: ("F32", t.to_f32()) for n, t in Checkpoint(HF).iter_tensors()}
    second = {n for n in tensors if n.startswith("model.layers.1.block_sparse_moe.experts.")}
    write_safetensors(hf / "model-00001-of-00002.safetensors", {n: v for n, v in tensors.items() if n not in second})
    weight_map = {n: f"model-0000{1 + (n in second)}-of-00002.safetensors" for n in tensors}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"shard model-00002-of-00002\.safetensors is missing .*"
                                              r"'model\.layers\.1\.block_sparse_moe\.experts\.0\.w1\.weight'"):
        Converter(hf, "f32", "minimax-m2").build_plan()


@pytest.mark.parametrize(("key", "value"), [("attn_type_list", [0, 1]), ("use_qk_norm", False),
                                            ("qk_norm_type", "per_head"), ("shared_intermediate_size", 64),
                                            ("sliding_window", 16), ("rope_scaling", {"type": "linear", "factor": 2}),
                                            ("scoring_func", "softmax")])
def test_unsupported_config_is_refused_naming_key_and_value(tmp_path: Path, key: str, value: object) -> None:
    hf = _variant(tmp_path, {key: value})
    with pytest.raises(ConvertError, match=f"config.json: {key} = {value!r}".replace("[", r"\[").replace("(", r"\(")
                       .replace("{", r"\{").replace("]", r"\]")):
        Converter(hf, "f32", "minimax-m2")


def test_ik_runs_the_conversion_as_ikrun_does(f32: Path) -> None:
    tokens = [int(t) for t in np.load(TOKENS)[0]]
    ours = Model(f32, kv_cache="f16").logits(np.asarray(tokens))
    assert mean_kld(ik_engine.logits(f32, tokens), ours) <= 1e-5


@pytest.mark.parametrize("imat", [False, True], ids=["plain", "imat"])
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q3_K_S", "Q6_K", "Q8_0", "IQ4_KS", "IQ3_K", "IQ2_KS", "IQ4_XS",
                                   "IQ2_KT", "IQ3_XXS", "IQ1_S", "Q4_0_R8"])
def test_plans_equal_iks_llama_quantize(tmp_path: Path, f32: Path, ftype: str, imat: bool) -> None:
    """ik's per-tensor rules for minimax-m2 (attn_v / ffn_down_exps with 4 experts, the fallbacks of 64-wide rows),
    against the llama-quantize of tests/ik_engine.py on the F32 conversion (the file ik's imatrix was made on)."""
    from ikquant.errors import QuantizeError
    from ikquant.ftypes import file_type
    from ikquant.quantize import QuantizeOptions, check_writable, make_plan
    from ikquant.shards import GGUFModel
    from tests.test_ik_engine import ik_plan

    imatrix = LOGITS / "ik-imatrix.dat"
    res = ik_engine.llama_quantize("--dry-run", *["--imatrix", str(imatrix)] * imat, str(f32),
                                   str(tmp_path / "out.gguf"), ftype, "1")
    opts = QuantizeOptions(file_type(ftype), imatrix=read_imatrix_dat(imatrix) if imat else None)
    if res.returncode != 0:  # ik refuses very-low-bit output without importance data: so do we
        assert not imat and "importance matrix" in res.stderr, res.stderr[-2000:]
        with pytest.raises(QuantizeError):
            check_writable(make_plan(GGUFModel(f32), opts))
        return
    plan = make_plan(GGUFModel(f32), QuantizeOptions(file_type(ftype), imatrix=opts.imatrix,
                                                     ignore_imatrix_rules=True))
    assert {p.name: (p.ik_type or p.type).ggml_name for p in plan.tensors} == ik_plan(res.stdout + res.stderr)


PLANS = DATA / "plans" / "minimax-m2-plan"


@pytest.mark.parametrize("imat", [False, True], ids=["plain", "imat"])
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q6_K", "Q8_0", "IQ4_KS", "IQ4_XS", "IQ3_K", "IQ2_KS", "IQ2_KT", "IQ4_K",
                                   "Q3_K_M"])
def test_plans_with_256_wide_rows_equal_iks(tmp_path: Path, ftype: str, imat: bool) -> None:
    """Where the k- and i-quants apply (hidden and expert FFN 256): ik's golden plans of minimax-m2-plan (its
    recipes' promotions of attn_v / attn_k / attn_output / the last ffn_down_exps), from the F16 file's header with
    zeros for weights, and the wheel's llama-quantize on that same input."""
    from ikquant.ftypes import file_type
    from ikquant.quantize import QuantizeOptions, make_plan
    from ikquant.shards import GGUFModel
    from tests.test_ik_engine import ik_plan

    model = tmp_path / "m.gguf"
    header = (PLANS / "ref-f16.header.bin").read_bytes()
    with open(model, "wb") as fh:
        fh.write(header)
        fh.truncate(len(header) + (8 << 20))
    imatrix = PLANS / "imatrix.dat"
    plan = make_plan(GGUFModel(model), QuantizeOptions(file_type(ftype), ignore_imatrix_rules=True,
                                                       imatrix=read_imatrix_dat(imatrix) if imat else None))
    ours = {p.name: (p.ik_type or p.type).ggml_name for p in plan.tensors}
    lines = (PLANS / f"ik-plan-{ftype}{'-imat' * imat}.txt").read_text().splitlines()
    assert ours == dict(line.split() for line in lines if line.strip())
    res = ik_engine.llama_quantize("--dry-run", "--ignore-imatrix-rules", *["--imatrix", str(imatrix)] * imat,
                                   str(model), str(tmp_path / "out.gguf"), ftype, "1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert ik_plan(res.stdout + res.stderr) == ours


def test_the_runtime_refuses_a_rope_scaling_it_does_not_compute(tmp_path: Path) -> None:
    from ikquant.gguf_io import GGUFFile
    from ikrun.errors import ModelError

    out = tmp_path / "yarn.gguf"
    res = CliRunner().invoke(convert_app, ["hf2gguf", str(HF), "--outtype", "f32", "--pre-tokenizer", "minimax-m2",
                                           "--outfile", str(out), "--override-kv",
                                           "minimax-m2.rope.scaling.type=str:yarn"])
    assert res.exit_code == 0, res.output
    assert GGUFFile(out).get("minimax-m2.rope.scaling.type") == "yarn"
    with pytest.raises(ModelError, match=r"minimax-m2\.rope\.scaling\.type = 'yarn' is not implemented"):
        Model(out)
