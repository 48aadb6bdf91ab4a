"""Trial configuration schemas (pydantic): what every trainable accepts, with defaults and
meanings. A user sets only what they vary; anything else takes the documented default.

``CommonConfig`` holds the keys every mechanism shares (data, seed, evaluation); each
mechanism's schema extends it. Unknown keys are refused, every value is checked before any
work, and errors name the key.
"""

from __future__ import annotations

import functools
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_EPOCHS = 100_000   # a bound no study reaches (full MNIST at batch 1: 5e9 steps), far below overflow
ATTACK_NAMES = ("fgsm", "ifgsm", "mim", "pgd", "apgd_ce", "apgd_dlr")


class CommonConfig(BaseModel):
    """Data, seed and evaluation keys shared by every trainable."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    dataset: Literal["mnist", "fashion_mnist", "cifar10"] | str = Field(
        "mnist", description="dataset, inputs scaled to [-1, 1]: a name, or your loader's import path "
        "'package.module:loader' returning (x_train, y_train, x_test, y_test) (docs/own_model.md)")
    train_size: int | None = Field(None, gt=0, description="training images (deterministic subset; null = all)")
    test_size: int | None = Field(1000, gt=0, description="test images used for evaluation (null = all)")
    data_seed: int = Field(0, ge=0, description="seed of the data subsets")
    selection_split: Literal["none", "validation", "test_half"] = Field(
        "none", description="images the sweep's selection reads (the spec's selection section sets it; docs/specs.md): "
        "none (the evaluation images), validation (selection_size training images held back from training) or "
        "test_half (selection_size of the evaluation images, default half); with a split, every evaluation metric "
        "is measured on the selection images and again as heldout_<metric> on images selection never saw")
    selection_size: int | None = Field(None, gt=0, description="images of the selection split (validation: required)")
    seed: int = Field(0, ge=0, description="public seed of initialisation, shuffling and augmentation (not of the noise: "
                      "noise_source)")
    noise_source: Literal["secret", "seed"] = Field(
        "secret", description="where the draws a guarantee rests on (sampling, noise, randomized response) come from: "
        "secret (the sweep's secret key, never published; the owner can reproduce and resume) or seed (research "
        "mode: derived from the public seed, every epsilon labelled 'reproducible noise: no guarantee against anyone "
        "who knows the seed'; docs/threat_model.md)")
    attacks: dict[str, list[float]] = Field(
        default_factory=dict, description="attack name -> sizes in the [-1, 1] domain, e.g. {pgd: [0.1, 0.2]}")
    attack_norm: Literal["linf", "l2"] = Field("l2", description="norm of the attack ball")
    attack_steps: int = Field(10, gt=0, description="iterations of ifgsm, mim and pgd")
    attack_labels: Literal["true", "predicted"] = Field(
        "true", description="labels the attacks maximise the loss of: true (the test labels, robust accuracy as the "
        "literature reports it) or predicted (the model's own clean predictions, the DPAL paper's choice against "
        "label leaking); accuracy is always measured against the true labels (docs/metrics.md)")
    eot_samples: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        "auto", description="noise draws averaged per attack gradient: a number >= 1, or auto (8 for a model whose forward "
        "pass is random, detected by two forward passes, 1 otherwise; logged as eot_samples_used; docs/attacks.md)")
    n_predict: int = Field(1, gt=0, description="noise draws averaged per prediction in accuracy metrics")
    certify_n: int = Field(1000, gt=0, description="Monte Carlo noise draws per certified image")
    certify_eta: float = Field(0.95, gt=0, lt=1, description="confidence level of the certification bounds")
    certify_bounds: Literal["argmax", "hoeffding", "bernstein"] = Field("argmax", description="confidence bound used by the certifier")
    certify_images: int = Field(500, ge=0, description="test images certified (0 = skip certification)")
    certify_sizes: list[float] = Field(
        default_factory=lambda: [0.05, 0.1, 0.2, 0.3, 0.5, 1.0], description="attack sizes reported as cert_acc_<size>")
    certifier: Literal["default", "smoothing", "both"] = Field(
        "default", description="default: the mechanism's own certifier; smoothing: randomized smoothing (Cohen et al. 2019, "
        "models with Gaussian noise on the input; docs/smoothing.md); both: the two side by side")
    smoothing_n0: int = Field(100, gt=0, description="randomized smoothing: selection draws n0 of CERTIFY (certify_n is n)")
    smoothing_alpha: float = Field(0.001, gt=0, lt=0.5, description="randomized smoothing: failure probability alpha of CERTIFY and PREDICT")
    audit_canaries: int = Field(0, ge=0, description="privacy audit: canaries inserted (0 = no audit; docs/audit.md)")
    audit_guess_fraction: float = Field(0.2, gt=0, le=1, description="privacy audit: fraction of canaries guessed")
    audit_beta: float = Field(0.05, gt=0, lt=1, description="privacy audit: 1 - confidence of epsilon_lower_bound")
    audit: dict | None = Field(
        None, description="privacy audit as one mapping (instead of the flat audit_* keys, which are the black-box "
        "audit): {mode: whitebox | blackbox, canaries: m, estimator: steinke | fdp | gdp or a list (the first of "
        "steinke/fdp gives audit_epsilon_lb), confidence: 0.95, direction: dirac | random, statistic: llr | sum, "
        "guess_fraction: 0.2}; whitebox = gradient canaries in the DP-SGD engine (docs/audit.md)")
    diagnostics: bool = Field(True, description="report and log the non-private diagnostics (train_loss, train_acc, "
                              "batch_size_mean, wasserstein, clipped_fraction, loss_near_chance: computed on the training "
                              "data without noise, not covered by epsilon); false for a release (docs/metrics.md)")

    # True for mechanisms whose epsilon protects training examples (the privacy audit applies)
    protects_training_examples: ClassVar[bool] = False
    # True for mechanisms with a certificate of their own (certifier default: cert_acc_<size>)
    has_certificate: ClassVar[bool] = False
    # True when the per-epoch train_loss is the mean cross-entropy of the classifier on the true
    # training labels, so that a loss near ln K means the model predicts uniformly (not_learned)
    loss_is_cross_entropy: ClassVar[bool] = False
    # Name of the delta key of a guarantee for the training data (the delta rules), or None
    privacy_delta_key: ClassVar[str | None] = None
    # The largest delta accepted for such a guarantee (above it the guarantee says little)
    MAX_PRIVACY_DELTA: ClassVar[float] = 0.1
    # True for mechanisms that take a user's dataset loader ('package.module:loader') as dataset
    accepts_custom_dataset: ClassVar[bool] = False
    # True for mechanisms that train their model with the DP-SGD engine (dpmech.dpsgd.trainer): a user's model is
    # trained as make_private_compatible returns it (BatchNorm -> GroupNorm) and checked per example
    dpsgd_engine: ClassVar[bool] = False

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, value: str):
        """A named dataset, or (where the mechanism takes one) a loader's import path, imported,
        called once per process and checked (dpmech.datasets.user_code.load_dataset)."""
        names = ("mnist", "fashion_mnist", "cifar10")
        if value in names:
            return value
        from dpmech.datasets.user_code import is_import_path

        if not is_import_path(value):
            raise ValueError(f"must be one of {', '.join(map(repr, names))}; got {value!r} (or your loader's "
                             f"import path 'package.module:loader')")
        if not cls.accepts_custom_dataset:
            raise ValueError(f"this mechanism builds its networks per named dataset: one of "
                             f"{', '.join(map(repr, names))} (a loader such as {value!r} is taken by dpsgd, "
                             f"dpal_sound, label_dp, pixeldp and secure_sgd)")
        from dpmech.datasets.user_code import load_dataset

        try:
            load_dataset(value)
        except ValueError as exc:
            raise ValueError(str(exc).removeprefix("dataset: ")) from None
        return value

    @field_validator("attack_labels", mode="before")
    @classmethod
    def _yaml_true(cls, value):
        """YAML reads ``attack_labels: true`` as the boolean True: take it as "true"."""
        if value is True:
            return "true"
        if value is False:
            raise ValueError("must be 'true' or 'predicted'; got False")
        return value

    @field_validator("delta", check_fields=False)
    @classmethod
    def _privacy_delta(cls, value, info):
        """delta > 0.1 is refused for a guarantee about the training data (``privacy_delta_key``;
        not for PixelDP's robustness delta, nor for a non-private baseline, epsilon null)."""
        private = info.data.get("epsilon", 1.0) is not None
        if cls.privacy_delta_key == "delta" and private and value is not None and value > cls.MAX_PRIVACY_DELTA:
            raise ValueError(f"must be <= {cls.MAX_PRIVACY_DELTA:g} for a guarantee about the training data (delta "
                             f"bounds the probability that the epsilon guarantee fails), got {value:g}")
        return value

    @classmethod
    def certifier_uses(cls, certifier: str) -> bool:
        """Whether a certifier runs with this ``certifier`` value (so that ``certify_images``
        matters): the mechanism's own (``has_certificate`` and default/both) or randomized
        smoothing (smoothing/both; ``smoothing_unavailable`` refuses it where it cannot run)."""
        return (cls.has_certificate and certifier in ("default", "both")) or certifier in ("smoothing", "both")

    @field_validator("audit")
    @classmethod
    def _audit_mapping(cls, value):
        """The ``audit`` mapping checked and completed with its defaults (trainables.audit_config)."""
        from trainables.audit_config import parse

        return None if value is None else parse(value)

    @model_validator(mode="before")
    @classmethod
    def _mia_elsewhere(cls, data):
        """``mia`` on a schema without the field (every trainable but dpsgd): refused in one line
        naming the rule (trainables.mia_config); ``mia: null`` is no attack."""
        if "mia" in cls.model_fields or not isinstance(data, dict) or "mia" not in data:
            return data
        from trainables.mia_config import refuse_elsewhere

        refuse_elsewhere(data, cls.__name__)
        return {k: v for k, v in data.items() if k != "mia"}

    @model_validator(mode="before")
    @classmethod
    def _label_attack_elsewhere(cls, data):
        """``label_attack`` on a schema without the field (every trainable but label_dp): refused in one
        line naming the rule (trainables.label_attack); ``label_attack: null`` is no attack."""
        if "label_attack" in cls.model_fields or not isinstance(data, dict) or "label_attack" not in data:
            return data
        from trainables.label_attack import refuse_elsewhere

        refuse_elsewhere(data, cls.__name__)
        return {k: v for k, v in data.items() if k != "label_attack"}

    @model_validator(mode="after")
    def _bounded_counts(self):
        """Every count of epochs (``epochs``, ``tstr_epochs``, ``stage1_epochs``, ...) at most
        MAX_EPOCHS: ``epochs: 1e30`` was accepted and planned a run no machine finishes (issue 49.7)."""
        for name, value in self:
            if name.endswith("epochs") and isinstance(value, int) and value > MAX_EPOCHS:
                raise ValueError(f"{name}: at most {MAX_EPOCHS:,} epochs, got {value:.3g}")
        return self

    @model_validator(mode="after")
    def _selection_split(self):
        """The selection split fits the data it is carved from (``selection_images``)."""
        split, size = self.selection_split, self.selection_size
        if split == "none":
            if size is not None:
                raise ValueError("selection_size: only used with selection_split validation or test_half")
            return self
        if split == "validation":
            if size is None:
                raise ValueError("selection_size: required with selection_split validation")
            if self.train_size is not None and size >= self.train_size:
                raise ValueError(f"selection_size: {size} validation images leave no training image of train_size "
                                 f"{self.train_size}; use fewer")
        elif self.test_size is not None:
            if self.test_size < 2:
                raise ValueError(f"selection_split: test_half needs at least 2 test images, test_size is {self.test_size}")
            if size is not None and size >= self.test_size:
                raise ValueError(f"selection_size: {size} selection images leave no held-out image of test_size "
                                 f"{self.test_size}; use fewer")
        return self

    @model_validator(mode="after")
    def _audit_applies(self):
        from trainables.audit_config import check, settings

        check(self)
        audit = settings(self)
        field = "audit" if self.audit else "audit_canaries"
        if audit and not self.protects_training_examples:
            raise ValueError(f"{field}: this mechanism gives no privacy guarantee for its training examples, "
                             "there is no claim to audit")
        if audit and "steinke" in audit.estimator and getattr(self, "privacy_delta_key", "delta"):
            from dpmech.privacy.audit.one_run import audit_possible, guess_counts

            key = getattr(self, "privacy_delta_key", "delta")
            m, delta, beta = audit.canaries, float(getattr(self, key, 0.0) or 0.0), audit.beta
            r = sum(guess_counts(m, audit.guess_fraction))
            if audit_possible(m, 0.0, beta, r) and not audit_possible(m, delta, beta, r):
                raise ValueError(f"{field}: {m} canaries with {key} = {delta:g} make the audit "
                                 f"impossible (the term 2 m delta alpha of Steinke et al. leaves nothing of beta = "
                                 f"{beta:g}); use fewer canaries or a smaller delta (docs/audit.md)")
        return self

    @model_validator(mode="after")
    def _per_example_model(self):
        """A private run of the DP-SGD engine (``dpsgd_engine``) trains a user's model only if its
        training forward pass, as the engine converts it, treats each example alone and changes no
        buffer (dpmech.privacy.per_example; a model-level rule: it depends on ``epsilon`` and
        ``model``, which a spec may sweep apart)."""
        path = getattr(self, "model", None)
        if self.dpsgd_engine and getattr(self, "epsilon", None) is not None:
            from dpmech.datasets.user_code import is_import_path

            if is_import_path(path):
                problem = _user_model_problem(path, self.dataset, False, "", None, True)
                if problem:
                    raise ValueError(problem)
        return self

    def smoothing_unavailable(self) -> str | None:
        """Why randomized smoothing cannot certify this trial's model (None: no objection here).

        A schema whose model never has Gaussian noise on its input (or only for some settings)
        overrides this so that ``certifier: smoothing`` fails at validation; otherwise the trial
        checks at its start that the mechanism provides ``smoothing_classifier()``."""
        return None

    @model_validator(mode="after")
    def _smoothing_applies(self):
        if self.certifier != "default":
            reason = self.smoothing_unavailable()
            if reason:
                raise ValueError(f"certifier: {self.certifier!r} is not available here: {reason}")
        return self

    @field_validator("attacks")
    @classmethod
    def _attacks(cls, value: dict[str, list[float]]):
        for name, sizes in value.items():
            if name not in ATTACK_NAMES:
                raise ValueError(f"unknown attack {name!r}; known: {', '.join(ATTACK_NAMES)}")
            if not sizes:
                raise ValueError(f"attack {name!r} needs at least one size")
            for s in sizes:
                if not s >= 0 or s != s or s == float("inf"):
                    raise ValueError(f"attack sizes must be finite and >= 0, got {s}")
        return value

    @field_validator("certify_sizes")
    @classmethod
    def _sizes(cls, value: list[float]):
        for s in value:
            if not (0 <= s < float("inf")):
                raise ValueError(f"certify sizes must be finite and >= 0, got {s}")
        return value


def check_user_model(path: str, info, *, bk: bool = False, trainable: str = "", outputs: int | None = None) -> None:
    """Validation of a ``model`` import path against the trial's dataset (``info.data``): importable,
    builds an ``nn.Module`` for the dataset's shape and classes, one forward pass; with ``bk``,
    every parameterised layer of the model as the DP-SGD engine trains it (``make_private_compatible``:
    BatchNorm with affine parameters replaced by GroupNorm) is one book-keeping clipping handles
    (dpmech.privacy.clipping). ``outputs`` overrides the number of classes (1 for a regression head).
    Cached per (path, dataset, bk, outputs) so validating many trials builds the model once. (The
    check that a private run's model treats each example alone is :meth:`CommonConfig._per_example_model`.)"""
    dataset = info.data.get("dataset")
    if dataset is None:        # the dataset itself failed validation: that error is reported
        return
    problem = _user_model_problem(path, dataset, bk, trainable, outputs)
    if problem:
        raise ValueError(problem)


@functools.lru_cache(maxsize=64)
def _user_model_problem(path: str, dataset: str, bk: bool, trainable: str, outputs: int | None,
                        per_example: bool = False) -> str | None:
    import torch

    from dpmech.datasets.splits import input_shape, num_classes
    from dpmech.datasets.user_code import build_model

    try:
        model = build_model(path, input_shape(dataset), outputs or num_classes(dataset), 0)
        if bk or per_example:     # the DP-SGD engine trains the model make_private_compatible returns
            from dpmech.dpsgd.trainer import make_private_compatible

            model = make_private_compatible(model, (torch.zeros(1, *input_shape(dataset)),) if per_example else None)
        if bk:
            from dpmech.privacy.clipping import check_model

            check_model(model)
    except ValueError as exc:
        msg = str(exc).removeprefix("model: ")
        if bk and msg.startswith("clipping: "):
            msg = msg.removeprefix("clipping: ")
            msg = f"model {path!r}: {msg}"
            if trainable:
                msg = f"{trainable} clips with 'bk' only, {msg}".replace("; use clipping 'ghost' or 'flat'",
                                                                            "; train it with dpsgd and clipping 'ghost' or 'flat'")
        elif per_example and msg.startswith(("module ", "the model itself", "its training forward pass")):
            msg = f"model {path!r}: {msg}"
        return msg
    return None


@functools.lru_cache(maxsize=64)
def user_model_conversion(path: str, dataset: str) -> str:
    """What the DP-SGD engine replaces in the user's model ``path`` built for ``dataset`` before
    training it (``make_private_compatible``: BatchNorm with affine parameters -> GroupNorm), in one
    line, "none" for nothing (dpmech.dpsgd.trainer.model_conversion)."""
    from dpmech.datasets.splits import input_shape, num_classes
    from dpmech.datasets.user_code import build_model
    from dpmech.dpsgd.trainer import make_private_compatible, model_conversion

    try:
        model = build_model(path, input_shape(dataset), num_classes(dataset), 0)
        return model_conversion(make_private_compatible(model))
    except ValueError:     # reported by the model's validation
        return "none"


def user_model_warnings(schema: type[CommonConfig], config: dict) -> list[str]:
    """One-line warnings for a trial's config: a user's model that the DP-SGD engine trains with
    some layers replaced (``dpsgd_engine`` schemas; the model trained is not the one written)."""
    from dpmech.datasets.user_code import is_import_path

    path, dataset = config.get("model"), config.get("dataset", "mnist")
    if not schema.dpsgd_engine or not is_import_path(path):
        return []
    done = user_model_conversion(path, dataset)
    if done == "none":
        return []
    return [f"model {path!r} is trained with layers replaced by Opacus's ModuleValidator.fix ({done}): the model "
            f"trained is not the one written (logged as the param model_converted; docs/own_model.md)"]


def own_network_field():
    """The ``model`` key of a mechanism whose network is its own (PixelDP's sensitivity-bounded
    first layer): only null, so that a model import path is refused with the reason (see
    :func:`refuse_model`) instead of "unknown key"."""
    return Field(None, description="not taken: the network is PixelDP's, its first layer's sensitivity "
                                                 "bounded by construction (an arbitrary model's cannot be); train your "
                                                 "own model with dpsgd or dpal_sound")


def refuse_model(value, trainable: str):
    if value is not None:
        raise ValueError(f"{trainable} trains its own network, whose first layer's sensitivity is bounded by "
                         f"construction; an arbitrary model's cannot be bounded, so {value!r} is refused (train it "
                         f"with dpsgd or dpal_sound; a dataset loader is accepted here)")
    return value


def trial_config(config: dict) -> dict:
    """Flatten the CLI's pre-expanded grid form ``{"trial": {...}, "_mlflow": ...}``."""
    if isinstance(config.get("trial"), dict):
        return {**config["trial"], **{k: v for k, v in config.items() if k != "trial"}}
    return dict(config)


def planned_train_size(cfg: CommonConfig) -> int:
    """N of a trial's privacy plan: ``train_size``, or the size of the full training split (a
    public number: a trainer plans q, steps and sigma from it, never from the data it is handed)."""
    from dpmech.datasets.splits import train_split_size

    from trainables.mia_config import expected_members

    n = int(cfg.train_size) if cfg.train_size is not None else train_split_size(cfg.dataset)
    # a membership attack's members join the training set: planned from their public expected count
    return n - validation_images(cfg) + expected_members(cfg)


def validation_images(cfg) -> int:
    """Training images held back for selection (``selection_split: validation``), else 0: the trial
    trains on the others, and its privacy plan counts only those."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    return int(get("selection_size") or 0) if get("selection_split", "none") == "validation" else 0


def selection_images(x, y, xt, yt, cfg):
    """The trial's data with its selection split (issue 34, point 2): ``(x, y, x_sel, y_sel, x_held,
    y_held)``: the training images, the images selection reads and the held-out ones (None without a
    split: selection and every metric read the evaluation images ``xt``). ``validation``: the first
    ``selection_size`` of a permutation of the training subset drawn from ``data_seed`` (public) are
    held back; the test images are held out. ``test_half``: the first ``selection_size`` (default half)
    of a permutation of the evaluation images select, the rest are held out."""
    import torch

    split = cfg.selection_split
    if split == "none":
        return x, y, xt, yt, None, None
    g = torch.Generator().manual_seed(int(cfg.data_seed) * 7919 + 17)
    if split == "validation":
        k = int(cfg.selection_size)
        if k >= x.shape[0]:
            raise ValueError(f"config.selection_size: {k} validation images leave no training image of the "
                             f"{x.shape[0]} loaded; use fewer")
        perm = torch.randperm(x.shape[0], generator=g).to(x.device)
        keep, val = perm[k:].sort().values, perm[:k].sort().values
        return x[keep], y[keep], x[val], y[val], xt, yt
    n = xt.shape[0]
    k = int(cfg.selection_size) if cfg.selection_size is not None else n // 2
    if not 0 < k < n:
        raise ValueError(f"config.selection_size: test_half needs 0 < selection images < the {n} test images, "
                         f"got {k}")
    perm = torch.randperm(n, generator=g).to(xt.device)
    sel, held = perm[:k].sort().values, perm[k:].sort().values
    return x, y, xt[sel], yt[sel], xt[held], yt[held]
