"""Fault suite (issue 33, point 7): a failed trial's MLflow run says why: the exception's last line
as the tag ``dpsweep.error`` and the traceback as the artifact ``error/traceback.txt``; a retry that
finishes keeps the traceback and moves the tag to ``dpsweep.error_retried``."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainables.runtime import TAG_ERROR, clear_failure, record_failure
from trainables.tracking import TrialTracker


def _tracker(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    exp = MlflowClient(uri).create_experiment("e")
    return TrialTracker.open({"tracking_uri": uri, "experiment_id": exp}, trial_id="t1", trial_name="t1",
                             trainable="dpsgd")


def test_a_failed_trial_run_says_why(tmp_path):
    tracker = _tracker(tmp_path)
    try:
        raise ValueError("config.model: mystudy.nets:small_cnnn is not a function of the module\nsecond line")
    except ValueError as exc:
        record_failure(tracker, exc)
    tracker.finish("FAILED")
    run = tracker.client.get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags[TAG_ERROR] == "second line"                       # the exception's last line
    path = tracker.client.download_artifacts(tracker.run_id, "error/traceback.txt", str(tmp_path))
    text = Path(path).read_text()
    assert text.startswith("Traceback") and "ValueError: config.model" in text


def test_a_retry_that_finishes_keeps_the_history_without_the_error_tag(tmp_path):
    tracker = _tracker(tmp_path)
    record_failure(tracker, RuntimeError("worker died"))
    clear_failure(tracker)
    tags = tracker.client.get_run(tracker.run_id).data.tags
    assert TAG_ERROR not in tags and tags["dpsweep.error_retried"] == "RuntimeError: worker died"
    clear_failure(tracker)                                              # nothing to clear: no change
    assert tracker.client.get_run(tracker.run_id).data.tags["dpsweep.error_retried"] == "RuntimeError: worker died"


# --------------------------------------------------------------------------- issue 49, point 5


def test_a_trial_that_failed_before_its_run_opened_gets_a_failed_run_the_restart_adopts(tmp_path, monkeypatch):
    """A trial killed (Ray's memory monitor, a time limit) or failing before it opened its child run
    had no run at all: its reason lived only in the console. The driver finds or opens it the way
    the trial would (``find_trial_run``: its Ray id, else its trial key) and records FAILED with the
    last attempt's cause; ``dpsweep resume``'s restarted trial (another driver, a new Ray id) logs
    into that run. A run that recorded its own error is left as it is."""
    from mlflow.tracking import MlflowClient

    from sweeps.tracking import record_runless_failures, start_parent_run
    from trainables.registry import REGISTRY
    from trainables.runtime import trial_key, validate_config
    from trainables.tracking import SESSION_ENV, TAG_KEY, TAG_TRIAL, find_trial_run

    uri = f"sqlite:///{tmp_path}/m.db"
    info = start_parent_run(uri, "e", "sweep", {"name": "e"}, {})
    info["swept"] = {"pixeldp": ["epsilon"]}
    monkeypatch.setenv(SESSION_ENV, "driver-1")
    killed = {"trial": {"trainable": "pixeldp", "epsilon": 2.0, "seed": 0}, "_mlflow": info}   # Ray's config
    own = {"trial": {"trainable": "pixeldp", "epsilon": 3.0, "seed": 0}, "_mlflow": info}
    tracker = TrialTracker.open(info, trial_id="t_own", trial_name="own", trainable="pixeldp", session="driver-1")
    record_failure(tracker, ValueError("its own error"))
    tracker.finish("FAILED")
    cause = "ray.exceptions.RayActorError: KilledForMemory: Task was killed due to the node running low on memory."
    assert record_runless_failures(info, [("t_own", own, "ValueError: its own error"), ("t_oom", killed, cause)]) == 1

    client = MlflowClient(uri)
    children = {r.data.tags[TAG_TRIAL]: r for r in client.search_runs(
        [info["experiment_id"]], filter_string=f"tags.mlflow.parentRunId = '{info['parent_run_id']}'")}
    assert set(children) == {"t_own", "t_oom"}
    run = children["t_oom"]
    flat = {"trainable": "pixeldp", "epsilon": 2.0, "seed": 0, "_mlflow": info}
    key = trial_key(validate_config(flat, REGISTRY["pixeldp"].config_model), "pixeldp", flat)
    assert run.info.status == "FAILED" and run.data.tags[TAG_ERROR] == cause
    assert run.data.tags[TAG_KEY] == key and run.data.tags["mlflow.runName"] == "pixeldp epsilon=2 seed=0"
    assert run.data.params["epsilon"] == "2.0" and run.data.params["trainable"] == "pixeldp"
    assert children["t_own"].data.tags[TAG_ERROR] == "ValueError: its own error"      # left as it is
    # dpsweep resume restarts it under a new Ray id and another driver session: it finds this run
    found = find_trial_run(client, info["experiment_id"], info["parent_run_id"], "t_new", key, "driver-2")
    assert found is not None and found.info.run_id == run.info.run_id
    assert record_runless_failures(info, [("t_oom", killed, cause)]) == 0           # once: it has its run now


@pytest.mark.slow
def test_a_trial_failing_before_its_run_opened_has_a_failed_run_that_says_why(tmp_path):
    """End to end: a user model whose factory raises under the trial's seed (validation builds it
    under seed 0) fails the trial before its child run exists. Before: no child run at all, the
    reason in the console only. Now: a FAILED child run with the cause, and the console's FAILED
    line says the cause too."""
    import os
    import subprocess
    import sys

    import yaml

    from tests.test_sweep_e2e import ROOT, _runs

    (tmp_path / "failpkg").mkdir()
    (tmp_path / "failpkg" / "__init__.py").write_text("")
    (tmp_path / "failpkg" / "nets.py").write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "def net(input_shape, num_classes):\n"
        "    if torch.initial_seed() == 1:\n"
        "        raise RuntimeError('this model cannot be built under seed 1')\n"
        "    n = 1\n    for s in input_shape:\n        n *= s\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(n, num_classes))\n")
    spec = tmp_path / "early.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "early", "storage": str(tmp_path / "ray_results"), "mlflow": {"experiment": "early"},
        "common": {"dataset": "mnist", "train_size": 64, "test_size": 64, "epochs": 1, "seed": 1},
        "trainables": [{"name": "dpsgd", "search": {"model": "failpkg.nets:net", "epsilon": 8.0, "batch_size": 32}}],
        "resources": {"cpu": 1}, "max_concurrent_trials": 1, "failure": {"max_retries": 0}}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    done = subprocess.run([sys.executable, "-m", "sweeps.cli", "run", str(spec), "--tracking-uri", uri],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    failed = [x for x in done.stdout.splitlines() if "FAILED " in x]
    assert len(failed) == 1 and "cannot be built under seed 1" in failed[0], out     # the cause, on the console
    _, parents, children = _runs(uri, "early")
    assert len(children) == 1, out
    run = children[0]
    assert run.info.status == "FAILED" and "cannot be built under seed 1" in run.data.tags[TAG_ERROR], out
    assert run.data.tags["dpsweep.trial_key"] and run.data.params["model"] == "failpkg.nets:net"
    assert parents[0].info.status == "FAILED"
