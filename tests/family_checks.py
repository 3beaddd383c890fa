"""The checks every model family's tests make in the same way: ik's KLD report as JSON, the imatrix against ik's,
streamed runs against chunk-by-chunk ones, checkpoint variants with a changed config, and a --numerics ik forward
against ik's saved base logits and the PPLs it printed."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from typer.testing import CliRunner

from ikconvert import write_safetensors
from ikquant.imatrix import read_imatrix_dat
from ikrun.cli import app
from ikrun.eval.evaluate import perplexity
from ikrun.eval.metrics import BaseLogitsFile, encode_records, scored_positions
from ikrun.eval.speculative import NextnDecoder, TargetDecoder, mtp_generate, previous_states
from ikrun.eval.stream import evaluate_chunks, minimum_budget, plan_run
from ikrun.model import Model
from ikrun.options import RuntimeOptions

runner = CliRunner()


def kld_json(gguf: Path, base: Path, *extra: str) -> dict[str, Any]:
    """`ikrun kld --json` of `gguf` against the base-logits file `base`."""
    res = runner.invoke(app, ["kld", str(gguf), "--base-logits", str(base), "--json", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout[res.stdout.index("{"):])  # type: ignore[no-any-return]


def assert_imatrix_equals_iks(gguf: Path, text: Path, ik_imatrix: Path, out: Path) -> None:
    """ikrun's imatrix over `text` (chunks of 64, ik's default F16 cache as ik's run kept it) has ik's entries, calls
    and chunks, and every value within 0.1% of ik's."""
    res = runner.invoke(app, ["imatrix", str(gguf), "--text", str(text), "--ctx", "64", "-o", str(out),
                              "--kv-cache", "f16"])
    assert res.exit_code == 0, res.output
    ik, ours = read_imatrix_dat(ik_imatrix), read_imatrix_dat(out)
    assert set(ours.entries) == set(ik.entries) and ours.chunks == ik.chunks
    for name, entry in ik.entries.items():
        assert ours.entries[name].ncall == entry.ncall
        a, b = entry.mean_sq(), ours.entries[name].mean_sq()
        assert (np.abs(a - b) <= 1e-3 * np.abs(a)).all(), name


def assert_streamed_equals_chunk_by_chunk(gguf: Path) -> None:
    """Five chunks layer-streamed under the smallest budget give the chunk-by-chunk logits bit for bit."""
    free = Model(gguf)
    chunks = np.random.default_rng(0).integers(0, free.n_vocab, size=(5, 48))
    expected = [x.copy() for _, x in evaluate_chunks(free, chunks, plan_run(free, 5, 48, one_pass=False))]
    tight = Model(gguf)
    tight.mem = minimum_budget(tight, 48)
    plan = plan_run(tight, 5, 48, one_pass=True)
    assert plan.streamed
    for a, (_, b) in zip(expected, evaluate_chunks(tight, chunks, plan)):
        np.testing.assert_array_equal(a, b)


def hf_variant(src: Path, tmp_path: Path, config: dict[str, Any],
               tensors: dict[str, tuple[str, np.ndarray]] | None = None) -> Path:
    """A copy of checkpoint `src` under tmp_path/hf with `config` merged into its config.json and, when given,
    `tensors` as its only safetensors file (in place of its file or its shards and their index)."""
    hf = tmp_path / "hf"
    shutil.copytree(src, hf, ignore=shutil.ignore_patterns("*.safetensors*") if tensors is not None else None)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, **config}))
    if tensors is not None:
        write_safetensors(hf / "model.safetensors", tensors)
    return hf


def iks_running_ppl(printed: Path) -> list[str]:
    """The PPL llama-perplexity prints after each chunk ([1]700.0754,[2]...)."""
    return re.findall(r"\[\d+\](\d+\.\d+)", printed.read_text(errors="replace"))


def running_ppl(nll: np.ndarray, n_chunk: int) -> list[str]:
    """The same figures from our NLLs: ik sums the float32 NLLs in float64 and prints exp(mean) with 4 decimals."""
    sums = np.cumsum(nll.reshape(n_chunk, -1).astype(np.float64).sum(axis=1))
    return [f"{np.exp(total / ((i + 1) * (nll.size // n_chunk))):.4f}" for i, total in enumerate(sums)]


