"""openPangu's latent cache in q8_0 (-ctk q8_0), against ik's runs of a variant of the tiny model whose key heads
ik's cache takes (tests/data/logits/openpangu-v2-rope32): ik writes the rows [latent | rope] blockwise and decodes
them to F32 for its unfused chain; what ik refuses or aborts on is refused."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.cli import app as convert_app
from ikconvert.safetensors_io import SafetensorsFile
from ikrun.cli import app
from ikrun.model import Model
from ikrun.options import RuntimeOptions
from tests.family_checks import assert_iks_forward, hf_variant, kld_json

runner = CliRunner()
DATA = Path(__file__).parent / "data"
HF = DATA / "convert" / "openpangu-v2" / "hf"
IK = DATA / "logits" / "openpangu-v2-rope32"
TEXT = DATA / "logits" / "openpangu-v2" / "text.txt"
RUN = ["--ctx", "64", "--chunks", "8"]
#: the file ik's runs were made on (IK's README)
SHA256 = "0aded88bf1156695d9cbf97dca99ad19361f17383fac60881c442af99bbe4c55"


def rope_variant(src: Path, folder: Path, rope: int, seed: int = 0) -> Path:
    """Checkpoint `src` under folder/hf with `rope` rope dims: the rope rows of kv_a_proj_with_mqa, of each head of q_b_proj and
    param_sink_k_pe drawn anew (gaussian, at the scale of the rows they replace), the rest as it was."""
    cfg = json.loads((src / "config.json").read_text())
    old, nope, lora, heads = (cfg[k] for k in ("qk_rope_head_dim", "qk_nope_head_dim", "kv_lora_rank",
                                                "num_attention_heads"))
    rng = np.random.default_rng(seed)
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, t in SafetensorsFile(path).tensors.items():
            raw = t.raw()
            x = t.to_f32()
            if name.endswith("kv_a_proj_with_mqa.weight"):
                new = np.concatenate([x[:lora], rng.standard_normal((rope, x.shape[1])) * x[lora:].std()])
            elif name.endswith("q_b_proj.weight"):
                h = x.reshape(heads, nope + old, -1)
                fresh = rng.standard_normal((heads, rope, h.shape[2])) * h[:, nope:].std()
                new = np.concatenate([h[:, :nope], fresh], axis=1).reshape(heads * (nope + rope), -1)
            elif name.endswith("param_sink_k_pe"):
                new = rng.standard_normal((x.shape[0], rope)) * x.std()
            else:
                tensors[name] = (t.dtype, raw)
                continue
            assert t.dtype == "BF16"
            tensors[name] = (t.dtype, (new.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16))
    return hf_variant(src, folder, {"qk_rope_head_dim": rope}, tensors)


@pytest.fixture(scope="module")
def rope32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The variant ik's runs were made on, converted as they were (byte for byte: its sha256)."""
    folder = tmp_path_factory.mktemp("openpangu-rope32")
    out = folder / "op32.gguf"
    res = runner.invoke(convert_app, ["hf2gguf", str(rope_variant(HF, folder, 32)), "--outtype", "f32",
                                      "--pre-tokenizer", "openpangu", "--outfile", str(out)])
    assert res.exit_code == 0, res.output
    assert hashlib.sha256(out.read_bytes()).hexdigest() == SHA256
    return out


def _printed(name: str) -> dict[str, float]:
    text = (IK / name).read_text(errors="replace")
    grab = {"ppl_q": r"Mean PPL\(Q\)\s*:\s*([\d.]+)", "kld_mean": r"Mean\s+KLD:\s*([\d.]+)",
            "kld_max": r"Maximum KLD:\s*([\d.]+)"}
    return {k: float(re.search(p, text).group(1)) for k, p in grab.items()}  # type: ignore[union-attr]


