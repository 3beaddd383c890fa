"""Split GGUFs (gguf-split's layout) read and written by every tool; metadata overrides, recipes out, model cards."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType
from typer.testing import CliRunner

from ikconvert.cli import app as ikconvert_app
from ikconvert.tiny import CORPUS, TinySpec, make_tiny_checkpoint
from ikquant.cli import app as ikquant_app
from ikquant.gguf_io import GGUFFile
from ikquant.shards import GGUFModel
from ikrun.cli import app as ikrun_app
from tests import ik_engine

runner = CliRunner()
ENV = {"COLUMNS": "300"}
TOKENS = list(range(1, 65))


def _ok(app, *args: object) -> str:  # type: ignore[no-untyped-def]
    res = runner.invoke(app, [str(a) for a in args], env=ENV)
    assert res.exit_code == 0, res.output
    return res.output


def _refused(app, *args: object) -> str:  # type: ignore[no-untyped-def]
    """The one-line error of a refused command (exit 2)."""
    res = runner.invoke(app, [str(a) for a in args], env=ENV)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    lines = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, res.output
    return lines[0]


def _tensor_bytes(path: Path) -> dict[str, tuple[str, bytes]]:
    m = GGUFModel(path)
    return {name: (info.type.name, m.raw(name).tobytes()) for name, info in m.tensors.items()}


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 with 256-wide rows (every type applies), and a model card naming its license and base model."""
    hf = make_tiny_checkpoint(tmp_path_factory.mktemp("split") / "hf", TinySpec(
        arch="qwen3", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, seed=5))
    (hf / "README.md").write_text("---\nlicense: apache-2.0\nbase_model: Qwen/Qwen3-0.6B\n---\n# tiny\n")
    return hf


@pytest.fixture(scope="module")
def base(hf: Path) -> Path:
    out = hf.parent / "m-f32.gguf"
    _ok(ikconvert_app, "hf2gguf", hf, "--outtype", "f32", "-o", out, "--pre-tokenizer", "qwen2")
    return out


@pytest.fixture(scope="module")
def split(hf: Path) -> Path:
    """The same conversion in shards of at most 10 tensors (25 tensors: 3 shards)."""
    out = hf.parent / "s-f32.gguf"
    _ok(ikconvert_app, "hf2gguf", hf, "--outtype", "f32", "-o", out, "--pre-tokenizer", "qwen2",
        "--split-max-tensors", "10")
    return hf.parent / "s-f32-00001-of-00003.gguf"


def test_split_conversion_has_gguf_splits_layout(base: Path, split: Path) -> None:
    whole, shards = GGUFFile(base), GGUFModel(split).shards
    assert [len(s.tensors) for s in shards] == [10, 10, 5]
    first = [(kv.key, kv.type) for kv in shards[0].kv()]
    assert [k for k, _ in first[:-3]] == [kv.key for kv in whole.kv()]  # every key, then the split keys
    split_keys = [("split.no", GGUFValueType.UINT16), ("split.count", GGUFValueType.UINT16),
                  ("split.tensors.count", GGUFValueType.INT32)]
    assert first[-3:] == split_keys
    for i, shard in enumerate(shards):
        assert [(kv.key, kv.type) for kv in shard.kv()][-3:] == split_keys
        assert (shard.get("split.no"), shard.get("split.count"), shard.get("split.tensors.count")) == (i, 3, 25)
        if i:
            assert len(list(shard.kv())) == 3  # later shards: the split keys alone, as gguf-split writes them
    assert list(GGUFModel(split).tensors) == list(whole.tensors)
    assert _tensor_bytes(split) == _tensor_bytes(base)
    # the runtime reads it as the one file
    ppl = [json.loads(runner.invoke(ikrun_app, ["ppl", str(p), "--text", str(CORPUS), "--ctx", "64", "--chunks", "3",
                                                "--json"]).stdout) for p in (base, split)]
    assert ppl[0] == ppl[1]


