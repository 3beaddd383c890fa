"""ikquant's per-tensor decisions against ik's llama-quantize plans, and the options that change them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikquant.cli import app
from ikquant.errors import QuantizeError
from ikquant.ftypes import file_type
from ikquant.gguf_io import GGUFFile, GGUFStreamWriter
from ikquant.imatrix import read_imatrix, read_imatrix_dat
from ikquant.quantize import QuantizeOptions, make_plan
from ikquant.types import type_by_name

DATA = Path(__file__).parent / "data" / "plans"
VARIANTS = ["qwen3-plan", "deepseek-v3-plan", "openpangu-v2-plan"]
FTYPES = ["IQ4_KS", "IQ2_KS", "IQ2_K", "IQ3_KS", "IQ3_K", "IQ4_KSS", "IQ4_K", "IQ5_KS", "IQ5_K", "IQ6_K", "IQ1_KT",
          "IQ2_KT", "IQ3_KT", "IQ4_KT", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0", "Q8_0", "IQ4_XS",
          "IQ4_NL", "MXFP4", "Q2_K_S", "IQ3_KL", "Q8_KV", "Q8_0_R8", "Q4_0_R8", "IQ4_NL_R4", "IQ3_S", "IQ3_M",
          "IQ3_XS", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M", "IQ1_BN", "IQ2_BN", "Q5_0_R4",
          "Q6_0_R4", "Q2_K_R4", "Q3_K_R4", "Q4_K_R4", "Q5_K_R4", "Q6_K_R4", "IQ2_XXS_R4", "IQ2_XS_R4", "IQ3_XXS_R4",
          "IQ1_S_R4", "IQ3_S_R4", "IQ2_M_R4", "IQ4_XS_R8", "IQ1_M_R4", "IQ2_BN_R4", "IQ2_K_R4", "IQ3_K_R4", "IQ4_K_R4",
          "IQ5_K_R4", "IQ4_KS_R4", "IQ5_KS_R4", "Q8_KV_R8", "Q8_K_R8"]
# ik refuses these (no plan file): a tensor's rows are no multiple of the BitNet types' 64-value blocks
IK_REFUSES = {("openpangu-v2-plan", t) for t in ("IQ1_BN", "IQ2_BN", "IQ2_BN_R4")}
runner = CliRunner()


@pytest.fixture(scope="module")
def plan_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, GGUFFile]:
    """ik's plan inputs: the golden headers, with the (irrelevant) weights as zeros in a sparse file."""
    out = {}
    folder = tmp_path_factory.mktemp("plan-models")
    for variant in VARIANTS:
        header = (DATA / variant / "ik-f16.header.bin").read_bytes()
        path = folder / f"{variant}.gguf"
        with open(path, "wb") as fh:
            fh.write(header)
            fh.truncate(len(header) + (64 << 20))
        out[variant] = GGUFFile(path)
    return out


def ik_plan(variant: str, ftype: str, imat: bool) -> dict[str, str]:
    text = (DATA / variant / f"ik-plan-{ftype}{'-imat' if imat else ''}.txt").read_text()
    return dict(line.split() for line in text.splitlines() if line.strip())


