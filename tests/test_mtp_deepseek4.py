"""DeepSeek-V4's MTP head as ik loads it, from its own export (ikconvert hf2gguf --mtp, here ik's own export of the
tiny V4-Flash checkpoint): the target continues through its cache (and where that differs from a whole forward), the
head's logits equal a float64 reference of DeepSeek's MTPBlock, speculative decoding with it gives the target's own
greedy text, and accept / imatrix / sweep take the export beside the target (bad input refused in one line)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.convert import Converter
from ikquant.imatrix import read_imatrix_dat
from ikrun.cli import app
from ikrun.eval.evaluate import tokenize_chunks
from ikrun.eval.speculative import TargetDecoder, greedy_continuation, mtp_generate, previous_states
from ikrun.model import Model
from ikrun.validate.deepseek4 import DeepseekV4Reference
from tests.family_checks import assert_drafts_equal_the_reference_loop, assert_head_equals_reference

runner = CliRunner()
DATA = Path(__file__).parent / "data"
FLASH = DATA / "convert" / "deepseek-v4-flash"
TARGET, EXPORT, HF = FLASH / "ref-f32.gguf", FLASH / "ik-mtp-f32.gguf", FLASH / "hf"
TEXT = DATA / "logits" / "deepseek-v4-flash" / "text.txt"
TRAINED = DATA / "mtp" / "deepseek-v4-trained"
DECODING = ["--text", str(TEXT), "--prompts", "2", "--prompt-len", "24", "--max-new", "12"]


@pytest.fixture(scope="module")
def target() -> Model:
    return Model(TARGET)


@pytest.fixture(scope="module")
def head() -> Model:
    return Model(EXPORT)


@pytest.fixture(scope="module")
def tokens(target: Model) -> np.ndarray:
    return np.array(target.tokenizer().encode(TEXT.read_text()), dtype=np.int64)


def test_a_continued_target_equals_the_whole_forward_until_its_indexer_ranks_fewer_entries(target: Model,
                                                                                           tokens: np.ndarray) -> None:
    """24 tokens, then one a call: equal to the whole 80-token forward (float rounding) up to position 67. From 68 on
    (17 CSA entries visible, the indexer keeps 16, and ReLU's zero scores tie) the continued indexer ranks the 17
    entries that exist, the whole forward's rows also hold the 3 not yet visible, and torch's top-k order over the
    two rows keeps different tied entries: a semantic of continuing, not rounding. Calls of 4 tokens (a verified
    block) rank as one token a call does, so speculation keeps the target's greedy text."""
    seq = tokens[:80]
    whole = target.logits(seq)
    dec, blocks = TargetDecoder(target, []), TargetDecoder(target, [])
    cont = np.concatenate([dec.run(seq[:24])[0]] + [dec.run(seq[p : p + 1])[0] for p in range(24, 80)])
    in_blocks = np.concatenate([blocks.run(seq[:24])[0]] + [blocks.run(seq[p : p + 4])[0] for p in range(24, 80, 4)])
    scale = np.abs(whole).max()
    diff = np.abs(cont - whole).max(axis=1)
    assert diff[:68].max() < 1e-5 * scale  # 5.2e-6 absolute measured, scale ~4
    assert diff[68] > 1e-2 * scale
    np.testing.assert_allclose(in_blocks, cont, rtol=0, atol=1e-5 * scale)


def test_a_cut_cache_continues_as_if_the_rejected_rows_never_ran(target: Model, tokens: np.ndarray) -> None:
    """A block of 6 verified, 4 of its rows cut (keep_cache), then the true continuation: the logits of a run that
    never saw the rejected rows (compressed entries are pooled again from the kept inputs), within float rounding:
    the kept rows' products ran in another batch size (3.3e-6 measured; a stale rejected row costs ~0.1)."""
    clean = TargetDecoder(target, [])
    clean.run(tokens[:30])
    expected = clean.run(tokens[30:40])[0]
    dec = TargetDecoder(target, [])
    dec.run(tokens[:28])
    dec.run(np.array([tokens[28], tokens[29], 5, 6, 7, 8]))
    dec.keep(30)
    np.testing.assert_allclose(dec.run(tokens[30:40])[0], expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_the_heads_logits_equal_the_float64_reference_whole_and_continued(target: Model, head: Model,
                                                                          tokens: np.ndarray) -> None:
    """40 positions of the export's head against DeepSeek's MTPBlock in float64 from the checkpoint (4.4e-7 of the
    largest logit measured), whole and 8 + 1 + 1 + ... through the head's cache."""
    reference = DeepseekV4Reference.from_folder(HF)
    seq = tokens[:40]
    assert_head_equals_reference(target, seq, lambda hidden: reference.mtp_logits(hidden, seq), 2e-6, head)


@pytest.mark.parametrize(("n_max", "p_min"), [(1, 0.0), (3, 0.0)])
def test_mtp_speculation_gives_the_targets_greedy_continuation(target: Model, head: Model, tokens: np.ndarray,
                                                               n_max: int, p_min: float) -> None:
    """The head is untrained (random weights): it drafts, the target verifies, the text is the target's own."""
    prompt = tokens[100:124]
    run = mtp_generate(target, prompt, 24, n_max, p_min, head)
    assert run.output_ids == greedy_continuation(target, prompt, 24)
    assert set(run.draft_lengths) == {n_max} and all(1 <= a <= n_max + 1 for a in run.acceptance_lengths)


def test_imatrix_collects_the_exports_head_in_the_same_file(target: Model, tmp_path: Path) -> None:
    """`imatrix T --mtp --mtp-model MTP`: the target's entries as without it, the export's block added, eh_proj's
    the mean square of [enorm(embedding) | hnorm(stream)] over every stream of the previous position."""
    plain, with_head = tmp_path / "plain.dat", tmp_path / "mtp.dat"
    for out, extra in ((plain, []), (with_head, ["--mtp", "--mtp-model", str(EXPORT)])):
        res = runner.invoke(app, ["imatrix", str(TARGET), "--text", str(TEXT), "--ctx", "64", "--chunks", "2", "-o",
                                  str(out), *extra])
        assert res.exit_code == 0, res.output
    a, b = read_imatrix_dat(plain).entries, read_imatrix_dat(with_head).entries
    assert {"blk.3.nextn.eh_proj.weight", "blk.3.attn_q_a.weight", "blk.3.ffn_up_exps.weight"} <= set(b)
    assert set(b) - set(a) == {n for n in b if n.startswith("blk.3.")}
    for name, entry in a.items():
        np.testing.assert_array_equal(b[name].values, entry.values)
    ckpt = DeepseekV4Reference.from_folder(HF)
    embed, enorm, hnorm = (ckpt.w(n).astype(np.float64) for n in ("embed.weight", "mtp.0.enorm.weight",
                                                                  "mtp.0.hnorm.weight"))
    rows = []
    for tokens in tokenize_chunks(target, TEXT.read_text(), 64, 2):
        _, features = TargetDecoder(target, [target.impl.n_active - 1], nextn=True).run(tokens)
        hidden = previous_states(features).astype(np.float64).reshape(len(tokens) * 4, -1)
        e = np.repeat(_rms(embed[tokens], enorm), 4, axis=0)
        rows.append(np.concatenate([e, _rms(hidden, hnorm)], axis=1))
    x = np.concatenate(rows)
    entry = b["blk.3.nextn.eh_proj.weight"]
    assert entry.ncall == 2
    np.testing.assert_allclose(entry.values, np.mean(x * x, axis=0) * 2, rtol=1e-5)


def test_a_trained_heads_acceptance_equals_the_reference_loop_at_every_step(target: Model, tmp_path: Path) -> None:
    """tools/make_mtp_head_deepseek4.py's loop (the numpy target and the float64 MTPBlock, whole-sequence forwards,
    no caches) on a head trained there: ikrun, the target continuing through its cache and ik's export layout of
    the head (ikconvert --mtp), drafts, accepts and outputs the same at every step of all 6 prompts."""
    oracle = json.loads((TRAINED / "mtp-oracle.json").read_text())
    export = Model(Converter(TRAINED / "hf", "f32", "joyai-llm", arch_options={"mtp": True}).write(tmp_path / "mtp.gguf"))
    assert_drafts_equal_the_reference_loop(target, oracle, head=export)


def _rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def test_accept_and_sweep_take_the_export_beside_the_target(tmp_path: Path) -> None:
    res = runner.invoke(app, ["accept", str(TARGET), str(EXPORT), "--mtp", *DECODING, "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout[res.stdout.index("{"):])
    assert got["output_matches_target"] and got["mean_acceptance_length"] >= 1
    res = runner.invoke(app, ["sweep", str(EXPORT), "--target", str(TARGET), "--metric", "acceptance", "--mtp",
                              *DECODING, "--types", "Q4_0", "--tensors", r"eh_proj|attn_q_a\.",
                              "-o", str(tmp_path / "head.json")])
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "head.json").read_text())["rows"]
    assert {r["group"] for r in rows} == {"blk.3.nextn.eh_proj.weight", "blk.3.attn_q_a.weight"}


def test_bad_input_is_refused_in_one_line(tmp_path: Path) -> None:
    cases = [
        (["ppl", str(EXPORT), "--text", str(TEXT), "--ctx", "64"], "MTP export"),
        (["accept", str(TARGET), "--mtp", "--text", str(TEXT)], "ikconvert hf2gguf --mtp"),
        (["accept", str(EXPORT), "--mtp", "--text", str(TEXT)], "MTP export"),
        (["sweep", str(EXPORT), "--metric", "acceptance", "--mtp", "--text", str(TEXT), "--types", "Q8_0", "-o",
          str(tmp_path / "x.json")], "MTP export"),
        (["accept", str(TARGET), str(TARGET), "--mtp", "--text", str(TEXT)], "not a DeepSeek-V4 MTP export"),
        (["imatrix", str(TARGET), "--mtp-model", str(EXPORT), "--text", str(TEXT), "-o", str(tmp_path / "x.dat")],
         "--mtp-model goes with --mtp"),
    ]
    for args, said in cases:
        res = runner.invoke(app, [*args, "--mem", "1G"], env={"COLUMNS": "400"})  # no note on a memory-short host
        assert res.exit_code == 2 and said in res.output and len(res.output.strip().splitlines()) == 1, (args,
                                                                                                         res.output)
