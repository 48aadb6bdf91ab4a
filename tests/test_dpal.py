"""DPAL (seed document 003): budget arithmetic, brute-force sensitivity checks with negative controls,
the fixed training noise and checkpoints, verified inference, and a short MNIST run.

Every random draw uses a fixed seed; the whole file runs in about a minute on 2 CPU cores.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpmech.robustness.attacks import pgd
from dpmech.dpal.config import DPALConfig
from dpmech.privacy.secret import NoiseKey
from dpmech.dpal.model import DPALNet
from dpmech.dpal.trainer import DPALTrainer
from dpmech.dpal.noise import TrainingNoise
from dpmech.dpal.verify import (certified_accuracy, conventional_accuracy_under_attack, robustness_size, search_eps_r,
                                verified_inference)
from dpmech.dpal.budget import delta_l2, delta_r
from dpmech.dpal.budget import gamma, gamma_x, split_budget
from dpmech.dpal.model import l1_operator_bound
from dpmech.dpal.objectives import (dp_adversarial_objective, dp_taylor_loss, label_coefficients,
                                    reconstruction_coefficients, reconstruction_loss)

MNIST_DELTA_R = (14 ** 2 + 2) * 25
CIFAR_DELTA_R = 3 * (14 ** 2 + 2) * 16


# ============================================================================ budget


def test_sensitivities_are_appendix_m_values():
    assert delta_r(25, 14 ** 2) == MNIST_DELTA_R == 4950
    assert delta_r(16, 14 ** 2, channels=3) == CIFAR_DELTA_R
    assert delta_l2(256) == 2 * 256
    assert DPALConfig().delta_R == MNIST_DELTA_R
    assert DPALConfig().delta_L2 == 512
    assert DPALConfig(dataset="cifar10", eps_t=2.0, batch_size=1851).delta_R == CIFAR_DELTA_R


@pytest.mark.parametrize("eps_t", [0.2, 0.5, 1.0, 2.0, 10.0])
@pytest.mark.parametrize("bound", [0.5, 1.0, 10.0])
def test_mnist_budget_adds_up_and_follows_appendix_m(eps_t, bound):
    cfg = DPALConfig(eps_t=eps_t, theta1_bound=bound)        # m = 2499 as in Appendix M
    b = cfg.budget
    g = 2 * MNIST_DELTA_R / (2499 * bound)                     # Lemma 3
    gx = MNIST_DELTA_R / 2499
    assert b.gamma == pytest.approx(g) and b.gamma_x == pytest.approx(gx)
    assert b.eps_2 == pytest.approx(0.1)
    assert b.eps_1 == pytest.approx((eps_t - 0.1) / (1 + 1 / g + 1 / gx))
    assert b.eps_x == pytest.approx(b.eps_1 / gx) and b.eps_h == pytest.approx(b.eps_1 / g)
    assert b.eps_1 + b.eps_1 / gx + b.eps_1 / g + b.eps_2 == pytest.approx(eps_t, rel=1e-12)
    assert b.total() == pytest.approx(eps_t, rel=1e-12)


@pytest.mark.parametrize("eps_t", [2.0, 3.5, 10.0])
def test_cifar_budget_adds_up_and_follows_appendix_m(eps_t):
    cfg = DPALConfig(dataset="cifar10", eps_t=eps_t, batch_size=1851, psi=10, xi=1.5, attack_steps=3, lr=5e-2)
    b = cfg.budget
    r = eps_t - 2
    denom = 1 + 1 / b.gamma + 1 / b.gamma_x
    assert b.eps_2 == pytest.approx(1 + r / 3)
    assert b.eps_1 == pytest.approx((1 + 2 * r / 3) / denom)
    assert b.total() == pytest.approx(eps_t, rel=1e-12)
    assert b.gamma == pytest.approx(2 * CIFAR_DELTA_R / 1851)


def test_noise_scales_realise_the_budget():
    cfg = DPALConfig(eps_t=1.0, batch_size=250, theta1_bound=10.0)
    b, s = cfg.budget, cfg.noise_scales
    assert s.x == pytest.approx(b.delta_R / (250 * b.eps_1))   # chi_1 / m
    assert s.h == pytest.approx(2 * s.x)                       # 2 chi_2 / m
    assert s.y == pytest.approx(b.delta_L2 / b.eps_2)          # chi_3
    # each component is the Laplace mechanism at its sensitivity (Lemma 3, Theorem 3)
    assert 1.0 / s.x == pytest.approx(b.eps_x)
    assert b.delta_h1 / s.h == pytest.approx(b.eps_h)
    assert b.delta_L2 / s.y == pytest.approx(b.eps_2)


def test_budget_refuses_unsplittable_targets():
    with pytest.raises(ValueError, match="eps_t"):
        split_budget(0.1, "mnist", gamma=1.0, gamma_x=1.0)
    with pytest.raises(ValueError, match="eps_t"):
        split_budget(1.9, "cifar10", gamma=1.0, gamma_x=1.0)
    with pytest.raises(ValueError, match="theta1_norm"):
        gamma(4950, 100, 0.0)
    with pytest.raises(ValueError, match="batch_size"):
        gamma_x(4950, 0)


# ============================================================================ Lemma 2


def _corner_or_uniform(shape, gen, p_corner=0.5):
    u = torch.rand(shape, generator=gen) * 2 - 1
    corner = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    pick = torch.rand((shape[0], 1), generator=gen) < p_corner
    return torch.where(pick, corner, u)


def _lemma2_max_change(trials: int, gen, m=20, d=25, beta=196):
    chi = torch.distributions.Laplace(0.0, 3.0).sample((d, beta + 1))  # the fixed noise, shared by both
    worst = 0.0
    for t in range(trials):
        x = _corner_or_uniform((m, d), gen)
        h = _corner_or_uniform((m, beta), gen)
        x2, h2 = x.clone(), h.clone()
        e = int(torch.randint(m, (1,), generator=gen))
        if t % 3 == 0:   # the extreme neighbour: every coordinate flips sign at a corner
            x[e], h[e] = 1.0, 1.0
            x2[e], h2[e] = -1.0, -1.0
        else:
            x2[e] = _corner_or_uniform((1, d), gen)[0]
            h2[e] = _corner_or_uniform((1, beta), gen)[0]
        a = reconstruction_coefficients(x, h) + chi
        b = reconstruction_coefficients(x2, h2) + chi
        worst = max(worst, (a - b).abs().sum().item())
    return worst


def test_lemma2_brute_force_on_neighbouring_batches():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    worst = _lemma2_max_change(300, gen)
    assert worst <= MNIST_DELTA_R + 1e-3
    assert worst >= 0.999 * MNIST_DELTA_R          # attained: the bound is tight
    # negative control: a sensitivity claimed without the "+2" of Lemma 2 is exceeded
    assert worst > 25 * 196


def _model_batch(gen, m=32):
    """MNIST-like inputs in [-1, 1]: half binary strokes, half uniform."""
    x = torch.rand((m, 1, 28, 28), generator=gen) * 2 - 1
    x[: m // 2] = torch.where(x[: m // 2] > 0.3, 1.0, -1.0)
    return x


def test_lemma2_on_the_models_perturbed_coefficients():
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    model = DPALNet("mnist", theta1_bound=10.0).eval()
    noise = TrainingNoise.draw(x_shape=(1, 28, 28), h_shape=model.hidden_shape, y_shape=(256, 10), scale_x=2.0,
                               scale_h=4.0, scale_y=100.0, generator=gen)
    d, beta = model.encoder.patch_size, model.beta
    assert d * (beta + 2) == MNIST_DELTA_R

    def coeffs(x, k, raw=False):
        x_bar = x + noise.x
        h = model.encoder.pre_activation(x_bar) if raw else model.affine(x_bar)
        patch = x[:, 0, 10:15, 10:15].flatten(1) + noise.x[0, 10:15, 10:15].flatten()   # x_bar on one patch
        return reconstruction_coefficients(patch, (h + noise.h)[:, k].flatten(1))

    worst = 0.0
    with torch.no_grad():
        for trial in range(10):
            x = _model_batch(gen)
            x2 = x.clone()
            x2[0] = -x[0]
            for k in range(model.hidden_shape[0]):
                worst = max(worst, (coeffs(x, k) - coeffs(x2, k)).abs().sum().item())
        assert worst <= MNIST_DELTA_R
        # negative control: h not bounded to [-1, 1] (the pre-activation of a kernel without the norm
        # bound, scaled up) breaks Lemma 2's assumption and the bound
        model.encoder.enforce = False
        model.encoder.weight.mul_(100.0)
        x = _model_batch(gen)
        x2 = x.clone()
        x2[0] = -x[0]
        raw_worst = max((coeffs(x, k, raw=True) - coeffs(x2, k, raw=True)).abs().sum().item()
                        for k in range(model.hidden_shape[0]))
        assert raw_worst > MNIST_DELTA_R


# ============================================================================ Lemma 3 (theta_1's norm bound)


def _single_pixel_sensitivity(model, x):
    """max over input pixels of ||h(x + e_p) - h(x)||_1 (unit L1 change at pixel p), pre-activation."""
    n = x[0].numel()
    eye = torch.eye(n).view(n, *x.shape[1:])
    with torch.no_grad():
        base = model.encoder.pre_activation(x)
        moved = model.encoder.pre_activation(x + eye)
        act = (model.affine(x + eye) - model.affine(x)).flatten(1).abs().sum(1).max().item()
    return (moved - base).flatten(1).abs().sum(1).max().item(), act


@pytest.mark.parametrize("bound", [1.0, 10.0])
def test_lemma3_norm_bound_is_enforced_for_any_weights(bound):
    torch.manual_seed(2)
    model = DPALNet("mnist", theta1_bound=bound)
    x = torch.rand(1, 1, 28, 28) * 2 - 1
    for scale in (0.01, 1.0, 100.0):
        with torch.no_grad():
            model.encoder.weight.normal_(0.0, scale)
        assert model.theta1_norm() <= bound * (1 + 1e-6)
        linear, act = _single_pixel_sensitivity(model, x)
        assert linear <= bound * (1 + 1e-5)
        assert act <= bound * (1 + 1e-5)                    # tanh never increases it
        if l1_operator_bound(model.encoder.weight, 2).item() > bound:
            assert linear >= bound * (1 - 1e-5)             # the interior pixels attain the bound
    # negative control: without the normalisation the same weights exceed Delta_h1
    model.encoder.enforce = False
    with torch.no_grad():
        model.encoder.weight.normal_(0.0, 1.0)
    linear, _ = _single_pixel_sensitivity(model, x)
    assert linear > bound


# ============================================================================ Lemma 4


def test_lemma4_brute_force_on_neighbouring_batches():
    gen = torch.Generator().manual_seed(3)
    hp, K, m = 256, 10, 20
    chi3 = torch.distributions.Laplace(0.0, 50.0).sample((hp, K))
    worst = 0.0
    for t in range(300):
        h = _corner_or_uniform((m, hp), gen)
        y = torch.nn.functional.one_hot(torch.randint(K, (m,), generator=gen), K).float()
        h2, y2 = h.clone(), y.clone()
        e = int(torch.randint(m, (1,), generator=gen))
        h2[e] = _corner_or_uniform((1, hp), gen, p_corner=0.7)[0]
        y2[e] = torch.roll(y[e], 1 + t % (K - 1))
        if t % 3 == 0:
            h[e], h2[e] = 1.0, -1.0
        diff = (label_coefficients(h, y) + chi3 - label_coefficients(h2, y2) - chi3).abs().sum().item()
        worst = max(worst, diff)
    assert worst <= 2 * hp + 1e-3
    assert worst >= 0.999 * 2 * hp
    assert worst > hp      # negative control: a sensitivity of |h_pi| is exceeded


def test_lemma4_on_the_models_hidden_layer():
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    model = DPALNet("mnist", theta1_bound=10.0).eval()
    K = model.classes
    with torch.no_grad():
        for bn in (model.body[1], model.body[5]):     # make h_pi large: small running variances
            bn.running_var.fill_(1e-3)
        worst = raw_worst = 0.0
        for trial in range(10):
            x = _model_batch(gen)
            y = torch.randint(K, (x.shape[0],), generator=gen)
            x2, y2 = x.clone(), y.clone()
            x2[0], y2[0] = -x[0], (y[0] + 1) % K
            hp = model.hidden(model.affine(x))
            hp2 = model.hidden(model.affine(x2))
            yo, yo2 = (torch.nn.functional.one_hot(t, K).float() for t in (y, y2))
            worst = max(worst, (label_coefficients(hp, yo) - label_coefficients(hp2, yo2)).abs().sum().item())
            raw, raw2 = model.body(model.affine(x)), model.body(model.affine(x2))   # h_pi without tanh
            raw_worst = max(raw_worst, (label_coefficients(raw, yo) - label_coefficients(raw2, yo2)).abs().sum().item())
    assert worst <= delta_l2(model.h_pi)
    assert raw_worst > delta_l2(model.h_pi)   # negative control: unbounded h_pi breaks Lemma 4


# ============================================================================ objectives


def test_taylor_objectives_match_their_definitions():
    torch.manual_seed(5)
    z = torch.randn(6, 10) * 0.3
    y = torch.nn.functional.one_hot(torch.arange(6) % 10, 10).float()
    exact = torch.nn.functional.binary_cross_entropy_with_logits(z, y, reduction="sum")
    h = torch.rand(6, 4) * 2 - 1
    w = torch.randn(4, 10) * 0.1
    chi3 = torch.zeros(4, 10)
    approx = dp_taylor_loss(h, y, w, chi3)
    exact_hw = torch.nn.functional.binary_cross_entropy_with_logits(h @ w, y, reduction="sum")
    assert approx.item() == pytest.approx(exact_hw.item(), abs=5e-3)   # 2nd-order Taylor, small logits
    assert exact.item() > 0
    # chi_3 enters as -<chi_3, W>
    chi = torch.randn(4, 10)
    assert (dp_taylor_loss(h, y, w, chi) - approx).item() == pytest.approx(-(chi * w).sum().item(), rel=1e-5)
    # Eq. 10 with xi = 0 is the benign term alone, normalised by m
    obj = dp_adversarial_objective(h, y, h, y, w, chi3, 0.0)
    assert obj.item() == pytest.approx(approx.item() / 6, rel=1e-6)
    # Eq. 7: R_bar = <1/2 - x_bar, theta_1 h_bar>, linear in the reconstruction
    model = DPALNet("mnist")
    xb = torch.rand(2, 1, 28, 28) * 2 - 1
    hb = model.affine(xb)
    r = reconstruction_loss(xb, hb, model.encoder.decode)
    assert r.item() == pytest.approx(((0.5 - xb) * model.encoder.decode(hb)).sum().item(), rel=1e-6)
    assert model.encoder.decode(hb).shape == xb.shape


# ============================================================================ config validation


@pytest.mark.parametrize("field,value", [
    ("dataset", "svhn"), ("eps_t", 0.0), ("eps_t", 0.05), ("eps_t", float("nan")), ("psi", 0.0), ("xi", -1.0),
    ("attacks", ()), ("attacks", ("cw",)), ("attacks", ("ifgsm", "bim")), ("attack_steps", 0), ("mu_a", 0.0),
    ("n", 0), ("eta", 1.0), ("bounds", "bernstein"), ("norm", "l2"), ("batch_size", 1), ("lr", 0.0),
    ("epochs", 0), ("theta1_bound", -1.0), ("seed", -1), ("epochs", 2.5)])
def test_bad_config_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        DPALConfig(**{field: value})


def test_cifar_config_needs_eps_t_of_at_least_two():
    with pytest.raises(ValueError, match="eps_t"):
        DPALConfig(dataset="cifar10", eps_t=1.0)


def test_trainer_refuses_bad_data():
    cfg = DPALConfig(batch_size=10, attack_steps=1, epochs=1)
    x = torch.zeros(30, 1, 28, 28)
    y = torch.zeros(30, dtype=torch.int64)
    with pytest.raises(ValueError, match="x_train"):
        DPALTrainer(cfg, x * 3 + 2, y)
    with pytest.raises(ValueError, match="batch_size"):
        DPALTrainer(cfg, x[:15], y[:15])      # one disjoint batch only
    with pytest.raises(ValueError, match="y_train"):
        DPALTrainer(cfg, x, y + 10)


# ============================================================================ noise drawn once; checkpoints


def _params(model):
    return {k: t.detach().clone() for k, t in model.state_dict().items()}


def test_noise_is_drawn_once_and_checkpoints_continue_bit_identically():
    gen = torch.Generator().manual_seed(6)
    x = _model_batch(gen, m=240)
    y = torch.randint(10, (240,), generator=gen)
    cfg = DPALConfig(eps_t=5.0, batch_size=60, theta1_bound=10.0, lr=1e-3, attack_steps=1, epochs=4, seed=3)
    key = NoiseKey.fresh()                         # the owner's: the noise follows from it (issue 48)
    tr = DPALTrainer(cfg, x, y, noise_key=key)
    noise0 = tr.noise.state_dict()
    batches0 = tr.batches.clone()
    # the batches are disjoint and cover N - (N mod m) examples
    assert tr.batches.unique().numel() == tr.batches.numel() == 240
    tr.train_epoch()
    for k in ("x", "h", "y"):
        assert torch.equal(getattr(tr.noise, k), noise0[k])
    assert torch.equal(tr.batches, batches0)
    assert torch.equal(tr._perturbed(tr.batches[0]), x[tr.batches[0]] + noise0["x"])
    state = tr.state_dict()
    tr.train_epoch()
    tr.train_epoch()
    after = _params(tr.model)
    for k in ("x", "h", "y"):
        assert torch.equal(getattr(tr.noise, k), noise0[k])       # identical across epochs

    # the state is a deep copy: training on did not change it; it holds no noise and no keyed stream's state
    assert state["epoch"] == 1 and not {"noise", "noise_gen", "train_gen"} & set(state)
    with pytest.raises(ValueError, match=r"checkpoint.noise_key_check: .*another noise key"):
        DPALTrainer(cfg, x, y).load_state_dict(state)        # another key would draw the noise a second time
    restored = DPALTrainer(cfg, x, y, noise_key=key)
    restored.load_state_dict(state)
    for k in ("x", "h", "y"):
        assert torch.equal(getattr(restored.noise, k), noise0[k])
    assert torch.equal(restored.batches, batches0)
    restored.train_epoch()
    restored.train_epoch()
    for k, t in _params(restored.model).items():
        assert torch.equal(t, after[k]), k
    assert restored.privacy() == tr.privacy()
    # a checkpoint of another configuration is refused
    other = DPALTrainer(DPALConfig(eps_t=5.0, batch_size=60, theta1_bound=10.0, lr=1e-3, attack_steps=1,
                                   epochs=4, seed=4), x, y)
    assert not torch.equal(other.noise.x, tr.noise.x)          # another seed, another draw
    with pytest.raises(ValueError, match="config"):
        other.load_state_dict(state)


def test_cifar_architecture_trains_one_epoch():
    gen = torch.Generator().manual_seed(7)
    x = torch.rand((12, 3, 32, 32), generator=gen) * 2 - 1
    y = torch.randint(10, (12,), generator=gen)
    cfg = DPALConfig(dataset="cifar10", eps_t=2.0, batch_size=6, attack_steps=1, epochs=1, psi=10, xi=1.5,
                     theta1_bound=10.0)
    tr = DPALTrainer(cfg, x, y)
    assert tr.model.hidden_shape == (128, 14, 14)
    assert tr.model.encoder.patch_size * (tr.model.beta + 2) * 3 == CIFAR_DELTA_R
    out = tr.train_epoch()
    assert math.isfinite(out["train_loss"])
    assert tr.model.input_sensitivity("linf") == 3 * 28 * 28
    p = tr.privacy()
    assert p["eps_t"] == pytest.approx(2.0)


# ============================================================================ robustness size (Eq. 15)


def test_certified_size_is_zero_without_margin_and_grows_with_it():
    ub = np.full(6, 0.2)
    lb = np.array([0.1, 0.2, 0.21, 0.3, 0.5, 0.9])
    eps_r, kappa, phi, size = robustness_size(lb, ub, scale_x=0.5, scale_h=1.0, sensitivity_x=784.0,
                                              sensitivity_h=100.0)
    assert size[0] == 0 and size[1] == 0 and eps_r[1] == 0          # no margin: not certified
    assert np.all(np.diff(size[1:]) > 0)                              # grows with the margin
    assert np.allclose(eps_r[2:], np.log(lb[2:] / ub[2:]) / 2)
    assert np.allclose(size, np.maximum(eps_r * 0.5 / 784, eps_r * 1.0 / 100))
    assert np.allclose(kappa, eps_r * 0.5 / 784) and np.allclose(phi, eps_r / 100)


def test_eps_r_is_the_maximiser_of_eq15():
    rng = np.random.default_rng(8)
    lb = rng.uniform(0.05, 1.0, 50)
    ub = rng.uniform(0.0, 0.5, 50)
    grid = np.linspace(0.0, 10.0, 200_001)
    closed = search_eps_r(lb, ub)
    for i in range(50):
        ok = lb[i] > np.exp(2 * grid) * ub[i]
        best = grid[ok].max() if ok.any() and ok[0] else 0.0
        if lb[i] <= ub[i]:
            best = 0.0
        assert closed[i] == pytest.approx(best, abs=1e-4)


# ============================================================================ a short MNIST run


@pytest.fixture(scope="module")
def trained():
    from dpmech.datasets.splits import load_splits

    train, test = load_splits("mnist", train_size=5000, test_size=1000, seed=0)
    x, y = train.tensors
    xt, yt = test.tensors
    cfg = DPALConfig(eps_t=10.0, theta1_bound=10.0, batch_size=250, lr=1e-3, attack_steps=2, epochs=3, psi=10.0,
                     n=200, bounds="argmax", mu_a=1e-4, seed=0)
    tr = DPALTrainer(cfg, x, y, noise_key=NoiseKey.reproducible(cfg.seed))
    history = [tr.train_epoch() for _ in range(cfg.epochs)]
    return tr, xt, yt, history


@pytest.mark.slow
def test_short_mnist_run_is_far_above_chance(trained):
    tr, xt, yt, history = trained
    assert all(math.isfinite(h["train_loss"]) for h in history)
    assert tr.accuracy(xt, yt) >= 0.8
    p = tr.privacy()
    assert p["eps_t"] == pytest.approx(10.0)
    assert p["theta1_norm_max"] <= 10.0 * (1 + 1e-5)                 # held at every step
    assert p["steps"] == 3 * 20 and p["epochs"] == 3


@pytest.mark.slow
def test_pgd_below_the_certified_size_rarely_changes_the_prediction(trained):
    tr, xt, yt, _ = trained
    xs, ys = xt[:100], yt[:100]
    res = verified_inference(tr, xs, ys, seed=1)
    assert res.accuracy() >= 0.6
    cols = res.as_columns()
    assert set(cols) >= {"index", "label", "prediction", "lower_bound", "upper_bound", "certified_size", "is_robust"}
    curve = certified_accuracy(res, [0.0, 1e-6, 1e-4, 1.0])
    assert list(curve.values()) == sorted(curve.values(), reverse=True)
    assert curve[1.0] == 0.0
    assert res.certified_accuracy() == pytest.approx(float((res.correct & res.is_robust).mean()))
    cert = np.flatnonzero(res.certified_size > 0)
    assert len(cert) >= 20
    centre = tr.scorer(fresh=False)
    gen = torch.Generator().manual_seed(9)

    def attacked(sizes):
        return torch.cat([pgd(centre, xs[i:i + 1], None, eps=float(s), steps=10, generator=gen)
                          for i, s in zip(cert, sizes)])

    inside = attacked(0.99 * res.certified_size[cert])
    adv = verified_inference(tr, inside, ys[cert], seed=2)
    changed = float((adv.prediction != res.prediction[cert]).mean())
    k, miss = len(cert), 1 - res.eta
    # each certificate may fail with probability 1 - eta, and so may the prediction's own estimate
    assert changed <= 2 * miss + 3 * math.sqrt(2 * miss / k)
    # control: the same attack far beyond the certified size changes many predictions
    far = verified_inference(tr, attacked(np.full(k, 1.0)), ys[cert], seed=3)
    assert float((far.prediction != res.prediction[cert]).mean()) > 0.3


@pytest.mark.slow
def test_conventional_accuracy_under_attack_scores_the_verified_prediction(trained):
    tr, xt, yt, _ = trained
    xs, ys = xt[:40], yt[:40]
    clean = verified_inference(tr, xs, ys, n=50, seed=4).accuracy()
    hit = conventional_accuracy_under_attack(tr, xs, ys, "fgsm", 1.0, n=50, seed=4)
    assert 0.0 <= hit < clean
    with pytest.raises(ValueError, match="mu_a"):
        conventional_accuracy_under_attack(tr, xs, ys, "fgsm", 0.0)
