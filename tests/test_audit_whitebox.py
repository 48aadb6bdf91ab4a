"""White-box gradient canaries in the DP-SGD engine (dpmech.privacy.audit.whitebox; issue 25, point 1).

* m = 0 canaries: training is bit-for-bit the run without canaries (each clipping engine).
* Canary gradients enter the clipped sum exactly: C e_c on the canary's coordinate, only for
  included canaries sampled in that step, before the noise (each engine, noise 0 so the sum is
  visible); sampled at the plan's q (a binomial test, with a negative control at 2q).
* The audit of a tiny run: a positive lower bound that does not exceed the claim (each engine),
  and a bound that grows as sigma shrinks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from scipy.stats import binomtest

from dpmech.privacy.audit.whitebox import WhiteBoxCanaries
from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer

pytestmark = [pytest.mark.filterwarnings("ignore:Full backward hook is firing"), pytest.mark.usefixtures("one_thread")]

ENGINES = ("bk", "ghost", "flat")


def data(n=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 6, 6, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def net() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(64, 16), nn.Tanh(),
                             nn.Linear(16, 3))


def trainer(clipping, canaries=None, **kw) -> DPSGDTrainer:
    x, y = data()
    cfg = dict(epsilon=None, noise_multiplier=1.0, max_grad_norm=0.5, batch_size=32, epochs=1, lr=0.05,
               clipping=clipping, seed=3)
    cfg.update(kw)
    return DPSGDTrainer(net(), x, y, DPSGDConfig(**cfg), canaries=canaries)


@pytest.mark.parametrize("clipping", ENGINES)
def test_zero_canaries_train_identically(clipping):
    plain = trainer(clipping)
    with_none = trainer(clipping, WhiteBoxCanaries(0, seed=1))
    for _ in range(3):
        plain.train_step()
        with_none.train_step()
    for a, b in zip(plain.model.parameters(), with_none.model.parameters()):
        assert torch.equal(a, b)
    assert with_none.canaries.steps == 3


def grab_observed(can: WhiteBoxCanaries) -> list:
    """Record every noisy sum the auditor observes (flattened, float64)."""
    seen, orig = [], can.observe

    def observe(noisy):
        seen.append(torch.cat([g.detach().reshape(-1) for g in noisy]).double())
        orig(noisy)
    can.observe = observe
    return seen


def grab_update(t: DPSGDTrainer) -> list:
    """Record B * p.grad when the wrapped optimizer steps: the noisy sum the step applies."""
    seen, opt = [], t.base_optimizer
    orig = opt.step

    def step(*a, **k):
        seen.append(torch.cat([p.grad.detach().reshape(-1) for p in t.model.parameters()]).double()
                    * t.config.batch_size)
        return orig(*a, **k)
    opt.step = step
    return seen


@pytest.mark.parametrize("clipping", ENGINES)
def test_canary_gradients_enter_the_sum_exactly(clipping):
    """Noise 0: the observed sum minus a canary-free run's clipped sum (same parameters, same
    batch) is C on the coordinates of the included canaries sampled in the step, 0 elsewhere; and
    the optimizer applies exactly the observed sum / B."""
    C = 0.5
    can = WhiteBoxCanaries(60, seed=2, statistic="sum", placement="all")
    t = trainer(clipping, can, noise_multiplier=0.0)
    ref = trainer(clipping, None, noise_multiplier=0.0)
    observed, applied, reference = grab_observed(can), grab_update(t), grab_update(ref)
    bumps = 0
    for _ in range(3):
        for p, r in zip(t.model.parameters(), ref.model.parameters()):   # same parameters before the step
            r.data.copy_(p.data)
        idx = t.poisson_batch()
        t._step(idx)
        ref._step(idx)
        expected = torch.zeros_like(observed[-1])
        expected[torch.from_numpy(can.coordinates[can.last_batch])] = C
        assert torch.allclose(observed[-1] - reference[-1], expected, atol=1e-5)
        assert torch.allclose(applied[-1], observed[-1], atol=1e-5)
        assert not (can.last_batch & ~can.included).any()
        bumps += int(can.last_batch.sum())
    assert bumps > 0


def test_canaries_are_sampled_with_the_plans_q():
    """Each included canary joins a step's batch with probability q = batch_size / N (binomial
    test); excluded canaries never do. Negative control: the same counts reject 2q."""
    can = WhiteBoxCanaries(400, seed=5, statistic="sum")
    t = trainer("bk", can, noise_multiplier=0.0, lr=1e-6)
    steps = 12
    for _ in range(steps):
        t.train_step()
    q = t.plan.sampling_rate
    n_in = int(can.included.sum())
    hits = int(can.sampled[can.included].sum())
    assert can.sampled[~can.included].sum() == 0
    assert binomtest(hits, n_in * steps, q).pvalue > 1e-3
    assert binomtest(hits, n_in * steps, min(2 * q, 1.0)).pvalue < 1e-6
    assert 150 < n_in < 250                 # the secret bits are fair coins


def audited(clipping, *, epsilon=None, noise_multiplier=None, m=1000, seed=0, statistic="llr"):
    """A tiny DP-SGD run (256 examples, batch 64, 4 epochs = 16 steps) with m Dirac canaries."""
    can = WhiteBoxCanaries(m, seed=seed, statistic=statistic)
    x, y = data(256)
    cfg = DPSGDConfig(epsilon=epsilon, noise_multiplier=noise_multiplier, delta=1e-5, max_grad_norm=1.0,
                      batch_size=64, epochs=4, lr=0.05, clipping=clipping, seed=seed)
    t = DPSGDTrainer(net(), x, y, cfg, canaries=can).fit()
    return t, can.audit(delta=1e-5, estimators=("steinke", "fdp", "gdp"), guess_fraction=0.1)


@pytest.mark.parametrize("clipping", ENGINES)
def test_whitebox_audit_of_a_correct_run_is_positive_and_below_the_claim(clipping):
    """Claim epsilon 8 (sigma ~1.02 over 16 steps at q = 1/4): the white-box bounds are well above
    0 (a black-box audit of such a run gives 0) and do not exceed the ledger's epsilon."""
    t, out = audited(clipping, epsilon=8.0)
    claim = t.privacy()["epsilon"]
    assert claim <= 8.0
    for key in ("audit_epsilon_lb_steinke", "audit_epsilon_lb_fdp"):
        assert 0.8 < out[key] <= claim, (key, out[key])
    assert out["audit_epsilon_lb_fdp"] > out["audit_epsilon_lb_steinke"]   # Mahloujifar et al.'s is tighter
    assert out["audit_epsilon_lb"] == out["audit_epsilon_lb_steinke"]       # the first rigorous estimator
    assert out["audit_steps"] == 16


