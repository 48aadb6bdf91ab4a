"""The end-to-end epsilon under each analysis (dpmech/privacy/tuning_analyses.py, issue 54.2).

Independent checks: the mixture curve against a brute-force Renyi divergence of the joint output
(configuration, result) of tiny discrete mechanisms; the whole analysis against the exact privacy
profile of the released best-of-K of tiny exponential mechanisms, K drawn from the distribution
(no RDP anywhere on that route); a single configuration against dp-accounting's own
``RepeatAndSelectDpEvent``. Negative controls: a planted wrong mixture (the mean of the curves,
not their log-mean-exp) and a planted "tuning is free" bound both fall below the exact figure.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpmech.privacy.accounting import RDP_ORDERS, rdp_curve, rdp_epsilon, subsampled_gaussian_event
from dpmech.privacy.tuning import num_trials_pmf, repeat_and_select_epsilon
from dpmech.privacy.tuning_analyses import (MIXTURE, PAPERNOT_STEINKE, charged_analysis,
                                            epsilon_total_by_analysis, mixture_rdp)

ORDERS = np.asarray(RDP_ORDERS)


def renyi(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """D_alpha(p || q) at every order of RDP_ORDERS, by direct summation (finite supports)."""
    logs = np.log(p)[None, :] * ORDERS[:, None] + np.log(q)[None, :] * (1 - ORDERS[:, None])
    m = logs.max(axis=1, keepdims=True)
    return (m[:, 0] + np.log(np.exp(logs - m).sum(axis=1))) / (ORDERS - 1)


def exp_mech(eps: float, scores: np.ndarray) -> np.ndarray:
    """The exponential mechanism's output distribution (utility sensitivity 1)."""
    w = np.exp(eps * scores / 2)
    return w / w.sum()


# three configurations (a privacy-relevant hyperparameter), each an exponential mechanism over 4
# outputs whose utilities shift by at most 1 between the neighbouring datasets X and X'
EPS = np.array([0.3, 0.8, 1.5])
U, U2 = np.array([0.0, 1.0, 2.0, 3.0]), np.array([1.0, 0.0, 2.0, 2.0])


def per_config_curves() -> np.ndarray:
    """Each configuration's exact RDP curve: the larger of the two directions."""
    return np.stack([np.maximum(renyi(exp_mech(e, U), exp_mech(e, U2)), renyi(exp_mech(e, U2), exp_mech(e, U)))
                     for e in EPS])


def test_the_mixture_curve_is_the_renyi_divergence_of_the_joint_output():
    """exp((a-1) D_a) of the joint (theta, y) is the weighted sum of the per-theta terms: with each
    theta's exact divergence as its curve, the mixture curve equals the joint's exact divergence."""
    w = np.array([0.5, 0.3, 0.2])
    joint_x = np.concatenate([wi * exp_mech(e, U) for wi, e in zip(w, EPS)])
    joint_x2 = np.concatenate([wi * exp_mech(e, U2) for wi, e in zip(w, EPS)])
    exact = renyi(joint_x, joint_x2)
    curves = np.stack([renyi(exp_mech(e, U), exp_mech(e, U2)) for e in EPS])
    assert np.allclose(mixture_rdp(curves, w), exact, rtol=1e-9, atol=1e-12)
    assert (mixture_rdp(curves, w) <= curves.max(axis=0)).all()
    # negative control: the plain mean of the curves under-states the joint divergence
    planted = (w[:, None] * curves).sum(axis=0)
    assert (planted < exact - 1e-6).any()


