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
