"""Issue 33, point 6: a tracking server that answers HTTP 500 ends ``dpsweep run`` in one line,
within seconds, exit 2, with nothing left RUNNING and nothing written; a store that fails part-way
through the set-up closes the parent run it made and says so in one line."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.test_sweep_e2e import ROOT, _spec


class _Handler(http.server.BaseHTTPRequestHandler):
    healthy_api = False

    def _answer(self):
        ok = self.path.startswith("/health") or (self.healthy_api and "/api/" in self.path)
        self.send_response(200 if ok else 500)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}" if ok else b'{"error_code": "INTERNAL_ERROR", "message": "backend store down"}')

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def failing_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_server_whose_api_answers_500_is_one_line_within_seconds(tmp_path, failing_server):
    spec = _spec(tmp_path, "http500", [1.0])
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "sweeps.cli", "run", str(spec), "--tracking-uri", failing_server],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)})
    elapsed = time.time() - t0
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(err) == 1 and err[0].startswith("dpsweep: error: tracking URI: the MLflow tracking server"), err
    assert "HTTP 500 on its REST API" in err[0] and "Traceback" not in done.stdout + done.stderr
    assert elapsed < 120, elapsed                     # the probe's few seconds, not MLflow's retries
    assert not (tmp_path / "ray_results").exists()    # nothing written, no Ray, no run


def test_a_store_failing_after_the_parent_run_exists_closes_it(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from sweeps import tracking

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setattr(tracking, "retry", lambda fn, what, **kw: (_ for _ in ()).throw(
        RuntimeError(f"MLflow {what} failed after 8 attempts: HTTP 500")) if what.startswith("log_batch") else fn())
    with pytest.raises(tracking.TrackingFailed) as info:
        tracking.start_parent_run(uri, "half", "half-1", {"name": "half"}, {"a": 1})
    msg = str(info.value)
    assert "\n" not in msg and "log_batch(params) failed" in msg and "is FAILED; nothing ran" in msg
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("half").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]


def test_mlflow_http_bounds_are_set_unless_the_user_chose(monkeypatch):
    from sweeps.tracking import MLFLOW_HTTP_BOUNDS, bound_mlflow_http

    for key in MLFLOW_HTTP_BOUNDS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")
    bound_mlflow_http()
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "5"
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "20" and os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == "1"


# --------------------------------------------------------------------------- issue 49, point 1
# A tracking server that starts failing while the sweep runs: a proxy in front of a real
# ``mlflow server`` that answers HTTP 500 to everything (``/health`` included) from the request
# that logs a trial's first epoch on, until the test heals it.


class _FailingProxy:
    """Forwards to ``backend`` (host, port) until a trial logs its first epoch's ``test_acc``; from
    then on, until ``heal()``, every request gets HTTP 500. ``failed_at``: when the first 500 went out."""

    def __init__(self, backend: tuple[str, int]):
        import http.client

        self.failing = False
        self.armed = True
        self.failed_at: float | None = None
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self):  # noqa: N802
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                if proxy.armed and "/runs/log-batch" in self.path and b"test_acc" in body:
                    proxy.armed, proxy.failing, proxy.failed_at = False, True, time.time()
                if proxy.failing:
                    data = b'{"error_code": "INTERNAL_ERROR", "message": "backend store down"}'
                    self.send_response(500)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                conn = http.client.HTTPConnection(*backend, timeout=120)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "connection", "keep-alive", "transfer-encoding")}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "keep-alive"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def heal(self) -> None:
        self.failing = False

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# MLflow's tracking server as a plain Flask app (what ``mlflow server`` runs under uvicorn, without
# its workers and job runner: up in seconds), with artifact proxying, on 127.0.0.1
_SERVER = """
import os, sys
root, port = sys.argv[1], int(sys.argv[2])
os.environ.update({"_MLFLOW_SERVER_FILE_STORE": f"sqlite:///{root}/mlflow.db", "_MLFLOW_SERVER_SERVE_ARTIFACTS": "true",
                   "_MLFLOW_SERVER_ARTIFACT_DESTINATION": f"{root}/artifacts", "_MLFLOW_SERVER_ARTIFACT_ROOT": "mlflow-artifacts:/"})
