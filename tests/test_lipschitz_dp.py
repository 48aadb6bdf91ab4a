"""Clipless DP-SGD (dpmech.lipschitz.trainer): the a-priori per-example gradient bounds hold, the noise drawn
is the noise the accountant assumes (statistical test, fixed keys, with a control), epsilon is dp-accounting's,
and a checkpoint continues bit for bit."""

import math

import pytest
import torch
from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import RdpAccountant
from torch import nn

from dpmech.lipschitz.layers import Flatten, GroupSort2, InputClip, L2NormPool2d, LipschitzConv2d, LipschitzDense
from dpmech.lipschitz.loss import LOSS_LIPSCHITZ
from dpmech.lipschitz.network import LipschitzSequential, lipschitz_mlp
from dpmech.lipschitz.trainer import (
    GradientBoundExceeded,
    LipschitzDPConfig,
    LipschitzDPTrainer,
    effective_noise_multiplier,
    noise_stds,
    per_example_gradient_norms,
)
from dpmech.privacy.secret import NoiseKey

KEY = NoiseKey(b"test-lipschitz-dp-fixed-key-0001")


class Understated(nn.Module):
    """Negative control: multiplies by ``factor``, claims Lipschitz 1."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return self.factor * x

    def lipschitz_bound(self):
        return 1.0


def small_cnn(lie=None):
    gen = torch.Generator().manual_seed(3)
    layers = [InputClip(-1.0, 4.0), LipschitzConv2d(1, 4, 3, (6, 6), generator=gen), GroupSort2(), L2NormPool2d(2),
              Flatten(), LipschitzDense(36, 8, generator=gen), GroupSort2()]
    layers += [Understated(lie)] if lie else []
    return LipschitzSequential(*layers, LipschitzDense(8, 5, generator=gen))


def adversarial_batch(model, n=64, tau=8.0, seed=0):
    """Inputs far outside the clip (so clipped to norm R) labelled with the class the model likes least,
    which drives ||softmax(tau z) - e_y|| towards sqrt(2): near the worst case of the bound."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape_of(model), generator=gen) * 5
    with torch.no_grad():
        y = model(x).argmin(1)
    return x, y


def shape_of(model):
    return (1, 6, 6) if isinstance(model[1], LipschitzConv2d) else (model[1].weight.shape[1],)


@pytest.mark.parametrize("make", [small_cnn, lambda: lipschitz_mlp(10, 12, 4, seed=2, input_radius=3.0, depth=3)])
def test_per_example_gradients_never_exceed_their_bounds(make):
    model = make()
    bounds = torch.tensor(model.gradient_bounds(LOSS_LIPSCHITZ))
    for seed in range(3):
        x, y = adversarial_batch(model, seed=seed)
        norms = per_example_gradient_norms(model, x, y, tau=8.0)
        assert (norms <= bounds * (1 + 1e-5)).all()
    gen = torch.Generator().manual_seed(9)
    x = torch.rand(64, *shape_of(model), generator=gen) * 2 - 1
    norms = per_example_gradient_norms(model, x, torch.randint(0, 4, (64,), generator=gen), tau=1.0)
    assert (norms <= bounds * (1 + 1e-5)).all()


def test_the_last_layers_bound_is_tight_and_an_understated_network_is_refused():
    # one dense layer after the clip: ||dW|| = ||softmax(tau z) - e_y|| ||x||, close to sqrt(2) R when wrong
    model = lipschitz_mlp(10, 12, 4, seed=2, input_radius=3.0, depth=1)
    x, y = adversarial_batch(model, tau=50.0)
    norms = per_example_gradient_norms(model, x, y, tau=50.0)
    assert float(norms.max()) > 0.95 * model.gradient_bounds(LOSS_LIPSCHITZ)[0]
    # control: a hidden layer scaled by 3 that claims 1 breaks the bounds, and the trainer's check refuses
    liar = small_cnn(lie=3.0)
    x, y = adversarial_batch(liar, tau=50.0)
    norms = per_example_gradient_norms(liar, x, y, tau=50.0)
    assert (norms > torch.tensor(liar.gradient_bounds(LOSS_LIPSCHITZ))).any()
    trainer = LipschitzDPTrainer(liar, x, y, LipschitzDPConfig(epsilon=3.0, batch_size=32, epochs=1, tau=50.0,
                                                              check_bound_every=1), noise_key=KEY)
    with pytest.raises(GradientBoundExceeded, match="a-priori bound"):
        trainer.check_bounds(x, y)
    honest = LipschitzDPTrainer(small_cnn(), x, y, LipschitzDPConfig(epsilon=3.0, batch_size=32, epochs=1, tau=50.0,
                                                                     check_bound_every=1), noise_key=KEY)
    honest.train_epoch()                         # the same check passes on every step of an honest network


