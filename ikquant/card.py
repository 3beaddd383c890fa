"""`ikquant card`: a Hugging Face model card (README.md) for a quantized GGUF, from what the file says about itself
(its metadata, tensor types, imatrix provenance, shards) and what was measured on it (`ikrun kld --json` results)
and how it was made (a `--recipe-out` file)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from ikquant.errors import InputNotFoundError, MetadataError
from ikquant.ftypes import all_file_types
from ikquant.shards import GGUFModel

#: the statistics a --kld file must hold (ikrun kld --json)
KLD_KEYS = ("n_tokens", "ppl_q", "ppl_q_err", "ppl_base", "kld_mean", "kld_mean_err", "same_top_p")


def read_kld(path: Path) -> dict[str, Any]:
    """One `ikrun kld --json` result."""
    if not path.is_file():
        raise InputNotFoundError(f"--kld {path}: no such file")
    try:
        stats = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MetadataError(f"--kld {path}: not a JSON file ({exc})") from None
    missing = [k for k in KLD_KEYS if not isinstance(stats, dict) or k not in stats]
    if missing:
        raise MetadataError(f"--kld {path}: no {missing[0]!r}: not an `ikrun kld --json` result")
    return stats


def _base_models(model: GGUFModel) -> list[str]:
    """The base models as hub ids (org/name) where the file names their repositories, else their names."""
    out = []
    for i in range(int(model.get("general.base_model.count", 0) or 0)):
        url = str(model.get(f"general.base_model.{i}.repo_url", "") or "")
        m = re.fullmatch(r"https?://huggingface\.co/([^/]+/[^/]+)/?", url)
        if m:
            out.append(m.group(1))
        elif model.get(f"general.base_model.{i}.name"):
            org = model.get(f"general.base_model.{i}.organization")
            name = str(model.get(f"general.base_model.{i}.name"))
            out.append(f"{org}/{name}" if org else name)
    return out


def _tensor_classes(model: GGUFModel) -> list[tuple[str, str, int]]:
    """(tensor class, its types with counts, bytes), classes in file order: blk.N. prefixes dropped."""
    types: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    sizes: dict[str, int] = defaultdict(int)
    for name, info in model.tensors.items():
        cls = re.sub(r"^blk\.\d+\.", "", name)
        types[cls][info.type.ggml_name] += 1
        sizes[cls] += info.nbytes
    return [(cls, ", ".join(f"{t} ×{n}" for t, n in counts.items()), sizes[cls]) for cls, counts in types.items()]


def model_card(model: GGUFModel, klds: list[tuple[str, dict[str, Any]]], recipe: str | None = None) -> str:
    """The README.md text for `model` (the first shard of a split model, or the file)."""
    ftype_id = model.get("general.file_type")
    if ftype_id is None:
        raise MetadataError(f"{model.path}: no general.file_type: a card describes a file ikquant or ik's "
                            "llama-quantize wrote")
    ftype = next((f.name for f in all_file_types() if f.id == int(ftype_id)), f"file type {ftype_id}")
    name = str(model.get("general.name") or model.path.stem)
    imatrix = model.get("quantize.imatrix.file")
    bases = _base_models(model)
    front = ["---"]
    if bases:
        front += ["base_model:", *(f"- {b}" for b in bases), "base_model_relation: quantized"]
    if model.get("general.license"):
        front.append(f"license: {model.get('general.license')}")
    front += ["pipeline_tag: text-generation", "tags:", "- ik_llama.cpp", *(["- imatrix"] if imatrix else []),
              "- gguf", "---", ""]
    n_weights = sum(t.n_elements for t in model.tensors.values())
    tensor_bytes = sum(t.nbytes for t in model.tensors.values())
    file_bytes = sum(s.path.stat().st_size for s in model.shards)
    first = model.path.name
    body = [f"# {name}: {ftype} GGUF for ik_llama.cpp", ""]
    if bases:
        source = f"[{bases[0]}](https://huggingface.co/{bases[0]})" if "/" in bases[0] else bases[0]
        body += [f"Quantized from {source} with iktools, in ik_llama.cpp's formats.", ""]
    body += ["| file type | size | bits per weight | tensors | files |", "|---|---|---|---|---|",
             f"| {ftype} | {file_bytes / 2**30:.2f} GiB ({file_bytes} bytes) | {8 * tensor_bytes / n_weights:.4f} | "
             f"{len(model.tensors)} | {len(model.shards)} |", ""]
    body += ["## Tensor types", "", "| tensor | types | MiB |", "|---|---|---|"]
    body += [f"| {cls} | {types} | {size / 2**20:.2f} |" for cls, types, size in _tensor_classes(model)]
    body += ["", "## Importance matrix", ""]
    if imatrix is None:
        body.append("None: quantized without importance data.")
    elif imatrix == "top_secret":
        body.append("Used, its provenance hidden (`--hide-imatrix`).")
    else:
        dataset = model.get("quantize.imatrix.dataset")
        body.append(f"`{Path(str(imatrix)).name}`: {model.get('quantize.imatrix.entries_count')} entries"
                    + (f", {model.get('quantize.imatrix.chunks_count')} chunks" if model.get(
                        "quantize.imatrix.chunks_count") else "")
                    + (f", from `{dataset}`" if dataset else "") + ".")
    if klds:
        body += ["", "## Measured", "", "Against the unquantized model on the same text (`ikrun kld`):", "",
                 "| file | tokens | PPL | base PPL | mean KLD | same top token |", "|---|---|---|---|---|---|"]
        for label, s in klds:
            body.append(f"| {label} | {s['n_tokens']} | {s['ppl_q']:.4f} ± {s['ppl_q_err']:.4f} | "
                        f"{s['ppl_base']:.4f} | {s['kld_mean']:.6f} ± {s['kld_mean_err']:.6f} | "
                        f"{100 * s['same_top_p']:.2f}% |")
    offload = [line[2:] for line in (recipe or "").splitlines() if line.startswith("# -ot ")]
    body += ["", "## Running it", "", "```bash",
             f"llama-server -m {first} -ngl 999" + "".join(f" {o}" for o in offload) if offload else
             f"llama-server -m {first}", "```"]
    if len(model.shards) > 1:
        body.append(f"\nName the first shard; ik_llama.cpp finds the other {len(model.shards) - 1}.")
    if recipe:
        body += ["", "## Recipe", "", "Per-tensor types as `--custom-q` rules (`ikquant ... --custom-q \"$(grep -v "
                 "'^#' recipe.txt | paste -sd, -)\"` reproduces the file):", "", "```", recipe.rstrip("\n"), "```"]
    body += ["", "## Files", "", "| file | bytes |", "|---|---|"]
    body += [f"| {s.path.name} | {s.path.stat().st_size} |" for s in model.shards]
    return "\n".join(front + body) + "\n"
