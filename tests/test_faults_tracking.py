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
