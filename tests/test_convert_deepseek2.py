"""ikconvert hf2gguf for DeepSeek-V2/V3 (arch deepseek2): ik's golden bytes, FP8 checkpoints, generated
checkpoints round-tripped through the GGUF reader, bad inputs, --dry-run, and tensor-by-tensor streaming."""

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
from ikconvert.safetensors_io import SafeTensor, SafetensorsFile, write_safetensors
from ikquant.formats.numeric import f32_to_bf16_bits
from ikquant.gguf_io import GGUFFile
from tests.convert_helpers import convert_fails, write_sharded

runner = CliRunner()
PRE = "deepseek-v3"  # the pre-tokenizer ik's golden runs forced (ik-convert.txt)
INDEX = "model.safetensors.index.json"


def _convert(args: list[str]):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["hf2gguf", *args], env={"COLUMNS": "300"})


def _golden(data_dir: Path, variant: str = "deepseek-v3") -> Path:
    return data_dir / "convert" / variant


# ---- independent FP8 oracle (weight = fp8 value x its tile's scale_inv, in float32) -------------------------------
def e4m3(codes: np.ndarray) -> np.ndarray:
    """OCP E4M3 decoded element by element with ldexp (not the converter's lookup table)."""
    c = codes.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exp, man = (c >> 3) & 0xF, c & 0x7
    val = np.where(exp == 0, np.ldexp(man / 8.0, -6), np.ldexp(1.0 + man / 8.0, exp - 7)) * sign
    return np.where((c & 0x7F) == 0x7F, np.nan, val).astype(np.float32)


