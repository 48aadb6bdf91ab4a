"""The ``lipschitz_dp`` trainable: a Lipschitz network trained by clipless DP-SGD (Bethune et al., ICLR 2024;
``dpmech.lipschitz``) and certified deterministically, under Ray Tune.

The certificate is deterministic (the Lipschitz margin: radius = margin / (sqrt(2) L), no Monte-Carlo, no
abstention): ``cert_acc_<size>`` at ``certify_sizes`` in the project's [-1, 1] domain (by default 1, 2, 3, 4:
0.5 / 1.0 / 1.5 / 2.0 in [0, 1] pixels), and ``det_cert_acc_01_<r>`` at ``cert_radii_01`` in the literature's
[0, 1] domain, beside ``lipschitz_bound`` (the L used). Every key and its default: :class:`LipschitzDPTrialConfig`
(``dpsweep mechanisms lipschitz_dp``); the mechanism: docs/lipschitz.md.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from trainables.config import CommonConfig, planned_train_size
from trainables.entry import TrainableEntry
from trainables.runtime import TrainerMechanism, run_trial


class LipschitzDPTrialConfig(CommonConfig):
    """Clipless DP-SGD on a 1-Lipschitz CNN; the deterministic Lipschitz-margin certificate."""

    protects_training_examples: ClassVar[bool] = True
    loss_is_cross_entropy: ClassVar[bool] = False      # tau-scaled cross-entropy: ln K is not its chance level
    privacy_delta_key: ClassVar[str | None] = "delta"
    has_certificate: ClassVar[bool] = True               # the deterministic Lipschitz certificate

    epsilon: float | None = Field(3.0, gt=0, allow_inf_nan=False,
                                  description="target epsilon of the run (noise calibrated by RDP over the planned steps); "
                                              "null = the same network and loss without noise")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the guarantee (add/remove one training example)")
    batch_size: int = Field(512, gt=0, description="expected batch size; Poisson sampling rate q = batch_size / train_size")
    epochs: int = Field(20, gt=0, description="training epochs of ceil(train_size / batch_size) steps")
    lr: float = Field(2e-3, gt=0, allow_inf_nan=False, description="learning rate")
    optimizer: Literal["adam", "sgd"] = Field("adam", description="optimizer applied to the noisy gradient")
    tau: float = Field(16.0, gt=0, allow_inf_nan=False,
                       description="temperature of the loss CE(tau z, y) / tau (sqrt(2)-Lipschitz in the logits for "
                                   "every tau): smaller pushes margins (radii), larger fits the labels")
    input_radius: float = Field(10.0, gt=0, allow_inf_nan=False,
                                description="R: every input, minus input_center, is projected onto the l2 ball of "
                                            "radius R ([-1, 1] domain); the per-example gradient bounds scale with R")
    input_center: float = Field(-1.0, allow_inf_nan=False,
                                description="public constant subtracted from every input before the projection "
                                            "(-1: MNIST's background becomes 0)")
    width: int = Field(16, ge=2, description="channels of the first convolution (the second has 2 width); even")
    hidden: int = Field(256, ge=2, description="units of the hidden dense layer; even")
    noise_allocation: Literal["per_layer", "global"] = Field(
        "per_layer", description="per_layer: each layer's noise proportional to its own gradient bound (lip-dp's "
                                 "per-layer strategy); global: one noise scale from the whole bound; the same epsilon")
    check_bound_every: int = Field(0, ge=0, description="every k-th step, compute per-example gradients and refuse "
                                                        "the run if one exceeds its bound (0 = never; slow)")
    accountant: Literal["rdp", "pld"] = Field("rdp", description="accountant used to calibrate the noise (both reported)")
    certify_sizes: list[float] = Field(
        default_factory=lambda: [1.0, 2.0, 3.0, 4.0],
        description="l2 radii in the [-1, 1] domain reported as cert_acc_<size> (the deterministic certificate; "
                    "1, 2, 3, 4 = 0.5, 1.0, 1.5, 2.0 in [0, 1] pixels)")
    cert_radii_01: list[float] = Field(
        default_factory=lambda: [0.5, 1.0, 1.5, 2.0],
        description="l2 radii in the [0, 1] domain reported as det_cert_acc_01_<r> (the same certificate)")

    @model_validator(mode="after")
    def _rules(self):
        if self.dataset != "mnist":
            raise ValueError(f"dataset: lipschitz_dp's network is the 28 x 28 MNIST CNN, got {self.dataset!r}")
        if self.width % 2 or self.hidden % 2:
            raise ValueError("width and hidden must be even (GroupSort pairs channels)")
        if self.train_size is not None and self.batch_size > self.train_size:
            raise ValueError(f"batch_size must be <= train_size ({self.train_size}), got {self.batch_size}")
        if self.certifier != "default":
            raise ValueError("certifier: lipschitz_dp's certificate is deterministic (no Gaussian noise on the input "
                             "to smooth); use 'default'")
        if any(r < 0 for r in self.cert_radii_01):
            raise ValueError("cert_radii_01: radii must be >= 0")
        return self


def trainer_config(cfg: LipschitzDPTrialConfig):
    from dpmech.lipschitz.trainer import LipschitzDPConfig

    return LipschitzDPConfig(epsilon=cfg.epsilon, delta=cfg.delta, batch_size=cfg.batch_size, epochs=cfg.epochs,
                             lr=cfg.lr, optimizer=cfg.optimizer, tau=cfg.tau, noise_allocation=cfg.noise_allocation,
                             check_bound_every=cfg.check_bound_every, accountant=cfg.accountant, seed=cfg.seed)


def privacy_event(cfg: LipschitzDPTrialConfig):
    """The dp-accounting event planned from the config: what the trainer records when it runs to the end."""
    from dpmech.lipschitz.trainer import plan

    return plan(trainer_config(cfg), planned_train_size(cfg)).dp_event()


PRIVACY_KEYS = ("epsilon", "delta", "batch_size", "epochs", "train_size", "dataset", "accountant")


class LipschitzDPMechanism(TrainerMechanism):
    """Adapter from the trial config to ``dpmech.lipschitz.trainer.LipschitzDPTrainer``."""

    def __init__(self, cfg: LipschitzDPTrialConfig, x, y, device, noise_key=None):
        from dpmech.lipschitz.network import mnist_lipschitz_cnn
        from dpmech.lipschitz.trainer import LipschitzDPTrainer

        model = mnist_lipschitz_cnn(cfg.seed, input_radius=cfg.input_radius, input_center=cfg.input_center,
                                    width=cfg.width, hidden=cfg.hidden)
        self.trainer = LipschitzDPTrainer(model, x, y, trainer_config(cfg), device=device,
                                          plan_size=planned_train_size(cfg), noise_key=noise_key)

    def certify(self, x, y, cfg: LipschitzDPTrialConfig):
        """The deterministic certificate as a CertificationResult: certified_size = the l2 radius in the
        [-1, 1] domain (0 for a tie), lower/upper = the top two logits, n = 0 (no Monte-Carlo), alpha = 0."""
        from dpmech.lipschitz.certify import certify
        from dpmech.robustness.certification import CertificationResult

        cert = certify(self.trainer.model, x, y)
        return CertificationResult(
            index=np.arange(len(cert.label)), label=cert.label, prediction=cert.prediction, lower=cert.margin,
            upper=np.zeros_like(cert.margin), certified_size=cert.radius_pm1, noise_scale=0.0,
            sensitivity=float(cert.lipschitz), norm="l2", n=0, alpha=0.0, bounds="lipschitz_margin")

    def conventional_accuracy(self, x, y, cfg: LipschitzDPTrialConfig) -> dict[str, float]:
        """The generic conventional metrics, plus the deterministic certificate in the [0, 1] domain
        (``det_cert_acc_01_<r>`` on the first ``certify_images`` images) and ``lipschitz_bound``."""
        from dpmech.lipschitz.certify import certify
        from dpmech.robustness.evaluation import conventional_accuracy, format_size

        out = conventional_accuracy(
            self.trainer.model, x, y, attacks=cfg.attacks, norm=cfg.attack_norm, n_predict=cfg.n_predict,
            eot_samples=cfg.eot_samples, steps=cfg.attack_steps, seed=cfg.seed, attack_labels=cfg.attack_labels)
        out["lipschitz_bound"] = float(self.trainer.model.lipschitz_bound())
        k = min(cfg.certify_images, x.shape[0])
        if k:
            cert = certify(self.trainer.model, x[:k], y[:k])
            for r, acc in cert.certified_accuracy_01(cfg.cert_radii_01).items():
                out[f"det_cert_acc_01_{format_size(r)}"] = acc
        return out


def final_metrics(config: dict, metrics: set[str]) -> set[str]:
    """The [0, 1]-domain certified accuracies depend on ``cert_radii_01``."""
    from dpmech.robustness.evaluation import format_size

    radii = config.get("cert_radii_01", [0.5, 1.0, 1.5, 2.0])
    return set(metrics) | {f"det_cert_acc_01_{format_size(r)}" for r in radii}


def lipschitz_dp(config: dict, noise_key=None) -> None:
    """Ray Tune function trainable (a flat config dict; see ``LipschitzDPTrialConfig``)."""
    run_trial(config, LipschitzDPTrialConfig, LipschitzDPMechanism, "lipschitz_dp", noise_key=noise_key)


TRAINABLES = (
    TrainableEntry(
        "lipschitz_dp", "trainables.lipschitz_dp:lipschitz_dp", LipschitzDPTrialConfig,
        "Clipless DP-SGD on a 1-Lipschitz CNN (Bethune et al., ICLR 2024): per-layer gradient bounds from the "
        "Lipschitz constants replace clipping; Poisson sampling, Gaussian noise calibrated to (epsilon, delta), "
        "RDP/PLD ledger; deterministic certificate (Lipschitz margin / (sqrt(2) L), no Monte-Carlo, no abstention; "
        "docs/lipschitz.md).",
        privacy_event="trainables.lipschitz_dp:privacy_event",
        privacy_keys=PRIVACY_KEYS,
        epsilon_protects="training examples (RDP/PLD ledger)",
        metrics=("epsilon_pld", "noise_multiplier", "sampling_rate", "steps", "lipschitz_bound"),
        final_metrics="trainables.lipschitz_dp:final_metrics"),
)
