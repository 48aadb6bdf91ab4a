"""The ``dpsgd`` trainable: DP-SGD (Abadi et al. 2016) through Opacus under Ray Tune.

Use it in your own study::

    from ray import tune
    from trainables.dpsgd import dpsgd
    tune.Tuner(dpsgd, param_space={"epsilon": tune.grid_search([1.0, 8.0]), "epochs": 2}).fit()

The network is chosen by ``model``: by default the PixelDP network without its noise layer (the
MNIST CNN; for CIFAR-10 the wide ResNet with GroupNorm), so DP-SGD is compared with the DPAL
paper's mechanisms on the same architecture; ``tb_cnn`` is Tramer & Boneh 2021's tanh CNN of the
published DP-SGD recipes (sweeps/dpsgd_mnist_tb.yaml). ``features: scatternet`` trains T&B's
``linear`` or ``scatter_cnn`` classifier on ScatterNet features of the images (cached per dataset;
the deployed model, scattering and classifier, is what is evaluated and attacked;
sweeps/dpsgd_mnist_scatternet_eps*.yaml). ``epsilon: null`` trains
the non-private baseline (no clipping, no noise; epsilon reported as inf). Every key and its
default: :class:`DPSGDTrialConfig` (``dpsweep mechanisms``); the mechanism: docs/dpsgd.md.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field, field_validator, model_validator

from dpmech.dpsgd.trainer import DPSGDTrainer, build_dpsgd_model
from trainables.audit_config import whitebox_canaries
from trainables.config import CommonConfig, check_user_model, planned_train_size
from trainables.entry import TrainableEntry
from trainables.runtime import TrainerMechanism, run_trial

BUILTIN_MODELS = ("pixeldp_cnn", "tb_cnn", "tb_cnn_gn", "lenet")
FEATURE_MODELS = ("linear", "scatter_cnn")      # classifiers on ScatterNet features (features: scatternet)
_IMAGE_CHANNELS = {"mnist": 1, "fashion_mnist": 1, "cifar10": 3}


def model_field(value: str, info, *, bk: bool = False, trainable: str = "") -> str:
    """The ``model`` key: one of :data:`BUILTIN_MODELS`, or an import path 'package.module:factory'
    whose factory builds a working network for the trial's dataset (dpmech.datasets.user_code)."""
    if value in BUILTIN_MODELS:
        return value
    from dpmech.datasets.user_code import is_import_path

    if not is_import_path(value):
        raise ValueError(f"must be one of {', '.join(map(repr, BUILTIN_MODELS))} or an import path "
                         f"'package.module:factory', got {value!r}")
    check_user_model(value, info, bk=bk, trainable=trainable)
    return value


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
    model: Literal["pixeldp_cnn", "tb_cnn", "tb_cnn_gn", "lenet", "linear", "scatter_cnn"] | str = Field(
        "pixeldp_cnn", description="network (dpmech.networks.dpsgd_models): pixeldp_cnn = the PixelDP network without its noise "
                                   "layer (the DPAL paper's baseline comparison); tb_cnn = Tramer & Boneh 2021's tanh "
                                   "CNN (the published DP-SGD recipes); tb_cnn_gn = tb_cnn with GroupNorm; lenet = the "
                                   "randomized-smoothing literature's MNIST LeNet (431k parameters, 28 x 28 only); or your "
                                   "factory's import path 'package.module:factory' (docs/own_model.md); with "
                                   "features: scatternet, linear (GroupNorm + one linear layer) or scatter_cnn (T&B's "
                                   "small CNN on the features), and only those")
    input_range: Literal["pm1", "unit"] = Field(
        "pm1", description="input range the network sees: pm1 = the project's [-1, 1]; unit = [0, 1] through a fixed "
                           "map (Tramer & Boneh's MNIST inputs, ToTensor without Normalize); no parameters, no privacy "
                           "effect")
    features: Literal["none", "scatternet"] = Field(
        "none", description="none: the network reads the images; scatternet: it reads their ScatterNet features "
                            "(Tramer & Boneh 2021: scattering J=2, L=8, 81 channels of 7 x 7 on MNIST; a fixed "
                            "per-image transform, no privacy cost; cached on disk per dataset), model linear or "
                            "scatter_cnn; input_range is then the range the scattering sees (T&B: unit)")
    feature_norm_groups: int = Field(
        27, ge=0, description="features: scatternet: GroupNorm groups over the scattering channels (per-example "
                              "statistics, no parameters, no privacy cost; must divide the 81 channels per image "
                              "channel; 0 = no normalisation; T&B use 27)")
    optimizer: Literal["sgd", "adam"] = Field("sgd", description="optimizer applied to the noisy gradient")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False, description="L2 weight decay")
    clipping: Literal["bk", "ghost", "flat"] = Field(
        "bk", validate_default=True, description="bk: book-keeping clipping, one backward pass (dpmech.privacy.clipping; the fastest); "
                          "ghost: Opacus ghost clipping (two backward passes); flat: per-example gradients by "
                          "Opacus hooks, then flat clipping (slowest); all three give the same clipped sum")
    noise_augmentation_sigma: float = Field(
        0.0, ge=0, allow_inf_nan=False,
        description="std of Gaussian noise added to training inputs ([-1, 1] domain); > 0 makes the model a "
                    "randomized-smoothing base classifier with this sigma")
    accountant: Literal["rdp", "pld"] = Field("rdp", description="accountant used to calibrate the noise (both are reported)")
    augment_multiplicity: int = Field(
        1, ge=1, description="k Gaussian noise augmentations (std noise_augmentation_sigma) of each example, its loss "
                             "averaged over them before clipping: one clipped gradient per example (DP-CERT, Wu et al. "
                             "2024; docs/dp_certified.md); k > 1 needs noise_augmentation_sigma > 0 and clipping bk or "
                             "flat; costs about k times a step")
    consistency_weight: float = Field(
        0.0, ge=0, allow_inf_nan=False,
        description="lambda of Jeong & Shin 2020's consistency regulariser (KL of each augmentation's softmax from "
                    "the example's mean softmax, plus consistency_eta times its entropy), inside each example's "
                    "clipped loss; > 0 needs augment_multiplicity >= 2")
    consistency_eta: float = Field(
        0.5, ge=0, allow_inf_nan=False,
        description="eta of the consistency regulariser's entropy term (used only with consistency_weight > 0)")
    smoothadv_radius: float = Field(
        0.0, ge=0, allow_inf_nan=False,
        description="SmoothAdv (Salman et al. 2019): l2 radius ([-1, 1] domain) of a PGD attack on each example's "
                    "soft smoothed classifier at its own augmentations before its loss (0 = off); needs "
                    "noise_augmentation_sigma > 0 and clipping bk or flat")
    smoothadv_steps: int = Field(1, ge=1, description="SmoothAdv's PGD steps (step size 2 radius / steps)")
    mia: dict | None = Field(
        None, description="membership inference attack on the trial's model (docs/mia.md): {attack: rmia | lira, "
        "references: 1-4 (default 2), candidates: M (default 1000), num_z: 1000, confidence: 0.95}; the candidates "
        "are training images outside train_size, each a member by a secret fair coin; logs mia_auc, "
        "mia_tpr_at_fpr_0.001, mia_tpr_at_fpr_0.01, mia_eps_lb (docs/metrics.md)")

    protects_training_examples: ClassVar[bool] = True
    supports_whitebox_audit: ClassVar[bool] = True   # trains with the DP-SGD engine (audit: {mode: whitebox})
    loss_is_cross_entropy: ClassVar[bool] = True
    privacy_delta_key: ClassVar[str | None] = "delta"
    accepts_custom_dataset: ClassVar[bool] = True
    dpsgd_engine: ClassVar[bool] = True      # trains with dpmech.dpsgd's engine
    supports_mia: ClassVar[bool] = True      # the mia key (trainables.mia_config, trainables.mia_trial)

    @field_validator("mia")
    @classmethod
    def _mia(cls, value):
        """The ``mia`` mapping checked and completed with its defaults (trainables.mia_config)."""
        from trainables.mia_config import parse

        return None if value is None else parse(value)

    @field_validator("model")
    @classmethod
    def _model(cls, value: str, info):
        """A built-in network, or a factory's import path checked against the dataset (the
        classifiers on features are checked against ``features`` in ``_mechanism_rules``)."""
        if value in FEATURE_MODELS:
            return value
        return model_field(value, info)

    @field_validator("clipping")
    @classmethod
    def _clipping(cls, value: str, info):
        """clipping 'bk' of a user's model (epsilon set): every parameterised layer must be one bk handles."""
        model, private = info.data.get("model"), info.data.get("epsilon", 1.0) is not None
        if value == "bk" and private and model is not None and model not in BUILTIN_MODELS + FEATURE_MODELS:
            check_user_model(model, info, bk=True)
        return value

    @model_validator(mode="after")
    def _mechanism_rules(self):
        if self.train_size is not None and self.batch_size > self.train_size:
            raise ValueError(f"batch_size must be <= train_size ({self.train_size}): the sampling rate "
                             f"batch_size / train_size is a probability, got {self.batch_size}")
        self._feature_rules()
        self._certified_rules()
        from trainables.mia_config import check as mia_rules

        mia_rules(self)
        return self

    def _certified_rules(self) -> None:
        """augment_multiplicity / consistency_weight: the rules of dpmech.dpsgd.certified.DPCertConfig
        (one line naming the key), checked here so that a spec fails at validation."""
        if self.augment_multiplicity == 1 and self.consistency_weight == 0 and self.smoothadv_radius == 0:
            return
        dpsgd_config(self)
        audit = getattr(self, "audit", None) or {}
        if audit.get("mode") == "whitebox" and audit.get("canary", "engine") in ("engine", None):
            raise ValueError("audit.canary: engine canaries are rows of the plain DP-SGD loss; with "
                             "augment_multiplicity > 1, consistency_weight > 0 or smoothadv_radius > 0 use 'inserted'")

    def _feature_rules(self) -> None:
        """``features`` and ``model`` go together (scatternet with linear / scatter_cnn only); with
        ScatterNet features, no input noise augmentation and GroupNorm groups that divide the
        81 C channels. Model-level rules: each depends on more than one key (a spec sweeps them)."""
        if self.features == "none":
            if self.model in FEATURE_MODELS:
                raise ValueError(f"features must be 'scatternet' with model {self.model!r} (a classifier on ScatterNet "
                                 f"features, not on images), got 'none'")
            return
        if self.model not in FEATURE_MODELS:
            raise ValueError(f"model must be 'linear' or 'scatter_cnn' with features 'scatternet' (a classifier on the "
                             f"features), got {self.model!r}")
        if self.noise_augmentation_sigma > 0:
            raise ValueError("noise_augmentation_sigma must be 0 with features 'scatternet': the noise would be added "
                             "to the features, not the images, so the model would not be a smoothing base classifier")
        channels = _IMAGE_CHANNELS.get(self.dataset)
        if channels is None:                 # a loader's dataset (already loaded by the dataset check)
            from dpmech.datasets.splits import input_shape
            from dpmech.networks.scatternet import check_params

            shape = input_shape(self.dataset)
            check_params(shape, 2, 8, self.input_range)
            channels = shape[0]
        if self.feature_norm_groups and (81 * channels) % self.feature_norm_groups:
            raise ValueError(f"feature_norm_groups must divide the {81 * channels} ScatterNet channels of "
                             f"{self.dataset!r} (GroupNorm groups; 0 = none), got {self.feature_norm_groups}")

    def smoothing_unavailable(self) -> str | None:
        if self.noise_augmentation_sigma == 0:
            return ("the DP-SGD model is a randomized-smoothing base classifier only when trained with Gaussian "
                    "noise on its inputs (set noise_augmentation_sigma > 0)")
        return None


