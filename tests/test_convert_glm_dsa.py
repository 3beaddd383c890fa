"""ikconvert hf2gguf for GlmMoeDsaForCausalLM (arch glm-dsa): the verified reference layout (ref-f32.gguf, which ik
loads and which reproduces transformers), a generated GLM-5-style checkpoint (an indexer on every layer, sharded),
and bad inputs."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.cli import app
from ikconvert.convert import Converter
from ikconvert.safetensors_io import SafetensorsFile, write_safetensors
from ikquant.formats.numeric import f32_to_bf16_bits
from ikquant.gguf_io import GGUFFile
from tests.convert_helpers import convert_fails, write_sharded
from tests.test_convert_deepseek2 import _DROP, _GLOBAL, _all_tensors, _copy, _edit_config
from tests.test_convert_deepseek2 import _RENAMES as _DEEPSEEK_RENAMES

runner = CliRunner()
GOLDEN = Path(__file__).parent / "data" / "convert" / "glm-dsa"
PRE = "glm4"  # the tiny tokenizer's probe hash is unknown; GLM tokenizers are ik's glm4 split
INDEX = "model.safetensors.index.json"


def _convert(args: list[str]):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["hf2gguf", *args], env={"COLUMNS": "300"})


def _keys(g: GGUFFile) -> list[tuple[str, object, object]]:
    return [(kv.key, kv.type, kv.value) for kv in g.kv() if kv.key.startswith(("glm-dsa.", "tokenizer."))]


# ---- 1. the verified reference layout ---------------------------------------------------------------------------
def test_golden_equals_the_verified_reference(tmp_path: Path) -> None:
    """Every glm-dsa.* / tokenizer.* key (value, type, order) and every tensor (name, shape, type, bytes)."""
    out = tmp_path / "f32.gguf"
    res = _convert([str(GOLDEN / "hf"), "--outtype", "f32", "--pre-tokenizer", PRE, "--outfile", str(out)])
    assert res.exit_code == 0, res.output
    ours, ref = GGUFFile(out), GGUFFile(GOLDEN / "ref-f32.gguf")
    assert _keys(ours) == _keys(ref)
    assert {n: (t.ne, t.type) for n, t in ours.tensors.items()} == {n: (t.ne, t.type) for n, t in ref.tensors.items()}
    for name in ref.tensors:
        assert ours.raw(name).tobytes() == ref.raw(name).tobytes(), name
    general = [k for k in ours.keys if k.startswith("general.")]
    assert general == ["general.architecture", "general.type", "general.name", "general.size_label",
                       "general.file_type", "general.quantization_version"]
    assert ours.get("general.name") == ref.get("general.name") == "Hf"


def test_keys_the_spec_singles_out(tmp_path: Path) -> None:
    """ik's MLA form (not config head_dim 32), the gating function written, the MTP block kept."""
    g = GGUFFile(Converter(GOLDEN / "hf", "f32", PRE).write(tmp_path / "f32.gguf"))
    cfg = json.loads((GOLDEN / "hf" / "config.json").read_text())
    assert cfg["head_dim"] == 32 and cfg["num_key_value_heads"] == 4
    assert g.get("glm-dsa.attention.key_length") == cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] == 48
    assert g.get("glm-dsa.attention.value_length") == cfg["v_head_dim"]
    assert g.get("glm-dsa.attention.head_count_kv") == cfg["num_attention_heads"]
    assert g.get("glm-dsa.expert_gating_func") == 2
    assert g.get("glm-dsa.rope.freq_base") == cfg["rope_parameters"]["rope_theta"]
    assert g.get("glm-dsa.block_count") == 8 and g.get("glm-dsa.nextn_predict_layers") == 1
    assert g.get("glm-dsa.attention.indexer.types") == [t == "full" for t in cfg["indexer_types"]]
    assert g.tensors["blk.0.attn_k_b.weight"].ne == (32, 64, 4) and g.tensors["blk.0.attn_v_b.weight"].ne == (64, 48, 4)
    assert "blk.0.attn_kv_b.weight" not in g.tensors
    assert {n for n in g.tensors if ".indexer.attn_k." in n} == {f"blk.{i}.indexer.attn_k.weight" for i in (0, 1, 2, 6, 7)}
    assert [g.get(f"tokenizer.ggml.{t}_token_id") for t in ("bos", "eot", "unknown", "eom")] == [298, 303, 296, 305]