@pytest.mark.parametrize("imat", [False, True], ids=["plain", "imat"])
@pytest.mark.parametrize("ftype", FTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_plan_equals_iks(plan_models: dict[str, GGUFFile], variant: str, ftype: str, imat: bool) -> None:
    if (variant, ftype) in IK_REFUSES:
        pytest.skip(f"ik refuses {ftype} on {variant}: test_bitnet_types_refuse_rows_their_blocks_cannot_hold")
    imatrix = read_imatrix_dat(DATA / variant / "imatrix.dat") if imat else None
    plan = make_plan(plan_models[variant], QuantizeOptions(file_type(ftype), imatrix=imatrix,
                                                           ignore_imatrix_rules=True))
    ours = {p.name: (p.ik_type or p.type).ggml_name for p in plan.tensors}
    assert ours == ik_plan(variant, ftype, imat)


@pytest.mark.parametrize("ftype", ["IQ1_BN", "IQ2_BN", "IQ2_BN_R4"])
def test_bitnet_types_refuse_rows_their_blocks_cannot_hold(plan_models: dict[str, GGUFFile], ftype: str) -> None:
    """The BitNet types have no fallback type: like ik, refuse a tensor with 3-value rows, with or without rules."""
    msg = rf"'blk\.0\.attn_compresskv_conv\.weight' has rows of 3 values, which {ftype}'s 64-value blocks"
    for pure in (False, True):
        with pytest.raises(QuantizeError, match=msg):
            make_plan(plan_models["openpangu-v2-plan"], QuantizeOptions(file_type(ftype), pure=pure,
                                                                        ignore_imatrix_rules=True))
    plan = make_plan(plan_models["openpangu-v2-plan"], QuantizeOptions(file_type(ftype), custom_q=[("_conv", "f16")],
                                                                       ignore_imatrix_rules=True))
    assert not any(p.quantize for p in plan.tensors if "_conv" in p.name)


def test_rows_no_block_fits_are_kept_and_reported(plan_models: dict[str, GGUFFile]) -> None:
    plan = make_plan(plan_models["openpangu-v2-plan"], QuantizeOptions(file_type("Q4_0")))
    conv = next(p for p in plan.tensors if p.name == "blk.0.attn_compresskv_conv.weight")
    assert conv.ik_type is type_by_name("Q4_0") and conv.type is type_by_name("F16") and not conv.quantize
    assert "broken" in conv.notes[-1]


def _names(plan, type_name: str) -> set[str]:  # type: ignore[no-untyped-def]
    return {p.name for p in plan.tensors if p.type.name == type_name}


def test_custom_q_wins_in_order_and_reports_dead_rules(plan_models: dict[str, GGUFFile]) -> None:
    g = plan_models["qwen3-plan"]
    opts = QuantizeOptions(file_type("Q4_K_M"), custom_q=[(r"blk\.1\.ffn_down", "q8_0"), (r"ffn_down", "iq4_ks"),
                                                          (r"no_such_tensor", "q8_0")])
    plan = make_plan(g, opts)
    assert _names(plan, "Q8_0") == {"blk.1.ffn_down.weight"}
    assert {p.name for p in plan.tensors if "ffn_down" in p.name} - _names(plan, "IQ4_KS") == {"blk.1.ffn_down.weight"}
    assert any("no_such_tensor" in w and "matches no tensor" in w for w in plan.warnings)


def test_class_options_where_ik_reads_them(plan_models: dict[str, GGUFFile]) -> None:
    g = plan_models["qwen3-plan"]
    plan = make_plan(g, QuantizeOptions(file_type("Q4_K_M"), class_types={"attn_v_type": "q8_0"}))
    assert {p.name for p in plan.tensors if "attn_v" in p.name} == _names(plan, "Q8_0") - {"output.weight"}
    assert not plan.warnings
    plan = make_plan(g, QuantizeOptions(file_type("IQ2_KS"), class_types={"attn_v_type": "q8_0"},
                                        ignore_imatrix_rules=True))
    assert not any("attn_v" in n for n in _names(plan, "Q8_0"))
    assert any("--attn-v-type is ignored" in w for w in plan.warnings)
    with pytest.raises(QuantizeError, match="q9_Z"):
        make_plan(g, QuantizeOptions(file_type("Q4_K_M"), class_types={"attn_v_type": "q9_Z"}))


def test_pure_ignores_custom_rules_loudly(plan_models: dict[str, GGUFFile]) -> None:
    g = plan_models["qwen3-plan"]
    plan = make_plan(g, QuantizeOptions(file_type("Q4_K_M"), pure=True, custom_q=[("ffn_down", "q8_0")]))
    assert not _names(plan, "Q8_0")
    assert {p.type.name for p in plan.tensors if p.quantize} == {"Q4_K"}
    assert any("--pure" in w for w in plan.warnings)


def test_driver_overrides(plan_models: dict[str, GGUFFile]) -> None:
    plan = make_plan(plan_models["qwen3-plan"], QuantizeOptions(file_type("Q4_0"), output_tensor_type="q8_0",
                                                                token_embedding_type="q6_K"))
    by_name = {p.name: p.type.name for p in plan.tensors}
    assert by_name["output.weight"] == "Q8_0" and by_name["token_embd.weight"] == "Q6_K"


def test_overrides_are_never_interleaved_on_token_embeddings(plan_models: dict[str, GGUFFile]) -> None:
    """As ik, the token embeddings lose an interleaved form after every override (--token-embedding-type too)."""
    plan = make_plan(plan_models["qwen3-plan"], QuantizeOptions(file_type("IQ4_K_R4"), token_embedding_type="iq4_k_r4",
                                                                output_tensor_type="iq4_k_r4"))
    by_name = {p.name: p.type.name for p in plan.tensors}
    assert by_name["token_embd.weight"] == "IQ4_K" and by_name["output.weight"] == "IQ4_K_R4"


def test_very_low_bit_types_need_an_imatrix(plan_models: dict[str, GGUFFile]) -> None:
    g = plan_models["qwen3-plan"]
    with pytest.raises(QuantizeError, match=r"IQ2_KT without importance data \(blk\.0\."):
        make_plan(g, QuantizeOptions(file_type("IQ2_KT")))
    imat = read_imatrix_dat(DATA / "qwen3-plan" / "imatrix.dat")
    assert make_plan(g, QuantizeOptions(file_type("IQ2_KT"), imatrix=imat)).tensors
    assert make_plan(g, QuantizeOptions(file_type("IQ2_KT"), ignore_imatrix_rules=True)).tensors


def test_imatrix_filters_and_name_fallbacks(tmp_path: Path) -> None:
    data = Path(__file__).parent / "data"
    model = data / "convert" / "qwen3" / "ik-f32.gguf"
    dat = data / "logits" / "qwen3" / "ik-imatrix.dat"

    def plan(*extra: str):  # type: ignore[no-untyped-def]
        res = runner.invoke(app, [str(model), str(tmp_path / "o.gguf"), "--type", "q4_0", "--imatrix", str(dat),
                                  "--dry-run", "--json", *extra], env={"COLUMNS": "250"})
        assert res.exit_code == 0, res.output
        return {p["name"]: p for p in json.loads(res.stdout)}, res.stderr

    full, _ = plan()
    assert full["blk.0.ffn_gate.weight"]["imatrix"] == "blk.0.ffn_gate.weight"
    no_gate, _ = plan("--exclude-weights", "ffn_gate")
    assert no_gate["blk.0.ffn_gate.weight"]["imatrix"] == "blk.0.ffn_up.weight"  # ik's gate -> up fallback
    filtered, stderr = plan("--exclude-weights", "ffn_up", "--exclude-weights", "ffn_gate")
    assert filtered["blk.0.ffn_gate.weight"]["imatrix"] is None
    assert filtered["blk.0.ffn_down.weight"]["imatrix"] == "blk.0.ffn_down.weight"
    assert "no imatrix entry" in stderr


def write_gguf_imatrix(path: Path, dat: Path, counts: int = 640) -> None:
    """The same statistics in mainline llama.cpp's GGUF imatrix layout (<name>.in_sum2 + <name>.counts)."""
    imat = read_imatrix_dat(dat)
    f32 = type_by_name("F32")
    with GGUFStreamWriter(path, "llama") as w:
        w.gw.add_type("imatrix")
        w.gw.add_array("imatrix.datasets", ["calibration.txt"])
        w.gw.add_uint32("imatrix.chunk_count", 10)
        w.gw.add_uint32("imatrix.chunk_size", 64)
        arrays = {}
        for name, e in imat.entries.items():
            arrays[name + ".in_sum2"] = (e.mean_sq() * counts).reshape(1, -1)
            arrays[name + ".counts"] = np.full((1, 1), counts, np.float32)
        for name, a in arrays.items():
            w.add_tensor_info(name, a.shape, f32)
        for name, a in arrays.items():
            w.write_tensor(name, a.astype(np.float32))
        w.finish()


def test_gguf_imatrix_reads_like_the_dat(tmp_path: Path) -> None:
    dat = DATA / "qwen3-plan" / "imatrix.dat"
    gguf = tmp_path / "imatrix.gguf"
    write_gguf_imatrix(gguf, dat)
    a, b = read_imatrix(dat), read_imatrix(gguf)
    assert set(a.entries) == set(b.entries)
    assert b.chunks == 10 and b.dataset == "calibration.txt"
    for name in a.entries:
        np.testing.assert_allclose(b.entries[name].mean_sq(), a.entries[name].mean_sq(), rtol=1e-6)


MAINLINE_FTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S",
                   "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M",
                   "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ4_NL", "IQ4_XS", "MXFP4_MOE"]


