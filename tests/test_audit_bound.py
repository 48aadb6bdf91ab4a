"""dpmech.privacy.audit.one_run's (epsilon, delta) bound is Steinke, Nasr & Jagielski (2023) Cor. 5.4 exactly (the
alpha-weighted delta term of their App. D), ``m`` is required with delta, the impossible audit is
recognised, and ``guess_fraction = 1`` works for any m (issue 18, points 8-10)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom

from dpmech.privacy.audit.one_run import audit, audit_possible, epsilon_lower_bound, guess_counts, p_value


def reference_p_value(m, r, v, eps, delta):
    """The paper's App. D loop, written out independently: F(v) + 2 m delta max_i (sum of pmf) / i."""
    q = 1 / (1 + math.exp(-eps))
    tail = binom.sf(v - 1, r, q)
    alpha, acc = 0.0, 0.0
    for i in range(1, v + 1):
        acc += binom.pmf(v - i, r, q)
        alpha = max(alpha, acc / i)
    return min(tail + alpha * delta * 2 * m, 1.0)


@pytest.mark.parametrize("m,r,v", [(1000, 200, 200), (1000, 200, 150), (100, 100, 80), (5000, 1000, 1000), (50, 10, 3)])
@pytest.mark.parametrize("eps", [0.0, 0.5, 2.0, 5.0])
@pytest.mark.parametrize("delta", [0.0, 1e-5, 1e-3])
def test_p_value_matches_the_papers_loop(m, r, v, eps, delta):
    assert p_value(m, r, v, eps, delta) == pytest.approx(reference_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15)


def test_issue_anchors():
    # the figures of the issue (and of the paper's own code): beta 0.05, delta 1e-5
    assert epsilon_lower_bound(200, 200, delta=1e-5, m=1000) == pytest.approx(4.17, abs=0.005)
    assert epsilon_lower_bound(1000, 1000, delta=1e-5, m=5000) == pytest.approx(5.67, abs=0.005)
    # negative control: the unweighted 2 m delta term gives the looser 4.03
    def unweighted(eps):
        return binom.sf(199, 200, 1 / (1 + math.exp(-eps))) + 2 * 1000 * 1e-5
    assert unweighted(4.1) > 0.05  # 4.1 is not rejected by the old bound, but it is by the paper's
    assert p_value(1000, 200, 200, 4.1, 1e-5) <= 0.05


def test_bound_is_the_largest_rejected_epsilon():
    for m, r, v, d in [(1000, 200, 180, 1e-5), (1000, 1000, 700, 1e-6), (300, 60, 55, 1e-4)]:
        e = epsilon_lower_bound(r, v, delta=d, m=m)
        assert p_value(m, r, v, e, d) <= 0.05 < p_value(m, r, v, e + 1e-6, d)


def test_m_is_required_with_delta():
    with pytest.raises(ValueError, match="^m: "):
        epsilon_lower_bound(200, 180, delta=1e-5)
    assert epsilon_lower_bound(200, 180) > 0  # pure DP: m does not enter


def test_impossible_audit_is_refused():
    assert audit_possible(1000, 1e-5) and not audit_possible(1000, 0.05)
    with pytest.raises(ValueError, match="delta"):
        epsilon_lower_bound(1000, 1000, delta=0.05, m=1000)


@pytest.mark.parametrize("m", [1, 2, 7, 999])
def test_guess_fraction_one_guesses_every_canary(m):
    k_pos, k_neg = guess_counts(m, 1.0)
    assert k_pos + k_neg == m and abs(k_pos - k_neg) <= 1
    rng = np.random.default_rng(m)
    included = rng.random(m) < 0.5
    res = audit(rng.random(m), included, guess_fraction=1.0, delta=1e-6)
    assert res["audit_guesses"] == m


def test_trial_with_an_impossible_audit_is_refused_at_validation():
    from pydantic import ValidationError

    from trainables.dpsgd import DPSGDTrialConfig

    assert DPSGDTrialConfig(audit_canaries=1000, delta=1e-5).audit_canaries == 1000
    with pytest.raises(ValidationError, match="audit_canaries: 2000 canaries with delta = 0.01 make the audit impossible"):
        DPSGDTrialConfig(audit_canaries=2000, delta=0.01)
    assert DPSGDTrialConfig(audit_canaries=7, audit_guess_fraction=1.0).audit_canaries == 7
