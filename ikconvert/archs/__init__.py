"""One module per Hugging Face architecture; importing this package registers them all."""

from ikconvert.archs import dflash, llama  # noqa: F401
