"""DPGAN plans q, critic steps and sigma from the configured size (``plan_size``, the trial's
``train_size`` or the full split), never from |D|: a trial whose audit draws canaries into the training
set plans and accounts exactly as one without them (issue 25, point 5; docs/dpgan.md "Privacy
accounting"). DP-MERF's single release does not depend on N at all (docs/dp_merf.md)."""

from __future__ import annotations

import math

import pytest
import torch

from dpmech.privacy.accounting import epsilon as event_epsilon
from dpmech.dpgan.config import DPGANConfig
from dpmech.dpgan.trainer import DPGANTrainer
from dpmech.dpgan.config import calibrate_noise

pytestmark = pytest.mark.usefixtures("one_thread")

N = 200        # the configured train_size
BATCH = 40


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 28, 28, generator=g) * 2 - 1, torch.randint(0, 10, (n,), generator=g)


def _cfg(**kw):
    base = dict(epsilon=2.0, delta=1e-5, epochs=1, batch_size=BATCH, hidden=16, latent_dim=8)
    base.update(kw)
    return DPGANConfig(**base)


@pytest.mark.parametrize("extra", [0, 7, 37])
def test_the_plan_comes_from_plan_size_not_from_the_data_given(extra):
    """N + extra examples (canaries drawn in), planned at N: q = m / N, ceil(N / m) steps an epoch,
    sigma calibrated at N, and the fake batch (the divisor) m, whatever extra is."""
    x, y = _data(N + extra)
    tr = DPGANTrainer(_cfg(), x, y, plan_size=N)
    assert tr.n == N + extra and tr.plan_size == N
    assert tr.sampling_rate == BATCH / N
    assert tr.steps_per_epoch == math.ceil(N / BATCH)
    assert tr.noise_multiplier == calibrate_noise(_cfg(), N)
    assert tr.expected_batch == pytest.approx(BATCH)


def test_negative_control_without_plan_size_the_plan_follows_the_data():
    """Without plan_size (a notebook's trainer on its own tensors) N is the data's size: drawing 37
    canaries in changes q and sigma, which is what plan_size prevents."""
    x, y = _data(N + 37)
    tr = DPGANTrainer(_cfg(), x, y)
    assert tr.plan_size == N + 37
    assert tr.sampling_rate == BATCH / (N + 37)
    assert tr.noise_multiplier != calibrate_noise(_cfg(), N)


@pytest.mark.parametrize("fake_labels", ["uniform", "dp_histogram"])
def test_trial_event_equals_the_ledger_with_canaries_drawn_in(monkeypatch, fake_labels):
    """The trainable's planned event (train_size N) and its mechanism's ledger after every planned
    step agree to 1e-9 when 23 extra examples ride along (what runtime.audit_canaries adds)."""
    import trainables.dpgan as tdpgan

    monkeypatch.setattr(tdpgan, "judge_data", lambda cfg: None)
    trial = tdpgan.DPGANTrialConfig(epsilon=2.0, train_size=N, batch_size=BATCH, epochs=1, hidden=16, latent_dim=8,
                                    fake_labels=fake_labels, histogram_noise=5.0, eval_samples=20)
    x, y = _data(N + 23)
    mech = tdpgan.DPGANMechanism(trial, x, y, torch.device("cpu"))
    mech.train_epoch()
    tr = mech.trainer
    assert tr.critic_steps == tr.planned_critic_steps == math.ceil(N / BATCH)
    planned = event_epsilon(tdpgan.privacy_event(trial), 1e-5)
    assert tr.privacy()["epsilon"] == pytest.approx(planned, rel=1e-9)
    assert planned <= 2.0


def test_full_split_when_train_size_is_null():
    from trainables.dpgan import DPGANTrialConfig, planned_train_size

    assert planned_train_size(DPGANTrialConfig(train_size=None)) == 60000
    assert planned_train_size(DPGANTrialConfig(train_size=1234)) == 1234


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "100"])
def test_bad_plan_size_is_refused_naming_it(bad):
    x, y = _data(20)
    with pytest.raises(ValueError, match="plan_size must be a positive integer"):
        DPGANTrainer(_cfg(), x, y, plan_size=bad)


def test_checkpoint_of_another_plan_is_refused():
    x, y = _data(N + 5)
    state = DPGANTrainer(_cfg(), x, y, plan_size=N).state_dict()
    DPGANTrainer(_cfg(), x, y, plan_size=N).load_state_dict(state)   # same plan: accepted
    with pytest.raises(ValueError, match="plan_size"):
        DPGANTrainer(_cfg(), x, y, plan_size=N + 5).load_state_dict(state)


def test_dp_merf_release_is_planned_without_n():
    """DP-MERF releases one Gaussian sum of sensitivity 1 with a count coordinate: sigma, the ledger
    and the trial's event are the same for any N (N enters only through the noisy count, post-
    processing), so canaries drawn in change nothing in its accounting."""
    from dpmech.dp_merf.trainer import DPMERFConfig, DPMERFTrainer
    from trainables.dp_merf import DPMERFTrialConfig, privacy_event

    cfg = DPMERFConfig(epsilon=1.0, n_features=20, epochs=1, steps_per_epoch=1, batch_size=10, hidden=8)
    eps = []
    for n in (50, 87):
        x, y = _data(n)
        tr = DPMERFTrainer(cfg, x, y)
        eps.append((tr.noise_multiplier, tr.privacy()["epsilon"]))
    assert eps[0] == eps[1]
    trial = DPMERFTrialConfig(epsilon=1.0, train_size=50, n_features=20)
    assert event_epsilon(privacy_event(trial), 1e-5) == pytest.approx(eps[0][1], rel=1e-12)
