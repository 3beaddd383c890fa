"""ik's flash attention over a q4_1 key cache under `--numerics ik` / `ik-avx2`: its own kernel on the cache rows
as stored (codes, scale and offset per block), the offset summed as a biased type's; ik's base-logits files byte for
byte (tests/data/logits/q4_1-flash) over whole chunks, batches of 3 and one token a batch, where the run took ik's
-fa off graph before (and reproduced its Q8_1_R8 defect there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ikrun.cli import app
from tests.test_flash_attention_gqa import heads  # noqa: F401  (the fixture making the head-64/128 files)

FOLDER = Path(__file__).parent / "data" / "logits" / "q4_1-flash"
TEXT = FOLDER.parent / "qwen3" / "text.txt"
runner = CliRunner()


@pytest.mark.parametrize(("name", "model", "ctx", "chunks", "batch", "build"), [
    ("qwen3-h64-c64", "h64-f32.gguf", 64, 4, None, "avx512"),
    ("qwen3-h64-c64", "h64-f32.gguf", 64, 4, None, "avx2"),
    ("qwen3-h128-c64", "h128-f32.gguf", 64, 4, None, "avx512"),
    ("qwen3-h64-c256", "h64-f32.gguf", 256, 2, None, "avx512"),
    ("qwen3-h64-c8-b3", "h64-f32.gguf", 8, 4, 3, "avx512"),
    ("qwen3-h64-c256-b1", "h64-f32.gguf", 256, 1, 1, "avx512"),
    ("qwen3-h64-c64-khad", "h64-f32.gguf", 64, 4, None, "avx512")])
def test_q4_1_keys_under_flash_attention_are_iks(heads: dict[str, Path], name: str, model: str, ctx: int,  # noqa: F811
                                                 chunks: int, batch: int | None, build: str, tmp_path: Path) -> None:
    """ik's default run with -ctk q4_1: its base-logits file byte for byte, its final line; the report names the
    flash-attention graph and no defect of ik's."""
    out = tmp_path / "base.kld"
    res = runner.invoke(app, ["ppl", str(heads[model]), "--text", str(TEXT), "-c", str(ctx), "--chunks", str(chunks),
                              *(["--batch", str(batch)] if batch else []), "-ctk", "q4_1",
                              *(["-khad"] if name.endswith("-khad") else []), "--numerics",
                              "ik" if build == "avx512" else "ik-avx2", "--ik-threads", "2", "--save-base-logits",
                              str(out), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["flash_attn"] == "on" and "ik_defect" not in report
    assert out.read_bytes() == (FOLDER / f"{name}-{build}.kld").read_bytes()
    final = next(line for line in (FOLDER / f"{name}-{build}.txt").read_text(errors="replace").splitlines()
                 if line.startswith("Final estimate"))
    assert f"= {report['ppl']:.4f} +/- {report['ppl_err']:.5f}" in final
