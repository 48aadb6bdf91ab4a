"""DP-SGD (dpmech.dpsgd.trainer, trainables.dpsgd): Poisson sampling, clipping, noise, ledger, restore,
accounting against Opacus and dp-accounting, and a short MNIST run.

The mechanics run on a tiny CNN over 8x8 random images (milliseconds per step); only the last
tests touch MNIST. Statistical checks use fixed seeds and have negative controls.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dpmech.privacy.accounting import epsilon as event_epsilon
from dpmech.privacy.secret import NoiseKey
from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer, plan

# Opacus's hooks stay on the model (disabled outside training steps); the reference gradients
# computed here through the same model make torch note that they fire on module outputs.
pytestmark = [pytest.mark.filterwarnings("ignore:Full backward hook is firing"), pytest.mark.usefixtures("one_thread")]


def tiny_model(seed: int = 0, batchnorm: bool = False) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = [nn.Conv2d(1, 4, 3, stride=2)]
        if batchnorm:
            layers.append(nn.BatchNorm2d(4))
        layers += [nn.ReLU(), nn.Flatten(), nn.Linear(4 * 3 * 3, 3)]
        return nn.Sequential(*layers)


def tiny_data(n: int = 200, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 8, 8, generator=g) * 2 - 1
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def tiny_trainer(n: int = 200, model=None, **cfg) -> DPSGDTrainer:
    base = dict(epsilon=None, noise_multiplier=0.0, max_grad_norm=0.05, batch_size=20, epochs=1, lr=1.0,
                momentum=0.0, clipping="ghost", seed=0)
    base.update(cfg)
    x, y = tiny_data(n)
    # the research mode's key: these tests replay runs from the seed (the secret default: test_noise_secret.py)
    return DPSGDTrainer(model if model is not None else tiny_model(), x, y, DPSGDConfig(**base),
                        noise_key=NoiseKey.reproducible(base["seed"]))


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def per_example_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B, P] gradients of each example's loss, one backward per example (the reference)."""
    params = list(model.parameters())
    rows = []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
        rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


def update_times_batch(trainer: DPSGDTrainer, idx: torch.Tensor) -> torch.Tensor:
    """-(theta' - theta) * B of one step on ``idx`` with SGD lr 1: the clipped noisy sum."""
    before = flat_params(trainer.model)
    trainer._step(idx)
    return (before - flat_params(trainer.model)) * trainer.config.batch_size


# ------------------------------------------------------------------ Poisson sampling
def binomial_batch_check(sizes: np.ndarray, n: int, q: float) -> bool:
    """Mean and variance of the batch sizes agree with Binomial(n, q) (4 standard errors)."""
    t = sizes.shape[0]
    mean, var = n * q, n * q * (1 - q)
    z_mean = (sizes.mean() - mean) / math.sqrt(var / t)
    z_var = (sizes.var(ddof=1) / var - 1) / math.sqrt(2 / (t - 1))
    return abs(z_mean) < 4 and abs(z_var) < 4


def test_poisson_sampling_is_real():
    trainer = tiny_trainer(n=1000, batch_size=50)          # q = 0.05
    draws = [trainer.poisson_batch() for _ in range(2000)]
    sizes = np.array([len(d) for d in draws])
    assert binomial_batch_check(sizes, 1000, 0.05)
    # every example is included independently at rate q: per-example counts are Binomial(T, q)
    counts = np.bincount(torch.cat(draws).numpy(), minlength=1000)
    assert abs(counts.mean() - 2000 * 0.05) < 1.0
    assert 0.85 < counts.var(ddof=1) / (2000 * 0.05 * 0.95) < 1.15
    # negative controls: fixed-size shuffled batches, and a sampler at the wrong rate
    assert not binomial_batch_check(np.full(2000, 50), 1000, 0.05)
    wrong = np.random.default_rng(0).binomial(1000, 0.045, size=2000)
    assert not binomial_batch_check(wrong, 1000, 0.05)
    # the sampler is reproducible from the seed and differs across seeds
    again = tiny_trainer(n=1000, batch_size=50)
    assert torch.equal(again.poisson_batch(), draws[0])
    other = tiny_trainer(n=1000, batch_size=50, seed=1)
    assert not torch.equal(other.poisson_batch(), draws[0])


