"""sweeps/dpsgd_mnist_mia.yaml runs end to end at a ``--set`` subset (issue 52): ``dpsweep run`` on local
Ray with an SQLite MLflow store trains one private trial (audited, attacked by RMIA) and one non-private
trial (attacked by LiRA); each logs the mia_* metrics, the console's finished line shows them, and
``dpsweep report`` writes the membership-inference section (attack beside audit and claim) and figure."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "sweeps" / "dpsgd_mnist_mia.yaml"
MIA = "{attack: %s, references: 1, candidates: 200, num_z: 200}"
SUBSET = ["common.train_size=200", "common.test_size=100", "common.epochs=1",
          "trainables.0.search.epsilon=8.0", "trainables.0.search.seed=0",
          "trainables.0.search.audit={mode: whitebox, canaries: 200, estimator: [steinke, fdp]}",
          f"trainables.0.search.mia={MIA % 'rmia'}",
          "trainables.1.search.seed=0", f"trainables.1.search.mia={MIA % 'lira'}"]


@pytest.fixture(scope="module")
def ray_local(tmp_path_factory):
    import ray

    old = os.environ.get("DPSWEEP_CACHE")
    os.environ["DPSWEEP_CACHE"] = str(tmp_path_factory.mktemp("cache"))   # Ray's workers inherit it
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()
    if old is None:
        os.environ.pop("DPSWEEP_CACHE", None)
    else:
        os.environ["DPSWEEP_CACHE"] = old


@pytest.mark.slow
def test_the_shipped_mia_spec_runs_at_a_subset_and_reports_the_attack(tmp_path, ray_local, monkeypatch, capsys):
    import mlflow

    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = [a for s in SUBSET for a in ("--set", s)]
    assert main(["run", str(SPEC), "--tracking-uri", uri, *args]) == 0
    console = capsys.readouterr()
    finished = [line for line in (console.out + console.err).splitlines() if "finished" in line and "mia_auc" in line]
    assert len(finished) == 2, console.out[-3000:] + console.err[-3000:]
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("dpsgd-mnist-mia")
    children = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 2
    for r in children:
        m = r.data.metrics
        assert r.info.status == "FINISHED"
        for key in ("mia_auc", "mia_tpr_at_fpr_0.001", "mia_tpr_at_fpr_0.01", "mia_eps_lb", "mia_auc_lo",
                    "mia_candidates", "mia_references"):
            assert key in m, key
        assert m["mia_candidates"] == 200 and m["mia_eps_lb"] <= m["epsilon"]
    private = next(r for r in children if r.data.params["epsilon"] != "None")
    assert "audit_epsilon_lb" in private.data.metrics
    out = tmp_path / "report"
    assert main(["report", "dpsgd-mnist-mia", "--tracking-uri", uri, "--out", str(out)]) == 0
    assert (out / "membership_inference.png").stat().st_size > 10_000
    page = next(out.glob("*.md")).read_text()
    assert "### Membership inference: attack beside audit and claim" in page
    assert "non-private" in page and "RMIA".lower() in page and "lira" in page
