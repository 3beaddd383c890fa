"""ikconvert hf2gguf for OpenPanguV2ForCausalLM: ik's golden bytes, a generated sharded checkpoint, bad inputs."""

from __future__ import annotations

import json
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
from ikquant.formats.numeric import f32_to_bf16_bits
from ikquant.gguf_io import GGUFFile
from tests.convert_helpers import convert_fails

runner = CliRunner()
GOLDEN = Path(__file__).parent / "data" / "convert" / "openpangu-v2"


def _convert(args: list[str]):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["hf2gguf", *args], env={"COLUMNS": "250"})


def _forced_pre_tokenizer() -> str:
    """The tokenizer.ggml.pre value ik's oracle run was forced to (recorded in ik-convert.txt)."""
    m = re.search(r"monkeypatched to return: (\S+)", (GOLDEN / "ik-convert.txt").read_text())
    assert m is not None
    return m.group(1)


PRE = _forced_pre_tokenizer()


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_golden_is_byte_identical(tmp_path: Path, outtype: str) -> None:
    assert f"--outtype {outtype} --outfile ik-{outtype}.gguf" in (GOLDEN / "ik-convert.txt").read_text()
    out = tmp_path / f"{outtype}.gguf"
    res = _convert([str(GOLDEN / "hf"), "--outtype", outtype, "--pre-tokenizer", PRE, "--outfile", str(out)])
    assert res.exit_code == 0, res.output
    ours, ik = GGUFFile(out), GGUFFile(GOLDEN / f"ik-{outtype}.gguf")
    assert [(kv.key, kv.type, kv.value) for kv in ours.kv()] == [(kv.key, kv.type, kv.value) for kv in ik.kv()]
    def layout(g: GGUFFile) -> list[tuple]:
        return [(t.name, t.ne, t.type) for t in g.tensors.values()]

    assert layout(ours) == layout(ik)
    for name in ik.tensors:
        assert ours.raw(name).tobytes() == ik.raw(name).tobytes(), name
    assert out.read_bytes() == (GOLDEN / f"ik-{outtype}.gguf").read_bytes()


def test_golden_transforms_match_the_hf_weights(tmp_path: Path) -> None:
    """What ik's bytes encode, checked from the HF tensors: per-head kv_b split, stacked experts, squeezes."""
    out = Converter(GOLDEN / "hf", "f32", PRE).write(tmp_path / "f32.gguf")
    g = GGUFFile(out)
    hf = _hf_tensors(GOLDEN / "hf")
    cfg = json.loads((GOLDEN / "hf" / "config.json").read_text())
    heads, nope, v, rank = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    kv_b = hf["model.layers.2.self_attn.kv_b_proj.weight"]
    k_b, v_b = g.dequantize("blk.2.attn_k_b.weight"), g.dequantize("blk.2.attn_v_b.weight")
    for h in range(heads):
        rows = kv_b[h * (nope + v):(h + 1) * (nope + v)]
        np.testing.assert_array_equal(k_b[h * rank:(h + 1) * rank], rows[:nope].T)
        np.testing.assert_array_equal(v_b[h * v:(h + 1) * v], rows[nope:])
    assert "blk.2.attn_kv_b.weight" not in g.tensors
    gate = g.dequantize("blk.3.ffn_gate_exps.weight")
    for x in range(cfg["n_routed_experts"]):
        np.testing.assert_array_equal(gate[x], hf[f"model.layers.3.mlp.experts.{x}.gate_proj.weight"])
    assert g.tensors["merge_mhc_alpha"].ne == ()
    assert g.tensors["blk.0.attn_o_conv.weight"].ne == (3, 128)
    assert g.get("openpangu.block_count") == cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]
    assert g.get("tokenizer.ggml.add_bos_token") is True


def test_dry_run_shows_the_transforms_and_writes_nothing(tmp_path: Path) -> None:
    res = _convert([str(GOLDEN / "hf"), "--dry-run", "--outtype", "q8_0", "--pre-tokenizer", PRE,
                    "--outfile", str(tmp_path / "x.gguf")])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()

    def row(gguf_name: str) -> str:
        return next(line for line in lines if f" {gguf_name} " in line)

    assert "kv_b split" in row("blk.0.attn_k_b.weight") and "kv_b split" in row("blk.0.attn_v_b.weight")
    assert "model.layers.1.mlp.experts.*.down_proj.weight" in row("blk.1.ffn_down_exps.weight")
    assert "stacked experts 0..3" in row("blk.1.ffn_down_exps.weight")
    conv = row("blk.0.attn_qa_conv.weight")
    assert "{3, 32}" in conv and "F16" in conv and "squeezed from [32, 1, 3]" in conv
    assert "{}" in row("merge_mhc_alpha") and "squeezed from [1]" in row("merge_mhc_alpha")
    assert "router bias renamed" in row("blk.1.exp_probs_b.bias")
    assert "model.layers.3.eh_proj.weight" in row("blk.3.nextn.eh_proj.weight")
    assert "135 tensors" in res.output and "nothing written" in res.output
    assert list(tmp_path.iterdir()) == []


