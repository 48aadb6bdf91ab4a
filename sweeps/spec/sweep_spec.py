"""Sweep specs: YAML files that declare a sweep (docs/specs.md is the full reference).

``load_spec(path, overrides)`` reads a spec with ``yaml.safe_load``, applies ``--set key=value``
overrides and validates everything before Ray starts: the spec's own sections (the pydantic
models below), the rules between them, and every candidate value of every trainable parameter
(through that trainable's config schema, ``sweeps.spec.space``). Any problem raises
``SpecError`` with one line ``<field path>: <rule>``, for example
``trainables[0].search.epsilon[2]: must be > 0, got -1.0``.

``expand_trials`` gives the exact list of flat trial configs of a grid/random spec
(deterministic: the random draws come from ``search.seed``); ``ray_param_space`` gives the Ray
Tune ``param_space`` for any algorithm; ``spec_to_flat_params`` the MLflow params of the spec.

Ray is imported only inside ``ray_param_space``.
"""

from __future__ import annotations

import copy
import json
import math
import re
import typing
from pathlib import Path
from typing import Any, Iterable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from sweeps.spec.space import (
    MAX_TRIALS,
    EPOCH_COUNTERPARTS,
    PER_EPOCH_METRICS,
    SpecError,
    TrainableSpace,
    build_space,
    check_common,
    check_metric,
    check_not_diagnostic,
    check_trainable_name,
    did_you_mean,
    expand,
    first_error,
    format_size,
    join_path,
    pydantic_rule,
    scheduler_metric,
    short_repr,
    union_members,
)
from trainables.registry import REGISTRY

__all__ = [
    "MAX_TRIALS", "SpecError", "SweepSpec", "apply_overrides", "expand_trials", "load_spec", "ray_param_space",
    "reference_matches",
    "spec_to_flat_params", "validate_spec",
]

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")
PARAM_VALUE_LIMIT = 500  # characters of an MLflow param value


# --------------------------------------------------------------------------- the spec's sections


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


MAX_NAME = 120          # a spec's name: the experiment directory is <name>-<timestamp>-<6 hex>
MAX_EXPERIMENT = 250    # an MLflow experiment name (its SQL column holds more; a readable bound)


class MlflowSection(_Section):
    """Where the sweep is tracked."""

    experiment: str | None = Field(None, min_length=1, max_length=MAX_EXPERIMENT,
                                   description="MLflow experiment (default: the spec's name)")
    tracking_uri: str | None = Field(
        None, min_length=1,
        description="tracking URI (default: --tracking-uri, else MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")

    @field_validator("tracking_uri")
    @classmethod
    def _scheme(cls, value: str | None) -> str | None:
        if value is not None:
            from sweeps.tracking import tracking_uri_problem

            problem = tracking_uri_problem(value)
            if problem:
                raise ValueError(problem)
        return value


class TrainableSection(_Section):
    """One entry of ``trainables``: a registered trainable and its parameter space."""

    name: str = Field(min_length=1, description="registered trainable (dpsweep mechanisms)")
    search: dict[str, Any] = Field(default_factory=dict, description="parameter -> value or distribution")

    @model_validator(mode="before")
    @classmethod
    def _null_search(cls, data):
        if isinstance(data, dict) and "search" in data and data["search"] is None:
            data = {k: v for k, v in data.items() if k != "search"}
        return data


class Objective(_Section):
    """One objective of a multi-objective Optuna search."""

    metric: str = Field(min_length=1)
    mode: Literal["min", "max"]


class SearchSection(_Section):
    """How trials are generated."""

    algorithm: Literal["grid", "random", "optuna"] = "grid"
    num_samples: int = Field(1, ge=1, le=MAX_TRIALS, description="grid: repeats of the grid; random: samples per grid point; "
                                                  "optuna: trials")
    seed: int = Field(0, ge=0, description="seed of the random draws and of Optuna's sampler")
    metric: str | None = Field(None, min_length=1, description="metric Optuna optimises / the sweep's best is by")
    mode: Literal["min", "max"] | None = None
    objectives: list[Objective] = Field(default_factory=list, description="Optuna multi-objective")


class SchedulerSection(_Section):
    """Early stopping of trials on their per-epoch results."""

    type: Literal["none", "asha"] = "none"
    metric: str | None = Field(None, min_length=1, description="a per-epoch metric (train_loss, test_acc)")
    mode: Literal["min", "max"] | None = Field(None, description="default: the metric's direction")
    grace_period: int = Field(1, ge=1, description="epochs a trial runs before it can be stopped")
    reduction_factor: float = Field(2.0, gt=1, allow_inf_nan=False, description="ASHA halving rate")

    @model_validator(mode="before")
    @classmethod
    def _default_mode(cls, data):
        metric = scheduler_metric(data.get("metric") or "") if isinstance(data, dict) else None
        if isinstance(data, dict) and data.get("mode") is None and metric in PER_EPOCH_METRICS:
            data = {**data, "mode": PER_EPOCH_METRICS[metric]}
        return data


class ResourcesSection(_Section):
    """Resources of one trial."""

    cpu: float = Field(1.0, gt=0, allow_inf_nan=False)
    gpu: float | Literal["auto"] = Field(
        "auto", description="GPUs per trial; fractional shares a GPU (0.25: four trials); auto: a share when the "
                            "cluster has GPUs, 0 otherwise (sweeps.cluster_checks.resolve_gpu)")

    @field_validator("gpu", mode="before")
    @classmethod
    def _gpu(cls, value):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"must be a number >= 0 or 'auto', got {short_repr(value)}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not value >= 0:
            raise ValueError(f"must be >= 0, got {value:g}")
        return value


