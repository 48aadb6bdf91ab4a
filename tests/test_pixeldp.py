"""PixelDP: noise calibration, sensitivity control, noise ramp, resumable training."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from dpmech.privacy.mechanisms import analytic_gaussian_sigma, gaussian_sigma
from dpmech.networks.pixeldp import PixelDPCNN, PixelDPNet, PixelDPWideResNet, build_pixeldp_model
from dpmech.robustness.noise_layer import BoundedConv2d, NoiseLayer, exact_sensitivity, pixeldp_noise_scale
from dpmech.pixeldp.trainer import PixelDPConfig, PixelDPTrainer, guarantee_epsilon


def test_noise_scale_follows_the_reference_formula():
    # _dp_mult: L * sqrt(2 ln(1.25/delta)) / eps with Delta = 1
    assert pixeldp_noise_scale(1.0, 0.05, 0.1) == pytest.approx(0.1 * math.sqrt(2 * math.log(25)))
    assert pixeldp_noise_scale(0.5, 1e-5, 0.2, sensitivity=2.0) == pytest.approx(gaussian_sigma(0.5, 1e-5, 0.4))
    # epsilon > 1: the analytic Gaussian
    assert pixeldp_noise_scale(3.0, 1e-5, 0.1) == pytest.approx(analytic_gaussian_sigma(3.0, 1e-5, 0.1))
    # l1: Laplace, b = Delta L / eps
    assert pixeldp_noise_scale(2.0, 0.05, 0.1, norm="l1") == pytest.approx(0.05)


@pytest.mark.parametrize("norm", ["l2", "l1"])
def test_bounded_conv_sensitivity_at_most_one_for_any_weights(norm):
    torch.manual_seed(0)
    conv = BoundedConv2d(1, 8, 5, stride=2, padding=2, norm=norm)
    for scale in (0.01, 1.0, 100.0):
        with torch.no_grad():
            conv.weight.normal_(0, scale)
        s = exact_sensitivity(conv, (1, 12, 12), norm)
        assert 0 < s <= 1.0 + 1e-9
    # negative control: the raw (un-normalised) convolution exceeds the bound
    raw = torch.nn.Conv2d(1, 8, 5, stride=2, padding=2)
    with torch.no_grad():
        raw.weight.copy_(conv.weight * 10)
    assert exact_sensitivity(raw, (1, 12, 12), norm) > 1.0


@pytest.mark.parametrize("norm", ["l2", "l1"])
@pytest.mark.parametrize("stride", [1, 2])
def test_bounded_conv_bound_is_nearly_tight_for_a_constant_kernel(norm, stride):
    """A constant kernel on a large image is where the construction bound (Sec. 3.3:
    ||W_flat||_2 ceil(k/s), or the largest per-channel l1 mass) is nearly attained: the measured
    sensitivity stays <= 1 and comes within a few percent of it, so a bound missing a factor
    (an undercounted patch overlap) shows up as a sensitivity above 1."""
    conv = BoundedConv2d(1, 1, 3, stride=stride, padding=1, bias=False, norm=norm)
    with torch.no_grad():
        conv.weight.fill_(1.0)
    s = exact_sensitivity(conv, (1, 24, 24), norm)
    assert s <= 1.0 + 1e-6  # the float32 kernel divided by its bound: 1 up to float32 rounding
    assert s > (0.95 if stride == 1 else 0.4)
    # negative control: the same kernel normalised by the bound without its overlap factor exceeds 1
    loose = torch.nn.Conv2d(1, 1, 3, stride=stride, padding=1, bias=False)
    with torch.no_grad():
        loose.weight.copy_(conv.weight / (conv.norm_bound() / math.sqrt(conv.overlap_factor())))
    if norm == "l2" and stride == 1:
        assert exact_sensitivity(loose, (1, 24, 24), norm) > 1.5


def _top_singular_pair(layer, input_shape, iters: int = 100):
    """The top right singular vector v of the linear map x -> layer(x) - layer(0) and its gain
    ||layer(v) - layer(0)|| / ||v||, by power iteration on the layer's own forward pass and its
    autograd adjoint (independent of ``exact_sensitivity``'s dense float64 matrix)."""
    gen = torch.Generator().manual_seed(123)
    zero = torch.zeros(1, *input_shape)

    def apply(x):
        return layer(x) - layer(zero)

    x = torch.randn(1, *input_shape, generator=gen)
    for _ in range(iters):
        x = x / x.norm()
        x = x.detach().requires_grad_(True)
        out = apply(x)
        (adj,) = torch.autograd.grad(out, x, grad_outputs=out.detach())  # M^T M x
        x = adj
    x = (x / x.norm()).detach()
    with torch.no_grad():
        return x, (apply(x).norm() / x.norm()).item()


def test_exact_sensitivity_matches_definition_on_random_pairs():
    """The ratio ||g(x) - g(x')|| / ||x - x'|| never exceeds the measured sensitivity, on random
    pairs and on pairs along the top singular direction, where it attains it."""
    torch.manual_seed(1)
    conv = BoundedConv2d(1, 4, 5, stride=2, padding=2, norm="l2")
    s = exact_sensitivity(conv, (1, 10, 10), "l2")
    x = torch.randn(2000, 1, 10, 10)
    x2 = torch.randn(2000, 1, 10, 10)
    v, _ = _top_singular_pair(conv, (1, 10, 10))
    t = torch.linspace(0.1, 3.0, 500).view(-1, 1, 1, 1)
    x = torch.cat([x, x[:500]])
    x2 = torch.cat([x2, x[:500] + t * v])  # pairs that differ along the top singular vector

    def max_ratio():
        with torch.no_grad():
            return ((conv(x) - conv(x2)).flatten(1).norm(dim=1) / (x - x2).flatten(1).norm(dim=1)).max().item()

    ratio = max_ratio()
    assert ratio <= s + 1e-5
    assert ratio >= s * (1 - 1e-4)  # attained: the check is as strict as the definition
    # negative control: the same check against a sensitivity 40% too low fails by a wide margin
    assert ratio > 0.6 * s * 1.5


@pytest.mark.parametrize("norm", ["l2", "l1"])
@pytest.mark.parametrize("kind", ["bounded", "conv", "linear"])
def test_exact_sensitivity_equals_the_operator_norm_of_the_autograd_jacobian(kind, norm):
    """exact_sensitivity against an independent computation: the layer's Jacobian by autograd
    (float64), its largest singular value (l2) or largest column l1 norm (l1); for l2 the norm is
    attained by the top right singular vector, and power iteration on the layer agrees."""
    torch.manual_seed(2)
    shape = (2, 7, 7)
    if kind == "bounded":
        layer = BoundedConv2d(2, 3, 3, stride=2, padding=1, norm=norm)
    elif kind == "conv":
        layer = torch.nn.Conv2d(2, 3, 3, stride=1, padding=1)
    else:
        layer = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(98, 20))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.7)
    s = exact_sensitivity(layer, shape, norm)
    layer64 = copy.deepcopy(layer).double()
    jac = torch.autograd.functional.jacobian(lambda z: layer64(z.view(1, *shape)).flatten(), torch.zeros(98,
                                             dtype=torch.float64))
    if norm == "l1":
        assert s == pytest.approx(jac.abs().sum(dim=0).max().item(), rel=1e-6)
        return
    _, sv, vh = torch.linalg.svd(jac)
    assert s == pytest.approx(sv[0].item(), rel=1e-6)
    top = vh[0]
    gain = (jac @ top).norm().item()  # ||J v|| with ||v|| = 1
    assert gain == pytest.approx(s, rel=1e-6)
    v, power = _top_singular_pair(layer, shape)
    assert power == pytest.approx(s, rel=1e-3)  # 100 iterations; a lower bound that converges to s
    with torch.no_grad():  # attained by the layer itself on the power-iteration vector
        assert (layer(v) - layer(torch.zeros_like(v))).norm().item() == pytest.approx(s, rel=1e-3)
    # negative control: a sensitivity 40% too low is exceeded by the layer itself on v
    assert power > 0.6 * s * 1.5


