"""The ``label_dp`` trainable: label differential privacy (Laplace or randomized response on the
training labels, released once per trial) under Ray Tune.

Use it in your own study::

    from ray import tune
    from trainables.label_dp import label_dp
    tune.Tuner(label_dp, param_space={"mechanism": tune.grid_search(["laplace", "rr"]),
                                      "epsilon": tune.grid_search([0.1, 1.0, 10.0])}).fit()

Every key and its default: ``LabelDPTrialConfig`` below (``dpsweep mechanisms``). The mechanism
itself is ``dpmech.label_dp.release``; the decisions it takes are in docs/label_dp.md.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import torch
from pydantic import Field, field_validator, model_validator

from trainables.config import CommonConfig, check_user_model
from trainables.entry import TrainableEntry
from trainables.runtime import TrainerMechanism, run_trial


class LabelDPTrialConfig(CommonConfig):
    """Label DP (docs/label_dp.md): the training labels released once through an epsilon-DP
    mechanism (Laplace on one-hot or scalar labels, K-ary randomized response, or randomized
    response with a prior in one or two stages), a fresh CNN trained on them. The guarantee covers labels only, not images."""

    task: Literal["classification", "regression"] = Field(
        "classification", description="classification (cross-entropy on labels) or regression (MSE on the digit value)")
    mechanism: Literal["laplace", "rr", "lp1st", "lp2st", "none"] = Field(
        "laplace", description="laplace (one-hot + Lap(2/eps), or digit + Lap(9/eps) for regression), rr (K-ary "
        "randomized response), lp1st / lp2st (randomized response with a prior, Ghazi et al. 2021, one or two "
        "stages; classification) or none (the non-private baseline; epsilon must be null)")
    epsilon: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        1.0, description="label-DP epsilon of the release (delta = 0); null = non-private baseline (true labels)")
    postprocess: Literal["argmax", "clamp_round"] = Field(
        "argmax", description="classification + laplace: argmax of the noisy one-hot vector, or the source's "
        "clamp(round(digit + Lap(9/eps)), 0, 9)")
    epochs: int = Field(5, gt=0, description="training epochs (the labels are released once, before the first)")
    batch_size: int = Field(100, gt=0, description="minibatch size")
    lr: float = Field(1e-3, gt=0, allow_inf_nan=False,
                      description="Adam learning rate (recipe adam) or peak SGD learning rate (recipe mixup_sgd)")
    recipe: Literal["adam", "mixup_sgd"] = Field(
        "adam", description="adam (the source's: Adam, constant lr, two-conv CNN) or mixup_sgd (Ghazi et al.'s: "
        "mixup, SGD with momentum, linear warm-up then linear decay, a smaller CNN)")
    momentum: float = Field(0.9, ge=0, lt=1, description="recipe mixup_sgd: SGD momentum")
    weight_decay: float = Field(5e-4, ge=0, allow_inf_nan=False, description="recipe mixup_sgd: SGD weight decay")
    warmup_epochs: float = Field(1.0, ge=0, allow_inf_nan=False,
                                 description="recipe mixup_sgd: linear warm-up epochs (per stage)")
    mixup_alpha: float = Field(4.0, ge=0, allow_inf_nan=False,
                               description="recipe mixup_sgd, classification: mixup's Beta(alpha, alpha); 0 = none")
    stage1_fraction: float = Field(0.4, gt=0, lt=1, description="lp2st: share of the training set in stage 1")
    stage1_epochs: int = Field(0, ge=0, description="lp2st: the first stage1_epochs of epochs train stage 1 "
                               "(1 .. epochs-1); 0 for every other mechanism")
    prior_mode: Literal["denoised", "softmax"] = Field(
        "denoised", description="lp2st: the stage-2 prior, the stage-1 softmax with its RR channel inverted "
        "(denoised) or as is (softmax)")
    width: int = Field(16, gt=0, description="recipe mixup_sgd: the CNN's channels (width, then 2 width)")
    hidden: int = Field(128, gt=0, description="recipe mixup_sgd: the CNN's hidden units")
    model: str | None = Field(
        None, description="null: the recipe's network; or your factory's import path 'package.module:factory' "
                          "(docs/own_model.md; task regression calls it with num_classes=1), trained by the recipe's "
                          "optimizer and schedule")
    certify_images: int = Field(0, ge=0, le=0, description="label DP has no certificate: must be 0")

    # Label DP protects labels only: a neighbouring dataset that changes an image is not covered,
    # so the membership audit (which inserts whole examples) has no claim to test.
    protects_training_examples: ClassVar[bool] = False
    accepts_custom_dataset: ClassVar[bool] = True

    @field_validator("model")
    @classmethod
    def _model(cls, value, info):
        """null, or a factory's import path checked against the dataset (one output for regression)."""
        if value is None:
            return value
        from dpmech.datasets.user_code import is_import_path

        if not is_import_path(value):
            raise ValueError(f"must be null (the recipe's network) or an import path 'package.module:factory', "
                             f"got {value!r}")
        check_user_model(value, info, outputs=1 if info.data.get("task") == "regression" else None)
        return value

    @model_validator(mode="after")
    def _mechanism_rules(self):
        label_dp_config(self)  # raises ValueError naming the field
        if self.task == "regression" and self.attacks:
            raise ValueError("attacks: adversarial accuracy is defined for task 'classification' only")
        return self

    def smoothing_unavailable(self) -> str | None:
        return "label DP adds no noise to the model's input"


