"""The sweep's MLflow parent run: created by the driver once the spec is valid and Ray is up,
holding the spec (artifact and flattened params), the project version and git commit, and the
sweep's privacy summary when it ends."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import yaml

from trainables.tracking import retry

DEFAULT_DB = "mlflow.db"


def resolve_tracking_uri(cli_uri: str | None, spec_uri: str | None) -> str:
    """--tracking-uri, then the spec, then MLFLOW_TRACKING_URI, then sqlite:///<cwd>/mlflow.db,
    made absolute (``absolute_tracking_uri``)."""
    uri = cli_uri or spec_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{DEFAULT_DB}"
    return absolute_tracking_uri(uri)


# the stores MLflow's client opens (a path without a scheme is a file store)
TRACKING_SCHEMES = ("http", "https", "sqlite", "file", "postgresql", "mysql", "mssql", "databricks",
                    "databricks-uc", "uc", "mlflow-artifacts")


def tracking_uri_problem(uri: str) -> str | None:
    """Why MLflow cannot use ``uri`` as a tracking store (its scheme), or None."""
    head = uri.split("://", 1)[0] if "://" in uri else None
    if head is None:
        return None   # a path (a file store), or databricks / uc
    scheme = head.split("+", 1)[0].lower()
    if scheme not in TRACKING_SCHEMES:
        return (f"scheme {head!r} is not a tracking store MLflow opens (one of {', '.join(TRACKING_SCHEMES[:8])}, "
                "or a local path)")
    return None


def absolute_tracking_uri(uri: str) -> str:
    """A tracking URI that names the same store from any working directory: a relative SQLite
    path (``sqlite:///mlflow.db``) or a plain relative path (a file store) is resolved against
    this process's working directory. Ray runs each trial in a working directory of its own, where
    the relative form would open a stray, empty store. Other URIs are returned unchanged."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    if "://" not in uri and ":" not in uri.split("/", 1)[0] and uri not in ("databricks", "databricks-uc", "uc"):
        return str(Path(uri).expanduser().resolve())
    return uri


class TrackingUnreachable(ValueError):
    """The MLflow tracking store cannot be reached or written (one line, naming the URI)."""


def check_tracking_store(uri: str, *, field: str = "tracking URI", timeout: float | None = None, tries: int = 2) -> None:
    """Fail fast (``TrackingUnreachable``) when ``uri`` cannot work, before Ray starts or any
    MLflow run exists: an ``http(s)://`` tracking server is probed at ``/health`` (MLflow's
    liveness endpoint; ``/api/2.0/mlflow/experiments/search`` where a proxy hides it) with a
    ``timeout``-second limit (default: ``probe_timeout()``, the limit MLflow's own requests get, so a
    slow but live server that the sweep's calls would reach is not refused), ``tries`` times; a
    SQLite database or a file store must be writable by this process. Other stores (postgresql://,
    databricks, ...) are left to MLflow.

    MLflow's own client retries a refused connection for about two minutes per call, so without
    this a sweep against a server that is not running stays silent for minutes."""
    problem = tracking_uri_problem(uri)
    if problem:
        raise TrackingUnreachable(f"{field}: {uri}: {problem}")
    if uri.startswith(("http://", "https://")):
        _probe_server(uri, field=field, timeout=probe_timeout() if timeout is None else timeout, tries=tries)
        return
    if uri.startswith("sqlite:///"):
        _check_writable(Path(uri[len("sqlite:///"):]), uri, field, is_file=True)
    elif uri.startswith("file:"):
        from urllib.parse import urlparse

        _check_writable(Path(urlparse(uri).path), uri, field, is_file=False)
    elif "://" not in uri and ":" not in uri.split("/", 1)[0] and uri not in ("databricks", "databricks-uc", "uc"):
        _check_writable(Path(uri), uri, field, is_file=False)


def probe_timeout() -> float:
    """Seconds the start-up probe waits for each answer: ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (what MLflow's
    own requests wait; ``bound_mlflow_http`` makes it 20 s unless the user set it), at least 1 s.
    A fixed 2.5 s refused a live server under load (issue 49, point 6) that the sweep's own calls
    would have reached."""
    try:
        value = float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT") or MLFLOW_HTTP_BOUNDS["MLFLOW_HTTP_REQUEST_TIMEOUT"])
    except ValueError:
        value = float(MLFLOW_HTTP_BOUNDS["MLFLOW_HTTP_REQUEST_TIMEOUT"])
    return max(1.0, value)


def _check_writable(path: Path, uri: str, field: str, *, is_file: bool) -> None:
    path = path.expanduser()
    if path.exists():
        target = path
    elif is_file:  # SQLite creates the database file, not its directory
        target = path.parent
        if not target.is_dir():
            raise TrackingUnreachable(f"{field}: {uri}: the directory {target} of the SQLite database does not "
                                      f"exist; create it or pass another tracking URI")
    else:  # a file store creates its directory and parents
        target = path
        while not target.exists() and target != target.parent:
            target = target.parent
    if not os.access(target, os.W_OK | (os.X_OK if target.is_dir() else 0)):
        raise TrackingUnreachable(f"{field}: {uri}: {target} is not writable by this user; pass a tracking URI "
                                  f"in a writable place")


def _probe_server(uri: str, *, field: str, timeout: float, tries: int) -> None:
    import ssl
    import time
    import urllib.error
    import urllib.request

    context = None
    if uri.startswith("https://"):
        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("1", "true"):
            context = ssl._create_unverified_context()  # noqa: S323 - what MLflow itself does with this setting
        else:
            context = ssl.create_default_context(cafile=os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or None)
    base = uri.rstrip("/")
    reason = ""
    api = "/api/2.0/mlflow/experiments/search?max_results=1"

    def status_of(path: str) -> int | None:
        nonlocal reason
        try:
            with urllib.request.urlopen(base + path, timeout=timeout, context=context) as resp:  # noqa: S310
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError) as exc:
            cause = getattr(exc, "reason", exc)
            timed_out = isinstance(cause, TimeoutError) or "timed out" in str(cause)
            reason = "timeout" if timed_out else str(cause or exc)
            return None

    for attempt in range(max(1, tries)):
        if attempt:
            time.sleep(0.5)
        health = status_of("/health")
        if health is None:
            continue
        # the REST API too: a server whose /health answers while its store fails (HTTP 500 on every
        # call) would otherwise pass, then fail the sweep after MLflow's own retries (issue 33, point 6)
        rest = status_of(api)
        if rest is None:
            continue
        if health == 404 and rest == 404:
            raise TrackingUnreachable(f"{field}: {uri} answers, but not as an MLflow tracking server (HTTP 404 on "
                                      f"/health and on the REST API); check the address")
        if health >= 500 or rest >= 500:
            reason = f"HTTP {health} on /health" if health >= 500 else f"HTTP {rest} on its REST API"
            continue
        return  # 2xx, 3xx, or 4xx such as 401: the server is there (credentials are MLflow's to send)
    if reason.startswith("HTTP"):
        raise TrackingUnreachable(f"{field}: the MLflow tracking server at {uri} fails ({reason}, {tries} tries); "
                                  f"its log or its backend store says why")
    if reason == "timeout":   # a live server under load answers slowly: say how long we waited (issue 49.6)
        raise TrackingUnreachable(f"{field}: the MLflow tracking server at {uri} did not answer within {timeout:g} s "
                                  f"({tries} tries; MLFLOW_HTTP_REQUEST_TIMEOUT sets how long to wait); check that "
                                  f"it runs and is not overloaded, or pass another --tracking-uri")
    raise TrackingUnreachable(f"{field}: no MLflow tracking server answers at {uri} ({reason}, {tries} tries); "
                              f"start one (mlflow server --host HOST --port PORT) or pass another --tracking-uri")


