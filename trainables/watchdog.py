"""A trial's time limit (``failure.trial_timeout``; issue 49.4, docs/faults.md).

A trial that hangs (a user model blocking in its forward pass, a stuck data loader) reports nothing,
so nothing in Ray Tune's result path can stop it: Tune's stoppers are asked only when a trial
reports. The limit is therefore kept inside the trial process, by a daemon thread started when the
attempt starts:

1. at the deadline it records the reason on the trial's MLflow run (``dpsweep.error``: ``TrialTimeout:
   ...``) and raises :class:`TrialTimeout` in the trial's thread (``PyThreadState_SetAsyncExc``); a
   trial running Python code stops there, through the ordinary failure path (its run FAILED, Tune's
   error file naming the timeout);
2. a trial blocked in C code (a sleep, a lock, a kernel) never reaches Python bytecode to receive it:
   after ``GRACE_S`` the thread closes the run FAILED itself and ends the worker process
   (``os._exit``), which Ray reports as the trial's actor dying: the trial fails, and is retried
   from its last checkpoint under ``failure.max_retries`` like any failure (a retry gets the same
   limit, so a trial that always hangs ends FAILED after max_retries + 1 limits).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from typing import Callable

GRACE_S = 10.0          # how long a trial has to stop after TrialTimeout was raised in it
EXIT_CODE = 70          # the worker's exit status when it had to be ended (EX_SOFTWARE)


def timeout_message(limit_s: float) -> str:
    """Why a trial stopped at its time limit (its run's ``dpsweep.error`` after ``TrialTimeout: ``)."""
    return (f"the trial ran past failure.trial_timeout ({float(limit_s):g} s) and was stopped (a hung forward "
            "pass or loader?)")


class TrialTimeout(Exception):
    """The trial ran past ``failure.trial_timeout`` (raised asynchronously, as a class: the message is
    the watchdog's, kept on the class)."""

    message = "the trial ran past failure.trial_timeout"

    def __init__(self, *args):
        super().__init__(*(args or (TrialTimeout.message,)))


class TrialWatchdog:
    """Stops the calling thread's trial ``limit_s`` seconds after :meth:`start`, unless :meth:`stop`
    comes first. ``record(message)`` writes the reason where the owner reads it (the MLflow run);
    ``close()`` closes that run FAILED before the process has to end."""

    def __init__(self, limit_s: float, record: Callable[[str], None], close: Callable[[], None],
                 grace_s: float = GRACE_S, exit_fn: Callable[[int], None] = os._exit):
        self.limit_s = float(limit_s)
        self.message = timeout_message(self.limit_s)
        self._record, self._close, self._grace, self._exit = record, close, grace_s, exit_fn
        self._done = threading.Event()
        self._target = threading.get_ident()
        self._thread: threading.Thread | None = None
        self.fired = False

    def start(self) -> "TrialWatchdog":
        self._thread = threading.Thread(target=self._watch, name="dpsweep-trial-timeout", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        if self._done.wait(self.limit_s):
            return
        self.fired = True
        try:
            self._record(self.message)
        except Exception as exc:  # noqa: BLE001 - the limit holds even when the store does not answer
            print(f"dpsweep: trial time limit: could not record the reason ({type(exc).__name__}: {exc})",
                  file=sys.stderr, flush=True)
        TrialTimeout.message = self.message
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._target), ctypes.py_object(TrialTimeout))
        if self._done.wait(self._grace):
            return
        try:
            self._close()
        except Exception as exc:  # noqa: BLE001
            print(f"dpsweep: trial time limit: could not close the run ({type(exc).__name__}: {exc})",
                  file=sys.stderr, flush=True)
        self._exit(EXIT_CODE)


@contextlib.contextmanager
def trial_time_limit(config: dict):
    """The time limit of a dpsweep trial (``_mlflow["trial_timeout"]``, set from the spec's
    ``failure.trial_timeout``), around the trainable's call; nothing without one."""
    info = config.get("_mlflow") or {}
    limit = info.get("trial_timeout")
    if not limit:
        yield None
        return
    from ray import tune

    trial_id = tune.get_context().get_trial_id()

    def run():
        from mlflow.tracking import MlflowClient

        from trainables.tracking import find_trial_run

        client = MlflowClient(info["tracking_uri"])
        found = find_trial_run(client, info["experiment_id"], info.get("parent_run_id"), trial_id)
        return client, found

    def record(message: str) -> None:
        from trainables.runtime import TAG_ERROR

        client, found = run()
        if found is not None:
            client.set_tag(found.info.run_id, TAG_ERROR, f"TrialTimeout: {message}")

    def close() -> None:
        client, found = run()
        if found is not None and found.info.status == "RUNNING":
            client.set_terminated(found.info.run_id, "FAILED")

    dog = TrialWatchdog(limit, record, close).start()
    try:
        yield dog
    finally:
        dog.stop()
