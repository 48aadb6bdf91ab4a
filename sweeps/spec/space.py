"""The parameter space of each trainable in a sweep spec, and the error form of spec validation.

This is the lower layer of ``sweeps.spec`` (import the public names from there). It knows the
trainables' config schemas (``trainables.registry``) but nothing about the spec's other sections:

* ``SpecError`` and the helpers that turn a pydantic error into one line ``<path>: <rule>``;
* ``Dimension``: one key of a trainable's ``search`` mapping, parsed into a fixed value, a grid,
  a choice or a range (``uniform`` / ``loguniform``), with every candidate value checked against
  the trainable's schema;
* ``TrainableSpace``: a trainable's common values and dimensions; it counts, expands and samples
  trials, and gives the Ray Tune domains for Optuna;
* ``reported_metrics``: the final metric names a trial config reports (docs/metrics.md), used to
  check ``search.metric`` and ``search.objectives`` before anything runs.

Ray is imported only by ``TrainableSpace.ray_space``.
"""

from __future__ import annotations

import copy
import difflib
import itertools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from trainables.registry import REGISTRY

DISTRIBUTIONS = ("grid", "choice", "uniform", "loguniform")
RANGES = ("uniform", "loguniform")
# A grid/random spec is expanded in full before Ray starts; past this it is almost surely a mistake.
MAX_TRIALS = 10_000

# Final metrics every trial reports (docs/metrics.md); a trainable's own are in its registry entry.
GENERIC_METRICS = ("acc_clean", "epsilon", "delta", "compute_seconds", "not_learned")
# Metrics reported after every epoch (what an early-stopping scheduler can compare), and the
# direction in which each is better. train_loss is a non-private diagnostic: refused for private
# trials (check_not_diagnostic).
PER_EPOCH_METRICS = {"train_loss": "min", "test_acc": "max"}
# Final metrics with a per-epoch counterpart: an early-stopping scheduler asked for the final one
# compares the counterpart at its rungs (acc_clean is the clean test accuracy; test_acc measures
# the same after every epoch, with one noise draw per example for randomized models).
EPOCH_COUNTERPARTS = {"acc_clean": "test_acc"}


def scheduler_metric(metric: str) -> str:
    """The per-epoch metric an early-stopping scheduler compares for ``metric``."""
    return EPOCH_COUNTERPARTS.get(metric, metric)


# --------------------------------------------------------------------------- errors


class SpecError(ValueError):
    """An invalid spec or override. The message is one line: ``<field path>: <rule>``."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def did_you_mean(word, options: Iterable) -> str:
    """`` (did you mean 'x'?)`` for the closest option, or ``""``."""
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def join_path(prefix: str, loc: Iterable) -> str:
    """``prefix`` followed by a pydantic location: ``("a", 0, "b")`` -> ``prefix.a[0].b``."""
    out = prefix
    for part in loc:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def pydantic_rule(err: dict) -> str:
    """The rule broken by one pydantic error, as a short phrase (no path)."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    got = f", got {short_repr(value)}"
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return "unknown key"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        op, bound = {"greater_than": (">", "gt"), "greater_than_equal": (">=", "ge"),
                     "less_than": ("<", "lt"), "less_than_equal": ("<=", "le")}[kind]
        return f"must be {op} {_number(ctx[bound])}{got}"
    if kind == "literal_error":
        expected = str(ctx.get("expected", ""))
        head, sep, tail = expected.rpartition(" or ")
        return f"must be one of {head + ', ' + tail if sep else expected}; got {short_repr(value)}"
    if kind in ("float_type", "float_parsing"):
        hint = ""
        if isinstance(value, str):
            try:
                float(value)
                hint = f" (YAML reads {value.strip()} as a string: write {yaml_float(value)})"
            except ValueError:
                pass
        return f"must be a number{got}{hint}"
    if kind == "finite_number":
        return f"must be a finite number{got}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"must be an integer{got}"
    if kind in ("bool_type", "bool_parsing"):
        return f"must be true or false{got}"
    if kind == "string_type":
        return f"must be a string{got}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"must be a mapping{got}"
    if kind in ("list_type", "tuple_type"):
        return f"must be a list{got}"
    if kind in ("too_short", "string_too_short"):
        return "must not be empty" if ctx.get("min_length") in (1, None) else \
            f"must have at least {ctx['min_length']} items"
    if kind == "string_pattern_mismatch":
        return f"must match {ctx.get('pattern')}{got}"
    msg = str(err.get("msg", kind))
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    return msg


