"""ikconvert hf2gguf for DeepSeek-V4 (arch deepseek4): ik's --mtp export byte for byte, the full model against the
runtime layout ik loads, a generated checkpoint of other dimensions, bad inputs."""

from __future__ import annotations

import json
import math
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
from tests.convert_helpers import convert_fails

runner = CliRunner()
PRE = "joyai-llm"  # ik's name for the DeepSeek-V4-Flash tokenizer (forced in the golden runs: ik-convert.txt)


def _convert(args: list[str]):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["hf2gguf", *args, "--pre-tokenizer", PRE], env={"COLUMNS": "250"})


@pytest.fixture(scope="module")
def flash(data_dir: Path) -> Path:
    return data_dir / "convert" / "deepseek-v4-flash"


# ---- golden equality --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_mtp_export_is_byte_identical_to_ik(flash: Path, tmp_path: Path, outtype: str) -> None:
    out = tmp_path / f"mtp-{outtype}.gguf"
    res = _convert([str(flash / "hf"), "--mtp", "--outtype", outtype, "--outfile", str(out)])
    assert res.exit_code == 0, res.output
    ours, ik = GGUFFile(out), GGUFFile(flash / f"ik-mtp-{outtype}.gguf")
    assert [(kv.key, kv.type, kv.value) for kv in ours.kv()] == [(kv.key, kv.type, kv.value) for kv in ik.kv()]
    assert [(t.name, t.ne, t.type) for t in ours.tensors.values()] == [
        (t.name, t.ne, t.type) for t in ik.tensors.values()]
    assert out.read_bytes() == (flash / f"ik-mtp-{outtype}.gguf").read_bytes()


def _keys(g: GGUFFile) -> dict[str, tuple[object, object]]:
    return {kv.key: (kv.type, kv.value) for kv in g.kv() if kv.key.startswith(("deepseek4.", "tokenizer."))}


def test_full_model_equals_the_verified_reference(flash: Path, tmp_path: Path) -> None:
    """Every deepseek4.*/tokenizer.* key and every tensor (name, shape, type, bytes) of ref-f32.gguf."""
    out = tmp_path / "full.gguf"
    res = _convert([str(flash / "hf"), "--outtype", "f32", "--outfile", str(out)])
    assert res.exit_code == 0, res.output
    ours, ref = GGUFFile(out), GGUFFile(flash / "ref-f32.gguf")
    assert _keys(ours) == _keys(ref)
    assert "deepseek4.nextn_predict_layers" not in ours.keys
    assert {n: (t.ne, t.type) for n, t in ours.tensors.items()} == {n: (t.ne, t.type) for n, t in ref.tensors.items()}
    for name in ref.tensors:
        assert ours.raw(name).tobytes() == ref.raw(name).tobytes(), name


@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_mxfp4_experts_and_i32_tables_keep_their_type_in_every_outtype(flash: Path, tmp_path: Path,
                                                                        outtype: str) -> None:
    out = tmp_path / f"full-{outtype}.gguf"
    res = _convert([str(flash / "hf"), "--outtype", outtype, "--outfile", str(out)])
    assert res.exit_code == 0, res.output
    ours, ref = GGUFFile(out), GGUFFile(flash / "ref-f32.gguf")
    kept = [n for n, t in ref.tensors.items() if t.type.name in ("MXFP4", "I32")]
    assert len(kept) == 3 * 3 + 1
    for name in kept:
        assert ours.tensors[name].type == ref.tensors[name].type
        assert ours.raw(name).tobytes() == ref.raw(name).tobytes(), name
    assert ours.tensors["blk.1.attn_q_b.weight"].type.name == outtype.upper()  # a dequantized FP8 linear
    assert ours.tensors["blk.1.attn_compressor_ape.weight"].type.name == "F32"  # source name has no .weight


