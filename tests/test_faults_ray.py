"""Fault injection (issue 33, point 9): a sweep stays on its own machine's own Ray.

* Someone else's single-node Ray running on this machine (`ray start --head`, which records its
  address in /tmp/ray/ray_current_cluster) is not joined: without RAY_ADDRESS the sweep gets a
  private local instance. Before the fix ``ray.init(address=None)`` joined it.
* A cluster that RAY_ADDRESS names but that does not answer (or ``auto`` naming a stopped one) is
  reported in one line within seconds, nothing started; before, ``ray.init`` waited in its GCS
  client with nothing printed (observed for 11 minutes).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from sweeps.runner import CURRENT_CLUSTER_FILE, RayUnreachable, probe_ray

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_named_cluster_that_does_not_answer_is_one_line_within_seconds(tmp_path):
    dead = f"127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RayUnreachable, match=f"RAY_ADDRESS={dead}: no Ray cluster answers at {dead}"):
        probe_ray(dead, timeout=2)
    assert time.monotonic() - t0 < 5
    stale = tmp_path / "ray_current_cluster"          # a stopped `ray start` left its address behind
    stale.write_text(dead + "\n")
    with pytest.raises(RayUnreachable, match="RAY_ADDRESS=auto: no Ray cluster answers"):
        probe_ray("auto", timeout=2, current_file=str(stale))
    with pytest.raises(RayUnreachable, match="no Ray cluster was started on this machine"):
        probe_ray("auto", timeout=2, current_file=str(tmp_path / "missing"))
    with pytest.raises(RayUnreachable, match="not host:port"):
        probe_ray("nonsense", timeout=2)
    # negative control: an address that answers as Ray's GCS does (gRPC: HTTP/2 SETTINGS) is accepted
    with _grpc_like() as live:
        assert probe_ray(live, timeout=2) == live
        assert probe_ray(f"ray://{live}", timeout=2) == live


@contextlib.contextmanager
def _grpc_like():
    """A listener that answers every connection as an HTTP/2 (gRPC) server does: a SETTINGS frame."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.recv(64)
                conn.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        srv.close()


@contextlib.contextmanager
def _http_server():
    import http.server

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_service_that_is_not_ray_is_refused_in_seconds():
    """Issue 49.2: a plain HTTP server at RAY_ADDRESS passed the TCP probe, then ray.init looped on
    'Failed to get cluster ID' for over 397 s, ignoring Ctrl-C; a silent listener likewise."""
    with _http_server() as http:
        t0 = time.monotonic()
        with pytest.raises(RayUnreachable, match="is not a Ray cluster .it answered as a plain HTTP server"):
            probe_ray(http, timeout=2)
        assert time.monotonic() - t0 < 20     # the probe's own 2 s, far from ray.init's minutes (generous: CI may be busy)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        addr = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(RayUnreachable, match="sent nothing within 1 s"):
            probe_ray(addr, timeout=1)


