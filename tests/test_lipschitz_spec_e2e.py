"""sweeps/lipschitz_dp_mnist.yaml runs end to end at a ``--set`` subset (issue 53 item 5): ``dpsweep run`` on
local Ray with an SQLite MLflow store trains lipschitz_dp at epsilon 3 and without noise, and each trial logs
epsilon, clean accuracy, the Lipschitz bound and the deterministic certificate in both domains."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "sweeps" / "lipschitz_dp_mnist.yaml"
SUBSET = ["common.train_size=512", "common.test_size=100", "common.certify_images=50",
          "trainables.0.search.epochs=1", "trainables.0.search.batch_size=128",
          "trainables.0.search.epsilon=[3.0, null]"]


@pytest.mark.slow
def test_the_shipped_spec_runs_at_a_subset_and_logs_the_deterministic_certificate(tmp_path, monkeypatch):
    import mlflow
    import ray

    from sweeps.cli import main

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        monkeypatch.chdir(tmp_path)
        uri = f"sqlite:///{tmp_path}/mlflow.db"
        assert main(["run", str(SPEC), "--tracking-uri", uri, *[a for s in SUBSET for a in ("--set", s)]]) == 0
    finally:
        ray.shutdown()
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("lipschitz-dp-mnist")
    children = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 2
    for r in children:
        m = r.data.metrics
        assert r.info.status == "FINISHED"
        assert 0.0 <= m["acc_clean"] <= 1.0 and m["lipschitz_bound"] <= 1 + 1e-5
        same = [(m[f"cert_acc_{pm1}"], m[f"det_cert_acc_01_{r01}"]) for pm1, r01 in
                (("1", "0.5"), ("2", "1"), ("3", "1.5"), ("4", "2"))]
        assert all(a == b for a, b in same)                      # the same balls in the two domains
    eps = sorted(r.data.metrics["epsilon"] for r in children)
    assert eps[0] <= 3.0 + 1e-9 and eps[1] > 1e300             # the non-private trial: inf (MLflow stores the largest float)
