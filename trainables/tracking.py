"""MLflow logging for trials: one child run per trial under the sweep's parent run.

All calls go through ``MlflowClient`` with an explicit tracking URI (no global MLflow state, so
trials in one worker process cannot leak runs into each other) and are retried with backoff:
a tracking server that is briefly away delays logging but loses nothing; one that stays away
fails the trial loudly; an error that cannot succeed (an unknown run or experiment, a refused
request: ``is_permanent``) fails it at once with MLflow's own message.

A trial finds its child run in this order: the run id stored in its checkpoint; an existing run
under the same parent tagged with its Ray trial id (a retry that crashed before its first
checkpoint: Tune's retries keep the id); a run tagged with its trial key (``dpsweep.trial_key``: its
trainable, config and repeat, which survive a restart: ``trainables.runtime.trial_key``) that an
attempt under an *earlier* dpsweep driver left FAILED or KILLED (an errored trial that ``dpsweep
resume`` restarts under a new Ray trial id, a trial Tune re-creates after a driver crash; the
driver's session is ``dpsweep.driver_session``); otherwise it creates one. A retried or restored
trial therefore never opens a second run, and two trials of one driver never share one.

Nothing is logged twice: a trial that reopens its run (a retry, ``dpsweep resume``) first reads
which (metric, step) pairs the run already holds, and ``log_metrics`` skips those. An interruption
between an epoch's MLflow log and its checkpoint therefore re-runs the epoch from the previous
checkpoint (the same values: RNG states are checkpointed) without a second point in the history.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

TAG_TRIAL = "dpsweep.trial_id"   # Ray Tune's id of the attempt that last opened the run
TAG_KEY = "dpsweep.trial_key"    # what identifies the trial across restarts (trainables.runtime.trial_key)
TAG_SESSION = "dpsweep.driver_session"   # the dpsweep driver (run or resume) whose attempt last opened the run
SESSION_ENV = "DPSWEEP_DRIVER_SESSION"    # set by sweeps.runner.ray_init for its workers
TAG_TRAINABLE = "dpsweep.trainable"
TAG_PARENT = "mlflow.parentRunId"
TAG_DEVICE = "dpsweep.device"
TAG_NOISE = "dpsweep.noise"   # "secret", or the research mode's label (docs/threat_model.md)
#: the keys a child run's name always shows when the trial has them (besides the swept ones)
NAME_ALWAYS = ("seed",)


def run_name(trainable: str, config: dict, swept: list[str] | tuple[str, ...] = ()) -> str:
    """A child run's name: the trainable and the values of the swept keys (those that differ
    between the sweep's trials of this trainable) and the seed, e.g. ``dpsgd epsilon=1 seed=0``."""
    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:g}"
        return str(v).replace(" ", "")

    keys = [k for k in swept if k in config and k not in NAME_ALWAYS]
    keys += [k for k in NAME_ALWAYS if k in config]
    return " ".join([trainable, *(f"{k}={fmt(config[k])}" for k in keys)])[:250]


#: HTTP statuses of MLflow errors worth retrying: a timeout, a conflicting concurrent write, a rate limit
TRANSIENT_HTTP = (408, 409, 429)


def is_permanent(exc: BaseException) -> bool:
    """Whether an MLflow error cannot succeed on a retry: an ``MlflowException`` (``RestException``
    included) whose error code maps to an HTTP 4xx status other than 408/409/429, e.g.
    ``RESOURCE_DOES_NOT_EXIST`` (404: "No Experiment with id=3 exists", an unknown run id),
    ``INVALID_PARAMETER_VALUE``/``BAD_REQUEST`` (400), ``UNAUTHENTICATED``/``PERMISSION_DENIED``
    (401/403). Everything else is transient: connection errors and timeouts, 5xx
    (``INTERNAL_ERROR``, ``TEMPORARILY_UNAVAILABLE``), rate limits, SQLite's "database is locked"."""
    from mlflow.exceptions import MlflowException

    if not isinstance(exc, MlflowException):
        return False
    try:
        status = int(exc.get_http_status_code())
    except (TypeError, ValueError):
        return False
    return 400 <= status < 500 and status not in TRANSIENT_HTTP


ATTEMPTS_ENV = "DPSWEEP_MLFLOW_ATTEMPTS"   # how many times ``retry`` tries a call (default ATTEMPTS)
ATTEMPTS = 8


