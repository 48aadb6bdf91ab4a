"""What ``dpsweep report`` reads back from MLflow: the latest sweep's parent run, one table row per
trial (typed parameters and final metrics), and the per-example certification tables.

The per-example Parquet tables make certified accuracy a function that can be evaluated at any
attack size after the sweep (``certified_accuracy_at``), not only at the configured ones.
"""

from __future__ import annotations

import json
import math
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

    @property
    def parent_metrics(self) -> dict[str, float]:
        return dict(self.parent.data.metrics)

    @property
    def parent_tags(self) -> dict[str, str]:
        return dict(self.parent.data.tags)


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
        parent = retry(lambda: client.get_run(parent_run_id), what="get_run")
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
    rows = []
    for run in sorted(children, key=lambda r: r.info.start_time or 0):
        row = {"run_id": run.info.run_id, "run": run.info.run_name or run.info.run_id[:8],
               "trainable": run.data.tags.get(TAG_TRAINABLE, ""), "status": run.info.status,
               "released": run.data.tags.get("dpsweep.released") == "true"}
        row.update({f"param.{k}": _typed(v) for k, v in run.data.params.items()})
        row.update({k: metric_value(v) for k, v in run.data.metrics.items()})
        rows.append(row)
    trials = pd.DataFrame(rows)
    return Sweep(client, experiment, tracking_uri, parent, trials)


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
    """Download every trial's per-example tables (those it logged) into ``sweep.tables``."""
    import pyarrow.parquet as pq

    if sweep.trials.empty:
        return
    with tempfile.TemporaryDirectory() as tmp:
        for run_id in sweep.trials["run_id"]:
            listed = {a.path for d in ("certification",) for a in
                      retry(lambda: sweep.client.list_artifacts(run_id, d), what="list_artifacts")}
            for kind, (path, _) in TABLES.items():
                if path not in listed:
                    continue
                local = retry(lambda: sweep.client.download_artifacts(run_id, path, tmp), what="download_artifacts")
                sweep.tables[(run_id, kind)] = pq.read_table(local).to_pandas()


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
