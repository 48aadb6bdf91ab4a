"""Robust accuracy against true labels (issue 13, point 1) and the did-not-learn flag (point 3).

``dpmech.robustness.evaluation.conventional_accuracy`` attacks the true labels by default; the DPAL paper's
predicted-label variant is ``attack_labels="predicted"``. On a trained model, and on a weak one,
accuracy under an attack of size > 0 against the true labels never exceeds clean accuracy by more
than sampling noise (2 binomial standard deviations). Negative control: on the weak model the
predicted-label attack leaves accuracy where it was (at or above clean accuracy at some size) and
significantly above the true-label attack's.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpmech.robustness.evaluation import chance_accuracy, conventional_accuracy, did_not_learn, loss_near_chance

ATTACKS = {"fgsm": [0.5], "pgd": [0.1, 0.25, 0.5, 1.0]}  # l2 sizes in the [-1, 1] domain


@pytest.fixture(scope="module")
def mnist(one_thread):
    from dpmech.datasets.splits import load_splits

    train, test = load_splits("mnist", train_size=2000, test_size=500, seed=0)
    return train.tensors, test.tensors


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 5, stride=2), nn.Tanh(), nn.Conv2d(16, 32, 5, stride=2), nn.Tanh(),
                         nn.Flatten(), nn.Linear(32 * 4 * 4, 10))


def _train(x, y, steps: int) -> nn.Module:
    """``steps`` Adam steps of 64 random training images (fixed seeds): a second of CPU."""
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (64,), generator=gen)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def models(mnist):
    (x, y), _ = mnist
    return {"trained": _train(x, y, 150), "weak": _train(x, y, 10)}


def _noise(p: float, n: int) -> float:
    return 2 * math.sqrt(max(p * (1 - p), 1e-12) / n)


@pytest.mark.parametrize("which", ["trained", "weak"])
def test_true_labels_never_beat_clean_accuracy(mnist, models, which):
    _, (xt, yt) = mnist
    out = conventional_accuracy(models[which], xt, yt, attacks=ATTACKS, norm="l2", seed=0)
    clean, n = out["acc_clean"], xt.shape[0]
    assert (which == "trained") == (clean > 0.8), clean  # the weak model really is weak
    for name, acc in out.items():
        if name != "acc_clean":
            assert acc <= clean + _noise(clean, n), (name, acc, clean)
    # and the attacks bite: the largest PGD attack costs more than noise
    assert out["acc_pgd_1"] < clean - _noise(clean, n)


def test_true_labels_are_the_default(mnist, models):
    _, (xt, yt) = mnist
    default = conventional_accuracy(models["weak"], xt, yt, attacks={"pgd": [0.5]}, norm="l2", seed=0)
    true = conventional_accuracy(models["weak"], xt, yt, attacks={"pgd": [0.5]}, norm="l2", seed=0,
                                 attack_labels="true")
    assert default == true


def test_predicted_labels_negative_control(mnist, models):
    """The DPAL paper's variant on a weak model: the attack pushes misclassified examples away from
    their (wrong) predicted class, often onto the true one, so accuracy under attack stays at clean
    accuracy or above, far above the true-label attack's."""
    _, (xt, yt) = mnist
    model, n = models["weak"], xt.shape[0]
    true = conventional_accuracy(model, xt, yt, attacks=ATTACKS, norm="l2", seed=0, attack_labels="true")
    pred = conventional_accuracy(model, xt, yt, attacks=ATTACKS, norm="l2", seed=0, attack_labels="predicted")
    clean = pred["acc_clean"]
    assert true["acc_clean"] == clean
    sized = [k for k in pred if k != "acc_clean"]
    assert max(pred[k] for k in sized) >= clean  # the attack of size > 0 does not lower accuracy at all
    for k in sized:
        assert pred[k] >= true[k], k
    gap = pred["acc_pgd_1"] - true["acc_pgd_1"]
    assert gap > _noise(0.5, n), (pred["acc_pgd_1"], true["acc_pgd_1"])  # significantly different


def test_attack_labels_is_checked(mnist, models):
    _, (xt, yt) = mnist
    with pytest.raises(ValueError, match="attack_labels"):
        conventional_accuracy(models["weak"], xt[:10], yt[:10], attacks={"fgsm": [0.1]}, attack_labels="own")


# --------------------------------------------------------------------------- the trial's evaluate()


class _Mech:
    """The smallest mechanism ``trainables.runtime.evaluate`` accepts."""

    def __init__(self, model):
        self.model = model

    def certify(self, x, y, cfg):
        return None

    def privacy(self):
        return {}


