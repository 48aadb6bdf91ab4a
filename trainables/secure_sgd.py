"""The ``secure_sgd`` and ``secure_sgd_agm`` trainables: SecureSGD (Phan et al., IJCAI 2019) with
the heterogeneous Gaussian mechanism, and the same with the analytic Gaussian mechanism.

Use them in your own study::

    from ray import tune
    from trainables.secure_sgd import secure_sgd
    tune.Tuner(secure_sgd, param_space={"epsilon": tune.grid_search([0.5, 2.0]), "epochs": 2}).fit()

``epsilon``/``delta`` are the DP-SGD guarantee for the training examples (from the privacy
ledger); ``robustness_epsilon``/``robustness_delta``/``attack_bound`` calibrate the PixelDP noise
layer. Every key and its default: :class:`SecureSGDTrialConfig` (``dpsweep mechanisms``); the
mechanism and its metric names: docs/secure_sgd.md.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from dpmech.robustness.certification import certify
from dpmech.secure_sgd.trainer import SecureSGDTrainer
from trainables.audit_config import whitebox_canaries
from trainables.config import CommonConfig, own_network_field, planned_train_size, refuse_model
from trainables.entry import TrainableEntry
from trainables.runtime import TrainerMechanism, run_trial


class SecureSGDTrialConfig(CommonConfig):
    """SecureSGD: DP-SGD for the training data + a PixelDP noise layer calibrated by the HGM."""

    epsilon: float = Field(2.0, gt=0, allow_inf_nan=False,
                           description="target epsilon of DP-SGD over the whole run (training examples; "
                                       "noise multiplier calibrated over the planned steps, reported from the ledger)")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the training-data guarantee (add/remove one example)")
    max_grad_norm: float = Field(1.0, gt=0, allow_inf_nan=False, description="C: per-example gradient clipping bound (l2)")
    batch_size: int = Field(256, gt=0, description="expected batch size; Poisson sampling rate q = batch_size / train_size")
    epochs: int = Field(5, gt=0, description="training epochs of ceil(train_size / batch_size) steps")
    lr: float = Field(0.1, gt=0, allow_inf_nan=False, description="learning rate")
    optimizer: Literal["sgd", "adam"] = Field("sgd", description="optimizer applied to the noisy gradient")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False, description="L2 weight decay")
    clipping: Literal["ghost", "flat"] = Field("ghost", description="Opacus ghost clipping or flat per-example clipping")
    accountant: Literal["rdp", "pld"] = Field("rdp", description="accountant used to calibrate the noise (both are reported)")
    robustness_epsilon: float = Field(1.0, gt=0, allow_inf_nan=False,
                                      description="eps_r of the noise layer (PixelDP robustness, not training-data privacy)")
    robustness_delta: float = Field(0.05, gt=0, lt=0.79, description="delta_r of the noise layer (HGM needs < sqrt(2/pi))")
    attack_bound: float = Field(0.1, gt=0, allow_inf_nan=False, description="construction attack bound L (l2, [-1, 1] domain)")
    noise_after: Literal[0, 1] = Field(1, description="0: noise on the input (randomized-smoothing compatible); "
                                                      "1: after the sensitivity-bounded first convolution")
    certify_calibration: Literal["analytic", "classic"] = Field(
        "analytic", description="certified-size search: exact Gaussian calibration, or the PixelDP reference's classic formula")
    certify_exact_sensitivity: bool = Field(
        True, description="certify with the measured whitened pre-noise sensitivity (False: the construction bound)")

    protects_training_examples: ClassVar[bool] = True
    supports_whitebox_audit: ClassVar[bool] = True   # trains with the DP-SGD engine (audit: {mode: whitebox})
    has_certificate: ClassVar[bool] = True  # the PixelDP test on the noise layer
    loss_is_cross_entropy: ClassVar[bool] = True
    privacy_delta_key: ClassVar[str | None] = "delta"  # robustness_delta is a robustness parameter
    mechanism: ClassVar[str] = "hgm"
    accepts_custom_dataset: ClassVar[bool] = True
    model: None = own_network_field()

    @field_validator("model", mode="before")
    @classmethod
    def _no_model(cls, value):
        return refuse_model(value, "secure_sgd")

    def smoothing_unavailable(self) -> str | None:
        if self.noise_after != 0:
            return "randomized smoothing needs the noise on the input (set noise_after: 0)"
        return None

    @model_validator(mode="after")
    def _mechanism_rules(self):
        if self.train_size is not None and self.batch_size > self.train_size:
            raise ValueError(f"batch_size must be <= train_size ({self.train_size}): the sampling rate "
                             f"batch_size / train_size is a probability, got {self.batch_size}")
        return self


class SecureSGDAGMTrialConfig(SecureSGDTrialConfig):
    """SecureSGD-AGM: the same, with the noise layer calibrated by the analytic Gaussian mechanism."""

    robustness_delta: float = Field(0.05, gt=0, lt=1, description="delta_r of the noise layer")
    mechanism: ClassVar[str] = "agm"


def secure_sgd_config(cfg: SecureSGDTrialConfig):
    """The dpmech configuration of a trial."""
    from dpmech.secure_sgd.trainer import SecureSGDConfig

    return SecureSGDConfig(
        dataset=cfg.dataset, mechanism=type(cfg).mechanism, epsilon=cfg.epsilon, delta=cfg.delta,
        max_grad_norm=cfg.max_grad_norm, batch_size=cfg.batch_size, epochs=cfg.epochs, lr=cfg.lr,
        optimizer=cfg.optimizer, momentum=cfg.momentum, weight_decay=cfg.weight_decay, clipping=cfg.clipping,
        accountant=cfg.accountant, robustness_epsilon=cfg.robustness_epsilon, robustness_delta=cfg.robustness_delta,
        attack_bound=cfg.attack_bound, noise_after=cfg.noise_after, seed=cfg.seed)


def privacy_event(cfg: SecureSGDTrialConfig):
    """The dp-accounting event of one trial planned from its config (the DP-SGD steps; the noise
    layer adds no privacy cost for the training data: its noise is not a function of the data)."""
    from dpmech.dpsgd.trainer import plan

    return plan(secure_sgd_config(cfg).dpsgd_config(), planned_train_size(cfg)).dp_event()


PRIVACY_KEYS = ("epsilon", "delta", "batch_size", "epochs", "train_size", "dataset", "accountant")
# final metrics beyond the generic ones: the DP-SGD ledger's, and the noise layer's robustness parameters
METRICS = ("epsilon_pld", "noise_multiplier", "sampling_rate", "steps", "robustness_epsilon", "robustness_delta",
           "attack_bound", "noise_scale", "sensitivity")


class SecureSGDMechanism(TrainerMechanism):
    """Adapter from the trial config to ``dpmech.secure_sgd.trainer.SecureSGDTrainer``."""

    def __init__(self, cfg: SecureSGDTrialConfig, x, y, device, noise_key=None):
        self.trainer = SecureSGDTrainer(secure_sgd_config(cfg), x, y, device=device,
                                        plan_size=planned_train_size(cfg), canaries=whitebox_canaries(cfg),
                                        noise_key=noise_key)

    def certify(self, x, y, cfg):
        """PixelDP certification of the whitened model (scale = base sigma, whitened sensitivity)."""
        from dpmech.secure_sgd.trainer import whitened_sensitivity

        if cfg.certify_exact_sensitivity:
            sens = whitened_sensitivity(self.model)
        else:
            sens = 1.0 / float(self.model.noise.r.min()) ** 0.5
        import torch

        gen = torch.Generator(device=next(self.model.parameters()).device).manual_seed(cfg.seed)
        return certify(self.model, x, y, n=cfg.certify_n, alpha=1.0 - cfg.certify_eta, bounds=cfg.certify_bounds,
                       sensitivity=sens, calibration=cfg.certify_calibration, generator=gen)

    def smoothing_classifier(self):
        """(model without its noise layer, sigma) when the noise is isotropic on the input."""
        return self.trainer.smoothing_classifier()


def secure_sgd(config: dict, noise_key=None) -> None:
    """Ray Tune function trainable for SecureSGD with the HGM (flat config; see the module docstring)."""
    run_trial(config, SecureSGDTrialConfig, SecureSGDMechanism, "secure_sgd", noise_key=noise_key)


def secure_sgd_agm(config: dict, noise_key=None) -> None:
    """Ray Tune function trainable for SecureSGD-AGM (flat config; see the module docstring)."""
    run_trial(config, SecureSGDAGMTrialConfig, SecureSGDMechanism, "secure_sgd_agm", noise_key=noise_key)


TRAINABLES = (
    TrainableEntry(
        "secure_sgd", "trainables.secure_sgd:secure_sgd",
        SecureSGDTrialConfig,
        "SecureSGD (Phan et al., IJCAI 2019): DP-SGD (Opacus, RDP/PLD epsilon from the ledger) on a PixelDP net whose "
        "noise layer is calibrated by the heterogeneous Gaussian mechanism (Theorem 1, any eps_r); certified with "
        "the PixelDP test (docs/secure_sgd.md).",
        epsilon_protects="training examples (DP-SGD ledger); the noise layer's robustness parameters are "
                         "robustness_epsilon/robustness_delta",
        privacy_event="trainables.secure_sgd:privacy_event",
        privacy_keys=PRIVACY_KEYS,
        metrics=METRICS),
    TrainableEntry(
        "secure_sgd_agm", "trainables.secure_sgd:secure_sgd_agm",
        SecureSGDAGMTrialConfig,
        "SecureSGD-AGM: SecureSGD with the noise layer calibrated by the analytic Gaussian mechanism "
        "(Balle & Wang 2018) instead of the HGM (docs/secure_sgd.md).",
        epsilon_protects="training examples (DP-SGD ledger); the noise layer's robustness parameters are "
                         "robustness_epsilon/robustness_delta",
        privacy_event="trainables.secure_sgd:privacy_event",
        privacy_keys=PRIVACY_KEYS,
        metrics=METRICS),
)
