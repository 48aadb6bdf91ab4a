"""What ``dpsweep report`` reads back from MLflow: the latest sweep's parent run, one table row per
trial (typed parameters and final metrics), and the per-example certification tables.

The per-example Parquet tables make certified accuracy a function that can be evaluated at any
attack size after the sweep (``certified_accuracy_at``), not only at the configured ones.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainables.tracking import TAG_PARENT, TAG_TRAINABLE, retry

# per-example tables a trial may log, and how to read a certified size from each
TABLES = {
    "native": ("certification/certification.parquet", "certified_size"),  # the mechanism's own certificate
    "smoothing": ("certification/smoothing.parquet", "radius"),             # Cohen et al. (l2 radius)
}


@dataclass
class Sweep:
    """A sweep as the report sees it."""

    client: object
    experiment: str
    tracking_uri: str
    parent: object
    trials: "object"                     # pandas.DataFrame, one row per child run
    tables: dict[tuple[str, str], "object"] = field(default_factory=dict)  # (run_id, kind) -> DataFrame
    parts: list["Sweep"] = field(default_factory=list)  # several sweeps compared: each one (``load_sweeps``)
    artifact_uris: dict[str, str] = field(default_factory=dict)  # run_id -> the run's artifact root

    @property
    def sweeps(self) -> list["Sweep"]:
        """The sweeps this report covers: itself, or each compared sweep."""
        return self.parts or [self]

    @property
    def parent_metrics(self) -> dict[str, float]:
        return dict(self.parent.data.metrics)

    @property
    def parent_tags(self) -> dict[str, str]:
        return dict(self.parent.data.tags)

    @property
    def reference(self) -> dict | None:
        """The spec's ``reference`` block (published values), from the parent's params."""
        return reference_from_params(dict(self.parent.data.params))


def _typed(value: str):
    """An MLflow param (a string) back as the number/bool/list/dict it was logged from."""
    for parse in (json.loads, float):
        try:
            out = parse(value)
        except (ValueError, TypeError):
            continue
        return out
    if value in ("True", "False"):
        return value == "True"
    if value == "None":
        return None
    return value


def as_number(value) -> float:
    """A table cell as a float (NaN for a missing or non-numeric one)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def metric_value(value) -> float:
    """A metric as logged: MLflow's SQL store keeps +-inf (a non-private trial's epsilon) as
    +-1.797e308, the largest float; read that back as infinity."""
    out = float(value)
    if abs(out) >= 1e308:
        return math.copysign(math.inf, out)
    return out


def _finished_children(client, exp_id: str, parent_id: str) -> bool:
    flt = f"tags.`{TAG_PARENT}` = '{parent_id}' and attributes.status = 'FINISHED'"
    return bool(retry(lambda: client.search_runs([exp_id], filter_string=flt, max_results=1), what="search_runs"))


def _latest_sweep(client, exp_id: str, experiment: str = ""):
    """The latest sweep with at least one finished trial (one stopped before any trial finished,
    or whose trials all failed, has nothing to report: skipped, with a note on stderr); None when
    the experiment holds no sweep; ValueError when no sweep has a finished trial."""
    import sys

    runs = retry(lambda: client.search_runs([exp_id], filter_string="tags.`dpsweep.kind` = 'sweep'",
                                            order_by=["attributes.start_time DESC"], max_results=200),
                 what="search_runs")
    if not runs:
        return None
    for run in runs:
        if _finished_children(client, exp_id, run.info.run_id):
            if run is not runs[0]:
                print(f"dpsweep: note: the latest sweep of {experiment!r} ({runs[0].info.run_name}, "
                      f"{runs[0].info.status}) has no finished trial; reporting on {run.info.run_name}",
                      file=sys.stderr, flush=True)
            return run
    raise ValueError(f"experiment: no sweep of {experiment!r} has a finished trial (the latest, "
                     f"{runs[0].info.run_name}, is {runs[0].info.status}); nothing to report")