class FailureSection(_Section):
    """Retries of failed trials (Ray FailureConfig)."""

    max_retries: int = Field(0, ge=0, description="retries of a failed trial, from its last checkpoint")
    trial_timeout: float | None = Field(
        None, gt=0, le=30 * 86400, allow_inf_nan=False,
        description="seconds one attempt of a trial may run; past it the trial is stopped FAILED (dpsweep.error "
                    "says why) and retried under max_retries (default: no limit)")
    silence_warning: float = Field(
        600, gt=0, le=30 * 86400, allow_inf_nan=False,
        description="seconds without a result from a running trial after which the console says so, once")


class TuningPrivacySection(_Section):
    """Private hyperparameter selection (sweeps/spec/tuning.py, docs/tuning_privacy.md)."""

    distribution: Literal["poisson", "geometric", "logarithmic", "truncated_negative_binomial"] = Field(
        description="distribution of the number of trials K (Papernot & Steinke 2022)")
    mean: float = Field(ge=1, allow_inf_nan=False, description="E[K], the expected number of trials")
    shape: float | None = Field(None, gt=0, allow_inf_nan=False, description="eta of the truncated negative binomial")
    delta: float | None = Field(None, gt=0, lt=1, description="delta of the end-to-end guarantee "
                                                              "(default: the largest per-trial delta)")
    target_epsilon: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="end-to-end epsilon to land on: every trial's epsilon is calibrated so that releasing the best "
                    "of K lands on it (the trainable's search must then leave epsilon unset)")


class ReferencePoint(_Section):
    """One configuration point of a paper's figure and the values the paper publishes there."""

    label: str | None = Field(None, min_length=1, description="how the table and the plots name the point")
    where: dict[str, Any] = Field(min_length=1, description="configured values (trainable and config keys); "
                                                            "a trial matches when every key equals")
    metrics: dict[str, float] = Field(min_length=1, description="metric name -> published value, in our units")


class ReferenceSection(_Section):
    """Published values beside the measured ones (``dpsweep report``'s published-vs-measured table)."""

    citation: str = Field(min_length=1, description="the paper and its figure or table")
    note: str = Field("", description="units and domain: how the paper's numbers were converted to ours")
    points: list[ReferencePoint] = Field(min_length=1)


class CompareItem(_Section):
    """Two configurations of ``selection.compare`` named by their configured values (like a
    ``reference`` point's ``where``: ``{trainable: dpsgd, epsilon: 8, max_grad_norm: 1}``)."""

    a: dict[str, Any] = Field(min_length=1, description="configured values of the first configuration")
    b: dict[str, Any] = Field(min_length=1, description="configured values of the second configuration")


class SelectionSection(_Section):
    """How the sweep's best is chosen and on which images it is scored (issue 34, points 1 and 2;
    docs/specs.md). ``split``: ``none`` (select on the evaluation images, the same ones every metric
    is reported on), ``validation`` (``size`` images carved from each trial's training subset: the
    trial trains on the rest; selection reads them, the test images stay unseen) or ``test_half``
    (the evaluation images split in two, as ``benchmarks/dpsgd_tuned.py`` does: selection reads
    ``size`` of them, default half, and the others are held out). ``statistic``: how a
    configuration's repeats are summarised for the choice (mean, median, or worst: the lowest of a
    max metric, the highest of a min one)."""

    split: Literal["none", "validation", "test_half"] = Field(
        "none", description="where the selection metric is measured: none (the evaluation images), validation "
                            "(carved from the training data) or test_half (half of the evaluation images)")
    size: int | None = Field(None, gt=0, description="images selection reads (validation: required, taken from the "
                                                     "training subset; test_half: default half of the test images)")
    statistic: Literal["mean", "median", "worst"] = Field(
        "mean", description="how a configuration's repeats are summarised when the best configuration is chosen")
    best_of: Literal["private", "all"] = Field(
        "private", description="private: the best is the best private configuration and a non-private baseline "
                               "(epsilon: null) is a reference beside it (what privacy costs); all: it competes")
    compare: list[Literal["runner_up", "baseline"] | CompareItem] = Field(
        default_factory=lambda: ["runner_up", "baseline"],
        description="comparisons the report makes, each with its paired test, p-value (Holm-adjusted when several), "
                    "effect size and interval: runner_up (best vs runner-up), baseline (best vs the non-private "
                    "baseline), or {a: {key: value, ...}, b: {...}} (two configurations by their configured values)")



_OPTIONAL = ("description", "storage", "mlflow", "common", "search", "scheduler", "resources",
             "max_concurrent_trials", "failure", "tuning_privacy", "reference", "keep_checkpoints", "selection")


