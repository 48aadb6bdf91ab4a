"""Issue 33, point 5: a full or read-only storage or store is one line naming the path and its free
space, within seconds: before the sweep starts, and while it runs (the sweep stops, its parent run
KILLED and resumable, the console saying what MLflow shows); a torn experiment state is refused
by ``resume`` (exit 2) instead of running an empty trial; ``dpsweep.json`` is written atomically.

The end-to-end cases run ``dpsweep`` in a mount namespace of its own with a small tmpfs (``unshare
-rm``); they are skipped where the machine does not allow that."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import namedtuple

import pytest
import yaml

from tests.test_interrupts import _Sweep
from tests.test_sweep_e2e import ROOT, _runs, _spec

Usage = namedtuple("Usage", "total used free")


def test_space_problem_names_the_path_and_its_free_space(tmp_path, monkeypatch):
    from sweeps import disk

    assert disk.space_problem("storage", tmp_path / "new" / "dir", 1.0) is None   # control: room enough
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: Usage(20 * 2**20, 19 * 2**20, 2**20))
    line = disk.space_problem("storage", tmp_path / "x", 64.0)
    assert line.startswith(f"storage {tmp_path / 'x'}: 1.0 MB free of 20.0 MB") and "DPSWEEP_MIN_FREE_MB" in line
    problems = disk.storage_problems(str(tmp_path), f"sqlite:///{tmp_path}/db/mlflow.db")
    assert [p.split(" ", 1)[0] for p in problems] == ["storage", "tracking"]
    assert disk.storage_problems("s3://bucket/x", "http://server:5000") == []   # remote: not checked here


def test_a_read_only_storage_is_named(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    from sweeps import disk

    try:
        if os.access(ro, os.W_OK):   # root writes anywhere: nothing to show
            pytest.skip("this user writes to a read-only directory (root)")
        assert "read-only file system or not writable" in disk.space_problem("storage", ro / "exp")
    finally:
        ro.chmod(0o700)


def test_dpsweep_json_is_written_atomically_and_a_torn_one_is_refused(tmp_path):
    from sweeps.runner import STATE_FILE, load_state, save_state

    save_state(tmp_path, {"spec": {"name": "a"}})
    assert load_state(tmp_path) == {"spec": {"name": "a"}} and not (tmp_path / (STATE_FILE + ".tmp")).exists()
    (tmp_path / STATE_FILE).write_text('{"spec": {"na')
    with pytest.raises(ValueError, match="dpsweep.json is torn .*cannot be resumed"):
        load_state(tmp_path)


def test_resume_of_a_torn_ray_snapshot_says_what_is_torn_and_exits_2(tmp_path, capsys):
    from sweeps.cli import main
    from sweeps.runner import save_state

    exp = tmp_path / "exp"
    save_state(exp, {"spec": {"name": "t", "trainables": [{"name": "pixeldp"}]},
                     "mlflow": {"tracking_uri": f"sqlite:///{tmp_path}/m.db", "experiment_id": "0",
                                "parent_run_id": "p"}, "run_name": "exp"})
    snap = exp / "experiment_state-2026-11-27_16-00-00.json"
    snap.write_text('{"trial_data": [["{\\"trial_id\\": \\"a\\"')          # cut off by a full disk
    assert main(["resume", str(exp)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{snap} is torn" in err[0], err
    snap.write_text(json.dumps({"trial_data": [["{\"trial_id\": \"a\"}", "{}"]]}))   # parses, but no config
    assert main(["resume", str(exp)]) == 2
    assert "have no config" in capsys.readouterr().err


def _can_mount() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                          capture_output=True, timeout=20)
    return done.returncode == 0


needs_tmpfs = pytest.mark.skipif(not _can_mount(), reason="no unprivileged mount namespace with tmpfs here")


def _in_tmpfs(tmp_path, mb: int, argv: list[str], env: dict | None = None) -> list[str]:
    small = tmp_path / "small"
    small.mkdir(exist_ok=True)
    inner = f"mount -t tmpfs -o size={mb}m tmpfs {small} && exec {sys.executable} -m sweeps.cli " + " ".join(argv)
    return ["unshare", "-rm", "sh", "-c", inner]


@needs_tmpfs
def test_a_storage_without_room_is_refused_before_anything_starts(tmp_path):
    spec = _spec(tmp_path, "full", [1.0], storage=str(tmp_path / "small" / "ray_results"))
    t0 = time.time()
    done = subprocess.run(_in_tmpfs(tmp_path, 20, ["run", str(spec), "--tracking-uri", f"sqlite:///{tmp_path}/m.db"]),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    err = [line for line in done.stderr.splitlines() if line.startswith("dpsweep:")]
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(err) == 1 and f"storage {tmp_path / 'small' / 'ray_results'}: 20.0 MB free of 20.0 MB" in err[0], err
    assert time.time() - t0 < 60 and "Traceback" not in done.stderr


@needs_tmpfs
@pytest.mark.slow
def test_a_storage_filled_mid_sweep_stops_it_in_seconds_and_says_what_mlflow_shows(tmp_path, monkeypatch):
    name = "filled"
    uri = f"sqlite:///{tmp_path}/mlflow.db"          # the store outside the tmpfs: the test reads it afterwards
    spec = _spec(tmp_path, name, [1.0], storage=str(tmp_path / "small" / "ray_results"))
    raw = yaml.safe_load(spec.read_text())
    raw["common"].update({"train_size": 200, "epochs": 60})
    spec.write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("DPSWEEP_MIN_FREE_MB", "40")   # start with 40 MB free; a running sweep stops below 10
    sweep = _Sweep.__new__(_Sweep)        # _Sweep's helpers around a command of our own
    sweep.markers, sweep.lines = tmp_path / "markers", []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    sweep.proc = subprocess.Popen(_in_tmpfs(tmp_path, 100, ["run", str(spec), "--tracking-uri", uri]), cwd=tmp_path,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sweep.reader = threading.Thread(target=lambda: sweep.lines.extend(sweep.proc.stdout), daemon=True)
    sweep.reader.start()
    sweep.wait_for(lambda: " progress " in sweep.out, timeout=300)   # a checkpoint is on the tmpfs
    view = f"/proc/{sweep.proc.pid}/root{tmp_path / 'small'}"
    free = shutil.disk_usage(view).free
    with open(f"{view}/filler", "wb") as fh:                         # leave about 4 MB
        fh.write(b"\0" * max(0, free - 4 * 2**20))
    t0 = time.time()
    rc = sweep.finish(240)
    out = sweep.out
    assert rc == 1, out
    line = [x for x in out.splitlines() if x.startswith("dpsweep: error: storage")]
    assert line and "free of 100.0 MB" in line[0] and "the sweep stopped" in line[0], out
    assert time.time() - t0 < 120, out
    client, parents, children = _runs(uri, name)
    assert parents[0].info.status == "KILLED" and "MLflow parent run" in line[0] and " KILLED;" in line[0]
    assert "continue with: " in line[0] and all(r.info.status != "RUNNING" for r in children)