# ------------------------------------------------------------------ clipping and noise
@pytest.mark.parametrize("clipping", ["bk", "ghost", "flat"])
def test_clipped_sum_equals_manual_per_example_clip_and_sum(clipping):
    trainer = tiny_trainer(clipping=clipping, max_grad_norm=0.05)
    idx = torch.arange(16)
    x, y = trainer.x[idx], trainer.y[idx]
    g = per_example_grads(trainer.model, x, y)
    norms = g.norm(dim=1)
    assert (norms > 0.05).sum() >= 8, "the test needs examples above the clipping bound"
    manual = (g * (0.05 / (norms + 1e-6)).clamp(max=1.0)[:, None]).sum(0)
    got = update_times_batch(trainer, idx)
    assert torch.allclose(got, manual, atol=1e-5, rtol=1e-4)
    # negative control: the unclipped sum is far from it
    assert not torch.allclose(got, g.sum(0), atol=1e-3)


@pytest.mark.parametrize("clipping", ["bk", "ghost", "flat"])
def test_every_clipped_per_example_gradient_is_at_most_c(clipping):
    """Each example alone in a batch: the step is its clipped gradient, of norm min(||g_i||, C)."""
    trainer = tiny_trainer(clipping=clipping, max_grad_norm=0.05)
    start = trainer.state_dict()
    g = per_example_grads(trainer.model, trainer.x[:12], trainer.y[:12])
    for i in range(12):
        trainer.load_state_dict(start)
        step = update_times_batch(trainer, torch.tensor([i]))
        assert step.norm() <= 0.05 + 1e-6
        assert step.norm() == pytest.approx(min(float(g[i].norm()), 0.05), rel=1e-4)


def test_flat_mode_grad_samples_are_per_example_gradients_and_clip_to_c():
    trainer = tiny_trainer(clipping="flat", max_grad_norm=0.05)
    idx = torch.arange(16)
    x, y = trainer.x[idx], trainer.y[idx]
    reference = per_example_grads(trainer.model, x, y)
    trainer.gsm.enable_hooks()
    trainer.forward_backward(x, y)
    trainer.gsm.disable_hooks()
    opt = trainer.optimizer
    gs = torch.cat([p.grad_sample.reshape(16, -1) for p in opt.params], dim=1)
    assert torch.allclose(gs, reference, atol=1e-6, rtol=1e-4)
    # Opacus's flat clipping of those grad samples: every clipped row has norm <= C
    norms = torch.stack([p.grad_sample.reshape(16, -1).norm(dim=1) for p in opt.params], 1).norm(dim=1)
    factor = (0.05 / (norms + 1e-6)).clamp(max=1.0)
    assert ((gs * factor[:, None]).norm(dim=1) <= 0.05 + 1e-6).all()
    opt.clip_and_accumulate()
    summed = torch.cat([p.summed_grad.flatten() for p in opt.params])
    assert torch.allclose(summed, (gs * factor[:, None]).sum(0), atol=1e-6)
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("clipping", ["bk", "ghost", "flat"])
def test_no_noise_and_no_clipping_equals_a_non_private_step(clipping):
    trainer = tiny_trainer(clipping=clipping, max_grad_norm=1e6, lr=0.3, momentum=0.9)
    baseline = tiny_trainer(epsilon=None, noise_multiplier=None, lr=0.3, momentum=0.9)
    reference = tiny_model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.9)
    for idx in (torch.arange(0, 23), torch.arange(40, 57)):   # two steps: momentum state too
        loss = F.cross_entropy(reference(trainer.x[idx]), trainer.y[idx], reduction="sum") / 20
        opt.zero_grad()
        loss.backward()
        opt.step()
        trainer._step(idx)
        baseline._step(idx)
    assert torch.allclose(flat_params(trainer.model), flat_params(reference), atol=1e-6)
    assert torch.allclose(flat_params(baseline.model), flat_params(reference), atol=1e-6)
    assert baseline.privacy()["epsilon"] == math.inf