# ---- a second checkpoint, generated: other dims, 3 shards + index, 2 NextN layers ------------------------------

DIMS = {
    "hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 3, "q_lora_rank": 48, "kv_lora_rank": 64,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24, "mhc_num_stream": 2, "n_routed_experts": 3,
    "n_shared_experts": 2, "moe_intermediate_size": 16, "intermediate_size": 80, "num_hidden_layers": 3,
    "num_nextn_predict_layers": 2, "first_k_dense_replace": 1, "index_n_heads": 2, "index_head_dim": 16,
    "param_sink_number": 4, "vocab_size": 336,
}


def _config() -> dict:
    return {
        "architectures": ["OpenPanguV2ForCausalLM"], "model_type": "openpangu_v2", **DIMS,
        "num_experts_per_tok": 2, "routed_scaling_factor": 1.5, "norm_topk_prob": False, "rope_theta": 25000.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "index_topk": 8, "mhc_recur_norm": 7,
        "swa_layers": [1, 3, 4], "sliding_window": 32, "sliding_window_list": [32, 64, 64], "dsa_layers": [0, 2],
        "block_post_layernorm_idx": [1, 2],
        "bos_token_id": 1, "eos_token_id": 300, "pad_token_id": 301, "tie_word_embeddings": False,
    }