class _BoundedLinearPixelDP(PixelDPNet):
    """A PixelDP network with its noise *after* a bounded convolution (noise_after=1): a 2-class
    linear classifier on the noised activations, whose weight w is the top left singular vector of
    the convolution M, so that the decision boundary of the expected argmax, w.(Mx + c) + b = 0,
    sits at distance |w.(Mx + c) + b| / ||M^T w|| = |w.(Mx + c) + b| / ||M|| from x."""

    def __init__(self, sigma: float, w: torch.Tensor, b: float, conv: BoundedConv2d):
        super().__init__(sigma, "l2", 1, seed=8)
        self.input_shape = (1, 6, 6)
        self.first = conv
        lin = torch.nn.Linear(w.numel(), 2)
        with torch.no_grad():
            lin.weight.copy_(torch.stack([w, torch.zeros_like(w)]))
            lin.bias.copy_(torch.tensor([b, 0.0]))
        self.body = torch.nn.Sequential(torch.nn.Flatten(), lin)


def test_certificate_is_sound_when_the_noise_sits_after_a_bounded_layer():
    """PixelDP's certify divides the size by the pre-noise layer's measured sensitivity: on a
    network whose distance to the decision boundary is known exactly, no certified size exceeds it
    (except where the (1 - alpha) bounds fail), and a sensitivity claimed 40% too low does."""
    from scipy.stats import binom

    from dpmech.robustness.certification import certify

    torch.manual_seed(3)
    conv = BoundedConv2d(1, 2, 3, stride=1, padding=1, norm="l2")
    with torch.no_grad():
        conv.weight.normal_(0, 1.0)
        conv.bias.zero_()
    jac = torch.autograd.functional.jacobian(
        lambda z: torch.nn.functional.conv2d(z.view(1, 1, 6, 6), conv.normalised_weight().double().detach(),
                                             None, 1, 1).flatten(), torch.zeros(36, dtype=torch.float64))
    u, sv, _ = torch.linalg.svd(jac)
    w = u[:, 0].float()          # top left singular vector: ||M^T w|| = ||M||
    model = _BoundedLinearPixelDP(0.25, w, 0.05, conv)
    assert model.sensitivity_exact() == pytest.approx(sv[0].item(), rel=1e-6)
    assert sv[0].item() < 0.9    # the construction bound 1 is loose here: the exact value matters
    gen = torch.Generator().manual_seed(4)
    x = torch.rand(300, 1, 6, 6, generator=gen) * 2 - 1
    with torch.no_grad():
        margin = model.pre_noise(x).flatten(1) @ w + 0.05
    radius = (margin.abs() / sv[0].item()).numpy()
    expected_class = (margin <= 0).long()
    alpha = 0.05
    allowed = binom.ppf(0.999, len(x), alpha)

    def violations(**kw):
        res = certify(model, x, expected_class, n=2000, alpha=alpha, generator=torch.Generator().manual_seed(5), **kw)
        certified = res.certified_size > 0
        assert certified.mean() > 0.5  # not vacuous
        wrong = certified & ((res.prediction != expected_class.numpy()) | (res.certified_size > radius * (1 + 1e-5)))
        return int(wrong.sum())

    assert violations() <= allowed
    # negative control: the same network certified with a sensitivity 40% below the true one
    assert violations(sensitivity=0.6 * model.sensitivity_exact()) > 3 * allowed


