"""The one-run privacy audit (dpmech.privacy.audit.one_run; Steinke, Nasr & Jagielski 2023) on real DP-SGD runs.

500 canaries (held-out MNIST images with random wrong labels) are each added to a 500-image
training set with probability 1/2; a small MLP is trained with the DP-SGD engine; membership
scores are the canaries' negative losses; 100 guesses (the top and bottom 10 %).

* A correct DP-SGD run claiming epsilon = 2 gives a lower bound below 2.
* The same run with clipping and noise disabled (the engine's non-private mode, as if a bug had
  switched them off while the claim stayed), trained to memorise the canaries, gives a lower
  bound above the claim: the audit can fail. With 100 guesses the largest possible bound is
  3.48 (100 of 100 right), so the claim is set at 2 to leave room on both sides.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dpmech.privacy.audit.one_run import audit, loss_scores, make_canaries
from dpmech.datasets.splits import load_held_out, load_splits
from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer
from dpmech.privacy.secret import NoiseKey

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
              pytest.mark.usefixtures("one_thread")]

CLAIM = 2.0
DELTA = 1e-5
TRAIN = 500


@pytest.fixture(scope="module")
def canary_data():
    train, _ = load_splits("mnist", train_size=TRAIN, test_size=100, seed=0)
    pool = load_held_out("mnist", train_size=TRAIN, test_size=100, seed=0)
    canaries = make_canaries(*pool.tensors, m=500, num_classes=10, seed=0)
    cx, cy = canaries.members()
    x = torch.cat([train.tensors[0], cx])
    y = torch.cat([train.tensors[1], cy])
    return x, y, canaries


def mlp() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))


def trained(x, y, epsilon) -> DPSGDTrainer:
    # 40 epochs of Adam on ~730 examples: enough to memorise every mislabelled canary without DP
    cfg = DPSGDConfig(epsilon=epsilon, delta=DELTA, max_grad_norm=1.0, batch_size=75, epochs=40, lr=1e-3,
                      optimizer="adam", clipping="ghost", seed=0)
    return DPSGDTrainer(mlp(), x, y, cfg, plan_size=TRAIN, noise_key=NoiseKey.reproducible(cfg.seed)).fit()


def run_audit(trainer: DPSGDTrainer, canaries) -> dict:
    scores = loss_scores(trainer.model, canaries.x, canaries.y)
    return audit(scores, canaries.included, guess_fraction=0.2, beta=0.05, delta=DELTA)


def test_audit_of_correct_dpsgd_stays_below_its_claim(canary_data):
    x, y, canaries = canary_data
    trainer = trained(x, y, CLAIM)
    claimed = trainer.privacy()["epsilon"]
    assert claimed <= CLAIM
    result = run_audit(trainer, canaries)
    assert result["audit_guesses"] == 100
    assert result["epsilon_lower_bound"] < claimed


def test_audit_refutes_the_claim_when_clipping_and_noise_are_disabled(canary_data):
    x, y, canaries = canary_data
    broken = trained(x, y, None)          # no clipping, no noise; the claim is still CLAIM
    result = run_audit(broken, canaries)
    assert result["audit_correct"] >= 97
    assert result["epsilon_lower_bound"] > CLAIM
