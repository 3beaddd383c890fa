"""ik's two flash-attention kernels for DeepSeek-V4's shared key = value head (shared_kv_flash.py): which one a layer
and batch get, the sinks a one-token batch's threads read, and each kernel against the port of the same ik kernel
for plain causal attention (flash_attention.py, iqk_flash_attention.py: each checked against ik's runs), where the
two compute the same thing."""

from __future__ import annotations

import numpy as np
import pytest

from ikquant.formats.numeric import round_f16
from ikrun.numerics.ik.flash_attention import generic_flash_attention
from ikrun.numerics.ik.iqk_flash_attention import AVX2_LANES, AVX512_LANES, NO_SCORES, iqk_flash_attention
from ikrun.numerics.ik.shared_kv_flash import ik_gathers, shared_kv_flash_attention, sink_heads, visible_keys


@pytest.mark.parametrize(("ratio", "window", "top_k", "start", "n", "gathers"), [
    (0, 16, 16, 0, 256, False),  # a raw-only layer: always the generic kernel
    (4, 16, 16, 0, 256, True),  # the tiny model's CSA layer: 32 seen -> 256 < 256 raw + 256 entries
    (128, 16, 16, 0, 256, True),  # its HCA layer at 256 tokens: 2 entries
    (128, 16, 16, 0, 64, False),  # HCA before its first complete window: the raw-only graph
    (128, 16, 16, 64, 64, True),  # ... and in the batch that completes it
    (4, 128, 512, 0, 256, False),  # DeepSeek-V4 Flash's CSA at 256 tokens: 640 seen -> 768, not < 256 + 256
    (4, 128, 512, 0, 1024, True),  # ... at 1024: 1024 + 256 cells
    (128, 128, 512, 0, 256, True),  # its HCA: 130 seen -> 256
    (4, 128, 512, 1023, 1, False),  # one token at 1024: the window view (512 raw cells) and 256 entry cells
])
def test_ik_picks_its_kernel_by_the_mask_it_builds(ratio: int, window: int, top_k: int, start: int, n: int,
                                                    gathers: bool) -> None:
    assert ik_gathers(ratio, window, top_k, start, n) is gathers


def test_one_token_threads_read_the_sinks_from_head_0() -> None:
    """ik's threads take ceil(H / threads) heads, the last ones one fewer where that overshoots; each reads the
    sinks from the first."""
    assert sink_heads(4, 1).tolist() == [0, 1, 2, 3]
    assert sink_heads(4, 2).tolist() == [0, 1, 0, 1]
    assert sink_heads(4, 3).tolist() == [0, 1, 0, 0]
    assert sink_heads(5, 2).tolist() == [0, 1, 2, 0, 1]
    assert sink_heads(2, 4).tolist() == [0, 0]


def test_visible_keys_are_the_window_then_the_kept_entries_in_cache_order() -> None:
    keep = np.array([[False, False], [True, False], [True, True]])
    rows, counts = visible_keys(3, 5, 2, 8, keep)
    assert counts.tolist() == [2, 3, 4]
    assert rows[0, :2].tolist() == [4, 5] and rows[1, :3].tolist() == [5, 6, 8] and rows[2].tolist() == [6, 7, 8, 9]


def _inputs(n: int, d: int, seed: int, heads: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, heads, d)).astype(np.float32)
    keys = np.vectorize(round_f16)(rng.standard_normal((n, d)).astype(np.float32)).astype(np.float32)
    return q, keys


@pytest.mark.parametrize("d", [64, 96])  # 96: dims past the whole steps of 4 x 16 lanes
@pytest.mark.parametrize("lanes", [AVX2_LANES, AVX512_LANES])
def test_generic_kernel_is_the_causal_ones_without_window_or_sinks(lanes: int, d: int) -> None:
    n = 40
    q, keys = _inputs(n, d, 1)
    rows, counts = visible_keys(n, 0, 0, n, np.zeros((n, 0), np.bool_))
    ours = shared_kv_flash_attention(q, keys, rows, counts, np.empty(0, np.float32), 0.125, False, lanes,
                                     np.arange(4))
    want = np.empty((4, n, d), np.float32)
    generic_flash_attention(np.ascontiguousarray(q.transpose(1, 0, 2)), keys[None], NO_SCORES, keys[None], 0.125, 0,
                            want, lanes, True)
    np.testing.assert_array_equal(ours, want.transpose(1, 0, 2))


@pytest.mark.parametrize("lanes", [AVX2_LANES, AVX512_LANES])
def test_gathered_kernel_is_the_causal_ones_where_their_key_blocks_agree(lanes: int) -> None:
    """Rows seeing 97..128 keys gather 128 cells: blocks of 128, as the causal kernel takes over a 128-cell cache.
    Six heads: some taken together through the keys, the rest one at a time."""
    n, d = 128, 64
    q, keys = _inputs(n, d, 2, heads=6)
    rows, counts = visible_keys(n, 0, 0, n, np.zeros((n, 0), np.bool_))
    ours = shared_kv_flash_attention(q, keys, rows, counts, np.empty(0, np.float32), 0.125, True, lanes,
                                     np.arange(6))
    want = np.empty((6, n, d), np.float32)
    iqk_flash_attention(np.ascontiguousarray(q.transpose(1, 0, 2)), keys[None], NO_SCORES, keys[None], 0.125, 0, 128,
                        want, lanes)
    np.testing.assert_array_equal(ours[96:], want.transpose(1, 0, 2)[96:])
    assert not np.array_equal(ours[:96], want.transpose(1, 0, 2)[:96])  # shorter rows: smaller blocks


@pytest.mark.parametrize("gathered", [False, True])
def test_sinks_take_weight_and_no_value(gathered: bool) -> None:
    """A sink far above every score leaves the output near 0, one far below leaves it as without sinks; each head
    its own, except where ik's own kernel's one-token threads read them from head 0 (the generic kernel has no such
    shift)."""
    n, d = 20, 64
    q, keys = _inputs(n, d, 3)
    rows, counts = visible_keys(n, 0, 8, n, np.zeros((n, 0), np.bool_))
    plain = shared_kv_flash_attention(q, keys, rows, counts, np.empty(0, np.float32), 0.125, gathered, AVX512_LANES,
                                      np.arange(4))
    sinks = np.array([-1e4, 1e4, -1e4, 1e4], np.float32)
    ours = shared_kv_flash_attention(q, keys, rows, counts, sinks, 0.125, gathered, AVX512_LANES, np.arange(4))
    np.testing.assert_array_equal(ours[:, 0::2], plain[:, 0::2])
    assert np.abs(ours[:, 1::2]).max() < 1e-30 < np.abs(plain[:, 1::2]).max()
    shifted = shared_kv_flash_attention(q, keys, rows, counts, sinks, 0.125, gathered, AVX512_LANES,
                                        np.array([0, 0, 0, 0]))
    np.testing.assert_array_equal(shifted, plain if gathered else ours)
