"""Certification: confidence-bound coverage, soundness on a linear classifier, monotonicity."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from dpmech.robustness.certification import (MonteCarloEstimate, bernstein_bounds, certified_accuracy, certified_size,
                                             certify, clopper_pearson, hoeffding_bounds, max_epsilon, robust)
from dpmech.robustness.noise_layer import NoiseLayer

TRIALS = 10_000


def _slack(alpha: float) -> float:
    # 3 standard deviations of the miss rate of TRIALS independent intervals.
    return 3 * math.sqrt(alpha * (1 - alpha) / TRIALS)


@pytest.mark.parametrize("p", [0.02, 0.3, 0.5, 0.93])
def test_clopper_pearson_coverage(p):
    rng = np.random.default_rng(7)
    n, alpha = 200, 0.05
    k = rng.binomial(n, p, size=TRIALS)
    lo, hi = clopper_pearson(k, n, alpha)
    miss = np.mean((p < lo) | (p > hi))
    assert miss <= alpha + _slack(alpha)
    # negative control: a too-narrow interval (Wald with z = 1) misses far more often than
    # alpha, so this coverage test can fail.
    phat = k / n
    half = 1.0 * np.sqrt(phat * (1 - phat) / n)
    assert np.mean((p < phat - half) | (p > phat + half)) > alpha + _slack(alpha)


def _estimate_from_scores(scores: np.ndarray) -> MonteCarloEstimate:
    """scores: [trials, n, K] softmax-like draws -> one MonteCarloEstimate over the trials."""
    n = scores.shape[1]
    counts = np.zeros((scores.shape[0], scores.shape[2]), dtype=np.int64)
    top = scores.argmax(axis=2)
    for kk in range(scores.shape[2]):
        counts[:, kk] = (top == kk).sum(axis=1)
    return MonteCarloEstimate(counts, scores.mean(axis=1), (scores**2).mean(axis=1), n)


def _joint_miss(lo: np.ndarray, hi: np.ndarray, truth: np.ndarray) -> float:
    """Fraction of trials in which some class's interval misses its true expectation."""
    return float(np.mean(((truth < lo) | (truth > hi)).any(axis=1)))


def _shrunk(lo: np.ndarray, hi: np.ndarray, mean: np.ndarray, factor: float):
    """The intervals [lo, hi] narrowed ``factor`` times around the sample mean (a wrong bound)."""
    return mean - (mean - lo) / factor, mean + (hi - mean) / factor


@pytest.mark.parametrize("bound_fn", [hoeffding_bounds, bernstein_bounds])
def test_score_bounds_cover_all_classes_jointly(bound_fn):
    rng = np.random.default_rng(11)
    eta, K, n, trials = 0.9, 3, 100, 2000
    # scores: a random softmax of Gaussian logits with known expectation (by a huge sample)
    logits_mean = np.array([1.0, 0.5, -0.5])
    def draw(size):
        z = logits_mean + rng.normal(0, 1.5, size=size + (K,))
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    truth = draw((400_000,)).mean(axis=0)
    est = _estimate_from_scores(draw((trials, n)))
    lo, hi = bound_fn(est, alpha=1 - eta)
    allowed = (1 - eta) + 3 * math.sqrt(0.1 * 0.9 / trials)
    assert _joint_miss(lo, hi, truth) <= allowed
    # the intervals are informative (not the trivial [0, 1])
    assert np.mean(hi - lo) < 0.5
    # negative control: the same check on a deliberately wrong bound, the Wald interval with z = 1
    # (mean +- one standard error; no Bonferroni), misses far more often than alpha. (Softmax scores
    # have far less variance than the [0, 1] range these bounds assume, so a halved Hoeffding width
    # still covers here: test_hoeffding_covers_bernoulli_half_scores_and_half_the_width_does_not.)
    se = np.sqrt(est.variance / n)
    bad = _joint_miss(est.mean - se, est.mean + se, truth)
    assert bad > 3 * allowed