def test_whitebox_audit_grows_as_sigma_shrinks():
    """Less noise, more leakage: the f-DP bound and the GDP estimate rise as sigma falls; with
    sigma 8 the bound is (near) 0 (the negative control)."""
    lbs, ests = [], []
    for sigma in (8.0, 1.5, 0.6):
        _, out = audited("bk", noise_multiplier=sigma)
        lbs.append(out["audit_epsilon_lb_fdp"])
        ests.append(out["audit_epsilon_est_gdp"])
    assert lbs[0] < 0.3
    assert lbs[0] < lbs[1] < lbs[2]
    assert ests[0] < ests[1] < ests[2]


def test_checkpoint_continues_the_canaries_exactly():
    """state_dict / load_state_dict carry the canaries' scores and sampling stream."""
    a = trainer("bk", WhiteBoxCanaries(50, seed=4))
    for _ in range(2):
        a.train_step()
    state = a.state_dict()
    b = trainer("bk", WhiteBoxCanaries(50, seed=4))
    b.load_state_dict(state)
    for _ in range(2):
        a.train_step()
        b.train_step()
    assert np.array_equal(a.canaries.scores, b.canaries.scores)
    assert np.array_equal(a.canaries.sampled, b.canaries.sampled)
    with pytest.raises(ValueError, match="canaries"):
        trainer("bk", WhiteBoxCanaries(50, seed=5)).load_state_dict(state)
    with pytest.raises(ValueError, match="checkpoint"):
        trainer("bk").load_state_dict(state)


