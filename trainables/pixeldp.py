"""The ``pixeldp`` trainable: PixelDP training and certification under Ray Tune.

Use it in your own study::

    from ray import tune
    from trainables.pixeldp import pixeldp
    tune.Tuner(pixeldp, param_space={"epsilon": tune.grid_search([0.5, 1.0]), "epochs": 2}).fit()

Every key and its default: ``trainables.config.PixelDPTrialConfig`` (``dpsweep mechanisms``).
"""

from __future__ import annotations

import torch

from dpmech.robustness.certification import certify
from dpmech.pixeldp.trainer import PixelDPConfig, PixelDPTrainer
from trainables.config import PixelDPTrialConfig
from trainables.runtime import TrainerMechanism, run_trial

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


def pixeldp(config: dict) -> None:
    """Ray Tune function trainable for PixelDP (flat config; see the module docstring)."""
    run_trial(config, PixelDPTrialConfig, PixelDPMechanism, "pixeldp")
