"""ikquant --repack / --unpack: tensors regrouped into ik's interleaved forms and back, no value changed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.tiny import CORPUS, TinySpec, make_tiny_checkpoint
from ikquant.cli import app as ikquant_app
from ikquant.gguf_io import GGUFFile
from ikrun.cli import app as ikrun_app

runner = CliRunner()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 with Q8_0, IQ4_K and Q6_K tensors (a vocabulary of rows that are no whole 8-row group)."""
    from ikconvert.convert import Converter

    tmp = tmp_path_factory.mktemp("repack")
    src = Converter(make_tiny_checkpoint(tmp / "hf", TinySpec(arch="qwen3", hidden=256, layers=2, heads=4, kv_heads=2,
                                                              head_dim=64, ffn=512)), "f32", "qwen2").write(tmp / "m.gguf")
    out = tmp / "mixed.gguf"
    res = runner.invoke(ikquant_app, [str(src), str(out), "--type", "Q8_0", "--custom-q",
                                      r"ffn_(up|gate)=iq4_k,ffn_down=q6_k,attn_v=q4_k,.*=q8_0"])
    assert res.exit_code == 0, res.output
    return out


def _kld(path: Path, base: Path) -> dict:
    res = runner.invoke(ikrun_app, ["kld", str(path), "--base-logits", str(base), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_repack_then_unpack_moves_bytes_only(mixed: Path, tmp_path: Path) -> None:
    packed, unpacked = tmp_path / "packed.gguf", tmp_path / "unpacked.gguf"
    res = runner.invoke(ikquant_app, [str(mixed), str(packed), "--repack"])
    assert res.exit_code == 0, res.output
    src, dst = GGUFFile(mixed), GGUFFile(packed)
    want = {"Q8_0": "Q8_0_R8", "IQ4_K": "IQ4_K_R4", "Q6_K": "Q6_K_R4", "Q4_K": "Q4_K_R4"}
    for name, info in src.tensors.items():
        got = dst.tensors[name].type.name
        if name == "token_embd.weight" or info.type.name not in want or info.n_rows % 8:
            assert got == info.type.name, name  # kept: token embeddings, 1-D tensors, rows no whole group
        else:
            assert got == want[info.type.name], name
    assert {t.type.name for t in dst.tensors.values()} >= set(want.values())
    assert src.tensors["token_embd.weight"].type.name == dst.tensors["token_embd.weight"].type.name == "Q8_0"
    res = runner.invoke(ikquant_app, [str(packed), str(unpacked), "--unpack"])
    assert res.exit_code == 0, res.output
    back = GGUFFile(unpacked)
    for name, info in src.tensors.items():
        assert back.tensors[name].type is info.type
        assert np.array_equal(back.raw(name), src.raw(name)), name
    assert dict((kv.key, kv.value) for kv in back.kv()) == dict((kv.key, kv.value) for kv in src.kv())
    # the repacked file gives the same statistics, every digit
    base = tmp_path / "base.kld"
    res = runner.invoke(ikrun_app, ["kld", str(mixed), "--base", str(mixed), "--text", str(CORPUS), "--ctx", "64",
                                    "--chunks", "3", "--save-base-logits", str(base)])
    assert res.exit_code == 0, res.output
    assert _kld(packed, base) == _kld(mixed, base)


def test_a_pattern_repacks_only_what_it_matches(mixed: Path, tmp_path: Path) -> None:
    out = tmp_path / "some.gguf"
    res = runner.invoke(ikquant_app, [str(mixed), str(out), "--repack-pattern", r"ffn_down"])
    assert res.exit_code == 0, res.output
    for name, info in GGUFFile(out).tensors.items():
        assert info.type.name.endswith("_R4") == ("ffn_down" in name), name
    dry = tmp_path / "dry.gguf"
    res = runner.invoke(ikquant_app, [str(mixed), str(dry), "--repack", "--dry-run"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "repacked to Q6_K_R4" in res.output and "token embeddings stay" in res.output
    assert not dry.exists()


def test_bad_requests_are_one_line_errors(mixed: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.gguf"
    for args, message in ((["--repack", "--unpack"], "opposite directions"),
                          (["--repack", "--type", "Q4_0"], "--type does not go with them"),
                          (["--repack-pattern", "("], "not a regular expression"),
                          ([], "--type is required")):
        res = runner.invoke(ikquant_app, [str(mixed), str(out), *args])
        assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output, (args, res.output)
        assert not out.exists()
    res = runner.invoke(ikquant_app, [str(mixed), str(mixed), "--repack"])
    assert res.exit_code == 2 and "is the input file" in res.output