class SweepSpec(_Section):
    """A validated sweep spec. Build it with ``load_spec`` or ``validate_spec``; ``raw`` is the
    mapping as written (after overrides), ``spaces`` the validated space of each trainable."""

    name: str = Field(description="experiment name: letters, digits, _ . -")
    description: str = ""
    storage: str = Field("./ray_results", min_length=1, description="Ray storage: local path, shared mount or s3://")
    mlflow: MlflowSection = Field(default_factory=MlflowSection)
    common: dict[str, Any] = Field(default_factory=dict, description="fixed values for every trainable")
    trainables: list[TrainableSection] = Field(min_length=1)
    search: SearchSection = Field(default_factory=SearchSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    resources: ResourcesSection = Field(default_factory=ResourcesSection)
    max_concurrent_trials: int | None = Field(None, ge=1)
    failure: FailureSection = Field(default_factory=FailureSection)
    tuning_privacy: TuningPrivacySection | None = None
    keep_checkpoints: bool = Field(False, description="keep each finished trial's checkpoint (default: deleted once "
                                                      "its final metrics and artifacts are in MLflow)")
    reference: ReferenceSection | None = None
    selection: SelectionSection = Field(default_factory=SelectionSection)

    _raw: dict | None = PrivateAttr(None)
    _spaces: tuple[TrainableSpace, ...] | None = PrivateAttr(None)
    _trials: list[dict] | None = PrivateAttr(None)
    _warnings: list[str] = PrivateAttr(default_factory=list)
    # the sweep's secret (dpmech.privacy.secret.NoiseKey) once ``dpsweep run`` made it: a tuning-private
    # sweep draws K and its candidates from it (docs/threat_model.md)
    _noise_key: Any = PrivateAttr(None)
    # tuning_privacy's summary (end-to-end epsilon, ...) computed at validation (check_tuning_guarantee)
    _tuning_summary: dict | None = PrivateAttr(None)

    def bind_noise_key(self, key) -> None:
        """Draw the sweep's random choices that a guarantee rests on (tuning_privacy's K and its
        candidates) from ``key``, the sweep's secret; the trial list is expanded again."""
        self._noise_key = key
        if self.tuning_privacy is not None:
            self._trials = None

    @property
    def reproducible_noise(self) -> bool:
        """True when the spec asks for the research mode (``noise_source: seed`` in common)."""
        return (self.common or {}).get("noise_source") == "seed"

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data):
        """A section written empty (``common:``) takes its defaults; the MLflow experiment
        defaults to the spec's name."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if not (k in _OPTIONAL and v is None)}
        mlflow = data.get("mlflow", {})
        if isinstance(mlflow, dict) and mlflow.get("experiment") is None and isinstance(data.get("name"), str):
            data["mlflow"] = {**mlflow, "experiment": data["name"]}
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if len(value) > MAX_NAME:   # it names a directory <name>-<timestamp>-<hex> (a file name <= 255 bytes)
            raise ValueError(f"at most {MAX_NAME} characters (it names the experiment directory), got {len(value)}")
        if not NAME_PATTERN.fullmatch(value):
            raise ValueError(f"must be letters, digits, '_', '.' or '-' only (it names the experiment directory), "
                             f"got {short_repr(value)}")
        return value

    @property
    def raw(self) -> dict:
        """The spec as written (after overrides), for logging as an artifact."""
        return self._raw if self._raw is not None else self.model_dump()

    @property
    def spaces(self) -> tuple[TrainableSpace, ...]:
        """The validated parameter space of each trainable, in spec order."""
        if self._spaces is None:
            self._spaces = _build_spaces(self)
        return self._spaces

    @property
    def warnings(self) -> list[str]:
        """One-line warnings of validation (the spec runs, but a rule of thumb is broken, e.g. the
        delta rule): the CLI prints them at validate and run."""
        return list(self._warnings)

    @property
    def num_trials(self) -> int:
        """Trials the sweep runs: the expansion's length, or num_samples for Optuna."""
        if self.search.algorithm == "optuna":
            return self.search.num_samples
        return len(_trials(self))


# --------------------------------------------------------------------------- errors of the sections


def _section_at(loc) -> type[BaseModel] | None:
    """The spec model found at a pydantic location (for did-you-mean on an unknown key)."""
    annotation: Any = SweepSpec
    for part in loc:
        step = None
        for member in union_members(annotation):
            if isinstance(part, str) and isinstance(member, type) and issubclass(member, BaseModel):
                field = member.model_fields.get(part)
                step = field.annotation if field else None
            elif isinstance(part, int) and typing.get_origin(member) is list:
                step = typing.get_args(member)[0]
            if step is not None:
                break
        if step is None:
            return None
        annotation = step
    return next((m for m in union_members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)), None)


def _section_error(exc: ValidationError) -> SpecError:
    err = first_error(exc)
    loc = err["loc"]
    rule = pydantic_rule(err)
    if err["type"] == "extra_forbidden":
        section = _section_at(loc[:-1])
        if section is not None:
            rule += did_you_mean(loc[-1], section.model_fields)
    return SpecError(f"{join_path('', loc) or 'spec'}: {rule}")


# --------------------------------------------------------------------------- loading and overrides


def _override_path(item: str, key: str) -> list[str]:
    parts = re.sub(r"\[(\d+)\]", r".\1", key).split(".")
    if any(not p.strip() for p in parts):
        raise SpecError(f"--set {item!r}: empty key" if not key else f"--set {item!r}: empty part in {key!r}")
    return [p.strip() for p in parts]


def _assign(raw: dict, item: str, parts: list[str], value) -> None:
    node: Any = raw
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "the spec"
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit():
                raise SpecError(f"--set {item!r}: {where} is a list; use an index, got {part!r}")
            index = int(part)
            if index >= len(node):
                raise SpecError(f"--set {item!r}: index {index} is out of range ({where} has {len(node)} item(s))")
            key: Any = index
        elif isinstance(node, dict):
            key = part
        else:
            raise SpecError(f"--set {item!r}: {where} is a value ({short_repr(node, 30)}), not a section")
        if last:
            node[key] = value
        else:
            if isinstance(node, dict) and node.get(key) is None:
                node[key] = {}  # a missing or empty section is created
            node = node[key]


