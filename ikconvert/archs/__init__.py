"""One module per Hugging Face architecture; importing this package registers them all."""

from ikconvert.archs import deepseek2, deepseek4, dflash, glm4moe, glm_dsa, llama, openpangu, qwen3moe  # noqa: F401
