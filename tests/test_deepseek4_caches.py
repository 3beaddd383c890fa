"""DeepSeek-V4's caches and its indexer's ties, against ik's runs at 256 tokens (HCA entries live, the indexer choosing
16 of up to 64 CSA entries): the key caches (-ctk f16, bf16, q8_0: the raw window's, CSA's and HCA's keys, which
its attention also reads as values), the indexer key cache (-ictk, keys Hadamard-rotated as ik writes them), what ik
refuses there, and under --numerics ik the order ik's fused top-k leaves among equal indexer scores and the attention
graph its report names."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ikquant.formats.cache_rows import cache_round_trip
from ikrun.cli import app
from ikrun.kvcache import blockwise_hadamard
from ikrun.model import Model
from ikrun.options import RuntimeOptions

runner = CliRunner()
DATA = Path(__file__).parent / "data"
GGUF = DATA / "convert" / "deepseek-v4-flash" / "ref-f32.gguf"
TEXT = DATA / "logits" / "deepseek-v4-flash" / "text.txt"
IK = DATA / "logits" / "deepseek-v4-flash-c256"
#: ik's runs: 4 chunks of 256 tokens (the README of IK)
RUN = ["--ctx", "256", "--chunks", "4"]


@pytest.fixture(scope="module")
def dequant(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ref-f32.gguf with its MXFP4 experts decoded to F32: the file ik's runs were made on (llama-quantize
    --allow-requantize ... F32 writes the same tensor bytes)."""
    from ikquant.ftypes import file_type
    from ikquant.quantize import QuantizeOptions, quantize_model

    out = tmp_path_factory.mktemp("ds4-caches") / "dequant.gguf"
    quantize_model(GGUF, out, QuantizeOptions(file_type("F32"), allow_requantize=True))
    return out


@pytest.fixture(scope="module")
def own_base(dequant: Path) -> Path:
    """The exact arithmetic's logits with ik's default caches (f16 keys and indexer keys), as a base file."""
    path = dequant.with_name("own-f16.kld")
    _kld(dequant, "--base", str(dequant), "--text", str(TEXT), *RUN, "-ctk", "f16", "--save-base-logits", str(path))
    return path