class TrackingDown(RuntimeError):
    """An MLflow call failed on every attempt with an error that a retry could cure (a refused
    connection, a timeout, HTTP 5xx): the tracking server or store is down, not the request wrong.
    One line: ``MLflow <call> failed after N attempts (S s): <MLflow's error>``. The sweep stops
    on it (``sweeps.runner.TrackingWatch``; docs/faults.md)."""


_single_attempt = contextvars.ContextVar("dpsweep_mlflow_single_attempt", default=False)


@contextlib.contextmanager
def single_attempt():
    """Inside, ``retry`` tries each call once: for recording how things ended once a call has just
    failed through all its attempts (``TrackingDown``), where a store that is still down would
    otherwise cost a full retry per record."""
    token = _single_attempt.set(True)
    try:
        yield
    finally:
        _single_attempt.reset(token)


def default_attempts() -> int:
    """``DPSWEEP_MLFLOW_ATTEMPTS`` (at least 1), else 8."""
    try:
        return max(1, int(os.environ.get(ATTEMPTS_ENV) or ATTEMPTS))
    except ValueError:
        return ATTEMPTS


def brief_error(exc: BaseException) -> str:
    """MLflow's error in a few words where it is one of the usual ones (``HTTP 500 from <url>``,
    ``connection refused by <url>``, ``no answer within 20 s from <url>``), else its text on one line."""
    import re

    text = " ".join(str(exc).split()) or type(exc).__name__
    found = re.search(r"API request to (\S+) failed", text)
    url = found.group(1) if found else ""
    for pattern, words in ((r"too many (\d{3}) error responses", "HTTP {0} from {url}"),
                           (r"Connection refused", "connection refused by {url}"),
                           (r"read timeout=([\d.]+)", "no answer within {0} s from {url}")):
        m = re.search(pattern, text)
        if m and url:
            return words.format(*m.groups(), url=url)
    return text[:1000]


def retry(fn: Callable[[], T], *, what: str, attempts: int | None = None, first_wait: float = 0.5) -> T:
    """Call ``fn`` until it succeeds: ``attempts`` tries (default ``default_attempts()``, 8),
    waiting 0.5, 1, 2, 4, 8, 16, 30 s between them (61.5 s in all; each try is one MLflow call with
    MLflow's own retries inside: docs/faults.md). Then ``TrackingDown``. One try inside
    ``single_attempt()``.

    A permanent MLflow error (``is_permanent``) is raised at once, unchanged: retrying an unknown
    run id or a refused request only delays the same message.
    """
    attempts = 1 if _single_attempt.get() else (default_attempts() if attempts is None else max(1, attempts))
    wait = first_wait
    t0 = time.monotonic()
    for i in range(attempts):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - MLflow raises many kinds on a lost connection
            if is_permanent(exc):
                raise
            if i == attempts - 1:
                said = brief_error(exc)
                raise TrackingDown(f"MLflow {what} failed after {attempts} attempt{'s' if attempts > 1 else ''} "
                                   f"({time.monotonic() - t0:.0f} s): {said}") from exc
            log.warning("MLflow %s failed (%s); retrying in %.1fs", what, exc, wait)
            time.sleep(wait)
            wait = min(wait * 2, 30.0)
    raise AssertionError("unreachable")


