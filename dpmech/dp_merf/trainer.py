"""DP-MERF (Harder, Adamczewski & Park, AISTATS 2021, "DP-MERF: Differentially Private Mean Embeddings
with Random Features for Practical Privacy-Preserving Data Generation"): release ONE noisy mean
embedding of the labelled training data, then train a generator to match it with no further access
to the data (docs/dp_merf.md).

* Features (paper Sec. 3, Eq. 4 and the "sphere" random Fourier features): for a Gaussian kernel
  k(x, x') = exp(-||x - x'||^2 / (2 l^2)), frequencies w_j ~ N(0, l^-2 I), j = 1..D/2, drawn from a
  seeded generator (data-independent), and phi(x) = [cos(w_j . x), sin(w_j . x)]_j / sqrt(D/2), so
  that phi(x) . phi(x') ~ k(x, x') and ||phi(x)|| = 1 exactly.
* Labelled embedding (paper Sec. 4, "product kernel" of the input and the one-hot label):
  vec(phi(x) e_y^T), a D x K matrix with one non-zero column, norm 1.
* Release (paper Eq. 6, Gaussian mechanism): under add/remove-one neighbours the *sum* of the
  per-example vectors v_i = [a vec(phi(x_i) e_{y_i}^T), b], a^2 + b^2 = 1, has L2 sensitivity
  max_i ||v_i|| = 1, so S~ = sum_i v_i + N(0, sigma^2 I) with sigma from the accountant for (epsilon,
  delta) of ONE Gaussian step. The last coordinate is the noisy count N~ = S~_last / b; the mean
  embedding estimate is S~[:-1] / (a max(N~, 1)) (post-processing). The paper releases the mean with
  sensitivity 2/N under replace-one neighbours (N public); the count coordinate keeps N private too
  (docs/dp_merf.md).
* Generator (paper Sec. 4 and its MNIST code's convolutional conditional generator): G(z, y), trained
  with Adam to minimise || mu~ - (1/m) sum_j vec(phi(G(z_j, y_j)) e_{y_j}^T) ||^2 over fresh
  (z, y) batches: post-processing of the release, never reading a training example.

The training tensors are read only by :func:`release_embedding`, called once in
:class:`DPMERFTrainer`'s constructor; the trainer keeps no reference to them.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dpmech import _validate as v
from dpmech.privacy.secret import NoiseKey
from dpmech.privacy.accounting import PrivacyLedger, noise_multiplier_for, subsampled_gaussian_event
from dpmech.datasets.splits import num_classes
from dpmech.dpgan.evaluate import JudgedSampler

DATASETS = ("mnist", "fashion_mnist", "cifar10")
# The paper's MNIST kernel: rff_sigma 105 on pixels in [0, 1], frequencies N(0, 1/105), i.e. a
# length scale sqrt(105); our inputs span [-1, 1] (twice as far apart), so l = 2 sqrt(105).
PAPER_LENGTHSCALE = 2.0 * math.sqrt(105.0)


@dataclass
class DPMERFConfig:
    """Hyperparameters of one DP-MERF run (defaults: the paper's MNIST code, docs/dp_merf.md)."""

    dataset: str = "mnist"
    epsilon: float | None = 1.0       # target (epsilon, delta) of the single release; None = non-private
    delta: float = 1e-5
    n_features: int = 10000           # D: random Fourier features (D/2 frequencies, cos and sin)
    lengthscale: float = PAPER_LENGTHSCALE  # l of the Gaussian kernel, in input units ([-1, 1] pixels)
    count_weight: float = 0.1         # b: weight of the count coordinate (a = sqrt(1 - b^2) on the embedding)
    epochs: int = 5                   # generator epochs (paper: 5); no privacy cost, the data is read once
    steps_per_epoch: int = 120        # generator steps per epoch (paper: 60,000 / 500)
    batch_size: int = 500             # generated examples per generator step
    lr: float = 0.01
    lr_decay: float = 0.9             # multiplied into lr after every epoch (paper: 0.9)
    code_dim: int = 5                 # latent z dimension (paper: 5)
    hidden: int = 200                 # the generator's fully connected width (paper: 200)
    seed: int = 0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        v.choice("dataset", self.dataset, DATASETS)
        if self.epsilon is not None:
            v.positive("epsilon", self.epsilon)
        v.open_unit("delta", self.delta)
        v.positive_int("n_features", self.n_features, minimum=2)
        if self.n_features % 2:
            raise ValueError(f"n_features must be even (cos and sin of each frequency), got {self.n_features}")
        v.positive("lengthscale", self.lengthscale)
        v.open_unit("count_weight", self.count_weight)
        v.positive_int("epochs", self.epochs)
        v.positive_int("steps_per_epoch", self.steps_per_epoch)
        v.positive_int("batch_size", self.batch_size)
        v.positive("lr", self.lr)
        v.unit_interval("lr_decay", self.lr_decay, low_open=True)
        v.positive_int("code_dim", self.code_dim)
        v.positive_int("hidden", self.hidden)
        v.positive_int("seed", self.seed, minimum=0)

    @property
    def private(self) -> bool:
        return self.epsilon is not None

    def to_dict(self) -> dict:
        return asdict(self)


def planned_event(config: DPMERFConfig):
    """The dp-accounting event of a trial: one Gaussian mechanism (sensitivity 1) at sigma."""
    return subsampled_gaussian_event(1.0, calibrate_noise(config), 1)


def calibrate_noise(config: DPMERFConfig) -> float:
    """sigma of the single Gaussian release (sensitivity 1): the smallest noise multiplier whose
    RDP epsilon (dp-accounting, sampling rate 1, one step) is <= the target at delta; 0 if non-private."""
    if not config.private:
        return 0.0
    return noise_multiplier_for(config.epsilon, config.delta, 1.0, 1)


class RandomFourierFeatures(nn.Module):
    """phi(x) = [cos(W x), sin(W x)] / sqrt(D/2), W ~ N(0, l^-2 I) of shape [D/2, d] (seeded, fixed).

    phi(x) . phi(x') is an unbiased estimate of exp(-||x - x'||^2 / (2 l^2)) and ||phi(x)|| = 1 for every x."""

    def __init__(self, input_dim: int, n_features: int, lengthscale: float, seed: int):
        super().__init__()
        gen = torch.Generator(device="cpu").manual_seed(seed)
        w = torch.randn(n_features // 2, input_dim, generator=gen) / lengthscale
        self.register_buffer("w", w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = x.flatten(1) @ self.w.t()
        return torch.cat([torch.cos(proj), torch.sin(proj)], 1) / math.sqrt(self.w.shape[0])


def labelled_embedding(features: RandomFourierFeatures, x: torch.Tensor, y: torch.Tensor, classes: int) -> torch.Tensor:
    """Per-example vec(phi(x) e_y^T): [B, D * K] (one non-zero block of D per example, norm 1).
    Materialises B x D x K numbers: for small batches (tests); sums go through :func:`embedding_sum`."""
    phi = features(x)
    return (phi.unsqueeze(2) * F.one_hot(y, classes).to(phi.dtype).unsqueeze(1)).flatten(1)


def embedding_sum(features: RandomFourierFeatures, x: torch.Tensor, y: torch.Tensor, classes: int) -> torch.Tensor:
    """sum_i vec(phi(x_i) e_{y_i}^T) = vec(Phi^T onehot(Y)), [D * K], without per-example blocks."""
    phi = features(x)
    return (phi.t() @ F.one_hot(y, classes).to(phi.dtype)).flatten()


def release_vectors(features: RandomFourierFeatures, x: torch.Tensor, y: torch.Tensor, classes: int,
                    count_weight: float) -> torch.Tensor:
    """v_i = [a vec(phi(x_i) e_{y_i}^T), b] with a = sqrt(1 - b^2): every row has norm exactly 1, the
    L2 sensitivity of their sum under adding or removing one example (per-example rows: for tests)."""
    a = math.sqrt(1.0 - count_weight ** 2)
    emb = labelled_embedding(features, x, y, classes)
    return torch.cat([a * emb, torch.full((emb.shape[0], 1), count_weight, dtype=emb.dtype, device=emb.device)], 1)


@torch.no_grad()
def release_embedding(features: RandomFourierFeatures, x: torch.Tensor, y: torch.Tensor, *, classes: int,
                      count_weight: float, noise_multiplier: float, generator: torch.Generator,
                      chunk: int = 2000) -> torch.Tensor:
    """The Gaussian mechanism of the paper's Eq. 6 on the sum: sum_i v_i + N(0, sigma^2 I) with v_i of
    :func:`release_vectors` (sensitivity 1). The ONLY function that reads training examples."""
    a = math.sqrt(1.0 - count_weight ** 2)
    total = torch.zeros(features.w.shape[0] * 2 * classes, dtype=torch.float64, device=features.w.device)
    for s in range(0, x.shape[0], chunk):
        total += embedding_sum(features, x[s:s + chunk], y[s:s + chunk], classes).double()
    total = torch.cat([a * total, torch.tensor([count_weight * x.shape[0]], dtype=torch.float64, device=total.device)])
    noise = torch.randn(total.shape, generator=generator, dtype=torch.float64, device=generator.device)
    return (total + noise_multiplier * noise.to(total.device)).float()


def mean_embedding(released: torch.Tensor, count_weight: float) -> tuple[torch.Tensor, float]:
    """Post-processing of the release: (mean embedding estimate [D * K], noisy count N~)."""
    a = math.sqrt(1.0 - count_weight ** 2)
    n_noisy = float(released[-1]) / count_weight
    return released[:-1] / (a * max(n_noisy, 1.0)), n_noisy


class ConvConditionalGenerator(nn.Module):
    """G(z, y): [z, one-hot y] -> FC h -> BN -> ReLU -> FC 16*7*7 -> BN -> ReLU -> upsample x2 ->
    conv5x5 (8) -> ReLU -> upsample x2 -> conv5x5 (C) -> tanh (inputs in [-1, 1]); the paper's
    MNIST generator shape (the batch normalisation sees generated examples only)."""

    def __init__(self, code_dim: int, classes: int, hidden: int, input_shape: tuple[int, ...]):
        super().__init__()
        c, h, w = input_shape
        if h % 4 or w % 4:
            raise ValueError(f"input_shape: height and width must be multiples of 4, got {input_shape}")
        self.code_dim, self.classes, self.input_shape = code_dim, classes, tuple(input_shape)
        self.hw = (h // 4, w // 4)
        self.fc = nn.Sequential(nn.Linear(code_dim + classes, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                                nn.Linear(hidden, 16 * self.hw[0] * self.hw[1]),
                                nn.BatchNorm1d(16 * self.hw[0] * self.hw[1]), nn.ReLU())
        self.conv1 = nn.Conv2d(16, 8, 5, padding=2)
        self.conv2 = nn.Conv2d(8, c, 5, padding=2)

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(torch.cat([z, F.one_hot(y, self.classes).to(z.dtype)], 1)).view(-1, 16, *self.hw)
        h = F.relu(self.conv1(F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=True)))
        return torch.tanh(self.conv2(F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=True)))


class DPMERFTrainer(JudgedSampler):
    """DP-MERF: the release happens in the constructor; :meth:`train` touches the released embedding only.

    The same sampling / judge interface as :class:`dpmech.dpgan.trainer.DPGANTrainer` (``sample``,
    ``classes``, ``device``, ``judge``), so :mod:`dpmech.dpgan.evaluate` scores both.
    """

    def __init__(self, config: DPMERFConfig, x_train: torch.Tensor, y_train: torch.Tensor, *,
                 device: str | torch.device = "cpu", judge_data=None, judge_epochs: int = 3,
                 eval_samples: int = 500, noise_key=None):
        self.config = config
        self.device = torch.device(device)
        v.training_images(x_train, y_train)
        self.classes = num_classes(config.dataset)
        if x_train.shape[0] and (y_train.min().item() < 0 or y_train.max().item() >= self.classes):
            raise ValueError(f"y_train must hold labels in [0, {self.classes})")
        self.input_shape = tuple(x_train.shape[1:])
        self.n = int(x_train.shape[0])
        self.noise_multiplier = calibrate_noise(config)
        self.features = RandomFourierFeatures(math.prod(self.input_shape), config.n_features, config.lengthscale,
                                              config.seed).to(self.device)
        self.noise_key = NoiseKey.resolve(noise_key)   # the release's noise (docs/threat_model.md)
        noise_gen = self.noise_key.generator("dp_merf.noise", config.seed + 2)
        self.released = release_embedding(self.features, x_train.to(self.device), y_train.to(self.device),
                                          classes=self.classes, count_weight=config.count_weight,
                                          noise_multiplier=self.noise_multiplier, generator=noise_gen)
        self.ledger = PrivacyLedger()
        self.ledger.record(1.0, self.noise_multiplier, 1)
        # Everything below is post-processing of self.released (no reference to x_train / y_train).
        self.target, self.noisy_count = mean_embedding(self.released, config.count_weight)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.generator = ConvConditionalGenerator(config.code_dim, self.classes, config.hidden,
                                                      self.input_shape).to(self.device)
        self.opt = torch.optim.Adam(self.generator.parameters(), lr=config.lr)
        self.latent_gen = torch.Generator(device="cpu").manual_seed(config.seed + 3)
        self.step = 0
        self.epoch = 0
        self.last_loss = math.nan
        self._judge_data = judge_data
        self.judge_epochs = judge_epochs
        self.eval_samples = eval_samples
        self._judge = None

    # -------------------------------------------------------------- training (post-processing)
    def loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """|| mu~ - mean_j vec(phi(G(z_j, y_j)) e_{y_j}^T) ||^2 (paper Eq. 7 with the released mu~)."""
        gen_mean = embedding_sum(self.features, images, labels, self.classes) / images.shape[0]
        return (self.target - gen_mean).pow(2).sum()

    def train_steps(self, k: int) -> float:
        """k generator steps on fresh (z, y) batches (labels uniform); returns the mean loss."""
        cfg = self.config
        self.generator.train()
        losses = []
        for _ in range(k):
            z = torch.randn(cfg.batch_size, cfg.code_dim, generator=self.latent_gen).to(self.device)
            y = torch.randint(0, self.classes, (cfg.batch_size,), generator=self.latent_gen).to(self.device)
            loss = self.loss(self.generator(z, y), y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.step += 1
            losses.append(loss.item())
        self.generator.eval()
        self.last_loss = sum(losses) / max(1, len(losses))
        return self.last_loss

    def train_epoch(self, progress=None) -> dict[str, float]:
        """``steps_per_epoch`` generator steps, then the learning rate decays by ``lr_decay``.
        ``train_loss`` is the mean matching loss (a function of the release only)."""
        loss = self.train_steps(self.config.steps_per_epoch)
        for g in self.opt.param_groups:
            g["lr"] *= self.config.lr_decay
        self.epoch += 1
        return {"train_loss": loss}

    @property
    def model(self) -> nn.Module:
        """The released model: the generator (the random features are a seeded constant)."""
        return self.generator

    # -------------------------------------------------------------- sampling and scores
    @torch.no_grad()
    def sample(self, labels: torch.Tensor, seed: int, batch_size: int = 2000) -> torch.Tensor:
        """Images G(z, y) for the given labels, z from a generator seeded by ``seed`` (eval mode)."""
        self.generator.eval()
        gen = torch.Generator(device="cpu").manual_seed(seed)
        labels = labels.to(self.device)
        out = []
        for s in range(0, labels.shape[0], batch_size):
            yb = labels[s:s + batch_size]
            z = torch.randn(yb.shape[0], self.config.code_dim, generator=gen).to(self.device)
            out.append(self.generator(z, yb))
        return torch.cat(out) if out else torch.zeros(0, *self.input_shape, device=self.device)

    # -------------------------------------------------------------- privacy
    def privacy(self) -> dict[str, float]:
        cfg = self.config
        private = cfg.private
        return {
            "epsilon": self.ledger.epsilon(cfg.delta, "rdp") if private else math.inf,
            "epsilon_pld": self.ledger.epsilon(cfg.delta, "pld") if private else math.inf,
            "delta": cfg.delta,
            "noise_multiplier": self.noise_multiplier,
            "sensitivity": 1.0,
            "noisy_count": self.noisy_count,
            "generator_steps": float(self.step),
        }

    # -------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        return copy.deepcopy({"config": self.config.to_dict(), "n": self.n, "released": self.released,
                              "generator": self.generator.state_dict(), "opt": self.opt.state_dict(),
                              "latent_gen": self.latent_gen.get_state(), "step": self.step, "epoch": self.epoch,
                              "ledger": self.ledger.state_dict()})

    def load_state_dict(self, state: dict) -> None:
        if state["config"] != self.config.to_dict() or int(state["n"]) != self.n:
            raise ValueError("checkpoint config does not match this trainer's config and data")
        self.released = state["released"].to(self.device)
        self.target, self.noisy_count = mean_embedding(self.released, self.config.count_weight)
        self.generator.load_state_dict(state["generator"])
        self.opt.load_state_dict(state["opt"])
        self.latent_gen.set_state(state["latent_gen"].cpu())
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.ledger.load_state_dict(state["ledger"])
