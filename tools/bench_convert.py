#!/usr/bin/env python3
"""Convert throughput (MB/s of input) and peak RSS on a generated ~1 GB bf16 Qwen3-shaped checkpoint, or with
--deepseek-fp8 a ~2 GB DeepSeek-V3-shaped FP8 one (F8_E4M3 + 128x128 weight_scale_inv, MLA, 64 routed experts).

Each conversion runs in its own process (its peak RSS is what is reported). The baseline in the same run is a
plain copy of the same shards (the I/O ceiling on this disk).

Example: python tools/bench_convert.py --workdir /tmp/bench --outtype f16 --outtype q8_0
         python tools/bench_convert.py --workdir /tmp/bench --deepseek-fp8 --outtype bf16 --outtype q8_0
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ikconvert import TinySpec, make_tiny_checkpoint, write_safetensors
from ikquant import f32_to_bf16_bits

DEEPSEEK_TOKENIZER = Path(__file__).parents[1] / "tests" / "data" / "convert" / "deepseek-v3" / "hf"
DEEPSEEK4_TOKENIZER = Path(__file__).parents[1] / "tests" / "data" / "convert" / "deepseek-v4-flash" / "hf"


def run_child(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one command, measured from a small parent (tools/peak_rss.py)."""
    res = subprocess.run([sys.executable, str(Path(__file__).parent / "peak_rss.py"), *cmd],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if res.returncode:
        sys.exit(f"command failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr}")
    _, rss, dt = res.stderr.strip().splitlines()[-1].split()
    return float(dt), float(rss)


def _finish_checkpoint(folder: Path, config: dict, weight_map: dict[str, str], tokenizer: Path) -> None:
    """config.json, the shard index and the tokenizer files beside the shards already written."""
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer / name, folder / name)


@dataclass(frozen=True)
class DeepSeekShape:
    """The widths and counts of a generated DeepSeek-V3-layout checkpoint (default: the 2048-wide bench model)."""

    hidden: int = 2048
    heads: int = 16
    q_lora: int = 768
    kv_lora: int = 512
    nope: int = 128
    rope: int = 64
    v: int = 128
    ffn: int = 6144
    moe_ffn: int = 768
    experts: int = 64
    used: int = 8
    first_dense: int = 1
    vocab: int = 320


