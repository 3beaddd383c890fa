"""ikconvert hf2gguf for the Gated DeltaNet hybrids (Qwen3NextForCausalLM -> qwen3next, Qwen3.5 MoE -> qwen35moe,
dense Qwen3.5 -> qwen35): the reference layout ik's runtime loads, variants built from the golden checkpoints, and
bad inputs."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
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
DATA = Path(__file__).parent / "data" / "convert"
FAMILIES = ("qwen3-next", "qwen35-moe")


def _pre(family: str) -> str:
    """The tokenizer.ggml.pre value the reference file was written with (recorded in ik-convert.txt)."""
    m = re.search(r"monkeypatched to return: (\S+)", (DATA / family / "ik-convert.txt").read_text())
    assert m is not None
    return m.group(1)


def _convert(folder: Path, outtype: str, out: Path, pre: str) -> Path:
    res = runner.invoke(app, ["hf2gguf", str(folder), "--outtype", outtype, "--pre-tokenizer", pre,
                              "--outfile", str(out)], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    return out


def _raw_tensors(folder: Path) -> dict[str, tuple[str, np.ndarray]]:
    st = SafetensorsFile(folder / "model.safetensors")
    return {n: (t.dtype, np.array(t.raw())) for n, t in st.tensors.items()}


def _variant(tmp_path: Path, family: str, edit_config: Callable[[dict], None] | None = None,
             edit_tensors: Callable[[dict[str, tuple[str, np.ndarray]]], None] | None = None) -> Path:
    """The golden checkpoint of `family` with its config and tensors edited, in tmp_path/hf."""
    src, folder = DATA / family / "hf", tmp_path / "hf"
    shutil.copytree(src, folder)
    for p in folder.iterdir():
        p.chmod(0o644)
    cfg = json.loads((src / "config.json").read_text())
    if edit_config is not None:
        edit_config(cfg)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    if edit_tensors is not None:
        tensors = _raw_tensors(src)
        edit_tensors(tensors)
        write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    return folder


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_is_the_reference_layout(tmp_path: Path, family: str) -> None:
    """Key for key, tensor for tensor, byte for byte: the file mainline's converter classes write."""
    out = _convert(DATA / family / "hf", "f32", tmp_path / "f32.gguf", _pre(family))
    assert_same_gguf(out, DATA / family / "ref-f32.gguf")


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_equals_ik_quantize_of_the_reference(tmp_path: Path, family: str) -> None:
    """Our Q8_0 output has ik's llama-quantize bytes and types for every tensor; the one difference is the shape of
    `ffn_gate_inp_shexp`: mainline's converter writes {H, 1} (kept), ik's quantizer squeezes it to {H}."""
    ours = GGUFFile(_convert(DATA / family / "hf", "q8_0", tmp_path / "q8.gguf", _pre(family)))
    ik = GGUFFile(DATA / family / "ref-q8_0.gguf")
    assert [(kv.key, kv.value) for kv in ours.kv()] == [(kv.key, kv.value) for kv in ik.kv()]
    assert list(ours.tensors) == list(ik.tensors)
    for name, t in ik.tensors.items():
        mine = ours.tensors[name]
        assert mine.type == t.type, name
        assert ours.raw(name).tobytes() == ik.raw(name).tobytes(), name
        want_ne = (*t.ne, 1) if name.endswith("ffn_gate_inp_shexp.weight") else t.ne
        assert mine.ne == want_ne, name
    types = {n: t.type.name for n, t in ours.tensors.items()}
    assert types["blk.0.ssm_conv1d.weight"] == "F32" and types["blk.0.ssm_a"] == "F32"
    assert types["blk.0.attn_qkv.weight"] == "Q8_0" and types["blk.0.ffn_gate_exps.weight"] == "Q8_0"


def _hf(family: str) -> dict[str, np.ndarray]:
    st = SafetensorsFile(DATA / family / "hf" / "model.safetensors")
    return {n: t.to_f32() for n, t in st.tensors.items()}


