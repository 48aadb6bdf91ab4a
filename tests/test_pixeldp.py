"""PixelDP: noise calibration, sensitivity control, noise ramp, resumable training."""

from __future__ import annotations

import math

import pytest
import torch

from dpmech.privacy.mechanisms import analytic_gaussian_sigma, gaussian_sigma
from dpmech.networks.pixeldp import PixelDPCNN, PixelDPWideResNet, build_pixeldp_model
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


def test_exact_sensitivity_matches_definition_on_random_pairs():
    torch.manual_seed(1)
    conv = BoundedConv2d(1, 4, 5, stride=2, padding=2, norm="l2")
    s = exact_sensitivity(conv, (1, 10, 10), "l2")
    x = torch.randn(2000, 1, 10, 10)
    x2 = torch.randn(2000, 1, 10, 10)
    with torch.no_grad():
        ratio = (conv(x) - conv(x2)).flatten(1).norm(dim=1) / (x - x2).flatten(1).norm(dim=1)
    assert ratio.max().item() <= s + 1e-5


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
