#!/usr/bin/env python3
"""A sweep's mix against a recipe at the same size: mean KLD of both assembled files, and the mix's prediction.

Generates (or takes with --model) an F32 model, collects its imatrix on --text, sweeps every tensor at --types on
--text (the exhaustive sweep, and with --sweeps pruned a `--target-bpw` sweep at the recipes' sizes), then for each
--ftypes: quantizes by the recipe (--recipe ik or mainline), builds each sweep's mix with --target-size equal to
the recipe file's tensor bytes (`ikrun mix`, which also measures it and can --refine), and measures the recipe
file's KLD against the same base logits. With --eval-text every KLD in the table is measured on that held-out text
(the imatrix and sweeps never see it), --eval-chunks of it (more than the sweeps' --chunks narrows the ±), the mixes
by `ikrun kld` against the same base logits as the recipes; without, on the sweep's own chunks (in-sample). --tie and
--refine go to `ikrun mix` (the sweeps are made without ties); --mix-types lets the mixes choose among those swept
types only (from a copy of each sweep without the other types' rows). --sweeps spread adds a
`--target-bpw ... --prediction-spread F` sweep (--spread F), --sweeps resolved the same with `--resolution K`
(--resolution K). With --eval-text and the exhaustive sweep, each other sweep's mix is also scored against the
exhaustive sweep's mix token by token (`ikrun kld --versus`): the ratio of their KLDs with its paired error.
--eval-text2 (a second held-out text, e.g. train_lm.py's eval2.txt) adds both figures measured on it.
--reuse keeps what --workdir already holds (imatrix, base logits, recipe files and their KLDs, sweeps and their CPU
seconds) and measures only what is missing.

Example: python tools/compare_mix.py --recipe mainline --ftypes Q3_K_M,Q4_K_M --types Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,Q8_0
         python tools/compare_mix.py --model lm-f32.gguf --text calib.txt --eval-text eval.txt \
             --ftypes IQ3_K,IQ4_KS,Q4_K_M --types IQ2_KS,IQ3_KS,IQ4_KS,Q6_K --sweeps exhaustive,pruned
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from typer.testing import CliRunner

from ikconvert import CORPUS, Converter, TinySpec, make_tiny_checkpoint
from ikquant import GGUFFile
from ikquant import app as ikquant_app
from ikrun import app as ikrun_app

runner = CliRunner()


def _ok(app, args: list[str]):  # type: ignore[no-untyped-def]
    res = runner.invoke(app, args, env={"COLUMNS": "200"})
    if res.exit_code != 0:
        raise SystemExit(f"{' '.join(args[:2])}: {res.output}")
    return res


def only_types(sweep: Path, types: list[str]) -> Path:
    """A copy of `sweep` (beside it) without the rows of types other than `types`."""
    data = json.loads(sweep.read_text())
    data["rows"] = [r for r in data["rows"] if r["type"] in types]
    out = sweep.with_name(f"{sweep.stem}-{'-'.join(types)}.json")
    out.write_text(json.dumps(data))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an F32/F16 GGUF (default: a generated 4-layer 256-wide Qwen3)")
    ap.add_argument("--text", type=Path, help="imatrix and sweep text (default: the tiny corpus twice)")
    ap.add_argument("--eval-text", type=Path, help="held-out text every KLD in the table is measured on")
    ap.add_argument("--eval-text2", type=Path, help="a second held-out text (with --eval-text): every KLD measured "
                    "on it too, in two more columns")
    ap.add_argument("--recipe", default="ik", choices=("ik", "mainline"))
    ap.add_argument("--ftypes", default="IQ3_K,IQ4_KS")
    ap.add_argument("--types", default="IQ2_KS,IQ3_K,IQ4_KS,IQ5_K,Q8_0")
    ap.add_argument("--sweeps", default="exhaustive", help="exhaustive, pruned, spread, resolved (comma-separated)")
    ap.add_argument("--spread", default="2", help="the spread and resolved sweeps' --prediction-spread")
    ap.add_argument("--resolution", default="1", help="the resolved sweep's --resolution")
    ap.add_argument("--reuse", action="store_true", help="keep the files --workdir already holds")
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--eval-chunks", type=int, help="chunks of --eval-text to measure on (default: --chunks)")
    ap.add_argument("--refine", type=int, default=0)
    ap.add_argument("--tie", action="append", default=[], help="REGEX for ikrun mix --tie (repeatable)")
    ap.add_argument("--mix-types", help="comma-separated swept types the mixes may choose (default: all)")
    ap.add_argument("--workdir", type=Path, help="keep the files here (default: a temporary folder)")
    a = ap.parse_args()
    kinds = a.sweeps.split(",")
    if not set(kinds) <= {"exhaustive", "pruned", "spread", "resolved"}:
        raise SystemExit(f"--sweeps {a.sweeps}: exhaustive, pruned, spread, resolved")
    if a.reuse and a.workdir is None:
        raise SystemExit("--reuse keeps the files of a --workdir")
    if a.eval_text2 and not a.eval_text:
        raise SystemExit("--eval-text2 is a second held-out text: give --eval-text too")
    with tempfile.TemporaryDirectory() as tmp:
        folder = a.workdir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        model = a.model or Converter(make_tiny_checkpoint(folder / "hf", TinySpec(
            arch="qwen3", hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=768, seed=11)), "f32",
            "qwen2").write(folder / "m-f32.gguf")
        text = a.text or folder / "text.txt"
        if a.text is None:
            text.write_text(CORPUS.read_text(encoding="utf-8") * 2, encoding="utf-8")
        imatrix, base = folder / "imatrix.dat", folder / "base.kld"
        shape = ["--ctx", str(a.ctx), "--chunks", str(a.chunks)]
        common = ["--text", str(text), *shape]
        def missing(path: Path) -> bool:
            return not (a.reuse and path.exists())

        if missing(imatrix):
            _ok(ikrun_app, ["imatrix", str(model), *common, "-o", str(imatrix)])
        eval_shape = ["--ctx", str(a.ctx), "--chunks", str(a.eval_chunks or a.chunks)] if a.eval_text else shape
        base2 = folder / "base2.kld"
        for logits, held_out in ((base, a.eval_text or text), (base2, a.eval_text2)):
            if held_out and missing(logits):
                _ok(ikrun_app, ["kld", str(model), "--base", str(model), "--text", str(held_out), *eval_shape,
                                "--save-base-logits", str(logits)])

        def kld_of(gguf: Path, logits: Path, versus: list[str]) -> dict:  # type: ignore[type-arg]
            return json.loads(_ok(ikrun_app, ["kld", str(gguf), "--base-logits", str(logits), "--json",
                                              *versus]).stdout)

        def against(judged: dict) -> str:  # type: ignore[type-arg]
            """A file's KLD against the exhaustive mix's, token by token (`ikrun kld --versus`), or -."""
            pair = judged.get("versus")
            return f"{pair['kld_ratio'] - 1:+.1%} ± {pair['kld_ratio_err']:.1%}" if pair else "-"

        def second(judged: dict | None) -> str:  # type: ignore[type-arg]
            """The two columns of --eval-text2: a file's KLD there, and against the exhaustive mix."""
            if judged is None:
                return ""
            return f" {judged['kld_mean']:.3e} ± {judged['kld_mean_err']:.3e} | {against(judged)} |"

        n_weights = sum(t.n_elements for t in GGUFFile(model).tensors.values())
        recipes = {}
        for ftype in a.ftypes.split(","):
            recipe_file = folder / f"recipe-{ftype}.gguf"
            if missing(recipe_file):
                _ok(ikquant_app, [str(model), str(recipe_file), "--type", ftype, "--recipe", a.recipe, "--imatrix",
                                  str(imatrix)])
            size = sum(t.nbytes for t in GGUFFile(recipe_file).tensors.values())
            klds = []
            for measured, logits in ((folder / f"recipe-{ftype}.kld.json", base),
                                     (folder / f"recipe-{ftype}.kld2.json", base2 if a.eval_text2 else None)):
                if logits is not None and missing(measured):
                    measured.write_text(json.dumps(kld_of(recipe_file, logits, [])))
                klds.append(json.loads(measured.read_text()) if logits is not None else None)
            recipes[ftype] = (size, *klds)
        sweeps = {}
        for kind in kinds:
            sweep, seconds = folder / f"sweep-{kind}.json", folder / f"sweep-{kind}.cpu"
            budgets = ["--target-bpw", ",".join(repr(8 * s / n_weights) for s, *_ in recipes.values())]
            spread = [*budgets, "--prediction-spread", a.spread]
            extra = {"exhaustive": [], "pruned": budgets, "spread": spread,
                     "resolved": [*spread, "--resolution", a.resolution]}
            if missing(sweep) or missing(seconds):
                sweep.unlink(missing_ok=True)
                t0 = time.process_time()
                _ok(ikrun_app, ["sweep", str(model), *common, "--types", a.types, "--imatrix", str(imatrix), "-o",
                                str(sweep), *extra[kind]])
                seconds.write_text(f"{time.process_time() - t0:.1f}")
            rows = json.loads(sweep.read_text())["rows"]
            cpu = float(seconds.read_text())
            if a.mix_types:
                sweep = only_types(sweep, a.mix_types.split(","))
            sweeps[kind] = (sweep, f"{sum(1 for r in rows if r.get('measured', True))}/{len(rows)}", cpu)
        where = f"held-out ({a.eval_text.name})" if a.eval_text else "in-sample"
        paired = bool(a.eval_text) and "exhaustive" in sweeps
        also = (f" KLD, held-out ({a.eval_text2.name}) | vs exhaustive mix there |" if a.eval_text2 else "")
        print(f"\n| target | mix | bytes | bpw | predicted | measured KLD, {where} | rows measured | CPU s |"
              + (" vs exhaustive mix, paired |" if paired else "") + also)
        print("|---|---|---|---|---|---|---|---|" + ("---|" if paired else "") + ("---|---|" if also else ""))
        ties = [arg for regex in a.tie for arg in ("--tie", regex)]
        for ftype, (size, kld, kld2) in recipes.items():
            print(f"| {ftype} | {a.recipe}'s recipe | {size} | {8 * size / n_weights:.4f} | - | "
                  f"{kld['kld_mean']:.3e} ± {kld['kld_mean_err']:.3e} | - | - |" + (" |" if paired else "")
                  + second(kld2))
            exhaustive_mix = folder / f"mix-exhaustive-{ftype}.gguf"
            for kind, (sweep, measured, cpu) in sorted(sweeps.items(), key=lambda kv: kv[0] != "exhaustive"):
                mix_file = folder / f"mix-{kind}-{ftype}.gguf"
                res = _ok(ikrun_app, ["mix", str(model), str(mix_file), "--sweep", str(sweep), "--type", ftype,
                                      "--recipe", a.recipe, "--target-size", f"{size}B", "--refine", str(a.refine),
                                      "--json", *ties])
                kept = next(m for m in json.loads(res.stdout) if m["kept"])
                versus = ["--versus", str(exhaustive_mix)] if paired and kind != "exhaustive" else []
                judged = kld_of(mix_file, base, versus) if a.eval_text else kept
                print(f"| {ftype} | {kind} sweep's mix | {kept['bytes']} | {kept['bpw']:.4f} | "
                      f"{kept['predicted_kld']:.3e} | {judged['kld_mean']:.3e} ± {judged['kld_mean_err']:.3e} "
                      f"({judged['kld_mean'] / kld['kld_mean'] - 1:+.0%}) | {measured} | {cpu:.0f} |"
                      + (f" {against(judged)} |" if paired else "")
                      + second(kld_of(mix_file, base2, versus) if a.eval_text2 else None))

if __name__ == "__main__":
    main()