@dataclass
class TrialTracker:
    """The child run of one trial."""

    tracking_uri: str
    experiment_id: str
    parent_run_id: str | None
    run_id: str
    logged: set[tuple[str, int]] = field(default_factory=set)  # (metric, step) pairs the run holds
    fresh: bool = False  # created by this attempt: it holds no params yet

    @functools.cached_property
    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.tracking_uri)

    @classmethod
    def open(cls, info: dict, *, trial_id: str, trial_name: str, trainable: str,
             run_id: str | None = None, key: str | None = None, session: str | None = None) -> "TrialTracker":
        """Find or create the trial's child run (see the module docstring); ``session``: the dpsweep
        driver this attempt runs under (``find_trial_run``)."""
        from mlflow.tracking import MlflowClient

        uri, exp, parent = info["tracking_uri"], str(info["experiment_id"]), info.get("parent_run_id")
        client = MlflowClient(uri)
        if run_id is None:
            found = find_trial_run(client, exp, parent, trial_id, key, session)
            if found is not None:
                run_id = found.info.run_id
        if run_id is None:
            tags = {TAG_TRIAL: trial_id, TAG_TRAINABLE: trainable, "mlflow.runName": trial_name,
                    **({TAG_KEY: key} if key else {}), **({TAG_SESSION: session} if session else {})}
            if parent:
                tags[TAG_PARENT] = parent
            run = retry(lambda: client.create_run(exp, tags=tags, run_name=trial_name), what="create_run")
            run_id = run.info.run_id
            return cls(uri, exp, parent, run_id, fresh=True)
        retry(lambda: client.update_run(run_id, status="RUNNING"), what="update_run")
        retry(lambda: client.set_tag(run_id, TAG_TRIAL, trial_id), what="set_tag(trial id)")
        if session:
            retry(lambda: client.set_tag(run_id, TAG_SESSION, session), what="set_tag(driver session)")
        return cls(uri, exp, parent, run_id, logged=_logged_points(client, run_id))

    def log_params(self, params: dict[str, Any], tags: dict[str, str] | None = None) -> None:
        """Log the params the run does not hold yet, and ``tags``, in as few store writes as MLflow
        allows (100 params and 100 tags a batch): one for a trial's start, where each write is a
        SQLite commit that costs more than a small trial's epoch."""
        from mlflow.entities import Param, RunTag

        flat = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
        existing = {} if self.fresh else retry(lambda: self.client.get_run(self.run_id), what="get_run").data.params
        todo = [p for p in flat if p.key not in existing]
        marks = [RunTag(k, str(v)[:5000]) for k, v in (tags or {}).items()]
        for i in range(0, max(len(todo), len(marks), 1), 100):
            batch, tag_batch = todo[i:i + 100], marks[i:i + 100]
            if batch or tag_batch:
                retry(lambda: self.client.log_batch(self.run_id, params=batch, tags=tag_batch),
                      what="log_batch(params)")
        self.fresh = False

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log each metric at ``step`` unless the run already holds that (metric, step) pair."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, int(step)) for k, v in metrics.items() if (k, int(step)) not in self.logged]
        for i in range(0, len(batch), 500):
            part = batch[i:i + 500]
            retry(lambda: self.client.log_batch(self.run_id, metrics=part), what="log_batch(metrics)")
        self.logged.update((m.key, m.step) for m in batch)

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        retry(lambda: self.client.log_artifact(self.run_id, path, artifact_path), what="log_artifact")

    def set_tag(self, key: str, value: str) -> None:
        retry(lambda: self.client.set_tag(self.run_id, key, value), what="set_tag")

    def finish(self, status: str = "FINISHED") -> None:
        retry(lambda: self.client.set_terminated(self.run_id, status=status), what="set_terminated")


def find_trial_run(client, experiment_id: str, parent: str | None, trial_id: str, key: str | None = None,
                   session: str | None = None):
    """The trial's child run under ``parent``: the one tagged with its Ray trial id (this attempt's
    lineage: Tune's retries keep the id), else one tagged with its trial key that an attempt of an
    *earlier driver* left FAILED or KILLED (``dpsweep resume`` restarts an errored trial under a new
    Ray id). The key is consulted only with a ``session`` (the dpsweep driver this attempt runs
    under; ``sweeps.runner.ray_init`` sets it) and only for a run another session opened last: within
    one driver two trials may share a key (a user's own Tuner sweeping a key the trainable drops, an
    Optuna proposal made twice), and one of them failing must not hand its run to the other. A
    RUNNING or FINISHED run with the key is never shared. None when there is none."""
    scope = f" and tags.`{TAG_PARENT}` = '{parent}'" if parent else ""

    def search(flt: str, most: int = 1):
        return retry(lambda: client.search_runs([experiment_id], filter_string=flt + scope, max_results=most,
                                                order_by=["attributes.start_time ASC"]), what="search_runs(trial)")

    found = search(f"tags.`{TAG_TRIAL}` = '{trial_id}'")
    if found:
        return found[0]
    if key and session:
        for status in ("FAILED", "KILLED"):
            for run in search(f"tags.`{TAG_KEY}` = '{key}' and attributes.status = '{status}'", 50):
                if run.data.tags.get(TAG_SESSION) != session:
                    return run
    return None


def _logged_points(client, run_id: str) -> set[tuple[str, int]]:
    """The (metric, step) pairs an existing run holds (its full metric histories)."""
    run = retry(lambda: client.get_run(run_id), what="get_run")
    out: set[tuple[str, int]] = set()
    for key in run.data.metrics:
        hist = retry(lambda: client.get_metric_history(run_id, key), what="get_metric_history")
        out.update((m.key, int(m.step)) for m in hist)
    return out
