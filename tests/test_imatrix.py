"""ikrun imatrix: ik's entries and conventions, an independent recomputation, file round trips, and its use."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.archs.base import arch_for
from ikconvert.checkpoint import Checkpoint
from ikquant.cli import app as ikquant_app
from ikquant.gguf_io import GGUFFile
from ikquant.imatrix import read_imatrix, read_imatrix_dat, write_imatrix_dat
from ikquant.quantize import quantize_rows
from ikquant.types import type_by_name
from ikrun.cli import app
from ikrun.eval.evaluate import collect_imatrix, tokenize_chunks
from ikrun.eval.imatrix import ImatrixCollector
from ikrun.model import Model
from ikrun.validate.hf import HFReference

runner = CliRunner()


def _collect(data_dir: Path, out: Path, *extra: str) -> None:
    res = runner.invoke(app, ["imatrix", str(data_dir / "convert" / "qwen3" / "ik-f32.gguf"), "--text",
                              str(data_dir / "logits" / "qwen3" / "text.txt"), "--ctx", "64", "-o", str(out), *extra])
    assert res.exit_code == 0, res.output


def test_matches_iks_llama_imatrix(data_dir: Path, tmp_path: Path) -> None:
    ours_path = tmp_path / "ours.dat"
    _collect(data_dir, ours_path)
    ik, ours = read_imatrix_dat(data_dir / "logits" / "qwen3" / "ik-imatrix.dat"), read_imatrix_dat(ours_path)
    assert set(ours.entries) == set(ik.entries)
    assert ours.chunks == ik.chunks == 60
    for name, entry in ik.entries.items():
        assert ours.entries[name].ncall == entry.ncall  # one call per 64-token chunk
        a, b = entry.mean_sq(), ours.entries[name].mean_sq()
        assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.01, name


def test_batches_are_iks_calls(data_dir: Path, tmp_path: Path) -> None:
    """--batch: each batch is one call of ik's llama-imatrix -b (ncall and the file's count are calls), and batches
    under its 16-row minimum collect nothing, said in a warning: against ik's own files."""
    ref = data_dir / "logits" / "batches"
    _collect(data_dir, tmp_path / "b32.dat", "--batch", "32", "--numerics", "ik", "--flash-attn", "off")
    ik, ours = read_imatrix_dat(ref / "qwen3-imatrix-c64-b32-avx512.dat"), read_imatrix_dat(tmp_path / "b32.dat")
    assert ours.chunks == ik.chunks == 120
    assert set(ours.entries) == set(ik.entries)
    for name, entry in ik.entries.items():
        assert ours.entries[name].ncall == entry.ncall == 120
        a, b = entry.mean_sq(), ours.entries[name].mean_sq()
        # ik sums 3840 rows in float32, the runtime in float64 (the activations are ik's own, --numerics ik)
        assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max(), name
    res = runner.invoke(app, ["imatrix", str(data_dir / "convert" / "qwen3" / "ik-f32.gguf"), "--text",
                              str(data_dir / "logits" / "qwen3" / "text.txt"), "--ctx", "64", "--batch", "8", "-o",
                              str(tmp_path / "b8.dat")])
    assert res.exit_code == 0, res.output
    assert "only routed experts can get data" in res.output and "the file holds no data" in res.output
    # ik's file and ours: no entries, a count of 0 (two int32), then the text's path as each was given it
    ik_bytes, ours_bytes = (ref / "qwen3-imatrix-c64-b8-avx512.dat").read_bytes(), (tmp_path / "b8.dat").read_bytes()
    assert ours_bytes[:8] == ik_bytes[:8] == bytes(8)
    text = str(data_dir / "logits" / "qwen3" / "text.txt").encode()
    assert ours_bytes[8:] == len(text).to_bytes(4, "little") + text


def test_equals_a_direct_computation_from_the_reference_activations(tiny_hf: Path, tiny_f32: Path) -> None:
    model = Model(tiny_f32)
    text = (Path(__file__).parents[1] / "ikconvert" / "data" / "tiny_corpus.txt").read_text(encoding="utf-8")
    chunks = tokenize_chunks(model, text, 64, 4)
    collector = ImatrixCollector()
    collect_imatrix(model, chunks, collector)
    ref = HFReference(tiny_hf)
    arch = arch_for(Checkpoint(tiny_hf))
    sums: dict[str, np.ndarray] = {}
    rows: dict[str, int] = {}

    def observe(hf_name: str, x: np.ndarray) -> None:
        name = arch.gguf_name(hf_name)
        x64 = x.reshape(-1, x.shape[-1]).astype(np.float64)
        sums[name] = sums.get(name, 0) + (x64**2).sum(axis=0)
        rows[name] = rows.get(name, 0) + x64.shape[0]

    add_bos, bos = model.tokenizer_flags()
    for c in chunks:
        fed = c.copy()
        if add_bos:
            fed[0] = bos
        ref.logits(fed, observe)
    assert set(sums) == set(collector.sums)
    for name in sums:
        assert collector.counts[name][0] == rows[name] == 4 * 64
        np.testing.assert_allclose(collector.sums[name][0], sums[name], rtol=2e-5, err_msg=name)
        assert collector.ncall[name] == 4


