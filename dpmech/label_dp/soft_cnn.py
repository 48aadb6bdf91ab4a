"""A CNN on ScatterNet features trained on released soft labels (issue 54.1's stretch; docs/label_dp.md,
"High privacy").

``cluster_rr`` trains a linear head on the posteriors of its released labels; this is a stronger head
for the same release, in the spirit of Ghazi et al. 2021 ("Deep learning with label differential
privacy", NeurIPS), who train a deep network on the labels RRWithPrior releases. Training on released
labels and public images is post-processing (Dwork & Roth 2014, Prop. 2.1): it reads no label and
changes no epsilon; the ledger stays the release's.

The network (:class:`ScatterSoftCNN`) takes the standardised ScatterNet features as K x 7 x 7 maps (81
channels for MNIST's J 2, L 8): conv 3x3 ``width`` -> ReLU -> conv 3x3 stride 2 ``2 width`` -> ReLU ->
dropout -> FC ``hidden`` -> ReLU -> dropout -> FC classes. Trained with AdamW on the soft-label
cross-entropy ``-sum_k q_k log softmax_k``, optionally on mixup of the batch (Zhang, Cisse, Dauphin,
Lopez-Paz 2018, "mixup: Beyond empirical risk minimization": ``lambda x_i + (1 - lambda) x_j`` with the
soft labels mixed alike, ``lambda ~ Beta(mixup_alpha, mixup_alpha)``, as Ghazi et al. 2021 train on RR's
labels), the rate decaying linearly to 0 (as :class:`LinearRun`),
one epoch per :meth:`SoftCNNRun.train_epoch` (the ``label_dp`` trial's ``head: cnn``) or all at once
(:func:`train_soft_cnn`, the benchmark's ``cluster_rr_cnn``): the same weights either way.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from dpmech import _validate as v

__all__ = ["SoftCNNConfig", "ScatterSoftCNN", "SoftCNNRun", "train_soft_cnn", "predict_soft_cnn"]


@dataclass
class SoftCNNConfig:
    """The head's settings (chosen on the validation split; benchmarks/labeldp_high_privacy_validation.py)."""

    epochs: int = 10
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 1e-4
    width: int = 64
    hidden: int = 256
    dropout: float = 0.3
    mixup_alpha: float = 0.0     # mixup (Zhang et al. 2018) of features and soft labels, lambda ~ Beta(a, a); 0: none

    def __post_init__(self):
        v.positive_int("epochs", self.epochs)
        v.positive_int("batch_size", self.batch_size)
        v.positive("lr", self.lr)
        v.non_negative("weight_decay", self.weight_decay)
        v.positive_int("width", self.width)
        v.positive_int("hidden", self.hidden)
        v.unit_interval("dropout", self.dropout, high_open=True)
        v.non_negative("mixup_alpha", self.mixup_alpha)

    def to_dict(self) -> dict:
        return asdict(self)


