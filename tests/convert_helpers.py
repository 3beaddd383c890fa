"""What every converter test file checks on bad input: exit code 2, a message naming the fault, no output left."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from ikconvert.cli import app

runner = CliRunner()


def convert_fails(args: list[str], out: Path, *needles: str) -> str:
    """`ikconvert hf2gguf ARGS --outfile OUT` must exit 2 with every needle in its (unwrapped) message and leave
    neither OUT nor its temporary file behind; returns the message."""
    res = runner.invoke(app, ["hf2gguf", *args, "--outfile", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    for needle in needles:
        assert needle in text, text
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]
    return text