def git_commit() -> str:
    try:
        here = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def project_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dpsweep")
    except PackageNotFoundError:
        return "unknown"


#: MLflow 3's UI opens an experiment in its GenAI view (traces) unless this tag says otherwise
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def experiment_id(client, name: str) -> str:
    """The id of experiment ``name`` (created, or restored if deleted), tagged as model training
    (``mlflow.experimentKind``) on creation and on every reuse."""
    exp = retry(lambda: client.get_experiment_by_name(name), what="get_experiment_by_name")
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            retry(lambda: client.restore_experiment(exp.experiment_id), what="restore_experiment")
        exp_id = exp.experiment_id
        if exp.tags.get(EXPERIMENT_KIND[0]) == EXPERIMENT_KIND[1]:
            return exp_id
    else:
        exp_id = retry(lambda: client.create_experiment(name, tags=dict([EXPERIMENT_KIND])), what="create_experiment")
    retry(lambda: client.set_experiment_tag(exp_id, *EXPERIMENT_KIND), what="set_experiment_tag")
    return exp_id


class TrackingFailed(RuntimeError):
    """The tracking store failed while the sweep was being set up; the message is one line."""


#: MLflow's HTTP client retries, bounded for dpsweep unless the user sets them (docs/faults.md):
#: a call's request times out after 20 s and is retried twice, and ``retry`` repeats a failing call
#: 8 times with 61.5 s of waits, so a server answering HTTP 500 ends a call in about 80 s (the sweep
#: stops about 95 s after the first failing answer), one whose every request hangs until its
#: timeout in about 9.5 minutes. ``ray_init`` hands them to the workers of a cluster too.
MLFLOW_HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                      "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


