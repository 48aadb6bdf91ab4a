"""The ``dpsgd`` trainable: DP-SGD (Abadi et al. 2016) through Opacus under Ray Tune.

Use it in your own study::

    from ray import tune
    from trainables.dpsgd import dpsgd
    tune.Tuner(dpsgd, param_space={"epsilon": tune.grid_search([1.0, 8.0]), "epochs": 2}).fit()

The network is chosen by ``model``: by default the PixelDP network without its noise layer (the
MNIST CNN; for CIFAR-10 the wide ResNet with GroupNorm), so DP-SGD is compared with the DPAL
paper's mechanisms on the same architecture; ``tb_cnn`` is Tramer & Boneh 2021's tanh CNN of the
published DP-SGD recipes (sweeps/dpsgd_mnist_tb.yaml). ``epsilon: null`` trains
the non-private baseline (no clipping, no noise; epsilon reported as inf). Every key and its
default: :class:`DPSGDTrialConfig` (``dpsweep mechanisms``); the mechanism: docs/dpsgd.md.
"""

from __future__ import annotations

from functools import lru_cache
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from trainables.config import CommonConfig, check_user_model

BUILTIN_MODELS = ("pixeldp_cnn", "tb_cnn", "tb_cnn_gn")


def model_field(value: str, info, *, bk: bool = False, trainable: str = "") -> str:
    """The ``model`` key: one of :data:`BUILTIN_MODELS`, or an import path 'package.module:factory'
    whose factory builds a working network for the trial's dataset (dpmech.user_code)."""
    if value in BUILTIN_MODELS:
        return value
    from dpmech.user_code import is_import_path

    if not is_import_path(value):
        raise ValueError(f"must be one of {', '.join(map(repr, BUILTIN_MODELS))} or an import path "
                         f"'package.module:factory', got {value!r}")
    check_user_model(value, info, bk=bk, trainable=trainable)
    return value

# The registry imports this module to validate specs without importing torch: dpmech and the trial
# runtime are imported inside the functions, and ``DPSGDMechanism`` is built on first use.


class DPSGDTrialConfig(CommonConfig):
    """DP-SGD (Abadi et al. 2016): Poisson sampling, per-example clipping, calibrated Gaussian noise."""

    epsilon: float | None = Field(
        1.0, gt=0, allow_inf_nan=False,
        description="target epsilon of the whole training run (noise calibrated by RDP over the planned steps); "
                    "null = non-private baseline of the same network (no clipping, no noise)")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the guarantee (add/remove one training example)")
    max_grad_norm: float = Field(1.0, gt=0, allow_inf_nan=False, description="C: per-example gradient clipping bound (l2)")
    batch_size: int = Field(256, gt=0, description="expected batch size; Poisson sampling rate q = batch_size / train_size")
    epochs: int = Field(5, gt=0, description="training epochs of ceil(train_size / batch_size) steps")
    lr: float = Field(0.1, gt=0, allow_inf_nan=False, description="learning rate")
    lr_schedule: Literal["constant", "cosine", "step"] = Field(
        "constant", description="learning-rate schedule over the planned steps: constant; cosine (to 0); "
                                "step (x0.1 after 1/2 and after 3/4 of the steps)")
    model: Literal["pixeldp_cnn", "tb_cnn", "tb_cnn_gn"] | str = Field(
        "pixeldp_cnn", description="network (dpmech.dp_models): pixeldp_cnn = the PixelDP network without its noise "
                                   "layer (the DPAL paper's baseline comparison); tb_cnn = Tramer & Boneh 2021's tanh "
                                   "CNN (the published DP-SGD recipes); tb_cnn_gn = tb_cnn with GroupNorm; or your "
                                   "factory's import path 'package.module:factory' (docs/own_model.md)")
    input_range: Literal["pm1", "unit"] = Field(
        "pm1", description="input range the network sees: pm1 = the project's [-1, 1]; unit = [0, 1] through a fixed "
                           "map (Tramer & Boneh's MNIST inputs, ToTensor without Normalize); no parameters, no privacy "
                           "effect")
    optimizer: Literal["sgd", "adam"] = Field("sgd", description="optimizer applied to the noisy gradient")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False, description="L2 weight decay")
    clipping: Literal["bk", "ghost", "flat"] = Field(
        "bk", validate_default=True, description="bk: book-keeping clipping, one backward pass (dpmech.clipping; the fastest); "
                          "ghost: Opacus ghost clipping (two backward passes); flat: per-example gradients by "
                          "Opacus hooks, then flat clipping (slowest); all three give the same clipped sum")
    noise_augmentation_sigma: float = Field(
        0.0, ge=0, allow_inf_nan=False,
        description="std of Gaussian noise added to training inputs ([-1, 1] domain); > 0 makes the model a "
                    "randomized-smoothing base classifier with this sigma")
    accountant: Literal["rdp", "pld"] = Field("rdp", description="accountant used to calibrate the noise (both are reported)")

    protects_training_examples: ClassVar[bool] = True
    supports_whitebox_audit: ClassVar[bool] = True   # trains with the DP-SGD engine (audit: {mode: whitebox})
    loss_is_cross_entropy: ClassVar[bool] = True
    privacy_delta_key: ClassVar[str | None] = "delta"
    accepts_custom_dataset: ClassVar[bool] = True

    @field_validator("model")
    @classmethod
    def _model(cls, value: str, info):
        """A built-in network, or a factory's import path checked against the dataset."""
        return model_field(value, info)

    @field_validator("clipping")
    @classmethod
    def _clipping(cls, value: str, info):
        """clipping 'bk' of a user's model (epsilon set): every parameterised layer must be one bk handles."""
        model, private = info.data.get("model"), info.data.get("epsilon", 1.0) is not None
        if value == "bk" and private and model is not None and model not in BUILTIN_MODELS:
            check_user_model(model, info, bk=True)
        return value

    @model_validator(mode="after")
    def _mechanism_rules(self):
        if self.train_size is not None and self.batch_size > self.train_size:
            raise ValueError(f"batch_size must be <= train_size ({self.train_size}): the sampling rate "
                             f"batch_size / train_size is a probability, got {self.batch_size}")
        return self

    def smoothing_unavailable(self) -> str | None:
        if self.noise_augmentation_sigma == 0:
            return ("the DP-SGD model is a randomized-smoothing base classifier only when trained with Gaussian "
                    "noise on its inputs (set noise_augmentation_sigma > 0)")
        return None


