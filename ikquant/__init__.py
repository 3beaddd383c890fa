"""ik_llama.cpp's GGUF file and number formats: type registry, GGUF I/O, quantization formats and recipes.

The names in `__all__` are the library's public API. They are loaded when first used (PEP 562 `__getattr__`), so
that `import ikquant` stays cheap for the command-line tools, which set up the environment below before numpy and
Numba load.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ikquant.cli import app
    from ikquant.errors import IkError
    from ikquant.formats.numeric import f32_to_bf16_bits
    from ikquant.ftypes import FileType, file_type
    from ikquant.gguf_io import GGUFFile, GGUFStreamWriter
    from ikquant.imatrix import Imatrix, ImatrixEntry, read_imatrix, write_imatrix_dat
    from ikquant.quantize import QuantizeOptions, quantize_model
    from ikquant.types import GGMLType, all_types, implemented_types, type_by_id, type_by_name

#: public name -> the module that defines it
_EXPORTS = {
    "IkError": "ikquant.errors",
    "GGUFFile": "ikquant.gguf_io",
    "GGUFStreamWriter": "ikquant.gguf_io",
    "GGMLType": "ikquant.types",
    "type_by_name": "ikquant.types",
    "type_by_id": "ikquant.types",
    "all_types": "ikquant.types",
    "implemented_types": "ikquant.types",
    "FileType": "ikquant.ftypes",
    "file_type": "ikquant.ftypes",
    "QuantizeOptions": "ikquant.quantize",
    "quantize_model": "ikquant.quantize",
    "Imatrix": "ikquant.imatrix",
    "ImatrixEntry": "ikquant.imatrix",
    "read_imatrix": "ikquant.imatrix",
    "write_imatrix_dat": "ikquant.imatrix",
    "f32_to_bf16_bits": "ikquant.formats.numeric",
    "app": "ikquant.cli",
}
__all__ = [
    "IkError", "GGUFFile", "GGUFStreamWriter", "GGMLType", "type_by_name", "type_by_id", "all_types",
    "implemented_types", "FileType", "file_type", "QuantizeOptions", "quantize_model", "Imatrix", "ImatrixEntry",
    "read_imatrix", "write_imatrix_dat", "f32_to_bf16_bits", "app",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use. The type registry comes with every codec attached
    (ikquant.formats imported), so a type from the public API can always quantize and dequantize."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ikquant' has no attribute {name!r}")
    if module == "ikquant.types":
        importlib.import_module("ikquant.formats")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

# OpenBLAS's worker threads spin for 2^28 cycles after each call (~0.1 s), and the runtime alternates BLAS with
# Numba's parallel kernels on the same cores: a spinning BLAS thread halves every kernel that follows (measured:
# --numerics ik on Q8_0 381 -> 721 tok/s, exact F16 340 -> 367 on 2 threads). OpenBLAS reads this when it loads, so
# it is set before anything here imports numpy; a value the user set is kept.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")


#: cache folders of other source versions kept besides this one's (another checkout may be running them)
KEPT_CACHES = 3


def _numba_cache_dir() -> str | None:
    """A Numba cache folder for exactly this version of the kernels. Numba keys a cached kernel on its own file only,
    so a kernel that inlines a helper from another module keeps the old helper's code after that module changes (it
    silently computes the old thing). One folder per hash of every source file that holds kernels or the tables
    they read (the format and op modules, and any other with a Numba decorator) makes such a change recompile; the
    least recently used folders of other versions beyond KEPT_CACHES are removed. None when no user cache folder can
    be written."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(p for package in ("ikquant", "ikconvert", "ikrun") for p in (root / package).rglob("*.py")):
        text = path.read_bytes()
        if path.parent.name in ("formats", "ops") or b"@njit" in text or b"@intrinsic" in text:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + text)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "iktools" / "numba"
    here = base / digest.hexdigest()[:16]
    try:
        here.mkdir(parents=True, exist_ok=True)
        os.utime(here)
    except OSError:
        return None
    others = sorted((p for p in base.iterdir() if p != here and p.is_dir()), key=lambda p: p.stat().st_mtime)
    for old in others[: max(0, len(others) - KEPT_CACHES)]:
        shutil.rmtree(old, ignore_errors=True)
    return str(here)


# read by Numba when it is first imported; a folder the user chose is kept. A program that imported Numba first
# (a script, a notebook) has it read again here: Numba picks a kernel's cache folder when the kernel is defined, and
# would otherwise put every kernel defined before its first compile beside the source, where a change to a helper
# in another module leaves the kernels that inline it stale.
if "NUMBA_CACHE_DIR" not in os.environ:
    _cache = _numba_cache_dir()
    if _cache is not None:
        os.environ["NUMBA_CACHE_DIR"] = _cache
        if "numba.core.config" in sys.modules:
            sys.modules["numba.core.config"].reload_config()