def load_sweep(experiment: str, tracking_uri: str, *, parent_run_id: str | None = None) -> Sweep:
    """The latest sweep of ``experiment`` (or the given parent run) with its trials table."""
    import pandas as pd
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = retry(lambda: client.get_experiment_by_name(experiment), what="get_experiment_by_name")
    if exp is None:
        raise ValueError(f"experiment: no MLflow experiment named {experiment!r} at {tracking_uri}")
    if parent_run_id:
        from mlflow.exceptions import MlflowException

        try:  # an unknown id is a permanent error: retry raises it at once
            parent = retry(lambda: client.get_run(parent_run_id), what="get_run")
        except MlflowException as exc:
            if exc.get_http_status_code() not in (400, 404):
                raise
            raise ValueError(f"--run: no MLflow run with id {parent_run_id!r} at {tracking_uri}") from None
        if parent.info.experiment_id != exp.experiment_id:
            raise ValueError(f"--run: run {parent_run_id} belongs to experiment id {parent.info.experiment_id}, "
                             f"not to {experiment!r} (id {exp.experiment_id})")
        if not _finished_children(client, exp.experiment_id, parent_run_id):
            raise ValueError(f"--run: sweep {parent.info.run_name} ({parent_run_id}) has no finished trial; "
                             f"nothing to report")
    else:
        parent = _latest_sweep(client, exp.experiment_id, experiment)
    if parent is None:
        raise ValueError(f"experiment: {experiment!r} holds no dpsweep sweep run")
    flt = f"tags.`{TAG_PARENT}` = '{parent.info.run_id}'"
    children = retry(lambda: client.search_runs([exp.experiment_id], filter_string=flt, max_results=10000),
                     what="search_runs")
    rows, uris = [], {}
    for run in sorted(children, key=lambda r: r.info.start_time or 0):
        uris[run.info.run_id] = run.info.artifact_uri or ""
        row = {"run_id": run.info.run_id, "run": run.info.run_name or run.info.run_id[:8],
               "trainable": run.data.tags.get(TAG_TRAINABLE, ""), "status": run.info.status,
               "released": run.data.tags.get("dpsweep.released") == "true"}
        row.update({f"param.{k}": _typed(v) for k, v in run.data.params.items()})
        row.update({k: metric_value(v) for k, v in run.data.metrics.items()})
        rows.append(row)
    trials = unused_keys_missing(privacy_epsilons_only(pd.DataFrame(rows)))
    return Sweep(client, experiment, tracking_uri, parent, trials, artifact_uris=uris)


def load_sweeps(experiment: str, tracking_uri: str, run_ids: list[str]) -> Sweep:
    """Several sweeps of ``experiment`` in one report (``dpsweep report EXP --run A --run B``):
    their trials in one table with a ``sweep`` column (the parent run's name, made unique), which
    groups configurations and draws a series per sweep; ``parts`` keeps each sweep."""
    import pandas as pd

    ids = list(dict.fromkeys(run_ids))
    if len(ids) == 1:
        return load_sweep(experiment, tracking_uri, parent_run_id=ids[0])
    parts = [load_sweep(experiment, tracking_uri, parent_run_id=i) for i in ids]
    names: dict[str, int] = {}
    frames = []
    for part in parts:
        name = part.parent.info.run_name or part.parent.info.run_id[:8]
        if name in names:  # two sweeps of the same name: tell them apart by id
            name = f"{name} ({part.parent.info.run_id[:8]})"
        names[name] = 1
        frames.append(part.trials.assign(**{SWEEP_COLUMN: name}))
    trials = pd.concat(frames, ignore_index=True, sort=False)
    first = parts[0]
    uris = {k: u for part in parts for k, u in part.artifact_uris.items()}
    return Sweep(first.client, experiment, tracking_uri, first.parent, trials, parts=parts, artifact_uris=uris)


