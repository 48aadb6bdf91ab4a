"""DP-MERF (dpmech.dp_merf.trainer, trainables.dp_merf): the sensitivity bound of the released sum, the noise
scale against the accountant, the generator's isolation from the data after the release, and a
short run that beats chance in train-on-synthetic accuracy (docs/dp_merf.md)."""

from __future__ import annotations

import math

import pytest
import torch

from dpmech.privacy.secret import NoiseKey
from dpmech.privacy.accounting import noise_multiplier_for
from dpmech.dp_merf.trainer import (DPMERFConfig, DPMERFTrainer, RandomFourierFeatures, embedding_sum,
                                    labelled_embedding, release_embedding, release_vectors)

pytestmark = pytest.mark.usefixtures("one_thread")


def _data(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 28, 28, generator=g) * 2 - 1
    y = torch.randint(0, 10, (n,), generator=g)
    return x, y


def _cfg(**kw):
    base = dict(epsilon=1.0, n_features=200, epochs=1, steps_per_epoch=3, batch_size=20, hidden=16)
    base.update(kw)
    return DPMERFConfig(**base)


# ------------------------------------------------------------------ the release
def test_every_example_vector_has_norm_one_the_sensitivity():
    """max_i ||v_i|| = 1: adding or removing one example moves the released sum by at most 1."""
    x, y = _data()
    x[0] = 1.0                    # extreme images too
    x[1] = -1.0
    feats = RandomFourierFeatures(784, 500, lengthscale=3.0, seed=0)
    v = release_vectors(feats, x, y, 10, count_weight=0.1)
    norms = v.norm(dim=1)
    assert norms.max().item() <= 1 + 1e-5
    assert norms.min().item() >= 1 - 1e-5
    # the features alone have norm 1 and the label block is the only non-zero one
    emb = labelled_embedding(feats, x, y, 10).view(len(y), 500, 10)
    assert torch.allclose(emb.norm(dim=(1, 2)), torch.ones(len(y)), atol=1e-5)
    assert (emb.abs().sum(1).argmax(1) == y).all()
    # negative control: without the a = sqrt(1 - b^2) scaling the rows would exceed 1
    assert (torch.cat([emb.flatten(1), torch.full((len(y), 1), 0.1)], 1).norm(dim=1) > 1.001).all()


def test_release_without_noise_is_the_sum_of_the_example_vectors():
    x, y = _data(n=250)
    feats = RandomFourierFeatures(784, 300, lengthscale=5.0, seed=1)
    gen = torch.Generator().manual_seed(0)
    released = release_embedding(feats, x, y, classes=10, count_weight=0.2, noise_multiplier=0.0, generator=gen,
                                 chunk=64)
    exact = release_vectors(feats, x, y, 10, 0.2).double().sum(0).float()
    torch.testing.assert_close(released, exact, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(embedding_sum(feats, x, y, 10), labelled_embedding(feats, x, y, 10).sum(0),
                               rtol=1e-4, atol=1e-4)


def test_noise_scale_matches_the_accountant_at_the_requested_epsilon():
    x, y = _data(n=200)
    cfg = _cfg(epsilon=2.0, n_features=4000)
    tr = DPMERFTrainer(cfg, x, y, noise_key=NoiseKey.reproducible(0))
    assert tr.noise_multiplier == noise_multiplier_for(2.0, 1e-5, 1.0, 1)
    eps = tr.privacy()["epsilon"]
    assert 0.98 * 2.0 < eps <= 2.0
    assert tr.privacy()["epsilon_pld"] <= eps
    # the released vector minus the exact sum has per-coordinate std sigma (sensitivity 1)
    exact = release_vectors(tr.features, x, y, 10, cfg.count_weight).double().sum(0)
    resid = (tr.released.double() - exact)
    assert resid.numel() > 20000
    assert abs(resid.std().item() / tr.noise_multiplier - 1) < 0.03
    # negative control: a mechanism with 10% less noise is told apart by the same check
    assert abs(0.9 * resid.std().item() / tr.noise_multiplier - 1) > 0.05
    # the noisy count recovers N within a few sigma / b
    assert abs(tr.noisy_count - 200) < 5 * tr.noise_multiplier / cfg.count_weight


def test_smaller_epsilon_means_more_noise_and_non_private_has_none():
    x, y = _data(n=50)
    s1 = DPMERFTrainer(_cfg(epsilon=1.0), x, y).noise_multiplier
    s10 = DPMERFTrainer(_cfg(epsilon=10.0), x, y).noise_multiplier
    assert s1 > s10 > 0
    tr = DPMERFTrainer(_cfg(epsilon=None), x, y)
    assert tr.noise_multiplier == 0 and math.isinf(tr.privacy()["epsilon"])
    assert tr.noisy_count == pytest.approx(50, rel=1e-5)


# ------------------------------------------------------------------ isolation of the generator
def test_generator_never_touches_data_after_the_release():
    """Overwriting the training tensors (NaN images, other labels) after construction changes nothing:
    training reads the released embedding only, and the trainer keeps no view of the data."""
    x, y = _data()
    a = DPMERFTrainer(_cfg(), x.clone(), y.clone(), noise_key=NoiseKey.reproducible(0))
    xb, yb = x.clone(), y.clone()
    b = DPMERFTrainer(_cfg(), xb, yb, noise_key=NoiseKey.reproducible(0))
    ptrs = {xb.untyped_storage().data_ptr(), yb.untyped_storage().data_ptr()}
    held = [t for t in vars(b).values() if isinstance(t, torch.Tensor)]
    assert all(t.untyped_storage().data_ptr() not in ptrs for t in held)
    xb.fill_(float("nan"))
    yb.fill_(3)
    for tr in (a, b):
        tr.train_epoch()
    for pa, pb in zip(a.generator.state_dict().values(), b.generator.state_dict().values()):
        torch.testing.assert_close(pa, pb)
    assert not any(torch.isnan(p).any() for p in b.generator.parameters())
    # negative control: NaN data BEFORE the release poisons the target
    xc = x.clone()
    xc[0] = float("nan")
    assert torch.isnan(DPMERFTrainer(_cfg(), xc, y).target).any()


def test_state_dict_round_trip_continues_bit_for_bit():
    x, y = _data(n=100)
    cfg = _cfg(epochs=2)
    a = DPMERFTrainer(cfg, x, y)
    a.train_epoch()
    state = a.state_dict()
    b = DPMERFTrainer(cfg, x, y)
    b.load_state_dict(state)
    a.train_epoch()
    b.train_epoch()
    for pa, pb in zip(a.generator.state_dict().values(), b.generator.state_dict().values()):
        torch.testing.assert_close(pa, pb)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="n_features"):
        DPMERFConfig(n_features=101)
    with pytest.raises(ValueError, match="count_weight"):
        DPMERFConfig(count_weight=1.0)
    with pytest.raises(ValueError, match="epsilon"):
        DPMERFConfig(epsilon=-1.0)