def test_qwen35_value_heads_are_tiled(tmp_path: Path) -> None:
    """What the reference bytes encode, from the HF tensors: tiled V-head j*n_k + g is HF's grouped head g*r + j."""
    g = GGUFFile(_convert(DATA / "qwen35-moe" / "hf", "f32", tmp_path / "f.gguf", "qwen35"))
    hf = _hf("qwen35-moe")
    cfg = json.loads((DATA / "qwen35-moe" / "hf" / "config.json").read_text())
    n_k, n_v, dv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    r = n_v // n_k
    p = "model.layers.1.linear_attn."
    z, gate = hf[p + "in_proj_z.weight"], g.dequantize("blk.1.attn_gate.weight")
    a_log, ssm_a = hf[p + "A_log"], g.dequantize("blk.1.ssm_a")
    out_w, ssm_out = hf[p + "out_proj.weight"], g.dequantize("blk.1.ssm_out.weight")
    for j in range(r):
        for grp in range(n_k):
            tiled, grouped = j * n_k + grp, grp * r + j
            np.testing.assert_array_equal(gate[tiled * dv:(tiled + 1) * dv], z[grouped * dv:(grouped + 1) * dv])
            np.testing.assert_array_equal(ssm_out[:, tiled * dv:(tiled + 1) * dv],
                                          out_w[:, grouped * dv:(grouped + 1) * dv])
            assert ssm_a[tiled] == np.float32(-np.exp(np.float64(a_log[grouped])))
    np.testing.assert_array_equal(g.dequantize("blk.1.ssm_norm.weight"), hf[p + "norm.weight"])
    np.testing.assert_array_equal(g.dequantize("blk.1.attn_norm.weight"),
                                  hf["model.layers.1.input_layernorm.weight"] + 1)


def test_qwen3next_qkvz_split_keeps_grouped_order(tmp_path: Path) -> None:
    g = GGUFFile(_convert(DATA / "qwen3-next" / "hf", "f32", tmp_path / "f.gguf", "qwen2"))
    hf = _hf("qwen3-next")
    cfg = json.loads((DATA / "qwen3-next" / "hf" / "config.json").read_text())
    n_k, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    rdv = cfg["linear_num_value_heads"] // n_k * cfg["linear_value_head_dim"]
    qkvz = hf["model.layers.0.linear_attn.in_proj_qkvz.weight"].reshape(n_k, 2 * dk + 2 * rdv, -1)
    qkv, z = g.dequantize("blk.0.attn_qkv.weight"), g.dequantize("blk.0.attn_gate.weight")
    for h in range(n_k):
        np.testing.assert_array_equal(qkv[h * dk:(h + 1) * dk], qkvz[h, :dk])
        np.testing.assert_array_equal(qkv[n_k * dk + h * dk:n_k * dk + (h + 1) * dk], qkvz[h, dk:2 * dk])
        np.testing.assert_array_equal(qkv[2 * n_k * dk + h * rdv:2 * n_k * dk + (h + 1) * rdv],
                                      qkvz[h, 2 * dk:2 * dk + rdv])
        np.testing.assert_array_equal(z[h * rdv:(h + 1) * rdv], qkvz[h, 2 * dk + rdv:])
    np.testing.assert_array_equal(g.dequantize("blk.0.ssm_ba.weight"),
                                  hf["model.layers.0.linear_attn.in_proj_ba.weight"])