@pytest.mark.parametrize("imat", [False, True], ids=["plain", "imat"])
@pytest.mark.parametrize("ftype", MAINLINE_FTYPES)
@pytest.mark.parametrize("variant", ["qwen3-plan", "deepseek-v3-plan"])
def test_mainline_plan_equals_mainlines(plan_models: dict[str, GGUFFile], variant: str, ftype: str,
                                        imat: bool) -> None:
    from ikquant.recipes_mainline import MAINLINE_TYPES, mainline_file_type

    imatrix = read_imatrix_dat(DATA / variant / "imatrix.dat") if imat else None
    plan = make_plan(plan_models[variant], QuantizeOptions(mainline_file_type(ftype), imatrix=imatrix,
                                                           ignore_imatrix_rules=True, recipe="mainline"))
    ours = {p.name: p.type.ggml_name for p in plan.tensors}
    text = (DATA / variant / f"mainline-plan-{ftype}{'-imat' if imat else ''}.txt").read_text()
    assert ours == dict(line.split() for line in text.splitlines() if line.strip())
    assert all(p.type.name in MAINLINE_TYPES for p in plan.tensors)


def test_mainline_recipe_refuses_ik_only_types(plan_models: dict[str, GGUFFile], tmp_path: Path) -> None:
    src = str(plan_models["qwen3-plan"].path)
    for extra, needle in ((["--type", "IQ4_KS"], "load in ik_llama.cpp only"),
                          (["--type", "Q4_K_M", "--custom-q", "ffn_down=iq5_k"], "cannot load it"),
                          (["--type", "Q4_K_M", "--attn-v-type", "q6_K"], "no per-class type options"),
                          (["--type", "Q4_K_M", "--output-tensor-type", "iq6_k"], "cannot load it")):
        res = runner.invoke(app, [src, str(tmp_path / "out.gguf"), "--recipe", "mainline", *extra, "--dry-run"])
        assert res.exit_code == 2 and needle in res.output, (extra, res.output)
    res = runner.invoke(app, [src, str(tmp_path / "out.gguf"), "--recipe", "mainline", "--type", "IQ4_XS",
                              "--dry-run", "--json"])
    assert res.exit_code == 0
    types = {row["written_type"] for row in json.loads(res.stdout)}
    assert "iq5_k" not in types and "iq4_xs" in types  # ik's IQ4_XS recipe puts IQ5_K on attn_v; mainline's does not
    res = runner.invoke(app, [src, str(tmp_path / "out.gguf"), "--recipe", "mainline", "--type", "IQ4_XS",
                              "--leave-output-tensor", "--dry-run", "--json"])
    output = next(row for row in json.loads(res.stdout) if row["name"] == "output.weight")
    assert res.exit_code == 0 and output["quantize"] is False


