"""Attacks: the ball, the domain, exact identities between attacks, strength, labels, EOT,
side effects on the model, random starts, and input validation.

The model is a small MLP trained in about a second on four Gaussian blobs of 1x6x6 "images" in
[-1, 1] (no dataset download); every random draw has a fixed seed.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from dpmech.robustness import attacks as A
from dpmech.robustness.attacks import ATTACKS, accuracy_under_attack, attack, fgsm, ifgsm, mim, pgd

N_CLASSES = 4


def _blobs(n: int, seed: int):
    centres = torch.rand(N_CLASSES, 1, 6, 6, generator=torch.Generator().manual_seed(99)) * 1.2 - 0.6
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, N_CLASSES, (n,), generator=gen)
    x = (centres[y] + 0.25 * torch.randn(n, 1, 6, 6, generator=gen)).clamp(-1, 1)
    return x, y


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int = 150) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(epochs):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for p in model.parameters():
        p.grad = None
    return model.eval()


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(36, 64), nn.ReLU(), nn.Linear(64, N_CLASSES))
    _train(model, *_blobs(2000, 0))
    xt, yt = _blobs(400, 1)
    with torch.no_grad():
        assert (model(xt).argmax(1) == yt).float().mean() > 0.95
    return model, xt, yt


class GaussianNoise(nn.Module):
    """A random forward pass (as PixelDP's noise layer), drawn from its own generator."""

    def __init__(self, sigma: float, seed: int):
        super().__init__()
        self.sigma = sigma
        self.gen = torch.Generator().manual_seed(seed)

    def forward(self, x):
        return x + self.sigma * torch.randn(x.shape, generator=self.gen, dtype=x.dtype)


class Counting(nn.Module):
    """Counts forward passes of the wrapped model."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


RANDOM_START = ("pgd", "apgd_ce", "apgd_dlr")


def _run(name, model, x, eps, norm, y=None, **kw):
    if name.startswith("apgd"):
        kw.setdefault("steps", 10)  # APGD's default is 100 (AutoAttack); 10 keeps these tests fast
    if name in RANDOM_START:
        kw.setdefault("generator", _gen(0))
    return attack(name, model, x, y, eps=eps, norm=norm, **kw)


def _linf(d: torch.Tensor) -> torch.Tensor:
    return d.flatten(1).abs().amax(dim=1)


def _l2(d: torch.Tensor) -> torch.Tensor:
    return d.flatten(1).norm(dim=1)


# ----------------------------------------------------------------------------- the ball, the domain

@pytest.mark.parametrize("name", ATTACKS)
@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_perturbation_within_ball_and_domain(trained, name, norm):
    model, x, _ = trained
    eps = 0.3 if norm == "linf" else 1.0
    adv = _run(name, model, x, eps, norm)
    assert adv.shape == x.shape and adv.dtype == x.dtype and adv.device == x.device
    assert not adv.requires_grad
    d = adv - x
    if norm == "linf":
        assert _linf(d).max().item() <= eps + 1e-6
    else:
        assert _l2(d).max().item() <= eps + 1e-5
    assert adv.min().item() >= -1.0 and adv.max().item() <= 1.0
    # the attack actually moves almost every example, and some clamping at the domain happens
    assert (_linf(d) > 0).float().mean() > 0.95
    assert ((adv == 1.0) | (adv == -1.0)).any()


@pytest.mark.parametrize("name", ATTACKS)
@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_custom_domain_and_flat_inputs(trained, name, norm):
    """[N, D] inputs in a domain (0, 1): the ball and the domain hold there too."""
    model, x, _ = trained
    flat = nn.Sequential(nn.Linear(36, 36), nn.Tanh(), nn.Linear(36, N_CLASSES))
    torch.manual_seed(1)
    x01 = ((x.flatten(1) + 1) / 2)  # [N, 36] in [0, 1]
    eps = 0.1 if norm == "linf" else 0.5
    adv = _run(name, flat, x01, eps, norm, domain=(0.0, 1.0))
    assert adv.shape == x01.shape
    assert adv.min().item() >= 0.0 and adv.max().item() <= 1.0
    bound = _linf(adv - x01) if norm == "linf" else _l2(adv - x01)
    assert bound.max().item() <= eps + 1e-5


@pytest.mark.parametrize("name", ATTACKS)
@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_size_zero_is_the_identity(trained, name, norm):
    model, x, y = trained
    counting = Counting(model)
    for labels in (None, y):
        out = _run(name, counting, x, 0.0, norm, y=labels)
        assert torch.equal(out, x)
        assert out is not x  # a copy: the caller may modify it
    assert counting.calls == 0  # no forward pass either


# ----------------------------------------------------------------------------- exact identities

@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_one_step_pgd_without_random_start_is_fgsm(trained, norm):
    model, x, _ = trained
    a = pgd(model, x, eps=0.2, steps=1, step_size=0.2, random_start=False, norm=norm)
    b = fgsm(model, x, eps=0.2, norm=norm)
    assert torch.equal(a, b)  # the same code path, so bitwise equal


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_fgsm_is_one_full_step_along_the_direction(trained, norm):
    """FGSM against an explicit formula (the step is exactly eps long before clamping)."""
    model, x, _ = trained
    xa = x.clone().requires_grad_(True)
    loss = nn.functional.cross_entropy(model(xa), model(x).argmax(1), reduction="sum")
    (g,) = torch.autograd.grad(loss, xa)
    step = g.sign() if norm == "linf" else g / _l2(g).view(-1, 1, 1, 1)
    expected = (x + 0.2 * step).clamp(-1, 1)
    assert torch.allclose(fgsm(model, x, eps=0.2, norm=norm), expected, atol=1e-6)


@pytest.mark.parametrize("norm", ["linf", "l2"])
@pytest.mark.parametrize("steps", [1, 5])
def test_mim_with_zero_decay_is_ifgsm(trained, norm, steps):
    # sign(g / ||g||_1) = sign(g) and (g / ||g||_1) / ||g / ||g||_1||_2 = g / ||g||_2: with
    # decay 0 the momentum is a positive multiple of the current gradient, which the step
    # direction ignores; the implementation uses the raw gradient then, so equality is exact.
    model, x, _ = trained
    a = mim(model, x, eps=0.3, steps=steps, step_size=0.1, decay=0.0, norm=norm)
    b = ifgsm(model, x, eps=0.3, steps=steps, step_size=0.1, norm=norm)
    assert torch.equal(a, b)


def _reference_mim(model, x, y, eps, steps, step_size, decay, norm):
    """MI-FGSM written out example by example (Dong et al. 2018, Algorithm 1 + projection)."""
    out = []
    for xi, yi in zip(x, y):
        xi, g_acc, adv = xi[None], torch.zeros_like(xi[None]), xi[None].clone()
        for _ in range(steps):
            a = adv.clone().requires_grad_(True)
            loss = nn.functional.cross_entropy(model(a), yi[None])
            (g,) = torch.autograd.grad(loss, a)
            g_acc = decay * g_acc + g / g.abs().sum()
            step = g_acc.sign() if norm == "linf" else g_acc / g_acc.norm()
            delta = adv + step_size * step - xi
            if norm == "linf":
                delta = delta.clamp(-eps, eps)
            elif delta.norm() > eps:
                delta = delta * (eps / delta.norm())
            adv = (xi + delta).clamp(-1, 1).detach()
        out.append(adv)
    return torch.cat(out)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_mim_matches_a_per_example_reference(trained, norm):
    model, x, _ = trained
    x = x[:40]
    y = model(x).argmax(1)
    eps, steps, step = (0.3, 6, 0.08) if norm == "linf" else (1.0, 6, 0.3)
    got = mim(model, x, eps=eps, steps=steps, step_size=step, decay=1.0, norm=norm)
    ref = _reference_mim(model, x, y, eps, steps, step, 1.0, norm)
    assert torch.allclose(got, ref, atol=1e-5)


def test_default_step_size(trained):
    model, x, _ = trained
    assert A.default_step_size(0.3, 10) == pytest.approx(0.075)
    for fn in (ifgsm, mim):
        assert torch.equal(fn(model, x, eps=0.3, steps=4), fn(model, x, eps=0.3, steps=4, step_size=2.5 * 0.3 / 4))
    assert torch.equal(pgd(model, x, eps=0.3, steps=4, generator=_gen(3)),
                       pgd(model, x, eps=0.3, steps=4, step_size=2.5 * 0.3 / 4, generator=_gen(3)))


# ----------------------------------------------------------------------------- strength

@pytest.mark.parametrize("name", ["pgd", "ifgsm", "mim"])
@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_accuracy_never_increases_with_the_attack_size(trained, name, norm):
    # Not a theorem: the attacks are local searches on a non-convex loss and a larger ball
    # changes the whole trajectory (the default step grows with eps). It holds here, with no
    # tolerance, because the network is nearly piecewise-linear on well-separated blobs, so a
    # larger step along the same signs only pushes examples further across the boundary.
    model, x, y = trained
    grid = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5) if norm == "linf" else (0.0, 0.25, 0.5, 1.0, 1.5, 2.5)
    accs = []
    for eps in grid:
        kw = {"generator": _gen(0)} if name in RANDOM_START else {}
        accs.append(accuracy_under_attack(model, x, y, name, eps, steps=20, norm=norm, **kw))
    assert all(b <= a for a, b in zip(accs, accs[1:])), accs
    assert accs[0] > 0.95 and accs[-1] < accs[0] - 0.3, accs  # the attacks do bite


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_pgd_is_at_least_as_strong_as_fgsm(trained, norm):
    model, x, y = trained
    sizes = (0.1, 0.2, 0.3) if norm == "linf" else (0.5, 1.0, 1.5)
    for eps in sizes:
        a_pgd = accuracy_under_attack(model, x, y, "pgd", eps, steps=20, norm=norm, generator=_gen(1))
        a_fgsm = accuracy_under_attack(model, x, y, "fgsm", eps, norm=norm)
        assert a_pgd <= a_fgsm + 0.02, (eps, a_pgd, a_fgsm)


# ----------------------------------------------------------------------------- labels

@pytest.mark.parametrize("name", ATTACKS)
def test_without_labels_the_attack_uses_the_model_predictions(trained, name):
    model, x, y = trained
    with torch.no_grad():
        pred = model(x).argmax(1)
    unlabelled = _run(name, model, x, 0.2, "linf")
    assert torch.equal(unlabelled, _run(name, model, x, 0.2, "linf", y=pred))
    # labels that differ from the predictions on a few examples change exactly those examples
    other = pred.clone()
    other[:10] = (other[:10] + 1) % N_CLASSES
    relabelled = _run(name, model, x, 0.2, "linf", y=other)
    changed = (relabelled != unlabelled).flatten(1).any(1)
    assert changed[:10].all()
    if name != "pgd":  # PGD's random start draws the whole batch at once, so all rows match too
        assert not changed[10:].any()


def test_accuracy_under_attack_labels_and_batching(trained):
    model, x, y = trained
    with torch.no_grad():
        pred = model(x).argmax(1)
        clean = (pred == y).float().mean().item()
    # size 0: the clean accuracy, measured against the true labels
    assert accuracy_under_attack(model, x, y, "ifgsm", 0.0) == pytest.approx(clean)
    for use_true, labels in ((False, pred), (True, y)):
        adv = ifgsm(model, x, labels, eps=0.15, steps=5)
        with torch.no_grad():
            expected = (model(adv).argmax(1) == y).float().mean().item()
        got = accuracy_under_attack(model, x, y, "ifgsm", 0.15, steps=5, use_true_labels=use_true)
        assert got == pytest.approx(expected)
        # batching does not change a deterministic attack
        assert accuracy_under_attack(model, x, y, "bim", 0.15, steps=5, use_true_labels=use_true,
                                     batch_size=64) == pytest.approx(expected)


def test_aliases(trained):
    model, x, _ = trained
    assert torch.equal(attack("bim", model, x, eps=0.1, steps=3), ifgsm(model, x, eps=0.1, steps=3))
    assert torch.equal(attack("madry", model, x, eps=0.1, steps=3, generator=_gen(2)),
                       pgd(model, x, eps=0.1, steps=3, generator=_gen(2)))


# ----------------------------------------------------------------------------- random start

@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_pgd_random_start_is_reproducible_from_the_generator(trained, norm):
    model, x, _ = trained
    eps = 0.3 if norm == "linf" else 1.0
    a = pgd(model, x, eps=eps, steps=2, norm=norm, generator=_gen(5))
    b = pgd(model, x, eps=eps, steps=2, norm=norm, generator=_gen(5))
    c = pgd(model, x, eps=eps, steps=2, norm=norm, generator=_gen(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    state = torch.random.get_rng_state()
    pgd(model, x, eps=eps, steps=2, norm=norm, generator=_gen(5))
    assert torch.equal(state, torch.random.get_rng_state())  # the global generator is not used


def test_random_start_l2_radius_is_uniform_in_zero_eps():
    # torchattacks' PGDL2 start (issue 18): with a domain far larger than the ball no clamping
    # happens; the radius R is uniform in [0, eps] and the direction isotropic.
    n, d, eps = 4000, 36, 0.7
    x = torch.zeros(n, 1, 6, 6)
    delta = A._random_start(x, eps, "l2", (-10.0, 10.0), _gen(11)) - x
    r = _l2(delta).double()
    assert r.max().item() <= eps + 1e-6
    assert stats.kstest((r / eps).numpy(), "uniform").pvalue > 1e-3
    # negative control: a point uniform in the ball's volume ((R / eps)^d uniform, the old start)
    # is rejected: its radius piles up at eps
    volume = eps * torch.rand(n, generator=_gen(12), dtype=torch.float64) ** (1 / d)
    assert stats.kstest((volume / eps).numpy(), "uniform").pvalue < 1e-6
    unit = delta.flatten(1) / r.float().view(-1, 1)
    assert unit.mean(0).abs().max().item() < 4 / math.sqrt(n)  # mean direction ~ 0
    # each coordinate of an isotropic unit vector has variance 1/d
    assert np.allclose(unit.var(0).numpy(), 1 / d, rtol=0.15)


def test_random_start_is_uniform_in_the_linf_ball():
    eps = 0.25
    x = torch.zeros(2000, 36)
    delta = (A._random_start(x, eps, "linf", (-10.0, 10.0), _gen(13)) - x).flatten()
    assert delta.abs().max().item() <= eps
    assert stats.kstest(((delta.double() + eps) / (2 * eps)).numpy(), "uniform").pvalue > 1e-3


def test_random_start_is_clamped_to_the_domain(trained):
    _, x, _ = trained
    start = A._random_start(x, 0.5, "linf", (-1.0, 1.0), _gen(0))
    assert start.min().item() >= -1.0 and start.max().item() <= 1.0
    assert _linf(start - x).max().item() <= 0.5 + 1e-6


# ----------------------------------------------------------------------------- EOT, side effects

def test_eot_averages_over_the_forward_passes(trained):
    model, x, _ = trained
    counting = Counting(model)
    fgsm(counting, x, eps=0.1, eot_samples=5)
    assert counting.calls == 5 + 5  # labels from 5 passes, then one 5-pass gradient
    counting.calls = 0
    ifgsm(counting, x, x.new_zeros(x.shape[0], dtype=torch.long), eps=0.1, steps=3, eot_samples=4)
    assert counting.calls == 3 * 4  # labels given: no prediction pass


def test_eot_reduces_the_gradient_variance(trained):
    model, x, _ = trained
    x = x[:100]
    noisy = nn.Sequential(GaussianNoise(0.6, seed=1), model)
    y = model(x).argmax(1)

    def spread(k: int) -> float:
        gs = torch.stack([A._loss_grad(noisy, x, y, k) for _ in range(12)])
        return gs.var(0).mean().item()

    ratio = spread(16) / spread(1)
    assert 1 / 32 < ratio < 1 / 8  # about 1/16: the mean of 16 independent draws

    # and two FGSM runs agree on more signs with EOT (coordinates whose expected gradient is
    # about 0 stay random, so the gain is modest; a wide domain keeps clamping out of it)
    def agreement(k: int) -> float:
        a, b = (fgsm(noisy, x, y, eps=0.1, eot_samples=k, domain=(-5.0, 5.0)) - x for _ in range(2))
        return (a.sign() == b.sign()).float().mean().item()

    assert agreement(32) > agreement(1) + 0.03


@pytest.mark.parametrize("name", ATTACKS)
def test_eot_on_a_random_model_runs_within_the_ball(trained, name):
    model, x, _ = trained
    noisy = nn.Sequential(GaussianNoise(0.6, seed=2), model)
    adv = _run(name, noisy, x, 0.2, "linf", eot_samples=4, steps=3) if name != "fgsm" else \
        _run(name, noisy, x, 0.2, "linf", eot_samples=4)
    assert _linf(adv - x).max().item() <= 0.2 + 1e-6 and torch.isfinite(adv).all()


@pytest.mark.parametrize("name", ATTACKS)
def test_the_model_is_left_as_found(trained, name):
    model, x, _ = trained
    # mixed modes: the outer module trains, a frozen inner block is in eval mode
    inner = nn.Sequential(nn.Dropout(0.1), model)
    outer = nn.Sequential(nn.Identity(), inner)
    outer.train()
    model.eval()
    modes = [m.training for m in outer.modules()]
    before = {k: p.clone() for k, p in outer.state_dict().items()}
    sentinel = [torch.full_like(p, 7.0) for p in outer.parameters()]
    for p, s in zip(outer.parameters(), sentinel):
        p.grad = s.clone()
    _run(name, outer, x, 0.2, "l2", eot_samples=2)
    assert [m.training for m in outer.modules()] == modes
    assert all(torch.equal(p.grad, s) for p, s in zip(outer.parameters(), sentinel))
    assert all(torch.equal(before[k], p) for k, p in outer.state_dict().items())
    for p in outer.parameters():
        p.grad = None
    _run(name, outer, x, 0.2, "linf")
    assert all(p.grad is None for p in outer.parameters())
    model.eval()


def test_works_inside_no_grad_and_with_an_input_that_requires_grad(trained):
    model, x, _ = trained
    ref = ifgsm(model, x, eps=0.1, steps=3)
    with torch.no_grad():
        assert torch.equal(ifgsm(model, x, eps=0.1, steps=3), ref)
    xg = x.clone().requires_grad_(True)
    out = ifgsm(model, xg, eps=0.1, steps=3)
    assert torch.equal(out, ref) and not out.requires_grad and xg.grad is None


@pytest.mark.parametrize("name", ATTACKS)
@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_a_zero_gradient_gives_no_step_and_no_nan(name, norm):
    """A model that ignores its input: zero gradient, no NaN, no move (bar PGD's start)."""
    torch.manual_seed(0)
    const = nn.Sequential(nn.Flatten(), nn.Linear(36, N_CLASSES))
    with torch.no_grad():
        const[1].weight.zero_()
    x, _ = _blobs(20, 3)
    out = _run(name, const, x, 0.2, norm, random_start=False) if name in RANDOM_START else _run(name, const, x, 0.2, norm)
    assert torch.equal(out, x)
    start = pgd(const, x, eps=0.2, norm=norm, generator=_gen(0))
    assert torch.isfinite(start).all()


def test_tiny_gradients_still_give_unit_l2_steps():
    """Gradients of order 1e-30 (whose squares underflow in float32) are normalised correctly."""
    g = torch.randn(8, 36, generator=_gen(4)) * 1e-30
    d = A._direction(g, "l2")
    assert torch.allclose(_l2(d), torch.ones(8), atol=1e-6)
    n1 = A._normalise(g, 1)
    assert torch.allclose(n1.abs().sum(1), torch.ones(8), atol=1e-6)
    assert torch.equal(A._direction(torch.zeros(3, 4), "l2"), torch.zeros(3, 4))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-20, 1e6), eps=st.floats(1e-4, 10.0),
       norm=st.sampled_from(["linf", "l2"]))