from mlflow.server import app
from werkzeug.serving import make_server
make_server("127.0.0.1", port, app, threaded=True).serve_forever()
"""


@pytest.fixture
def failing_mid_sweep(tmp_path):
    import urllib.request

    from tests.cluster_helpers import LOOPBACK, free_port

    root, port = tmp_path / "server", free_port()
    root.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    with open(root / "server.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-c", _SERVER, str(root), str(port)], stdout=log,
                                  stderr=subprocess.STDOUT, env=env)
    uri = f"http://{LOOPBACK}:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                break
        except OSError:
            assert server.poll() is None and time.time() < deadline, (root / "server.log").read_text()[-2000:]
            time.sleep(0.2)
    proxy = _FailingProxy((LOOPBACK, port))
    yield uri, proxy
    proxy.close()
    server.terminate()
    server.wait(timeout=20)


@pytest.mark.slow
def test_a_server_failing_mid_sweep_stops_it_in_one_line_and_resume_closes_the_runs(tmp_path, failing_mid_sweep):
    """Issue 49, point 1. Before: the driver died in record_selection with a raw traceback 8 minutes
    after the server began failing, the parent and child runs left RUNNING with nothing said. Now:
    the first MLflow call whose retries run out stops the sweep (``TrackingDown``) with one line
    naming the server, what failed and the resume command; ``dpsweep resume`` against the healed
    server closes the runs left RUNNING, finishes the trial in its own run, and the parent."""
    import yaml

    from mlflow.tracking import MlflowClient

    server_uri, proxy = failing_mid_sweep
    spec = tmp_path / "down.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "down", "storage": str(tmp_path / "ray_results"), "mlflow": {"experiment": "down"},
        "common": {"dataset": "mnist", "train_size": 64, "test_size": 64, "epochs": 2, "batch_size": 32,
                   "certify_images": 0, "attacks": {}},
        "trainables": [{"name": "pixeldp", "search": {"epsilon": [1.0]}}],
        "resources": {"cpu": 1}, "max_concurrent_trials": 1, "failure": {"max_retries": 1}}))
    # MLflow's own retries off and dpsweep's cut to 2 attempts (0.5 s): a call gives up in about a
    # second instead of MLflow's 3 requests times dpsweep's 8 attempts (docs/faults.md)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
           "DPSWEEP_MLFLOW_ATTEMPTS": "2"}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "sweeps.cli"]
    done = subprocess.run([*cmd, "run", str(spec), "--tracking-uri", proxy.uri], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    ended = time.time()
    out = done.stdout + done.stderr
    assert proxy.failed_at is not None, out
    errors = [x for x in done.stderr.splitlines() if x.startswith("dpsweep: error:")]
    # (Ray logs the trial's failure with its traceback, as for any trial; the driver's is one line, the last)
    assert done.returncode == 1 and "sweeps/cli.py" not in out and len(errors) == 1, out
    assert done.stderr.strip().splitlines()[-1] == errors[0], out
    exp_dir = next(x.split()[1].rstrip(";") for x in done.stdout.splitlines() if x.startswith("experiment "))
    line = errors[0]
    assert f"MLflow tracking server at {proxy.uri}" in line and "log_batch(metrics)" in line, line
    assert "500" in line and f"resume {exp_dir}" in line and "RUNNING" in line, line
    assert ended - proxy.failed_at < 30, ended - proxy.failed_at     # seconds after the first 500, not minutes
    client = MlflowClient(server_uri)
    exp = client.get_experiment_by_name("down").experiment_id
    assert {r.info.status for r in client.search_runs([exp])} == {"RUNNING"}   # the server took nothing since

    proxy.heal()
    done = subprocess.run([*cmd, "resume", exp_dir], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in out, out
    assert "1 child run an earlier driver left RUNNING set KILLED" in done.stdout, out
    runs = client.search_runs([exp])
    parents = [r for r in runs if r.data.tags.get("dpsweep.kind") == "sweep"]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert [r.info.status for r in parents] == ["FINISHED"], out
    assert [r.info.status for r in children] == ["FINISHED"], out        # one run for the trial, finished
    steps = [m.step for m in client.get_metric_history(children[0].info.run_id, "test_acc")]
    assert steps == [1, 2], steps                                          # no epoch lost, none twice


def test_a_call_that_keeps_failing_ends_as_tracking_down_and_stops_the_sweep(tmp_path, monkeypatch):
    """The bound of one call (8 attempts, 61.5 s of waits; ``DPSWEEP_MLFLOW_ATTEMPTS``), one attempt
    inside ``single_attempt``, and the watch that turns a trial's ``TrackingDown`` into a stop."""
    from types import SimpleNamespace

    from sweeps.runner import TrackingWatch
    from trainables import tracking

    sleeps, calls = [], []
    monkeypatch.setattr(tracking.time, "sleep", sleeps.append)

    def refused():
        calls.append(1)
        raise ConnectionError("API request to http://h:5000/api/2.0/mlflow/runs/log-batch failed with exception "
                              "HTTPConnectionPool(host='h', port=5000): Max retries exceeded (Caused by "
                              "ResponseError('too many 500 error responses'))")

    monkeypatch.delenv(tracking.ATTEMPTS_ENV, raising=False)
    with pytest.raises(tracking.TrackingDown) as info:
        tracking.retry(refused, what="log_batch(metrics)")
    assert len(calls) == 8 and sum(sleeps) == 61.5 and isinstance(info.value, RuntimeError)
    assert str(info.value).startswith("MLflow log_batch(metrics) failed after 8 attempts (")
    assert str(info.value).endswith("HTTP 500 from http://h:5000/api/2.0/mlflow/runs/log-batch")
    calls.clear()
    monkeypatch.setenv(tracking.ATTEMPTS_ENV, "3")
    with pytest.raises(tracking.TrackingDown):
        tracking.retry(refused, what="x")
    assert len(calls) == 3
    calls.clear()
    with tracking.single_attempt(), pytest.raises(tracking.TrackingDown, match="after 1 attempt "):
        tracking.retry(refused, what="x", attempts=8)
    assert len(calls) == 1

    err = tmp_path / "error.txt"
    err.write_text("Failure # 1 (occurred at 2026-12-06_10-00-00)\nray.exceptions.RayTaskError(TrackingDown): "
                   "ray::ImplicitFunc.train()\ntrainables.tracking.TrackingDown: MLflow log_batch(metrics) failed "
                   "after 8 attempts (81 s): HTTP 500 from http://h:5000/api\n")
    watch = TrackingWatch()
    watch.on_step_end(0, [])                                       # nothing yet
    watch.on_trial_recover(0, [], SimpleNamespace(trial_id="t1", error_file=str(err)))
    with pytest.raises(tracking.TrackingDown, match=r"^trial t1: MLflow log_batch\(metrics\) failed after 8"):
        watch.on_step_end(1, [])
    err.write_text("Failure # 1 (occurred at x)\nValueError: lr must be positive\n")   # any other failure: no stop
    watch.on_trial_error(2, [], SimpleNamespace(trial_id="t2", error_file=str(err)))
    watch.on_step_end(3, [])


