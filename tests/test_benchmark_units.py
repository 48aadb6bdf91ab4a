"""benchmarks.common.claimed_unit: the resumable unit of the long benchmarks (dpsgd_mnist_full,
audit_mnist) runs once, is skipped when done or claimed by another process, and releases its
claim whatever happens."""

from __future__ import annotations

import pytest

from benchmarks.common import claimed_unit


def test_a_unit_runs_once_and_its_claim_is_released(tmp_path):
    ran = []
    for stem in ("a", "a", "b"):
        with claimed_unit(tmp_path, stem) as path:
            if path is None:
                continue
            path.write_text("{}")
            ran.append(stem)
    assert ran == ["a", "b"] and not list(tmp_path.glob("*.running"))
    (tmp_path / "c.running").touch()  # another process runs c
    with claimed_unit(tmp_path, "c") as path:
        assert path is None
    with pytest.raises(RuntimeError), claimed_unit(tmp_path, "e") as path:
        raise RuntimeError("the unit failed")
    assert not (tmp_path / "e.running").exists() and not (tmp_path / "e.json").exists()


def test_a_claim_left_by_a_killed_process_is_taken_over_and_a_live_ones_is_not(tmp_path):
    """A unit killed by a signal never releases its claim; the claim names its host and pid, so the next run
    takes over a dead process's claim and still skips a live one's (negative control), another host's, and a
    claim that names no owner."""
    import os
    import socket
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    (tmp_path / "k.running").write_text(f"{host} {int(dead.stdout)}\n")
    with claimed_unit(tmp_path, "k") as path:
        assert path is not None
        assert (tmp_path / "k.running").read_text().split() == [host, str(os.getpid())]
        path.write_text("{}")
    assert not (tmp_path / "k.running").exists() and not list(tmp_path.glob("*.stale-*"))
    for owner in (f"{host} {os.getppid()}", f"another-{host} {int(dead.stdout)}", ""):
        (tmp_path / "l.running").write_text(owner)
        with claimed_unit(tmp_path, "l") as path:
            assert path is None, owner
        assert (tmp_path / "l.running").read_text() == owner
