"""The Numba runtime's forward against an independent numpy reference and against Hugging Face transformers."""

from __future__ import annotations

from pathlib import Path

import numba
import numpy as np
from typer.testing import CliRunner

from ikrun.cli import app
from ikrun.model import Model
from ikrun.validate.hf import HFReference, compare_logits


def test_f32_gguf_matches_the_numpy_reference(tiny_hf: Path, tiny_f32: Path) -> None:
    ref = HFReference(tiny_hf)
    model = Model(tiny_f32)
    tokens = np.arange(3, 83) % model.n_vocab
    res = compare_logits(ref.logits(tokens), model.logits(tokens))
    assert res["max_rel_logit_err"] < 1e-4, res
    assert res["same_top"] == 1.0


def test_forward_matches_transformers_logits(data_dir: Path) -> None:
    model = Model(data_dir / "convert" / "qwen3" / "ik-f32.gguf")
    hf_logits = np.load(data_dir / "hf-logits" / "qwen3" / "logits.npy")
    tokens = np.load(data_dir / "hf-logits" / "qwen3" / "tokens.npy")
    for chunk in range(2):
        res = compare_logits(hf_logits[chunk], model.logits(tokens[chunk]))
        assert res["max_rel_logit_err"] < 1e-4, res
        assert res["kld_mean"] < 1e-9, res


def test_results_do_not_depend_on_thread_count(data_dir: Path) -> None:
    model = Model(data_dir / "convert" / "qwen3" / "ik-q8_0.gguf")
    tokens = np.load(data_dir / "hf-logits" / "qwen3" / "tokens.npy")[0]
    runs = []
    for n in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(n)
        runs.append(model.logits(tokens))
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    np.testing.assert_array_equal(runs[0], runs[1])


def test_validate_command(tiny_hf: Path, tiny_f32: Path) -> None:
    res = CliRunner().invoke(app, ["validate", "--hf", str(tiny_hf), "--gguf", str(tiny_f32), "--json"])
    assert res.exit_code == 0, res.output
    assert '"ok": true' in res.output


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    from ikquant.gguf_io import GGUFStreamWriter
    from ikquant.types import type_by_name

    path = tmp_path / "mamba.gguf"
    with GGUFStreamWriter(path, "mamba") as w:
        w.add_tensor_info("x.weight", (2, 32), type_by_name("F32"))
        w.write_tensor("x.weight", np.zeros((2, 32), np.float32))
        w.finish()
    res = CliRunner().invoke(app, ["logits", str(path), "--tokens", "1,2"], env={"COLUMNS": "250"})
    assert res.exit_code == 2
    assert "mamba" in res.output and "qwen3" in res.output


def test_missing_tensor_is_named_before_compute(data_dir: Path, tmp_path: Path) -> None:
    from ikquant.gguf_io import GGUFFile, GGUFStreamWriter

    src = GGUFFile(data_dir / "convert" / "qwen3" / "ik-f32.gguf")
    path = tmp_path / "broken.gguf"
    with GGUFStreamWriter(path, src.architecture) as w:
        w.copy_kvs(src.kv())
        keep = [t for t in src.tensors.values() if t.name != "blk.1.ffn_up.weight"]
        for t in keep:
            w.add_tensor_info(t.name, t.shape, t.type)
        for t in keep:
            w.write_tensor(t.name, src.raw(t.name))
        w.finish()
    res = CliRunner().invoke(app, ["logits", str(path), "--tokens", "1,2"], env={"COLUMNS": "250"})
    assert res.exit_code == 2
    assert "blk.1.ffn_up.weight" in res.output


def test_a_bug_shows_its_traceback_not_a_user_error(data_dir: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Only IkError means "your input is wrong" (exit 2, one line); a ValueError from our own code is a bug."""
    import ikrun.eval.stream

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ValueError("an internal mistake")

    monkeypatch.setattr(ikrun.eval.stream, "plan_run", broken)
    res = CliRunner().invoke(app, ["ppl", str(data_dir / "convert" / "qwen3" / "ik-f32.gguf"), "--text",
                                   str(data_dir / "logits" / "qwen3" / "text.txt"), "--ctx", "64"])
    assert res.exit_code == 1 and isinstance(res.exception, ValueError)


def test_bad_text_and_tokens_are_one_line_errors(tiny_f32: Path, tmp_path: Path) -> None:
    """A missing or non-UTF-8 --text and a malformed --tokens are the user's mistakes: one line, exit 2."""
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    for args, says in ((["ppl", str(tiny_f32), "--text", str(tmp_path / "missing.txt")], "no such file"),
                       (["ppl", str(tiny_f32), "--text", str(latin1)], "not UTF-8"),
                       (["logits", str(tiny_f32), "--tokens", "1,x,3"], "comma-separated list")):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and says in res.output, res.output
        assert "Traceback" not in res.output and len(res.output.strip().splitlines()) <= 2, res.output
