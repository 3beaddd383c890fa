"""One module per GGUF architecture, registered here: `model_class` finds the one for a file's
general.architecture, `check_options` refuses a runtime option it does not honour."""

from __future__ import annotations

from pathlib import Path

from ikrun.errors import ModelError
from ikrun.models.base import ArchModel
from ikrun.models.deepseek2 import Deepseek2
from ikrun.models.deepseek4 import Deepseek4
from ikrun.models.dflash import DFlashDraft
from ikrun.models.glm4moe import Glm4Moe
from ikrun.models.glm_dsa import GlmDsa
from ikrun.models.gpt_oss import GptOss
from ikrun.models.llama import LlamaFamily
from ikrun.models.minimax_m2 import MiniMaxM2
from ikrun.models.openpangu import OpenPangu
from ikrun.models.qwen3moe import Qwen3Moe
from ikrun.models.qwen3next import Qwen3Next
from ikrun.models.qwen35 import Qwen35
from ikrun.models.qwen35moe import Qwen35Moe
from ikrun.options import RuntimeOptions, every_arch

_BY_ARCH = {arch: cls for cls in (LlamaFamily, Qwen3Moe, Glm4Moe, MiniMaxM2, GptOss, Deepseek2, Deepseek4, OpenPangu,
                                  GlmDsa, DFlashDraft, Qwen3Next, Qwen35Moe, Qwen35)
            for arch in cls.archs}


def check_options(options: RuntimeOptions, path: Path, arch: str) -> None:
    """Refuse an option the architecture of the model at `path` does not honour: a flag never silently does
    nothing."""
    options.check()
    honoured = model_class(arch).runtime_options
    for option in options.given():
        if option not in honoured and not every_arch(option):
            honour = [a for a in supported_architectures() if option in model_class(a).runtime_options]
            raise ModelError(f"--{option.replace('_', '-')} applies only to {', '.join(honour)}; {path} is {arch}")


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCH)


def model_class(arch: str) -> type[ArchModel]:
    try:
        return _BY_ARCH[arch]
    except KeyError:
        raise ModelError(f"architecture {arch!r} is not supported by ikrun; supported: "
                         f"{', '.join(supported_architectures())}") from None
