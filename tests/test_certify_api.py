"""The certifiers as a library (issue 18, points 1-5): any noisy module, one call from counts,
one confidence convention (alpha; eta deprecated), explicit generators and kept counts, single
images."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from dpmech.robustness import smoothing
from dpmech.robustness.certification import (argmax_bounds, certified_size, certify, certify_counts, hoeffding_bounds,
                                             max_epsilon, top_and_runner_up)
from dpmech.robustness.noise_layer import NoiseLayer, pixeldp_noise_scale


class NoisyLinear(nn.Module):
    """An ordinary module that adds Gaussian noise to its input in forward (no PixelDP interface)."""

    def __init__(self, w: torch.Tensor, b: float, sigma: float):
        super().__init__()
        self.sigma = sigma
        self.lin = nn.Linear(w.numel(), 2)
        with torch.no_grad():
            self.lin.weight.copy_(torch.stack([w, torch.zeros_like(w)]))
            self.lin.bias.copy_(torch.tensor([b, 0.0]))

    def forward(self, x):
        return self.lin(x + self.sigma * torch.randn_like(x))


class LinearPixelDP(nn.Module):
    """The same classifier behind PixelDP's interface (pre_noise, noise layer, post_noise)."""

    norm = "l2"

    def __init__(self, lin: nn.Linear, sigma: float):
        super().__init__()
        self.lin = lin
        self.noise = NoiseLayer(sigma, "l2", seed=3)

    def pre_noise(self, x):
        return x

    def post_noise(self, h):
        return self.lin(h)

    def forward(self, x):
        return self.post_noise(self.noise(x))

    def sensitivity_exact(self):
        return 1.0


def _setup(n=200, d=6, sigma=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d, generator=g)
    x = torch.rand(n, d, generator=g) * 2 - 1
    margin = x @ w + 0.1
    return NoisyLinear(w, 0.1, sigma), x, (margin <= 0).long(), (margin.abs() / w.norm()).numpy()


def test_any_noisy_module_is_certified_soundly():
    model, x, y, radius = _setup()
    res = certify(model, x, y, n=1000, mechanism="gaussian", noise_scale=0.3, generator=torch.Generator().manual_seed(1))
    agree = res.correct
    assert agree.mean() > 0.9 and (res.certified_size > 0).mean() > 0.3
    assert np.all(res.certified_size[agree] <= radius[agree] + 1e-9)
    # the same draws through PixelDP's fast path certify the same sizes up to Monte Carlo noise
    pdp = certify(LinearPixelDP(model.lin, 0.3), x, y, n=1000, generator=torch.Generator().manual_seed(1))
    assert abs((pdp.certified_size > 0).mean() - (res.certified_size > 0).mean()) < 0.1
    # negative control: a 10x too small noise scale claims sizes beyond the true radius
    bad = certify(model, x, y, n=1000, mechanism="gaussian", noise_scale=3.0, generator=torch.Generator().manual_seed(1))
    assert np.any(bad.certified_size[agree] > radius[agree])


def test_generic_module_needs_mechanism_and_a_random_forward_pass():
    model, x, y, _ = _setup(n=4)
    with pytest.raises(ValueError, match="^mechanism: "):
        certify(model, x, y, n=10)
    with pytest.raises(ValueError, match="mechanism"):
        certify(model, x, y, n=10, mechanism="cauchy", noise_scale=0.3)
    with pytest.raises(ValueError, match="^model: its forward pass is deterministic"):
        certify(model.lin, x, y, n=10, mechanism="gaussian", noise_scale=0.3)