def test_multimodal_checkpoint_skips_the_vision_tower_and_mtp(tmp_path: Path) -> None:
    """Qwen3_5MoeForConditionalGeneration: text_config and `model.language_model.` read as the text model's; the
    vision tower and the MTP layer are skipped and listed by --dry-run; the file is the text model's."""
    def edit_config(cfg: dict) -> None:
        top = ("architectures", "transformers_version", "bos_token_id", "eos_token_id")  # SpecialVocab reads these
        text = {k: cfg.pop(k) for k in list(cfg) if k not in top}
        cfg.update(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
                   text_config=text, vision_config={"depth": 1, "hidden_size": 16})

    def edit_tensors(t: dict[str, tuple[str, np.ndarray]]) -> None:
        for name in [n for n in t if n.startswith("model.")]:
            t[name.replace("model.", "model.language_model.", 1)] = t.pop(name)
        t["model.visual.blocks.0.attn.qkv.weight"] = ("F32", np.ones((48, 16), np.float32))
        t["mtp.fc.weight"] = ("F32", np.ones((64, 128), np.float32))

    folder = _variant(tmp_path, "qwen35-moe", edit_config, edit_tensors)
    out = _convert(folder, "f32", tmp_path / "mm.gguf", "qwen35")
    assert_same_gguf(out, DATA / "qwen35-moe" / "ref-f32.gguf")
    res = runner.invoke(app, ["hf2gguf", str(folder), "--dry-run", "--pre-tokenizer", "qwen35",
                              "--outfile", str(tmp_path / "x.gguf")], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "2 HF tensors skipped" in res.output and "model.visual.blocks.0.attn.qkv.weight" in res.output
    assert "mtp.fc.weight" in res.output and not (tmp_path / "x.gguf").exists()


def _layer_as_full_attention(layer: int, source_layer: int = 3, keep: bool = False) -> Callable[[dict], None]:
    """Tensor edit: `layer` given a copy of `source_layer`'s gated attention, its delta-net deleted unless `keep`."""
    def edit(t: dict[str, tuple[str, np.ndarray]]) -> None:
        for name in [n for n in t if n.startswith(f"model.layers.{layer}.linear_attn.") and not keep]:
            del t[name]
        for name in [n for n in t if n.startswith(f"model.layers.{source_layer}.self_attn.")]:
            t[name.replace(f".{source_layer}.", f".{layer}.", 1)] = t[name]
    return edit


def test_qwen3next_interval_other_than_4_converts_with_a_warning(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """full_attention_interval 2: layers 1 and 3 full attention. The file says so (ikrun computes it); ik's loader
    assumes 4 and would refuse it, which the warning says."""
    folder = _variant(tmp_path, "qwen3-next", lambda c: c.update(full_attention_interval=2),
                      _layer_as_full_attention(1))
    with caplog.at_level(logging.WARNING):
        g = GGUFFile(Converter(folder, "f32", "qwen2").write(tmp_path / "i2.gguf"))
    assert g.get("qwen3next.full_attention_interval") == 2
    assert "blk.1.attn_q.weight" in g.tensors and "blk.1.ssm_a" not in g.tensors and "blk.2.ssm_a" in g.tensors
    assert "full_attention_interval = 2" in caplog.text and "will not load" in caplog.text


def _dense_config(cfg: dict) -> None:
    """Config edit: the Qwen3.5 MoE checkpoint as a dense Qwen3_5ForCausalLM (FFN 96)."""
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        del cfg[key]
    cfg.update(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", intermediate_size=96)


def _dense_tensors(t: dict[str, tuple[str, np.ndarray]]) -> None:
    """Tensor edit: the shared expert becomes the dense MLP, the routed experts and gates go."""
    for name in [n for n in t if ".mlp." in n]:
        if ".shared_expert." in name:
            t[name.replace(".shared_expert.", ".")] = t[name]
        del t[name]


def test_dense_qwen35(tmp_path: Path) -> None:
    """Qwen3_5ForCausalLM (arch qwen35): a dense SwiGLU FFN per layer, no expert keys."""
    g = GGUFFile(Converter(_variant(tmp_path, "qwen35-moe", _dense_config, _dense_tensors), "f32", "qwen35")
                 .write(tmp_path / "dense.gguf"))
    assert g.get("general.architecture") == "qwen35" and g.get("qwen35.feed_forward_length") == 96
    keys = [kv.key for kv in g.kv()]
    assert not any("expert" in k for k in keys)
    assert list(g.tensors)[-5:] == ["blk.3.ffn_gate.weight", "blk.3.ffn_up.weight", "blk.3.ffn_down.weight",
                                    "output_norm.weight", "output.weight"]
    ref = GGUFFile(DATA / "qwen35-moe" / "ref-f32.gguf")
    assert g.raw("blk.0.attn_gate.weight").tobytes() == ref.raw("blk.0.attn_gate.weight").tobytes()


def test_qwen35_without_mrope_section_gets_mainlines_default(tmp_path: Path) -> None:
    """ik's qwen35moe loader requires rope.dimension_sections: mainline writes [11, 11, 10, 0], after its other keys."""
    folder = _variant(tmp_path, "qwen35-moe", lambda c: c["rope_parameters"].pop("mrope_section"))
    g = GGUFFile(Converter(folder, "f32", "qwen35").write(tmp_path / "x.gguf"))
    keys = [kv.key for kv in g.kv()]
    assert list(g.get("qwen35moe.rope.dimension_sections")) == [11, 11, 10, 0]
    assert keys.index("qwen35moe.rope.dimension_sections") == keys.index("qwen35moe.rope.dimension_count") + 1
    qwen3next = GGUFFile(DATA / "qwen3-next" / "ref-f32.gguf")
    assert not any(kv.key.endswith("dimension_sections") for kv in qwen3next.kv())


def test_ik_runs_the_dense_qwen35_conversion_as_transformers_defines_it(tmp_path: Path) -> None:
    """No golden file for dense Qwen3.5: ik (the wheel) on our conversion against the numpy reference on the
    checkpoint (ikrun.validate.qwen3next, itself checked against transformers on the MoE model)."""
    from ikrun.validate.hf import HFReference
    from tests import ik_engine
    from tests.test_ik_engine import mean_kld

    folder = _variant(tmp_path, "qwen35-moe", _dense_config, _dense_tensors)
    out = Converter(folder, "f32", "qwen35").write(tmp_path / "dense.gguf")
    tokens = np.load(DATA.parent / "hf-logits" / "qwen35-moe" / "tokens.npy")[0]
    assert mean_kld(HFReference(folder).logits(tokens), ik_engine.logits(out, [int(t) for t in tokens])) <= 1e-8


def _value_heads_of(dv: int, cfg: dict) -> Callable[[dict[str, tuple[str, np.ndarray]]], None]:
    """Tensor edit: every delta-net value head cut to its first `dv` channels (config `cfg`'s heads)."""
    n_k, dk, n_v, old = (cfg[k] for k in ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
                                           "linear_value_head_dim"))
    keep = np.concatenate([np.arange(2 * n_k * dk)] + [2 * n_k * dk + h * old + np.arange(dv) for h in range(n_v)])
    keep_z = np.concatenate([h * old + np.arange(dv) for h in range(n_v)])

    def edit(t: dict[str, tuple[str, np.ndarray]]) -> None:
        for name, (dtype, w) in list(t.items()):
            if ".linear_attn." not in name:
                continue
            if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
                t[name] = (dtype, w[keep])
            elif name.endswith("in_proj_z.weight"):
                t[name] = (dtype, w[keep_z])
            elif name.endswith("out_proj.weight"):
                t[name] = (dtype, w[:, keep_z])
            elif name.endswith("norm.weight"):
                t[name] = (dtype, w[:dv])
    return edit


def test_qwen35_value_head_size_off_the_key_head_size_converts_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tests import ik_engine

    cfg = json.loads((DATA / "qwen35-moe" / "hf" / "config.json").read_text())
    folder = _variant(tmp_path, "qwen35-moe", lambda c: c.update(linear_value_head_dim=32), _value_heads_of(32, cfg))
    with caplog.at_level(logging.WARNING):
        out = Converter(folder, "f32", "qwen35").write(tmp_path / "dv32.gguf")
    assert "linear_value_head_dim = 32 differs from linear_key_head_dim = 64" in caplog.text
    g = GGUFFile(out)
    assert g.get("qwen35moe.ssm.inner_size") == 128 and g.tensors["blk.0.ssm_norm.weight"].ne == (32,)
    with pytest.raises(ik_engine.IkFailed, match="attn_qkv.weight"):
        ik_engine.logits(out, [1, 2, 3])


def _qwen3next_heads_of(d: int, cfg: dict) -> Callable[[dict[str, tuple[str, np.ndarray]]], None]:
    """Tensor edit: every Qwen3-Next delta-net q / k / v / z head cut to its first `d` channels."""
    n_k, dk, n_v, dv = (cfg[k] for k in ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
                                         "linear_value_head_dim"))
    r = n_v // n_k

    def heads(start: int, count: int, size: int) -> list[np.ndarray]:
        return [start + h * size + np.arange(d) for h in range(count)]

    per_key = 2 * dk + 2 * r * dv
    qkvz = np.concatenate([np.concatenate(heads(g * per_key, 2, dk) + heads(g * per_key + 2 * dk, 2 * r, dv))
                           for g in range(n_k)])
    conv = np.concatenate(heads(0, 2 * n_k, dk) + heads(2 * n_k * dk, n_v, dv))
    out = np.concatenate(heads(0, n_v, dv))

    def edit(t: dict[str, tuple[str, np.ndarray]]) -> None:
        for name, (dtype, w) in list(t.items()):
            rows = {"in_proj_qkvz.weight": qkvz, "conv1d.weight": conv, "norm.weight": np.arange(d)}
            for suffix, keep in rows.items():
                if name.endswith(".linear_attn." + suffix):
                    t[name] = (dtype, w[keep])
            if name.endswith(".linear_attn.out_proj.weight"):
                t[name] = (dtype, w[:, out])
    return edit


def test_head_size_32_converts_with_a_warning_and_ik_computes_something_else(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """ik loads a head-size-32 file but its generic delta-net path is far from the model (the reference)."""
    from ikrun.validate.hf import HFReference
    from tests import ik_engine
    from tests.test_ik_engine import mean_kld

    cfg = json.loads((DATA / "qwen3-next" / "hf" / "config.json").read_text())
    folder = _variant(tmp_path, "qwen3-next", lambda c: c.update(linear_key_head_dim=32, linear_value_head_dim=32),
                      _qwen3next_heads_of(32, cfg))
    with caplog.at_level(logging.WARNING):
        out = Converter(folder, "f32", "qwen2").write(tmp_path / "d32.gguf")
    assert "cover head sizes 64 and 128 only" in caplog.text
    tokens = np.load(DATA.parent / "hf-logits" / "qwen3-next" / "tokens.npy")[0]
    # measured 1.01 (the golden README: 0.96 against transformers on another head-size-32 checkpoint)
    assert mean_kld(HFReference(folder).logits(tokens), ik_engine.logits(out, [int(t) for t in tokens])) > 0.1


def test_ik_refuses_the_interval_2_file_as_the_warning_says(tmp_path: Path) -> None:
    from tests import ik_engine

    folder = _variant(tmp_path, "qwen3-next", lambda c: c.update(full_attention_interval=2),
                      _layer_as_full_attention(1))
    out = Converter(folder, "f32", "qwen2").write(tmp_path / "i2.gguf")
    with pytest.raises(ik_engine.IkFailed, match="blk.1.ssm_conv1d.weight' not found"):
        ik_engine.logits(out, [1, 2, 3])


# ---- bad input: one line naming the culprit, exit 2, nothing written -------------------------------------------

def _fails(folder: Path, tmp_path: Path, pre: str, *needles: str) -> None:
    convert_fails([str(folder), "--outtype", "f32", "--pre-tokenizer", pre], tmp_path / "out.gguf", *needles)


def test_conv_kernel_disagreeing_with_the_config(tmp_path: Path) -> None:
    folder = _variant(tmp_path, "qwen3-next", lambda c: c.update(linear_conv_kernel_dim=3))
    _fails(folder, tmp_path, "qwen2", "model.layers.0.linear_attn.conv1d.weight", "[512, 4]", "implies [512, 3]",
           "linear_conv_kernel_dim")


def test_state_size_disagreeing_with_the_heads(tmp_path: Path) -> None:
    folder = _variant(tmp_path, "qwen35-moe", lambda c: c.update(linear_key_head_dim=32))
    _fails(folder, tmp_path, "qwen35", "model.layers.0.linear_attn.", "config.json implies", "linear_key_head_dim")


def test_qkvz_disagreeing_with_the_heads(tmp_path: Path) -> None:
    folder = _variant(tmp_path, "qwen3-next", lambda c: c.update(linear_value_head_dim=32))
    _fails(folder, tmp_path, "qwen2", "model.layers.0.linear_attn.in_proj_qkvz.weight", "[768, 64]",
           "linear_value_head_dim")


def test_value_heads_not_a_multiple_of_key_heads(tmp_path: Path) -> None:
    folder = _variant(tmp_path, "qwen3-next", lambda c: c.update(linear_num_value_heads=3))
    _fails(folder, tmp_path, "qwen2", "linear_num_value_heads = 3", "linear_num_key_heads = 2")


def test_layer_types_off_the_interval(tmp_path: Path) -> None:
    types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    folder = _variant(tmp_path, "qwen35-moe", lambda c: c.update(layer_types=types))
    _fails(folder, tmp_path, "qwen35", "layer_types", "full_attention_interval = 4")


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_scaling_is_refused(tmp_path: Path, family: str) -> None:
    def edit(cfg: dict) -> None:
        if family == "qwen3-next":
            cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
        else:
            cfg["rope_parameters"]["rope_type"] = "yarn"

    folder = _variant(tmp_path, family, edit)
    _fails(folder, tmp_path, _pre(family), "rope_scaling" if family == "qwen3-next" else "rope_parameters.rope_type",
           "'yarn'", "not supported")


def test_unknown_layer_type(tmp_path: Path) -> None:
    types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    folder = _variant(tmp_path, "qwen35-moe", lambda c: c.update(layer_types=types))
    _fails(folder, tmp_path, "qwen35", "layer_types[1] = 'sliding_attention'")


def test_delta_net_layer_without_its_tensors(tmp_path: Path) -> None:
    folder = _variant(tmp_path, "qwen3-next", edit_tensors=_layer_as_full_attention(1))
    _fails(folder, tmp_path, "qwen2", "lacks 8 tensor(s)", "blk.1.attn_qkv.weight")


def test_attention_tensor_in_a_delta_net_layer(tmp_path: Path) -> None:
    """layer 1 given gated attention beside its delta-net: named, not dropped."""
    folder = _variant(tmp_path, "qwen3-next", edit_tensors=_layer_as_full_attention(1, keep=True))
    _fails(folder, tmp_path, "qwen2", "model.layers.1.self_attn.", "does not belong in layer 1",
           "linear attention")
