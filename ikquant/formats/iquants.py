"""IQ3_XXS and IQ3_S: the 3-bit i-quants ik shares with mainline llama.cpp (ik's recipes put IQ3_S on token_embd
for IQ3_KT, and IQ3_XXS beside IQ3_S in IQ3_XS).

Both code each group of four values as one point of a grid of odd magnitudes 1..15 (IQ3_XXS: 256 points, 8-bit
indices; IQ3_S: 512 points, 9-bit indices, the 9th bit in qh), with the signs apart and a 4-bit scale per 32-value
sub-block under an f16 d per 256 values:

- IQ3_XXS (98 bytes): d, 64 grid indices, then per sub-block a u32 of four 7-bit sign groups (the 8th sign of each
  group of 8 is its parity: ik flips the least important value when a group has an odd number of negatives) and
  the scale in the top 4 bits; value = d * (0.5 + s) / 2 * m * sign, m = 4 (2 l + 1) for levels l < 7 but 62
  for l = 7 (ik's decoding table; its search fits 2 l + 1).
- IQ3_S (110 bytes): d, 64 low index bytes, 8 high-bit bytes, 32 sign bytes, 4 bytes of two scales;
  value = d * (1 + 2 s) * grid * sign.

ik's search (quantize_row_iq3_xxs_impl / quantize_row_iq3_s_impl) takes |x|, tries inverse scales around 15 / max
(31 for IQ3_XXS, 19 for IQ3_S), rounds each group to the nearest grid point (the nearest of the precomputed
neighbours, by importance-weighted distance, when the rounded point is off the grid), keeps the best weighted fit,
re-rounds (IQ3_XXS: only the groups that were off the grid) and refits once, and stores d = f * max scale / 31
(f = 1.0125, 1.033). The grids and neighbour lists are built as ik's iq3xs_init_impl builds them (every grid point
within the 2 (256) or 3 (512) smallest distances, by distance then index), once per process. Multiply-adds are
fused as GCC contracts them. One quirk of ik's IQ3_S search is kept: an all-zero sub-block does not advance its qs
and signs write positions, so the following sub-blocks' indices and signs land one slot early.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from ikquant.formats.base import Codec
from ikquant.formats.listed_search import nearest_listed, nearest_listed_lanes
from ikquant.formats.numeric import f32_to_f16_bits, fmaf, load_f16, nearest_int
from ikquant.formats.trials import best_trial, fit_trials
from ikquant.formats.vector_ir import LANES, whole_vectors

QK_K = 256
BLOCK = 32
IQ3_S_BYTES = 110  # d (2), qs (64), qh (8), signs (32), scales (4)
IQ3_XXS_BYTES = 98  # d (2), qs (64), scales and signs (32)
K_MAX_Q = 8
GROUP_MAX_EPS = np.float32(1e-8)  # ik: an IQ3_XXS sub-block below this maximum is stored as zeros
NJIT = dict(cache=True, nogil=True, error_model="numpy")
KERNEL = dict(cache=True, nogil=True, parallel=True, error_model="numpy")

#: ik's kgrid_256 and kgrid_512: 4 x 3-bit levels l (magnitude 2 l + 1) per grid point
KGRID_256 = np.array([
    0, 2, 4, 9, 11, 15, 16, 18, 25, 34, 59, 61, 65, 67, 72, 74,
    81, 85, 88, 90, 97, 108, 120, 128, 130, 132, 137, 144, 146, 153, 155, 159,
    169, 175, 189, 193, 199, 200, 202, 213, 248, 267, 287, 292, 303, 315, 317, 321,
    327, 346, 362, 413, 436, 456, 460, 462, 483, 497, 513, 515, 520, 522, 529, 531,
    536, 538, 540, 551, 552, 576, 578, 585, 592, 594, 641, 643, 648, 650, 657, 664,
    698, 704, 706, 720, 729, 742, 758, 769, 773, 808, 848, 852, 870, 889, 901, 978,
    992, 1024, 1026, 1033, 1035, 1040, 1042, 1046, 1049, 1058, 1089, 1091, 1093, 1096, 1098, 1105,
    1112, 1139, 1143, 1144, 1152, 1154, 1161, 1167, 1168, 1170, 1183, 1184, 1197, 1217, 1224, 1228,
    1272, 1276, 1309, 1323, 1347, 1367, 1377, 1404, 1473, 1475, 1486, 1509, 1537, 1544, 1546, 1553,
    1555, 1576, 1589, 1594, 1600, 1602, 1616, 1625, 1636, 1638, 1665, 1667, 1672, 1685, 1706, 1722,
    1737, 1755, 1816, 1831, 1850, 1856, 1862, 1874, 1901, 1932, 1950, 1971, 2011, 2032, 2052, 2063,
    2077, 2079, 2091, 2095, 2172, 2192, 2207, 2208, 2224, 2230, 2247, 2277, 2308, 2345, 2356, 2389,
    2403, 2424, 2501, 2504, 2506, 2520, 2570, 2593, 2616, 2624, 2630, 2646, 2669, 2700, 2714, 2746,
    2754, 2795, 2824, 2835, 2839, 2874, 2882, 2905, 2984, 3028, 3042, 3092, 3108, 3110, 3124, 3153,
    3185, 3215, 3252, 3288, 3294, 3364, 3397, 3434, 3483, 3523, 3537, 3587, 3589, 3591, 3592, 3610,
    3626, 3670, 3680, 3722, 3749, 3754, 3776, 3789, 3803, 3824, 3857, 3873, 3904, 3906, 3924, 3992,
], dtype=np.int64)
KGRID_512 = np.array([
    0, 1, 2, 5, 7, 8, 9, 10, 12, 14, 16, 17, 21, 27, 32, 34,
    37, 39, 41, 43, 48, 50, 57, 60, 63, 64, 65, 66, 68, 72, 73, 77,
    80, 83, 87, 89, 93, 100, 113, 117, 122, 128, 129, 133, 135, 136, 139, 142,
    145, 149, 152, 156, 162, 165, 167, 169, 171, 184, 187, 195, 201, 205, 208, 210,
    217, 219, 222, 228, 232, 234, 247, 249, 253, 256, 267, 271, 273, 276, 282, 288,
    291, 297, 312, 322, 324, 336, 338, 342, 347, 353, 357, 359, 374, 379, 390, 393,
    395, 409, 426, 441, 448, 450, 452, 464, 466, 470, 475, 488, 492, 512, 513, 514,
    516, 520, 521, 523, 525, 527, 528, 530, 537, 540, 542, 556, 558, 561, 570, 576,
    577, 579, 582, 584, 588, 593, 600, 603, 609, 616, 618, 632, 638, 640, 650, 653,
    655, 656, 660, 666, 672, 675, 685, 688, 698, 705, 708, 711, 712, 715, 721, 727,
    728, 732, 737, 754, 760, 771, 773, 778, 780, 793, 795, 802, 806, 808, 812, 833,
    840, 843, 849, 856, 858, 873, 912, 916, 919, 932, 934, 961, 963, 968, 970, 977,
    989, 993, 1010, 1016, 1024, 1025, 1027, 1029, 1031, 1032, 1034, 1036, 1038, 1041, 1043, 1047,
    1048, 1050, 1057, 1059, 1061, 1064, 1066, 1079, 1080, 1083, 1085, 1088, 1090, 1096, 1099, 1103,
    1106, 1109, 1113, 1116, 1122, 1129, 1153, 1156, 1159, 1169, 1171, 1176, 1183, 1185, 1195, 1199,
    1209, 1212, 1216, 1218, 1221, 1225, 1234, 1236, 1241, 1243, 1250, 1256, 1270, 1281, 1287, 1296,
    1299, 1306, 1309, 1313, 1338, 1341, 1348, 1353, 1362, 1375, 1376, 1387, 1400, 1408, 1410, 1415,
    1425, 1453, 1457, 1477, 1481, 1494, 1496, 1507, 1512, 1538, 1545, 1547, 1549, 1551, 1554, 1561,
    1563, 1565, 1570, 1572, 1575, 1577, 1587, 1593, 1601, 1603, 1605, 1612, 1617, 1619, 1632, 1648,
    1658, 1662, 1664, 1674, 1680, 1690, 1692, 1704, 1729, 1736, 1740, 1745, 1747, 1751, 1752, 1761,
    1763, 1767, 1773, 1787, 1795, 1801, 1806, 1810, 1817, 1834, 1840, 1844, 1857, 1864, 1866, 1877,
    1882, 1892, 1902, 1915, 1934, 1953, 1985, 1987, 2000, 2002, 2013, 2048, 2052, 2058, 2064, 2068,
    2071, 2074, 2081, 2088, 2104, 2114, 2119, 2121, 2123, 2130, 2136, 2141, 2147, 2153, 2157, 2177,
    2179, 2184, 2189, 2193, 2203, 2208, 2223, 2226, 2232, 2244, 2249, 2251, 2256, 2258, 2265, 2269,
    2304, 2306, 2324, 2335, 2336, 2361, 2373, 2375, 2385, 2418, 2443, 2460, 2480, 2504, 2509, 2520,
    2531, 2537, 2562, 2568, 2572, 2578, 2592, 2596, 2599, 2602, 2614, 2620, 2625, 2627, 2629, 2634,
    2641, 2650, 2682, 2688, 2697, 2707, 2712, 2718, 2731, 2754, 2759, 2760, 2775, 2788, 2793, 2805,
    2811, 2817, 2820, 2832, 2842, 2854, 2890, 2902, 2921, 2923, 2978, 3010, 3012, 3026, 3081, 3083,
    3085, 3097, 3099, 3120, 3136, 3152, 3159, 3188, 3210, 3228, 3234, 3245, 3250, 3256, 3264, 3276,
    3281, 3296, 3349, 3363, 3378, 3392, 3395, 3420, 3440, 3461, 3488, 3529, 3531, 3584, 3588, 3591,
    3600, 3602, 3614, 3616, 3628, 3634, 3650, 3657, 3668, 3683, 3685, 3713, 3716, 3720, 3726, 3729,
    3736, 3753, 3778, 3802, 3805, 3819, 3841, 3845, 3851, 3856, 3880, 3922, 3938, 3970, 3993, 4032,
], dtype=np.int64)


def _grid(kgrid: np.ndarray) -> np.ndarray:
    """[points, 4] magnitudes 2 l + 1 of a grid's points."""
    return (2 * ((kgrid[:, None] >> (3 * np.arange(4))[None, :]) & 7) + 1).astype(np.int8)


