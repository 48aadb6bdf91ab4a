"""Sweep specs: YAML files that declare what to run (docs/specs.md has the full reference).

``load_spec(path, overrides)`` reads a spec with ``yaml.safe_load``, applies ``--set key=value``
overrides and validates everything before Ray starts: the spec's own sections (pydantic) and
every candidate value of every trainable parameter (through that trainable's config schema).
Any problem raises ``SpecError`` with one line ``<field path>: <rule>``, for example
``trainables[0].search.epsilon[2]: must be > 0``.

``expand_trials`` turns a grid/random spec into the exact list of flat trial configs
(deterministic: the random draws come from ``search.seed``); ``ray_param_space`` gives the
Ray Tune ``param_space`` for any algorithm.
"""

from __future__ import annotations

import difflib
import itertools
import math
import typing
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from trainables.registry import REGISTRY

DISTRIBUTIONS = ("grid", "choice", "uniform", "loguniform")


class SpecError(ValueError):
    """An invalid spec: the message is one line naming the field path and the rule."""


# --------------------------------------------------------------------------- the spec's sections


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class MlflowSection(_Section):
    experiment: str | None = None
    tracking_uri: str | None = None


class TrainableSection(_Section):
    name: str
    search: dict[str, Any] = Field(default_factory=dict)


class Objective(_Section):
    metric: str
    mode: Literal["min", "max"]


class SearchSection(_Section):
    algorithm: Literal["grid", "random", "optuna"] = "grid"
    num_samples: int = Field(1, ge=1)
    seed: int = Field(0, ge=0)
    metric: str | None = None
    mode: Literal["min", "max"] | None = None
    objectives: list[Objective] = Field(default_factory=list)


class SchedulerSection(_Section):
    type: Literal["none", "asha"] = "none"
    metric: str | None = None
    mode: Literal["min", "max"] = "max"
    grace_period: int = Field(1, ge=1)
    reduction_factor: int = Field(2, ge=2)


class Resources(_Section):
    cpu: float = Field(1.0, gt=0)
    gpu: float = Field(0.0, ge=0)


class FailureSection(_Section):
    max_retries: int = Field(0, ge=0)


