"""ikconvert hf2gguf: equality with ik's converter output, generated checkpoints, and every bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.cli import app
from ikconvert.convert import Converter
from ikconvert.safetensors_io import SafetensorsFile, write_safetensors
from ikquant.gguf_io import GGUFFile
from tests.convert_helpers import assert_same_gguf, convert_fails

runner = CliRunner()


def _convert(args: list[str]):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["hf2gguf", *args], env={"COLUMNS": "250"})


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_qwen3_golden_is_byte_identical(data_dir: Path, tmp_path: Path, outtype: str) -> None:
    golden = data_dir / "convert" / "qwen3"
    out = tmp_path / f"{outtype}.gguf"
    res = _convert([str(golden / "hf"), "--outtype", outtype, "--pre-tokenizer", "qwen2", "--outfile", str(out)])
    assert res.exit_code == 0, res.output
    assert_same_gguf(out, golden / f"ik-{outtype}.gguf")


def test_generated_checkpoint_accounts_for_every_tensor(tiny_hf: Path, tiny_f32: Path) -> None:
    names = set()
    for f in sorted(tiny_hf.glob("model*.safetensors")):
        names |= set(SafetensorsFile(f).tensors)
    g = GGUFFile(tiny_f32)
    assert len(g.tensors) == len(names)
    hf = {}
    for f in sorted(tiny_hf.glob("model*.safetensors")):
        hf.update(SafetensorsFile(f).tensors)
    # plain renames carry the bf16 weights exactly
    np.testing.assert_array_equal(g.dequantize("blk.1.ffn_down.weight"), hf["model.layers.1.mlp.down_proj.weight"].to_f32())
    np.testing.assert_array_equal(g.dequantize("token_embd.weight"), hf["model.embed_tokens.weight"].to_f32())
    assert g.get("tokenizer.ggml.model") == "gpt2"
    assert len(g.get("tokenizer.ggml.tokens")) == json.loads((tiny_hf / "config.json").read_text())["vocab_size"]


def test_dry_run_prints_the_plan_and_writes_nothing(data_dir: Path, tmp_path: Path) -> None:
    res = _convert([str(data_dir / "convert" / "qwen3" / "hf"), "--dry-run", "--pre-tokenizer", "qwen2",
                    "--outfile", str(tmp_path / "x.gguf")])
    assert res.exit_code == 0, res.output
    assert "blk.0.attn_q.weight" in res.output and "model.layers.0.self_attn.q_proj.weight" in res.output
    assert list(tmp_path.iterdir()) == []


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        p.chmod(0o644)
    return dst


def _fails(folder: Path, tmp_path: Path, *needles: str, extra: tuple[str, ...] = ()) -> None:
    convert_fails([str(folder), "--outtype", "f32", "--pre-tokenizer", "qwen2", *extra], tmp_path / "out.gguf",
                  *needles)


def test_unknown_architecture_lists_the_supported_ones(data_dir: Path, tmp_path: Path) -> None:
    hf = _copy(data_dir / "convert" / "qwen3" / "hf", tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (hf / "config.json").write_text(json.dumps(cfg))
    _fails(hf, tmp_path, "MambaForCausalLM", "not supported", "Qwen3ForCausalLM", "LlamaForCausalLM")


def test_missing_shard(tiny_sharded: Path, tmp_path: Path) -> None:
    hf = _copy(tiny_sharded, tmp_path / "hf")
    (hf / "model-00002-of-00003.safetensors").unlink()
    _fails(hf, tmp_path, "model-00002-of-00003.safetensors", "missing", extra=("--pre-tokenizer", "llama-bpe"))


def test_truncated_safetensors(data_dir: Path, tmp_path: Path) -> None:
    hf = _copy(data_dir / "convert" / "qwen3" / "hf", tmp_path / "hf")
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[:-5000])
    _fails(hf, tmp_path, "model.safetensors", "truncated")


def test_corrupt_safetensors_header(data_dir: Path, tmp_path: Path) -> None:
    hf = _copy(data_dir / "convert" / "qwen3" / "hf", tmp_path / "hf")
    data = bytearray((hf / "model.safetensors").read_bytes())
    data[8:20] = b"{{{{{{{{{{{{"
    (hf / "model.safetensors").write_bytes(bytes(data))
    _fails(hf, tmp_path, "model.safetensors", "corrupt header")


def test_tensor_missing_from_index(tiny_sharded: Path, tmp_path: Path) -> None:
    hf = _copy(tiny_sharded, tmp_path / "hf")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    _fails(hf, tmp_path, "model.norm.weight", "missing from model.safetensors.index.json",
           extra=("--pre-tokenizer", "llama-bpe"))


def test_shape_disagreeing_with_config(data_dir: Path, tmp_path: Path) -> None:
    hf = _copy(data_dir / "convert" / "qwen3" / "hf", tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (hf / "config.json").write_text(json.dumps(cfg))
    _fails(hf, tmp_path, "model.layers.0.mlp.down_proj.weight", "[64, 128]", "config.json implies [64, 96]")


def test_nonfinite_weights_stop_unless_allowed(data_dir: Path, tmp_path: Path) -> None:
    hf = _copy(data_dir / "convert" / "qwen3" / "hf", tmp_path / "hf")
    st = SafetensorsFile(hf / "model.safetensors")
    tensors = {n: (t.dtype, np.array(t.raw())) for n, t in st.tensors.items()}
    bad = tensors["model.layers.1.mlp.up_proj.weight"][1]
    bad[3, 5] = 0x7FC0  # bf16 NaN
    del st
    write_safetensors(hf / "model.safetensors", tensors, {"format": "pt"})
    _fails(hf, tmp_path, "model.layers.1.mlp.up_proj.weight", "NaN/Inf", "--allow-nonfinite")
    out = tmp_path / "ok.gguf"
    res = _convert([str(hf), "--outtype", "f32", "--pre-tokenizer", "qwen2", "--outfile", str(out),
                    "--allow-nonfinite"])
    assert res.exit_code == 0, res.output
    assert np.isnan(GGUFFile(out).dequantize("blk.1.ffn_up.weight")[3, 5])


def test_unknown_pre_tokenizer_is_reported_not_guessed(data_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.gguf"
    res = _convert([str(data_dir / "convert" / "qwen3" / "hf"), "--outfile", str(out)])
    assert res.exit_code == 2
    text = " ".join(res.output.split())
    assert "not recognized" in text and "--pre-tokenizer" in text
    assert not out.exists()


def test_auto_outtype_follows_ik(data_dir: Path) -> None:
    assert Converter(data_dir / "convert" / "qwen3" / "hf", "auto", "qwen2").outtype == "bf16"


def test_hub_reference_resolves_from_the_offline_cache(data_dir: Path, tmp_path: Path) -> None:
    """hf://org/repo[@rev] goes through huggingface_hub, which serves a cached snapshot when offline."""
    import os
    import subprocess
    import sys

    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--tiny-org--tiny-qwen3"
    shutil.copytree(data_dir / "convert" / "qwen3" / "hf", repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    out = tmp_path / "hub.gguf"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    exe = Path(sys.executable).parent / "ikconvert"
    res = subprocess.run([str(exe), "hf2gguf", "hf://tiny-org/tiny-qwen3@main", "--outtype", "f32", "--pre-tokenizer",
                          "qwen2", "--outfile", str(out)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    # general.name comes from the folder name: the snapshot folder here, "hf" for ik's run
    assert GGUFFile(out).get("general.name") != "Hf"
    ours, ik = GGUFFile(out), GGUFFile(data_dir / "convert" / "qwen3" / "ik-f32.gguf")
    assert [t.name for t in ours.tensors.values()] == [t.name for t in ik.tensors.values()]
    assert all(ours.raw(n).tobytes() == ik.raw(n).tobytes() for n in ik.tensors)
    res = subprocess.run([str(exe), "hf2gguf", "hf://tiny-org/not-cached", "--outfile", str(out)], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 2 and "hf://tiny-org/not-cached" in res.stderr


def test_tied_embeddings_convert_and_run(tmp_path: Path) -> None:
    from ikconvert.tiny import TinySpec, make_tiny_checkpoint
    from ikrun.model import Model
    from ikrun.validate.hf import HFReference, compare_logits

    hf = make_tiny_checkpoint(tmp_path / "tied", TinySpec(arch="qwen3", tie_embeddings=True, seed=5))
    out = Converter(hf, "f32", "qwen2").write(tmp_path / "tied.gguf")
    g = GGUFFile(out)
    assert "output.weight" not in g.tensors  # ik does not duplicate token_embd
    tokens = np.arange(40)
    res = compare_logits(HFReference(hf).logits(tokens), Model(out).logits(tokens))
    assert res["max_rel_logit_err"] < 1e-4


def test_error_messages_keep_square_brackets(tmp_path: Path) -> None:
    """Paths and shapes like `[2, 1]` are text, not rich markup: the user must see them whole."""
    missing = tmp_path / "ckpt[bold]" / "[2, 1]"
    res = _convert([str(missing)])
    assert res.exit_code == 2
    assert f"{missing}: no such folder" in res.output


def test_a_missing_checkpoint_folder_is_a_one_line_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    res = _convert([str(missing)])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and str(missing) in lines[0] and "no such folder" in lines[0], \
        res.output
