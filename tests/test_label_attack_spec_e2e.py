"""sweeps/label_dp_mnist_mia.yaml runs end to end at a ``--set`` subset (issue 52, part 5): ``dpsweep run`` on
local Ray with an SQLite MLflow store trains one private label-DP trial and the non-private baseline, each
attacked by label inference on its audited training labels; each logs the label_inference_* metrics beside
label_epsilon, the console's finished line shows them, and ``dpsweep report`` writes the label-inference
table in the membership-inference section."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "sweeps" / "label_dp_mnist_mia.yaml"
SUBSET = ["common.train_size=100", "common.test_size=100",
          "trainables.0.search.mechanism=rr", "trainables.0.search.epsilon=1.0", "trainables.0.search.seed=0",
          "trainables.0.search.epochs=3", "trainables.0.search.label_attack={examples: 100}",
          "trainables.1.search.seed=0", "trainables.1.search.epochs=12", "trainables.1.search.lr=0.003",
          "trainables.1.search.batch_size=25", "trainables.1.search.label_attack={examples: 100}"]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.mark.slow
def test_the_shipped_label_attack_spec_runs_at_a_subset_and_reports_it(tmp_path, ray_local, monkeypatch, capsys):
    import mlflow

    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = [a for s in SUBSET for a in ("--set", s)]
    assert main(["run", str(SPEC), "--tracking-uri", uri, *args]) == 0
    console = capsys.readouterr()
    finished = [line for line in (console.out + console.err).splitlines()
                if "finished" in line and "label_inference_eps_lb" in line and "label_epsilon" in line]
    assert len(finished) == 2, console.out[-3000:] + console.err[-3000:]
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("label-dp-mnist-mia")
    children = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 2
    for r in children:
        m = r.data.metrics
        assert r.info.status == "FINISHED"
        for key in ("label_inference_accuracy", "label_inference_advantage", "label_inference_eps_lb",
                    "label_inference_examples", "label_epsilon"):
            assert key in m, key
        assert m["label_inference_examples"] == 100 and m["label_inference_eps_lb"] <= m["label_epsilon"]
    baseline = next(r for r in children if r.data.params["mechanism"] == "none")
    assert baseline.data.metrics["label_inference_advantage"] > 0.3     # the non-private model is found
    out = tmp_path / "report"
    assert main(["report", "label-dp-mnist-mia", "--tracking-uri", uri, "--out", str(out)]) == 0
    page = next(out.glob("*.md")).read_text()
    assert "### Label inference: attack beside the label epsilon" in page
    assert "label_dp rr" in page and "label_dp none" in page and "non-private" in page
