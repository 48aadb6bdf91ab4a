"""The vectorised RDP of the subsampled Gaussian mechanism equals dp-accounting's, the searches
that use it return what dp-accounting's own search returns, and a wrong fast curve cannot make
them return an unsound answer (the exact check catches it)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant as rdp_acc

from dpmech.privacy import accounting
from dpmech.privacy.accounting import RDP_ORDERS, rdp_curve, subsampled_gaussian_event
from dpmech.privacy.sampled_gaussian_rdp import sampled_gaussian_rdp

ORDERS = np.array(sorted(set(rdp_acc.DEFAULT_RDP_ORDERS) | set(RDP_ORDERS)))
GRID = list(itertools.product([1e-4, 256 / 60000, 0.05, 0.5, 0.99], [0.3, 0.6, 1.1, 3.0, 30.0]))


def _reference(q, sigma, orders=ORDERS):
    return rdp_acc._compute_rdp_poisson_subsampled_gaussian(q, sigma, orders)  # noqa: SLF001 - the reference


def _close(a, b, rtol=1e-9, atol=1e-13):
    both_inf = np.isinf(a) & np.isinf(b)
    return bool(np.all(both_inf | np.isclose(a, b, rtol=rtol, atol=atol)))


@pytest.mark.parametrize("q,sigma", GRID)
def test_equals_dp_accounting_at_every_order(q, sigma):
    """Integer orders up to 1024 and fractional ones (q 1e-4 with sigma 0.3 needs hundreds of
    series terms: the slow-convergence path)."""
    assert _close(sampled_gaussian_rdp(q, sigma, ORDERS), _reference(q, sigma))


def test_a_noise_multiplier_off_by_1e_4_is_told_apart():
    """Negative control: the tolerance of the comparison above is tight enough to see a sigma
    mis-scaled by one part in ten thousand (the calibration's own tolerance)."""
    q, sigma = 256 / 60000, 1.1
    assert not _close(sampled_gaussian_rdp(q, sigma * (1 + 1e-4), ORDERS), _reference(q, sigma))


def test_edge_cases_match():
    for q, sigma in [(0.0, 1.0), (1.0, 0.7), (0.3, 0.0)]:
        assert _close(sampled_gaussian_rdp(q, sigma, ORDERS), _reference(q, sigma))
    assert np.isinf(sampled_gaussian_rdp(0.1, 1.0, [np.inf])).all()
    with pytest.raises(ValueError, match="q: "):
        sampled_gaussian_rdp(1.5, 1.0, ORDERS)
    with pytest.raises(ValueError, match="sigma: "):
        sampled_gaussian_rdp(0.1, -1.0, ORDERS)


def test_fast_rdp_curve_of_composed_events_matches():
    events = [subsampled_gaussian_event(0.01, 1.1, 500), subsampled_gaussian_event(1.0, 3.0, 10),
              dpe.ComposedDpEvent([subsampled_gaussian_event(0.01, 1.1, 500), subsampled_gaussian_event(0.02, 0.8, 9)])]
    for ev in events:
        assert _close(rdp_curve(ev, fast=True), rdp_curve(ev))
    laplace = dpe.ComposedDpEvent([dpe.LaplaceDpEvent(2.0), subsampled_gaussian_event(0.01, 1.1, 5)])
    assert np.array_equal(rdp_curve(laplace, fast=True), rdp_curve(laplace))   # handed to dp-accounting


def _exact_sigma(target, delta, q, steps, before=None):
    """The bisection on dp-accounting's epsilon alone (what the search did before the fast curve)."""
    eps = accounting._search_epsilon(q, steps, delta, before, "rdp")  # noqa: SLF001
    return accounting._bisect_sigma(eps, target, delta, steps, 1e-4)  # noqa: SLF001


@pytest.mark.parametrize("target,q,steps,before", [
    (1.0, 256 / 60000, 2000, None), (3.0, 0.05, 100, None), (8.0, 1.0, 100, None),
    (1.0, 256 / 60000, 2000, dpe.GaussianDpEvent(20.0))])
def test_noise_calibration_returns_the_exact_search_s_sigma(target, q, steps, before):
    assert accounting._calibrate(target, 1e-5, q, steps, "rdp", 1e-4, before) == \
        _exact_sigma(target, 1e-5, q, steps, before)  # noqa: SLF001


def test_a_wrong_fast_curve_cannot_lower_the_noise(monkeypatch):
    """A planted under-estimate in the fast RDP (half the true curve) would choose too little
    noise; the dp-accounting check catches it and the search runs again exactly."""
    real = accounting.sampled_gaussian_rdp
    monkeypatch.setattr(accounting, "sampled_gaussian_rdp", lambda q, s, o: 0.5 * real(q, s, o))
    sigma = accounting._calibrate(1.0, 1e-5, 256 / 60000, 2000, "rdp", 1e-4, None)  # noqa: SLF001
    assert sigma == _exact_sigma(1.0, 1e-5, 256 / 60000, 2000)
    assert accounting.epsilon(subsampled_gaussian_event(256 / 60000, sigma, 2000), 1e-5) <= 1.0


def test_calibration_speed_benchmark_demo(tmp_path):
    from benchmarks import calibration_speed

    out = calibration_speed.main(["--demo", "--out", str(tmp_path / "c.json")])
    assert out["noise"]["same_sigmas"] and len(out["noise"]["sigmas"]) == 2
    assert (tmp_path / "c.json").exists()
