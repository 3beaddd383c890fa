"""ikquant through its command line: golden bytes with --pure, ik's plans, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikquant.cli import app
from ikquant.gguf_io import GGUFFile, GGUFStreamWriter
from ikquant.imatrix import Imatrix, ImatrixEntry, write_imatrix_dat
from ikquant.types import implemented_types, type_by_name
from tests.quant_golden import golden_cases, golden_types

runner = CliRunner()


#: types whose quantized bytes differ from ik's in a few blocks of the golden cases (FMA contraction)
FMA_BYTES = {"IQ3_XXS"}


def _run(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), env={"COLUMNS": "250"})


def _ftype_for(type_name: str) -> str:
    """A --type whose default type is `type_name` (Q3_K comes from Q3_K_M, Q4_K from Q4_K_M, ...)."""
    from ikquant.ftypes import all_file_types

    return next(f.name for f in all_file_types() if f.default_type == type_name)


def _has_ftype(type_name: str) -> bool:
    from ikquant.ftypes import all_file_types

    return any(f.default_type == type_name for f in all_file_types())


@pytest.mark.parametrize("type_name", [t for t in golden_types()
                                       if t in {x.name for x in implemented_types()} and _has_ftype(t)])
def test_pure_quantization_reproduces_golden_bytes(tmp_path: Path, type_name: str) -> None:
    # IQ2_KS: llama-quantize (and ikquant) run the AVX2 search, which only the *_fastpath cases hold
    cases = [c for c in golden_cases(type_name) if type_name != "IQ2_KS" or c.user_data is not None]
    src = tmp_path / "rows.gguf"
    with GGUFStreamWriter(src, "llama") as w:
        for i, c in enumerate(cases):
            w.add_tensor_info(f"blk.{i}.ffn_up.weight", c.x.shape, type_by_name("F32"))
        for i, c in enumerate(cases):
            w.write_tensor(f"blk.{i}.ffn_up.weight", c.x)
        w.finish()
    imat = Imatrix(chunks=1, dataset="golden")
    for i, c in enumerate(cases):
        if c.imatrix is not None:
            imat.entries[f"blk.{i}.ffn_up.weight"] = ImatrixEntry(c.imatrix.astype(np.float32), 1)
    dat = tmp_path / "imatrix.dat"
    write_imatrix_dat(dat, imat)
    out = tmp_path / "out.gguf"
    ftype = _ftype_for(type_name)
    res = _run(str(src), str(out), "--type", ftype.lower(), "--pure", "--imatrix", str(dat), "--ignore-imatrix-rules")
    assert res.exit_code == 0, res.output
    g = GGUFFile(out)
    codec = type_by_name(type_name).require_codec()
    for i, c in enumerate(cases):
        assert g.info(f"blk.{i}.ffn_up.weight").type is type_by_name(type_name)
        # where the codec's bytes move with ik's FMA contraction (test_quant_golden), the file holds the codec's
        want = codec.quantize(c.x, c.imatrix) if type_name in FMA_BYTES else c.quant
        assert g.raw(f"blk.{i}.ffn_up.weight").tobytes() == want.tobytes(), c.name
    from ikquant.ftypes import file_type

    assert g.get("general.file_type") == file_type(ftype).id
    assert g.get("quantize.imatrix.entries_count") == len(imat.entries)


def test_slow_iq2ks_option_reproduces_the_other_search(tmp_path: Path) -> None:
    cases = [c for c in golden_cases("IQ2_KS") if c.user_data is None and c.imatrix is None]
    src = tmp_path / "rows.gguf"
    with GGUFStreamWriter(src, "llama") as w:
        for i, c in enumerate(cases):
            w.add_tensor_info(f"blk.{i}.ffn_up.weight", c.x.shape, type_by_name("F32"))
        for i, c in enumerate(cases):
            w.write_tensor(f"blk.{i}.ffn_up.weight", c.x)
        w.finish()
    out = tmp_path / "out.gguf"
    res = _run(str(src), str(out), "--type", "iq2_ks", "--pure", "--slow-iq2ks", "--ignore-imatrix-rules")
    assert res.exit_code == 0, res.output
    g = GGUFFile(out)
    for i, c in enumerate(cases):
        assert g.raw(f"blk.{i}.ffn_up.weight").tobytes() == c.quant.tobytes(), c.name


def plan_model(data_dir: Path, tmp_path: Path, variant: str) -> Path:
    """ik's plan input: the golden header, with the (irrelevant) weights as zeros in a sparse file."""
    path = tmp_path / f"{variant}.gguf"
    header = (data_dir / "plans" / variant / "ik-f16.header.bin").read_bytes()
    with open(path, "wb") as fh:
        fh.write(header)
        fh.truncate(len(header) + (64 << 20))
    return path


