"""Loading the ik golden quantization cases (tests/data/quant/<TYPE>/manifest.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ikquant.types import type_by_name

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


#: IQ1_BN's trit j of a byte b is the top trit of (b * 3^(4 - j)) mod 256
IQ1_BN_MULT = np.array([81, 27, 9, 3, 1], dtype=np.int64)


def _iq1_bn_codes(blocks: np.ndarray) -> np.ndarray:
    """[n_blocks, 64] codes (-1, 0, 1) of IQ1_BN blocks [n_blocks, 13], as ik's dequantize_row_iq1_bn computes them."""

    def trit(b: np.ndarray, mult: int) -> np.ndarray:
        v = (b.astype(np.int64) * mult) & 0xFF
        return ((v + (v >> 1)) >> 7) - 1

    out = np.empty((blocks.shape[0], 64), dtype=np.float32)
    for g in range(4):
        for k in range(3):
            for j in range(5):
                out[:, 16 * g + 5 * k + j] = trit(blocks[:, 3 * g + k], int(IQ1_BN_MULT[j]))
        out[:, 16 * g + 15] = trit(blocks[:, 12], int(IQ1_BN_MULT[g]))
    return out


def _iq2_bn_codes(blocks: np.ndarray) -> np.ndarray:
    """[n_blocks, 64] codes of IQ2_BN blocks [n_blocks, 16]: ik's d_s * (byte & (3 << 2s)) - 1, d_s = 4^-s."""
    b = blocks.astype(np.int64)
    parts = [np.float32(0.25**s) * (b & (3 << 2 * s)).astype(np.float32) - np.float32(1.0) for s in range(4)]
    return np.concatenate(parts, axis=1).astype(np.float32)


def header_blind_to_float(type_name: str, data: np.ndarray, n: int) -> np.ndarray:
    """ik's CPU to_float for IQ1_BN / IQ2_BN on `data` (the bytes at the row pointer): n / 64 blocks read from its
    first byte, unscaled."""
    gtype = type_by_name(type_name)
    blocks = data[: n // 64 * gtype.type_size].reshape(-1, gtype.type_size)
    codes = _iq1_bn_codes(blocks) if type_name == "IQ1_BN" else _iq2_bn_codes(blocks)
    return codes.reshape(-1)


def row_scale(type_name: str, row: np.ndarray) -> np.float32:
    if type_name == "IQ1_BN":
        return np.float32(row[:2].view(np.float16)[0])
    return row[:4].view(np.float32)[0]