def _run_at(tmp_path: Path, name: str, address: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``dpsweep run`` of a one-trial spec with ``RAY_ADDRESS=address``: the process and its error lines."""
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({
        "name": name, "storage": str(tmp_path / "ray_results"),
        "common": {"train_size": 64, "test_size": 32, "certify_images": 0},
        "trainables": [{"name": "pixeldp", "search": {"epochs": 1}}]}))
    env = {**os.environ, "RAY_ADDRESS": address, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "sweeps.cli", "run", str(spec), "--tracking-uri",
                           f"sqlite:///{tmp_path}/mlflow.db"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    return proc, [ln for ln in proc.stderr.splitlines() if ln.startswith("dpsweep: error")]


def test_run_against_a_plain_http_server_exits_2_in_one_line_and_writes_nothing(tmp_path):
    with _http_server() as http:
        proc, errors = _run_at(tmp_path, "http", http)
    assert proc.returncode == 2 and len(errors) == 1 and "is not a Ray cluster" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]     # no experiment, no MLflow store


def test_run_with_an_unreachable_cluster_exits_2_and_starts_nothing(tmp_path):
    t0 = time.monotonic()
    proc, errors = _run_at(tmp_path, "nowhere", f"127.0.0.1:{_free_port()}")
    assert proc.returncode == 2 and len(errors) == 1 and "no Ray cluster answers" in errors[0], proc.stderr[-2000:]
    assert time.monotonic() - t0 < 120
    assert not list((tmp_path / "ray_results").glob("nowhere-*"))   # no experiment, no parent run


@pytest.fixture
def foreign_ray():
    """Another user's single-node Ray on this machine, recorded where `ray init` looks for one."""
    backup = Path(CURRENT_CLUSTER_FILE).read_text() if Path(CURRENT_CLUSTER_FILE).exists() else None
    port = _free_port()
    ray_bin = Path(sys.executable).with_name("ray")
    proc = subprocess.Popen([str(ray_bin), "start", "--head", f"--port={port}", "--num-cpus=1", "--block",
                             "--include-dashboard=false", "--disable-usage-stats"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if Path(CURRENT_CLUSTER_FILE).read_text().strip().endswith(f":{port}"):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.skip("ray start --head did not come up within 120 s")
        yield Path(CURRENT_CLUSTER_FILE).read_text().strip()
    finally:
        # `ray start --block` shuts its daemons down gracefully on SIGTERM, which takes ~30 s here;
        # a few seconds of grace, then the whole process group (gcs_server, raylet, workers) is killed.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        if backup is None:
            Path(CURRENT_CLUSTER_FILE).unlink(missing_ok=True)
        else:
            Path(CURRENT_CLUSTER_FILE).write_text(backup)


def test_a_sweep_does_not_join_someone_elses_local_ray(foreign_ray, monkeypatch):
    import ray

    from sweeps.runner import ray_init

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if ray.is_initialized():
        ray.shutdown()
    try:
        line = ray_init()
        ours = ray.get_runtime_context().gcs_address
        assert line.startswith("Ray: a private local instance")
        assert ours != foreign_ray                        # joined before the fix ("Connecting to latest cluster")
    finally:
        ray.shutdown()


def test_ray_token_is_made_owner_only(tmp_path):
    """Issue 33, point 10: Ray's local processes listen on every interface (Ray 2.60 binds '*'
    whatever the node address; docs/cluster.md), so the token guarding them is made 0600."""
    import stat

    from sweeps.runner import protect_ray_token

    folder = tmp_path / ".ray"
    folder.mkdir(mode=0o755)
    (folder / "auth_token").write_text("t" * 64)
    (folder / "auth_token").chmod(0o644)
    assert sorted(protect_ray_token(tmp_path)) == [str(folder), str(folder / "auth_token")]
    assert stat.S_IMODE((folder / "auth_token").stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert protect_ray_token(tmp_path) == []                 # already private: nothing to change
    assert protect_ray_token(tmp_path / "nobody") == []      # no token: nothing, no error


RAY_STARTUP_TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet "
                       "failed to startup or the GCS has become overloaded.")   # ray._private.node, Ray 2.60


def test_a_local_ray_that_does_not_start_is_one_line_exit_2_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """Issue 49, point 6: Ray's own start-up timeout (its raylet not registered within 30 s on an
    overloaded machine) gave a raw traceback. Now: one line, exit 2, whatever Ray started shut
    down, and what this run created (a fresh SQLite store, the storage folder) removed; a store
    that was there before is kept."""
    import ray

    from sweeps.cli import main
    from trainables.tracking import SESSION_ENV

    monkeypatch.chdir(tmp_path)
    for name in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "DPSWEEP_STORAGE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(SESSION_ENV, "test")   # ray_init sets it: restored afterwards
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"name": "slow", "common": {"train_size": 64, "test_size": 32, "certify_images": 0},
                                    "trainables": [{"name": "pixeldp", "search": {"epochs": 1}}]}))
    shutdowns = []

    def init(*args, **kwargs):
        (tmp_path / "mlflow.db").touch()            # as if the store had been opened before Ray's start
        (tmp_path / "ray_results").mkdir(exist_ok=True)
        raise Exception(RAY_STARTUP_TIMEOUT)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))
    assert main(["run", str(spec)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dpsweep: error: Ray: the private local instance did not start"), err
    assert "timed out during startup" in err[0] and "Traceback" not in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"] and shutdowns == [1]
    (tmp_path / "mlflow.db").write_bytes(b"")     # the user's store, there before: kept
    assert main(["run", str(spec)]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "s.yaml"]
