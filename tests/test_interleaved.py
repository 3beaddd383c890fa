"""Row-interleaved types: files written with them decode to the values of their base type, in the runtime too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.tiny import CORPUS, TinySpec, make_tiny_checkpoint
from ikquant.cli import app as ikquant_app
from ikquant.errors import QuantInputError
from ikquant.formats.interleaved import InterleavedCodec
from ikquant.gguf_io import GGUFFile
from ikquant.types import all_types, type_by_name
from ikrun.cli import app

runner = CliRunner()


def test_groups_must_be_whole() -> None:
    with pytest.raises(QuantInputError, match="not a whole number of 8-row groups"):
        type_by_name("Q8_0_R8").require_codec().quantize(np.ones((12, 64), dtype=np.float32))


@pytest.mark.parametrize("base_type,interleaved", [("Q8_0", "Q8_0_R8"), ("Q4_0", "Q4_0_R8"), ("IQ4_NL", "IQ4_NL_R4"),
                                                   ("IQ2_K", "IQ2_K_R4"), ("IQ3_K", "IQ3_K_R4"), ("IQ4_K", "IQ4_K_R4"),
                                                   ("IQ4_KS", "IQ4_KS_R4"), ("IQ5_K", "IQ5_K_R4"), ("IQ5_KS", "IQ5_KS_R4"),
                                                   ("Q4_K", "Q4_K_R4"), ("Q6_K", "Q6_K_R4"), ("IQ4_XS", "IQ4_XS_R8"),
                                                   ("Q5_0", "Q5_0_R4"), ("Q6_0", "Q6_0_R4"), ("Q2_K", "Q2_K_R4"),
                                                   ("Q3_K", "Q3_K_R4"), ("Q5_K", "Q5_K_R4"), ("IQ3_XXS", "IQ3_XXS_R4"),
                                                   ("IQ3_S", "IQ3_S_R4"), ("Q8_KV", "Q8_KV_R8")])
def test_an_interleaved_file_evaluates_as_its_base_type(tmp_path: Path, base_type: str, interleaved: str) -> None:
    """The interleaved file (its file type, or --custom-q where iktools has no file type for it yet) gives the base
    type's KLD statistics, every digit."""
    from ikconvert.convert import Converter

    src = Converter(make_tiny_checkpoint(tmp_path / "hf", TinySpec(arch="qwen3", hidden=256, layers=2, heads=4,
                                                                   kv_heads=2, head_dim=64, ffn=512)),
                    "f32", "qwen2").write(tmp_path / "m.gguf")
    files = {}
    from ikquant.ftypes import all_file_types

    def how(t: str) -> list[str]:
        if any(f.name == t for f in all_file_types()):
            return ["--type", t, "--pure"]
        rules = f".*={t.lower()}" if t == base_type else rf"blk\..*={t.lower()},.*={base_type.lower()}"
        return ["--type", "Q8_0", "--custom-q", rules]  # without --pure, which would ignore --custom-q

    for t in (base_type, interleaved):
        files[t] = tmp_path / f"{t}.gguf"
        res = runner.invoke(ikquant_app, [str(src), str(files[t]), *how(t)])
        assert res.exit_code == 0, res.output
    grouped_file = GGUFFile(files[interleaved])
    assert grouped_file.tensors["blk.0.ffn_down.weight"].type.name == interleaved
    assert grouped_file.tensors["token_embd.weight"].type.name == base_type  # token embeddings are never interleaved
    base = tmp_path / "base.kld"
    args = ["--text", str(CORPUS), "--ctx", "64", "--chunks", "4"]
    assert runner.invoke(app, ["kld", str(src), "--base", str(src), *args, "--save-base-logits",
                               str(base)]).exit_code == 0
    stats = {}
    for t, path in files.items():
        res = runner.invoke(app, ["kld", str(path), "--base-logits", str(base), "--json"])
        assert res.exit_code == 0, res.output
        stats[t] = json.loads(res.stdout)
    assert stats[interleaved] == stats[base_type]
    # rows decoded alone (tiles of a head larger than the cache, lookups) come from their groups
    from ikrun.weights import WeightStore

    rows = np.array([17, 3, 5, 3, 200])
    plain, grouped = WeightStore(files[base_type]), WeightStore(files[interleaved])
    for name in ("output.weight", "blk.1.ffn_down.weight"):
        assert np.array_equal(grouped.decode_rows(name, rows), plain.decode_rows(name, rows))
        assert np.array_equal(grouped.decode(name), plain.decode(name))


