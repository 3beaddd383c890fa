"""Properties every implemented codec must have, on adversarial rows (hypothesis).

Each codec documents its accuracy: |x - dequantize(quantize(x))| <= rel_error_bound * M + abs_error_floor, where M
is max|x| over the value's block (its block_size group) -- or over its row for types with a per-row header, whose
single row scale serves every block -- and it refuses, with an error naming the row, inputs beyond max_abs_input
and NaN/Inf.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ikquant.errors import QuantInputError
from ikquant.types import implemented_types

TYPES = [t.name for t in implemented_types()]
KINDS = ["gauss", "constant", "zeros", "subnormal", "outlier", "huge", "wide"]


def _rows(kind: str, rows: int, n: int, limit: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "gauss":
        scale = 10.0 ** rng.uniform(-4, min(3, np.log10(limit) - 2))
        return (rng.standard_normal((rows, n)) * scale).astype(np.float32)
    if kind == "constant":
        return np.full((rows, n), rng.uniform(-1, 1), dtype=np.float32)
    if kind == "zeros":
        return np.zeros((rows, n), dtype=np.float32)
    if kind == "subnormal":
        return (rng.standard_normal((rows, n)) * 1e-39).astype(np.float32)
    if kind == "outlier":
        x = (rng.standard_normal((rows, n)) * 0.01).astype(np.float32)
        x[:, rng.integers(n)] = np.float32(min(limit / 2, 1e3)) * rng.choice([-1, 1])
        return x
    if kind == "huge":
        x = rng.standard_normal((rows, n)).astype(np.float32)
        x[rows - 1, rng.integers(n)] = np.float32(1e30) * rng.choice([-1, 1])
        return x
    x = rng.standard_normal((rows, n)) * 10.0 ** rng.uniform(-3, 3, size=(rows, n))
    return np.clip(x, -limit / 4, limit / 4).astype(np.float32)


def _scope_max(x: np.ndarray, gtype) -> np.ndarray:  # type: ignore[no-untyped-def]
    """max|x| over the group whose scale each value shares (block, or whole row for row-scaled types)."""
    a = np.abs(x.astype(np.float64))
    if gtype.row_meta_size:
        return np.broadcast_to(a.max(axis=1, keepdims=True), x.shape)
    b = gtype.block_size
    m = a.reshape(x.shape[0], -1, b).max(axis=2, keepdims=True)
    return np.broadcast_to(m, (x.shape[0], x.shape[1] // b, b)).reshape(x.shape)


@pytest.mark.parametrize("type_name", TYPES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS), n_blocks=st.integers(1, 3), rows=st.integers(1, 3), seed=st.integers(0, 2**31),
       weighted=st.booleans())
def test_roundtrip_stays_within_the_documented_bound(type_name: str, kind: str, n_blocks: int, rows: int,
                                                     seed: int, weighted: bool) -> None:
    from ikquant.types import type_by_name

    gtype = type_by_name(type_name)
    codec = gtype.require_codec()
    n = gtype.block_size * n_blocks * (8 if gtype.block_size == 1 else 1)
    rows *= gtype.row_group  # interleaved types quantize whole groups of rows
    x = _rows(kind, rows, n, codec.max_abs_input, seed)
    weighted = weighted or codec.requires_imatrix  # IQ2_XXS, IQ2_XS and IQ1_S refuse to quantize without weights
    w = np.random.default_rng(seed).uniform(0.1, 10.0, n).astype(np.float32) if weighted else None
    if np.abs(x).max() > codec.max_abs_input:
        with pytest.raises(QuantInputError, match=f"row {rows - 1}"):
            codec.quantize(x, w)
        return
    q = codec.quantize(x, w)
    assert q.shape == (rows, gtype.row_bytes(n))
    y = codec.dequantize(q, n)
    assert np.isfinite(y).all(), "quantize emitted NaN/Inf"
    if w is None:
        err = np.abs(y.astype(np.float64) - x)
        bound = codec.rel_error_bound * _scope_max(x, gtype) + codec.abs_error_floor
        worst = np.argmax(err - bound)
        assert (err <= bound).all(), f"{kind}: error {err.flat[worst]:.3g} > bound {bound.flat[worst]:.3g}"


@pytest.mark.parametrize("type_name", TYPES)
def test_nonfinite_input_names_the_row(type_name: str) -> None:
    from ikquant.types import type_by_name

    gtype = type_by_name(type_name)
    codec = gtype.require_codec()
    n = max(gtype.block_size, 32)
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones((max(3, gtype.row_group), n), dtype=np.float32)
        x[2, 5] = bad
        with pytest.raises(QuantInputError, match=r"row 2 .*column 5"):
            codec.quantize(x)


@pytest.mark.parametrize("type_name", [t for t in TYPES if t not in ("F32", "F16", "BF16")])
def test_row_length_must_fit_the_blocks(type_name: str) -> None:
    from ikquant.types import type_by_name

    gtype = type_by_name(type_name)
    with pytest.raises(QuantInputError, match="not a multiple of the block size"):
        gtype.require_codec().quantize(np.ones((2 * gtype.row_group, gtype.block_size * 3 // 2), dtype=np.float32))


@pytest.mark.parametrize("type_name", TYPES)
def test_vanishing_importance_weights_never_give_nan(type_name: str) -> None:
    from ikquant.types import type_by_name

    gtype = type_by_name(type_name)
    codec = gtype.require_codec()
    n = max(gtype.block_size, 32) * 2
    x = np.random.default_rng(3).standard_normal((2 * gtype.row_group, n)).astype(np.float32)
    w = np.ones(n, dtype=np.float32)
    w[: n // 2] = 0.0
    with warnings.catch_warnings(record=True) as caught, np.errstate(all="ignore"):
        warnings.simplefilter("always")
        y = codec.dequantize(codec.quantize(x, w), n)
    assert np.isfinite(y).all()
    assert all("quantized without importance weights" in str(c.message) for c in caught)


@pytest.mark.parametrize("type_name", [t.name for t in implemented_types()
                                       if t.require_codec().block_scale_f16 is not None])
def test_block_scale_f16_is_the_scale_every_value_is_a_multiple_of(type_name: str) -> None:
    """The field the NaN check after a weighted quantization reads instead of decoding: doubling it doubles every
    value of its block and nothing else, and a NaN or infinity there makes exactly its row's decoding non-finite."""
    from ikquant.types import type_by_name

    gtype = type_by_name(type_name)
    codec = gtype.require_codec()
    at, ts, b = codec.block_scale_f16, gtype.type_size, gtype.block_size
    assert at is not None
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((4, 2 * b)) * 0.5).astype(np.float32)
    q = codec.quantize(x, rng.uniform(0.5, 2, 2 * b).astype(np.float32))
    y = codec.dequantize(q, 2 * b)
    doubled = q.copy()
    blocks = doubled.reshape(4, 2, ts)
    d = blocks[:, 1, at : at + 2].copy().view(np.float16)
    blocks[:, 1, at : at + 2] = (d * np.float16(2)).view(np.uint8)
    y2 = codec.dequantize(doubled, 2 * b)
    np.testing.assert_array_equal(y2[:, :b], y[:, :b])
    np.testing.assert_array_equal(y2[:, b:], 2 * y[:, b:])
    for bad in (np.nan, np.inf):
        poked = q.copy()
        poked.reshape(4, 2, ts)[2, 0, at : at + 2] = np.array([bad], np.float16).view(np.uint8)
        with np.errstate(all="ignore"):
            decoded = ~np.isfinite(codec.dequantize(poked, 2 * b)).all(axis=1)
        np.testing.assert_array_equal(codec._nonfinite_block_scales(poked).any(axis=1), decoded)
        assert decoded.tolist() == [False, False, True, False]


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_into_a_given_array_writes_every_value(type_name: str) -> None:
    """dequantize(..., out=) fills the caller's array (NaN-filled first, so a value left unwritten shows) with the
    same floats it returns by itself, and refuses an array of another shape."""
    from ikquant.types import type_by_name

    gtype = type_by_name(type_name)
    codec = gtype.require_codec()
    n = max(gtype.block_size, 256 // gtype.block_size * gtype.block_size)
    x = _rows("gauss", 2 * gtype.row_group, n, min(1e3, codec.max_abs_input), 7)
    q = codec.quantize(x, np.ones(n, np.float32) if codec.requires_imatrix else None)
    out = np.full(x.shape, np.nan, np.float32)
    assert codec.dequantize(q, n, out) is out
    assert np.array_equal(out, codec.dequantize(q, n), equal_nan=False)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        codec.dequantize(q, n, np.empty((x.shape[0] + 1, n), np.float32))