@pytest.mark.parametrize("clipping", ["bk", "ghost"])
def test_noise_has_std_sigma_c_and_comes_from_the_explicit_generator(clipping):
    """An empty batch: the update is the noise alone, N(0, (sigma C)^2) per coordinate, / B."""
    def noise(seed, sigma=1.3):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Flatten(), nn.Linear(64, 40))
        t = tiny_trainer(model=model, noise_multiplier=sigma, max_grad_norm=0.5, seed=seed, clipping=clipping)
        return update_times_batch(t, torch.tensor([], dtype=torch.long)), t

    z, t = noise(0)
    assert t.ledger.steps == 1  # an empty batch is a step and is recorded
    se = 1 / math.sqrt(2 * z.numel())  # relative standard error of the std estimate
    assert abs(float(z.std()) / (1.3 * 0.5) - 1) < 4 * se
    assert abs(float(z.mean())) < 4 * 1.3 * 0.5 / math.sqrt(z.numel())
    # negative control: noise of sigma / 1.2 is rejected by the same check
    low, _ = noise(0, sigma=1.3 / 1.2)
    assert abs(float(low.std()) / (1.3 * 0.5) - 1) > 4 * se
    assert torch.equal(noise(0)[0], z) and not torch.equal(noise(1)[0], z)


# ------------------------------------------------------------------ ledger and checkpoints
@pytest.mark.parametrize("clipping", ["bk", "ghost"])
def test_kill_and_restore_continues_identically(clipping):
    cfg = dict(noise_multiplier=1.1, max_grad_norm=0.5, epochs=3, optimizer="adam", lr=0.01,
               noise_augmentation_sigma=0.25, clipping=clipping, lr_schedule="cosine")
    full = tiny_trainer(**cfg)
    full.fit()

    first = tiny_trainer(**cfg)
    first.train_epoch()
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    del first                                               # the kill
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    restored = tiny_trainer(model=tiny_model(seed=5), **cfg)  # a fresh process, different init
    restored.load_state_dict(state)
    restored.fit()

    assert restored.ledger == full.ledger and restored.ledger.steps == 3 * 10
    assert restored.ledger.entries[0].noise_multiplier == 1.1 and restored.ledger.entries[0].sampling_rate == 0.1
    for a, b in zip(restored.model.state_dict().values(), full.model.state_dict().values()):
        assert torch.equal(a, b)

    # negative control: restoring everything but the noise generator gives other weights
    broken = tiny_trainer(model=tiny_model(seed=5), **cfg)
    broken.load_state_dict(state)
    broken.noise_gen.manual_seed(123)
    broken.fit()
    assert broken.ledger == full.ledger
    assert not torch.equal(flat_params(broken.model), flat_params(full.model))


def test_checkpoint_of_another_config_is_refused():
    state = tiny_trainer(noise_multiplier=1.0).state_dict()
    with pytest.raises(ValueError, match="config"):
        tiny_trainer(noise_multiplier=2.0).load_state_dict(state)


