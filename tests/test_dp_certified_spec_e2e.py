"""sweeps/dp_certified_mnist.yaml runs end to end at a ``--set`` subset (issue 36): ``dpsweep run`` on local
Ray with an SQLite MLflow store trains and certifies one trial of each kind the chart compares (DP-SGD with
k = 4 at epsilon 3; consistency regularisation without privacy; dpal_sound, SecureSGD, PixelDP), each trial
logs the certified accuracies at the literature's radii, and ``dpsweep report`` draws the certified-radius
figure and writes its table with the spec's published anchors."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "sweeps" / "dp_certified_mnist.yaml"

# the [-1, 1] noise std 1.0 everywhere (sigma_01 0.5), tiny data and N; the first entry keeps epsilon 3 and
# none at k 1 and 4, the configurations the reference block's anchors name (a point matching no trial is
# refused)
SUBSET = ["common.train_size=1024", "common.test_size=100", "common.certify_images=10", "common.certify_n=200",
          "common.epochs=1",
          "trainables.0.search.epsilon=[3.0, null]", "trainables.0.search.noise_augmentation_sigma=1.0",
          "trainables.1.search.epsilon=null", "trainables.1.search.noise_augmentation_sigma=1.0",
          "trainables.2.search.epsilon=3.0", "trainables.2.search.smoothing_sigma=1.0",
          "trainables.3.search.epsilon=3.0", "trainables.3.search.attack_bound=0.392189",
          "trainables.4.search.attack_bound=0.394124"]


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.mark.slow
def test_the_shipped_spec_runs_at_a_subset_and_reports_its_certified_radius_figure(tmp_path, ray_local,
                                                                                  monkeypatch):
    import mlflow

    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = [a for s in SUBSET for a in ("--set", s)]
    assert main(["run", str(SPEC), "--tracking-uri", uri, *args]) == 0
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("dp-certified-mnist")
    runs = client.search_runs([exp.experiment_id])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert sorted(r.data.params["trainable"] for r in children) == ["dpal_sound", *["dpsgd"] * 5, "pixeldp",
                                                                     "secure_sgd"]
    for r in children:
        assert r.info.status == "FINISHED", r.info.run_name
        accs = [r.data.metrics[f"smooth_cert_acc_{i}"] for i in (1, 2, 3, 4)]   # the [0, 1] radii 0.5 .. 2.0
        assert all(0.0 <= a <= 1.0 for a in accs) and accs == sorted(accs, reverse=True), r.info.run_name

    out = tmp_path / "report"
    assert main(["report", "dp-certified-mnist", "--tracking-uri", uri, "--out", str(out)]) == 0
    assert (out / "certified_radius.png").stat().st_size > 10_000 and (out / "certified_radius.pdf").exists()
    with open(out / "certified_radius.csv") as fh:
        rows = list(csv.DictReader(fh))
    configs = [r["configuration"] for r in rows]
    assert sum(not c.startswith("published") for c in configs) >= 8          # a row per trial's configuration
    assert {c for c in configs if c.startswith("published")} == {                 # the non-private ones too
        "published: DP-CERT, epsilon ~3", "published: Cohen et al. 2019, non-private Gaussian augmentation",
        "published: best non-private (SmoothMix / SmoothAdv / consistency)"}
    dpcert = next(r for r in rows if r["configuration"] == "published: DP-CERT, epsilon ~3")
    assert float(dpcert["r01_0.5_mean"]) == 93.3 and float(dpcert["r01_2_mean"]) == 26.3   # numbers in columns
    protects = {r["configuration"].split(":")[0]: r["epsilon_protects"] for r in rows
                if not r["configuration"].startswith("published")}
    assert any("no training data" in p or "not DP" in p or "robustness" in p for p in protects.values()), protects
    page = next(out.glob("*.md")).read_text()
    assert "## Certified accuracy against l2 radius (randomized smoothing)" in page
    assert "certified_radius.png" in page
