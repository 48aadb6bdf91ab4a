"""The training recipe of the label-DP methods at full scale, and the multi-stage training of
Ghazi et al. 2021 (LP-1ST, LP-2ST; "Deep Learning with Label Differential Privacy", NeurIPS 2021,
Alg. 3 "LP-MST"); docs/label_dp.md, "Recipe" and "LP-MST".

Recipe (Ghazi et al., Sec. 4 / App. B: mixup, SGD with momentum 0.9, a warm-up then a linear decay
of the learning rate; a smaller net than their ResNets to fit our CPU budget): ``RecipeCNN`` (two
3x3 convolutions with ``width`` and ``2 width`` channels, ReLU, 2x2 max pooling, a ``hidden``-unit
layer, linear head), the training set as one preloaded tensor (no DataLoader), minibatches of
``batch_size`` in a fresh order each epoch, mixup (Zhang et al. 2018) with lambda ~ Beta(alpha,
alpha) once per batch, the loss ``lambda CE(f(x_mix), y_a) + (1 - lambda) CE(f(x_mix), y_b)`` on
the released hard labels, and the learning rate rising linearly from 0 to ``lr`` over
``warmup_epochs`` then falling linearly to 0 at the last step. Regression (the digit value, MSE)
uses the same net with one output and no mixup.

LP-MST with T = 2 (``lp2st``): the training set is split at random (the split uses no label) into
part 1 (``stage1_fraction``) and part 2. Stage 1 releases part 1's labels with RRWithPrior under
the uniform prior (= K-ary RR) and trains a model on them. Stage 2 takes as prior that model's
softmax on part 2's images (``prior_mode="denoised"``, the default: with stage 1's known RR channel
inverted, ``denoise_rr_prior``; ``"softmax"``: as is), releases part 2's labels with RRWithPrior, and trains on part 1 and part
2 together with their released labels (Alg. 3 trains stage t on S^(1) u ... u S^(t)), starting from
the stage-1 weights (``stage2_init="stage1"``, post-processing of the stage-1 release; or
``"scratch"``). Every label is released exactly once, so the whole run is epsilon-label-DP
(substitution neighbours): a changed label changes one release, and everything after it is
post-processing. ``lp1st`` is one stage on the whole set with the uniform prior.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from dpmech import _validate as v
from dpmech.privacy.secret import NoiseKey
from dpmech.label_dp.rr_prior import denoise_rr_prior, rr_with_prior, uniform_prior

METHODS = ("none", "laplace", "rr", "lp1st", "lp2st", "alibi")
STAGE2_INIT = ("stage1", "scratch")
PRIOR_MODES = ("denoised", "softmax")


class RecipeCNN(nn.Module):
    """conv3x3(width) - ReLU - pool - conv3x3(2 width) - ReLU - pool - linear(hidden) - ReLU - linear."""

    def __init__(self, input_shape=(1, 28, 28), out_dim: int = 10, width: int = 16, hidden: int = 128):
        super().__init__()
        c, h, w = input_shape
        self.out_dim = out_dim
        self.features = nn.Sequential(
            nn.Conv2d(c, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * (h // 4) * (w // 4), hidden), nn.ReLU(),
                                  nn.Linear(hidden, out_dim))

    def forward(self, x):
        out = self.head(self.features(x))
        return out.squeeze(1) if self.out_dim == 1 else out


@dataclass
class RecipeConfig:
    """Hyperparameters of one training (one stage)."""

    epochs: int = 15
    batch_size: int = 256
    lr: float = 0.05               # peak learning rate
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_epochs: float = 1.0
    mixup_alpha: float = 4.0       # 0: no mixup
    width: int = 16
    hidden: int = 128
    optimizer: str = "sgd"         # "sgd" (momentum, the recipe) or "adam" (the seed's; regression)

    def __post_init__(self):
        v.choice("optimizer", self.optimizer, ("sgd", "adam"))
        v.positive_int("epochs", self.epochs)
        v.positive_int("batch_size", self.batch_size)
        v.positive("lr", self.lr)
        v.unit_interval("momentum", self.momentum, high_open=True)
        v.non_negative("weight_decay", self.weight_decay)
        v.non_negative("warmup_epochs", self.warmup_epochs)
        v.non_negative("mixup_alpha", self.mixup_alpha)
        v.positive_int("width", self.width)
        v.positive_int("hidden", self.hidden)

    def to_dict(self) -> dict:
        return asdict(self)


def make_model(cfg: RecipeConfig, input_shape, out_dim: int, seed: int) -> RecipeCNN:
    """A freshly initialised ``RecipeCNN`` from ``seed`` (the global RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model = RecipeCNN(tuple(input_shape), out_dim, cfg.width, cfg.hidden)
    if out_dim == 1:
        with torch.no_grad():
            model.head[-1].bias.fill_(4.5)  # the middle of [0, 9] (public, not data)
    return model


def lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    """Linear warm-up from 0 to ``peak`` over ``warmup`` steps, then linear decay to 0 at ``total``."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    return peak * max(0.0, (total - step) / max(1, total - warmup))


class RecipeRun:
    """One training of ``model`` on (x, labels) with the recipe, epoch by epoch (``train_epoch``)."""

    def __init__(self, model: nn.Module, x: torch.Tensor, labels: torch.Tensor, cfg: RecipeConfig, seed: int,
                 *, regression: bool = False):
        self.model, self.x, self.labels, self.cfg = model, x, labels, cfg
        self.regression = regression
        if cfg.optimizer == "adam":
            self.opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        else:
            self.opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                       weight_decay=cfg.weight_decay)
        self.gen = torch.Generator().manual_seed(int(seed))                 # order and mixup partners
        self.beta = np.random.default_rng(int(seed))                        # mixup's lambda
        self.nb = math.ceil(x.shape[0] / cfg.batch_size)
        self.total = cfg.epochs * self.nb
        self.warm = int(round(cfg.warmup_epochs * self.nb))
        self.step = 0
        self.epoch = 0

    def train_epoch(self) -> float:
        cfg, model = self.cfg, self.model
        model.train()
        n = self.x.shape[0]
        order = torch.randperm(n, generator=self.gen).to(self.x.device)
        alpha = 0.0 if self.regression else cfg.mixup_alpha
        total = 0.0
        for b in range(self.nb):
            idx = order[b * cfg.batch_size:(b + 1) * cfg.batch_size]
            xb, yb = self.x[idx], self.labels[idx]
            for g in self.opt.param_groups:
                g["lr"] = lr_at(self.step, self.total, self.warm, cfg.lr)
            if alpha > 0:
                lam = float(self.beta.beta(alpha, alpha))
                perm = torch.randperm(len(idx), generator=self.gen).to(xb.device)
                out = model(lam * xb + (1.0 - lam) * xb[perm])
                if yb.is_floating_point():       # soft labels (ALIBI): mix the targets
                    target = lam * yb + (1.0 - lam) * yb[perm]
                    loss = -(target * F.log_softmax(out, 1)).sum(1).mean()
                else:
                    loss = lam * F.cross_entropy(out, yb) + (1.0 - lam) * F.cross_entropy(out, yb[perm])
            elif self.regression:
                loss = F.mse_loss(model(xb), yb)
            elif yb.is_floating_point():
                loss = -(yb * F.log_softmax(model(xb), 1)).sum(1).mean()
            else:
                loss = F.cross_entropy(model(xb), yb)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.step += 1
            total += loss.item() * len(idx)
        self.epoch += 1
        return total / n


@torch.no_grad()
def predict(model: nn.Module, x: torch.Tensor, batch_size: int = 2000) -> torch.Tensor:
    """Raw outputs (logits, or values for regression) on CPU."""
    model.eval()
    return torch.cat([model(x[s:s + batch_size]).cpu() for s in range(0, x.shape[0], batch_size)])


def accuracy(model, x, y) -> float:
    return float((predict(model, x).argmax(1) == y.cpu()).float().mean())


def mse(model, x, y) -> float:
    return float(((predict(model, x).double() - y.cpu().double()) ** 2).mean())


def _seed(seed: int, stream: int) -> int:
    return int(np.random.SeedSequence([int(seed), 16, int(stream)]).generate_state(1)[0])


@dataclass
class MSTResult:
    model: nn.Module
    info: dict = field(default_factory=dict)


def train_label_dp(method: str, x: torch.Tensor, y: torch.Tensor, epsilon: float | None, *, seed: int,
                   cfg: RecipeConfig, num_classes: int = 10, task: str = "classification",
                   stage1_fraction: float = 0.4, stage1_epochs: int | None = None,
                   stage2_init: str = "stage1", prior_mode: str = "denoised", alibi_prior: str = "uniform",
                   log=None, noise_key=None) -> MSTResult:
    """Release the labels of (x, y) with ``method`` at ``epsilon`` and train with the recipe.

    method: none (true labels), laplace / rr (the seed's release, ``dpmech.label_dp.release.release_labels``,
    argmax post-processing), lp1st (RRWithPrior, uniform prior), lp2st (two stages, see the module
    docstring; ``stage1_epochs`` for stage 1, ``cfg.epochs`` for stage 2). ``info`` holds the keep
    rates, mean k* and (lp2st) the stage-1 model's accuracy on part 2's images against the true
    labels (a diagnostic only: never used by the training).
    """
    from dpmech.label_dp.release import release_labels

    v.choice("method", method, METHODS)
    v.choice("task", task, ("classification", "regression"))
    v.choice("stage2_init", stage2_init, STAGE2_INIT)
    v.choice("prior_mode", prior_mode, PRIOR_MODES)
    if method != "none":
        v.positive("epsilon", epsilon)
    if task == "regression" and method not in ("none", "laplace"):  # (alibi: classification only too)
        raise ValueError(f"method must be 'none' or 'laplace' for task 'regression', got {method!r}")
    y = y.to(torch.int64)
    n = x.shape[0]
    regression = task == "regression"
    out_dim = 1 if regression else num_classes
    info: dict = {"method": method, "epsilon": epsilon, "task": task}
    t0 = time.perf_counter()

    def fit(model, xs, labels, c, s, tag):
        run = RecipeRun(model, xs, labels, c, s, regression=regression)
        for e in range(c.epochs):
            loss = run.train_epoch()
            if log is not None:
                log(f"    {tag} epoch {e + 1}/{c.epochs} loss {loss:.4f} ({time.perf_counter() - t0:.0f} s)")
        return model

    # the release's randomness from the secret key (a fresh one by default; docs/threat_model.md)
    lab_gen = NoiseKey.resolve(noise_key).generator("label_dp.recipe", _seed(seed, 2 if method.startswith("lp") else 6))
    if method in ("none", "laplace", "rr"):
        rel = release_labels(y, num_classes=num_classes, task=task, mechanism=method,
                             epsilon=None if method == "none" else epsilon, generator=lab_gen)
        labels = rel.labels
        info["label_keep_rate"] = float(rel.kept(y).float().mean())
        model = fit(make_model(cfg, x.shape[1:], out_dim, _seed(seed, 0)), x, labels, cfg, _seed(seed, 1), method)
        info["train_seconds"] = time.perf_counter() - t0
        return MSTResult(model, info)
    if method == "alibi":
        from dpmech.label_dp.alibi import PRIORS, alibi_release, alibi_soft_labels

        v.choice("alibi_prior", alibi_prior, PRIORS)
        noisy, b = alibi_release(y, num_classes, epsilon, lab_gen)
        soft = alibi_soft_labels(noisy, b).float()
        info["label_keep_rate"] = float((noisy.argmax(1) == y).float().mean())
        info["soft_label_true_mass"] = float(soft[torch.arange(n), y].mean())   # diagnostic only
        model = make_model(cfg, x.shape[1:], out_dim, _seed(seed, 0))
        run = RecipeRun(model, x, soft, cfg, _seed(seed, 1))
        for e in range(cfg.epochs):
            if alibi_prior == "model" and e > 0:   # refresh the prior from the model (images only)
                prior = torch.softmax(predict(model, x).double(), 1)
                run.labels = alibi_soft_labels(noisy, b, prior).float()
            loss = run.train_epoch()
            if log is not None:
                log(f"    alibi epoch {e + 1}/{cfg.epochs} loss {loss:.4f} ({time.perf_counter() - t0:.0f} s)")
        info["alibi_prior"] = alibi_prior
        info["train_seconds"] = time.perf_counter() - t0
        return MSTResult(model, info)
    if method == "lp1st":
        labels, kstar = rr_with_prior(y, uniform_prior(n, num_classes), epsilon, lab_gen)
        info["label_keep_rate"] = float((labels == y).float().mean())
        info["mean_k"] = float(kstar.double().mean())
        model = fit(make_model(cfg, x.shape[1:], out_dim, _seed(seed, 0)), x, labels, cfg, _seed(seed, 1), method)
        info["train_seconds"] = time.perf_counter() - t0
        return MSTResult(model, info)
    # lp2st
    frac = v.open_unit("stage1_fraction", stage1_fraction)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(_seed(seed, 3)))
    n1 = int(round(frac * n))
    p1, p2 = perm[:n1], perm[n1:]
    lab1, _ = rr_with_prior(y[p1], uniform_prior(n1, num_classes), epsilon, lab_gen)
    c1 = RecipeConfig(**{**cfg.to_dict(), "epochs": stage1_epochs or cfg.epochs})
    m1 = fit(make_model(cfg, x.shape[1:], out_dim, _seed(seed, 0)), x[p1], lab1, c1, _seed(seed, 1), "stage1")
    prior = torch.softmax(predict(m1, x[p2]).double(), dim=1)        # images of part 2 only
    if prior_mode == "denoised":
        prior = denoise_rr_prior(prior, epsilon)
    lab2, kstar = rr_with_prior(y[p2], prior, epsilon, lab_gen)
    info.update({"stage1_size": n1, "stage1_keep_rate": float((lab1 == y[p1]).float().mean()),
                 "stage1_acc_part2": float((prior.argmax(1) == y[p2]).float().mean()),
                 "stage2_keep_rate": float((lab2 == y[p2]).float().mean()),
                 "mean_k": float(kstar.double().mean()), "stage2_init": stage2_init, "prior_mode": prior_mode})
    info["label_keep_rate"] = (info["stage1_keep_rate"] * n1 + info["stage2_keep_rate"] * (n - n1)) / n
    if stage2_init == "stage1":
        m2 = m1
    else:
        m2 = make_model(cfg, x.shape[1:], out_dim, _seed(seed, 4))
    idx = torch.cat([p1, p2])
    m2 = fit(m2, x[idx], torch.cat([lab1, lab2]), cfg, _seed(seed, 5), "stage2")
    info["train_seconds"] = time.perf_counter() - t0
    return MSTResult(m2, info)
