"""The ``pixeldp`` trainable: PixelDP training and certification under Ray Tune.

Use it in your own study::

    from ray import tune
    from trainables.pixeldp import pixeldp
    tune.Tuner(pixeldp, param_space={"epsilon": tune.grid_search([0.5, 1.0]), "epochs": 2}).fit()

Every key and its default: ``PixelDPTrialConfig`` below (``dpsweep mechanisms``).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field, field_validator

from dpmech.pixeldp.trainer import PixelDPConfig, PixelDPTrainer
from dpmech.robustness.certification import certify
from trainables.config import CommonConfig, own_network_field, refuse_model
from trainables.entry import TrainableEntry
from trainables.runtime import TrainerMechanism, run_trial


class PixelDPTrialConfig(CommonConfig):
    """PixelDP (Lecuyer et al. 2018): a noise layer calibrated to (epsilon, delta, L)."""

    accepts_custom_dataset: ClassVar[bool] = True
    model: None = own_network_field()

    @field_validator("model", mode="before")
    @classmethod
    def _no_model(cls, value):
        return refuse_model(value, "pixeldp")

    # epsilon/delta are robustness parameters of the noise layer, not a training-data guarantee:
    # privacy_delta_key stays None, the delta rules do not apply
    has_certificate: ClassVar[bool] = True
    loss_is_cross_entropy: ClassVar[bool] = True

    epsilon: float = Field(1.0, gt=0, allow_inf_nan=False, description="PixelDP epsilon of the noise layer")
    delta: float = Field(0.05, gt=0, lt=1, description="PixelDP delta (l2 / Gaussian only)")
    attack_bound: float = Field(0.1, gt=0, allow_inf_nan=False, description="construction attack bound L ([-1, 1] domain)")
    norm: Literal["l2", "l1"] = Field("l2", description="l2: Gaussian noise; l1: Laplace noise")
    noise_after: Literal[0, 1] = Field(1, description="0: noise on the input; 1: after the first convolution")
    epochs: int = Field(5, gt=0, description="training epochs")
    batch_size: int = Field(128, gt=0, description="minibatch size")
    lr: float = Field(1e-3, gt=0, allow_inf_nan=False, description="learning rate")
    optimizer: Literal["adam", "sgd"] = Field("adam", description="optimizer")
    weight_decay: float = Field(0.0, ge=0, description="L2 weight decay")
    noise_ramp_epochs: float = Field(0.0, ge=0, description="linear ramp of the noise from 0 to full over this many epochs")
    certify_calibration: Literal["analytic", "classic"] = Field(
        "analytic", description="certified-size search: exact Gaussian calibration, or the reference's classic formula with eps' <= 1")
    certify_exact_sensitivity: bool = Field(
        True, description="correct the certified size with the measured pre-noise sensitivity (False: the construction bound 1, as the paper)")

    def smoothing_unavailable(self) -> str | None:
        if self.noise_after != 0 or self.norm != "l2":
            return "randomized smoothing needs Gaussian noise on the input (set noise_after: 0 and norm: l2)"
        return None


_TRAINER_KEYS = ("dataset", "epsilon", "delta", "attack_bound", "norm", "noise_after", "epochs",
                 "batch_size", "lr", "optimizer", "weight_decay", "noise_ramp_epochs", "seed")


class _WithoutNoise(torch.nn.Module):
    """A PixelDP network with its noise on the input (``noise_after == 0``) minus that noise: the
    network's forward pass is ``post_noise(x + Z)`` with Z ~ N(0, scale^2 I), so this base
    classifier plus Gaussian input noise of std ``scale`` is exactly the PixelDP model's random
    forward pass (docs/smoothing.md). Parameters are shared with the PixelDP network."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.post_noise(self.net.pre_noise(x))


class PixelDPMechanism(TrainerMechanism):
    """Adapter from the trial config to ``dpmech.pixeldp.trainer.PixelDPTrainer``."""

    def __init__(self, cfg: PixelDPTrialConfig, x: torch.Tensor, y: torch.Tensor, device: torch.device):
        self.trainer = PixelDPTrainer(PixelDPConfig(**{k: getattr(cfg, k) for k in _TRAINER_KEYS}), x, y,
                                      device=device)

    def privacy(self):
        """PixelDP's robustness parameters under their own names (docs/metrics.md): its epsilon is
        a robustness parameter of the noise layer, not a guarantee about the training data, so
        the trial logs no ``epsilon``/``delta``. ``robustness_epsilon`` is recomputed from the
        noise actually drawn and the measured sensitivity (<= the configured value, which is
        ``robustness_epsilon_config``, the config key ``epsilon``)."""
        g = self.trainer.guarantee()
        return {"robustness_epsilon": g["epsilon"], "robustness_epsilon_config": float(self.trainer.config.epsilon),
                "robustness_delta": g["delta"], "attack_bound": g["attack_bound"],
                "noise_scale": g["noise_scale"], "sensitivity": g["sensitivity"]}

    def certify(self, x, y, cfg):
        sensitivity = None if cfg.certify_exact_sensitivity else self.model.sensitivity_bound()
        # the certification noise comes from a generator seeded by the trial seed (never the layer's own)
        gen = torch.Generator(device=next(self.model.parameters()).device).manual_seed(cfg.seed)
        return certify(self.model, x, y, n=cfg.certify_n, alpha=1.0 - cfg.certify_eta, bounds=cfg.certify_bounds,
                       sensitivity=sensitivity, calibration=cfg.certify_calibration, generator=gen)

    def smoothing_classifier(self):
        """(base, sigma) for randomized smoothing when the noise is Gaussian and on the input
        (``noise_after == 0``, ``norm == "l2"``); None otherwise (the noise then sits after the
        first convolution, or is Laplace, and smoothing's l2 certificate does not apply)."""
        m = self.model
        if m.noise_after != 0 or m.norm != "l2" or not m.has_noise:
            return None
        return _WithoutNoise(m), float(m.noise.scale)


def pixeldp(config: dict, noise_key=None) -> None:
    """Ray Tune function trainable for PixelDP (flat config; see the module docstring)."""
    run_trial(config, PixelDPTrialConfig, PixelDPMechanism, "pixeldp", noise_key=noise_key)


TRAINABLES = (
    TrainableEntry(
        "pixeldp", "trainables.pixeldp:pixeldp", PixelDPTrialConfig,
        "PixelDP (Lecuyer et al. 2018): noise layer after a sensitivity-bounded first layer; "
        "certified with the PixelDP robustness test.",
        epsilon_protects="nothing: no epsilon metric; the config's epsilon is a robustness parameter of the noise "
                         "layer, logged as robustness_epsilon_config (configured) and robustness_epsilon "
                         "(recomputed from the noise)",
        privacy_epsilon=False,
        metrics=("robustness_epsilon", "robustness_epsilon_config", "robustness_delta", "attack_bound", "noise_scale",
                 "sensitivity")),
)