def apply_overrides(raw: dict, overrides: Iterable[str] | None = ()) -> dict:
    """A copy of ``raw`` with ``KEY=VALUE`` overrides applied in order.

    KEY is a dotted path (``trainables.0.search.epsilon``; ``trainables[0]`` works too); missing
    mapping keys are created, list indices must exist. VALUE is parsed with ``yaml.safe_load``
    (``[0.5, 2]`` is a list, ``null`` is None, an empty VALUE is None).
    """
    raw = copy.deepcopy(raw)
    for item in overrides or ():
        if not isinstance(item, str) or "=" not in item:
            raise SpecError(f"--set {item!r}: expected KEY=VALUE")
        key, text = item.split("=", 1)
        parts = _override_path(item, key.strip())
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise SpecError(f"--set {item!r}: the value is not valid YAML ({problem})") from None
        _assign(raw, item, parts, value)
    return raw


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping with a key written twice (plain YAML keeps the last
    silently: ``epsilon`` written twice would run the second value with no word; issue 49.7)."""


def _unique_mapping(loader: UniqueKeyLoader, node, deep: bool = False):
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            twice = key in seen
        except TypeError:   # an unhashable key: the base constructor says so
            continue
        first = seen.setdefault(key, key_node.start_mark.line + 1)
        if twice:
            raise yaml.constructor.ConstructorError(
                None, None, f"the key {key!r} is written twice (first on line {first}); YAML would keep only the "
                            "last", key_node.start_mark)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def only_trainables(raw: dict, only: Iterable[str]) -> dict:
    """The spec keeping only the trainables named in ``only`` (``dpsweep run/validate --only NAME``,
    issue 51.5: one trainable of a multi-trainable spec without a copy of it); reference points that
    name a dropped trainable go with it."""
    names = list(dict.fromkeys(str(t.get("name")) for t in raw.get("trainables") or [] if isinstance(t, dict)))
    wanted = [n.strip() for item in only for n in str(item).split(",") if n.strip()]
    for n in wanted:
        if n not in names:
            raise SpecError(f"--only: {n!r} is not a trainable of this spec ({', '.join(names)})"
                            f"{did_you_mean(n, names)}")
    raw = copy.deepcopy(raw)
    raw["trainables"] = [t for t in raw["trainables"] if isinstance(t, dict) and str(t.get("name")) in wanted]
    ref = raw.get("reference")
    if isinstance(ref, dict) and isinstance(ref.get("points"), list):
        ref["points"] = [p for p in ref["points"] if not (isinstance(p, dict) and isinstance(p.get("where"), dict)
                                                          and "trainable" in p["where"]
                                                          and p["where"]["trainable"] not in wanted)]
        if not ref["points"]:
            raw.pop("reference")
    return raw


def load_spec(path: str | Path, overrides: Iterable[str] | None = (), only: Iterable[str] | None = ()) -> SweepSpec:
    """Read a spec file with ``yaml.safe_load``, apply overrides (and ``only``: the trainables to
    keep) and validate it."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise SpecError(f"{path}: is a directory, not a spec file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        raw = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader that refuses duplicate keys
    except RecursionError:
        raise SpecError(f"{path}: nested too deeply to read (a spec is a few levels of mappings and lists)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{where}: invalid YAML: {problem}") from None
    if raw is None:
        raise SpecError(f"{path}: empty spec")
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: must be a mapping of spec keys (name, trainables, ...), got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides)
    return validate_spec(only_trainables(raw, only) if only else raw)


# --------------------------------------------------------------------------- validation


def _check_search(spec: SweepSpec) -> None:
    s = spec.search
    if s.algorithm == "optuna" and len(spec.trainables) != 1:
        raise SpecError(f"search.algorithm: optuna searches the space of one trainable, got {len(spec.trainables)} "
                        f"trainables; run one sweep per trainable, or use grid or random")
    if s.objectives:
        if s.algorithm != "optuna":
            raise SpecError("search.objectives: only used by search.algorithm optuna; "
                            "use search.metric and search.mode")
        if s.metric is not None or s.mode is not None:
            raise SpecError("search.objectives: give either search.metric and search.mode, or search.objectives")
        seen: list[str] = []
        for j, o in enumerate(s.objectives):
            if o.metric in seen:
                raise SpecError(f"search.objectives[{j}].metric: duplicate {o.metric!r}")
            seen.append(o.metric)
    elif s.metric is None and s.mode is not None:
        raise SpecError("search.metric: required with search.mode")
    elif s.metric is not None and s.mode is None:
        raise SpecError("search.mode: required with search.metric (min or max)")
    elif s.algorithm == "optuna" and s.metric is None:
        raise SpecError("search.metric: required for search.algorithm optuna (with search.mode), "
                        "or give search.objectives")


HELD_OUT_PREFIX = "heldout_"  # trainables.runtime.HELD_OUT: metrics on images selection never saw


def _check_selection(spec: SweepSpec) -> None:
    """The ``selection`` section (issue 34, points 1 and 2): held-out metrics never steer anything;
    a tuning-private sweep's selection reads no private data (a validation split is carved from the
    training data, which its guarantee protects); the split reaches every trial as the common keys
    ``selection_split`` / ``selection_size``, which a spec therefore does not set itself."""
    sel, s, sch = spec.selection, spec.search, spec.scheduler
    steering = [("search.metric", s.metric)] + [(f"search.objectives[{j}].metric", o.metric)
                                                for j, o in enumerate(s.objectives)]
    steering.append(("scheduler.metric", sch.metric))
    for path, metric in steering:
        if metric and metric.startswith(HELD_OUT_PREFIX):
            raise SpecError(f"{path}: {metric!r} is measured on the held-out images of the selection split, which "
                            f"never steer a choice; select by {metric[len(HELD_OUT_PREFIX):]!r} (measured on the "
                            "selection images)")
    for key in ("selection_split", "selection_size"):
        where = ["common"] * (key in spec.common) + [f"trainables[{i}].search" for i, t in enumerate(spec.trainables)
                                                     if key in t.search]
        if where:
            raise SpecError(f"{where[0]}.{key}: set by the spec's selection section (selection: {{split: ..., "
                            "size: ...}}); remove it here")
    if sel.split == "validation" and spec.tuning_privacy is not None:
        raise SpecError("selection.split: validation images are carved from the training data, which the "
                        "tuning_privacy guarantee protects, and they would steer the released choice without noise; "
                        "use test_half (selection on half of the test images, the other half held out)")
    if sel.split == "validation" and sel.size is None:
        raise SpecError("selection.size: required with split validation (the number of training images held back "
                        "from training for selection)")
    if sel.split == "none" and sel.size is not None:
        raise SpecError("selection.size: only used with split validation or test_half")
    limit = {"validation": ("train_size", "training"), "test_half": ("test_size", "test")}.get(sel.split)
    if limit and sel.size is not None and isinstance(spec.common.get(limit[0]), int) \
            and sel.size >= spec.common[limit[0]]:
        raise SpecError(f"selection.size: {sel.size} selection images leave none of the {spec.common[limit[0]]} "
                        f"{limit[1]} images (common.{limit[0]}) for {'training' if limit[1] == 'training' else 'the held-out score'}; "
                        "use fewer")
    if sel.split != "none":
        spec.common["selection_split"] = sel.split
        if sel.size is not None:
            spec.common["selection_size"] = sel.size


