"""One architecture registry: every GGUF architecture ikconvert writes is one ikrun runs, and every Hugging Face
architecture it converts has a numpy reference (or is declared without one, with the reason)."""

from __future__ import annotations

import pytest

from ikconvert import architectures
from ikrun.models import model_class
from ikrun.validate import REFERENCES, WITHOUT_REFERENCE, reference_class

CONVERTERS = architectures()
HF_ARCHITECTURES = list(CONVERTERS)


@pytest.mark.parametrize("hf_arch", HF_ARCHITECTURES)
def test_every_converted_architecture_runs(hf_arch: str) -> None:
    gguf_arch = CONVERTERS[hf_arch].gguf_arch
    assert gguf_arch in model_class(gguf_arch).archs


@pytest.mark.parametrize("hf_arch", HF_ARCHITECTURES)
def test_every_converted_architecture_has_a_reference(hf_arch: str) -> None:
    if hf_arch in WITHOUT_REFERENCE:
        assert hf_arch not in REFERENCES, f"{hf_arch} is declared without a reference but has one"
        return
    assert reference_class(hf_arch) is not None, f"{hf_arch} has no numpy reference in ikrun.validate.REFERENCES"


def test_references_name_only_converted_architectures() -> None:
    assert sorted(set(REFERENCES) | set(WITHOUT_REFERENCE)) == HF_ARCHITECTURES
