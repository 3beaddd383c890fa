"""Hugging Face checkpoints -> GGUF files that ik_llama.cpp loads.

The names in `__all__` are the library's public API, loaded when first used (PEP 562 `__getattr__`) so that
`import ikconvert` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import ikquant  # noqa: F401  (its import sets the BLAS thread timeout and the Numba cache folder before they load)

if TYPE_CHECKING:
    from ikconvert.archs.base import architectures
    from ikconvert.convert import Converter
    from ikconvert.errors import ConvertError
    from ikconvert.safetensors_io import write_safetensors
    from ikconvert.tiny import CORPUS, TinySpec, make_tiny_checkpoint

#: public name -> the module that defines it
_EXPORTS = {
    "Converter": "ikconvert.convert",
    "ConvertError": "ikconvert.errors",
    "architectures": "ikconvert.archs.base",
    "TinySpec": "ikconvert.tiny",
    "make_tiny_checkpoint": "ikconvert.tiny",
    "CORPUS": "ikconvert.tiny",
    "write_safetensors": "ikconvert.safetensors_io",
}
__all__ = [
    "Converter", "ConvertError", "architectures", "TinySpec", "make_tiny_checkpoint", "CORPUS", "write_safetensors",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ikconvert' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
