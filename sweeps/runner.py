"""Build and run the Ray Tune experiment of a validated sweep spec, and resume one.

The experiment directory (``<storage>/<name>``) also holds ``dpsweep.json``: the MLflow parent
run of the sweep and the settings ``dpsweep resume`` needs to finish it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import uuid
from pathlib import Path

from ray import tune
from ray.exceptions import RayActorError

from sweeps.disk import local_paths
from trainables.dispatch import dispatch

STATE_FILE = "dpsweep.json"


def finished(trial) -> bool:
    """Whether a trial finished: Ray has its final result (``evaluated`` = 1). The trial closes its
    MLflow child run FINISHED just before reporting that result, and a trial whose child run is
    already FINISHED reports the run's metrics on restore instead of training again
    (``trainables.runtime``), so this and MLflow agree once the sweep ends; Ray's TERMINATED does
    not mean finished (an interrupted sweep's running trials end TERMINATED too, issue 24)."""
    return bool((trial.last_result or {}).get("evaluated"))


class ProgressPrinter(tune.Callback):
    """One line per epoch result and per finished, stopped or failed trial. The ``[k/N]`` count
    is of the finished trials (``finished``) among all the experiment's trials, restored ones
    included, so a resumed sweep continues the count instead of restarting it."""

    def __init__(self, total: int | None = None):
        self.total = total
        self.done = 0
        self.failed = 0
        self.t0 = time.time()

    def setup(self, **info):
        self.t0 = time.time()  # also on `dpsweep resume`, which restores the pickled callback

    def _say(self, msg: str) -> None:
        # sys.stdout is looked up on each call: the callback is pickled with the experiment state
        print(f"[{time.time() - self.t0:6.0f}s] {msg}", file=sys.stdout, flush=True)

    def on_trial_start(self, iteration, trials, trial, **info):
        self._say(f"started  {trial.trial_id} ({_describe(trial.config)})")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if result.get("checkpoint_fallback"):   # a torn checkpoint was skipped (trainables.runtime)
            self._say(f"restored {trial.trial_id} past a corrupt checkpoint: {result['checkpoint_fallback']}")
        if "test_acc" in result and "evaluated" not in result:
            # train_loss is a non-private diagnostic (absent with diagnostics: false; docs/metrics.md)
            loss = f"train_loss {result['train_loss']:.4f} (diagnostic), " if "train_loss" in result else ""
            self._say(f"progress {trial.trial_id} epoch {result.get('epoch')}: "
                      f"{loss}test_acc {result.get('test_acc', float('nan')):.4f}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        r = trial.last_result or {}
        if not finished(trial):  # a scheduler (ASHA) stopped it before its evaluation
            self._say(f"stopped  {trial.trial_id} by the scheduler after epoch {r.get('epoch', 0)} (not evaluated)")
            return
        self.done = sum(finished(t) for t in trials) if trials else self.done + 1
        keys = [k for k in ("acc_clean", "epsilon") if k in r]
        keys += sorted(k for k in r if k.startswith("cert_acc_"))[:3]
        keys += [k for k in ("mia_auc", "mia_tpr_at_fpr_0.001", "mia_eps_lb") if k in r]  # the mia key's attack
        keys += [k for k in ("label_epsilon", "label_inference_advantage", "label_inference_eps_lb")
                 if k in r and "label_inference_eps_lb" in r]   # the label_attack key's attack beside its claim
        shown = ", ".join(f"{k} {r[k]:.4f}" for k in keys)
        total = f"/{self.total}" if self.total else ""
        self._say(f"finished {trial.trial_id} [{self.done}{total}] {shown}")

    def on_trial_recover(self, iteration, trials, trial, **info):
        if _killed_for_memory(trial):
            self._say(f"killed   {trial.trial_id} ({_describe(trial.config)}) by Ray's memory monitor: {MEMORY_HINT}; "
                      "retried from its last checkpoint")

    def on_trial_error(self, iteration, trials, trial, **info):
        # the last attempt's cause: after a memory kill, a later attempt may fail otherwise (issue 49.5)
        self.failed += 1
        if _killed_for_memory(trial):
            why = f" killed by Ray's memory monitor: {MEMORY_HINT};"
        else:
            cause = last_failure_cause(trial)
            why = f" {cause[:300]};" if cause else ""
        self._say(f"FAILED   {trial.trial_id} ({_describe(trial.config)});{why} see {trial.local_path}")


MEMORY_HINT = "the node ran low on memory (lower max_concurrent_trials or the batch size)"


class KilledForMemory(RayActorError):
    """A trial's worker killed by Ray's memory monitor, as the actor failure it is (issue 33, point 3)."""


def last_failure(trial) -> str:
    """The text of the trial's last failure in Tune's error file, which holds every attempt's
    (``Failure # 1 (occurred at ...)``, ``Failure # 2 ...``, appended); "" when there is none."""
    import re

    try:
        path = trial.error_file
        text = Path(path).read_text(errors="replace") if path else ""
    except Exception:  # noqa: BLE001 - only console lines and tags depend on it
        return ""
    return re.split(r"(?m)^Failure # \d+\b.*$", text)[-1].strip()


def last_failure_cause(trial) -> str:
    """The last line of the trial's last failure (``ValueError: lr must be positive``), or "". A trial
    that ran past ``failure.trial_timeout`` and had to end its worker: the time limit, not Ray's "the
    actor died" (sweeps.watch)."""
    from sweeps.watch import timed_out

    limit = timed_out(getattr(trial, "trial_id", ""))
    if limit:
        return limit
    lines = [x for x in last_failure(trial).splitlines() if x.strip()]
    return lines[-1].strip() if lines else ""


def _killed_for_memory(trial) -> bool:
    """Whether the trial's last failure was a memory kill (Tune writes every attempt's to the
    trial's error file: an earlier attempt's memory kill says nothing of the last one)."""
    try:
        text = last_failure(trial)
        # ours (Ray's OutOfMemoryError raised to the actor manager) or Ray's own, wrapped in a task error
        return any(m in text for m in (KilledForMemory.__name__, "OutOfMemoryError", "running low on memory"))
    except Exception:  # noqa: BLE001 - only a console line depends on it
        return False


def tolerate_memory_kills() -> None:
    """Make a worker killed by Ray's memory monitor fail its trial, not the sweep (issue 33, point 3).

    Ray Tune's actor manager handles a trial task's ``RayActorError`` (the trial failed: retried
    under ``failure.max_retries`` from its checkpoint) and ``RayTaskError``, and raises anything
    else, which ends ``Tuner.fit``: "Caught unexpected exception: 1 worker(s) were killed due to the
    node running low on memory", every other trial stopped. The memory monitor's ``OutOfMemoryError``
    is such an exception. This wraps the handler once (driver side, idempotent) so that error becomes
    a ``KilledForMemory`` (a ``RayActorError``) with Ray's message: the trial fails like any other."""
    from ray.air.execution._internal import actor_manager
    from ray.exceptions import OutOfMemoryError

    cls = actor_manager.RayActorManager
    if getattr(cls._actor_task_failed, "_dpsweep_memory", False):
        return
    handler = cls._actor_task_failed

    def failed(self, tracked_actor_task, exception):
        if isinstance(exception, OutOfMemoryError):
            exception = KilledForMemory(error_msg=f"KilledForMemory: {exception}")
        return handler(self, tracked_actor_task, exception)

    failed._dpsweep_memory = True
    failed.__wrapped__ = handler
    cls._actor_task_failed = failed


@contextlib.contextmanager
def results_without_histories():
    """``tuner.fit()``'s results without each trial's history read back from its files: Tune's
    ``ExperimentAnalysis`` reads every trial's ``result.json`` into a pandas DataFrame
    (``Result.metrics_dataframe``) when ``fit`` returns, about 3 ms a trial (seconds at 1,000
    trials, issue 49.8), and nothing of dpsweep reads it: the console, the selection and the
    records use each trial's last result, and the history is in MLflow. Within the block those
    DataFrames are not read (``metrics_dataframe`` is None); the files stay as Tune wrote them."""
    from ray.tune.analysis.experiment_analysis import ExperimentAnalysis

    original = ExperimentAnalysis.__dict__.get("_fetch_trial_dataframes")
    if original is None:   # another Ray: its results as they are
        yield
        return
    ExperimentAnalysis._fetch_trial_dataframes = _no_histories
    try:
        yield
    finally:
        ExperimentAnalysis._fetch_trial_dataframes = original


def _no_histories(self) -> dict:
    return {}


class CheckpointCleaner(tune.Callback):
    """Deletes a trial's checkpoints once it completes (issue 13, point 13).

    A completed trial (Ray calls ``on_trial_complete`` only for trials that ended without an
    error: evaluated, or stopped by the scheduler) has logged its final metrics, weights and tables
    to MLflow and closed its child run before its last result, and neither ``dpsweep resume`` nor
    a retry ever restores it, so its checkpoints (tens of MB each) are dead weight. Errored trials
    keep theirs (``resume`` retries them from it). ``keep_checkpoints: true`` disables this.

    Only once the completion is durable (issue 33, point 1): Tune records a trial's completion in
    its experiment snapshot some seconds later. A driver that dies in between leaves a snapshot that
    says RUNNING, and ``dpsweep resume`` restores that trial from its checkpoint (the trial then
    finds its FINISHED child run and reports it without training). So a completed trial's
    checkpoints are deleted one snapshot after the one that recorded it (Tune calls ``get_state``
    while it writes each snapshot, after the trials' statuses), and at the end of the experiment
    after Tune's final snapshot.
    """

    def __init__(self):
        self.removed = 0
        self.failed: list[str] = []
        self._completed: list = []     # complete, not yet in a snapshot
        self._recorded: list = []      # in the snapshot being written (or written)

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._completed.append(trial)

    def get_state(self):
        self._delete(self._recorded)   # recorded by the previous snapshot: durable by now
        self._recorded, self._completed = self._completed, []
        return None                    # nothing of its own to save

    def on_experiment_end(self, trials, **info):
        self._delete(self._recorded)   # Tune's final snapshot (written and synced) came before

    def _delete(self, done: list) -> None:
        from pyarrow import fs as pafs

        for trial in done:
            try:
                filesystem, path = trial.storage.storage_filesystem, trial.path
                listing = filesystem.get_file_info(pafs.FileSelector(path, allow_not_found=True))
                for entry in listing:
                    if entry.type == pafs.FileType.Directory and entry.base_name.startswith("checkpoint_"):
                        filesystem.delete_dir(entry.path)
                self.removed += 1
            except Exception as exc:  # noqa: BLE001 - disk hygiene must never fail a sweep
                self.failed.append(f"{trial.trial_id}: {exc}")
        done.clear()


SHOWN_KEYS = ("epsilon", "delta", "attack_bound", "psi", "seed")  # shown for every trial that has them


def _swept_in(config: dict) -> list[str]:
    """The keys the sweep varies for this trial's trainable (``swept_keys``, carried in the
    trial's ``_mlflow`` entry; for Optuna the keys it draws)."""
    from trainables.config import trial_config

    cfg = trial_config(config)
    swept = (config.get("_mlflow") or {}).get("swept") or {}
    return [k for k in swept.get(cfg.get("trainable", ""), []) if k != "trainable"]


def _show(value) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, default=str)
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _describe(config: dict) -> str:
    """``trainable=..., <every swept key>=..., epsilon=..., ...`` of a trial (issue 24, point 6)."""
    from trainables.config import trial_config

    cfg = trial_config(config)
    keys = ["trainable", *_swept_in(config), *SHOWN_KEYS]
    shown = {k: cfg[k] for k in dict.fromkeys(keys) if k in cfg}
    if (config.get("_mlflow") or {}).get("candidates"):  # tuning_privacy: candidates, not repeats (issue 34.9)
        shown = {("candidate" if k == "repeat" else k): v for k, v in shown.items()}
    return ", ".join(f"{k}={_show(v)}" for k, v in shown.items())


def swept_keys(spec, trials: list[dict] | None = None) -> dict[str, list[str]]:
    """Per trainable, the keys whose value varies in the sweep (they name the child runs):
    grid/random: the keys that differ between that trainable's expanded trials; optuna: the keys
    the spec gives a distribution or a list of several values."""
    out: dict[str, list[str]] = {}
    if spec.search.algorithm == "optuna":
        for t in spec.trainables:
            out[t.name] = [k for k, v in t.search.items()
                           if isinstance(v, dict) or (isinstance(v, list) and len(v) > 1)]
        return out
    by: dict[str, list[dict]] = {}
    for trial in trials or []:
        by.setdefault(trial.get("trainable", ""), []).append(trial)
    for name, group in by.items():
        keys = []
        for k in group[0]:
            if k == "trainable":
                continue
            values = {json.dumps(t.get(k), sort_keys=True, default=str) for t in group}
            if len(values) > 1:
                keys.append(k)
        out[name] = keys
    return out


def _final_metric_optuna():
    """OptunaSearch that reads a single objective from the results that carry it.

    Ray's single-objective OptunaSearch hands every intermediate result to Optuna
    (``result[metric]``): the per-epoch results carry ``train_loss``/``test_acc`` only, so a final
    metric (``acc_clean``, ``cert_acc_*``) raised KeyError inside Ray and killed every trial. The
    final result carries every metric (the last epoch's included), and Optuna is told the trial's
    value from it at completion; no pruner is used, so skipping the intermediate results loses
    nothing. Public, for a study's own Tuner: ``trainables.search.FinalMetricOptunaSearch``."""
    from trainables.search import FinalMetricOptunaSearch

    return FinalMetricOptunaSearch


def _trial_dirname():
    from trainables.search import trial_dirname

    return trial_dirname


def search_algorithm(spec):
    """None (Ray's variant generator over the pre-expanded trials) or Optuna, single- or
    multi-objective."""
    s = spec.search
    if s.algorithm != "optuna":
        return None
    search_cls = _final_metric_optuna()
    if s.objectives:
        return search_cls(metric=[o.metric for o in s.objectives], mode=[o.mode for o in s.objectives], seed=s.seed)
    return search_cls(metric=s.metric, mode=s.mode, seed=s.seed)


def trial_scheduler(spec):
    sch = spec.scheduler
    if sch.type != "asha":
        return None
    from ray.tune.schedulers import ASHAScheduler

    from sweeps.spec.space import scheduler_metric

    # a final metric (acc_clean) is compared through its per-epoch counterpart (test_acc)
    return ASHAScheduler(time_attr="training_iteration", metric=scheduler_metric(sch.metric), mode=sch.mode,
                         grace_period=sch.grace_period, reduction_factor=sch.reduction_factor)


def trial_resources(spec, gpu: float | None = None) -> dict:
    """Ray resources of one trial; ``gpu`` is the resolved ``resources.gpu`` (a number, see
    ``sweeps.cluster_checks.resolve_gpu``)."""
    value = spec.resources.gpu if gpu is None else gpu
    return {"cpu": spec.resources.cpu, "gpu": 0.0 if value == "auto" else float(value)}


class ForwardInterrupt(tune.Callback):
    """At each step of Tune's loop: a SIGINT/SIGTERM that came before ``fit()`` had installed its
    handler stops the loop now (``sweeps.signals``), so Tune saves the experiment state and
    ``dpsweep resume`` can finish the sweep."""

    def on_step_begin(self, iteration, trials, **info):
        from sweeps.signals import active

        interrupts = active()
        if interrupts is not None:
            interrupts.forward()


class TrackingWatch(tune.Callback):
    """Stops the sweep when a trial failed because the MLflow tracking store kept failing (issue 49,
    point 1): one of its MLflow calls failed through all its attempts (``TrackingDown``, about a
    minute and a half against a server answering HTTP 500; docs/faults.md). Every other trial's
    next call would fail the same way, each after its own retries, and the driver's records after
    theirs, so the sweep stops at the next step of Tune's loop (``sweeps.cli`` turns the raised
    ``TrackingDown`` into one line naming the server and ``dpsweep resume``, exit 1), as
    ``StorageWatch`` does for a full disk."""

    def __init__(self):
        self.down: str | None = None

    def _check(self, trial) -> None:
        if self.down is None:
            why = tracking_down_in(last_failure(trial))
            if why:
                self.down = f"trial {trial.trial_id}: {why}"

    def on_trial_recover(self, iteration, trials, trial, **info):
        self._check(trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._check(trial)

    def on_step_end(self, iteration, trials, **info):
        if self.down is not None:
            from trainables.tracking import TrackingDown

            down, self.down = self.down, None
            raise TrackingDown(down)


def tracking_down_in(failure: str) -> str | None:
    """The ``TrackingDown`` message in a trial's failure text (Ray's traceback of it), or None."""
    from trainables.tracking import TrackingDown

    marker = f"{TrackingDown.__name__}: "
    lines = [x for x in failure.splitlines() if marker in x]
    return lines[-1].split(marker, 1)[1].strip() if lines else None


def callbacks(spec, total: int | None, places: list[tuple[str, str]] = ()) -> list:
    from sweeps.disk import StorageWatch

    from sweeps.watch import SilenceWatch

    # SilenceWatch first: it notes a trial that timed out before ProgressPrinter prints its failure
    out = [SilenceWatch(spec.failure.silence_warning, spec.failure.trial_timeout), ProgressPrinter(total),
           ForwardInterrupt(), StorageWatch(list(places))]
    if not spec.keep_checkpoints:
        out.append(CheckpointCleaner())
    out.append(TrackingWatch())
    return out


def sweep_trainable(spec, gpu: float | None, noise_key):
    """``dispatch`` with the sweep's secret (``tune.with_parameters``: Ray's object store, never a
    config, a param or a result; docs/threat_model.md) and the trial's resources."""
    fn = dispatch if noise_key is None else tune.with_parameters(dispatch, noise_key=noise_key)
    return tune.with_resources(fn, trial_resources(spec, gpu))


def build_tuner(spec, *, storage: str, run_name: str, mlflow_info: dict, param_space: dict, total: int | None,
                gpu: float | None = None, noise_key=None):
    # per-epoch results carry train_loss/test_acc only; the final metrics a searcher optimises
    # (acc_clean, epsilon, cert_acc_*) arrive with the last result of each trial
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    trainable = sweep_trainable(spec, gpu, noise_key)
    space = dict(param_space)
    space["_mlflow"] = mlflow_info
    tune_config = tune.TuneConfig(
        search_alg=search_algorithm(spec),
        scheduler=trial_scheduler(spec),
        num_samples=spec.search.num_samples if spec.search.algorithm == "optuna" else 1,
        max_concurrent_trials=spec.max_concurrent_trials,
        reuse_actors=True,  # function trainables: keeps imports warm between trials
        # Optuna: the trial directory named after the drawn values, not the constant _mlflow mapping
        trial_dirname_creator=_trial_dirname() if spec.search.algorithm == "optuna" else None,
    )
    run_config = tune.RunConfig(
        name=run_name,
        storage_path=storage,
        failure_config=tune.FailureConfig(max_failures=spec.failure.max_retries),
        checkpoint_config=tune.CheckpointConfig(num_to_keep=2),  # the full state; the one before the latest
        # is the fallback when the latest is torn (trainables.runtime.restore_checkpoint)
        callbacks=callbacks(spec, total, [(what, str(path)) for what, path in
                                          local_paths(storage, mlflow_info.get("tracking_uri", ""))]),
        verbose=0,
    )
    return tune.Tuner(trainable, param_space=space, tune_config=tune_config, run_config=run_config)


def unique_run_name(name: str, storage: str) -> str:
    """``<name>-<YYYYmmdd-HHMMSS>-<6 hex digits>``: names the sweep's directory ``<storage>/<run
    name>`` and its MLflow parent run. On local storage the directory is created here, exclusively,
    so two sweeps with the same name started in the same second never share it (issue 24, point
    11: they shared ``ray_results/<name>-<timestamp>``, its experiment state and ``dpsweep.json``);
    on remote storage (``s3://``) the random part keeps them apart."""
    import datetime as dt
    import secrets

    for _ in range(100):
        run_name = f"{name}-{dt.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
        if "://" in storage:
            return run_name
        try:
            (Path(storage) / run_name).mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            continue
        return run_name
    raise RuntimeError(f"storage {storage}: no unused directory name for sweep {name!r} after 100 tries")


def save_state(experiment_dir: Path, state: dict) -> None:
    """Write ``dpsweep.json`` atomically: a temporary file, flushed to disk, renamed over the old."""
    experiment_dir.mkdir(parents=True, exist_ok=True)
    tmp = experiment_dir / (STATE_FILE + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(state, indent=2))
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(experiment_dir / STATE_FILE)


def load_state(experiment_dir: Path) -> dict:
    """The experiment's ``dpsweep.json``; a ValueError in one line when it, or Ray Tune's experiment
    snapshot beside it, is torn (issue 33, point 5: a full disk once left a snapshot whose resume
    ran a trial with an empty config)."""
    path = experiment_dir / STATE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: not a dpsweep experiment directory")
    try:
        state = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is torn ({exc}): this experiment cannot be resumed") from None
    for snap in sorted(experiment_dir.glob("experiment_state-*.json")):
        try:
            data = json.loads(snap.read_text())
            bad = [i for i, (trial, _meta) in enumerate(data["trial_data"]) if '"config"' not in trial]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{snap} is torn ({type(exc).__name__}: {str(exc)[:120]}): Ray Tune's experiment "
                             f"state cannot be resumed; the finished trials are in MLflow") from None
        if bad:
            raise ValueError(f"{snap} is torn: trial entries {bad} have no config; the finished trials are in "
                             f"MLflow") from None
    return state


def _varying_keys(results, configs: list[dict]) -> list[str]:
    """Every config key that varies in the sweep: the swept keys of each trial's trainable (Optuna's
    drawn keys included) and any key whose value differs between the trials that have it."""
    keys: list[str] = []
    for r in results:
        keys += [k for k in _swept_in(r.config or {}) if k not in keys]
    for k in dict.fromkeys(k for c in configs for k in c):
        if k in keys or k == "trainable" or k.startswith("_"):
            continue
        values = {_show(c[k]) for c in configs if k in c}
        if len(values) > 1:
            keys.append(k)
    return keys


AUDIT_COLUMNS = ("audit_claim", "epsilon_lower_bound")  # with audit_epsilon_lb*: an audited trial's claim and bounds


def summarize(result_grid, extra_metrics=()) -> tuple[list[dict], dict[str, float], int]:
    """Rows of final metrics per trial (``cfg.<key>`` for every key that varies in the sweep,
    then accuracies, epsilon, delta and ``extra_metrics``), the sweep's privacy summary, and the
    failure count."""
    from trainables.config import trial_config

    results = list(result_grid)
    configs = [trial_config(r.config or {}) for r in results]
    varying = _varying_keys(results, configs)
    rows, failed = [], 0
    for r, cfg in zip(results, configs):
        m = r.metrics or {}
        row = {"trial_id": m.get("trial_id", ""), "trainable": cfg.get("trainable", "")}
        for k in dict.fromkeys([*varying, "epsilon", "delta", "attack_bound", "seed"]):
            if k in cfg:
                row[f"cfg.{k}"] = cfg[k] if isinstance(cfg[k], (int, float, str, bool)) else _show(cfg[k])
        for k, val in m.items():
            if k.startswith(("acc_", "cert_acc_", "smooth_cert_acc_")) or k in ("epsilon", "delta", *extra_metrics) \
                    or k in AUDIT_COLUMNS or k.startswith("audit_epsilon_lb"):  # an audit's claim and bounds
                row[k] = val
        row["status"] = ("ERROR" if r.error else "DIVERGED" if m.get("diverged") == 1
                         else "DONE" if m.get("evaluated") else "STOPPED")
        row["!"] = "!" if m.get("not_learned") == 1 else ""  # did not learn (NOT_LEARNED_LEGEND)
        failed += int(r.error is not None)
        rows.append(row)
    from trainables.registry import REGISTRY  # privacy epsilons only: a robustness epsilon is not one (docs/metrics.md)
    eps = [row["epsilon"] for row in rows if isinstance(row.get("epsilon"), (int, float)) and math.isfinite(row["epsilon"])
           and getattr(REGISTRY.get(row.get("trainable")), "privacy_epsilon", True)]
    summary = {"trials": float(len(rows)), "trials_failed": float(failed)}
    if eps:
        summary.update({"epsilon_max_trial": max(eps), "epsilon_min_trial": min(eps)})
    return rows, summary, failed


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(no trials)"
    cols: list[str] = []
    for row in rows:
        for k in row:
            if k not in cols:
                cols.append(k)
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)
    cells = [[fmt(row.get(c, "")) for c in cols] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


NOT_LEARNED_LEGEND = ("!  did not learn (not_learned = 1: accuracy not significantly above chance, binomial test; "
                      "docs/metrics.md): its accuracies and certificates say nothing about the mechanism")


def quiet_ray() -> None:
    """Keep Ray's own hints (the token-authentication notice, the experiment box, TensorBoard,
    ``Tuner.restore``, snapshot timings) and MLflow's database set-up notes off the console: dpsweep
    prints its own progress, where the data goes and how to resume. Ray's other warnings and its
    errors still show."""
    import logging

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    # frequent experiment snapshots are expected with a checkpoint per epoch
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    # Ray's new console output prints an experiment box and a TensorBoard hint even at verbose=0
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    for name in ("ray.tune", "ray.train", "ray.air", "ray.tune.tune", "ray.tune.impl.tuner_internal",
                 "ray._private.authentication.authentication_token_setup",
                 "ray.tune.analysis.experiment_analysis"):  # trials that never reported (an interrupt)
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RayHintFilter) for f in logger.filters):
            logger.addFilter(_RayHintFilter())
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Ray's TensorBoard logger (not dpsweep's output) is handed a non-private baseline's epsilon, inf as
    # docs/metrics.md says, and tensorboardX warned "NaN or Inf found in input tensor." per such scalar
    tbx = logging.getLogger("tensorboardX.x2num")
    if not any(isinstance(f, _RayHintFilter) for f in tbx.filters):
        tbx.addFilter(_RayHintFilter())


