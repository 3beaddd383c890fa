"""The NextN/MTP head of GLM-4.x (`glm4moe`) against an independent numpy reference of ik's MTP graph, and greedy
speculative decoding with it (`ikrun accept --mtp`): the output is the target's own greedy continuation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ikconvert.checkpoint import Checkpoint
from ikconvert.convert import Converter
from ikquant.imatrix import read_imatrix_dat
from ikrun.cli import app
from ikrun.eval.evaluate import tokenize_chunks
from ikrun.eval.speculative import TargetDecoder, greedy_continuation, mtp_generate
from ikrun.model import Model
from ikrun.options import RuntimeOptions
from tests.family_checks import assert_drafts_equal_the_reference_loop, assert_head_equals_reference

runner = CliRunner()
DATA = Path(__file__).parent / "data"
HF = DATA / "convert" / "glm4-moe" / "hf"
GGUF = DATA / "convert" / "glm4-moe" / "ik-f32.gguf"
TEXT = DATA / "logits" / "glm4-moe" / "text.txt"
NO_NEXTN = DATA / "convert" / "qwen3-moe" / "ik-f32.gguf"
TRAINED = DATA / "mtp" / "glm4-moe-trained"


def rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def reference_head(w: dict[str, np.ndarray], hidden: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """GLM-4.5's MTP layer 3 in float64 from the checkpoint's tensors, as ik's graph defines it: position p takes
    the hidden row p (the target's state before it) and token p; heads 4 x 32, 2 KV heads, NEOX rope on the first 16
    dims (theta 1e6), sigmoid top-2 of 4 experts renormalised, one shared expert."""
    g = {n[len("model.layers.3."):]: t.astype(np.float64) for n, t in w.items() if n.startswith("model.layers.3.")}
    n = len(tokens)
    x = np.concatenate([rms(g["embed_tokens.weight"][tokens], g["enorm.weight"]), rms(hidden, g["hnorm.weight"])], 1)
    x = x @ g["eh_proj.weight"].T
    h = rms(x, g["input_layernorm.weight"])
    q = (h @ g["self_attn.q_proj.weight"].T + g["self_attn.q_proj.bias"]).reshape(n, 4, 32)
    k = (h @ g["self_attn.k_proj.weight"].T + g["self_attn.k_proj.bias"]).reshape(n, 2, 32)
    v = (h @ g["self_attn.v_proj.weight"].T + g["self_attn.v_proj.bias"]).reshape(n, 2, 32)
    ang = np.arange(n)[:, None] * (1e6 ** (-np.arange(0, 16, 2) / 16))[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(t: np.ndarray) -> np.ndarray:
        a, b = t[..., :8], t[..., 8:16]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin, t[..., 16:]], axis=-1)

    q, k = rope(q), rope(k)
    att = np.empty((n, 4, 32))
    for head in range(4):
        s = q[:, head] @ k[:, head // 2].T / np.sqrt(32) + np.triu(np.full((n, n), -np.inf), 1)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        att[:, head] = (p / p.sum(axis=1, keepdims=True)) @ v[:, head // 2]
    x = x + att.reshape(n, 128) @ g["self_attn.o_proj.weight"].T
    h = rms(x, g["post_attention_layernorm.weight"])

    def mlp(t: np.ndarray, b: str) -> np.ndarray:
        return (silu(t @ g[b + "gate_proj.weight"].T) * (t @ g[b + "up_proj.weight"].T)) @ g[b + "down_proj.weight"].T

    scores = 1 / (1 + np.exp(-(h @ g["mlp.gate.weight"].T)))
    y = mlp(h, "mlp.shared_experts.")
    for r in range(n):
        top = np.argsort(-(scores[r] + g["mlp.gate.e_score_correction_bias"]), kind="stable")[:2]
        for e in top:
            y[r] += scores[r, e] / scores[r, top].sum() * mlp(h[r : r + 1], f"mlp.experts.{e}.")[0]
    x = rms(x + y, g["shared_head.norm.weight"])
    return x @ g["shared_head.head.weight"].T


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(GGUF)


def test_nextn_head_equals_the_numpy_reference_whole_and_continued(model: Model) -> None:
    """The head over 20 positions (hidden rows shifted as ik's warmup shifts them) equals the reference; running the
    same positions as 8 + 1 + 1 + ... through its cache gives the same logits."""
    tokens = np.random.default_rng(3).integers(0, 336, 20)
    weights = {n: t.to_f32() for n, t in Checkpoint(HF).iter_tensors() if n.startswith("model.layers.3.")}
    assert_head_equals_reference(model, tokens, lambda hidden: reference_head(weights, hidden, tokens), 2e-5)


@pytest.mark.parametrize(("n_max", "p_min"), [(1, 0.0), (3, 0.0), (4, 0.02)])
def test_mtp_speculation_gives_the_targets_greedy_continuation(model: Model, n_max: int, p_min: float) -> None:
    prompt = np.random.default_rng(n_max).integers(0, 336, 12)
    run = mtp_generate(model, prompt, 24, n_max, p_min)
    assert run.output_ids == greedy_continuation(model, prompt, 24)
    assert sum(run.acceptance_lengths) >= 24 and all(1 <= a <= n_max + 1 for a in run.acceptance_lengths)
    assert all(1 <= d <= n_max for d in run.draft_lengths)
    assert set(run.draft_lengths) == {n_max} if p_min == 0 else len(set(run.draft_lengths)) > 1  # p_min cut some


def test_accept_mtp_cli_and_a_file_without_nextn_tensors() -> None:
    res = runner.invoke(app, ["accept", str(GGUF), "--mtp", "--n-max", "2", "--text", str(TEXT), "--prompts", "2",
                              "--prompt-len", "8", "--max-new", "12", "--json"])
    assert res.exit_code == 0, res.output
    assert '"output_matches_target": true' in res.output and '"mean_acceptance_length"' in res.output
    res = runner.invoke(app, ["accept", str(NO_NEXTN), "--mtp", "--text", str(TEXT)])
    assert res.exit_code == 2
    assert str(NO_NEXTN) in res.output and "NextN" in res.output and len(res.output.strip().splitlines()) == 1
    res = runner.invoke(app, ["accept", str(GGUF), "--text", str(TEXT)])
    assert res.exit_code == 2 and "--mtp" in res.output
    res = runner.invoke(app, ["accept", str(GGUF), "--mtp", "--block", "4", "--text", str(TEXT)])
    assert res.exit_code == 2 and "--block" in res.output


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:  # type: ignore[type-arg]
    gguf = Converter(TRAINED / "hf", "f32", "glm4").write(tmp_path_factory.mktemp("mtp") / "f32.gguf")
    return gguf, json.loads((TRAINED / "mtp-oracle.json").read_text())


def test_a_trained_heads_acceptance_equals_the_reference_loop_at_every_step(trained: tuple[Path, dict]) -> None:  # type: ignore[type-arg]
    """tools/make_mtp_head.py's torch loop (whole-sequence forwards, no caches) on the trained head: ikrun drafts,
    accepts and outputs the same at every step of all 6 prompts."""
    gguf, oracle = trained
    assert_drafts_equal_the_reference_loop(Model(gguf), oracle)


def test_imatrix_mtp_collects_the_heads_tensors_by_running_it(model: Model, tmp_path: Path) -> None:
    """`ikrun imatrix --mtp`: the main tensors' entries as without it, the head's block gets entries (ik's gives it
    none), eh_proj's being the mean square of the reference's [enorm(embedding) | hnorm(previous hidden)] rows."""
    plain, with_head = tmp_path / "plain.dat", tmp_path / "mtp.dat"
    for out, extra in ((plain, []), (with_head, ["--mtp"])):
        res = runner.invoke(app, ["imatrix", str(GGUF), "--text", str(TEXT), "--ctx", "32", "--chunks", "3", "-o",
                                  str(out), *extra])
        assert res.exit_code == 0, res.output
    a, b = read_imatrix_dat(plain), read_imatrix_dat(with_head)
    assert not any(n.startswith("blk.3.") for n in a.entries)
    assert {"blk.3.nextn.eh_proj.weight", "blk.3.attn_q.weight", "blk.3.attn_output.weight", "blk.3.ffn_up_exps.weight",
            "blk.3.ffn_down_exps.weight", "blk.3.ffn_gate_shexp.weight"} <= set(b.entries)
    for name, entry in a.entries.items():
        np.testing.assert_array_equal(b.entries[name].values, entry.values)
    w = {n: t.to_f32().astype(np.float64) for n, t in Checkpoint(HF).iter_tensors() if n.startswith("model.layers.3.")}
    rows = []
    for tokens in tokenize_chunks(model, TEXT.read_text(), 32, 3):
        _, features = TargetDecoder(model, [model.impl.n_active - 1]).run(tokens)
        hidden = np.concatenate([np.zeros_like(features[:1]), features[:-1]]).astype(np.float64)
        rows.append(np.concatenate([rms(w["model.layers.3.embed_tokens.weight"][tokens], w["model.layers.3.enorm.weight"]),
                                    rms(hidden, w["model.layers.3.hnorm.weight"])], axis=1))
    x = np.concatenate(rows)
    entry = b.entries["blk.3.nextn.eh_proj.weight"]
    assert entry.ncall == 3
    np.testing.assert_allclose(entry.values, np.mean(x * x, axis=0) * 3, rtol=1e-5)
    res = runner.invoke(app, ["imatrix", str(NO_NEXTN), "--mtp", "--text", str(TEXT), "-o", str(tmp_path / "x.dat")])
    assert res.exit_code == 2 and str(NO_NEXTN) in res.output and not (tmp_path / "x.dat").exists()


def test_numerics_ik_drafts_with_the_models_tables_as_iks_loader_ignores_the_heads(trained: tuple[Path, dict]) -> None:  # type: ignore[type-arg]
    """ik loads this file with "model has unused tensor blk.3.nextn.embed_tokens.weight ... ignoring" (and
    shared_head_head), its MTP graph then falls back to token_embd / output; the default keeps the head's own."""
    gguf, _ = trained
    own, ik = Model(gguf).impl.nextn_head(), Model(gguf, options=RuntimeOptions(numerics="ik")).impl.nextn_head()
    assert (own.embeddings, own.output) == ("blk.3.nextn.embed_tokens.weight", "blk.3.nextn.shared_head_head.weight")
    assert (ik.embeddings, ik.output) == ("token_embd.weight", "output.weight")


@pytest.fixture(scope="module")
def head_sweep(trained: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[type-arg]
    """`ikrun sweep --metric acceptance --mtp` of the trained head: every head tensor at Q4_0 and Q8_0."""
    out = tmp_path_factory.mktemp("head-sweep") / "head.json"
    res = runner.invoke(app, ["sweep", str(trained[0]), "--metric", "acceptance", "--mtp", *DECODING, "--types",
                              "Q4_0,Q8_0", "-o", str(out)])
    assert res.exit_code == 0, res.output
    return out


#: the prompts an acceptance sweep and `accept --mtp` decode in these tests
DECODING = ["--text", str(TEXT), "--prompts", "3", "--prompt-len", "16", "--max-new", "32"]


def _accept(gguf: Path, *extra: str) -> list[dict]:  # type: ignore[type-arg]
    res = runner.invoke(app, ["accept", str(gguf), "--mtp", *DECODING, "--no-check", "--json", *extra])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    return got if isinstance(got, list) else [got]


def test_mtp_acceptance_sweep_rows_are_the_heads_acceptance(trained: tuple[Path, dict], head_sweep: Path,
                                                            tmp_path: Path) -> None:  # type: ignore[type-arg]
    """A head tensor's row is `accept --mtp` on the file with that tensor alone quantized; the whole head's row
    (--group layer) is `accept --mtp --compare`'s figure for the type, below the stored head's."""
    from ikquant.ftypes import file_type
    from ikquant.quantize import QuantizeOptions, quantize_model
    from ikquant.recipes import eligible

    gguf = trained[0]
    data = json.loads(head_sweep.read_text())
    assert data["metric"] == "acceptance" and data["decoding"]["mtp"] == {"n_max": 3, "p_min": 0.0}
    assert data["unmeasured"] == {} and len(data["rows"]) == 26
    w = Model(gguf).weights
    assert {r["group"] for r in data["rows"]} == {n for n in w.names() if n.startswith("blk.3.") and eligible(
        n, w.info(n).n_dims, w.info(n).type)}  # every quantizable tensor of the head, none of the model's
    stored, q4, q8 = _accept(gguf, "--compare", "Q4_0,Q8_0")
    row = next(r for r in data["rows"] if (r["group"], r["type"]) == ("blk.3.nextn.eh_proj.weight", "Q4_0"))
    single = tmp_path / "one.gguf"
    quantize_model(gguf, single, QuantizeOptions(file_type("F32"), pure=True, tensor_types={row["group"]: "Q4_0"}))
    assert _accept(single)[0]["mean_acceptance_length"] == row["acceptance_mean"]
    assert row["acceptance_loss"] == pytest.approx(stored["mean_acceptance_length"] - row["acceptance_mean"],
                                                   abs=1e-12)
    out = tmp_path / "layer.json"
    res = runner.invoke(app, ["sweep", str(gguf), "--metric", "acceptance", "--mtp", *DECODING, "--types",
                              "Q4_0,Q8_0", "--group", "layer", "-o", str(out)])
    assert res.exit_code == 0, res.output
    rows = {r["type"]: r for r in json.loads(out.read_text())["rows"]}
    assert [r["group"] for r in rows.values()] == ["blk.3", "blk.3"]
    assert rows["Q4_0"]["acceptance_mean"] == q4["mean_acceptance_length"] < stored["mean_acceptance_length"]
    assert rows["Q8_0"]["acceptance_mean"] == q8["mean_acceptance_length"]


def test_a_bound_on_the_heads_acceptance_loss_chooses_its_types(trained: tuple[Path, dict], head_sweep: Path,
                                                                tmp_path: Path) -> None:  # type: ignore[type-arg]
    """ikquant --mtp-sweep: a tight bound keeps the head at Q8_0 while the rest goes to Q4_0, a loose one lets the
    head go down to Q4_0, one between mixes both within it; ikrun mix measures the kept file's head."""
    from ikquant.cli import app as ikquant_app

    gguf = trained[0]

    def head_types(bound: str) -> dict[str, str]:
        res = runner.invoke(ikquant_app, [str(gguf), str(tmp_path / "x.gguf"), "--type", "Q4_0", "--mtp-sweep",
                                          str(head_sweep), "--max-acceptance-loss", bound, "--dry-run", "--json"])
        assert res.exit_code == 0, res.output
        plan = json.loads(res.stdout)
        assert {p["type"] for p in plan if p["name"] == "blk.0.attn_q.weight"} == {"q4_0"}
        return {p["name"]: p["type"] for p in plan if p["name"].startswith("blk.3.") and p["type"] != "f32"}

    rows = json.loads(head_sweep.read_text())["rows"]
    q4_loss = sum(max(r["acceptance_loss"], 0.0) for r in rows if r["type"] == "Q4_0")
    tight, loose, middle = head_types("0"), head_types(f"{q4_loss + 0.01}"), head_types(f"{q4_loss / 3}")
    assert len(tight) == 13 and set(tight.values()) == {"q8_0"}
    assert set(loose.values()) == {"q4_0"}
    assert set(middle.values()) == {"q4_0", "q8_0"}
    assert sum(max(r["acceptance_loss"], 0.0) for r in rows if middle[r["group"]] == r["type"].lower()) <= q4_loss / 3
    assert middle["blk.3.ffn_up_exps.weight"] == middle["blk.3.ffn_gate_exps.weight"]  # ik's fused pair stays tied
    kld = tmp_path / "kld.json"
    res = runner.invoke(app, ["sweep", str(gguf), "--text", str(TEXT), "--types", "Q4_0,Q8_0", "--ctx", "32",
                              "--chunks", "2", "--tensors", r"blk\.0\.attn", "-o", str(kld)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["mix", str(gguf), str(tmp_path / "mix.gguf"), "--sweep", str(kld), "--type", "Q4_0",
                              "--target-bpw", "5.85", "--mtp-sweep", str(head_sweep), "--max-acceptance-loss",
                              f"{q4_loss / 3}", "--json"])
    assert res.exit_code == 0, res.output
    head = json.loads(res.stdout)[0]["head"]
    assert head["acceptance"] < head["acceptance_base"] and head["predicted_acceptance_loss"] <= q4_loss / 3
    written = Model(tmp_path / "mix.gguf").weights
    assert {n: written.encoding(n).type.name.lower() for n in middle} == middle


def test_head_sweeps_and_bounds_refuse_bad_input(head_sweep: Path, tmp_path: Path) -> None:
    from ikquant.cli import app as ikquant_app

    cases = [
        (app, ["sweep", str(NO_NEXTN), "--metric", "acceptance", "--mtp", *DECODING, "--types", "Q4_0"], "NextN"),
        (app, ["sweep", str(GGUF), "--mtp", "--text", str(TEXT), "--types", "Q4_0"], "--metric acceptance"),
        (app, ["sweep", str(GGUF), "--metric", "acceptance", "--mtp", "--target", str(GGUF), "--text", str(TEXT),
               "--types", "Q4_0"], "own NextN/MTP head"),
        (app, ["sweep", str(GGUF), "--metric", "acceptance", "--mtp", "--text", str(TEXT), "--prompts", "0",
               "--types", "Q4_0"], "prompts"),
        (app, ["sweep", str(GGUF), "--n-max", "2", "--text", str(TEXT), "--types", "Q4_0"], "--n-max"),
        (app, ["sweep", str(GGUF), "--metric", "acceptance", "--mtp", *DECODING, "--types", "Q4_0", "--tensors",
               r"blk\.0\."], "NextN head"),
        (ikquant_app, [str(GGUF), str(tmp_path / "x.gguf"), "--type", "Q4_0", "--mtp-sweep", str(head_sweep)],
         "--max-acceptance-loss"),
        (ikquant_app, [str(GGUF), str(tmp_path / "x.gguf"), "--type", "Q4_0", "--mtp-sweep", str(head_sweep),
                       "--max-acceptance-loss", "-1"], "--max-acceptance-loss"),
        (ikquant_app, [str(NO_NEXTN), str(tmp_path / "x.gguf"), "--type", "Q4_0", "--mtp-sweep", str(head_sweep),
                       "--max-acceptance-loss", "1"], "not in the model"),
    ]
    kld = tmp_path / "kld.json"
    kld.write_text(head_sweep.read_text().replace('"metric": "acceptance"', '"metric": "kld"'))
    own = tmp_path / "own-kld.json"  # a KLD sweep of GGUF itself, so that only the head sweep is another model's
    res = runner.invoke(app, ["sweep", str(GGUF), "--text", str(TEXT), "--types", "Q4_0,Q8_0", "--ctx", "32",
                              "--chunks", "2", "--tensors", r"blk\.0\.attn_q\.", "-o", str(own)])
    assert res.exit_code == 0, res.output
    cases.append((app, ["mix", str(GGUF), str(tmp_path / "x.gguf"), "--sweep", str(own), "--type", "Q4_0",
                        "--target-bpw", "6", "--mtp-sweep", str(head_sweep), "--max-acceptance-loss", "1"],
                  "another model file"))
    cases.append((ikquant_app, [str(GGUF), str(tmp_path / "x.gguf"), "--type", "Q4_0", "--mtp-sweep", str(kld),
                                "--max-acceptance-loss", "1"], "--metric acceptance --mtp"))
    for cli, args, said in cases:
        res = runner.invoke(cli, args, env={"COLUMNS": "400"})
        assert res.exit_code == 2 and said in res.output and len(res.output.strip().splitlines()) == 1, (args,
                                                                                                         res.output)
    assert not (tmp_path / "x.gguf").exists()