def test_projection_and_direction_properties(seed, scale, eps, norm):
    """The projection lands in the ball, fixes points already inside and is idempotent; the
    direction has unit norm (dual-norm sense: sign for l-inf) at any gradient scale."""
    delta = torch.randn(6, 3, 2, 2, generator=_gen(seed), dtype=torch.float64) * scale
    p = A._project(delta, eps, norm)
    size = _linf(p) if norm == "linf" else _l2(p)
    assert (size <= eps * (1 + 1e-12)).all()
    assert torch.allclose(A._project(p, eps, norm), p, rtol=1e-12, atol=0)
    inside = delta / ((_linf(delta) if norm == "linf" else _l2(delta)).view(-1, 1, 1, 1) / (0.5 * eps))
    assert torch.equal(A._project(inside, eps, norm), inside)
    d = A._direction(delta, norm)
    if norm == "linf":
        assert torch.equal(d, delta.sign())
    else:
        assert torch.allclose(_l2(d), torch.ones(6, dtype=torch.float64))
        assert torch.allclose(d, delta / _l2(delta).view(-1, 1, 1, 1))


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs,message", [
    (dict(eps=-0.1), "eps must be >= 0, got -0.1"),
    (dict(eps=float("nan")), "eps must not be NaN"),
    (dict(eps=float("inf")), "eps must be finite"),
    (dict(eps=True), "eps must be a real number"),
    (dict(eps="0.1"), "eps must be a real number"),
    (dict(eps=None), "eps must be a real number"),
    (dict(eps=0.1, norm="l3"), "norm must be one of 'linf', 'l2'; got 'l3'"),
    (dict(eps=0.1, steps=0), "steps must be >= 1, got 0"),
    (dict(eps=0.1, steps=2.0), "steps must be an integer"),
    (dict(eps=0.1, steps=True), "steps must be an integer"),
    (dict(eps=0.1, step_size=0.0), "step_size must be > 0"),
    (dict(eps=0.1, step_size=-1.0), "step_size must be > 0"),
    (dict(eps=0.1, eot_samples=0), "eot_samples must be >= 1"),
    (dict(eps=0.1, domain=(1, -1)), "domain must have low < high"),
    (dict(eps=0.1, domain=(0.0,)), "domain must be a pair"),
    (dict(eps=0.1, domain=(0.0, float("nan"))), "domain[1] must not be NaN"),
])
def test_bad_parameters(trained, kwargs, message):
    model, x, _ = trained
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        ifgsm(model, x, **kwargs)


