"""The sweep's best trial by ``search.metric`` and the MLflow compare view of its trials (issue 24,
points 5 and 9).

* The best trial is the finished trial with the best ``search.metric`` (``search.mode``), the
  rule ``sweeps.spec.tuning.best_row`` applies to a tuning-private sweep's released trial. Choosing it
  is not private unless the sweep ran with ``tuning_privacy`` (then it *is* the released trial
  and the end-to-end epsilon covers it): ``selection_caveat`` says which, and every place that
  shows the best trial shows the caveat with it.
* ``record_best`` tags the parent run: ``dpsweep.best_trial_id``, ``dpsweep.best_run_id``,
  ``dpsweep.best_metric`` (``<metric> (<mode>)``), metric ``best_<metric>``, and
  ``dpsweep.compare_url``, the address of MLflow's compare view of the sweep's child runs (its
  parallel-coordinates plot draws the params that differ between them against a metric).
* ``compare_url`` builds that address: ``<ui>/#/compare-runs?runs=<JSON list>&experiments=<JSON
  list>``, the route of MLflow's UI (``Routes.getCompareRunPageRoute``), each value URL-encoded.

No Ray here; MLflow is imported inside the functions that talk to the tracking store.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from urllib.parse import quote

from trainables.tracking import TAG_PARENT, TAG_TRIAL, retry

LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` listens by default
MAX_TAG = 8000  # MLflow's limit on a tag value (mlflow.utils.validation.MAX_TAG_VAL_LENGTH)


@dataclass
class Best:
    """The best trial of a finished sweep, and the compare view of all its trials."""

    metric: str
    mode: str
    row: dict | None          # the console row of the best trial (None: no finished trial has the metric)
    run_id: str | None        # its MLflow child run
    compare_url: str          # the compare view of every child run ("" without any)
    n_runs: int               # child runs in that view
    private: bool             # tuning_privacy: the best trial is the released one
    claims_privacy: bool = True  # some trial's epsilon is a guarantee for its training data


def best_trial(rows: list[dict], metric: str, mode: str) -> dict | None:
    """The finished trial with the best finite ``metric`` (``mode`` max or min); ties keep the
    first. The same rule as a tuning-private sweep's released trial (``sweeps.spec.tuning.best_row``)."""
    from sweeps.spec.tuning import best_row

    return best_row(rows, metric, mode)


def claims_privacy(trainables) -> bool:
    """Whether any of these trainables' epsilon protects its training data (PixelDP's does not: it
    is a robustness parameter; ``TrainableEntry.privacy_epsilon``)."""
    from trainables.registry import REGISTRY

    return any(getattr(REGISTRY.get(str(t)), "privacy_epsilon", True) for t in trainables)


def selection_caveat(private: bool, n: int, claims: bool = True) -> str:
    """What covers choosing the best of ``n`` trials (docs/tuning_privacy.md); ``claims``: whether
    the trials claim any privacy for their training data at all."""
    if not claims:
        return (f"a tuning choice among {n} trials, none of which claims privacy for its training data; the best "
                "value is an optimistic estimate of the chosen configuration's (it was chosen on the same test set)")
    if private:
        return ("the released trial of a tuning_privacy sweep: covered by the end-to-end epsilon "
                "(Papernot & Steinke 2022)")
    return (f"not private: choosing the best of {n} trials uses the training data again and no guarantee covers "
            "the choice; each trial's epsilon holds for that trial alone (tuning_privacy gives an end-to-end one)")


def ui_base(tracking_uri: str) -> str:
    """The MLflow UI's address: the tracking server itself, or ``mlflow ui``'s local default."""
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return LOCAL_UI


def compare_url(base: str, experiment_id, run_ids: list[str]) -> str:
    """The address of MLflow's compare view of ``run_ids``: runs and experiments as JSON lists,
    URL-encoded (``["a","b"]`` -> ``%5B%22a%22%2C%22b%22%5D``)."""
    if not run_ids:
        return ""

    def enc(values) -> str:
        return quote(json.dumps([str(v) for v in values], separators=(",", ":")), safe="")

    return f"{base.rstrip('/')}/#/compare-runs?runs={enc(run_ids)}&experiments={enc([experiment_id])}"


def child_runs(client, info: dict) -> dict[str, str]:
    """Ray trial id -> MLflow run id of every child run of the sweep (one search)."""
    runs = retry(lambda: client.search_runs([str(info["experiment_id"])],
                                            filter_string=f"tags.`{TAG_PARENT}` = '{info['parent_run_id']}'",
                                            max_results=50000), what="search_runs(children)")
    ordered = sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id))
    return {r.data.tags.get(TAG_TRIAL, r.info.run_id): r.info.run_id for r in ordered}


def record_best(info: dict, spec, rows: list[dict]) -> Best:
    """Find the best trial by ``spec.search.metric``, tag it and the compare view on the parent run
    (only the compare view when the spec names no metric)."""
    from mlflow.entities import Metric, RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient(info["tracking_uri"])
    children = child_runs(client, info)
    url = compare_url(ui_base(info["tracking_uri"]), info["experiment_id"], list(children.values()))
    metric, mode = spec.search.metric, spec.search.mode or "max"
    row = best_trial(rows, metric, mode) if metric else None
    run_id = children.get(str(row.get("trial_id", ""))) if row else None
    tags, metrics = [], []
    if url:
        tags.append(RunTag("dpsweep.compare_url", url if len(url) <= MAX_TAG else
                           f"{len(children)} runs: too many for one tag; open the experiment's runs view"))
    if row is not None:
        tags += [RunTag("dpsweep.best_trial_id", str(row.get("trial_id", ""))),
                 RunTag("dpsweep.best_metric", f"{metric} ({mode})")]
        if run_id:
            tags.append(RunTag("dpsweep.best_run_id", run_id))
        metrics.append(Metric(f"best_{metric}", float(row[metric]), int(time.time() * 1000), 0))
    if tags or metrics:
        retry(lambda: client.log_batch(info["parent_run_id"], metrics=metrics, tags=tags), what="log_batch(best)")
    return Best(metric or "", mode, row, run_id, url, len(children), spec.tuning_privacy is not None,
                claims_privacy([row.get("trainable") for row in rows]) if rows else True)


def describe_best(best: Best, shown_keys: list[str] | None = None, n: int | None = None) -> str:
    """The console's ``best:`` line: trial, metric value, its swept values and the caveat."""
    if not best.metric:
        return "best:     no best trial (the spec sets no single search.metric)"
    if best.row is None:
        return f"best:     no finished trial has {best.metric}"
    r = best.row
    keys = [k for k in (shown_keys or []) if k in r]
    values = ", ".join(f"{k[len('cfg.'):] if k.startswith('cfg.') else k}={_fmt(r[k])}" for k in keys)
    where = f" ({values})" if values else ""
    run = f", run {best.run_id}" if best.run_id else ""
    return (f"best:     trial {r.get('trial_id', '?')}{where} with {best.metric} = {_fmt(r[best.metric])} "
            f"({best.mode}{run}); {selection_caveat(best.private, n if n is not None else 0, best.claims_privacy)}")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)
