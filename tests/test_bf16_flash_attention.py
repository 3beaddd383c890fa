"""ik's flash attention over bf16 K and V caches (FlashAttnBF16: its bf16 K x Q, key blocks of 64 or 32, the bf16
values accumulated as f32), and its -fa off graph over them (bf16 matmuls, the probabilities rounded to bf16 for the
values), under `--numerics ik`: ik's base-logits files byte for byte (tests/data/logits/bf16-flash) over whole
chunks, small batches, one token a batch with the keys split among threads and with heads shared unevenly; refused
where ik has no such kernel (its AVX2 build)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ikrun.cli import app
from tests.test_flash_attention_gqa import heads  # noqa: F401  (the fixture making the head-64/128 files)
from tests.test_flash_attention_small_batches import group4  # noqa: F401  (the 4-heads-on-1 file)

FOLDER = Path(__file__).parent / "data" / "logits" / "bf16-flash"
TEXT = FOLDER.parent / "qwen3" / "text.txt"
runner = CliRunner()


@pytest.mark.parametrize(("name", "model", "ctx", "chunks", "batch", "threads"), [
    ("qwen3-h64-c64", "h64-f32.gguf", 64, 4, None, 2),
    ("qwen3-h128-c64", "h128-f32.gguf", 64, 4, None, 2),
    ("qwen3-h64-c256", "h64-f32.gguf", 256, 2, None, 2),
    ("qwen3-h64-c8-b3", "h64-f32.gguf", 8, 4, 3, 2),
    ("qwen3-h64-c256-b1", "h64-f32.gguf", 256, 1, 1, 2),
    ("qwen3-g4-h64-c8-b1-t3", "g4", 8, 4, 1, 3),
    ("qwen3-h64-c64-fa-off", "h64-f32.gguf", 64, 4, None, 2),
    ("qwen3-h128-c64-fa-off", "h128-f32.gguf", 64, 4, None, 2),
    ("qwen3-h64-c256-fa-off", "h64-f32.gguf", 256, 2, None, 2),
    ("qwen3-h64-c64-ctk-f16-fa-off", "h64-f32.gguf", 64, 4, None, 2),
    ("qwen3-h64-c64-ctk-q8_0-fa-off", "h64-f32.gguf", 64, 4, None, 2),
    ("qwen3-h64-c64-ctk-q4_0-fa-off", "h64-f32.gguf", 64, 4, None, 2)])
def test_bf16_caches_under_flash_attention_are_iks(heads: dict[str, Path], group4: Path, name: str,  # noqa: F811
                                                   model: str, ctx: int, chunks: int, batch: int | None,
                                                   threads: int, tmp_path: Path) -> None:
    """ik's run with -ctk bf16 -ctv bf16 (its default flash attention, or -fa off: its bf16 matmuls, the
    probabilities rounded to bf16 for the values): its base-logits file byte for byte, its final line."""
    out = tmp_path / "base.kld"
    path = group4 if model == "g4" else heads[model]
    graph = "off" if name.endswith("-fa-off") else "on"
    keys = name.split("-ctk-")[1].split("-")[0] if "-ctk-" in name else "bf16"
    res = runner.invoke(app, ["ppl", str(path), "--text", str(TEXT), "-c", str(ctx), "--chunks", str(chunks),
                              *(["--batch", str(batch)] if batch else []), "-ctk", keys, "-ctv", "bf16",
                              "--numerics", "ik", "--ik-threads", str(threads), "--flash-attn", graph,
                              "--save-base-logits", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert f"K cache {keys}, V cache bf16, flash attention {graph}" in res.stdout
    assert out.read_bytes() == (FOLDER / f"{name}-avx512.kld").read_bytes()
    final = next(line for line in (FOLDER / f"{name}-avx512.txt").read_text(errors="replace").splitlines()
                 if line.startswith("Final estimate"))
    assert final in res.stdout


def test_bf16_caches_where_ik_has_no_bf16_flash_attention(heads: dict[str, Path]) -> None:  # noqa: F811
    """ik's AVX2 build has no FlashAttnBF16 (it aborts): --numerics ik-avx2 refuses -ctv bf16 in one line, exit 2,
    in its -fa off graph too (not reproduced); bf16 keys over F16 values (which ik refuses under flash attention)
    take its -fa off graph."""
    flags = ["ppl", str(heads["h64-f32.gguf"]), "--text", str(TEXT), "-c", "64", "--chunks", "1", "-ctk", "bf16"]
    res = runner.invoke(app, [*flags, "-ctv", "bf16", "--numerics", "ik-avx2"])
    assert res.exit_code == 2 and "AVX2 build has no flash attention over bf16 caches" in \
        " ".join(res.output.split()), res.output
    res = runner.invoke(app, [*flags, "--numerics", "ik", "--json"])
    assert res.exit_code == 0 and '"flash_attn": "off"' in res.stdout, res.output
    res = runner.invoke(app, [*flags, "-ctv", "bf16", "--numerics", "ik-avx2", "--flash-attn", "off"])
    assert res.exit_code == 2 and "AVX2 build's -fa off graph over a bf16 V cache is not reproduced" in \
        " ".join(res.output.split()), res.output