def other_sweeps(sweep: Sweep) -> list[dict]:
    """The experiment's other sweeps (not in this report), newest first: name, run id, trials
    (the parent's ``trials`` metric; None for a sweep that never finished), start date, status.
    One search of the experiment's parent runs."""
    import datetime as dt

    shown = {s.parent.info.run_id for s in sweep.sweeps}
    runs = retry(lambda: sweep.client.search_runs([sweep.parent.info.experiment_id],
                                                  filter_string="tags.`dpsweep.kind` = 'sweep'",
                                                  order_by=["attributes.start_time DESC"], max_results=1000),
                 what="search_runs(sweeps)")
    out = []
    for run in runs:
        if run.info.run_id in shown:
            continue
        n = run.data.metrics.get("trials")
        start = run.info.start_time
        out.append({"name": run.info.run_name or run.info.run_id[:8], "run_id": run.info.run_id,
                    "trials": int(n) if n is not None else None, "status": run.info.status,
                    "date": dt.datetime.fromtimestamp(start / 1000).strftime("%Y-%m-%d %H:%M") if start else "?"})
    return out


def privacy_epsilons_only(trials):
    """``epsilon``/``delta`` hold privacy guarantees only: a run of a trainable whose epsilon is
    a robustness parameter (``pixeldp``) logged before the rename has its recomputed robustness
    epsilon as ``epsilon``; it moves to ``robustness_epsilon`` (docs/metrics.md)."""
    from trainables.registry import REGISTRY

    if trials.empty or "trainable" not in trials or "epsilon" not in trials:
        return trials
    trials = trials.copy()
    robust = trials["trainable"].map(lambda n: not getattr(REGISTRY.get(n), "privacy_epsilon", True)).astype(bool)
    if robust.any():
        for old, new in (("epsilon", "robustness_epsilon"), ("delta", "robustness_delta")):
            if old not in trials:
                continue
            if new not in trials:
                trials[new] = math.nan
            fill = robust & trials[new].isna()
            trials.loc[fill, new] = trials.loc[fill, old]
            trials.loc[robust, old] = math.nan
    return trials


# configured keys a non-private baseline (``epsilon: null``) never uses: it neither clips, nor adds noise,
# nor accounts (issue 51.1); its trials show them missing, not as the unused default
NONPRIVATE_UNUSED = ("delta", "max_grad_norm", "accountant", "clipping", "noise_source", "label_delta")


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value == ""


def is_nonprivate(row) -> bool:
    """Whether a trials row (or an aggregated row) is a non-private baseline: a trainable whose
    epsilon is a privacy guarantee, run with ``epsilon: null`` (its param missing) or logging an
    infinite epsilon."""
    from trainables.registry import REGISTRY

    entry = REGISTRY.get(str(row.get("trainable", "")))
    if entry is None or not getattr(entry, "privacy_epsilon", True):
        return False
    if "epsilon" not in getattr(entry.config_model, "model_fields", {}):
        return False
    eps = row.get("epsilon")
    if isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isinf(eps):
        return True
    return "param.epsilon" in row and _missing(row.get("param.epsilon"))


def nonprivate_mask(trials):
    """A boolean Series: which rows of ``trials`` are non-private baselines (``is_nonprivate``)."""
    import pandas as pd

    if trials.empty:
        return pd.Series([], dtype=bool, index=trials.index)
    return pd.Series([is_nonprivate(r) for r in trials.to_dict("records")], index=trials.index, dtype=bool)


def private_only(trials):
    """``trials`` without its non-private baselines (importances, issue 51.3)."""
    return trials[~nonprivate_mask(trials)] if not trials.empty else trials