def dpsgd_config(cfg: DPSGDTrialConfig):
    """The dpmech configuration of a trial (one-line ValueError naming the key on a bad value)."""
    from dpmech.dpsgd.trainer import DPSGDConfig

    kw = dict(epsilon=cfg.epsilon, delta=cfg.delta, max_grad_norm=cfg.max_grad_norm,
              batch_size=cfg.batch_size, epochs=cfg.epochs, lr=cfg.lr, lr_schedule=cfg.lr_schedule,
              optimizer=cfg.optimizer,
              momentum=cfg.momentum, weight_decay=cfg.weight_decay, clipping=cfg.clipping,
              noise_augmentation_sigma=cfg.noise_augmentation_sigma, accountant=cfg.accountant,
              seed=cfg.seed)
    if cfg.augment_multiplicity > 1 or cfg.consistency_weight > 0 or cfg.smoothadv_radius > 0:
        # k augmentations / the consistency regulariser inside each example's loss (docs/dp_certified.md)
        from dpmech.dpsgd.certified import DPCertConfig

        return DPCertConfig(**kw, augment_multiplicity=cfg.augment_multiplicity,
                            consistency_weight=cfg.consistency_weight, consistency_eta=cfg.consistency_eta,
                            smoothadv_radius=cfg.smoothadv_radius, smoothadv_steps=cfg.smoothadv_steps)
    return DPSGDConfig(**kw)


