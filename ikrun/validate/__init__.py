"""Independent numpy references written from the Hugging Face model definitions, one per architecture, registered
here by the Hugging Face architecture name they implement (tests/test_registry.py checks that every architecture
ikconvert converts has one, or is declared here without one and why)."""

from __future__ import annotations

import importlib

#: Hugging Face architecture -> "module:class" of its numpy reference forward
REFERENCES = {
    "LlamaForCausalLM": "ikrun.validate.hf:HFReference",
    "Qwen2ForCausalLM": "ikrun.validate.hf:HFReference",
    "Qwen3ForCausalLM": "ikrun.validate.hf:HFReference",
    "Qwen3MoeForCausalLM": "ikrun.validate.hf:HFReference",
    "MiniMaxM2ForCausalLM": "ikrun.validate.minimax_m2:MiniMaxM2Reference",
    "GptOssForCausalLM": "ikrun.validate.gpt_oss:GptOssReference",
    "DeepseekV3ForCausalLM": "ikrun.validate.deepseek2:DeepseekV3Reference",
    "DeepseekV4ForCausalLM": "ikrun.validate.deepseek4:DeepseekV4Reference",
    "DeepseekV4FlashForCausalLM": "ikrun.validate.deepseek4:DeepseekV4Reference",
    "DeepseekV4ProForCausalLM": "ikrun.validate.deepseek4:DeepseekV4Reference",
    "Glm4MoeForCausalLM": "ikrun.validate.glm4moe:Glm4MoeReference",
    "GlmMoeDsaForCausalLM": "ikrun.validate.glm_dsa:GlmDsaReference",
    "OpenPanguV2ForCausalLM": "ikrun.validate.openpangu:OpenPanguReference",
    "DFlashDraftModel": "ikrun.validate.dflash:DFlashReference",
    "Qwen3NextForCausalLM": "ikrun.validate.qwen3next:GatedDeltaNetReference",
    "Qwen3_5MoeForCausalLM": "ikrun.validate.qwen3next:GatedDeltaNetReference",
    "Qwen3_5MoeForConditionalGeneration": "ikrun.validate.qwen3next:GatedDeltaNetReference",
    "Qwen3_5ForCausalLM": "ikrun.validate.qwen3next:GatedDeltaNetReference",
    "Qwen3_5ForConditionalGeneration": "ikrun.validate.qwen3next:GatedDeltaNetReference",
}

#: converted architectures without a reference of their own, and why
WITHOUT_REFERENCE = {
    "DeepseekV2ForCausalLM": "converted by the DeepSeek-V3 map; the V3 reference is not checked against V2's "
                             "transformers definition (no V2 checkpoint with transformers' logits among the goldens)",
}


def reference_class(hf_architecture: str) -> type | None:
    """The reference forward of a Hugging Face architecture, None without one."""
    where = REFERENCES.get(hf_architecture)
    if where is None:
        return None
    module, name = where.split(":")
    cls: type = getattr(importlib.import_module(module), name)
    return cls