def unused_keys_missing(trials):
    """A non-private baseline's keys that do not apply to it (``NONPRIVATE_UNUSED``: it never clips,
    draws noise nor accounts) set missing: its configuration is named by what applies, and two
    baselines that differ only in an unused default are one configuration."""
    if trials.empty:
        return trials
    mask = nonprivate_mask(trials)
    cols = [f"param.{k}" for k in NONPRIVATE_UNUSED if f"param.{k}" in trials]
    if not mask.any() or not cols:
        return trials
    out = trials.copy()
    for c in cols:
        out[c] = out[c].astype(object)
        out.loc[mask, c] = None
    return out


def reference_from_params(params: dict[str, str]) -> dict | None:
    """The spec's ``reference`` block read back from the parent run's flattened params
    (``sweeps.spec.spec_to_flat_params``): ``reference.citation``, ``reference.note``,
    ``reference.points.<j>.label``, ``reference.points.<j>.where.<key>`` and
    ``reference.points.<j>.metrics.<metric>`` (a metric name may hold dots: ``cert_acc_0.2``).
    None when the spec had no reference block."""
    ref: dict = {}
    points: dict[int, dict] = {}
    for key, value in params.items():
        if not key.startswith("reference."):
            continue
        parts = key.split(".", 4)
        if parts[1] in ("citation", "note") and len(parts) == 2:
            ref[parts[1]] = value
        elif parts[1] == "points" and len(parts) >= 4 and parts[2].isdigit():
            point = points.setdefault(int(parts[2]), {"label": None, "where": {}, "metrics": {}})
            field, rest = parts[3], key.split(".", 4)[4] if len(parts) == 5 else None
            if field == "label" and rest is None:
                point["label"] = None if value == "null" else value
            elif field == "where" and rest:
                point["where"][rest] = _typed(value)
            elif field == "metrics" and rest:
                point["metrics"][rest] = float(value)
    if not ref and not points:
        return None
    ref.setdefault("citation", "")
    ref.setdefault("note", "")
    ref["points"] = [points[j] for j in sorted(points)]
    return ref


def load_tables(sweep: Sweep) -> None:
    """Read every trial's per-example tables (those it logged) into ``sweep.tables``.

    Artifacts on this machine's disk (a local store: ``file://`` or a plain path) are read in place;
    others are listed and downloaded through MLflow, which costs two store round trips per run (18 s
    for 960 runs on SQLite, so the local path matters for large sweeps)."""
    import pyarrow.parquet as pq

    if sweep.trials.empty:
        return
    with tempfile.TemporaryDirectory() as tmp:
        for run_id in sweep.trials["run_id"]:
            root = _local_dir(sweep.artifact_uris.get(run_id, ""))
            listed = None
            for kind, (path, _) in TABLES.items():
                if root is not None:
                    local = root / path
                    if local.is_file():
                        sweep.tables[(run_id, kind)] = pq.read_table(local).to_pandas()
                    continue
                if listed is None:
                    listed = {a.path for a in retry(lambda: sweep.client.list_artifacts(run_id, "certification"),
                                                    what="list_artifacts")}
                if path not in listed:
                    continue
                local = retry(lambda: sweep.client.download_artifacts(run_id, path, tmp), what="download_artifacts")
                sweep.tables[(run_id, kind)] = pq.read_table(local).to_pandas()


def _local_dir(uri: str) -> Path | None:
    """The directory of an artifact root on this machine's disk (None: remote, or not there)."""
    from urllib.parse import unquote, urlparse

    if not uri:
        return None
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        path = Path(unquote(parsed.path))
    elif parsed.scheme == "" and uri.startswith("/"):
        path = Path(uri)
    else:
        return None
    return path if path.is_dir() else None


def certified_accuracy_at(table, kind: str, sizes) -> np.ndarray:
    """Certified accuracy at each size from a per-example table: the fraction of examples whose
    prediction is correct and certified at a size >= it (an abstention is never certified)."""
    col = TABLES[kind][1]
    size = table[col].to_numpy(dtype=np.float64)
    ok = table["prediction"].to_numpy() == table["label"].to_numpy()
    if "abstained" in table:
        ok &= ~table["abstained"].to_numpy(dtype=bool)
    ok &= size > 0
    sizes = np.asarray(sizes, dtype=np.float64)
    return np.array([(ok & (size >= s)).mean() if len(size) else math.nan for s in sizes])