def test_evaluate_passes_attack_labels_and_flags_not_learned(mnist, models, monkeypatch):
    from trainables import runtime
    from trainables.dpsgd import DPSGDTrialConfig

    _, (xt, yt) = mnist
    seen = []
    import dpmech.robustness.evaluation as ev

    real = ev.conventional_accuracy

    def spy(*args, **kwargs):
        seen.append(kwargs.get("attack_labels"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ev, "conventional_accuracy", spy)
    cfg = DPSGDTrialConfig(attacks={"pgd": [0.5]}, certify_images=0)
    good = runtime.evaluate(_Mech(models["trained"]), cfg, xt, yt, train_loss=0.4)["metrics"]
    assert good["not_learned"] == 0.0 and "acc_pgd_0.5" in good
    cfg = DPSGDTrialConfig(attacks={"pgd": [0.5]}, certify_images=0, attack_labels="predicted")
    assert runtime.evaluate(_Mech(models["trained"]), cfg, xt, yt)["metrics"]["not_learned"] == 0.0
    assert seen == ["true", "predicted"]
    # an untrained network: accuracy at chance
    untrained = runtime.evaluate(_Mech(_net().eval()), DPSGDTrialConfig(certify_images=0), xt, yt,
                                 train_loss=2.30)["metrics"]
    assert untrained["not_learned"] == 1.0
    # a trained network whose last epoch's cross-entropy sat at ln 10 gets the hint, not the verdict
    hinted = runtime.evaluate(_Mech(models["trained"]), DPSGDTrialConfig(certify_images=0), xt, yt,
                              train_loss=0.96 * math.log(10))["metrics"]
    assert hinted["not_learned"] == 0.0 and hinted["loss_near_chance"] == 1.0
    assert good["loss_near_chance"] == 0.0


def test_label_dp_and_dpal_pass_attack_labels(monkeypatch):
    """The mechanisms with their own conventional_accuracy honour attack_labels (label_dp through
    dpmech.robustness.evaluation; DPAL through dpmech.dpal.verify); DPGAN takes no attacks at all."""
    import dpmech.robustness.attacks
    import dpmech.dpal.verify as verify
    import dpmech.robustness.evaluation as ev
    from trainables.label_dp import LabelDPMechanism, LabelDPTrialConfig

    seen = []
    monkeypatch.setattr(ev, "conventional_accuracy", lambda *a, **k: seen.append(k["attack_labels"]) or {})
    mech = SimpleNamespace(model=None)
    for labels in ("true", "predicted"):
        LabelDPMechanism.conventional_accuracy(mech, None, None, LabelDPTrialConfig(attack_labels=labels))
    assert seen == ["true", "predicted"]

    # DPAL: the attack gets the true labels, or None (= the model's own predictions)
    got = []

    def fake_attack(name, model, x, y=None, **kw):
        got.append(None if y is None else y.tolist())
        return x

    monkeypatch.setattr(dpmech.robustness.attacks, "attack", fake_attack)
    monkeypatch.setattr(verify, "verified_inference", lambda *a, **k: SimpleNamespace(accuracy=lambda: 0.5))
    trainer = SimpleNamespace(scorer=lambda fresh: None, device=torch.device("cpu"))
    x, y = torch.zeros(3, 1, 28, 28), torch.tensor([1, 2, 3])
    verify.conventional_accuracy_under_attack(trainer, x, y, "pgd", 0.2, n=5)
    verify.conventional_accuracy_under_attack(trainer, x, y, "pgd", 0.2, n=5, attack_labels="predicted")
    assert got == [[1, 2, 3], None]


def test_attack_labels_config_key():
    from trainables.config import CommonConfig
    from trainables.dpal import DPALTrialConfig
    from trainables.dpsgd import DPSGDTrialConfig

    assert CommonConfig().attack_labels == "true" == DPALTrialConfig(epochs=1).attack_labels
    assert DPSGDTrialConfig(attack_labels=True).attack_labels == "true"  # YAML's `true`
    assert DPSGDTrialConfig(attack_labels="predicted").model_dump()["attack_labels"] == "predicted"
    for bad in (False, "own"):
        with pytest.raises(ValueError, match="attack_labels"):
            DPSGDTrialConfig(attack_labels=bad)


# --------------------------------------------------------------------------- did_not_learn


def test_did_not_learn_rules():
    y = np.repeat(np.arange(10), 100)  # balanced, n = 1000
    ln10 = math.log(10)
    kw = dict(num_classes=10, n_test=1000, y=y)
    assert did_not_learn(acc_clean=0.9, **kw) == 0.0
    # the loss hint: within 5% of ln K, or above it, or not finite; a hint only (loss_near_chance)
    hint = dict(num_classes=10, loss_is_cross_entropy=True)
    assert loss_near_chance(train_loss=0.951 * ln10, **hint) == 1.0
    assert loss_near_chance(train_loss=0.949 * ln10, **hint) == 0.0
    assert loss_near_chance(train_loss=float("nan"), **hint) == 1.0
    # ... only where train_loss is the classifier's cross-entropy (else not logged)
    assert loss_near_chance(num_classes=10, train_loss=5.0, loss_is_cross_entropy=False) is None
    assert loss_near_chance(train_loss=None, **hint) is None
    # the accuracy rule: the quickstart's 10.5% is chance; 13% of 1000 is not (p ~ 0.001)
    assert did_not_learn(acc_clean=0.105, **kw) == 1.0
    assert did_not_learn(acc_clean=0.115, **kw) == 1.0   # p ~ 0.06
    assert did_not_learn(acc_clean=0.13, **kw) == 0.0
    assert did_not_learn(acc_clean=float("nan"), **kw) == 1.0
    # chance is the best constant prediction: 30% of the labels are class 0
    skewed = np.concatenate([np.zeros(300, int), np.repeat(np.arange(1, 10), 78)[:700]])
    assert chance_accuracy(skewed, 10) == 0.3
    assert did_not_learn(num_classes=10, acc_clean=0.3, n_test=1000, y=skewed) == 1.0
    assert did_not_learn(num_classes=10, acc_clean=0.36, n_test=1000, y=skewed) == 0.0
    # regression: the MSE of predicting the mean of the targets
    t = np.arange(10.0).repeat(10)  # variance 8.25
    assert did_not_learn(num_classes=10, mse=8.0, y_values=t) == 1.0
    assert did_not_learn(num_classes=10, mse=7.7, y_values=t) == 0.0
    assert did_not_learn(num_classes=10, mse=float("inf"), y_values=t) == 1.0


def test_an_honest_small_epsilon_point_is_not_flagged():
    """Issue 24, point 8: an epsilon-1 trial at 32.5% test accuracy (1000 balanced test labels, over
    3x chance) whose noisy train loss is within 5% of ln 10 learned: the binomial test decides, the
    loss is only a hint. Negative control: 11% of 1000 is chance (p ~ 0.15) and stays flagged."""
    y = np.repeat(np.arange(10), 100)
    assert did_not_learn(num_classes=10, acc_clean=0.325, n_test=1000, y=y) == 0.0
    assert loss_near_chance(num_classes=10, train_loss=0.97 * math.log(10), loss_is_cross_entropy=True) == 1.0
    assert did_not_learn(num_classes=10, acc_clean=0.11, n_test=1000, y=y) == 1.0


def test_run_trial_hints_a_trial_whose_last_epoch_loss_sat_at_ln_k(models, monkeypatch):
    """run_trial hands the last epoch's train_loss to evaluate(): a trained network (accuracy far
    above chance) whose reported cross-entropy stayed at ln K gets the hint ``loss_near_chance``
    but is not flagged ``not_learned`` (issue 24, point 8); one whose loss fell gets neither.
    Ray's tune calls are replaced by recorders (no cluster)."""
    from ray import tune

    from trainables.dpsgd import DPSGDTrialConfig
    from trainables.runtime import run_trial

    class Fake:
        losses: list[float] = []

        def __init__(self, cfg, x, y, device):
            self.model, self.epoch = models["trained"], 0

        def train_epoch(self):
            self.epoch += 1
            return {"train_loss": self.losses[self.epoch - 1]}

        def test_accuracy(self, x, y):
            return 0.0

        def state_dict(self):
            return {}

        def certify(self, x, y, cfg):
            return None

        def privacy(self):
            return {}

    reports = []
    monkeypatch.setattr(tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(tune, "get_context", lambda: None)
    monkeypatch.setattr(tune, "report", lambda metrics, checkpoint=None: reports.append(metrics))
    config = {"epochs": 2, "train_size": 256, "test_size": 300, "batch_size": 64, "certify_images": 0}
    for losses, flag in (([2.30, 2.29], 1.0), ([2.30, 0.50], 0.0), ([0.5, 2.25], 1.0)):
        Fake.losses, reports[:] = losses, []
        run_trial(config, DPSGDTrialConfig, Fake, "dpsgd")
        final = reports[-1]
        assert final["evaluated"] == 1.0 and final["acc_clean"] > 0.7
        assert final["loss_near_chance"] == flag and final["not_learned"] == 0.0, (losses, final)


def test_a_model_without_parameters_is_evaluated_on_its_buffers_device():
    """A model whose state is a buffer (or nothing) is evaluated, not refused with StopIteration."""
    from dpmech.robustness.evaluation import conventional_accuracy

    class Centroids(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("c", torch.eye(4))

        def forward(self, x):
            return -torch.cdist(x.flatten(1), self.c)

    x, y = torch.eye(4).view(4, 1, 2, 2), torch.arange(4)
    assert conventional_accuracy(Centroids(), x, y) == {"acc_clean": 1.0}