def test_explicit_generator_replays_and_counts_are_kept():
    model, x, y, _ = _setup(n=30)
    state = torch.get_rng_state()
    a = certify(model, x, y, n=200, mechanism="gaussian", noise_scale=0.3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(state, torch.get_rng_state())  # the caller's global RNG is untouched
    b = certify(model, x, y, n=200, mechanism="gaussian", noise_scale=0.3, generator=torch.Generator().manual_seed(5))
    c = certify(model, x, y, n=200, mechanism="gaussian", noise_scale=0.3, generator=torch.Generator().manual_seed(6))
    assert a.counts.shape == (30, 2) and (a.counts.sum(1) == 200).all()
    assert np.array_equal(a.counts, b.counts) and not np.array_equal(a.counts, c.counts)
    # PixelDP path: the layer's own generator state does not matter, only the one passed in
    net = LinearPixelDP(model.lin, 0.3)
    p1 = certify(net, x, y, n=200, generator=torch.Generator().manual_seed(5))
    net.noise.sample(torch.zeros(1000))  # advance the layer's internal streams
    p2 = certify(net, x, y, n=200, generator=torch.Generator().manual_seed(5))
    p3 = certify(net, x, y, n=200, generator=torch.Generator().manual_seed(7))
    assert np.array_equal(p1.counts, p2.counts) and not np.array_equal(p1.counts, p3.counts)
    # the kept counts reproduce the sizes in one call
    again = certify_counts(p1.counts, y, alpha=p1.alpha, noise_scale=p1.noise_scale, sensitivity=p1.sensitivity)
    assert np.array_equal(again.certified_size, p1.certified_size)


def test_one_call_from_raw_counts_and_mechanism_parameters():
    counts = np.array([[950, 30, 20], [400, 350, 250], [0, 1000, 0]])
    lo, hi = argmax_bounds(counts, alpha=0.05)  # raw counts: no AttributeError
    assert lo.shape == (3, 3) and np.all(lo <= counts / 1000) and np.all(hi >= counts / 1000)
    hoeffding_bounds(counts, alpha=0.05)
    eps, delta, L = 1.0, 0.05, 0.1
    by_params = certify_counts(counts, epsilon=eps, delta=delta, attack_bound=L)
    by_scale = certify_counts(counts, noise_scale=pixeldp_noise_scale(eps, delta, L))
    assert np.array_equal(by_params.certified_size, by_scale.certified_size)
    assert by_params.prediction.tolist() == [0, 0, 1]
    assert by_params.certified_size[0] > 0 and by_params.certified_size[1] == 0
    k, lb, ub = top_and_runner_up(lo, hi, counts)
    assert np.array_equal(certified_size(lb, ub, epsilon=eps, delta=delta, attack_bound=L), by_params.certified_size)
    # l1 / Laplace from parameters: b = L / eps, size = b eps' / Delta
    l1 = certified_size(lb, ub, epsilon=eps, attack_bound=L, norm="l1")
    assert l1[0] == pytest.approx(L / eps * max_epsilon(lb[:1], ub[:1], 0.0)[0])
    with pytest.raises(ValueError, match="^noise_scale: "):
        certified_size(lb, ub, epsilon=eps, attack_bound=L)  # l2 needs delta too
    with pytest.raises(ValueError, match="^noise_scale: "):
        certified_size(lb, ub, noise_scale=0.5, epsilon=eps, delta=delta, attack_bound=L)
    with pytest.raises(ValueError, match="^counts: "):
        argmax_bounds(np.array([[5, 5], [3, 4]]), alpha=0.05)  # rows with different n


def test_alpha_is_the_one_convention_and_eta_is_deprecated():
    counts = np.array([[900, 100], [600, 400]])
    new = argmax_bounds(counts, alpha=0.1)
    with pytest.warns(DeprecationWarning, match="alpha = 1 - eta"):
        old = argmax_bounds(counts, eta=0.9)
    assert np.array_equal(new[0], old[0]) and np.array_equal(new[1], old[1])
    with pytest.raises(ValueError, match="^alpha: "):
        argmax_bounds(counts, alpha=0.1, eta=0.9)
    with pytest.raises(TypeError):  # the old positional confidence is refused, never read as alpha
        argmax_bounds(counts, 0.95)
    model, x, y, _ = _setup(n=10)
    kw = dict(n=100, mechanism="gaussian", noise_scale=0.3)
    with pytest.warns(DeprecationWarning):
        r_eta = certify(model, x, y, eta=0.9, generator=torch.Generator().manual_seed(0), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r_alpha = certify(model, x, y, alpha=0.1, generator=torch.Generator().manual_seed(0), **kw)
    assert r_eta.alpha == pytest.approx(0.1) and r_alpha.alpha == 0.1
    assert np.array_equal(r_eta.certified_size, r_alpha.certified_size)


def test_single_image_is_accepted_by_both_certifiers():
    base = nn.Sequential(nn.Flatten(), nn.Linear(2 * 5 * 5, 3))
    torch.manual_seed(0)
    img = torch.rand(2, 5, 5) * 2 - 1
    one = smoothing.certify(base, 0.25, img, 1, n0=20, n=100, alpha=0.01, generator=torch.Generator().manual_seed(2))
    batch = smoothing.certify(base, 0.25, img[None], torch.tensor([1]), n0=20, n=100, alpha=0.01,
                              generator=torch.Generator().manual_seed(2))
    assert one.prediction.shape == (1,) and np.array_equal(one.counts, batch.counts)
    assert one.counts.sum() == 100 and one.counts0.sum() == 20
    pred = smoothing.predict(base, 0.25, img, n=50, alpha=0.01, generator=torch.Generator().manual_seed(2))
    assert pred.shape == (1,)
    with pytest.raises(ValueError, match=r"^x must be a batch \[N, C, H, W\]"):
        smoothing.certify(base, 0.25, img[None, None], generator=torch.Generator())

    from dpmech.networks.pixeldp import PixelDPCNN

    net = PixelDPCNN(0.5, seed=0)
    res = certify(net, torch.zeros(1, 28, 28), 3, n=8, generator=torch.Generator().manual_seed(0))
    assert res.counts.shape == (1, 10)