def size_grid(sweep: Sweep, kind: str, points: int = 120) -> np.ndarray:
    """Attack sizes from 0 to the largest certified size of any trial (for curves)."""
    col = TABLES[kind][1]
    top = max((float(t[col].max()) for (_, k), t in sweep.tables.items() if k == kind and len(t)), default=0.0)
    return np.linspace(0.0, max(top, 1e-3) * 1.02, points)


# --------------------------------------------------------------------------- repeats


# params that tell repeats of one configuration apart: never a grouping key (docs/specs.md)
REPEAT_PARAMS = ("param.seed", "param.repeat")
# what a trials row holds besides params and metrics
ROW_KEYS = ("run_id", "run", "trainable", "status", "released")


def _key_value(value):
    """A param value as a hashable, comparable grouping key (lists and dicts as JSON, missing as "")."""
    if isinstance(value, (list, dict)):
        return json.dumps(value, sort_keys=True, default=str)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return value


SWEEP_COLUMN = "sweep"  # several sweeps compared: the parent run's name; groups and series per sweep


def config_columns(trials) -> list[str]:
    """The configured parameters that define a group of repeats: every ``param.*`` column
    except ``seed`` and ``repeat`` (measured values never group), and ``sweep`` when several
    sweeps are compared (``load_sweeps``)."""
    own = [SWEEP_COLUMN] if SWEEP_COLUMN in trials.columns else []
    return own + [c for c in trials.columns if str(c).startswith("param.") and c not in REPEAT_PARAMS]


def key_name(column: str) -> str:
    """A grouping column as the user wrote the key: ``param.max_grad_norm`` -> ``max_grad_norm``."""
    return column[len("param."):] if str(column).startswith("param.") else str(column)


def varying_columns(trials) -> list[str]:
    """The configured parameters that differ between groups (what names a group)."""
    cols = [c for c in config_columns(trials) if c != "param.trainable"]

    def values(c):   # a key a non-private baseline does not use is missing there, which is no value of it
        v = trials[c].map(_key_value).astype(str)
        return v[v != ""] if key_name(c) in NONPRIVATE_UNUSED else v

    return [c for c in cols if values(c).nunique() > 1]


def with_groups(trials):
    """``trials`` with a ``group`` column: trials with the same trainable and the same configured
    parameters (all but ``seed``/``repeat``) share a group, numbered in order of first appearance."""
    trials = trials.copy()
    if trials.empty:
        trials["group"] = []
        return trials
    cols = ["trainable", *config_columns(trials)]
    keys = [tuple(_key_value(v) for v in row) for row in trials[cols].itertuples(index=False)]
    ids: dict[tuple, int] = {}
    trials["group"] = [ids.setdefault(k, len(ids)) for k in keys]
    return trials


def label_keys(trials) -> dict[str, list[str]]:
    """Per trainable, the configured parameters that differ between its groups: what names a group of it
    in a figure's legend (a key that differs only from one trainable to another, such as their default
    learning rates, names none: the trainable's name already tells them apart)."""
    if trials.empty or "trainable" not in trials:
        return {}
    return {str(t): varying_columns(g) for t, g in trials.groupby("trainable", sort=False)}


