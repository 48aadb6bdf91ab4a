"""DPGAN (dpmech.dpgan, trainables.dpgan): the enforced per-example bound c_g, weight clipping,
the generator's isolation from real data, the ledger's epsilon, checkpoints, and a short run that
beats chance in train-on-synthetic accuracy. Tiny subsets and networks (docs/dpgan.md)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant

from dpmech.privacy.secret import NoiseKey
from dpmech.privacy.accounting import RDP_ORDERS, noise_multiplier_for
from dpmech.dpgan.config import DPGANConfig, paper_lemma2_epsilon, paper_lemma2_sigma
from dpmech.dpgan.trainer import DPGANTrainer
from dpmech.dpgan.evaluate import sample_scores, synthetic_dataset, tstr_accuracy


def _data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 28, 28, generator=g) * 2 - 1
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y


SIGMA = 1.3  # noise multiplier of the mechanics tests (calibration is tested on its own)


def _trainer(n=256, calibrate=False, **kw):
    base = dict(epsilon=5.0, delta=1e-5, epochs=2, batch_size=32, hidden=16, latent_dim=8, clip_grad=0.5,
                clip_weight=0.05, n_critic=2)
    base.update(kw)
    x, y = _data(n)
    cfg = DPGANConfig(**base)
    if calibrate or not cfg.private:
        return DPGANTrainer(cfg, x, y, noise_key=NoiseKey.reproducible(cfg.seed))
    with pytest.MonkeyPatch.context() as mp:  # skip the (slow) bisection; sigma is recorded as used
        mp.setattr("dpmech.dpgan.trainer.calibrate_noise", lambda config, n: SIGMA)
        return DPGANTrainer(cfg, x, y, noise_key=NoiseKey.reproducible(cfg.seed))


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------ the critic's mechanism
def _measure_engine_clipping(tr, steps: int):
    """Run ``steps`` critic steps and measure what the engine clipped, against plain autograd.

    Each step's Poisson batch, the critic's weights before the step and the clipped sum the engine
    hands to the Gaussian mechanism (the argument of ``_add_noise``) are captured. Afterwards, at each
    step's weights: the reference per-example gradients g_i of -f_w(x_i, y_i), one backward pass each,
    clipped to c_g with the engine's factor min(1, c_g / (||g_i|| + 1e-6)), summed; and the engine run
    on every example alone (its clipped sum of one example is that example's clipped gradient).
    Returns (largest relative error of the engine's sums, largest norm of an engine-clipped example,
    fraction of examples the bound was active on)."""
    c_g = tr.config.clip_grad
    batches, sums, weights = [], [], []
    sample, add_noise = tr._sample_real_batch, tr._add_noise

    def spy_sample():
        xb, yb = sample()
        batches.append((xb.clone(), yb.clone()))
        weights.append(copy.deepcopy(tr.critic.state_dict()))
        return xb, yb

    def spy_noise(summed):
        sums.append({k: g.detach().clone() for k, g in summed.items()})
        return add_noise(summed)

    tr._sample_real_batch, tr._add_noise = spy_sample, spy_noise
    try:
        for _ in range(steps):
            tr.critic_step()
    finally:
        tr._sample_real_batch, tr._add_noise = sample, add_noise
    now = copy.deepcopy(tr.critic.state_dict())
    names = [k for k, _ in tr.critic.named_parameters()]
    err, top, active, total = 0.0, 0.0, 0, 0
    try:
        for (xb, yb), summed, w in zip(batches, sums, weights):
            if xb.shape[0] == 0:
                continue
            tr.critic.load_state_dict(w)
            ref = _per_example_grads(tr, xb, yb, -1.0)
            norms = ref.norm(dim=1, keepdim=True)
            expected = (ref * (c_g / (norms + 1e-6)).clamp(max=1.0)).sum(0)
            engine = torch.cat([summed[k].flatten() for k in names])
            err = max(err, ((engine - expected).norm() / expected.norm()).item())
            active += int((norms > c_g).sum())
            total += xb.shape[0]
            for i in range(xb.shape[0]):
                one, _, _ = tr._clipped_sum(xb[i:i + 1], yb[i:i + 1], -1.0)
                top = max(top, torch.sqrt(sum(g.pow(2).sum() for g in one.values())).item())
    finally:
        tr.critic.load_state_dict(now)
    return err, top, active / total


def test_per_example_gradient_norms_are_clipped_before_noise(monkeypatch):
    """What the engine clipped during training, measured: the clipped sum that reaches the noise at
    every step equals the sum of the autograd per-example gradients clipped to c_g, and each example's
    clipped gradient has norm <= c_g (not ``last_clipped_norms``, which is computed from the bound)."""
    tr = _trainer(clip_grad=1.2)  # per-example norms here are about 1.1 to 1.5
    err, top, active = _measure_engine_clipping(tr, 6)
    assert err < 1e-4
    assert top <= tr.config.clip_grad * (1 + 1e-6)
    assert 0.05 < active < 1.0  # the bound is active on some examples and not on all
    # negative control: an engine that clips to 2 c_g (the trainer still believes c_g) is caught by
    # the same measurement, on the sums and on the per-example norms
    from dpmech.privacy.clipping import BookKeeper

    real = BookKeeper.clipped_sum
    monkeypatch.setattr(BookKeeper, "clipped_sum", lambda self, loss, c: real(self, loss, 2 * c))
    bad_err, bad_top, _ = _measure_engine_clipping(_trainer(clip_grad=1.2), 6)
    assert bad_err > 100 * 1e-4 and bad_top > 1.1 * tr.config.clip_grad


def test_per_example_gradients_match_autograd():
    tr = _trainer()
    xb, yb = tr._x[:3], tr._y[:3]
    tr.config.clip_grad = 1e9  # no clipping: the per-example gradients themselves
    clipped, scores, _, _ = tr.clipped_real_gradients(xb, yb)
    for i in range(3):
        tr.critic.zero_grad()
        (-tr.critic(xb[i:i + 1], yb[i:i + 1]).sum()).backward()
        for k, p in tr.critic.named_parameters():
            torch.testing.assert_close(clipped[k][i], p.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(scores, tr.critic(xb, yb).detach())


def _unclipped_sum(tr, x, y):
    """A wrong engine for the negative control: the plain sum of the real term's gradients."""
    out = tr.critic(x, y)
    grads = torch.autograd.grad(-out.sum(), list(tr.critic.parameters()))
    norms = torch.zeros(x.shape[0])
    return {k: g.detach() for (k, _), g in zip(tr.critic.named_parameters(), grads)}, out.detach(), norms


def test_noise_is_added_to_the_clipped_sum_with_std_sigma_cg():
    """The released real-data gradient minus the clipped sum / m has per-coordinate std sigma c_g / m."""
    def check(tr) -> tuple[float, float]:
        """(relative error of the residual's std against sigma c_g, its mean in standard errors)"""
        xb, yb = tr._x[:100], tr._y[:100]
        clipped, _, _, _ = tr.clipped_real_gradients(xb, yb)
        noisy, _ = tr._noisy_real_gradient(xb, yb)
        resid = torch.cat([(noisy[k] * tr.expected_batch - clipped[k].sum(0)).flatten() for k in clipped])
        expected = SIGMA * tr.config.clip_grad
        assert resid.numel() > 10000
        return abs(resid.std().item() / expected - 1), abs(resid.mean().item()) / (expected / math.sqrt(resid.numel()))

    tr = _trainer(n=2000, batch_size=100)
    assert tr.noise_multiplier == SIGMA
    std_err, mean_z = check(tr)
    assert std_err < 0.03 and mean_z < 4
    # negative controls, the same check on deliberately wrong mechanisms: noise of std 1.15 sigma c_g
    # (std 15% off, about 20 standard errors), and noise added to the unclipped sum (the residual then
    # holds the clipped-away part, so its mean and spread move)
    loud = _trainer(n=2000, batch_size=100)
    loud.noise_multiplier = 1.15 * SIGMA
    assert check(loud)[0] > 0.1
    unclipped = _trainer(n=2000, batch_size=100)
    real_sum = unclipped._clipped_sum
    unclipped._clipped_sum = lambda x, y, sign: real_sum(x, y, sign) if x.shape[0] < 2 else _unclipped_sum(unclipped, x, y)
    std_bad, mean_bad = check(unclipped)
    assert std_bad > 0.1 or mean_bad > 10


def test_critic_weights_within_clip_after_every_step():
    tr = _trainer(lr_critic=0.05)  # a large step, so unclipped weights would leave the box
    c_p = float(np.float32(tr.config.clip_weight))  # the clamp bound as the float32 weights hold it
    for _ in range(8):
        tr.critic_step()
        assert all(p.abs().max().item() <= c_p for p in tr.critic.parameters())
    assert any(p.abs().max().item() == pytest.approx(c_p) for p in tr.critic.parameters())


@pytest.mark.parametrize("extra", [{}, {"mode_seeking": 1.0, "ema": 0.9}, {"generator": "dcgan", "ema": 0.9}])
def test_generator_step_reads_no_real_data(extra):
    tr = _trainer(**extra)
    for _ in range(2):
        tr.critic_step()
    calls = {"n": 0}
    original = tr._sample_real_batch

    def spy():
        calls["n"] += 1
        return original()

    tr._sample_real_batch = spy
    # the training tensors become NaN after the critic step: a generator step that read them
    # (directly or through anything but the critic's weights) would produce NaN parameters
    tr._x.fill_(float("nan"))
    tr._y.fill_(0)
    before = [p.detach().clone() for p in tr.generator.parameters()]
    critic_before = [p.detach().clone() for p in tr.critic.parameters()]
    tr.generator_step()
    assert calls["n"] == 0
    after = list(tr.generator.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
    assert all(torch.equal(a, b) for a, b in zip(tr.critic.parameters(), critic_before))
    # the critic step does read the real data (negative control: NaNs propagate there)
    tr.critic_step()
    assert calls["n"] == 1
    assert not all(torch.isfinite(p).all() for p in tr.critic.parameters())


def test_fake_term_needs_no_real_data():
    """The critic step's fake term depends on the generator and the critic only: with the real
    batch emptied, the update is the fake gradient plus pure noise."""
    tr = _trainer(epsilon=None)
    tr._sample_real_batch = lambda: (tr._x[:0], tr._y[:0])
    tr.critic_step()
    assert all(torch.isfinite(p).all() for p in tr.critic.parameters())


# ------------------------------------------------------------------ accounting
def test_epsilon_equals_dp_accounting_for_the_recorded_ledger():
    tr = _trainer(n=512, batch_size=32, epochs=2, epsilon=1.0, calibrate=True)
    tr.train_epoch()
    assert tr.ledger.steps == tr.critic_steps == tr.steps_per_epoch == 16
    q, sigma = 32 / 512, tr.noise_multiplier
    acc = rdp_privacy_accountant.RdpAccountant(list(RDP_ORDERS))
    acc.compose(dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(sigma)), 16))
    priv = tr.privacy()
    assert priv["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert priv["epsilon_pld"] <= priv["epsilon"] * 1.01
    assert priv["epsilon_paper_lemma2"] == pytest.approx(2 * q * math.sqrt(16 * math.log(1e5)) / sigma)
    # calibrated for all planned steps (2 epochs): one epoch spends less than the target
    assert priv["epsilon"] < 1.0
    tr.train_epoch()
    assert 0.99 < tr.privacy()["epsilon"] <= 1.0
    assert sigma == noise_multiplier_for(1.0, 1e-5, q, 32)


def test_paper_lemma2_formula():
    q, n_d, delta = 0.01, 1000, 1e-5
    sigma = paper_lemma2_sigma(2.0, q, n_d, delta)
    assert sigma == pytest.approx(2 * q / 2.0 * math.sqrt(n_d * math.log(1 / delta)))
    assert paper_lemma2_epsilon(sigma, q, n_d, delta) == pytest.approx(2.0)


def test_non_private_mode_has_no_noise_and_infinite_epsilon():
    tr = _trainer(epsilon=None, epochs=1)
    assert tr.noise_multiplier == 0.0
    tr.train_epoch()
    priv = tr.privacy()
    assert math.isinf(priv["epsilon"]) and math.isinf(priv["epsilon_paper_lemma2"])


def test_poisson_sampling_rate():
    tr = _trainer(n=2000, batch_size=100)
    sizes = [tr._sample_real_batch()[0].shape[0] for _ in range(200)]
    # Binomial(2000, 0.05): mean 100, sd ~9.7; the mean of 200 draws is within 4 sd / sqrt(200)
    assert abs(np.mean(sizes) - 100) < 4 * 9.75 / math.sqrt(200)
    assert np.std(sizes) > 5  # not a fixed-size batch


# ------------------------------------------------------------------ checkpoints
def test_state_dict_round_trip_continues_bit_for_bit():
    a = _trainer(epochs=2)
    a.train_epoch()
    state = a.state_dict()
    b = _trainer(epochs=2)
    b.load_state_dict(state)
    assert b.ledger == a.ledger and b.ledger.steps == a.critic_steps
    assert b.ledger.epsilon(1e-5) == a.ledger.epsilon(1e-5)
    a.train_epoch()
    b.train_epoch()
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert a.ledger == b.ledger


def test_state_dict_survives_torch_save_weights_only(tmp_path):
    a = _trainer(epochs=1)
    a.train_epoch()
    torch.save(a.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    b = _trainer(epochs=1)
    b.load_state_dict(state)
    assert b.ledger == a.ledger


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="clip_grad"):
        DPGANConfig(clip_grad=0)
    with pytest.raises(ValueError, match="epsilon"):
        DPGANConfig(epsilon=-1.0)
    with pytest.raises(ValueError, match="architecture"):
        DPGANConfig(architecture="resnet")


# ------------------------------------------------------------------ evaluation
def test_sample_scores_on_a_perfect_and_a_useless_generator():
    judge = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    with torch.no_grad():
        judge[1].weight.copy_(torch.eye(3, 4) * 50)
        judge[1].bias.zero_()
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    perfect = torch.eye(3, 4)[labels].view(6, 1, 2, 2)
    s = sample_scores(judge, perfect, labels)
    assert s["sample_quality"] == 1.0 and s["classifier_score"] == pytest.approx(3.0, rel=1e-3)
    useless = torch.eye(3, 4)[torch.zeros(6, dtype=torch.long)].view(6, 1, 2, 2)
    s = sample_scores(judge, useless, labels)
    assert s["sample_quality"] == pytest.approx(1 / 3) and s["classifier_score"] == pytest.approx(1.0, rel=1e-3)


@pytest.mark.slow
def test_short_run_beats_chance_in_train_on_synthetic_accuracy():
    from dpmech.datasets.splits import load_splits

    train, test = load_splits("mnist", train_size=2000, test_size=500, seed=0)
    x, y = train.tensors
    xt, yt = test.tensors
    cfg = DPGANConfig(epsilon=None, epochs=10, batch_size=64, n_critic=1, hidden=128, latent_dim=32,
                      clip_weight=0.1, lr_critic=1e-3, lr_generator=1e-3, seed=0)
    tr = DPGANTrainer(cfg, x, y, noise_key=NoiseKey.reproducible(cfg.seed))
    for _ in range(cfg.epochs):
        tr.train_epoch()
    acc = tstr_accuracy(tr, xt, yt, n_samples=1000, epochs=2, seed=0)
    # negative control: the untrained generator's samples carry no label information
    untrained = DPGANTrainer(cfg, x, y, noise_key=NoiseKey.reproducible(cfg.seed))
    acc0 = tstr_accuracy(untrained, xt, yt, n_samples=1000, epochs=2, seed=0)
    assert acc0 < 0.2
    assert acc > 0.25, acc


# ------------------------------------------------------------------ trainable
def test_trial_schema_and_planned_privacy_event():
    from dpmech.privacy.accounting import epsilon as event_epsilon
    from trainables.dpgan import DPGANTrialConfig
    from trainables.registry import get_trainable
    from trainables.runtime import validate_config

    entry = get_trainable("dpgan")
    assert entry.config_model is DPGANTrialConfig and DPGANTrialConfig.protects_training_examples
    with pytest.raises(ValueError, match="attacks"):
        validate_config({"attacks": {"pgd": [0.1]}}, DPGANTrialConfig)
    with pytest.raises(ValueError, match="epsilon"):
        validate_config({"epsilon": 0.0}, DPGANTrialConfig)
    assert validate_config({"epsilon": None}, DPGANTrialConfig).epsilon is None
    cfg = DPGANTrialConfig(epsilon=1.0, train_size=1000, batch_size=100, epochs=1)
    eps = event_epsilon(entry.privacy_event_fn(cfg), 1e-5)
    assert 0.99 < eps <= 1.0


# ------------------------------------------------------------------ issue 17: fake-term clipping, EMA
def _per_example_grads(tr, x, y, sign):
    """Reference per-example gradients of sign * f_w(x_i, y_i) by plain autograd, one at a time."""
    out = []
    for i in range(x.shape[0]):
        tr.critic.zero_grad()
        (sign * tr.critic(x[i:i + 1], y[i:i + 1]).sum()).backward()
        out.append(torch.cat([p.grad.flatten().clone() for p in tr.critic.parameters()]))
    tr.critic.zero_grad(set_to_none=True)
    return torch.stack(out)


def test_fake_gradient_is_the_mean_of_per_example_gradients_clipped_to_cg():
    tr = _trainer(clip_grad=0.05)
    z, yf = tr._latent(6)
    with torch.no_grad():
        xf = tr.generator(z, yf)
    ref = _per_example_grads(tr, xf, yf, 1.0)
    assert (ref.norm(dim=1) > 0.05).any()          # the bound is active
    clipped = ref * (0.05 / (ref.norm(dim=1, keepdim=True) + 1e-6)).clamp(max=1.0)
    grads, _ = tr._fake_gradient(xf, yf)
    torch.testing.assert_close(torch.cat([g.flatten() for g in grads]), clipped.mean(0), rtol=1e-4, atol=1e-7)
    # negative control: clip_fake off gives the unclipped mean, which differs
    tr.config.clip_fake = False
    grads, _ = tr._fake_gradient(xf, yf)
    torch.testing.assert_close(torch.cat([g.flatten() for g in grads]), ref.mean(0), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(ref.mean(0), clipped.mean(0), atol=1e-6)


def test_real_clipped_sum_by_the_engine_matches_per_example_reference():
    tr = _trainer(clip_grad=0.05)
    xb, yb = tr._x[:5], tr._y[:5]
    ref = _per_example_grads(tr, xb, yb, -1.0)
    clipped = ref * (0.05 / (ref.norm(dim=1, keepdim=True) + 1e-6)).clamp(max=1.0)
    sums, _, norms = tr._clipped_sum(xb, yb, -1.0)
    torch.testing.assert_close(norms, ref.norm(dim=1), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.cat([sums[k].flatten() for k, _ in tr.critic.named_parameters()]),
                               clipped.sum(0), rtol=1e-4, atol=1e-6)


def test_generator_ema_is_an_average_of_the_iterates_and_makes_the_samples():
    tr = _trainer(ema=0.9)
    before = [p.detach().clone() for p in tr.generator_ema.parameters()]
    tr.critic_step()
    tr.generator_step()
    for pe, p0, p in zip(tr.generator_ema.parameters(), before, tr.generator.parameters()):
        torch.testing.assert_close(pe, 0.9 * p0 + 0.1 * p.detach())
    labels = torch.arange(10)
    z = torch.randn(10, tr.config.latent_dim, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(tr.sample(labels, seed=7), tr.generator_ema(z, labels))
    assert not torch.allclose(tr.sample(labels, seed=7), tr.generator(z, labels))
    assert _trainer().generator_ema is None   # ema 0: the last iterate samples


def test_mode_seeking_term_changes_the_generator_update_only():
    a, b = _trainer(), _trainer(mode_seeking=1.0)
    for tr in (a, b):
        tr.critic_step()
    torch.testing.assert_close(list(a.critic.parameters()), list(b.critic.parameters()))
    for tr in (a, b):
        tr.generator_step()
    assert any(not torch.allclose(pa, pb) for pa, pb in zip(a.generator.parameters(), b.generator.parameters()))
    with pytest.raises(ValueError, match="mode_seeking"):
        DPGANConfig(mode_seeking=-1.0)


def test_dcgan_generator_shape_range_and_per_sample_normalisation():
    """generator "dcgan": images of the data's shape in [-1, 1]; GroupNorm normalises each sample on its
    own, so a sample does not depend on the others drawn with it (a BatchNorm generator's would: the
    negative control)."""
    from dpmech.dpgan.models import ConvGenerator

    torch.manual_seed(0)
    g = ConvGenerator(16, (1, 28, 28), 10, 64)
    z, y = torch.randn(6, 16), torch.arange(6) % 10
    x = g(z, y)
    assert x.shape == (6, 1, 28, 28) and x.abs().max() <= 1
    assert torch.allclose(g(z[:1], y[:1]), x[:1], atol=1e-6)            # alone = in company
    bn = torch.nn.Sequential(torch.nn.BatchNorm2d(32))                    # control: batch statistics
    with torch.no_grad():
        h = torch.randn(6, 32, 7, 7)
        assert not torch.allclose(bn(h[:2])[:1], bn(h)[:1], atol=1e-3)
    with pytest.raises(ValueError, match="generator"):
        DPGANConfig(generator="resnet")
    tr = _trainer(generator="dcgan")
    assert isinstance(tr.generator, ConvGenerator)
    assert tr.sample(torch.arange(4), seed=0).shape == (4, 1, 28, 28)
