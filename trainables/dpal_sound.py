"""The ``dpal_sound`` trainable: a sound DPAL (dpmech.dpal_sound.trainer) under Ray Tune.

DP-SGD (Poisson sampling, per-example clipping, RDP/PLD ledger) on DPAL's adversarial objective,
the benign and the adversarial pass of each example clipped together; Gaussian input noise
``smoothing_sigma`` at training and at inference; certified by randomized smoothing; attacked
white-box (EOT) on the noisy classifier with true labels. The whole epsilon is DP-SGD's.

    from ray import tune
    from trainables.dpal_sound import dpal_sound
    tune.Tuner(dpal_sound, param_space={"epsilon": tune.grid_search([1.0, 2.0]), "epochs": 8}).fit()

Every key and its default: :class:`DPALSoundTrialConfig`; the mechanism and its metrics:
docs/dpal_sound.md, docs/metrics.md.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field, field_validator, model_validator

from dpmech.dpal_sound.trainer import DPALSoundTrainer, NoisyClassifier, evaluate
from dpmech.dpsgd.trainer import build_dpsgd_model, stream_seed
from trainables.audit_config import whitebox_canaries
from trainables.config import CommonConfig, planned_train_size
from trainables.entry import TrainableEntry
from trainables.runtime import TrainerMechanism, run_trial

METRICS = ("acc_clean_smoothed", "abstain_rate_smoothed", "cert_abstain_rate", "epsilon_pld", "noise_multiplier",
           "sampling_rate", "steps")


class DPALSoundTrialConfig(CommonConfig):
    """dpal_sound: DP-SGD on DPAL's adversarial objective under smoothing noise (docs/dpal_sound.md)."""

    epsilon: float | None = Field(
        2.0, gt=0, allow_inf_nan=False,
        description="target epsilon of the whole run (all of it goes to DP-SGD: noise calibrated by RDP over the "
                    "planned steps); null = non-private adversarial training with the same attacks and noise")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the guarantee (add/remove one training example)")
    max_grad_norm: float = Field(0.1, gt=0, allow_inf_nan=False,
                                 description="C: clipping bound of each example's gradient (benign + adversarial pass together)")
    batch_size: int = Field(512, gt=0, description="expected batch size; Poisson sampling rate q = batch_size / train_size")
    epochs: int = Field(8, gt=0, description="training epochs of ceil(train_size / batch_size) steps")
    lr: float = Field(0.5, gt=0, allow_inf_nan=False, description="learning rate")
    lr_schedule: Literal["constant", "cosine", "step"] = Field("constant", description="learning-rate schedule (as dpsgd)")
    model: Literal["tb_cnn_gn", "tb_cnn", "pixeldp_cnn"] | str = Field(
        "tb_cnn_gn", description="network (dpmech.networks.dpsgd_models); tb_cnn_gn = Tramer & Boneh's tanh CNN with GroupNorm; or "
                                 "your factory's import path 'package.module:factory' (docs/own_model.md; its layers "
                                 "must be ones book-keeping clipping handles)")
    optimizer: Literal["sgd", "adam"] = Field("sgd", description="optimizer applied to the noisy gradient")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False, description="L2 weight decay")
    accountant: Literal["rdp", "pld"] = Field("rdp", description="accountant used to calibrate the noise (both reported)")
    smoothing_sigma: float = Field(0.5, gt=0, allow_inf_nan=False,
                                   description="sigma_s: std of the Gaussian input noise at training and inference "
                                               "([-1, 1] domain); the randomized-smoothing sigma of the certificate")
    xi: float = Field(1.0, ge=0, allow_inf_nan=False, description="weight of the adversarial term (DPAL Eq. 10)")
    mu_max: float = Field(0.3, ge=0, allow_inf_nan=False,
                          description="training attack sizes mu_i ~ U(0, mu_max), l-inf, [-1, 1] domain")
    train_attacks: list[Literal["fgsm", "ifgsm", "mim", "pgd"]] = Field(
        default_factory=lambda: ["fgsm", "pgd"], min_length=1,
        description="DPAL's ensemble: each training example draws one of these attacks uniformly")
    train_attack_steps: int = Field(3, gt=0, description="iterations of the iterative training attacks (fgsm: 1)")
    # evaluation defaults of this mechanism
    attacks: dict[str, list[float]] = Field(
        default_factory=lambda: {"pgd": [0.1, 0.2]},
        description="attack name -> l-inf sizes ([-1, 1] domain): white-box EOT attacks on the noisy classifier, "
                    "then its smoothed prediction")
    attack_norm: Literal["linf"] = Field("linf", description="dpal_sound is attacked in l-inf")
    attack_labels: Literal["true"] = Field("true", description="white-box attacks maximise the loss of the true labels")
    eot_samples: int = Field(8, gt=0, description="noise draws averaged per attack gradient (EOT)")
    attack_images: int = Field(500, gt=0, description="test images attacked (the first ones)")
    n_predict: int = Field(100, gt=0, description="n of the smoothed classifier's PREDICT (Cohen et al.)")
    certify_n: int = Field(1000, gt=0, description="n of CERTIFY (estimation draws); smoothing_n0 selects")
    cert_l2_radii: list[float] = Field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0],
                                       description="l2 radii reported as cert_l2_acc_<r> ([-1, 1] units)")
    cert_linf_sizes: list[float] = Field(default_factory=lambda: [0.01, 0.02, 0.03, 0.05],
                                         description="l-inf sizes reported as cert_linf_acc_<s> (l2 radius s sqrt(d))")

    protects_training_examples: ClassVar[bool] = True
    supports_whitebox_audit: ClassVar[bool] = True   # trains with the DP-SGD engine (audit: {mode: whitebox})
    loss_is_cross_entropy: ClassVar[bool] = False   # train_loss is the mean of (CE + xi CE_adv) / (1 + xi) under noise
    privacy_delta_key: ClassVar[str | None] = "delta"
    accepts_custom_dataset: ClassVar[bool] = True
    dpsgd_engine: ClassVar[bool] = True      # trains with dpmech.dpsgd's engine

    @field_validator("model")
    @classmethod
    def _model(cls, value: str, info):
        """A built-in network, or a factory's import path whose network bk clipping handles."""
        from trainables.dpsgd import model_field

        return model_field(value, info, bk=info.data.get("epsilon") is not None, trainable="dpal_sound")

    @model_validator(mode="after")
    def _mechanism_rules(self):
        if self.train_size is not None and self.batch_size > self.train_size:
            raise ValueError(f"batch_size must be <= train_size ({self.train_size}): the sampling rate "
                             f"batch_size / train_size is a probability, got {self.batch_size}")
        sound_config(self)      # raises ValueError naming the field
        return self


