"""Randomized smoothing (Cohen, Rosenfeld & Kolter 2019): soundness and tightness of CERTIFY on a
linear classifier, PREDICT's error rate, the comparison with PixelDP's bound on the same
Gaussian-input model, and the trial wiring (config key ``certifier``, metrics, Parquet table).

A two-class linear classifier f(x) = [w.x + b > 0 ? 0 : 1] under Gaussian input noise of std
sigma has P(f(x + eps) = true class) = Phi(d / sigma) with d the distance of x to the hyperplane,
so the smoothed classifier's exact robust radius is d: CERTIFY's radius sigma Phi^{-1}(p_A_lower)
must stay below d except with probability alpha, and tends to d as n grows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from scipy.stats import binom

from dpmech.robustness import smoothing
from dpmech.robustness.certification import certify as pixeldp_certify
from dpmech.robustness.noise_layer import NoiseLayer

SIGMA = 0.25


pytestmark = pytest.mark.usefixtures("one_thread")


class Linear2(nn.Module):
    """Logits [m, -m] with m = w.x + b: class 0 on the positive side of the hyperplane."""

    def __init__(self, w: torch.Tensor, b: float):
        super().__init__()
        self.lin = nn.Linear(w.numel(), 2)
        with torch.no_grad():
            self.lin.weight.copy_(torch.stack([w, -w]) / 2)
            self.lin.bias.copy_(torch.tensor([b, -b]) / 2)

    def forward(self, x):
        return self.lin(x)


def _setup(seed: int = 0, d: int = 8, b: float = 0.1):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(d, generator=gen)
    return Linear2(w, b), w, b


def _at_distance(w, b, dist: float, copies: int, seed: int = 1):
    """``copies`` copies of one point at signed distance ``dist`` from the hyperplane (class 0
    side for dist > 0), and its true class."""
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.rand(w.numel(), generator=gen) * 2 - 1
    u = w / w.norm()
    x = x0 - ((x0 @ w + b) / w.norm()) * u + dist * u  # project onto the plane, step out
    return x.repeat(copies, 1), 0 if dist > 0 else 1


def _bound(trials: int, alpha: float) -> float:
    """Failures allowed in ``trials`` runs when each fails with probability <= alpha (the
    0.999 quantile of Binomial(trials, alpha): a sound certifier passes with prob >= 0.999)."""
    return binom.ppf(0.999, trials, alpha)


# ----------------------------------------------------------------------------- CERTIFY


@pytest.mark.parametrize("dist", [0.02, 0.1, 0.3])
def test_certified_radius_never_exceeds_the_true_distance(dist, monkeypatch):
    model, w, b = _setup()
    runs, alpha = 2000, 0.05
    x, cls = _at_distance(w, b, dist, runs)
    gen = torch.Generator().manual_seed(2)
    res = smoothing.certify(model, SIGMA, x, torch.full((runs,), cls), n0=50, n=500, alpha=alpha, generator=gen)
    fails = ((~res.abstained) & ((res.prediction != cls) | (res.radius > dist))).sum()
    assert fails <= _bound(runs, alpha)
    assert (~res.abstained).mean() > 0.5 or dist < 0.05  # not vacuous where p_A is far from 1/2
    assert np.all(res.radius[res.abstained] == 0)

    # negative control: sampling with sigma / 2 while claiming sigma certifies beyond the true
    # distance, and the same count of failures catches it.
    real = smoothing.sample_noise

    def too_little_noise(base, x, num, sigma, **kw):
        return real(base, x, num, sigma / 2, **kw)

    monkeypatch.setattr(smoothing, "sample_noise", too_little_noise)
    bad = smoothing.certify(model, SIGMA, x, torch.full((runs,), cls), n0=50, n=500, alpha=alpha,
                            generator=torch.Generator().manual_seed(2))
    bad_fails = ((~bad.abstained) & ((bad.prediction != cls) | (bad.radius > dist))).sum()
    assert bad_fails > _bound(runs, alpha)


def _radius_convergence(model, x, cls, dist) -> tuple[bool, list[float]]:
    """(every answer right and below the true distance, mean gap to it) at n = 10^3, 10^4, 10^5."""
    gen = torch.Generator().manual_seed(3)
    sound, gaps = True, []
    for n in (1_000, 10_000, 100_000):
        res = smoothing.certify(model, SIGMA, x, n0=100, n=n, alpha=0.001, generator=gen)
        sound &= bool(np.all(res.prediction == cls) and np.all(res.radius <= dist))
        gaps.append(float(np.mean(dist - res.radius)))
    return sound, gaps


def test_certified_radius_approaches_the_distance_as_n_grows(monkeypatch):
    model, w, b = _setup()
    dist, copies = 0.1, 10
    x, cls = _at_distance(w, b, dist, copies)
    sound, gaps = _radius_convergence(model, x, cls, dist)
    assert sound
    assert gaps[0] > gaps[1] > gaps[2]
    assert gaps[2] < 0.05 * dist
    # negative control: the radius of the point estimate nA / n instead of the lower confidence bound
    # exceeds the true distance on about half the copies at every n, and the same check sees it
    monkeypatch.setattr(smoothing, "lower_confidence_bound", lambda count, n, alpha: np.asarray(count) / n)
    bad_sound, bad_gaps = _radius_convergence(model, x, cls, dist)
    assert not bad_sound and min(bad_gaps) < 0.01 * dist


def test_certify_abstains_at_a_tie():
    model, w, b = _setup()
    runs, alpha = 500, 0.01
    x, _ = _at_distance(w, b, 0.0, runs)  # on the hyperplane: p_A = 1/2
    res = smoothing.certify(model, SIGMA, x, n0=50, n=1000, alpha=alpha, generator=torch.Generator().manual_seed(4))
    assert (~res.abstained).sum() <= _bound(runs, alpha)
    assert np.all(res.radius[res.abstained] == 0)
    # negative control: certifying with the point estimate nA / n instead of the lower bound
    # claims a class with p > 1/2 on about half the runs.
    naive = res.count_a / res.n > 0.5
    assert naive.sum() > _bound(runs, alpha)


def test_max_radius_is_what_certify_returns_when_every_draw_agrees():
    """Far from the hyperplane every draw is class 0: CERTIFY returns exactly the reach max_radius(sigma, n,
    alpha), and no input gets more; a point the noise sometimes crosses gets less."""
    model, w, b = _setup()
    gen = torch.Generator().manual_seed(5)
    n, alpha = 2000, 0.001
    reach = smoothing.max_radius(SIGMA, n, alpha)
    far, y = _at_distance(w, b, 50 * SIGMA, 3)
    res = smoothing.certify(model, SIGMA, far, [y] * 3, n0=50, n=n, alpha=alpha, generator=gen)
    assert np.all(res.count_a == n) and np.allclose(res.radius, reach, rtol=1e-12)
    # its closed form: p_A_lower = alpha^(1/n) (Clopper-Pearson at count n)
    from scipy.stats import norm
    assert reach == pytest.approx(SIGMA * norm.ppf(alpha ** (1 / n)), rel=1e-9)
    near, y = _at_distance(w, b, 1.5 * SIGMA, 3)
    res = smoothing.certify(model, SIGMA, near, [y] * 3, n0=50, n=n, alpha=alpha, generator=gen)
    assert np.all(res.count_a < n) and np.all(res.radius < reach)
    # the benchmark's figure: sigma_01 0.5 at N 10,000 reaches 1.60 in the [0, 1] domain; N 100,000 reaches 1.91
    assert round(smoothing.max_radius(0.5, 10_000), 2) == 1.60 and round(smoothing.max_radius(0.5, 100_000), 2) == 1.91
    with pytest.raises(ValueError, match="sigma"):
        smoothing.max_radius(0.0, n)


def test_count_from_radius_inverts_certify_and_projected_radius_keeps_its_own_n():
    """The count a radius came from is recovered exactly (every count from the threshold to n, at N 10,000 and
    100,000, from radii rounded as the benchmark records them); projecting to the same n returns the radius."""
    from scipy.stats import norm

    for n in (10_000, 100_000):
        counts = np.arange(n // 2 + 1, n + 1, 7 if n == 10_000 else 53)
        radius = np.round(0.5 * norm.ppf(smoothing.lower_confidence_bound(counts, n, 0.001)), 5)
        ok = radius > 0
        np.testing.assert_array_equal(smoothing.count_from_radius(radius[ok], n, 0.5), counts[ok])
        np.testing.assert_allclose(smoothing.projected_radius(counts[ok], n, n, 0.5), radius[ok], atol=1e-5)
    assert smoothing.count_from_radius([0.0], 10_000, 0.5)[0] == -1             # an abstention: count unknown
    assert smoothing.projected_radius([-1], 10_000, 100_000, 0.5)[0] == 0.0     # stays one
    # every draw c_A at N 10,000 projects to N 100,000's reach
    assert smoothing.projected_radius([10_000], 10_000, 100_000, 0.5)[0] == pytest.approx(
        smoothing.max_radius(0.5, 100_000))
    with pytest.raises(ValueError, match="^count_a must be at most n=10"):
        smoothing.projected_radius([11], 10, 100, 0.5)


def test_projected_radius_foretells_the_larger_n_certified_accuracy():
    """Statistically: 4,000 images whose c_A probabilities lie near N 10,000's reach at sigma 0.5 (r 1.5 needs
    p_A_lower >= Phi(3)); each drawn at N 10,000 and, independently, at N 100,000. The certified accuracy at
    r 1.5 projected from the N 10,000 counts is within 3 points of the one CERTIFY gives at N 100,000 (a stress
    case: every image near the threshold, where the plug-in is measured 2.4 points optimistic over seeds 0-5),
    under a fifth of the N 10,000 figure's own error; that figure (the negative control: what a comparison
    without the projection uses) is more than 10 points below."""
    from scipy.stats import norm

    rng = np.random.default_rng(11)
    p = 1.0 - rng.uniform(0.0, 0.004, 4000)
    small, big = rng.binomial(10_000, p), rng.binomial(100_000, p)

    def cert_at(radius):
        return 100.0 * float(np.mean(radius >= 1.5))

    measured = cert_at(0.5 * norm.ppf(smoothing.lower_confidence_bound(big, 100_000, 0.001)))
    projected = cert_at(smoothing.projected_radius(small, 10_000, 100_000, 0.5))
    unprojected = cert_at(0.5 * norm.ppf(smoothing.lower_confidence_bound(small, 10_000, 0.001)))
    assert abs(projected - measured) <= 3.0
    assert abs(projected - measured) < 0.2 * abs(unprojected - measured)
    assert measured - unprojected > 10.0


def test_lower_confidence_bound_is_one_sided_clopper_pearson():
    from scipy.stats import beta

    k, n, alpha = np.array([0, 3, 50, 100]), 100, 0.01
    lo = smoothing.lower_confidence_bound(k, n, alpha)
    assert lo[0] == 0.0
    np.testing.assert_allclose(lo[1:], beta.ppf(alpha, k[1:], n - k[1:] + 1), rtol=1e-10)
    # coverage: the true p is below the bound in at most alpha of 10^4 binomials
    rng = np.random.default_rng(5)
    p, trials = 0.7, 10_000
    k = rng.binomial(n, p, trials)
    miss = (smoothing.lower_confidence_bound(k, n, 0.05) > p).sum()
    assert miss <= _bound(trials, 0.05)
    # negative control: the same coverage check on the bound at 4 alpha (the lower end of the
    # two-sided interval at 1 - 8 alpha) misses far more often than alpha allows
    bad = (smoothing.lower_confidence_bound(k, n, 0.2) > p).sum()
    assert bad > 2 * _bound(trials, 0.05)


# ----------------------------------------------------------------------------- PREDICT


def test_predict_abstains_at_a_tie_and_is_right_far_from_the_boundary():
    model, w, b = _setup()
    runs, alpha = 500, 0.01
    x, _ = _at_distance(w, b, 0.0, runs)
    tie = smoothing.predict(model, SIGMA, x, n=1000, alpha=alpha, generator=torch.Generator().manual_seed(6))
    assert (tie != smoothing.ABSTAIN).sum() <= _bound(runs, alpha)
    # negative control: the same check on PREDICT run at a level 50 times too loose answers at
    # the tie on about half the runs
    loose = smoothing.predict(model, SIGMA, x, n=1000, alpha=0.5, generator=torch.Generator().manual_seed(6))
    assert (loose != smoothing.ABSTAIN).sum() > 10 * _bound(runs, alpha)
    for dist in (0.5, -0.5):
        far, cls = _at_distance(w, b, dist, 50)
        out = smoothing.predict(model, SIGMA, far, n=200, alpha=0.001, generator=torch.Generator().manual_seed(7))
        assert np.all(out == cls)


def test_predict_returns_a_wrong_class_with_probability_at_most_alpha():
    """Proposition 1: P(PREDICT returns a class != g(x)) <= alpha, here close to the boundary
    (p_A = Phi(0.04) ~ 0.516) where the two counts are close and errors are possible."""
    model, w, b = _setup()
    runs, alpha, n = 4000, 0.1, 200
    x, cls = _at_distance(w, b, 0.01, runs)
    out = smoothing.predict(model, SIGMA, x, n=n, alpha=alpha, generator=torch.Generator().manual_seed(8))
    wrong = ((out != smoothing.ABSTAIN) & (out != cls)).sum()
    assert wrong <= _bound(runs, alpha)
    assert (out == cls).sum() > 0  # it does answer sometimes
    # negative control: a majority vote without the test errs on ~40% of the runs
    counts = smoothing.sample_noise(model, x, n, SIGMA, generator=torch.Generator().manual_seed(8))
    assert (counts.argmax(1) != cls).sum() > _bound(runs, alpha)


def _patched_counts(monkeypatch, tables):
    """Make SAMPLEUNDERNOISE return the given count tables, one per call, in order."""
    calls = iter(tables)
    monkeypatch.setattr(smoothing, "sample_noise", lambda *a, **kw: next(calls))


def _boundary_counts(n: int, alpha: float) -> np.ndarray:
    """Rows [nA, nB, nC] (nA >= nB >= nC) around PREDICT's decision boundary: for several nA + nB,
    every nA whose two-sided binomial p-value lies between alpha / 4 and 4 alpha (so some fall in
    (alpha, 2 alpha]), plus ties and a unanimous row."""
    from scipy.stats import binomtest

    rows = []
    for total in (20, 57, 200, 513, n):
        for na in range((total + 1) // 2, total + 1):
            p = binomtest(na, total, 0.5).pvalue
            if alpha / 4 <= p <= 4 * alpha:
                rows.append([na, total - na, (total - na) // 2])  # a third class below c_B
    rows += [[n // 2, n // 2, 0], [300, 300, 100], [n, 0, 0]]
    return np.array(rows, dtype=np.int64)


def test_predict_decision_is_exactly_the_binomial_test_at_alpha(monkeypatch):
    """PREDICT answers c_A iff BINOMPVALUE(nA, nA + nB, 1/2) <= alpha (Cohen et al. 2019, PREDICT),
    row by row against scipy's exact two-sided binomtest on the same counts, including counts
    whose p-value lies in (alpha, 2 alpha], where a frequency test cannot tell the difference."""
    from scipy.stats import binomtest

    n, alpha = 1000, 0.01
    rows = _boundary_counts(n, alpha)
    for order in ([0, 1, 2], [2, 0, 1]):   # c_A anywhere among the classes
        counts = rows[:, order]
        c_a = order.index(0)
        expected = np.array([c_a if binomtest(int(r[0]), int(r[0] + r[1]), 0.5).pvalue <= alpha else smoothing.ABSTAIN
                             for r in rows])
        _patched_counts(monkeypatch, [counts])
        out = smoothing.predict(nn.Identity(), SIGMA, torch.zeros(len(rows), 3), n=n, alpha=alpha,
                                generator=torch.Generator())
        np.testing.assert_array_equal(out, expected)
    pvalues = np.array([binomtest(int(r[0]), int(r[0] + r[1]), 0.5).pvalue for r in rows])
    between = (pvalues > alpha) & (pvalues <= 2 * alpha)
    assert between.sum() >= 5 and (pvalues <= alpha).sum() >= 5  # the boundary is exercised
    # negative control: the rule at 2 alpha answers on those rows, which the exact comparison sees
    _patched_counts(monkeypatch, [rows])
    loose = smoothing.predict(nn.Identity(), SIGMA, torch.zeros(len(rows), 3), n=n, alpha=2 * alpha,
                              generator=torch.Generator())
    assert np.all(loose[between] == 0)


def test_certify_decision_and_radius_are_exactly_the_algorithm_box(monkeypatch):
    """CERTIFY on given counts: c_A from the selection counts, p_A_lower the one-sided Clopper-Pearson
    bound beta.ppf(alpha, nA, n - nA + 1) on the estimation counts, abstain iff p_A_lower <= 1/2,
    radius sigma * Phi^-1(p_A_lower), all checked against scipy directly."""
    from scipy.stats import beta, norm

    n, n0, alpha = 500, 20, 0.01
    na = np.array([0, 100, 250, 270, 280, 290, 300, 400, 499, 500])
    counts = np.stack([n - na, na], axis=1)              # class 1 gets nA of the n draws
    counts0 = np.tile([[3, 17]], (len(na), 1))          # the selection picks class 1
    _patched_counts(monkeypatch, [counts0, counts])
    res = smoothing.certify(nn.Identity(), SIGMA, torch.zeros(len(na), 2), n0=n0, n=n, alpha=alpha,
                            generator=torch.Generator())
    lower = np.where(na > 0, beta.ppf(alpha, na, n - na + 1), 0.0)
    np.testing.assert_allclose(res.p_a_lower, lower, rtol=1e-9, atol=1e-12)
    certified = lower > 0.5
    assert 0 < certified.sum() < len(na)
    np.testing.assert_array_equal(res.prediction, np.where(certified, 1, smoothing.ABSTAIN))
    np.testing.assert_allclose(res.radius, np.where(certified, SIGMA * norm.ppf(np.clip(lower, 0.5, 1)), 0.0),
                               rtol=1e-9, atol=0)
    np.testing.assert_array_equal(res.count_a, na)


# ----------------------------------------------------------------------------- vs PixelDP


class LinearPixelDP(nn.Module):
    """The same linear classifier as a PixelDP network with its Gaussian noise on the input."""

    norm = "l2"

    def __init__(self, base: nn.Module, sigma: float):
        super().__init__()
        self.base = base
        self.noise = NoiseLayer(sigma, "l2", seed=9)

    def pre_noise(self, x):
        return x

    def post_noise(self, h):
        return self.base(h)

    def forward(self, x):
        return self.post_noise(self.noise(x))

    def sensitivity_exact(self):
        return 1.0


def test_smoothing_certifies_at_least_the_pixeldp_bound_for_the_same_budget():
    model, w, b = _setup()
    gen = torch.Generator().manual_seed(10)
    x = torch.rand(300, w.numel(), generator=gen) * 2 - 1
    y = ((x @ w + b) <= 0).long()
    dist = ((x @ w + b).abs() / w.norm()).numpy()
    budget, alpha = 2000, 0.05  # the same failure probability alpha
    pdp = pixeldp_certify(LinearPixelDP(model, SIGMA), x, y, n=budget, alpha=alpha, bounds="argmax")
    sm = smoothing.certify(model, SIGMA, x, y, n0=100, n=budget - 100, alpha=alpha, generator=gen)
    both = (pdp.certified_size > 0) & (sm.radius > 0)
    assert both.sum() > 100
    assert np.mean(sm.radius[both] >= pdp.certified_size[both]) > 0.95
    # and it is still sound: below the true distance wherever the class is right
    ok = sm.correct
    assert np.mean(sm.radius[ok] <= dist[ok]) > 1 - 3 * alpha
    # negative control: the same soundness check on a certifier that samples sigma / 2 while
    # claiming sigma (radii about twice the truth) fails by a wide margin
    real = smoothing.sample_noise
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(smoothing, "sample_noise", lambda base, x, num, sigma, **kw: real(base, x, num, sigma / 2, **kw))
        bad = smoothing.certify(model, SIGMA, x, y, n0=100, n=budget - 100, alpha=alpha,
                                generator=torch.Generator().manual_seed(10))
    bad_ok = bad.correct & (bad.radius > 0)
    assert np.mean(bad.radius[bad_ok] <= dist[bad_ok]) < 1 - 6 * alpha


# ----------------------------------------------------------------------------- the trial wiring


@pytest.fixture(scope="module")
def pixeldp_input_noise():
    """A PixelDP CNN with Gaussian noise on its input, trained one epoch on 512 MNIST images."""
    from dpmech.datasets.splits import load_splits
    from trainables.pixeldp import PixelDPTrialConfig
    from trainables.pixeldp import PixelDPMechanism

    torch.manual_seed(0)
    cfg = PixelDPTrialConfig(noise_after=0, certifier="both", epochs=1, batch_size=64, lr=3e-3, certify_images=10,
                             certify_n=100, smoothing_n0=20, smoothing_alpha=0.01, certify_sizes=[0.0, 0.1, 0.3])
    train, test = load_splits("mnist", train_size=512, test_size=32, seed=0)
    mech = PixelDPMechanism(cfg, *train.tensors, torch.device("cpu"))
    mech.train_epoch()
    return mech, cfg, test.tensors


def test_pixeldp_base_plus_gaussian_input_noise_is_its_random_forward_pass(pixeldp_input_noise):
    mech, _, (xt, _) = pixeldp_input_noise
    base, sigma = mech.smoothing_classifier()
    noise = mech.model.noise
    assert sigma == noise.scale and noise.ramp == 1.0 and noise.norm == "l2"
    x = xt[:8]
    state = noise.get_rng_state(torch.device("cpu"))
    z = noise.sample(x)
    noise.set_rng_state(torch.device("cpu"), state)
    mech.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(mech.model(x), base(x + z), rtol=0, atol=0)
        # negative control: the base alone (no noise) is a different function
        assert not torch.allclose(mech.model(x), base(x))


def test_smoothing_classifier_only_for_gaussian_noise_on_the_input():
    from trainables.pixeldp import PixelDPTrialConfig
    from trainables.pixeldp import PixelDPMechanism

    x, y = torch.zeros(4, 1, 28, 28), torch.zeros(4, dtype=torch.long)
    for kw in ({"noise_after": 1}, {"noise_after": 0, "norm": "l1"}):
        assert PixelDPMechanism(PixelDPTrialConfig(**kw), x, y, torch.device("cpu")).smoothing_classifier() is None


def test_smoothing_on_the_pixeldp_cnn_certifies_at_least_its_bound(pixeldp_input_noise):
    mech, _, (xt, yt) = pixeldp_input_noise
    base, sigma = mech.smoothing_classifier()
    x, y = xt[:12], yt[:12]
    pdp = pixeldp_certify(mech.model, x, y, n=300, alpha=0.05)
    sm = smoothing.certify(base, sigma, x, y, n0=20, n=280, alpha=0.05, generator=torch.Generator().manual_seed(11))
    both = (pdp.certified_size > 0) & (sm.radius > 0)
    assert both.sum() >= 4
    assert np.mean(sm.radius[both] >= pdp.certified_size[both]) >= 0.9


def test_evaluate_reports_both_certifiers_and_logs_the_smoothing_table(pixeldp_input_noise, tmp_path):
    import pyarrow.parquet as pq

    from sweeps.report.data import certified_accuracy_at
    from trainables.artifacts import log_final_artifacts
    from trainables.runtime import evaluate

    mech, cfg, (xt, yt) = pixeldp_input_noise
    final = evaluate(mech, cfg, xt, yt)
    m = final["metrics"]
    for key in ("acc_clean", "cert_acc_0.1", "acc_clean_expected", "robustness_epsilon", "smooth_cert_acc_0", "smooth_cert_acc_0.1",
                "smooth_cert_acc_0.3", "smooth_acc_clean", "smooth_abstain_rate", "smooth_cert_abstain_rate"):
        assert key in m, key
    res = final["smoothing"]
    assert final["certification"] is not None and len(res.radius) == cfg.certify_images
    assert m["certified_images"] == cfg.certify_images
    # fewer evaluation images than certify_images (the default 500 on a small test split): the metric
    # says how many were certified, not the configured number
    fewer = evaluate(mech, cfg.model_copy(update={"certifier": "default"}), xt[:4], yt[:4])["metrics"]
    assert fewer["certified_images"] == 4 and cfg.certify_images > 4
    assert res.sigma == mech.model.noise.scale and res.n == cfg.certify_n and res.n0 == cfg.smoothing_n0
    assert m["smooth_cert_acc_0"] == pytest.approx(np.mean(res.correct & ~res.abstained))
    assert m["smooth_cert_acc_0"] >= m["smooth_cert_acc_0.1"] >= m["smooth_cert_acc_0.3"]

    class Tracker:
        run_id = "0123456789abcdef"
        logged: list = []

        def log_artifact(self, path, artifact_dir):
            dest = tmp_path / artifact_dir
            dest.mkdir(exist_ok=True)
            dest.joinpath(path.rsplit("/", 1)[-1]).write_bytes(open(path, "rb").read())

    log_final_artifacts(Tracker(), mech, final, cfg)
    table = pq.read_table(tmp_path / "certification" / "smoothing.parquet")
    assert {"index", "label", "prediction", "abstained", "p_a_lower", "radius", "smoothed_prediction"} <= set(
        table.column_names)
    assert table.schema.metadata[b"dpsweep.sigma"] == str(res.sigma).encode()
    assert (tmp_path / "certification" / "certification.parquet").exists()
    assert (tmp_path / "certification" / "smooth_cert_acc.png").stat().st_size > 1000
    # the report reads the table back to the same certified accuracy
    acc = certified_accuracy_at(table.to_pandas(), "smoothing", [0.0, 0.1, 0.3])
    assert list(acc) == pytest.approx([m["smooth_cert_acc_0"], m["smooth_cert_acc_0.1"], m["smooth_cert_acc_0.3"]])


def test_certifier_smoothing_refused_without_gaussian_input_noise():
    from trainables.config import CommonConfig
    from trainables.pixeldp import PixelDPTrialConfig
    from trainables.runtime import run_trial, validate_config

    # PixelDP with the noise after the first convolution: refused when the config is validated
    with pytest.raises(ValueError, match="certifier.*noise_after: 0"):
        validate_config({"certifier": "smoothing", "noise_after": 1}, PixelDPTrialConfig)
    validate_config({"certifier": "both", "noise_after": 0}, PixelDPTrialConfig)

    # a mechanism without smoothing_classifier(): refused at the start of the trial, before training
    class Tiny(CommonConfig):
        epochs: int = 1

    class NoSmoothing:
        def __init__(self, cfg, x, y, device):
            pass

        def train_epoch(self):
            raise AssertionError("must fail before training")

    config = {"certifier": "smoothing", "train_size": 16, "test_size": 16}
    with pytest.raises(ValueError, match=r"config\.certifier: 'smoothing' needs a model with Gaussian noise.*'tiny'"):
        run_trial(config, Tiny, NoSmoothing, "tiny")


def test_bad_arguments_name_the_field():
    model, _, _ = _setup()
    x = torch.zeros(2, 8)
    gen = torch.Generator()
    with pytest.raises(ValueError, match="^sigma must be > 0"):
        smoothing.certify(model, 0.0, x, generator=gen)
    with pytest.raises(ValueError, match="^alpha must be in the open interval"):
        smoothing.predict(model, SIGMA, x, alpha=1.0, generator=gen)
    with pytest.raises(ValueError, match="^n0 must be >= 1"):
        smoothing.certify(model, SIGMA, x, n0=0, generator=gen)
    with pytest.raises(ValueError, match="^generator must be a torch.Generator"):
        smoothing.sample_noise(model, x, 10, SIGMA, generator=0)
    with pytest.raises(ValueError, match=r"^y must have shape \[2\]"):
        smoothing.certify(model, SIGMA, x, torch.zeros(3), generator=gen)
