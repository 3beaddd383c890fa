"""The numpy DeepSeek-V4 reference against transformers 5.23's logits for the tiny deepseek-v4-flash checkpoint.

The oracle (tests/data/hf-logits/deepseek-v4-flash, a copy of shared/golden/hf-logits/deepseek-v4-flash) holds 8 chunks
of 64 tokens, each one forward with use_cache=False at positions 0..63; its meta.json says how transformers was run.
The reference matches it to ~1e-5 in the logits (float32 rounding), so the bounds below leave ~10x headroom and no more.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ikrun.validate.deepseek4 import DeepseekV4Reference, dequantize_fp4, torch_topk

DATA = Path(__file__).parent / "data"
CKPT = DATA / "convert" / "deepseek-v4-flash" / "hf"
ORACLE = DATA / "hf-logits" / "deepseek-v4-flash"
MAX_ABS = 1e-4
MEAN_KL = 1e-9


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """KL(ref || got) per position."""
    lr, lg = _log_softmax(ref), _log_softmax(got)
    return (np.exp(lr) * (lr - lg)).sum(-1)


@pytest.fixture(scope="module")
def model() -> DeepseekV4Reference:
    return DeepseekV4Reference.from_folder(CKPT)


@pytest.fixture(scope="module")
def oracle() -> tuple[np.ndarray, np.ndarray]:
    meta = json.loads((ORACLE / "meta.json").read_text())
    assert meta["model_class"] == "DeepseekV4ForCausalLM" and meta["positions"].startswith("0..63")
    return np.load(ORACLE / "tokens.npy"), np.load(ORACLE / "logits.npy")


def test_one_chunk(model: DeepseekV4Reference, oracle: tuple[np.ndarray, np.ndarray]) -> None:
    tokens, logits = oracle
    got = model.logits(tokens[0])
    assert got.shape == logits[0].shape and got.dtype == np.float32
    assert np.abs(got - logits[0]).max() < MAX_ABS
    assert _kl(logits[0], got).mean() < MEAN_KL


def test_all_chunks(model: DeepseekV4Reference, oracle: tuple[np.ndarray, np.ndarray]) -> None:
    tokens, logits = oracle
    worst, kls = 0.0, []
    for c in range(len(tokens)):
        got = model.logits(tokens[c])
        err = float(np.abs(got - logits[c]).max())
        kl = float(_kl(logits[c], got).mean())
        print(f"chunk {c}: max abs {err:.2e}, mean KL {kl:.2e}")
        worst, kls = max(worst, err), [*kls, kl]
        assert (got.argmax(-1) == logits[c].argmax(-1)).all()
    print(f"all chunks: max abs {worst:.2e}, mean KL {np.mean(kls):.2e}")
    assert worst < MAX_ABS
    assert np.mean(kls) < MEAN_KL


def test_hooks(model: DeepseekV4Reference, oracle: tuple[np.ndarray, np.ndarray]) -> None:
    tokens = oracle[0][1][:9]
    blocks: list[tuple[int, tuple[int, ...]]] = []
    seen: dict[str, int] = {}
    model.logits(tokens, observe=lambda name, x: seen.__setitem__(name, x.shape[0]),
                 on_block=lambda i, x: blocks.append((i, x.shape)))
    cfg = model.cfg
    assert blocks == [(i, (9, cfg["hc_mult"], cfg["hidden_size"])) for i in range(cfg["num_hidden_layers"])]
    assert seen["head.weight"] == 9 and seen["layers.1.attn.indexer.wq_b.weight"] == 9
    assert seen["layers.1.attn.compressor.wkv.weight"] == 9 and "mtp.0.attn.wq_a.weight" not in seen


def test_hash_routing_counts_a_repeated_expert_twice(model: DeepseekV4Reference) -> None:
    """tid2eid[0] (BOS) names one expert twice; transformers then adds that expert's output twice."""
    row = model.tensors["layers.0.ffn.gate.tid2eid"].raw()[0]
    assert row[0] == row[1]
    h = np.random.default_rng(0).standard_normal((1, model.cfg["hidden_size"])).astype(np.float32)
    shared = model._swiglu(h, "layers.0.ffn.shared_experts.")
    routed = model._moe(h, "layers.0.ffn.", 0, np.array([0])) - shared
    expert = model._swiglu(h, f"layers.0.ffn.experts.{row[0]}.")
    np.testing.assert_allclose(routed, expert * model.cfg["routed_scaling_factor"], rtol=1e-5, atol=1e-6)


def test_fp4_decode() -> None:
    codes = np.array([[0x21, 0xF9] + [0] * 14], dtype=np.uint8)  # 32 values: 0.5, 1, -0.5, -6, then zeros
    got = dequantize_fp4(codes, np.array([[128]], dtype=np.uint8))  # x 2
    assert got.shape == (1, 32)
    np.testing.assert_array_equal(got[0, :4], [1.0, 2.0, -1.0, -12.0])
    assert not got[0, 4:].any()


#: (values: digits, x = -inf; k; the sorted index set torch 2.13's CPU torch.topk returns)
TORCH_TOPK = [
    ("32232330011x3xx30301", 16, [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 15, 16, 17, 18, 19]),
    ("x110300x32302x10x", 16, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 15, 16]),
    ("313xx23x212122x30211x0xx013300201130x2x3", 16, [0, 2, 5, 6, 8, 10, 12, 13, 15, 17, 26, 27, 30, 34, 37, 39]),
    ("32320xxx33x3x1x3x020000x1x011x33x31010x01x302x23332223xx31123000x0x232133221x023x1xxxx00010x3332x22310x12x1"
     "033xx212002021x323323", 2, [0, 2]),
    ("1x0210112", 5, [3, 4, 6, 7, 8]),
    ("23110211103112332xx231301302000xx0203x033013x2x012313212x22320xx", 1, [1]),
]


@pytest.mark.parametrize(("values", "k", "want"), TORCH_TOPK)
def test_torch_topk_ties(values: str, k: int, want: list[int]) -> None:
    v = np.array([-np.inf if ch == "x" else float(ch) for ch in values], dtype=np.float32)
    assert sorted(torch_topk(v, k)) == want
