"""Perplexity and KL-divergence exactly as ik_llama.cpp's llama-perplexity computes and stores them.

The base-logits file is ik's `--kl-divergence-base` layout: "_logits_", n_ctx, n_vocab, n_chunk, the
evaluated tokens, then per scored position a record of 16-bit log-probabilities with a two-float header. Files
move between ik and this runtime in both directions. Per-token arithmetic follows ik's float32/float64 mix,
including the multiply-adds its compiler fuses, so statistics agree with ik's to the last printed digit.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numba import njit, prange

from ikquant.formats.numeric import f32_bits
from ikrun.errors import BaseLogitsError
from ikrun.ops.parallel import pick

MAGIC = b"_logits_"


def record_words(n_vocab: int) -> int:
    """uint16 words per scored position: two floats (4 words) then n_vocab codes, padded to an even count."""
    return 2 * ((n_vocab + 1) // 2) + 4


def scored_positions(n_ctx: int) -> range:
    """Positions whose next token is scored: the second half of the chunk, up to the second-to-last."""
    return range(n_ctx // 2, n_ctx - 1)


@njit(cache=True, nogil=True, inline="always")
def _encode_row(logits: np.ndarray, tokens_next: np.ndarray, out: np.ndarray, nll: np.ndarray, t: int) -> None:
    n_vocab = logits.shape[1]
    row = logits[t]
    mx = row[0]
    mn = row[0]
    for i in range(1, n_vocab):
        mx = max(mx, row[i])
        mn = min(mn, row[i])
    mn = max(mn, mx - np.float32(24.0))
    s = 0.0
    for i in range(n_vocab):
        s += np.float64(np.exp(row[i] - mx))
    lse = np.float32(math.log(s))
    min_log_prob = mn - mx - lse
    scale = (mx - mn) / np.float32(65535.0)
    hdr = out[t, :4].view(np.float32)
    hdr[0] = scale
    hdr[1] = min_log_prob
    codes = out[t, 4:]
    if scale != 0:
        inv = np.float32(1.0) / scale
        for i in range(n_vocab):
            if row[i] > mn:
                v = np.float32(inv * (row[i] - mn)) + np.float32(12582912.0)  # not fused: ik's nearest_int
                codes[i] = np.uint16((f32_bits(v) & np.uint32(0x007FFFFF)) - np.uint32(0x00400000))
            else:
                codes[i] = 0
    else:
        for i in range(n_vocab):
            codes[i] = 0
    for i in range(n_vocab, codes.shape[0]):
        codes[i] = 0
    nll[t] = (mx + lse) - row[tokens_next[t]]


@njit(cache=True, nogil=True)
def _encode_serial(logits: np.ndarray, tokens_next: np.ndarray, out: np.ndarray, nll: np.ndarray) -> None:
    for t in range(logits.shape[0]):
        _encode_row(logits, tokens_next, out, nll, t)


@njit(cache=True, nogil=True, parallel=True)
def _encode_parallel(logits: np.ndarray, tokens_next: np.ndarray, out: np.ndarray, nll: np.ndarray) -> None:
    for t in prange(logits.shape[0]):
        _encode_row(logits, tokens_next, out, nll, t)


def encode_records(logits: np.ndarray, tokens_next: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ik's 16-bit log-softmax records for rows of logits, and the float32 NLL of each next token."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    out = np.empty((logits.shape[0], record_words(logits.shape[1])), dtype=np.uint16)
    nll = np.empty(logits.shape[0], dtype=np.float32)
    pick(_encode_serial, _encode_parallel, logits.size)(logits, np.ascontiguousarray(tokens_next, dtype=np.int64),
                                                        out, nll)
    return out, nll


@njit(cache=True, nogil=True, inline="always")
def _compare_row(logits: np.ndarray, records: np.ndarray, tokens_next: np.ndarray, nll: np.ndarray,
                 nll_base: np.ndarray, kld: np.ndarray, p_diff: np.ndarray, same_top: np.ndarray, t: int) -> None:
    n_vocab = logits.shape[1]
    row = logits[t]
    mx = row[0]
    imax = 0
    for i in range(1, n_vocab):
        if row[i] > mx:
            mx = row[i]
            imax = i
    s = 0.0
    for i in range(n_vocab):
        s += np.float64(np.exp(row[i] - mx))
    lse = np.float32(math.log(s))
    hdr = records[t, :4].view(np.float32)
    scale = hdr[0]
    min_lp = hdr[1]
    codes = records[t, 4:]
    tok = tokens_next[t]
    q_nll = (mx + lse) - row[tok]
    b_nll = -(scale * np.float32(codes[tok]) + min_lp)
    top = mx + lse
    acc = 0.0
    imax_base = 0
    best = np.float32(0.0)
    for i in range(n_vocab):
        lpb = scale * np.float32(codes[i]) + min_lp
        if i == 0 or lpb > best:
            best = lpb
            imax_base = i
        if lpb > np.float32(-16.0):
            acc += np.float64(np.exp(lpb) * ((lpb - row[i]) + top))
    nll[t] = q_nll
    nll_base[t] = b_nll
    kld[t] = acc
    p_diff[t] = np.exp(-q_nll) - np.exp(-b_nll)
    same_top[t] = imax == imax_base


@njit(cache=True, nogil=True)
def _compare_serial(logits, records, tokens_next, nll, nll_base, kld, p_diff, same_top) -> None:  # type: ignore[no-untyped-def]
    for t in range(logits.shape[0]):
        _compare_row(logits, records, tokens_next, nll, nll_base, kld, p_diff, same_top, t)


@njit(cache=True, nogil=True, parallel=True)
def _compare_parallel(logits, records, tokens_next, nll, nll_base, kld, p_diff, same_top) -> None:  # type: ignore[no-untyped-def]
    for t in prange(logits.shape[0]):
        _compare_row(logits, records, tokens_next, nll, nll_base, kld, p_diff, same_top, t)


_ACC_FIELDS = ("nll", "nll_base", "kld", "p_diff", "same_top")


@dataclass
class KLDAccumulator:
    """Per-token values of a KLD run, kept so that order statistics and running totals can be computed."""

    nll: list[np.ndarray] = field(default_factory=list)
    nll_base: list[np.ndarray] = field(default_factory=list)
    kld: list[np.ndarray] = field(default_factory=list)
    p_diff: list[np.ndarray] = field(default_factory=list)
    same_top: list[np.ndarray] = field(default_factory=list)

    def add(self, logits: np.ndarray, records: np.ndarray, tokens_next: np.ndarray) -> None:
        """Score rows of model logits against the base records for the same positions."""
        n = logits.shape[0]
        outs: list[np.ndarray] = [np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.float64), np.empty(n, np.float32),
                np.empty(n, np.bool_)]
        pick(_compare_serial, _compare_parallel, logits.size)(
            np.ascontiguousarray(logits, dtype=np.float32), np.ascontiguousarray(records),
            np.ascontiguousarray(tokens_next, dtype=np.int64), *outs)
        for store, arr in zip((self.nll, self.nll_base, self.kld, self.p_diff, self.same_top), outs):
            store.append(arr)

    def merged(self, later: KLDAccumulator) -> KLDAccumulator:
        """This run's chunks followed by `later`'s: the statistics of both runs scored as one."""
        return KLDAccumulator(*(getattr(self, k) + getattr(later, k) for k in _ACC_FIELDS))

    def arrays(self) -> dict[str, np.ndarray]:
        cat = {k: np.concatenate(getattr(self, k)) if getattr(self, k) else np.empty(0) for k in _ACC_FIELDS}
        return cat


def mean_and_uncertainty(s: float, s2: float, n: int) -> tuple[float, float]:
    """A mean from its sum `s` and sum of squares `s2` over `n` values, and its standard error as ik's
    llama-perplexity prints it (sqrt(population variance / (n - 1)), 0 for 10 values or fewer): the one ± of every
    mean KLD we report (`ikrun kld`, `ikrun mix`'s rows, a sweep row's `kld_sem`), all through kld_stats."""
    if n < 1:
        return 0.0, 0.0
    m = s / n
    var = s2 / n - m * m
    return m, (math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0)


def covariance(sa: float, sb: float, sab: float, n: int) -> float:
    if n < 10:
        return 0.0
    return (sab / n - (sa / n) * (sb / n)) / (n - 1)


def percentile(v: np.ndarray, f: float) -> float:
    """ik's percentile on an ascending-sorted array: linear interpolation between neighbours, in float32 as ik
    computes it (its per-token values are float32; `f` too)."""
    v = np.asarray(v, dtype=np.float32)
    if f <= 0:
        return float(v[0])
    if f >= 1:
        return float(v[-1])
    p = np.float32(f) * np.float32(len(v) - 1)
    i = int(p)
    frac = np.float32(p - np.float32(i))
    one = np.float32(1.0)
    return float(np.float32((one - frac) * v[i]) + np.float32(frac * v[min(i + 1, len(v) - 1)]))


def median(v: np.ndarray) -> float:
    """ik's median of an ascending-sorted array, in float32."""
    v = np.asarray(v, dtype=np.float32)
    n = len(v)
    return float(np.float32(0.5) * (v[n // 2] + v[n // 2 - 1])) if n % 2 == 0 else float(v[n // 2])


def kld_stats(acc: KLDAccumulator) -> dict[str, float | int]:
    """Every statistic of ik's final KLD report; the ± estimates of each under `<key>_err`."""
    a = acc.arrays()
    n = int(len(a["kld"]))
    nll = a["nll"].astype(np.float64)
    nllb = a["nll_base"].astype(np.float64)
    sq = (a["nll"] * a["nll"]).astype(np.float64)
    sqb = (a["nll_base"] * a["nll_base"]).astype(np.float64)
    cross = (a["nll"] * a["nll_base"]).astype(np.float64)
    m_q, u_q = mean_and_uncertainty(nll.sum(), sq.sum(), n)
    m_b, u_b = mean_and_uncertainty(nllb.sum(), sqb.sum(), n)
    cov = covariance(nll.sum(), nllb.sum(), cross.sum(), n)
    p_q, p_b = math.exp(m_q), math.exp(m_b)
    r = m_q - m_b
    u_r_sq = u_q * u_q + u_b * u_b - 2 * cov
    u_r = math.sqrt(u_r_sq) if u_r_sq > 0 else 0.0
    diff_sq = (p_q * u_q) ** 2 + (p_b * u_b) ** 2 - 2 * p_q * p_b * cov
    kld = a["kld"]
    m_kld, u_kld = mean_and_uncertainty(kld.sum(), (kld * kld).sum(), n)
    pd = a["p_diff"].astype(np.float64)
    pd2 = (a["p_diff"] * a["p_diff"]).astype(np.float64)  # ik squares the float32 value, then widens
    m_pd, u_pd = mean_and_uncertainty(pd.sum(), pd2.sum(), n)
    m_pd2, u_pd2 = mean_and_uncertainty(pd2.sum(), (pd2 * pd2).sum(), n)
    rms = math.sqrt(m_pd2) if m_pd2 > 0 else 0.0
    same = float(a["same_top"].sum()) / n if n else 0.0
    ks = np.sort(kld.astype(np.float32))  # ik keeps the per-token values as float32
    ps = np.sort(a["p_diff"].astype(np.float32))
    stats: dict[str, float | int] = {
        "n_tokens": n,
        "ppl_q": p_q, "ppl_q_err": p_q * u_q,
        "ppl_base": p_b, "ppl_base_err": p_b * u_b,
        "cor_ln_ppl": 100 * cov / (u_q * u_b) if u_q * u_b > 0 else 0.0,
        "ln_ppl_ratio": r, "ln_ppl_ratio_err": u_r,
        "ppl_ratio": math.exp(r), "ppl_ratio_err": math.exp(r) * u_r,
        "ppl_diff": p_q - p_b, "ppl_diff_err": math.sqrt(diff_sq) if diff_sq > 0 else 0.0,
        "kld_mean": m_kld, "kld_mean_err": u_kld,
        "dp_mean": m_pd, "dp_mean_err": u_pd,
        "dp_rms": rms, "dp_rms_err": 0.5 * u_pd2 / rms if rms > 0 else 0.0,
        "same_top_p": same, "same_top_p_err": math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0,
    }
    if n:
        stats.update({
            "kld_max": float(ks[-1]), "kld_p999": percentile(ks, 0.999), "kld_p99": percentile(ks, 0.99),
            "kld_p95": percentile(ks, 0.95), "kld_p90": percentile(ks, 0.90), "kld_median": median(ks),
            "kld_p10": percentile(ks, 0.10), "kld_p05": percentile(ks, 0.05), "kld_p01": percentile(ks, 0.01),
            "kld_p001": percentile(ks, 0.001), "kld_min": float(ks[0]),
            "dp_max": float(ps[-1]), "dp_p999": percentile(ps, 0.999), "dp_p99": percentile(ps, 0.99),
            "dp_p95": percentile(ps, 0.95), "dp_p90": percentile(ps, 0.90), "dp_p75": percentile(ps, 0.75),
            "dp_median": median(ps), "dp_p25": percentile(ps, 0.25), "dp_p10": percentile(ps, 0.10),
            "dp_p05": percentile(ps, 0.05), "dp_p01": percentile(ps, 0.01), "dp_p001": percentile(ps, 0.001),
            "dp_min": float(ps[0]),
        })
    return stats


def paired_kld_stats(a: KLDAccumulator, b: KLDAccumulator) -> dict[str, float | int]:
    """Two models' KLDs on the same tokens against the same base, compared token by token: the mean difference
    (a - b) with the standard error of the per-token differences, and the ratio of the means with its delta-method
    error. Quantizations of one model err on the same hard tokens, so the paired error is far below the two means'
    errors combined: a difference of a few percent that two separate runs cannot resolve, this one can. The ±s count
    tokens as independent, as ik's do."""
    ka, kb = a.arrays()["kld"], b.arrays()["kld"]
    if ka.shape != kb.shape:
        raise ValueError(f"paired KLDs need the same tokens: {ka.size} against {kb.size}")
    n = int(ka.size)
    d = ka - kb
    m_a, u_a = mean_and_uncertainty(ka.sum(), (ka * ka).sum(), n)
    m_b, u_b = mean_and_uncertainty(kb.sum(), (kb * kb).sum(), n)
    m_d, u_d = mean_and_uncertainty(d.sum(), (d * d).sum(), n)
    cov = covariance(ka.sum(), kb.sum(), (ka * kb).sum(), n)
    ratio = m_a / m_b if m_b > 0 else math.inf
    rel_sq = ((u_a / m_a) ** 2 + (u_b / m_b) ** 2 - 2 * cov / (m_a * m_b)) if m_a > 0 and m_b > 0 else 0.0
    return {
        "n_tokens": n, "kld_mean": m_a, "kld_mean_err": u_a, "versus_kld_mean": m_b, "versus_kld_mean_err": u_b,
        "kld_diff": m_d, "kld_diff_err": u_d,
        "kld_ratio": ratio, "kld_ratio_err": ratio * math.sqrt(rel_sq) if rel_sq > 0 else 0.0,
        "kld_cor": 100 * cov / (u_a * u_b) if u_a * u_b > 0 else 0.0,
        "lower_kld_tokens": float((d < 0).sum()) / n if n else 0.0,
    }


def ppl_stats(nll: np.ndarray) -> dict[str, float | int]:
    """Final perplexity estimate and its ± (ik: P * sqrt((E[nll^2] - E[nll]^2) / (n - 1)))."""
    v = nll.astype(np.float64)
    n = int(v.size)
    m = float(v.sum() / n)
    var = float((v * v).sum() / n - m * m)
    ppl = math.exp(m)
    return {"n_tokens": n, "ppl": ppl, "ppl_err": ppl * math.sqrt(var / (n - 1)) if var > 0 and n > 1 else 0.0}


class BaseLogitsFile:
    """An ik base-logits file opened for reading (records memory-mapped, read chunk by chunk)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as fh:
            head = fh.read(20)
        if len(head) < 20 or head[:8] != MAGIC:
            raise BaseLogitsError(f"{self.path}: not an ik base-logits file (no '_logits_' magic)")
        self.n_ctx, self.n_vocab, self.n_chunk = (int(v) for v in np.frombuffer(head[8:20], dtype="<i4"))
        if self.n_ctx < 4 or self.n_vocab < 1 or self.n_chunk < 1:
            raise BaseLogitsError(f"{self.path}: implausible header n_ctx={self.n_ctx} n_vocab={self.n_vocab} "
                                  f"n_chunk={self.n_chunk}")
        self.nv = record_words(self.n_vocab)
        self.per_chunk = len(scored_positions(self.n_ctx))
        expected = 20 + 4 * self.n_chunk * self.n_ctx + 2 * self.nv * self.n_chunk * self.per_chunk
        if size != expected:
            raise BaseLogitsError(f"{self.path}: {size} bytes, but n_ctx={self.n_ctx}, n_vocab={self.n_vocab}, "
                                  f"n_chunk={self.n_chunk} need {expected} (truncated or not a base-logits file)")
        # a plain ndarray view of the map: slices of an np.memmap each pay memmap.__array_finalize__ (measured 8% of
        # a tiny-model sweep, which slices records per chunk per tensor)
        mm = np.memmap(self.path, mode="r", dtype=np.uint8).view(np.ndarray)
        self.tokens = mm[20 : 20 + 4 * self.n_chunk * self.n_ctx].view("<i4").reshape(self.n_chunk, self.n_ctx)
        self._records = mm[20 + 4 * self.n_chunk * self.n_ctx :].view("<u2").reshape(
            self.n_chunk, self.per_chunk, self.nv)

    def records(self, chunk: int) -> np.ndarray:
        return self._records[chunk]


class BaseLogitsWriter:
    """Writes ik's base-logits layout chunk by chunk to a temporary name, renamed when complete."""

    def __init__(self, path: str | os.PathLike[str], n_ctx: int, n_vocab: int, tokens: np.ndarray):
        from ikquant.outputs import partial_path, prepare_output

        self.path = Path(path)
        n_chunk = tokens.shape[0]
        prepare_output(self.path, 20 + 4 * n_chunk * n_ctx + 2 * record_words(n_vocab) * n_chunk *
                       len(scored_positions(n_ctx)))
        self.tmp = partial_path(self.path)
        self.n_vocab = n_vocab
        with self._errors():
            self._fh = open(self.tmp, "wb")
            self._fh.write(MAGIC)
            self._fh.write(np.array([n_ctx, n_vocab, n_chunk], dtype="<i4").tobytes())
            self._fh.write(np.ascontiguousarray(tokens, dtype="<i4").tobytes())

    def _errors(self):  # type: ignore[no-untyped-def]
        from ikquant.outputs import write_errors

        return write_errors(self.path)

    def write_chunk(self, records: np.ndarray) -> None:
        with self._errors():
            self._fh.write(np.ascontiguousarray(records, dtype="<u2").tobytes())

    def finish(self) -> Path:
        with self._errors():
            self._fh.close()
            os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        self._fh.close()
        self.tmp.unlink(missing_ok=True)
