"""The packages' public names: each one importable from the top level, and `import ikquant` still cheap."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ikconvert
import ikquant


@pytest.mark.parametrize("package", [ikquant, ikconvert], ids=lambda p: p.__name__)
def test_every_public_name_is_importable(package) -> None:  # type: ignore[no-untyped-def]
    for name in package.__all__:
        assert getattr(package, name) is not None, name
    with pytest.raises(AttributeError):
        package.no_such_name  # noqa: B018


def test_the_public_types_carry_their_codecs() -> None:
    assert ikquant.type_by_name("Q4_0").codec is not None


def test_importing_the_packages_loads_neither_numpy_nor_numba() -> None:
    code = "import sys, ikconvert; print(sorted(m for m in ('numpy', 'numba', 'typer') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("package", ["ikrun", "ikquant", "ikconvert"])
def test_python_dash_m_runs_the_command(package: str) -> None:
    done = subprocess.run([sys.executable, "-m", package, "--help"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"Usage: {package} " in done.stdout