#: the neighbour lists (search_tables): counts and grid indices; their magnitudes in listed_search's dense layout;
#: where each list's magnitudes start, by the list's offset in the first; each entry's four magnitudes as the bytes
#: of a uint32 (nearest_listed_lanes), by the same offsets as the first
Lists = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@functools.cache
def search_tables(points: int) -> tuple[np.ndarray, np.ndarray, Lists]:
    """(grid, map [4096] (index >= 0 on the grid, else -(offset + 1) into neighbours), the neighbour lists) of the
    256- or 512-point grid, for the 2 or 3 smallest distances; built on first quantize (~0.15 s each), not by every
    command that imports the codecs. The lists (Lists): each a count then that many grid indices, and again as
    magnitudes laid out for listed_search."""
    kgrid, nearest_levels = (KGRID_256, 2) if points == 256 else (KGRID_512, 3)
    levels = (kgrid[:, None] >> (3 * np.arange(4))[None, :]) & 7
    grid = _grid(kgrid)
    kmap = np.full(4096, -1, dtype=np.int64)
    kmap[(levels << (3 * np.arange(4))[None, :]).sum(axis=1)] = np.arange(len(grid))
    off = np.flatnonzero(kmap < 0)
    points_off = 2 * ((off[:, None] >> (3 * np.arange(4))[None, :]) & 7) + 1
    dist = ((grid.astype(np.int64)[None, :, :] - points_off[:, None, :]) ** 2).sum(axis=2)  # [off-grid, grid]
    order = np.argsort(dist, axis=1, kind="stable")  # by distance, then index
    neighbours: list[int] = []
    starts: list[int] = []
    dense: list[np.ndarray] = []
    at = [0]
    for row, i in enumerate(off):
        limit = np.unique(dist[row])[nearest_levels - 1]
        kept = order[row][dist[row][order[row]] <= limit]
        kmap[i] = -(len(neighbours) + 1)
        starts.append(len(neighbours))
        block = np.zeros((4, whole_vectors(len(kept))), dtype=np.uint8)  # value-major, whole vectors
        block[:, : len(kept)] = grid[kept].T
        dense.append(block.ravel())
        at.append(at[-1] + block.size)
        neighbours += [len(kept), *kept.tolist()]
    dense_at = np.zeros(len(neighbours), dtype=np.int64)
    dense_at[starts] = at[:-1]
    packed_grid = (grid.astype(np.uint32) << (8 * np.arange(4, dtype=np.uint32))).sum(axis=1, dtype=np.uint32)
    packed = packed_grid[np.minimum(neighbours, len(grid) - 1)]  # the counts' slots hold no point
    return grid, kmap, (np.array(neighbours, dtype=np.int64), np.concatenate(dense), dense_at, packed)