class ScatterSoftCNN(nn.Module):
    """conv(K -> w) -> ReLU -> conv(w -> 2w, stride 2) -> ReLU -> FC hidden -> ReLU -> FC classes."""

    def __init__(self, feature_shape: tuple[int, int, int], num_classes: int, cfg: SoftCNNConfig):
        super().__init__()
        k, h, w = (int(s) for s in feature_shape)
        self.shape = (k, h, w)
        hh, ww = (h + 1) // 2, (w + 1) // 2
        self.net = nn.Sequential(
            nn.Conv2d(k, cfg.width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(cfg.width, 2 * cfg.width, 3, stride=2, padding=1), nn.ReLU(),
            nn.Flatten(), nn.Dropout(cfg.dropout), nn.Linear(2 * cfg.width * hh * ww, cfg.hidden), nn.ReLU(),
            nn.Dropout(cfg.dropout), nn.Linear(cfg.hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.reshape(x.shape[0], *self.shape))


class SoftCNNRun:
    """:class:`ScatterSoftCNN` trained with AdamW on the soft-label cross-entropy, one epoch per
    ``train_epoch`` (the trial runtime's unit of progress and checkpoint), the rate decaying linearly to 0
    over ``cfg.epochs``. Initialisation, dropout and batch order come from ``seed`` (public randomness):
    the dropout stream is kept with the run, so the global RNG is untouched and an epoch-wise run, resumed
    or not, trains exactly the weights of :func:`train_soft_cnn`."""

    def __init__(self, feats: torch.Tensor, soft: torch.Tensor, cfg: SoftCNNConfig, seed: int,
                 feature_shape: tuple[int, int, int] = (81, 7, 7)):
        if feats.dim() != 2 or feats.shape[1] != math.prod(feature_shape):
            raise ValueError(f"feats must be [N, {math.prod(feature_shape)}] (feature_shape {tuple(feature_shape)}), "
                             f"got {list(feats.shape)}")
        if soft.shape[0] != feats.shape[0]:
            raise ValueError(f"soft must have one row per example ({feats.shape[0]}), got {soft.shape[0]}")
        self.feats, self.soft, self.cfg = feats, soft.float(), cfg
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            self.model = ScatterSoftCNN(feature_shape, soft.shape[1], cfg)
            self.rng = torch.random.get_rng_state()          # dropout's stream, continued epoch to epoch
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        steps = cfg.epochs * math.ceil(feats.shape[0] / cfg.batch_size)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda t: max(0.0, 1.0 - t / steps))
        self.gen = torch.Generator().manual_seed(int(seed))
        self.epoch = 0
        self.model.eval()

    def train_epoch(self) -> float:
        """One pass in a fresh random order; the mean soft-label cross-entropy over it."""
        n, total = self.feats.shape[0], 0.0
        perm = torch.randperm(n, generator=self.gen)
        a = float(self.cfg.mixup_alpha)
        beta = torch.distributions.Beta(a, a) if a > 0 else None
        with torch.random.fork_rng(devices=[]):
            torch.random.set_rng_state(self.rng)
            self.model.train()
            for s in range(0, n, self.cfg.batch_size):
                idx = perm[s:s + self.cfg.batch_size]
                x, q = self.feats[idx], self.soft[idx]
                if beta is not None:    # each batch mixed with a shuffle of itself, one lambda per batch
                    lam = float(beta.sample())
                    j = torch.randperm(len(idx), generator=self.gen)
                    x, q = lam * x + (1 - lam) * x[j], lam * q + (1 - lam) * q[j]
                loss = -(q * F.log_softmax(self.model(x), 1)).sum(1).mean()
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                self.opt.step()
                self.sched.step()
                total += float(loss.detach()) * len(idx)
            self.rng = torch.random.get_rng_state()
        self.model.eval()
        self.epoch += 1
        return total / n

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                "gen": self.gen.get_state(), "rng": self.rng.clone(), "epoch": self.epoch}

    def load_state_dict(self, st: dict) -> None:
        self.model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.gen.set_state(st["gen"])
        self.rng = st["rng"].clone()
        self.epoch = int(st["epoch"])


def train_soft_cnn(feats: torch.Tensor, soft: torch.Tensor, cfg: SoftCNNConfig, seed: int,
                   feature_shape: tuple[int, int, int] = (81, 7, 7)) -> ScatterSoftCNN:
    """``cfg.epochs`` epochs of :class:`SoftCNNRun` on (standardised features [N, K*h*w], soft labels
    [N, C]); returns the network in eval mode."""
    run = SoftCNNRun(feats, soft, cfg, seed, feature_shape)
    for _ in range(cfg.epochs):
        run.train_epoch()
    return run.model


@torch.no_grad()
def predict_soft_cnn(model: ScatterSoftCNN, feats: torch.Tensor) -> torch.Tensor:
    """The predicted class of every row (eval mode, batches of 4,096)."""
    model.eval()
    return torch.cat([model(feats[s:s + 4096]).argmax(1) for s in range(0, feats.shape[0], 4096)])
