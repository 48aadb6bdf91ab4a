"""Every one-run estimator on one run's canary scores, with the same fixed guesses: Steinke et
al. 2023's bound, Mahloujifar et al. 2025's f-DP bound and the GDP estimate (docs/audit.md)."""

from __future__ import annotations

import math

import numpy as np

from dpmech import _validate as v
from dpmech.privacy.audit.one_run import epsilon_lower_bound, guess_outcome
from dpmech.privacy.audit.fdp import mu_lower_bound
from dpmech.privacy.audit.gdp import estimate_gdp, gdp_epsilon

ESTIMATORS = ("steinke", "fdp", "gdp")
RIGOROUS = ("steinke", "fdp")       # estimators that give a (1 - beta)-confidence lower bound


def run_estimators(scores, included, *, estimators=ESTIMATORS, beta: float = 0.05, delta: float,
                   guess_fraction: float = 0.2, claim: float | None = None) -> dict[str, float]:
    """Every requested estimator on one run's canary scores (higher = more likely a member),
    with the same fixed guesses (the top and bottom ``guess_fraction`` / 2; :func:`dpmech.privacy.audit.one_run.audit`):

    * ``steinke``: ``audit_epsilon_lb_steinke``, :func:`epsilon_lower_bound` at ``delta`` (Steinke
      et al. 2023, Cor. 5.4) -- a (1 - beta)-confidence lower bound on epsilon;
    * ``fdp``: ``audit_mu_lb_fdp``, :func:`dpmech.privacy.audit.fdp.mu_lower_bound` (Mahloujifar et al.
      2025) -- a (1 - beta)-confidence lower bound on mu -- and ``audit_epsilon_lb_fdp``, its
      epsilon at ``delta`` (a lower bound within the Gaussian family; docs/audit.md);
    * ``gdp``: ``audit_mu_est_gdp`` and ``audit_epsilon_est_gdp``, the standardised mean
      difference of the members' and non-members' scores (:func:`dpmech.privacy.audit.gdp.estimate_gdp`
      on one row) -- an *estimate*, no confidence level.

    ``audit_epsilon_lb`` is the first rigorous estimator's bound (the list's order names the
    primary); with ``claim`` (the trial's epsilon) also ``audit_claim`` and ``audit_ratio`` = lb / claim.
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
    m, r, correct = guess_outcome(scores, included, guess_fraction, name="guess_fraction")
    out = {"audit_canaries": float(m), "audit_guesses": float(r), "audit_correct": float(correct),
           "audit_beta": float(beta)}
    if "steinke" in names:
        out["audit_epsilon_lb_steinke"] = epsilon_lower_bound(r, correct, beta=beta, delta=delta, m=m)
    if "fdp" in names:
        mu = mu_lower_bound(m, r, correct, beta=beta)
        out["audit_mu_lb_fdp"] = mu
        out["audit_epsilon_lb_fdp"] = gdp_epsilon(mu, delta) if (mu > 0 and delta > 0) else (math.inf if mu > 0 else 0.0)
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
