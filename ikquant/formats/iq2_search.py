"""The searches that write IQ2_XXS, IQ2_XS and IQ2_S (ik's quantize_row_iq2_xxs_impl, _xs_impl and _s_impl).

Every group of 8 values becomes one point of a grid of 8 two-bit levels (256, 512 or 1024 points, iq12_grids.py).
The search works on |x| with the signs kept apart, in odd magnitudes 2 l + 1 = 1, 3, 5 (the decoders store them as
8, 25, 43). At a trial inverse scale each value is rounded to its level; when the 8 levels are not a grid point,
the group takes the nearest of that key's precomputed neighbours by importance-weighted squared error. The trial
whose weighted least-squares fit explains most of the block wins; then the block is re-rounded at the fitted
scale and fitted again (the trials of a sub-block side by side, trials.py). Per type:

- IQ2_XXS (32-value sub-blocks): a first scale from make_qp_quants on codes 0..4, trials (5 + 0.1 k) / (3 scale)
  for k = -6..6, then every group re-rounded and refitted once.
- IQ2_XS (16-value sub-blocks): a first scale from the best split of the sorted values into levels 1 / 3 / 5
  (every pair of cut points), trials k = -7..7 around it, then up to three re-roundings while they change a grid
  point and improve the fit; finally the super-block d is refitted over the decoded values and stored 5% larger.
- IQ2_S (16-value sub-blocks): trials (5 + 0.1 k) / max for k = -9..9, then only the groups that were off the grid
  re-rounded; d is stored 1.25% smaller than max scale / 31.

IQ2_XXS and IQ2_XS store 7 signs per group, the 8th being the parity: when a group has an odd number of negatives
the value of least importance (w x^2) is fitted with the wrong sign. IQ2_S stores all 8 signs.

The importance of a value is qw sqrt(sigma2 + x^2) with an importance vector qw, else sigma2 / 4 + x^2 (sigma2 is
the super-block's mean square, twice it for IQ2_S). The neighbour lists hold, for every key of 8 levels 0..2 that
is not a grid point, all grid points within its 2 smallest distances (IQ2_S: the smallest only), in order of
distance then index, as ik's iq2xs_init_impl builds them; each grid's are built on its first use (grid_tables).

The float arithmetic is ik's GCC build (-O3, AVX-512), read from its assembly: multiply-adds fused (`fmaf`) where
GCC contracts them, and not where it vectorised the products first: the super-block's sum of squares, the
unweighted importances of IQ2_XS and IQ2_S, and the first group's rounding in IQ2_S's trials.

A sub-block that no trial fits (importance weights that vanish over it) keeps the levels of the sub-block before
it, as in ik (zeros at a row's start, where ik's are uninitialised). Where ik aborts (a sub-block's levels end off the grid, or its scale is NaN, which only importance weights that
vanish over a sub-block bring about), the block's d is written as NaN so that Codec.quantize quantizes the row
again without the weights.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from ikquant.formats.iq12_grids import KGRID_IQ1S, KGRID_IQ2S, KGRID_IQ2XS, KGRID_IQ2XXS
from ikquant.formats.iqk_grids import sum_squares
from ikquant.formats.iquants import KSIGNS
from ikquant.formats.kquants import make_qp_quants
from ikquant.formats.listed_search import nearest_listed
from ikquant.formats.numeric import fmaf, nearest_int_fma, store_f16
from ikquant.formats.trials import best_trial, fit_trials
from ikquant.formats.vector_ir import whole_vectors

QK_K = 256
IQ2_XXS_BYTES = 66  # d (2), per 32 values: 4 grid bytes, then a u32 of 4 x 7 sign bits and the 4-bit scale
IQ2_XS_BYTES = 74  # d (2), 32 u16 (9-bit grid index, 7 sign bits), 8 bytes of two 4-bit scales
IQ2_S_BYTES = 82  # d (2), 32 grid index bytes, 32 sign bytes, 8 bytes of index top bits, 8 scale bytes
GROUP_MAX_EPS = np.float32(1e-15)  # ik: a sub-block below this maximum is stored as zeros (IQ2_XXS, IQ2_XS)
GROUP_MAX_EPS_IQ2_S = np.float32(1e-8)
K_MAX_Q = 3  # levels 0..2: magnitudes 1, 3, 5
#: kmap entry of a key with a level 3, which no rounding forms (the levels are clamped to 0..2)
NO_POINT = np.int32(np.iinfo(np.int32).min)
NAN_F16 = 0x7E00
NJIT = dict(cache=True, nogil=True, error_model="numpy")
KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")


class GridTables:
    """One grid's search tables: levels [points, 8], the key map (key = levels 2 bits each, low value first;
    entry >= 0 a grid point, else -(offset + 1) into `neighbours`), the neighbour lists (a count, then that many
    grid points), and those lists' magnitudes laid out for listed_search (dense, dense_at)."""

    def __init__(self, kgrid: np.ndarray, nearest_distances: int) -> None:
        shifts = 2 * np.arange(8)
        self.levels = (kgrid.astype(np.int64)[:, None] >> shifts[None, :]) & 3
        if (self.levels == 3).any():
            raise AssertionError("a 2-bit grid point with level 3")
        self.kmap = np.full(1 << 16, NO_POINT, dtype=np.int32)
        self.kmap[kgrid.astype(np.int64)] = np.arange(len(kgrid), dtype=np.int32)
        keys = (((np.arange(3**8)[:, None] // 3 ** np.arange(8)[None, :]) % 3) << shifts[None, :]).sum(axis=1)
        off = np.sort(keys[self.kmap[keys] < 0])  # the keys a rounding can form that are not grid points
        off_levels = ((off[:, None] >> shifts[None, :]) & 3).astype(np.float32)
        points = self.levels.astype(np.float32)
        # squared distance in levels (a quarter of ik's, in magnitudes: the same order), exact in float32
        dist = ((off_levels**2).sum(axis=1)[:, None] + (points**2).sum(axis=1)[None, :]
                - 2 * off_levels @ points.T).astype(np.int64)
        limit = dist.min(axis=1)
        for _ in range(nearest_distances - 1):
            limit = np.where(dist > limit[:, None], dist, np.iinfo(np.int64).max).min(axis=1)
        key_row, point = np.nonzero(dist <= limit[:, None])
        kept = np.lexsort((point, dist[key_row, point], key_row))  # by key, distance, then index
        key_row, point = key_row[kept], point[kept]
        counts = np.bincount(key_row, minlength=len(off))
        starts = np.concatenate([[0], np.cumsum(counts + 1)[:-1]])
        self.kmap[off] = -(starts + 1)
        self.neighbours = np.empty(int((counts + 1).sum()), dtype=np.int32)
        self.neighbours[starts] = counts
        rank = np.arange(len(key_row)) - (np.cumsum(counts) - counts)[key_row]  # place within its key's list
        self.neighbours[starts[key_row] + 1 + rank] = point
        self._dense_lists(starts, counts, key_row, rank, point)

    def _dense_lists(self, starts: np.ndarray, counts: np.ndarray, key_row: np.ndarray, rank: np.ndarray,
                     point: np.ndarray) -> None:
        """Each list's magnitudes again as uint8, value-major (value i of neighbours j, j+1, ... adjacent) and
        padded to whole vectors of listed_search, so it reads contiguous vectors instead of gathering grid rows;
        dense_at[start] is where the list at neighbours[start] begins."""
        padded = whole_vectors(counts)
        dense_starts = np.concatenate([[0], np.cumsum(8 * padded)[:-1]])
        self.dense_at = np.zeros(len(self.neighbours), dtype=np.int32)
        self.dense_at[starts] = dense_starts
        self.dense = np.zeros(int(8 * padded.sum()), dtype=np.uint8)
        value = np.arange(8)
        at = dense_starts[key_row][:, None] + value[None, :] * padded[key_row][:, None] + rank[:, None]
        self.dense[at] = (2 * self.levels[point] + 1).astype(np.uint8)


#: per grid: its points and how many of the smallest distances ik's iq2xs_init_impl keeps as neighbours
GRIDS = {"IQ2_XXS": (KGRID_IQ2XXS, 2), "IQ2_XS": (KGRID_IQ2XS, 2), "IQ2_S": (KGRID_IQ2S, 1), "IQ1_S": (KGRID_IQ1S, 3)}


@functools.cache
def grid_tables(grid: str) -> GridTables:
    """The search tables of `grid` (a key of GRIDS), built on first use and kept: building one takes ~0.1 s, which
    no command that only reads these types should pay."""
    kgrid, nearest = GRIDS[grid]
    return GridTables(kgrid, nearest)


@njit(**NJIT)
def _level(id_: np.float32, v: np.float32, fused: bool) -> int:
    """The level of |x| = v at inverse scale id_: ggml's nearest_int((id v - 1) / 2) clamped to 0..2, with id v - 1
    one fused multiply-add (or, not fused, id v rounded first)."""
    t = fmaf(id_, v, np.float32(-1.0)) if fused else id_ * v - np.float32(1.0)
    return max(0, min(K_MAX_Q - 1, nearest_int_fma(np.float32(0.5), t)))


@njit(inline="always", **NJIT)
def _best_neighbour(levels: np.ndarray, dense: np.ndarray, dense_at: np.ndarray, neighbours: np.ndarray,
                    start: int, xval: np.ndarray, waux: np.ndarray, o: int, scale: np.float32, L: np.ndarray) -> int:
    """ik's iq2_find_best_neighbour (listed_search.nearest_listed): the listed point with the least sum of
    waux (scale q - x)^2, the first on ties; its levels into L[o:o+8] (ik's index -1, the last point, when no sum
    is finite)."""
    count = neighbours[start]
    j = nearest_listed(dense, dense_at[start], count,
                       (-xval[o], -xval[o + 1], -xval[o + 2], -xval[o + 3], -xval[o + 4], -xval[o + 5],
                        -xval[o + 6], -xval[o + 7]),
                       (waux[o], waux[o + 1], waux[o + 2], waux[o + 3], waux[o + 4], waux[o + 5], waux[o + 6],
                        waux[o + 7]), scale, np.float32(1.0), np.float32(0.0))
    g = neighbours[start + 1 + j] if j >= 0 else -1
    for i in range(8):
        L[o + i] = levels[g, i]
    return g


@njit(**NJIT)
def _rounded_key(id_: np.float32, xval: np.ndarray, o: int, L: np.ndarray, fused: bool) -> int:
    """Group xval[o:o+8] rounded at inverse scale id_: its levels into L[o:o+8], and their grid key."""
    u = 0
    for i in range(8):
        l = _level(id_, xval[o + i], fused)
        L[o + i] = l
        u |= l << (2 * i)
    return u


@njit(**NJIT)
def _round_group(levels: np.ndarray, dense: np.ndarray, dense_at: np.ndarray, kmap: np.ndarray,
                 neighbours: np.ndarray, id_: np.float32, scale: np.float32, xval: np.ndarray, waux: np.ndarray,
                 o: int, L: np.ndarray, fused: bool = True) -> tuple[int, bool]:
    """Group xval[o:o+8] at inverse scale id_ (scale for the neighbour search): its levels into L[o:o+8], and
    (grid point, whether the rounded levels were one)."""
    g = kmap[_rounded_key(id_, xval, o, L, fused)]
    if g >= 0:
        return g, True
    return _best_neighbour(levels, dense, dense_at, neighbours, -g - 1, xval, waux, o, scale, L), False


@njit(**NJIT)
def _point(kmap: np.ndarray, L: np.ndarray, o: int) -> int:
    """The grid point of levels L[o:o+8] (key truncated to 16 bits as ik's uint16), negative when off the grid."""
    u = 0
    for i in range(8):
        u |= L[o + i] << (2 * i)
    return kmap[u & 0xFFFF]


@njit(**NJIT)
def _fit(weight: np.ndarray, xval: np.ndarray, L: np.ndarray) -> tuple[np.float32, np.float32]:
    """sum w x q and sum w q^2 over the sub-block, q = 2 l + 1."""
    sumqx = np.float32(0.0)
    sumq2 = np.float32(0.0)
    for i in range(weight.size):
        q = np.float32(2 * L[i] + 1)
        sumqx = fmaf(weight[i] * xval[i], q, sumqx)
        sumq2 = fmaf(weight[i] * q, q, sumq2)
    return sumqx, sumq2


@njit(**NJIT)
def _weights(xbl: np.ndarray, qw: np.ndarray, o: int, sigma2: np.float32, plain_fused: bool,
             weight: np.ndarray) -> None:
    """Importance of xbl[o:o + weight.size]: qw sqrt(sigma2 + x^2), or sigma2 / 4 + x^2 without qw (qw is the
    row's importance vector from the super-block's start). ik's build fuses x^2 + sigma2 / 4 for IQ2_XXS only."""
    quarter = np.float32(0.25) * sigma2
    for i in range(weight.size):
        v = xbl[o + i]
        if qw.size:
            weight[i] = qw[o + i] * np.sqrt(fmaf(v, v, sigma2))
        else:
            weight[i] = fmaf(v, v, quarter) if plain_fused else v * v + quarter


@njit(**NJIT)
def _roots(weight: np.ndarray, waux: np.ndarray) -> None:
    for i in range(weight.size):
        waux[i] = np.sqrt(weight[i])


@njit(**NJIT)
def _even_signs(xb: np.ndarray, o: int, weight: np.ndarray, xval: np.ndarray, k: int) -> int:
    """|x| of group k of the sub-block at xb[o:] into xval, and its 7 stored sign bits; with an odd number of
    negatives the least important value (least w x^2) keeps the wrong sign, negated in xval."""
    s = 0
    flips = 0
    for i in range(8):
        v = xb[o + 8 * k + i]
        if v >= 0:
            xval[8 * k + i] = v
        else:
            xval[8 * k + i] = -v
            flips += 1
            s |= 1 << i
    if flips % 2:
        imin = 0
        v = xb[o + 8 * k]
        least = weight[8 * k] * v * v
        for i in range(1, 8):
            v = xb[o + 8 * k + i]
            ax = weight[8 * k + i] * v * v
            if ax < least:
                least = ax
                imin = i
        xval[8 * k + imin] = -xval[8 * k + imin]
        s ^= 1 << imin
    return s & 127


@njit(**NJIT)
def _largest(xval: np.ndarray) -> np.float32:
    mx = xval[0]
    for i in range(1, xval.size):
        mx = mx if mx > xval[i] else xval[i]
    return mx


@njit(**NJIT)
def _scale_code(id_: np.float32, scale: np.float32) -> int:
    """A sub-block scale as its 4-bit code s (decoded as d (2 s + 1) / 2 in the search's units)."""
    return max(0, min(15, nearest_int_fma(np.float32(0.5), fmaf(id_, scale, np.float32(-1.0)))))


@njit(inline="always", **NJIT)
def _run_trials(levels: np.ndarray, dense: np.ndarray, dense_at: np.ndarray, kmap: np.ndarray,
                neighbours: np.ndarray, weight: np.ndarray, waux: np.ndarray, xval: np.ndarray, eff_max: np.float32,
                n_unfused: int, scale: np.float32, trials: Trials) -> tuple[int, np.float32, np.float32]:
    """A sub-block's trials side by side: the inverse scales (5 + 0.1 k) / eff_max, k centred on 0, rounded (the
    first n_unfused groups unfused), searched and fitted, then compared in ik's order: (chosen trial or -1, best,
    scale, `scale` itself when no trial fits)."""
    ids, levels_t, keys, _, sumqx, sumq2, _ = trials
    for t in range(ids.size):
        ids[t] = fmaf(np.float32(t - ids.size // 2), np.float32(0.1), np.float32(2 * K_MAX_Q - 1)) / eff_max
    _round_trials(ids, xval, n_unfused, levels_t, keys)
    _search_trials(levels, dense, dense_at, kmap, neighbours, xval, waux, trials)
    fit_trials(weight, xval, levels_t, sumqx, sumq2)
    return best_trial(sumqx, sumq2, np.float32(0.0), scale)


@njit(**NJIT)
def _iq2_xxs_sub_block(levels: np.ndarray, dense: np.ndarray, dense_at: np.ndarray, kmap: np.ndarray,
                       neighbours: np.ndarray, weight: np.ndarray, waux: np.ndarray, xval: np.ndarray, L: np.ndarray,
                       Lqp: np.ndarray, trials: Trials) -> np.float32:
    """Levels (into L) and scale of a 32-value IQ2_XXS sub-block; the 13 trials side by side as in IQ2_S's."""
    scale = make_qp_quants(K_MAX_Q + 1, xval, Lqp, weight)
    for i in range(32):
        L[i] = Lqp[i]
    chosen, _, scale = _run_trials(levels, dense, dense_at, kmap, neighbours, weight, waux, xval,
                                   scale * np.float32(K_MAX_Q), 0, scale, trials)
    if chosen >= 0:
        for i in range(32):
            L[i] = trials[1][i, chosen]
    if scale > 0:
        id_ = np.float32(1.0) / scale
        for k in range(4):
            _round_group(levels, dense, dense_at, kmap, neighbours, id_, scale, xval, waux, 8 * k, L)
        sumqx0, sumq20 = _fit(weight, xval, L)
        if sumq20 > 0:
            scale = sumqx0 / sumq20
    return scale


@njit(**KERNEL)
def quantize_iq2_xxs(x: np.ndarray, qw: np.ndarray, out: np.ndarray, levels: np.ndarray, dense: np.ndarray,
                     dense_at: np.ndarray,
                     kmap: np.ndarray, neighbours: np.ndarray) -> None:
    """Rows x into IQ2_XXS blocks (qw: importance vector, or empty for ik's unweighted branch)."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        weight = np.empty(32, dtype=np.float32)
        waux = np.empty(32, dtype=np.float32)
        xval = np.empty(32, dtype=np.float32)
        L = np.zeros(32, dtype=np.int64)
        Lqp = np.zeros(32, dtype=np.uint8)
        trials = _trial_scratch(13, 32)
        signs = np.zeros(4, dtype=np.int64)
        scales = np.zeros(8, dtype=np.float32)
        words = np.zeros(16, dtype=np.uint32)
        for ibl in range(n // QK_K):
            blk = out[r, ibl * IQ2_XXS_BYTES : (ibl + 1) * IQ2_XXS_BYTES]
            blk[:] = 0
            words[:] = 0
            xbl = x[r, ibl * QK_K : (ibl + 1) * QK_K]
            qbl = qw[ibl * QK_K : (ibl + 1) * QK_K]
            sigma2 = sum_squares(xbl) / np.float32(QK_K)
            max_scale = np.float32(0.0)
            aborted = False
            for ib in range(8):
                _weights(xbl, qbl, 32 * ib, sigma2, True, weight)
                _roots(weight, waux)
                for k in range(4):
                    signs[k] = _even_signs(xbl, 32 * ib, weight, xval, k)
                if _largest(xval) < GROUP_MAX_EPS:
                    scales[ib] = 0
                    L[:] = 0
                    continue
                scale = _iq2_xxs_sub_block(levels, dense, dense_at, kmap, neighbours, weight, waux, xval, L, Lqp,
                                           trials)
                if scale < 0:
                    scale = -scale
                    for k in range(4):
                        signs[k] = ~signs[k] & 127
                for k in range(4):
                    g = _point(kmap, L, 8 * k)
                    if g < 0:
                        aborted = True
                        g = 0
                    words[2 * ib] |= np.uint32(g) << np.uint32(8 * k)
                    words[2 * ib + 1] |= np.uint32(signs[k]) << np.uint32(7 * k)
                aborted = aborted or not scale >= 0
                scales[ib] = scale
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == 0:
                continue
            d = max_scale / np.float32(31.0)
            store_f16(blk, 0, d)
            id_ = np.float32(1.0) / d
            for ib in range(8):
                words[2 * ib + 1] |= np.uint32(_scale_code(id_, scales[ib])) << np.uint32(28)
            _store_words(blk, words)
            if aborted:
                _store_nan_d(blk)


@njit(**NJIT)
def _store_words(blk: np.ndarray, words: np.ndarray) -> None:
    for j in range(words.size):
        for b in range(4):
            blk[2 + 4 * j + b] = (words[j] >> np.uint32(8 * b)) & np.uint32(255)


@njit(**NJIT)
def _store_nan_d(blk: np.ndarray) -> None:
    blk[0] = NAN_F16 & 0xFF
    blk[1] = NAN_F16 >> 8


@njit(**NJIT)
def _split_scale(weight: np.ndarray, xval: np.ndarray, order: np.ndarray, sumx: np.ndarray,
                 sumw: np.ndarray) -> np.float32:
    """IQ2_XS's first scale: the best weighted fit over every split of the sorted values into magnitudes 1, 3, 5."""
    n = xval.size
    for j in range(n):  # stable insertion sort by value (glibc's merge sort keeps equal values in index order)
        order[j] = j
        i = j
        while i > 0 and xval[order[i - 1]] > xval[j]:
            order[i] = order[i - 1]
            i -= 1
        order[i] = j
    sumx[0] = 0
    sumw[0] = 0
    for j in range(n):
        i = order[j]
        sumx[j + 1] = fmaf(weight[i], xval[i], sumx[j])
        sumw[j + 1] = sumw[j] + weight[i]
    best = np.float32(0.0)
    scale = np.float32(0.0)
    for i1 in range(n + 1):
        for i2 in range(i1, n + 1):
            sumqx = fmaf(sumx[n] - sumx[i2], np.float32(5.0), fmaf(sumx[i2] - sumx[i1], np.float32(3.0),
                                                                  sumx[i1] - sumx[0]))
            sumq2 = fmaf(sumw[n] - sumw[i2], np.float32(25.0), fmaf(sumw[i2] - sumw[i1], np.float32(9.0),
                                                                   sumw[i1] - sumw[0]))
            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                scale = sumqx / sumq2
                best = scale * sumqx
    return scale


@njit(**NJIT)
def _iq2_xs_sub_block(levels: np.ndarray, dense: np.ndarray, dense_at: np.ndarray, kmap: np.ndarray,
                      neighbours: np.ndarray, weight: np.ndarray, waux: np.ndarray, xval: np.ndarray, L: np.ndarray,
                      Laux: np.ndarray, index: np.ndarray, aux_index: np.ndarray, order: np.ndarray, sumx: np.ndarray,
                      sumw: np.ndarray, trials: Trials) -> np.float32:
    """Levels (into L, left as they were when no trial fits) and scale of a 16-value IQ2_XS sub-block; the 15
    trials side by side as in IQ2_S's, the re-roundings after them one by one."""
    levels_t, points = trials[1], trials[3]
    scale = _split_scale(weight, xval, order, sumx, sumw)
    chosen, best, scale = _run_trials(levels, dense, dense_at, kmap, neighbours, weight, waux, xval,
                                      scale * np.float32(2 * K_MAX_Q - 1), 0, scale, trials)
    index[:] = 0
    if chosen >= 0:
        for i in range(16):
            L[i] = levels_t[i, chosen]
        for k in range(2):
            index[k] = points[k, chosen]
    if scale != 0:
        for _ in range(3):
            id_ = np.float32(1.0) / scale
            changed = False
            for k in range(2):
                aux_index[k] = _round_group(levels, dense, dense_at, kmap, neighbours, id_, scale, xval, waux,
                                            8 * k,
                                            Laux)[0]
                changed = changed or aux_index[k] != index[k]
            if not changed:
                break
            fx, f2 = _fit(weight, xval, Laux)
            if not (f2 > 0 and fx * fx > best * f2):
                break
            scale = fx / f2
            best = scale * fx
            L[:] = Laux
            index[:] = aux_index
    return scale


@njit(**NJIT)
def _xs_refit_d(xbl: np.ndarray, qbl: np.ndarray, sigma2: np.float32, blk: np.ndarray, weight: np.ndarray,
                stored: np.ndarray) -> None:
    """IQ2_XS's final d: 1.05 times the weighted fit of x by the block's decoded values at unit d."""
    sumqx = np.float32(0.0)
    sumq2 = np.float32(0.0)
    for ib in range(16):
        l = 2 * ((blk[66 + ib // 2] >> (4 * (ib % 2))) & 15) + 1
        _weights(xbl, qbl, 16 * ib, sigma2, False, weight)
        for k in range(2):
            o = 2 + 4 * ib + 2 * k
            v = np.int64(blk[o]) | (np.int64(blk[o + 1]) << 8)
            g = v & 511
            signs = KSIGNS[v >> 9]
            for j in range(8):
                w = weight[8 * k + j]
                q = np.float32(0.125) * np.float32(l) * np.float32(stored[g, j])
                if (signs >> j) & 1:
                    q = -q
                sumqx = fmaf(w * q, xbl[16 * ib + 8 * k + j], sumqx)
                sumq2 = fmaf(w * q, q, sumq2)
    if sumq2 > 0:
        store_f16(blk, 0, np.float32(1.05) * sumqx / sumq2)


@njit(**KERNEL)
def quantize_iq2_xs(x: np.ndarray, qw: np.ndarray, out: np.ndarray, levels: np.ndarray, dense: np.ndarray,
                    dense_at: np.ndarray,
                    kmap: np.ndarray, neighbours: np.ndarray, stored: np.ndarray) -> None:
    """Rows x into IQ2_XS blocks (qw: importance vector, or empty; stored: the grid's decoded magnitudes)."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        weight = np.empty(16, dtype=np.float32)
        waux = np.empty(16, dtype=np.float32)
        xval = np.empty(16, dtype=np.float32)
        L = np.zeros(16, dtype=np.int64)
        Laux = np.zeros(16, dtype=np.int64)
        index = np.zeros(2, dtype=np.int64)
        aux_index = np.zeros(2, dtype=np.int64)
        order = np.zeros(16, dtype=np.int64)
        sumx = np.zeros(17, dtype=np.float32)
        sumw = np.zeros(17, dtype=np.float32)
        signs = np.zeros(2, dtype=np.int64)
        scales = np.zeros(16, dtype=np.float32)
        trials = _trial_scratch(15, 16)
        for ibl in range(n // QK_K):
            blk = out[r, ibl * IQ2_XS_BYTES : (ibl + 1) * IQ2_XS_BYTES]
            blk[:] = 0
            xbl = x[r, ibl * QK_K : (ibl + 1) * QK_K]
            qbl = qw[ibl * QK_K : (ibl + 1) * QK_K]
            sigma2 = sum_squares(xbl) / np.float32(QK_K)
            max_scale = np.float32(0.0)
            aborted = False
            for ib in range(16):
                _weights(xbl, qbl, 16 * ib, sigma2, False, weight)
                _roots(weight, waux)
                for k in range(2):
                    signs[k] = _even_signs(xbl, 16 * ib, weight, xval, k)
                if _largest(xval) < GROUP_MAX_EPS:
                    scales[ib] = 0
                    L[:] = 0
                    continue
                scale = _iq2_xs_sub_block(levels, dense, dense_at, kmap, neighbours, weight, waux, xval, L, Laux,
                                          index, aux_index, order, sumx, sumw, trials)
                if scale < 0:
                    scale = -scale
                    for k in range(2):
                        signs[k] = ~signs[k] & 127
                for k in range(2):
                    g = _point(kmap, L, 8 * k)
                    if g < 0:
                        aborted = True
                        g = 0
                    v = g | (signs[k] << 9)
                    blk[2 + 4 * ib + 2 * k] = v & 255
                    blk[3 + 4 * ib + 2 * k] = v >> 8
                aborted = aborted or not scale >= 0
                scales[ib] = scale
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == 0:
                blk[2:66] = 0
                continue
            d = max_scale / np.float32(31.0)
            store_f16(blk, 0, d)
            id_ = np.float32(1.0) / d
            for ib in range(16):
                blk[66 + ib // 2] |= np.uint8(_scale_code(id_, scales[ib]) << (4 * (ib % 2)))
            _xs_refit_d(xbl, qbl, sigma2, blk, weight, stored)
            if aborted:
                _store_nan_d(blk)


#: a sub-block's trial scratch (_trial_scratch): inverse scales, levels [value, trial], group keys and grid points
#: [group, trial], the fits' sums, and one row of levels for the neighbour search
Trials = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@njit(**NJIT)
def _trial_scratch(n_trials: int, n: int) -> Trials:
    return (np.empty(n_trials, dtype=np.float32), np.empty((n, n_trials), dtype=np.int32),
            np.empty((n // 8, n_trials), dtype=np.int32), np.empty((n // 8, n_trials), dtype=np.int32),
            np.empty(n_trials, dtype=np.float32), np.empty(n_trials, dtype=np.float32), np.zeros(n, dtype=np.int64))


@njit(**NJIT)
def _search_trials(levels: np.ndarray, dense: np.ndarray, dense_at: np.ndarray, kmap: np.ndarray,
                   neighbours: np.ndarray, xval: np.ndarray, waux: np.ndarray,
                   trials: Trials) -> None:
    """Each trial's groups that rounded off the grid replaced by their best neighbour at that trial's scale; every
    group's grid point into points[k, t]."""
    ids, levels_t, keys, points, _, _, row = trials
    for t in range(ids.size):
        for k in range(keys.shape[0]):
            g = kmap[keys[k, t]]
            if g < 0:
                g = _best_neighbour(levels, dense, dense_at, neighbours, -g - 1, xval, waux, 8 * k,
                                    np.float32(1.0) / ids[t], row)
                for i in range(8 * k, 8 * k + 8):
                    levels_t[i, t] = row[i]
            points[k, t] = g


@njit(**NJIT)
def _round_trials(ids: np.ndarray, xval: np.ndarray, n_unfused: int, levels_t: np.ndarray, keys: np.ndarray) -> None:
    """Every trial's rounding at once: levels_t[i, t] the level of xval[i] at inverse scale ids[t], keys[k, t] the
    grid key of group k. Trial-minor, so each loop runs across the trials in vector lanes; the first n_unfused
    groups round id x before subtracting 1 (as ik's build does for IQ2_S's first group), the others fuse it."""
    n_trials = ids.size
    for i in range(xval.size):
        v = xval[i]
        if i < 8 * n_unfused:
            for t in range(n_trials):
                levels_t[i, t] = _level(ids[t], v, False)
        else:
            for t in range(n_trials):
                levels_t[i, t] = _level(ids[t], v, True)
    for k in range(xval.size // 8):
        for t in range(n_trials):
            keys[k, t] = 0
        for i in range(8):
            for t in range(n_trials):
                keys[k, t] |= levels_t[8 * k + i, t] << (2 * i)


@njit(**NJIT)
def _iq2_s_sub_block(levels: np.ndarray, dense: np.ndarray, dense_at: np.ndarray, kmap: np.ndarray,
                     neighbours: np.ndarray, weight: np.ndarray, waux: np.ndarray, xval: np.ndarray, mx: np.float32,
                     L: np.ndarray, trials: Trials) -> np.float32:
    """Levels (into L, left as they were when no trial fits) and scale of a 16-value IQ2_S sub-block: the 19 trials
    side by side (_run_trials), then the off-grid groups of the chosen one re-rounded at its fitted scale."""
    levels_t, keys = trials[1], trials[2]
    # ik's build rounds the first group's id x before subtracting 1 in the trials (the second's is fused)
    chosen, _, scale = _run_trials(levels, dense, dense_at, kmap, neighbours, weight, waux, xval, mx, 1,
                                   mx / np.float32(2 * K_MAX_Q - 1), trials)
    if chosen < 0:
        return scale
    for i in range(16):
        L[i] = levels_t[i, chosen]
    on_grid0 = kmap[keys[0, chosen]] >= 0
    on_grid1 = kmap[keys[1, chosen]] >= 0
    if (not on_grid0 or not on_grid1) and scale > 0:
        id_ = np.float32(1.0) / scale
        if not on_grid0:
            _round_group(levels, dense, dense_at, kmap, neighbours, id_, scale, xval, waux, 0, L)
        if not on_grid1:
            _round_group(levels, dense, dense_at, kmap, neighbours, id_, scale, xval, waux, 8, L)
        sumqx0, sumq20 = _fit(weight, xval, L)
        if sumq20 > 0:
            scale = sumqx0 / sumq20
    return scale


@njit(**KERNEL)
def quantize_iq2_s(x: np.ndarray, qw: np.ndarray, out: np.ndarray, levels: np.ndarray, dense: np.ndarray,
                   dense_at: np.ndarray, kmap: np.ndarray, neighbours: np.ndarray) -> None:
    """Rows x into IQ2_S blocks (qw: importance vector, or empty for weights from x alone)."""
    n_rows, n = x.shape
    for r in prange(n_rows):
        weight = np.empty(16, dtype=np.float32)
        waux = np.empty(16, dtype=np.float32)
        xval = np.empty(16, dtype=np.float32)
        L = np.zeros(16, dtype=np.int64)
        signs = np.zeros(2, dtype=np.int64)
        scales = np.zeros(16, dtype=np.float32)
        trials = _trial_scratch(19, 16)
        for ibl in range(n // QK_K):
            blk = out[r, ibl * IQ2_S_BYTES : (ibl + 1) * IQ2_S_BYTES]
            blk[:] = 0
            xbl = x[r, ibl * QK_K : (ibl + 1) * QK_K]
            qbl = qw[ibl * QK_K : (ibl + 1) * QK_K]
            sigma2 = np.float32(2.0) * sum_squares(xbl) / np.float32(QK_K)
            max_scale = np.float32(0.0)
            aborted = False
            for ib in range(16):
                _weights(xbl, qbl, 16 * ib, sigma2, False, weight)
                _roots(weight, waux)
                for k in range(2):
                    s = 0
                    for i in range(8):
                        v = xbl[16 * ib + 8 * k + i]
                        if v >= 0:
                            xval[8 * k + i] = v
                        else:
                            xval[8 * k + i] = -v
                            s |= 1 << i
                    signs[k] = s
                mx = _largest(xval)
                if mx < GROUP_MAX_EPS_IQ2_S:
                    scales[ib] = 0
                    continue
                scale = _iq2_s_sub_block(levels, dense, dense_at, kmap, neighbours, weight, waux, xval, mx, L, trials)
                if scale < 0:
                    scale = -scale
                    for k in range(2):
                        signs[k] = ~signs[k] & 255
                for k in range(2):
                    g = _point(kmap, L, 8 * k)
                    if g < 0:
                        aborted = True
                        g = 0
                    i8 = 2 * ib + k
                    blk[2 + i8] = g & 255
                    blk[66 + i8 // 4] |= np.uint8((g >> 8) << (2 * (i8 % 4)))
                    blk[34 + i8] = signs[k]
                aborted = aborted or not scale >= 0
                scales[ib] = scale
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == 0:
                continue
            d = max_scale / np.float32(31.0)
            store_f16(blk, 0, d * np.float32(0.9875))
            id_ = np.float32(1.0) / d
            for ib in range(16):
                blk[74 + ib // 2] |= np.uint8(_scale_code(id_, scales[ib]) << (4 * (ib % 2)))
            if aborted:
                _store_nan_d(blk)
