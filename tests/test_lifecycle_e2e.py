"""The life of a sweep end to end through Ray Tune and MLflow (issue 13, points 4, 5, 7, 11, 13,
14): a crash between an epoch's MLflow log and its checkpoint, single-objective Optuna, run names
and tags, checkpoints deleted or kept, a GPU that is not there (Ctrl-C and resume:
tests/test_interrupts.py).

Tiny PixelDP trials on a small real-MNIST subset against temporary SQLite stores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.test_sweep_e2e import TINY, _runs, _spec

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


def test_crash_between_the_mlflow_log_and_the_checkpoint_logs_nothing_twice(tmp_path, ray_local):
    """One trial dies right after epoch 2 is in MLflow but before its checkpoint (the retry
    re-runs epoch 2 from the epoch-1 checkpoint); another dies after its final metrics are in
    MLflow but before Ray has its last result (the retry re-evaluates). Each (metric, step) once,
    each retry in the run it crashed in (an error inside the open run kept as ``dpsweep.error_retried``,
    the traceback in ``error/``), and both end exactly like their uninterrupted twin with the same seed (this
    test took over test_sweep_e2e's crash-and-resume test, whose assertions it holds)."""
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
             "crash_at": tune.grid_search([2, 4, 0])}  # report 2: epoch 2; 4: the final result; 0: the twin
    tuner = tune.Tuner(
        tune.with_resources(flaky, {"cpu": 1}), param_space=space,
        run_config=tune.RunConfig(storage_path=str(tmp_path / "ray"), name="crash",
                                  failure_config=tune.FailureConfig(max_failures=1)),
    )
    results = tuner.fit()
    assert not results.errors
    assert (tmp_path / "crashed-2").exists() and (tmp_path / "crashed-4").exists()
    final = {r.config["crash_at"]: r.metrics for r in results}
    for when in (2, 4):  # the retried trials end exactly like the uninterrupted one
        for key in ("robustness_epsilon", "acc_clean", "acc_pgd_0.1", "cert_acc_0.05", "acc_clean_expected"):
            assert final[when][key] == pytest.approx(final[0][key], abs=1e-9), (when, key)
    client, _, children = _runs(uri, "crash")
    assert len(children) == 3  # no crashed trial opened a second run
    for run in children:
        assert run.info.status == "FINISHED"
        assert "dpsweep.error" not in run.data.tags          # finished: no error tag (issue 33, point 7)
        for key in ("train_loss", "test_acc"):
            assert _steps(client, run.info.run_id, key) == [1, 2, 3], key
        for key in ("acc_clean", "acc_pgd_0.1", "cert_acc_0.1", "compute_seconds"):
            assert _steps(client, run.info.run_id, key) == [3], key
    # the crash at epoch 2 failed an open run: its retry keeps the error; the one at the final report
    # came after the run had closed FINISHED, so there was no failure to record
    retried = [r for r in children if "dpsweep.error_retried" in r.data.tags]
    assert [r.data.tags["dpsweep.error_retried"] for r in retried] == ["RuntimeError: injected crash before report 2"]
    run = retried[0]
    path = client.download_artifacts(run.info.run_id, "error/traceback.txt", str(tmp_path))
    assert "RuntimeError: injected crash before report 2" in Path(path).read_text()


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