def _released_profile_epsilon(weights, distribution: str, mean: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of releasing the best (by score) of K candidates, each drawing
    its configuration with ``weights`` and releasing (configuration, output), K ~ the distribution:
    the released distribution is sum_k P[K=k] (F(o)^k - F(o^-)^k) over outputs o sorted by score,
    and the epsilon is read from the exact privacy profile (both directions)."""
    pmf = num_trials_pmf(distribution, mean, kmax=6000)

    def released(u: np.ndarray) -> np.ndarray:
        # one candidate's output (theta, y), scored by y with ties broken by theta: a total order
        single = np.concatenate([wi * exp_mech(e, u) for wi, e in zip(weights, EPS)])
        score = np.concatenate([U * 10 + i for i in range(len(EPS))])   # the public score of each output
        order = np.argsort(score)
        cdf = np.cumsum(single[order])
        prev = np.concatenate([[0.0], cdf[:-1]])
        k = np.arange(len(pmf))
        out = np.empty_like(single)
        out[order] = (pmf[None, :] * (cdf[:, None] ** k[None, :] - prev[:, None] ** k[None, :])).sum(axis=1)
        return np.append(out, pmf[0])                  # K = 0: nothing released

    p, q = released(U), released(U2)

    def profile(eps: float) -> float:
        return max(np.clip(p - np.exp(eps) * q, 0, None).sum(), np.clip(q - np.exp(eps) * p, 0, None).sum())

    lo, hi = 0.0, 20.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if profile(mid) <= delta else (mid, hi)
    return hi


@pytest.mark.parametrize("distribution, mean", [("geometric", 5), ("logarithmic", 20), ("poisson", 8)])
def test_each_analysis_bounds_the_exact_release_and_the_mixture_is_tighter(distribution, mean):
    w, delta = np.array([1 / 3] * 3), 1e-5
    curves = per_config_curves()
    by = epsilon_total_by_analysis(curves, delta, distribution, mean)
    exact = _released_profile_epsilon(w, distribution, mean, delta)
    assert exact <= by[MIXTURE] <= by[PAPERNOT_STEINKE]
    # tuning is never free: at least one candidate's own epsilon (the mixture's) under each analysis
    one = rdp_epsilon(mixture_rdp(curves), delta)
    assert by[MIXTURE] >= one and by[PAPERNOT_STEINKE] >= rdp_epsilon(curves.max(axis=0), delta)
    assert charged_analysis(by) == (MIXTURE, by[MIXTURE])
    # negative control: "tuning is free" (one candidate's epsilon) falls below the exact release
    assert one < exact


def test_one_configuration_gives_dp_accountings_repeat_and_select_under_both():
    event = subsampled_gaussian_event(256 / 50000, 1.1, 5850)
    curves = rdp_curve(event)[None, :]
    by = epsilon_total_by_analysis(curves, 1e-5, "logarithmic", 20)
    reference = repeat_and_select_epsilon(event, 1e-5, "logarithmic", 20)
    assert by[PAPERNOT_STEINKE] == pytest.approx(reference, rel=1e-9)
    assert by[MIXTURE] == pytest.approx(reference, rel=1e-9)
    assert charged_analysis(by)[0] == PAPERNOT_STEINKE       # a tie goes to the plainer analysis


def test_a_configuration_of_zero_weight_does_not_count_and_an_infinite_one_does():
    curves = per_config_curves()
    assert np.allclose(mixture_rdp(curves, [0.5, 0.5, 0.0]), mixture_rdp(curves[:2]))
    bad = curves.copy()
    bad[2, :5] = np.inf
    mixed = mixture_rdp(bad)
    assert np.isinf(mixed[:5]).all() and np.isfinite(mixed[5:]).all()


@pytest.mark.parametrize("weights, words", [([0.5, 0.5], "one non-negative weight per configuration"),
                                            ([1.5, -0.25, -0.25], "one non-negative weight"),
                                            ([0.2, 0.2, 0.2], "summing to 1")])
def test_bad_weights_are_refused_in_one_line(weights, words):
    with pytest.raises(ValueError, match=f"^weights: .*{words}"):
        mixture_rdp(per_config_curves(), weights)


def test_the_charged_analysis_is_the_smallest_finite_one():
    assert charged_analysis({PAPERNOT_STEINKE: 3.0, MIXTURE: 2.9}) == (MIXTURE, 2.9)
    assert charged_analysis({PAPERNOT_STEINKE: 3.0, MIXTURE: math.inf}) == (PAPERNOT_STEINKE, 3.0)
    assert charged_analysis({PAPERNOT_STEINKE: math.inf})[1] == math.inf
    with pytest.raises(ValueError, match="^by_analysis: unknown analyses"):
        charged_analysis({"koskela_kulkarni": 1.0})