def test_sensitivity_bound_holds_throughout_training():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(512, 1, 28, 28, generator=gen) * 2 - 1
    y = torch.randint(0, 10, (512,), generator=gen)
    tr = PixelDPTrainer(PixelDPConfig(epochs=3, lr=1e-2, batch_size=64), x, y)
    for _ in range(3):
        tr.train_epoch()
        assert tr.model.sensitivity_exact() <= 1.0 + 1e-9
        assert tr.model.first.norm_bound().item() > 0


def test_noise_is_on_at_prediction_and_training_time():
    model = PixelDPCNN(0.5)
    x = torch.zeros(4, 1, 28, 28)
    model.eval()
    with torch.no_grad():
        assert not torch.equal(model(x), model(x))
    model.train()
    with torch.no_grad():
        assert not torch.equal(model(x), model(x))


def test_noise_layer_is_reproducible_from_its_seed():
    a, b = NoiseLayer(1.0, seed=3), NoiseLayer(1.0, seed=3)
    h = torch.zeros(100)
    assert torch.equal(a(h), b(h))
    lap = NoiseLayer(1.0, "l1", seed=3)(torch.zeros(200_000))
    assert lap.abs().mean().item() == pytest.approx(1.0, rel=0.02)


def test_noise_ramp_up():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(256, 1, 28, 28, generator=gen) * 2 - 1
    y = torch.randint(0, 10, (256,), generator=gen)
    tr = PixelDPTrainer(PixelDPConfig(noise_ramp_epochs=2, batch_size=64), x, y)
    tr.train_epoch()
    assert tr.model.noise.ramp == pytest.approx(0.5)
    tr.train_epoch()
    assert tr.model.noise.ramp == 1.0