def group_label(row, varying: list[str] | dict[str, list[str]], exclude=()) -> str:
    """``trainable key=value ...`` of the varying configured parameters of a group (``varying``: a list,
    or ``label_keys``'s per-trainable lists), but ``exclude``."""
    parts = [str(row.get("trainable", ""))]
    if isinstance(varying, dict):
        varying = varying.get(parts[0], [])
    if is_nonprivate(row):   # named by what applies (issue 51.1): no epsilon, no clipping norm
        parts.append("non-private")
        varying = [c for c in varying if key_name(c) not in NONPRIVATE_UNUSED + ("epsilon",)]
    for c in varying:
        if c in exclude:
            continue
        v = row.get(c)
        if _key_value(v) == "":
            continue
        parts.append(f"{key_name(c)}={v:.4g}" if isinstance(v, float) else f"{key_name(c)}={v}")
    return " ".join(parts)


def metric_columns(trials) -> list[str]:
    """Numeric final-metric columns of the trials table."""
    import pandas as pd

    skip = set(ROW_KEYS) | {"group"}
    return [c for c in trials.columns if c not in skip and not str(c).startswith("param.")
            and pd.api.types.is_numeric_dtype(trials[c]) and not pd.api.types.is_bool_dtype(trials[c])]


def finished(trials):
    """The finished trials (a failed or killed trial's partial metrics are not averaged)."""
    if trials.empty or "status" not in trials:
        return trials
    return trials[trials["status"] == "FINISHED"]


def aggregate(trials, metrics: list[str] | None = None):
    """One row per group of repeats of the finished trials: ``group``, ``trainable``, the
    configured params, ``label``, ``n`` (trials), ``runs`` (their names) and, for each metric,
    ``<m>`` (mean), ``<m>.sd`` (sample standard deviation, ddof 1; NaN for one trial) and
    ``<m>.n`` (trials with a finite value). Infinite values (a non-private epsilon) stay
    infinite when every repeat has them."""
    import numpy as np
    import pandas as pd

    df = finished(with_groups(trials) if "group" not in trials else trials)
    metrics = metric_columns(df) if metrics is None else [m for m in metrics if m in df]
    varying = varying_columns(df) if not df.empty else []     # a table row names every swept key it has
    rows = []
    for gid, g in df.groupby("group", sort=True):
        first = g.iloc[0]
        row = {"group": gid, "trainable": first.get("trainable", ""),
               **{c: first[c] for c in config_columns(df)}, "n": len(g), "runs": ", ".join(map(str, g["run"]))}
        row["label"] = group_label(row, varying)
        for m in metrics:
            vals = g[m].to_numpy(dtype=np.float64)
            vals = vals[~np.isnan(vals)]
            finite = vals[np.isfinite(vals)]
            if len(vals) and len(finite) == 0:  # all infinite (same sign: a non-private epsilon)
                row[m], row[f"{m}.sd"], row[f"{m}.n"] = float(vals[0]), 0.0, len(vals)
                continue
            row[m] = float(finite.mean()) if len(finite) else math.nan
            row[f"{m}.sd"] = float(finite.std(ddof=1)) if len(finite) > 1 else math.nan
            row[f"{m}.n"] = len(finite)
        rows.append(row)
    return pd.DataFrame(rows)


def fmt_stat(mean: float, sd: float, n: int, *, of: int | None = None) -> str:
    """``mean ± sd`` (one trial, or a constant: the value alone), ``(k)`` appended when only k of
    the group's ``of`` trials have the metric. An sd that is zero within floating-point rounding
    (1.4e-16 beside a mean of 1) is a constant, not a spread (issue 51, point 4)."""
    if n == 0 or mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return ""
    constant = not math.isfinite(sd) or sd <= 1e-12 * max(abs(mean), 1.0) if math.isfinite(mean) else True
    text = f"{mean:.4g}" if n == 1 or constant else f"{mean:.4g} ± {sd:.2g}"
    if of is not None and n != of:
        text += f" ({n})"
    return text


ATTACK_MEAN = re.compile(r"^acc_attack_mean_(.+)$")


