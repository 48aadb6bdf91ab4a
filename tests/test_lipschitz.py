"""dpmech.lipschitz: the layers' bounds are upper bounds, the network's claimed Lipschitz constant is never
exceeded, and the deterministic certificate holds (exhaustively in 2-D, against PGD on real 8x8 digits);
negative controls: a network whose constant is understated is caught."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from dpmech.lipschitz.bounds import conv_norm_bound, dense_norm_bound, power_iteration_lower_bound
from dpmech.lipschitz.certify import certify
from dpmech.lipschitz.layers import (
    Flatten,
    GroupSort2,
    InputClip,
    L2NormPool2d,
    LipschitzConv2d,
    LipschitzDense,
)
from dpmech.lipschitz.network import LipschitzSequential, lipschitz_mlp, mnist_lipschitz_cnn
from dpmech.lipschitz.trainer import LipschitzDPConfig, LipschitzDPTrainer
from dpmech.privacy.secret import NoiseKey


class Understated(nn.Module):
    """The negative control: multiplies by ``factor`` and claims Lipschitz 1 (a lie)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return self.factor * x

    def lipschitz_bound(self) -> float:
        return 1.0


def tiny_cnn(seed=0, lie: float | None = None):
    gen = torch.Generator().manual_seed(seed)
    layers = [InputClip(-1.0, 8.0), LipschitzConv2d(1, 8, 3, (8, 8), generator=gen), GroupSort2(), L2NormPool2d(2),
              Flatten(), LipschitzDense(128, 64, generator=gen), GroupSort2()]
    if lie is not None:
        layers.append(Understated(lie))
    layers.append(LipschitzDense(64, 10, generator=gen))
    return LipschitzSequential(*layers)


def conv_matrix(kernel, hw, padding):
    """The exact matrix of conv2d(., kernel, padding) on [c_in, h, w] inputs (columns: basis images)."""
    c_in = kernel.shape[1]
    eye = torch.eye(c_in * hw[0] * hw[1], dtype=torch.float64).view(-1, c_in, *hw)
    return torch.nn.functional.conv2d(eye, kernel.double(), padding=padding).flatten(1).t()


def test_dense_bound_is_an_upper_bound_and_tight():
    gen = torch.Generator().manual_seed(0)
    for shape in [(10, 3), (3, 10), (64, 200), (256, 1568)]:
        w = torch.randn(shape, generator=gen)
        exact = float(torch.linalg.matrix_norm(w.double(), ord=2))
        bound = dense_norm_bound(w)
        assert exact <= bound <= exact * (1 + 2e-6)


def test_conv_bound_is_an_upper_bound_of_the_exact_operator_norm_and_power_iteration_is_not():
    gen = torch.Generator().manual_seed(1)
    for c_in, c_out, hw, pad in [(1, 4, (6, 6), 1), (2, 3, (5, 7), 1), (3, 2, (6, 6), 0), (2, 2, (8, 8), 2)]:
        k = torch.randn(c_out, c_in, 3 if pad < 2 else 5, 3 if pad < 2 else 5, generator=gen)
        exact = float(torch.linalg.matrix_norm(conv_matrix(k, hw, pad), ord=2))
        bound = conv_norm_bound(k, hw, (pad, pad))
        assert exact <= bound <= exact * 1.35            # sound; the circular operator is a little looser
    # control: a few power iterations under-estimate the norm (why the layers never normalise by them)
    k = torch.randn(4, 4, 3, 3, generator=gen)
    exact = float(torch.linalg.matrix_norm(conv_matrix(k, (6, 6), 1), ord=2))
    low = power_iteration_lower_bound(lambda v: torch.nn.functional.conv2d(v, k.double(), padding=1), (4, 6, 6),
                                      iters=2, generator=torch.Generator().manual_seed(0))
    assert low < exact * 0.999


def test_projected_layers_claim_at_most_one_and_the_claim_holds():
    gen = torch.Generator().manual_seed(2)
    dense = LipschitzDense(30, 20, bjorck_iters=3, generator=gen)
    conv = LipschitzConv2d(2, 4, 3, (6, 6), generator=gen)
    with torch.no_grad():
        dense.weight.mul_(7.0)
        conv.weight.mul_(7.0)
    dense.project_()
    conv.project_()
    assert dense.lipschitz_bound() <= 1 + 1e-5 and conv.lipschitz_bound() <= 1 + 1e-5
    assert float(torch.linalg.matrix_norm(dense.weight.detach().double(), ord=2)) <= dense.lipschitz_bound()
    assert float(torch.linalg.matrix_norm(conv_matrix(conv.weight.detach(), (6, 6), 1), ord=2)) <= conv.lipschitz_bound()