def test_hoeffding_half_width_is_pinned():
    """mean +- sqrt(ln(2K / alpha) / (2n)) (PixelDP Sec. 3.4, Bonferroni over K classes), checked
    against numbers worked out by hand."""
    K, n = 10, 1000
    mean = np.full((1, K), 0.5)
    est = MonteCarloEstimate(np.zeros((1, K), dtype=np.int64) + 100, mean, mean**2, n)
    lo, hi = hoeffding_bounds(est, alpha=0.05)
    # ln(400) = 5.9914645; / 2000 = 0.0029957; sqrt = 0.0547335
    np.testing.assert_allclose(hi - 0.5, 0.0547335, rtol=1e-5)
    np.testing.assert_allclose(0.5 - lo, 0.0547335, rtol=1e-5)
    lo, hi = hoeffding_bounds(MonteCarloEstimate(est.counts[:, :2] * 5, mean[:, :2], mean[:, :2], n), alpha=0.01)
    # K = 2: ln(400) again, same width
    np.testing.assert_allclose(hi - 0.5, 0.0547335, rtol=1e-5)


def test_bernstein_half_width_is_pinned():
    """Maurer & Pontil (2009), Thm. 4 at a = alpha / (2K): sqrt(2 V ln(2/a) / n) + 7 ln(2/a) / (3 (n - 1)),
    V the unbiased sample variance; worked out by hand for V = 0.25 n / (n - 1)."""
    K, n = 10, 1000
    mean = np.full((1, K), 0.5)
    est = MonteCarloEstimate(np.zeros((1, K), dtype=np.int64) + 100, mean, mean.copy(), n)  # scores in {0, 1}
    lo, hi = bernstein_bounds(est, alpha=0.05)
    # ln(800) = 6.6846117; sqrt(2 * 0.2502503 * 6.6846117 / 1000) = 0.0578416; 7 * 6.6846117 / 2997 = 0.0156130
    np.testing.assert_allclose(hi - 0.5, 0.0734546, rtol=1e-5)
    np.testing.assert_allclose(0.5 - lo, 0.0734546, rtol=1e-5)


