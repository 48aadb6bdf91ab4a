"""PixelDP training (Lecuyer et al. 2018, Sec. 3 and 4): the configuration, the noise
calibration from (epsilon, delta, L, sensitivity), a resumable epoch-by-epoch trainer with an
optional noise ramp-up, and the robustness guarantee recomputed from the noise actually used.

The trainer holds everything a restart needs (model, optimizer, RNG states, epoch) in
``state_dict()``; the Ray trainables checkpoint it every epoch.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from dpmech import _validate as v
from dpmech.privacy.mechanisms import gaussian_delta
from dpmech.networks.pixeldp import PixelDPCNN, PixelDPNet, build_pixeldp_model
from dpmech.robustness.noise_layer import NORMS, pixeldp_noise_scale
from dpmech._validate import matching_checkpoint

OPTIMIZERS = ("adam", "sgd")


def pixeldp_network(dataset: str, noise_scale: float | None, *, norm: str = "l2", noise_after: int = 1,
                    seed: int = 0) -> PixelDPNet:
    """The PixelDP network of ``dataset`` (:func:`dpmech.networks.pixeldp.build_pixeldp_model`); for a user's
    loader (import path, docs/own_model.md) the PixelDP CNN at the loader's image shape and number
    of classes (its first convolution's sensitivity is bounded for any input shape)."""
    from dpmech.datasets.splits import input_shape, is_custom, num_classes

    if is_custom(dataset):
        return PixelDPCNN(noise_scale, norm=norm, noise_after=noise_after, input_shape=input_shape(dataset),
                          num_classes=num_classes(dataset), seed=seed)
    return build_pixeldp_model(dataset, noise_scale, norm=norm, noise_after=noise_after, seed=seed)


@dataclass
class PixelDPConfig:
    """Hyperparameters of one PixelDP training run (defaults: the paper's MNIST setting)."""

    dataset: str = "mnist"
    epsilon: float = 1.0          # PixelDP epsilon of the noise layer
    delta: float = 0.05           # PixelDP delta (l2 only)
    attack_bound: float = 0.1     # construction attack bound L, in the [-1, 1] input domain
    norm: str = "l2"              # l2 -> Gaussian noise, l1 -> Laplace noise
    noise_after: int = 1          # 0: noise on the input; 1: after the first convolution
    epochs: int = 10
    batch_size: int = 128
    lr: float = 1e-3
    optimizer: str = "adam"
    momentum: float = 0.9         # sgd only
    weight_decay: float = 0.0
    noise_ramp_epochs: float = 0.0  # linear ramp of the noise from 0 to full over this many epochs
    seed: int = 0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        from dpmech.datasets.splits import check_dataset

        check_dataset(self.dataset)
        v.positive("epsilon", self.epsilon)
        v.positive("attack_bound", self.attack_bound)
        v.choice("norm", self.norm, NORMS)
        if self.norm == "l2":
            v.open_unit("delta", self.delta)
        if isinstance(self.noise_after, bool) or self.noise_after not in (0, 1):
            raise ValueError(f"noise_after must be 0 or 1, got {self.noise_after!r}")
        v.positive_int("epochs", self.epochs)
        v.positive_int("batch_size", self.batch_size)
        v.positive("lr", self.lr)
        v.choice("optimizer", self.optimizer, OPTIMIZERS)
        v.unit_interval("momentum", self.momentum, high_open=True)
        v.non_negative("weight_decay", self.weight_decay)
        v.non_negative("noise_ramp_epochs", self.noise_ramp_epochs)
        v.positive_int("seed", self.seed, minimum=0)

    @property
    def noise_scale(self) -> float:
        """Noise std (l2) or Laplace scale (l1) for the construction bound, Delta = 1."""
        return pixeldp_noise_scale(self.epsilon, self.delta, self.attack_bound, 1.0, self.norm)

    def to_dict(self) -> dict:
        return asdict(self)


def guarantee_epsilon(noise_scale: float, attack_bound: float, sensitivity: float, delta: float,
                      norm: str) -> float:
    """The smallest epsilon for which noise of ``noise_scale`` on a pre-noise layer of
    ``sensitivity`` is (epsilon, delta)-DP against attacks of size ``attack_bound``.

    Computed from the noise the model actually adds (exact Gaussian profile, Balle & Wang 2018),
    so it is at most the configured epsilon and smaller when the sensitivity bound is loose.
    """
    unit = noise_scale / (sensitivity * attack_bound)
    if norm == "l1":
        return 1.0 / unit
    lo, hi = 0.0, 1.0
    while gaussian_delta(unit, hi) > delta:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        if gaussian_delta(unit, mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


class PixelDPTrainer:
    """Trains a PixelDP network epoch by epoch on in-memory tensors (inputs in [-1, 1])."""

    def __init__(self, config: PixelDPConfig, x_train: torch.Tensor, y_train: torch.Tensor, *,
                 device: str | torch.device = "cpu", with_noise: bool = True):
        config.validate()
        self.config = config
        self.device = torch.device(device)
        v.training_images(x_train, y_train)
        self.x = x_train.to(self.device)
        self.y = y_train.to(self.device)
        torch.manual_seed(config.seed)  # parameter initialisation
        scale = config.noise_scale if with_noise else None
        self.model: PixelDPNet = pixeldp_network(
            config.dataset, scale, norm=config.norm, noise_after=config.noise_after, seed=config.seed + 1
        ).to(self.device)
        if tuple(self.model.input_shape) != tuple(x_train.shape[1:]):
            raise ValueError(f"x_train images must have shape {self.model.input_shape}, got {tuple(x_train.shape[1:])}")
        params = self.model.parameters()
        if config.optimizer == "adam":
            self.optimizer = torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
        else:
            self.optimizer = torch.optim.SGD(params, lr=config.lr, momentum=config.momentum,
                                             weight_decay=config.weight_decay)
        self.shuffle_gen = torch.Generator(device="cpu").manual_seed(config.seed + 2)
        self.epoch = 0
        self.steps = 0

    # -------------------------------------------------------------- noise ramp-up
    def _set_ramp(self, progress_epochs: float) -> None:
        if not self.model.has_noise:
            return
        r = self.config.noise_ramp_epochs
        self.model.noise.ramp = 1.0 if r <= 0 else min(1.0, progress_epochs / r)

    # -------------------------------------------------------------- training
    def train_epoch(self, progress=None) -> dict[str, float]:
        """One pass over the training set in a fresh random order; returns train_loss/acc."""
        cfg = self.config
        self.model.train()
        n = self.x.shape[0]
        order = torch.randperm(n, generator=self.shuffle_gen).to(self.device)
        nb = math.ceil(n / cfg.batch_size)
        total_loss = 0.0
        correct = 0
        for b in range(nb):
            self._set_ramp(self.epoch + (b + 1) / nb)
            idx = order[b * cfg.batch_size:(b + 1) * cfg.batch_size]
            xb, yb = self.x[idx], self.y[idx]
            logits = self.model(xb)
            loss = F.cross_entropy(logits, yb)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.steps += 1
            total_loss += loss.item() * len(idx)
            correct += (logits.argmax(1) == yb).sum().item()
            if progress is not None:
                progress(b + 1, nb)
        self.epoch += 1
        self._set_ramp(self.epoch)
        return {"train_loss": total_loss / n, "train_acc": correct / n}

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000) -> float:
        """Accuracy of one noisy forward pass per example (the cheap per-epoch test metric)."""
        self.model.eval()
        correct = 0
        for s in range(0, x.shape[0], batch_size):
            xb = x[s:s + batch_size].to(self.device)
            correct += (self.model(xb).argmax(1).cpu() == y[s:s + batch_size].cpu()).sum().item()
        return correct / x.shape[0]

    # -------------------------------------------------------------- guarantee
    def guarantee(self) -> dict[str, float]:
        """The PixelDP guarantee of the trained model, recomputed from its actual noise and its
        exactly measured pre-noise sensitivity (never copied from the config)."""
        cfg = self.config
        if not self.model.has_noise:
            raise ValueError("the model has no noise layer, so it has no PixelDP guarantee")
        scale = self.model.noise.scale
        sens = self.model.sensitivity_exact()
        eps = guarantee_epsilon(scale, cfg.attack_bound, sens, cfg.delta, cfg.norm)
        return {"epsilon": eps, "delta": cfg.delta if cfg.norm == "l2" else 0.0,
                "attack_bound": cfg.attack_bound, "noise_scale": scale, "sensitivity": sens,
                "sensitivity_bound": self.model.sensitivity_bound()}

    # -------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        """A snapshot (deep copy) of everything needed to continue training bit for bit."""
        noise_gen = None
        if self.model.has_noise:
            noise_gen = self.model.noise.get_rng_state(self.device)
        return copy.deepcopy({
            "config": self.config.to_dict(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "shuffle_gen": self.shuffle_gen.get_state(),
            "noise_gen": noise_gen,
            "epoch": self.epoch,
            "steps": self.steps,
        })

    def load_state_dict(self, state: dict) -> None:
        matching_checkpoint(state["config"], self.config.to_dict())
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.shuffle_gen.set_state(state["shuffle_gen"])
        if state["noise_gen"] is not None:
            self.model.noise.set_rng_state(self.device, state["noise_gen"])
        self.epoch = int(state["epoch"])
        self.steps = int(state["steps"])
        self._set_ramp(self.epoch)
