"""`--flash-attn`: ik's default attention graph (flash attention over its F16 caches) for grouped-query attention,
against ik's default runs on a native AVX2 ik (tests/data/logits/gqa-fa-avx2): its own iqk kernel for qwen3 heads of
64 and 128, ggml's generic one for the test models' heads of 32; the -fa off graph misses those runs; the option
refused where it means nothing or is not reproduced."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ikrun.cli import app
from ikrun.eval.evaluate import perplexity
from ikrun.eval.metrics import BaseLogitsFile
from ikrun.model import Model
from ikrun.options import RuntimeOptions
from tests.family_checks import assert_iks_forward
from tests.test_numerics import _printed

runner = CliRunner()
DATA = Path(__file__).parent / "data"
FOLDER = DATA / "logits" / "gqa-fa-avx2"
CONVERT = DATA / "convert"
#: the tiny qwen3 files with heads of 64 and 128 ik ran (FOLDER's README), made again by the tests
SHA256 = {"h64-f32.gguf": "4c53d97fdd43922d56d7c92533b402a525ce18d5290b3a2f3c6ee4f0fd5bee18",
          "h64-q8_0.gguf": "187b94fa9c36e0902626592fec7ed1fe02edc50829a7238d02bbaf5e5caf87cd",
          "h128-f32.gguf": "6f563261b5451240c370b4c815f0024d28d04037f60fcdd66a9b9bf5fcf63cd6",
          "h128-q8_0.gguf": "31a4bc8e2cc864b77b2c885d5ec31e5237481344daa29bfac65c73eefb94d0bd"}


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The qwen3 files with heads of 64 and 128 (tests/gqa_heads.py), checked to be the very bytes ik ran; the
    head-32 ones are the qwen3 test model's."""
    from ikconvert.cli import app as ikconvert_app
    from ikquant.cli import app as ikquant_app
    from tests.gqa_heads import make_checkpoint

    tmp = tmp_path_factory.mktemp("gqa-heads")
    files = {"h32-f32.gguf": CONVERT / "qwen3" / "ik-f32.gguf", "h32-q8_0.gguf": CONVERT / "qwen3" / "ik-q8_0.gguf"}
    for head in (64, 128):
        f32, q8 = tmp / f"h{head}-f32.gguf", tmp / f"h{head}-q8_0.gguf"
        hf = make_checkpoint(tmp / f"hf{head}", head)
        res = runner.invoke(ikconvert_app, ["hf2gguf", str(hf), "--outtype", "f32", "--pre-tokenizer", "qwen2",
                                            "--outfile", str(f32)])
        assert res.exit_code == 0, res.output
        res = runner.invoke(ikquant_app, [str(f32), str(q8), "--type", "Q8_0"])
        assert res.exit_code == 0, res.output
        for path in (f32, q8):
            assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA256[path.name], path.name
            files[path.name] = path
    return files


@pytest.mark.parametrize("head", [32, 64, 128])
def test_ik_avx2_is_iks_default_run_on_qwen3(heads: dict[str, Path], head: int, tmp_path: Path) -> None:
    """ik's default run (-fa on) of the F32 files: its base-logits file byte for byte with every running PPL (heads
    of 32: PPL 542.5599, ggml's generic kernel; 64: 802.5446 and 128: 826.4532, ik's own kernel), and --flash-attn
    off (the -fa off graph the code before computed: PPL(Q) 542.526625, 802.544418, 826.453246 where ours is
    542.559850, 802.544555, 826.453235) misses it."""
    base, printed = FOLDER / f"qwen3-h{head}-base.kld", FOLDER / f"qwen3-h{head}-base.txt"
    model = heads[f"h{head}-f32.gguf"]
    assert_iks_forward(Model(model, options=RuntimeOptions(numerics="ik-avx2")), base, printed, tmp_path / "fa.kld")
    perplexity(Model(model, options=RuntimeOptions(numerics="ik-avx2", flash_attn="off")),
               np.asarray(BaseLogitsFile(base).tokens), save_base=tmp_path / "off.kld")
    assert (tmp_path / "off.kld").read_bytes() != base.read_bytes()


@pytest.mark.parametrize(("folder", "gguf"), [("qwen3-moe", "ik-f32"), ("glm4-moe", "ik-f32"),
                                              ("minimax-m2", "ref-f32")])
def test_ik_avx2_is_iks_default_run_on_the_other_gqa_models(folder: str, gguf: str, tmp_path: Path) -> None:
    """qwen3moe (PPL 525.0891), glm4moe (590.5937) and minimax-m2 (508.5057), heads of 32: ik's default run byte for
    byte."""
    assert_iks_forward(Model(CONVERT / folder / f"{gguf}.gguf", options=RuntimeOptions(numerics="ik-avx2")),
                       FOLDER / f"{folder}-base.kld", FOLDER / f"{folder}-base.txt", tmp_path / "fa.kld")