def sound_config(cfg: DPALSoundTrialConfig):
    """The dpmech configuration of a trial."""
    from dpmech.dpal_sound.trainer import DPALSoundConfig

    return DPALSoundConfig(epsilon=cfg.epsilon, delta=cfg.delta, max_grad_norm=cfg.max_grad_norm,
                           batch_size=cfg.batch_size, epochs=cfg.epochs, lr=cfg.lr, lr_schedule=cfg.lr_schedule,
                           optimizer=cfg.optimizer, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                           clipping="bk", accountant=cfg.accountant, seed=cfg.seed,
                           smoothing_sigma=cfg.smoothing_sigma, xi=cfg.xi, mu_max=cfg.mu_max,
                           attacks=tuple(cfg.train_attacks), attack_steps=cfg.train_attack_steps)


def privacy_event(cfg: DPALSoundTrialConfig):
    """The dp-accounting event of one trial, planned from its config (what the ledger records when
    the trial runs to the end)."""
    from dpmech.dpsgd.trainer import plan

    return plan(sound_config(cfg), planned_train_size(cfg)).dp_event()


PRIVACY_KEYS = ("epsilon", "delta", "batch_size", "epochs", "train_size", "dataset", "accountant")


class DPALSoundMechanism(TrainerMechanism):
    """Adapter from the trial config to ``dpmech.dpal_sound.trainer.DPALSoundTrainer``."""

    def __init__(self, cfg: DPALSoundTrialConfig, x, y, device, noise_key=None):
        self.sigma = float(cfg.smoothing_sigma)
        self.seed = int(cfg.seed)
        self.trainer = DPALSoundTrainer(build_dpsgd_model(cfg.dataset, cfg.seed, cfg.model), x, y, sound_config(cfg),
                                        device=device, plan_size=planned_train_size(cfg),
                                        canaries=whitebox_canaries(cfg), noise_key=noise_key)

    def test_accuracy(self, x, y) -> float:
        """Per-epoch ``test_acc``: f(x + z) with one noise draw per image (the classifier under its noise)."""
        gen = torch.Generator(device=x.device).manual_seed(stream_seed(self.seed, 200 + self.epoch))
        noisy = NoisyClassifier(self.model, self.sigma, gen)
        self.model.eval()
        correct = 0
        with torch.no_grad():
            for s in range(0, x.shape[0], 1000):
                correct += int((noisy(x[s:s + 1000]).argmax(1) == y[s:s + 1000]).sum())
        return correct / x.shape[0]

    def conventional_accuracy(self, x, y, cfg: DPALSoundTrialConfig) -> dict[str, float]:
        """Every dpal_sound metric (dpmech.dpal_sound.trainer.evaluate): smoothed clean accuracy, white-box
        EOT attacks on the noisy classifier, randomized-smoothing certificates."""
        return evaluate(self.model, self.sigma, x, y, seed=cfg.seed, predict_n=cfg.n_predict,
                        cert_size=own_certify_images(cfg), cert_n0=cfg.smoothing_n0, cert_n=cfg.certify_n,
                        alpha=cfg.smoothing_alpha, l2_radii=tuple(cfg.cert_l2_radii),
                        linf_sizes=tuple(cfg.cert_linf_sizes), attacks=cfg.attacks,
                        pgd_size_n=cfg.attack_images, pgd_steps=cfg.attack_steps, eot_samples=cfg.eot_samples)

    def privacy(self) -> dict[str, float]:
        return self.trainer.privacy()

    def smoothing_classifier(self):
        return (self.model, self.sigma)