def test_guarantee_is_computed_from_the_noise_used():
    # the classic calibration at (1, 0.05) is loose: the exact epsilon of that noise is smaller
    eps = guarantee_epsilon(pixeldp_noise_scale(1.0, 0.05, 0.1), 0.1, 1.0, 0.05, "l2")
    assert 0.3 < eps < 1.0
    # with the analytic calibration the guarantee is exactly the target
    s = analytic_gaussian_sigma(2.0, 1e-5, 0.1)
    assert guarantee_epsilon(s, 0.1, 1.0, 1e-5, "l2") == pytest.approx(2.0, rel=1e-6)
    # a smaller measured sensitivity gives a smaller epsilon
    assert guarantee_epsilon(s, 0.1, 0.5, 1e-5, "l2") < 2.0
    assert guarantee_epsilon(0.05, 0.1, 1.0, 0.0, "l1") == pytest.approx(2.0)


def _balle_wang_sigma(eps: float, delta: float, sens: float) -> float:
    """The analytic Gaussian calibration solved here from Balle & Wang's Thm. 8 with scipy's
    normal CDF (independent of dpmech.privacy.mechanisms)."""
    from scipy.optimize import brentq
    from scipy.stats import norm as normal

    def profile(sigma):
        return normal.cdf(sens / (2 * sigma) - eps * sigma / sens) - math.exp(eps) * normal.cdf(
            -sens / (2 * sigma) - eps * sigma / sens)

    return brentq(lambda s_: profile(s_) - delta, 1e-3 * sens, 1e3 * sens, xtol=1e-15, rtol=1e-13)


