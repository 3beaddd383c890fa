"""Importance matrices in ik's legacy .dat layout: read, write, and ik's per-tensor lookup.

The stored value is mean(x^2)*ncall per column (per expert or head slice); readers divide by ncall. llama-quantize
finds a tensor's entry by its exact name, then by a few fallbacks (gate -> up, merged/unmerged expert names,
attn_v_b <-> attn_kv_b), and requires exactly ne0*ne2 values.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ikquant.errors import GGUFFormatError, ImatrixError, InputNotFoundError


@dataclass
class ImatrixEntry:
    values: np.ndarray  # stored sums: mean(x^2) * ncall
    ncall: int

    def mean_sq(self) -> np.ndarray:
        """Per-column mean of x^2, what the quantizers take (no division when ncall <= 0, as ik)."""
        return self.values / np.float32(self.ncall) if self.ncall > 0 else self.values.copy()


@dataclass
class Imatrix:
    entries: dict[str, ImatrixEntry] = field(default_factory=dict)
    chunks: int = -1
    dataset: str = ""
    path: Path | None = None

    def lookup(self, name: str, n_per_row: int, n_mat: int = 1, n_rows: int = 1) -> tuple[np.ndarray | None, str | None]:
        """ik's lookup for tensor `name`: (importance [n_groups, n_per_row], entry name used), or (None, None).

        An entry holds ne0 values per matrix (per expert of a 3-D tensor: n_groups = n_mat). MLA's attn_k_b/attn_v_b
        are stored 2-D (all heads' rows stacked) while the runtime multiplies them per head, so their entries hold
        one ne0 slice per head: each slice then serves its head's block of rows (n_groups = heads). ik's quantizer
        cannot use such entries (it wants exactly ne0 values), which is why ik's own imatrix hides them under a
        "(reshaped)" name.
        """
        entry_name = None
        for candidate in _candidates(name):
            if candidate in self.entries:
                entry_name = candidate
                break
        if entry_name is None:
            return None, None
        values = self.entries[entry_name].mean_sq()
        groups = values.size // n_per_row if values.size % n_per_row == 0 else 0
        per_head = (n_mat == 1 and groups > 1 and n_rows % groups == 0
                    and name.endswith((".attn_k_b.weight", ".attn_v_b.weight")))
        if groups != n_mat and not per_head:
            if name == "token_embd.weight":
                return None, None
            raise ImatrixError(f"{self.path}: entry {entry_name!r} has {values.size} values, tensor {name!r} needs "
                               f"{n_per_row * n_mat}: is this imatrix for another model?")
        if not np.isfinite(values).all():
            raise ImatrixError(f"{self.path}: entry {entry_name!r} contains non-finite values")
        return values.astype(np.float32).reshape(groups, n_per_row), entry_name


def _candidates(name: str) -> list[str]:
    out = [name]
    for part in ("ffn_up_exps.weight", "ffn_gate_exps.weight"):
        if part in name:
            stem = name[: name.index(part)]
            return out + [stem + "ffn_gate_up_exps.weight", stem + "ffn_up_exps.weight"]
    if "ffn_gate_up_exps.weight" in name:
        return out + [name.replace("ffn_gate_up_exps.weight", "ffn_up_exps.weight")]
    if "ffn_gate.weight" in name:
        return out + [name[: name.index("ffn_gate.weight")] + "ffn_up.weight"]
    for a, b in ((".attn_v_b.weight", ".attn_kv_b.weight"), (".attn_kv_b.weight", ".attn_v_b.weight")):
        if a in name:
            return out + [name.replace(a, b)]
    return out


def read_imatrix_dat(path: str | os.PathLike[str]) -> Imatrix:
    """Read ik's legacy .dat (entries, then the optional chunk-count/dataset trailer)."""
    p = Path(path)
    data = p.read_bytes()
    pos = 0

    def take(fmt: str) -> tuple:
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise ImatrixError(f"{p}: truncated at byte {pos}")
        vals = struct.unpack_from(fmt, data, pos)
        pos += size
        return vals

    (n_entries,) = take("<i")
    if n_entries < 1:
        raise ImatrixError(f"{p}: no entries (is it a .dat imatrix?)")
    imat = Imatrix(path=p)
    for _ in range(n_entries):
        (name_len,) = take("<i")
        if not 0 < name_len < 4096:
            raise ImatrixError(f"{p}: implausible name length {name_len} at byte {pos - 4}")
        name = data[pos : pos + name_len].decode("utf-8", errors="replace")
        pos += name_len
        ncall, nval = take("<ii")
        if nval < 1:
            raise ImatrixError(f"{p}: entry {name!r} has {nval} values")
        if pos + 4 * nval > len(data):
            raise ImatrixError(f"{p}: entry {name!r} is truncated")
        values = np.frombuffer(data, dtype="<f4", count=nval, offset=pos).copy()
        pos += 4 * nval
        imat.entries[name] = ImatrixEntry(values, ncall)
    if pos + 8 <= len(data):
        (imat.chunks,) = take("<i")
        (ds_len,) = take("<i")
        imat.dataset = data[pos : pos + ds_len].decode("utf-8", errors="replace")
    return imat


def write_imatrix_dat(path: str | os.PathLike[str], imat: Imatrix) -> None:
    """Write ik's legacy .dat layout (with the trailer, as ik always writes it), atomically."""
    from ikquant.outputs import output_file

    with output_file(Path(path)) as tmp, open(tmp, "wb") as fh:
        fh.write(struct.pack("<i", len(imat.entries)))
        for name, entry in imat.entries.items():
            raw = name.encode("utf-8")
            fh.write(struct.pack("<i", len(raw)) + raw)
            fh.write(struct.pack("<ii", entry.ncall, entry.values.size))
            fh.write(np.ascontiguousarray(entry.values, dtype="<f4").tobytes())
        ds = imat.dataset.encode("utf-8")
        fh.write(struct.pack("<ii", imat.chunks, len(ds)) + ds)


def read_imatrix_gguf(path: str | os.PathLike[str]) -> Imatrix:
    """Read mainline llama.cpp's GGUF imatrix (`<name>.in_sum2` sums + `<name>.counts` per matrix).

    Each matrix's columns become mean(x^2) = sums / count with that matrix's own count (ik's converter divides every
    expert by expert 0's count); a matrix that no token reached reads as all ones, as ik's .dat writer stores it.
    """
    from ikquant.gguf_io import GGUFFile

    p = Path(path)
    try:
        g = GGUFFile(p)
    except GGUFFormatError as exc:
        raise ImatrixError(str(exc)) from None
    sums: dict[str, str] = {}
    counts: dict[str, str] = {}
    for name in g.tensors:
        for suffix in (".in_sum2", ".sums"):
            if name.endswith(suffix):
                sums[name[: -len(suffix)]] = name
        if name.endswith(".counts"):
            counts[name[: -len(".counts")]] = name
    if not sums:
        raise ImatrixError(f"{p}: no '<tensor>.in_sum2' tensors: not a GGUF imatrix")
    imat = Imatrix(path=p, chunks=int(g.get("imatrix.chunk_count", -1) or -1))
    datasets = g.get("imatrix.datasets") or []
    imat.dataset = str(datasets[0]) if datasets else ""
    for base, sums_name in sums.items():
        s = g.dequantize(sums_name).astype(np.float64)
        s = s.reshape(-1, s.shape[-1])
        if base not in counts:
            raise ImatrixError(f"{p}: {sums_name!r} has no {base + '.counts'!r} tensor")
        c = g.dequantize(counts[base]).astype(np.float64).reshape(-1)
        if c.size != s.shape[0]:
            raise ImatrixError(f"{p}: {base!r} has {s.shape[0]} matrices but {c.size} counts")
        mean = np.ones_like(s)
        reached = c > 0
        mean[reached] = s[reached] / c[reached, None]
        imat.entries[base] = ImatrixEntry(mean.reshape(-1).astype(np.float32), 1)
    return imat


def read_imatrix(path: str | os.PathLike[str]) -> Imatrix:
    """ik's .dat, or mainline's GGUF imatrix (told apart by the GGUF magic)."""
    p = Path(path)
    if not p.is_file():
        raise InputNotFoundError(f"{p}: no such file")
    with open(p, "rb") as fh:
        magic = fh.read(4)
    return read_imatrix_gguf(p) if magic == b"GGUF" else read_imatrix_dat(p)


def filter_entries(imat: Imatrix, include: list[str], exclude: list[str]) -> Imatrix:
    """ik's --include-weights / --exclude-weights: substring tests on entry names (they cannot be combined)."""
    if include and exclude:
        raise ImatrixError("--include-weights and --exclude-weights cannot be combined")
    if include:
        entries = {k: v for k, v in imat.entries.items() if any(s in k for s in include)}
    elif exclude:
        entries = {k: v for k, v in imat.entries.items() if not any(s in k for s in exclude)}
    else:
        return imat
    return Imatrix(entries, imat.chunks, imat.dataset, imat.path)


def write_imatrix_gguf(path: str | os.PathLike[str], sums: dict[str, np.ndarray], counts: dict[str, np.ndarray],
                       chunks: int, chunk_size: int, dataset: str) -> None:
    """Write mainline llama.cpp's GGUF imatrix: per entry `<name>.in_sum2` [n_mat, ne0] (sums of x^2) and
    `<name>.counts` [n_mat, 1] (activation rows), with the imatrix.* keys."""
    from gguf import GGUFValueType

    from ikquant.gguf_io import GGUFStreamWriter, KeyValue
    from ikquant.types import type_by_name

    f32 = type_by_name("F32")
    with GGUFStreamWriter(path, "imatrix") as w:
        w.gw.kv_data[0].pop("general.architecture", None)  # an imatrix file has no architecture
        w.add_kv(KeyValue("general.type", "imatrix", GGUFValueType.STRING))
        w.add_kv(KeyValue("imatrix.datasets", [dataset] if dataset else [], GGUFValueType.ARRAY,
                          GGUFValueType.STRING))
        w.add_kv(KeyValue("imatrix.chunk_count", int(chunks), GGUFValueType.UINT32))
        w.add_kv(KeyValue("imatrix.chunk_size", int(chunk_size), GGUFValueType.UINT32))
        arrays = {}
        for name in sums:
            arrays[name + ".in_sum2"] = np.asarray(sums[name], dtype=np.float32).reshape(len(counts[name]), -1)
            arrays[name + ".counts"] = np.asarray(counts[name], dtype=np.float32).reshape(-1, 1)
        for name, a in arrays.items():
            w.add_tensor_info(name, a.shape, f32)
        for name, a in arrays.items():
            w.write_tensor(name, a)
        w.finish()
