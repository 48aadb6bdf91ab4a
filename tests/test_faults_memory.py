"""Issue 33, point 3: a trial whose worker Ray's memory monitor kills is a trial failure (retried
under ``failure.max_retries`` from its checkpoint), not a sweep crash, and the console says so."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

OOM = "Task was killed due to the node running low on memory. Memory on the node (IP: 127.0.0.1) ..."


def _task(calls: list):
    actor = SimpleNamespace(actor_id="a1", _on_error=lambda a, e: calls.append(("actor", e)))
    return SimpleNamespace(_tracked_actor=actor, _on_error=lambda a, e: calls.append(("task", e)))


def _manager():
    return SimpleNamespace(_failed_actor_ids=set(), _cleanup_actor=lambda tracked_actor: None)


def test_a_memory_kill_fails_the_trial_not_the_sweep():
    from ray.air.execution._internal.actor_manager import RayActorManager
    from ray.exceptions import OutOfMemoryError

    from sweeps.runner import KilledForMemory, tolerate_memory_kills

    tolerate_memory_kills()
    handler = RayActorManager._actor_task_failed
    # negative control: Ray's own handler ends the sweep ("Caught unexpected exception")
    with pytest.raises(RuntimeError, match="Caught unexpected exception"):
        handler.__wrapped__(_manager(), _task([]), OutOfMemoryError(OOM))
    calls = []
    manager = _manager()
    handler(manager, _task(calls), OutOfMemoryError(OOM))
    assert [kind for kind, _ in calls] == ["actor", "task"]      # Tune's trial-failure path, both callbacks
    assert all(isinstance(e, KilledForMemory) and "low on memory" in str(e) for _, e in calls)
    assert manager._failed_actor_ids == {"a1"}
    tolerate_memory_kills()                                     # idempotent: wrapped once
    assert RayActorManager._actor_task_failed is handler


def test_the_console_names_the_memory_kill_and_what_to_lower(tmp_path, capsys):
    from sweeps.runner import ProgressPrinter

    err = tmp_path / "error.txt"
    trial = SimpleNamespace(trial_id="t_00001", config={"trainable": "dpsgd", "seed": 1}, local_path=str(tmp_path),
                            error_file=str(err))
    err.write_text("Failure # 1\nray.exceptions.RayActorError: KilledForMemory: " + OOM)
    printer = ProgressPrinter(2)
    printer.on_trial_recover(0, [], trial)
    printer.on_trial_error(0, [], trial)
    out = capsys.readouterr().out
    assert "killed   t_00001" in out and "retried from its last checkpoint" in out
    assert "FAILED   t_00001" in out and "lower max_concurrent_trials or the batch size" in out
    err.write_text("ValueError: lr must be positive")                 # control: another failure says nothing of memory
    printer.on_trial_error(0, [], trial)
    assert "memory" not in capsys.readouterr().out.split("FAILED")[-1]
    assert Path(err).exists()
