"""Loading the ik golden quantization cases (tests/data/quant/<TYPE>/manifest.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QUANT_DIR = Path(__file__).parent / "data" / "quant"


@dataclass
class GoldenCase:
    type_name: str
    name: str
    x: np.ndarray
    imatrix: np.ndarray | None
    quant: np.ndarray
    dequant: np.ndarray
    user_data: dict | None
    manifest: dict

    @property
    def n_per_row(self) -> int:
        return self.x.shape[1]


def golden_types() -> list[str]:
    return sorted(p.name for p in QUANT_DIR.iterdir() if (p / "manifest.json").is_file())


def golden_cases(type_name: str) -> list[GoldenCase]:
    folder = QUANT_DIR / type_name
    manifest = json.loads((folder / "manifest.json").read_text())
    cases = []
    for case in manifest["cases"]:
        files = case["files"]
        n, rows = case["row_length"], case["n_rows"]
        x = np.fromfile(folder / files["input"], dtype=np.float32).reshape(rows, n)
        w = np.fromfile(folder / files["imatrix"], dtype=np.float32) if "imatrix" in files else None
        q = np.fromfile(folder / files["quant"], dtype=np.uint8).reshape(rows, -1)
        d = np.fromfile(folder / files["dequant"], dtype=np.float32).reshape(rows, n)
        cases.append(GoldenCase(type_name, case["name"], x, w, q, d, case.get("user_data"), case))
    return cases


def weighted_rmse(x: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> float:
    """RMSE weighted per column by the importance vector (plain RMSE without one), as the manifest computes it."""
    wv = np.ones(x.shape[1], dtype=np.float64) if w is None else w.astype(np.float64)
    err = (x.astype(np.float64) - y.astype(np.float64)) ** 2
    return float(np.sqrt((err * wv).sum() / (wv.sum() * x.shape[0])))
