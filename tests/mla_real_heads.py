"""The tiny DeepSeek-V3 with real MLA head sizes (keys 128 + 64 rope = 192, values 128: what ik's own flash-attention
kernel takes), narrow elsewhere: the checkpoint behind tests/data/logits/deepseek-v3-heads192-fa-avx2, made again
from its seed by the tests (the file it converts to is 1.2 MB)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from ikconvert.safetensors_io import SafetensorsFile, write_safetensors
from ikquant.formats.numeric import f32_to_bf16_bits
from tests.test_convert_deepseek2 import DSSpec, make_deepseek_checkpoint

SPEC = DSSpec(q_lora=32, fp8_block=None, hidden=64, heads=2, kv_lora=64, nope=128, rope=64, v=128, ff=128, moe_ff=32,
              experts=4, shared=1, dense=1, layers=2, seed=7)
#: the same with DeepSeek-V3's latent of 512 (the absorbed form's flash attention at ik's 576 / 512 heads)
LATENT512 = replace(SPEC, kv_lora=512)
TOKENIZER = Path(__file__).parent / "data" / "convert" / "deepseek-v3" / "hf"


def make_checkpoint(folder: Path, spec: DSSpec = SPEC) -> Path:
    """`spec`'s checkpoint with its norm weights near 1 (1 + N(0, 0.1)) instead of the generator's small random ones,
    so that attention moves the logits and a quantized attn_kv_b shows in the KLD."""
    make_deepseek_checkpoint(folder, spec, TOKENIZER)
    rng = np.random.default_rng(spec.seed + 1)
    for shard in sorted(folder.glob("model-*.safetensors")):
        st = SafetensorsFile(shard)
        tensors = {}
        for name, t in st.tensors.items():
            if name.endswith("norm.weight"):
                n = int(np.prod(t.shape))
                tensors[name] = ("BF16", f32_to_bf16_bits((1 + 0.1 * rng.standard_normal(n)).astype(np.float32)))
            else:
                tensors[name] = (t.dtype, np.array(t.raw()))
        del st
        write_safetensors(shard, tensors, {"format": "pt"})
    return folder