def _check_compare(spec: SweepSpec) -> None:
    """``selection.compare`` (issue 51.2): on a grid/random sweep each named configuration matches a
    trial, and ``baseline`` written in the spec needs a non-private trial (``epsilon: null``)."""
    sel = spec.selection
    if "compare" not in sel.model_fields_set or spec.search.algorithm == "optuna":
        return
    configs = _trials(spec)
    for j, item in enumerate(sel.compare):
        if item == "baseline" and not any("epsilon" in c and c["epsilon"] is None for c in configs):
            raise SpecError(f"selection.compare[{j}]: baseline needs a non-private trial (epsilon: null) in the "
                            "sweep; add one or remove baseline")
        if isinstance(item, CompareItem):
            for side in ("a", "b"):
                where = getattr(item, side)
                if not any(reference_matches(where, c) for c in configs):
                    raise SpecError(f"selection.compare[{j}].{side}: {short_repr(where)} matches no trial of the "
                                    "sweep (name a configuration by its configured values)")


def _check_scheduler(spec: SweepSpec) -> None:
    sch = spec.scheduler
    if sch.type != "asha":
        return
    names = [*PER_EPOCH_METRICS, *EPOCH_COUNTERPARTS]
    known = ", ".join(PER_EPOCH_METRICS) + "; or " + ", ".join(f"{k} (compared as {v})" for k, v in EPOCH_COUNTERPARTS.items())
    if sch.metric is None:
        raise SpecError(f"scheduler.metric: required for scheduler.type asha (a per-epoch metric: {known})")
    if sch.metric not in names:
        raise SpecError(f"scheduler.metric: asha compares per-epoch metrics ({known}), got {sch.metric!r}; "
                        f"a metric reported once per trial has no value at ASHA's rungs"
                        f"{did_you_mean(sch.metric, names)}")
    better = PER_EPOCH_METRICS[scheduler_metric(sch.metric)]
    if sch.mode != better:
        raise SpecError(f"scheduler.mode: {sch.metric} is better when {'lower' if better == 'min' else 'higher'}; "
                        f"use {better}, got {sch.mode!r}")


def _scheduler_warnings(spec: SweepSpec) -> list[str]:
    sch = spec.scheduler
    if sch.type == "none" or not sch.metric or sch.metric not in EPOCH_COUNTERPARTS:
        return []
    return [f"scheduler.metric: {sch.metric} is reported once, at the end of a trial; {sch.type} compares its "
            f"per-epoch counterpart {scheduler_metric(sch.metric)} at each rung"]


def _check_resources(spec: SweepSpec) -> None:
    for key in ("cpu", "gpu"):
        value = getattr(spec.resources, key)
        if isinstance(value, (int, float)) and value > 1 and value != int(value):
            raise SpecError(f"resources.{key}: above 1 must be a whole number (Ray), got {value:g}")


def _build_spaces(spec: SweepSpec) -> tuple[TrainableSpace, ...]:
    for i, t in enumerate(spec.trainables):
        check_trainable_name(i, t.name)
    check_common(spec.common, [t.name for t in spec.trainables])
    return tuple(build_space(i, t.name, t.search, spec.common, spec.search.algorithm)
                 for i, t in enumerate(spec.trainables))


def _trials(spec: SweepSpec) -> list[dict]:
    """The cached expansion of a grid/random spec (computed once; validated specs are frozen)."""
    if spec._trials is None:
        n, seed = spec.search.num_samples, spec.search.seed
        repeat_seeds = True
        if spec.tuning_privacy is not None:
            from sweeps.spec.tuning import draw_k, draws_seed

            # K trials, each drawn independently from the spec's distributions, from the sweep's secret
            # (before ``dpsweep run`` binds it, e.g. at validate: from a throw-away one). Every candidate
            # keeps the configured public seed (initialisation, augmentation, data subsets): a public seed
            # per candidate index would let the released weights name their candidate, hence a lower bound
            # on K (issue 48.1). The research mode keeps per-repeat seeds: its noise follows the seed.
            n, seed = draw_k(spec), draws_seed(spec)
            repeat_seeds = spec.reproducible_noise
        spec._trials = expand(spec.spaces, n, seed, repeat_seeds=repeat_seeds)
    return spec._trials


def _space_configs(spec: SweepSpec) -> list[tuple[TrainableSpace, list[dict]]]:
    """Each trainable's space with its trial configs (grid/random) or probe configs (Optuna)."""
    if spec.search.algorithm == "optuna":
        return [(sp, sp.probes()) for sp in spec.spaces]
    trials = _trials(spec)
    return [(sp, [c for c in trials if c["trainable"] == sp.name]) for sp in spec.spaces]