def first_error(exc: ValidationError) -> dict:
    """The error to report: an unknown key first (a typo explains the errors that follow it)."""
    errors = exc.errors()
    return next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])


# --------------------------------------------------------------------------- schema fields


def union_members(annotation) -> tuple:
    """The members of a union annotation, without None (``int | None`` -> ``(int,)``)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return tuple(a for a in typing.get_args(annotation) if a is not type(None))
    return (annotation,)


def _takes_container(field: FieldInfo) -> bool:
    """The field's value is a list or a mapping (``certify_sizes``, ``attacks``)."""
    for a in union_members(field.annotation):
        if a in (list, dict, tuple, set) or typing.get_origin(a) in (list, dict, tuple, set):
            return True
    return False


def _numeric_kind(field: FieldInfo) -> str | None:
    """``"float"``, ``"int"`` or None: whether uniform/loguniform apply and what they draw."""
    members = union_members(field.annotation)
    if float in members:
        return "float"
    if int in members:
        return "int"
    return None


def _literal_options(field: FieldInfo) -> tuple | None:
    for a in union_members(field.annotation):
        if typing.get_origin(a) is typing.Literal:
            return typing.get_args(a)
    return None


def _takes_bool(field: FieldInfo) -> bool:
    """The key takes a boolean: a bool, or a literal with a boolean or the word "true" (YAML reads
    ``attack_labels: true`` as True; the schema takes it as "true")."""
    members = union_members(field.annotation)
    return bool in members or Any in members or any(
        isinstance(o, bool) or o == "true" for o in (_literal_options(field) or ()))


def _is_scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _value_problem(field: FieldInfo, value) -> str | None:
    """Rules the schemas leave to the spec: no booleans for non-boolean keys (pydantic lets
    ``True`` pass as ``1`` for a ``Literal[0, 1]``), no infinite or NaN scalars."""
    if isinstance(value, bool) and not _takes_bool(field):
        options = _literal_options(field)
        if options:
            return f"must be one of {', '.join(map(repr, options))}; got {value!r}"
        return f"must not be a boolean, got {value!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    return None


def check_config_value(model: type[BaseModel], base: dict, key: str, value, path: str) -> None:
    """Check one value of ``key`` by building ``model`` from ``base`` plus that value.

    Only errors of ``key`` itself are reported (at ``path``); an error of the whole model (a
    model-level validator) may depend on other swept keys and is left to the combination check.
    """
    problem = _value_problem(model.model_fields[key], value)
    if problem:
        raise SpecError(f"{path}: {problem}")
    try:
        model(**{**base, key: value})
    except ValidationError as exc:
        errors = [e for e in exc.errors() if e["loc"][:1] == (key,)]
        if errors:
            raise SpecError(f"{join_path(path, errors[0]['loc'][1:])}: {pydantic_rule(errors[0])}") from None


def check_common(common: dict, names: Iterable[str]) -> None:
    """Check ``common`` against every trainable the spec names (each key a parameter of each)."""
    models = {name: REGISTRY[name].config_model for name in dict.fromkeys(names)}
    for key, value in common.items():
        owners = [n for n, m in models.items() if key in m.model_fields]
        if not owners:
            fields = set().union(*(m.model_fields for m in models.values()))
            raise SpecError(f"common.{key}: unknown key{did_you_mean(key, fields)}")
        if len(owners) < len(models):
            missing = next(n for n in models if n not in owners)
            raise SpecError(f"common.{key}: not a parameter of trainable {missing!r}; "
                            f"set it in the search of the trainables that take it")
    for name, model in models.items():
        fields = model.model_fields
        for key, value in common.items():
            field = fields[key]
            if not _takes_container(field) and (
                    isinstance(value, list) or (isinstance(value, dict) and set(value) & set(DISTRIBUTIONS))):
                raise SpecError(f"common.{key}: common holds fixed values; sweep {key} in a trainable's search")
            problem = _value_problem(field, value)
            if problem:
                raise SpecError(f"common.{key}: {problem}")
        try:
            model(**common)
        except ValidationError as exc:
            errors = [e for e in exc.errors() if e["loc"]]
            if errors:  # model-level errors are left to the combination check
                raise SpecError(f"{join_path('common', errors[0]['loc'])}: {pydantic_rule(errors[0])}") from None


# --------------------------------------------------------------------------- dimensions


