"""The ``dpgan`` trainable: DPGAN (Xie et al. 2018) under Ray Tune.

Every key and its default: ``DPGANTrialConfig`` below (``dpsweep mechanisms``). The mechanism is
``dpmech.dpgan``; the decisions it takes are in docs/dpgan.md. Evaluation replaces the classifier
metrics: ``acc_clean`` is the train-on-synthetic, test-on-real accuracy ``tstr_acc``.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import torch
from pydantic import Field, model_validator

from dpmech.dpgan.config import DPGANConfig, planned_event
from dpmech.dpgan.evaluate import evaluate_samples, sample_grid
from dpmech.dpgan.trainer import DPGANTrainer
from trainables.config import CommonConfig, planned_train_size
from trainables.entry import TrainableEntry
from trainables.runtime import TrainerMechanism, run_trial

_TRAINER_KEYS = ("dataset", "epsilon", "delta", "epochs", "batch_size", "n_critic", "clip_grad", "clip_weight",
                 "clip_fake", "mode_seeking", "ema", "lr_critic", "lr_generator", "optimizer", "latent_dim", "hidden", "architecture",
                 "generator", "fake_labels", "histogram_noise", "seed")


class SampleEvaluationConfig(CommonConfig):
    """The keys of the generative mechanisms (dpgan, dp_merf): they are evaluated by their samples
    (``acc_clean`` = ``tstr_acc``, train on synthetic, test on real), never attacked or certified."""

    tstr_samples: int = Field(10000, gt=0, description="synthetic labelled images the tstr_acc classifier is trained on (SoK protocol: 60000)")
    tstr_epochs: int = Field(3, gt=0, description="epochs of the tstr_acc classifier")
    judge_size: int = Field(10000, gt=0, description="real non-training images the sample-quality classifier is trained on")
    judge_epochs: int = Field(3, gt=0, description="epochs of the sample-quality classifier")
    quality_samples: int = Field(2000, gt=0, description="synthetic images scored by sample_quality")
    eval_samples: int = Field(500, gt=0, description="synthetic images scored per epoch (test_acc)")
    certify_images: int = Field(0, ge=0, le=0, description="a generative mechanism certifies nothing (must be 0)")

    protects_training_examples: ClassVar[bool] = True
    privacy_delta_key: ClassVar[str | None] = "delta"
    mechanism_label: ClassVar[str] = "a generative mechanism"

    @model_validator(mode="after")
    def _evaluated_by_samples(self):
        if self.attacks:
            raise ValueError(f"attacks: {self.mechanism_label} is evaluated by its samples (tstr_acc), not under attack; "
                             f"leave attacks empty")
        return self


class DPGANTrialConfig(SampleEvaluationConfig):
    """DPGAN (docs/dpgan.md): a conditional WGAN whose critic takes clipped, noisy steps on real data."""

    epsilon: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        3.2, description="target epsilon of the critic's noisy steps (RDP, at delta); null = non-private WGAN")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the guarantee")
    epochs: int = Field(30, gt=0, description="epochs; one epoch = ceil(N / batch_size) critic steps")
    batch_size: int = Field(64, gt=0, description="expected real batch size m (Poisson sampling at q = m / N)")
    n_critic: int = Field(1, gt=0, description="n_d: critic steps per generator step")
    clip_grad: float = Field(1.0, gt=0, allow_inf_nan=False, description="c_g: per-example critic-gradient norm bound (enforced by clipping)")
    clip_weight: float = Field(0.1, gt=0, allow_inf_nan=False, description="c_p: critic weights clipped to [-c_p, c_p]")
    clip_fake: bool = Field(True, description="clip each fake example's critic gradient to c_g too, so real and fake terms "
                            "enter on one scale (no privacy effect; docs/dpgan.md 'Why it did not learn')")
    mode_seeking: float = Field(0.0, ge=0, allow_inf_nan=False, description="weight of the generator's mode-seeking "
                                "term (Mao et al. 2019; 0 = the paper's generator loss; no privacy effect)")
    ema: float = Field(0.0, ge=0, lt=1, description="decay of the generator's weight EMA used for sampling "
                       "(0 = the last iterate; post-processing, no privacy effect)")
    lr_critic: float = Field(1e-3, gt=0, allow_inf_nan=False, description="critic learning rate")
    lr_generator: float = Field(1e-3, gt=0, allow_inf_nan=False, description="generator learning rate")
    optimizer: Literal["rmsprop", "adam"] = Field("rmsprop", description="optimizer of both networks (the paper: RMSProp)")
    latent_dim: int = Field(64, gt=0, description="dimension of the generator's latent z")
    hidden: int = Field(256, gt=0, description="width h of the MLPs (critic 2h-h, generator h-2h)")
    architecture: Literal["mlp", "conv"] = Field("mlp", description="critic feature map: mlp (fast per-example gradients on CPUs) or conv (the reference's DCGAN critic, narrowed, no normalisation)")
    generator: Literal["mlp", "dcgan"] = Field("mlp", description="generator: mlp (h-2h) or dcgan (the reference's DCGAN shape, narrowed to h/4 and h/8 channels, GroupNorm; no privacy effect)")
    fake_labels: Literal["uniform", "dp_histogram"] = Field(
        "uniform", description="labels of the fake examples: uniform (the paper's Alg. 1) or dp_histogram: drawn from "
        "the class frequencies released once by the Gaussian mechanism, counted in epsilon (docs/dpgan.md 'Why class 5 fails')")
    histogram_noise: float = Field(100.0, gt=0, allow_inf_nan=False, description="std of the Gaussian noise on each "
                                   "class count (sensitivity 1) of fake_labels: dp_histogram")
    mechanism_label: ClassVar[str] = "DPGAN"
    supports_whitebox_audit: ClassVar[bool] = True   # the critic's private step (audit: {mode: whitebox}; docs/audit.md)


def dpgan_config(cfg: DPGANTrialConfig) -> DPGANConfig:
    return DPGANConfig(**{k: getattr(cfg, k) for k in _TRAINER_KEYS})


def privacy_event(cfg: DPGANTrialConfig):
    """The trial's planned dp-accounting event (the label histogram's Gaussian release when
    ``fake_labels`` is dp_histogram, then the Poisson-subsampled Gaussian critic steps): exactly
    what the trainer's ledger records when the trial runs to the end, audit canaries or not."""
    return planned_event(dpgan_config(cfg), planned_train_size(cfg))


