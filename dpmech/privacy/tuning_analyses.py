"""The end-to-end epsilon of a tuning-private release under each analysis dpsweep can verify.

A tuning-private sweep (docs/tuning_privacy.md) releases the best of K candidates, K random and
unobserved, each candidate drawing its hyperparameters independently from the search space.
Two analyses apply to that procedure and are computed here:

``papernot_steinke``
    Papernot & Steinke (ICLR 2022) Thm 2 (truncated negative binomial, incl. geometric and
    logarithmic) / Thm 6 (Poisson) on one per-candidate RDP curve that bounds *every*
    configuration the search could draw: the order-wise maximum
    (:func:`dpmech.privacy.tuning.worst_case_rdp`). Any RDP base mechanism.

``papernot_steinke_mixture``
    The same theorems on the RDP curve of one candidate *as it is drawn*: the candidate's
    privacy configuration theta is drawn from the search distribution p (independently of the
    data) and is part of its output, so for every neighbouring pair and order alpha

        exp((alpha-1) D_alpha(Q(X) || Q(X'))) = sum_theta p(theta) exp((alpha-1) D_alpha(Q_theta(X) || Q_theta(X')))
                                             <= sum_theta p(theta) exp((alpha-1) eps_theta(alpha)),

    (the joint density of (theta, y) is p(theta) q_theta(y); the sum over theta factors out),
    hence one candidate is (alpha, eps_mix(alpha))-RDP with eps_mix(alpha) =
    log E_p[exp((alpha-1) eps_theta(alpha))] / (alpha-1) (:func:`mixture_rdp`), never above the
    worst case. It needs the draw distribution p of the privacy-relevant keys exactly (dpsweep:
    independent uniform ``choice`` keys, so the product of their values, equally weighted), and
    nothing hidden beyond what Papernot & Steinke need (K, the unselected candidates). Any RDP
    base mechanism. The identity is proved here and checked by brute force
    (tests/test_tuning_analyses.py); we do not attribute its exact form to a paper.

Tuning on a secret subset and training once on everything (the procedure of Koskela & Kulkarni,
NeurIPS 2023) is a different procedure with its own accounting: :mod:`dpmech.privacy.subset_tuning`.
Not implemented (docs/tuning_privacy.md, "Analyses not shipped"): Xiang et al. (NDSS 2026), whose full
text could not be read here.
"""

from __future__ import annotations

import math

import numpy as np

from dpmech.privacy.accounting import RDP_ORDERS

PAPERNOT_STEINKE = "papernot_steinke"
MIXTURE = "papernot_steinke_mixture"
# the analyses in the order a tie is broken in (the plainer one first)
ANALYSES = (PAPERNOT_STEINKE, MIXTURE)


def mixture_rdp(curves, weights=None) -> np.ndarray:
    """RDP curve of one candidate whose configuration theta is drawn with probability ``weights``
    (default: equal) among the configurations whose RDP curves are the rows of ``curves``:
    eps_mix(alpha) = log(sum_theta w_theta exp((alpha-1) eps_theta(alpha))) / (alpha-1), at
    dpmech's RDP_ORDERS (module docstring). An order where a configuration of positive weight has
    an infinite curve is infinite."""
    curves = np.atleast_2d(np.asarray(curves, dtype=np.float64))
    if curves.shape[0] == 0 or curves.shape[1] != len(RDP_ORDERS):
        raise ValueError(f"curves: one row per configuration, {len(RDP_ORDERS)} orders each; got shape {curves.shape}")
    w = np.full(curves.shape[0], 1.0 / curves.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (curves.shape[0],) or (w < 0).any() or not math.isclose(float(w.sum()), 1.0, rel_tol=1e-9):
        raise ValueError("weights: one non-negative weight per configuration, summing to 1")
    keep = w > 0
    curves, w = curves[keep], w[keep]
    orders = np.asarray(RDP_ORDERS, dtype=np.float64)
    out = np.full(len(orders), np.inf)
    finite = np.isfinite(curves).all(axis=0)
    if finite.any():
        from scipy.special import logsumexp

        a1 = orders[finite] - 1.0
        out[finite] = logsumexp(a1 * curves[:, finite], axis=0, b=w[:, None]) / a1
        # rounding may put the mean a hair above the maximum: it is never above it
        out[finite] = np.minimum(out[finite], curves[:, finite].max(axis=0))
    return out


def epsilon_total_by_analysis(curves, delta: float, distribution: str, mean: float, shape: float | None = None,
                              weights=None) -> dict[str, float]:
    """End-to-end epsilon at ``delta`` of releasing the best of K candidates under each analysis
    (module docstring): ``curves`` holds the RDP curve of every privacy configuration the search
    draws (rows), ``weights`` their probabilities (default: equal)."""
    from dpmech.privacy.tuning import tuning_epsilon

    curves = np.atleast_2d(np.asarray(curves, dtype=np.float64))
    return {
        PAPERNOT_STEINKE: tuning_epsilon(curves.max(axis=0), delta, distribution, mean, shape),
        MIXTURE: tuning_epsilon(mixture_rdp(curves, weights), delta, distribution, mean, shape),
    }


def charged_analysis(by_analysis: dict[str, float]) -> tuple[str, float]:
    """(name, epsilon) of the analysis a release is charged under: the smallest end-to-end epsilon
    among the sound analyses that apply (every key of ``by_analysis``); a tie goes to the one
    listed first in ANALYSES. Infinite when none is finite."""
    if not by_analysis:
        raise ValueError("by_analysis: no analysis applies")
    unknown = set(by_analysis) - set(ANALYSES)
    if unknown:
        raise ValueError(f"by_analysis: unknown analyses {sorted(unknown)}; known: {', '.join(ANALYSES)}")
    order = [a for a in ANALYSES if a in by_analysis]
    finite = [a for a in order if isinstance(by_analysis[a], (int, float)) and math.isfinite(by_analysis[a])]
    if not finite:
        return order[0], math.inf
    name = min(finite, key=lambda a: (by_analysis[a], order.index(a)))
    return name, float(by_analysis[name])
