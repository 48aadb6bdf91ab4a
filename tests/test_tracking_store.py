"""The MLflow tracking store (issue 24, points 3 and 4): relative SQLite URIs are made absolute
where the parent run opens; errors that cannot succeed are not retried; a tracking server that
is not there, or an unknown ``--run`` id, is one line and exit code 2 within seconds."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos import databricks_pb2 as pb

from sweeps.cli import main
from sweeps.tracking import TrackingUnreachable, absolute_tracking_uri, check_tracking_store, start_parent_run
from trainables.tracking import TrialTracker, is_permanent, retry

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- retries


def _counting(exc):
    calls = []

    def fn():
        calls.append(1)
        raise exc
    return fn, calls


@pytest.mark.parametrize("code", ["RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "BAD_REQUEST",
                                  "PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_ALREADY_EXISTS"])
def test_permanent_mlflow_errors_are_raised_at_once_unchanged(code):
    exc = MlflowException(f"{code} happened", error_code=getattr(pb, code))
    fn, calls = _counting(exc)
    with pytest.raises(MlflowException) as got:
        retry(fn, what="x", attempts=5, first_wait=0.01)
    assert got.value is exc and len(calls) == 1


@pytest.mark.parametrize("exc", [MlflowException("boom", error_code=pb.INTERNAL_ERROR),
                                 MlflowException("busy", error_code=pb.TEMPORARILY_UNAVAILABLE),
                                 MlflowException("slow down", error_code=pb.REQUEST_LIMIT_EXCEEDED),
                                 ConnectionError("refused"), RuntimeError("database is locked")])
def test_transient_errors_are_still_retried(exc):
    fn, calls = _counting(exc)
    with pytest.raises(RuntimeError, match="failed after 3 attempts"):
        retry(fn, what="x", attempts=3, first_wait=0.01)
    assert len(calls) == 3
    assert not is_permanent(exc)


def test_unknown_experiment_fails_a_trial_at_once(tmp_path):
    """The issue's ``No Experiment with id=3 exists``, retried 8 times before: now at once."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    MlflowClient(uri).search_experiments()  # the database exists (its creation takes seconds)
    start = time.perf_counter()
    with pytest.raises(MlflowException, match="No Experiment with id=3"):
        TrialTracker.open({"tracking_uri": uri, "experiment_id": "3", "parent_run_id": None},
                          trial_id="t1", trial_name="t1", trainable="pixeldp")
    assert time.perf_counter() - start < 10


# --------------------------------------------------------------------------- absolute URIs


def test_relative_sqlite_uri_is_made_absolute_where_the_parent_run_opens(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    info = start_parent_run("sqlite:///mlflow.db", "study", "study-1", spec_raw={"a": 1}, flat_params={"a": "1"})
    assert info["tracking_uri"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert (tmp_path / "mlflow.db").exists()
    # a trial elsewhere finds the experiment through the returned URI
    elsewhere = tmp_path / "trial_dir"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    tracker = TrialTracker.open(info, trial_id="t1", trial_name="t1", trainable="pixeldp")
    tracker.finish()
    assert not (elsewhere / "mlflow.db").exists()


def test_absolute_tracking_uri_leaves_other_uris_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_tracking_uri("sqlite:////abs/m.db") == "sqlite:////abs/m.db"
    assert absolute_tracking_uri("http://h:5000") == "http://h:5000"
    assert absolute_tracking_uri("databricks") == "databricks"
    assert absolute_tracking_uri("mlruns") == str(tmp_path / "mlruns")


# --------------------------------------------------------------------------- the store is there


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """A local HTTP server answering ``status`` on ``/health`` (404 elsewhere)."""

    def __init__(self, health_status: int):
        status = health_status

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                code = status if self.path == "/health" else 404
                self.send_response(code)
                self.end_headers()
                self.wfile.write(b"OK")

            def log_message(self, *args):
                pass

        self.httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_probe_accepts_a_live_server_and_refuses_the_others():
    ok, wrong, sick = _Server(200), _Server(404), _Server(503)
    try:
        check_tracking_store(ok.uri)
        with pytest.raises(TrackingUnreachable, match="not as an MLflow tracking server"):
            check_tracking_store(wrong.uri)
        with pytest.raises(TrackingUnreachable, match="HTTP 503"):
            check_tracking_store(sick.uri, timeout=1)
    finally:
        for s in (ok, wrong, sick):
            s.close()


def test_sqlite_in_a_missing_directory_is_refused(tmp_path):
    check_tracking_store(f"sqlite:///{tmp_path}/m.db")
    with pytest.raises(TrackingUnreachable, match="does not exist"):
        check_tracking_store(f"sqlite:///{tmp_path}/nope/m.db")


def test_run_against_no_server_is_one_line_and_exit_2_before_ray(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    uri = f"http://127.0.0.1:{_free_port()}"
    start = time.perf_counter()
    code = main(["run", str(ROOT / "sweeps" / "quickstart.yaml"), "--tracking-uri", uri])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and elapsed < 10
    assert len(err) == 1 and err[0].startswith("dpsweep: error: ") and uri in err[0]
    assert not (tmp_path / "ray_results").exists()  # nothing started


def test_report_of_an_unknown_run_id_is_one_line_and_exit_2(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("e")
    other = client.create_run(client.create_experiment("other")).info.run_id
    client.create_run(exp)
    capsys.readouterr()
    start = time.perf_counter()
    code = main(["report", "e", "--tracking-uri", uri, "--run", "0123456789abcdef", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and time.perf_counter() - start < 10
    assert err == [f"dpsweep: error: --run: no MLflow run with id '0123456789abcdef' at {uri}"]
    assert main(["report", "e", "--tracking-uri", uri, "--run", other, "--out", str(tmp_path / "r")]) == 2
    assert "belongs to experiment id" in capsys.readouterr().err
    assert main(["report", "e", "--tracking-uri", f"http://127.0.0.1:{_free_port()}"]) == 2
    assert "no MLflow tracking server answers" in capsys.readouterr().err


def test_a_fresh_trial_logs_its_params_and_tags_in_one_write(tmp_path, monkeypatch):
    """A trial's start is one store write (each is a SQLite commit, more than a small trial's
    epoch); a reopened run reads what it holds first and adds only what is missing."""
    from mlflow.tracking import MlflowClient

    from trainables.tracking import TrialTracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    exp = MlflowClient(uri).create_experiment("e")
    info = {"tracking_uri": uri, "experiment_id": exp, "parent_run_id": None}
    tracker = TrialTracker.open(info, trial_id="t1", trial_name="dpsgd seed=0", trainable="dpsgd")
    calls = []
    for name in ("log_batch", "get_run", "set_tag"):
        real = getattr(tracker.client, name)
        monkeypatch.setattr(tracker.client, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    tracker.log_params({f"k{i}": i for i in range(150)}, tags={"dpsweep.device": "cpu", "x": "1"})
    assert calls == ["log_batch", "log_batch"]  # 150 params: two batches of at most 100, the tags with the first
    again = TrialTracker.open(info, trial_id="t1", trial_name="dpsgd seed=0", trainable="dpsgd")
    assert again.run_id == tracker.run_id and not again.fresh
    again.log_params({"k0": 0, "new": 1}, tags={"dpsweep.device": "cuda:0"})
    run = MlflowClient(uri).get_run(tracker.run_id)
    assert len(run.data.params) == 151 and run.data.params["new"] == "1"
    assert run.data.tags["dpsweep.device"] == "cuda:0" and run.data.tags["x"] == "1"