def test_quantized_outtype_keeps_small_tensors_f32(tmp_path: Path) -> None:
    g = GGUFFile(Converter(GOLDEN / "hf", "q8_0", PRE).write(tmp_path / "q8.gguf"))
    types = {n: t.type.name for n, t in g.tensors.items()}
    for name in ("blk.0.indexer.k_norm.weight", "blk.0.indexer.k_norm.bias", "blk.3.exp_probs_b.bias",
                 "blk.3.ffn_gate_inp.weight", "blk.0.attn_q_a_norm.weight"):
        assert types[name] == "F32", name
    for name in ("blk.0.indexer.attn_q_b.weight", "blk.0.indexer.proj.weight", "blk.0.attn_k_b.weight",
                 "blk.3.ffn_up_exps.weight", "blk.7.nextn.eh_proj.weight"):
        assert types[name] == "Q8_0", name
    ref = GGUFFile(GOLDEN / "ref-f32.gguf")
    w, q = ref.dequantize("blk.0.attn_k_b.weight"), g.dequantize("blk.0.attn_k_b.weight")
    assert w.shape == q.shape == (4, 64, 32) and np.abs(w - q).max() <= np.abs(w).max() / 100


# ---- 2. a generated GLM-5-style checkpoint ----------------------------------------------------------------------
@dataclass(frozen=True)
class GlmSpec:
    """GLM-5 style: no IndexShare keys (every layer full), top-level rope_theta, a head_dim unlike the key length."""

    hidden: int = 48
    heads: int = 3
    q_lora: int = 40
    kv_lora: int = 32
    nope: int = 16
    rope: int = 8
    v: int = 24
    head_dim: int = 64
    ff: int = 96
    moe_ff: int = 16
    experts: int = 5
    shared: int = 2
    dense: int = 1
    layers: int = 4
    index_heads: int = 16  # with few heads relu makes exact zero-score ties likely (the top-k's tie-break would decide)
    index_dim: int = 16
    mtp_head: bool = False  # the MTP block's own embed_tokens / shared_head.head (GLM-5 has neither)
    seed: int = 0