# ------------------------------------------------------------------ accounting
def test_epsilon_agrees_with_opacus_and_dp_accounting_and_meets_the_target():
    from dp_accounting import dp_event as dpe
    from dp_accounting.rdp import rdp_privacy_accountant
    from opacus.accountants import RDPAccountant

    # the MNIST test's plan (q = 64 / 2000, 64 steps, epsilon 8): its calibration is computed once
    trainer = tiny_trainer(n=2000, batch_size=64, epochs=2, epsilon=8.0, noise_multiplier=None)
    trainer.fit()
    p = trainer.privacy()
    q, sigma, steps = p["sampling_rate"], p["noise_multiplier"], int(p["steps"])
    assert (q, steps) == (0.032, 64) and len(trainer.ledger.entries) == 1

    opacus = RDPAccountant()
    opacus.history = [(sigma, q, steps)]
    eps_opacus = opacus.get_epsilon(1e-5)
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(sigma)), steps))
    eps_dpa = acc.get_epsilon(1e-5)
    assert p["epsilon"] == pytest.approx(eps_dpa, abs=0.01)
    assert p["epsilon"] == pytest.approx(eps_opacus, abs=0.02)
    # calibrated from the planned steps: at most the target, and not wastefully below it
    assert 7.95 <= p["epsilon"] <= 8.0
    assert p["epsilon_pld"] < p["epsilon"]
    # the calibration is the smallest sigma: 1% less noise exceeds the target
    smaller = trainer.plan.__class__(2000, q, 32, steps, sigma * 0.99)
    assert event_epsilon(smaller.dp_event(), 1e-5) > 8.0


def test_config_errors_name_the_field():
    x, y = tiny_data(50)
    for kwargs, field in [({"epsilon": -1.0}, "epsilon"), ({"epsilon": 1.0, "noise_multiplier": 1.0}, "epsilon"),
                          ({"clipping": "perlayer"}, "clipping"), ({"delta": 1.0}, "delta"),
                          ({"max_grad_norm": 0.0}, "max_grad_norm"), ({"epsilon": math.inf}, "epsilon")]:
        with pytest.raises(ValueError, match=f"^{field}"):
            DPSGDConfig(**kwargs)
    with pytest.raises(ValueError, match="^batch_size"):
        plan(DPSGDConfig(batch_size=51), 50)


def test_batchnorm_is_replaced_and_a_model_is_not_wrapped_twice():
    trainer = tiny_trainer(model=tiny_model(batchnorm=True), noise_multiplier=1.0)
    kinds = {type(m) for m in trainer.model.modules()}
    assert nn.GroupNorm in kinds and nn.BatchNorm2d not in kinds
    model = tiny_model()
    tiny_trainer(model=model, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="^model"):
        tiny_trainer(model=model, noise_multiplier=1.0)


# ------------------------------------------------------------------ the trainable on MNIST
def test_short_mnist_run_is_well_above_chance_and_matches_its_planned_event():
    from dpmech.datasets.splits import load_splits
    from trainables.dpsgd import DPSGDMechanism, DPSGDTrialConfig, privacy_event

    train, test = load_splits("mnist", train_size=2000, test_size=500, seed=0)
    cfg = DPSGDTrialConfig(train_size=2000, epsilon=8.0, epochs=2, batch_size=64, lr=0.1)
    mech = DPSGDMechanism(cfg, *train.tensors, torch.device("cpu"), noise_key=NoiseKey.reproducible(0))
    while mech.epoch < cfg.epochs:
        mech.train_epoch()
    acc = mech.test_accuracy(*test.tensors)
    assert acc > 0.5, acc                                   # chance is 0.1
    p = mech.privacy()
    assert p["steps"] == 2 * 32 and p["epsilon"] <= 8.0
    assert p["epsilon"] == pytest.approx(event_epsilon(privacy_event(cfg), cfg.delta), abs=1e-9)
    assert mech.smoothing_classifier() is None and mech.certify(None, None, cfg) is None
    sigma_cfg = DPSGDTrialConfig(train_size=2000, epsilon=None, noise_augmentation_sigma=0.5)
    assert DPSGDMechanism(sigma_cfg, *train.tensors, torch.device("cpu")).smoothing_classifier()[1] == 0.5


def test_trial_schema_rules():
    from trainables.dpsgd import DPSGDTrialConfig

    assert DPSGDTrialConfig(epsilon=None).epsilon is None          # the non-private baseline
    for bad in ({"epsilon": 0.0}, {"epsilon": float("inf")}, {"train_size": 100, "batch_size": 101},
                {"clipping": "hooks"}):
        with pytest.raises(Exception):
            DPSGDTrialConfig(**bad)
    assert DPSGDTrialConfig(audit_canaries=10).audit_canaries == 10  # the audit applies