def make_deepseek_fp8_checkpoint(folder: Path, layers: int, dims: DeepSeekShape = DeepSeekShape(),
                                 fp8: bool = True) -> None:
    """DeepSeek-V3's layout (by default at 2048 wide: layer 0 dense, the rest MoE, 64 experts of 768 + 1 shared),
    FP8 linears with 128x128 scales (BF16 ones without `fp8`), one shard per layer so the generator holds one layer
    at a time."""
    h, heads, q_lora, kv_lora, nope, rope, v = dims.hidden, dims.heads, dims.q_lora, dims.kv_lora, dims.nope, \
        dims.rope, dims.v
    ff, moe_ff, n_exp = dims.ffn, dims.moe_ffn, dims.experts
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)

    def bf16(*shape: int) -> tuple[str, np.ndarray]:
        return "BF16", f32_to_bf16_bits((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32))

    def linear(part: dict, name: str, rows: int, cols: int) -> None:
        if not fp8:
            part[name] = bf16(rows, cols)
            return
        codes = rng.integers(0, 256, size=(rows, cols), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] -= 1  # no NaN codes
        part[name] = ("F8_E4M3", codes)
        part[name + "_scale_inv"] = ("F32", rng.uniform(1e-4, 2e-3, (-(-rows // 128), -(-cols // 128)))
                                     .astype(np.float32))

    weight_map = {}
    for i in range(layers + 1):
        p, part = f"model.layers.{i}.", {}
        if i == layers:  # last shard: embeddings, head, final norm
            part = {"model.embed_tokens.weight": bf16(dims.vocab, h), "lm_head.weight": bf16(dims.vocab, h),
                    "model.norm.weight": bf16(h)}
        else:
            for n, d in (("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_a_layernorm", q_lora),
                         ("self_attn.kv_a_layernorm", kv_lora)):
                part[f"{p}{n}.weight"] = bf16(d)
            for n, shape in (("q_a_proj", (q_lora, h)), ("q_b_proj", (heads * (nope + rope), q_lora)),
                             ("kv_a_proj_with_mqa", (kv_lora + rope, h)), ("kv_b_proj", (heads * (nope + v), kv_lora)),
                             ("o_proj", (h, heads * v))):
                linear(part, f"{p}self_attn.{n}.weight", *shape)
            dense = i < dims.first_dense
            mlps = [("mlp.", ff)] if dense else [(f"mlp.experts.{x}.", moe_ff) for x in range(n_exp)] + [
                ("mlp.shared_experts.", moe_ff)]
            for prefix, width in mlps:
                for n, shape in (("gate_proj", (width, h)), ("up_proj", (width, h)), ("down_proj", (h, width))):
                    linear(part, f"{p}{prefix}{n}.weight", *shape)
            if not dense:
                part[f"{p}mlp.gate.weight"] = bf16(n_exp, h)
                part[f"{p}mlp.gate.e_score_correction_bias"] = ("F32", rng.standard_normal(n_exp).astype(np.float32))
        fname = f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors"
        write_safetensors(folder / fname, part, {"format": "pt"})
        weight_map.update({n: fname for n in part})
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "bos_token_id": 0, "eos_token_id": 1,
        "first_k_dense_replace": dims.first_dense,
        "hidden_size": h, "intermediate_size": ff, "kv_lora_rank": kv_lora, "max_position_embeddings": 163840,
        "moe_intermediate_size": moe_ff, "n_routed_experts": n_exp, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": heads, "num_experts_per_tok": dims.used, "num_hidden_layers": layers,
        "num_key_value_heads": heads, "q_lora_rank": q_lora, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
        "rms_norm_eps": 1e-6, "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "v_head_dim": v, "vocab_size": dims.vocab, "torch_dtype": "bfloat16",
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
    }
    if fp8:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": [128, 128]}
    _finish_checkpoint(folder, config, weight_map, DEEPSEEK_TOKENIZER)


def make_deepseek4_checkpoint(folder: Path, layers: int = 6) -> None:
    """DeepSeek-V4-Flash's layout scaled to 1024 wide (~58M parameters a layer): 16 heads of 256 with 64 rope dims,
    a q LoRA of 512, 4 output groups of rank 512, hc 4, a 128-row window, 32 routed experts of 512 (4 used) plus one
    shared, an indexer of 16 heads x 128 keeping 64; ratios 0, 4, 128, 4, 128, 0, ...; the first 2 layers
    hash-routed. BF16 linears and FP4 (E2M1 + E8M0) experts with unit-sized activations; one shard per layer."""
    h, heads, hd, rope, q_lora, groups, o_lora, n_exp, moe_ff, hc = 1024, 16, 256, 64, 512, 4, 512, 32, 512, 4
    ih, idim, vocab, used, n_hash = 16, 128, 320, 4, 2
    ratios = [(0, 4, 128)[i % 3] if i % 6 < 5 else 0 for i in range(layers)]
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)

    def bf16(*shape: int) -> tuple[str, np.ndarray]:
        return "BF16", f32_to_bf16_bits((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32))

    def f32(*shape: int, scale: float = 0.1) -> tuple[str, np.ndarray]:
        return "F32", (rng.standard_normal(shape) * scale).astype(np.float32)

    def fp4(part: dict, name: str, rows: int, cols: int) -> None:
        part[name + ".weight"] = ("I8", rng.integers(-128, 128, (rows, cols // 2), dtype=np.int8))
        exponent = 127 - int(np.ceil(np.log2(np.sqrt(cols)))) - 2  # E2M1 values of ~2: ~1/sqrt(cols) in all
        part[name + ".scale"] = ("F8_E8M0", np.full((rows, cols // 32), exponent, dtype=np.uint8))

    weight_map = {}
    for i in range(layers + 1):
        p, part = f"layers.{i}.", {}
        if i == layers:
            part = {"embed.weight": bf16(vocab, h), "head.weight": bf16(vocab, h), "norm.weight": bf16(h),
                    "hc_head_fn": f32(hc, hc * h, scale=0.01), "hc_head_base": f32(hc),
                    "hc_head_scale": f32(1)}
        else:
            for n in ("attn_norm.weight", "ffn_norm.weight"):
                part[p + n] = ("F32", np.ones(h, np.float32))
            for sub in ("attn", "ffn"):
                part[f"{p}hc_{sub}_fn"] = f32((2 + hc) * hc, hc * h, scale=0.01)
                part[f"{p}hc_{sub}_base"] = f32((2 + hc) * hc)
                part[f"{p}hc_{sub}_scale"] = f32(3)
            part[p + "attn.attn_sink"] = f32(heads)
            for n, shape in (("wq_a", (q_lora, h)), ("wq_b", (heads * hd, q_lora)), ("wkv", (hd, h)),
                             ("wo_a", (groups * o_lora, heads * hd // groups)), ("wo_b", (h, groups * o_lora))):
                part[f"{p}attn.{n}.weight"] = bf16(*shape)
            part[p + "attn.q_norm.weight"] = ("F32", np.ones(q_lora, np.float32))
            part[p + "attn.kv_norm.weight"] = ("F32", np.ones(hd, np.float32))
            r = ratios[i]
            comps = [("attn.compressor.", hd, r)] if r else []
            if r == 4:
                comps.append(("attn.indexer.compressor.", idim, 4))
                part[p + "attn.indexer.wq_b.weight"] = bf16(ih * idim, q_lora)
                part[p + "attn.indexer.weights_proj.weight"] = bf16(ih, h)
            for prefix, width, ratio in comps:
                w = (2 if ratio == 4 else 1) * width
                part[f"{p}{prefix}wkv.weight"], part[f"{p}{prefix}wgate.weight"] = bf16(w, h), bf16(w, h)
                part[f"{p}{prefix}ape"] = f32(ratio, w)
                part[f"{p}{prefix}norm.weight"] = ("F32", np.ones(width, np.float32))
            part[p + "ffn.gate.weight"] = bf16(n_exp, h)
            if i < n_hash:
                part[p + "ffn.gate.tid2eid"] = ("I64", rng.integers(0, n_exp, (vocab, used)))
            else:
                part[p + "ffn.gate.bias"] = f32(n_exp)
            for x in range(n_exp):
                for n, rows, cols in (("w1", moe_ff, h), ("w2", h, moe_ff), ("w3", moe_ff, h)):
                    fp4(part, f"{p}ffn.experts.{x}.{n}", rows, cols)
            for n, shape in (("w1", (moe_ff, h)), ("w2", (h, moe_ff)), ("w3", (moe_ff, h))):
                part[f"{p}ffn.shared_experts.{n}.weight"] = bf16(*shape)
        fname = f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors"
        write_safetensors(folder / fname, part, {"format": "pt"})
        weight_map.update({n: fname for n in part})
    config = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "bos_token_id": 0,
        "eos_token_id": 1, "hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": 1, "head_dim": hd, "qk_rope_head_dim": rope, "q_lora_rank": q_lora,
        "o_groups": groups, "o_lora_rank": o_lora, "vocab_size": vocab, "n_routed_experts": n_exp,
        "num_experts_per_tok": used, "moe_intermediate_size": moe_ff, "n_shared_experts": 1, "hc_mult": hc,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "index_n_heads": ih, "index_head_dim": idim, "index_topk": 64,
        "num_hash_layers": n_hash, "compress_ratios": ratios, "compress_rope_theta": 160000, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "routed_scaling_factor": 1.5,
        "norm_topk_prob": True, "scoring_func": "sqrtsoftplus", "sliding_window": 128, "swiglu_limit": 10.0,
        "quantization_config": {"fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128]},
    }
    _finish_checkpoint(folder, config, weight_map, DEEPSEEK4_TOKENIZER)


QWEN3MOE_TOKENIZER = Path(__file__).parents[1] / "tests" / "data" / "convert" / "qwen3-moe" / "hf"
GPT_OSS_TOKENIZER = Path(__file__).parents[1] / "tests" / "data" / "convert" / "gpt-oss" / "hf"
QWEN3NEXT_TOKENIZER = Path(__file__).parents[1] / "tests" / "data" / "convert" / "qwen3-next" / "hf"


def _bf16(rng: np.random.Generator, *shape: int, scale: float | None = None) -> tuple[str, np.ndarray]:
    """Normal draws scaled by 1/sqrt(fan_in) (or `scale`), as a BF16 tensor."""
    s = 1 / np.sqrt(shape[-1]) if scale is None else scale
    return "BF16", f32_to_bf16_bits((rng.standard_normal(shape) * s).astype(np.float32))


def _ones(n: int) -> tuple[str, np.ndarray]:
    return "BF16", f32_to_bf16_bits(np.ones(n, np.float32))


def _zeros(n: int) -> tuple[str, np.ndarray]:
    """A zero-centred norm's unit gain (Qwen3-Next stores gain - 1)."""
    return "BF16", f32_to_bf16_bits(np.zeros(n, np.float32))


def _moe_experts(rng: np.random.Generator, part: dict, p: str, n_exp: int, h: int, moe_ff: int) -> None:
    """A router `mlp.gate` and `n_exp` SwiGLU experts of width `moe_ff` under prefix `p` (Qwen3-MoE's names)."""
    part[f"{p}mlp.gate.weight"] = _bf16(rng, n_exp, h)
    for x in range(n_exp):
        for n, shape in (("gate_proj", (moe_ff, h)), ("up_proj", (moe_ff, h)), ("down_proj", (h, moe_ff))):
            part[f"{p}mlp.experts.{x}.{n}.weight"] = _bf16(rng, *shape)


def _write_layer_shards(folder: Path, layers: int, layer: Callable[[str], dict], last: dict) -> dict[str, str]:
    """One shard per layer (`layer(prefix)` gives its tensors) and a last one with `last`; the weight map."""
    folder.mkdir(parents=True)
    weight_map = {}
    for i in range(layers + 1):
        part = last if i == layers else layer(f"model.layers.{i}.")
        fname = f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors"
        write_safetensors(folder / fname, part, {"format": "pt"})
        weight_map.update({n: fname for n in part})
    return weight_map


def make_qwen3moe_checkpoint(folder: Path, layers: int = 10) -> None:
    """Qwen3-30B-A3B's layout scaled to 1024 wide (~105M parameters a layer): 16 heads of 128 over 4 KV heads with
    q/k norms, 64 routed experts of 512 (8 used, softmax, normalised top-k), every layer MoE; bf16, one shard per
    layer."""
    h, heads, kv, hd, n_exp, moe_ff, vocab = 1024, 16, 4, 128, 64, 512, 320
    rng = np.random.default_rng(0)

    def layer(p: str) -> dict:
        part = {f"{p}{n}.weight": _ones(d) for n, d in (("input_layernorm", h), ("post_attention_layernorm", h),
                                                        ("self_attn.q_norm", hd), ("self_attn.k_norm", hd))}
        for n, shape in (("q_proj", (heads * hd, h)), ("k_proj", (kv * hd, h)), ("v_proj", (kv * hd, h)),
                         ("o_proj", (h, heads * hd))):
            part[f"{p}self_attn.{n}.weight"] = _bf16(rng, *shape)
        _moe_experts(rng, part, p, n_exp, h, moe_ff)
        return part

    last = {"model.embed_tokens.weight": _bf16(rng, vocab, h), "lm_head.weight": _bf16(rng, vocab, h),
            "model.norm.weight": _ones(h)}
    weight_map = _write_layer_shards(folder, layers, layer, last)
    config = json.loads((QWEN3MOE_TOKENIZER / "config.json").read_text())
    config.update({"hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
                   "num_key_value_heads": kv, "head_dim": hd, "num_experts": n_exp, "num_experts_per_tok": 8,
                   "moe_intermediate_size": moe_ff, "intermediate_size": 3 * moe_ff, "max_window_layers": layers,
                   "vocab_size": vocab})
    _finish_checkpoint(folder, config, weight_map, QWEN3MOE_TOKENIZER)


def make_gpt_oss_checkpoint(folder: Path, layers: int = 12) -> None:
    """gpt-oss-20b's layout scaled to 1024 wide (~100M parameters a layer): 16 heads of 64 over 4 KV heads with
    biases and sinks, alternating 128-token sliding and full layers, 32 experts of 1024 (4 used) stored as the
    published checkpoint stores them (MXFP4 blocks and E8M0 scales, bf16 biases); one shard per layer."""
    h, heads, kv, hd, n_exp, ff, vocab = 1024, 16, 4, 64, 32, 1024, 336
    rng = np.random.default_rng(0)
    exponent = 127 - int(np.ceil(np.log2(np.sqrt(h)))) - 2  # E2M1 values of ~2: ~1/sqrt(fan_in) in all

    def mxfp4(part: dict, name: str, rows: int, cols: int) -> None:
        part[name + "_blocks"] = ("U8", rng.integers(0, 256, (n_exp, rows, cols // 32, 16), dtype=np.uint8))
        part[name + "_scales"] = ("U8", np.full((n_exp, rows, cols // 32), exponent, dtype=np.uint8))
        part[name + "_bias"] = _bf16(rng, n_exp, rows, scale=0.02)

    def layer(p: str) -> dict:
        part = {f"{p}{n}.weight": _ones(h) for n in ("input_layernorm", "post_attention_layernorm")}
        for n, rows, cols in (("q_proj", heads * hd, h), ("k_proj", kv * hd, h), ("v_proj", kv * hd, h),
                              ("o_proj", h, heads * hd)):
            part[f"{p}self_attn.{n}.weight"] = _bf16(rng, rows, cols)
            part[f"{p}self_attn.{n}.bias"] = _bf16(rng, rows, scale=0.02)
        part[f"{p}self_attn.sinks"] = _bf16(rng, heads, scale=1.0)
        part[f"{p}mlp.router.weight"], part[f"{p}mlp.router.bias"] = _bf16(rng, n_exp, h), _bf16(rng, n_exp,
                                                                                                  scale=0.02)
        mxfp4(part, f"{p}mlp.experts.gate_up_proj", 2 * ff, h)
        mxfp4(part, f"{p}mlp.experts.down_proj", h, ff)
        return part

    last = {"model.embed_tokens.weight": _bf16(rng, vocab, h), "lm_head.weight": _bf16(rng, vocab, h),
            "model.norm.weight": _ones(h)}
    weight_map = _write_layer_shards(folder, layers, layer, last)
    config = json.loads((GPT_OSS_TOKENIZER / "config.json").read_text())
    config.update({"hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
                   "num_key_value_heads": kv, "head_dim": hd, "num_local_experts": n_exp, "experts_per_token": 4,
                   "num_experts_per_tok": 4, "intermediate_size": ff, "sliding_window": 128, "vocab_size": vocab,
                   "layer_types": ["sliding_attention" if j % 2 == 0 else "full_attention" for j in range(layers)]})
    _finish_checkpoint(folder, config, weight_map, GPT_OSS_TOKENIZER)


def make_qwen3next_checkpoint(folder: Path, layers: int = 10) -> None:
    """Qwen3-Next-80B-A3B's layout scaled to 1024 wide (~110M parameters a layer): gated delta-net layers of 8 key
    and 16 value heads, both of 128 (the head dim ik's fused kernels take), a 4-tap convolution; gated full attention
    (8 heads of 256 over 2 KV heads, a quarter rotated) every 4th layer (ik hard-codes 4); every layer a MoE of 64
    experts of 512 (8 used) plus a shared expert of 512 behind its sigmoid gate. Zero-centred norms stored as
    gain - 1, as the published checkpoint does; bf16, one shard per layer."""
    h, heads, kv, hd, n_exp, moe_ff, vocab = 1024, 8, 2, 256, 64, 512, 320
    k_heads, v_heads, d_lin, kernel = 8, 16, 128, 4
    conv = (2 * k_heads + v_heads) * d_lin
    rng = np.random.default_rng(0)

    def layer(p: str) -> dict:
        part = {f"{p}{n}.weight": _zeros(h) for n in ("input_layernorm", "post_attention_layernorm")}
        if int(p.split(".")[2]) % 4 == 3:  # "model.layers.{i}."
            part.update({f"{p}self_attn.{n}.weight": _zeros(hd) for n in ("q_norm", "k_norm")})
            for n, shape in (("q_proj", (2 * heads * hd, h)), ("k_proj", (kv * hd, h)), ("v_proj", (kv * hd, h)),
                             ("o_proj", (h, heads * hd))):
                part[f"{p}self_attn.{n}.weight"] = _bf16(rng, *shape)
        else:
            a = f"{p}linear_attn."
            part.update({a + "in_proj_qkvz.weight": _bf16(rng, conv + v_heads * d_lin, h),
                         a + "in_proj_ba.weight": _bf16(rng, 2 * v_heads, h),
                         a + "conv1d.weight": _bf16(rng, conv, 1, kernel, scale=0.5),
                         a + "dt_bias": _ones(v_heads), a + "norm.weight": _ones(d_lin),
                         a + "out_proj.weight": _bf16(rng, h, v_heads * d_lin),
                         a + "A_log": ("BF16", f32_to_bf16_bits(np.log(rng.uniform(1, 16, v_heads))
                                                                .astype(np.float32)))})
        _moe_experts(rng, part, p, n_exp, h, moe_ff)
        for n, shape in (("gate_proj", (moe_ff, h)), ("up_proj", (moe_ff, h)), ("down_proj", (h, moe_ff))):
            part[f"{p}mlp.shared_expert.{n}.weight"] = _bf16(rng, *shape)
        part[f"{p}mlp.shared_expert_gate.weight"] = _bf16(rng, 1, h)
        return part

    last = {"model.embed_tokens.weight": _bf16(rng, vocab, h), "lm_head.weight": _bf16(rng, vocab, h),
            "model.norm.weight": _zeros(h)}
    weight_map = _write_layer_shards(folder, layers, layer, last)
    config = json.loads((QWEN3NEXT_TOKENIZER / "config.json").read_text())
    config.update({"hidden_size": h, "num_hidden_layers": layers, "num_attention_heads": heads,
                   "num_key_value_heads": kv, "head_dim": hd, "linear_num_key_heads": k_heads,
                   "linear_num_value_heads": v_heads, "linear_key_head_dim": d_lin, "linear_value_head_dim": d_lin,
                   "linear_conv_kernel_dim": kernel, "full_attention_interval": 4, "num_experts": n_exp,
                   "num_experts_per_tok": 8, "moe_intermediate_size": moe_ff,
                   "shared_expert_intermediate_size": moe_ff, "intermediate_size": 3 * moe_ff, "vocab_size": vocab})
    _finish_checkpoint(folder, config, weight_map, QWEN3NEXT_TOKENIZER)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("bench-convert"))
    ap.add_argument("--outtype", action="append", help="output types to measure (default: f16, q8_0)")
    ap.add_argument("--layers", type=int, help="11 layers of a 2048-wide model are about 1 GB in bf16 (default); "
                    "with --deepseek-fp8, 7 layers (1 dense + 6 MoE) are about 2 GB (default)")
    ap.add_argument("--deepseek-fp8", action="store_true", help="a DeepSeek-V3-shaped FP8 checkpoint instead")
    a = ap.parse_args()
    outtypes = a.outtype or ["f16", "q8_0"]
    hf = a.workdir / ("hf-deepseek-fp8" if a.deepseek_fp8 else "hf")
    pre = "deepseek-v3" if a.deepseek_fp8 else "qwen2"
    if not (hf / "config.json").exists():
        print(f"generating checkpoint in {hf} ...", flush=True)
        if a.deepseek_fp8:
            make_deepseek_fp8_checkpoint(hf, a.layers or 7)
        else:
            make_tiny_checkpoint(hf, TinySpec(arch="qwen3", hidden=2048, layers=a.layers or 11, heads=16,
                                              kv_heads=4, head_dim=128, ffn=6144, shards=4))
    size = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    print(f"checkpoint: {size / 1e6:.0f} MB in {len(list(hf.glob('*.safetensors')))} shards")
    rows = []
    copy_dir = a.workdir / "copy"
    copy_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for p in hf.glob("*.safetensors"):
        shutil.copyfile(p, copy_dir / p.name)
    copy_s = time.perf_counter() - t0
    shutil.rmtree(copy_dir)
    rows.append(("copy shards (baseline)", copy_s, float("nan")))
    exe = str(Path(sys.executable).parent / "ikconvert")
    for outtype in outtypes:
        out = a.workdir / f"out-{outtype}.gguf"
        dt, peak_mib = run_child([exe, "hf2gguf", str(hf), "--outtype", outtype, "--pre-tokenizer", pre,
                                  "--outfile", str(out)])
        rows.append((f"ikconvert --outtype {outtype}", dt, peak_mib))
        out.unlink()
    print(f"{'step':32s} {'seconds':>8s} {'MB/s in':>8s} {'x copy':>7s} {'peak RSS MiB':>13s}")
    for name, dt, rss in rows:
        print(f"{name:32s} {dt:8.2f} {size / 1e6 / dt:8.1f} {copy_s / dt:7.2f} {rss:13.0f}")


if __name__ == "__main__":
    main()
