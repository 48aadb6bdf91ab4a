"""The console's word on trials that go quiet (issue 49.4, issue 51.8; docs/faults.md).

A trial that reports nothing for ``failure.silence_warning`` seconds (default 600) gets one line,
once per quiet stretch: how long, and what will happen (``failure.trial_timeout`` stops it, or
nothing will). When the machine's load is above its cores the line says so: Ray runs trial workers
at niceness 15, so beside other work a sweep waits for the CPU without any error. A trial that
fails after running for at least its time limit is said to have timed out (the trial itself stops
and records it: trainables.watchdog)."""

from __future__ import annotations

import os
import sys
import time

from ray import tune


# Ray trial id -> why it failed, for the trials this driver saw run past their time limit: the worker
# that had to end itself leaves only "the actor died" in Tune's error file (sweeps.runner.last_failure_cause)
TIMED_OUT: dict[str, str] = {}


def timed_out(trial_id: str) -> str | None:
    return TIMED_OUT.get(trial_id)


class SilenceWatch(tune.Callback):
    def __init__(self, silence_s: float = 600.0, timeout_s: float | None = None, clock=time.monotonic):
        self.silence_s = float(silence_s)
        self.timeout_s = timeout_s
        self._clock = clock
        self._heard: dict[str, float] = {}     # trial id -> when it last started or reported
        self._started: dict[str, float] = {}   # trial id -> when its current attempt started
        self._warned: set[str] = set()
        self._busy_said = False

    def __getstate__(self):   # pickled with the experiment state: times are this process's
        return {**self.__dict__, "_heard": {}, "_started": {}, "_warned": set(), "_clock": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._clock = time.monotonic

    def _say(self, msg: str) -> None:
        print(f"[watch] {msg}", file=sys.stdout, flush=True)

    def _begin(self, trial) -> None:
        now = self._clock()
        self._heard[trial.trial_id] = self._started[trial.trial_id] = now
        self._warned.discard(trial.trial_id)

    def on_trial_start(self, iteration, trials, trial, **info):
        self._begin(trial)

    def on_trial_restore(self, iteration, trials, trial, **info):
        self._begin(trial)

    def on_trial_recover(self, iteration, trials, trial, **info):
        self._begin(trial)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self._heard[trial.trial_id] = self._clock()
        self._warned.discard(trial.trial_id)

    def on_trial_error(self, iteration, trials, trial, **info):
        started = self._started.get(trial.trial_id)
        if self.timeout_s and started is not None and self._clock() - started >= self.timeout_s:
            from trainables.watchdog import timeout_message

            TIMED_OUT[trial.trial_id] = f"TrialTimeout: {timeout_message(self.timeout_s)}"
            self._say(f"{trial.trial_id} timed out: no end within failure.trial_timeout ({self.timeout_s:g} s); "
                      "its run says so (dpsweep.error)")

    def on_step_end(self, iteration, trials, **info):
        now = self._clock()
        for trial in trials:
            if trial.status != "RUNNING" or trial.trial_id in self._warned:
                continue
            heard = self._heard.setdefault(trial.trial_id, now)
            quiet = now - heard
            if quiet < self.silence_s:
                continue
            self._warned.add(trial.trial_id)
            then = (f"failure.trial_timeout stops it {self.timeout_s:g} s after its attempt started"
                    if self.timeout_s else "no failure.trial_timeout is set, so nothing will stop it")
            self._say(f"{trial.trial_id} has reported nothing for {quiet:.0f} s (still running; {then})"
                      + self._busy())

    def _busy(self) -> str:
        """A note, once per sweep, when the machine is busier than its cores."""
        if self._busy_said:
            return ""
        try:
            load, cores = os.getloadavg()[0], os.cpu_count() or 1
        except OSError:
            return ""
        if load <= cores:
            return ""
        self._busy_said = True
        return (f"; this machine is busy (load {load:.0f} on {cores} cores): Ray runs trials at niceness 15, "
                "so they wait for the CPU behind other work")
