"""The heterogeneous Gaussian mechanism (Phan et al. 2019): Theorem 1's sigma is sound for every
epsilon (checked exactly against the Balle & Wang privacy profile), never below the analytic
Gaussian sigma, and the redistribution keeps the whitened query's guarantee."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpmech.secure_sgd.hgm import (DELTA_MAX, agm_sigma, egm_sigma, hgm_noise, hgm_sigma, mechanism_sigma,
                                   redistribution_vector, whitened_sensitivity_bound)
from dpmech.privacy.mechanisms import analytic_gaussian_sigma, gaussian_delta

EPSILONS = [1e-3, 0.01, 0.1, 0.5, 1.0, 1.5, 2.0, 4.0, 8.0, 16.0, 50.0, 200.0, 1000.0]
DELTAS = [1e-12, 1e-8, 1e-5, 1e-3, 0.01, 0.05, 0.2, 0.5, 0.79]


def test_theorem1_matches_the_reference_formula():
    # the authors' sigmaEGM: s = ln(sqrt(2/pi) * 1e5), sqrt(2) (sqrt(s) + sqrt(s + eps)) / (2 eps)
    s = math.log(math.sqrt(2.0 / math.pi) * 1e5)
    for eps in (0.5, 1.0, 4.0):
        ref = math.sqrt(2.0) * (math.sqrt(s) + math.sqrt(s + eps)) / (2.0 * eps)
        assert egm_sigma(eps, 1e-5, 1.0) == pytest.approx(ref, rel=1e-12)
    assert egm_sigma(2.0, 1e-5, 3.0) == pytest.approx(3.0 * egm_sigma(2.0, 1e-5, 1.0))  # linear in Delta
    assert hgm_sigma(2.0, 1e-5, 1.0) == egm_sigma(2.0, 1e-5, 1.0)


@pytest.mark.parametrize("delta", DELTAS)
def test_hgm_sigma_is_sound_for_every_epsilon_including_above_one(delta):
    for eps in EPSILONS:
        for sens in (0.1, 1.0, 7.0):
            s_hgm = mechanism_sigma("hgm", eps, delta, sens)
            s_agm = mechanism_sigma("agm", eps, delta, sens)
            # the analytic sigma is the exact minimum: HGM is at least that (sound) ...
            assert s_hgm >= s_agm * (1 - 1e-9), (eps, delta, sens)
            # ... and the exact delta of a Gaussian with the HGM sigma is <= delta
            assert gaussian_delta(s_hgm, eps, sens) <= delta * (1 + 1e-9), (eps, delta, sens)


def test_negative_controls_fail_the_same_check():
    # a sigma 20% below the exact minimum leaks more than delta, at every (eps, delta)
    for delta in DELTAS:
        for eps in EPSILONS:
            too_small = 0.8 * analytic_gaussian_sigma(eps, delta, 1.0)
            assert gaussian_delta(too_small, eps, 1.0) > delta
    # HGM minus 20% already fails for eps > 1 at delta = 1e-5 (the bound is within 20% there) ...
    for eps in (2.0, 5.0, 10.0, 50.0):
        assert gaussian_delta(0.8 * egm_sigma(eps, 1e-5, 1.0), eps, 1.0) > 1e-5
    # ... and the classic formula, used beyond its eps <= 1 range, is unsound: the check sees it
    for eps in (10.0, 50.0):
        classic = math.sqrt(2.0 * math.log(1.25 / 1e-5)) / eps
        assert gaussian_delta(classic, eps, 1.0) > 1e-5


def test_hgm_is_close_to_the_exact_minimum_for_large_epsilon():
    # Theorem 1 behaves like Theta(1/sqrt(eps)), as the exact calibration does
    ratios = [egm_sigma(e, 1e-5, 1.0) / agm_sigma(e, 1e-5, 1.0) for e in (10.0, 100.0, 1000.0)]
    assert all(1.0 <= r < 1.15 for r in ratios)


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="delta"):
        egm_sigma(1.0, 0.9, 1.0)  # s <= 0
    with pytest.raises(ValueError, match="delta"):
        egm_sigma(1.0, DELTA_MAX, 1.0)
    with pytest.raises(ValueError, match="epsilon"):
        egm_sigma(0.0, 1e-5, 1.0)
    with pytest.raises(ValueError, match="sensitivity"):
        egm_sigma(1.0, 1e-5, -1.0)
    with pytest.raises(ValueError, match="mechanism"):
        mechanism_sigma("gauss", 1.0, 1e-5, 1.0)
    with pytest.raises(ValueError, match="r_min"):
        redistribution_vector(torch.ones(4), 0.0)
    with pytest.raises(ValueError, match="weights"):
        redistribution_vector(torch.tensor([1.0, -1.0]), 0.5)


def test_redistribution_vector_sums_to_k_and_respects_the_floor():
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(32, 7, 7, generator=gen) ** 3
    r = redistribution_vector(w, 0.25)
    assert r.shape == w.shape
    assert float(r.sum()) == pytest.approx(w.numel(), rel=1e-6)
    assert float(r.min()) >= 0.25 - 1e-7
    # more weight -> more noise
    flat_w, flat_r = w.flatten(), r.flatten()
    assert flat_r[flat_w.argmax()] == flat_r.max()
    assert torch.equal(redistribution_vector(torch.zeros(5), 0.3), torch.ones(5))


def test_heterogeneous_noise_is_dp_for_the_whitened_sensitivity():
    """Exact check: N(0, sigma^2 diag(r)) on A is the Gaussian mechanism on diag(r)^(-1/2) A, so the
    worst-case shift (sensitivity along the smallest-r axis) has exact delta <= delta with the
    whitened bound, and > delta if one ignores the redistribution (negative control)."""
    r = redistribution_vector(torch.tensor([0.0, 1.0, 3.0, 8.0]), 0.25)
    sens, eps, delta = 1.0, 2.0, 1e-5
    sigma = hgm_sigma(eps, delta, whitened_sensitivity_bound(sens, r))
    # the privacy loss of a shift d under N(0, sigma^2 diag(r)) is that of a 1-D Gaussian with
    # shift ||diag(r)^(-1/2) d||; the worst unit-norm shift lies on the smallest r
    worst = sens / math.sqrt(float(r.min()))
    assert gaussian_delta(sigma, eps, worst) <= delta
    naive = hgm_sigma(eps, delta, sens)  # Delta_A read as the plain L2 sensitivity
    assert gaussian_delta(naive, eps, worst) > delta


def test_hgm_noise_has_the_redistributed_variances():
    gen = torch.Generator().manual_seed(3)
    r = torch.tensor([0.5, 1.0, 2.5])
    z = hgm_noise(torch.zeros(200_000, 3), 0.7, r, gen)
    var = z.var(dim=0).numpy()
    np.testing.assert_allclose(var, 0.49 * r.numpy(), rtol=0.02)
    with pytest.raises(ValueError, match="r of shape"):
        hgm_noise(torch.zeros(10, 4), 0.7, r, gen)
