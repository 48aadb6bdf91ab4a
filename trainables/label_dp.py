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
    mechanism: Literal["laplace", "rr", "lp1st", "lp2st", "cluster_rr", "labeldp_pro", "none"] = Field(
        "laplace", description="laplace (one-hot + Lap(2/eps), or digit + Lap(9/eps) for regression), rr (K-ary "
        "randomized response), lp1st / lp2st (randomized response with a prior, Ghazi et al. 2021, one or two "
        "stages; classification), cluster_rr (image-only k-means prior + noisy per-cluster histograms + "
        "RR-with-prior, pure; a linear or CNN head on ScatterNet features), labeldp_pro (Ghazi et al. 2024's projected "
        "noisy label gradients, approximate (epsilon, label_delta); the same head) or none (the non-private "
        "baseline; epsilon must be null)")
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
    weight_decay: float = Field(5e-4, ge=0, allow_inf_nan=False,
                                description="recipe mixup_sgd: SGD weight decay; cluster_rr: the head's AdamW weight decay")
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
    n_clusters: int = Field(200, gt=0, description="cluster_rr: k-means clusters of the images (image-only, free)")
    hist_share: float = Field(1.0, gt=0, le=1, description="cluster_rr: share of epsilon spent on the noisy per-cluster "
                              "label histograms (Laplace, sensitivity 2); the rest on RR-with-prior")
    rr_stages: int = Field(1, gt=0, description="cluster_rr: RR-with-prior stages (LP-MST); unused when hist_share is 1")
    prior_temperature: float = Field(1.0, gt=0, allow_inf_nan=False,
                                     description="cluster_rr: RR's top-k choice uses prior^temperature (< 1: larger k*)")
    pca_dim: int = Field(50, gt=0, description="cluster_rr: principal components of the features clustered")
    head: Literal["linear", "cnn"] = Field(
        "linear", description="cluster_rr: the network trained on the released labels, a linear layer or a small CNN "
        "on the same ScatterNet features (dpmech.label_dp.soft_cnn; the benchmark's best at epsilon 2 and 4), both "
        "with epochs, batch_size, lr and weight_decay; post-processing, the epsilon is the release's")
    head_width: int = Field(64, gt=0, description="head cnn: the CNN's channels (width, then 2 width)")
    head_hidden: int = Field(256, gt=0, description="head cnn: the CNN's hidden units")
    head_dropout: float = Field(0.3, ge=0, lt=1, description="head cnn: dropout before each fully connected layer")
    head_mixup_alpha: float = Field(0.0, ge=0, allow_inf_nan=False,
                                    description="head cnn: mixup of features and released soft labels, "
                                    "lambda ~ Beta(alpha, alpha) per batch; 0 = none")
    label_delta: float = Field(1e-5, gt=0, lt=1, description="labeldp_pro: delta of the (epsilon, delta) guarantee")
    pro_batch_size: int = Field(5000, gt=0, description="labeldp_pro: examples per noisy gradient (disjoint batches)")
    pro_lr: float = Field(0.5, gt=0, allow_inf_nan=False, description="labeldp_pro: step size (momentum 0.9)")
    pro_clip: float = Field(1.0, gt=0, allow_inf_nan=False, description="labeldp_pro: norm of each [feature, 1] row")
    pro_proj_images: int = Field(256, ge=0, description="labeldp_pro: public images whose per-label gradients span "
                                 "the projection (0: the batch's own)")
    certify_images: int = Field(0, ge=0, le=0, description="label DP has no certificate: must be 0")
    label_attack: dict | None = Field(
        None, description="label-inference attack on the trial's model (docs/mia.md, 'Label DP in a sweep'): "
        "{examples: n (default 500), confidence: 0.95}; n training examples' labels are drawn from the uniform prior "
        "by the trial's secret key before the release, the attacker guesses them from the model's output; logs "
        "label_inference_advantage and label_inference_eps_lb (against label_epsilon; docs/metrics.md)")

    # Label DP protects labels only: a neighbouring dataset that changes an image is not covered,
    # so the membership audit (which inserts whole examples) has no claim to test.
    protects_training_examples: ClassVar[bool] = False
    accepts_custom_dataset: ClassVar[bool] = True
    supports_label_attack: ClassVar[bool] = True   # the label_attack key (trainables.label_attack)

    @field_validator("label_attack", mode="before")
    @classmethod
    def _label_attack(cls, value):
        """The ``label_attack`` mapping checked and completed with its defaults (trainables.label_attack)."""
        from trainables.label_attack import parse

        return None if value is None else parse(value)

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
        feature_rules(self)
        label_dp_config(self)  # raises ValueError naming the field
        if self.task == "regression" and self.attacks:
            raise ValueError("attacks: adversarial accuracy is defined for task 'classification' only")
        from trainables.label_attack import check as label_attack_rules

        label_attack_rules(self)
        return self

    def smoothing_unavailable(self) -> str | None:
        return "label DP adds no noise to the model's input"


