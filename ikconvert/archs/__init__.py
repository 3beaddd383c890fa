"""One module per Hugging Face architecture; importing this package registers them all."""

from ikconvert.archs import dflash, llama, openpangu  # noqa: F401
