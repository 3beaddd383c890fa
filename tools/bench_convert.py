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
from pathlib import Path

import numpy as np

from ikconvert.safetensors_io import write_safetensors
from ikconvert.tiny import TinySpec, make_tiny_checkpoint
from ikquant.formats.numeric import f32_to_bf16_bits

DEEPSEEK_TOKENIZER = Path(__file__).parents[1] / "tests" / "data" / "convert" / "deepseek-v3" / "hf"


def run_child(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one command, measured from a small parent (tools/peak_rss.py)."""
    res = subprocess.run([sys.executable, str(Path(__file__).parent / "peak_rss.py"), *cmd],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if res.returncode:
        sys.exit(f"command failed ({res.returncode}): {' '.join(cmd)}\n{res.stderr}")
    _, rss, dt = res.stderr.strip().splitlines()[-1].split()
    return float(dt), float(rss)


def make_deepseek_fp8_checkpoint(folder: Path, layers: int) -> None:
    """DeepSeek-V3's layout at 2048 wide: layer 0 dense, the rest MoE (64 experts of 768 + 1 shared), FP8
    linears with 128x128 scales, one shard per layer so the generator holds one layer at a time."""
    h, heads, q_lora, kv_lora, nope, rope, v, ff, moe_ff, n_exp = 2048, 16, 768, 512, 128, 64, 128, 6144, 768, 64
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)

    def bf16(*shape: int) -> tuple[str, np.ndarray]:
        return "BF16", f32_to_bf16_bits((rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32))

    def fp8(part: dict, name: str, rows: int, cols: int) -> None:
        codes = rng.integers(0, 256, size=(rows, cols), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] -= 1  # no NaN codes
        part[name] = ("F8_E4M3", codes)
        part[name + "_scale_inv"] = ("F32", rng.uniform(1e-4, 2e-3, (-(-rows // 128), -(-cols // 128)))
                                     .astype(np.float32))

    weight_map = {}
    for i in range(layers + 1):
        p, part = f"model.layers.{i}.", {}
        if i == layers:  # last shard: embeddings, head, final norm
            part = {"model.embed_tokens.weight": bf16(320, h), "lm_head.weight": bf16(320, h),
                    "model.norm.weight": bf16(h)}
        else:
            for n, d in (("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_a_layernorm", q_lora),
                         ("self_attn.kv_a_layernorm", kv_lora)):
                part[f"{p}{n}.weight"] = bf16(d)
            for n, shape in (("q_a_proj", (q_lora, h)), ("q_b_proj", (heads * (nope + rope), q_lora)),
                             ("kv_a_proj_with_mqa", (kv_lora + rope, h)), ("kv_b_proj", (heads * (nope + v), kv_lora)),
                             ("o_proj", (h, heads * v))):
                fp8(part, f"{p}self_attn.{n}.weight", *shape)
            mlps = [("mlp.", ff)] if i == 0 else [(f"mlp.experts.{x}.", moe_ff) for x in range(n_exp)] + [
                ("mlp.shared_experts.", moe_ff)]
            for prefix, width in mlps:
                for n, shape in (("gate_proj", (width, h)), ("up_proj", (width, h)), ("down_proj", (h, width))):
                    fp8(part, f"{p}{prefix}{n}.weight", *shape)
            if i > 0:
                part[f"{p}mlp.gate.weight"] = bf16(n_exp, h)
                part[f"{p}mlp.gate.e_score_correction_bias"] = ("F32", rng.standard_normal(n_exp).astype(np.float32))
        fname = f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors"
        write_safetensors(folder / fname, part, {"format": "pt"})
        weight_map.update({n: fname for n in part})
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 1,
        "hidden_size": h, "intermediate_size": ff, "kv_lora_rank": kv_lora, "max_position_embeddings": 163840,
        "moe_intermediate_size": moe_ff, "n_routed_experts": n_exp, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": heads, "num_experts_per_tok": 8, "num_hidden_layers": layers,
        "num_key_value_heads": heads, "q_lora_rank": q_lora, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
        "rms_norm_eps": 1e-6, "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "v_head_dim": v, "vocab_size": 320, "torch_dtype": "bfloat16",
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(DEEPSEEK_TOKENIZER / name, folder / name)


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