def bound_mlflow_http() -> None:
    """Set ``MLFLOW_HTTP_BOUNDS`` in this process's environment (the trials of a local Ray inherit
    it) where the user has not set them: MLflow's defaults (7 retries, factor 2, 120 s) keep a call
    against a failing server going for tens of minutes (issue 33, point 6)."""
    for key, value in MLFLOW_HTTP_BOUNDS.items():
        os.environ.setdefault(key, value)


def start_parent_run(tracking_uri: str, experiment: str, run_name: str, spec_raw: dict, flat_params: dict,
                     planned: int | None = None) -> dict:
    """Create the parent run; returns the info trials need (``_mlflow`` in their config), with the
    tracking URI made absolute (``absolute_tracking_uri``): ``sqlite:///mlflow.db`` names the
    database in this process's working directory, for every trial. ``planned``: the number of
    trials the sweep will run, tagged ``dpsweep.trials_planned`` (the report of an interrupted sweep
    says how many of them finished).

    A store that fails part-way raises ``TrackingFailed`` (one line) after setting the run it
    created FAILED where the store still takes that write: no parent run is left RUNNING by a sweep
    that never started."""
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    tracking_uri = absolute_tracking_uri(tracking_uri)  # trials run in other working directories
    client = MlflowClient(tracking_uri)
    run_id = None
    try:
        exp_id = experiment_id(client, experiment)
        tags = {"mlflow.runName": run_name, "dpsweep.kind": "sweep", "dpsweep.version": project_version(),
                "dpsweep.git_commit": git_commit(), "mlflow.source.git.commit": git_commit()}
        if planned is not None:
            tags["dpsweep.trials_planned"] = str(int(planned))
        run = retry(lambda: client.create_run(exp_id, tags=tags, run_name=run_name), what="create_run")
        run_id = run.info.run_id
        params = [Param(k[:250], str(v)[:6000]) for k, v in sorted(flat_params.items())]
        for i in range(0, len(params), 100):
            batch = params[i:i + 100]
            retry(lambda: client.log_batch(run_id, params=batch), what="log_batch(params)")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "spec.yaml"
            path.write_text(yaml.safe_dump(spec_raw, sort_keys=False))
            retry(lambda: client.log_artifact(run_id, str(path)), what="log_artifact(spec)")
    except Exception as exc:  # noqa: BLE001 - MLflow raises many kinds; the message says which
        left = ""
        if run_id is not None:
            try:
                client.set_terminated(run_id, status="FAILED")
                left = f"; its parent run {run_id} is FAILED"
            except Exception:  # noqa: BLE001
                left = f"; its parent run {run_id} could not be closed (the store refuses writes)"
        last = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        raise TrackingFailed(f"MLflow tracking store {tracking_uri} failed while the sweep was set up "
                             f"({last}){left}; nothing ran") from exc
    return {"tracking_uri": tracking_uri, "experiment_id": exp_id, "parent_run_id": run_id}


