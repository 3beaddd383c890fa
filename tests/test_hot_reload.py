"""Tensor hot-swap and reload of changed files: exact results, and refusals that change nothing."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from ikquant.gguf_io import GGUFFile, GGUFStreamWriter
from ikquant.types import type_by_name
from ikrun.errors import SwapError
from ikrun.model import Model

TOKENS = np.arange(5, 69)


def _copy_with(src: Path, dst: Path, replace: dict[str, tuple[str, np.ndarray]] | None = None,
               split_key: tuple[int, int, int] | None = None, names: list[str] | None = None,
               keep_kv: bool = True) -> None:
    """Write `src` (or some of its tensors) to `dst`, optionally with tensors re-encoded as (type, raw)."""
    g = GGUFFile(src)
    replace = replace or {}
    names = names if names is not None else list(g.tensors)
    with GGUFStreamWriter(dst, g.architecture) as w:
        if keep_kv:
            w.copy_kvs(g.kv())
        if split_key is not None:
            w.gw.add_uint16("split.no", split_key[0])
            w.gw.add_uint16("split.count", split_key[1])
            w.gw.add_int32("split.tensors.count", split_key[2])
        for n in names:
            t = type_by_name(replace[n][0]) if n in replace else g.info(n).type
            w.add_tensor_info(n, g.info(n).shape, t)
        for n in names:
            w.write_tensor(n, replace[n][1] if n in replace else g.raw(n))
        w.finish()


def _requantized(path: Path, name: str, type_name: str) -> np.ndarray:
    g = GGUFFile(path)
    codec = type_by_name(type_name).require_codec()
    return codec.quantize(g.dequantize(name).reshape(-1, g.info(name).n_per_row))


def test_swap_and_swap_back(tiny_f32: Path) -> None:
    m = Model(tiny_f32)
    before = m.logits(TOKENS)
    m.swap("blk.1.ffn_down.weight", type_by_name("Q4_0"), _requantized(tiny_f32, "blk.1.ffn_down.weight", "Q4_0"))
    swapped = m.logits(TOKENS)
    assert not np.array_equal(before, swapped)
    m.restore("blk.1.ffn_down.weight")
    np.testing.assert_array_equal(m.logits(TOKENS), before)


def test_a_swap_equals_loading_the_replaced_file(tiny_f32: Path, tmp_path: Path) -> None:
    raw = _requantized(tiny_f32, "blk.0.attn_q.weight", "IQ4_NL")
    replaced = tmp_path / "replaced.gguf"
    _copy_with(tiny_f32, replaced, {"blk.0.attn_q.weight": ("IQ4_NL", raw)})
    m = Model(tiny_f32)
    m.logits(TOKENS)  # with every weight cached, only the swapped one may change
    m.swap("blk.0.attn_q.weight", type_by_name("IQ4_NL"), raw)
    np.testing.assert_array_equal(m.logits(TOKENS), Model(replaced).logits(TOKENS))
    other = Model(tiny_f32)
    other.swap_from_file("blk.0.attn_q.weight", replaced)
    np.testing.assert_array_equal(other.logits(TOKENS), m.logits(TOKENS))


def test_refusals_change_nothing(tiny_f32: Path, tmp_path: Path) -> None:
    m = Model(tiny_f32)
    before = m.logits(TOKENS)
    wrong_shape = np.zeros((3, 18 * 2), np.uint8)
    with pytest.raises(SwapError, match="needs"):
        m.swap("blk.0.attn_q.weight", type_by_name("Q4_0"), wrong_shape)
    with pytest.raises(SwapError, match="no tensor named"):
        m.swap("blk.0.attn_qkv.weight", type_by_name("F32"), np.zeros(4, np.float32))
    other = tmp_path / "other.gguf"
    _copy_with(tiny_f32, other, names=["blk.0.attn_k.weight"])
    with pytest.raises(SwapError, match="has no tensor named"):
        m.swap_from_file("blk.0.attn_q.weight", other)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(SwapError, match="cannot swap"):
        m.swap_from_file("blk.0.attn_q.weight", broken)
    np.testing.assert_array_equal(m.logits(TOKENS), before)


def _split_one_tensor_per_file(src: Path, folder: Path) -> list[Path]:
    names = list(GGUFFile(src).tensors)
    paths = [folder / f"model-{i + 1:05d}-of-{len(names):05d}.gguf" for i in range(len(names))]
    for i, (name, path) in enumerate(zip(names, paths)):
        _copy_with(src, path, names=[name], split_key=(i, len(names), len(names)), keep_kv=i == 0)
    return paths


def test_reload_changed_reloads_exactly_the_changed_tensors(tiny_f32: Path, tmp_path: Path) -> None:
    paths = _split_one_tensor_per_file(tiny_f32, tmp_path)
    m = Model(paths[0])
    assert len(m.gguf.tensors) == 1 and m.weights.has("output_norm.weight")
    before = m.logits(TOKENS)
    np.testing.assert_array_equal(before, Model(tiny_f32).logits(TOKENS))
    assert m.reload_changed() == []
    target = next(p for p in paths if "blk.1.ffn_up.weight" in GGUFFile(p).tensors)
    saved = tmp_path / "saved.gguf"
    shutil.copy(target, saved)
    untouched = next(p for p in paths if "blk.0.ffn_up.weight" in GGUFFile(p).tensors)
    os.utime(untouched)  # touched but identical: not reloaded
    candidate = tmp_path / "candidate.gguf"
    _copy_with(target, candidate, {"blk.1.ffn_up.weight": ("Q4_0", _requantized(target, "blk.1.ffn_up.weight", "Q4_0"))},
               split_key=(int(GGUFFile(target).get("split.no")), len(paths), len(paths)), keep_kv=False)
    os.replace(candidate, target)
    assert m.reload_changed() == ["blk.1.ffn_up.weight"]
    swapped = m.logits(TOKENS)
    assert not np.array_equal(swapped, before)
    shutil.copy(saved, target)
    assert m.reload_changed() == ["blk.1.ffn_up.weight"]
    np.testing.assert_array_equal(m.logits(TOKENS), before)


def test_without_change_tracking_a_file_rewritten_in_place_counts_as_changed(tiny_f32: Path, tmp_path: Path) -> None:
    """A model opened with track_changes=False (the commands: they never reload) hashes no decoded bytes; a reload
    then takes every cached tensor of a file rewritten in place as changed, and still compares a renamed file's
    bytes."""
    paths = _split_one_tensor_per_file(tiny_f32, tmp_path)
    m = Model(paths[0], track_changes=False)
    before = m.logits(TOKENS)
    untouched = next(p for p in paths if "blk.0.ffn_up.weight" in GGUFFile(p).tensors)
    os.utime(untouched)
    assert m.reload_changed() == ["blk.0.ffn_up.weight"]
    target = next(p for p in paths if "blk.1.ffn_up.weight" in GGUFFile(p).tensors)
    candidate = tmp_path / "candidate.gguf"
    _copy_with(target, candidate, {"blk.1.ffn_up.weight": ("Q4_0", _requantized(target, "blk.1.ffn_up.weight", "Q4_0"))},
               split_key=(int(GGUFFile(target).get("split.no")), len(paths), len(paths)), keep_kv=False)
    renamed_same = next(p for p in paths if "blk.1.ffn_down.weight" in GGUFFile(p).tensors)
    shutil.copy(renamed_same, tmp_path / "same.gguf")
    os.replace(tmp_path / "same.gguf", renamed_same)
    os.replace(candidate, target)
    assert m.reload_changed() == ["blk.1.ffn_up.weight"]
    assert not np.array_equal(m.logits(TOKENS), before)


def test_reload_refuses_broken_or_reshaped_files(tiny_f32: Path, tmp_path: Path) -> None:
    paths = _split_one_tensor_per_file(tiny_f32, tmp_path)
    m = Model(paths[0])
    before = m.logits(TOKENS)
    target = next(p for p in paths if "blk.0.attn_v.weight" in GGUFFile(p).tensors)
    good = target.read_bytes()
    target.write_bytes(good[: len(good) // 2])
    with pytest.raises(SwapError, match="no longer parses"):
        m.reload_changed()
    np.testing.assert_array_equal(m.logits(TOKENS), before)
    target.write_bytes(good)
    assert m.reload_changed() == []  # same bytes again, and nothing was cached from the broken state
    np.testing.assert_array_equal(m.logits(TOKENS), before)


def test_a_file_rewritten_under_a_swap_is_what_restore_brings_back(tiny_f32: Path, tmp_path: Path) -> None:
    """A swap sets the file's decoded tensor aside for restore; a reload that changes the file must not let that
    stale copy come back."""
    paths = _split_one_tensor_per_file(tiny_f32, tmp_path)
    name = "blk.1.ffn_up.weight"
    target = next(p for p in paths if name in GGUFFile(p).tensors)
    m = Model(paths[0])
    before = m.logits(TOKENS)
    m.swap(name, type_by_name("Q8_0"), _requantized(target, name, "Q8_0"))
    with_swap = m.logits(TOKENS)
    m.restore(name)
    np.testing.assert_array_equal(m.logits(TOKENS), before)  # the set-aside copy came back
    m.swap(name, type_by_name("Q8_0"), _requantized(target, name, "Q8_0"))
    candidate = tmp_path / "candidate.gguf"
    _copy_with(target, candidate, {name: ("Q4_0", _requantized(target, name, "Q4_0"))},
               split_key=(int(GGUFFile(target).get("split.no")), len(paths), len(paths)), keep_kv=False)
    os.replace(candidate, target)
    assert m.reload_changed() == [name]
    np.testing.assert_array_equal(m.logits(TOKENS), with_swap)  # the swap stays in place
    m.restore(name)
    rewritten = m.logits(TOKENS)
    assert not np.array_equal(rewritten, before)
    np.testing.assert_array_equal(rewritten, Model(paths[0]).logits(TOKENS))