@pytest.mark.parametrize("call,match", [
    (lambda m, x: mim(m, x, eps=0.1, decay=-0.5), "^decay must be >= 0"),
    (lambda m, x: pgd(m, x, eps=0.1), "^generator must be a torch.Generator"),
    (lambda m, x: pgd(m, x, eps=0.1, generator=0), "^generator must be a torch.Generator"),
    (lambda m, x: pgd(m, x, eps=0.1, random_start="yes", generator=_gen()), "^random_start must be a bool"),
    (lambda m, x: attack("deepfool", m, x, eps=0.1), "^attack must be one of"),
    (lambda m, x: attack(3, m, x, eps=0.1), "^attack must be a string"),
    (lambda m, x: attack("fgsm", m, x, eps=0.1, steps=3), "^steps is not a parameter of attack 'fgsm'"),
    (lambda m, x: fgsm(m, x[0], eps=0.1), r"^x must have shape \[N, C, H, W\] or \[N, D\]"),
    (lambda m, x: fgsm(m, x[:, 0], eps=0.1), r"^x must have shape"),
    (lambda m, x: fgsm(m, x[:0], eps=0.1), r"^x must have shape .* N > 0"),
    (lambda m, x: fgsm(m, (x * 100).long(), eps=0.1), "^x must be a floating-point tensor"),
    (lambda m, x: fgsm(m, x.numpy(), eps=0.1), "^x must be a floating-point tensor"),
    (lambda m, x: fgsm(m, x * 3, eps=0.1), r"^x must lie in the domain \[-1, 1\]"),
    (lambda m, x: fgsm(m, x, eps=0.1, domain=(0.0, 1.0)), r"^x must lie in the domain \[0, 1\]"),
    (lambda m, x: fgsm(m, torch.where(x > 0.5, float("nan"), x), eps=0.1), "^x must be finite"),
    (lambda m, x: fgsm(m, x, torch.zeros(3, dtype=torch.long), eps=0.1), r"^y must have shape \[400\]"),
    (lambda m, x: fgsm(m, x, torch.zeros(400), eps=0.1), "^y must be an integer tensor"),
    (lambda m, x: fgsm(m, x, torch.full((400,), -1), eps=0.1), "^y must hold class indices >= 0"),
    (lambda m, x: fgsm(m, x, torch.full((400,), N_CLASSES), eps=0.1), "^y must hold class indices < 4"),
    (lambda m, x: fgsm(lambda t: t.flatten(1).sum(1), x, eps=0.1), r"^model must return logits of shape \[N, K"),
])
def test_bad_inputs(trained, call, match):
    model, x, _ = trained
    with pytest.raises(ValueError, match=match):
        call(model, x)


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="cw"), "^attack must be one of"),
    (dict(eps=-1.0), "^eps must be >= 0"),
    (dict(batch_size=0), "^batch_size must be >= 1"),
    (dict(use_true_labels="no"), "^use_true_labels must be a bool"),
    (dict(y=torch.zeros(5, dtype=torch.long)), r"^y must have shape \[400\]"),
])
def test_bad_accuracy_under_attack_arguments(trained, kwargs, match):
    model, x, y = trained
    args = dict(name="fgsm", eps=0.1, y=y)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        accuracy_under_attack(model, x, args.pop("y"), args.pop("name"), args.pop("eps"), **args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ATTACKS)
def test_on_the_inputs_device(trained, name):
    """Batches stay on x's device; PGD's generator may live on the CPU."""
    model, x, y = trained
    gpu = torch.nn.Sequential(*[m for m in model]).to("cuda")
    xg = x.to("cuda")
    adv = _run(name, gpu, xg, 0.2, "linf", y=y)  # labels on the CPU are moved too
    assert adv.device == xg.device
    assert _linf(adv - xg).max().item() <= 0.2 + 1e-6
    assert 0.0 <= accuracy_under_attack(gpu, x, y, name, 0.2, **({"generator": _gen()} if name == "pgd" else {})) <= 1.0