class SweepSpec(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    storage: str | None = None
    mlflow: MlflowSection = Field(default_factory=MlflowSection)
    common: dict[str, Any] = Field(default_factory=dict)
    trainables: list[TrainableSection] = Field(min_length=1)
    search: SearchSection = Field(default_factory=SearchSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    resources: Resources = Field(default_factory=Resources)
    max_concurrent_trials: int | None = Field(None, ge=1)
    failure: FailureSection = Field(default_factory=FailureSection)

    _raw: dict = PrivateAttr(default_factory=dict)

    @property
    def raw(self) -> dict:
        """The spec as written (after overrides), for logging as an artifact."""
        return self._raw


_SECTIONS: dict[str, type[BaseModel]] = {
    "mlflow": MlflowSection, "trainables": TrainableSection, "search": SearchSection, "objectives": Objective,
    "scheduler": SchedulerSection, "resources": Resources, "failure": FailureSection,
}


# --------------------------------------------------------------------------- error messages


def _path(loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _did_you_mean(key: str, options) -> str:
    close = difflib.get_close_matches(str(key), [str(o) for o in options], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _rule(err: dict, allowed_keys=None) -> str:
    """A short rule for one pydantic error."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "extra_forbidden":
        return "unknown key" + (_did_you_mean(err["loc"][-1], allowed_keys) if allowed_keys else "")
    if kind == "missing":
        return "required"
    if kind == "greater_than":
        return f"must be > {ctx['gt']:g}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx['ge']:g}"
    if kind == "less_than":
        return f"must be < {ctx['lt']:g}"
    if kind == "less_than_equal":
        return f"must be <= {ctx['le']:g}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}; got {value!r}"
    if kind in ("float_type", "float_parsing", "finite_number"):
        return f"must be a finite number, got {value!r}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"must be an integer, got {value!r}"
    if kind == "string_type":
        return f"must be a string, got {value!r}"
    if kind in ("dict_type", "model_type"):
        return f"must be a mapping, got {value!r}"
    if kind == "list_type":
        return f"must be a list, got {value!r}"
    if kind == "too_short":
        return "must not be empty"
    if kind == "string_pattern_mismatch":
        return f"must match {ctx.get('pattern')}, got {value!r}"
    return err["msg"].removeprefix("Value error, ")


def _section_keys(loc) -> list[str] | None:
    """The keys allowed where an unknown key was found."""
    names = [p for p in loc[:-1] if isinstance(p, str)]
    cls = _SECTIONS.get(names[-1]) if names else SweepSpec
    return list(cls.model_fields) if cls else None


def _from_validation(exc: ValidationError, prefix: str = "", allowed=None) -> SpecError:
    errors = exc.errors()
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])  # a typo explains the rest
    loc = err["loc"]
    keys = allowed if allowed is not None else _section_keys(loc)
    path = _path(loc)
    if prefix:
        path = prefix + (("." + path) if path and not path.startswith("[") else path)
    return SpecError(f"{path}: {_rule(err, keys)}")


# --------------------------------------------------------------------------- loading


def _set_path(raw: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node: Any = raw
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise SpecError(f"--set {dotted}: {where} is not an index of a list of {len(node)}")
            idx = int(part)
            if last:
                node[idx] = value
            else:
                node = node[idx]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise SpecError(f"--set {dotted}: {'.'.join(parts[:i])} is a value, not a section")


def apply_overrides(raw: dict, overrides) -> dict:
    """Apply ``key.path=value`` overrides (values parsed as YAML) to a copy of ``raw``."""
    import copy

    raw = copy.deepcopy(raw)
    for item in overrides or ():
        if not isinstance(item, str) or "=" not in item:
            raise SpecError(f"--set {item!r}: expected KEY=VALUE")
        key, text = item.split("=", 1)
        key = key.strip()
        if not key or any(not p for p in key.split(".")):
            raise SpecError(f"--set {item!r}: empty key")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as exc:
            raise SpecError(f"--set {key}: value is not valid YAML ({str(exc).splitlines()[0]})") from None
        _set_path(raw, key, value)
    return raw


def load_spec(path: str | Path, overrides=()) -> SweepSpec:
    """Read, override and validate a spec file."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"spec: file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"spec: {path}{where}: invalid YAML ({problem})") from None
    if not isinstance(raw, dict):
        raise SpecError(f"spec: {path} must hold a mapping of sections, got {type(raw).__name__}")
    return validate_spec(apply_overrides(raw, overrides))


# --------------------------------------------------------------------------- dimensions


def _is_container(field) -> bool:
    ann = field.annotation
    origin = typing.get_origin(ann)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return any(typing.get_origin(a) in (list, dict) or a in (list, dict) for a in typing.get_args(ann))
    return origin in (list, dict) or ann in (list, dict)


def _is_numeric(field) -> bool:
    ann = field.annotation
    args = typing.get_args(ann) or (ann,)
    return any(a in (float, int) for a in args)


def parse_dimension(value, field) -> tuple[str, Any]:
    """(kind, payload): kind in fixed / grid / choice / uniform / loguniform."""
    if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in DISTRIBUTIONS:
        kind, payload = next(iter(value.items()))
        return kind, payload
    if isinstance(value, list) and not _is_container(field):
        return "grid", value
    return "fixed", value


def _candidates(kind: str, payload, where: str):
    """(suffix, value) pairs that must each validate."""
    if kind == "fixed":
        return [("", payload)]
    if kind in ("grid", "choice"):
        if not isinstance(payload, list):
            raise SpecError(f"{where}: {kind} must be a list of values")
        if not payload:
            raise SpecError(f"{where}: must not be empty")
        return [(f"[{j}]" if kind == "grid" else f".choice[{j}]", val) for j, val in enumerate(payload)]
    if not (isinstance(payload, list) and len(payload) == 2):
        raise SpecError(f"{where}.{kind}: must be a pair [low, high]")
    return [(f".{kind}[0]", payload[0]), (f".{kind}[1]", payload[1])]


def _schema_error(schema, base: dict, key: str, value, where: str) -> None:
    try:
        schema(**{**base, key: value})
    except ValidationError as exc:
        errs = [e for e in exc.errors() if e["loc"] and e["loc"][0] == key] or exc.errors()
        err = errs[0]
        sub = _path(err["loc"][1:])
        raise SpecError(f"{where}{('.' + sub) if sub and not sub.startswith('[') else sub}: {_rule(err)}") from None


def _check_trainable(i: int, section: TrainableSection, common: dict, algorithm: str) -> None:
    if section.name not in REGISTRY:
        raise SpecError(f"trainables[{i}].name: unknown trainable {section.name!r}{_did_you_mean(section.name, REGISTRY)}; "
                        f"known: {', '.join(REGISTRY)}")
    schema = REGISTRY[section.name].config_model
    fields = schema.model_fields
    for key in common:
        if key not in fields:
            raise SpecError(f"common.{key}: unknown key for trainable {section.name!r}{_did_you_mean(key, fields)}")
    try:
        schema(**common)
    except ValidationError as exc:
        raise _from_validation(exc, "common", allowed=list(fields)) from None
    for key, value in section.search.items():
        where = f"trainables[{i}].search.{key}"
        if key not in fields:
            raise SpecError(f"{where}: unknown key{_did_you_mean(key, fields)}")
        kind, payload = parse_dimension(value, fields[key])
        if kind == "grid" and isinstance(value, dict):
            where_grid = where + ".grid"
        else:
            where_grid = where
        cands = _candidates(kind, payload, where_grid if kind in ("grid",) else where)
        if kind in ("uniform", "loguniform"):
            if algorithm == "grid":
                raise SpecError(f"{where}: {kind} needs search.algorithm random or optuna (a grid cannot sample)")
            if not _is_numeric(fields[key]) or _is_container(fields[key]):
                raise SpecError(f"{where}: {kind} needs a numeric key")
            lo, hi = payload
            for v in (lo, hi):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise SpecError(f"{where}.{kind}: bounds must be finite numbers, got {v!r}")
            if not lo < hi:
                raise SpecError(f"{where}.{kind}: low must be < high, got [{lo}, {hi}]")
            if kind == "loguniform" and lo <= 0:
                raise SpecError(f"{where}.{kind}: low must be > 0, got {lo}")
        for suffix, cand in cands:
            base = where_grid if suffix.startswith("[") else where
            _schema_error(schema, common, key, cand, base + suffix)


def validate_spec(raw: dict) -> SweepSpec:
    """Validate a raw spec mapping; SpecError on the first problem."""
    if not isinstance(raw, dict):
        raise SpecError(f"spec: must be a mapping, got {type(raw).__name__}")
    try:
        spec = SweepSpec(**raw)
    except ValidationError as exc:
        raise _from_validation(exc) from None
    spec._raw = raw
    s = spec.search
    if s.algorithm == "optuna":
        if len(spec.trainables) != 1:
            raise SpecError("search.algorithm: optuna needs exactly one trainable (each mechanism has its own space); "
                            "run one sweep per mechanism or use grid/random")
        if not s.objectives and not (s.metric and s.mode):
            raise SpecError("search.metric: optuna needs search.metric and search.mode, or search.objectives")
    if spec.scheduler.type == "asha" and not spec.scheduler.metric:
        raise SpecError("scheduler.metric: required for asha (a per-epoch metric such as test_acc)")
    for i, section in enumerate(spec.trainables):
        _check_trainable(i, section, spec.common, s.algorithm)
    if s.algorithm != "optuna":
        expand_trials(spec)  # validates every combination
    return spec


# --------------------------------------------------------------------------- expansion


def _dimensions(section: TrainableSection):
    fields = REGISTRY[section.name].config_model.model_fields
    fixed, grids, samples = {}, [], []
    for key, value in section.search.items():
        kind, payload = parse_dimension(value, fields[key])
        if kind == "fixed":
            fixed[key] = payload
        elif kind == "grid":
            grids.append((key, payload))
        else:
            samples.append((key, kind, payload))
    return fixed, grids, samples


def _draw(rng: np.random.Generator, kind: str, payload):
    if kind == "choice":
        return payload[int(rng.integers(len(payload)))]
    lo, hi = float(payload[0]), float(payload[1])
    if kind == "uniform":
        return float(rng.uniform(lo, hi))
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def expand_trials(spec: SweepSpec) -> list[dict]:
    """Every trial of a grid/random spec as a flat, fully resolved config (defaults explicit)."""
    rng = np.random.default_rng(spec.search.seed)
    trials = []
    for i, section in enumerate(spec.trainables):
        schema = REGISTRY[section.name].config_model
        fixed, grids, samples = _dimensions(section)
        keys = [k for k, _ in grids]
        for _ in range(spec.search.num_samples):
            for combo in itertools.product(*(vals for _, vals in grids)):
                cfg = {**spec.common, **fixed, **dict(zip(keys, combo))}
                cfg.update({k: _draw(rng, kind, payload) for k, kind, payload in samples})
                try:
                    model = schema(**cfg)
                except ValidationError as exc:
                    raise _from_validation(exc, f"trainables[{i}].search", allowed=list(schema.model_fields)) from None
                trials.append({"trainable": section.name, **model.model_dump()})
    return trials


def ray_param_space(spec: SweepSpec) -> dict:
    """The Tuner's param_space: the pre-expanded trials for grid/random, Ray domains for optuna."""
    from ray import tune

    if spec.search.algorithm != "optuna":
        return {"trial": tune.grid_search(expand_trials(spec))}
    section = spec.trainables[0]
    fixed, grids, samples = _dimensions(section)
    space: dict[str, Any] = {"trainable": section.name, **spec.common, **fixed}
    for key, values in grids:
        space[key] = tune.choice(values)  # Optuna has no grid; a list is a categorical choice
    for key, kind, payload in samples:
        if kind == "choice":
            space[key] = tune.choice(payload)
        elif kind == "uniform":
            space[key] = tune.uniform(float(payload[0]), float(payload[1]))
        else:
            space[key] = tune.loguniform(float(payload[0]), float(payload[1]))
    return space


def spec_to_flat_params(spec: SweepSpec) -> dict[str, str]:
    """The raw spec flattened to ``a.b.0.c -> str`` for MLflow params (values up to 500 chars)."""
    out: dict[str, str] = {}

    def walk(prefix: str, node):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(node, list) and node and any(isinstance(x, (dict, list)) for x in node):
            for j, v in enumerate(node):
                walk(f"{prefix}.{j}", v)
        else:
            out[prefix] = str(node)[:500]

    walk("", spec.raw)
    return out
