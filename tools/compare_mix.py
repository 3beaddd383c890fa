#!/usr/bin/env python3
"""A sweep's mix against a recipe at the same size: mean KLD of both assembled files, and the mix's prediction.

Generates (or takes with --model) an F32 model, collects its imatrix, sweeps every tensor at --types, then for each
--ftypes: quantizes by the recipe (--recipe ik or mainline), builds the sweep's mix with --target-size equal to the
recipe file's tensor bytes (`ikrun mix`, which also measures it and can --refine), and measures the recipe file's
KLD against the same base logits. Everything is measured on the sweep's own chunks (in-sample).

Example: python tools/compare_mix.py --recipe mainline --ftypes Q3_K_M,Q4_K_M --types Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,Q8_0
"""

from __future__ import annotations

import argparse
import json
import tempfile
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an F32/F16 GGUF (default: a generated 4-layer 256-wide Qwen3)")
    ap.add_argument("--recipe", default="ik", choices=("ik", "mainline"))
    ap.add_argument("--ftypes", default="IQ3_K,IQ4_KS")
    ap.add_argument("--types", default="IQ2_KS,IQ3_K,IQ4_KS,IQ5_K,Q8_0")
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--refine", type=int, default=0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = a.model or Converter(make_tiny_checkpoint(folder / "hf", TinySpec(
            arch="qwen3", hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=768, seed=11)), "f32",
            "qwen2").write(folder / "m-f32.gguf")
        text = folder / "text.txt"
        text.write_text(CORPUS.read_text(encoding="utf-8") * 2, encoding="utf-8")
        imatrix, sweep, base = folder / "imatrix.dat", folder / "sweep.json", folder / "base.kld"
        common = ["--text", str(text), "--ctx", str(a.ctx), "--chunks", str(a.chunks)]
        _ok(ikrun_app, ["imatrix", str(model), *common, "-o", str(imatrix)])
        _ok(ikrun_app, ["sweep", str(model), *common, "--types", a.types, "--imatrix", str(imatrix), "-o", str(sweep)])
        _ok(ikrun_app, ["kld", str(model), "--base", str(model), *common, "--save-base-logits", str(base)])
        n_weights = sum(t.n_elements for t in GGUFFile(model).tensors.values())
        print(f"| target | {a.recipe}'s recipe: bytes, bpw, mean KLD | sweep mix: bytes, bpw, mean KLD | mix predicted |")
        print("|---|---|---|---|")
        for ftype in a.ftypes.split(","):
            recipe_file = folder / f"recipe-{ftype}.gguf"
            _ok(ikquant_app, [str(model), str(recipe_file), "--type", ftype, "--recipe", a.recipe, "--imatrix",
                              str(imatrix)])
            size = sum(t.nbytes for t in GGUFFile(recipe_file).tensors.values())
            kld = json.loads(_ok(ikrun_app, ["kld", str(recipe_file), "--base-logits", str(base), "--json"]).stdout)
            res = _ok(ikrun_app, ["mix", str(model), str(folder / f"mix-{ftype}.gguf"), "--sweep", str(sweep),
                                  "--type", ftype, "--recipe", a.recipe, "--target-size", f"{size}B", "--refine",
                                  str(a.refine), "--json"])
            mixes = json.loads(res.stdout)
            kept = next(m for m in mixes if m["kept"])
            print(f"| {ftype} | {size}, {8 * size / n_weights:.4f}, {kld['kld_mean']:.6f} ± {kld['kld_mean_err']:.6f} "
                  f"| {kept['bytes']}, {kept['bpw']:.4f}, {kept['kld_mean']:.6f} ± {kept['kld_mean_err']:.6f} "
                  f"| {kept['predicted_kld']:.6f} ({kept['mix']}) |")


if __name__ == "__main__":
    main()