def _kld(model: Path, *flags: str) -> dict[str, Any]:
    res = runner.invoke(app, ["kld", str(model), "--json", *flags], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _printed_kld(name: str) -> float:
    m = re.search(r"Mean\s+KLD:\s*([\d.]+)", (IK / name).read_bytes().decode(errors="replace"))
    assert m is not None
    return float(m.group(1))


def test_numerics_ik_breaks_indexer_ties_as_iks_fused_top_k(dequant: Path) -> None:
    """Two indexer heads often score entries exactly 0 (every ReLU term 0): at 256 tokens the 16th and 17th best
    tie at a sixth of the positions. ik's fused top-k leaves std::partial_sort's order among them; under --numerics
    ik the run is ik's (torch.topk's order gave 4.0e-3 here); the exact arithmetic keeps transformers' order."""
    ik = _kld(dequant, "--base-logits", str(IK / "ik-base.kld"), "--numerics", "ik", "--flash-attn", "off")
    assert abs(ik["kld_mean"]) < 1e-6 and ik["same_top_p"] == 1.0, ik
    printed = re.search(r"n_ctx=256 = ([\d.]+)", (IK / "ik-base.txt").read_text(errors="replace"))
    assert printed is not None  # ik's attention, compressor and hyper-connections keep their own float orders
    assert ik["ppl_q"] == pytest.approx(float(printed.group(1)), rel=1e-6)
    exact = _kld(dequant, "--base-logits", str(IK / "ik-base.kld"), "-ctk", "f16")
    assert exact["kld_mean"] > 1e-3 and exact["same_top_p"] < 0.95, exact


def test_numerics_ik_computes_iks_default_flash_attention_graph(dequant: Path) -> None:
    """ik's default graph runs DeepSeek-V4's attention in flash attention: the raw-only layer in ggml's generic
    kernel (f16 value sums), the CSA and HCA layers in its own over the gathered visible keys. Under --numerics ik
    that is the run (a KLD of 1.27e-4 from its -fa off graph, which --flash-attn off computes), and the report says
    which; the exact arithmetic has one attention."""
    ik = _kld(dequant, "--base-logits", str(IK / "ik-fa-base.kld"), "--numerics", "ik", *RUN)
    assert ik["flash_attn"] == "on" and abs(ik["kld_mean"]) < 1e-6 and ik["same_top_p"] == 1.0, ik
    printed = re.search(r"n_ctx=256 = ([\d.]+)", (IK / "ik-fa-base.txt").read_text(errors="replace"))
    assert printed is not None
    assert ik["ppl_q"] == pytest.approx(float(printed.group(1)), rel=1e-5)
    off = _kld(dequant, "--base-logits", str(IK / "ik-fa-base.kld"), "--numerics", "ik", "--flash-attn", "off", *RUN)
    assert off["flash_attn"] == "off" and off["kld_mean"] > 1e-4, off
    assert Model(dequant, options=RuntimeOptions(numerics="ik")).computed_paths(256) == {"flash_attn": "on"}
    assert Model(dequant).computed_paths(256) == {}


def test_numerics_ik_q8_0_key_caches_are_iks_default_run(dequant: Path) -> None:
    """-ctk q8_0 (the raw, CSA and HCA key caches, which the attention also reads as values) in ik's default graph:
    ggml's generic kernel takes q . k from ik's Q8_0 kernel one row and one key at a time, ik's own kernel from its
    integer kernel over a token's heads as one call's rows; both the decoded rows as values, summed in float32.
    Against ik's f16 run, what ik prints to the digit."""
    ik = _kld(dequant, "--base-logits", str(IK / "ik-fa-base.kld"), "--numerics", "ik", "-ctk", "q8_0", *RUN)
    text = (IK / "ik-fa-ctk-q8_0-kld.txt").read_text(errors="replace")
    for key, label in (("kld_mean", r"Mean\s+KLD"), ("kld_max", "Maximum KLD"), ("kld_median", r"Median\s+KLD")):
        m = re.search(label + r":\s*([\d.]+)", text)
        assert m is not None and abs(ik[key] - float(m.group(1))) <= 5e-7, (key, ik[key], text[-400:])
    assert ik["cache_type_k"] == "q8_0" and abs(ik["same_top_p"] - 0.92520) < 5e-6, ik


def test_numerics_ik_bf16_key_caches_are_iks_default_run(dequant: Path) -> None:
    """-ctk bf16 in ik's default graph: ggml's generic kernel's q . k is ggml_vec_dot_bf16 (the query rounded to
    bf16, vdpbf16ps lanes), ik's own kernel's its bf16 kernel's, in its own key blocks; the values summed in float32.
    Against ik's bf16 run as a base, the run's level of agreement (-fa on f16: -5.1e-8)."""
    ik = _kld(dequant, "--base-logits", str(IK / "ik-fa-ctk-bf16.kld"), "--numerics", "ik", "-ctk", "bf16", *RUN)
    assert ik["cache_type_k"] == "bf16" and abs(ik["kld_mean"]) < 1e-6 and ik["same_top_p"] == 1.0, ik
    assert ik["kld_max"] < 2e-5, ik


def test_numerics_ik_flash_attention_in_batches(dequant: Path) -> None:
    """Fed 64 tokens at a time (chunks of 128): the HCA layer's first batch has no entry (the raw-only graph, the
    generic kernel), its second one entry (ik's own kernel); the second batch's queries see the first's rows."""
    ik = _kld(dequant, "--base-logits", str(IK / "ik-fa-c128-b64.kld"), "--numerics", "ik", "--ctx", "128",
              "--chunks", "8", "--batch", "64")
    assert abs(ik["kld_mean"]) < 1e-6 and ik["same_top_p"] == 1.0, ik


@pytest.mark.parametrize(("ctk", "printed"), [("q8_0", "ik-ctk-q8_0-kld.txt"), ("bf16", "ik-ctk-bf16-kld.txt")])
def test_a_key_cache_type_prices_its_rounding_alone(dequant: Path, own_base: Path, ctk: str, printed: str) -> None:
    """Against the exact arithmetic's own run with ik's default caches, a q8_0 or bf16 key cache costs its rounding
    alone, below ik's printed figure against its default-cache run (ik's K x Q products also round the queries to
    the cache's dot type: 8-bit blocks, bf16)."""
    ours = _kld(dequant, "--base-logits", str(own_base), "-ctk", ctk)
    assert ours["cache_type_k"] == ctk
    assert 0 < ours["kld_mean"] < _printed_kld(printed), (ours["kld_mean"], _printed_kld(printed))


def test_the_indexer_cache_holds_rotated_keys(dequant: Path) -> None:
    """ik rotates the indexer's keys (and queries) by its Hadamard transform over the 32-value key before writing
    them to the cache: the keys scored are H(cache(H k)); an f32 cache (the weights alone) holds them as they are.
    A q8_0 indexer cache moves the logits at 256 tokens."""
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((9, 32)).astype(np.float32)
    q8 = Model(dequant, indexer_cache_type_k="q8_0")
    assert (q8.cache.k, q8.cache.indexer) == ("f32", "q8_0")
    want = blockwise_hadamard(cache_round_trip("Q8_0", blockwise_hadamard(keys, 32)), 32)
    np.testing.assert_array_equal(q8.ctx.indexer_store(keys, 32), want)
    assert not np.allclose(want, keys, atol=1e-3)
    plain = Model(dequant)
    assert plain.cache.indexer == "f32" and plain.ctx.indexer_store(keys, 32) is keys
    tokens = np.array(plain.tokenizer().encode(TEXT.read_text()), dtype=np.int64)[:256]
    assert not np.array_equal(q8.logits(tokens), plain.logits(tokens))


def _refused(flags: list[str], *named: str) -> None:
    res = runner.invoke(app, ["ppl", str(GGUF), "--text", str(TEXT), "--ctx", "64", "--chunks", "1", *flags],
                        env={"COLUMNS": "250"})
    assert res.exit_code == 2, res.output
    line = " ".join(res.output.split())
    assert "Traceback" not in line
    for text in named:
        assert text in line, res.output


@pytest.mark.parametrize(("flags", "named"), [
    (["-ctk", "q4_0"], ("--cache-type-k q4_0", "deepseek4", "f16, bf16, q8_0 only")),
    (["-ctv", "q8_0"], ("--cache-type-v q8_0", "reads its values from its key cache")),
    (["-ctk", "q8_0", "-khad"], ("--k-cache-hadamard", "untransformed")),
    (["-ictk", "q4_0"], ("--indexer-cache-type-k q4_0", "f16, bf16, q8_0 only")),
    (["--numerics", "ik", "-ctk", "q8_0", "--flash-attn", "off"],
     ("--cache-type-k q8_0", "not a q8_0 key cache on deepseek4")),
    (["--numerics", "ik", "-ctk", "bf16", "--flash-attn", "off"],
     ("--cache-type-k bf16", "not a bf16 key cache on deepseek4")),
    (["--numerics", "ik-avx2", "-ctk", "bf16"], ("--cache-type-k bf16", "AVX512BF16")),
    (["--numerics", "ik", "-ictk", "q8_0"], ("--indexer-cache-type-k q8_0", "f16 indexer key cache", "only")),
])
def test_caches_ik_refuses_or_ikrun_cannot_reproduce_are_refused(flags: list[str], named: tuple[str, ...]) -> None:
    _refused(flags, *named)
