"""End to end through Ray Tune and MLflow: the CLI, multi-objective Optuna with ASHA, two mechanisms
in one sweep (a crash and its retry: tests/test_lifecycle_e2e.py; `dpsweep resume`: test_interrupts.py).

Each test runs tiny PixelDP trials on a small real-MNIST subset against a temporary SQLite
store; Ray runs locally (one instance per test module).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

TINY = {
    "dataset": "mnist", "train_size": 256, "test_size": 64, "epochs": 2, "batch_size": 64,
    "certify_images": 16, "certify_n": 40, "attacks": {"pgd": [0.1]}, "attack_steps": 2,
    "certify_sizes": [0.05, 0.1],
}


def _spec(tmp_path: Path, name: str, epsilons, **extra) -> Path:
    spec = {
        "name": name,
        "storage": str(tmp_path / "ray_results"),
        "mlflow": {"experiment": name},
        "common": dict(TINY),
        "trainables": [{"name": "pixeldp", "search": {"epsilon": list(epsilons)}}],
        "resources": {"cpu": 1},
        "max_concurrent_trials": 2,
        "failure": {"max_retries": 1},
        **extra,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def _runs(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("dpsweep.kind") == "sweep"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return client, parents, children


def test_cli_sweep_logs_parent_and_children(tmp_path, ray_local, monkeypatch, capsys):
    import pyarrow.parquet as pq
    import torch

    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = _spec(tmp_path, "e2e", [0.5, 1.0], search={"algorithm": "grid", "metric": "acc_clean", "mode": "max"})
    assert main(["run", str(spec), "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    assert out.count(" DONE") == 2 and "STOPPED" not in out  # the results table
    assert "mlflow ui --backend-store-uri" in out
    assert "cfg.epsilon" in out.splitlines()[[ln.startswith("trial_id") for ln in out.splitlines()].index(True)]

    client, parents, children = _runs(uri, "e2e")
    assert len(parents) == 1 and len(children) == 2
    parent = parents[0]
    # the best trial and the compare view: printed and tagged on the parent (issue 24, points 5 and 9)
    best = max(children, key=lambda r: r.data.metrics["acc_clean"])
    assert parent.data.tags["dpsweep.best_run_id"] == best.info.run_id
    assert parent.data.metrics["best_acc_clean"] == best.data.metrics["acc_clean"]
    # PixelDP's epsilon is a robustness parameter: the choice is a tuning choice, not a privacy question
    assert f"run {best.info.run_id}); a tuning choice among 2 trials, none of which claims privacy" in out
    compare = next(ln for ln in out.splitlines() if ln.startswith("compare:  "))
    assert parent.data.tags["dpsweep.compare_url"] in compare
    assert all(r.info.run_id in compare for r in children)
    assert parent.data.tags["dpsweep.git_commit"]
    assert "spec.yaml" in [a.path for a in client.list_artifacts(parent.info.run_id)]
    assert parent.data.metrics["trials"] == 2
    for run in children:
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        m = run.data.metrics
        for key in ("acc_clean", "acc_pgd_0.1", "cert_acc_0.05", "cert_acc_0.1", "robustness_epsilon",
                    "robustness_epsilon_config", "robustness_delta", "train_loss", "test_acc"):
            assert key in m, key
        assert "epsilon" not in m and "delta" not in m  # PixelDP's epsilon is no privacy guarantee
        assert len(client.get_metric_history(run.info.run_id, "train_loss")) == 2
        assert run.data.params["epsilon"] in ("0.5", "1.0")
        assert run.data.params["train_size"] == "256"
        local = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / run.info.run_id)))
        table = pq.read_table(local / "certification" / "certification.parquet")
        assert table.num_rows == 16
        assert {"index", "label", "prediction", "lower_bound", "upper_bound", "certified_size"} <= set(table.column_names)
        assert (local / "certification" / "cert_acc.png").stat().st_size > 1000
        weights = torch.load(local / "model" / "weights.pt", weights_only=True)
        assert "first.weight" in weights

    from sweeps.report import make_report

    report = make_report("e2e", uri, tmp_path / "report")
    assert (tmp_path / "report" / "cert_acc_vs_size.png").exists()
    text = report.read_text()   # PixelDP only: no privacy epsilon, so no privacy caveat to make (issue 51.7)
    assert "reports a privacy epsilon for its training data" in text and "per-trial epsilons above" not in text


def test_optuna_multi_objective_and_asha(tmp_path, ray_local, monkeypatch):
    """Optuna proposes trials for two objectives; ASHA schedules on the per-epoch test_acc."""
    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = _spec(tmp_path, "optuna", [0.5, 1.0],
                 search={"algorithm": "optuna", "num_samples": 3, "seed": 1,
                         "objectives": [{"metric": "acc_clean", "mode": "max"},
                                        {"metric": "robustness_epsilon", "mode": "min"}]})
    raw = yaml.safe_load(spec.read_text())
    raw["trainables"][0]["search"]["lr"] = {"loguniform": [1e-4, 1e-2]}
    spec.write_text(yaml.safe_dump(raw))
    assert main(["run", str(spec), "--tracking-uri", uri]) == 0
    _, _, children = _runs(uri, "optuna")
    assert len(children) == 3
    lrs = {float(r.data.params["lr"]) for r in children}
    assert len(lrs) == 3 and all(1e-4 <= lr <= 1e-2 for lr in lrs)

    spec = _spec(tmp_path, "asha", [0.5, 1.0, 2.0],
                 scheduler={"type": "asha", "metric": "acc_clean", "grace_period": 1})  # compared as test_acc
    assert main(["run", str(spec), "--tracking-uri", uri]) == 0
    _, _, children = _runs(uri, "asha")
    assert len(children) == 3


def test_two_mechanisms_in_one_sweep(tmp_path, ray_local, monkeypatch):
    """The mechanism is a sweep dimension: PixelDP and DPAL side by side under one parent run."""
    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = _spec(tmp_path, "both", [1.0])
    raw = yaml.safe_load(spec.read_text())
    raw["common"].update({"train_size": 600, "epochs": 1, "attacks": {"fgsm": [0.2]}, "attack_norm": "linf",
                          "certify_images": 16, "certify_n": 20, "test_size": 48})
    raw["trainables"].append({"name": "dpal", "search": {"eps_t": [1.0], "batch_size": 200, "train_attack_steps": 1,
                                                         "n_predict": 10, "certify_bounds": "hoeffding"}})
    spec.write_text(yaml.safe_dump(raw))
    assert main(["run", str(spec), "--tracking-uri", uri]) == 0
    _, parents, children = _runs(uri, "both")
    assert len(parents) == 1 and len(children) == 2
    by = {r.data.tags["dpsweep.trainable"]: r for r in children}
    assert set(by) == {"pixeldp", "dpal"}
    dpal = by["dpal"].data.metrics
    for key in ("acc_clean", "acc_fgsm_0.2", "cert_acc_0.1", "epsilon", "eps_1", "eps_2", "gamma"):
        assert key in dpal, key
    assert dpal["epsilon"] == pytest.approx(1.0, rel=1e-6)

    # the report: Pareto fronts, curves and tables from the per-example Parquet files
    from sweeps.report import make_report
    from sweeps.report.data import certified_accuracy_at, load_sweep, load_tables

    out = tmp_path / "report"
    report = make_report("both", uri, out, sizes=[0.1, 0.0123]).read_text()
    for name in ("pareto_accuracy.png", "pareto_certified.png", "cert_acc_vs_size.png",
                 "fig6_certified_vs_attack_size.png", "trials.csv", "certified_accuracy.csv"):
        assert (out / name).stat().st_size > 100, name
    assert "not covered by any privacy guarantee" in report and "cert_acc_0.0123" in report
    assert "DPAL verified inference" in report
    sweep = load_sweep("both", uri)
    load_tables(sweep)
    assert len(sweep.tables) == 2
    for (run_id, kind), table in sweep.tables.items():
        logged = sweep.trials.set_index("run_id").loc[run_id, "cert_acc_0.1"]
        assert certified_accuracy_at(table, kind, [0.1])[0] == pytest.approx(logged, abs=1e-9)
