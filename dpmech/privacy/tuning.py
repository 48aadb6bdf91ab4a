"""The privacy cost of hyperparameter tuning: random-search with a random number of trials.

Choosing the best of K trials trained on the same private data releases more than one trial.
Liu & Talwar (2019) and Papernot & Steinke (2022, "Hyperparameter Tuning with Renyi Differential
Privacy", ICLR) show that when K itself is random — Poisson, or truncated negative binomial
(shape eta; eta = 1 geometric, eta -> 0 logarithmic) — each trial draws its hyperparameters
independently, and only the best trial's output is released, the whole procedure is
(epsilon, delta)-DP with epsilon only moderately above one trial's:

* Papernot & Steinke, Thm 2 (truncated negative binomial, incl. geometric and logarithmic) and
  Thm 6 (Poisson) map the per-trial RDP curve to the RDP curve of the released best trial;
  dp-accounting implements both (``RepeatAndSelectDpEvent``) and we call it.
* The per-trial curve must bound *every* trial the search could draw, so it is the order-wise
  maximum of the RDP curves of all privacy-relevant configurations of the search space
  (:func:`worst_case_rdp`).

K is drawn here too (:func:`draw_num_trials`), from the definitions of Papernot & Steinke
(Def. 1), with the halting parameter gamma solved from the mean by dp-accounting.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant as rdp_acc

from dpmech._validate import open_unit, positive
from dpmech.privacy.accounting import RDP_ORDERS, _non_private, epsilon, rdp_curve, rdp_epsilon

DISTRIBUTIONS = ("poisson", "geometric", "logarithmic", "truncated_negative_binomial")
TUNING_SHAPES = {"poisson": math.inf, "geometric": 1.0, "logarithmic": 0.0}


def tuning_shape(distribution: str, shape: float | None = None) -> float:
    """dp-accounting's ``shape`` (eta) of a distribution of the number of trials."""
    if distribution in TUNING_SHAPES:
        return TUNING_SHAPES[distribution]
    if distribution == "truncated_negative_binomial":
        if shape is None or not (0 < shape < math.inf) or shape == 1:
            raise ValueError("tuning_privacy.shape: the truncated negative binomial needs 0 < shape < inf, shape != 1 "
                             "(shape 1 is the geometric, 0 the logarithmic distribution)")
        return float(shape)
    raise ValueError(f"tuning_privacy.distribution: unknown {distribution!r}; known: {', '.join(DISTRIBUTIONS)}")


def _check_mean(mean: float) -> float:
    positive("tuning_privacy.mean", mean)
    if mean < 1:
        raise ValueError(f"tuning_privacy.mean: must be >= 1 (the expected number of trials), got {mean}")
    return float(mean)


def _gamma(distribution: str, mean: float, shape: float | None) -> float:
    """Halting probability gamma of the truncated negative binomial with this mean (Def. 1)."""
    eta = tuning_shape(distribution, shape)
    return rdp_acc._gamma_truncated_negative_binomial(eta, mean)  # noqa: SLF001 - dp-accounting's inversion


def num_trials_pmf(distribution: str, mean: float, shape: float | None = None, kmax: int | None = None) -> np.ndarray:
    """P[K = k] for k = 0..kmax (Papernot & Steinke Def. 1; Poisson: k = 0 has mass e^-mean).

    Truncated negative binomial: P[K=k] = (1-gamma)^k / (gamma^-eta - 1) * prod_{l<k} (l+eta)/(l+1),
    k >= 1; eta = 0 is the logarithmic limit (1-gamma)^k / (k log(1/gamma)).
    """
    mean = _check_mean(mean)
    eta = tuning_shape(distribution, shape)
    kmax = int(kmax if kmax is not None else max(50, 40 * mean))
    k = np.arange(kmax + 1, dtype=np.float64)
    if eta == math.inf:
        from scipy.stats import poisson

        return poisson.pmf(k, mean)
    gamma = _gamma(distribution, mean, shape)
    pmf = np.zeros(kmax + 1)
    if eta == 0:
        pmf[1:] = np.exp(k[1:] * math.log1p(-gamma) - np.log(k[1:]) - math.log(math.log(1 / gamma)))
        return pmf
    # log prod_{l<k} (l+eta)/(l+1) = lgamma(k+eta) - lgamma(eta) - lgamma(k+1)
    from scipy.special import gammaln

    log_norm = math.log(math.expm1(-eta * math.log(gamma)))  # gamma^-eta - 1
    pmf[1:] = np.exp(k[1:] * math.log1p(-gamma) + gammaln(k[1:] + eta) - gammaln(eta) - gammaln(k[1:] + 1) - log_norm)
    return pmf


