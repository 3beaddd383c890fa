"""What every converter test file checks on bad input: exit code 2, a message naming the fault, no output left."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from ikconvert.cli import app

runner = CliRunner()


def convert_fails(args: list[str], out: Path, *needles: str) -> str:
    """`ikconvert hf2gguf ARGS --outfile OUT` must exit 2 with every needle in its (unwrapped) message and leave
    neither OUT nor its temporary file behind; returns the message."""
    res = runner.invoke(app, ["hf2gguf", *args, "--outfile", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    for needle in needles:
        assert needle in text, text
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]
    return text


def assert_same_gguf(ours_path: Path, ik_path: Path) -> None:
    """Our conversion equals ik's: the same keys (with their value types), tensor table and bytes, then the file."""
    from ikquant.gguf_io import GGUFFile

    ours, ik = GGUFFile(ours_path), GGUFFile(ik_path)
    assert [(kv.key, kv.type, kv.value) for kv in ours.kv()] == [(kv.key, kv.type, kv.value) for kv in ik.kv()]
    assert [(t.name, t.ne, t.type) for t in ours.tensors.values()] == [(t.name, t.ne, t.type) for t in ik.tensors.values()]
    for name in ik.tensors:
        assert ours.raw(name).tobytes() == ik.raw(name).tobytes(), name
    assert ours_path.read_bytes() == ik_path.read_bytes()


def write_sharded(folder: Path, weights: dict, shard_of, index_name: str) -> None:  # type: ignore[no-untyped-def,type-arg]
    """Write `weights` as three safetensors shards (`shard_of(name)` -> 1..3) and their index."""
    import json

    from ikconvert.safetensors_io import write_safetensors

    weight_map = {}
    for k in (1, 2, 3):
        fname = f"model-{k:05d}-of-00003.safetensors"
        part = {n: v for n, v in weights.items() if shard_of(n) == k}
        write_safetensors(folder / fname, part, {"format": "pt"})
        weight_map.update({n: fname for n in part})
    (folder / index_name).write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}))