@pytest.mark.parametrize("norm,eps,delta,bound,noise_after", [
    ("l2", 1.0, 0.05, 0.1, 1),    # the paper's MNIST setting: the classic calibration
    ("l2", 0.5, 1e-5, 0.3, 0),
    ("l2", 2.0, 1e-5, 0.2, 0),    # epsilon > 1: the analytic Gaussian
    ("l1", 1.5, 0.05, 0.1, 0),    # Laplace
])
def test_trained_model_noise_scale_is_the_formula_of_its_configuration(norm, eps, delta, bound, noise_after):
    """The noise the trained network draws is the one the configuration promises (Lecuyer et al.
    2018, Sec. 3.2, construction bound Delta = 1), computed here by the formula, not by the code;
    and where the calibration is exact (analytic Gaussian, Laplace) and the pre-noise part is the
    identity, the epsilon recomputed from the trained model is the configured one."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(64, 1, 28, 28, generator=gen) * 2 - 1
    y = torch.randint(0, 10, (64,), generator=gen)
    cfg = PixelDPConfig(epsilon=eps, delta=delta, attack_bound=bound, norm=norm, noise_after=noise_after,
                        epochs=1, batch_size=32)
    tr = PixelDPTrainer(cfg, x, y)
    tr.train_epoch()
    if norm == "l1":
        expected = bound / eps                                           # b = Delta L / eps
    elif eps <= 1:
        expected = math.sqrt(2 * math.log(1.25 / delta)) * bound / eps   # sigma = sqrt(2 ln(1.25/d)) Delta L / eps
    else:
        expected = _balle_wang_sigma(eps, delta, bound)
    assert tr.model.noise.scale == pytest.approx(expected, rel=1e-9)
    assert tr.model.noise.ramp == 1.0
    # the draws themselves have that scale (std for Gaussian, mean |z| for Laplace)
    z = tr.model.noise.sample(torch.zeros(200_000))
    measured = z.std().item() if norm == "l2" else z.abs().mean().item()
    assert measured == pytest.approx(expected, rel=0.01)
    g = tr.guarantee()
    assert g["noise_scale"] == tr.model.noise.scale
    if noise_after == 0 and (norm == "l1" or eps > 1):
        assert g["sensitivity"] == 1.0
        assert g["epsilon"] == pytest.approx(eps, rel=1e-6)
    else:
        assert g["epsilon"] <= eps * (1 + 1e-9)
    # negative control: the noise of sensitivity 0.5 (half the noise) is far from the formula, and
    # its recomputed epsilon exceeds the configured one
    half = pixeldp_noise_scale(eps, delta, bound, 0.5, norm)
    assert abs(half / expected - 1) > 0.4
    assert guarantee_epsilon(half, bound, 1.0, delta, norm) > 1.5 * g["epsilon"]


def test_resume_from_state_dict_is_bit_identical():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(256, 1, 28, 28, generator=gen) * 2 - 1
    y = torch.randint(0, 10, (256,), generator=gen)
    cfg = PixelDPConfig(epochs=2, batch_size=64, seed=4)
    full = PixelDPTrainer(cfg, x, y)
    full.train_epoch()
    state = full.state_dict()
    full.train_epoch()
    resumed = PixelDPTrainer(cfg, x, y)
    resumed.load_state_dict(state)
    resumed.train_epoch()
    for (k, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), k


def test_models_shapes():
    assert build_pixeldp_model("mnist", 0.1)(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    wrn = PixelDPWideResNet(0.1, noise_after=0)
    assert wrn(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="dataset"):
        build_pixeldp_model("svhn", 0.1)


@pytest.mark.parametrize("field,value,match", [
    ("epsilon", 0.0, "epsilon"), ("delta", 1.0, "delta"), ("attack_bound", -0.1, "attack_bound"),
    ("norm", "linf", "norm"), ("noise_after", 2, "noise_after"), ("epochs", 0, "epochs"),
    ("dataset", "imagenet", "dataset"), ("lr", float("nan"), "lr"), ("batch_size", True, "batch_size"),
])
def test_config_rejects_bad_values(field, value, match):
    with pytest.raises(ValueError, match=match):
        PixelDPConfig(**{field: value})


def test_certify_rejects_wrong_image_shape():
    from dpmech.robustness.certification import certify

    with pytest.raises(ValueError, match="x must hold images of shape"):
        certify(PixelDPCNN(0.1), torch.zeros(2, 3, 32, 32), torch.zeros(2, dtype=torch.long), n=2)


def test_trainer_rejects_wrong_image_shape():
    with pytest.raises(ValueError, match="x_train"):
        PixelDPTrainer(PixelDPConfig(), torch.zeros(4, 3, 32, 32), torch.zeros(4, dtype=torch.long))


@pytest.mark.slow
def test_pixeldp_reaches_90_percent_on_a_real_mnist_subset():
    from dpmech.robustness.certification import certify
    from dpmech.datasets.splits import load_splits

    train, test = load_splits("mnist", train_size=5000, test_size=1000, seed=0)
    tr = PixelDPTrainer(PixelDPConfig(epochs=4, batch_size=64, lr=1e-3, seed=0), *train.tensors)
    for _ in range(4):
        tr.train_epoch()
    assert tr.accuracy(*test.tensors) >= 0.90
    res = certify(tr.model, *(t[:200] for t in test.tensors), n=100)
    assert res.accuracy() >= 0.90
    assert (res.certified_size > 0).mean() > 0.5