def draw_num_trials(distribution: str, mean: float, shape: float | None = None, *,
                    rng: np.random.Generator) -> int:
    """One draw of the number of trials K (Papernot & Steinke Def. 1; exact inverse-CDF for the
    truncated negative binomial family, numpy's sampler for the Poisson)."""
    mean = _check_mean(mean)
    eta = tuning_shape(distribution, shape)
    if eta == math.inf:
        return int(rng.poisson(mean))
    if eta == 1:
        return int(rng.geometric(1 / mean))
    u = rng.uniform()
    kmax = int(max(100, 60 * mean))
    while True:
        cdf = np.cumsum(num_trials_pmf(distribution, mean, shape, kmax))
        if cdf[-1] >= u or kmax > 10**7:
            return int(min(np.searchsorted(cdf, u, side="left"), kmax))
        kmax *= 4


def worst_case_rdp(events: Iterable[dpe.DpEvent], fast: bool = False) -> np.ndarray:
    """Order-wise maximum of the RDP curves of ``events``: an RDP bound holding for every one of
    them, hence for a trial whose configuration is any of them (Papernot & Steinke's Q).
    ``fast``: vectorised curves (:func:`dpmech.privacy.accounting.rdp_curve`), for a search only."""
    curves = [rdp_curve(e, fast=fast) for e in events]
    if not curves:
        raise ValueError("worst_case_rdp: no privacy event given")
    return np.max(np.stack(curves), axis=0)


def repeat_and_select_rdp(rdp: np.ndarray, distribution: str, mean: float, shape: float | None = None) -> np.ndarray:
    """RDP curve of releasing the best of K trials, each with RDP curve ``rdp`` (Thms 2 and 6).

    Orders where the per-trial curve is not finite are left out of the computation and stay
    infinite in the result (as the single-run conversion does): Thm 2 bounds order lambda from the
    curve at lambda and at any second order lambda-hat, and Thm 6 from the curve's delta at a
    derived epsilon-hat, a minimum over the orders given; a minimum over the finite orders only is
    still a bound. Before issue 48 one non-finite order (dp-accounting does not converge at some
    fractional orders for large sampling rates) made every order infinite, and an infinite
    epsilon was released."""
    mean = _check_mean(mean)
    rdp = np.asarray(rdp, dtype=np.float64)
    orders = np.asarray(RDP_ORDERS, dtype=np.float64)
    finite = np.isfinite(rdp)
    out = np.full(len(RDP_ORDERS), np.inf)
    if not finite.any():
        return out
    out[finite] = rdp_acc._compute_rdp_repeat_and_select(  # noqa: SLF001 - dp-accounting's Thm 2/6
        list(orders[finite]), list(rdp[finite]), mean, tuning_shape(distribution, shape))
    return out


def tuning_epsilon(rdp: np.ndarray, delta: float, distribution: str, mean: float, shape: float | None = None) -> float:
    """End-to-end epsilon at ``delta`` of the tuned procedure given the worst-case per-trial curve."""
    open_unit("delta", delta)
    return rdp_epsilon(repeat_and_select_rdp(rdp, distribution, mean, shape), delta)


def repeat_and_select_epsilon(event: dpe.DpEvent, delta: float, distribution: str, mean: float,
                              shape: float | None = None) -> float:
    """End-to-end epsilon for one per-trial ``event``, through dp-accounting's own
    ``RepeatAndSelectDpEvent`` (the reference the curve-based :func:`tuning_epsilon` is tested against)."""
    mean = _check_mean(mean)
    if _non_private(event):
        return math.inf
    return epsilon(dpe.RepeatAndSelectDpEvent(event, mean, tuning_shape(distribution, shape)), delta, "rdp")
