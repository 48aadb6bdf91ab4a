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
    """--tracking-uri, then the spec, then MLFLOW_TRACKING_URI, then sqlite:///<cwd>/mlflow.db.

    A relative SQLite path is made absolute: Ray runs trials in other working directories.
    """
    uri = cli_uri or spec_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{DEFAULT_DB}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    return uri


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


def experiment_id(client, name: str) -> str:
    exp = retry(lambda: client.get_experiment_by_name(name), what="get_experiment_by_name")
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            retry(lambda: client.restore_experiment(exp.experiment_id), what="restore_experiment")
        return exp.experiment_id
    return retry(lambda: client.create_experiment(name), what="create_experiment")


def start_parent_run(tracking_uri: str, experiment: str, run_name: str, spec_raw: dict, flat_params: dict) -> dict:
    """Create the parent run; returns the info trials need (``_mlflow`` in their config)."""
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp_id = experiment_id(client, experiment)
    tags = {"mlflow.runName": run_name, "dpsweep.kind": "sweep", "dpsweep.version": project_version(),
            "dpsweep.git_commit": git_commit(), "mlflow.source.git.commit": git_commit()}
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
    return {"tracking_uri": tracking_uri, "experiment_id": exp_id, "parent_run_id": run_id}


def finish_parent_run(info: dict, summary: dict[str, float], status: str) -> None:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient
    import time

    client = MlflowClient(info["tracking_uri"])
    ts = int(time.time() * 1000)
    metrics = [Metric(k, float(v), ts, 0) for k, v in summary.items()]
    if metrics:
        retry(lambda: client.log_batch(info["parent_run_id"], metrics=metrics), what="log_batch(summary)")
    retry(lambda: client.set_terminated(info["parent_run_id"], status=status), what="set_terminated")
