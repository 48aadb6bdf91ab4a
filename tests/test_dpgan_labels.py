"""DPGAN's fake labels (dpmech.dpgan.labels, ``fake_labels: dp_histogram``): the label histogram is
the Gaussian mechanism with sensitivity 1, it is in the ledger and in the calibration, the fake labels
follow it and never the raw labels, and checkpoints keep the released histogram (docs/dpgan.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import stats

from dpmech.privacy.accounting import RDP_ORDERS, noise_multiplier_for
from dpmech.dpgan.config import DPGANConfig, planned_event
from dpmech.dpgan.trainer import DPGANTrainer
from dpmech.dpgan.labels import label_probabilities, release_label_histogram
from dpmech.privacy.secret import NoiseKey
from trainables.dpgan import DPGANTrialConfig, privacy_event

pytestmark = pytest.mark.usefixtures("one_thread")

# MNIST's training-label counts: class 5 the rarest, class 1 the most frequent
MNIST_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def _imbalanced(n_per_class=(60, 10, 30, 30, 30, 30, 30, 30, 30, 20), seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.cat([torch.full((k,), c, dtype=torch.long) for c, k in enumerate(n_per_class)])
    y = y[torch.randperm(y.numel(), generator=g)]
    x = torch.rand(y.numel(), 1, 28, 28, generator=g) * 2 - 1
    return x, y


def _trainer(fake_labels="dp_histogram", noise_key=None, **kw):
    base = dict(epsilon=5.0, delta=1e-5, epochs=1, batch_size=50, hidden=16, latent_dim=8, fake_labels=fake_labels,
                histogram_noise=2.0)
    base.update(kw)
    x, y = _imbalanced()
    return DPGANTrainer(DPGANConfig(**base), x, y, noise_key=noise_key)


def _shapiro_std_check(residuals: np.ndarray, sigma: float) -> tuple[float, float]:
    """p-values: residuals / sigma against N(0, 1) (Kolmogorov-Smirnov) and the variance (chi-square)."""
    z = residuals / sigma
    ks = stats.kstest(z, "norm").pvalue
    k = z.size
    chi = float((z ** 2).sum())
    var_p = 2 * min(stats.chi2.cdf(chi, k), stats.chi2.sf(chi, k))
    return ks, var_p


# ------------------------------------------------------------------ the release
def test_histogram_is_counts_plus_gaussian_noise_with_std_sigma():
    y = torch.repeat_interleave(torch.arange(10), torch.tensor(MNIST_COUNTS))
    counts = np.array(MNIST_COUNTS, dtype=float)
    res = np.concatenate([
        release_label_histogram(y, 10, 100.0, torch.Generator().manual_seed(s)).numpy() - counts
        for s in range(300)])
    ks, var_p = _shapiro_std_check(res, 100.0)
    assert ks > 1e-3 and var_p > 1e-3
    # negative control: the same residuals read as if the noise were 80 or 125 are rejected
    assert _shapiro_std_check(res, 80.0)[1] < 1e-6
    assert _shapiro_std_check(res, 125.0)[1] < 1e-6
    # sensitivity 1 under add/remove: one more example moves exactly one count by exactly 1
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a = release_label_histogram(y, 10, 100.0, g1)
    b = release_label_histogram(torch.cat([y, torch.tensor([3])]), 10, 100.0, g2)
    assert torch.allclose(b - a, torch.nn.functional.one_hot(torch.tensor(3), 10).double())


def test_label_probabilities_clip_normalise_and_fall_back_to_uniform():
    p = label_probabilities(torch.tensor([30.0, -5.0, 10.0, 0.0], dtype=torch.float64))
    assert torch.allclose(p, torch.tensor([0.75, 0.0, 0.25, 0.0]))
    assert torch.allclose(label_probabilities(torch.tensor([-1.0, -2.0])), torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="labels"):
        release_label_histogram(torch.tensor([0, 10]), 10, 1.0, torch.Generator())


# ------------------------------------------------------------------ the fake labels
def _expected_counts(probs: torch.Tensor, n: int) -> np.ndarray:
    """n times the float32 probabilities, renormalised in float64: their float32 sum is 1 only to
    float32 precision, and scipy's chisquare refuses expected counts whose sum is off by more than
    sqrt(float64 eps) relative (it failed CI once, at 1.9e-8)."""
    p = probs.double().numpy()
    return p / p.sum() * n


def test_fake_labels_follow_the_released_histogram_and_never_read_the_raw_labels():
    # a fixed key (the standards' fixed seeds): the histogram's noise and the draws are the same every run
    tr = _trainer(noise_key=NoiseKey.reproducible(0))
    probs = tr.fake_label_probs.clone()
    assert torch.allclose(probs, label_probabilities(tr.label_histogram))
    assert abs(probs[0].item() - 0.2) < 0.05 and abs(probs[1].item() - 1 / 30) < 0.05  # histogram noise 2
    tr._y = None                      # the raw labels are gone: the fake labels do not need them
    ys = torch.cat([tr._latent(500)[1] for _ in range(20)])
    observed = torch.bincount(ys, minlength=10).numpy()
    assert stats.chisquare(observed, _expected_counts(probs, ys.numel())).pvalue > 1e-3
    # negative control: uniform fake labels fail the same test against these frequencies
    uniform = _trainer("uniform", noise_key=NoiseKey.reproducible(0))
    ys_u = torch.cat([uniform._latent(500)[1] for _ in range(20)])
    observed_u = torch.bincount(ys_u, minlength=10).numpy()
    assert stats.chisquare(observed_u, _expected_counts(probs, ys_u.numel())).pvalue < 1e-6


def test_uniform_fake_labels_are_the_default_and_release_nothing():
    tr = _trainer("uniform")
    assert DPGANConfig().fake_labels == "uniform"
    assert tr.label_histogram is None and tr.fake_label_probs is None and tr.ledger.entries == []


# ------------------------------------------------------------------ privacy
def test_epsilon_is_dp_accountings_for_histogram_then_critic_steps():
    tr = _trainer(epsilon=2.0, epochs=2, histogram_noise=5.0)
    assert tr.ledger.steps == 1 and tr.ledger.entries[0].sampling_rate == 1.0
    tr.train_epoch()
    tr.train_epoch()
    q, sigma, steps = tr.sampling_rate, tr.noise_multiplier, tr.critic_steps
    acc = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS))
    acc.compose(dpe.ComposedDpEvent([dpe.GaussianDpEvent(5.0), dpe.SelfComposedDpEvent(
        dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(sigma)), steps)]))
    eps = tr.privacy()["epsilon"]
    assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert 1.99 < eps <= 2.0                     # calibrated for the composition
    # negative control: the critic steps alone spend less, so the histogram is counted
    alone = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS))
    alone.compose(dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(sigma)), steps))
    assert alone.get_epsilon(1e-5) < eps - 0.01
    # ... and the critic needs more noise than it would without the histogram
    assert sigma > noise_multiplier_for(2.0, 1e-5, q, steps) * 1.005
    assert tr.privacy()["histogram_noise"] == 5.0


def test_planned_event_and_trial_event_include_the_histogram():
    cfg = DPGANConfig(epsilon=1.0, epochs=1, batch_size=600, fake_labels="dp_histogram")
    event = planned_event(cfg, 60000)
    assert isinstance(event, dpe.ComposedDpEvent) and event.events[0] == dpe.SelfComposedDpEvent(dpe.GaussianDpEvent(100.0), 1)
    acc = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS))
    acc.compose(event)
    assert 0.99 < acc.get_epsilon(1e-5) <= 1.0
    trial = DPGANTrialConfig(epsilon=1.0, epochs=1, batch_size=600, fake_labels="dp_histogram", train_size=None)
    assert privacy_event(trial) == event
    # the default (uniform) plans the critic steps alone
    assert not isinstance(planned_event(DPGANConfig(epsilon=1.0, epochs=1, batch_size=600), 60000),
                          dpe.ComposedDpEvent)


def test_histogram_too_noisy_for_the_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="epsilon: 1.0 is unreachable .* fixed release"):
        _trainer(epsilon=1.0, histogram_noise=0.5)
    with pytest.raises(ValueError, match="histogram_noise"):
        DPGANConfig(histogram_noise=0)
    with pytest.raises(ValueError, match="fake_labels"):
        DPGANConfig(fake_labels="frequencies")


def test_non_private_baseline_uses_exact_frequencies():
    tr = _trainer(epsilon=None)
    assert tr.histogram_noise == 0.0
    counts = torch.bincount(tr._y, minlength=10).double()
    assert torch.equal(tr.label_histogram, counts)
    assert math.isinf(tr.privacy()["epsilon"])


# ------------------------------------------------------------------ checkpoints
def test_checkpoint_keeps_the_released_histogram_and_continues_bit_for_bit(tmp_path):
    key = NoiseKey.fresh()                           # the owner's (issue 48: the checkpoint holds the step only)
    a = _trainer(epochs=2, noise_key=key)
    a.train_epoch()
    torch.save(a.state_dict(), tmp_path / "s.pt")
    assert "sample_gen" not in a.state_dict() and "noise_gen" not in a.state_dict()
    b = _trainer(epochs=2, noise_key=key)
    b.label_histogram = b.label_histogram + 1000.0   # a different draw would be a second release
    b.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert torch.equal(b.label_histogram, a.label_histogram) and b.ledger == a.ledger
    a.train_epoch()
    b.train_epoch()
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert a.ledger == b.ledger and a.ledger.steps == 1 + a.critic_steps


def test_trial_plans_what_the_trainer_spends():
    """The trainable's planned event (used by the sweep before any trial runs) and the trainer's
    ledger after every planned step give the same epsilon, histogram included."""
    from dpmech.privacy.accounting import epsilon as event_epsilon
    from trainables.dpgan import dpgan_config

    x, y = _imbalanced()
    trial = DPGANTrialConfig(epsilon=2.0, train_size=x.shape[0], batch_size=50, epochs=1, hidden=16, latent_dim=8,
                             fake_labels="dp_histogram", histogram_noise=5.0)
    tr = DPGANTrainer(dpgan_config(trial), x, y)
    tr.train_epoch()
    assert tr.critic_steps == tr.planned_critic_steps
    assert tr.privacy()["epsilon"] == pytest.approx(event_epsilon(privacy_event(trial), 1e-5), rel=1e-9)