def judge_data(cfg: DPGANTrialConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Up to ``judge_size`` real examples in neither the training nor the evaluation subset (None
    when the two subsets use everything: then the judge trains on the evaluation set)."""
    from dpmech.datasets.splits import load_held_out, subset_indices

    try:
        pool = load_held_out(cfg.dataset, train_size=cfg.train_size, test_size=cfg.test_size, seed=cfg.data_seed)
    except ValueError:
        return None
    x, y = pool.tensors
    k = min(cfg.judge_size, x.shape[0])
    idx = torch.from_numpy(subset_indices(x.shape[0], k, cfg.seed))
    return x[idx], y[idx]


class GenerativeMechanism(TrainerMechanism):
    """The evaluation shared by the generative mechanisms (dpgan, dp_merf): ``acc_clean`` is the
    train-on-synthetic, test-on-real accuracy of their samples; a grid of samples is an artifact."""

    cfg: CommonConfig

    def conventional_accuracy(self, x, y, cfg: CommonConfig) -> dict[str, float]:
        """tstr_acc (= acc_clean), sample_quality, sample_confidence, classifier_score, judge_acc."""
        return evaluate_samples(self.trainer, x, y, tstr_samples=cfg.tstr_samples, tstr_epochs=cfg.tstr_epochs,
                                quality_samples=cfg.quality_samples, seed=cfg.seed)

    def extra_artifacts(self, directory):
        """``samples/samples.png``: 10 generated images per class, one row per class."""
        path = sample_grid(self.trainer, directory / "samples.png", per_class=10, seed=self.cfg.seed)
        return [(path, "samples")]


class DPGANMechanism(GenerativeMechanism):
    """Adapter from the trial config to ``dpmech.dpgan.trainer.DPGANTrainer``."""

    def __init__(self, cfg: DPGANTrialConfig, x: torch.Tensor, y: torch.Tensor, device: torch.device, noise_key=None):
        from trainables.audit_config import whitebox_canaries

        self.cfg = cfg
        self.trainer = DPGANTrainer(dpgan_config(cfg), x, y, device=device, judge_data=judge_data(cfg),
                                    judge_epochs=cfg.judge_epochs, eval_samples=cfg.eval_samples,
                                    plan_size=planned_train_size(cfg), canaries=whitebox_canaries(cfg),
                                    noise_key=noise_key)

    def membership_scores(self, x: torch.Tensor, y: torch.Tensor):
        """The critic's score f_w(x, y): high where the critic takes (x, y) for real data."""
        return self.trainer.critic_scores(x, y).numpy()


def dpgan(config: dict, noise_key=None) -> None:
    """Ray Tune function trainable for DPGAN (flat config; see the module docstring)."""
    run_trial(config, DPGANTrialConfig, DPGANMechanism, "dpgan", noise_key=noise_key)


TRAINABLES = (
    TrainableEntry(
        "dpgan", "trainables.dpgan:dpgan", DPGANTrialConfig,
        "DPGAN (Xie et al. 2018): conditional WGAN, critic steps on Poisson-sampled real data with per-example "
        "clipping at c_g, Gaussian noise and weight clipping; RDP/PLD epsilon from the ledger; evaluated by "
        "train-on-synthetic accuracy (docs/dpgan.md).",
        epsilon_protects="training examples (RDP/PLD ledger of the critic's steps)",
        privacy_event="trainables.dpgan:privacy_event",
        privacy_keys=("epsilon", "delta", "epochs", "batch_size", "train_size", "dataset", "fake_labels",
                      "histogram_noise"),
        metrics=("tstr_acc", "sample_quality", "sample_confidence", "classifier_score", "judge_acc", "epsilon_pld",
                 "epsilon_paper_lemma2", "noise_multiplier", "sampling_rate", "critic_steps", "generator_steps")),
)