@pytest.mark.parametrize("ftype", ["Q4_0", "Q8_0"])
@pytest.mark.parametrize("with_imatrix", [False, True])
def test_plan_equals_iks(data_dir: Path, tmp_path: Path, ftype: str, with_imatrix: bool) -> None:
    variant = "qwen3-plan"
    model = plan_model(data_dir, tmp_path, variant)
    extra = ["--imatrix", str(data_dir / "plans" / variant / "imatrix.dat")] if with_imatrix else []
    res = _run(str(model), str(tmp_path / "out.gguf"), "--type", ftype, "--dry-run", "--json", *extra)
    assert res.exit_code == 0, res.output
    ours = {p["name"]: p["type"] for p in json.loads(res.stdout)}
    suffix = "-imat" if with_imatrix else ""
    lines = (data_dir / "plans" / variant / f"ik-plan-{ftype}{suffix}.txt").read_text().split("\n")
    ik = dict(line.split() for line in lines if line.strip())
    assert ours == ik
    assert not (tmp_path / "out.gguf").exists()


def test_tiny_rows_fall_back_like_ik(tiny_f32: Path, tmp_path: Path) -> None:
    res = _run(str(tiny_f32), str(tmp_path / "o.gguf"), "--type", "q4_0", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    plan = {p["name"]: p for p in json.loads(res.stdout)}
    # 64-column output rows cannot hold Q6_K's 256-value blocks: ik uses Q8_0
    assert plan["output.weight"]["type"] == "q8_0"
    assert plan["blk.0.attn_q.weight"]["type"] == "q4_0"
    assert plan["blk.0.attn_norm.weight"]["type"] == "f32"


def _no_output(tmp_path: Path, name: str = "out.gguf") -> None:
    assert not (tmp_path / name).exists()
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_bad_inputs(data_dir: Path, tmp_path: Path) -> None:
    f32 = str(data_dir / "convert" / "qwen3" / "ik-f32.gguf")
    q8 = str(data_dir / "convert" / "qwen3" / "ik-q8_0.gguf")
    out = str(tmp_path / "out.gguf")
    res = _run(f32, out, "--type", "Q4_Z")
    assert res.exit_code == 2 and "unknown type" in res.output and "IQ4_KS" in res.output
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\0" * 100)
    res = _run(str(junk), out, "--type", "q8_0")
    assert res.exit_code == 2 and "not a readable GGUF" in res.output
    res = _run(f32, f32, "--type", "q8_0")
    assert res.exit_code == 2 and "is the input file" in res.output
    res = _run(q8, out, "--type", "q4_0")
    assert res.exit_code == 2 and "--allow-requantize" in res.output
    res = _run(q8, out, "--type", "q4_0", "--allow-requantize")
    assert res.exit_code == 0, res.output
    Path(out).unlink()
    other = Imatrix(entries={"blk.0.attn_q.weight": ImatrixEntry(np.ones(17, np.float32), 1)})
    write_imatrix_dat(tmp_path / "other.dat", other)
    res = _run(f32, out, "--type", "q4_0", "--imatrix", str(tmp_path / "other.dat"))
    assert res.exit_code == 2 and "blk.0.attn_q.weight" in res.output and "another model" in res.output
    _no_output(tmp_path)


@pytest.fixture
def untied_256(tmp_path: Path) -> Path:
    from ikconvert.convert import Converter
    from ikconvert.tiny import TinySpec, make_tiny_checkpoint

    return Converter(make_tiny_checkpoint(tmp_path / "hf", TinySpec(arch="qwen3", hidden=256, layers=2, heads=4,
                                                                    kv_heads=2, head_dim=64, ffn=512)),
                     "f32", "qwen2").write(tmp_path / "m.gguf")


def test_iq3_kt_writes_its_iq3_s_token_embeddings(untied_256: Path, tmp_path: Path) -> None:
    """ik's IQ3_KT recipe puts IQ3_S on an untied model's token_embd (and IQ3_XS mixes IQ3_S with IQ3_XXS)."""
    from ikquant.gguf_io import GGUFFile
    from ikrun.model import Model

    for ftype, wanted in (("IQ3_KT", {"IQ3_S", "IQ3_KT"}), ("IQ3_XS", {"IQ3_S", "IQ3_XXS"})):
        dst = tmp_path / f"{ftype}.gguf"
        res = runner.invoke(app, [str(untied_256), str(dst), "--type", ftype, "--ignore-imatrix-rules"])
        assert res.exit_code == 0, res.output
        types = {t.type.name for t in GGUFFile(dst).tensors.values()}
        assert wanted <= types, (ftype, types)
        assert np.isfinite(Model(dst).logits(np.arange(1, 17))).all()


def test_a_plan_naming_a_type_without_codec_is_refused_before_writing(untied_256: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan with a type iktools cannot encode is refused before any file exists, and --dry-run says so (every
    type ik writes is writable here, so the test takes IQ2_XXS's encoder away)."""
    from ikquant.types import type_by_name

    monkeypatch.setattr(type_by_name("IQ2_XXS").require_codec(), "can_quantize", False)
    dst = tmp_path / "x.gguf"
    args = [str(untied_256), str(dst), "--type", "Q4_K_M", "--custom-q", "attn_q=iq2_xxs", "--ignore-imatrix-rules"]
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and "IQ2_XXS: blk.0.attn_q.weight" in res.output and "nothing was written" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf"]
    res = runner.invoke(app, [*args, "--dry-run"], env={"COLUMNS": "300"})
    assert res.exit_code == 0 and "this plan cannot be written" in res.output


def _one_line_error(res, *words: str) -> None:  # type: ignore[no-untyped-def]
    """Exit 2 with a single 'error:' line naming `words`, and no traceback."""
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert all(w in lines[0] for w in words), res.output


def test_missing_inputs_are_one_line_errors(data_dir: Path, tmp_path: Path) -> None:
    f32 = str(data_dir / "convert" / "qwen3" / "ik-f32.gguf")
    out = str(tmp_path / "out.gguf")
    missing = str(tmp_path / "missing")
    _one_line_error(_run(missing + ".gguf", out, "--type", "q8_0"), missing + ".gguf", "no such file")
    _one_line_error(_run(missing + ".gguf", out, "--repack"), missing + ".gguf", "no such file")
    _one_line_error(_run(f32, out, "--type", "q4_0", "--imatrix", missing + ".dat"), missing + ".dat", "no such file")
    _one_line_error(_run(f32, out, "--type", "q4_0", "--sweep", missing + ".json", "--target-bpw", "5"),
                    missing + ".json", "no such file")
    _no_output(tmp_path)


def test_a_type_without_codec_is_a_one_line_error(data_dir: Path, tmp_path: Path) -> None:
    from ikquant.errors import CodecMissingError, IkError, InputNotFoundError

    f32 = str(data_dir / "convert" / "qwen3" / "ik-f32.gguf")
    _one_line_error(_run(f32, str(tmp_path / "out.gguf"), "--type", "q4_0", "--custom-q", "attn_q=q8_1"),
                    "Q8_1", "cannot encode", "nothing was written")
    _no_output(tmp_path)
    with pytest.raises(CodecMissingError, match="Q8_1") as info:
        type_by_name("Q8_1").require_codec()
    assert isinstance(info.value, IkError) and isinstance(info.value, NotImplementedError)
    with pytest.raises(InputNotFoundError) as missing:
        GGUFFile(tmp_path / "missing.gguf")
    assert isinstance(missing.value, IkError) and isinstance(missing.value, FileNotFoundError)