def _checkpoint_tensors(cfg: dict, seed: int = 7) -> dict[str, np.ndarray]:
    """Every tensor of an openPangu-style checkpoint for `cfg` (float32 values, stored later as BF16 or F32)."""
    rng = np.random.default_rng(seed)
    e, heads, vocab = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    s = cfg["mhc_num_stream"]
    ff_exp = cfg["moe_intermediate_size"]
    base = cfg["num_hidden_layers"]

    def w(*shape: int) -> np.ndarray:
        """Matrices scaled by 1/sqrt(fan_in), vectors around 1, so the model ik loads computes sane numbers."""
        x = rng.standard_normal(shape)
        return (x / np.sqrt(shape[-1]) if len(shape) > 1 else 1 + 0.1 * x).astype(np.float32)

    t = {"model.embed_tokens.weight": w(vocab, e), "lm_head.weight": w(vocab, e), "model.norm.weight": w(e),
         "model.merge_mhc_module.phi.weight": w(s, s * e), "model.merge_mhc_module.branch_alpha_pre": w(1),
         "model.merge_mhc_module.branch_beta_pre": w(s), "model.merge_mhc_module.norm_gamma": w(s * e)}
    for layer in range(base + cfg["num_nextn_predict_layers"]):
        p = f"model.layers.{layer}."
        t |= {p + n: w(e) for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                    "pre_mlp_layernorm.weight", "post_mlp_layernorm.weight")}
        a = p + "self_attn."
        t |= {a + "q_a_proj.weight": w(q_lora, e), a + "q_a_layernorm.weight": w(q_lora),
              a + "q_b_proj.weight": w(heads * (nope + rope), q_lora),
              a + "kv_a_proj_with_mqa.weight": w(kv_lora + rope, e), a + "kv_a_layernorm.weight": w(kv_lora),
              a + "kv_b_proj.weight": w(heads * (nope + v), kv_lora), a + "o_proj.weight": w(e, heads * v),
              a + "qa_conv.weight": w(q_lora, 1, 3), a + "compresskv_conv.weight": w(kv_lora, 1, 3),
              a + "o_conv.weight": w(heads * v, 1, 3),
              a + "param_sink_compressed_kv": w(cfg["param_sink_number"], kv_lora),
              a + "param_sink_k_pe": w(cfg["param_sink_number"], rope)}
        if layer in cfg["dsa_layers"]:
            n_idx, d_idx = cfg["index_n_heads"], cfg["index_head_dim"]
            t |= {a + "indexer.wq_b.weight": w(n_idx * d_idx, q_lora), a + "indexer.wk.weight": w(d_idx, e),
                  a + "indexer.k_norm.weight": w(d_idx), a + "indexer.weights_proj.weight": w(n_idx, e)}
        if layer < base:
            for sub in ("attn", "mlp"):
                m = f"{p}{sub}_mhc_module."
                t |= {m + "phi.weight": w((s + 2) * s, s * e), m + "branch_alpha": w(3),
                      m + "branch_beta": w(s * (s + 2)), m + "norm_gamma": w(s * e)}
            if layer in cfg["block_post_layernorm_idx"]:
                t[p + "block_post_layernorm.weight"] = w(s * e)
        else:
            t |= {p + "eh_proj.weight": w(e, 2 * e), p + "enorm.weight": w(e), p + "hnorm.weight": w(e),
                  p + "shared_head.norm.weight": w(e)}
            if layer == base + 1:
                t |= {p + "embed_tokens.weight": w(vocab, e), p + "shared_head.head.weight": w(vocab, e)}
        if layer < cfg["first_k_dense_replace"]:
            ff = cfg["intermediate_size"]
            t |= {p + "mlp.gate_proj.weight": w(ff, e), p + "mlp.up_proj.weight": w(ff, e),
                  p + "mlp.down_proj.weight": w(e, ff)}
            continue
        ff_sh = ff_exp * cfg["n_shared_experts"]
        t |= {p + "mlp.gate.weight": w(cfg["n_routed_experts"], e),
              p + "mlp.e_score_correction_bias": w(cfg["n_routed_experts"]),
              p + "mlp.shared_experts.gate_proj.weight": w(ff_sh, e),
              p + "mlp.shared_experts.up_proj.weight": w(ff_sh, e),
              p + "mlp.shared_experts.down_proj.weight": w(e, ff_sh)}
        for x in range(cfg["n_routed_experts"]):
            t |= {f"{p}mlp.experts.{x}.gate_proj.weight": w(ff_exp, e),
                  f"{p}mlp.experts.{x}.up_proj.weight": w(ff_exp, e),
                  f"{p}mlp.experts.{x}.down_proj.weight": w(e, ff_exp)}
    t["model.layers.1.self_attn.rotary_emb.inv_freq"] = w(rope // 2)  # ik drops these by name
    return t


def _shard_of(name: str) -> int:
    """Global tensors and layers 0-1 in shard 1, layer 2 in shard 2 except its expert 0 (so its experts straddle
    shards 1 and 2), NextN layers in shard 3."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    layer = int(m.group(1)) if m else -1
    if layer == 2:
        return 1 if ".experts.0." in name else 2
    return 3 if layer >= 3 else 1


def _write_checkpoint(folder: Path, cfg: dict, tensors: dict[str, np.ndarray]) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    shutil.copy(GOLDEN / "hf" / "tokenizer.json", folder / "tokenizer.json")
    # add_bos_token false here: ik's converter still writes true (in the position SpecialVocab gave the key)
    tok_cfg = json.loads((GOLDEN / "hf" / "tokenizer_config.json").read_text()) | {"add_bos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    weight_map = {}
    for shard in (1, 2, 3):
        part = f"model-{shard:05d}-of-00003.safetensors"
        chosen = {n: a for n, a in tensors.items() if _shard_of(n) == shard}
        # mHC branch scalars ship as F32 (like the published checkpoint), everything else BF16
        stored = {n: ("F32", a) if ".branch_" in n else ("BF16", f32_to_bf16_bits(a)) for n, a in chosen.items()}
        write_safetensors(folder / part, stored, {"format": "pt"})
        weight_map |= dict.fromkeys(chosen, part)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _hf_tensors(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("model*.safetensors")):
        out |= {n: t.to_f32() for n, t in SafetensorsFile(f).tensors.items()}
    return out


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_checkpoint(tmp_path_factory.mktemp("pangu") / "hf", _config(), _checkpoint_tensors(_config()))


def test_generated_checkpoint_accounts_for_every_tensor(generated: Path, tmp_path: Path) -> None:
    conv = Converter(generated, "f32", PRE)
    plan = conv.build_plan()
    g = GGUFFile(conv.write(tmp_path / "gen.gguf"))
    hf = _hf_tensors(generated)
    cfg = _config()
    heads, nope, v, rank = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    accounted: dict[str, str] = {}
    for p in plan:
        data = g.dequantize(p.out.name)
        if "experts.*" in p.out.source:
            for x in range(cfg["n_routed_experts"]):
                name = p.out.source.replace("*", str(x))
                np.testing.assert_array_equal(data[x], hf[name], err_msg=name)
                accounted[name] = p.out.name
        elif p.out.source.endswith("kv_b_proj.weight"):
            per_head = hf[p.out.source].reshape(heads, nope + v, rank)
            want = (per_head[:, :nope].transpose(0, 2, 1).reshape(heads * rank, nope) if ".attn_k_b." in p.out.name
                    else per_head[:, nope:].reshape(heads * v, rank))
            np.testing.assert_array_equal(data, want, err_msg=p.out.name)
            accounted[p.out.source] = p.out.name
        else:
            np.testing.assert_array_equal(data, np.squeeze(hf[p.out.source]), err_msg=p.out.source)
            accounted[p.out.source] = p.out.name
    skipped = sorted(set(hf) - set(accounted))
    assert skipped == ["model.layers.1.self_attn.rotary_emb.inv_freq"]
    assert all(conv.arch.is_skipped(n) for n in skipped)
    # experts of layer 2 straddle shards 1 and 2: merged when the last one arrives, in shard 2's walk
    names = list(g.tensors)
    assert names.index("blk.2.ffn_down_exps.weight") > names.index("blk.2.attn_norm.weight")
    assert names.index("blk.2.ffn_down_exps.weight") < names.index("blk.3.attn_norm.weight")
    assert [n for n in names if n.startswith("blk.2.ffn_") and n.endswith("_exps.weight")] == [
        "blk.2.ffn_down_exps.weight", "blk.2.ffn_gate_exps.weight", "blk.2.ffn_up_exps.weight"]
    # NextN layers are blocks 3 and 4; the optional embed_tokens/shared_head.head of block 4 are kept
    assert {"blk.4.nextn.embed_tokens.weight", "blk.4.nextn.shared_head_head.weight", "blk.3.nextn.eh_proj.weight",
            "blk.4.ffn_up_exps.weight"} <= set(names)
    assert not any(n.startswith(("blk.3.attn_mhc", "blk.3.mlp_mhc", "blk.5.")) for n in names)
    assert "blk.0.attn_indexer_k.weight" in names and "blk.1.attn_indexer_k.weight" not in names
    assert g.tensors["blk.1.attn_k_b.weight"].ne == (nope, heads * rank)
    assert g.tensors["blk.1.attn_v_b.weight"].ne == (rank, heads * v)
    assert g.tensors["blk.1.ffn_gate_exps.weight"].ne == (96, 16, 3)
    assert g.tensors["merge_mhc_alpha"].ne == ()
    assert g.tensors["blk.0.attn_qa_conv.weight"].ne == (3, cfg["q_lora_rank"])


def test_generated_checkpoint_metadata(generated: Path, tmp_path: Path) -> None:
    g = GGUFFile(Converter(generated, "bf16", PRE).write(tmp_path / "gen.gguf"))
    a = "openpangu."
    keys = [kv.key for kv in g.kv()]
    assert g.get(a + "block_count") == 5 and g.get(a + "nextn_predict_layers") == 2
    assert g.get(a + "attention.key_length") == 24 and g.get(a + "attention.value_length") == 24
    assert g.get(a + "attention.head_count_kv") == 3 and g.get(a + "expert_gating_func") == 2
    assert g.get(a + "expert_weights_norm") is False and g.get(a + "expert_shared_count") == 2
    assert g.get(a + "mhc_num_stream") == 2 and g.get(a + "mhc_recur_norm") == 7
    assert g.get(a + "param_sink_number") == 4 and g.get(a + "attention.sliding_window") == 32
    assert g.get(a + "attention.indexer.top_k") == 8 and list(g.get(a + "swa_layers")) == [1, 3, 4]
    assert list(g.get(a + "sliding_window_list")) == [32, 64, 64]
    # general.file_type follows the base keys, before the architecture's own (ik's Model order)
    assert keys.index("general.file_type") == keys.index(a + "expert_used_count") + 1
    assert keys.index(a + "leading_dense_block_count") == keys.index("general.file_type") + 1
    assert g.get("tokenizer.ggml.add_bos_token") is True and g.get("tokenizer.ggml.pre") == PRE
    assert keys.index("tokenizer.ggml.add_bos_token") < keys.index("tokenizer.chat_template")


def test_generated_checkpoint_q8_0_falls_back_to_f16_for_conv_rows(generated: Path, tmp_path: Path) -> None:
    g = GGUFFile(Converter(generated, "q8_0", PRE).write(tmp_path / "gen.gguf"))
    types = {n: t.type.name for n, t in g.tensors.items()}
    for conv in ("attn_qa_conv", "attn_compresskv_conv", "attn_o_conv"):
        assert types[f"blk.4.{conv}.weight"] == "F16"
    assert types["blk.0.attn_q_a.weight"] == "Q8_0" and types["blk.1.ffn_down_exps.weight"] == "F16"  # ne0 16
    assert types["blk.1.attn_param_sink_kv"] == "F32" and types["blk.1.ffn_gate_inp.weight"] == "F32"
    assert types["blk.2.attn_mhc_phi.weight"] == "Q8_0" and types["merge_mhc_alpha"] == "F32"


# ---- bad input: a clear error naming the culprit, and no output file -------------------------------------------

def _fails(folder: Path, tmp_path: Path, *needles: str) -> None:
    convert_fails([str(folder), "--outtype", "f32", "--pre-tokenizer", PRE], tmp_path / "out.gguf", *needles)


def _variant(tmp_path: Path, edit_config: Callable[[dict], None] | None = None, drop: tuple[str, ...] = (),
             rename: dict[str, str] | None = None) -> Path:
    """The generated checkpoint with config edits, tensors dropped or renamed."""
    cfg = _config()
    tensors = _checkpoint_tensors(_config())
    for name in drop:
        del tensors[name]
    for old, new in (rename or {}).items():
        tensors[new] = tensors.pop(old)
    if edit_config is not None:
        edit_config(cfg)
    return _write_checkpoint(tmp_path / "hf", cfg, tensors)


def test_config_disagreeing_with_a_tensor(tmp_path: Path) -> None:
    hf = _variant(tmp_path, lambda c: c.update(mhc_num_stream=3))
    _fails(hf, tmp_path, "model.layers.0.attn_mhc_module.branch_beta", "[8]", "config.json implies [15]",
           "blk.0.attn_mhc_beta")


def test_kv_b_disagreeing_with_the_head_count(tmp_path: Path) -> None:
    hf = _variant(tmp_path, lambda c: c.update(num_attention_heads=2))
    _fails(hf, tmp_path, "model.layers.0.self_attn.kv_b_proj.weight", "[120, 64]", "implies [80, 64]",
           "num_attention_heads")


def test_leftover_experts(tmp_path: Path) -> None:
    hf = _variant(tmp_path, drop=("model.layers.2.mlp.experts.1.up_proj.weight",))
    _fails(hf, tmp_path, "layer 2 has 8 of the 9 expert matrices", "model.layers.2.mlp.experts.1.up_proj.weight")


def test_expert_beyond_n_routed_experts(tmp_path: Path) -> None:
    hf = _variant(tmp_path, lambda c: c.update(n_routed_experts=2))
    _fails(hf, tmp_path, "model.layers.1.mlp.experts.2.down_proj.weight", "n_routed_experts = 2")


def test_deepseek_style_router_bias_does_not_map(tmp_path: Path) -> None:
    hf = _variant(tmp_path, rename={"model.layers.1.mlp.e_score_correction_bias":
                                   "model.layers.1.mlp.gate.e_score_correction_bias"})
    _fails(hf, tmp_path, "model.layers.1.mlp.gate.e_score_correction_bias", "no mapping")


def test_layers_beyond_the_configured_nextn_count(tmp_path: Path) -> None:
    hf = _variant(tmp_path, lambda c: c.update(num_nextn_predict_layers=1))
    _fails(hf, tmp_path, "model.layers.4.", "no mapping")


@pytest.mark.parametrize("key", ["mhc_num_stream", "q_lora_rank", "swa_layers"])
def test_missing_required_config_key(tmp_path: Path, key: str) -> None:
    hf = _variant(tmp_path, lambda c: c.update({key: None}))
    _fails(hf, tmp_path, "config.json", repr(key), "required")


def test_optional_schedule_keys_are_left_out_when_absent(tmp_path: Path) -> None:
    """sliding_window null and no sliding_window_list: ik writes neither key (and no nextn layers: 0)."""
    def edit(cfg: dict) -> None:
        cfg.update(sliding_window=None, num_nextn_predict_layers=0)
        del cfg["sliding_window_list"]

    nextn = tuple(n for n in _checkpoint_tensors(_config()) if re.match(r"model\.layers\.[34]\.", n))
    hf = _variant(tmp_path, edit, drop=nextn)
    g = GGUFFile(Converter(hf, "f32", PRE).write(tmp_path / "x.gguf"))
    keys = [kv.key for kv in g.kv()]
    assert "openpangu.sliding_window_list" not in keys and "openpangu.attention.sliding_window" not in keys
    assert g.get("openpangu.nextn_predict_layers") == 0 and g.get("openpangu.block_count") == 3
