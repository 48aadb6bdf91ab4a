"""dpmech.privacy.subset_tuning: the Poisson-subsampled RDP bound and the subset-then-final total.

Independent checks: dp-accounting's exact Poisson-subsampled Gaussian; exhaustive Renyi divergences
of subsampled discrete mechanisms (both directions of the add/remove relation). Controls: an
understated rate and a fixed (not random) subset are caught."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant as rdp_acc
from scipy.special import logsumexp

from dpmech.privacy.accounting import RDP_ORDERS, rdp_curve, rdp_epsilon, subsampled_gaussian_event
from dpmech.privacy.subset_tuning import poisson_subsampled_rdp, subset_then_final_epsilon, subset_tuning_rdp
from dpmech.privacy.tuning import repeat_and_select_rdp

ORDERS = np.asarray(RDP_ORDERS)
INTEGER = np.array([float(a).is_integer() and 2 <= a <= 256 for a in ORDERS])


def gaussian_curve(sigma):
    return ORDERS / (2.0 * sigma ** 2)


def exact_subsampled_gaussian(q, sigma):
    acc = rdp_acc.RdpAccountant(list(ORDERS))
    acc.compose(dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(sigma)))
    return np.asarray(acc._rdp)  # noqa: SLF001 - the accountant's curve at these orders


@pytest.mark.parametrize("sigma", [0.8, 1.5, 4.0])
@pytest.mark.parametrize("q", [0.01, 0.1, 0.5])
def test_the_formula_is_dp_accountings_exact_subsampled_gaussian_without_the_factor(q, sigma):
    """With the factor 1 the expansion is the exact RDP of the Poisson-subsampled Gaussian at integer
    orders (Mironov et al. 2019), which dp-accounting computes by its own code: the implementation of
    the sum is checked term by term."""
    ours = poisson_subsampled_rdp(gaussian_curve(sigma), q, factor=1.0)
    exact = exact_subsampled_gaussian(q, sigma)
    np.testing.assert_allclose(ours[INTEGER], exact[INTEGER], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("sigma", [0.8, 1.5, 4.0])
@pytest.mark.parametrize("q", [0.01, 0.1, 0.5])
def test_the_shipped_bound_is_above_the_exact_curve_and_within_zhu_wangs_constant(q, sigma):
    ours = poisson_subsampled_rdp(gaussian_curve(sigma), q)
    exact = exact_subsampled_gaussian(q, sigma)
    assert (ours[INTEGER] >= exact[INTEGER] - 1e-9).all()
    assert (ours[INTEGER] <= exact[INTEGER] + math.log(3) / (ORDERS[INTEGER] - 1) + 1e-9).all()
    # a fractional order takes the next integer order's bound (Renyi divergence does not decrease with
    # the order; dp-accounting's fractional orders are series bounds, not exact, so not compared)
    for i in np.flatnonzero(~INTEGER & (ORDERS < 256)):
        j = int(np.flatnonzero(ORDERS == max(2, math.ceil(ORDERS[i])))[0])
        assert ours[i] == min(ours[j], gaussian_curve(sigma)[i])
    # subsampling never costs privacy
    assert (ours <= gaussian_curve(sigma) + 1e-12).all()


def _renyi(a, p, q):
    return float(logsumexp(a * np.log(p) + (1 - a) * np.log(q)) / (a - 1))


def _random_instances(seed, n):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        k = int(rng.integers(2, 5))
        conc = rng.choice([0.1, 0.5, 1.0, 5.0], size=2)
        p, r = (np.maximum(rng.dirichlet(np.ones(k) * c), 1e-12) for c in conc)
        yield p / p.sum(), r / r.sum()


def _worst_gap(rate_true, rate_claimed, seed=0, n=200, top=10):
    """max over random discrete mechanisms (output laws p without the example, r with it) and
    integer orders of (true subsampled RDP, both directions) - (the bound at ``rate_claimed``)."""
    worst = -math.inf
    for p, r in _random_instances(seed, n):
        base = np.full(len(ORDERS), np.inf)
        for i, a in enumerate(ORDERS):
            if INTEGER[i] and a <= top:
                base[i] = max(_renyi(a, p, r), _renyi(a, r, p))
        bound = poisson_subsampled_rdp(base, rate_claimed)
        mix = (1 - rate_true) * p + rate_true * r     # the example is in the subsample with prob. rate_true
        for i, a in enumerate(ORDERS):
            if INTEGER[i] and a <= top:
                worst = max(worst, max(_renyi(a, mix, p), _renyi(a, p, mix)) - bound[i])
    return worst


@pytest.mark.parametrize("q", [0.05, 0.3, 0.9])
def test_exhaustive_divergences_of_subsampled_discrete_mechanisms_stay_under_the_bound(q):
    assert _worst_gap(q, q) <= 1e-9


def test_control_an_understated_rate_is_caught():
    """The same exhaustive check fails when the bound is computed at a smaller rate than the coins
    used: the check can fail."""
    assert _worst_gap(0.3, 0.1) > 0.05


def test_control_a_fixed_subset_gets_no_amplification():
    """Where the bound must not apply: a subset fixed in advance (or known to the attacker) holds the
    example with certainty, so the tuning's privacy loss is its whole curve, above the amplified one."""
    base = gaussian_curve(1.0)
    amplified = poisson_subsampled_rdp(base, 0.1)
    fixed_subset_truth = base          # rate 1 for the examples in the fixed subset
    assert (fixed_subset_truth[INTEGER] > amplified[INTEGER] + 0.1).all()
    np.testing.assert_array_equal(poisson_subsampled_rdp(base, 1.0), base)


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, float("nan"), True, "0.1"])
def test_rate_outside_the_unit_interval_is_refused(bad):
    with pytest.raises(ValueError, match="^rate: "):
        poisson_subsampled_rdp(gaussian_curve(1.0), bad)