def _check_metrics(spec: SweepSpec) -> None:
    """search.metric, each objective and a scheduler's metric outside the per-epoch ones must be
    reported by every trial (or, for Optuna, by every probe config of the space)."""
    s = spec.search
    wanted = [("search.metric", s.metric)] if s.metric else []
    wanted += [(f"search.objectives[{j}].metric", o.metric) for j, o in enumerate(s.objectives)]
    sch = spec.scheduler
    if sch.type != "none" and sch.metric and scheduler_metric(sch.metric) not in PER_EPOCH_METRICS:
        wanted.append(("scheduler.metric", sch.metric))
    selecting = wanted + ([("scheduler.metric", scheduler_metric(sch.metric))] if sch.type != "none" and sch.metric else [])
    if not selecting:
        return
    configs = [c for _, cs in _space_configs(spec) for c in cs]
    for path, metric in selecting:  # never a non-private diagnostic of a private trial
        check_not_diagnostic(metric, path, configs)
    for path, metric in wanted:
        check_metric(metric, path, configs)


def _check_certify_images(spec: SweepSpec) -> None:
    """``certify_images`` written in a spec (a trainable's search, or common) where no trial of
    that trainable runs a certifier is refused: it would be ignored. A trainable runs one when
    its schema ``certifier_uses(certifier)`` (its own certificate, or randomized smoothing).
    ``certify_images`` in common is refused only when it reaches no trainable that certifies
    (a spec comparing PixelDP with DP-SGD sets it once for PixelDP); 0 and the default are silent."""
    common_reaches_a_certifier = False
    common_given = "certify_images" in spec.common
    for space, configs in _space_configs(spec):
        model = space.model
        certifying = any(model.certifier_uses(c.get("certifier", "default")) for c in configs)
        asked = any((c.get("certify_images") or 0) > 0 for c in configs)
        dim = next((d for d in space.dims if d.key == "certify_images"), None)
        if dim is not None:
            if asked and not certifying:
                certifier = configs[0].get("certifier", "default") if configs else "default"
                raise SpecError(f"{dim.path}: trainable {space.name!r} runs no certifier with certifier "
                                f"{certifier!r} ({_no_certifier_reason(model)}); certify_images would be ignored, "
                                f"remove it")
        elif common_given and certifying:
            common_reaches_a_certifier = True
    if common_given and (spec.common.get("certify_images") or 0) > 0 and not common_reaches_a_certifier:
        without = [sp for sp in spec.spaces if not any(d.key == "certify_images" for d in sp.dims)]
        if without:
            names = ", ".join(dict.fromkeys(repr(sp.name) for sp in without))
            raise SpecError(f"common.certify_images: no trial of {names} runs a certifier "
                            f"({_no_certifier_reason(without[0].model)}); certify_images would be ignored, remove it")


def _no_certifier_reason(model) -> str:
    if model.has_certificate:
        return "its own certificate is off"
    return "it has no certificate of its own; certifier: smoothing needs a model with Gaussian input noise"


SUBSETS = (("train_size", "train", "training"), ("test_size", "test", "test"))


def _check_subset_sizes(spec: SweepSpec) -> None:
    """``train_size`` and ``test_size`` of every trial (every Optuna probe config) are at most the
    examples of the dataset's split: the named datasets' sizes are known without their files, a
    loader's are those of the tensors it returned (it was called once while its ``dataset`` value
    was checked). A subset larger than its split would fail every trial once Ray and MLflow had
    started (``subset_indices``); here it is one line naming the key, the value and the size."""
    from dpmech.datasets.splits import is_custom, split_size

    for space, configs in _space_configs(spec):
        for c in configs:
            dataset = c.get("dataset", "mnist")
            for key, split, words in SUBSETS:
                n = c.get(key)
                if n is None:
                    continue
                total = split_size(dataset, split)
                if n <= total:
                    continue
                where, default = _value_path(spec, space, key, n), ""
                if where is None:
                    where, default = f"common.{key}", " (the default)"
                source = (f"that loader {dataset!r} returned" if is_custom(dataset)
                          else f"of {dataset!r}")
                raise SpecError(f"{where}: {n}{default} is more than the {total} {words} images {source}; "
                                f"set {key} to at most {total} (or null for all of them)")
            _check_certify_size(spec, space, c, dataset)


def _check_certify_size(spec: SweepSpec, space, c: dict, dataset: str) -> None:
    """``certify_images`` at most the images each evaluation reads (issue 51.5): ``test_size`` (or the
    whole test split), or with ``selection.split: test_half`` the smaller of its two parts (both are
    certified). A written value is refused like every oversized subset, where a certifier runs (it was
    silently capped); the default, 500, means "up to 500" and certifies all of fewer images."""
    from dpmech.datasets.splits import split_size

    asked = c.get("certify_images")
    model = REGISTRY[space.name].config_model if space.name in REGISTRY else None
    if not asked or model is None or "certify_images" not in model.model_fields:
        return
    if not model.certifier_uses(c.get("certifier", "default")):
        return
    n = c.get("test_size") or split_size(dataset, "test")
    limit, words = n, f"the {n} evaluation images (test_size)"
    if c.get("selection_split") == "test_half":
        k = c.get("selection_size") or n // 2
        limit, words = min(k, n - k), f"the {min(k, n - k)} images of the smaller half of test_half's {n} (test_size)"
    if asked <= limit:
        return
    where = _value_path(spec, space, "certify_images", asked)
    if where is None:   # the default (500): it certifies every evaluation image when there are fewer (docs/specs.md)
        return
    raise SpecError(f"{where}: {asked} is more than {words}; set certify_images to at most {limit}, or raise "
                    "test_size")