def test_size_limits_and_a_metadata_only_first_shard(hf: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    _ok(ikconvert_app, "hf2gguf", hf, "--outtype", "f16", "-o", out, "--pre-tokenizer", "qwen2",
        "--split-max-size", "1M", "--no-tensor-first-split")
    model = GGUFModel(next(tmp_path.glob("m-00001-of-*.gguf")))
    assert len(model.shards[0].tensors) == 0 and len(model.shards) > 2
    for shard in model.shards[1:]:
        sizes = [t.nbytes for t in shard.tensors.values()]
        assert sum(sizes) <= 1_000_000 or len(sizes) == 1
    # a limit below the largest tensor: refused before anything is written
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _refused(ikconvert_app, "hf2gguf", hf, "--outtype", "f32", "-o", empty / "m.gguf", "--pre-tokenizer",
                    "qwen2", "--split-max-size", "100K")
    assert "--split-max-size (100000 bytes)" in line and "blk.0.ffn_down.weight (524288 bytes" in line
    assert list(empty.iterdir()) == []


def test_ik_loads_split_files_and_computes_the_same_logits(base: Path, split: Path, tmp_path: Path) -> None:
    np.testing.assert_array_equal(ik_engine.logits(split, TOKENS), ik_engine.logits(base, TOKENS))
    q = tmp_path / "q.gguf"
    _ok(ikquant_app, base, q, "--type", "Q4_K_M")
    _ok(ikquant_app, base, tmp_path / "qs.gguf", "--type", "Q4_K_M", "--split-max-tensors", "7")
    np.testing.assert_array_equal(ik_engine.logits(tmp_path / "qs-00001-of-00004.gguf", TOKENS),
                                  ik_engine.logits(q, TOKENS))


def test_quantizing_a_split_input_equals_the_unsplit_one(base: Path, split: Path, tmp_path: Path) -> None:
    for args in (["--type", "Q4_K_M"], ["--type", "IQ4_KS", "--custom-q", "ffn_down=q8_0"]):
        _ok(ikquant_app, base, tmp_path / "a.gguf", *args)
        _ok(ikquant_app, split, tmp_path / "b.gguf", *args)
        assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    # repacking a split quantized file
    _ok(ikquant_app, base, tmp_path / "q8.gguf", "--type", "Q8_0")
    _ok(ikquant_app, split, tmp_path / "q8s.gguf", "--type", "Q8_0", "--split-max-tensors", "10")
    _ok(ikquant_app, tmp_path / "q8.gguf", tmp_path / "r.gguf", "--repack")
    _ok(ikquant_app, tmp_path / "q8s-00001-of-00003.gguf", tmp_path / "rs.gguf", "--repack")
    assert (tmp_path / "r.gguf").read_bytes() == (tmp_path / "rs.gguf").read_bytes()
    assert "Q8_0_R8" in {t for t, _ in _tensor_bytes(tmp_path / "rs.gguf").values()}
    # a later shard is not a model
    line = _refused(ikquant_app, split.with_name("s-f32-00002-of-00003.gguf"), tmp_path / "x.gguf", "--type", "Q8_0")
    assert "shard 2 of 3" in line and "s-f32-00001-of-00003.gguf" in line
    assert not (tmp_path / "x.gguf").exists()


@pytest.fixture(scope="module")
def sweep(base: Path) -> Path:
    out = base.parent / "sweep.json"
    res = runner.invoke(ikrun_app, ["sweep", str(base), "--text", str(CORPUS), "--ctx", "64", "--chunks", "3",
                                    "--types", "IQ2_KS,IQ4_KS,Q8_0", "--tensors", "ffn_|attn_v", "-o", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_mixes_from_a_split_input_and_their_recipes(base: Path, split: Path, sweep: Path, tmp_path: Path) -> None:
    mix = ["--type", "IQ4_KS", "--sweep", sweep, "--target-bpw", "4.0"]
    _ok(ikquant_app, base, tmp_path / "a.gguf", *mix, "--recipe-out", tmp_path / "recipe.txt")
    _ok(ikquant_app, split, tmp_path / "b.gguf", *mix)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    recipe = (tmp_path / "recipe.txt").read_text()
    rules = [line for line in recipe.splitlines() if not line.startswith("#")]
    assert rules and all(r.startswith("^") and "$=" in r for r in rules)
    assert "predicted KLD" in recipe
    assert {r.split("=")[1] for r in rules} >= {"iq2_ks", "q6_K"}  # the types, spelled as ik parses them
    # read back through --custom-q: the same bytes, from ikquant and from ik's own llama-quantize
    custom = ",".join(rules)
    _ok(ikquant_app, base, tmp_path / "c.gguf", "--type", "IQ4_KS", "--custom-q", custom)
    assert (tmp_path / "c.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()
    res = ik_engine.llama_quantize("--custom-q", custom, str(base), str(tmp_path / "ik.gguf"), "IQ4_KS", "2")
    assert res.returncode == 0, res.stderr
    # the wheel's generic x86-64 build searches IQ2_KS scales with its scalar code (no AVX2 path compiled in):
    # --slow-iq2ks is that search; with it the bytes are the same
    _ok(ikquant_app, base, tmp_path / "slow.gguf", "--type", "IQ4_KS", "--custom-q", custom, "--slow-iq2ks",
        "--threads", "2")  # ik batches its quantize calls by its thread count: as the wheel's run
    assert (tmp_path / "ik.gguf").read_bytes() == (tmp_path / "slow.gguf").read_bytes()
    assert np.isfinite(ik_engine.logits(tmp_path / "a.gguf", TOKENS)).all()  # and ik runs the mix
    # ikrun mix takes the split base and writes the same mix and recipe
    res = runner.invoke(ikrun_app, ["mix", str(split), str(tmp_path / "m.gguf"), "--sweep", str(sweep), "--type",
                                    "IQ4_KS", "--target-bpw", "4.0", "--recipe-out", str(tmp_path / "m.txt")], env=ENV)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "m.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()
    mixed = (tmp_path / "m.txt").read_text()
    assert "measured mean KLD" in mixed
    assert [line for line in mixed.splitlines() if not line.startswith("#")] == rules
    # budgets give the offload lines
    _ok(ikquant_app, base, tmp_path / "d.gguf", "--type", "IQ4_KS", "--sweep", sweep, "--budget", "ffn_.*=1MiB",
        "--budget", "rest=2MiB", "--recipe-out", tmp_path / "budget.txt")
    assert '# -ot "ffn_.*=CPU"' in (tmp_path / "budget.txt").read_text().splitlines()


def test_keep_split_and_partial_requant(split: Path, tmp_path: Path) -> None:
    out = tmp_path / "q.gguf"
    _ok(ikquant_app, split, out, "--type", "Q8_0", "--keep-split", "--threads", "2")
    names = [tmp_path / f"q-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert [list(s.tensors) for s in GGUFModel(names[0]).shards] == [list(s.tensors) for s in GGUFModel(split).shards]
    # ik's --keep-split writes the same shards, byte for byte
    res = ik_engine.llama_quantize("--keep-split", str(split), str(tmp_path / "ik.gguf"), "Q8_0", "2")
    assert res.returncode == 0, res.stderr
    for i, ours in enumerate(names, 1):
        assert (tmp_path / f"ik-0000{i}-of-00003.gguf").read_bytes() == ours.read_bytes()
    assert np.isfinite(ik_engine.logits(names[0], TOKENS)).all()
    # a rule that changes a tensor of the second shard rewrites that shard alone
    before = [_md5(p) for p in names]
    changed = GGUFModel(split).shards[1].tensors
    tensor = next(n for n in changed if n.endswith("ffn_down.weight"))
    output = _ok(ikquant_app, split, out, "--type", "Q8_0", "--keep-split", "--partial-requant",
                 "--custom-q", f"{tensor}=q6_K")
    after = [_md5(p) for p in names]
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]
    assert f"{names[0]}: unchanged" in output and f"{names[1]}: written" in output
    _ok(ikquant_app, split, tmp_path / "full.gguf", "--type", "Q8_0", "--keep-split", "--custom-q", f"{tensor}=q6_K")
    for i, ours in enumerate(names, 1):
        assert (tmp_path / f"full-0000{i}-of-00003.gguf").read_bytes() == ours.read_bytes()
    # another file type changes the first shard's metadata: every shard is written
    output = _ok(ikquant_app, split, out, "--type", "Q4_0", "--keep-split", "--partial-requant")
    assert "unchanged" not in output


def test_broken_splits_are_refused_naming_the_shard(hf: Path, split: Path, tmp_path: Path) -> None:
    def converted(name: str, *args: str) -> list[Path]:
        folder = tmp_path / name
        folder.mkdir()
        _ok(ikconvert_app, "hf2gguf", hf, "--outtype", "f32", "-o", folder / "s.gguf", "--pre-tokenizer", "qwen2",
            *args)
        return sorted(folder.glob("s-*.gguf"))

    a = converted("a", "--split-max-tensors", "10")  # 10, 10, 5
    b = converted("b", "--split-max-tensors", "9")  # 9, 9, 7: another split of the same model
    c = converted("c", "--split-max-tensors", "7")  # 4 shards
    d = converted("d", "--split-max-tensors", "12")  # 12, 12, 1
    out = tmp_path / "out.gguf"

    def refused(*shards: Path) -> str:
        folder = tmp_path / "try"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        for i, shard in enumerate(shards, 1):
            shutil.copy(shard, folder / f"s-0000{i}-of-00003.gguf")
        line = _refused(ikquant_app, folder / "s-00001-of-00003.gguf", out, "--type", "Q8_0")
        assert not out.exists() and not list(tmp_path.glob("out*"))
        return line

    line = refused(a[0], a[1])
    assert "shard 3 of 3" in line and "is missing" in line
    assert "also in" in refused(a[0], b[1], a[2])  # shards of two different splits hold the same tensor
    assert "split.count is 4" in refused(a[0], a[1], c[2])
    assert "split.tensors.count is 25, but its 3 shards hold 21 tensors" in refused(a[0], a[1], d[2])


def test_override_kv_and_hide_imatrix(hf: Path, base: Path, tmp_path: Path) -> None:
    imat = tmp_path / "imatrix.dat"
    res = runner.invoke(ikrun_app, ["imatrix", str(base), "--text", str(CORPUS), "--ctx", "64", "--chunks", "2",
                                    "-o", str(imat)])
    assert res.exit_code == 0, res.output
    overrides = ["--override-kv", "general.name=str:Tiny test", "--override-kv", "qwen3.context_length=int:4096",
                 "--override-kv", "my.scale=float:0.5", "--override-kv", "tokenizer.ggml.add_bos_token=bool:true"]
    out = tmp_path / "q.gguf"
    _ok(ikquant_app, base, out, "--type", "IQ4_KS", "--imatrix", imat, "--hide-imatrix", *overrides, "--threads", "2")
    g = GGUFFile(out)
    kv = {k.key: (k.value, k.type) for k in g.kv()}
    assert kv["general.name"] == ("Tiny test", GGUFValueType.STRING)
    assert kv["qwen3.context_length"] == (4096, GGUFValueType.INT32)
    assert kv["my.scale"] == (0.5, GGUFValueType.FLOAT32)
    assert kv["tokenizer.ggml.add_bos_token"] == (True, GGUFValueType.BOOL)
    assert kv["quantize.imatrix.file"][0] == "top_secret" and kv["quantize.imatrix.entries_count"][0] == 0
    # ik's llama-quantize, given the same options, writes the same file
    res = ik_engine.llama_quantize("--imatrix", str(imat), "--hide-imatrix", *overrides, str(base),
                                   str(tmp_path / "ik.gguf"), "IQ4_KS", "2")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "ik.gguf").read_bytes() == out.read_bytes()
    # the converter takes them too
    _ok(ikconvert_app, "hf2gguf", hf, "--outtype", "f16", "-o", tmp_path / "c.gguf", "--pre-tokenizer", "qwen2",
        "--override-kv", "general.name=str:Renamed")
    assert GGUFFile(tmp_path / "c.gguf").get("general.name") == "Renamed"
    for bad, why in (("general.name", "KEY=TYPE:VALUE"), ("a=int:x", "int32"), ("a=double:1", "int, float, bool"),
                     ("a=bool:yes", "true or false"), ("split.count=int:2", "written by the tool"),
                     ("a=str:" + "x" * 128, "127")):
        line = _refused(ikquant_app, base, tmp_path / "bad.gguf", "--type", "Q8_0", "--override-kv", bad)
        assert why in line, line
    assert not (tmp_path / "bad.gguf").exists()


def test_general_keys_from_the_model_card_and_the_hub(hf: Path, base: Path, tmp_path: Path) -> None:
    from ikconvert.convert import Converter

    g = GGUFFile(base)
    assert g.get("general.license") == "apache-2.0"
    assert g.get("general.base_model.count") == 1
    assert g.get("general.base_model.0.repo_url") == "https://huggingface.co/Qwen/Qwen3-0.6B"
    hub = GGUFFile(Converter(hf, "f16", "qwen2", hub_repo="someone/tiny-qwen3").write(tmp_path / "h.gguf"))
    assert hub.get("general.repo_url") == "https://huggingface.co/someone/tiny-qwen3"


def test_model_card(base: Path, tmp_path: Path) -> None:
    out = tmp_path / "q.gguf"
    _ok(ikquant_app, base, out, "--type", "IQ4_KS", "--split-max-tensors", "10", "--recipe-out",
        tmp_path / "recipe.txt")
    first = tmp_path / "q-00001-of-00003.gguf"
    res = runner.invoke(ikrun_app, ["kld", str(first), "--base", str(base), "--text", str(CORPUS), "--ctx", "64",
                                    "--chunks", "3", "--json"])
    assert res.exit_code == 0, res.output
    (tmp_path / "kld.json").write_text(res.stdout)
    stats = json.loads(res.stdout)
    _ok(ikquant_app, "card", first, "--kld", tmp_path / "kld.json", "--recipe", tmp_path / "recipe.txt",
        "-o", tmp_path / "README.md")
    card = (tmp_path / "README.md").read_text()
    front = card.split("---")[1]
    for line in ("base_model:\n- Qwen/Qwen3-0.6B", "base_model_relation: quantized", "license: apache-2.0",
                 "- ik_llama.cpp", "- gguf", "pipeline_tag: text-generation"):
        assert line in front
    assert "| IQ4_KS |" in card and "| ffn_down.weight |" in card
    assert f"{stats['kld_mean']:.6f}" in card and "q-00001-of-00003.gguf" in card
    assert "q-00003-of-00003.gguf" in card and "^token_embd\\.weight$=" in card
    line = _refused(ikquant_app, "card", tmp_path / "nothing.gguf", "-o", tmp_path / "x.md")
    assert "nothing.gguf" in line
    bare = tmp_path / "bare.gguf"
    from ikquant.gguf_io import GGUFStreamWriter
    from ikquant.types import type_by_name

    with GGUFStreamWriter(bare, "qwen3") as w:
        w.add_tensor_info("token_embd.weight", (2, 32), type_by_name("F32"))
        w.write_tensor("token_embd.weight", np.zeros((2, 32), np.float32))
        w.finish()
    assert "general.file_type" in _refused(ikquant_app, "card", bare, "-o", tmp_path / "x.md")
    assert not (tmp_path / "x.md").exists()


def test_a_split_output_that_does_not_fit_leaves_no_shard(base: Path, tmp_path: Path) -> None:
    from tests.test_faults import tmpfs

    with tmpfs(tmp_path / "small", "1m") as small:
        line = _refused(ikquant_app, base, small / "q.gguf", "--type", "Q8_0", "--split-max-tensors", "5")
        assert "are free" in line and str(small / "q.gguf") in line
        assert list(small.iterdir()) == []