def test_argmax_bounds_are_clopper_pearson_at_alpha_over_k_and_cover_jointly():
    """Each class's interval is the two-sided Clopper-Pearson interval at level 1 - alpha / K
    (Bonferroni): pinned against scipy's beta quantiles, and jointly covering the K true argmax
    probabilities of 10,000 multinomial count vectors; the same intervals at level 1 - alpha each
    (no Bonferroni, the control) miss jointly far more often than alpha."""
    from scipy.stats import beta

    from dpmech.robustness.certification import argmax_bounds

    rng = np.random.default_rng(13)
    K, n, alpha, trials = 10, 200, 0.05, 10_000
    p = np.array([0.3, 0.2, 0.1, 0.1, 0.08, 0.07, 0.05, 0.05, 0.03, 0.02])
    counts = rng.multinomial(n, p, size=trials)
    lo, hi = argmax_bounds(counts, alpha=alpha)
    a = alpha / K
    np.testing.assert_allclose(lo[:50], np.where(counts[:50] > 0, beta.ppf(a / 2, counts[:50], n - counts[:50] + 1), 0),
                               rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(hi[:50], np.where(counts[:50] < n, beta.ppf(1 - a / 2, counts[:50] + 1, n - counts[:50]),
                                                 1), rtol=1e-9, atol=1e-12)
    allowed = alpha + _slack(alpha)
    assert _joint_miss(lo, hi, p) <= allowed
    bad_lo, bad_hi = clopper_pearson(counts, n, alpha)
    assert _joint_miss(bad_lo, bad_hi, p) > 3 * allowed


def test_hoeffding_covers_bernoulli_half_scores_and_half_the_width_does_not():
    """Scores that are Bernoulli(1/2) (all their variance at the edges of [0, 1]) are where
    Hoeffding is nearly tight: the bounds cover every class jointly with probability >= 1 - alpha,
    and the same bounds with half their width (the negative control) miss far more than alpha."""
    rng = np.random.default_rng(12)
    K, n, alpha, trials = 3, 100, 0.1, 20_000
    counts = rng.binomial(n, 0.5, size=(trials, K))       # K independent Bernoulli(1/2) score streams
    mean = counts / n
    est = MonteCarloEstimate(counts, mean, mean, n)       # scores in {0, 1}: E[s^2] = E[s]
    lo, hi = hoeffding_bounds(est, alpha=alpha)
    truth = np.full(K, 0.5)
    allowed = alpha + 3 * math.sqrt(alpha * (1 - alpha) / trials)
    assert _joint_miss(lo, hi, truth) <= allowed
    # normal approximation: per class P(|Z| > 1.43) = 0.15, jointly 1 - 0.85^3 = 0.39
    assert _joint_miss(*_shrunk(lo, hi, mean, 2.0), truth) > 2.5 * allowed


# ----------------------------------------------------------------- the PixelDP test and the size


def test_robust_condition_is_proposition_1():
    assert robust(0.9, 0.05, 1.0, 1e-5)
    lb, ub, eps, d = 0.6, 0.2, 0.5, 0.01
    assert robust(lb, ub, eps, d) == (lb > math.exp(2 * eps) * ub + (1 + math.exp(eps)) * d)
    assert not robust(0.5, 0.5, 0.01, 0.0)


def test_max_epsilon_solves_the_condition():
    lb, ub, d = np.array([0.8]), np.array([0.1]), 1e-3
    eps = max_epsilon(lb, ub, d)[0]
    assert robust(lb, ub, eps * 0.999, d)[0] and not robust(lb, ub, eps * 1.001, d)[0]


def test_certified_size_zero_when_tied_and_grows_with_margin():
    tied = certified_size(np.array([0.45]), np.array([0.46]), noise_scale=0.3, sensitivity=1.0, norm="l2")
    assert tied[0] == 0.0
    margins = np.linspace(0.0, 0.9, 19)
    lb = 0.5 + margins / 2
    ub = 0.5 - margins / 2
    for norm in ("l2", "l1"):
        sizes = certified_size(lb, ub, noise_scale=0.3, sensitivity=1.0, norm=norm)
        assert sizes[0] == 0.0
        assert np.all(np.diff(sizes) >= 0) and sizes[-1] > sizes[1] > 0


def test_certified_size_scales_with_noise_and_sensitivity():
    lb, ub = np.array([0.9]), np.array([0.05])
    base = certified_size(lb, ub, noise_scale=0.2, sensitivity=1.0, norm="l2")[0]
    assert certified_size(lb, ub, noise_scale=0.4, sensitivity=1.0, norm="l2")[0] == pytest.approx(2 * base)
    assert certified_size(lb, ub, noise_scale=0.2, sensitivity=0.5, norm="l2")[0] == pytest.approx(2 * base)


class LinearNoisy(nn.Module):
    """Two-class linear classifier with Gaussian noise on its input (PixelDP, noise_after=0)."""

    norm = "l2"

    def __init__(self, w: torch.Tensor, b: float, sigma: float):
        super().__init__()
        self.noise = NoiseLayer(sigma, "l2", seed=5)
        self.lin = nn.Linear(w.numel(), 2)
        with torch.no_grad():
            self.lin.weight.copy_(torch.stack([w, torch.zeros_like(w)]))
            self.lin.bias.copy_(torch.tensor([b, 0.0]))

    def pre_noise(self, x):
        return x

    def post_noise(self, h):
        return self.lin(h)

    def forward(self, x):
        return self.post_noise(self.noise(x))

    def sensitivity_exact(self):
        return 1.0


def test_certified_size_never_exceeds_the_true_radius_of_a_linear_classifier():
    gen = torch.Generator().manual_seed(0)
    d = 8
    w = torch.randn(d, generator=gen)
    model = LinearNoisy(w, 0.1, sigma=0.3)
    x = torch.rand(300, d, generator=gen) * 2 - 1
    margin = (x @ w + 0.1)
    base_pred = (margin <= 0).long()  # class 0 when w.x + b > 0
    radius = (margin.abs() / w.norm()).numpy()
    res = certify(model, x, base_pred, n=1000, alpha=0.05, bounds="argmax")
    agree = res.prediction == base_pred.numpy()
    assert agree.mean() > 0.95
    assert (res.certified_size > 0).mean() > 0.3  # the test is not vacuous
    assert np.all(res.certified_size[agree] <= radius[agree] + 1e-9)
    # negative control: claiming a 10x smaller pre-noise sensitivity than the truth certifies
    # sizes beyond the true radius, which this test catches.
    bad = certify(model, x, base_pred, n=1000, alpha=0.05, bounds="argmax", sensitivity=0.1)
    assert np.any(bad.certified_size[agree] > radius[agree])


def test_l1_certified_size_is_the_laplace_formula():
    """Laplace noise of scale b, delta' = 0: Prop. 1 holds for eps' < ln(lb / ub) / 2, and the noise is
    eps'-DP against l1 attacks of size L' = b eps' / Delta (Lecuyer et al. 2018, Sec. 3.2)."""
    size = certified_size(np.array([0.9, 0.4]), np.array([0.05, 0.5]), noise_scale=0.3, sensitivity=1.0, norm="l1")
    # 0.3 * ln(18) / 2 = 0.3 * 2.8903718 / 2 = 0.4335558; lb < ub: nothing certified
    np.testing.assert_allclose(size, [0.4335558, 0.0], rtol=1e-6)
    half = certified_size(np.array([0.9]), np.array([0.05]), noise_scale=0.3, sensitivity=0.5, norm="l1")
    np.testing.assert_allclose(half, [0.8671115], rtol=1e-6)


class LinearLaplace(LinearNoisy):
    """The two-class linear classifier with Laplace noise on its input (PixelDP, l1 attacks)."""

    norm = "l1"

    def __init__(self, w: torch.Tensor, b: float, scale: float):
        super().__init__(w, b, scale)
        self.noise = NoiseLayer(scale, "l1", seed=6)


def test_l1_certified_size_never_exceeds_the_true_l1_radius():
    """With w = e_1 the expected-argmax classifier changes at w.x + b = 0, at l1 distance
    |w.x + b| / ||w||_inf from x. No certified l1 size exceeds it (except where the bounds fail);
    a sensitivity claimed at half the truth (sizes doubled, the control) exceeds it on most points."""
    from scipy.stats import binom

    d = 6
    w = torch.zeros(d)
    w[0] = 1.0
    model = LinearLaplace(w, 0.05, scale=0.2)
    gen = torch.Generator().manual_seed(7)
    x = torch.rand(300, d, generator=gen) * 2 - 1
    margin = x @ w + 0.05
    expected = (margin <= 0).long()
    radius = margin.abs().numpy() / w.abs().max().item()
    alpha = 0.05

    def violations(**kw):
        res = certify(model, x, expected, n=2000, alpha=alpha, bounds="argmax", **kw)
        certified = res.certified_size > 0
        assert certified.mean() > 0.5
        return int((certified & ((res.prediction != expected.numpy()) | (res.certified_size > radius))).sum())

    allowed = binom.ppf(0.999, len(x), alpha)
    assert violations() <= allowed
    assert violations(sensitivity=0.5) > 3 * allowed


def test_certified_accuracy_definition():
    gen = torch.Generator().manual_seed(1)
    model = LinearNoisy(torch.ones(4), 0.0, sigma=0.2)
    x = torch.rand(50, 4, generator=gen) * 2 - 1
    y = (x.sum(1) <= 0).long()
    res = certify(model, x, y, n=200)
    acc = certified_accuracy(res, [0.0, 0.05, 0.1])
    for t, a in acc.items():
        expect = np.mean(res.correct & (res.certified_size > 0) & (res.certified_size >= t))
        assert a == pytest.approx(expect)
    assert acc[0.0] >= acc[0.05] >= acc[0.1]


def test_certify_validates_input():
    model = LinearNoisy(torch.ones(4), 0.0, sigma=0.2)
    x = torch.zeros(3, 4)
    y = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="n must"):
        certify(model, x, y, n=0)
    with pytest.raises(ValueError, match="alpha"):
        certify(model, x, y, alpha=1.5)
    with pytest.raises(ValueError, match="bounds"):
        certify(model, x, y, bounds="wald")
    with pytest.raises(ValueError, match="y must"):
        certify(model, x, torch.zeros(2, dtype=torch.long))
    model.noise.ramp = 0.5
    with pytest.raises(ValueError, match="ramp"):
        certify(model, x, y)
    with pytest.raises(ValueError, match="alpha"):
        clopper_pearson(3, 10, 0.0)


def test_classic_calibration_never_certifies_more_and_matches_the_formula():
    rng = np.random.default_rng(5)
    lb = rng.uniform(0.3, 1.0, 500)
    ub = rng.uniform(0.0, 0.5, 500)
    kw = dict(noise_scale=0.25, sensitivity=1.0, norm="l2")
    analytic = certified_size(lb, ub, **kw)
    classic = certified_size(lb, ub, calibration="classic", **kw)
    assert np.all(classic <= analytic + 1e-12) and (classic > 0).any()
    # one example by hand: the best over the reference's grid (delta' = 0.001 .. 0.299) of
    # sigma eps' / sqrt(2 ln(1.25/delta')), eps' <= 1
    from dpmech.robustness.certification import DELTA_GRID_CLASSIC

    best = 0.0
    for d in DELTA_GRID_CLASSIC:
        e = min(max_epsilon(lb[:1], ub[:1], d)[0], 1.0)
        if e > 0:
            best = max(best, 0.25 * e / math.sqrt(2 * math.log(1.25 / d)))
    assert classic[0] == pytest.approx(best)
    with pytest.raises(ValueError, match="calibration"):
        certified_size(lb, ub, calibration="exact", **kw)
