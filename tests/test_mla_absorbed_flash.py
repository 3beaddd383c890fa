"""DeepSeek's absorbed MLA form as ik's default run computes it (flash attention, mla 3, batches under 128 tokens):
the queries [q_rope | q_nope x attn_k_b] against the latent cache rows as one key head, their latent part as values
(tests/data/logits/deepseek-v3-absorbed-fa), in ggml's generic kernel (heads 128 / 64) and ik's own (576 / 512,
DeepSeek-V3's), in both builds' float orders; --flash-attn off keeps ik's -fa off graph."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.cli import app as ikconvert_app
from ikquant.cli import app as ikquant_app
from ikrun.cli import app
from ikrun.eval.evaluate import perplexity
from ikrun.eval.metrics import BaseLogitsFile
from ikrun.model import Model
from ikrun.options import RuntimeOptions
from tests.family_checks import assert_decoded_records, assert_iks_forward, iks_running_ppl, running_ppl
from tests.mla_real_heads import LATENT512, make_checkpoint
from tests.test_ik_avx2 import _matches
from tests.test_ik_flash_attention import real_heads  # noqa: F401  (the heads-192 DeepSeek-V3 files)

runner = CliRunner()
FOLDER = Path(__file__).parent / "data" / "logits" / "deepseek-v3-absorbed-fa"
TYPES = FOLDER.parent / "deepseek-v3-latent-types"
SHA256 = {"latent512": "ba92aed8a3b6645a2dc0f8ab3c2069516a43989f5deb553ca616de31a80aaacf",
          "q8_0": "e18856a6b83eeacd7230e8f04f2d71cb57f069882c9e8a332115ac5a20d15e42"}


@pytest.fixture(scope="module")
def models(real_heads: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # noqa: F811
    """The heads-192 F32 file, its Q8_0 quantization and the latent-512 F32 file, checked to be the bytes ik ran."""
    tmp = tmp_path_factory.mktemp("absorbed")
    latent512 = tmp / "latent512.gguf"
    res = runner.invoke(ikconvert_app, ["hf2gguf", str(make_checkpoint(tmp / "hf", LATENT512)), "--outtype", "f32",
                                        "--pre-tokenizer", "deepseek-v3", "--outfile", str(latent512)])
    assert res.exit_code == 0, res.output
    q8_0 = tmp / "q8_0.gguf"
    res = runner.invoke(ikquant_app, [str(real_heads["ik-f32.gguf"]), str(q8_0), "--type", "Q8_0"])
    assert res.exit_code == 0, res.output
    files = {"heads192": real_heads["ik-f32.gguf"], "latent512": latent512, "q8_0": q8_0}
    for name in SHA256:
        assert hashlib.sha256(files[name].read_bytes()).hexdigest() == SHA256[name], name
    return files


@pytest.mark.parametrize("model", ["heads192", "latent512"])
@pytest.mark.parametrize(("numerics", "build"), [("ik", "avx512"), ("ik-avx2", "avx2")])
def test_the_absorbed_form_is_iks_default_run(models: dict[str, Path], model: str, numerics: str, build: str,
                                             tmp_path: Path) -> None:
    """ik's base-logits file of its default run byte for byte, every running PPL (heads192 512.3806, latent512
    499.4681 on AVX-512); the report names the graph."""
    options = RuntimeOptions(numerics=numerics, ik_threads=1)
    assert Model(models[model], options=options).computed_paths(64) == {"mla_path": "decode", "flash_attn": "on"}
    assert_iks_forward(Model(models[model], options=options), FOLDER / f"{model}-{build}-base.kld",
                       FOLDER / f"{model}-{build}-base.txt", tmp_path / "base.kld")


def test_flash_attn_off_is_iks_other_graph(models: dict[str, Path], tmp_path: Path) -> None:
    """--flash-attn off: ik's -fa off graph (the absorbed form in its K x Q matmul; PPL 515.4670), not the default
    run's file."""
    base = FOLDER / "heads192-avx512-base.kld"
    res = perplexity(Model(models["heads192"], options=RuntimeOptions(numerics="ik", flash_attn="off")),
                     np.asarray(BaseLogitsFile(base).tokens), save_base=tmp_path / "off.kld")
    assert f"{np.exp(res.nll.astype(np.float64).mean()):.4f}" == "515.4670"
    assert (tmp_path / "off.kld").read_bytes() != base.read_bytes()


