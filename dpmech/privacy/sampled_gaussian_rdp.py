"""RDP of the Poisson-subsampled Gaussian mechanism at many orders at once (numpy).

The same quantity dp-accounting computes order by order in Python (Mironov, Talwar & Zhang 2019,
"Renyi Differential Privacy of the Sampled Gaussian Mechanism"): for sampling rate q and noise
multiplier sigma, RDP(alpha) = log(A_alpha) / (alpha - 1), with

* integer alpha (their Sec. 3.2, Eq. 5 expanded by the binomial theorem):
  A_alpha = sum_{i=0..alpha} C(alpha, i) q^i (1-q)^(alpha-i) exp((i^2 - i) / (2 sigma^2));
* fractional alpha (their Sec. 3.3): the integral split at z0 = sigma^2 log(1/q - 1) + 1/2 into
  two series over i = 0, 1, ... with j = alpha - i,
  s0_i = |C(alpha, i)| q^i (1-q)^j exp((i^2 - i) / (2 sigma^2)) erfc((i - z0) / (sqrt(2) sigma)) / 2,
  s1_i = |C(alpha, i)| q^j (1-q)^i exp((j^2 - j) / (2 sigma^2)) erfc((z0 - j) / (sqrt(2) sigma)) / 2,
  summed until both terms decrease and lie 30 nats below the running total (absolute values of
  the generalised binomial coefficients: an upper bound of A_alpha, the sound side).

Used where speed matters and an exact answer is checked afterwards: the noise calibration's
search (:func:`dpmech.privacy.accounting.noise_multiplier_for` verifies the sigma it returns with
dp-accounting) and the tuning calibration's intermediate steps. Every reported epsilon is still
computed by dp-accounting. ``tests/test_sampled_gaussian_rdp.py`` holds it to dp-accounting's
values to 1e-9 over a grid of q, sigma and orders.
"""

from __future__ import annotations

import numpy as np
from scipy import special

_FRAC_TERMS = 1000     # series terms of a fractional order (small sigma: hundreds); dp-accounting's cap too
_STOP_GAP = 30.0       # a term this many nats below the running total ends the series


def _log_comb(n, k):
    """log |C(n, k)| (generalised binomial coefficient; scipy's gammaln is log |Gamma|)."""
    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)


def _log_a_int(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    """log A_alpha for integer orders: one row of binomial terms per order, masked past alpha, the
    orders grouped by the power of two above them (a grid's few large orders get rows of their own
    length instead of widening every row)."""
    out = np.empty(len(alphas))
    bucket = np.ceil(np.log2(alphas)).astype(np.int64)
    for b in np.unique(bucket):
        rows = bucket == b
        out[rows] = _log_a_int_block(q, sigma, alphas[rows])
    return out


def _log_a_int_block(q: float, sigma: float, alphas: np.ndarray) -> np.ndarray:
    top = int(alphas.max())
    log_fact = special.gammaln(np.arange(top + 1, dtype=np.float64) + 1)   # log k!, k = 0..top
    ii = np.arange(top + 1)[None, :]
    aa = alphas.astype(np.int64)[:, None]
    inside = ii <= aa
    i = ii.astype(np.float64)
    log_comb = log_fact[aa] - log_fact[ii] - log_fact[np.where(inside, aa - ii, 0)]
    terms = log_comb + i * np.log(q) + (aa - i) * np.log1p(-q) + (i * i - i) / (2 * sigma ** 2)
    return special.logsumexp(np.where(inside, terms, -np.inf), axis=1)


def _log_erfc(x):
    return np.log(2.0) + special.log_ndtr(-x * np.sqrt(2.0))


def _log_a_frac(q: float, sigma: float, alphas: np.ndarray, terms: int = 64) -> np.ndarray:
    """log A_alpha for fractional orders: both series to the first index where each term falls and
    both lie ``_STOP_GAP`` nats below the running total (inf where that never happens within
    ``_FRAC_TERMS`` terms: the order is then useless to the epsilon conversion, which takes the
    minimum over orders). ``terms`` first; the orders left unsettled again with ``_FRAC_TERMS``
    (small sigma and q: the series falls like a power of i and needs hundreds)."""
    i = np.arange(terms, dtype=np.float64)[None, :]
    a = alphas.astype(np.float64)[:, None]
    j = a - i
    z0 = sigma ** 2 * np.log(1 / q - 1) + 0.5
    lc = _log_comb(a, i)
    log_s0 = (lc + i * np.log(q) + j * np.log1p(-q) + (i * i - i) / (2 * sigma ** 2)
              + np.log(0.5) + _log_erfc((i - z0) / (np.sqrt(2.0) * sigma)))
    log_s1 = (lc + j * np.log(q) + i * np.log1p(-q) + (j * j - j) / (2 * sigma ** 2)
              + np.log(0.5) + _log_erfc((z0 - j) / (np.sqrt(2.0) * sigma)))
    total = np.logaddexp.accumulate(np.logaddexp(log_s0, log_s1), axis=1)
    falling = np.zeros_like(total, dtype=bool)
    falling[:, 1:] = (log_s0[:, 1:] < log_s0[:, :-1]) & (log_s1[:, 1:] < log_s1[:, :-1])
    done = falling & (np.maximum(log_s0, log_s1) < total - _STOP_GAP)
    out = np.full(len(alphas), np.inf)
    hit = done.any(axis=1)
    out[hit] = total[hit, done.argmax(axis=1)[hit]]
    if terms < _FRAC_TERMS and not hit.all():
        out[~hit] = _log_a_frac(q, sigma, alphas[~hit], _FRAC_TERMS)
    return out


def sampled_gaussian_rdp(q: float, sigma: float, orders) -> np.ndarray:
    """RDP of one step of the Poisson-subsampled Gaussian mechanism at ``orders`` (> 1).

    inf where sigma is 0, an order is infinite, or a fractional order's series does not settle
    within ``_FRAC_TERMS`` terms."""
    orders = np.asarray(orders, dtype=np.float64)
    if not 0 <= q <= 1:
        raise ValueError(f"q: a sampling rate in [0, 1], got {q}")
    if sigma < 0:
        raise ValueError(f"sigma: a noise multiplier >= 0, got {sigma}")
    if q == 0:
        return np.zeros_like(orders)
    if sigma == 0:
        return np.full_like(orders, np.inf)
    if q == 1:
        return orders / (2 * sigma ** 2)
    out = np.full_like(orders, np.inf)
    finite = np.isfinite(orders)
    integer = finite & (orders == np.round(orders))
    frac = finite & ~integer
    if integer.any():
        out[integer] = _log_a_int(q, sigma, orders[integer])
    if frac.any():
        out[frac] = _log_a_frac(q, sigma, orders[frac])
    with np.errstate(invalid="ignore"):
        return np.where(finite, out / (orders - 1), np.inf)
