"""One module per Hugging Face architecture; importing this package registers them all."""

from ikconvert.archs import deepseek2, deepseek4, dflash, glm_dsa, gpt_oss, llama, minimax_m2, openpangu, qwen3moe  # noqa: F401