GRID_256 = _grid(KGRID_256)
GRID_512 = _grid(KGRID_512)
#: IQ3_XXS decodes level l as these magnitudes (ik's iq3xxs_grid: 4 (2 l + 1), except 62 for the top level), where
#: the search uses 2 l + 1
IQ3_XXS_LEVELS = np.array([4, 12, 20, 28, 36, 44, 52, 62], dtype=np.int64)
DQ_GRID_256 = IQ3_XXS_LEVELS[(GRID_256.astype(np.int64) - 1) // 2]
#: ik's ksigns_iq2xs: 7 stored sign bits -> 8, the 8th making the count of negatives even
KSIGNS = np.array([i | (128 if bin(i).count("1") % 2 else 0) for i in range(128)], dtype=np.uint8)


@njit(inline="always", **NJIT)
def _best_neighbour(grid: np.ndarray, lists: Lists, start: int, xval: np.ndarray, w: np.ndarray, o: int,
                    scale: np.float32, out: np.ndarray) -> int:
    """ik's iq3_find_best_neighbour (listed_search.nearest_listed): the listed neighbour with the smallest weighted
    squared error, the first on ties; its levels into out[o:o+4] (ik's index -1, the last point, when no sum is
    finite)."""
    neighbours, dense, dense_at, _ = lists
    count = neighbours[start]
    j = nearest_listed(dense, dense_at[start], count,
                       (-xval[o], -xval[o + 1], -xval[o + 2], -xval[o + 3]), (w[o], w[o + 1], w[o + 2], w[o + 3]),
                       scale, np.float32(1.0), np.float32(0.0))
    g = neighbours[start + 1 + j] if j >= 0 else -1
    for i in range(4):
        out[o + i] = (grid[g, i] - 1) // 2
    return g


@njit(**NJIT)
def _weights(xbl: np.ndarray, qw: np.ndarray, o: int, sigma2: np.float32, ib: int, weight: np.ndarray,
             waux: np.ndarray) -> None:
    """Sub-block ib's importance (qw * sqrt(sigma2 + x^2), or x^2 without an imatrix) and its square root."""
    for i in range(BLOCK):
        v = xbl[ib * BLOCK + i]
        weight[i] = qw[o + ib * BLOCK + i] * np.sqrt(fmaf(v, v, sigma2)) if qw.size else v * v
        waux[i] = np.sqrt(weight[i])


@njit(**NJIT)
def _sigma2(xbl: np.ndarray) -> np.float32:
    sumx2 = np.float32(0.0)
    for i in range(QK_K):
        sumx2 = fmaf(xbl[i], xbl[i], sumx2)
    return np.float32(2.0) * sumx2 / np.float32(QK_K)


@njit(**NJIT)
def _search(grid: np.ndarray, kmap: np.ndarray, lists: Lists, n_steps: int, weight: np.ndarray, waux: np.ndarray,
            xval: np.ndarray, mx: np.float32, L: np.ndarray, on_grid: np.ndarray, trials: Trials) -> np.float32:
    """The best weighted fit over inverse scales (15 + 0.2 k) / max, k = -n_steps..n_steps (one trial each in
    `trials`, trials.py's scheme, padded to whole vectors with copies of the last): its levels into L, which groups
    were on the grid into on_grid; returns its scale."""
    ids, levels_t, keys, sumqx, sumq2, lane_start, lane_count, lane_scale, lane_pos = trials
    neighbours, _, _, packed = lists
    n_trials = 2 * n_steps + 1
    for t in range(ids.size):
        ids[t] = fmaf(np.float32(min(t, n_trials - 1) - n_steps), np.float32(0.2), np.float32(2 * K_MAX_Q - 1)) / mx
    for i in range(BLOCK):
        v = xval[i]
        for t in range(ids.size):
            levels_t[i, t] = max(0, min(K_MAX_Q - 1, nearest_int(np.float32(0.5) * fmaf(ids[t], v, np.float32(-1.0)))))
    for k in range(BLOCK // 4):
        for t in range(ids.size):
            keys[k, t] = levels_t[4 * k, t] | (levels_t[4 * k + 1, t] << 3) | (levels_t[4 * k + 2, t] << 6) \
                | (levels_t[4 * k + 3, t] << 9)
    for k in range(BLOCK // 4):  # the off-grid groups' neighbour searches, eight trials at once
        o = 4 * k
        for t0 in range(0, n_trials, LANES):
            steps = 0
            for lane in range(LANES):
                t = t0 + lane
                g = kmap[keys[k, t]] if t < n_trials else 0
                lane_count[lane] = neighbours[-g - 1] if g < 0 else 0
                lane_start[lane] = -g if g < 0 else 0
                lane_scale[lane] = np.float32(1.0) / ids[t]
                steps = max(steps, lane_count[lane])
            if steps == 0:
                continue
            nearest_listed_lanes(packed, lane_start, lane_count, steps,
                                 (-xval[o], -xval[o + 1], -xval[o + 2], -xval[o + 3]),
                                 (waux[o], waux[o + 1], waux[o + 2], waux[o + 3]), lane_scale, lane_pos)
            for lane in range(LANES):
                if lane_count[lane] > 0:
                    j = lane_pos[lane]
                    g = neighbours[lane_start[lane] + j] if j >= 0 else -1  # ik's index -1: the last point
                    for i in range(4):
                        levels_t[o + i, t0 + lane] = (grid[g, i] - 1) // 2
    fit_trials(weight, xval, levels_t, sumqx, sumq2)
    chosen, _, scale = best_trial(sumqx[:n_trials], sumq2[:n_trials], np.float32(0.0),
                                  mx / np.float32(2 * K_MAX_Q - 1))
    if chosen < 0:
        on_grid[:] = False
        return scale
    for i in range(BLOCK):
        L[i] = levels_t[i, chosen]
    for k in range(BLOCK // 4):
        on_grid[k] = kmap[keys[k, chosen]] >= 0
    return scale


@njit(**NJIT)
def _refit(grid: np.ndarray, kmap: np.ndarray, lists: Lists, scale: np.float32, off_grid_only: bool,
           weight: np.ndarray, waux: np.ndarray, xval: np.ndarray, L: np.ndarray, Laux: np.ndarray,
           on_grid: np.ndarray) -> np.float32:
    """Re-round at the chosen scale (every group, or only those that were off the grid) and fit once more."""
    id_ = np.float32(1.0) / scale
    for k in range(BLOCK // 4):
        if off_grid_only and on_grid[k]:
            continue
        u = _round_group(id_, xval, 4 * k, Laux)
        g = kmap[u]
        if g < 0:
            g = _best_neighbour(grid, lists, -g - 1, xval, waux, 4 * k, scale, L)
        for i in range(4):
            L[4 * k + i] = (grid[g, i] - 1) // 2
    sumqx, sumq2 = _fit(weight, xval, L)
    return sumqx / sumq2 if sumq2 > 0 else scale


@njit(**NJIT)
def _round_group(id_: np.float32, xval: np.ndarray, o: int, out: np.ndarray) -> int:
    """Levels of xval[o:o+4] at inverse scale id_ into out, and their 12-bit grid key."""
    u = 0
    for i in range(4):
        l = nearest_int(np.float32(0.5) * fmaf(id_, xval[o + i], np.float32(-1.0)))
        l = max(0, min(K_MAX_Q - 1, l))
        out[o + i] = l
        u |= l << (3 * i)
    return u


@njit(**NJIT)
def _fit(weight: np.ndarray, xval: np.ndarray, levels: np.ndarray) -> tuple[np.float32, np.float32]:
    sumqx = np.float32(0.0)
    sumq2 = np.float32(0.0)
    for i in range(BLOCK):
        q = np.float32(2 * levels[i] + 1)
        sumqx = fmaf(weight[i] * xval[i], q, sumqx)
        sumq2 = fmaf(weight[i] * q, q, sumq2)
    return sumqx, sumq2


#: a sub-block's trials (trials.py): inverse scales, levels [value, trial], group keys [group, trial], the fits'
#: sums, and eight trials' searches (nearest_listed_lanes: list starts, counts, scales, found positions)
Trials = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
               np.ndarray]


@njit(**NJIT)
def _buffers(n_steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, Trials]:
    """A sub-block's work arrays: weights, their roots, |x|, levels (chosen, refit), groups on the grid, and the
    trials of inverse scales k = -n_steps..n_steps, padded to whole 8-lane vectors."""
    n_trials = whole_vectors(2 * n_steps + 1)
    trials = (np.empty(n_trials, dtype=np.float32), np.empty((BLOCK, n_trials), dtype=np.int32),
              np.empty((BLOCK // 4, n_trials), dtype=np.int32), np.empty(n_trials, dtype=np.float32),
              np.empty(n_trials, dtype=np.float32), np.zeros(LANES, dtype=np.int32), np.zeros(LANES, dtype=np.int32),
              np.zeros(LANES, dtype=np.float32), np.zeros(LANES, dtype=np.int32))
    return (np.empty(BLOCK, dtype=np.float32), np.empty(BLOCK, dtype=np.float32), np.empty(BLOCK, dtype=np.float32),
            np.zeros(BLOCK, dtype=np.int64), np.zeros(BLOCK, dtype=np.int64), np.zeros(BLOCK // 4, dtype=np.bool_),
            trials)


@njit(**NJIT)
def _fit_grid(grid: np.ndarray, kmap: np.ndarray, lists: Lists, n_steps: int, off_grid_only: bool,
              weight: np.ndarray, waux: np.ndarray, xval: np.ndarray, mx: np.float32, L: np.ndarray,
              Laux: np.ndarray, on_grid: np.ndarray, trials: Trials) -> np.float32:
    """A sub-block's levels (into L) and scale: the best fit over the inverse scales, then, when a group was off
    the grid, the re-rounded refit."""
    scale = _search(grid, kmap, lists, n_steps, weight, waux, xval, mx, L, on_grid, trials)
    if not on_grid.all() and scale > 0:
        scale = _refit(grid, kmap, lists, scale, off_grid_only, weight, waux, xval, L, Laux, on_grid)
    return scale


@njit(**KERNEL)
def _quantize_iq3_s(x: np.ndarray, qw: np.ndarray, out: np.ndarray, grid: np.ndarray, kmap: np.ndarray,
                    lists: Lists) -> None:
    n_rows, n = x.shape
    for r in prange(n_rows):
        weight, waux, xval, L, Laux, on_grid, trials = _buffers(9)
        signs = np.zeros(BLOCK // 8, dtype=np.uint8)
        scales = np.zeros(QK_K // BLOCK, dtype=np.float32)
        for ibl in range(n // QK_K):
            blk = out[r, ibl * IQ3_S_BYTES : (ibl + 1) * IQ3_S_BYTES]
            blk[:] = 0
            xbl = x[r, ibl * QK_K : (ibl + 1) * QK_K]
            sigma2 = _sigma2(xbl)
            qs_pos = 2
            sign_pos = 2 + 64 + 8
            max_scale = np.float32(0.0)
            for ib in range(QK_K // BLOCK):
                _weights(xbl, qw, ibl * QK_K, sigma2, ib, weight, waux)
                for k in range(BLOCK // 8):
                    s = 0
                    for i in range(8):
                        v = xbl[ib * BLOCK + 8 * k + i]
                        xval[8 * k + i] = v if v >= 0 else -v
                        if v < 0:
                            s |= 1 << i
                    signs[k] = s
                mx = xval.max()
                if mx == 0:
                    scales[ib] = 0  # ik's `continue`: qs and signs positions are not advanced
                    continue
                scale = _fit_grid(grid, kmap, lists, 9, False, weight, waux, xval, mx, L, Laux, on_grid, trials)
                if scale < 0:
                    scale = -scale
                    for k in range(BLOCK // 8):
                        signs[k] = ~signs[k]
                for k in range(BLOCK // 4):
                    g = kmap[_key(L, 4 * k)]
                    blk[qs_pos + k] = g & 255
                    blk[66 + ib] |= np.uint8((g >> 8) << k)
                qs_pos += BLOCK // 4
                blk[sign_pos : sign_pos + BLOCK // 8] = signs
                sign_pos += BLOCK // 8
                scales[ib] = scale
                max_scale = max(max_scale, scale)
            if max_scale == 0:
                continue
            id_ = _store_d(blk, max_scale, np.float32(1.033))
            for ib in range(0, QK_K // BLOCK, 2):
                blk[106 + ib // 2] = _scale_code(id_, scales[ib]) | (_scale_code(id_, scales[ib + 1]) << 4)


@njit(**NJIT)
def _key(L: np.ndarray, o: int) -> int:
    u = 0
    for i in range(4):
        u |= L[o + i] << (3 * i)
    return u


@njit(**NJIT)
def _store_d(blk: np.ndarray, max_scale: np.float32, fudge: np.float32) -> np.float32:
    """d = max scale / 31 stored as f16(fudge * d); returns 1 / d for the sub-block scale codes."""
    d = max_scale / np.float32(31.0)
    h = f32_to_f16_bits(d * fudge)
    blk[0] = h & 0xFF
    blk[1] = h >> 8
    return np.float32(1.0) / d


@njit(**NJIT)
def _scale_code(id_: np.float32, scale: np.float32) -> int:
    return max(0, min(15, nearest_int(np.float32(0.5) * fmaf(id_, scale, np.float32(-1.0)))))


@njit(**KERNEL)
def _quantize_iq3_xxs(x: np.ndarray, qw: np.ndarray, out: np.ndarray, grid: np.ndarray, kmap: np.ndarray,
                      lists: Lists) -> None:
    n_rows, n = x.shape
    for r in prange(n_rows):
        weight, waux, xval, L, Laux, on_grid, trials = _buffers(15)
        signs = np.zeros(BLOCK // 8, dtype=np.int64)
        scales = np.zeros(QK_K // BLOCK, dtype=np.float32)
        packed = np.zeros(QK_K // BLOCK, dtype=np.uint32)
        for ibl in range(n // QK_K):
            blk = out[r, ibl * IQ3_XXS_BYTES : (ibl + 1) * IQ3_XXS_BYTES]
            blk[:] = 0
            packed[:] = 0
            xbl = x[r, ibl * QK_K : (ibl + 1) * QK_K]
            sigma2 = _sigma2(xbl)
            max_scale = np.float32(0.0)
            for ib in range(QK_K // BLOCK):
                _weights(xbl, qw, ibl * QK_K, sigma2, ib, weight, waux)
                for k in range(BLOCK // 8):
                    s = 0
                    flips = 0
                    for i in range(8):
                        v = xbl[ib * BLOCK + 8 * k + i]
                        xval[8 * k + i] = v if v >= 0 else -v
                        if v < 0:
                            s |= 1 << i
                            flips += 1
                    if flips % 2:  # an even count of negatives: flip the value that matters least
                        imin = 0
                        v = xbl[ib * BLOCK + 8 * k]
                        least = weight[8 * k] * v * v
                        for i in range(1, 8):
                            v = xbl[ib * BLOCK + 8 * k + i]
                            ax = weight[8 * k + i] * v * v
                            if ax < least:
                                least = ax
                                imin = i
                        xval[8 * k + imin] = -xval[8 * k + imin]
                        s ^= 1 << imin
                    signs[k] = s & 127
                mx = xval.max()
                if mx < GROUP_MAX_EPS:
                    scales[ib] = 0
                    continue
                scale = _fit_grid(grid, kmap, lists, 15, True, weight, waux, xval, mx, L, Laux, on_grid, trials)
                if scale < 0:
                    scale = -scale
                    for k in range(BLOCK // 8):
                        signs[k] = ~signs[k] & 127
                for k in range(BLOCK // 4):
                    blk[2 + 8 * ib + k] = kmap[_key(L, 4 * k)]
                packed[ib] = np.uint32(signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21))
                scales[ib] = scale
                max_scale = max(max_scale, scale)
            if max_scale == 0:
                blk[:] = 0
                continue
            id_ = _store_d(blk, max_scale, np.float32(1.0125))
            for ib in range(QK_K // BLOCK):
                word = packed[ib] | (np.uint32(_scale_code(id_, scales[ib])) << np.uint32(28))
                for b in range(4):
                    blk[66 + 4 * ib + b] = (word >> np.uint32(8 * b)) & np.uint32(255)


@njit(**KERNEL)
def _dequantize_iq3_xxs(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        for ibl in range(n // QK_K):
            blk = q[r, ibl * IQ3_XXS_BYTES : (ibl + 1) * IQ3_XXS_BYTES]
            d = load_f16(blk, 0)
            for ib in range(QK_K // BLOCK):
                o = 66 + 4 * ib
                word = np.uint32(blk[o]) | (np.uint32(blk[o + 1]) << 8) | (np.uint32(blk[o + 2]) << 16) \
                    | (np.uint32(blk[o + 3]) << 24)
                db = d * (np.float32(0.5) + np.float32(word >> np.uint32(28))) * np.float32(0.5)
                for k in range(BLOCK // 4):
                    g = np.int64(blk[2 + 8 * ib + k])
                    signs = KSIGNS[(word >> np.uint32(7 * (k // 2))) & np.uint32(127)]
                    for i in range(4):
                        v = db * np.float32(DQ_GRID_256[g, i])
                        bit = 4 * (k % 2) + i
                        out[r, ibl * QK_K + ib * BLOCK + 4 * k + i] = -v if (signs >> bit) & 1 else v


@njit(**KERNEL)
def _dequantize_iq3_s(q: np.ndarray, out: np.ndarray) -> None:
    n_rows, n = out.shape
    for r in prange(n_rows):
        for ibl in range(n // QK_K):
            blk = q[r, ibl * IQ3_S_BYTES : (ibl + 1) * IQ3_S_BYTES]
            d = load_f16(blk, 0)
            for ib in range(QK_K // BLOCK):
                s = (blk[106 + ib // 2] >> (4 * (ib % 2))) & 15
                db = d * np.float32(1 + 2 * np.int64(s))
                qh = np.int64(blk[66 + ib])
                for k in range(BLOCK // 4):
                    g = np.int64(blk[2 + ib * 8 + k]) | (((qh >> k) & 1) << 8)
                    signs = blk[74 + ib * 4 + k // 2]
                    for i in range(4):
                        v = db * np.float32(GRID_512[g, i])
                        bit = 4 * (k % 2) + i
                        out[r, ibl * QK_K + ib * BLOCK + 4 * k + i] = -v if (signs >> bit) & 1 else v


class IQ3_SCodec(Codec, type_name="IQ3_S"):
    block_scale_f16 = 0
    # d = 1.033 max scale / 31 in f16; the fitted scale maps the block maximum near 15
    max_abs_input = 65504.0 * 31 / 15
    rel_error_bound = 2.0
    abs_error_floor = 31 * 15 * 2.0**-24

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq3_s(x, w, out, *search_tables(512))

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq3_s(q, out)


class IQ3_XXSCodec(Codec, type_name="IQ3_XXS"):
    block_scale_f16 = 0
    # d = 1.0125 max scale / 31 in f16, a sub-block scale up to d * 15.5 / 2
    max_abs_input = 65504.0 * 31 / 15
    rel_error_bound = 2.0
    abs_error_floor = 31 * 15 * 2.0**-24

    def _quantize(self, x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
        _quantize_iq3_xxs(x, w, out, *search_tables(256))

    def _dequantize(self, q: np.ndarray, out: np.ndarray) -> None:
        _dequantize_iq3_xxs(q, out)