def dequant_oracle(codes: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """W[r, c] = e4m3(code[r, c]) * scale[r // br, c // bc], float32, edge tiles partial."""
    rows, cols = codes.shape
    full = np.repeat(np.repeat(scale.astype(np.float32), block[0], axis=0), block[1], axis=1)[:rows, :cols]
    return e4m3(codes) * full


def test_e4m3_oracle_known_values() -> None:
    codes = np.array([0x38, 0x7E, 0x01, 0x08, 0xC0, 0x00, 0x80], dtype=np.uint8)
    np.testing.assert_array_equal(e4m3(codes), np.array([1.0, 448.0, 2.0**-9, 2.0**-6, -2.0, 0.0, -0.0], np.float32))
    assert np.isnan(e4m3(np.array([0x7F, 0xFF], np.uint8))).all()


# ---- checkpoint editing helpers -------------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        p.chmod(0o644)
    return dst


_DROP = object()  # _edit_config: remove the key


def _edit_config(hf: Path, **changes: object) -> None:
    cfg = json.loads((hf / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (hf / "config.json").write_text(json.dumps(cfg, indent=2))


def _all_tensors(hf: Path) -> dict[str, SafeTensor]:
    out: dict[str, SafeTensor] = {}
    for f in sorted(hf.glob("model*.safetensors")):
        out.update(SafetensorsFile(f).tensors)
    return out


def _rewrite(hf: Path, drop: tuple[str, ...] = (), add: dict[str, tuple[str, np.ndarray]] | None = None) -> None:
    """Drop tensors from (or add to the first shard of) a sharded checkpoint, keeping its index consistent."""
    index = json.loads((hf / INDEX).read_text())
    wm = index["weight_map"]
    shards = sorted(set(wm.values()))
    for k, shard in enumerate(shards):
        st = SafetensorsFile(hf / shard)
        tensors = {n: (t.dtype, np.array(t.raw())) for n, t in st.tensors.items() if n not in drop}
        if k == 0 and add:
            tensors.update(add)
        del st
        write_safetensors(hf / shard, tensors, {"format": "pt"})
        for n in tensors:
            wm[n] = shard
    for n in drop:
        del wm[n]
    (hf / INDEX).write_text(json.dumps(index, indent=2))


def _fails(folder: Path, tmp_path: Path, *needles: str) -> str:
    return convert_fails([str(folder), "--outtype", "f32", "--pre-tokenizer", PRE], tmp_path / "out.gguf", *needles)


# ---- 1. ik's golden conversion, byte for byte -----------------------------------------------------------------
@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_deepseek_v3_golden_is_byte_identical(data_dir: Path, tmp_path: Path, outtype: str) -> None:
    golden = _golden(data_dir)
    out = tmp_path / f"{outtype}.gguf"
    res = _convert([str(golden / "hf"), "--outtype", outtype, "--pre-tokenizer", PRE, "--outfile", str(out)])
    assert res.exit_code == 0, res.output
    ours, ik = GGUFFile(out), GGUFFile(golden / f"ik-{outtype}.gguf")
    assert [(kv.key, kv.type, kv.value) for kv in ours.kv()] == [(kv.key, kv.type, kv.value) for kv in ik.kv()]
    listing = [[(t.name, t.ne, t.type) for t in f.tensors.values()] for f in (ours, ik)]
    assert listing[0] == listing[1]
    for name in ik.tensors:
        assert ours.raw(name).tobytes() == ik.raw(name).tobytes(), name
    assert out.read_bytes() == (golden / f"ik-{outtype}.gguf").read_bytes()


# ---- 2. FP8 checkpoints ---------------------------------------------------------------------------------------
def _predequantize(src: Path, dst: Path) -> Path:
    """The FP8 checkpoint with every F8_E4M3 weight replaced by weight x scale (F32) and the scales dropped."""
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    rows, cols = cfg.pop("quantization_config")["weight_block_size"]
    cfg["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, dst / name)
    everything = _all_tensors(src)
    weight_map = {}
    for shard in sorted(src.glob("model*.safetensors")):
        tensors: dict[str, tuple[str, np.ndarray]] = {}
        for name, t in SafetensorsFile(shard).tensors.items():
            if name.endswith("_scale_inv"):
                continue
            if t.dtype == "F8_E4M3":
                scale = everything[name + "_scale_inv"].raw()
                tensors[name] = ("F32", dequant_oracle(t.raw(), scale, (rows, cols)))
            else:
                tensors[name] = (t.dtype, t.raw())
        write_safetensors(dst / shard.name, tensors, {"format": "pt"})
        weight_map.update({n: shard.name for n in tensors})
    (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return dst


@pytest.fixture(scope="module")
def predequantized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = Path(__file__).parent / "data" / "convert" / "deepseek-v3-fp8" / "hf"
    return _predequantize(src, tmp_path_factory.mktemp("predeq") / "hf")  # folder named hf: general.name "Hf"


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
def test_fp8_checkpoint_equals_the_predequantized_one(data_dir: Path, predequantized: Path, tmp_path: Path,
                                                      outtype: str) -> None:
    fp8 = Converter(_golden(data_dir, "deepseek-v3-fp8") / "hf", outtype, PRE).write(tmp_path / "fp8.gguf")
    ref = Converter(predequantized, outtype, PRE).write(tmp_path / "ref.gguf")
    assert fp8.read_bytes() == ref.read_bytes()
    g = GGUFFile(fp8)
    assert g.get("general.file_type") == {"f32": 0, "bf16": 32, "q8_0": 7}[outtype]
    assert len(g.tensors) == 36 and g.get("deepseek2.block_count") == 2  # MTP layer 2 dropped


def test_fp8_tiles_come_from_the_config_not_the_scale_grid(data_dir: Path, tmp_path: Path) -> None:
    """q_b_proj [192, 64] with 128-row tiles has a [2, 1] scale grid: rows 96..127 belong to the first tile."""
    hf = _golden(data_dir, "deepseek-v3-fp8") / "hf"
    g = GGUFFile(Converter(hf, "f32", PRE).write(tmp_path / "fp8.gguf"))
    t = _all_tensors(hf)
    codes = t["model.layers.0.self_attn.q_b_proj.weight"].raw()
    scale = t["model.layers.0.self_attn.q_b_proj.weight_scale_inv"].raw()
    assert scale.shape == (2, 1) and scale[0, 0] != scale[1, 0]
    ours = g.dequantize("blk.0.attn_q_b.weight")
    np.testing.assert_array_equal(ours, dequant_oracle(codes, scale, (128, 128)))
    np.testing.assert_array_equal(ours[96:128], e4m3(codes[96:128]) * scale[0, 0])
    inferred = dequant_oracle(codes, scale, (96, 64))  # rows // scale_rows, the transformers 5.23 mistake
    assert not np.array_equal(ours[96:128], inferred[96:128])
    np.testing.assert_array_equal(ours[:96], inferred[:96])


# ---- 3. generated DeepSeek-V3-style checkpoints ---------------------------------------------------------------
@dataclass(frozen=True)
class DSSpec:
    """A DeepSeek-style checkpoint with dims unlike the golden one; `fp8_block` None means plain BF16."""

    q_lora: int | None = 48
    fp8_block: tuple[int, int] | None = (32, 32)
    scoring: str = "sigmoid"
    yarn_key: str = "type"
    score_bias: bool = True
    hidden: int = 96
    heads: int = 3
    kv_lora: int = 64
    nope: int = 32
    rope: int = 16
    v: int = 24
    ff: int = 160
    moe_ff: int = 48
    experts: int = 5
    shared: int = 2
    dense: int = 2
    layers: int = 4
    vocab: int = 320
    seed: int = 0


def _linear_shapes(s: DSSpec) -> dict[str, tuple[int, int]]:
    """HF weight name suffix (after model.layers.N.) -> shape, for one layer of either kind."""
    qk = s.nope + s.rope
    out = {"self_attn.kv_a_proj_with_mqa.weight": (s.kv_lora + s.rope, s.hidden),
           "self_attn.kv_b_proj.weight": (s.heads * (s.nope + s.v), s.kv_lora),
           "self_attn.o_proj.weight": (s.hidden, s.heads * s.v)}
    if s.q_lora is None:
        out["self_attn.q_proj.weight"] = (s.heads * qk, s.hidden)
    else:
        out["self_attn.q_a_proj.weight"] = (s.q_lora, s.hidden)
        out["self_attn.q_b_proj.weight"] = (s.heads * qk, s.q_lora)
    return out


def make_deepseek_checkpoint(folder: Path, s: DSSpec, tokenizer_from: Path) -> Path:
    """Write config, tokenizer and weights in DeepSeek's published layout: FP8 linears with per-tile scales (or
    BF16), an MTP layer at index `layers`, three shards with an index where a layer's experts and a weight's
    scale straddle shards."""
    rng = np.random.default_rng(s.seed)
    folder.mkdir(parents=True)
    w: dict[str, tuple[str, np.ndarray]] = {}

    def bf16(*shape: int) -> tuple[str, np.ndarray]:
        return "BF16", f32_to_bf16_bits((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32))

    def linear(name: str, rows: int, cols: int) -> None:
        if s.fp8_block is None:
            w[name] = bf16(rows, cols)
            return
        codes = rng.integers(0, 255, size=(rows, cols), dtype=np.uint8)
        codes[codes == 0x7F] = 0x7E  # no NaN codes
        grid = (-(-rows // s.fp8_block[0]), -(-cols // s.fp8_block[1]))
        w[name] = ("F8_E4M3", codes)
        w[name + "_scale_inv"] = ("F32", rng.uniform(1e-4, 2e-3, size=grid).astype(np.float32))

    w["model.embed_tokens.weight"] = bf16(s.vocab, s.hidden)
    w["lm_head.weight"] = bf16(s.vocab, s.hidden)
    w["model.norm.weight"] = bf16(s.hidden)
    for i in range(s.layers + 1):  # the last one is the MTP layer
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = bf16(s.hidden)
        w[p + "post_attention_layernorm.weight"] = bf16(s.hidden)
        w[p + "self_attn.kv_a_layernorm.weight"] = bf16(s.kv_lora)
        if s.q_lora is not None:
            w[p + "self_attn.q_a_layernorm.weight"] = bf16(s.q_lora)
        for suffix, shape in _linear_shapes(s).items():
            linear(p + suffix, *shape)
        if i < s.dense:
            for proj, shape in (("gate", (s.ff, s.hidden)), ("up", (s.ff, s.hidden)), ("down", (s.hidden, s.ff))):
                linear(f"{p}mlp.{proj}_proj.weight", *shape)
            continue
        w[p + "mlp.gate.weight"] = bf16(s.experts, s.hidden)
        if s.score_bias:
            w[p + "mlp.gate.e_score_correction_bias"] = ("F32", rng.standard_normal(s.experts).astype(np.float32))
        for ex in [f"experts.{x}." for x in range(s.experts)] + ["shared_experts."]:
            ff = s.moe_ff * (s.shared if ex == "shared_experts." else 1)
            for proj, shape in (("gate", (ff, s.hidden)), ("up", (ff, s.hidden)), ("down", (s.hidden, ff))):
                linear(f"{p}mlp.{ex}{proj}_proj.weight", *shape)
    mtp = f"model.layers.{s.layers}."
    w[mtp + "eh_proj.weight"] = bf16(s.hidden, 2 * s.hidden)
    w[mtp + "embed_tokens.weight"] = bf16(s.vocab, s.hidden)
    w[mtp + "shared_head.head.weight"] = bf16(s.vocab, s.hidden)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        w[f"{mtp}{norm}.weight"] = bf16(s.hidden)

    def shard_of(name: str) -> int:
        """Layers alternate between shards 1 and 2, the MTP layer has shard 3; the first MoE layer's last expert
        and its kv_b scale go to the other shard of the pair."""
        if name.startswith(mtp):
            return 3
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m is None:
            return 2
        moved = (f"model.layers.{s.dense}.mlp.experts.{s.experts - 1}.",
                 f"model.layers.{s.dense}.self_attn.kv_b_proj.weight_scale_inv")
        return 1 + (int(m.group(1)) + name.startswith(moved)) % 2

    write_sharded(folder, w, shard_of, INDEX)
    rope_scaling = {"beta_fast": 32, "beta_slow": 1, "factor": 16, "mscale": 0.7, "mscale_all_dim": 0.7,
                    "original_max_position_embeddings": 2048, s.yarn_key: "yarn"}
    config = {
        "architectures": ["DeepseekV3ForCausalLM" if s.score_bias else "DeepseekV2ForCausalLM"],
        "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": s.dense, "hidden_size": s.hidden,
        "intermediate_size": s.ff, "kv_lora_rank": s.kv_lora, "max_position_embeddings": 32768,
        "moe_intermediate_size": s.moe_ff, "n_routed_experts": s.experts, "n_shared_experts": s.shared,
        "norm_topk_prob": s.scoring == "sigmoid", "num_attention_heads": s.heads, "num_experts_per_tok": 2,
        "num_hidden_layers": s.layers, "num_key_value_heads": s.heads, "num_nextn_predict_layers": 1,
        "q_lora_rank": s.q_lora, "qk_nope_head_dim": s.nope, "qk_rope_head_dim": s.rope, "rms_norm_eps": 1e-6,
        "rope_scaling": rope_scaling, "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": s.scoring,
        "v_head_dim": s.v, "vocab_size": s.vocab, "torch_dtype": "bfloat16",
    }
    if s.fp8_block is not None:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": list(s.fp8_block)}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_from / name, folder / name)
    return folder


# spec's name table (convert-archs.md §3), written out independently of the converter's
_RENAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
           "model.norm.weight": "output_norm.weight"}

VARIANTS = {
    "v3-fp8": DSSpec(),
    # ik's runtime takes a model for q_proj-style (no q_lora_rank) only at DeepSeek-V2-Lite's 26 or 27 layers
    "v2lite-qproj": DSSpec(q_lora=None, fp8_block=None, scoring="softmax", yarn_key="rope_type", score_bias=False,
                           hidden=64, heads=4, experts=6, shared=1, dense=1, layers=26, seed=3),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_generated_checkpoint_round_trips(data_dir: Path, tmp_path: Path, variant: str) -> None:
    s = VARIANTS[variant]
    hf = make_deepseek_checkpoint(tmp_path / "hf", s, _golden(data_dir) / "hf")
    conv = Converter(hf, "f32", PRE)
    g = GGUFFile(conv.write(tmp_path / "out.gguf"))
    src = _all_tensors(hf)

    def value(name: str) -> np.ndarray:
        t = src[name]
        if t.dtype != "F8_E4M3":
            return t.to_f32()
        assert s.fp8_block is not None
        return dequant_oracle(t.raw(), src[name + "_scale_inv"].raw(), s.fp8_block)

    used: set[str] = set()

    def check(gguf: str, want: np.ndarray) -> None:
        np.testing.assert_array_equal(g.dequantize(gguf), want, err_msg=gguf)
        used.add(gguf)

    for name in src:
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if m and int(m.group(1)) >= s.layers:
            assert conv.arch.is_skipped(name) and name in conv.skipped, name  # MTP layer, scales included
            continue
        if name.endswith("_scale_inv"):
            assert src[name.removesuffix("_scale_inv")].dtype == "F8_E4M3"  # consumed by its weight, checked there
            continue
        if m is None:
            check(_GLOBAL[name], value(name))
            continue
        bid, rest = int(m.group(1)), m.group(2)
        ex = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", rest)
        if ex:
            merged = f"blk.{bid}.ffn_{ex.group(2)}_exps.weight"
            np.testing.assert_array_equal(g.dequantize(merged)[int(ex.group(1))], value(name), err_msg=name)
            used.add(merged)
        elif rest == "self_attn.kv_b_proj.weight":
            kv_b = value(name)
            check(f"blk.{bid}.attn_kv_b.weight", kv_b)
            k_b, v_b = g.dequantize(f"blk.{bid}.attn_k_b.weight"), g.dequantize(f"blk.{bid}.attn_v_b.weight")
            assert k_b.shape == (s.heads * s.kv_lora, s.nope) and v_b.shape == (s.heads * s.v, s.kv_lora)
            for h in range(s.heads):
                head = kv_b[h * (s.nope + s.v):(h + 1) * (s.nope + s.v)]
                np.testing.assert_array_equal(k_b[h * s.kv_lora:(h + 1) * s.kv_lora], head[:s.nope].T)
                np.testing.assert_array_equal(v_b[h * s.v:(h + 1) * s.v], head[s.nope:])
            used |= {f"blk.{bid}.attn_k_b.weight", f"blk.{bid}.attn_v_b.weight"}
        else:
            check(f"blk.{bid}.{_RENAMES[rest]}", value(name))
    assert used == set(g.tensors)
    key = "deepseek2."
    assert g.get(key + "block_count") == s.layers and g.get(key + "leading_dense_block_count") == s.dense
    assert g.get(key + "expert_count") == s.experts and g.get(key + "expert_shared_count") == s.shared
    assert g.get(key + "expert_gating_func") == {"softmax": 1, "sigmoid": 2}[s.scoring]
    assert g.get(key + "attention.key_length") == s.nope + s.rope and g.get(key + "attention.value_length") == s.v
    keys = set(g.keys)
    assert (key + "attention.q_lora_rank" in keys) == (s.q_lora is not None)
    if s.yarn_key == "type":
        assert g.get(key + "rope.scaling.type") == "yarn" and g.get(key + "rope.scaling.factor") == 16
        assert g.get(key + "rope.scaling.original_context_length") == 2048
        assert g.get(key + "rope.scaling.yarn_log_multiplier") == np.float32(0.1 * 0.7)
    else:  # ik looks at rope_scaling["type"] only
        assert not [k for k in keys if ".rope.scaling." in k]


def test_generated_fp8_checkpoint_equals_its_predequantized_twin(data_dir: Path, tmp_path: Path) -> None:
    """32x32 tiles over dims that are not multiples of 32 (q_b 144 rows, experts 48 wide): partial edge tiles."""
    hf = make_deepseek_checkpoint(tmp_path / "fp8" / "hf", DSSpec(), _golden(data_dir) / "hf")
    ref = _predequantize(hf, tmp_path / "ref" / "hf")
    for outtype in ("bf16", "q8_0"):
        a = Converter(hf, outtype, PRE).write(tmp_path / f"a-{outtype}.gguf")
        b = Converter(ref, outtype, PRE).write(tmp_path / f"b-{outtype}.gguf")
        assert a.read_bytes() == b.read_bytes(), outtype


# ---- 4. bad input: a clear error naming the file/tensor, and no output ----------------------------------------
def test_llama_tensors_under_a_deepseek_config(data_dir: Path, tmp_path: Path) -> None:
    from ikconvert.tiny import TinySpec, make_tiny_checkpoint

    hf = make_tiny_checkpoint(tmp_path / "hf", TinySpec(arch="llama"))
    shutil.copyfile(_golden(data_dir) / "hf" / "config.json", hf / "config.json")
    _fails(hf, tmp_path, "model.safetensors", "'model.layers.0.self_attn.k_proj.weight'", "no mapping for deepseek2",
           "DeepseekV3ForCausalLM")


def test_deepseek_tensors_under_a_llama_config(data_dir: Path, tmp_path: Path) -> None:
    hf = _copy(_golden(data_dir) / "hf", tmp_path / "hf")
    _edit_config(hf, architectures=["LlamaForCausalLM"])
    _fails(hf, tmp_path, "model.layers.0.self_attn.kv_a_layernorm.weight", "no mapping for llama")


def test_fp8_weight_without_its_scale(data_dir: Path, tmp_path: Path) -> None:
    hf = _copy(_golden(data_dir, "deepseek-v3-fp8") / "hf", tmp_path / "hf")
    _rewrite(hf, drop=("model.layers.1.self_attn.q_b_proj.weight_scale_inv",))
    _fails(hf, tmp_path, "model-00001-of-00002.safetensors", "'model.layers.1.self_attn.q_b_proj.weight'",
           "F8_E4M3", "no 'model.layers.1.self_attn.q_b_proj.weight_scale_inv'")


@pytest.mark.parametrize("block, needles", [
    ([64, 64], ("'model.layers.0.mlp.down_proj.weight_scale_inv' has shape [1, 2]", "[128, 256] in 64x64 tiles",
                "needs [2, 4]")),
    ([96, 128], ("'model.layers.0.mlp.down_proj.weight_scale_inv' has shape [1, 2]", "needs [2, 2]")),
    ([128], ("quantization_config.weight_block_size is [128]", "'model.layers.0.mlp.down_proj.weight'")),
    (None, ("quantization_config.weight_block_size is None", "not guessed")),
])
def test_fp8_block_size_that_does_not_fit(data_dir: Path, tmp_path: Path, block: list[int] | None,
                                          needles: tuple[str, ...]) -> None:
    hf = _copy(_golden(data_dir, "deepseek-v3-fp8") / "hf", tmp_path / "hf")
    qc = json.loads((hf / "config.json").read_text())["quantization_config"]
    qc["weight_block_size"] = block
    _edit_config(hf, quantization_config=qc if block is not None else _DROP)
    _fails(hf, tmp_path, *needles)


def test_scale_without_an_fp8_weight(data_dir: Path, tmp_path: Path) -> None:
    hf = _copy(_golden(data_dir) / "hf", tmp_path / "hf")
    _rewrite(hf, add={"model.layers.0.mlp.down_proj.weight_scale_inv": ("F32", np.ones((1, 1), np.float32))})
    _fails(hf, tmp_path, "model-00001-of-00002.safetensors", "'model.layers.0.mlp.down_proj.weight_scale_inv'",
           "it is BF16, not FP8")


def test_layer_with_missing_experts(data_dir: Path, tmp_path: Path) -> None:
    hf = _copy(_golden(data_dir) / "hf", tmp_path / "hf")
    _rewrite(hf, drop=("model.layers.2.mlp.experts.3.up_proj.weight",))
    _fails(hf, tmp_path, "layer 2 has 11 of 12 routed-expert tensors", "missing 1:",
           "model.layers.2.mlp.experts.3.up_proj.weight")


def test_expert_beyond_n_routed_experts(data_dir: Path, tmp_path: Path) -> None:
    hf = _copy(_golden(data_dir) / "hf", tmp_path / "hf")
    _edit_config(hf, n_routed_experts=3)
    _fails(hf, tmp_path, "'model.layers.1.mlp.experts.3.down_proj.weight'", "experts 0..2")


@pytest.mark.parametrize("change, needles", [
    ({"first_k_dense_replace": 0}, ("'model.layers.0.mlp.down_proj.weight'", "does not belong in layer 0", "MoE")),
    ({"first_k_dense_replace": 2}, ("blk.1.ffn_down_exps.weight", "does not belong in layer 1", "dense")),
    ({"q_lora_rank": None}, ("'model.layers.0.self_attn.q_a_layernorm.weight'", "q_lora_rank None")),
    ({"num_key_value_heads": 2}, ("'model.layers.0.self_attn.kv_b_proj.weight'", "[256, 32]",
                                  "num_key_value_heads x (qk_nope_head_dim + v_head_dim) = 128 rows")),
    ({"moe_intermediate_size": 16}, ("blk.1.ffn_down_exps.weight", "[4, 64, 32]", "implies [4, 64, 16]")),
    ({"scoring_func": "relu"}, ("scoring_func 'relu'", "sigmoid")),
])
def test_tensors_disagreeing_with_config(data_dir: Path, tmp_path: Path, change: dict,
                                         needles: tuple[str, ...]) -> None:
    hf = _copy(_golden(data_dir) / "hf", tmp_path / "hf")
    _edit_config(hf, **change)
    _fails(hf, tmp_path, *needles)


@pytest.mark.parametrize("scoring, code", [("softmax", 1), ("sigmoid", 2), ("sqrtsoftplus", 4)])
def test_expert_gating_func(data_dir: Path, tmp_path: Path, scoring: str, code: int) -> None:
    """ik's ExpertGatingFuncType numbers, written in ik's key position."""
    hf = _copy(_golden(data_dir) / "hf", tmp_path / "hf")
    _edit_config(hf, scoring_func=scoring)
    g = GGUFFile(Converter(hf, "f32", PRE).write(tmp_path / "out.gguf"))
    assert g.get("deepseek2.expert_gating_func") == code
    ik = GGUFFile(_golden(data_dir) / "ik-f32.gguf")
    assert [kv.key for kv in g.kv()] == [kv.key for kv in ik.kv()]


# ---- 5. --dry-run -----------------------------------------------------------------------------------------------
def test_dry_run_shows_merges_splits_and_dequantization(data_dir: Path, tmp_path: Path) -> None:
    res = _convert([str(_golden(data_dir, "deepseek-v3-fp8") / "hf"), "--dry-run", "--outtype", "q8_0",
                    "--pre-tokenizer", PRE, "--outfile", str(tmp_path / "x.gguf")])
    assert res.exit_code == 0, res.output
    rows = {}
    for line in res.output.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 5:
            rows[cells[1]] = cells
    assert rows["blk.1.ffn_down_exps.weight"][0] == "model.layers.1.mlp.experts.{0..3}.down_proj.weight"
    assert rows["blk.1.ffn_down_exps.weight"][2:4] == ["{64, 128, 4}", "Q8_0"]
    assert "expert merge: 4 x [128, 64]" in rows["blk.1.ffn_down_exps.weight"][4]
    assert rows["blk.0.attn_k_b.weight"][:4] == ["model.layers.0.self_attn.kv_b_proj.weight", "blk.0.attn_k_b.weight",
                                                  "{64, 128}", "Q8_0"]
    assert "kv_b split: k_b" in rows["blk.0.attn_k_b.weight"][4]
    assert "kv_b split: v_b" in rows["blk.0.attn_v_b.weight"][4]
    assert rows["blk.0.attn_q_b.weight"][4] == "fp8 dequant x weight_scale_inv [2, 1] (128x128 tiles)"
    assert rows["blk.1.exp_probs_b.bias"][3] == "F32" and rows["blk.1.ffn_gate_inp.weight"][3] == "F32"
    assert "36 tensors" in res.output and "nothing written" in res.output
    mtp = [n for n in _all_tensors(_golden(data_dir, "deepseek-v3-fp8") / "hf") if n.startswith("model.layers.2.")]
    assert f"{len(mtp)} HF tensors skipped on purpose, as ik does: model.layers.2.eh_proj.weight," in res.output
    assert list(tmp_path.iterdir()) == []


# ---- 6. streaming: nothing read while planning, then each tensor reads only its own sources ----------------------
def test_conversion_streams_tensor_by_tensor(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    real_raw = SafeTensor.raw

    def counting_raw(self: SafeTensor) -> np.ndarray:
        reads.append(self.name)
        return real_raw(self)

    monkeypatch.setattr(SafeTensor, "raw", counting_raw)
    conv = Converter(_golden(data_dir, "deepseek-v3-fp8") / "hf", "q8_0", PRE)
    plan = conv.build_plan()
    assert reads == []
    per_tensor: dict[str, list[str]] = {}

    def step(p, nbytes: int) -> None:  # type: ignore[no-untyped-def]
        per_tensor[p.out.name] = reads.copy()
        reads.clear()

    conv.write(tmp_path / "out.gguf", step)
    assert list(per_tensor) == [p.out.name for p in plan]
    experts = [f"model.layers.1.mlp.experts.{x}.gate_proj.weight" for x in range(4)]
    assert per_tensor["blk.1.ffn_gate_exps.weight"] == [n + s for n in experts for s in ("", "_scale_inv")]
    assert per_tensor["blk.0.attn_k_b.weight"] == ["model.layers.0.self_attn.kv_b_proj.weight",
                                                   "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"]
    assert per_tensor["output_norm.weight"] == ["model.norm.weight"]
