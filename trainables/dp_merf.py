"""The ``dp_merf`` trainable: DP-MERF (Harder et al. 2021) under Ray Tune.

Every key and its default: ``DPMERFTrialConfig`` below (``dpsweep mechanisms``). The mechanism is
``dpmech.dp_merf.trainer``; its decisions are in docs/dp_merf.md. The training data is read once, when the
trial is built (the noisy mean embedding); the epochs train the generator on that release only.
Evaluation as for ``dpgan``: ``acc_clean`` is the train-on-synthetic, test-on-real accuracy ``tstr_acc``.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import torch
from pydantic import Field, model_validator

from dpmech.dp_merf.trainer import PAPER_LENGTHSCALE, DPMERFConfig, DPMERFTrainer, planned_event
from trainables.dpgan import GenerativeMechanism, SampleEvaluationConfig, judge_data
from trainables.entry import TrainableEntry
from trainables.runtime import run_trial

_TRAINER_KEYS = ("dataset", "epsilon", "delta", "n_features", "lengthscale", "count_weight", "epochs",
                 "steps_per_epoch", "batch_size", "lr", "lr_decay", "code_dim", "hidden", "seed")
PRIVACY_KEYS = ("epsilon", "delta", "dataset")


class DPMERFTrialConfig(SampleEvaluationConfig):
    """DP-MERF (docs/dp_merf.md): one noisy mean embedding of random Fourier features, a generator matched to it."""

    epsilon: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        1.0, description="target epsilon of the single Gaussian release (RDP, at delta); null = non-private")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the guarantee")
    n_features: int = Field(10000, ge=2, description="D: random Fourier features (even: cos and sin of D/2 frequencies)")
    lengthscale: float = Field(PAPER_LENGTHSCALE, gt=0, allow_inf_nan=False,
                               description="Gaussian kernel length scale in [-1, 1] pixel units (paper: 2 sqrt(105))")
    count_weight: float = Field(0.1, gt=0, lt=1, description="b: weight of the noisy-count coordinate of the release")
    epochs: int = Field(5, gt=0, description="generator epochs (no privacy cost)")
    steps_per_epoch: int = Field(120, gt=0, description="generator steps per epoch")
    batch_size: int = Field(500, gt=0, description="generated examples per generator step")
    lr: float = Field(0.01, gt=0, allow_inf_nan=False, description="Adam learning rate of the generator")
    lr_decay: float = Field(0.9, gt=0, le=1, description="learning-rate factor after every epoch")
    code_dim: int = Field(5, gt=0, description="dimension of the generator's latent z")
    hidden: int = Field(200, gt=0, description="the generator's fully connected width")
    mechanism_label: ClassVar[str] = "DP-MERF"
    # train_loss is the generator's matching loss against the released embedding: post-processing of
    # the release, not a non-private diagnostic (trainables.diagnostics)
    private_epoch_metrics: ClassVar[tuple[str, ...]] = ("train_loss",)

    @model_validator(mode="after")
    def _dp_merf_rules(self):
        if self.n_features % 2:
            raise ValueError(f"n_features: must be even (cos and sin of each frequency), got {self.n_features}")
        return self


def dp_merf_config(cfg: DPMERFTrialConfig) -> DPMERFConfig:
    return DPMERFConfig(**{k: getattr(cfg, k) for k in _TRAINER_KEYS})


def privacy_event(cfg: DPMERFTrialConfig):
    """The trial's dp-accounting event: one Gaussian release of sensitivity 1."""
    return planned_event(dp_merf_config(cfg))


class DPMERFMechanism(GenerativeMechanism):
    """Adapter from the trial config to ``dpmech.dp_merf.trainer.DPMERFTrainer``."""

    def __init__(self, cfg: DPMERFTrialConfig, x: torch.Tensor, y: torch.Tensor, device: torch.device, noise_key=None):
        self.cfg = cfg
        self.trainer = DPMERFTrainer(dp_merf_config(cfg), x, y, device=device, judge_data=judge_data(cfg),
                                     judge_epochs=cfg.judge_epochs, eval_samples=cfg.eval_samples,
                                     noise_key=noise_key)

    def membership_scores(self, x: torch.Tensor, y: torch.Tensor):
        """Similarity of each (x, y) to the released mean embedding (<phi(x) e_y^T, mu~>): the
        natural membership score of a mean-embedding release (privacy audit)."""
        from dpmech.dp_merf.trainer import embedding_sum

        tr = self.trainer
        with torch.no_grad():
            out = [float(embedding_sum(tr.features, x[i:i + 1].to(tr.device), y[i:i + 1].to(tr.device), tr.classes)
                         @ tr.target) for i in range(x.shape[0])]
        return torch.tensor(out).numpy()


def dp_merf(config: dict, noise_key=None) -> None:
    """Ray Tune function trainable for DP-MERF (flat config; see the module docstring)."""
    run_trial(config, DPMERFTrialConfig, DPMERFMechanism, "dp_merf", noise_key=noise_key)


TRAINABLES = (
    TrainableEntry(
        "dp_merf", "trainables.dp_merf:dp_merf", DPMERFTrialConfig,
        "DP-MERF (Harder et al. 2021): one Gaussian release of the random-Fourier-feature mean embedding of (image, "
        "label) pairs (sensitivity 1 with a noisy-count coordinate), a conditional generator matched to it with no "
        "further data access; evaluated by train-on-synthetic accuracy (docs/dp_merf.md).",
        epsilon_protects="training examples (one Gaussian release, RDP/PLD)",
        privacy_event="trainables.dp_merf:privacy_event",
        privacy_keys=PRIVACY_KEYS,
        metrics=("tstr_acc", "sample_quality", "sample_confidence", "classifier_score", "judge_acc", "epsilon_pld",
                 "noise_multiplier", "sensitivity", "noisy_count", "generator_steps")),
)
