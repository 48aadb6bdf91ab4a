"""The label-DP trainer (docs/label_dp.md): releases the training labels once through
:mod:`dpmech.label_dp.release` (constructor; LP-2ST: part 2 when stage 2 begins), then trains a fresh
network on the images and the released labels; the source document's CNN (``LabelDPCNN``).

Randomness and checkpoints (docs/threat_model.md; DESIGN.md, Conventions: "a checkpoint holds the
step, not a generator state"): the release's draws (randomized response, Laplace noise) come from
the secret key's ``label_dp.release`` stream, per stage (:class:`dpmech.privacy.secret.StepStream`:
the generator of stage s is seeded by HMAC(key, stream, s); LP-2ST's part 2 is stage 2). A
checkpoint holds the released labels and the stage, never that stream's state, so LP-2ST's second
release, drawn after a checkpoint of stage 1, needs the owner's key. The shuffling and mixup follow
the public seed (training on released labels is post-processing) and keep their states. The research
mode (``NoiseKey.reproducible``) keeps one running stream from the public seed and checkpoints it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from dpmech import _validate as v
from dpmech.privacy.secret import NoiseKey
from dpmech._validate import matching_checkpoint
from dpmech.label_dp.release import (MECHANISMS, POSTPROCESS, PRIOR_MODES, RECIPES, TASKS, LabelRelease, _check_labels,
                                     analytic_keep_prob, release_labels, rr_keep_prob)


class LabelDPCNN(nn.Module):
    """The source document's small CNN: two 3x3 convolutions (32 and 64 channels, ELU, 2x2 max
    pooling), a 32-unit ELU layer and a linear head with ``out_dim`` outputs (10 class scores, or
    1 value for regression). The source's ELU after the class scores is dropped (it bounds the
    logits below by -1 for no benefit)."""

    def __init__(self, input_shape: tuple[int, int, int] = (1, 28, 28), out_dim: int = 10):
        super().__init__()
        c, h, w = input_shape
        self.input_shape = tuple(input_shape)
        self.features = nn.Sequential(
            nn.Conv2d(c, 32, 3, padding=1), nn.ELU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ELU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * (h // 4) * (w // 4), 32), nn.ELU(),
                                  nn.Linear(32, out_dim))
        self.out_dim = out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.features(x))
        return out.squeeze(1) if self.out_dim == 1 else out


@dataclass
class LabelDPConfig:
    """Hyperparameters of one label-DP run (defaults: the source's Adam, lr 1e-3, batches of 100).

    ``recipe="mixup_sgd"`` (Ghazi et al.'s recipe, ``dpmech.label_dp.recipe``): ``RecipeCNN``, SGD
    with ``momentum`` and ``weight_decay``, ``lr`` the peak of a linear warm-up over
    ``warmup_epochs`` then a linear decay to 0 (per stage), mixup with Beta(``mixup_alpha``,
    ``mixup_alpha``) (classification only). ``lp2st``: the first ``stage1_epochs`` of ``epochs``
    train stage 1 on a random ``stage1_fraction`` of the training set; the rest trains stage 2 on
    all of it (Alg. 3), from the stage-1 weights with a fresh optimizer and schedule. ``width`` and
    ``hidden`` size the RecipeCNN (16 / 128; 32 / 256 closes LP-2ST's gap at epsilon 2, docs/label_dp.md).
    """

    dataset: str = "mnist"
    task: str = "classification"      # "classification" (cross-entropy) or "regression" (MSE on the digit)
    mechanism: str = "laplace"        # "laplace", "rr", "lp1st", "lp2st" or "none"
    epsilon: float | None = 1.0       # None: non-private baseline (true labels)
    postprocess: str = "argmax"       # classification + laplace only: "argmax" or "clamp_round"
    epochs: int = 5
    batch_size: int = 100
    lr: float = 1e-3
    seed: int = 0
    recipe: str = "adam"              # "adam" (the source's) or "mixup_sgd" (Ghazi et al.'s)
    momentum: float = 0.9             # mixup_sgd only
    weight_decay: float = 5e-4        # mixup_sgd only
    warmup_epochs: float = 1.0        # mixup_sgd only
    mixup_alpha: float = 4.0          # mixup_sgd + classification only; 0 = no mixup
    stage1_fraction: float = 0.4      # lp2st only
    stage1_epochs: int = 0            # lp2st only: 1 <= stage1_epochs < epochs
    prior_mode: str = "denoised"      # lp2st only: "denoised" (stage 1's RR channel inverted) or "softmax"
    width: int = 16                   # mixup_sgd only: RecipeCNN's channels (width, 2 width)
    hidden: int = 128                 # mixup_sgd only: RecipeCNN's hidden units
    model: str | None = None          # None: the recipe's CNN; or a factory's import path (docs/own_model.md)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        from dpmech.datasets.splits import check_dataset
        from dpmech.datasets.user_code import is_import_path

        check_dataset(self.dataset)
        if self.model is not None and not is_import_path(self.model):
            raise ValueError(f"model must be None (the recipe's CNN) or an import path 'package.module:factory', "
                             f"got {self.model!r}")
        if self.model is not None and (self.width, self.hidden) != (LabelDPConfig.width, LabelDPConfig.hidden):
            raise ValueError("width and hidden size the recipe's CNN; they do not apply to a model import path")
        v.choice("task", self.task, TASKS)
        v.choice("mechanism", self.mechanism, MECHANISMS)
        v.choice("postprocess", self.postprocess, POSTPROCESS)
        v.choice("recipe", self.recipe, RECIPES)
        v.choice("prior_mode", self.prior_mode, PRIOR_MODES)
        if self.epsilon is not None:
            v.positive("epsilon", self.epsilon)
        if self.mechanism == "none" and self.epsilon is not None:
            raise ValueError(f"epsilon must be null when mechanism is 'none' (no noise, no epsilon), got {self.epsilon}")
        if self.postprocess != "argmax" and (self.task != "classification" or self.mechanism != "laplace"):
            raise ValueError("postprocess 'clamp_round' applies to task 'classification' with mechanism 'laplace' only")
        if self.mechanism in ("lp1st", "lp2st") and self.task != "classification":
            raise ValueError(f"mechanism {self.mechanism!r} applies to task 'classification' only")
        v.positive_int("epochs", self.epochs)
        v.positive_int("batch_size", self.batch_size)
        v.positive("lr", self.lr)
        v.positive_int("seed", self.seed, minimum=0)
        v.unit_interval("momentum", self.momentum, high_open=True)
        v.non_negative("weight_decay", self.weight_decay)
        v.non_negative("warmup_epochs", self.warmup_epochs)
        v.non_negative("mixup_alpha", self.mixup_alpha)
        v.open_unit("stage1_fraction", self.stage1_fraction)
        v.positive_int("width", self.width)
        v.positive_int("hidden", self.hidden)
        if self.recipe != "mixup_sgd" and (self.width, self.hidden) != (LabelDPConfig.width, LabelDPConfig.hidden):
            raise ValueError("width and hidden apply to recipe 'mixup_sgd' only (recipe 'adam' trains the source's "
                             f"CNN), got width {self.width}, hidden {self.hidden}")
        s1 = v.positive_int("stage1_epochs", self.stage1_epochs, minimum=0)
        if self.mechanism == "lp2st" and self.epsilon is not None and not 1 <= s1 < self.epochs:
            raise ValueError(f"stage1_epochs must be in [1, epochs - 1] = [1, {self.epochs - 1}] for mechanism "
                             f"'lp2st' (stage 2 needs at least one epoch), got {s1}")
        if self.mechanism != "lp2st" and s1 != 0:
            raise ValueError(f"stage1_epochs applies to mechanism 'lp2st' only (must be 0), got {s1}")

    @property
    def private(self) -> bool:
        return self.mechanism != "none" and self.epsilon is not None

    def to_dict(self) -> dict:
        return asdict(self)


def derive_seed(seed: int, stream: int) -> int:
    """Independent seeds for the streams of one trial (0: init, 1: shuffling, 2: label release,
    3: LP-2ST's split, 4: mixup's lambda)."""
    return int(np.random.SeedSequence([int(seed), int(stream)]).generate_state(1)[0])


class LabelDPTrainer:
    """Releases the training labels once (constructor; LP-2ST: part 1 there, part 2 when stage 2
    begins), then trains a fresh network on the images and the released labels epoch by epoch.
    Inputs in [-1, 1], labels int in [0, K-1]."""

    def __init__(self, config: LabelDPConfig, x_train: torch.Tensor, y_train: torch.Tensor, *,
                 num_classes: int = 10, device: str | torch.device = "cpu", noise_key=None):
        config.validate()
        self.config = config
        self.device = torch.device(device)
        self.num_classes = v.positive_int("num_classes", num_classes, minimum=2)
        if x_train.dim() != 4 or x_train.shape[0] != y_train.shape[0] or x_train.shape[0] == 0:
            raise ValueError(f"x_train must be [N, C, H, W] with N >= 1 labels, got {tuple(x_train.shape)} "
                             f"and {tuple(y_train.shape)}")
        _check_labels(y_train, self.num_classes)
        self.x = x_train.to(self.device)
        self.y_true = y_train.to(self.device, torch.int64)
        n = x_train.shape[0]
        mech = config.mechanism if config.private else "none"
        self.two_stage = mech == "lp2st"
        # 1. the release: drawn once, before training, from its own generator
        # (its randomness is the guarantee's: from the secret key, docs/threat_model.md)
        self.noise_key = NoiseKey.resolve(noise_key)
        self.label_stream = self.noise_key.step_stream("label_dp.release", derive_seed(config.seed, 2))
        self.label_gen = self.label_stream.at(1)   # stage 1's generator (research mode: the running stream)
        self.part1 = torch.arange(n)
        self.stage = 1
        if self.two_stage:
            from dpmech.label_dp.rr_prior import rr_with_prior, uniform_prior

            if n < 2:
                raise ValueError("x_train must hold at least 2 examples for mechanism 'lp2st' (two parts)")
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(config.seed, 3)))
            n1 = min(n - 1, max(1, int(round(config.stage1_fraction * n))))
            self.part1 = perm[:n1].sort().values
            y_cpu = y_train.detach().to("cpu", torch.int64)
            labels = torch.full((n,), -1, dtype=torch.int64)       # -1: not released yet (part 2)
            labels[self.part1], _ = rr_with_prior(y_cpu[self.part1], uniform_prior(n1, self.num_classes),
                                                  config.epsilon, self.label_gen)
            self.release = LabelRelease(labels, config.task, "lp2st", config.postprocess, self.num_classes,
                                        epsilon_value=float(config.epsilon))
            self.keep_exact = torch.full((n,), math.nan, dtype=torch.float64)
            self.keep_exact[self.part1] = rr_keep_prob(config.epsilon, self.num_classes)
        else:
            self.release = release_labels(y_train, num_classes=self.num_classes, task=config.task, mechanism=mech,
                                          epsilon=config.epsilon, generator=self.label_gen,
                                          postprocess=config.postprocess)
            self.keep_exact = None
        self.labels = self.release.labels.to(self.device)
        # 2. a freshly initialised network (global RNG untouched)
        out_dim = self.num_classes if config.task == "classification" else 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(config.seed, 0))
            if config.model is not None:
                from dpmech.datasets.user_code import build_model

                model = build_model(config.model, tuple(x_train.shape[1:]), out_dim, derive_seed(config.seed, 0))
            elif config.recipe == "mixup_sgd":
                from dpmech.label_dp.recipe import RecipeCNN

                model = RecipeCNN(tuple(x_train.shape[1:]), out_dim, width=config.width, hidden=config.hidden)
            else:
                model = LabelDPCNN(tuple(x_train.shape[1:]), out_dim)
        if out_dim == 1 and config.model is None:  # start the regression output at the middle of [0, K-1] (public)
            with torch.no_grad():
                model.head[-1].bias.fill_((self.num_classes - 1) / 2)
        self.model = model.to(self.device)
        self.optimizer = self._make_optimizer()
        self.shuffle_gen = torch.Generator(device="cpu").manual_seed(derive_seed(config.seed, 1))
        self.mixup_rng = np.random.default_rng(derive_seed(config.seed, 4))
        self.epoch = 0
        self.steps = 0
        self.stage_step = 0

    def _make_optimizer(self):
        cfg = self.config
        if cfg.recipe == "mixup_sgd":
            return torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                   weight_decay=cfg.weight_decay)
        return torch.optim.Adam(self.model.parameters(), lr=cfg.lr)

    # ------------------------------------------------------------------ LP-2ST's second release
    def _train_index(self) -> torch.Tensor:
        return self.part1 if (self.two_stage and self.stage == 1) else torch.arange(self.x.shape[0])

    @torch.no_grad()
    def _begin_stage2(self) -> None:
        """Alg. 3, t = 2: the stage-1 model's softmax on part 2's images (denoised: stage 1's RR
        channel inverted) is the prior of RRWithPrior on part 2's labels; never reads a part-2 label
        before the release itself."""
        from dpmech.label_dp.rr_prior import denoise_rr_prior, rr_prior_choose_k, rr_with_prior

        cfg = self.config
        n = self.x.shape[0]
        mask = torch.ones(n, dtype=torch.bool)
        mask[self.part1] = False
        part2 = torch.nonzero(mask).squeeze(1)
        prior = torch.softmax(self.predict_raw(self.x[part2.to(self.device)]).double(), dim=1)
        if cfg.prior_mode == "denoised":
            prior = denoise_rr_prior(prior, cfg.epsilon)
        y2 = self.y_true.cpu()[part2]
        out, kstar = rr_with_prior(y2, prior, cfg.epsilon, self.label_stream.at(2))
        labels = self.release.labels.clone()
        labels[part2] = out
        self.release = LabelRelease(labels, cfg.task, "lp2st", cfg.postprocess, self.num_classes,
                                    epsilon_value=float(cfg.epsilon))
        self.labels = labels.to(self.device)
        # exact P(release = y) per example (a diagnostic: needs the true label, never used to train)
        _, order = rr_prior_choose_k(prior, cfg.epsilon)
        rank = (order == y2[:, None]).to(torch.int64).argmax(1)
        keep = 1.0 / (1.0 + (kstar.double() - 1.0) * math.exp(-cfg.epsilon))
        self.keep_exact[part2] = torch.where(rank < kstar, keep, torch.zeros_like(keep))
        self.stage = 2
        self.stage_step = 0
        self.optimizer = self._make_optimizer()

    # ------------------------------------------------------------------ training
    def _loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.config.task == "classification":
            return F.cross_entropy(out, target)
        return F.mse_loss(out, target)

    def _stage_epochs(self) -> int:
        cfg = self.config
        if not self.two_stage:
            return cfg.epochs
        return cfg.stage1_epochs if self.stage == 1 else cfg.epochs - cfg.stage1_epochs

    def train_epoch(self, progress=None) -> dict[str, float]:
        """One pass over the training set in a fresh order, on the released labels (never redrawn;
        LP-2ST: the part-2 release happens at the start of epoch ``stage1_epochs + 1``)."""
        cfg = self.config
        if self.two_stage and self.stage == 1 and self.epoch >= cfg.stage1_epochs:
            self._begin_stage2()
        self.model.train()
        index = self._train_index()
        n = index.numel()
        order = index[torch.randperm(n, generator=self.shuffle_gen)].to(self.device)
        nb = math.ceil(n / cfg.batch_size)
        sgd = cfg.recipe == "mixup_sgd"
        alpha = cfg.mixup_alpha if (sgd and cfg.task == "classification") else 0.0
        if sgd:
            from dpmech.label_dp.recipe import lr_at

            total_steps = self._stage_epochs() * nb
            warm = int(round(cfg.warmup_epochs * nb))
        total = 0.0
        for b in range(nb):
            idx = order[b * cfg.batch_size:(b + 1) * cfg.batch_size]
            xb, yb = self.x[idx], self.labels[idx]
            if sgd:
                for g in self.optimizer.param_groups:
                    g["lr"] = lr_at(self.stage_step, total_steps, warm, cfg.lr)
            if alpha > 0:
                lam = float(self.mixup_rng.beta(alpha, alpha))
                perm = torch.randperm(len(idx), generator=self.shuffle_gen).to(self.device)
                out = self.model(lam * xb + (1.0 - lam) * xb[perm])
                loss = lam * self._loss(out, yb) + (1.0 - lam) * self._loss(out, yb[perm])
            else:
                loss = self._loss(self.model(xb), yb)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.steps += 1
            self.stage_step += 1
            total += loss.item() * len(idx)
            if progress is not None:
                progress(b + 1, nb)
        self.epoch += 1
        return {"train_loss": total / n}

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def predict_raw(self, x: torch.Tensor, batch_size: int = 1000) -> torch.Tensor:
        """Raw outputs (class scores, or values for regression) on CPU."""
        self.model.eval()
        out = [self.model(x[s:s + batch_size].to(self.device)).cpu() for s in range(0, x.shape[0], batch_size)]
        return torch.cat(out)

    @torch.no_grad()
    def predict(self, x: torch.Tensor, batch_size: int = 1000) -> torch.Tensor:
        """Class predictions (classification) or real-valued predictions (regression), on CPU."""
        out = self.predict_raw(x, batch_size)
        return out.argmax(1) if self.config.task == "classification" else out

    def predict_labels(self, x: torch.Tensor) -> torch.Tensor:
        """Predicted labels; regression predictions are rounded to the nearest digit in [0, K-1]."""
        p = self.predict(x)
        if self.config.task == "regression":
            p = torch.round(p.clamp(0.0, self.num_classes - 1.0)).to(torch.int64)
        return p

    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Test accuracy (regression: of the rounded predictions; the per-epoch ``test_acc``)."""
        return float((self.predict_labels(x) == y.cpu()).float().mean())

    def mse(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Mean squared error of the raw regression output against the true digit (the source's MSE)."""
        if self.config.task != "regression":
            raise ValueError("mse is defined for task 'regression' only")
        return float(((self.predict(x).double() - y.cpu().double()) ** 2).mean())

    # ------------------------------------------------------------------ privacy
    def label_keep_rate(self) -> float:
        """Fraction of training labels the release kept (regression: released value rounds to y);
        LP-2ST before stage 2: of the labels released so far (part 1)."""
        kept = self.release.kept(self.y_true)
        if self.two_stage:
            kept = kept[self.release.labels.to(kept.device) >= 0]
        return float(kept.float().mean())

    def privacy(self) -> dict[str, float]:
        """epsilon (delta = 0) from the drawn mechanism's parameters, the exact label-level epsilon,
        the measured and the analytic keep probability (for RR: 1 - the flip probability used), and
        the Laplace scale actually used (0 for RR and the baseline). LP-2ST's analytic keep
        probability is the mean over the released labels of the exact per-example P(release = y)
        (RR's keep probability in part 1; in part 2 ``e^eps/(e^eps+k*-1)`` if y is in the prior's
        top k*, else 0)."""
        r = self.release
        freq = np.bincount(self.y_true.cpu().numpy(), minlength=self.num_classes) / self.y_true.numel()
        eps = r.epsilon()
        if self.two_stage:
            ke = self.keep_exact
            analytic = float(ke[~torch.isnan(ke)].mean())
        else:
            analytic = analytic_keep_prob(r.mechanism, None if r.mechanism == "none" else eps, self.num_classes,
                                          task=r.task, postprocess=r.postprocess, label_freq=freq)
        return {
            "epsilon": eps,
            "delta": 0.0,
            "label_epsilon": r.label_epsilon(),
            "label_keep_rate": self.label_keep_rate(),
            "analytic_keep_prob": analytic,
            "noise_scale": r.noise_scale if r.mechanism == "laplace" else 0.0,
        }

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """A snapshot of everything needed to continue bit for bit with the same key, the released
        labels included; the release stream's state only in the research mode (``label_gen``)."""
        stream = self.label_stream.state_dict()
        return copy.deepcopy({
            "config": self.config.to_dict(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "shuffle_gen": self.shuffle_gen.get_state(),
            **({"label_gen": stream} if stream is not None else {}),
            "labels": self.labels.detach().cpu(),
            "release": self.release.meta(),
            "epoch": self.epoch,
            "steps": self.steps,
            "stage": self.stage,
            "stage_step": self.stage_step,
            "mixup_rng": self.mixup_rng.bit_generator.state,
            "keep_exact": None if self.keep_exact is None else self.keep_exact.clone(),
        })

    def load_state_dict(self, state: dict) -> None:
        """Restore a snapshot; the released labels come from it (they are never drawn again)."""
        matching_checkpoint(state["config"], self.config.to_dict())
        labels = state["labels"]
        if tuple(labels.shape) != (self.x.shape[0],):
            raise ValueError(f"checkpoint labels have shape {tuple(labels.shape)}, the training set {self.x.shape[0]} examples")
        self.model.load_state_dict(state["model"])
        self.optimizer = self._make_optimizer()
        self.optimizer.load_state_dict(state["optimizer"])
        self.shuffle_gen.set_state(state["shuffle_gen"])
        # secret key: the stream's state is not read (a checkpoint before issue 48 held it: ignored; stage 2
        # draws from the key); research mode: refused in one line when missing
        self.label_stream.load_state_dict(state.get("label_gen"), "label_gen")
        self.release = LabelRelease(labels.clone(), **state["release"])
        self.labels = self.release.labels.to(self.device)
        self.epoch = int(state["epoch"])
        self.steps = int(state["steps"])
        self.stage = int(state.get("stage", 1))
        self.stage_step = int(state.get("stage_step", self.steps))
        if state.get("mixup_rng") is not None:
            self.mixup_rng.bit_generator.state = state["mixup_rng"]
        if state.get("keep_exact") is not None:
            self.keep_exact = state["keep_exact"].clone()
