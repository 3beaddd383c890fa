"""ikconvert hf2gguf for DFlashDraftModel drafts (dflash-draft): ik's golden files, a generated draft, bad input."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.cli import app
from ikconvert.safetensors_io import SafetensorsFile, write_safetensors
from ikquant.gguf_io import GGUFFile
from tests.convert_helpers import assert_same_gguf, convert_fails

runner = CliRunner()
VARIANTS = ("dflash-qwen3", "dflash-gptoss")


def _convert(args: list[str]):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["hf2gguf", *args], env={"COLUMNS": "250"})


def _ik_runs(golden: Path) -> tuple[str, dict[str, list[str]]]:
    """The pre-tokenizer ik's run was forced to, and its argument list per output file, from ik-convert.txt."""
    text = (golden / "ik-convert.txt").read_text()
    pre = re.search(r"monkeypatched to return: (\S+)", text)
    assert pre is not None
    runs = {}
    for line in text.splitlines():
        if line.startswith("OK "):
            args = shlex.split(line)[2:]
            runs[args[args.index("--outfile") + 1]] = args
    return pre.group(1), runs


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_golden_is_byte_identical(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str,
                                  outtype: str) -> None:
    golden = data_dir / "convert" / variant
    pre, runs = _ik_runs(golden)
    args = runs[f"ik-{outtype}.gguf"]
    out = tmp_path / f"{outtype}.gguf"
    args[args.index("--outfile") + 1] = str(out)
    monkeypatch.chdir(golden)  # ik's arguments are relative to the variant folder
    res = _convert([*args, "--pre-tokenizer", pre])
    assert res.exit_code == 0, res.output
    assert_same_gguf(out, golden / f"ik-{outtype}.gguf")


# ---- a second draft, generated: other dimensions and every optional rule the goldens do not exercise ----------
DRAFT = {"hidden": 32, "heads": 2, "kv": 1, "head_dim": 24, "ff": 80, "layers": 3}
TARGET = {"hidden": 64, "vocab": 352}
TARGET_LAYERS = [0, 2, 5]


def _bf16(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _draft_tensors(seed: int, bias: bool = True) -> dict[str, tuple[str, np.ndarray]]:
    """HF names as z-lab drafts mix them: bare `layers.N`, `model.`-prefixed top-level tensors, a self-contained
    embedding + LM head, attention sinks, and one tensor stored as F32."""
    rng = np.random.default_rng(seed)
    d = DRAFT
    q, kv = d["heads"] * d["head_dim"], d["kv"] * d["head_dim"]

    def w(*shape: int) -> tuple[str, np.ndarray]:
        return "BF16", _bf16(rng.standard_normal(shape).astype(np.float32) * 0.1)

    t = {
        "model.fc.weight": w(d["hidden"], TARGET["hidden"] * len(TARGET_LAYERS)),
        "hidden_norm.weight": ("F32", (1 + 0.1 * rng.standard_normal(d["hidden"])).astype(np.float32)),
        "model.norm.weight": w(d["hidden"]),
        "embed_tokens.weight": w(TARGET["vocab"], d["hidden"]),
        "lm_head.weight": w(TARGET["vocab"], d["hidden"]),
    }
    for i in range(d["layers"]):
        p = f"layers.{i}"
        t |= {
            f"{p}.input_layernorm.weight": w(d["hidden"]),
            f"{p}.post_attention_layernorm.weight": w(d["hidden"]),
            f"{p}.self_attn.q_proj.weight": w(q, d["hidden"]),
            f"{p}.self_attn.k_proj.weight": w(kv, d["hidden"]),
            f"{p}.self_attn.v_proj.weight": w(kv, d["hidden"]),
            f"{p}.self_attn.o_proj.weight": w(d["hidden"], q),
            f"{p}.self_attn.q_norm.weight": w(d["head_dim"]),
            f"{p}.self_attn.k_norm.weight": w(d["head_dim"]),
            f"{p}.self_attn.attention_sink_bias": w(d["heads"]),
            f"{p}.mlp.gate_proj.weight": w(d["ff"], d["hidden"]),
            f"{p}.mlp.up_proj.weight": w(d["ff"], d["hidden"]),
            f"{p}.mlp.down_proj.weight": w(d["hidden"], d["ff"]),
        }
        if bias:
            t |= {f"{p}.self_attn.q_proj.bias": w(q), f"{p}.self_attn.k_proj.bias": w(kv),
                  f"{p}.self_attn.v_proj.bias": w(kv), f"{p}.self_attn.o_proj.bias": w(d["hidden"])}
    return t


def _expected_name(hf: str) -> str:
    """The GGUF name ik gives each HF tensor of the generated draft (written out independently of the converter)."""
    top = {"model.fc.weight": "dflash_fc.weight", "hidden_norm.weight": "dflash_hidden_norm.weight",
           "model.norm.weight": "output_norm.weight", "embed_tokens.weight": "token_embd.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, bid, rest = hf.split(".", 2)
    block = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "post_attention_norm.weight",
             "self_attn.attention_sink_bias": "attn_sinks.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
    if rest in block:
        return f"blk.{bid}.{block[rest]}"
    proj, suffix = rest.rsplit(".", 1)
    return f"blk.{bid}.attn_" + {"self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v",
                                 "self_attn.o_proj": "output"}[proj] + "." + suffix


def _draft_config() -> dict:
    d = DRAFT
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": True,
        "hidden_size": d["hidden"], "intermediate_size": d["ff"], "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"], "num_key_value_heads": d["kv"], "head_dim": d["head_dim"],
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "vocab_size": 999,
        "partial_rotary_factor": 0.5,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                         "attention_factor": 0.8, "beta_fast": 32.0, "beta_slow": 1.0},
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "mask_token_id": 340,
        "dflash_config": {"block_size": 12, "target_layer_ids": TARGET_LAYERS, "use_swa": True,
                          "swa_window_size": 64, "backbone_rotary_base": 250000.0, "attention_value_scale": 0.5},
    }


