"""One driver per sweep (issue 49.3): two ``dpsweep resume`` of one experiment, or a resume while the
run still goes, both ran, each with its own Ray, and the last to finish decided the parent's status.
The driver now holds an flock on ``<experiment>/dpsweep.lock`` for its lifetime; the second is refused
at once in one line naming the holder, and the lock dies with its process (no stale lock)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dpmech.privacy.secret import NoiseKey
from sweeps.driver_lock import DriverLock, SweepLocked
from sweeps.runner import save_state
from sweeps.secret_store import fingerprint, save_secret

ROOT = Path(__file__).resolve().parent.parent
RAW = {"name": "locked", "common": {"train_size": 64, "test_size": 32, "certify_images": 0},
       "trainables": [{"name": "pixeldp", "search": {"epochs": 1}}], "search": {"algorithm": "grid"}}


def _experiment(tmp: Path) -> Path:
    exp = tmp / "locked-1"
    key = NoiseKey(b"\x05" * 32)
    save_state(exp, {"spec": RAW, "mlflow": {"tracking_uri": f"sqlite:///{tmp}/nowhere/mlflow.db"},
                     "run_name": "locked-1", "total": 1, "secret_fingerprint": fingerprint(key)})
    save_secret(str(exp), "locked-1", key)
    return exp


def _holder(exp: Path) -> subprocess.Popen:
    """Another driver of ``exp``: a process that takes the lock as ``dpsweep run`` does, then waits."""
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
            "from sweeps.driver_lock import DriverLock\n"
            f"DriverLock({str(exp)!r}).acquire('run'); print('held', flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_driver_is_refused_at_once_naming_the_holder(tmp_path, capsys):
    from sweeps.cli import main

    exp = _experiment(tmp_path)
    holder = _holder(exp)
    try:
        assert main(["resume", str(exp)]) == 2           # at once: the lock is not waited for (LOCK_NB)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "another dpsweep driver holds this sweep" in err[0], err
        assert f"pid {holder.pid}" in err[0] and "dpsweep run" in err[0]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder was killed: its lock died with it; the next resume gets past the lock (it stops later,
    # at the tracking store this test does not provide, but not on the lock)
    main(["resume", str(exp)])
    err = capsys.readouterr().err
    assert "another dpsweep driver" not in err


def test_the_lock_is_exclusive_within_one_machine_and_released(tmp_path):
    first = DriverLock(tmp_path).acquire("run")
    with pytest.raises(SweepLocked, match=f"pid {os.getpid()}"):
        DriverLock(tmp_path).acquire("resume")
    first.release()
    DriverLock(tmp_path).acquire("resume").release()   # control: once released, it is free