def test_mainline_files_carry_mainlines_file_type(tmp_path: Path) -> None:
    from ikconvert.convert import Converter
    from ikconvert.tiny import TinySpec, make_tiny_checkpoint
    from ikquant.recipes_mainline import MAINLINE_TYPES

    src = Converter(make_tiny_checkpoint(tmp_path / "hf", TinySpec(arch="qwen3", hidden=256, layers=2, heads=4,
                                                                   kv_heads=2, head_dim=64, ffn=512)),
                    "f32", "qwen2").write(tmp_path / "m.gguf")
    for ftype, mainline_id in (("Q4_K_M", 15), ("Q3_K_L", 13), ("IQ4_XS", 30)):
        out = tmp_path / f"{ftype}.gguf"
        res = runner.invoke(app, [str(src), str(out), "--type", ftype, "--recipe", "mainline"])
        assert res.exit_code == 0, res.output
        g = GGUFFile(out)
        assert g.get("general.file_type") == mainline_id
        assert {t.type.name for t in g.tensors.values()} <= MAINLINE_TYPES


def test_sweeps_for_mainline_mixes_take_mainline_types_only(tmp_path: Path) -> None:
    from ikconvert.tiny import CORPUS
    from ikrun.cli import app as ikrun_app

    res = runner.invoke(ikrun_app, ["sweep", str(tmp_path / "absent.gguf"), "--text", str(CORPUS), "--types",
                                    "Q4_K,IQ4_KS", "--recipe", "mainline"])
    assert res.exit_code == 2 and "--types IQ4_KS" in res.output and "cannot load it" in res.output


