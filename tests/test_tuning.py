"""dpmech.privacy.tuning: the end-to-end epsilon of private hyperparameter selection (Papernot & Steinke
2022) against dp-accounting, and the distribution of the number of trials."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant
from scipy.stats import chisquare

from dpmech.privacy.accounting import epsilon, rdp_curve, subsampled_gaussian_event
from dpmech.privacy.tuning import (draw_num_trials, num_trials_pmf, repeat_and_select_epsilon, tuning_epsilon,
                                   tuning_shape, worst_case_rdp)

# One DP-SGD run (q = 256/50000, sigma = 1.1, 5,850 steps) has epsilon 1.989 at delta 1e-5; the
# best of K runs with E[K] = 20 costs (dp-accounting's RDP accountant):
TUNED = {"logarithmic": (None, 3.572), "geometric": (None, 4.317), "poisson": (None, 6.590),
         "truncated_negative_binomial": (0.5, 3.961)}
EVENT = subsampled_gaussian_event(256 / 50000, 1.1, 5850)


def test_single_run_reference_epsilon():
    assert epsilon(EVENT, 1e-5) == pytest.approx(1.989, abs=0.005)


@pytest.mark.parametrize("distribution", list(TUNED))
def test_end_to_end_epsilon_matches_dp_accounting(distribution):
    shape, expected = TUNED[distribution]
    via_event = repeat_and_select_epsilon(EVENT, 1e-5, distribution, 20, shape)
    via_curve = tuning_epsilon(rdp_curve(EVENT), 1e-5, distribution, 20, shape)
    assert via_curve == pytest.approx(expected, abs=0.01)
    assert via_event == pytest.approx(via_curve, abs=1e-9)
    # independently: dp-accounting with its own default orders
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dpe.RepeatAndSelectDpEvent(EVENT, 20.0, tuning_shape(distribution, shape)))
    assert abs(via_curve - acc.get_epsilon(1e-5)) < 0.02
    # more trials on average cost more, and tuning always costs more than one trial
    assert tuning_epsilon(rdp_curve(EVENT), 1e-5, distribution, 40, shape) > via_curve
    assert epsilon(EVENT, 1e-5) < tuning_epsilon(rdp_curve(EVENT), 1e-5, distribution, 5, shape) < via_curve


def test_worst_case_curve_bounds_every_configuration():
    events = [subsampled_gaussian_event(256 / 50000, s, 5850) for s in (0.9, 1.1, 1.5)]
    worst = worst_case_rdp(events)
    for e in events:
        assert np.all(worst >= rdp_curve(e) - 1e-12)
    # the least noisy configuration dominates here, so the worst case is its curve
    assert np.allclose(worst, rdp_curve(events[0]))
    assert tuning_epsilon(worst, 1e-5, "geometric", 20) > tuning_epsilon(rdp_curve(events[1]), 1e-5, "geometric", 20)
    assert math.isinf(tuning_epsilon(worst_case_rdp([dpe.NonPrivateDpEvent()]), 1e-5, "poisson", 5))


@pytest.mark.parametrize("distribution, shape", [("poisson", None), ("geometric", None), ("logarithmic", None),
                                                 ("truncated_negative_binomial", 0.5)])
def test_pmf_is_a_distribution_with_the_asked_mean(distribution, shape):
    pmf = num_trials_pmf(distribution, 8, shape, kmax=2000)
    assert pmf.sum() == pytest.approx(1.0, abs=1e-9)
    assert (np.arange(len(pmf)) * pmf).sum() == pytest.approx(8, rel=1e-6)
    if distribution != "poisson":
        assert pmf[0] == 0  # at least one trial


def _chi2_pvalue(draws: np.ndarray, pmf: np.ndarray) -> float:
    """Chi-square goodness of fit, tail bins merged so every expected count is >= 5."""
    n = len(draws)
    counts = np.bincount(draws, minlength=len(pmf))[:len(pmf)]
    exp = pmf * n
    obs_b, exp_b, o_acc, e_acc = [], [], 0.0, 0.0
    for o, e in zip(counts, exp):
        o_acc += o
        e_acc += e
        if e_acc >= 5:
            obs_b.append(o_acc)
            exp_b.append(e_acc)
            o_acc = e_acc = 0.0
    obs_b[-1] += o_acc + (n - counts.sum())
    exp_b[-1] += e_acc + (n - exp.sum())
    return chisquare(obs_b, exp_b).pvalue


@pytest.mark.parametrize("distribution, shape", [("poisson", None), ("geometric", None), ("logarithmic", None),
                                                 ("truncated_negative_binomial", 0.5)])
def test_number_of_trials_follows_the_distribution(distribution, shape):
    rng = np.random.default_rng(12)
    draws = np.array([draw_num_trials(distribution, 6, shape, rng=rng) for _ in range(4000)])
    pmf = num_trials_pmf(distribution, 6, shape, kmax=int(draws.max()) + 1)
    assert _chi2_pvalue(draws, pmf) > 1e-3
    assert draws.mean() == pytest.approx(6, rel=0.1)


def test_number_of_trials_test_can_fail():
    # negative control: geometric draws are rejected as Poisson draws of the same mean
    rng = np.random.default_rng(12)
    draws = np.array([draw_num_trials("geometric", 6, rng=rng) for _ in range(4000)])
    assert _chi2_pvalue(draws, num_trials_pmf("poisson", 6, kmax=int(draws.max()) + 1)) < 1e-6


def test_tuning_rules():
    with pytest.raises(ValueError, match="tuning_privacy.distribution"):
        tuning_shape("uniform")
    with pytest.raises(ValueError, match="tuning_privacy.shape"):
        tuning_shape("truncated_negative_binomial", None)
    with pytest.raises(ValueError, match="tuning_privacy.mean"):
        draw_num_trials("poisson", 0.5, rng=np.random.default_rng(0))