def test_dry_run_shows_each_transform(flash: Path, tmp_path: Path) -> None:
    res = _convert([str(flash / "hf"), "--dry-run", "--outtype", "f32", "--outfile", str(tmp_path / "x.gguf")])
    assert res.exit_code == 0, res.output
    text = res.output
    assert "fp8 e4m3 dequant" in text and "128x128 tile" in text
    assert "fp4 e2m1 -> mxfp4 repack" in text and "stacked experts 0..3" in text
    assert "layers.0.ffn.experts.*.w1.weight" in text and "hash routing table I64 -> I32" in text
    assert "blk.3." not in text  # the MTP block is not part of the full model
    assert list(tmp_path.iterdir()) == []
    res = _convert([str(flash / "hf"), "--dry-run", "--mtp", "--outfile", str(tmp_path / "x.gguf")])
    assert res.exit_code == 0, res.output
    assert "e_proj | h_proj concatenated" in res.output and "blk.3.nextn.eh_proj.weight" in res.output


# ---- a generated checkpoint of other dimensions -----------------------------------------------------------------
GEN_CONFIG = {
    "architectures": ["DeepseekV4FlashForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 160,
    "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 96,
    "qk_rope_head_dim": 32, "q_lora_rank": 96, "o_groups": 2, "o_lora_rank": 48, "vocab_size": 336,
    "n_routed_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 96, "n_shared_experts": 1,
    "hc_mult": 2, "hc_sinkhorn_iters": 5, "hc_eps": 1e-6, "index_n_heads": 3, "index_head_dim": 32,
    "index_topk": 8, "num_hash_layers": 2, "compress_ratios": [4, 0, 128, 4, 0], "compress_rope_theta": 40000,
    "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024,
                                          "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "scoring_func": "sqrtsoftplus", "sliding_window": 8, "swiglu_limit": 7.0, "num_nextn_predict_layers": 1,
    "bos_token_id": 0, "eos_token_id": 1,
    "quantization_config": {"fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128]},
}


def _gen_tensors(cfg: dict, seed: int) -> dict[str, tuple[str, np.ndarray]]:
    """Random tensors laid out as DeepSeek publishes V4: FP8 + E8M0 tiles, FP4 experts in I8 + E8M0 per 32."""
    rng = np.random.default_rng(seed)
    H, V, c, nh, hd, ql = (cfg[k] for k in ("hidden_size", "vocab_size", "hc_mult", "num_attention_heads",
                                             "head_dim", "q_lora_rank"))
    g, ol, E, m, ih, idim = (cfg[k] for k in ("o_groups", "o_lora_rank", "n_routed_experts", "moe_intermediate_size",
                                              "index_n_heads", "index_head_dim"))
    out: dict[str, tuple[str, np.ndarray]] = {}

    def bf16(name: str, *shape: int) -> None:
        out[name] = ("BF16", (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16))

    def f32(name: str, *shape: int) -> None:
        out[name] = ("F32", rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1))

    def fp8(name: str, rows: int, cols: int) -> None:
        codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes
        out[name + ".weight"] = ("F8_E4M3", codes)
        out[name + ".scale"] = ("F8_E8M0", rng.integers(115, 128, (math.ceil(rows / 128), math.ceil(cols / 128)),
                                                         dtype=np.uint8))

    def fp4(name: str, rows: int, cols: int) -> None:
        out[name + ".weight"] = ("I8", rng.integers(-128, 128, (rows, cols // 2), dtype=np.int8))
        out[name + ".scale"] = ("F8_E8M0", rng.integers(118, 130, (rows, cols // 32), dtype=np.uint8))

    def block(p: str, ratio: int, hashed: bool) -> None:
        for n in ("attn_norm.weight", "ffn_norm.weight"):
            bf16(p + n, H)
        for s in ("attn", "ffn"):
            f32(f"{p}hc_{s}_fn", (2 + c) * c, c * H)
            f32(f"{p}hc_{s}_base", (2 + c) * c)
            f32(f"{p}hc_{s}_scale", 3)
        f32(p + "attn.attn_sink", nh)
        fp8(p + "attn.wq_a", ql, H)
        bf16(p + "attn.q_norm.weight", ql)
        fp8(p + "attn.wq_b", nh * hd, ql)
        fp8(p + "attn.wkv", hd, H)
        bf16(p + "attn.kv_norm.weight", hd)
        fp8(p + "attn.wo_a", g * ol, nh * hd // g)
        fp8(p + "attn.wo_b", H, g * ol)
        if ratio:
            w = (2 if ratio == 4 else 1) * hd
            bf16(p + "attn.compressor.wkv.weight", w, H)
            bf16(p + "attn.compressor.wgate.weight", w, H)
            f32(p + "attn.compressor.ape", ratio, w)
            bf16(p + "attn.compressor.norm.weight", hd)
        if ratio == 4:
            fp8(p + "attn.indexer.wq_b", ih * idim, ql)
            bf16(p + "attn.indexer.weights_proj.weight", ih, H)
            bf16(p + "attn.indexer.compressor.wkv.weight", 2 * idim, H)
            bf16(p + "attn.indexer.compressor.wgate.weight", 2 * idim, H)
            f32(p + "attn.indexer.compressor.ape", 4, 2 * idim)
            bf16(p + "attn.indexer.compressor.norm.weight", idim)
        bf16(p + "ffn.gate.weight", E, H)
        if hashed:
            out[p + "ffn.gate.tid2eid"] = ("I64", rng.integers(0, E, (V, cfg["num_experts_per_tok"])))
        else:
            f32(p + "ffn.gate.bias", E)
        for x in range(E):
            fp4(f"{p}ffn.experts.{x}.w1", m, H)
            fp4(f"{p}ffn.experts.{x}.w2", H, m)
            fp4(f"{p}ffn.experts.{x}.w3", m, H)
        fp8(p + "ffn.shared_experts.w1", m, H)
        fp8(p + "ffn.shared_experts.w2", H, m)
        fp8(p + "ffn.shared_experts.w3", m, H)

    bf16("embed.weight", V, H)
    bf16("head.weight", V, H)
    bf16("norm.weight", H)
    f32("hc_head_fn", c, c * H)
    f32("hc_head_base", c)
    f32("hc_head_scale", 1)
    for i in range(cfg["num_hidden_layers"]):
        block(f"layers.{i}.", cfg["compress_ratios"][i], i < cfg["num_hash_layers"])
    block("mtp.0.", 0, False)
    fp8("mtp.0.e_proj", H, H)
    fp8("mtp.0.h_proj", H, H)
    for n in ("enorm.weight", "hnorm.weight", "norm.weight"):
        bf16("mtp.0." + n, H)
    f32("mtp.0.hc_head_fn", c, c * H)
    f32("mtp.0.hc_head_base", c)
    f32("mtp.0.hc_head_scale", 1)
    return out


def _shard_of(name: str) -> int:
    """Three shards; a weight's scale and some experts deliberately land in another shard than their partners."""
    if name.startswith("mtp.") or name == "layers.2.attn.wq_b.scale" or name.startswith(
            ("layers.3.ffn.experts.4.", "layers.3.ffn.experts.5.")):
        return 3
    return 1 if name.startswith(("layers.0.", "layers.1.")) else 2


def _write_checkpoint(folder: Path, cfg: dict, tensors: dict[str, tuple[str, np.ndarray]],
                      tokenizer_from: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / f, folder / f)
        (folder / f).chmod(0o644)
    shards = sorted({_shard_of(n) for n in tensors})
    weight_map = {}
    for s in shards:
        part = f"model-{s:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / part, {n: v for n, v in tensors.items() if _shard_of(n) == s}, {"format": "pt"})
        weight_map |= {n: part for n in tensors if _shard_of(n) == s}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.fixture(scope="module")
def generated(flash: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[str, np.ndarray]]]:
    tensors = _gen_tensors(GEN_CONFIG, seed=7)
    return _write_checkpoint(tmp_path_factory.mktemp("ds4gen") / "hf", GEN_CONFIG, tensors, flash / "hf"), tensors


def _spec_name(name: str) -> str | None:
    """GGUF name of a non-scale DeepSeek-V4 tensor as ik's runtime names it (full model); None for the expert parts."""
    root = {"embed.weight": "token_embd.weight", "head.weight": "output.weight", "norm.weight": "output_norm.weight",
            "hc_head_fn": "output_hc_fn.weight", "hc_head_base": "output_hc_base.weight",
            "hc_head_scale": "output_hc_scale.weight"}
    if name in root:
        return root[name]
    _, bid, rest = name.split(".", 2)
    table = {
        "attn.attn_sink": "attn_sinks.weight", "attn.wq_a.weight": "attn_q_a.weight",
        "attn.q_norm.weight": "attn_q_a_norm.weight", "attn.wq_b.weight": "attn_q_b.weight",
        "attn.wkv.weight": "attn_kv.weight", "attn.kv_norm.weight": "attn_kv_a_norm.weight",
        "attn.wo_a.weight": "attn_output_a.weight", "attn.wo_b.weight": "attn_output_b.weight",
        "attn.compressor.wkv.weight": "attn_compressor_kv.weight",
        "attn.compressor.wgate.weight": "attn_compressor_gate.weight",
        "attn.compressor.ape": "attn_compressor_ape.weight",
        "attn.compressor.norm.weight": "attn_compressor_norm.weight",
        "attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
        "attn.indexer.weights_proj.weight": "indexer.proj.weight",
        "attn.indexer.compressor.wkv.weight": "indexer_compressor_kv.weight",
        "attn.indexer.compressor.wgate.weight": "indexer_compressor_gate.weight",
        "attn.indexer.compressor.ape": "indexer_compressor_ape.weight",
        "attn.indexer.compressor.norm.weight": "indexer_compressor_norm.weight",
        "ffn.gate.weight": "ffn_gate_inp.weight", "ffn.gate.bias": "exp_probs_b.bias",
        "ffn.gate.tid2eid": "ffn_gate_tid2eid.weight", "ffn.shared_experts.w1.weight": "ffn_gate_shexp.weight",
        "ffn.shared_experts.w2.weight": "ffn_down_shexp.weight", "ffn.shared_experts.w3.weight": "ffn_up_shexp.weight",
    }
    if rest.startswith("ffn.experts."):
        proj = rest.split(".")[3]
        return f"blk.{bid}." + {"w1": "ffn_gate_exps", "w2": "ffn_down_exps", "w3": "ffn_up_exps"}[proj] + ".weight"
    if rest.startswith("hc_"):
        return f"blk.{bid}.{rest}.weight"
    return f"blk.{bid}.{table.get(rest, rest)}"


def _e4m3(code: np.ndarray) -> np.ndarray:
    """OCP E4M3 decoded from its bit fields (independent of the converter's table)."""
    c = code.astype(np.int64)
    s, e, mnt = np.where(c & 0x80, -1.0, 1.0), (c >> 3) & 15, c & 7
    return (s * np.where(e == 0, mnt / 8 * 2.0**-6, (1 + mnt / 8) * 2.0 ** (e - 7))).astype(np.float32)


def _fp8_expected(tensors: dict, base: str) -> np.ndarray:
    w, s = tensors[base + ".weight"][1], tensors[base + ".scale"][1]
    r = np.arange(w.shape[0])[:, None] // 128
    col = np.arange(w.shape[1])[None, :] // 128
    return (_e4m3(w) * 2.0 ** (s[r, col].astype(np.float64) - 127)).astype(np.float32)


def _fp4_expected(tensors: dict, base: str) -> np.ndarray:
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)
    w, s = tensors[base + ".weight"][1].view(np.uint8), tensors[base + ".scale"][1]
    codes = np.stack([w & 15, w >> 4], axis=-1).reshape(w.shape[0], -1)
    return (e2m1[codes] * 2.0 ** (np.repeat(s, 32, axis=1).astype(np.float64) - 127)).astype(np.float32)


def _spec_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """ne (ggml order) and type of every tensor of the full model, from ik's runtime layout and config.json."""
    H, V, c, nh, hd, ql = (cfg[k] for k in ("hidden_size", "vocab_size", "hc_mult", "num_attention_heads",
                                             "head_dim", "q_lora_rank"))
    g, ol, E, m, ih, idim, k = (cfg[x] for x in ("o_groups", "o_lora_rank", "n_routed_experts",
                                                 "moe_intermediate_size", "index_n_heads", "index_head_dim",
                                                 "num_experts_per_tok"))
    f = "F32"
    out = {"token_embd.weight": ((H, V), f), "output.weight": ((H, V), f), "output_norm.weight": ((H,), f),
           "output_hc_fn.weight": ((c * H, c), f), "output_hc_base.weight": ((c,), f),
           "output_hc_scale.weight": ((1,), f)}
    for i in range(cfg["num_hidden_layers"]):
        r = cfg["compress_ratios"][i]
        b = {"attn_norm": (H,), "ffn_norm": (H,), "hc_attn_fn": (c * H, (2 + c) * c), "hc_ffn_fn": (c * H, (2 + c) * c),
             "hc_attn_base": ((2 + c) * c,), "hc_ffn_base": ((2 + c) * c,), "hc_attn_scale": (3,),
             "hc_ffn_scale": (3,), "attn_sinks": (nh,), "attn_q_a": (H, ql), "attn_q_a_norm": (ql,),
             "attn_q_b": (ql, nh * hd), "attn_kv": (H, hd), "attn_kv_a_norm": (hd,),
             "attn_output_a": (nh * hd // g, g * ol), "attn_output_b": (g * ol, H), "ffn_gate_inp": (H, E),
             "ffn_gate_shexp": (H, m), "ffn_up_shexp": (H, m), "ffn_down_shexp": (m, H)}
        types = {n: f for n in b}
        for n, ne in (("ffn_gate_exps", (H, m, E)), ("ffn_up_exps", (H, m, E)), ("ffn_down_exps", (m, H, E))):
            b[n], types[n] = ne, "MXFP4"
        if r:
            co = (2 if r == 4 else 1) * hd
            b |= {"attn_compressor_kv": (H, co), "attn_compressor_gate": (H, co), "attn_compressor_ape": (co, r),
                  "attn_compressor_norm": (hd,)}
        if r == 4:
            b |= {"indexer.attn_q_b": (ql, ih * idim), "indexer.proj": (H, ih), "indexer_compressor_kv": (H, 2 * idim),
                  "indexer_compressor_gate": (H, 2 * idim), "indexer_compressor_ape": (2 * idim, 4),
                  "indexer_compressor_norm": (idim,)}
        if i < cfg["num_hash_layers"]:
            b["ffn_gate_tid2eid"], types["ffn_gate_tid2eid"] = (k, V), "I32"
        else:
            out[f"blk.{i}.exp_probs_b.bias"] = ((E,), f)
        out |= {f"blk.{i}.{n}.weight": (ne, types.get(n, f)) for n, ne in b.items()}
    return out


def test_generated_checkpoint_converts_to_the_spec_layout(generated: tuple[Path, dict], tmp_path: Path) -> None:
    hf, tensors = generated
    conv = Converter(hf, "f32", PRE)
    conv.build_plan()
    out = conv.write(tmp_path / "gen.gguf")
    g = GGUFFile(out)
    # every checkpoint tensor is accounted for: mapped (a scale with its weight), or skipped as the MTP block
    skipped = {n for n in tensors if conv.arch.is_skipped(n)}
    assert skipped == {n for n in tensors if n.startswith("mtp.")}
    mapped = {_spec_name(n) for n in tensors if n not in skipped and not n.endswith(".scale")}
    assert all(n[: -len(".scale")] + ".weight" in tensors for n in tensors if n.endswith(".scale"))
    assert mapped == set(g.tensors)
    # shapes and types as the spec's layout requires
    want = _spec_shapes(GEN_CONFIG)
    assert {n: (t.ne, t.type.name) for n, t in g.tensors.items()} == want
    # values: FP8 dequantized exactly (partial and full tiles), FP4 repacked to the same values, ids kept
    for base, gguf in (("layers.2.attn.wq_b", "blk.2.attn_q_b.weight"), ("layers.0.attn.wq_a", "blk.0.attn_q_a.weight"),
                       ("layers.3.attn.indexer.wq_b", "blk.3.indexer.attn_q_b.weight"),
                       ("layers.1.ffn.shared_experts.w2", "blk.1.ffn_down_shexp.weight")):
        np.testing.assert_array_equal(g.dequantize(gguf), _fp8_expected(tensors, base))
    for proj, gguf in (("w1", "ffn_gate_exps"), ("w2", "ffn_down_exps"), ("w3", "ffn_up_exps")):
        got = g.dequantize(f"blk.3.{gguf}.weight")
        exp = np.stack([_fp4_expected(tensors, f"layers.3.ffn.experts.{x}.{proj}") for x in range(6)])
        np.testing.assert_array_equal(got, exp)
    np.testing.assert_array_equal(g.raw("blk.1.ffn_gate_tid2eid.weight").view("<i4"),
                                  tensors["layers.1.ffn.gate.tid2eid"][1])
    np.testing.assert_array_equal(g.dequantize("blk.2.attn_compressor_ape.weight"),
                                  tensors["layers.2.attn.compressor.ape"][1])
    # metadata a full model needs: L layers, arrays of L entries, no MTP layer count
    assert g.get("deepseek4.block_count") == 4 and "deepseek4.nextn_predict_layers" not in g.keys
    assert list(g.get("deepseek4.swiglu_clamp_exp")) == [7.0] * 4
    assert list(g.get("deepseek4.attention.compress_ratios")) == [4, 0, 128, 4, 0]
    assert g.get("deepseek4.hash_layer_count") == 2 and g.get("deepseek4.hyper_connection.count") == 2
    assert g.get("deepseek4.rope.scaling.original_context_length") == 1024
    assert g.get("deepseek4.expert_gating_func") == 4


def test_generated_checkpoint_mtp_export(generated: tuple[Path, dict], tmp_path: Path) -> None:
    hf, tensors = generated
    out = Converter(hf, "q8_0", PRE, arch_options={"mtp": True}).write(tmp_path / "mtp.gguf")
    g = GGUFFile(out)
    L, H = 4, GEN_CONFIG["hidden_size"]
    assert g.get("deepseek4.block_count") == L + 1 and g.get("deepseek4.nextn_predict_layers") == 1
    assert not [n for n in g.tensors if n.startswith("blk.") and not n.startswith(f"blk.{L}.")]
    assert [n for n in g.tensors][-3:] == [f"blk.{L}.ffn_{p}_exps.weight" for p in ("gate", "down", "up")]
    assert g.tensors[f"blk.{L}.nextn.eh_proj.weight"].ne == (2 * H, H)
    eh = g.dequantize(f"blk.{L}.nextn.eh_proj.weight")
    exact = np.concatenate([_fp8_expected(tensors, "mtp.0.e_proj"), _fp8_expected(tensors, "mtp.0.h_proj")], axis=1)
    assert np.abs(eh - exact).max() <= np.abs(exact).reshape(H, -1, 32).max(axis=-1).max() / 127  # Q8_0 step
    np.testing.assert_array_equal(g.dequantize("output_hc_fn.weight"), tensors["mtp.0.hc_head_fn"][1])
    assert g.tensors[f"blk.{L}.ffn_up_exps.weight"].type.name == "MXFP4"


# ---- bad input: an error naming the tensor or key, and no output file --------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        p.chmod(0o644)
    return dst


Edit = Callable[[str, np.ndarray], "tuple[str, np.ndarray] | None"]


def _edit(hf: Path, changes: dict[str, Edit], add: dict[str, tuple[str, np.ndarray]] | None = None) -> None:
    """Replace (or, when the change returns None, remove) tensors in their shard, `add` new ones to the first
    shard; keep the index in step."""
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    for i, part in enumerate(sorted(hf.glob("model-*.safetensors"))):
        st = SafetensorsFile(part)
        tensors = {n: (t.dtype, np.array(t.raw())) for n, t in st.tensors.items()}
        del st
        for name in set(changes) & set(tensors):
            new = changes[name](*tensors.pop(name))
            if new is not None:
                tensors[name] = new
        if i == 0:
            tensors |= add or {}
        write_safetensors(part, tensors, {"format": "pt"})
        index["weight_map"] = {n: p for n, p in index["weight_map"].items() if p != part.name} | {
            n: part.name for n in tensors}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


def _config(hf: Path, **changes: object) -> None:
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))


def _fails(hf: Path, tmp_path: Path, *needles: str, extra: tuple[str, ...] = ()) -> None:
    convert_fails([str(hf), "--outtype", "f32", "--pre-tokenizer", PRE, *extra], tmp_path / "out.gguf", *needles)


@pytest.fixture
def broken(flash: Path, tmp_path: Path) -> Path:
    return _copy(flash / "hf", tmp_path / "hf")


def _drop(dtype: str, a: np.ndarray) -> None:
    return None


def test_missing_fp8_scale(broken: Path, tmp_path: Path) -> None:
    _edit(broken, {"layers.1.attn.wo_a.scale": _drop})
    _fails(broken, tmp_path, "'layers.1.attn.wo_a.weight' is F8_E4M3", "'layers.1.attn.wo_a.scale' is missing")


def test_missing_fp4_scale(broken: Path, tmp_path: Path) -> None:
    _edit(broken, {"layers.2.ffn.experts.3.w2.scale": _drop})
    _fails(broken, tmp_path, "'layers.2.ffn.experts.3.w2.weight' is I8", "'layers.2.ffn.experts.3.w2.scale' is missing")


def test_missing_mtp_scale_with_mtp(broken: Path, tmp_path: Path) -> None:
    _edit(broken, {"mtp.0.h_proj.scale": _drop})
    _fails(broken, tmp_path, "'mtp.0.h_proj.weight' is F8_E4M3", "'mtp.0.h_proj.scale' is missing", extra=("--mtp",))


def test_scale_without_weight(broken: Path, tmp_path: Path) -> None:
    _edit(broken, {"layers.0.attn.wkv.weight": _drop})
    _fails(broken, tmp_path, "scale 'layers.0.attn.wkv.scale' has no weight 'layers.0.attn.wkv.weight'")


def test_fp8_tile_that_does_not_match_the_scale_grid(broken: Path, tmp_path: Path) -> None:
    cfg = json.loads((broken / "config.json").read_text())
    _config(broken, quantization_config={**cfg["quantization_config"], "weight_block_size": [48, 48]})
    _fails(broken, tmp_path, "scale 'layers.0.attn.wkv.scale' has grid [1, 1]", "weight_block_size [48, 48]",
           "'layers.0.attn.wkv.weight' [64, 128] into [2, 3]")


def test_fp8_without_a_block_size(broken: Path, tmp_path: Path) -> None:
    _config(broken, quantization_config={"fmt": "e4m3"})
    _fails(broken, tmp_path, "config.json quantization_config.weight_block_size is None", "'layers.0.attn.wkv.weight'")


def test_scale_of_the_wrong_dtype(broken: Path, tmp_path: Path) -> None:
    _edit(broken, {"layers.1.ffn.shared_experts.w3.scale": lambda d, a: ("F32", np.ones(a.shape, np.float32))})
    _fails(broken, tmp_path, "scale 'layers.1.ffn.shared_experts.w3.scale' is F32, expected F8_E8M0")


def test_tid2eid_of_the_wrong_dtype(broken: Path, tmp_path: Path) -> None:
    _edit(broken, {"layers.0.ffn.gate.tid2eid": lambda d, a: ("F32", a.astype(np.float32))})
    _fails(broken, tmp_path, "'layers.0.ffn.gate.tid2eid' has dtype F32", "I64 or I32")


def test_fp4_packing_on_a_linear_is_refused(broken: Path, tmp_path: Path) -> None:
    _edit(broken, {"layers.2.attn.wkv.weight": lambda d, a: ("I8", a.view(np.int8))})
    _fails(broken, tmp_path, "'layers.2.attn.wkv.weight' has dtype I8", "routed experts only")


def test_expert_weight_of_the_wrong_dtype(broken: Path, tmp_path: Path) -> None:
    _edit(broken, {"layers.1.ffn.experts.0.w1.weight": lambda d, a: ("BF16", np.zeros((64, 128), np.uint16))})
    _fails(broken, tmp_path, "'layers.1.ffn.experts.0.w1.weight' is BF16 but has a scale")


def _poke(index: tuple[int, int], value: int) -> Edit:
    def change(dtype: str, a: np.ndarray) -> tuple[str, np.ndarray]:
        a[index] = value
        return dtype, a

    return change


def test_nan_scale_is_refused_at_write_time(broken: Path, tmp_path: Path) -> None:
    _edit(broken, {"layers.1.ffn.experts.2.w1.scale": _poke((5, 1), 255)})
    _fails(broken, tmp_path, "scale 'layers.1.ffn.experts.2.w1.scale' holds E8M0 code 255 (NaN)")


def test_expert_id_out_of_range(broken: Path, tmp_path: Path) -> None:
    _edit(broken, {"layers.0.ffn.gate.tid2eid": _poke((7, 1), 4)})
    _fails(broken, tmp_path, "'layers.0.ffn.gate.tid2eid' holds expert id 4", "0..3 (n_routed_experts)")


def test_missing_expert(broken: Path, tmp_path: Path) -> None:
    _edit(broken, {"layers.1.ffn.experts.2.w3.weight": _drop, "layers.1.ffn.experts.2.w3.scale": _drop})
    _fails(broken, tmp_path, "block 1 has 3 of the 4 w3 experts", "'layers.1.ffn.experts.2.w3.weight' is missing")


def test_compress_ratios_disagreeing_with_the_tensors(broken: Path, tmp_path: Path) -> None:
    _config(broken, compress_ratios=[0, 0, 128, 0])
    _fails(broken, tmp_path, "'layers.1.attn.compressor.ape' -> blk.1.attn_compressor_ape.weight does not belong",
           "layer 1 has compress ratio 0")
    _config(broken, compress_ratios=[4, 4, 128, 0])
    _fails(broken, tmp_path, "lacks 10 tensor(s)", "first blk.0.attn_compressor_ape.weight")


def test_config_errors(broken: Path, tmp_path: Path) -> None:
    _config(broken, compress_ratios=[0, 4, 64, 0])
    _fails(broken, tmp_path, "config.json: 'compress_ratios'", "(0, 4, 128)")
    _config(broken, compress_ratios=[0, 4, 128, 0], num_nextn_predict_layers=0)
    _fails(broken, tmp_path, "'num_nextn_predict_layers' must be 1 for --mtp", extra=("--mtp",))
    _config(broken, scoring_func="softmax")
    _fails(broken, tmp_path, "'scoring_func' is 'softmax'")


def test_experts_of_one_projection_must_share_dtype_and_shape(broken: Path, tmp_path: Path) -> None:
    _edit(broken, {"layers.1.ffn.experts.0.w1.weight": lambda d, a: ("F8_E4M3", np.full((64, 128), 0x38, np.uint8)),
                   "layers.1.ffn.experts.0.w1.scale": lambda d, a: (d, np.full((1, 1), 127, np.uint8))})
    _fails(broken, tmp_path, "'layers.1.ffn.experts.1.w1.weight' is I8 [64, 64], but "
           "'layers.1.ffn.experts.0.w1.weight' is F8_E4M3 [64, 128]")


def test_fp8_output_head_is_dequantized(broken: Path, tmp_path: Path) -> None:
    """ik's --mtp drops head.scale and then fails on the unpaired FP8 head; both modes dequantize it here."""
    codes = np.random.default_rng(3).integers(0, 0x7F, (320, 128), dtype=np.uint8)
    scale = np.array([[120], [125], [127]], dtype=np.uint8)  # 128-row tiles, the last one partial (64 rows)
    _edit(broken, {"head.weight": lambda d, a: ("F8_E4M3", codes)}, add={"head.scale": ("F8_E8M0", scale)})
    exact = _fp8_expected({"head.weight": ("F8_E4M3", codes), "head.scale": ("F8_E8M0", scale)}, "head")
    for extra in ((), ("--mtp",)):
        out = tmp_path / f"head{len(extra)}.gguf"
        res = _convert([str(broken), "--outtype", "f32", "--outfile", str(out), *extra])
        assert res.exit_code == 0, res.output
        np.testing.assert_array_equal(GGUFFile(out).dequantize("output.weight"), exact)
