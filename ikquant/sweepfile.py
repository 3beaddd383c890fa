"""The sweep file `ikrun sweep` writes and `ikquant --sweep` reads: a versioned header, then one row per measurement.

JSON: `{"format": "iktools-sweep", "version": 2, ...header..., "rows": [...]}`. CSV: a first line `# {header as
JSON}`, then a column line and one line per row (a group's tensors joined by `;`). Both resume and both feed
`ikquant --sweep`. The header says what the rows were measured on (model fingerprint, text hash, ctx, batch, chunks,
grouping, imatrix hash, runtime options), so a resumed sweep refuses rows measured on anything else.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path
from typing import Any

from ikquant.errors import InputNotFoundError, SweepFileError

FORMAT = "iktools-sweep"
VERSION = 2
#: header fields a resumed sweep must match exactly (the model's path and the text's name may move)
IDENTITY = ("metric", "cost", "model_fingerprint", "text_sha256", "ctx", "batch", "chunks", "group", "imatrix_sha256",
            "runtime", "decoding")
#: what a header without the field means (files written before the field existed)
DEFAULTS = {"metric": "kld"}
#: what each metric's rows measure, and the column a mix minimises (lower is better, additive across groups) where
#: the header names none (a KLD sweep's header says `"cost": "kld_added"`; older files have only kld_mean)
METRICS = {"kld": "kld_mean", "acceptance": "acceptance_loss"}
CSV_COLUMNS = {
    "kld": ("group", "tensors", "type", "type_used", "n_weights", "bytes_base", "bytes_new", "bpw", "kld_mean",
            "kld_sem", "kld_p99", "same_top_p", "ppl_ratio", "ln_ppl_ratio", "ln_ppl_ratio_err", "seconds", "fallback",
            "measured", "prediction", "basis", "kld_added", "kld_added_sem"),
    "acceptance": ("group", "tensors", "type", "type_used", "n_weights", "bytes_base", "bytes_new", "bpw",
                   "acceptance_mean", "acceptance_loss", "acceptance_first", "seconds", "fallback"),
}
_INTS = {"n_weights", "bytes_base", "bytes_new"}
_STRS = {"group", "type", "type_used"}
#: columns a row may leave empty (written as "", read as None)
_OPTIONAL_STRS = {"fallback", "basis"}
_OPTIONAL_FLOATS = {"prediction"}
_BOOLS = {"measured"}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_sweep_file(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, rows) of a sweep file; a SweepFileError names the file and what is wrong with it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputNotFoundError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise SweepFileError(f"{path}: not a sweep file ({exc})") from None
    try:
        if Path(path).suffix == ".csv":
            first, _, body = text.partition("\n")
            if not first.startswith("# "):
                raise SweepFileError(f"{path}: no '# {{header}}' first line: written by an older ikrun, or not a "
                                     "sweep file; its rows cannot be checked against this run")
            header = json.loads(first[2:])
            rows = [_typed(r) for r in csv.DictReader(io.StringIO(body))]
        else:
            data = json.loads(text)
            rows = data.pop("rows", [])
            header = data
    except (json.JSONDecodeError, KeyError, ValueError) as exc:
        if isinstance(exc, SweepFileError):
            raise
        raise SweepFileError(f"{path}: not a readable sweep file ({exc})") from None
    if header.get("format") != FORMAT:
        raise SweepFileError(f"{path}: no {FORMAT!r} header: written by an older ikrun, or not a sweep file; its rows "
                             "cannot be checked against this run (remove it or write elsewhere)")
    if header.get("version") != VERSION:
        raise SweepFileError(f"{path}: sweep format version {header.get('version')}, this ikrun reads {VERSION}")
    return header, rows


def _typed(row: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in row.items():
        if key == "tensors":
            out[key] = value.split(";")
        elif key in _STRS:
            out[key] = value
        elif key in _OPTIONAL_STRS:
            out[key] = value or None
        elif key in _OPTIONAL_FLOATS:
            out[key] = float(value) if value else None
        elif key in _BOOLS:
            out[key] = value != "False"
        else:
            out[key] = int(value) if key in _INTS else float(value)
    return out


def write_sweep_file(path: Path, header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Write the sweep (JSON, or CSV when the name ends in .csv) under a temporary name, then rename."""
    from ikquant.outputs import output_file

    full = {"format": FORMAT, "version": VERSION, **header}
    if Path(path).suffix == ".csv":
        buf = io.StringIO()
        buf.write("# " + json.dumps(full) + "\n")
        columns = CSV_COLUMNS[header.get("metric", DEFAULTS["metric"])]
        writer = csv.DictWriter(buf, columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for r in rows:
            writer.writerow({**r, "tensors": ";".join(r["tensors"])})
        text = buf.getvalue()
    else:
        text = json.dumps({**full, "rows": rows}, indent=1)
    with output_file(Path(path)) as tmp:
        tmp.write_text(text, encoding="utf-8")


def check_resumable(path: Path, header: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Refuse to resume `path` when its rows were measured on anything else than `header` describes."""
    for key in IDENTITY:
        mine, other = header.get(key, DEFAULTS.get(key)), theirs.get(key, DEFAULTS.get(key))
        if other != mine:
            raise SweepFileError(f"{path} was measured with {key} = {other!r}, this run has "
                                 f"{mine!r}: its rows cannot be reused (remove it or write elsewhere)")