def fa_off(gguf: Path) -> dict[str, str]:
    """{"flash_attn": "off"} for a model whose attention ik computes with or without flash attention (--flash-attn:
    the grouped-query and MLA families), the -fa off graph the stored oracles were made with; {} for the others."""
    from ikrun.models import model_class
    from ikrun.weights import WeightStore

    return {"flash_attn": "off"} if "flash_attn" in model_class(
        WeightStore(gguf).metadata.architecture).runtime_options else {}


def fa_off_flags(gguf: Path) -> list[str]:
    """fa_off as command-line flags."""
    return ["--flash-attn", "off"] if fa_off(gguf) else []


def assert_iks_forward(model: Model, base: Path, printed: Path, out: Path) -> None:
    """`model`'s --save-base-logits file `out` over the tokens of ik's base-logits file `base` is `base` byte for
    byte (every 16-bit log-probability code and both header floats of every scored position), and the PPL after
    every chunk is the one ik printed (`printed`, llama-perplexity's output)."""
    res = perplexity(model, np.asarray(BaseLogitsFile(base).tokens), save_base=out)
    assert out.read_bytes() == base.read_bytes()
    assert running_ppl(res.nll, res.n_chunk) == iks_running_ppl(printed)


def ik_quantized(gguf: Path, out: Path, ftype: str) -> Path:
    """`gguf` as ik's llama-quantize --allow-requantize writes it in file type `ftype` (F32: every tensor decoded)."""
    from ikquant.ftypes import file_type
    from ikquant.quantize import QuantizeOptions, quantize_model

    quantize_model(gguf, out, QuantizeOptions(file_type(ftype), allow_requantize=True))
    return out


def assert_head_equals_reference(model: Model, tokens: np.ndarray, reference: Callable[[np.ndarray], np.ndarray],
                                 rel: float, head: Model | None = None) -> None:
    """The model's NextN/MTP head (or `head`'s, an MTP export beside it) over `tokens` (fed the target's last states
    shifted by one, as ik's warmup feeds it) equals `reference(hidden in float64)` within rel x its largest logit, run
    whole and run 8 + 1 + 1 + ... through the head's own cache."""
    _, features = TargetDecoder(model, [model.impl.n_active - 1], nextn=True).run(tokens)
    hidden = previous_states(features)
    ref = reference(hidden.astype(np.float64))
    _, whole = NextnDecoder(head or model).run(hidden, tokens)
    assert np.abs(whole - ref).max() < rel * np.abs(ref).max()
    dec = NextnDecoder(head or model)
    parts = [dec.run(hidden[:8], tokens[:8])[1]] + [dec.run(hidden[i : i + 1], tokens[i : i + 1])[1]
                                                     for i in range(8, len(tokens))]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=0, atol=rel * np.abs(ref).max())


def assert_drafts_equal_the_reference_loop(target: Model, oracle: dict[str, Any], head: Model | None = None) -> None:
    """A trained head's reference loop (tools/make_mtp_head*.py: whole-sequence forwards, no caches) against ikrun's
    speculative decoding: the same acceptance and output at every step of every prompt."""
    assert oracle["mean_acceptance_length"] > 1.5  # a head that drafts: the accepted path is exercised
    for r in oracle["runs"]:
        run = mtp_generate(target, np.asarray(r["prompt"]), oracle["max_new_tokens"], oracle["n_max"], head=head)
        assert run.acceptance_lengths == r["acceptance_lengths"]
        assert run.output_ids == r["output_ids"]


def assert_decoded_records(path: Path, oracle: Path, numerics: str, threads: int, cache: str) -> None:
    """Each chunk of ik's base-logits file `oracle` fed one token at a time through the cache: every scored
    position's record is ik's."""
    base = BaseLogitsFile(oracle)
    target = Model(path, options=RuntimeOptions(numerics=numerics, ik_threads=threads), cache_type_k=cache)
    for c, chunk in enumerate(np.asarray(base.tokens)):
        decoder = TargetDecoder(target, [])
        rows = [decoder.run(chunk[i : i + 1])[0][0] for i in range(len(chunk))]
        scored = scored_positions(len(chunk))
        records, _ = encode_records(np.stack(rows[scored.start : scored.stop]),
                                    chunk[scored.start + 1 : scored.stop + 1])
        np.testing.assert_array_equal(records, base.records(c))
