"""The life of a sweep end to end through Ray Tune and MLflow (issue 13, points 4, 5, 7, 11, 13,
14): Ctrl-C and resume, a crash between an epoch's MLflow log and its checkpoint, single-objective
Optuna, run names and tags, checkpoints deleted or kept, a GPU that is not there.

Tiny PixelDP trials on a small real-MNIST subset against temporary SQLite stores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.test_sweep_e2e import ROOT, TINY, _runs, _spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def _steps(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _checkpoints(storage: Path) -> list[Path]:
    return sorted(storage.glob("*/*/checkpoint_*"))


def test_ctrl_c_exits_130_kills_the_parent_and_resume_logs_each_step_once(tmp_path):
    """SIGINT inside the first trial's first epoch (the second never started): exit 130, the parent run
    KILLED, and ``dpsweep resume`` finishes both trials, each epoch's metrics logged once, each trial
    certified, one MLflow run each (this test replaced test_sweep_e2e's interrupt-and-resume test, whose
    assertions it holds)."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = _spec(tmp_path, "sigint", [0.5, 1.0], max_concurrent_trials=1)
    raw = yaml.safe_load(spec.read_text())
    raw["common"].update({"train_size": 300, "epochs": 3})
    spec.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "sweeps.cli", "run", str(spec), "--tracking-uri", uri],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(300, proc.kill)
    timer.start()
    lines = []
    for line in proc.stdout:  # interrupt once the first trial reported its first epoch
        lines.append(line)
        if " progress " in line and "epoch 1" in line:
            break
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=180)
    timer.cancel()
    out = "".join(lines) + rest
    assert proc.returncode == 130, out
    exp_dir = next(p for p in (tmp_path / "ray_results").iterdir() if p.is_dir())
    assert f"continue with: " in out and f"resume {exp_dir}" in out
    assert "Tuner.restore" not in out and "TensorBoard" not in out  # Ray's own hints stay off
    client, parents, children = _runs(uri, "sigint")
    assert len(parents) == 1 and parents[0].info.status == "KILLED"
    assert all(r.info.status != "RUNNING" for r in children)

    done = subprocess.run([sys.executable, "-m", "sweeps.cli", "resume", str(exp_dir)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    client, parents, children = _runs(uri, "sigint")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children)
    for run in children:  # nothing logged twice, nothing missing
        for key in ("train_loss", "test_acc"):
            assert _steps(client, run.info.run_id, key) == [1, 2, 3], (run.info.run_name, key)
        assert _steps(client, run.info.run_id, "acc_clean") == [3]
        assert "cert_acc_0.1" in run.data.metrics       # the resumed trials reach their certification
    assert _checkpoints(tmp_path / "ray_results") == []  # finished trials' checkpoints are gone


def test_crash_between_the_mlflow_log_and_the_checkpoint_logs_nothing_twice(tmp_path, ray_local):
    """One trial dies right after epoch 2 is in MLflow but before its checkpoint (the retry
    re-runs epoch 2 from the epoch-1 checkpoint); another dies after its final metrics are in
    MLflow but before Ray has its last result (the retry re-evaluates). Each (metric, step) once."""
    from ray import tune

    from sweeps.tracking import start_parent_run

    uri = f"sqlite:///{tmp_path}/mlflow.db"

    def flaky(config):
        import ray.tune as rt

        from trainables.pixeldp import pixeldp

        config = dict(config)
        when = config.pop("crash_at")
        marker = Path(config.pop("marker_dir")) / f"crashed-{when}"
        original = rt.report
        calls = [0]

        def report(metrics, checkpoint=None):
            calls[0] += 1
            if calls[0] == when and not marker.exists():
                marker.touch()
                raise RuntimeError(f"injected crash before report {when}")
            original(metrics, checkpoint=checkpoint)

        rt.report = report
        try:
            return pixeldp(config)
        finally:
            rt.report = original

    info = start_parent_run(uri, "crash", "crash", {"name": "crash"}, {})
    space = {**TINY, "epochs": 3, "seed": 3, "_mlflow": info, "marker_dir": str(tmp_path),
             "crash_at": tune.grid_search([2, 4])}  # report 2: epoch 2; report 4: the final result
    tuner = tune.Tuner(
        tune.with_resources(flaky, {"cpu": 1}), param_space=space,
        run_config=tune.RunConfig(storage_path=str(tmp_path / "ray"), name="crash",
                                  failure_config=tune.FailureConfig(max_failures=1)),
    )
    results = tuner.fit()
    assert not results.errors
    assert (tmp_path / "crashed-2").exists() and (tmp_path / "crashed-4").exists()
    client, _, children = _runs(uri, "crash")
    assert len(children) == 2
    for run in children:
        assert run.info.status == "FINISHED"
        for key in ("train_loss", "test_acc"):
            assert _steps(client, run.info.run_id, key) == [1, 2, 3], key
        for key in ("acc_clean", "acc_pgd_0.1", "cert_acc_0.1", "compute_seconds"):
            assert _steps(client, run.info.run_id, key) == [3], key


def test_single_objective_optuna_names_tags_and_checkpoint_cleanup(tmp_path, ray_local, monkeypatch, capsys):
    """search.algorithm optuna with one final metric (acc_clean) runs every trial; --name names
    the MLflow experiment; child runs are named after the swept values and carry the device;
    finished trials leave no checkpoint behind."""
    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = _spec(tmp_path, "optuna1", [1.0],
                 search={"algorithm": "optuna", "num_samples": 2, "seed": 1, "metric": "acc_clean", "mode": "max"})
    raw = yaml.safe_load(spec.read_text())
    raw["trainables"][0]["search"]["lr"] = {"loguniform": [1e-4, 1e-2]}
    raw["common"]["epochs"] = 1
    spec.write_text(yaml.safe_dump(raw))
    assert main(["run", str(spec), "--tracking-uri", uri, "--name", "named-study"]) == 0
    out = capsys.readouterr().out
    assert "MLflow runs in " in out and "checkpoints under " in out and "resources per trial: cpu 1, gpu 0" in out
    client, parents, children = _runs(uri, "named-study")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].info.run_name.startswith("named-study-")
    assert client.get_experiment_by_name("named-study").tags["mlflow.experimentKind"] == "custom_model_development"
    assert len(children) == 2 and all(r.info.status == "FINISHED" for r in children)
    for run in children:
        lr = float(run.data.params["lr"])
        assert run.info.run_name == f"pixeldp lr={lr:g} seed=0"
        assert run.data.tags["dpsweep.device"] == "cpu"
        assert "acc_clean" in run.data.metrics
    assert _checkpoints(tmp_path / "ray_results") == []


def test_keep_checkpoints_keeps_the_latest_two(tmp_path, ray_local, monkeypatch):
    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = _spec(tmp_path, "keep", [1.0], keep_checkpoints=True)
    assert main(["run", str(spec), "--tracking-uri", uri]) == 0
    kept = _checkpoints(tmp_path / "ray_results")
    # epochs 2: both kept (a trial keeps its latest two: the one before is the fallback of a torn latest)
    assert sorted(p.name for p in kept) == ["checkpoint_000000", "checkpoint_000001"]


def test_gpu_per_trial_on_a_cluster_without_gpus_is_refused_before_any_run(tmp_path, ray_local, monkeypatch, capsys):
    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = _spec(tmp_path, "gpu", [1.0])
    assert main(["run", str(spec), "--tracking-uri", uri, "--set", "resources.gpu=1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dpsweep:")]
    assert err == ["dpsweep: error: resources.gpu: 1 GPU(s) per trial, but the Ray cluster has no GPU "
                   "(ray.cluster_resources()); trials would wait forever; use resources.gpu: auto or 0"]
    assert not (tmp_path / "mlflow.db").exists()  # no MLflow run for a sweep that never started
