"""Build and run the Ray Tune experiment of a validated sweep spec, and resume one.

The experiment directory (``<storage>/<name>``) also holds ``dpsweep.json``: the MLflow parent
run of the sweep and the settings ``dpsweep resume`` needs to finish it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from ray import tune

from trainables.dispatch import dispatch

STATE_FILE = "dpsweep.json"


class ProgressPrinter(tune.Callback):
    """One line per epoch result and per finished or failed trial."""

    def __init__(self, total: int | None = None):
        self.total = total
        self.done = 0
        self.failed = 0
        self.t0 = time.time()

    def _say(self, msg: str) -> None:
        # sys.stdout is looked up on each call: the callback is pickled with the experiment state
        print(f"[{time.time() - self.t0:6.0f}s] {msg}", file=sys.stdout, flush=True)

    def on_trial_start(self, iteration, trials, trial, **info):
        self._say(f"started  {trial.trial_id} ({_describe(trial.config)})")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if "train_loss" in result and "evaluated" not in result:
            self._say(f"progress {trial.trial_id} epoch {result.get('epoch')}: "
                      f"train_loss {result['train_loss']:.4f}, test_acc {result.get('test_acc', float('nan')):.4f}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        self.done += 1
        r = trial.last_result or {}
        keys = [k for k in ("acc_clean", "epsilon") if k in r]
        keys += sorted(k for k in r if k.startswith("cert_acc_"))[:3]
        shown = ", ".join(f"{k} {r[k]:.4f}" for k in keys)
        total = f"/{self.total}" if self.total else ""
        self._say(f"finished {trial.trial_id} [{self.done}{total}] {shown}")

    def on_trial_error(self, iteration, trials, trial, **info):
        self.failed += 1
        self._say(f"FAILED   {trial.trial_id} ({_describe(trial.config)}); see {trial.local_path}")


def _describe(config: dict) -> str:
    from trainables.dispatch import trial_config

    cfg = trial_config(config)
    shown = {k: cfg[k] for k in ("trainable", "epsilon", "delta", "attack_bound", "psi", "seed") if k in cfg}
    return ", ".join(f"{k}={v}" for k, v in shown.items())


def search_algorithm(spec):
    """None (Ray's variant generator over the pre-expanded trials) or Optuna, single- or
    multi-objective."""
    s = spec.search
    if s.algorithm != "optuna":
        return None
    from ray.tune.search.optuna import OptunaSearch

    if s.objectives:
        return OptunaSearch(metric=[o.metric for o in s.objectives], mode=[o.mode for o in s.objectives], seed=s.seed)
    return OptunaSearch(metric=s.metric, mode=s.mode, seed=s.seed)


def trial_scheduler(spec):
    sch = spec.scheduler
    if sch.type != "asha":
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(time_attr="training_iteration", metric=sch.metric, mode=sch.mode,
                         grace_period=sch.grace_period, reduction_factor=sch.reduction_factor)


def build_tuner(spec, *, storage: str, run_name: str, mlflow_info: dict, param_space: dict, total: int | None):
    # per-epoch results carry train_loss/test_acc only; the final metrics a searcher optimises
    # (acc_clean, epsilon, cert_acc_*) arrive with the last result of each trial
    os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    res = spec.resources
    trainable = tune.with_resources(dispatch, {"cpu": res.cpu, "gpu": res.gpu})
    space = dict(param_space)
    space["_mlflow"] = mlflow_info
    tune_config = tune.TuneConfig(
        search_alg=search_algorithm(spec),
        scheduler=trial_scheduler(spec),
        num_samples=spec.search.num_samples if spec.search.algorithm == "optuna" else 1,
        max_concurrent_trials=spec.max_concurrent_trials,
        reuse_actors=True,  # function trainables: keeps imports warm between trials
    )
    run_config = tune.RunConfig(
        name=run_name,
        storage_path=storage,
        failure_config=tune.FailureConfig(max_failures=spec.failure.max_retries),
        checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
        callbacks=[ProgressPrinter(total)],
        verbose=0,
    )
    return tune.Tuner(trainable, param_space=space, tune_config=tune_config, run_config=run_config)


def save_state(experiment_dir: Path, state: dict) -> None:
    experiment_dir.mkdir(parents=True, exist_ok=True)
    tmp = experiment_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(experiment_dir / STATE_FILE)


def load_state(experiment_dir: Path) -> dict:
    path = experiment_dir / STATE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: not a dpsweep experiment directory")
    return json.loads(path.read_text())


def summarize(result_grid, extra_metrics=()) -> tuple[list[dict], dict[str, float], int]:
    """Rows of final metrics per trial (accuracies, epsilon, delta and ``extra_metrics``), the
    sweep's privacy summary, and the failure count."""
    from trainables.dispatch import trial_config

    rows, failed = [], 0
    for r in result_grid:
        cfg = trial_config(r.config or {})
        m = r.metrics or {}
        row = {"trial_id": m.get("trial_id", ""), "trainable": cfg.get("trainable", "")}
        for k in ("epsilon", "delta", "attack_bound", "seed"):
            if k in cfg:
                row[f"cfg.{k}"] = cfg[k]
        for k, val in m.items():
            if k.startswith(("acc_", "cert_acc_", "smooth_cert_acc_")) or k in ("epsilon", "delta", *extra_metrics):
                row[k] = val
        row["status"] = "ERROR" if r.error else ("DONE" if m.get("evaluated") else "STOPPED")
        failed += int(r.error is not None)
        rows.append(row)
    eps = [row["epsilon"] for row in rows if isinstance(row.get("epsilon"), (int, float)) and math.isfinite(row["epsilon"])]
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


def ray_init() -> None:
    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_DEDUP_LOGS", "1")
        # keeping two checkpoints per trial forces frequent experiment snapshots; that is expected
        os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False,
                 log_to_driver=False, configure_logging=True, logging_level="WARNING")