FA_OFF_BF16 = FOLDER.parent / "deepseek-v3-heads192-fa-off-bf16-{build}"
BUILDS = [("ik", "avx512"), ("ik-avx2", "avx2")]


@pytest.mark.parametrize(("numerics", "build"), BUILDS)
def test_flash_attn_off_is_iks_f16_run_byte_for_byte(models: dict[str, Path], numerics: str, build: str,
                                                     tmp_path: Path) -> None:
    """--flash-attn off over ik's f16 latent: its -fa off run's base-logits file byte for byte, every running PPL."""
    folder = Path(str(FA_OFF_BF16).format(build=build))
    assert_iks_forward(Model(models["heads192"], options=RuntimeOptions(numerics=numerics, flash_attn="off")),
                       folder / "fa-off-base.kld", folder / "fa-off-base.txt", tmp_path / "off.kld")


@pytest.mark.parametrize(("numerics", "build"), BUILDS)
def test_a_bf16_latent_without_flash_attention_is_iks(models: dict[str, Path], numerics: str, build: str,
                                                      tmp_path: Path) -> None:
    """-ctv bf16 --flash-attn off: ik's -fa off graph keeps the latent in -ctv's type; its AVX-512 build takes q . k
    and the latents' sum in its bf16 kernel (queries and probabilities rounded to bf16: PPL 521.5349, KLD 0.004056
    against its f16 run), its AVX2 build in its float kernel on unrounded activations (515.4729, 0.000008): each
    build's base-logits file byte for byte, every running PPL, and every KLD figure it printed."""
    folder = Path(str(FA_OFF_BF16).format(build=build))
    model = Model(models["heads192"], options=RuntimeOptions(numerics=numerics, flash_attn="off"),
                  cache_type_v="bf16")
    assert model.kv_cache == "k-bf16,v-bf16"
    assert_iks_forward(model, folder / "ctv-bf16-fa-off-base.kld", folder / "ctv-bf16-fa-off-base.txt",
                       tmp_path / "bf16.kld")
    res = runner.invoke(app, ["kld", str(models["heads192"]), "--base-logits", str(folder / "fa-off-base.kld"),
                              "--json", "--numerics", numerics, "--flash-attn", "off", "-ctv", "bf16"])
    assert res.exit_code == 0, res.output
    assert _matches(json.loads(res.stdout), folder / "ctv-bf16-fa-off-kld.txt")