@pytest.mark.parametrize("name", sorted(t.name for t in all_types() if isinstance(t.codec, InterleavedCodec)
                                         and t.codec.unpacks_to_base and t.codec.can_quantize))
def test_packing_moves_bits_and_unpacking_restores_them(name: str) -> None:
    """pack(base rows) decodes to the base rows' values (ik's zeros of d x code - offset x d are +0), and unpack
    gives back every byte; the scrambled sign groups and dropped code sums included."""
    codec = type_by_name(name).require_codec()
    assert isinstance(codec, InterleavedCodec)
    base = codec.base
    x = np.random.default_rng(7).standard_normal((2 * codec.group, 512)).astype(np.float32)
    w = np.random.default_rng(8).uniform(0.1, 2.0, 512).astype(np.float32)
    rows = base.quantize(x, w)
    packed = codec.pack(rows)
    assert packed.shape == (rows.shape[0], type_by_name(name).row_bytes(512))
    assert np.array_equal(codec.unpack(packed), rows)
    want = base.dequantize(rows, 512)
    want[want == 0] = 0.0
    got = codec.dequantize(packed, 512)
    got[got == 0] = 0.0
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_q8_k_forms_have_no_plain_form_to_unpack_to() -> None:
    """Q8_K_R8 / Q8_K_R16 regroup ik's 8-bit activation blocks, which no file type stores: --repack never makes
    them and --unpack keeps them (their fallback type Q8_0 is for tensors whose rows are no whole group)."""
    from ikquant.repack import interleaved_form

    for name in ("Q8_K_R8", "Q8_K_R16"):
        codec = type_by_name(name).require_codec()
        assert isinstance(codec, InterleavedCodec) and not codec.unpacks_to_base
    assert interleaved_form(type_by_name("Q8_0")) is type_by_name("Q8_0_R8")
    assert interleaved_form(type_by_name("Q8_KV")) is type_by_name("Q8_KV_R8")


def _awkward_rows() -> np.ndarray:
    """Several groups and blocks, an all-zero row and block, an outlier, and a row so small that the reciprocal of
    its scale overflows."""
    x = np.random.default_rng(7).standard_normal((32, 512)).astype(np.float32)
    x[0] = 0
    x[1, :256] = 0
    x[2, 300] = 90.0
    x[3] *= np.float32(1e-40)
    return x


@pytest.mark.parametrize("name", [t.name for t in all_types() if isinstance(t.codec, InterleavedCodec)
                                  and t.codec.quantizes_directly])
def test_direct_interleaved_quantizers_equal_quantize_then_regroup(name: str) -> None:
    """The 8-bit forms quantized straight into their layout give the bytes of their plain rows quantized and then
    regrouped, byte for byte."""
    codec = type_by_name(name).require_codec()
    assert isinstance(codec, InterleavedCodec)
    x = _awkward_rows()
    got = codec.quantize(x)
    want = np.empty_like(got)
    codec.quantize_then_regroup(x, np.empty(0, dtype=np.float32), want)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("name", [t.name for t in all_types() if isinstance(t.codec, InterleavedCodec)
                                  and t.codec.decodes_directly])
def test_direct_decoders_equal_regroup_then_decode(name: str) -> None:
    """The forms decoded straight from their layout give the floats of their rows regrouped and then decoded, bit
    for bit (signed zeros included)."""
    codec = type_by_name(name).require_codec()
    assert isinstance(codec, InterleavedCodec)
    q = codec.quantize(_awkward_rows())
    want = np.empty((q.shape[0], 512), np.float32)
    codec.regroup_then_decode(q, want)
    assert np.array_equal(codec.dequantize(q, 512).view(np.uint32), want.view(np.uint32))


def test_mxfp4_r8_rows_of_256_follow_the_layout() -> None:
    """ik's own MXFP4_R8 quantizer corrupts its heap on 256-value rows (its decoder overruns the group): the layout
    defines such a tensor all the same, as the base type's blocks regrouped."""
    x = np.random.default_rng(5).standard_normal((16, 256)).astype(np.float32)
    r8, base = type_by_name("MXFP4_R8").require_codec(), type_by_name("MXFP4").require_codec()
    assert np.array_equal(r8.dequantize(r8.quantize(x), 256), base.dequantize(base.quantize(x), 256))