def with_metric(trials, metric: str):
    """``trials`` with ``metric`` as a column: a logged metric as is; ``acc_attack_mean_<size>``
    (a reference block's average over attacks, sweeps.spec.MEAN_OVER_ATTACKS) computed per trial as
    the mean of its ``acc_<attack>_<size>`` columns (NaN without any)."""
    m = ATTACK_MEAN.match(metric)
    if metric in trials or m is None or trials.empty:
        return trials
    cols = [c for c in trials.columns if re.fullmatch(rf"acc_(fgsm|ifgsm|mim|pgd)_{re.escape(m.group(1))}", str(c))]
    out = trials.copy()
    out[metric] = out[cols].astype(float).mean(axis=1, skipna=True) if cols else math.nan
    return out


def trial_config(row) -> dict:
    """A trial row's configured values, as a reference point's ``where`` names them: ``trainable`` and the
    ``param.`` columns without the prefix; a missing value (NaN: a key logged as None, e.g. a non-private
    run's ``epsilon: null``, or one its trainable lacks) as None, so that ``where: {epsilon: null}`` matches."""
    out = {"trainable": row.get("trainable")}
    for c, v in row.items():
        if str(c).startswith("param."):
            out[c[len("param."):]] = None if isinstance(v, float) and math.isnan(v) else v
    return out


def measured(trials, where: dict, metric: str) -> tuple[float, float, int]:
    """(mean, sd, n) of ``metric`` over the finished trials whose configured values match a
    ``reference`` point's ``where`` (sweeps.spec.reference_matches)."""
    import numpy as np

    from sweeps.spec.sweep_spec import reference_matches

    df = with_metric(finished(trials), metric)
    if df.empty or metric not in df:
        return math.nan, math.nan, 0
    vals = []
    for _, row in df.iterrows():
        if reference_matches(where, trial_config(row)) and math.isfinite(float(row[metric])):
            vals.append(float(row[metric]))
    arr = np.array(vals, dtype=np.float64)
    if not len(arr):
        return math.nan, math.nan, 0
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else math.nan, len(arr)


def reference_rows(trials, reference: dict | None) -> list[dict]:
    """The published-vs-measured table: one row per (point, metric) of the spec's reference
    block: label, metric, published, measured mean ± sd (n), difference (measured mean minus
    published)."""
    rows = []
    for j, point in enumerate((reference or {}).get("points", [])):
        label = point.get("label") or ", ".join(f"{k}={v}" for k, v in point["where"].items())
        for metric, published in point["metrics"].items():
            mean, sd, n = measured(trials, point["where"], metric)
            rows.append({"point": label, "metric": metric, "published": published,
                         "measured": fmt_stat(mean, sd, n) + (f" (n={n})" if n else "no finished trial"),
                         "difference": mean - published if n else math.nan,
                         "_where": point["where"], "_mean": mean, "_sd": sd, "_n": n})
    return rows


# the flat black-box audit keys, which the ``audit`` mapping replaces (trainables.audit_config)
FLAT_AUDIT_PARAMS = ("param.audit_canaries", "param.audit_guess_fraction", "param.audit_beta")


def without_shadowed_audit_keys(trials):
    """``trials`` without the flat audit keys (``audit_canaries = 0`` and its defaults) where the
    trial ran the ``audit`` mapping instead (issue 34, point 8): a row then shows the mapping that ran,
    not a flat ``audit_canaries = 0`` beside its 1,000 canaries. A column left empty is dropped."""
    if "param.audit" not in trials or trials.empty:
        return trials
    # MLflow keeps a mapping param as its Python repr ("{'mode': 'whitebox', ...}"), read back as text
    mapped = trials["param.audit"].map(lambda v: (isinstance(v, dict) and bool(v))
                                       or (isinstance(v, str) and v.strip().startswith("{") and v.strip() != "{}"))
    if not mapped.any():
        return trials
    out = trials.copy()
    for col in FLAT_AUDIT_PARAMS:
        if col in out:
            out[col] = out[col].astype(object)
            out.loc[mapped, col] = None
            if out[col].isna().all():
                out = out.drop(columns=[col])
    return out