def privacy_event(cfg: DPSGDTrialConfig):
    """The dp-accounting event of one trial, planned from its config: exactly what the trainer
    records when the trial runs to the end (the same q, sigma and number of steps)."""
    from dpmech.dpsgd.trainer import plan

    return plan(dpsgd_config(cfg), planned_train_size(cfg)).dp_event()


PRIVACY_KEYS = ("epsilon", "delta", "batch_size", "epochs", "train_size", "dataset", "accountant",
                "mia")   # mia: its candidates // 2 join the planned training-set size


class DPSGDMechanism(TrainerMechanism):
    """Adapter from the trial config to ``dpmech.dpsgd.trainer.DPSGDTrainer``."""

    def __init__(self, cfg: DPSGDTrialConfig, x, y, device, noise_key=None):
        self.sigma = float(cfg.noise_augmentation_sigma)
        self.extractor = self.deployed = None
        if cfg.features == "scatternet":
            model, x = self._scatternet(cfg, x, device)
        else:
            model = build_dpsgd_model(cfg.dataset, cfg.seed, cfg.model, cfg.input_range)
        config = dpsgd_config(cfg)
        trainer_cls = DPSGDTrainer
        if type(config).__name__ == "DPCertConfig":
            from dpmech.dpsgd.certified import DPCertTrainer as trainer_cls
        self.trainer = trainer_cls(model, x, y, config,
                                    device=device, plan_size=planned_train_size(cfg), canaries=whitebox_canaries(cfg),
                                    noise_key=noise_key)
        if self.extractor is not None:
            # the deployed model reads images: evaluation, attacks and audits see scattering + classifier
            self.deployed = torch.nn.Sequential(self.extractor, self.trainer.model)
            self.conventional_accuracy = self._features_accuracy   # runtime.evaluate uses it when present

    def _scatternet(self, cfg: DPSGDTrialConfig, x, device):
        """(classifier, features of x): the training examples become their cached ScatterNet
        features (same N, so the same q, sigma and steps: the privacy event is unchanged)."""
        from dpmech.datasets.splits import num_classes
        from dpmech.networks.dpsgd_models import build_feature_model
        from dpmech.networks.scatternet import ScatterNet, scatter_features

        self.dataset, self.input_range = cfg.dataset, cfg.input_range
        self.extractor = ScatterNet(tuple(x.shape[1:]), input_range=cfg.input_range).to(device)
        self._feature_memo = None
        feats = scatter_features(x, input_range=cfg.input_range, dataset=cfg.dataset, device=device)
        model = build_feature_model(cfg.model, feats.shape[1:], num_classes(cfg.dataset), cfg.seed,
                                    groups=cfg.feature_norm_groups)
        return model, feats

    def _features(self, x):
        """ScatterNet features of evaluation images (disk cache; memo of the last tensor)."""
        from dpmech.networks.scatternet import scatter_features

        key = (x.data_ptr(), tuple(x.shape), str(x.device))
        if self._feature_memo is None or self._feature_memo[0] != key:
            feats = scatter_features(x, input_range=self.input_range, dataset=self.dataset, device=x.device)
            self._feature_memo = (key, feats)
        return self._feature_memo[1]

    @property
    def model(self):
        """The deployed model (images in): ``Sequential(ScatterNet, classifier)`` with features,
        else the trained network."""
        return self.deployed if self.deployed is not None else self.trainer.model

    def test_accuracy(self, x, y) -> float:
        if self.deployed is None:
            return self.trainer.accuracy(x, y)
        return self.trainer.accuracy(self._features(x), y)   # = the deployed model's accuracy on x

    def _features_accuracy(self, x, y, cfg) -> dict[str, float]:
        """The final conventional accuracy with features: with attacks, everything on the deployed
        model end to end (gradients through the scattering); without, ``acc_clean`` from the
        cached features of the same images (the same function, computed once)."""
        if cfg.attacks:
            from dpmech.robustness.evaluation import conventional_accuracy

            return conventional_accuracy(
                self.deployed, x, y, attacks=cfg.attacks, norm=cfg.attack_norm, n_predict=cfg.n_predict,
                eot_samples=cfg.eot_samples, steps=cfg.attack_steps, seed=cfg.seed, attack_labels=cfg.attack_labels)
        return {"acc_clean": self.test_accuracy(x, y)}

    def privacy(self) -> dict[str, float]:
        """epsilon (RDP) and epsilon_pld of the ledger, delta, noise_multiplier, sampling_rate, steps."""
        return self.trainer.privacy()

    def smoothing_classifier(self):
        """(base model, sigma) when trained with Gaussian noise augmentation (the model adds no
        noise itself), else None."""
        return (self.model, self.sigma) if self.sigma > 0 else None


def dpsgd(config: dict, noise_key=None) -> None:
    """Ray Tune function trainable for DP-SGD (flat config; see the module docstring)."""
    run_trial(config, DPSGDTrialConfig, DPSGDMechanism, "dpsgd", noise_key=noise_key)


TRAINABLES = (
    TrainableEntry(
        "dpsgd", "trainables.dpsgd:dpsgd", DPSGDTrialConfig,
        "DP-SGD (Abadi et al. 2016): Poisson sampling, per-example clipping (clipping: bk, book-keeping in one "
        "backward pass, the default; ghost or flat through Opacus), "
        "Gaussian noise calibrated to (epsilon, delta) over the planned steps; RDP/PLD epsilon from the ledger; "
        "epsilon null = non-private baseline of the same network (docs/dpsgd.md).",
        epsilon_protects="training examples (RDP/PLD ledger)",
        privacy_event="trainables.dpsgd:privacy_event",
        privacy_keys=PRIVACY_KEYS,
        metrics=("epsilon_pld", "noise_multiplier", "sampling_rate", "steps")),
)
