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


def deepseek_v3_with_vocab(data_dir: Path, folder: Path, vocab_size: int, tokenizer_files: list[Path],
                           seed: int = 0) -> Path:
    """The tiny DeepSeek-V3 checkpoint (tests/data/convert/deepseek-v3/hf) with another vocabulary: its tokenizer
    files replaced by `tokenizer_files`, config.json's vocab_size set and the embedding and LM head re-drawn with
    that many rows (bf16). Tokenizer tests use it to convert a vocabulary and run ik and ikrun on the file."""
    import json
    import shutil

    import numpy as np

    from ikconvert.safetensors_io import SafetensorsFile, write_safetensors
    from ikquant.formats.numeric import f32_to_bf16_bits

    shutil.copytree(data_dir / "convert" / "deepseek-v3" / "hf", folder)
    for p in folder.iterdir():
        p.chmod(0o644)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    for src in tokenizer_files:
        shutil.copyfile(src, folder / src.name)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["vocab_size"] = vocab_size
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    rng = np.random.default_rng(seed)
    for shard in sorted(folder.glob("model-*.safetensors")):
        st = SafetensorsFile(shard)
        tensors = {n: (t.dtype, np.array(t.raw())) for n, t in st.tensors.items()}
        del st
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in tensors:
                rows = rng.standard_normal((vocab_size, cfg["hidden_size"])).astype(np.float32) * 0.1
                tensors[name] = ("BF16", f32_to_bf16_bits(rows))
        write_safetensors(shard, tensors, {"format": "pt"})
    return folder