# ------------------------------------------------------------------ utility
@pytest.mark.slow
def test_short_run_beats_chance_in_train_on_synthetic_accuracy():
    from dpmech.datasets.splits import load_splits
    from dpmech.dpgan.evaluate import tstr_accuracy

    train, test = load_splits("mnist", train_size=5000, test_size=500, seed=0)
    x, y = train.tensors
    xt, yt = test.tensors
    cfg = DPMERFConfig(epsilon=10.0, n_features=2000, epochs=2, steps_per_epoch=60, batch_size=200, seed=0)
    tr = DPMERFTrainer(cfg, x, y)
    for _ in range(cfg.epochs):
        tr.train_epoch()
    acc = tstr_accuracy(tr, xt, yt, n_samples=1000, epochs=2, seed=0)
    # negative control: the untrained generator's samples carry no label information
    acc0 = tstr_accuracy(DPMERFTrainer(cfg, x, y), xt, yt, n_samples=1000, epochs=2, seed=0)
    assert acc0 < 0.2
    assert acc > 0.4, acc


# ------------------------------------------------------------------ trainable
def test_trial_schema_and_privacy_event():
    from dpmech.privacy.accounting import epsilon as event_epsilon
    from trainables.dp_merf import DPMERFTrialConfig
    from trainables.registry import get_trainable
    from trainables.runtime import validate_config

    entry = get_trainable("dp_merf")
    assert entry.config_model is DPMERFTrialConfig and DPMERFTrialConfig.protects_training_examples
    with pytest.raises(ValueError, match="attacks"):
        validate_config({"attacks": {"pgd": [0.1]}}, DPMERFTrialConfig)
    with pytest.raises(ValueError, match="n_features"):
        validate_config({"n_features": 11}, DPMERFTrialConfig)
    assert validate_config({"epsilon": None}, DPMERFTrialConfig).epsilon is None
    eps = event_epsilon(entry.privacy_event_fn(DPMERFTrialConfig(epsilon=1.0)), 1e-5)
    assert 0.98 < eps <= 1.0


def test_trial_runs_end_to_end_without_a_cluster(monkeypatch):
    """run_trial with the real mechanism (Ray's tune calls replaced by recorders): the final report
    has tstr_acc = acc_clean, the release's epsilon at most the target, and its noise multiplier."""
    from ray import tune

    from trainables.dp_merf import DPMERFMechanism, DPMERFTrialConfig
    from trainables.runtime import run_trial

    reports = []
    monkeypatch.setattr(tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(tune, "get_context", lambda: None)
    monkeypatch.setattr(tune, "report", lambda metrics, checkpoint=None: reports.append(metrics))
    config = {"epsilon": 1.0, "train_size": 300, "test_size": 100, "n_features": 200, "epochs": 2,
              "steps_per_epoch": 2, "batch_size": 20, "tstr_samples": 100, "tstr_epochs": 1, "judge_size": 100,
              "judge_epochs": 1, "quality_samples": 50, "eval_samples": 50}
    run_trial(config, DPMERFTrialConfig, DPMERFMechanism, "dp_merf")
    final = reports[-1]
    assert final["acc_clean"] == final["tstr_acc"]
    assert 0.98 < final["epsilon"] <= 1.0
    assert final["noise_multiplier"] == pytest.approx(noise_multiplier_for(1.0, 1e-5, 1.0, 1))
    assert final["generator_steps"] == 4 and final["sensitivity"] == 1.0