# --------------------------------------------------------------------------- issue 49, point 6


class _SlowHandler(http.server.BaseHTTPRequestHandler):
    delay = 2.8   # a live server under load (~40): more than the old fixed 2.5 s probe limit

    def do_GET(self):  # noqa: N802
        time.sleep(self.delay)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")
        except OSError:   # the probe gave up first
            pass

    def log_message(self, *args):
        pass


def test_a_slow_live_server_is_given_mlflows_own_timeout_and_a_silent_one_is_named(monkeypatch):
    """The start-up probe waited a fixed 2.5 s: a live server that answered in 3 s was refused as
    "no MLflow tracking server answers". It now waits MLFLOW_HTTP_REQUEST_TIMEOUT (what the
    sweep's own requests wait) and, when even that passes, says so."""
    from sweeps.tracking import TrackingUnreachable, check_tracking_store

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        check_tracking_store(uri)                                         # slow, but there
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
        with pytest.raises(TrackingUnreachable) as info:
            check_tracking_store(uri)
        msg = str(info.value)
        assert f"the MLflow tracking server at {uri} did not answer within 1 s" in msg, msg
        assert "MLFLOW_HTTP_REQUEST_TIMEOUT" in msg and "\n" not in msg
    finally:
        server.shutdown()
        server.server_close()