def reopen_parent_run(info: dict) -> int:
    """``dpsweep resume``: the interrupted sweep's parent run is RUNNING again, and the child runs an
    earlier driver left RUNNING are KILLED (``close_stale_children``; their number is returned)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(info["tracking_uri"])
    parent = info["parent_run_id"]
    tags = retry(lambda: client.get_run(parent), what="get_run(parent)").data.tags
    retry(lambda: client.update_run(parent, status="RUNNING"), what="update_run(parent)")
    if "dpsweep.interrupted" in tags:   # only a sweep that was interrupted is "resumed"
        retry(lambda: client.set_tag(parent, "dpsweep.interrupted", "resumed"), what="set_tag")
    if "dpsweep.error" in tags:         # the crash it recorded is over: a resumed sweep ends with its own state
        retry(lambda: client.delete_tag(parent, "dpsweep.error"), what="delete_tag(error)")
    return close_stale_children(client, info)


def close_stale_children(client, info: dict) -> int:
    """Set KILLED the child runs still RUNNING under the parent when ``dpsweep resume`` starts: no
    trial of the new driver runs yet, so they are an earlier driver's, left RUNNING because the
    tracking store refused their last writes (it was down: issue 49, point 1) or the driver was
    killed. A restored trial reopens its own by its Ray trial id, a restarted one by its trial key
    (``trainables.tracking.find_trial_run``, which adopts a KILLED run, never a RUNNING one).
    Returns how many were closed."""
    from trainables.tracking import TAG_PARENT

    running = retry(lambda: client.search_runs(
        [str(info["experiment_id"])],
        filter_string=f"tags.`{TAG_PARENT}` = '{info['parent_run_id']}' and attributes.status = 'RUNNING'",
        max_results=10000), what="search_runs(running children)")
    for run in running:
        retry(lambda: client.set_terminated(run.info.run_id, status="KILLED"), what="set_terminated(stale child)")
    return len(running)


def stop_parent_run(info: dict, status: str, note: str) -> int:
    """An interrupted (``KILLED``) or crashed (``FAILED``) sweep: the parent run and its child runs
    still RUNNING get ``status``; ``note`` goes in the parent's ``dpsweep.interrupted`` tag (how to
    resume) or ``dpsweep.error`` tag. Returns the number of child runs stopped."""
    from mlflow.tracking import MlflowClient

    from trainables.tracking import TAG_PARENT

    client = MlflowClient(info["tracking_uri"])
    parent = info["parent_run_id"]
    retry(lambda: client.set_tag(parent, "dpsweep.interrupted" if status == "KILLED" else "dpsweep.error",
                                 note[:5000]), what="set_tag(parent)")
    running = retry(lambda: client.search_runs(
        [str(info["experiment_id"])], filter_string=f"tags.`{TAG_PARENT}` = '{parent}' and attributes.status = 'RUNNING'",
        max_results=10000), what="search_runs(running children)")
    for run in running:
        retry(lambda: client.set_terminated(run.info.run_id, status=status), what="set_terminated(child)")
    retry(lambda: client.set_terminated(parent, status=status), what="set_terminated(parent)")
    return len(running)


def child_statuses(info: dict) -> dict[str, str]:
    """The status of each child run under the sweep's parent run, by Ray trial id
    (``dpsweep.trial_id``): which trials MLflow has FINISHED (issue 24, point 11)."""
    from mlflow.tracking import MlflowClient

    from trainables.tracking import TAG_PARENT, TAG_TRIAL

    client = MlflowClient(info["tracking_uri"])
    runs = retry(lambda: client.search_runs(
        [str(info["experiment_id"])], filter_string=f"tags.`{TAG_PARENT}` = '{info['parent_run_id']}'",
        max_results=10000), what="search_runs(children)")
    return {r.data.tags[TAG_TRIAL]: r.info.status for r in runs if TAG_TRIAL in r.data.tags}


def finish_parent_run(info: dict, summary: dict[str, float], status: str,
                      errors: dict[str, str] | None = None) -> None:
    """Log the sweep's summary and close its parent run ``status``. A child run still RUNNING at the
    end belongs to a trial whose process died without closing it (killed by Ray's memory monitor or
    the OOM killer, a lost node): it is set FAILED, with Ray's error for that trial (``errors``, by
    Ray trial id) as its ``dpsweep.error`` tag (issue 33, point 3)."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient
    import time

    from trainables.tracking import TAG_PARENT, TAG_TRIAL

    client = MlflowClient(info["tracking_uri"])
    parent = info["parent_run_id"]
    running = retry(lambda: client.search_runs(
        [str(info["experiment_id"])], filter_string=f"tags.`{TAG_PARENT}` = '{parent}' and attributes.status = 'RUNNING'",
        max_results=10000), what="search_runs(running children)")
    for run in running:
        why = (errors or {}).get(run.data.tags.get(TAG_TRIAL, ""), "the trial's process ended without closing its run")
        retry(lambda: client.set_tag(run.info.run_id, "dpsweep.error", why[:5000]), what="set_tag(child error)")
        retry(lambda: client.set_terminated(run.info.run_id, status="FAILED"), what="set_terminated(child)")
    ts = int(time.time() * 1000)
    metrics = [Metric(k, float(v), ts, 0) for k, v in summary.items()]
    if metrics:
        retry(lambda: client.log_batch(parent, metrics=metrics), what="log_batch(summary)")
    retry(lambda: client.set_terminated(parent, status=status), what="set_terminated")


