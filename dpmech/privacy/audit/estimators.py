"""Every one-run estimator on one run's canary scores, with the same fixed guesses: Steinke et
al. 2023's bound, Mahloujifar et al. 2025's f-DP bounds and the GDP estimate (docs/audit.md,
docs/metrics.md).

Naming rule: a metric called ``audit_epsilon_lb*`` is a (1 - beta)-confidence lower bound on
epsilon that holds for *any* mechanism, so a value above the claimed epsilon refutes the claim.
The Gaussian-family conversion of the f-DP mu bound (``audit_epsilon_gaussian_fdp``) is not one:
a pure epsilon-DP mechanism (randomized response at epsilon 1, 100,000 canaries) reads 1.6 times
its epsilon there. It is compared with a claim only where the mechanism is Gaussian
(``gaussian_mu``: the mu the mechanism is claimed to be, ``audit_mu_claim``)."""

from __future__ import annotations

import math

import numpy as np

from dpmech import _validate as v
from dpmech.privacy.audit.one_run import epsilon_lower_bound, guess_outcome
from dpmech.privacy.audit.fdp import eps_delta_lower_bound, mu_lower_bound
from dpmech.privacy.audit.gdp import estimate_gdp, gdp_epsilon

ESTIMATORS = ("steinke", "fdp", "gdp")
RIGOROUS = ("steinke", "fdp")       # estimators that give a (1 - beta)-confidence lower bound


def run_estimators(scores, included, *, estimators=ESTIMATORS, beta: float = 0.05, delta: float,
                   guess_fraction: float = 0.2, claim: float | None = None,
                   gaussian_mu: float | None = None) -> dict[str, float]:
    """Every requested estimator on one run's canary scores (higher = more likely a member),
    with the same fixed guesses (the top and bottom ``guess_fraction`` / 2; :func:`dpmech.privacy.audit.one_run.audit`):

    * ``steinke``: ``audit_epsilon_lb_steinke``, :func:`epsilon_lower_bound` at ``delta`` (Steinke
      et al. 2023, Cor. 5.4) -- a (1 - beta)-confidence lower bound on epsilon, any mechanism;
    * ``fdp`` (Mahloujifar et al. 2025, Sec. 4's recursion): ``audit_epsilon_lb_fdp``, the recursion
      against the (epsilon, delta)-DP curve itself (:func:`dpmech.privacy.audit.fdp.eps_delta_lower_bound`)
      -- a (1 - beta)-confidence lower bound on epsilon at ``delta``, any mechanism;
      ``audit_mu_lb_fdp``, the recursion against the Gaussian curves
      (:func:`dpmech.privacy.audit.fdp.mu_lower_bound`) -- a (1 - beta)-confidence lower bound on
      the GDP mu (the mechanism is not mu'-GDP for any smaller mu'); and
      ``audit_epsilon_gaussian_fdp``, eps(mu lower bound) at ``delta`` (the paper's "empirical
      epsilon"): the epsilon of the weakest Gaussian mechanism not rejected, **not** a lower bound
      on epsilon for a mechanism that is not Gaussian;
    * ``gdp``: ``audit_mu_est_gdp`` and ``audit_epsilon_est_gdp``, the standardised mean
      difference of the members' and non-members' scores (:func:`dpmech.privacy.audit.gdp.estimate_gdp`
      on one row) -- an *estimate*, no confidence level.

    ``audit_epsilon_lb`` is the first rigorous estimator's ``audit_epsilon_lb_*`` (the list's order
    names the primary); with ``claim`` (the epsilon the trial was calibrated to) also
    ``audit_claim`` and ``audit_ratio`` = lb / claim. ``gaussian_mu``: only where the audited
    mechanism is exactly a Gaussian mechanism of that mu (e.g. full-batch DP-SGD, mu =
    sqrt(steps) / sigma), logged as ``audit_mu_claim``; ``audit_mu_lb_fdp`` above it refutes it.
    """
    names = [estimators] if isinstance(estimators, str) else list(estimators)
    for name in names:
        v.choice("estimator", name, ESTIMATORS)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"estimator: give one or more distinct names of {', '.join(ESTIMATORS)}, got {names}")
    primary = next((n for n in names if n in RIGOROUS), None)
    if primary is None:
        raise ValueError("estimator: 'gdp' is an estimate, not a lower bound; include 'steinke' or 'fdp' "
                         "(the first rigorous one is audit_epsilon_lb)")
    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    if scores.shape != included.shape or scores.ndim != 1:
        raise ValueError(f"scores: need one score per canary, got {scores.shape} scores for {included.shape} canaries")
    if not np.all(np.isfinite(scores)):
        raise ValueError("scores: every canary score must be finite")
    beta = v.open_unit("beta", beta)
    delta = v.unit_interval("delta", delta, high_open=True)
    if gaussian_mu is not None:
        gaussian_mu = v.non_negative("gaussian_mu", gaussian_mu)
    m, r, correct = guess_outcome(scores, included, guess_fraction, name="guess_fraction")
    out = {"audit_canaries": float(m), "audit_guesses": float(r), "audit_correct": float(correct),
           "audit_beta": float(beta), "audit_delta": float(delta)}
    if "steinke" in names:
        out["audit_epsilon_lb_steinke"] = epsilon_lower_bound(r, correct, beta=beta, delta=delta, m=m)
    if "fdp" in names:
        mu = mu_lower_bound(m, r, correct, beta=beta)
        out["audit_epsilon_lb_fdp"] = eps_delta_lower_bound(m, r, correct, delta=delta, beta=beta)
        out["audit_mu_lb_fdp"] = mu
        out["audit_epsilon_gaussian_fdp"] = (gdp_epsilon(mu, delta) if (mu > 0 and delta > 0)
                                             else (math.inf if mu > 0 else 0.0))
        if gaussian_mu is not None:
            out["audit_mu_claim"] = float(gaussian_mu)
    if "gdp" in names:
        if included.sum() < 2 or (~included).sum() < 2:
            raise ValueError("estimator: 'gdp' needs at least 2 member and 2 non-member canaries")
        est = estimate_gdp([scores[included]], [scores[~included]], delta=delta if delta > 0 else 1e-300)
        out["audit_mu_est_gdp"] = float(est["mu"])
        out["audit_epsilon_est_gdp"] = float(est["epsilon"])
    out["audit_epsilon_lb"] = out[f"audit_epsilon_lb_{primary}"]
    if claim is not None:
        out["audit_claim"] = float(claim)
        out["audit_ratio"] = (out["audit_epsilon_lb"] / claim) if claim > 0 and math.isfinite(claim) else 0.0
    return out