def own_certify_images(cfg) -> int:
    """The images dpal_sound's own CERTIFY runs on: none when the trial's ``certifier`` runs randomized
    smoothing too (``smoothing`` / ``both``): that is the same certificate (this model, its sigma, the
    same images, n0, N and alpha), reported as ``smooth_cert_acc_<r>``, so it is not computed twice (at
    N 100,000 each costs half an hour of a core)."""
    return 0 if cfg.certifier in ("smoothing", "both") else cfg.certify_images


def final_metrics(config: dict, metrics: set[str]) -> set[str]:
    """Without its own CERTIFY (``own_certify_images``) a trial reports no ``cert_l2_acc_*``,
    ``cert_linf_acc_*`` or ``cert_abstain_rate`` (the runtime's ``smooth_cert_*`` instead)."""
    if (config.get("certifier") or "default") in ("smoothing", "both"):
        return {m for m in metrics if not m.startswith(("cert_l2_acc_", "cert_linf_acc_", "cert_abstain_rate"))}
    return metrics


def dpal_sound(config: dict, noise_key=None) -> None:
    """Ray Tune function trainable for dpal_sound (flat config; see the module docstring)."""
    run_trial(config, DPALSoundTrialConfig, DPALSoundMechanism, "dpal_sound", noise_key=noise_key)


TRAINABLES = (
    TrainableEntry(
        "dpal_sound", "trainables.dpal_sound:dpal_sound", DPALSoundTrialConfig,
        "dpal_sound: a sound DPAL. DP-SGD (Poisson sampling, per-example clipping of the benign + adversarial "
        "pass of each example, RDP/PLD ledger) on DPAL's adversarial objective with an attack ensemble, Gaussian "
        "input noise at training and inference; certified by randomized smoothing, attacked white-box with EOT "
        "(docs/dpal_sound.md).",
        epsilon_protects="training examples (RDP/PLD ledger; the whole epsilon is DP-SGD's)",
        privacy_event="trainables.dpal_sound:privacy_event",
        privacy_keys=PRIVACY_KEYS,
        metrics=METRICS + tuple(f"cert_l2_acc_{r:g}" for r in (0.25, 0.5, 0.75, 1.0))
        + tuple(f"cert_linf_acc_{s:g}" for s in (0.01, 0.02, 0.03, 0.05)),
        final_metrics="trainables.dpal_sound:final_metrics"),
)