class _RayHintFilter:
    """Drops Ray's log records that repeat what dpsweep says (how to resume, where the results
    are) or address a Ray user (the default token authentication of a local cluster, TensorBoard)."""

    HINTS = ("Tuner.restore", "TensorBoard", "tensorboard", "has been interrupted", "Wrote the latest version",
             "Trials did not complete", "Stop signal received", "Token authentication is enabled for this Ray cluster",
             "Failed to fetch metrics",  # of trials an interrupt stopped before their first result
             "NaN or Inf found in input tensor")  # tensorboardX on a non-private epsilon (inf), issue 51.5

    def filter(self, record) -> bool:
        msg = record.getMessage()
        return not any(h in msg for h in self.HINTS)


CURRENT_CLUSTER_FILE = "/tmp/ray/ray_current_cluster"   # where `ray start` records the latest local cluster
PROBE_SECONDS = 10.0


class RayUnreachable(RuntimeError):
    """The Ray cluster the user named does not answer (one line: the address and how long we waited),
    or the private local Ray did not start."""


def _named_address(address: str, current_file: str = CURRENT_CLUSTER_FILE) -> str:
    """The ``host:port`` behind ``RAY_ADDRESS``: itself, the GCS address of ``ray://host:port``, or
    for ``auto`` the cluster ``ray start`` recorded last (RayUnreachable when there is none)."""
    if address.lower() == "auto":
        try:
            return Path(current_file).read_text().strip()
        except OSError:
            raise RayUnreachable(f"RAY_ADDRESS=auto: no Ray cluster was started on this machine ({current_file} "
                                 "is missing); unset RAY_ADDRESS for a private local Ray") from None
    return address.split("://", 1)[-1]