def worst_ratio(model, shape, n=512, steps=150, seed=0, scale=1.0):
    """The largest ||f(x) - f(x')|| / ||x - x'|| found: random pairs, then gradient ascent on the ratio."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.rand(n, *shape, generator=gen) * 2 - 1) * scale
    x2 = x + 0.3 * torch.randn(n, *shape, generator=gen)
    a, b = x.clone().requires_grad_(True), x2.clone().requires_grad_(True)
    opt = torch.optim.Adam([a, b], lr=0.02)
    best = 0.0
    for _ in range(steps):
        ratio = (model(a) - model(b)).flatten(1).norm(dim=1) / (a - b).flatten(1).norm(dim=1).clamp_min(1e-9)
        best = max(best, float(ratio.detach().max()))
        opt.zero_grad()
        (-ratio.sum()).backward()
        opt.step()
    return best


def test_true_lipschitz_constant_never_exceeds_the_claim_and_an_understated_one_is_caught():
    mlp = lipschitz_mlp(6, 16, 4, seed=0, input_radius=3.0, depth=3)
    assert worst_ratio(mlp, (6,), n=256, steps=80, scale=2.0) <= mlp.lipschitz_bound() * (1 + 1e-5)
    cnn = tiny_cnn(0)
    found = worst_ratio(cnn, (1, 8, 8), n=48, steps=30)
    assert found <= cnn.lipschitz_bound() * (1 + 1e-5)
    assert found > 0.3 * cnn.lipschitz_bound()             # the search is not toothless
    liar = tiny_cnn(0, lie=4.0)                              # control: claims the same L, is up to 4 times as steep
    assert liar.lipschitz_bound() == pytest.approx(cnn.lipschitz_bound())
    assert worst_ratio(liar, (1, 8, 8), n=48, steps=30) > liar.lipschitz_bound() * 1.05


def two_d_problem():
    gen = torch.Generator().manual_seed(0)
    centers = torch.tensor([[0.6, 0.0], [-0.3, 0.5], [-0.3, -0.5]])
    y = torch.randint(0, 3, (600,), generator=gen)
    x = centers[y] + 0.25 * torch.randn(600, 2, generator=gen)
    return x, y


def train_plain(model, x, y, epochs, batch=64, lr=0.02, tau=2.0):
    cfg = LipschitzDPConfig(epsilon=None, batch_size=batch, epochs=epochs, lr=lr, tau=tau)
    return LipschitzDPTrainer(model, x, y, cfg, noise_key=NoiseKey(b"test-lipschitz-plain-key")).fit().model


def flips_inside(model, centers, preds, radii, angles=256, rings=24):
    """How many certified points have an input inside their claimed ball (radius * (1 - 1e-4)) predicted
    otherwise: an exhaustive polar grid of each disc (rings x angles points)."""
    t = torch.linspace(0, 2 * math.pi, angles + 1)[:-1]
    dirs = torch.stack([t.cos(), t.sin()], 1)
    flips = 0
    with torch.no_grad():
        for c, p, r in zip(centers, preds, radii):
            rs = torch.linspace(0, 1, rings + 1)[1:] * float(r) * (1 - 1e-4)
            pts = c + (rs.view(-1, 1, 1) * dirs.view(1, -1, 2)).reshape(-1, 2)
            flips += int((model(pts).argmax(1) != p).any())
    return flips


def test_certificate_holds_exhaustively_in_2d_and_breaks_when_the_constant_is_understated():
    x, y = two_d_problem()
    model = train_plain(lipschitz_mlp(2, 16, 3, seed=0, input_radius=3.0, depth=3), x, y, epochs=15)
    gen = torch.Generator().manual_seed(5)
    pts = torch.rand(150, 2, generator=gen) * 2.4 - 1.2
    cert = certify(model, pts, torch.zeros(150, dtype=torch.long))
    assert (cert.radius_pm1 > 0.05).sum() > 50                 # non-trivial radii
    assert flips_inside(model, pts, cert.prediction, cert.radius_pm1) == 0
    # control: the same model with its last layer scaled by 5, claiming the same L (a lie): the claimed
    # radii are 5 times too large, and the exhaustive search finds inputs that change the prediction
    liar = LipschitzSequential(*list(model)[:-1], Understated(5.0), model[-1])
    lie = certify(liar, pts, torch.zeros(150, dtype=torch.long), lipschitz=model.lipschitz_bound())
    assert flips_inside(liar, pts, lie.prediction, lie.radius_pm1) > 10


def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0     # [0, 16] -> [-1, 1]
    return x, torch.tensor(d.target)


def pgd_l2(model, x, y, radius, steps=50, restarts=1, seed=0):
    """Strong l2 PGD with a per-example radius on the margin max_{j != y} f_j - f_y (a point with a
    positive margin is an adversarial example); random starts inside the ball. Returns the found flags."""
    gen = torch.Generator().manual_seed(seed)
    r = radius.view(-1, 1, 1, 1)
    found = torch.zeros(x.shape[0], dtype=torch.bool)
    for restart in range(restarts + 1):
        d = torch.randn(x.shape, generator=gen)
        d = d / d.flatten(1).norm(dim=1).view(-1, 1, 1, 1) * r * (0.5 if restart else 0.0)
        for i in range(steps):
            d.requires_grad_(True)
            z = model(x + d)
            other = z.masked_fill(nn.functional.one_hot(y, z.shape[1]).bool(), -1e9).max(1).values
            margin = other - z.gather(1, y[:, None]).squeeze(1)
            found |= (margin > 0).detach()
            (g,) = torch.autograd.grad(margin.sum(), d)
            step = 2.5 * r / steps * g / g.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, 1, 1, 1)
            d = (d.detach() + step)
            d = d * (r / d.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, 1, 1, 1)).clamp(max=1.0)
        with torch.no_grad():
            z = model(x + d)
            found |= z.argmax(1) != y
    return found


def test_pgd_finds_nothing_inside_the_certified_radius_and_breaks_an_understated_certificate():
    x, y = digits()
    model = train_plain(tiny_cnn(0), x[:1200], y[:1200], epochs=6, batch=100, lr=0.01, tau=1.0)
    xt, yt = x[1500:1700], y[1500:1700]
    cert = certify(model, xt, yt)
    ok = torch.as_tensor(cert.correct & (cert.radius_pm1 > 0.02))
    assert int(ok.sum()) > 40                                    # the model learned, with non-trivial radii
    radius = torch.as_tensor(cert.radius_pm1, dtype=torch.float32)[ok] * (1 - 1e-4)
    assert not pgd_l2(model, xt[ok], yt[ok], radius).any()
    # the attack is strong: at 4 times the certified radius it succeeds on some images
    assert pgd_l2(model, xt[ok], yt[ok], radius * 4, steps=20, restarts=0).any()
    # control: a layer scaled by 4 that claims 1: its claimed radii break under the same attack
    liar = LipschitzSequential(*list(model)[:-1], Understated(4.0), model[-1])
    lie = certify(liar, xt, yt, lipschitz=model.lipschitz_bound())
    ok2 = torch.as_tensor(lie.correct & (lie.radius_pm1 > 0.02))
    radius2 = torch.as_tensor(lie.radius_pm1, dtype=torch.float32)[ok2] * (1 - 1e-4)
    assert pgd_l2(liar, xt[ok2], yt[ok2], radius2, steps=20, restarts=0).float().mean() > 0.1


def test_certificate_domains_and_accuracy_at_radii():
    model = lipschitz_mlp(4, 8, 3, seed=1, input_radius=2.0)
    x = torch.randn(40, 4)
    cert = certify(model, x, torch.zeros(40, dtype=torch.long))
    assert np.allclose(cert.radius_01 * 2, cert.radius_pm1)
    acc = cert.certified_accuracy_01([0.0, 0.01, 100.0])
    assert acc[0.0] == pytest.approx(float(cert.correct.mean())) and acc[100.0] == 0.0
    assert cert.certified_accuracy_pm1([0.02])[0.02] == acc[0.01]
    with pytest.raises(ValueError, match="lipschitz"):
        certify(model, x, torch.zeros(40, dtype=torch.long), lipschitz=0.0)


def test_the_mnist_network_is_one_lipschitz_and_refuses_a_layer_without_bounds():
    net = mnist_lipschitz_cnn(0)
    assert net.lipschitz_bound() <= 1 + 1e-5 and net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match="first layer must be an InputClip"):
        LipschitzSequential(LipschitzDense(3, 2))
    with pytest.raises(ValueError, match=r"layers\[1\]: ReLU declares no lipschitz_bound"):
        LipschitzSequential(InputClip(), nn.ReLU())