def test_a_q8_0_file_costs_what_ik_prints(models: dict[str, Path]) -> None:
    """The Q8_0 file against ik's default F32 run: every figure ik printed (mean KLD 0.002122, PPL(Q) 511.330755)."""
    res = runner.invoke(app, ["kld", str(models["q8_0"]), "--base-logits", str(FOLDER / "heads192-avx512-base.kld"),
                              "--json", "--numerics", "ik", "--ik-threads", "1"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert got["flash_attn"] == "on" and _matches(got, FOLDER / "heads192-q8_0-avx512-kld.txt")


@pytest.mark.parametrize(("numerics", "build"), [("ik", "avx512"), ("ik-avx2", "avx2")])
def test_a_q8_0_latent_in_the_absorbed_form_is_iks(models: dict[str, Path], numerics: str, build: str,
                                                   tmp_path: Path) -> None:
    """-ctk q8_0 at DeepSeek-V3's 576 / 512 heads: ik's own kernel multiplies the Q8_0 cache rows with the queries
    in integers (repacked to Q8_0_R8) and sums their decoded latent part as values: its base-logits file byte for
    byte (PPL 500.1432), and against the F16 cache's run every figure ik printed (mean KLD 0.000413)."""
    model = Model(models["latent512"], options=RuntimeOptions(numerics=numerics, ik_threads=1), cache_type_k="q8_0")
    assert_iks_forward(model, FOLDER / f"latent512-ctk-q8_0-{build}-base.kld",
                       FOLDER / f"latent512-ctk-q8_0-{build}-base.txt", tmp_path / "base.kld")
    if numerics == "ik":
        res = runner.invoke(app, ["kld", str(models["latent512"]), "--base-logits",
                                  str(FOLDER / "latent512-avx512-base.kld"), "--json", "-ctk", "q8_0", "--numerics",
                                  "ik", "--ik-threads", "1"])
        assert res.exit_code == 0, res.output
        assert _matches(json.loads(res.stdout), FOLDER / "latent512-ctk-q8_0-avx512-kld.txt")


@pytest.mark.parametrize(("model", "flags", "says"), [
    # ik's AVX2 Q8_0 kernel over 4-block keys (AVX-512: tests/test_ik_flash_attention.py reproduces its run)
    ("heads192", ["--numerics", "ik-avx2", "-ctk", "q8_0"],
     "not in ggml's generic flash-attention kernel (heads 128/64)"),
    ("heads192", ["--numerics", "ik", "-ctk", "q4_0"], "not in ggml's generic flash-attention kernel (heads 128/64)"),
    # ik's -fa off graph keeps the latent in -ctv's type: its run with -ctk q8_0 writes its f16 run's base-logits
    # file byte for byte (PPL 515.4670 on heads192), and with -ctv q8_0 it stops
    ("latent512", ["--numerics", "ik", "-ctk", "q8_0", "--flash-attn", "off"],
     "in -ctv's type and never reads -ctk (its figures for -ctk q8_0 there are its f16 cache's)"),
    ("heads192", ["--numerics", "ik", "-ctv", "q8_0", "--flash-attn", "off"],
     "ik refuses a V cache other than f16 or bf16 without flash attention"),
    ("heads192", ["--numerics", "ik", "-ctv", "q8_0"], "in -ctk's type under flash attention (ik's default, which "
                                                        "ignores -ctv)"),
])
def test_a_quantized_latent_where_its_absorbed_form_is_not_reproduced_is_refused(models: dict[str, Path], model: str,
                                                                                 flags: list[str], says: str) -> None:
    res = runner.invoke(app, ["ppl", str(models[model]), "--text", str(FOLDER.parent / "deepseek-v3" / "text.txt"),
                              "--ctx", "64", "--chunks", "1", *flags])
    assert res.exit_code == 2 and says in " ".join(res.output.split()), res.output


@pytest.mark.parametrize("cache", ["q4_0", "q6_0", "iq4_nl"])
@pytest.mark.parametrize(("model", "form"), [("latent512", "decode"), ("kvb-q4_0", "prefill")])
@pytest.mark.parametrize(("numerics", "build"), [("ik", "avx512"), ("ik-avx2", "avx2")])
def test_other_latent_types_are_iks(models: dict[str, Path], real_heads: dict[str, Path],  # noqa: F811
                                    cache: str, model: str, form: str, numerics: str, build: str,
                                    tmp_path: Path) -> None:
    """A Q4_0, Q6_0 or IQ4_NL latent cache in both forms (key heads of 18 and 6 blocks: the type's kernel takes the
    whole 4-block groups, then each block past them): every running PPL ik printed, and its base-logits file byte
    for byte where stored (tests/data/logits/deepseek-v3-latent-types)."""
    path = models["latent512"] if model == "latent512" else real_heads["kvb-q4_0.gguf"]
    name = f"{model}-{form}-ctk-{cache}-{build}"
    printed = TYPES / f"{name}.txt"
    options = RuntimeOptions(numerics=numerics, ik_threads=1)
    if (TYPES / f"{name}.kld").exists():
        assert_iks_forward(Model(path, options=options, cache_type_k=cache), TYPES / f"{name}.kld", printed,
                           tmp_path / "base.kld")
        return
    tokens = np.asarray(BaseLogitsFile(FOLDER / "heads192-avx512-base.kld").tokens) if model == "latent512" else \
        np.asarray(BaseLogitsFile(TYPES / "kvb-q4_0-prefill-ctk-q6_0-avx512.kld").tokens)
    res = perplexity(Model(path, options=options, cache_type_k=cache), tokens)
    assert running_ppl(res.nll, res.n_chunk) == iks_running_ppl(printed)


@pytest.mark.parametrize(("threads", "cache", "numerics", "build"), [
    (2, "f16", "ik", "avx512"), (4, "q8_0", "ik", "avx512"), (2, "q8_0", "ik-avx2", "avx2")])
def test_one_token_batches_whose_keys_ik_splits(models: dict[str, Path], threads: int, cache: str, numerics: str,
                                                build: str) -> None:
    """Generation's one-token batches at DeepSeek-V3's 576 / 512 heads (one key head for all query heads), a
    256-token chunk, --ik-threads 2 (a part of the cache a thread over all heads) and 4 (4 parts over the heads the
    threads share): every record of ik's base-logits file bit for bit, the parts merged as ik merges them."""
    name = f"latent512-b1-c256-t{threads}{'' if cache == 'f16' else '-ctk-' + cache}-{build}-base.kld"
    assert_decoded_records(models["latent512"], FOLDER / name, numerics, threads, cache)
