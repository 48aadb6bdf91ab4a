"""White-box gradient canaries in the DP-SGD engine (dpmech.privacy.audit.whitebox; issue 25 point 1,
issue 32 point 5, issue 35 points 6 and 7).

* m = 0 canaries (either kind): training is bit-for-bit the run without canaries (each clipping engine).
* Engine canaries are rows of the batch clipped by the engine (each route): noise 0, the update
  minus a canary-free run's on the same real examples is exactly kappa C on the sampled canaries'
  coordinates (and C / sqrt(s^2 + 1) on their bias entries); an engine that clips to 100 C fails
  the same check by a factor of 100 (negative control).
* Inserted canaries' clipped gradients enter the sum exactly (each engine).
* One sampling plan: canaries are drawn by the engine's sampler with every example, at the plan's
  q; 60,000 draws see a 1.1 q rate as wrong (negative control), and so do the self-drawn
  canaries of trainers that do not draw them (DPGAN's).
* The audit of a tiny run (each engine, both kinds): positive and below the claim; the same check
  on an engine whose noise is a tenth of what its ledger claims fails by a wide margin.
* Every bound the audit reports is recomputed from its counts at the configured beta and delta.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from scipy.stats import binomtest

from dpmech.privacy.audit.whitebox import EngineCanaries, WhiteBoxCanaries
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


def replayable(seed: int) -> dict:
    """The research mode's noise key where the engine takes one (issue 32.1): these tests compare
    runs draw for draw, so their sampling and noise follow the public seed."""
    import inspect

    if "noise_key" not in inspect.signature(DPSGDTrainer).parameters:
        return {}
    from dpmech.privacy.secret import NoiseKey

    return {"noise_key": NoiseKey.reproducible(seed)}


def trainer(clipping, canaries=None, cls=DPSGDTrainer, **kw) -> DPSGDTrainer:
    x, y = data()
    cfg = dict(epsilon=None, noise_multiplier=1.0, max_grad_norm=0.5, batch_size=32, epochs=1, lr=0.05,
               clipping=clipping, seed=3)
    cfg.update(kw)
    return cls(net(), x, y, DPSGDConfig(**cfg), canaries=canaries, **replayable(cfg["seed"]))


KINDS = {"engine": EngineCanaries, "inserted": WhiteBoxCanaries}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("clipping", ENGINES)
def test_zero_canaries_train_identically(clipping, kind):
    plain = trainer(clipping)
    with_none = trainer(clipping, KINDS[kind](0, seed=1))
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


def real_part(t: DPSGDTrainer, idx: torch.Tensor) -> torch.Tensor:
    return idx[idx < t.num_real_examples]


@pytest.mark.parametrize("clipping", ENGINES)
def test_inserted_canary_gradients_enter_the_sum_exactly(clipping):
    """Noise 0: the observed update minus a canary-free run's (same parameters, same real
    examples) is C on the coordinates of the included canaries the engine drew, 0 elsewhere; and
    the optimizer applies exactly the observed update / B."""
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
        ref._step(real_part(t, idx))
        expected = torch.zeros_like(observed[-1])
        expected[torch.from_numpy(can.coordinates[can.last_batch])] = C
        assert torch.allclose(observed[-1] - reference[-1], expected, atol=1e-5)
        assert torch.allclose(applied[-1], observed[-1], atol=1e-5)
        assert not (can.last_batch & ~can.included).any()
        bumps += int(can.last_batch.sum())
    assert bumps > 0


class ClipsAt100C(DPSGDTrainer):
    """A planted clipping bug (bk): every example is clipped to 100 C while the ledger assumes C."""

    def _bk_forward_backward(self, xb, yb):
        bk = self.bookkeeper
        bk.enabled = True
        try:
            logits = self.forward_train(xb)
        finally:
            bk.enabled = False
        per_example = self.per_example_loss(logits, yb)
        bk.clipped_sum(per_example.sum(), 100 * self.config.max_grad_norm)
        self._add_noise_and_scale()
        return logits.detach(), per_example.detach()


def engine_canary_excess(clipping, cls=DPSGDTrainer, steps=3) -> list[torch.Tensor]:
    """Noise 0: per step, (update with engine canaries - canary-free update on the same real
    examples and parameters) - the exact clipped canary gradients (kappa C on each drawn canary's
    coordinate, C / sqrt(s^2 + 1) on its layer's bias entry r): zero for a correct engine."""
    C = 0.5
    can = EngineCanaries(60, seed=2, statistic="sum", placement="all")
    t = trainer(clipping, can, cls=cls, noise_multiplier=0.0)
    ref = trainer(clipping, None, cls=cls, noise_multiplier=0.0)
    observed, reference = grab_observed(can), grab_update(ref)
    names = [n for n, p in t.model.named_parameters() if p.requires_grad]
    sizes = [p.numel() for p in t.model.parameters() if p.requires_grad]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    s = can.raw_norm
    out = []
    for _ in range(steps):
        for p, r in zip(t.model.parameters(), ref.model.parameters()):
            r.data.copy_(p.data)
        idx = t.poisson_batch()
        t._step(idx)
        ref._step(real_part(t, idx))
        expected = torch.zeros_like(observed[-1], dtype=torch.float64)
        for mod, (js, rows, cols) in can._targets.items():
            w = names.index(next(n for n, p in t.model.named_parameters() if p is mod.weight))
            b = names.index(next(n for n, p in t.model.named_parameters() if p is mod.bias))
            for j, r in zip(js.tolist(), rows.tolist()):
                if can.last_batch[j]:
                    expected[int(can.coordinates[j])] += C * can.kappa[j]
                    expected[int(starts[b]) + r] += C / math.sqrt(s * s + 1)
            assert can.layer_names and w != b
        out.append((observed[-1] - reference[-1]) - expected)
        assert can.last_batch.any() or _ > 0
    assert int(can.sampled.sum()) > 0
    return out


@pytest.mark.parametrize("clipping", ENGINES)
def test_engine_canaries_are_clipped_by_the_engine(clipping):
    """Engine canaries (raw norm 100 C) come out of the engine's clipping at exactly their clipped
    value on every route; the real examples' clipped sum is unchanged by them."""
    for excess in engine_canary_excess(clipping):
        assert excess.abs().max() < 2e-5, excess.abs().max()


def test_a_clipping_bug_is_seen_by_engine_canaries_untold():
    """Negative control: the same check on an engine that clips to 100 C (nothing tells the
    canaries) is off by ~99 C on every drawn canary's coordinate."""
    worst = max(float(e.abs().max()) for e in engine_canary_excess("bk", cls=ClipsAt100C))
    assert worst > 40, worst


@pytest.mark.parametrize("kind", KINDS)
def test_canaries_and_examples_share_one_sampling_plan(kind):
    """Both kinds are drawn by the engine's Poisson sampler with the real examples: over 120 steps
    (~60,000 canary draws at q = 1/4) the included canaries' rate is q (binomial test), the same
    counts reject 1.1 q (negative control: ~14 standard deviations away), excluded canaries are
    never drawn, and the real examples' rate in the same draws is q too."""
    can = KINDS[kind](1000, seed=5, statistic="sum", placement="all")
    t = trainer("bk", can, noise_multiplier=0.0, lr=1e-6)
    real_hits, draw = [0], t.poisson_batch

    def recorded():
        idx = draw()
        real_hits[0] += int((idx < t.num_real_examples).sum())
        return idx
    t.poisson_batch = recorded
    steps = 120
    for _ in range(steps):
        t.train_step()
    q = t.plan.sampling_rate
    n_in = int(can.included.sum())
    hits = int(can.sampled[can.included].sum())
    assert t.num_examples == t.num_real_examples + n_in
    assert can.sampled[~can.included].sum() == 0
    assert binomtest(hits, n_in * steps, q).pvalue > 1e-3
    assert binomtest(hits, n_in * steps, 1.1 * q).pvalue < 1e-6
    assert binomtest(real_hits[0], t.num_real_examples * steps, q).pvalue > 1e-3
    assert 400 < n_in < 600                 # the secret bits are fair coins


def test_canaries_a_trainer_does_not_draw_are_drawn_at_its_q():
    """Where the trainer does not draw the canaries (DPGAN's critic calls insert alone), they draw
    themselves at the attached q: 60,000 draws accept q and reject 1.1 q."""
    can = WhiteBoxCanaries(1000, seed=6, statistic="sum", placement="all")
    params = [torch.zeros(2000)]
    can.attach(params, max_grad_norm=1.0, sampling_rate=0.25, noise_multiplier=0.0)
    steps = 120
    for _ in range(steps):
        can.insert([torch.zeros(2000)])
    n_in = int(can.included.sum())
    hits = int(can.sampled[can.included].sum())
    assert can.sampled[~can.included].sum() == 0
    assert binomtest(hits, n_in * steps, 0.25).pvalue > 1e-3
    assert binomtest(hits, n_in * steps, 0.275).pvalue < 1e-6


class NoiseTenth(DPSGDTrainer):
    """A planted noise bug (bk): the noise std is sigma C / 10 while the ledger records sigma."""

    def _add_noise_and_scale(self):
        real = self.plan
        self.plan = type(real)(real.n, real.sampling_rate, real.steps_per_epoch, real.steps,
                               real.noise_multiplier / 10)
        try:
            super()._add_noise_and_scale()
        finally:
            self.plan = real


def audited(clipping, *, epsilon=None, noise_multiplier=None, m=1000, seed=0, statistic="llr", kind="inserted",
            cls=DPSGDTrainer, beta=0.05):
    """A tiny DP-SGD run (256 examples, batch 64, 4 epochs = 16 steps) with m Dirac canaries."""
    can = KINDS[kind](m, seed=seed, statistic=statistic)
    x, y = data(256)
    cfg = DPSGDConfig(epsilon=epsilon, noise_multiplier=noise_multiplier, delta=1e-5, max_grad_norm=1.0,
                      batch_size=64, epochs=4, lr=0.05, clipping=clipping, seed=seed)
    t = cls(net(), x, y, cfg, canaries=can, **replayable(seed)).fit()
    return t, can.audit(delta=1e-5, estimators=("steinke", "fdp", "gdp"), guess_fraction=0.1, beta=beta,
                        claim=t.privacy()["epsilon"])


def below_the_claim(t, out) -> bool:
    """The check of a correct run: both rigorous bounds positive and at most the ledger's epsilon."""
    claim = t.privacy()["epsilon"]
    return all(0.8 < out[k] <= claim for k in ("audit_epsilon_lb_steinke", "audit_epsilon_lb_fdp"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("clipping", ENGINES)
def test_whitebox_audit_of_a_correct_run_is_positive_and_below_the_claim(clipping, kind):
    """Claim epsilon 8 (sigma ~1.02 over 16 steps at q = 1/4): the white-box bounds are well above
    0 (a black-box audit of such a run gives 0) and do not exceed the ledger's epsilon."""
    t, out = audited(clipping, epsilon=8.0, kind=kind)
    assert t.privacy()["epsilon"] <= 8.0
    assert below_the_claim(t, out), out
    assert out["audit_epsilon_lb"] == out["audit_epsilon_lb_steinke"]       # the first rigorous estimator
    assert out["audit_steps"] == 16 and out["canary_kind"] == kind


@pytest.mark.parametrize("kind", KINDS)
def test_the_correct_run_check_fails_on_an_engine_with_a_tenth_of_its_noise(kind):
    """Negative control: the same check on an engine that claims epsilon 1 (its ledger's sigma)
    but adds a tenth of that noise: every rigorous bound is above the claim by far (the ratio is
    the audit's ceiling at 1,000 canaries, not the leak)."""
    t, out = audited("bk", epsilon=1.0, kind=kind, cls=NoiseTenth)
    claim = t.privacy()["epsilon"]
    assert not below_the_claim(t, out)
    assert out["audit_epsilon_lb_steinke"] > 2.5 * claim and out["audit_epsilon_lb_fdp"] > 2.5 * claim, out


def test_every_reported_bound_is_recomputed_from_its_counts():
    """The library's audit at beta 0.05 and delta 1e-5: audit_beta and audit_delta are the
    configured values, the counts are the fixed guesses on the scores, and every bound equals the
    bound computed from those counts at that beta and delta (so an audit at 2 beta, which gives
    larger bounds, cannot pass)."""
    from dpmech.privacy.audit.fdp import eps_delta_lower_bound, mu_lower_bound
    from dpmech.privacy.audit.gdp import gdp_epsilon
    from dpmech.privacy.audit.one_run import epsilon_lower_bound, guess_outcome

    t, out = audited("bk", noise_multiplier=1.0, kind="engine")
    can = t.canaries
    assert out["audit_beta"] == 0.05 and out["audit_delta"] == 1e-5
    m, r, v = guess_outcome(can.scores, can.included, 0.1)
    assert (out["audit_canaries"], out["audit_guesses"], out["audit_correct"]) == (m, r, v)
    assert out["audit_epsilon_lb_steinke"] == epsilon_lower_bound(r, v, beta=0.05, delta=1e-5, m=m)
    assert out["audit_epsilon_lb_fdp"] == eps_delta_lower_bound(m, r, v, delta=1e-5, beta=0.05)
    mu = mu_lower_bound(m, r, v, beta=0.05)
    assert out["audit_mu_lb_fdp"] == mu and out["audit_epsilon_gaussian_fdp"] == gdp_epsilon(mu, 1e-5)
    assert out["audit_epsilon_lb_steinke"] > 0.5
    # the same counts at twice the beta give bounds the check above would see
    assert epsilon_lower_bound(r, v, beta=0.1, delta=1e-5, m=m) > out["audit_epsilon_lb_steinke"] + 0.01
    assert eps_delta_lower_bound(m, r, v, delta=1e-5, beta=0.1) > out["audit_epsilon_lb_fdp"] + 0.01


def test_whitebox_audit_grows_as_sigma_shrinks():
    """Less noise, more leakage: the f-DP bound and the GDP estimate rise as sigma falls; with
    sigma 8 the bound is (near) 0 (the negative control)."""
    lbs, ests = [], []
    for sigma in (8.0, 1.5, 0.6):
        _, out = audited("bk", noise_multiplier=sigma, kind="engine")
        lbs.append(out["audit_epsilon_lb_fdp"])
        ests.append(out["audit_epsilon_est_gdp"])
    assert lbs[0] < 0.3
    assert lbs[0] < lbs[1] < lbs[2]
    assert ests[0] < ests[1] < ests[2]


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_continues_the_canaries_exactly(kind):
    """state_dict / load_state_dict carry the canaries' scores and counts."""
    a = trainer("bk", KINDS[kind](50, seed=4))
    for _ in range(2):
        a.train_step()
    state = a.state_dict()
    b = trainer("bk", KINDS[kind](50, seed=4))
    b.load_state_dict(state)
    for _ in range(2):
        a.train_step()
        b.train_step()
    assert np.array_equal(a.canaries.scores, b.canaries.scores)
    assert np.array_equal(a.canaries.sampled, b.canaries.sampled)
    with pytest.raises(ValueError, match="canaries"):
        trainer("bk", KINDS[kind](50, seed=5)).load_state_dict(state)
    other = "inserted" if kind == "engine" else "engine"
    with pytest.raises(ValueError, match="canaries"):
        trainer("bk", KINDS[other](50, seed=4)).load_state_dict(state)
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
    with pytest.raises(ValueError, match="largest nn.Linear weight"):
        trainer("bk", EngineCanaries(5000, seed=1))
    with pytest.raises(ValueError, match="raw_norm"):
        EngineCanaries(10, raw_norm=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        conv_only = nn.Sequential(nn.Conv2d(1, 3, 6), nn.Flatten())
    x, y = data()
    with pytest.raises(ValueError, match="no trainable nn.Linear layer"):
        DPSGDTrainer(conv_only, x, y, DPSGDConfig(epsilon=None, noise_multiplier=1.0, batch_size=32),
                     canaries=EngineCanaries(5))
    can = EngineCanaries(5)
    with pytest.raises(ValueError, match="use inserted canaries"):
        can.attach([torch.zeros(3)], max_grad_norm=1.0, sampling_rate=0.5, noise_multiplier=1.0)


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
            return DPALSoundTrainer(model, x, y, cfg, canaries=c, **keyed(DPALSoundTrainer, 0))
    else:
        from dpmech.secure_sgd.trainer import SecureSGDConfig, SecureSGDTrainer

        x, y = torch.rand(32, 1, 28, 28, generator=g) * 2 - 1, torch.randint(0, 10, (32,), generator=g)
        cfg = SecureSGDConfig(epsilon=None, noise_multiplier=0.0, max_grad_norm=0.05, batch_size=16, epochs=1,
                              lr=1.0, momentum=0.0, seed=3)

        def build(c):
            return SecureSGDTrainer(cfg, x, y, canaries=c, **keyed(SecureSGDTrainer, 3))
    can = WhiteBoxCanaries(30, seed=1, statistic="sum", placement="all")
    t, ref = build(can), build(None)
    observed, reference = grab_observed(can), grab_update(ref)
    idx = t.poisson_batch()
    t._step(idx)
    ref._step(real_part(t, idx))
    expected = torch.zeros_like(observed[-1])
    expected[torch.from_numpy(can.coordinates[can.last_batch])] = cfg.max_grad_norm
    assert can.steps == 1 and can.last_batch.any()
    assert torch.allclose(observed[-1] - reference[-1], expected, atol=1e-5)
    if which == "dpal_sound":      # its own paired per-example loss: engine canaries are refused, in one line
        with pytest.raises(ValueError, match="use inserted canaries"):
            build(EngineCanaries(30, seed=1, statistic="sum", placement="all"))
        return
    # SecureSGD (Opacus ghost through a PixelDP noise layer): engine canaries come out clipped. The
    # noise layer draws for every row, so the real rows' noise (and their gradients, ~1e-4 here on
    # these coordinates) differs from the canary-free run's: 1e-3 against a 0.05 signal (an
    # unclipped canary would give 5)
    can = EngineCanaries(30, seed=1, statistic="sum", placement="all")
    t, ref = build(can), build(None)
    observed, reference = grab_observed(can), grab_update(ref)
    idx = t.poisson_batch()
    t._step(idx)
    ref._step(real_part(t, idx))
    on_coords = (observed[-1] - reference[-1])[torch.from_numpy(can.coordinates)]
    expected = torch.from_numpy(np.where(can.last_batch, cfg.max_grad_norm * can.kappa, 0.0))
    assert can.last_batch.any()
    assert torch.allclose(on_coords, expected.to(on_coords.dtype), atol=1e-3)


def keyed(cls, seed: int) -> dict:
    """The research mode's noise key where ``cls`` takes one (see :func:`replayable`)."""
    import inspect

    if "noise_key" not in inspect.signature(cls).parameters:
        return {}
    from dpmech.privacy.secret import NoiseKey

    return {"noise_key": NoiseKey.reproducible(seed)}