def _value_path(spec: SweepSpec, space, key: str, value) -> str | None:
    """Where the spec writes ``value`` for ``key`` of ``space``'s trials: the search value (a grid's or
    range's item), else ``common.<key>``; None when the value is the schema's default."""
    dim = next((d for d in space.dims if d.key == key), None)
    if dim is not None:
        return next((path for path, v in dim.candidate_paths() if v == value), dim.path)
    if key in spec.common:
        return f"common.{key}"
    return None


def _planned_train_size(config: dict) -> int:
    """N of the delta rule: the planned training-set size (train_size, or the full split) plus the
    audit canaries (at most that many join the training set)."""
    n = config.get("train_size")
    if n is None:
        from dpmech.datasets.splits import train_split_size

        n = train_split_size(config.get("dataset", "mnist"))
    from trainables.config import validation_images

    n = int(n) - validation_images(config)  # a validation split is held back from training
    from trainables.mia_config import expected_members   # a membership attack's members join it too

    return (int(n) + int(config.get("audit_canaries") or 0) + int((config.get("audit") or {}).get("canaries") or 0)
            + expected_members(config))


def _delta_warnings(spec: SweepSpec) -> list[str]:
    """The delta rule for guarantees about the training data: delta >= 1/N (N the planned
    training-set size) gets a warning (such a guarantee allows a mechanism that publishes one
    training example outright). delta > 0.1 is refused by the schemas (``privacy_delta_key``).
    PixelDP's delta (and SecureSGD's robustness_delta) are robustness parameters: not covered."""
    out: list[str] = []
    for space, configs in _space_configs(spec):
        key = space.model.privacy_delta_key
        if key is None:
            continue
        dim = next((d for d in space.dims if d.key == key), None)
        where = dim.path if dim is not None else (f"common.{key}" if key in spec.common else
                                                  f"{space.path} (default {key})")
        seen = set()
        for c in configs:
            if c.get("epsilon", 1.0) is None:  # a non-private baseline: no guarantee
                continue
            delta, n = c.get(key), _planned_train_size(c)
            if delta is None or delta < 1.0 / n or (delta, n) in seen:
                continue
            seen.add((delta, n))
            out.append(f"{where}: delta {delta:g} >= 1/N = {1.0 / n:.3g} (N = {n} planned training examples of "
                       f"{space.name!r}): an (epsilon, delta) guarantee with delta >= 1/N allows releasing a training "
                       f"example outright; choose delta < 1/N")
    return out


def _model_warnings(spec: SweepSpec) -> list[str]:
    """A user's model that the DP-SGD engine trains with layers replaced (BatchNorm with affine
    parameters -> GroupNorm, ``make_private_compatible``): one warning per model and dataset
    (trainables.config.user_model_warnings)."""
    from trainables.config import user_model_warnings

    out: list[str] = []
    for space, configs in _space_configs(spec):
        dim = next((d for d in space.dims if d.key == "model"), None)
        where = dim.path if dim is not None else ("common.model" if "model" in spec.common else f"{space.path}.model")
        for c in configs:
            for line in user_model_warnings(space.model, c):
                if f"{where}: {line}" not in out:
                    out.append(f"{where}: {line}")
    return out


def reference_matches(where: dict, config: dict) -> bool:
    """A trial config matches a ``reference`` point when every key of ``where`` equals the
    trial's configured value (numbers compared to a relative 1e-9, so 0.2 matches 0.2000000001)."""
    for key, want in where.items():
        if key not in config:
            return False
        got = config[key]
        if isinstance(want, (int, float)) and isinstance(got, (int, float)) \
                and not isinstance(want, bool) and not isinstance(got, bool):
            if not math.isclose(float(want), float(got), rel_tol=1e-9, abs_tol=1e-12):
                return False
        elif want != got:
            return False
    return True


def _check_reference(spec: SweepSpec) -> None:
    """reference.points[j]: ``where`` names the trainable or keys of its config (of every trainable
    it may match); on a grid/random sweep it matches at least one trial; each metric is reported
    by every trial it matches (by every probe config of an Optuna space)."""
    ref = spec.reference
    if ref is None:
        return
    names = [t.name for t in spec.trainables]
    configs = _trials(spec) if spec.search.algorithm != "optuna" else [c for sp in spec.spaces for c in sp.probes()]
    for j, point in enumerate(ref.points):
        path = f"reference.points[{j}]"
        wanted = point.where.get("trainable")
        if wanted is not None and wanted not in names:
            raise SpecError(f"{path}.where.trainable: {short_repr(wanted)} is not a trainable of this spec "
                            f"({', '.join(names)}){did_you_mean(wanted, names)}")
        candidates = [wanted] if wanted is not None else list(dict.fromkeys(names))
        for key in point.where:
            if key == "trainable":
                continue
            owners = [n for n in candidates if key in REGISTRY[n].config_model.model_fields]
            if not owners:
                fields = set().union(*(REGISTRY[n].config_model.model_fields for n in candidates))
                raise SpecError(f"{path}.where.{key}: not a config key of {' or '.join(map(repr, candidates))}"
                                f"{did_you_mean(key, fields)} (where holds configured values: trainable "
                                f"and that trainable's config keys)")
        for metric, value in point.metrics.items():
            if not math.isfinite(value):
                raise SpecError(f"{path}.metrics.{metric}: must be a finite number, got {value!r}")
        matched = [c for c in configs if reference_matches(point.where, c)]
        if spec.search.algorithm != "optuna" and not matched:
            shown = ", ".join(f"{k}={short_repr(v, 30)}" for k, v in point.where.items())
            raise SpecError(f"{path}.where: no trial of the sweep has {shown} (a point must name configured "
                            f"values of at least one trial)")
        for metric in point.metrics:
            _check_reference_metric(metric, f"{path}.metrics.{metric}",
                                    matched or [c for c in configs if c["trainable"] in candidates])


