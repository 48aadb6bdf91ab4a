"""dpal_sound (dpmech.dpal_sound.trainer): DP-SGD on DPAL's adversarial objective under smoothing noise.

Tiny GroupNorm CNN on 8x8 random images (milliseconds per step). Checked: the clipped sum is the
per-example clip-and-sum of loss_i = [CE(f(x_i+z_i)) + xi CE(f(x_i^adv+z'_i))] / (1+xi) (negative
control: clipping the two passes apart differs); x_i^adv depends on x_i only (negative control: a
BatchNorm model fails the same check); epsilon is the accountant's for the steps that ran; the
certificate is dpmech.robustness.smoothing's; the attack stays in each example's ball of size mu_i <= mu_max.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy.stats import norm

from dpmech.robustness import smoothing
from dpmech.privacy.accounting import epsilon as event_epsilon
from dpmech.privacy.accounting import subsampled_gaussian_event
from dpmech.privacy.clipping import BookKeeper
from dpmech.dpal_sound.trainer import (DPALSoundConfig, DPALSoundTrainer, PairedBookKeeper, craft, evaluate,
                                       per_example_loss)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed: int = 0, norm_layer: str = "group") -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = [nn.Conv2d(1, 4, 3, stride=2)]
        layers.append(nn.GroupNorm(2, 4) if norm_layer == "group" else nn.BatchNorm2d(4))
        layers += [nn.Tanh(), nn.Flatten(), nn.Linear(4 * 3 * 3, 8), nn.Tanh(), nn.Linear(8, 3)]
        return nn.Sequential(*layers)


def tiny_data(n: int = 120, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 8, 8, generator=g) * 2 - 1
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def tiny_config(**kw) -> DPALSoundConfig:
    base = dict(epsilon=None, noise_multiplier=0.0, max_grad_norm=0.05, batch_size=16, epochs=1, lr=1.0,
                momentum=0.0, smoothing_sigma=0.5, xi=0.7, mu_max=0.3, attacks=("fgsm", "pgd", "mim", "ifgsm"),
                attack_steps=3, seed=0)
    base.update(kw)
    return DPALSoundConfig(**base)


def reference_clipped_sum(model, inp, y, xi, c):
    """sum_i clip_C(grad [CE(f(inp_i), y_i) + xi CE(f(inp_{B+i}), y_i)] / (1 + xi)), one example at a time."""
    b = y.shape[0]
    params = [p for p in model.parameters()]
    total = [torch.zeros_like(p) for p in params]
    for i in range(b):
        ce = F.cross_entropy(model(inp[[i, b + i]]), y[[i, i]], reduction="none")
        loss = (ce[0] + xi * ce[1]) / (1 + xi)
        grads = torch.autograd.grad(loss, params)
        n = torch.sqrt(sum((g * g).sum() for g in grads))
        f = min(1.0, c / (float(n) + 1e-6))
        total = [t + f * g for t, g in zip(total, grads)]
    return total


@pytest.mark.parametrize("prefer", ["mixed", "inst", "ghost"])
def test_paired_bookkeeper_clips_each_example_as_one(prefer):
    model = tiny_model()
    x, y = tiny_data(10)
    g = torch.Generator().manual_seed(1)
    inp = torch.cat([x + 0.5 * torch.randn(x.shape, generator=g), x + 0.5 * torch.randn(x.shape, generator=g)])
    ref = reference_clipped_sum(model, inp, y, 0.7, 0.05)
    bk = PairedBookKeeper(model, prefer=prefer)
    bk.enabled = True
    logits = model(inp)
    bk.enabled = False
    ce = F.cross_entropy(logits, torch.cat([y, y]), reduction="none")
    bk.clipped_sum(per_example_loss(ce[:10], ce[10:], 0.7).sum(), 0.05)
    for p, r in zip(model.parameters(), ref):
        assert torch.allclose(p.grad, r, atol=1e-6, rtol=1e-4)
    bk.remove()
    # negative control: clipping the benign and adversarial rows as separate examples gives another sum
    for p in model.parameters():
        p.grad = None
    plain = BookKeeper(model, prefer=prefer)
    plain.enabled = True
    logits = model(inp)
    plain.enabled = False
    ce = F.cross_entropy(logits, torch.cat([y, y]), reduction="none")
    plain.clipped_sum((torch.cat([ce[:10], 0.7 * ce[10:]]) / 1.7).sum(), 0.05)
    assert max(float((p.grad - r).abs().max()) for p, r in zip(model.parameters(), ref)) > 1e-3
    plain.remove()


def test_training_step_gradient_is_the_formula_per_example():
    """One trainer step on a fixed batch: p.grad = (clipped sum of the per-example objective) / B, with
    the very inputs [x+z; x_adv+z'] the trainer drew (noise multiplier 0: no gradient noise)."""
    x, y = tiny_data()
    tr = DPALSoundTrainer(tiny_model(), x, y, tiny_config())
    seen = {}
    orig = tr.paired_inputs

    def spy(xb, yb):
        seen["inp"] = orig(xb, yb)
        return seen["inp"]
    tr.paired_inputs = spy
    idx = torch.arange(16)
    before = [p.detach().clone() for p in tr.model.parameters()]
    ref_model = tiny_model()
    ref_model.load_state_dict(tr.model.state_dict())
    tr.optimizer.zero_grad(set_to_none=True)
    logits, per_example = tr.forward_backward(x[idx], y[idx])
    ref = reference_clipped_sum(ref_model, seen["inp"], y[idx], 0.7, 0.05)
    for p, r in zip(tr.model.parameters(), ref):
        assert torch.allclose(p.grad, r / 16, atol=1e-7, rtol=1e-4)
    ce = F.cross_entropy(ref_model(seen["inp"]), torch.cat([y[idx], y[idx]]), reduction="none")
    assert torch.allclose(per_example, (ce[:16] + 0.7 * ce[16:]) / 1.7, atol=1e-6)
    # the benign half carries fresh noise of std sigma_s; the adversarial half too, around x_adv
    z = seen["inp"][:16] - x[idx]
    assert 0.4 < float(z.std()) < 0.6
    assert all(torch.equal(b, p) for b, p in zip(before, tr.model.parameters()))  # no step taken yet


def test_adversarial_example_of_i_depends_on_x_i_only():
    x, y = tiny_data(12)
    x2 = x.clone()
    x2[5] = -x2[5]                       # perturb example j = 5 only

    def run(model, xs):
        model.train()
        return craft(model, xs, y, sigma=0.5, mu_max=0.3, attacks=("fgsm", "pgd", "mim", "ifgsm"), steps=3,
                     generator=torch.Generator().manual_seed(3))
    model = tiny_model()
    a, b = run(model, x), run(model, x2)
    others = torch.arange(12) != 5
    assert torch.equal(a[others], b[others])
    assert not torch.equal(a[5], b[5])
    # negative control: a BatchNorm model (batch statistics) makes every row depend on example 5
    bn = tiny_model(norm_layer="batch")
    a, b = run(bn, x), run(bn, x2)
    assert not torch.equal(a[others], b[others])


def test_attack_stays_in_each_examples_ball_and_ensemble_is_used():
    x, y = tiny_data(400)
    adv = craft(tiny_model(), x, y, sigma=0.5, mu_max=0.3, attacks=("fgsm", "pgd"), steps=3,
                generator=torch.Generator().manual_seed(0))
    size = (adv - x).flatten(1).abs().amax(1)
    assert float(size.max()) <= 0.3 + 1e-6
    assert float(adv.abs().max()) <= 1.0
    # mu_i ~ U(0, 0.3): the sizes spread over the range (FGSM rows sit at mu_i exactly, up to clamping)
    assert 0.1 < float(size.mean()) < 0.2 and float(size.min()) < 0.03 and float(size.max()) > 0.27
    # control: mu_max 0 leaves every example unchanged
    same = craft(tiny_model(), x, y, sigma=0.5, mu_max=0.0, attacks=("fgsm", "pgd"), steps=3,
                 generator=torch.Generator().manual_seed(0))
    assert torch.equal(same, x)


def test_epsilon_is_the_accountants_for_the_steps_that_ran():
    x, y = tiny_data(200)
    cfg = tiny_config(noise_multiplier=None, epsilon=2.0, batch_size=20, epochs=2)
    tr = DPALSoundTrainer(tiny_model(), x, y, cfg)
    for _ in range(3):
        tr.train_step()
    q, sigma = tr.plan.sampling_rate, tr.noise_multiplier
    p = tr.privacy()
    assert p["steps"] == 3
    assert p["epsilon"] == pytest.approx(event_epsilon(subsampled_gaussian_event(q, sigma, 3), 1e-5, "rdp"), rel=1e-9)
    assert p["epsilon"] < 2.0
    tr = DPALSoundTrainer(tiny_model(), x, y, cfg)
    tr.fit()
    p = tr.privacy()
    assert p["steps"] == tr.plan.steps == 20
    full = event_epsilon(subsampled_gaussian_event(q, sigma, 20), 1e-5, "rdp")
    assert p["epsilon"] == pytest.approx(full, rel=1e-9) and full <= 2.0 + 1e-9
    assert p["epsilon_pld"] == pytest.approx(event_epsilon(subsampled_gaussian_event(q, sigma, 20), 1e-5, "pld"),
                                             rel=1e-9)
    # control: a smaller noise multiplier for the same steps costs more epsilon
    assert event_epsilon(subsampled_gaussian_event(q, sigma * 0.8, 20), 1e-5, "rdp") > 2.0


def test_non_private_mode_is_plain_adversarial_training():
    x, y = tiny_data()
    tr = DPALSoundTrainer(tiny_model(), x, y, tiny_config(noise_multiplier=None))
    assert tr.bookkeeper is None and not tr.config.private
    seen = {}
    orig = tr.paired_inputs
    tr.paired_inputs = lambda xb, yb: seen.setdefault("inp", orig(xb, yb))
    ref_model = tiny_model()
    ref_model.load_state_dict(tr.model.state_dict())
    idx = torch.arange(16)
    tr.forward_backward(x[idx], y[idx])
    ce = F.cross_entropy(ref_model(seen["inp"]), torch.cat([y[idx], y[idx]]), reduction="none")
    grads = torch.autograd.grad(((ce[:16] + 0.7 * ce[16:]) / 1.7).sum() / 16, list(ref_model.parameters()))
    for p, r in zip(tr.model.parameters(), grads):
        assert torch.allclose(p.grad, r, atol=1e-6)


def test_checkpoint_continues_bit_for_bit():
    """With the owner's key the continuation is bit for bit; with another key it is not (issue 48: the
    checkpoint holds the step, not the sampling and noise generators' states)."""
    from dpmech.privacy.secret import NoiseKey

    x, y = tiny_data()
    cfg = tiny_config(noise_multiplier=1.0)
    key = NoiseKey.fresh()
    a = DPALSoundTrainer(tiny_model(), x, y, cfg, noise_key=key)
    a.train_step()
    state = a.state_dict()
    assert "sample_gen" not in state and "noise_gen" not in state
    b = DPALSoundTrainer(tiny_model(seed=5), x, y, cfg, noise_key=key)
    b.load_state_dict(state)
    other = DPALSoundTrainer(tiny_model(seed=5), x, y, cfg)          # a fresh key: not the owner
    other.load_state_dict(state)
    a.train_step()
    b.train_step()
    other.train_step()
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    assert not all(torch.equal(p, q) for p, q in zip(a.model.parameters(), other.model.parameters()))


def test_invalid_configs_name_the_field():
    with pytest.raises(ValueError, match="noise_augmentation_sigma"):
        tiny_config(noise_augmentation_sigma=0.1)
    with pytest.raises(ValueError, match="clipping"):
        tiny_config(clipping="ghost")
    with pytest.raises(ValueError, match="attacks"):
        tiny_config(attacks=("fgsm", "cw"))
    with pytest.raises(ValueError, match="smoothing_sigma"):
        tiny_config(smoothing_sigma=0.0)


def test_certificate_is_randomized_smoothing_and_linf_is_l2_over_sqrt_d():
    x, y = tiny_data(40)
    model = tiny_model()
    out = evaluate(model, 0.5, x, y, seed=0, predict_n=50, cert_size=40, cert_n0=20, cert_n=200,
                   l2_radii=(0.1, 0.25), linf_sizes=(0.01, 0.02), pgd_sizes=(0.2,), pgd_size_n=8, pgd_steps=2,
                   eot_samples=2)
    # the same CERTIFY call (same generator stream) through dpmech.robustness.smoothing
    from dpmech.dpsgd.trainer import stream_seed
    res = smoothing.certify(model, 0.5, x, y.numpy(), n0=20, n=200, alpha=0.001,
                            generator=torch.Generator().manual_seed(stream_seed(0, 101)))
    # radius = sigma Phi^-1(p_lower) of the counts (Cohen et al. Thm 1), abstain when p_lower <= 1/2
    p_lower = smoothing.lower_confidence_bound(res.count_a, 200, 0.001)
    radius = np.where(p_lower > 0.5, 0.5 * norm.ppf(np.clip(p_lower, 1e-12, 1 - 1e-12)), 0.0)
    assert np.allclose(res.radius, radius)
    ok = res.correct & ~res.abstained
    for r in (0.1, 0.25):
        assert out[f"cert_l2_acc_{r}"] == pytest.approx(float((ok & (radius >= r)).mean()))
    for s in (0.01, 0.02):
        assert out[f"cert_linf_acc_{s}"] == pytest.approx(float((ok & (radius >= s * 8)).mean()))  # sqrt(64) = 8
    assert set(out) >= {"acc_clean_smoothed", "acc_pgd_0.2", "cert_abstain_rate"}


def test_trainable_runs_a_trial_and_reports_its_metrics(monkeypatch):
    """The dpal_sound trainable end to end on 512 MNIST images (Ray's report patched): its metrics are
    the ones the registry lists, epsilon is the ledger's and equals the planned event's."""
    from ray import tune

    from dpmech.privacy.accounting import epsilon as eps_of
    from sweeps.spec.space import reported_metrics
    from trainables.dpal_sound import DPALSoundTrialConfig, dpal_sound, privacy_event

    reports = []
    monkeypatch.setattr(tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(tune, "get_context", lambda: None)
    monkeypatch.setattr(tune, "report", lambda metrics, checkpoint=None: reports.append(metrics))
    config = {"epochs": 1, "train_size": 512, "test_size": 64, "batch_size": 64, "certify_images": 16,
              "certify_n": 50, "n_predict": 20, "attack_images": 8, "attack_steps": 2, "eot_samples": 2,
              "attacks": {"pgd": [0.2], "fgsm": [0.2]}}
    dpal_sound(config)
    final = reports[-1]
    full = {"trainable": "dpal_sound", **DPALSoundTrialConfig(**config).model_dump()}
    missing = reported_metrics("dpal_sound", full) - set(final)
    assert not missing, missing
    assert final["epsilon"] == pytest.approx(eps_of(privacy_event(DPALSoundTrialConfig(**config)), 1e-5, "rdp"))
    assert final["epsilon"] <= 2.0 and final["steps"] == 8
    assert 0 <= final["acc_worst_0.2"] <= min(final["acc_pgd_0.2"], final["acc_fgsm_0.2"])


@pytest.mark.parametrize("certifier", ["default", "smoothing"])
def test_a_trial_certifies_once_whatever_the_certifier(monkeypatch, certifier):
    """With ``certifier: smoothing`` the runtime's CERTIFY is the certificate; dpal_sound's own (the same
    model, sigma, images and N) is not run again; with ``default`` only its own runs."""
    from ray import tune

    from dpmech.robustness import smoothing
    from sweeps.spec.space import reported_metrics
    from trainables.dpal_sound import DPALSoundTrialConfig, dpal_sound

    reports, calls = [], []
    real = smoothing.certify
    monkeypatch.setattr(smoothing, "certify", lambda *a, **kw: (calls.append(kw["n"]), real(*a, **kw))[1])
    monkeypatch.setattr(tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(tune, "get_context", lambda: None)
    monkeypatch.setattr(tune, "report", lambda metrics, checkpoint=None: reports.append(metrics))
    config = {"epochs": 1, "train_size": 256, "test_size": 32, "batch_size": 64, "certify_images": 8,
              "certify_n": 50, "n_predict": 20, "attack_images": 4, "attack_steps": 1, "eot_samples": 1,
              "attacks": {"fgsm": [0.2]}, "certifier": certifier, "certify_sizes": [0.5]}
    dpal_sound(config)
    final = reports[-1]
    assert calls == [50]
    full = {"trainable": "dpal_sound", **DPALSoundTrialConfig(**config).model_dump()}
    expected = reported_metrics("dpal_sound", full)
    assert not expected - set(final), expected - set(final)
    own = {m for m in final if m.startswith(("cert_l2_acc_", "cert_linf_acc_"))}
    assert bool(own) == (certifier == "default")
    assert ("smooth_cert_acc_0.5" in final) == (certifier == "smoothing")
