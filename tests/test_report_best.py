"""The best trial and the MLflow compare view (issue 24, points 5 and 9), and the console's swept
keys (point 6)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from urllib.parse import parse_qs, unquote

import pytest


def _spec(metric="acc_clean", mode="max", tuning=None):
    return SimpleNamespace(search=SimpleNamespace(metric=metric, mode=mode), tuning_privacy=tuning)


def _query(url: str) -> dict:
    assert url.startswith("http://127.0.0.1:5000/#/compare-runs?")
    return {k: json.loads(v[0]) for k, v in parse_qs(url.split("?", 1)[1]).items()}


def test_compare_url_is_mlflows_route_with_url_encoded_json_lists():
    from sweeps.report.best import compare_url

    url = compare_url("http://127.0.0.1:5000/", "7", ["a1", "b2"])
    assert url == ("http://127.0.0.1:5000/#/compare-runs?runs=%5B%22a1%22%2C%22b2%22%5D"
                   "&experiments=%5B%227%22%5D")
    assert _query(url) == {"runs": ["a1", "b2"], "experiments": ["7"]}
    assert json.loads(unquote(url.split("runs=")[1].split("&")[0])) == ["a1", "b2"]
    assert compare_url("http://x", "1", []) == ""


def test_ui_base_is_the_server_or_the_local_ui():
    from sweeps.report.best import ui_base

    assert ui_base("sqlite:////tmp/m.db") == "http://127.0.0.1:5000"
    assert ui_base("http://head:5000/") == "http://head:5000"


@pytest.fixture()
def sweep_store(tmp_path):
    """A parent run with three child runs (trial ids t0..t2) and one run of another sweep."""
    from mlflow.tracking import MlflowClient

    from trainables.tracking import TAG_PARENT, TAG_TRIAL

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("best")
    parent = client.create_run(exp, tags={"dpsweep.kind": "sweep"}).info.run_id
    other = client.create_run(exp, tags={"dpsweep.kind": "sweep"}).info.run_id
    children = {}
    for i in range(3):
        children[f"t{i}"] = client.create_run(exp, tags={TAG_PARENT: parent, TAG_TRIAL: f"t{i}"}).info.run_id
    client.create_run(exp, tags={TAG_PARENT: other, TAG_TRIAL: "x"})
    info = {"tracking_uri": uri, "experiment_id": exp, "parent_run_id": parent}
    return client, info, children


ROWS = [{"trial_id": "t0", "status": "DONE", "acc_clean": 0.80, "cfg.max_grad_norm": 1.0},
        {"trial_id": "t1", "status": "DONE", "acc_clean": 0.91, "cfg.max_grad_norm": 0.1},
        {"trial_id": "t2", "status": "ERROR", "acc_clean": 0.99, "cfg.max_grad_norm": 10.0}]


def test_record_best_tags_the_parent_with_the_best_trial_and_the_compare_view(sweep_store):
    from sweeps.report.best import describe_best, record_best

    client, info, children = sweep_store
    best = record_best(info, _spec(), ROWS)
    assert best.row["trial_id"] == "t1" and best.run_id == children["t1"]  # the errored trial is not a candidate
    parent = client.get_run(info["parent_run_id"]).data
    assert parent.tags["dpsweep.best_trial_id"] == "t1"
    assert parent.tags["dpsweep.best_run_id"] == children["t1"]
    assert parent.tags["dpsweep.best_metric"] == "acc_clean (max)"
    assert parent.metrics["best_acc_clean"] == pytest.approx(0.91)
    # the compare view holds exactly this sweep's child runs (not the other sweep's)
    q = _query(parent.tags["dpsweep.compare_url"])
    assert sorted(q["runs"]) == sorted(children.values()) and q["experiments"] == [info["experiment_id"]]
    line = describe_best(best, ["cfg.max_grad_norm"], 3)
    assert "trial t1 (max_grad_norm=0.1) with acc_clean = 0.91" in line
    assert "not private" in line and "best of 3 trials" in line and "tuning_privacy" in line
    # minimising picks the other trial
    assert record_best(info, _spec(mode="min"), ROWS).row["trial_id"] == "t0"


def test_without_a_metric_only_the_compare_view_is_tagged(sweep_store):
    from sweeps.report.best import describe_best, record_best

    client, info, _ = sweep_store
    best = record_best(info, _spec(metric=None), ROWS)
    tags = client.get_run(info["parent_run_id"]).data.tags
    assert "dpsweep.compare_url" in tags and "dpsweep.best_trial_id" not in tags
    assert "no best trial" in describe_best(best)


def test_a_tuning_private_best_is_the_released_trial_and_says_so(sweep_store):
    from sweeps.report.best import describe_best, record_best

    _, info, _ = sweep_store
    line = describe_best(record_best(info, _spec(tuning=object()), ROWS), [], 3)
    assert "end-to-end epsilon" in line and "not private" not in line


# --------------------------------------------------------------------------- console (point 6)


def _result(cfg, metrics):
    return SimpleNamespace(config=cfg, error=None, metrics={"evaluated": 1.0, **metrics})


def test_console_table_shows_every_key_that_varies():
    from sweeps.runner import format_table, summarize

    base = {"trainable": "dpsgd", "epsilon": 1.0, "delta": 1e-5, "seed": 0, "lr": 0.5}
    grid = [_result({**base, "max_grad_norm": 0.1}, {"trial_id": "a", "acc_clean": 0.8}),
            _result({**base, "max_grad_norm": 1.0}, {"trial_id": "b", "acc_clean": 0.9})]
    rows, _, _ = summarize(grid)
    assert [r["cfg.max_grad_norm"] for r in rows] == [0.1, 1.0]
    assert "cfg.lr" not in rows[0]  # a key that is the same everywhere stays out
    header = format_table(rows).splitlines()[0].split()
    assert "cfg.max_grad_norm" in header and "cfg.epsilon" in header


def test_console_shows_what_optuna_varied():
    from sweeps.runner import _describe, summarize

    mlflow = {"swept": {"dpsgd": ["lr", "batch_size"]}}
    cfg = {"trainable": "dpsgd", "epsilon": 1.0, "seed": 0, "lr": 0.0123, "batch_size": 256, "_mlflow": mlflow}
    assert _describe(cfg) == "trainable=dpsgd, lr=0.0123, batch_size=256, epsilon=1, seed=0"
    # one finished trial so far: nothing differs yet, but Optuna drew lr and batch_size
    rows, _, _ = summarize([_result(cfg, {"trial_id": "a", "acc_clean": 0.5})])
    assert rows[0]["cfg.lr"] == 0.0123 and rows[0]["cfg.batch_size"] == 256


# --------------------------------------------------------------------------- the compare view in a browser


@pytest.mark.skipif(__import__("shutil").which("chromium") is None, reason="needs chromium (apt-get install chromium)")
def test_compare_view_opens_on_parallel_coordinates_of_the_swept_keys(tmp_path):
    """Headless Chromium on the printed address: MLflow's compare view draws the parallel
    coordinates of the params that differ between the children (the swept keys) against a metric."""
    import re
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from sweeps.report.best import record_best
    from trainables.tracking import TAG_PARENT, TAG_TRIAL

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("ui")
    parent = client.create_run(exp, tags={"dpsweep.kind": "sweep"}).info.run_id
    rows = []
    for i, (eps, mgn) in enumerate([(1.0, 0.1), (1.0, 1.0), (4.0, 0.1), (4.0, 1.0)]):
        run = client.create_run(exp, tags={TAG_PARENT: parent, TAG_TRIAL: f"t{i}"}).info.run_id
        client.log_batch(run, params=[Param("epsilon", str(eps)), Param("max_grad_norm", str(mgn)), Param("lr", "0.5")],
                         metrics=[Metric("acc_clean", 0.5 + 0.1 * eps - 0.05 * mgn, 0, 0), Metric("epsilon", eps, 0, 0)])
        client.set_terminated(run)
        rows.append({"trial_id": f"t{i}", "status": "DONE", "acc_clean": 0.5 + 0.1 * eps - 0.05 * mgn})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    info = {"tracking_uri": uri, "experiment_id": exp, "parent_run_id": parent}
    url = record_best(info, _spec(), rows).compare_url.replace("127.0.0.1:5000", f"127.0.0.1:{port}")
    mlflow_bin = str(Path(sys.executable).parent / "mlflow")
    ui = subprocess.Popen([mlflow_bin, "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(90):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        dom = subprocess.run(["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1600,1200",
                              "--virtual-time-budget=20000", "--dump-dom", url],
                             capture_output=True, text=True, timeout=180).stdout
    finally:
        import os
        import signal

        os.killpg(ui.pid, signal.SIGTERM)
        ui.wait(timeout=30)
    assert "Comparing 4 Runs" in dom and "Parallel Coordinates Plot" in dom
    axes = re.findall(r'class="axis-title"[^>]*data-unformatted="([^"]+)"', dom)
    assert axes == ["epsilon", "max_grad_norm", "acc_clean"], axes  # lr is the same everywhere: not drawn


def test_the_caveat_speaks_of_privacy_only_where_a_trial_claims_some():
    """PixelDP's epsilon is a robustness parameter: the best of a PixelDP sweep is a tuning choice,
    not a privacy question; a DP-SGD sweep's best is not covered without tuning_privacy."""
    from sweeps.report.best import claims_privacy, selection_caveat

    assert not claims_privacy(["pixeldp"]) and claims_privacy(["pixeldp", "dpsgd"]) and claims_privacy(["dpsgd"])
    plain = selection_caveat(False, 4, claims_privacy(["pixeldp"]))
    assert "private" not in plain.replace("privacy for its training data", "") and "optimistic" in plain
    assert selection_caveat(False, 4, True).startswith("not private")
    assert "end-to-end epsilon" in selection_caveat(True, 4, True)
