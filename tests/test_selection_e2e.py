"""``dpsweep run`` end to end with a selection split, private selection and an audit (issue 34, points
2, 7, 8 and 9): the console and the parent run carry the held-out headline, candidates are labelled
candidates, the closing lines restate the end-to-end epsilon and point to ``dpsweep release``, the
compare view's port and metric are named, and an audited sweep's console table shows each trial's
claim and bounds while trials.csv drops the flat audit defaults beside the mapping that ran."""

from __future__ import annotations

import csv

import pytest
import yaml

pytestmark = pytest.mark.slow

TINY = {"dataset": "mnist", "train_size": 200, "test_size": 60, "epochs": 1, "batch_size": 50, "model": "tb_cnn",
        "certify_images": 0, "noise_source": "seed"}


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def _write(tmp_path, name, **spec):
    raw = {"name": name, "storage": str(tmp_path / "ray_results"), "mlflow": {"experiment": name},
           "resources": {"cpu": 1}, "max_concurrent_trials": 2, **spec}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _parent(uri, name):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    (parent,) = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("dpsweep.kind") == "sweep"]
    return parent


def test_private_selection_with_a_test_half_split(tmp_path, ray_local, monkeypatch, capsys):
    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPSWEEP_CACHE", str(tmp_path / "cache"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = _write(tmp_path, "tp", common={**TINY, "epsilon": 2.0, "noise_source": "secret", "diagnostics": False},  # as a release needs
                  trainables=[{"name": "dpsgd", "search": {"lr": {"choice": [0.1, 0.5]}}}],
                  search={"algorithm": "random", "seed": 1, "metric": "acc_clean", "mode": "max"},
                  tuning_privacy={"distribution": "geometric", "mean": 4},
                  selection={"split": "test_half"})
    assert main(["run", str(spec), "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    parent = _parent(uri, "tp")
    held = parent.data.metrics["released_heldout_acc_clean"]
    assert f"headline: held-out acc_clean = {held:.4g} on the test images the selection never read" in out
    assert parent.data.metrics["best_heldout_acc_clean"] == pytest.approx(held)
    lines = out.splitlines()
    i = next(j for j, ln in enumerate(lines) if ln.startswith("trial_id"))
    n = sum(1 for ln in lines[i + 2:] if ln.split()[-2:-1] == ["DONE"] or " DONE " in ln)
    assert "cfg.repeat" not in lines[i] and ("candidate" in lines[i].split() or n == 1)  # candidates, not repeats
    # (K is drawn from the sweep's secret: with K = 1 there is no candidate index to show)
    from sweeps.report.data import metric_value

    e2e = metric_value(parent.data.metrics["tuning_epsilon"])   # MLflow keeps inf as the largest float
    started = [ln for ln in capsys.readouterr().out.splitlines() + out.splitlines() if "] started  " in ln]
    assert started and all("repeat=" not in ln and ("candidate=" in ln or n == 1) for ln in started), started
    assert f"privacy:  end-to-end epsilon {e2e:.4g} at delta" in out
    assert "for the owner only; publish with: dpsweep release tp --tracking-uri" in out
    assert "start it with --port 5000" in out and "pick acc_clean in the plot's Metrics box" in out
    assert "--backend-store-uri " + uri + " --port 5000" in out

    from sweeps.report import make_report

    text = make_report("tp", uri, tmp_path / "r").read_text()
    assert "**For the sweep's owner only**" in text and "`dpsweep release tp --out release/`" in text
    assert f"**Headline: held-out acc_clean = {held:.4g}**" in text

    import json

    from sweeps.release import make_release

    bundle = make_release("tp", str(tmp_path / "release"), uri, None)
    guarantee = json.loads((bundle / "guarantee.json").read_text())
    assert guarantee["selection"]["held_out_score"] == pytest.approx(held)


def test_audited_sweep_console_and_trials_csv(tmp_path, ray_local, monkeypatch, capsys):
    from sweeps.cli import main

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    spec = _write(tmp_path, "aud", common={**TINY, "audit": {"mode": "whitebox", "canaries": 50}},
                  trainables=[{"name": "dpsgd", "search": {"epsilon": [2.0, 8.0]}}],
                  search={"metric": "acc_clean", "mode": "max"})
    assert main(["run", str(spec), "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    i = next(j for j, ln in enumerate(lines) if ln.startswith("trial_id"))
    header = lines[i].split()
    assert "audit_claim" in header and "audit_epsilon_lb" in header, header
    rows = [dict(zip(header, ln.split())) for ln in lines[i + 2:i + 4]]
    assert sorted(float(r["audit_claim"]) for r in rows) == pytest.approx([2.0, 8.0], rel=0.01)
    assert all(float(r["audit_epsilon_lb"]) < float(r["audit_claim"]) for r in rows)

    from sweeps.report import make_report

    make_report("aud", uri, tmp_path / "r")
    with open(tmp_path / "r" / "trials.csv") as fh:
        cols = next(csv.reader(fh))
    assert "param.audit" in cols and "param.audit_canaries" not in cols and "param.audit_beta" not in cols