def _kld(model: Path, base: Path, *flags: str) -> dict[str, Any]:
    res = runner.invoke(app, ["kld", str(model), "--base-logits", str(base), "--json", "--numerics", "ik-avx2",
                              "--ik-threads", "2", *flags])
    assert res.exit_code == 0, res.output
    return dict(json.loads(res.stdout))


@pytest.mark.parametrize("head", [32, 64, 128])
def test_ik_avx2_q8_0_kld_is_what_ik_prints_by_default(heads: dict[str, Path], head: int) -> None:
    """The Q8_0 files against ik's default base, ik -t 2: every figure ik printed, to the digit (heads of 32: KLD
    0.000593, PPL(Q) 542.137622; 64: 0.000135, 801.803106; 128: 0.000130, 825.829748); the report names the graph.
    The -fa off graph prints KLD 0.000578, PPL(Q) 542.179591; 0.000135, 801.869124; 0.000130, 825.796080."""
    got = _kld(heads[f"h{head}-q8_0.gguf"], FOLDER / f"qwen3-h{head}-base.kld")
    assert got["flash_attn"] == "on"
    for key, value in _printed(FOLDER / f"qwen3-h{head}-q8_0-kld.txt").items():
        assert abs(got[key] - value) <= (5.01e-6 if key == "same_top_p" else 5.01e-7), key


def test_the_report_names_the_attention_graph() -> None:
    """auto is on over F16 caches and Hadamard-rotated q4_0 ones, off over an F32 key cache (whose flash attention
    is not ported); the console line says which."""
    base = FOLDER / "qwen3-h32-base.kld"
    assert _kld(CONVERT / "qwen3" / "ik-q8_0.gguf", base, "-ctk", "q4_0", "-khad")["flash_attn"] == "on"
    assert _kld(CONVERT / "qwen3" / "ik-q8_0.gguf", base, "-ctk", "f32")["flash_attn"] == "off"
    res = runner.invoke(app, ["kld", str(CONVERT / "qwen3" / "ik-q8_0.gguf"), "--base-logits", str(base),
                              "--numerics", "ik-avx2", "--ik-threads", "2"])
    assert res.exit_code == 0 and "flash attention on" in " ".join(res.output.split()), res.output


@pytest.mark.parametrize(("gguf", "flags", "says"), [
    (CONVERT / "qwen3" / "ik-f32.gguf", ["--flash-attn", "on"], "only --numerics ik / ik-avx2 compute"),
    (CONVERT / "qwen3" / "ik-f32.gguf", ["--flash-attn", "off"], "only --numerics ik / ik-avx2 compute"),
    (CONVERT / "qwen3" / "ik-f32.gguf", ["--flash-attn", "maybe", "--numerics", "ik-avx2"], "maybe"),
    (CONVERT / "qwen3" / "ik-f32.gguf", ["--flash-attn", "on", "--numerics", "ik", "-ctk", "q5_0"],
     "q8_0 / q4_0 / q6_0 / iq4_nl / q4_1 key caches, not a q5_0 key cache (give --flash-attn off"),
    (CONVERT / "qwen3" / "ik-f32.gguf", ["--flash-attn", "on", "--numerics", "ik", "-ctk", "f32"],
     "not a f32 key cache"),
    (CONVERT / "glm-dsa" / "ref-f32.gguf", ["--flash-attn", "on", "--numerics", "ik-avx2"],
     "--flash-attn applies only to"),
    (CONVERT / "deepseek-v3" / "ik-f32.gguf", ["--flash-attn", "off", "--numerics", "ik", "--mla", "prefill"],
     "--mla prefill is ik's flash-attention graph's form"),
    (CONVERT / "gpt-oss" / "ref-f32.gguf", ["--flash-attn", "on", "--numerics", "ik"],
     "reproduces ik's flash attention on qwen3, qwen3moe, glm4moe, minimax-m2, not gpt-oss"),
])
def test_flash_attn_where_it_means_nothing_or_is_not_reproduced_is_refused(gguf: Path, flags: list[str],
                                                                           says: str) -> None:
    res = runner.invoke(app, ["logits", str(gguf), "--tokens", "1,2", *flags])
    assert res.exit_code == 2 and says in " ".join(res.output.split()), res.output


def test_a_one_token_batch_whose_keys_ik_splits_runs(heads: dict[str, Path]) -> None:
    """One token over grouped heads of 64: with more ik threads than key/value heads ik's kernel splits its keys
    (ikrun/numerics/ik/arithmetic.split_parts; checked bit for bit in tests/test_flash_attention_small_batches.py),
    with as many it computes the whole rows; both run."""
    flags = ["logits", str(heads["h64-f32.gguf"]), "--tokens", "1", "--numerics", "ik-avx2", "--ik-threads"]
    assert runner.invoke(app, [*flags, "4"]).exit_code == 0
    assert runner.invoke(app, [*flags, "2"]).exit_code == 0