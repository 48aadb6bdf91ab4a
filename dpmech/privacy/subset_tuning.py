"""Tuning on a secret random subset, then one final training run: the end-to-end RDP of the procedure.

The procedure (Koskela & Kulkarni, NeurIPS 2023, as their abstract states it; docs/tuning_privacy.md,
"Subset tuning"): every training example joins a tuning set X1 independently with probability
``rate`` (Poisson subsampling, the draw secret); Papernot & Steinke's repeat-and-select tuning runs on
X1 alone (K ~ the spec's distribution, each candidate trained on X1, the best kept); the chosen
hyperparameters, mapped by a public rule to the full data, train one final model on all of X, which is
released with them. The candidates' models and scores stay with the owner.

The bound here is this module's own composition of three published results, each checked in
tests/test_subset_tuning.py; it is *not* Koskela & Kulkarni's theorem, whose text could not be read
here (docs/tuning_privacy.md says so):

1. The tuning on X1 is (alpha, eps_T(alpha))-RDP with eps_T Papernot & Steinke's Thm 2 / Thm 6 curve
   (:func:`dpmech.privacy.tuning.repeat_and_select_rdp`) of the candidates' curve.
2. Running it on a Poisson subsample of rate q is (alpha, eps_q(alpha))-RDP for every integer
   alpha >= 2 with (Zhu & Wang, ICML 2019, the general upper bound for Poisson subsampling, which
   their abstract places within log(3)/(alpha-1) of optimal)

       eps_q(alpha) = log{ (1-q)^(alpha-1) (alpha q - q + 1) + C(alpha,2) q^2 (1-q)^(alpha-2) e^eps_T(2)
                           + 3 sum_{l=3..alpha} C(alpha,l) q^l (1-q)^(alpha-l) e^((l-1) eps_T(l)) } / (alpha-1)

   (:func:`poisson_subsampled_rdp`). A non-integer order alpha takes the bound at ceil(alpha): Renyi
   divergence does not decrease with the order. Every order also keeps the unsubsampled eps_T(alpha)
   (subsampling never costs privacy), so the curve is the smaller of the two.
3. The final training reads X and the tuning's output: adaptive composition adds the two RDP curves
   (Mironov 2017, Prop. 1), converted to (epsilon, delta) as every ledger here is.

Neighbouring datasets differ by adding or removing one example (the relation DP-SGD's accounting and
Poisson subsampling share). What must hold: X1 is drawn by independent coins of a key nobody else
holds (a fixed or public subset gets no amplification: the test's negative control), the candidates
read nothing of X outside X1, and the final run's configuration is a public function of the tuning's
output.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import gammaln, logsumexp

from dpmech.privacy.accounting import RDP_ORDERS, rdp_epsilon

SUBSET_TUNING = "subset_tuning"
# the factor Zhu & Wang's general bound puts on the terms of order l >= 3 (module docstring, item 2)
GENERAL_FACTOR = 3.0


def _check_rate(rate: float) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 < float(rate) <= 1.0:
        raise ValueError(f"rate: the probability that an example joins the tuning set, in (0, 1]; got {rate!r}")
    return float(rate)


def _integer_bound(eps_at: np.ndarray, m: int, q: float, factor: float) -> float:
    """The general bound at integer order ``m`` from ``eps_at[l]`` = eps(l), l = 2..m (item 2)."""
    ls = np.arange(2, m + 1)
    eps = eps_at[ls]
    if not np.isfinite(eps).all():
        return math.inf
    log_binom = gammaln(m + 1) - gammaln(ls + 1) - gammaln(m - ls + 1)
    terms = log_binom + ls * math.log(q) + (m - ls) * math.log1p(-q) + (ls - 1) * eps
    terms = terms + np.where(ls >= 3, math.log(factor), 0.0)
    head = [m * math.log1p(-q), math.log(m) + math.log(q) + (m - 1) * math.log1p(-q)]   # l = 0 and l = 1
    return float(logsumexp(np.concatenate([head, terms])) / (m - 1))


def poisson_subsampled_rdp(curve, rate: float, *, factor: float = GENERAL_FACTOR) -> np.ndarray:
    """RDP curve, at dpmech's RDP_ORDERS, of a mechanism with RDP curve ``curve`` run on a Poisson
    subsample of rate ``rate`` (module docstring, item 2). Orders above the largest integer order whose
    lower orders are all on the grid keep ``curve``'s value (no amplification claimed there).
    ``factor`` other than 3 is for the tests' controls only."""
    q = _check_rate(rate)
    curve = np.asarray(curve, dtype=np.float64)
    orders = np.asarray(RDP_ORDERS, dtype=np.float64)
    if curve.shape != orders.shape:
        raise ValueError(f"curve: one value per order of RDP_ORDERS ({len(orders)}); got shape {curve.shape}")
    if q == 1.0:
        return curve.copy()
    # eps(l) at every integer l = 2..top present on the grid
    integer = {int(a): float(e) for a, e in zip(orders, curve) if float(a).is_integer() and a >= 2}
    top = 2
    while top + 1 in integer:
        top += 1
    eps_at = np.full(top + 1, np.inf)
    for lv in range(2, top + 1):
        eps_at[lv] = integer[lv]
    bound_at = {m: _integer_bound(eps_at, m, q, factor) for m in range(2, top + 1)}
    out = curve.copy()
    for i, a in enumerate(orders):
        m = max(2, math.ceil(a - 1e-12))
        if m <= top:
            out[i] = min(out[i], bound_at[m])
    return out


def subset_tuning_rdp(tuning_curve, rate: float) -> np.ndarray:
    """RDP curve of the tuning run on the secret subset: ``tuning_curve`` is the repeat-and-select
    curve of the candidates (item 1), amplified by the subsample (item 2)."""
    return poisson_subsampled_rdp(tuning_curve, rate)


def subset_then_final_epsilon(tuning_curve, rate: float, final_curve, delta: float) -> dict[str, float]:
    """End-to-end (epsilon, delta) of tuning on the subset and then training the final model on all of
    X (item 3): ``{"epsilon": total, "tuning_epsilon": the tuning alone, "final_epsilon": the final
    run alone}``, each at ``delta``."""
    tuned = subset_tuning_rdp(tuning_curve, rate)
    final = np.asarray(final_curve, dtype=np.float64)
    if final.shape != tuned.shape:
        raise ValueError(f"final_curve: one value per order of RDP_ORDERS ({len(tuned)}); got shape {final.shape}")
    return {"epsilon": rdp_epsilon(tuned + final, delta), "tuning_epsilon": rdp_epsilon(tuned, delta),
            "final_epsilon": rdp_epsilon(final, delta)}
