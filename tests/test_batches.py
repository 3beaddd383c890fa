"""`ikrun ppl / kld --batch N` (ik's `-b`): each chunk fed N tokens at a time through its key/value cache. Against
ik's own runs in batches (tests/data/logits/batches): every base-logits file byte for byte and ik's final line, over
grouped-query caches (f16, q4_0, q8_0 keys; batches of 3, 4 and 100) and DeepSeek's latent cache (batches of 64: the
absorbed MLA form; of 192: the prefill form, then the absorbed one for the last 64 tokens)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ikconvert.convert import Converter
from ikrun.cli import app

runner = CliRunner()
FOLDER = Path(__file__).parent / "data" / "logits" / "batches"
LOGITS = FOLDER.parent
SHA256 = {"h64": "4c53d97fdd43922d56d7c92533b402a525ce18d5290b3a2f3c6ee4f0fd5bee18",
          "latent512": "ba92aed8a3b6645a2dc0f8ab3c2069516a43989f5deb553ca616de31a80aaacf"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The head-64 qwen3 and the latent-512 DeepSeek-V3 files ik ran, made again and checked to be its bytes."""
    from tests.gqa_heads import make_checkpoint as gqa_checkpoint
    from tests.mla_real_heads import make_checkpoint as mla_checkpoint
    from tests.test_mla_absorbed_flash import LATENT512

    tmp = tmp_path_factory.mktemp("batches")
    files = {"h64": Converter(gqa_checkpoint(tmp / "hf64", 64), "f32", pre_tokenizer="qwen2").write(tmp / "h64.gguf"),
             "latent512": Converter(mla_checkpoint(tmp / "l512" / "hf", LATENT512), "f32",
                                    pre_tokenizer="deepseek-v3").write(tmp / "latent512.gguf")}
    for name, path in files.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA256[name], name
    return files


def _final_line(log: Path) -> str:
    return next(line for line in log.read_text(errors="replace").splitlines() if line.startswith("Final estimate"))


@pytest.mark.parametrize(("name", "model", "text", "ctx", "chunks", "batch", "cache", "build"), [
    ("qwen3-h64-c8-b3-ctk-q4_0", "h64", "qwen3", 8, 4, 3, "q4_0", "avx512"),
    ("qwen3-h64-c8-b3-ctk-q4_0", "h64", "qwen3", 8, 4, 3, "q4_0", "avx2"),
    ("qwen3-h64-c8-b3-ctk-f16", "h64", "qwen3", 8, 4, 3, "f16", "avx512"),
    ("qwen3-h64-c8-b4-ctk-q8_0", "h64", "qwen3", 8, 4, 4, "q8_0", "avx512"),
    ("qwen3-h64-c256-b100-ctk-q8_0", "h64", "qwen3", 256, 2, 100, "q8_0", "avx512"),
    ("latent512-c256-b64", "latent512", "deepseek-v3", 256, 1, 64, "f16", "avx512"),
    ("latent512-c256-b192", "latent512", "deepseek-v3", 256, 1, 192, "f16", "avx512"),
    ("latent512-c256-b192", "latent512", "deepseek-v3", 256, 1, 192, "f16", "avx2")])
def test_batches_are_iks(models: dict[str, Path], name: str, model: str, text: str, ctx: int, chunks: int,
                         batch: int, cache: str, build: str, tmp_path: Path) -> None:
    """ik's run with -b `batch`: its base-logits file byte for byte and its final line to the digit."""
    out = tmp_path / "base.kld"
    res = runner.invoke(app, ["ppl", str(models[model]), "--text", str(LOGITS / text / "text.txt"), "-c", str(ctx),
                              "--chunks", str(chunks), "--batch", str(batch), "-ctk", cache, "--numerics",
                              "ik" if build == "avx512" else "ik-avx2", "--ik-threads", "2", "--save-base-logits",
                              str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert out.read_bytes() == (FOLDER / f"{name}-{build}.kld").read_bytes()
    assert _final_line(FOLDER / f"{name}-{build}.txt") in res.stdout
    assert f"batches of {batch} tokens" in res.stdout


def test_the_report_names_each_batch_size_s_mla_form(models: dict[str, Path]) -> None:
    """A 256-token chunk in batches of 192 runs the prefill form, then the absorbed one for its last 64 tokens; the
    JSON report says so, and the batch size; without --batch the chunk is one batch in the prefill form."""
    flags = ["--text", str(LOGITS / "deepseek-v3" / "text.txt"), "-c", "256", "--chunks", "1", "--json"]
    res = runner.invoke(app, ["ppl", str(models["latent512"]), *flags, "--batch", "192"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["mla_path"] == "prefill (192-token batches) + decode (64-token batches)" and report["batch"] == 192
    whole = json.loads(runner.invoke(app, ["ppl", str(models["latent512"]), *flags]).stdout)
    assert whole["mla_path"] == "prefill" and "batch" not in whole


def test_the_exact_arithmetic_in_batches_is_the_whole_chunk_s(models: dict[str, Path]) -> None:
    """The model's semantics do not depend on how a chunk is fed: the same PPL in batches of 3 as whole (to float32
    rounding: the cache holds the same keys), and a --batch of the chunk or more is the chunk whole."""
    flags = ["--text", str(LOGITS / "qwen3" / "text.txt"), "-c", "8", "--chunks", "4", "--json"]

    def ppl(*extra: str) -> float:
        res = runner.invoke(app, ["ppl", str(models["h64"]), *flags, *extra])
        assert res.exit_code == 0, res.output
        return float(json.loads(res.stdout)["ppl"])

    whole = ppl()
    assert ppl("--batch", "3") == pytest.approx(whole, rel=1e-5)
    assert ppl("--batch", "8") == whole


@pytest.mark.parametrize(("flags", "why"), [
    (["--batch", "0"], "--batch 0: give 1 token or more"),
    (["--batch", "4", "--stream"], "--batch 4 feeds each chunk through its cache in turn, chunk by chunk: not with "
                                   "--stream")])
def test_bad_batches_are_refused(models: dict[str, Path], flags: list[str], why: str, tmp_path: Path) -> None:
    for command in (["ppl"], ["kld", "--base", str(models["h64"])]):
        out = tmp_path / "base.kld"
        res = runner.invoke(app, [*command, str(models["h64"]), "--text", str(LOGITS / "qwen3" / "text.txt"),
                                  "-c", "8", *flags, "--save-base-logits", str(out)])
        assert res.exit_code == 2 and why in " ".join(res.output.split()), res.output
        assert not out.exists()


def test_a_model_without_a_cache_to_continue_runs_chunks_whole(tmp_path: Path) -> None:
    """openPangu's forward keeps no key/value cache a batch could continue through: --batch below the chunk is
    refused in one line, before any compute; a --batch of the chunk is the chunk whole."""
    model = LOGITS.parent / "convert" / "openpangu-v2" / "ik-f32.gguf"
    flags = ["ppl", str(model), "--text", str(LOGITS / "qwen3" / "text.txt"), "-c", "8", "--chunks", "1"]
    res = runner.invoke(app, [*flags, "--batch", "4"])
    assert res.exit_code == 2 and "--batch 4: openpangu runs each chunk whole here" in \
        " ".join(res.output.split()), res.output
    assert runner.invoke(app, [*flags, "--batch", "8"]).exit_code == 0
