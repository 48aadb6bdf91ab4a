"""DPGAN hyperparameters, the sampling/step plan and the paper's Lemma 2 formula.

Xie et al. 2018 ("Differentially Private Generative Adversarial Network", arXiv:1802.06739),
Algorithm 1: a Wasserstein GAN whose critic ("discriminator") takes ``n_critic`` noisy, weight-clipped
steps per generator step. Here one *epoch* is ``ceil(N / batch_size)`` critic steps (every training
example is expected to be read once), and real batches are Poisson samples with rate
``q = batch_size / N``; the planned number of critic steps, ``epochs * ceil(N / batch_size)``, is
what the noise multiplier is calibrated for (docs/dpgan.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dp_accounting.dp_event import ComposedDpEvent

from dpmech import _validate as v
from dpmech.privacy.accounting import noise_multiplier_for, subsampled_gaussian_event

OPTIMIZERS = ("rmsprop", "adam")
FAKE_LABELS = ("uniform", "dp_histogram")
# Size of the training split of each dataset (used to plan a trial whose train_size is null).
TRAIN_SPLIT_SIZE = {"mnist": 60000, "fashion_mnist": 60000, "cifar10": 50000}


@dataclass
class DPGANConfig:
    """Hyperparameters of one DPGAN run (defaults: docs/dpgan.md, chosen on an MNIST subset)."""

    dataset: str = "mnist"
    epsilon: float | None = 3.2   # target (epsilon, delta) of the critic's Gaussian steps; None = non-private WGAN
    delta: float = 1e-5
    epochs: int = 10              # one epoch = ceil(N / batch_size) critic steps
    batch_size: int = 64          # expected real batch size m (Poisson sampling, q = m / N)
    n_critic: int = 1             # n_d: critic steps per generator step (Alg. 1 inner loop)
    clip_grad: float = 1.0        # c_g: enforced bound on each real example's critic-gradient norm
    clip_weight: float = 0.1      # c_p: critic weights clipped to [-c_p, c_p] (Alg. 1 line 9)
    clip_fake: bool = True        # clip each fake example's critic gradient to c_g too (no privacy effect)
    mode_seeking: float = 0.0     # lambda of the generator's mode-seeking term lambda / (ratio + 1e-5) (Mao et al. 2019; 0 = the paper)
    ema: float = 0.0              # decay of the generator's weight EMA used for sampling (0 = last iterate)
    lr_critic: float = 1e-3
    lr_generator: float = 1e-3
    optimizer: str = "rmsprop"    # the paper's (and WGAN's) RMSProp, or Adam
    latent_dim: int = 64
    hidden: int = 256
    architecture: str = "mlp"     # critic feature map: "mlp" (fast per-example gradients on CPUs) or "conv"
    generator: str = "mlp"        # generator: "mlp" or "dcgan" (the reference's DCGAN shape, narrowed; no privacy effect)
    fake_labels: str = "uniform"  # labels y' of the fake examples: "uniform" (Alg. 1) or "dp_histogram" (docs/dpgan.md)
    histogram_noise: float = 100.0  # std of the Gaussian noise on each class count (sensitivity 1) of "dp_histogram"
    seed: int = 0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        v.choice("dataset", self.dataset, tuple(TRAIN_SPLIT_SIZE))
        if self.epsilon is not None:
            v.positive("epsilon", self.epsilon)
        v.open_unit("delta", self.delta)
        v.positive_int("epochs", self.epochs)
        v.positive_int("batch_size", self.batch_size)
        v.positive_int("n_critic", self.n_critic)
        v.positive("clip_grad", self.clip_grad)
        v.positive("clip_weight", self.clip_weight)
        if not isinstance(self.clip_fake, bool):
            raise ValueError(f"clip_fake must be true or false, got {self.clip_fake!r}")
        v.unit_interval("ema", self.ema, high_open=True)
        v.non_negative("mode_seeking", self.mode_seeking)
        v.positive("lr_critic", self.lr_critic)
        v.positive("lr_generator", self.lr_generator)
        v.choice("optimizer", self.optimizer, OPTIMIZERS)
        v.positive_int("latent_dim", self.latent_dim)
        v.positive_int("hidden", self.hidden)
        v.choice("architecture", self.architecture, ("mlp", "conv"))
        v.choice("generator", self.generator, ("mlp", "dcgan"))
        v.choice("fake_labels", self.fake_labels, FAKE_LABELS)
        v.positive("histogram_noise", self.histogram_noise)
        v.positive_int("seed", self.seed, minimum=0)

    @property
    def private(self) -> bool:
        return self.epsilon is not None

    def to_dict(self) -> dict:
        return asdict(self)


def sampling_rate(n: int, batch_size: int) -> float:
    """Poisson sampling rate q = m / N of the real batches (1 when m >= N)."""
    v.positive_int("n", n)
    return min(1.0, batch_size / n)


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Critic steps per epoch: ceil(N / m), so each example is read once per epoch in expectation."""
    v.positive_int("n", n)
    return math.ceil(n / batch_size)