def make_glm_checkpoint(folder: Path, s: GlmSpec) -> Path:
    """Config, the golden tokenizer and random BF16 weights in three shards with an index; an indexer on every
    layer and on the MTP block (model.layers.<layers>), a layer's experts straddling two shards."""
    rng = np.random.default_rng(s.seed)
    folder.mkdir(parents=True)
    vocab = 336
    w: dict[str, tuple[str, np.ndarray]] = {}

    def bf16(name: str, *shape: int) -> None:
        w[name] = ("BF16", f32_to_bf16_bits((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)))

    bf16("model.embed_tokens.weight", vocab, s.hidden)
    bf16("lm_head.weight", vocab, s.hidden)
    bf16("model.norm.weight", s.hidden)
    for i in range(s.layers + 1):
        p = f"model.layers.{i}."
        for norm, dim in (("input_layernorm", s.hidden), ("post_attention_layernorm", s.hidden),
                          ("self_attn.q_a_layernorm", s.q_lora), ("self_attn.kv_a_layernorm", s.kv_lora)):
            bf16(p + norm + ".weight", dim)
        bf16(p + "self_attn.q_a_proj.weight", s.q_lora, s.hidden)
        bf16(p + "self_attn.q_b_proj.weight", s.heads * (s.nope + s.rope), s.q_lora)
        bf16(p + "self_attn.kv_a_proj_with_mqa.weight", s.kv_lora + s.rope, s.hidden)
        bf16(p + "self_attn.kv_b_proj.weight", s.heads * (s.nope + s.v), s.kv_lora)
        bf16(p + "self_attn.o_proj.weight", s.hidden, s.heads * s.v)
        bf16(p + "self_attn.indexer.wq_b.weight", s.index_heads * s.index_dim, s.q_lora)
        bf16(p + "self_attn.indexer.wk.weight", s.index_dim, s.hidden)
        bf16(p + "self_attn.indexer.k_norm.weight", s.index_dim)
        bf16(p + "self_attn.indexer.k_norm.bias", s.index_dim)
        bf16(p + "self_attn.indexer.weights_proj.weight", s.index_heads, s.hidden)
        if i < s.dense:
            for proj, shape in (("gate", (s.ff, s.hidden)), ("up", (s.ff, s.hidden)), ("down", (s.hidden, s.ff))):
                bf16(f"{p}mlp.{proj}_proj.weight", *shape)
            continue
        bf16(p + "mlp.gate.weight", s.experts, s.hidden)
        w[p + "mlp.gate.e_score_correction_bias"] = ("F32", rng.standard_normal(s.experts).astype(np.float32))
        for ex in [f"experts.{x}." for x in range(s.experts)] + ["shared_experts."]:
            ff = s.moe_ff * (s.shared if ex == "shared_experts." else 1)
            for proj, shape in (("gate", (ff, s.hidden)), ("up", (ff, s.hidden)), ("down", (s.hidden, ff))):
                bf16(f"{p}mlp.{ex}{proj}_proj.weight", *shape)
    mtp = f"model.layers.{s.layers}."
    bf16(mtp + "eh_proj.weight", s.hidden, 2 * s.hidden)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        bf16(f"{mtp}{norm}.weight", s.hidden)
    if s.mtp_head:
        bf16(mtp + "embed_tokens.weight", vocab, s.hidden)
        bf16(mtp + "shared_head.head.weight", vocab, s.hidden)

    def shard_of(name: str) -> int:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m is None or name.startswith(mtp):
            return 3
        moved = name.startswith(f"model.layers.{s.dense}.mlp.experts.{s.experts - 1}.")
        return 1 + (int(m.group(1)) + moved) % 2

    write_sharded(folder, w, shard_of, INDEX)
    config = {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": s.hidden,
        "num_attention_heads": s.heads, "num_key_value_heads": s.heads, "head_dim": s.head_dim,
        "q_lora_rank": s.q_lora, "kv_lora_rank": s.kv_lora, "qk_nope_head_dim": s.nope, "qk_rope_head_dim": s.rope,
        "v_head_dim": s.v, "intermediate_size": s.ff, "moe_intermediate_size": s.moe_ff, "n_routed_experts": s.experts,
        "n_shared_experts": s.shared, "num_experts_per_tok": 2, "first_k_dense_replace": s.dense,
        "num_hidden_layers": s.layers, "num_nextn_predict_layers": 1, "index_n_heads": s.index_heads,
        "index_head_dim": s.index_dim, "index_topk": 8, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "norm_topk_prob": True,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "vocab_size": vocab, "pad_token_id": 296,
        "eos_token_id": [296, 303, 305], "tie_word_embeddings": False, "dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(GOLDEN / "hf" / name, folder / name)
    return folder


# the spec's name table (glm-dsa-gguf.md §5): DeepSeek's, written out independently of the converter's, plus
_RENAMES = {
    **_DEEPSEEK_RENAMES,
    "self_attn.indexer.wq_b.weight": "indexer.attn_q_b.weight", "self_attn.indexer.wk.weight": "indexer.attn_k.weight",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm.weight", "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight", "hnorm.weight": "nextn.hnorm.weight",
    "shared_head.norm.weight": "nextn.shared_head_norm.weight", "embed_tokens.weight": "nextn.embed_tokens.weight",
    "shared_head.head.weight": "nextn.shared_head_head.weight",
}
VARIANTS = {"glm5": GlmSpec(), "one-head-mtp-head": GlmSpec(heads=1, layers=3, dense=2, mtp_head=True, seed=4)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_generated_checkpoint_accounts_for_every_tensor(tmp_path: Path, variant: str) -> None:
    s = VARIANTS[variant]
    hf = make_glm_checkpoint(tmp_path / "hf", s)
    g = GGUFFile(Converter(hf, "f32", PRE).write(tmp_path / "out.gguf"))
    used: set[str] = set()
    for name, t in _all_tensors(hf).items():
        value = t.to_f32()
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if m is None:
            np.testing.assert_array_equal(g.dequantize(_GLOBAL[name]), value, err_msg=name)
            used.add(_GLOBAL[name])
            continue
        bid, rest = int(m.group(1)), m.group(2)
        ex = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", rest)
        if ex:
            merged = f"blk.{bid}.ffn_{ex.group(2)}_exps.weight"
            np.testing.assert_array_equal(g.dequantize(merged)[int(ex.group(1))], value, err_msg=name)
            used.add(merged)
        elif rest == "self_attn.kv_b_proj.weight":
            k_b, v_b = f"blk.{bid}.attn_k_b.weight", f"blk.{bid}.attn_v_b.weight"
            assert g.tensors[k_b].ne == (s.nope, s.kv_lora, s.heads)  # 3-D even for a single head
            assert g.tensors[v_b].ne == (s.kv_lora, s.v, s.heads)
            heads = value.reshape(s.heads, s.nope + s.v, s.kv_lora)
            for h in range(s.heads):
                np.testing.assert_array_equal(g.dequantize(k_b)[h], heads[h, :s.nope].T)
                np.testing.assert_array_equal(g.dequantize(v_b)[h], heads[h, s.nope:])
            used |= {k_b, v_b}
        else:
            target = f"blk.{bid}.{_RENAMES[rest]}"
            np.testing.assert_array_equal(g.dequantize(target), value, err_msg=name)
            used.add(target)
    assert used == set(g.tensors)
    key = "glm-dsa."
    assert g.get(key + "block_count") == s.layers + 1 and g.get(key + "nextn_predict_layers") == 1
    assert g.get(key + "attention.key_length") == s.nope + s.rope != s.head_dim
    assert g.get(key + "attention.head_count_kv") == s.heads
    assert g.get(key + "attention.indexer.types") == [True] * s.layers  # GLM-5: no IndexShare keys
    assert g.get(key + "rope.freq_base") == 1e6 and g.get(key + "leading_dense_block_count") == s.dense
    assert (g.get(key + "attention.indexer.head_count"), g.get(key + "attention.indexer.key_length"),
            g.get(key + "attention.indexer.top_k")) == (s.index_heads, s.index_dim, 8)


@pytest.mark.parametrize(("config", "types"), [
    ({"index_topk_freq": 4, "index_skip_topk_offset": 3}, "FFFSSSFSSSF"),  # GLM-5.2's schedule, derived
    ({"index_topk_pattern": "FSFFSSFSFSS"}, "FSFFSSFSFSS"),
    ({}, "FFFFFFFFFFF"),
])
def test_indexer_schedule_as_transformers_derives_it(config: dict, types: str) -> None:
    from ikconvert.archs.glm_dsa import indexer_types

    assert "".join(t[0].upper() for t in indexer_types(config, 11)) == types


# ---- 3. bad input: a clear error naming the file/tensor, and no output ------------------------------------------
def _drop_tensors(hf: Path, pattern: str) -> None:
    st = SafetensorsFile(hf / "model.safetensors")
    keep = {n: (t.dtype, np.array(t.raw())) for n, t in st.tensors.items() if not re.fullmatch(pattern, n)}
    assert len(keep) < len(st.tensors)
    del st
    write_safetensors(hf / "model.safetensors", keep, {"format": "pt"})


def _fails(folder: Path, tmp_path: Path, *needles: str) -> None:
    convert_fails([str(folder), "--outtype", "f32", "--pre-tokenizer", PRE], tmp_path / "out.gguf", *needles)


def test_full_layer_without_indexer(tmp_path: Path) -> None:
    hf = _copy(GOLDEN / "hf", tmp_path / "hf")
    _drop_tensors(hf, r"model\.layers\.6\.self_attn\.indexer\..*")
    _fails(hf, tmp_path, "layer 6 is 'full' in indexer_types", "blk.6.indexer.attn_q_b.weight",
           "model.layers.6.self_attn.indexer")


def test_layer_with_part_of_an_indexer(tmp_path: Path) -> None:
    hf = _copy(GOLDEN / "hf", tmp_path / "hf")
    _drop_tensors(hf, r"model\.layers\.7\.self_attn\.indexer\.wk\.weight")
    _fails(hf, tmp_path, "layer 7 has only part of an indexer", "blk.7.indexer.attn_k.weight")


def test_missing_nextn_block(tmp_path: Path) -> None:
    hf = _copy(GOLDEN / "hf", tmp_path / "hf")
    _edit_config(hf, num_nextn_predict_layers=2)
    _fails(hf, tmp_path, "NextN/MTP block (num_nextn_predict_layers) 8", "no model.layers.8.* tensors")


def test_nextn_tensor_in_a_main_layer(tmp_path: Path) -> None:
    hf = _copy(GOLDEN / "hf", tmp_path / "hf")
    _edit_config(hf, num_hidden_layers=8, num_nextn_predict_layers=0, indexer_types=_DROP, mlp_layer_types=_DROP)
    _fails(hf, tmp_path, "'model.layers.7.eh_proj.weight' is a NextN/MTP tensor", "layer 7 is a main layer")


@pytest.mark.parametrize(("change", "needles"), [
    ({"indexer_types": ["full", "full", "shared"]}, ("indexer_types must give 'full' or 'shared' for each of the 7",)),
    ({"indexer_types": ["shared"] + ["full"] * 6}, ("indexer_types starts with 'shared'",)),
    ({"mlp_layer_types": ["dense"] * 2 + ["sparse"] * 5}, ("mlp_layer_types", "is not 3 dense layers",)),
    ({"rope_parameters": {"rope_theta": 8e6, "rope_type": "yarn", "factor": 4}}, ("rope scaling 'yarn'",)),
    ({"index_n_heads": 8}, ("'model.layers.0.self_attn.indexer.weights_proj.weight'", "[16, 64]", "implies [8, 64]")),
    ({"num_attention_heads": 2}, ("'model.layers.0.self_attn.kv_b_proj.weight'", "[320, 64]")),
    ({"scoring_func": _DROP}, ("scoring_func None",)),
])
def test_config_that_does_not_fit(tmp_path: Path, change: dict, needles: tuple[str, ...]) -> None:
    hf = _copy(GOLDEN / "hf", tmp_path / "hf")
    _edit_config(hf, **change)
    _fails(hf, tmp_path, *needles)


def test_tokenizer_without_glm_special_tokens(tmp_path: Path) -> None:
    hf = _copy(GOLDEN / "hf", tmp_path / "hf")
    tok = json.loads((hf / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "[gMASK]"]
    (hf / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((hf / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {k: v for k, v in cfg["added_tokens_decoder"].items() if v["content"] != "[gMASK]"}
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    _fails(hf, tmp_path, "tokenizer.json: no added token '[gMASK]'", "bos token")