def planned_train_size(cfg: DPSGDTrialConfig) -> int:
    """N of the privacy plan: train_size, or the full training split."""
    from dpmech.dpsgd import FULL_TRAIN_SIZES

    return int(cfg.train_size) if cfg.train_size is not None else FULL_TRAIN_SIZES[cfg.dataset]


def dpsgd_config(cfg: DPSGDTrialConfig):
    """The dpmech configuration of a trial (one-line ValueError naming the key on a bad value)."""
    from dpmech.dpsgd import DPSGDConfig

    return DPSGDConfig(epsilon=cfg.epsilon, delta=cfg.delta, max_grad_norm=cfg.max_grad_norm,
                       batch_size=cfg.batch_size, epochs=cfg.epochs, lr=cfg.lr, lr_schedule=cfg.lr_schedule,
                       optimizer=cfg.optimizer,
                       momentum=cfg.momentum, weight_decay=cfg.weight_decay, clipping=cfg.clipping,
                       noise_augmentation_sigma=cfg.noise_augmentation_sigma, accountant=cfg.accountant,
                       seed=cfg.seed)


def privacy_event(cfg: DPSGDTrialConfig):
    """The dp-accounting event of one trial, planned from its config: exactly what the trainer
    records when the trial runs to the end (the same q, sigma and number of steps)."""
    from dpmech.dpsgd import plan

    return plan(dpsgd_config(cfg), planned_train_size(cfg)).dp_event()


PRIVACY_KEYS = ("epsilon", "delta", "batch_size", "epochs", "train_size", "dataset", "accountant")


@lru_cache(maxsize=None)
def _mechanism_class():
    """``DPSGDMechanism``, built on first use (it subclasses the runtime's ``TrainerMechanism``)."""
    from dpmech.dpsgd import DPSGDTrainer, build_dpsgd_model
    from trainables.audit_config import whitebox_canaries
    from trainables.runtime import TrainerMechanism

    class DPSGDMechanism(TrainerMechanism):
        """Adapter from the trial config to ``dpmech.dpsgd.DPSGDTrainer``."""

        def __init__(self, cfg: DPSGDTrialConfig, x, y, device):
            self.sigma = float(cfg.noise_augmentation_sigma)
            self.trainer = DPSGDTrainer(build_dpsgd_model(cfg.dataset, cfg.seed, cfg.model, cfg.input_range), x, y, dpsgd_config(cfg),
                                        device=device, plan_size=planned_train_size(cfg), canaries=whitebox_canaries(cfg))

        def privacy(self) -> dict[str, float]:
            """epsilon (RDP) and epsilon_pld of the ledger, delta, noise_multiplier, sampling_rate, steps."""
            return self.trainer.privacy()

        def certify(self, x, y, cfg):
            return None  # no certificate of its own; see smoothing_classifier

        def smoothing_classifier(self):
            """(base model, sigma) when trained with Gaussian noise augmentation (the model adds no
            noise itself), else None."""
            return (self.model, self.sigma) if self.sigma > 0 else None

    DPSGDMechanism.__qualname__ = "DPSGDMechanism"
    return DPSGDMechanism


def __getattr__(name: str):
    if name == "DPSGDMechanism":
        return _mechanism_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dpsgd(config: dict) -> None:
    """Ray Tune function trainable for DP-SGD (flat config; see the module docstring)."""
    from trainables.runtime import run_trial

    run_trial(config, DPSGDTrialConfig, _mechanism_class(), "dpsgd")
