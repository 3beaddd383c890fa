"""Every implemented type against ik_llama.cpp's golden vectors: exact dequantization, matching quantization."""

from __future__ import annotations

import numpy as np
import pytest

from ikquant.types import decodable_types, implemented_types, type_by_name
from tests.quant_golden import golden_cases, golden_types, header_blind_to_float, row_scale, weighted_rmse

IMPLEMENTED = {t.name for t in implemented_types()}
DECODABLE = {t.name for t in decodable_types()}
TYPES = [t for t in golden_types() if t in IMPLEMENTED]
CASES = [(t, c.name) for t in TYPES for c in golden_cases(t)]
#: types read but not written yet: their golden bytes must decode to ik's floats all the same
DECODE_ONLY = [t for t in golden_types() if t in DECODABLE - IMPLEMENTED]
DECODE_CASES = CASES + [(t, c.name) for t in DECODE_ONLY for c in golden_cases(t)]

# Types whose quantized bytes do not depend on the compiler's fused multiply-adds (their searches involve no multiply-add the compiler may fuse).
EXACT_BYTES = {"F16", "BF16", "Q8_0", "MXFP4", "Q8_0_R8", "MXFP4_R8"}
# Types whose golden floats come from a broken ik to_float: dequantize_row_mxfp4_r8 counts the blocks of all 8 rows
# of a group as one row's (nblock = k/32 with k = 8 * n_per_row), so decoding runs past the group and overwrites
# rows 1..7 with what follows in memory (and past the buffer for 256-value rows: the heap corruption the golden
# README reports). Only each group's first row is ik's correct output; every row must equal its base type's
# decoding of the same input, quantized by the base codec (bit-exact with ik on its own golden cases).
ORACLE_DEQUANT_BUG = {"MXFP4_R8": "MXFP4"}
# Types whose golden floats come from ik's CPU to_float reading the row from its first byte: dequantize_row_iq1_bn
# and dequantize_row_iq2_bn decode the row header as codes (dropping the last block's tail) and never apply the row
# scale, which ik's matrix kernels and CUDA dequantizer apply. The golden floats must equal a port of that to_float
# (tests/test_bitnet.py); every value must be the row's scale times ik's codes of its blocks.
HEADER_BLIND_DEQUANT = {"IQ1_BN", "IQ2_BN"}
# Share of identical blocks required per case where bytes can move with FMA contraction (ik's build fuses some multiply-adds that numpy rounds twice).
MIN_SAME_BLOCKS = {"IQ1_KT": 0.90, "IQ2_KT": 0.90, "IQ3_KT": 0.90, "IQ4_KT": 0.90}


def _case(type_name: str, case_name: str):
    return next(c for c in golden_cases(type_name) if c.name == case_name)


def _codec_for(case):
    """The codec as ggml_quantize_chunk ran it for this case: user_data NULL and llama-quantize's struct differ."""
    codec = type_by_name(case.type_name).require_codec()
    return codec.with_user_data(case.user_data) if hasattr(codec, "with_user_data") else codec


@pytest.mark.parametrize("type_name,case_name", DECODE_CASES)
def test_dequantize_is_bit_exact(type_name: str, case_name: str) -> None:
    case = _case(type_name, case_name)
    gtype = type_by_name(type_name)
    out = gtype.require_codec().dequantize(case.quant, case.n_per_row)
    want = case.dequant
    if type_name in ORACLE_DEQUANT_BUG:
        base = type_by_name(ORACLE_DEQUANT_BUG[type_name]).require_codec()
        first_rows = slice(0, None, gtype.row_group)
        assert np.array_equal(out[first_rows].view(np.uint32), want[first_rows].view(np.uint32))
        want = base.dequantize(base.quantize(case.x, case.imatrix), case.n_per_row)
    if type_name in HEADER_BLIND_DEQUANT:
        n, h = case.n_per_row, gtype.row_meta_size
        blind = np.stack([header_blind_to_float(type_name, row, n) for row in case.quant])
        assert np.array_equal(blind.view(np.uint32), want.view(np.uint32))
        want = np.stack([row_scale(type_name, row) * header_blind_to_float(type_name, row[h:], n) for row in case.quant])
    mismatch = np.flatnonzero(out.view(np.uint32) != want.view(np.uint32))
    assert mismatch.size == 0, f"{mismatch.size} values differ, first at flat index {mismatch[0]}"


@pytest.mark.parametrize("type_name,case_name", CASES)
def test_quantize_matches_ik(type_name: str, case_name: str) -> None:
    case = _case(type_name, case_name)
    gtype = type_by_name(type_name)
    codec = _codec_for(case)
    q = codec.quantize(case.x, case.imatrix)
    assert q.shape == case.quant.shape
    if type_name in EXACT_BYTES:
        assert np.array_equal(q, case.quant)
        return
    h = gtype.row_meta_size
    ours = q[:, h:].reshape(q.shape[0], -1, gtype.type_size)
    ik = case.quant[:, h:].reshape(q.shape[0], -1, gtype.type_size)
    same = np.all(ours == ik, axis=2).mean()
    assert same >= MIN_SAME_BLOCKS.get(type_name, 0.95), f"only {same:.1%} of blocks identical"
    err_ours = weighted_rmse(case.x, codec.dequantize(q, case.n_per_row), case.imatrix)
    err_ik = weighted_rmse(case.x, case.dequant, case.imatrix)
    assert err_ours <= err_ik * 1.005 + 1e-12, f"weighted RMSE {err_ours:.6g} vs ik {err_ik:.6g}"