def test_random_directions_and_bad_input():
    """Random unit directions work through the same engine; bad settings fail with one line."""
    can = WhiteBoxCanaries(200, seed=1, direction="random")
    t = trainer("bk", can, noise_multiplier=0.8, epochs=3)
    t.fit()
    assert can.steps == t.steps and np.all(np.isfinite(can.scores))
    assert can.audit(delta=1e-5)["audit_epsilon_lb_steinke"] >= 0
    with pytest.raises(ValueError, match="largest parameter tensor"):
        trainer("bk", WhiteBoxCanaries(5000, seed=1))
    with pytest.raises(ValueError, match="'llr' needs noise"):
        trainer("bk", WhiteBoxCanaries(10, seed=1), noise_multiplier=0.0)
    with pytest.raises(ValueError, match="non-private baseline"):
        trainer("bk", WhiteBoxCanaries(10, seed=1), noise_multiplier=None)
    with pytest.raises(ValueError, match="direction"):
        WhiteBoxCanaries(10, direction="diagonal")
    with pytest.raises(ValueError, match="'gdp' is an estimate"):
        can.audit(delta=1e-5, estimators=("gdp",))


@pytest.mark.parametrize("which", ["dpal_sound", "secure_sgd"])
def test_mechanisms_on_the_engine_get_the_canaries(which):
    """DPAL-sound (paired book-keeping) and SecureSGD (Opacus ghost on a PixelDP network) insert
    the canaries into their clipped sums like DP-SGD: observed - canary-free = C on the sampled
    included canaries' coordinates (noise 0, one step from the same initialisation)."""
    g = torch.Generator().manual_seed(0)
    if which == "dpal_sound":
        from dpmech.dpal_sound.trainer import DPALSoundConfig, DPALSoundTrainer

        x, y = torch.rand(64, 1, 8, 8, generator=g) * 2 - 1, torch.randint(0, 3, (64,), generator=g)
        cfg = DPALSoundConfig(epsilon=None, noise_multiplier=0.0, max_grad_norm=0.05, batch_size=32, epochs=1,
                              lr=1.0, smoothing_sigma=0.5, xi=0.7, mu_max=0.3, attacks=("fgsm",), attack_steps=2,
                              seed=0)

        def build(c):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                model = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(),
                                      nn.Linear(36, 8), nn.Tanh(), nn.Linear(8, 3))
            return DPALSoundTrainer(model, x, y, cfg, canaries=c)
    else:
        from dpmech.secure_sgd.trainer import SecureSGDConfig, SecureSGDTrainer

        x, y = torch.rand(32, 1, 28, 28, generator=g) * 2 - 1, torch.randint(0, 10, (32,), generator=g)
        cfg = SecureSGDConfig(epsilon=None, noise_multiplier=0.0, max_grad_norm=0.05, batch_size=16, epochs=1,
                              lr=1.0, momentum=0.0, seed=3)

        def build(c):
            return SecureSGDTrainer(cfg, x, y, canaries=c)
    can = WhiteBoxCanaries(30, seed=1, statistic="sum", placement="all")
    t, ref = build(can), build(None)
    observed, reference = grab_observed(can), grab_update(ref)
    idx = t.poisson_batch()
    t._step(idx)
    ref._step(idx)
    expected = torch.zeros_like(observed[-1])
    expected[torch.from_numpy(can.coordinates[can.last_batch])] = cfg.max_grad_norm
    assert can.steps == 1 and can.last_batch.any()
    assert torch.allclose(observed[-1] - reference[-1], expected, atol=1e-5)