@dataclass(frozen=True)
class Dimension:
    """One key of a trainable's ``search``: a fixed value, a grid, a choice or a range.

    ``values`` holds the fixed value (one item), the grid or choice options, or ``(low, high)``.
    ``explicit`` is True for the mapping forms (``{grid: [...]}``); a bare list is a grid too.
    ``integer`` is True for an integer key: its ranges draw integers in [low, high].
    """

    key: str
    kind: str
    values: tuple
    path: str
    explicit: bool = False
    integer: bool = False

    @property
    def swept(self) -> bool:
        return self.kind != "fixed"

    def candidate_paths(self) -> list[tuple[str, Any]]:
        """(spec path, value) of every value that must validate on its own."""
        if self.kind == "fixed":
            return [(self.path, self.values[0])]
        base = f"{self.path}.{self.kind}" if self.explicit else self.path
        return [(f"{base}[{j}]", v) for j, v in enumerate(self.values)]

    def sample(self, rng: np.random.Generator):
        """One draw of a choice or a range."""
        if self.kind == "choice":
            return copy.deepcopy(self.values[int(rng.integers(len(self.values)))])
        lo, hi = self.values
        if self.kind == "uniform":
            return int(rng.integers(lo, hi + 1)) if self.integer else float(rng.uniform(lo, hi))
        if self.integer:  # log-uniform over [lo, hi + 1), floored: as Ray's lograndint(lo, hi + 1)
            return int(min(hi, max(lo, math.floor(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))
        return float(min(hi, max(lo, math.exp(rng.uniform(math.log(lo), math.log(hi))))))

    def ray_domain(self, tune):
        """The Ray Tune domain of this dimension (``tune`` is ``ray.tune``); Optuna has no grid,
        so a grid becomes a categorical choice."""
        if self.kind == "fixed":
            return copy.deepcopy(self.values[0])
        if self.kind in ("grid", "choice"):
            return tune.choice(list(self.values))
        lo, hi = self.values
        if self.integer:
            return (tune.randint if self.kind == "uniform" else tune.lograndint)(int(lo), int(hi) + 1)
        return (tune.uniform if self.kind == "uniform" else tune.loguniform)(float(lo), float(hi))


def parse_dimension(key: str, value, field: FieldInfo, path: str) -> Dimension:
    """The dimension written as ``value`` for a schema field (shape only; values unchecked).

    A mapping with the single key grid/choice/uniform/loguniform is that distribution; for a
    scalar key a bare list is a grid and any other mapping is a mistake; for a list- or
    dict-typed key a list or mapping is the (fixed) value.
    """
    container = _takes_container(field)
    if isinstance(value, dict) and len(value) == 1 and next(iter(value)) in DISTRIBUTIONS:
        kind, payload = next(iter(value.items()))
        where = f"{path}.{kind}"
        if kind in RANGES:
            if not (isinstance(payload, list) and len(payload) == 2):
                raise SpecError(f"{where}: must be a pair [low, high], got {short_repr(payload)}")
        elif not isinstance(payload, list):
            raise SpecError(f"{where}: must be a list of values, got {short_repr(payload)}")
        elif not payload:
            raise SpecError(f"{where}: must not be empty")
        return Dimension(key, kind, tuple(payload), path, explicit=True,
                         integer=_numeric_kind(field) == "int")
    if isinstance(value, dict) and not container:
        names = [str(k) for k in value]
        hint = did_you_mean(names[0], DISTRIBUTIONS) if len(names) == 1 else ""
        raise SpecError(f"{path}: a mapping here must be one of {{grid: [...]}}, {{choice: [...]}}, "
                        f"{{uniform: [low, high]}}, {{loguniform: [low, high]}}; got key(s) "
                        f"{', '.join(map(repr, names)) or 'none'}{hint}")
    if isinstance(value, list) and not container:
        if not value:
            raise SpecError(f"{path}: must not be empty")
        return Dimension(key, "grid", tuple(value), path)
    return Dimension(key, "fixed", (value,), path)


def _check_dimension(dim: Dimension, model: type[BaseModel], common: dict, algorithm: str) -> None:
    """Every candidate value against the schema, and the rules of each kind."""
    field = model.model_fields[dim.key]
    if dim.kind in RANGES:
        numeric = _numeric_kind(field)
        if numeric is None or _takes_container(field):
            options = _literal_options(field)
            takes = f" (it takes {', '.join(map(repr, options))}; use choice)" if options else ""
            raise SpecError(f"{dim.path}.{dim.kind}: needs a numeric key{takes}")
        if algorithm == "grid":
            raise SpecError(f"{dim.path}: {dim.kind} is not allowed with search.algorithm grid "
                            f"(a grid cannot sample); use search.algorithm: random or optuna")
    for path, value in dim.candidate_paths():
        check_config_value(model, common, dim.key, value, path)
    if dim.kind in RANGES:
        for path, value in dim.candidate_paths():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SpecError(f"{path}: a bound must be a number, got {short_repr(value)}")
        lo, hi = dim.values
        if not lo < hi:
            raise SpecError(f"{dim.path}.{dim.kind}: low must be < high, got [{lo}, {hi}]")
        if dim.kind == "loguniform" and lo <= 0:
            raise SpecError(f"{dim.path}.{dim.kind}[0]: must be > 0 for loguniform, got {lo}")
    if dim.kind == "grid":
        for j, v in enumerate(dim.values):
            if v in dim.values[:j]:
                where = dim.candidate_paths()[j][0]
                raise SpecError(f"{where}: duplicate of [{dim.values.index(v)}] "
                                f"(to repeat trials use search.num_samples)")
    if algorithm == "optuna" and dim.kind in ("grid", "choice"):
        for path, value in dim.candidate_paths():
            if not _is_scalar(value):
                raise SpecError(f"{path}: Optuna chooses among single values (number, string, "
                                f"boolean, null), got {short_repr(value)}; use grid or random")


# --------------------------------------------------------------------------- one trainable's space


@dataclass(frozen=True)
class TrainableSpace:
    """The validated space of ``trainables[index]``: its schema, common values and dimensions."""

    index: int
    name: str
    model: type[BaseModel]
    common: dict
    dims: tuple[Dimension, ...]

    @property
    def path(self) -> str:
        return f"trainables[{self.index}]"

    @property
    def fixed(self) -> dict:
        return {d.key: d.values[0] for d in self.dims if d.kind == "fixed"}

    @property
    def grid_dims(self) -> tuple[Dimension, ...]:
        return tuple(d for d in self.dims if d.kind == "grid")

    @property
    def sampled_dims(self) -> tuple[Dimension, ...]:
        return tuple(d for d in self.dims if d.kind in ("choice",) + RANGES)

    def size(self, num_samples: int) -> int:
        """Trials of a grid/random expansion: the grid product times num_samples."""
        return math.prod(len(d.values) for d in self.grid_dims) * num_samples

    def config(self, values: dict, label: str) -> dict:
        """The full, validated flat config (defaults explicit) of one assignment of the
        dimensions; ``label`` names the trial in an error."""
        try:
            model = self.model(**{**self.common, **values})
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = err["loc"]
            by_key = {d.key: d for d in self.dims}
            if not loc:
                where = f"{self.path}.search"
            elif loc[0] in by_key:
                where = join_path(by_key[loc[0]].path, loc[1:])
            else:
                where = join_path("common", loc)
            swept = ", ".join(f"{d.key}={short_repr(values.get(d.key), 30)}" for d in self.dims if d.swept)
            raise SpecError(f"{where}: {pydantic_rule(err)} ({label}{': ' + swept if swept else ''})") from None
        return {"trainable": self.name, **model.model_dump()}

    def expand(self, num_samples: int, rng: np.random.Generator, first: int = 0,
               repeat_seeds: bool = True) -> Iterator[dict]:
        """Grid/random trials: num_samples repeats of the grid (row-major in the order the keys
        are written), the choices and ranges drawn from ``rng`` for each trial.

        With num_samples > 1 each trial carries its ``repeat`` index r (0 .. num_samples - 1, a key
        outside the schema that the trial logs as a param). Repeat r > 0 runs with
        its own seed, ``repeat_seed(configured seed, r)``, unless ``seed`` is swept (a grid, choice
        or range in ``search``): then the written seeds are left alone. ``repeat_seeds=False`` keeps
        the configured seed for every repeat (a tuning-private sweep's candidates: a public seed that
        differs between candidates would name the released one, docs/tuning_privacy.md)."""
        fixed, grids, sampled = self.fixed, self.grid_dims, self.sampled_dims
        seed_swept = any(d.key == "seed" and d.swept for d in self.dims)
        n = first
        for r in range(num_samples):
            for combo in itertools.product(*(d.values for d in grids)):
                values = dict(fixed)
                values.update({d.key: copy.deepcopy(v) for d, v in zip(grids, combo)})
                values.update({d.key: d.sample(rng) for d in sampled})
                cfg = self.config(values, f"trial {n}")
                if r and repeat_seeds and not seed_swept and "seed" in cfg:
                    cfg = self.config({**values, "seed": repeat_seed(cfg["seed"], r)}, f"trial {n}")
                yield {**cfg, "repeat": r} if num_samples > 1 else cfg
                n += 1

    def probes(self) -> list[dict]:
        """Configs that stand for an Optuna space: every dimension at its first value (the low
        end of a range), and each value of each dimension in turn with the others there."""
        base = {d.key: d.values[0] for d in self.dims}
        out = [self.config(base, "every dimension at its first value")]
        for d in self.dims:
            for value in d.values[1:]:
                out.append(self.config({**base, d.key: value}, f"{d.key}={short_repr(value, 30)}, "
                                                                "others at their first value"))
        return out

    def ray_space(self) -> dict:
        """Ray Tune ``param_space`` (for Optuna): common values fixed, the dimensions as domains."""
        from ray import tune

        space: dict[str, Any] = {"trainable": self.name, **copy.deepcopy(self.common)}
        for d in self.dims:
            space[d.key] = d.ray_domain(tune)
        return space


def check_trainable_name(index: int, name: str) -> None:
    """``trainables[index].name`` must be a registered trainable."""
    if name not in REGISTRY:
        raise SpecError(f"trainables[{index}].name: unknown trainable {name!r}{did_you_mean(name, REGISTRY)}; "
                        f"known: {', '.join(REGISTRY)}")


def build_space(index: int, name: str, search: dict, common: dict, algorithm: str) -> TrainableSpace:
    """Validate ``trainables[index]`` (its name and every key and value of its search) against
    its registered schema and return its space. ``common`` must already have passed
    ``check_common``."""
    check_trainable_name(index, name)
    path = f"trainables[{index}]"
    model = REGISTRY[name].config_model
    fields = model.model_fields
    dims = []
    for key, value in search.items():
        where = f"{path}.search.{key}"
        if key not in fields:
            raise SpecError(f"{where}: unknown key{did_you_mean(key, fields)}")
        dim = parse_dimension(key, value, fields[key], where)
        _check_dimension(dim, model, common, algorithm)
        dims.append(dim)
    return TrainableSpace(index, name, model, dict(common), tuple(dims))


REPEAT_SEED_STRIDE = 1_000_003  # a prime: repeat seeds of nearby configured seeds never collide below it


def repeat_seed(seed: int, repeat: int) -> int:
    """The seed of repeat ``repeat`` of a trial whose configured seed is ``seed``:
    ``seed + 1_000_003 * repeat`` (repeat 0 keeps the configured seed; docs/specs.md)."""
    return int(seed) + REPEAT_SEED_STRIDE * int(repeat)


def yaml_float(text: str) -> str:
    """How to write the number ``text`` so that YAML 1.1 (PyYAML) reads a float: a dot in the
    mantissa and a signed exponent (``1e-3`` -> ``1.0e-3``, ``1.0e6`` -> ``1.0e+6``)."""
    text = text.strip()
    mantissa, sep, exponent = text.lower().partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    if sep and exponent[:1] not in ("+", "-"):
        exponent = "+" + exponent
    return f"{mantissa}e{exponent}" if sep else mantissa


def expand(spaces: Iterable[TrainableSpace], num_samples: int, seed: int, repeat_seeds: bool = True) -> list[dict]:
    """Every trial of a grid/random sweep, trainables in order, from one Generator(seed); each
    with its ``repeat`` index and, for repeats > 0 (unless ``repeat_seeds`` is False), its own seed
    (``TrainableSpace.expand``)."""
    spaces = list(spaces)
    total = sum(s.size(num_samples) for s in spaces)
    if total > MAX_TRIALS:
        raise SpecError(f"search: the spec expands to {total} trials (grid product x num_samples), "
                        f"more than {MAX_TRIALS}")
    rng = np.random.default_rng(seed)
    trials: list[dict] = []
    for space in spaces:
        trials.extend(space.expand(num_samples, rng, first=len(trials), repeat_seeds=repeat_seeds))
    return trials


# --------------------------------------------------------------------------- metrics


def format_size(size: float) -> str:
    """An attack size as metric names write it (docs/metrics.md): up to 6 significant digits."""
    return f"{float(size):.6g}"


def reported_metrics(name: str, config: dict) -> set[str]:
    """The final metrics a trial of trainable ``name`` with this full config reports: the generic
    ones, the trainable's own (``TrainableEntry.metrics``), those of its attacks, certificates and
    audit, and whatever its ``final_metrics`` hook makes of them."""
    entry = REGISTRY.get(name)
    out = set(GENERIC_METRICS) | set(getattr(entry, "metrics", ()) or ())
    if not getattr(entry, "privacy_epsilon", True):  # a robustness epsilon has its own names
        out -= {"epsilon", "delta"}
    for attack, sizes in (config.get("attacks") or {}).items():
        out |= {f"acc_{attack}_{format_size(s)}" for s in sizes}
        out |= {f"acc_worst_{format_size(s)}" for s in sizes}  # worst case over the attacks at that size
    certifier = config.get("certifier") or "default"
    model = getattr(entry, "config_model", None)
    own_certificate = bool(getattr(model, "has_certificate", False))
    if (config.get("certify_images") or 0) > 0:
        if certifier in ("default", "both") and own_certificate:
            out.add("acc_clean_expected")
            out |= {f"cert_acc_{format_size(s)}" for s in config.get("certify_sizes") or ()}
        # smoothing runs only where the schema lets it (smoothing_unavailable, e.g. dpsgd without
        # noise_augmentation_sigma), so a config that validated with it reports its metrics
        if certifier in ("smoothing", "both"):
            out |= {"smooth_acc_clean", "smooth_abstain_rate", "smooth_cert_abstain_rate"}
            out |= {f"smooth_cert_acc_{format_size(s)}" for s in config.get("certify_sizes") or ()}
    from trainables.audit_config import metric_names  # the audit's metrics (flat keys or the audit mapping)

    out |= metric_names(config.get("audit"), config.get("audit_canaries") or 0)
    return entry.reported_metrics(config, out) if entry is not None else out


def _size_key(name: str):
    head, _, tail = name.rpartition("_")
    try:
        return head, float(tail)
    except ValueError:
        return head, math.inf


def check_not_diagnostic(metric: str, path: str, configs: Iterable[dict]) -> None:
    """A searcher or scheduler must not select on a non-private diagnostic (``train_loss``,
    ``train_acc``, ..., trainables.diagnostics) of a private trial: it is computed on the training
    data without noise, so the selection would leak through a channel epsilon does not cover. A
    trial with ``diagnostics: false`` does not report it at all. One line naming the path."""
    from trainables.diagnostics import is_diagnostic

    for cfg in configs:
        entry = REGISTRY.get(cfg["trainable"])
        if entry is None or not is_diagnostic(metric, entry.config_model):
            continue
        if cfg.get("diagnostics") is False:
            raise SpecError(f"{path}: {metric} is a non-private diagnostic and trials with diagnostics: false do not "
                            f"report it; use test_acc or a final metric such as acc_clean (docs/metrics.md)")
        if entry.privacy_epsilon and cfg.get("epsilon", 0.0) is not None:
            raise SpecError(f"{path}: {metric} is a non-private diagnostic (computed on the training data without "
                            f"noise, not covered by epsilon) of the private trainable {cfg['trainable']!r}; select on "
                            f"test_acc or a final metric such as acc_clean (docs/metrics.md)")


def check_metric(metric: str, path: str, configs: Iterable[dict]) -> None:
    """``metric`` must be reported by every one of ``configs`` (full trial configs)."""
    for cfg in configs:
        names = reported_metrics(cfg["trainable"], cfg)
        if metric in names:
            continue
        family = metric.rpartition("_")[0]
        similar = sorted((n for n in names if family and n.rpartition("_")[0] == family), key=_size_key)
        if similar:  # a size that is not configured: list the sizes that are
            shown = ", ".join(similar[:8]) + (", ..." if len(similar) > 8 else "")
            hint = f"; it reports {shown}"
        else:
            hint = did_you_mean(metric, names)
            if metric.startswith("cert_acc_"):
                model = getattr(REGISTRY.get(cfg["trainable"]), "config_model", None)
                if not getattr(model, "has_certificate", False):
                    hint += (f"; {cfg['trainable']!r} has no certificate of its own (cert_acc_<size>); "
                             f"randomized smoothing reports smooth_cert_acc_<size> (certifier: smoothing)")
                else:
                    hint += "; cert_acc_<size> needs the size in certify_sizes and certify_images > 0"
            elif metric.startswith("acc_"):
                hint += "; acc_<attack>_<size> needs that attack and size in attacks"
        raise SpecError(f"{path}: {metric!r} is not reported by every trial of {cfg['trainable']!r}{hint} "
                        f"(metric names: docs/metrics.md)")