FEATURE_MECHANISMS = ("cluster_rr", "labeldp_pro")
CLUSTER_KEYS = ("n_clusters", "hist_share", "rr_stages", "prior_temperature", "pca_dim", "head")
CNN_HEAD_KEYS = ("head_width", "head_hidden", "head_dropout", "head_mixup_alpha")
PRO_KEYS = ("label_delta", "pro_batch_size", "pro_lr", "pro_clip", "pro_proj_images")


def feature_rules(cfg: LabelDPTrialConfig) -> None:
    """The high-privacy mechanisms' rules (one-line ValueError naming the key)."""
    fields = type(cfg).model_fields
    for keys, field, value in ((CLUSTER_KEYS, "mechanism", "cluster_rr"), (PRO_KEYS, "mechanism", "labeldp_pro"),
                               (CNN_HEAD_KEYS, "head", "cnn")):
        if getattr(cfg, field) != value:
            for key in keys:
                if getattr(cfg, key) != fields[key].default:
                    raise ValueError(f"{key}: applies to {field} {value} only ({field} is {getattr(cfg, field)})")
    if cfg.mechanism not in FEATURE_MECHANISMS:
        return
    if cfg.epsilon is None:
        raise ValueError(f"epsilon: mechanism {cfg.mechanism} needs a finite epsilon > 0 (null is mechanism none)")
    if cfg.task != "classification":
        raise ValueError(f"task: mechanism {cfg.mechanism} applies to task 'classification' only")
    if cfg.model is not None:
        raise ValueError(f"model: mechanism {cfg.mechanism} trains its own head on ScatterNet features; must be null")
    if cfg.mechanism == "cluster_rr" and cfg.hist_share == 1.0 and cfg.rr_stages != 1:
        raise ValueError("rr_stages: must be 1 when hist_share is 1 (no budget is left for randomized response)")
    if cfg.train_size is not None and cfg.mechanism == "cluster_rr" and cfg.n_clusters > cfg.train_size:
        raise ValueError(f"n_clusters: must be <= train_size ({cfg.train_size}), got {cfg.n_clusters}")


def feature_config(cfg: LabelDPTrialConfig):
    from dpmech.label_dp.feature_trainer import FeatureLabelDPConfig

    return FeatureLabelDPConfig(mechanism=cfg.mechanism, epsilon=cfg.epsilon, delta=cfg.label_delta, epochs=cfg.epochs,
                                seed=cfg.seed, batch_size=cfg.batch_size, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                n_clusters=cfg.n_clusters, hist_share=cfg.hist_share, rr_stages=cfg.rr_stages,
                                prior_temperature=cfg.prior_temperature, pca_dim=cfg.pca_dim,
                                pro_batch_size=cfg.pro_batch_size, pro_lr=cfg.pro_lr, pro_clip=cfg.pro_clip,
                                pro_proj_images=cfg.pro_proj_images, head=cfg.head, head_width=cfg.head_width,
                                head_hidden=cfg.head_hidden, head_dropout=cfg.head_dropout,
                                head_mixup_alpha=cfg.head_mixup_alpha)


def label_dp_config(cfg: LabelDPTrialConfig):
    """The dpmech configuration of a trial."""
    from dpmech.label_dp.trainer import LabelDPConfig

    if cfg.mechanism in FEATURE_MECHANISMS:
        return feature_config(cfg)
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

        if cfg.mechanism in FEATURE_MECHANISMS:
            from dpmech.label_dp.feature_trainer import FeatureLabelDPTrainer

            self.trainer = FeatureLabelDPTrainer(feature_config(cfg), x, y, num_classes=num_classes(cfg.dataset),
                                                 device=device, noise_key=noise_key)
            return
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
    """A regression trial also reports ``mse``; labeldp_pro releases no labels, so no keep rates."""
    if config.get("mechanism") == "labeldp_pro":
        metrics = metrics - {"label_keep_rate", "analytic_keep_prob"}
    return metrics | {"mse"} if config.get("task") == "regression" else metrics


TRAINABLES = (
    TrainableEntry(
        "label_dp", "trainables.label_dp:label_dp", LabelDPTrialConfig,
        "Label DP (source: Laplace on MNIST labels): training labels released once per trial with the Laplace "
        "mechanism (one-hot + Lap(2/eps) -> argmax, or the digit + Lap(9/eps)), K-ary randomized response, or "
        "randomized response with a prior (LP-1ST / LP-2ST, Ghazi et al. 2021), a fresh CNN trained on them "
        "(the source's Adam recipe or mixup + SGD); classification or regression; at high privacy cluster_rr "
        "(image-only cluster prior + noisy histograms + RR-with-prior, pure) and the LabelDP-Pro baseline "
        "(approximate); epsilon protects labels only (docs/label_dp.md).",
        epsilon_protects="training labels only (label DP, delta 0; labeldp_pro: delta label_delta); the images are "
                         "not protected",
        metrics=("label_keep_rate", "analytic_keep_prob", "label_epsilon"),
        final_metrics="trainables.label_dp:final_metrics"),
)