def probe_ray(address: str, timeout: float = PROBE_SECONDS, current_file: str = CURRENT_CLUSTER_FILE) -> str:
    """``host:port`` of the named cluster once it accepts a TCP connection; RayUnreachable within
    ``timeout`` seconds otherwise (``ray.init`` would wait in its GCS client with nothing printed)."""
    import socket

    target = _named_address(address, current_file)
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise RayUnreachable(f"RAY_ADDRESS={address}: not host:port (e.g. 10.0.0.5:6379), ray://host:port or auto")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as conn:
            answer = _grpc_answer(conn, timeout)
    except OSError as exc:
        raise RayUnreachable(f"RAY_ADDRESS={address}: no Ray cluster answers at {target} within {timeout:g} s "
                             f"({exc.strerror or type(exc).__name__}); start it, or unset RAY_ADDRESS for a private "
                             "local Ray") from None
    if answer is not None:   # ray.init would loop on "Failed to get cluster ID" for minutes (issue 49.2)
        raise RayUnreachable(f"RAY_ADDRESS={address}: the service at {target} is not a Ray cluster ({answer}); "
                             "point RAY_ADDRESS at the head's GCS port (6379 by default), or unset it for a private "
                             "local Ray")
    return target


# HTTP/2's client connection preface and an empty SETTINGS frame (RFC 9113, 3.4 and 6.5)
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _grpc_answer(conn, timeout: float) -> str | None:
    """None when the peer speaks HTTP/2 as Ray's GCS (a gRPC server) does: it answers the client
    preface with a SETTINGS frame. Otherwise what it did instead, in a few words (a plain HTTP
    server answers ``HTTP/1.1 400``; another service closes or sends something else)."""
    import socket

    conn.settimeout(timeout)
    try:
        conn.sendall(_H2_PREFACE)
        head = b""
        while len(head) < 9:
            chunk = conn.recv(9 - len(head))
            if not chunk:
                break
            head += chunk
    except socket.timeout:
        return f"it accepted the connection but sent nothing within {timeout:g} s"
    except OSError as exc:
        return f"it dropped the connection ({exc.strerror or type(exc).__name__})"
    if len(head) == 9 and head[3] == 0x04:   # frame type SETTINGS
        return None
    if not head:
        return "it closed the connection without an answer"
    if head.startswith((b"HTTP/", b"<")):
        return "it answered as a plain HTTP server, not as gRPC"
    return "it answered something other than gRPC"