def record_runless_failures(info: dict, failed: list[tuple[str, dict, str]]) -> int:
    """Every trial that failed for good has a child run saying why (issue 49, point 5). ``failed``:
    (Ray trial id, trial config, the last attempt's cause) of each errored trial. A trial that
    failed before it opened its run (killed by Ray's memory monitor, a time limit or an error while
    loading its data or building its model) has none: the driver finds it the way the trial would
    (``trainables.tracking.find_trial_run``: by its Ray trial id, else by its trial key among the
    runs an earlier driver left FAILED or KILLED) or opens it, with the trial's tags (Ray id, trial
    key, trainable, this driver's session), name and params, then records the cause as
    ``dpsweep.error`` and closes it FAILED. A restarted trial (``dpsweep resume``) logs into that
    run. A run that already holds a ``dpsweep.error`` (the trial recorded its own) is left as it
    is; one still RUNNING is ``finish_parent_run``'s. Returns how many runs were written."""
    from mlflow.entities import Param, RunTag
    from mlflow.tracking import MlflowClient

    from trainables.runtime import TAG_ERROR
    from trainables.tracking import (SESSION_ENV, TAG_KEY, TAG_PARENT, TAG_SESSION, TAG_TRAINABLE, TAG_TRIAL,
                                     TrackingDown, find_trial_run)

    if not failed:
        return 0
    client = MlflowClient(info["tracking_uri"])
    exp, parent = str(info["experiment_id"]), info["parent_run_id"]
    session = os.environ.get(SESSION_ENV) or None
    written = 0
    for trial_id, config, why in failed:
        try:
            trainable, key, params, name = _trial_identity(config, info)
            run = find_trial_run(client, exp, parent, trial_id, key, session)
            if run is not None and (run.info.status == "RUNNING" or TAG_ERROR in run.data.tags
                                    and run.data.tags.get(TAG_TRIAL) == trial_id):
                continue
            tags = {TAG_TRIAL: trial_id, TAG_ERROR: why[:5000], **({TAG_SESSION: session} if session else {})}
            if run is None:
                tags.update({TAG_PARENT: parent, TAG_TRAINABLE: trainable, "mlflow.runName": name,
                             **({TAG_KEY: key} if key else {})})
                run = retry(lambda: client.create_run(exp, tags=tags, run_name=name), what="create_run(failed trial)")
                batch = [Param(k[:250], str(v)[:6000]) for k, v in sorted(params.items())]
                for i in range(0, len(batch), 100):
                    part = batch[i:i + 100]
                    retry(lambda: client.log_batch(run.info.run_id, params=part), what="log_batch(failed trial)")
            else:   # an earlier driver's run of this trial, which this attempt never reached
                marks = [RunTag(k, v) for k, v in tags.items()]
                retry(lambda: client.log_batch(run.info.run_id, tags=marks), what="log_batch(failed trial)")
            retry(lambda: client.set_terminated(run.info.run_id, status="FAILED"), what="set_terminated(failed trial)")
            written += 1
        except TrackingDown:
            raise
        except Exception:  # noqa: BLE001 - one trial's record must not stop the others' or the sweep's end
            continue
    return written


def _trial_identity(config: dict, info: dict) -> tuple[str, str | None, dict, str]:
    """(trainable, trial key, params, run name) of a trial from its Ray config, as ``run_trial``
    makes them (``trainables.runtime.trial_key``); a config its trainable's schema refuses has no
    key, and its params are the config as given."""
    from trainables.config import trial_config
    from trainables.registry import REGISTRY
    from trainables.runtime import HIDDEN_KEYS, trial_key, validate_config
    from trainables.tracking import run_name

    flat = trial_config(config)
    trainable = str(flat.get("trainable", ""))
    key, params = None, {k: v for k, v in flat.items() if k not in HIDDEN_KEYS}
    entry = REGISTRY.get(trainable)
    if entry is not None:
        try:
            cfg = validate_config(flat, entry.config_model)
            key, params = trial_key(cfg, trainable, flat), cfg.model_dump()
        except ValueError:
            pass
    name = run_name(trainable, params, (info.get("swept") or {}).get(trainable, ()))
    params = {"trainable": trainable, **params, **({"repeat": flat["repeat"]} if "repeat" in flat else {})}
    return trainable, key, params, name


