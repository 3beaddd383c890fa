"""The generated reference pages in docs/ match the code they are generated from (rerun tools/gen_docs.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "tools" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", ["formats.md", "layouts.md"])
def test_generated_page_is_current(page: str) -> None:
    assert (ROOT / "docs" / page).read_text(encoding="utf-8") == _generator().PAGES[page](), \
        f"docs/{page} is stale: run python tools/gen_docs.py"


def test_docs_point_only_inside_the_repository() -> None:
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        assert "shared/" not in text and "spec/" not in text, path