def protect_ray_token(home: Path | None = None) -> list[str]:
    """Make Ray's token (``~/.ray/auth_token``, written 0644 by Ray 2.60) readable by its owner only,
    and its folder 0700 (issue 33, point 10): Ray's local processes listen on every interface and the
    token is all that guards them, so another user of the machine must not read it. Best effort
    (only files this user owns); returns the paths changed."""
    import stat

    folder = (home or Path.home()) / ".ray"
    changed = []
    for path, mode in ((folder, 0o700), (folder / "auth_token", 0o600)):
        try:
            st = path.stat()
            if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077:
                path.chmod(mode)
                changed.append(str(path))
        except OSError:
            continue
    return changed


def ray_init(spec=None) -> str:
    """Start a private local Ray, or join the cluster ``RAY_ADDRESS`` names; a spec's own model/dataset
    modules travel to the workers (sweeps.user_modules). Returns a line saying where the sweep runs.

    Without ``RAY_ADDRESS`` (or with ``local``) the sweep gets a Ray instance of its own
    (``address="local"``): never one that someone else (another user, a test, a stopped ``ray start``
    whose address file remains) started on this machine, which Ray would otherwise join. A named
    cluster must answer within ``PROBE_SECONDS`` (``probe_ray``), else RayUnreachable in one line."""
    import ray

    from sweeps.user_modules import runtime_env

    quiet_ray()
    tolerate_memory_kills()
    if ray.is_initialized():
        return "Ray: this process's own instance (already initialised)"
    address = (os.environ.get("RAY_ADDRESS") or "").strip()
    env = dict(runtime_env(spec) or {}) if spec is not None else {}
    # this driver's session, for its trials' workers: a trial key adopts only a run an earlier driver
    # left FAILED or KILLED (trainables.tracking.find_trial_run)
    from trainables.tracking import SESSION_ENV

    session = uuid.uuid4().hex
    os.environ[SESSION_ENV] = session
    # and how long its MLflow calls retry (sweeps.tracking.bound_mlflow_http): a cluster's workers do
    # not inherit the driver's environment, and MLflow's defaults retry for tens of minutes
    from sweeps.tracking import MLFLOW_HTTP_BOUNDS
    from trainables.tracking import ATTEMPTS_ENV

    bounds = {k: os.environ[k] for k in (*MLFLOW_HTTP_BOUNDS, ATTEMPTS_ENV) if os.environ.get(k)}
    env["env_vars"] = {**bounds, **env.get("env_vars", {}), SESSION_ENV: session}
    common = dict(include_dashboard=False, log_to_driver=False, configure_logging=True, logging_level="WARNING",
                  **({"runtime_env": env} if env else {}))
    if not address or address.lower() == "local":
        try:
            ray.init(address="local", **common)
        except Exception as exc:  # noqa: BLE001 - one line, not Ray's traceback (issue 49, point 6)
            try:   # whatever Ray managed to start goes again
                ray.shutdown()
            except Exception:  # noqa: BLE001
                pass
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise RayUnreachable(f"Ray: the private local instance did not start ({type(exc).__name__}: {first}); "
                                 "nothing ran; Ray's logs are under /tmp/ray/session_latest/logs (a machine short "
                                 "of CPU, memory or /tmp space delays Ray's processes past its start-up limit)") from None
        protect_ray_token()
        cpus = ray.cluster_resources().get("CPU", 0)
        return f"Ray: a private local instance ({cpus:g} CPUs; set RAY_ADDRESS to run on a cluster)"
    target = probe_ray(address)
    try:
        ray.init(address=address, **common)
    except Exception as exc:  # noqa: BLE001 - one line, not Ray's tracebacks (issue 49.2)
        raise RayUnreachable(f"RAY_ADDRESS={address}: Ray could not join the cluster at {target} "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return f"Ray: the cluster at {target} ({nodes} node(s), RAY_ADDRESS={address})"
