"""Fault suite (issue 33, point 8): a trial whose parameters stop being finite is DIVERGED (console,
MLflow, best-trial choice), not a success, and spends no retries."""

from __future__ import annotations

import pytest
import yaml

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def test_a_diverged_trial_is_marked_and_never_the_best(tmp_path, ray_local, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "div.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "div", "storage": str(tmp_path / "ray_results"), "mlflow": {"experiment": "div"},
        "common": {"dataset": "mnist", "train_size": 128, "test_size": 32, "certify_images": 0},
        "trainables": [{"name": "dpsgd", "search": {"epsilon": None, "epochs": 2, "batch_size": 32,
                                                     "lr": [0.05, 1.0e+30]}}],
        "search": {"algorithm": "grid", "metric": "acc_clean", "mode": "max"},
        "resources": {"cpu": 1}, "max_concurrent_trials": 2, "failure": {"max_retries": 2}}))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert main(["run", str(spec), "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    table = [ln for ln in out.splitlines() if "dpsgd" in ln and ("DONE" in ln or "DIVERGED" in ln)]
    assert sum("DIVERGED" in ln for ln in table) == 1 and sum(" DONE" in ln for ln in table) == 1, out
    best = next(ln for ln in out.splitlines() if ln.startswith("best:"))
    assert "lr" not in best or "1e+30" not in best
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("div")
    children = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    bad = [r for r in children if "dpsweep.diverged" in r.data.tags]
    assert len(bad) == 1 and float(bad[0].data.params["lr"]) == 1e30
    assert bad[0].data.metrics["diverged"] == 1.0 and "non-finite parameters" in bad[0].data.tags["dpsweep.diverged"]
    assert "dpsweep.error" not in bad[0].data.tags and "dpsweep.error_retried" not in bad[0].data.tags   # no retry
    assert "acc_clean" not in bad[0].data.metrics
