"""Evaluation of a DPGAN by its samples (docs/dpgan.md):

* ``tstr_acc``: train-on-synthetic, test-on-real. A small CNN is trained only on labelled samples
  G(z, y) (balanced labels) and tested on the real test set;
* ``sample_quality``: the fraction of samples that a classifier trained on *real* data (the
  "judge", trained on examples outside the training set) assigns to their conditioning label;
  ``sample_confidence``: the judge's mean probability of the conditioning label;
  ``classifier_score``: exp(E_x KL(p(y|x) || p(y))) under the judge (an Inception-score analogue,
  between 1 and the number of classes);
* a PNG grid of samples, one row per class.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dpmech import _validate as v
from dpmech.networks.fit import fit_classifier


class SmallCNN(nn.Module):
    """conv32-pool-conv64-pool-fc128-fc(classes): the classifier of TSTR and the judge."""

    def __init__(self, input_shape: tuple[int, ...], classes: int):
        super().__init__()
        c, h, w = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * (h // 4) * (w // 4), 128), nn.ReLU(),
                                  nn.Linear(128, classes))

    def forward(self, x):
        return self.head(self.features(x))


@torch.enable_grad()
def train_classifier(x: torch.Tensor, y: torch.Tensor, *, classes: int, epochs: int = 3, batch_size: int = 128,
                     lr: float = 1e-3, seed: int = 0, device: str | torch.device = "cpu") -> SmallCNN:
    """Adam, cross-entropy, ``epochs`` passes in a seeded random order."""
    v.positive_int("epochs", epochs)
    if x.shape[0] == 0 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x must be a non-empty [N, C, H, W] with N labels, got {tuple(x.shape)}, {tuple(y.shape)}")
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SmallCNN(tuple(x.shape[1:]), classes).to(device)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    x, y = x.to(device), y.to(device)
    return fit_classifier(model, x, y, epochs=epochs, batch_size=batch_size, lr=lr, generator=gen)


@torch.no_grad()
def probabilities(model: nn.Module, x: torch.Tensor, batch_size: int = 2000) -> torch.Tensor:
    model.eval()
    device = next(model.parameters()).device
    return torch.cat([F.softmax(model(x[s:s + batch_size].to(device)), 1) for s in range(0, x.shape[0], batch_size)])


def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return probabilities(model, x).argmax(1)


def balanced_labels(n: int, classes: int) -> torch.Tensor:
    """n labels, as equal per class as possible (0, 1, ..., K-1, 0, 1, ...)."""
    v.positive_int("n", n)
    return torch.arange(n) % classes


class JudgedSampler:
    """The sample judge shared by the generative trainers (DPGAN, DP-MERF): a real-data classifier
    that scores generated samples. The trainer sets ``_judge_data`` (real, non-training (x, y) or
    None), ``judge_epochs``, ``eval_samples``, ``_judge = None``, ``classes``, ``device``,
    ``config.seed`` and provides ``sample(labels, seed)``."""

    def judge(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None):
        """The real-data classifier that scores samples (trained once, deterministically, on
        ``judge_data``; without it, on the first (x, y) given, which must not be training data)."""
        if self._judge is None:
            jx, jy = self._judge_data if self._judge_data is not None else (x, y)
            if jx is None:
                raise ValueError("judge_data: no real non-training data to train the sample-quality classifier on")
            self._judge = train_classifier(jx, jy, classes=self.classes, epochs=self.judge_epochs,
                                           seed=self.config.seed + 4, device=self.device)
        return self._judge

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Per-epoch ``test_acc``: the fraction of samples conditioned on the first
        ``eval_samples`` test labels that the real-data judge classifies as their label
        (the same latent draws every call, so epochs are comparable)."""
        judge = self.judge(x, y)
        labels = y[:self.eval_samples].to(self.device)
        return float((predict(judge, self.sample(labels, seed=self.config.seed + 5)) == labels).float().mean())


def synthetic_dataset(trainer, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n labelled samples of the trainer's generator (balanced labels, latents seeded by ``seed``)."""
    y = balanced_labels(n, trainer.classes).to(trainer.device)
    return trainer.sample(y, seed=seed), y


def tstr_accuracy(trainer, x_test: torch.Tensor, y_test: torch.Tensor, *, n_samples: int = 10000,
                  epochs: int = 3, seed: int = 0) -> float:
    """Train-on-synthetic, test-on-real accuracy: a SmallCNN trained only on ``n_samples``
    generated, labelled images, evaluated on the real (x_test, y_test)."""
    xs, ys = synthetic_dataset(trainer, n_samples, seed)
    clf = train_classifier(xs, ys, classes=trainer.classes, epochs=epochs, seed=seed + 1, device=trainer.device)
    return float((predict(clf, x_test).cpu() == y_test.cpu()).float().mean())


def sample_scores(judge: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """``sample_quality`` (judge agrees with the conditioning label), ``sample_confidence``
    (judge's mean probability of it) and ``classifier_score`` (exp E KL(p(y|x) || p(y)))."""
    p = probabilities(judge, images).cpu().double()
    labels = labels.cpu()
    marginal = p.mean(0, keepdim=True)
    kl = (p * (torch.log(p.clamp_min(1e-12)) - torch.log(marginal.clamp_min(1e-12)))).sum(1)
    return {"sample_quality": float((p.argmax(1) == labels).double().mean()),
            "sample_confidence": float(p[torch.arange(len(labels)), labels].mean()),
            "classifier_score": float(math.exp(kl.mean()))}


def sample_grid(trainer, path: str | Path, per_class: int = 10, seed: int = 0) -> Path:
    """A PNG of generated samples: one row per class, ``per_class`` columns (no training data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = trainer.classes
    labels = torch.arange(k).repeat_interleave(per_class)
    imgs = ((trainer.sample(labels, seed=seed).cpu() + 1) / 2).clamp(0, 1).numpy()
    c, h, w = imgs.shape[1:]
    grid = np.ones((k * (h + 2), per_class * (w + 2), c))
    for i in range(k):
        for j in range(per_class):
            img = imgs[i * per_class + j].transpose(1, 2, 0)
            grid[i * (h + 2) + 1:i * (h + 2) + 1 + h, j * (w + 2) + 1:j * (w + 2) + 1 + w] = img
    path = Path(path)
    if c == 1:
        plt.imsave(path, grid[..., 0], cmap="gray", vmin=0, vmax=1)
    else:
        plt.imsave(path, grid)
    return path


def evaluate_samples(trainer, x_test: torch.Tensor, y_test: torch.Tensor, *, tstr_samples: int = 10000,
                     tstr_epochs: int = 3, quality_samples: int = 2000, seed: int = 0) -> dict[str, float]:
    """``tstr_acc``, ``acc_clean`` (= tstr_acc), the judge's scores and ``judge_acc`` (the judge's
    own accuracy on the real test set, the ceiling of ``sample_quality``'s meaning)."""
    tstr = tstr_accuracy(trainer, x_test, y_test, n_samples=tstr_samples, epochs=tstr_epochs, seed=seed + 10)
    judge = trainer.judge(x_test, y_test)
    xs, ys = synthetic_dataset(trainer, quality_samples, seed + 20)
    out = {"tstr_acc": tstr, "acc_clean": tstr}
    out.update(sample_scores(judge, xs, ys))
    out["judge_acc"] = float((predict(judge, x_test).cpu() == y_test.cpu()).float().mean())
    return out