# A published value that averages a metric over the attacks (the DPAL paper's "on average" over
# FGSM, I-FGSM, MIM and MadryEtAl): the report computes it from the acc_<attack>_<size> metrics.
MEAN_OVER_ATTACKS = re.compile(r"acc_attack_mean_(.+)")


def _check_reference_metric(metric: str, path: str, configs: list[dict]) -> None:
    """A reference metric is a metric every matched trial reports, or ``acc_attack_mean_<size>``:
    the mean of ``acc_<attack>_<size>`` over the attacks each matched trial runs at that size."""
    m = MEAN_OVER_ATTACKS.fullmatch(metric)
    if m is None:
        check_metric(metric, path, configs)
        return
    size = m.group(1)
    for cfg in configs:
        if not any(size in (format_size(s) for s in sizes) for sizes in (cfg.get("attacks") or {}).values()):
            raise SpecError(f"{path}: {metric!r} averages acc_<attack>_{size} over the attacks, but a trial of "
                            f"{cfg['trainable']!r} runs no attack at size {size} (attacks)")


def validate_spec(raw: dict) -> SweepSpec:
    """Validate a spec mapping (as loaded from YAML, overrides applied); ``SpecError`` names the
    first problem. Checks, in order: the sections, the rules between them, common, each
    trainable's search, every trial (grid/random) or probe config (optuna), the subset sizes
    against the dataset's splits, the metric names."""
    if not isinstance(raw, dict):
        raise SpecError(f"spec: must be a mapping of spec keys (name, trainables, ...), got {type(raw).__name__}")
    try:
        spec = SweepSpec.model_validate(copy.deepcopy(raw))
    except ValidationError as exc:
        raise _section_error(exc) from None
    _check_search(spec)
    _check_selection(spec)
    _check_scheduler(spec)
    _check_resources(spec)
    if spec.tuning_privacy is not None:
        from sweeps.spec.tuning import check_tuning_spec

        check_tuning_spec(spec)
    spec._spaces = _build_spaces(spec)
    if spec.tuning_privacy is not None:
        from sweeps.spec.tuning import calibrate_to_target, check_tuning_space

        check_tuning_space(spec)
        if spec.tuning_privacy.target_epsilon is not None:
            calibrate_to_target(spec)   # sets the trainable's epsilon
            spec._spaces = _build_spaces(spec)
            check_tuning_space(spec)
    if spec.search.algorithm == "optuna":
        for space in spec.spaces:
            space.probes()  # the combinations validate (model-level rules)
    else:
        _trials(spec)
    _check_subset_sizes(spec)
    if spec.tuning_privacy is not None:
        from sweeps.spec.tuning import check_tuning_guarantee

        check_tuning_guarantee(spec)    # a finite end-to-end epsilon, at most the target
    _check_metrics(spec)
    _check_certify_images(spec)
    _check_reference(spec)
    _check_compare(spec)
    spec._warnings = _delta_warnings(spec) + _scheduler_warnings(spec) + _model_warnings(spec)
    spec._raw = copy.deepcopy(raw)
    return spec


# --------------------------------------------------------------------------- what the runner uses


def expand_trials(spec: SweepSpec) -> list[dict]:
    """Every trial of a grid/random spec as a flat, fully resolved config:
    ``{"trainable": name, **every schema key}`` (defaults explicit).

    Trainables in spec order; for each, ``num_samples`` repeats of the grid in row-major order of
    the keys as written, choices and ranges drawn from ``numpy.random.default_rng(search.seed)``.
    The same spec always gives the same list. The list is a fresh copy on every call.
    """
    if spec.search.algorithm == "optuna":
        raise SpecError("search.algorithm: optuna proposes its trials while the sweep runs; there is no list to expand")
    return copy.deepcopy(_trials(spec))


def ray_param_space(spec: SweepSpec) -> dict:
    """The Tuner's ``param_space``.

    grid/random: ``{"trial": tune.grid_search(expand_trials(spec))}`` (one Ray trial per
    expanded config; ``trainables.dispatch`` unwraps it). optuna: the trainable's flat space,
    ``{"trainable": name, **common, <key>: fixed value or tune domain}``; a grid becomes
    ``tune.choice``, uniform/loguniform ``tune.uniform``/``tune.loguniform`` (``tune.randint`` /
    ``tune.lograndint`` with inclusive bounds for integer keys).
    """
    from ray import tune

    if spec.search.algorithm != "optuna":
        return {"trial": tune.grid_search(expand_trials(spec))}
    return spec.spaces[0].ray_space()


def spec_to_flat_params(spec: SweepSpec) -> dict[str, str]:
    """The raw spec flattened for MLflow params: ``{"trainables.0.search.epsilon": "[0.5, 1.0]"}``.

    Mappings and lists holding mappings or lists are walked (list items by index); other
    values are leaves, written as the string itself or JSON (``null``, ``true``, ``[0.5, 1.0]``),
    truncated to 500 characters. One resolved value is added: ``attack_labels``, the labels the
    trials' attacks use (``true``, ``predicted`` or both, comma-separated; docs/metrics.md), written
    or not.
    """
    out: dict[str, str] = {}

    def leaf(value) -> str:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        return text[:PARAM_VALUE_LIMIT]

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(node, list) and any(isinstance(x, (dict, list)) for x in node):
            for j, v in enumerate(node):
                walk(f"{prefix}.{j}", v)
        else:
            out[prefix] = leaf(node)

    walk("", spec.raw)
    labels = {str(c.get("attack_labels", "true")) for _, configs in _space_configs(spec) for c in configs}
    out["attack_labels"] = ", ".join(sorted(labels))
    return out
