"""One module per GGUF architecture; `model_class` finds the one for a file's general.architecture."""

from __future__ import annotations

from ikrun.errors import ModelError
from ikrun.models.base import ArchModel
from ikrun.models.deepseek2 import Deepseek2
from ikrun.models.deepseek4 import Deepseek4
from ikrun.models.dflash import DFlashDraft
from ikrun.models.glm_dsa import GlmDsa
from ikrun.models.llama import LlamaFamily
from ikrun.models.openpangu import OpenPangu

_BY_ARCH = {arch: cls for cls in (LlamaFamily, Deepseek2, Deepseek4, OpenPangu, GlmDsa,
                                                    DFlashDraft) for arch in cls.archs}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCH)


def model_class(arch: str) -> type[ArchModel]:


    try:
        return _BY_ARCH[arch]
    except KeyError:
        raise ModelError(f"architecture {arch!r} is not supported by ikrun; supported: "
                         f"{', '.join(supported_architectures())}") from None