def _write_draft(folder: Path, tensors: dict[str, tuple[str, np.ndarray]], config: dict) -> Path:
    """Two shards + index, split so that each shard's sorted order differs from the global sorted order."""
    folder.mkdir(parents=True)
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": [n for n in names if not n.startswith("layers.1")],
             "model-00002-of-00002.safetensors": [n for n in names if n.startswith("layers.1")]}
    for part, members in parts.items():
        write_safetensors(folder / part, {n: tensors[n] for n in members}, {"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: p for p, ms in parts.items() for n in ms}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def generated(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A draft with other dimensions, and a multimodal-style target (vocab and hidden size in text_config)."""
    root = tmp_path_factory.mktemp("dflash-gen")
    draft = _write_draft(root / "draft", _draft_tensors(7), _draft_config())
    target = root / "target"
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_dir / "convert" / "dflash-qwen3" / "target" / name, target / name)
    (target / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "bos_token_id": 296, "eos_token_id": 298,
        "text_config": {"hidden_size": TARGET["hidden"], "vocab_size": TARGET["vocab"], "num_hidden_layers": 6}}))
    return draft, target


def test_generated_draft_accounts_for_every_tensor(generated: tuple[Path, Path], tmp_path: Path) -> None:
    draft, target = generated
    out = tmp_path / "gen.gguf"
    res = _convert([str(draft), "--outtype", "f32", "--pre-tokenizer", "qwen2", "--target-model-dir", str(target),
                    "--outfile", str(out)])
    assert res.exit_code == 0, res.output
    g = GGUFFile(out)
    hf: dict = {}
    order: list[str] = []
    for part in sorted(draft.glob("model-*.safetensors")):
        tensors = SafetensorsFile(part).tensors
        hf |= tensors
        order += [_expected_name(n) for n in sorted(tensors)]
    assert list(g.tensors) == order  # ik's walk: shard by shard, sorted inside each
    assert len(g.tensors) == len(hf) == 3 * 16 + 5
    for name, t in hf.items():
        gguf = _expected_name(name)
        np.testing.assert_array_equal(g.dequantize(gguf), t.to_f32(), err_msg=f"{name} -> {gguf}")
        assert g.tensors[gguf].type.name == "F32"
    a = "dflash-draft"
    want = {
        f"{a}.embedding_length": 32, f"{a}.attention.key_length": 24, f"{a}.attention.causal": False,
        f"{a}.rope.dimension_count": 12, f"{a}.rope.scaling.type": "yarn", f"{a}.rope.scaling.factor": 4.0,
        f"{a}.rope.scaling.original_context_length": 2048, f"{a}.rope.scaling.yarn_attn_factor": 0.8,
        f"{a}.rope.scaling.yarn_beta_fast": 32.0, f"{a}.rope.scaling.yarn_beta_slow": 1.0,
        f"{a}.dflash.backbone_rotary_base": 250000.0, f"{a}.attention.value_scale": 0.5,
        f"{a}.dflash.block_size": 12, f"{a}.dflash.mask_token_id": 340, f"{a}.dflash.target_layer_ids": TARGET_LAYERS,
        f"{a}.dflash.n_target_features": 64 * 3, f"{a}.attention.sliding_window": 64,
        f"{a}.attention.sliding_window_pattern": [True, True, False],
        "tokenizer.ggml.bos_token_id": 296, "tokenizer.ggml.eos_token_id": 298,
    }
    for key, value in want.items():
        got = g.get(key)
        assert (pytest.approx(value) if isinstance(value, float) else value) == got, key
    keys = [kv.key for kv in g.kv()]
    # ik writes freq_base only for a top-level rope_theta (its runtime would rope this draft at 10000); the draft's
    # theta is rope_parameters' and written where ik writes a top-level one
    assert g.get(f"{a}.rope.freq_base") == 500000.0
    assert keys.index(f"{a}.rope.freq_base") == keys.index(f"{a}.attention.head_count_kv") + 1
    assert keys.index("general.file_type") == keys.index(f"{a}.attention.value_length") + 1
    assert keys.index(f"{a}.attention.causal") == keys.index("general.file_type") + 1
    tokens = g.get("tokenizer.ggml.tokens")
    assert len(tokens) == TARGET["vocab"] and tokens[-1] == f"[PAD{TARGET['vocab'] - 1}]"