def test_types_iks_matmul_cannot_multiply_are_planned_as_ik_but_warned(plan_models: dict[str, GGUFFile]) -> None:
    """ik's recipe puts IQ1_S_R4 on DeepSeek's 64-value attn_k_b rows, where its CPU matmul writes no output: the
    plan stays ik's, the warning names the tensors."""
    imatrix = read_imatrix_dat(DATA / "deepseek-v3-plan" / "imatrix.dat")
    plan = make_plan(plan_models["deepseek-v3-plan"], QuantizeOptions(file_type("IQ1_S_R4"), imatrix=imatrix))
    assert {p.name: p.type.name for p in plan.tensors}["blk.0.attn_k_b.weight"] == "IQ1_S_R4"
    warned = [w for w in plan.warnings if "no multiple of 128" in w]
    assert len(warned) == 1 and "blk.0.attn_k_b.weight" in warned[0]
    plain = make_plan(plan_models["deepseek-v3-plan"], QuantizeOptions(file_type("IQ1_S"), imatrix=imatrix))
    assert not [w for w in plain.warnings if "no multiple of" in w]


def test_types_iks_quantizer_cannot_write_without_importance_data_are_refused_before_writing(
        plan_models: dict[str, GGUFFile]) -> None:
    """IQ2_XXS, IQ2_XS and IQ1_S: ik's quantizer asserts importance data, so no option (not --ignore-imatrix-rules)
    lets such a plan be written; --dry-run still shows it (ik's does), and the refusal names the tensors."""
    from ikquant.quantize import check_writable

    g = plan_models["qwen3-plan"]
    for ftype in ("IQ2_XXS", "IQ2_XS", "IQ1_S"):
        plan = make_plan(g, QuantizeOptions(file_type(ftype), ignore_imatrix_rules=True))
        with pytest.raises(QuantizeError, match=rf"{ftype} cannot be quantized without importance data.*blk\.0\."):
            check_writable(plan)
    imat = read_imatrix_dat(DATA / "qwen3-plan" / "imatrix.dat")  # no entries for token_embd / output
    with pytest.raises(QuantizeError, match=r"IQ2_XXS cannot be quantized .*token_embd\.weight"):
        check_writable(make_plan(g, QuantizeOptions(file_type("IQ2_XXS"), imatrix=imat, pure=True)))
    check_writable(make_plan(g, QuantizeOptions(file_type("IQ2_XXS"), imatrix=imat)))  # ik's recipe: Q2_K / Q5_K there