def test_numerics_ik_q8_0_latent_cache_is_iks_run(rope32: Path, tmp_path: Path) -> None:
    """ik's q8_0 run byte for byte (its base-logits file), and against its f16 run the figures it prints."""
    out = tmp_path / "ours.kld"
    res = runner.invoke(app, ["kld", str(rope32), "--base", str(rope32), "--save-base-logits", str(out), "--text",
                              str(TEXT), *RUN, "--numerics", "ik", "--ik-sink-overread", "-ctk", "q8_0"])
    assert res.exit_code == 0, res.output
    assert out.read_bytes() == (IK / "ik-ctk-q8_0.kld").read_bytes()
    got = kld_json(rope32, IK / "ik-base.kld", "--numerics", "ik", "--ik-sink-overread", "-ctk", "q8_0")
    ik = _printed("ik-ctk-q8_0-kld.txt")
    assert got["cache_type_k"] == "q8_0" and got["ppl_q"] == pytest.approx(ik["ppl_q"], abs=5e-7 * ik["ppl_q"])
    assert abs(got["kld_mean"] - ik["kld_mean"]) <= 5e-7 and abs(got["kld_max"] - ik["kld_max"]) <= 5e-7, (got, ik)
    f16 = kld_json(rope32, IK / "ik-base.kld", "--numerics", "ik", "--ik-sink-overread")
    assert abs(f16["kld_mean"]) < 1e-6 and f16["same_top_p"] == 1.0, f16


def test_ik_avx2_q8_0_latent_cache_is_iks_avx2_run(rope32: Path, tmp_path: Path) -> None:
    """ik's AVX2 build (no sink over-read there): its f16 and q8_0 runs byte for byte (base-logits files, every
    running PPL: 511.2681, 510.7741), and the q8_0 run against the f16 one the figures it prints (KLD 0.001165)."""
    for cache, name in (("f16", "ik-avx2-base"), ("q8_0", "ik-avx2-ctk-q8_0")):
        model = Model(rope32, options=RuntimeOptions(numerics="ik-avx2"), cache_type_k=cache)
        assert_iks_forward(model, IK / f"{name}.kld", IK / f"{name}.txt", tmp_path / f"{cache}.kld")
    got = kld_json(rope32, IK / "ik-avx2-base.kld", "--numerics", "ik-avx2", "-ctk", "q8_0")
    ik = _printed("ik-avx2-ctk-q8_0-kld.txt")
    assert got["cache_type_k"] == "q8_0" and got["ppl_q"] == pytest.approx(ik["ppl_q"], abs=5e-7 * ik["ppl_q"])
    assert abs(got["kld_mean"] - ik["kld_mean"]) <= 5e-7 and abs(got["kld_max"] - ik["kld_max"]) <= 5e-7, (got, ik)


def test_exact_q8_0_latent_cache_costs_its_rounding(rope32: Path, tmp_path: Path) -> None:
    """The exact arithmetic rounds the rows through q8_0 as ik writes them: against its own run with ik's default
    f16 cache, a q8_0 cache costs more than an f32 one (ik's figures carry its sink over-read, which only --numerics
    ik reproduces: this arithmetic is 0.21 from them)."""
    own = tmp_path / "own-f16.kld"
    res = runner.invoke(app, ["kld", str(rope32), "--base", str(rope32), "--save-base-logits", str(own), "--text",
                              str(TEXT), *RUN, "-ctk", "f16"])
    assert res.exit_code == 0, res.output
    q8: dict[str, Any] = kld_json(rope32, own, "-ctk", "q8_0")
    f32: dict[str, Any] = kld_json(rope32, own, "-ctk", "f32")
    assert q8["cache_type_k"] == "q8_0" and 0 < f32["kld_mean"] < q8["kld_mean"], (q8, f32)


@pytest.mark.parametrize(("model", "flags", "named"), [
    ("tiny", ["-ctk", "q8_0"], ("--cache-type-k q8_0", "key head size", "48", "ik aborts")),
    ("rope32", ["-ctk", "q4_0"], ("--cache-type-k q4_0", "f32, f16, q8_0 only")),
    ("rope32", ["-ctk", "q8_0", "-ctv", "q8_0"], ("--cache-type-v q8_0", "latent alone")),
    ("rope32", ["-ctk", "q8_0", "-khad"], ("--k-cache-hadamard", "untransformed")),
])
def test_latent_caches_ik_refuses_are_refused(rope32: Path, model: str, flags: list[str],
                                               named: tuple[str, ...]) -> None:
    path = DATA / "convert" / "openpangu-v2" / "ik-f32.gguf" if model == "tiny" else rope32
    for arithmetic in ("exact", "ik"):
        res = runner.invoke(app, ["ppl", str(path), "--text", str(TEXT), "--ctx", "64", "--chunks", "1",
                                  "--numerics", arithmetic, *flags], env={"COLUMNS": "250"})
        line = " ".join(res.output.split())
        assert res.exit_code == 2 and "Traceback" not in line, res.output
        for text in named:
            assert text in line, res.output