# ------------------------------------------------------------------ models and recipes (issue 14)
def test_model_key_builds_the_named_network_and_defaults_to_the_pixeldp_cnn():
    from dpmech.networks.dpsgd_models import TBMnistCNN
    from dpmech.networks.pixeldp import PixelDPCNN
    from trainables.dpsgd import DPSGDMechanism, DPSGDTrialConfig

    x, y = torch.rand(64, 1, 28, 28) * 2 - 1, torch.randint(0, 10, (64,))
    assert DPSGDTrialConfig().model == "pixeldp_cnn"           # the DPAL-paper baseline comparison
    default = DPSGDMechanism(DPSGDTrialConfig(train_size=64, batch_size=16), x, y, torch.device("cpu"))
    assert isinstance(default.model, PixelDPCNN)
    tb = DPSGDMechanism(DPSGDTrialConfig(train_size=64, batch_size=16, model="tb_cnn", clipping="bk"), x, y,
                        torch.device("cpu"))
    assert isinstance(tb.model, TBMnistCNN) and sum(p.numel() for p in tb.model.parameters()) == 26010
    assert tb.model(x[:2]).shape == (2, 10)
    with pytest.raises(Exception):
        DPSGDTrialConfig(model="resnet")


def test_lenet_is_the_smoothing_literature_s_mnist_network_and_clips_per_example():
    """``model: lenet`` (431,080 parameters); one DP-SGD step's clipped sum on it equals the
    per-example reference (every clipping route handles its layers); refused on CIFAR-10 in one line."""
    from dpmech.networks.dpsgd_models import LeNet, build_dp_model
    from trainables.dpsgd import DPSGDMechanism, DPSGDTrialConfig

    x, y = torch.rand(32, 1, 28, 28) * 2 - 1, torch.randint(0, 10, (32,))
    m = DPSGDMechanism(DPSGDTrialConfig(train_size=32, batch_size=8, model="lenet", clipping="bk"), x, y,
                       torch.device("cpu"))
    assert isinstance(m.model, LeNet) and sum(p.numel() for p in m.model.parameters()) == 431_080
    with torch.no_grad():
        fast = m.model(x[:4])
    assert torch.equal(fast, m.model(x[:4]).detach())     # FastMaxPool2d: the same function as autograd's kernel
    from tests.test_clipping_routes import per_row_grads, run_bk

    g = per_row_grads(build_dp_model("lenet", "mnist", 0), x[:8], y[:8])
    clipped = g * (0.5 / (g.norm(dim=1) + 1e-6)).clamp(max=1.0)[:, None]
    _, got, _ = run_bk(build_dp_model("lenet", "mnist", 0), x[:8], y[:8], 0.5, prefer="inst")
    assert torch.allclose(got, clipped.sum(0), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="^model: 'lenet' is defined for 28 x 28 images"):
        build_dp_model("lenet", "cifar10", 0)


def test_lr_schedules_follow_the_planned_steps():
    cfg = DPSGDConfig(lr=0.5, lr_schedule="cosine")
    assert cfg.lr_at(0, 100) == 0.5 and cfg.lr_at(50, 100) == pytest.approx(0.25) and cfg.lr_at(100, 100) == 0.0
    step = DPSGDConfig(lr=1.0, lr_schedule="step")
    assert [step.lr_at(k, 100) for k in (0, 49, 50, 74, 75)] == pytest.approx([1, 1, 0.1, 0.1, 0.01])
    assert DPSGDConfig(lr=0.3).lr_at(99, 100) == 0.3
    trainer = tiny_trainer(noise_multiplier=1.0, lr=0.4, lr_schedule="cosine", epochs=2)   # 20 steps
    for _ in range(10):
        trainer.train_step()
    trainer.train_step()                                                                    # step 10 of 20
    assert trainer.base_optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="^lr_schedule"):
        DPSGDConfig(lr_schedule="linear")
