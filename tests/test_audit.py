"""dpmech.privacy.audit.one_run: the one-run lower bound on epsilon (Steinke, Nasr & Jagielski 2023) on
simulated mechanisms with a known epsilon, including the negative control that refutes a claim."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import binom

from dpmech.privacy.audit.one_run import audit, epsilon_lower_bound, guesses, make_canaries


def rr_scores(included: np.ndarray, eps: float, rng: np.random.Generator) -> np.ndarray:
    """An eps-DP release per canary: its bit flipped with probability 1/(1+e^eps), plus a tie-breaker."""
    s = np.where(included, 1.0, -1.0)
    keep = rng.random(s.shape[0]) < math.exp(eps) / (1 + math.exp(eps))
    return np.where(keep, s, -s) + 0.01 * rng.random(s.shape[0])


def test_lower_bound_is_the_largest_unrejected_epsilon():
    eps = epsilon_lower_bound(200, 180, beta=0.05)
    p = 1 / (1 + math.exp(-eps))
    assert binom.sf(179, 200, p) == pytest.approx(0.05, rel=1e-3)
    assert epsilon_lower_bound(200, 190) > eps > epsilon_lower_bound(200, 170)
    assert epsilon_lower_bound(200, 100) == 0.0 and epsilon_lower_bound(0, 0) == 0.0
    # delta spends part of beta: a smaller bound
    assert epsilon_lower_bound(200, 180, delta=1e-5, m=1000) < eps
    with pytest.raises(ValueError, match="delta"):  # 2 m delta alpha leaves nothing of beta
        epsilon_lower_bound(200, 180, delta=0.05, m=1000)


def test_bound_holds_at_the_confidence_level_on_an_eps_dp_mechanism():
    rng = np.random.default_rng(0)
    eps, fails, bounds = 1.0, 0, []
    for _ in range(400):
        included = rng.random(1000) < 0.5
        res = audit(rr_scores(included, eps, rng), included, guess_fraction=1.0)
        fails += res["epsilon_lower_bound"] > eps
        bounds.append(res["epsilon_lower_bound"])
    assert fails / 400 <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 400)
    # and it is informative: close to the truth with 1,000 canaries all guessed
    assert 0.7 < np.median(bounds) <= eps


def test_audit_refutes_a_wrong_claim():
    # negative control: the mechanism really leaks eps = 3, the claim says 1
    rng = np.random.default_rng(1)
    included = rng.random(1000) < 0.5
    res = audit(rr_scores(included, 3.0, rng), included, guess_fraction=1.0)
    assert res["epsilon_lower_bound"] > 1.0


def test_guesses_and_canaries():
    g = guesses(np.array([0.1, 0.9, 0.5, 0.2]), 1, 1)
    assert g.tolist() == [-1, 1, 0, 0]
    x = torch.randn(50, 1, 4, 4)
    y = torch.randint(0, 10, (50,))
    c = make_canaries(x, y, 40, 10, seed=3)
    c2 = make_canaries(x, y, 40, 10, seed=3)
    assert torch.equal(c.x, c2.x) and (c.included == c2.included).all()
    assert 10 < c.included.sum() < 30
    assert c.members()[0].shape[0] == c.included.sum()
    with pytest.raises(ValueError, match="audit_canaries"):
        make_canaries(x, y, 60, 10, seed=0)