def planned_critic_steps(config: DPGANConfig, n: int) -> int:
    return config.epochs * steps_per_epoch(n, config.batch_size)


def histogram_noise_multiplier(config: DPGANConfig) -> float | None:
    """Noise multiplier of the label-histogram release (its sensitivity is 1): ``histogram_noise``
    when ``fake_labels`` is "dp_histogram" and the run is private, 0 (exact counts) for the
    non-private baseline, None when no histogram is released ("uniform")."""
    if config.fake_labels != "dp_histogram":
        return None
    return config.histogram_noise if config.private else 0.0


def histogram_event(config: DPGANConfig):
    """The dp-accounting event of the label-histogram release (one Gaussian mechanism), or None."""
    sigma = histogram_noise_multiplier(config)
    return None if sigma is None else subsampled_gaussian_event(1.0, sigma, 1)


def calibrate_noise(config: DPGANConfig, n: int) -> float:
    """The noise multiplier sigma (noise std sigma * c_g on the clipped sum) whose RDP epsilon after
    the planned critic steps at rate q -- composed after the label histogram, when one is released --
    is <= the target epsilon at delta (0 when non-private)."""
    if not config.private:
        return 0.0
    return noise_multiplier_for(config.epsilon, config.delta, sampling_rate(n, config.batch_size),
                                planned_critic_steps(config, n), before=histogram_event(config))


def planned_event(config: DPGANConfig, n: int | None = None):
    """The dp-accounting event of a trial that takes every planned critic step (N = ``n``, else the
    dataset's training split): the label histogram's Gaussian release (if any), then the
    Poisson-subsampled Gaussian critic steps, self-composed."""
    n = TRAIN_SPLIT_SIZE[config.dataset] if n is None else n
    steps = subsampled_gaussian_event(sampling_rate(n, config.batch_size), calibrate_noise(config, n),
                                      planned_critic_steps(config, n))
    hist = histogram_event(config)
    return steps if hist is None else ComposedDpEvent([hist, steps])


def paper_lemma2_epsilon(noise_multiplier: float, sampling_rate: float, critic_steps: int, delta: float) -> float:
    """Lemma 2 of Xie et al. 2018, sigma_n = (2q / eps) sqrt(n_d log(1/delta)), solved for eps:
    eps = 2 q sqrt(n_d log(1/delta)) / sigma_n, with n_d the number of critic steps taken.

    This is the paper's formula, reported for comparison only: it is Abadi et al.'s (2016)
    Theorem 1 with its unspecified constant set to 2, which that theorem proves only up to a
    constant and for eps < c_1 q^2 n_d; it is not a guarantee (docs/dpgan.md).
    """
    v.non_negative("noise_multiplier", noise_multiplier)
    v.unit_interval("sampling_rate", sampling_rate, low_open=True)
    v.open_unit("delta", delta)
    if noise_multiplier == 0:
        return math.inf
    return 2.0 * sampling_rate * math.sqrt(critic_steps * math.log(1.0 / delta)) / noise_multiplier


def paper_lemma2_sigma(epsilon: float, sampling_rate: float, critic_steps: int, delta: float) -> float:
    """Lemma 2's sigma_n for a target eps (the noise the paper would prescribe)."""
    v.positive("epsilon", epsilon)
    v.open_unit("delta", delta)
    return 2.0 * sampling_rate / epsilon * math.sqrt(critic_steps * math.log(1.0 / delta))
