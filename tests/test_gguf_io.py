"""GGUF reading and writing with ik's own type ids, laziness, and errors on damaged files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from ikquant.errors import GGUFFormatError
from ikquant.gguf_io import GGUFFile, GGUFStreamWriter
from ikquant.types import all_types, type_by_id, type_by_name


@pytest.mark.parametrize("variant", ["ik-f32", "ik-bf16", "ik-q8_0"])
def test_round_trip_is_byte_identical(data_dir: Path, tmp_path: Path, variant: str) -> None:
    src = data_dir / "convert" / "qwen3" / f"{variant}.gguf"
    g = GGUFFile(src)
    out = tmp_path / "copy.gguf"
    with GGUFStreamWriter(out, g.architecture) as w:
        w.copy_kvs(g.kv())
        for t in g.tensors.values():
            w.add_tensor_info(t.name, t.shape, t.type)
        for t in g.tensors.values():
            w.write_tensor(t.name, g.raw(t.name))
        w.finish()
    assert out.read_bytes() == src.read_bytes()


def _write_all_types(path: Path, rng: np.random.Generator) -> dict[str, tuple[str, bytes]]:
    """A GGUF holding one [3, 512] tensor of every sized type, ik-only ones included, with random bytes."""
    written = {}
    with GGUFStreamWriter(path, "llama") as w:
        types = [t for t in all_types() if 512 % t.block_size == 0]
        for t in types:
            w.add_tensor_info(f"t.{t.name}", (3, 512), t)
        for t in types:
            data = rng.integers(0, 256, size=t.tensor_bytes((512, 3)), dtype=np.uint8)
            written[f"t.{t.name}"] = (t.name, data.tobytes())
            w.write_tensor(f"t.{t.name}", data)
        w.finish()
    return written


def test_every_ik_type_round_trips_with_row_headers(tmp_path: Path) -> None:
    path = tmp_path / "types.gguf"
    written = _write_all_types(path, np.random.default_rng(0))
    g = GGUFFile(path)
    for name, (type_name, data) in written.items():
        info = g.info(name)
        assert info.type is type_by_name(type_name)
        assert info.ne == (512, 3)
        assert info.nbytes == 3 * (info.type.row_meta_size + info.type.type_size * 512 // info.type.block_size)
        assert g.raw(name).tobytes() == data
    # PyPI gguf alone cannot read the file: that is the gap the registry fills
    with pytest.raises(ValueError):
        GGUFReader(path)


def test_row_scaled_type_sizes_include_the_header() -> None:
    assert type_by_name("iq4_ks").row_bytes(4096) == 4 + 136 * 16
    assert type_by_name("IQ2_KS").row_bytes(256) == 2 + 70
    assert type_by_id(153).name == "IQ2_KT"
    with pytest.raises(ValueError, match="multiple"):
        type_by_name("Q4_K").row_bytes(100)


def test_opening_a_huge_file_reads_only_the_header(tmp_path: Path) -> None:
    path = tmp_path / "huge.gguf"
    t = type_by_name("F16")
    with GGUFStreamWriter(path, "llama") as w:
        shape = (65536, 16384)  # 2 GiB of f16
        w.add_tensor_info("big.weight", shape, t)
        w._start()  # header only (padded); then a sparse data section instead of 2 GiB of writes
        fout = w._shards[0].file
        assert fout is not None
        fout.seek(fout.tell() + t.tensor_bytes(tuple(reversed(shape))) - 1)
        fout.write(b"\0")
        w._next = 1
        w.finish()
    assert path.stat().st_size > 2 << 30
    before = _resident_bytes()
    g = GGUFFile(path)
    info = g.info("big.weight")
    after = _resident_bytes()
    assert info.nbytes == 2 << 30
    assert after - before < 64 << 20  # opening did not read (or map in) the tensor data


def _resident_bytes() -> int:
    """This process's resident memory now (not its lifetime peak, which an earlier test may have set higher)."""
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def test_truncated_and_foreign_files_are_rejected(data_dir: Path, tmp_path: Path) -> None:
    src = (data_dir / "convert" / "qwen3" / "ik-f32.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src[: len(src) - 1000])
    with pytest.raises(GGUFFormatError, match="truncated"):
        GGUFFile(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFFormatError, match="not a readable GGUF"):
        GGUFFile(junk)


def test_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "out.gguf"
    with pytest.raises(RuntimeError):
        with GGUFStreamWriter(out, "llama") as w:
            w.add_tensor_info("a.weight", (2, 32), type_by_name("F32"))
            w.write_tensor("a.weight", np.zeros((2, 32), np.float32))
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