SELECTION_NOT_COVERED = ("not covered: choosing among the trials ({best}) is not covered by any privacy "
                         "guarantee; each trial's epsilon holds for that trial alone (use tuning_privacy)")


def selection_not_covered(n: int) -> str:
    """The parent run's ``dpsweep.selection_privacy`` tag of a sweep without tuning_privacy."""
    from sweeps.words import best_of

    if n == 1:
        return "nothing chosen: the sweep ran one trial, whose own epsilon covers it"
    return SELECTION_NOT_COVERED.format(best=best_of(n, "trial"))


def record_selection(info: dict, spec, rows: list[dict], tuning: dict[str, float] | None) -> dict | None:
    """Record on the parent run what the sweep's selection among trials costs.

    Without ``tuning_privacy``: a tag stating plainly that the selection is not covered. With it:
    the end-to-end guarantee (``tuning_epsilon`` at ``tuning_delta``, K, the worst per-trial
    epsilon) and the released trial: ``released_<metric>``, tags ``dpsweep.released_trial_id`` /
    ``dpsweep.released_run_id``, and its model copied to ``released/``. Returns the released row.
    """
    from mlflow.entities import Metric, RunTag
    from mlflow.tracking import MlflowClient
    import time

    from sweeps.spec.tuning import best_row

    client = MlflowClient(info["tracking_uri"])
    run_id = info["parent_run_id"]
    ts = int(time.time() * 1000)
    if tuning is None:
        tag = RunTag("dpsweep.selection_privacy", selection_not_covered(len(rows)))
        retry(lambda: client.log_batch(run_id, tags=[tag]), what="log_batch(selection tag)")
        return None
    tp = spec.tuning_privacy
    tags = [RunTag("dpsweep.selection_privacy",
                   f"tuning_privacy: {tp.distribution}, mean {tp.mean:g}; only the released trial is covered by "
                   f"the end-to-end epsilon {tuning['tuning_epsilon']:.4g} at delta {tuning['tuning_delta']:.3g}")]
    metrics = [Metric(k, float(v), ts, 0) for k, v in tuning.items()]
    best = best_row(rows, spec.search.metric, spec.search.mode)
    if best is not None:
        metrics.append(Metric(f"released_{spec.search.metric}", float(best[spec.search.metric]), ts, 0))
        import math

        held = best.get(f"heldout_{spec.search.metric}")   # a selection split: the headline (issue 34, point 2)
        if isinstance(held, (int, float)) and math.isfinite(held):
            metrics.append(Metric(f"released_heldout_{spec.search.metric}", float(held), ts, 0))
        tags.append(RunTag("dpsweep.released_trial_id", str(best.get("trial_id", ""))))
        child = _child_run(client, info, str(best.get("trial_id", "")))
        if child is not None:
            tags.append(RunTag("dpsweep.released_run_id", child))
            retry(lambda: client.set_tag(child, "dpsweep.released", "true"), what="set_tag(released)")
            _copy_model(client, child, run_id)
    retry(lambda: client.log_batch(run_id, metrics=metrics, tags=tags), what="log_batch(tuning privacy)")
    return best


def _child_run(client, info: dict, trial_id: str) -> str | None:
    if not trial_id:
        return None
    runs = retry(lambda: client.search_runs(
        [info["experiment_id"]],
        filter_string=f"tags.mlflow.parentRunId = '{info['parent_run_id']}' and tags.`dpsweep.trial_id` = '{trial_id}'",
        max_results=5), what="search_runs(released)")
    return runs[0].info.run_id if runs else None


def _copy_model(client, child: str, parent: str) -> None:
    """The released trial's model, as the sweep's output (``released/weights.pt`` on the parent)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(child, "model/weights.pt", tmp)
        except Exception:  # noqa: BLE001 - a trainable without a model artifact releases its score only
            return
        retry(lambda: client.log_artifact(parent, path, "released"), what="log_artifact(released model)")