def test_files_round_trip(data_dir: Path, tmp_path: Path) -> None:
    dat, gguf = tmp_path / "i.dat", tmp_path / "i.gguf"
    _collect(data_dir, dat, "--chunks", "6")
    _collect(data_dir, gguf, "--chunks", "6")
    a = read_imatrix_dat(dat)
    again = tmp_path / "again.dat"
    write_imatrix_dat(again, a)
    assert again.read_bytes() == dat.read_bytes()
    b = read_imatrix(gguf)
    assert set(a.entries) == set(b.entries) and b.chunks == 6
    for name in a.entries:
        np.testing.assert_allclose(b.entries[name].mean_sq(), a.entries[name].mean_sq(), rtol=1e-6)


def test_merging_an_earlier_file(data_dir: Path, tmp_path: Path) -> None:
    first = tmp_path / "first.dat"
    _collect(data_dir, first, "--chunks", "10")
    merged = tmp_path / "merged.dat"
    _collect(data_dir, merged, "--chunks", "10", "--in-file", str(first))
    a, m = read_imatrix_dat(first), read_imatrix_dat(merged)
    for name, entry in a.entries.items():
        assert m.entries[name].ncall == 2 * entry.ncall
        np.testing.assert_allclose(m.entries[name].mean_sq(), entry.mean_sq(), rtol=1e-5)  # same data twice


def test_quantizing_with_it_lowers_the_kld(data_dir: Path, tmp_path: Path) -> None:
    imat = tmp_path / "i.dat"
    _collect(data_dir, imat)
    base = data_dir / "logits" / "qwen3" / "ik-base.kld"
    klds = []
    for extra in ([], ["--imatrix", str(imat)]):
        out = tmp_path / f"q{len(extra)}.gguf"
        res = runner.invoke(ikquant_app, [str(data_dir / "convert" / "qwen3" / "ik-f32.gguf"), str(out), "--type",
                                          "q4_0", "--pure", *extra])
        assert res.exit_code == 0, res.output
        res = runner.invoke(app, ["kld", str(out), "--base-logits", str(base), "--json"])
        klds.append(json.loads(res.stdout)["kld_mean"])
    assert klds[1] < klds[0]
    assert klds[0] == pytest.approx(0.0821, rel=0.05)


def test_mla_entries_serve_each_heads_rows(data_dir: Path, tmp_path: Path) -> None:
    """attn_k_b is stored 2-D (heads stacked) but multiplied per head: its entry holds one slice per head, which
    ikquant applies to that head's rows (ik's quantizer cannot use such entries at all)."""
    model = data_dir / "convert" / "deepseek-v3" / "ik-f32.gguf"
    imat = tmp_path / "ds.dat"
    res = runner.invoke(app, ["imatrix", str(model), "--text", str(data_dir / "logits" / "deepseek-v3" / "text.txt"),
                              "--ctx", "64", "--chunks", "4", "-o", str(imat)])
    assert res.exit_code == 0, res.output
    entry = read_imatrix_dat(imat).entries["blk.0.attn_k_b.weight"]
    info = GGUFFile(model).info("blk.0.attn_k_b.weight")
    heads = entry.values.size // info.n_per_row
    assert heads > 1 and info.n_rows % heads == 0
    out = tmp_path / "q.gguf"
    res = runner.invoke(ikquant_app, [str(model), str(out), "--type", "q4_0", "--pure", "--imatrix", str(imat),
                                      "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    plan = {p["name"]: p for p in json.loads(res.stdout)}
    assert plan["blk.0.attn_k_b.weight"]["imatrix"] == "blk.0.attn_k_b.weight"
    g = GGUFFile(model)
    q4 = type_by_name("Q4_0")
    with_heads = quantize_rows(g.raw(info.name), info, q4, q4.require_codec(), read_imatrix_dat(imat), 1)
    rows = g.dequantize(info.name).reshape(info.n_rows, -1)
    slices = entry.mean_sq().reshape(heads, -1)
    per_head = info.n_rows // heads
    for h in range(heads):
        one = q4.require_codec().quantize(rows[h * per_head : (h + 1) * per_head], slices[h])
        assert with_heads[h * per_head : (h + 1) * per_head].tobytes() == one.tobytes()