def label_dp_config(cfg: LabelDPTrialConfig):
    """The dpmech configuration of a trial."""
    from dpmech.label_dp.trainer import LabelDPConfig

    return LabelDPConfig(dataset=cfg.dataset, task=cfg.task, mechanism=cfg.mechanism, epsilon=cfg.epsilon,
                         postprocess=cfg.postprocess, epochs=cfg.epochs, batch_size=cfg.batch_size, lr=cfg.lr,
                         seed=cfg.seed, recipe=cfg.recipe, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                         warmup_epochs=cfg.warmup_epochs, mixup_alpha=cfg.mixup_alpha,
                         stage1_fraction=cfg.stage1_fraction, stage1_epochs=cfg.stage1_epochs,
                         prior_mode=cfg.prior_mode, width=cfg.width, hidden=cfg.hidden, model=cfg.model)


class LabelDPMechanism(TrainerMechanism):
    """Adapter from the trial config to ``dpmech.label_dp.trainer.LabelDPTrainer``."""

    def __init__(self, cfg: LabelDPTrialConfig, x: torch.Tensor, y: torch.Tensor, device: torch.device, noise_key=None):
        from dpmech.datasets.splits import num_classes
        from dpmech.label_dp.trainer import LabelDPTrainer

        self.trainer = LabelDPTrainer(label_dp_config(cfg), x, y, num_classes=num_classes(cfg.dataset), device=device,
                                      noise_key=noise_key)

    def conventional_accuracy(self, x, y, cfg: LabelDPTrialConfig) -> dict[str, float]:
        """Classification: the project's default (acc_clean and every configured attack).
        Regression: ``mse`` of the raw output and ``acc_clean`` of the rounded predictions."""
        if cfg.task == "regression":
            return {"mse": self.trainer.mse(x, y), "acc_clean": self.trainer.accuracy(x, y)}
        from dpmech.robustness.evaluation import conventional_accuracy

        return conventional_accuracy(self.model, x, y, attacks=cfg.attacks, norm=cfg.attack_norm,
                                     n_predict=cfg.n_predict, eot_samples=cfg.eot_samples, steps=cfg.attack_steps,
                                     seed=cfg.seed, attack_labels=cfg.attack_labels)


def label_dp(config: dict, noise_key=None) -> None:
    """Ray Tune function trainable for label DP (flat config; see the module docstring)."""
    run_trial(config, LabelDPTrialConfig, LabelDPMechanism, "label_dp", noise_key=noise_key)


def final_metrics(config: dict, metrics: set[str]) -> set[str]:
    """A regression trial also reports ``mse``."""
    return metrics | {"mse"} if config.get("task") == "regression" else metrics


TRAINABLES = (
    TrainableEntry(
        "label_dp", "trainables.label_dp:label_dp", LabelDPTrialConfig,
        "Label DP (source: Laplace on MNIST labels): training labels released once per trial with the Laplace "
        "mechanism (one-hot + Lap(2/eps) -> argmax, or the digit + Lap(9/eps)), K-ary randomized response, or "
        "randomized response with a prior (LP-1ST / LP-2ST, Ghazi et al. 2021), a fresh CNN trained on them "
        "(the source's Adam recipe or mixup + SGD); classification or regression; epsilon protects labels only "
        "(docs/label_dp.md).",
        epsilon_protects="training labels only (label DP, delta 0); the images are not protected",
        metrics=("label_keep_rate", "analytic_keep_prob", "label_epsilon"),
        final_metrics="trainables.label_dp:final_metrics"),
)