def noise_of_one_step(trainer):
    """The noise the step adds to each layer's gradient SUM (an empty batch: the sum is 0), read before
    the optimizer applies it (times B: the trainer divides by the expected batch size)."""
    seen = {}

    def grab(opt, args, kwargs):
        seen.update({i: [p.grad.clone() * trainer.config.batch_size for p in trainer.model[i].parameters()]
                     for i in trainer.model.parameterised()})
    handle = trainer.optimizer.register_step_pre_hook(grab)
    trainer._step(torch.zeros(0, dtype=torch.long))
    handle.remove()
    return [torch.cat([g.flatten() for g in seen[i]]) for i in trainer.model.parameterised()]


def empirical_sigma(trainer, steps=10):
    """sigma_eff estimated from the noise drawn in ``steps`` empty steps (lr ~ 0: the weights, hence the
    bounds, do not move): 1 / sqrt(sum_i (Delta_i / s_hat_i)^2), s_hat_i the sample sd of layer i's noise,
    and the largest |z| of the per-layer relative errors (each s_hat^2 / s^2 has sd sqrt(2 / n_i))."""
    bounds = trainer.model.gradient_bounds(LOSS_LIPSCHITZ)
    draws = [noise_of_one_step(trainer) for _ in range(steps)]
    noise = [torch.cat(layer) for layer in zip(*draws)]
    s_hat = [float(z.std()) for z in noise]
    expected = noise_stds(bounds, trainer.noise_multiplier, trainer.config.noise_allocation)
    z = max(abs(sh ** 2 / s ** 2 - 1) / math.sqrt(2 / n.numel()) for sh, s, n in zip(s_hat, expected, noise))
    return effective_noise_multiplier(bounds, s_hat), z


@pytest.mark.parametrize("allocation", ["per_layer", "global"])
def test_the_noise_drawn_is_the_noise_the_accountant_assumes_and_a_halved_noise_is_caught(allocation, monkeypatch):
    x = torch.randn(400, 1, 6, 6)
    y = torch.randint(0, 5, (400,))
    cfg = LipschitzDPConfig(epsilon=2.0, batch_size=40, epochs=2, noise_allocation=allocation, lr=1e-12)
    trainer = LipschitzDPTrainer(small_cnn(), x, y, cfg, noise_key=KEY)
    sigma_hat, z = empirical_sigma(trainer)
    assert z < 4.5                                              # each layer's variance within 4.5 sd
    assert sigma_hat == pytest.approx(trainer.noise_multiplier, rel=0.1)
    assert trainer.ledger.entries[-1].noise_multiplier == trainer.noise_multiplier
    # control: a trainer that draws half the noise it claims fails the same test
    import dpmech.lipschitz.trainer as mod

    halved = lambda b, s, a: [v / 2 for v in noise_stds(b, s, a)]          # noqa: E731
    monkeypatch.setattr(mod, "noise_stds", halved)
    monkeypatch.setattr(mod, "effective_noise_multiplier", lambda b, s: 10.0)   # and lies about it
    cheat = LipschitzDPTrainer(small_cnn(), x, y, cfg, noise_key=KEY)
    sigma_cheat, z_cheat = empirical_sigma(cheat)
    assert z_cheat > 4.5 and sigma_cheat < 0.6 * cheat.noise_multiplier


def test_epsilon_is_dp_accountings_for_the_steps_taken_and_survives_a_checkpoint():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 10, generator=gen), torch.randint(0, 4, (200,), generator=gen)
    cfg = LipschitzDPConfig(epsilon=1.5, delta=1e-5, batch_size=20, epochs=2, lr=0.01)
    make = lambda: lipschitz_mlp(10, 12, 4, seed=2, input_radius=3.0)    # noqa: E731
    trainer = LipschitzDPTrainer(make(), x, y, cfg, noise_key=KEY)
    trainer.train_epoch()
    state = trainer.state_dict()
    trainer.train_epoch()
    spent = trainer.privacy()
    q, sigma, steps = 0.1, spent["noise_multiplier"], 20
    event = SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)
    rdp = RdpAccountant()
    rdp.compose(event)
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(event)
    assert spent["steps"] == steps and spent["epsilon"] <= 1.5
    assert spent["epsilon"] == pytest.approx(rdp.get_epsilon(1e-5), rel=1e-3)
    assert spent["epsilon_pld"] == pytest.approx(pld.get_epsilon(1e-5), rel=1e-2)
    resumed = LipschitzDPTrainer(make(), x, y, cfg, noise_key=KEY)
    resumed.load_state_dict(state)
    resumed.train_epoch()
    for a, b in zip(trainer.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert resumed.privacy() == spent


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="noise_allocation"):
        LipschitzDPConfig(noise_allocation="half")
    with pytest.raises(ValueError, match="tau"):
        LipschitzDPConfig(tau=0)
    with pytest.raises(ValueError, match="batch_size"):
        LipschitzDPTrainer(lipschitz_mlp(3, 4, 2), torch.zeros(5, 3), torch.zeros(5, dtype=torch.long),
                           LipschitzDPConfig(batch_size=10), noise_key=KEY)
    with pytest.raises(ValueError, match="model"):
        LipschitzDPTrainer(nn.Linear(3, 2), torch.zeros(5, 3), torch.zeros(5, dtype=torch.long),
                           LipschitzDPConfig(batch_size=2), noise_key=KEY)
