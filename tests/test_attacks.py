"""Attacks: the ball, the domain, identities between attacks, strength, labels, EOT."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dpmech.attacks import ATTACKS, accuracy_under_attack, attack, fgsm, ifgsm, mim, pgd
from dpmech.noise_layer import NoiseLayer


def _blobs(n: int, seed: int):
    centres = torch.rand(4, 1, 6, 6, generator=torch.Generator().manual_seed(99)) * 1.2 - 0.6
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=gen)
    x = (centres[y] + 0.25 * torch.randn(n, 1, 6, 6, generator=gen)).clamp(-1, 1)
    return x, y


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 64), nn.ReLU(), nn.Linear(64, 4))
    x, y = _blobs(2000, 0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for p in model.parameters():
        p.grad = None
    model.eval()
    xt, yt = _blobs(400, 1)
    assert (model(xt).argmax(1) == yt).float().mean() > 0.95
    return model, xt, yt


def _run(name, model, x, eps, norm, **kw):
    if name == "pgd":
        kw.setdefault("generator", torch.Generator().manual_seed(0))
    return attack(name, model, x, eps=eps, norm=norm, **kw)


@pytest.mark.parametrize("name", ATTACKS)
@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_perturbation_within_ball_and_domain(trained, name, norm):
    model, x, _ = trained
    eps = 0.3 if norm == "linf" else 1.0
    adv = _run(name, model, x, eps, norm)
    d = (adv - x).flatten(1)
    if norm == "linf":
        assert d.abs().max().item() <= eps + 1e-6
    else:
        assert d.norm(dim=1).max().item() <= eps + 1e-5
    assert adv.min().item() >= -1.0 and adv.max().item() <= 1.0
    assert (adv != x).any()


@pytest.mark.parametrize("name", ATTACKS)
def test_size_zero_is_identity(trained, name):
    model, x, _ = trained
    assert torch.equal(_run(name, model, x, 0.0, "linf"), x)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_one_step_pgd_without_random_start_is_fgsm(trained, norm):
    model, x, _ = trained
    a = pgd(model, x, eps=0.2, steps=1, step_size=0.2, random_start=False, norm=norm)
    b = fgsm(model, x, eps=0.2, norm=norm)
    assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_mim_with_zero_decay_is_ifgsm(trained, norm):
    model, x, _ = trained
    a = mim(model, x, eps=0.3, steps=5, step_size=0.1, decay=0.0, norm=norm)
    b = ifgsm(model, x, eps=0.3, steps=5, step_size=0.1, norm=norm)
    assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("name", ["pgd", "ifgsm", "mim"])
def test_accuracy_never_increases_with_the_attack_size(trained, name):
    model, x, y = trained
    accs = []
    for eps in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5):
        kw = {"generator": torch.Generator().manual_seed(0)} if name == "pgd" else {}
        accs.append(accuracy_under_attack(model, x, y, name, eps, steps=20, **kw))
    assert all(b <= a + 1e-9 for a, b in zip(accs, accs[1:])), accs
    assert accs[-1] < accs[0] - 0.2  # the attacks do bite


def test_pgd_is_at_least_as_strong_as_fgsm(trained):
    model, x, y = trained
    for eps in (0.1, 0.2, 0.3):
        a_pgd = accuracy_under_attack(model, x, y, "pgd", eps, steps=20, generator=torch.Generator().manual_seed(1))
        a_fgsm = accuracy_under_attack(model, x, y, "fgsm", eps)
        assert a_pgd <= a_fgsm + 0.02


def test_without_labels_the_attack_uses_the_model_predictions(trained):
    model, x, y = trained
    pred = model(x).argmax(1)
    assert torch.equal(fgsm(model, x, eps=0.2), fgsm(model, x, pred, eps=0.2))
    wrong = (y + 1) % 4
    assert not torch.equal(fgsm(model, x, wrong, eps=0.2), fgsm(model, x, eps=0.2))


def test_eot_on_a_random_model_and_no_side_effects(trained):
    model, x, _ = trained
    noisy = nn.Sequential(NoiseLayer(0.6, seed=1), model)
    noisy.train()
    g1 = (fgsm(noisy, x, eps=0.1, eot_samples=1) - x).sign()
    g2 = (fgsm(noisy, x, eps=0.1, eot_samples=1) - x).sign()
    e1 = (fgsm(noisy, x, eps=0.1, eot_samples=32) - x).sign()
    e2 = (fgsm(noisy, x, eps=0.1, eot_samples=32) - x).sign()
    # averaging over noise draws makes the direction far more stable
    assert (e1 == e2).float().mean() > (g1 == g2).float().mean() + 0.03
    assert noisy.training  # mode left as found
    assert all(p.grad is None for p in noisy.parameters())


@pytest.mark.parametrize("kwargs,match", [
    (dict(eps=-0.1), "eps"), (dict(eps=float("nan")), "eps"), (dict(eps=True), "eps"), (dict(eps="0.1"), "eps"),
    (dict(eps=0.1, norm="l3"), "norm"), (dict(eps=0.1, steps=0), "steps"), (dict(eps=0.1, eot_samples=0), "eot_samples"),
    (dict(eps=0.1, domain=(1, -1)), "domain"),
])
def test_bad_parameters(trained, kwargs, match):
    model, x, _ = trained
    with pytest.raises(ValueError, match=match):
        ifgsm(model, x, **kwargs)


def test_bad_inputs(trained):
    model, x, _ = trained
    with pytest.raises(ValueError, match="attack"):
        attack("deepfool", model, x, eps=0.1)
    with pytest.raises(ValueError, match="x must"):
        fgsm(model, x[0], eps=0.1)
    with pytest.raises(ValueError, match="domain"):
        fgsm(model, x * 3, eps=0.1)
    with pytest.raises(ValueError, match="y must"):
        fgsm(model, x, torch.zeros(3, dtype=torch.long), eps=0.1)
    with pytest.raises(ValueError, match="generator"):
        pgd(model, x, eps=0.1)
