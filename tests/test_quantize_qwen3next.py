"""ik's quantize rules on the Gated DeltaNet hybrids (qwen3next, qwen35moe): the per-tensor plans of ik's
llama-quantize for 10 file types with and without an importance matrix, on the tiny oracle models (64-wide rows: the
fallbacks) and on the -plan models (256-wide rows: the k- and i-quants themselves), and ik's Q8_0 / BF16 bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from ikquant.ftypes import file_type
from ikquant.gguf_io import GGUFFile
from ikquant.imatrix import read_imatrix_dat
from ikquant.quantize import QuantizeOptions, make_plan, quantize_model
from ikquant.shards import GGUFModel

DATA = Path(__file__).parent / "data"
FTYPES = ["Q4_K_M", "Q6_K", "Q8_0", "IQ4_KS", "IQ4_XS", "IQ3_K", "IQ2_KS", "IQ2_KT", "IQ4_K", "Q3_K_M"]
#: plan variant -> its input: the reference F32 file, or the header of the F16 one (weights as zeros)
INPUTS = {"qwen3-next": "convert/qwen3-next/ref-f32.gguf", "qwen35-moe": "convert/qwen35-moe/ref-f32.gguf",
          "qwen3-next-plan": "plans/qwen3-next-plan/ref-f16.header.bin",
          "qwen35-moe-plan": "plans/qwen35-moe-plan/ref-f16.header.bin"}
#: never quantized, whatever the file type (ik's rules: 1-D by ggml's count, norms, routers, the conv kernel)
KEPT = ("ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ssm_norm.weight", "ffn_gate_inp.weight",
        "ffn_gate_inp_shexp.weight", "attn_norm.weight", "post_attention_norm.weight")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for variant, rel in INPUTS.items():
        path = DATA / rel
        if path.suffix == ".bin":
            header = path.read_bytes()
            path = tmp_path_factory.mktemp(variant) / "model.gguf"
            with open(path, "wb") as fh:
                fh.write(header)
                fh.truncate(len(header) + (16 << 20))
        out[variant] = path
    return out


@pytest.mark.parametrize("imat", [False, True], ids=["plain", "imat"])
@pytest.mark.parametrize("ftype", FTYPES)
@pytest.mark.parametrize("variant", list(INPUTS))
def test_plan_equals_iks(models: dict[str, Path], variant: str, ftype: str, imat: bool) -> None:
    imatrix = read_imatrix_dat(DATA / "plans" / variant / "imatrix.dat") if imat else None
    plan = make_plan(GGUFModel(models[variant]), QuantizeOptions(file_type(ftype), ignore_imatrix_rules=True,
                                                                 imatrix=imatrix))
    ours = {p.name: (p.ik_type or p.type).ggml_name for p in plan.tensors}
    lines = (DATA / "plans" / variant / f"ik-plan-{ftype}{'-imat' * imat}.txt").read_text().splitlines()
    assert ours == dict(line.split() for line in lines if line.strip())
    for p in plan.tensors:
        if p.name.startswith("blk.") and p.name.split(".", 2)[2] in KEPT:
            assert not p.quantize, p.name


@pytest.mark.parametrize("family", ["qwen3-next", "qwen35-moe"])
def test_q8_0_file_is_iks(tmp_path: Path, family: str) -> None:
    """ikquant on the reference F32 file writes ik's llama-quantize Q8_0 output byte for byte, including the
    shared-expert gate {H, 1} written as the 1-D {H} ggml counts it as."""
    out = tmp_path / "q.gguf"
    quantize_model(DATA / "convert" / family / "ref-f32.gguf", out, QuantizeOptions(file_type("Q8_0")))
    assert out.read_bytes() == (DATA / "convert" / family / "ref-q8_0.gguf").read_bytes()
    assert GGUFFile(out).tensors["blk.0.ffn_gate_inp_shexp.weight"].ne == (64,)
