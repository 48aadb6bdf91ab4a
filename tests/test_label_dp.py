"""Label DP (dpmech.label_dp.release, trainables.label_dp): exact and statistical privacy checks of the
label release, the release-once rule, keep probabilities, and a short training run."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dpmech.privacy.secret import NoiseKey
from dpmech.label_dp.trainer import LabelDPConfig, LabelDPTrainer
from dpmech.label_dp.release import (LabelRelease, clamp_round_keep_prob, clamp_round_log_matrix, laplace_argmax_keep_prob,
                                     laplace_one_hot, laplace_value, randomized_response, release_labels, rr_epsilon,
                                     rr_flip_prob, rr_keep_prob, rr_output_matrix)
from dpmech.privacy.mechanisms import laplace_scale
from tests.dp_histogram import delta_hat

K = 10
N_DP = 10**6
SLACK = 0.0025


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- randomized response: exact enumeration


def _max_log_ratio(m: np.ndarray) -> float:
    """Largest log P(o | y) / P(o | y') over every output o and every pair of labels y, y'."""
    logm = np.log(m)
    return float((logm.max(axis=0) - logm.min(axis=0)).max())


@pytest.mark.parametrize("k", [2, 3, 10])
@pytest.mark.parametrize("eps", [0.05, 0.5, 1.0, 3.0, 8.0])
def test_rr_output_ratios_are_bounded_by_e_eps_and_tight(k, eps):
    p = rr_keep_prob(eps, k)
    assert p == pytest.approx(math.exp(eps) / (math.exp(eps) + k - 1), rel=1e-12)
    m = rr_output_matrix(p, k)
    assert np.allclose(m.sum(axis=1), 1.0)
    ratio = _max_log_ratio(m)
    assert ratio <= eps + 1e-12
    assert ratio == pytest.approx(eps, abs=1e-9)  # RR spends exactly its budget
    assert rr_epsilon(rr_flip_prob(eps, k), k) == pytest.approx(eps, rel=1e-12)
    # negative control: keeping slightly more often than e^eps / (e^eps + K - 1) breaks the bound
    bad = _max_log_ratio(rr_output_matrix(p + 1e-3 * (1 - p), k))
    assert bad > eps + 1e-6


def test_rr_sampler_matches_its_output_matrix():
    """Chi-square of the sampler's output frequencies for y = 3 against row 3 of the matrix; the
    control (the matrix of a keep probability 0.01 higher) is rejected."""
    eps, n = 1.0, 200_000
    q = rr_flip_prob(eps, K)
    out = randomized_response(torch.full((n,), 3), K, q, torch.Generator().manual_seed(5))
    counts = np.bincount(out.numpy(), minlength=K)
    assert chisquare(counts, n * rr_output_matrix(1 - q, K)[3]).pvalue > 1e-3
    assert chisquare(counts, n * rr_output_matrix(1 - q + 0.01, K)[3]).pvalue < 1e-6


def test_rr_large_epsilon_stays_conservative():
    q = rr_flip_prob(100.0, K)
    assert 0 < q < 1e-40 and rr_epsilon(q, K) == pytest.approx(100.0, rel=1e-12)
    assert rr_epsilon(0.0, K) == math.inf


# ---------------------------------------------------------------- Laplace on one-hot labels: statistical DP test


def _privacy_loss_statistic(o: np.ndarray, a: int, b: int) -> np.ndarray:
    """T(o) = |o_a| - |o_a - 1| + |o_b - 1| - |o_b|: for noise of any scale s,
    log p_a(o) / p_b(o) = T(o) / s exactly (the other K - 2 coordinates have the same law under
    both labels and are independent of these two, so they cancel). T is the likelihood-ratio
    statistic, so binning it keeps the worst event {T > s * eps} and the test is tight."""
    # |x| - |x - 1| = clip(2x - 1, -1, 1), written so that the atoms at +-1 are exact (the plain
    # difference rounds differently for different magnitudes of x, i.e. differently under a and b)
    return np.clip(2 * o[:, a] - 1, -1, 1) + np.clip(1 - 2 * o[:, b], -1, 1)


def _one_hot_dp_check(eps: float, scale: float, a: int = 0, b: int = 2, k: int = 3) -> float:
    """The release of labels a and b, 10^6 times each. K = 3 (one coordinate that cancels) rather
    than 10 keeps the test fast: the extra coordinates never enter the likelihood ratio."""
    ya = torch.full((N_DP,), a)
    yb = torch.full((N_DP,), b)
    oa = laplace_one_hot(ya, k, scale, torch.Generator().manual_seed(11)).numpy()
    ob = laplace_one_hot(yb, k, scale, torch.Generator().manual_seed(12)).numpy()
    return delta_hat(_privacy_loss_statistic(oa, a, b), _privacy_loss_statistic(ob, a, b), eps, width=0.05)


@pytest.mark.parametrize("eps", [0.5, 1.0, 2.0])
def test_laplace_one_hot_release_is_dp_and_negative_control_fails(eps):
    scale = laplace_scale(eps, 2.0)  # the release's calibration: L1 sensitivity 2
    assert release_labels(torch.tensor([0]), num_classes=K, task="classification", mechanism="laplace",
                          epsilon=eps, generator=torch.Generator()).noise_scale == scale
    assert _one_hot_dp_check(eps, scale) <= SLACK
    assert _one_hot_dp_check(eps, scale / 1.2) > SLACK  # too little noise (sensitivity 1 instead of 2 would be /2)


def test_laplace_regression_release_is_dp_and_negative_control_fails():
    """The clamped scalar release of labels 0 and 9 (the extreme neighbours): outputs binned on
    [0, 9] with the clamped atoms in the edge bins."""
    eps = 1.0
    scale = laplace_scale(eps, 9.0)

    def release(label, s, seed):
        y = torch.full((N_DP,), label)
        return laplace_value(y, s, torch.Generator().manual_seed(seed)).clamp_(0, 9).numpy()

    assert delta_hat(release(0, scale, 1), release(9, scale, 2), eps, width=scale / 10) <= SLACK
    assert delta_hat(release(0, scale / 1.2, 1), release(9, scale / 1.2, 2), eps, width=scale / 10) > SLACK


def test_post_processed_label_epsilons_do_not_exceed_epsilon():
    for eps in (0.1, 1.0, 5.0):
        y = torch.arange(K)
        for task, post in (("classification", "argmax"), ("classification", "clamp_round"), ("regression", "argmax")):
            r = release_labels(y, num_classes=K, task=task, mechanism="laplace", epsilon=eps,
                               generator=torch.Generator().manual_seed(0), postprocess=post)
            assert r.epsilon() == pytest.approx(eps, rel=1e-12)
            assert r.label_epsilon() <= eps + 1e-9
        # the clamp-and-round matrix: every output ratio within e^eps (post-processing of Lap(9/eps))
        lm = clamp_round_log_matrix(laplace_scale(eps, 9.0), K)
        assert np.allclose(np.exp(lm).sum(axis=1), 1.0)
        assert (lm.max(axis=0) - lm.min(axis=0)).max() <= eps + 1e-9
        # negative control: the same check on the source code's calibration of that scalar release
        # (Delta = 2 instead of K - 1 = 9) finds output ratios up to e^(4.4 eps)
        bad = clamp_round_log_matrix(laplace_scale(eps, 2.0), K)
        assert (bad.max(axis=0) - bad.min(axis=0)).max() > 4 * eps
    # negative control: a one-hot release with half the noise (b = 1 / eps, sensitivity 1 instead of
    # 2) spends more than eps on the argmax labels where the post-processing saves little
    for eps in (0.1, 1.0):
        half = LabelRelease(torch.arange(K), "classification", "laplace", "argmax", K,
                            noise_scale=laplace_scale(eps, 1.0), sensitivity=1.0)
        assert half.label_epsilon() > 1.1 * eps


def test_argmax_label_epsilon_matches_the_measured_keep_probability():
    """label_epsilon of the argmax release, log(p (K - 1) / (1 - p)), against p measured on 400,000
    draws of the release itself; a release with half the noise measures far above epsilon."""
    eps, n = 1.0, 400_000
    y = torch.full((n,), 3)

    def measured(release) -> tuple[float, float]:
        p = release.kept(y).double().mean().item()
        se = math.sqrt(p * (1 - p) / n) / (p * (1 - p))  # delta method: d/dp log(p / (1 - p))
        return math.log(p * (K - 1) / (1 - p)), se

    r = release_labels(y, num_classes=K, task="classification", mechanism="laplace", epsilon=eps,
                       generator=torch.Generator().manual_seed(21))
    got, se = measured(r)
    assert abs(got - r.label_epsilon()) < 4 * se and r.label_epsilon() <= eps
    noisy_half = laplace_one_hot(y, K, laplace_scale(eps, 1.0), torch.Generator().manual_seed(22)).argmax(dim=1)
    half = LabelRelease(noisy_half, "classification", "laplace", "argmax", K, noise_scale=laplace_scale(eps, 1.0),
                        sensitivity=1.0)
    bad, bad_se = measured(half)
    assert bad > eps + 20 * bad_se


# ---------------------------------------------------------------- keep probabilities


def _argmax_keep_closed_form(eps: float, k: int) -> float:
    """P(argmax(e_y + Lap(2/eps)^K) = y) by binomial expansion of F^(K-1), region by region
    (an independent derivation of the integral the module computes numerically)."""
    c = eps / 2
    total = 0.5**k * math.exp(-c) / k
    for j in range(k):
        coef = math.comb(k - 1, j) * (-0.5) ** j * math.exp(-j * c)
        total += coef * 0.5 * (c if j == 1 else (1 - math.exp(-(1 - j) * c)) / (1 - j))
        total += coef * 0.5 / (1 + j)
    return total


@pytest.mark.parametrize("k", [2, 3, 10])
def test_laplace_argmax_keep_prob_matches_closed_form(k):
    for eps in (0.01, 0.3, 1.0, 4.0, 12.0):
        assert laplace_argmax_keep_prob(eps, k) == pytest.approx(_argmax_keep_closed_form(eps, k), abs=1e-10)
    assert laplace_argmax_keep_prob(1e-6, k) == pytest.approx(1 / k, abs=1e-6)


@pytest.mark.parametrize("task,mechanism,post,eps", [
    ("classification", "laplace", "argmax", 1.0),
    ("classification", "laplace", "argmax", 6.0),
    ("classification", "laplace", "clamp_round", 10.0),
    ("classification", "rr", "argmax", 1.0),
    ("classification", "rr", "argmax", 4.0),
    ("regression", "laplace", "argmax", 20.0),
])
def test_label_keep_rate_matches_analytic_keep_prob(task, mechanism, post, eps):
    """The measured keep rate over 200,000 labels lies within 4.5 binomial standard deviations of
    the analytic probability; the control (the analytic value at 1.2 epsilon) lies outside."""
    n = 200_000
    y = torch.randint(0, K, (n,), generator=torch.Generator().manual_seed(3))
    trainer_cfg = LabelDPConfig(task=task, mechanism=mechanism, epsilon=eps, postprocess=post)
    r = release_labels(y, num_classes=K, task=task, mechanism=mechanism, epsilon=eps,
                       generator=torch.Generator().manual_seed(4), postprocess=post)
    rate = float(r.kept(y).float().mean())
    freq = np.bincount(y.numpy(), minlength=K) / n

    def analytic(e):
        if mechanism == "rr":
            return rr_keep_prob(e, K)
        if task == "classification" and post == "argmax":
            return laplace_argmax_keep_prob(e, K)
        return clamp_round_keep_prob(laplace_scale(e, 9.0), K, freq)

    p = analytic(trainer_cfg.epsilon)
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(rate - p) <= 4.5 * sd
    assert abs(rate - analytic(1.2 * eps)) > 4.5 * sd


# ---------------------------------------------------------------- the release: once per trial, in [0, 9]


def _data(n=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 28, 28, generator=g) * 2 - 1
    y = torch.randint(0, K, (n,), generator=g)
    return x, y


def test_regression_labels_stay_in_range():
    y = torch.randint(0, K, (100_000,), generator=torch.Generator().manual_seed(0))
    for eps in (0.01, 1.0, 100.0):
        r = release_labels(y, num_classes=K, task="regression", mechanism="laplace", epsilon=eps,
                           generator=torch.Generator().manual_seed(1))
        assert r.labels.dtype == torch.float32
        assert float(r.labels.min()) >= 0.0 and float(r.labels.max()) <= 9.0
    assert float(r.labels.min()) == 0.0 or eps >= 100  # large noise piles mass on the clamped ends
    r = release_labels(y, num_classes=K, task="regression", mechanism="laplace", epsilon=0.01,
                       generator=torch.Generator().manual_seed(1))
    assert (r.labels == 0).float().mean() > 0.4 and (r.labels == 9).float().mean() > 0.4


@pytest.mark.parametrize("task,mechanism", [("classification", "laplace"), ("regression", "laplace"),
                                            ("classification", "rr")])
def test_labels_released_once_identical_across_epochs_and_restore(task, mechanism):
    x, y = _data(60)
    cfg = LabelDPConfig(task=task, mechanism=mechanism, epsilon=1.0, epochs=3, batch_size=20, seed=4)
    a = LabelDPTrainer(cfg, x, y, noise_key=NoiseKey.reproducible(cfg.seed))
    released = a.labels.clone()
    gen_state = a.label_gen.get_state()
    assert not torch.equal(released.to(torch.int64) if task == "classification" else released, y.to(released.dtype))
    a.train_epoch()
    assert torch.equal(a.labels, released) and torch.equal(a.label_gen.get_state(), gen_state)

    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert torch.equal(state["labels"], released)

    a.train_epoch()
    a.train_epoch()
    assert torch.equal(a.labels, released) and torch.equal(a.label_gen.get_state(), gen_state)

    # a restored trainer uses the stored labels (not a redraw) and continues bit for bit
    b = LabelDPTrainer(cfg, x, y, noise_key=NoiseKey.reproducible(cfg.seed))
    b.labels = torch.zeros_like(b.labels)  # would show if the restore kept its own draw
    b.load_state_dict(state)
    assert torch.equal(b.labels, released) and b.epoch == 1
    b.train_epoch()
    b.train_epoch()
    for pa, pb in zip(a.model.state_dict().values(), b.model.state_dict().values()):
        assert torch.equal(pa, pb)
    assert a.privacy() == b.privacy()

    # same config, same draw; another seed, another draw; a config mismatch is refused
    assert torch.equal(LabelDPTrainer(cfg, x, y, noise_key=NoiseKey.reproducible(cfg.seed)).labels, released)
    other = LabelDPConfig(task=task, mechanism=mechanism, epsilon=1.0, epochs=3, batch_size=20, seed=5)
    assert not torch.equal(LabelDPTrainer(other, x, y, noise_key=NoiseKey.reproducible(other.seed)).labels, released)
    with pytest.raises(ValueError, match="config"):
        LabelDPTrainer(other, x, y, noise_key=NoiseKey.reproducible(other.seed)).load_state_dict(state)


def test_each_trainer_starts_from_a_fresh_model_and_leaves_global_rng_alone():
    x, y = _data(50)
    cfg = LabelDPConfig(epsilon=2.0, epochs=1, batch_size=25)
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = LabelDPTrainer(cfg, x, y)
    assert torch.equal(torch.rand(3), before)
    a.train_epoch()
    b = LabelDPTrainer(cfg, x, y)
    first = next(iter(b.model.parameters()))
    assert torch.equal(first, next(iter(LabelDPTrainer(cfg, x, y).model.parameters())))
    assert not torch.equal(first, next(iter(a.model.parameters())))


def test_baseline_trains_on_true_labels():
    x, y = _data(60)
    for cfg in (LabelDPConfig(epsilon=None), LabelDPConfig(mechanism="none", epsilon=None)):
        t = LabelDPTrainer(cfg, x, y)
        assert torch.equal(t.labels, y)
        p = t.privacy()
        assert p["epsilon"] == math.inf and p["delta"] == 0 and p["label_keep_rate"] == 1 == p["analytic_keep_prob"]


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs,field", [
    (dict(epsilon=0.0), "epsilon"), (dict(epsilon=float("nan")), "epsilon"), (dict(mechanism="gauss"), "mechanism"),
    (dict(mechanism="none", epsilon=1.0), "epsilon"), (dict(task="regression", postprocess="clamp_round"), "postprocess"),
    (dict(task="ranking"), "task"), (dict(epochs=0), "epochs"), (dict(lr=-1.0), "lr"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LabelDPConfig(**kwargs)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="y must hold labels"):
        release_labels(torch.tensor([0, 10]), num_classes=K, task="classification", mechanism="rr", epsilon=1.0,
                       generator=torch.Generator())
    with pytest.raises(ValueError, match="generator"):
        release_labels(torch.tensor([0]), num_classes=K, task="classification", mechanism="rr", epsilon=1.0, generator=0)
    with pytest.raises(ValueError, match="flip_prob"):
        rr_epsilon(0.95, K)


def test_trial_schema_rules():
    from trainables.label_dp import LabelDPTrialConfig
    from trainables.runtime import validate_config

    assert LabelDPTrialConfig(epsilon=None).epsilon is None
    for bad, field in [({"epsilon": -1.0}, "epsilon"), ({"certify_images": 10}, "certify_images"),
                       ({"task": "regression", "attacks": {"pgd": [0.1]}}, "attacks"),
                       ({"mechanism": "none"}, "epsilon"), ({"audit_canaries": 10}, "audit_canaries")]:
        with pytest.raises(ValueError, match=field):
            validate_config(bad, LabelDPTrialConfig)


# ---------------------------------------------------------------- training


@pytest.mark.slow
def test_short_training_beats_chance_and_adapter_reports_metrics():
    from dpmech.datasets.splits import load_splits
    from trainables.label_dp import LabelDPMechanism, LabelDPTrialConfig
    from trainables.runtime import evaluate

    train, test = load_splits("mnist", train_size=600, test_size=200, seed=0)
    x, y = train.tensors
    xt, yt = test.tensors
    cfg = LabelDPTrialConfig(mechanism="laplace", epsilon=100.0, epochs=2, batch_size=50, test_size=200)
    mech = LabelDPMechanism(cfg, x, y, torch.device("cpu"))
    for _ in range(cfg.epochs):
        mech.train_epoch()
    m = evaluate(mech, cfg, xt, yt)["metrics"]
    assert m["acc_clean"] > 0.5  # chance is 0.1
    assert m["epsilon"] == pytest.approx(100.0) and m["delta"] == 0.0
    assert m["label_keep_rate"] == 1.0 and m["analytic_keep_prob"] > 0.999999

    reg = LabelDPTrialConfig(task="regression", mechanism="rr", epsilon=2.0, epochs=1, test_size=200)
    mech = LabelDPMechanism(reg, x[:100], y[:100], torch.device("cpu"))
    mech.train_epoch()
    m = evaluate(mech, reg, xt, yt)["metrics"]
    assert {"mse", "acc_clean", "epsilon", "delta", "label_keep_rate", "analytic_keep_prob"} <= set(m)
    assert m["epsilon"] == pytest.approx(2.0) and m["mse"] > 0


def test_report_figure_from_a_trials_table(tmp_path):
    import pandas as pd

    from sweeps.report.labeldp import FIGURE, labeldp_figures

    rows = []
    for task in ("classification", "regression"):
        rows.append({"trainable": "label_dp", "param.task": task, "param.mechanism": "none", "param.epsilon": None,
                     "param.postprocess": "argmax", "acc_clean": 0.98, "mse": 0.25 if task == "regression" else None,
                     "epsilon": 1.7976931348623157e308, "label_keep_rate": 1.0})
        for mech in ("laplace", "rr"):
            for eps in (0.1, 1.0, 10.0):
                rows.append({"trainable": "label_dp", "param.task": task, "param.mechanism": mech, "param.epsilon": eps,
                             "param.postprocess": "argmax", "acc_clean": min(0.98, 0.1 * eps + 0.1),
                             "mse": 8.0 / (1 + eps) if task == "regression" else None, "epsilon": eps,
                             "label_keep_rate": rr_keep_prob(eps, K)})
    rows.append({"trainable": "pixeldp", "acc_clean": 0.9, "epsilon": 1.0})
    out = labeldp_figures(pd.DataFrame(rows), tmp_path)
    assert out == [tmp_path / FIGURE] and (tmp_path / FIGURE).stat().st_size > 10_000
    assert labeldp_figures(pd.DataFrame([rows[-1]]), tmp_path / "none") == []