def test_generated_draft_quantizes(generated: tuple[Path, Path], tmp_path: Path) -> None:
    """q8_0: 2-D weights whose rows fit Q8_0 blocks are quantized; 24-wide rows fall back to F16; 1-D stay F32."""
    draft, target = generated
    out = tmp_path / "gen-q8.gguf"
    res = _convert([str(draft), "--outtype", "q8_0", "--pre-tokenizer", "qwen2", "--target-model-dir",
                    str(target), "--outfile", str(out)])
    assert res.exit_code == 0, res.output
    types = {n: t.type.name for n, t in GGUFFile(out).tensors.items()}
    assert types["dflash_fc.weight"] == types["blk.0.attn_q.weight"] == types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_output.weight"] == "F16"  # rows of 48 are not a multiple of 32
    assert types["blk.2.attn_sinks.weight"] == types["blk.0.attn_q.bias"] == types["dflash_hidden_norm.weight"] == "F32"


# ---- bad input: a clear error, exit code 2, and no output file ---------------------------------------------------
def _fails(args: list[str], tmp_path: Path, *needles: str) -> None:
    convert_fails([*args, "--outtype", "f32", "--pre-tokenizer", "qwen2"], tmp_path / "out.gguf", *needles)


def test_missing_target_model_dir(data_dir: Path, tmp_path: Path) -> None:
    _fails([str(data_dir / "convert" / "dflash-qwen3" / "hf")], tmp_path, "--target-model-dir", "tokenizer")


def test_target_without_tokenizer(data_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    shutil.copy(data_dir / "convert" / "dflash-qwen3" / "target" / "config.json", target / "config.json")
    _fails([str(data_dir / "convert" / "dflash-qwen3" / "hf"), "--target-model-dir", str(target)], tmp_path,
           str(target), "no tokenizer.json")


def test_target_dir_that_is_not_a_model(data_dir: Path, tmp_path: Path) -> None:
    _fails([str(data_dir / "convert" / "dflash-qwen3" / "hf"), "--target-model-dir", str(tmp_path / "nowhere")],
           tmp_path, "nowhere", "not a folder")


def test_output_without_token_embd_is_rejected(generated: tuple[Path, Path], tmp_path: Path) -> None:
    _, target = generated
    tensors = _draft_tensors(7)
    del tensors["embed_tokens.weight"]
    draft = _write_draft(tmp_path / "draft", tensors, _draft_config())
    _fails([str(draft), "--target-model-dir", str(target)], tmp_path, "output.weight", "token_embd.weight")


def test_draft_without_tensors(generated: tuple[Path, Path], tmp_path: Path) -> None:
    _, target = generated
    draft = tmp_path / "draft"
    draft.mkdir()
    write_safetensors(draft / "model.safetensors", {}, {"format": "pt"})
    (draft / "config.json").write_text(json.dumps(_draft_config()))
    _fails([str(draft), "--target-model-dir", str(target)], tmp_path, str(draft), "no tensors", "block weights")


@pytest.mark.parametrize("key", ["block_size", "mask_token_id", "target_layer_ids"])
def test_missing_required_dflash_key(generated: tuple[Path, Path], tmp_path: Path, key: str) -> None:
    _, target = generated
    config = _draft_config()
    config.pop(key, None)
    config["dflash_config"].pop(key, None)
    draft = _write_draft(tmp_path / "draft", _draft_tensors(7), config)
    _fails([str(draft), "--target-model-dir", str(target)], tmp_path, "config.json", f"dflash_config.{key}")


def test_fc_width_disagreeing_with_target(generated: tuple[Path, Path], tmp_path: Path) -> None:
    """n_target_features is target hidden size x target layers; an fc of another width is named, not written."""
    _, target = generated
    config = _draft_config()
    config["dflash_config"]["target_layer_ids"] = [0, 2]
    draft = _write_draft(tmp_path / "draft", _draft_tensors(7), config)
    _fails([str(draft), "--target-model-dir", str(target)], tmp_path, "model.fc.weight", "[32, 192]", "[32, 128]")


def test_target_model_dir_is_refused_for_other_architectures(data_dir: Path, tmp_path: Path) -> None:
    _fails([str(data_dir / "convert" / "qwen3" / "hf"), "--target-model-dir",
            str(data_dir / "convert" / "dflash-qwen3" / "target")], tmp_path, "--target-model-dir", "does not apply")