def test_a_curve_on_other_orders_is_refused():
    with pytest.raises(ValueError, match="^curve: "):
        poisson_subsampled_rdp(np.ones(5), 0.1)


def test_an_infinite_order_stays_infinite_above_it_only():
    base = gaussian_curve(1.0)
    i7 = int(np.flatnonzero(ORDERS == 7.0)[0])
    base[i7] = np.inf
    out = poisson_subsampled_rdp(base, 0.1)
    i6 = int(np.flatnonzero(ORDERS == 6.0)[0])
    assert math.isfinite(out[i6]) and out[i6] < base[i6]
    assert math.isinf(out[i7])
    # orders above keep their own (unamplified) value: the sum needs eps(7)
    i8 = int(np.flatnonzero(ORDERS == 8.0)[0])
    assert out[i8] == base[i8]


def test_subset_tuning_of_dpsgd_candidates_costs_less_than_tuning_on_everything():
    """A DP-SGD candidate (batch 4,096 of 60,000, 40 epochs, sigma 6: epsilon about 1) tuned by Papernot & Steinke
    (logarithmic, mean 20): on the whole data the tuning alone costs more than one candidate; on a
    secret 10% subset it costs a fraction of one, and the cost grows with the rate."""
    q, steps = 4096 / 60000, int(40 * 60000 / 4096)
    cand = rdp_curve(subsampled_gaussian_event(q, 6.0, steps))
    ps = repeat_and_select_rdp(cand, "logarithmic", 20)
    delta = 1e-5
    eps_cand, eps_ps = rdp_epsilon(cand, delta), rdp_epsilon(ps, delta)
    by_rate = [rdp_epsilon(subset_tuning_rdp(ps, r), delta) for r in (0.05, 0.1, 0.3, 1.0)]
    assert eps_ps > eps_cand
    assert by_rate == sorted(by_rate) and by_rate[-1] == pytest.approx(eps_ps)
    assert by_rate[1] < 0.5 * eps_cand


def test_the_total_composes_the_two_curves():
    cand = rdp_curve(subsampled_gaussian_event(0.05, 2.0, 500))
    ps = repeat_and_select_rdp(cand, "logarithmic", 10)
    final = rdp_curve(subsampled_gaussian_event(0.05, 1.5, 800))
    out = subset_then_final_epsilon(ps, 0.1, final, 1e-5)
    assert out["final_epsilon"] == pytest.approx(rdp_epsilon(final, 1e-5))
    assert out["tuning_epsilon"] == pytest.approx(rdp_epsilon(subset_tuning_rdp(ps, 0.1), 1e-5))
    # RDP composition: more than either part, less than their sum at the same delta
    assert max(out["final_epsilon"], out["tuning_epsilon"]) < out["epsilon"] < out["final_epsilon"] + out["tuning_epsilon"]
    with pytest.raises(ValueError, match="^final_curve: "):
        subset_then_final_epsilon(ps, 0.1, final[:10], 1e-5)
