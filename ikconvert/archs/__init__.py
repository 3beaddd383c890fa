"""One module per Hugging Face architecture; importing this package registers them all."""

from ikconvert.archs import (  # noqa: F401
    deepseek2,
    deepseek4,
    dflash,
    glm4moe,
    glm_dsa,
    gpt_oss,
    llama,
    minimax_m2,
    openpangu,
    qwen3moe,
    qwen3next,
)
